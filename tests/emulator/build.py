"""Compiler discovery, translation-unit assembly and the compiled-object cache.

A kernel build is: prelude.h + the rewritten MLX source (``#line`` mapped to
``<kernel>.metal``) + generated glue calling the kernel from the runtime,
compiled by clang and linked with a cached runtime object. Results are cached
under ``$TQ_EMULATOR_CACHE`` (default ``~/.cache/tq-mlx/emulator``) by a hash of
everything that goes into them, shared by every process that uses the folder
(pytest-xdist workers, runs side by side, later runs): a file in it is written
to a temporary name and renamed into place, so it is whole when it exists, and
one process builds an entry while any other that wants it waits on a lock file
(``locks/``), then finds it built.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from .errors import EmulatorCompileError, EmulatorUnavailable
from .rewrite import rewrite_source
from .source import GeneratedKernel

HERE = Path(__file__).resolve().parent
PRELUDE = HERE / "prelude.h"
RUNTIME_H = HERE / "runtime.h"
RUNTIME_CPP = HERE / "runtime.cpp"
DRIVER_CPP = HERE / "driver.cpp"
INCLUDE = HERE / "include"  # empty stand-ins for <metal_stdlib> & co.

MIN_CLANG = 17  # __bf16 arithmetic and -fbfloat16-excess-precision


@dataclass(frozen=True)
class Compiler:
    argv: tuple[str, ...]  # command prefix, e.g. ("clang++-19",)
    version: str  # first line of --version
    major: int
    is_zig: bool = False

    @property
    def ident(self) -> str:
        return " ".join(self.argv) + "|" + self.version


def _probe(argv: list[str]) -> Compiler | None:
    try:
        out = subprocess.run(
            argv + ["--version"], capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    first = (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr) else ""
    m = re.search(r"clang version (\d+)", out.stdout + out.stderr)
    if not m:
        return None
    major = int(m.group(1))
    if major < MIN_CLANG:
        return None
    return Compiler(tuple(argv), first, major, is_zig="zig" in " ".join(argv))


@lru_cache(maxsize=1)
def find_compiler() -> Compiler | None:
    """``$TQ_EMULATOR_CXX``, then clang++-N / clang++ on PATH, then ``python -m ziglang c++``."""
    env = os.environ.get("TQ_EMULATOR_CXX")
    if env:
        return _probe(shlex.split(env))
    names = [f"clang++-{v}" for v in range(25, MIN_CLANG - 1, -1)] + ["clang++"]
    for name in names:
        path = shutil.which(name)
        if path:
            c = _probe([path])
            if c:
                return c
    try:
        import importlib.util

        if importlib.util.find_spec("ziglang") is not None:
            return _probe([sys.executable, "-m", "ziglang", "c++"])
    except Exception:
        pass
    return None


def require_compiler() -> Compiler:
    c = find_compiler()
    if c is None:
        raise EmulatorUnavailable(
            "the MSL emulator needs clang >= 17: `pip install ziglang` (in the test extra), "
            "`apt-get install -y clang-19`, or set TQ_EMULATOR_CXX"
        )
    return c


def cache_dir() -> Path:
    d = Path(os.environ.get("TQ_EMULATOR_CACHE", Path.home() / ".cache" / "tq-mlx" / "emulator"))
    d.mkdir(parents=True, exist_ok=True)
    return d


# ----------------------------------------------------------------- flags
COMMON_FLAGS = (
    "-std=c++17",
    "-fPIC",
    "-fno-exceptions",
    "-fno-rtti",
    "-fno-strict-aliasing",
    "-Xclang", "-ffloat16-excess-precision=none",
    "-Xclang", "-fbfloat16-excess-precision=none",
)
# Kernel code only: every load/store calls the runtime (byte counts, bounds).
KERNEL_FLAGS = (
    "-O1",
    # Without this, clang turns copy loops into llvm.memcpy, which the load/store hooks never see: those
    # bytes would go uncounted and unchecked.
    "-fno-builtin",
    "-fvisibility=hidden",
    "-fsanitize-coverage=func,inline-8bit-counters,trace-loads,trace-stores",
    "-Wall",
    "-Wno-unknown-attributes",
    "-Wno-unused-variable",
    "-Wno-unused-function",
    "-Wno-unused-but-set-variable",
    "-Wno-unused-local-typedef",
    "-ferror-limit=20",
    # Large private arrays probe every page, so they hit the guard page below
    # the fiber stack instead of silently landing in a neighbour's stack.
    "-fstack-clash-protection",
)
RUNTIME_FLAGS = ("-O2", "-fvisibility=hidden", "-Wall")
ASAN_FLAGS = ("-fsanitize=address", "-fno-omit-frame-pointer", "-gline-tables-only")


@dataclass(frozen=True)
class BuildMode:
    address_spaces: bool = True
    asan: bool = False

    @property
    def defines(self) -> tuple[str, ...]:
        return () if self.address_spaces else ("-DTQEMU_NO_ADDRESS_SPACES",)

    @property
    def tag(self) -> str:
        return ("asan" if self.asan else "run") + ("-as" if self.address_spaces else "-plain")


def _hash(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()[:24]


def _run(cmd: list[str], what: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        err = proc.stderr.strip()
        # Errors inside prelude templates name the kernel line only in a
        # note further down: list the kernel locations first.
        where = [ln for ln in err.splitlines() if ".metal:" in ln and "error" not in ln]
        head = ("kernel lines involved:\n  " + "\n  ".join(where) + "\n") if where else ""
        raise EmulatorCompileError(f"{what} failed:\n{head}{err}")
    return proc


def _atomic_output(final: Path) -> Path:
    """A temp path next to ``final``; os.replace() it into place when done."""
    fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=final.name + ".", suffix=".tmp")
    os.close(fd)
    return Path(tmp)


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader (clang, another process) never sees it half written."""
    tmp = _atomic_output(path)
    tmp.write_text(text)
    os.replace(tmp, path)


