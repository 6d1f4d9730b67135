"""OpenBLAS for MLX's Linux CPU back end.

The mlx-cpu wheel links a slow reference BLAS (a SmolLM2 256-token float32 forward: ~50 s, against ~2.4 s with
Debian's OpenBLAS, identical results). A library cannot be swapped into a running process, so `use_openblas()`,
called first thing by tq-chat, tq-generate and tq-server, re-executes the command with OpenBLAS in LD_PRELOAD
when it is installed, and otherwise prints once how to get it.

`TQ_MLX_OPENBLAS`: a BLAS library to preload instead of the Debian path, or `0` to keep the reference BLAS
without a word.

From Python, `warn_reference_blas()` (called by the library's entry points that build or load TurboQuant caches)
warns once per process, with a ReferenceBLASWarning saying how to get the fast path: start Python with OpenBLAS in
LD_PRELOAD, or call `tq_mlx.blas.use_openblas()` first thing in the script. Never at import, never per token.
"""

from __future__ import annotations

import os
import platform
import sys
import warnings
from pathlib import Path
from typing import Mapping

ENV_VAR = "TQ_MLX_OPENBLAS"
_REEXEC_MARK = "TQ_MLX_OPENBLAS_REEXEC"  # set in the re-executed process: never loop
OPENBLAS_LIB = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"  # libopenblas0-pthread, Debian/Ubuntu

_hinted = False  # use_openblas printed its note
_warned = False  # warn_reference_blas ran


class ReferenceBLASWarning(UserWarning):
    """MLX's Linux CPU back end is running on its slow reference BLAS (~20x slower float32 matmuls)."""


def openblas_path(environ: Mapping[str, str] | None = None) -> str:
    """The library to preload: $TQ_MLX_OPENBLAS, else Debian's libopenblas0-pthread path for this machine."""
    env = os.environ if environ is None else environ
    if env.get(ENV_VAR, "").strip() not in ("", "0"):
        return env[ENV_VAR].strip()
    arch = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine())
    return f"/usr/lib/{arch}-linux-gnu/openblas-pthread/libblas.so.3"


def openblas_preloaded(environ: Mapping[str, str] | None = None) -> bool:
    """True if this process was started with OpenBLAS (or $TQ_MLX_OPENBLAS) in LD_PRELOAD. Checking the
    loaded libraries would not do: numpy maps its own bundled OpenBLAS, which MLX does not use."""
    env = os.environ if environ is None else environ
    preload = env.get("LD_PRELOAD", "").replace(":", " ").split()
    want = openblas_path(env)
    return any(p == want or ("openblas" in p and Path(p).exists()) for p in preload)


def blas_hint(environ: Mapping[str, str] | None = None) -> str | None:
    """How to get the fast path, when MLX's CPU back end runs on the reference BLAS; None when OpenBLAS is
    preloaded, on other systems, or with TQ_MLX_OPENBLAS=0."""
    env = os.environ if environ is None else environ
    if not sys.platform.startswith("linux") or env.get(ENV_VAR, "").strip() == "0" or openblas_preloaded(env):
        return None
    lib = openblas_path(env)
    preload = f"LD_PRELOAD={lib}"
    if Path(lib).exists():
        return f"MLX CPU is using its reference BLAS; run with {preload} for ~20x faster float32 forwards"
    if env.get(ENV_VAR, "").strip():
        return f"{ENV_VAR}={lib} does not exist; MLX CPU is using its reference BLAS (~20x slower)"
    return (f"MLX CPU is using its reference BLAS; `apt-get install libopenblas0-pthread` makes float32 forwards "
            f"~20x faster ({lib}; tq-chat, tq-generate and tq-server then preload it on their own; "
            f"{ENV_VAR}=0 silences this)")


def reexec_environ(environ: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """The environment to re-execute this command with so MLX gets OpenBLAS; None when there is nothing to
    do (not Linux, already preloaded, disabled, library not installed, or this is the re-executed process)."""
    env = dict(os.environ if environ is None else environ)
    if not sys.platform.startswith("linux") or env.get(ENV_VAR, "").strip() == "0":
        return None
    if env.get(_REEXEC_MARK) or openblas_preloaded(env):
        return None
    lib = openblas_path(env)
    if not Path(lib).is_file():
        return None
    env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    env[_REEXEC_MARK] = "1"
    return env


def use_openblas(prog: str | None = None) -> None:
    """Entry-point hook: re-execute the running command with OpenBLAS preloaded when it is installed and not
    in use yet, else print (once) how to get it. Call it before any work, from a command or first thing in a
    script (it replaces the process: the script starts again). prog: the name the note starts with (default:
    the script's)."""
    global _hinted
    prog = prog or Path(sys.argv[0] or "python").name
    env = reexec_environ()
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            os.execve(sys.executable, list(sys.orig_argv), env)
        except OSError as e:  # keep going on the reference BLAS
            print(f"{prog}: could not restart with OpenBLAS ({e})", file=sys.stderr)
    hint = blas_hint()
    if hint and not _hinted:
        _hinted = True
        print(f"{prog}: note: {hint}", file=sys.stderr, flush=True)


def python_hint(environ: Mapping[str, str] | None = None) -> str | None:
    """blas_hint for a Python program (no command restarts itself there): how to get OpenBLAS from a script."""
    env = os.environ if environ is None else environ
    hint = blas_hint(env)
    if hint is None:
        return None
    lib = openblas_path(env)
    if Path(lib).exists():
        how = f"start Python with LD_PRELOAD={lib}, or call tq_mlx.blas.use_openblas() first thing in your script"
    else:
        how = ("`apt-get install libopenblas0-pthread`, then call tq_mlx.blas.use_openblas() first thing in your "
               f"script (or start Python with LD_PRELOAD={lib})")
    return (f"MLX's CPU back end is using its reference BLAS (~20x slower float32 forwards): {how}; "
            f"{ENV_VAR}=0 silences this")


def _on_cpu() -> bool:
    import mlx.core as mx

    return mx.default_device().type == mx.DeviceType.cpu


def warn_reference_blas() -> None:
    """Warn once per process (ReferenceBLASWarning) when MLX computes on the Linux CPU back end with the reference
    BLAS, saying how to get OpenBLAS. For the library's entry points (building or loading TurboQuant caches):
    after the first call it is one global check, and it is not meant for the per-token path."""
    global _warned
    if _warned:
        return
    _warned = True
    if _hinted or not sys.platform.startswith("linux") or not _on_cpu():
        return  # a command already printed its note, or MLX does not run on the CPU BLAS here
    hint = python_hint()
    if hint:
        warnings.warn(hint, ReferenceBLASWarning, stacklevel=3)