@contextlib.contextmanager
def _build_lock(out: Path):
    """Hold ``locks/<out's name>.lock`` in the cache folder while building ``out``: a second process that
    needs the same entry waits, then finds it in the cache, instead of compiling it a second time."""
    locks = out.parent / "locks"
    locks.mkdir(exist_ok=True)
    with open(locks / f"{out.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _support_object(c: Compiler, src: Path, mode: BuildMode) -> Path:
    flags = list(COMMON_FLAGS + RUNTIME_FLAGS) + (list(ASAN_FLAGS) if mode.asan else [])
    key = _hash(c.ident, " ".join(flags), src.read_bytes(), RUNTIME_H.read_bytes())
    out = cache_dir() / f"{src.stem}-{'asan' if mode.asan else 'run'}-{key}.o"
    if out.exists():
        return out
    with _build_lock(out):
        if not out.exists():  # (else another process built it while this one waited)
            tmp = _atomic_output(out)
            try:
                _run(list(c.argv) + flags + ["-I", str(HERE), "-c", str(src), "-o", str(tmp)],
                     f"compiling {src.name}")
            except EmulatorCompileError:
                tmp.unlink(missing_ok=True)
                raise
            os.replace(tmp, out)
    return out


# ------------------------------------------------------------------ glue
def _param_expr(p, i: int) -> str:
    b = f"B[{i}]"
    if p.kind == "input":
        if p.is_ref:
            return f"*(const {p.space} {p.ctype}*){b}"
        return f"(const {p.space} {p.ctype}*){b}"
    if p.kind == "shape":
        return f"(const constant int*){b}"
    if p.kind == "strides":
        return f"(const constant int64_t*){b}"
    if p.kind == "ndim":
        return f"*(const constant int*){b}"
    if p.kind == "output":
        return f"(device {p.ctype}*){b}"
    raise AssertionError(p.kind)


def glue_source(g: GeneratedKernel, atomic_outputs: bool) -> str:
    """C++ that adapts the runtime's (buffers, attributes) call to the kernel."""
    args = []
    nbuf = 0
    for p in g.params:
        if p.kind == "attr":
            if p.ctype == "uint3":
                args.append(f"uint3{{A->{p.name}[0], A->{p.name}[1], A->{p.name}[2]}}")
            else:
                args.append(f"A->{p.name}")
            continue
        if p.kind == "output" and atomic_outputs:
            args.append(f"(device atomic<{p.ctype}>*)B[{nbuf}]")
        else:
            args.append(_param_expr(p, nbuf))
        nbuf += 1
    call = g.kernel_name + g.template_def
    return (
        "static void tqemu_thunk(void* const* B, const ::tqemu::ThreadAttrs* A) {\n"
        "  (void)B; (void)A;\n"
        f"  {call}(\n    " + ",\n    ".join(args) + ");\n"
        "}\n"
        'extern "C" __attribute__((visibility("default"))) int tqemu_launch('
        "::tqemu::LaunchDesc* d) {\n"
        "  return ::tqemu::run_launch(d, &tqemu_thunk);\n"
        "}\n"
    )


def translation_unit(g: GeneratedKernel, atomic_outputs: bool) -> str:
    metal_name = g.kernel_name + ".metal"
    return (
        '#include "prelude.h"\n'
        f'#line 1 "{metal_name}"\n'
        + rewrite_source(g.source)
        + '\n#line 1 "tqemu_glue.cpp"\n'
        + glue_source(g, atomic_outputs)
    )


@dataclass(frozen=True)
class Built:
    path: Path  # .so (in-process) or executable (ASan)
    warnings: str  # clang warnings, if any
    tu_path: Path


def build_kernel_binary(g: GeneratedKernel, atomic_outputs: bool, mode: BuildMode) -> Built:
    """Compile (or fetch from cache) the kernel for ``mode``."""
    c = require_compiler()
    if mode.asan and c.is_zig:
        raise EmulatorUnavailable("ASan builds need Debian's clang (zig ships no ASan runtime)")
    tu = translation_unit(g, atomic_outputs)
    flags = list(COMMON_FLAGS + KERNEL_FLAGS) + list(mode.defines)
    if mode.asan:
        flags += list(ASAN_FLAGS)
    key = _hash(c.ident, " ".join(flags), mode.tag, tu, PRELUDE.read_bytes(),
                RUNTIME_H.read_bytes(), RUNTIME_CPP.read_bytes(), DRIVER_CPP.read_bytes())
    d = cache_dir()
    tu_path = d / f"{g.kernel_name[:80]}-{key}.cpp"
    out = d / (f"{g.kernel_name[:80]}-{key}" + (".asan" if mode.asan else ".so"))
    warn_path = out.with_suffix(out.suffix + ".log")

    def cached() -> Built:  # (the log is renamed into place before the binary: present whenever it is)
        return Built(out, warn_path.read_text() if warn_path.exists() else "", tu_path)

    if out.exists():
        return cached()
    objs = [str(_support_object(c, RUNTIME_CPP, mode))]
    if mode.asan:
        objs.append(str(_support_object(c, DRIVER_CPP, mode)))
    with _build_lock(out):
        if out.exists():  # another process built it while this one waited
            return cached()
        _write_atomic(tu_path, tu)
        tmp = _atomic_output(out)
        link = ["-o", str(tmp), "-pthread", "-lm"] + ([] if mode.asan else ["-shared"])
        try:
            proc = _run(
                list(c.argv) + flags + ["-I", str(HERE), "-isystem", str(INCLUDE), "-x", "c++", str(tu_path),
                                        "-x", "none"] + objs + link,
                f"compiling kernel {g.kernel_name}",
            )
        except EmulatorCompileError:
            tmp.unlink(missing_ok=True)
            raise
        _write_atomic(warn_path, proc.stderr)
        os.replace(tmp, out)
    return Built(out, proc.stderr, tu_path)


def syntax_check(g: GeneratedKernel, atomic_outputs: bool, address_spaces: bool = True) -> str:
    """``clang -fsyntax-only`` of the kernel; returns warnings, raises on errors."""
    c = require_compiler()
    tu = translation_unit(g, atomic_outputs)
    flags = list(COMMON_FLAGS + KERNEL_FLAGS) + list(BuildMode(address_spaces).defines)
    with tempfile.TemporaryDirectory() as td:
        p = Path(td) / "tu.cpp"
        p.write_text(tu)
        proc = _run(list(c.argv) + flags + ["-I", str(HERE), "-isystem", str(INCLUDE), "-fsyntax-only", str(p)],
                    f"syntax check of {g.kernel_name}")
    return proc.stderr
