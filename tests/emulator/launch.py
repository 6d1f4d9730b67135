"""Running a compiled kernel: in-process through ctypes, or the ASan build as a
subprocess. Both speak ``tqemu::LaunchDesc`` (runtime.h)."""

from __future__ import annotations

import ctypes
import os
import struct
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import AsanReport

KIND_AUX, KIND_INPUT, KIND_OUTPUT = 0, 1, 2
SCHEDULES = {"forward": 0, "reverse": 1, "random": 2}


class LaunchDesc(ctypes.Structure):
    # Must match tqemu::LaunchDesc field for field.
    _fields_ = [
        ("n_buffers", ctypes.c_int32),
        ("schedule", ctypes.c_int32),
        ("seed", ctypes.c_uint64),
        ("buffers", ctypes.POINTER(ctypes.c_void_p)),
        ("buffer_bytes", ctypes.POINTER(ctypes.c_int64)),
        ("buffer_kinds", ctypes.POINTER(ctypes.c_int32)),
        ("buffer_names", ctypes.POINTER(ctypes.c_char_p)),
        ("grid", ctypes.c_uint32 * 3),
        ("threadgroup", ctypes.c_uint32 * 3),
        ("strict", ctypes.c_int32),
        ("guard_buffers", ctypes.c_int32),
        ("workers", ctypes.c_int32),
        ("stack_bytes", ctypes.c_uint64),
        ("max_threads_per_threadgroup", ctypes.c_uint32),
        ("max_threadgroup_memory", ctypes.c_uint32),
        ("stats", ctypes.POINTER(ctypes.c_int64)),
        ("log", ctypes.c_char_p),
        ("log_capacity", ctypes.c_int64),
        ("error", ctypes.c_int32),
        ("n_warnings", ctypes.c_int32),
        ("threadgroup_memory", ctypes.c_uint64),
        ("fiber_switches", ctypes.c_uint64),
        ("threadgroups_run", ctypes.c_uint64),
    ]


@dataclass
class BufferSpec:
    """One kernel buffer in parameter order."""

    name: str
    kind: int
    array: np.ndarray  # holds the bytes; outputs are written back into it
    nbytes: int  # bytes the kernel may touch (from the array's data pointer)


@dataclass
class LaunchParams:
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    schedule: str = "forward"
    seed: int = 0
    strict: bool = True
    workers: int = 1
    stack_bytes: int = 256 * 1024
    max_threads_per_threadgroup: int = 1024
    max_threadgroup_memory: int = 32 * 1024
    guard_buffers: bool = True


@dataclass
class RawResult:
    error: bool
    log: str
    stats: list[tuple[int, int, int, int]]  # per buffer: total rd, total wr, unique rd, unique wr
    threadgroup_memory: int
    fiber_switches: int
    threadgroups_run: int


def _data_ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


_libs: dict[str, tuple[ctypes.CDLL, threading.Lock]] = {}
_libs_lock = threading.Lock()


def _load(path: Path) -> tuple[ctypes.CDLL, threading.Lock]:
    with _libs_lock:
        key = str(path)
        if key not in _libs:
            lib = ctypes.CDLL(key, mode=os.RTLD_NOW | os.RTLD_LOCAL)
            lib.tqemu_launch.argtypes = [ctypes.POINTER(LaunchDesc)]
            lib.tqemu_launch.restype = ctypes.c_int
            # One launch at a time per library: the runtime keeps the current
            # launch's address ranges in globals.
            _libs[key] = (lib, threading.Lock())
        return _libs[key]


def run_in_process(so_path: Path, buffers: list[BufferSpec], p: LaunchParams) -> RawResult:
    lib, lock = _load(so_path)
    n = len(buffers)
    ptrs = (ctypes.c_void_p * n)(*[_data_ptr(b.array) for b in buffers])
    sizes = (ctypes.c_int64 * n)(*[b.nbytes for b in buffers])
    kinds = (ctypes.c_int32 * n)(*[b.kind for b in buffers])
    names = (ctypes.c_char_p * n)(*[b.name.encode() for b in buffers])
    stats = (ctypes.c_int64 * (4 * n))()
    log = ctypes.create_string_buffer(1 << 16)
    d = LaunchDesc()
    d.n_buffers = n
    d.schedule = SCHEDULES[p.schedule]
    d.seed = p.seed & 0xFFFFFFFFFFFFFFFF
    d.buffers = ptrs
    d.buffer_bytes = sizes
    d.buffer_kinds = kinds
    d.buffer_names = names
    d.grid[:] = list(p.grid)
    d.threadgroup[:] = list(p.threadgroup)
    d.strict = int(p.strict)
    d.guard_buffers = int(p.guard_buffers)
    d.workers = p.workers
    d.stack_bytes = p.stack_bytes
    d.max_threads_per_threadgroup = p.max_threads_per_threadgroup
    d.max_threadgroup_memory = p.max_threadgroup_memory
    d.stats = stats
    d.log = ctypes.cast(log, ctypes.c_char_p)
    d.log_capacity = len(log)
    with lock:
        lib.tqemu_launch(ctypes.byref(d))
    return RawResult(
        error=bool(d.error),
        log=log.value.decode(errors="replace"),
        stats=[tuple(stats[4 * i : 4 * i + 4]) for i in range(n)],
        threadgroup_memory=d.threadgroup_memory,
        fiber_switches=d.fiber_switches,
        threadgroups_run=d.threadgroups_run,
    )


def _write_launch_file(path: Path, buffers: list[BufferSpec], p: LaunchParams) -> None:
    with open(path, "wb") as f:
        f.write(b"TQEMU01\0")
        f.write(struct.pack("<iiiii", len(buffers), SCHEDULES[p.schedule], int(p.strict),
                            p.workers, int(p.guard_buffers)))
        f.write(struct.pack("<QQ", p.seed & 0xFFFFFFFFFFFFFFFF, p.stack_bytes))
        f.write(struct.pack("<3I3III", *p.grid, *p.threadgroup,
                            p.max_threads_per_threadgroup, p.max_threadgroup_memory))
        for b in buffers:
            name = b.name.encode()
            f.write(struct.pack("<ii", b.kind, len(name)))
            f.write(name)
            f.write(struct.pack("<q", b.nbytes))
            raw = (ctypes.c_char * b.nbytes).from_address(_data_ptr(b.array)) if b.nbytes else b""
            f.write(bytes(raw))


def _asan_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)  # ASan must come first; the driver needs nothing else
    env["ASAN_OPTIONS"] = "detect_leaks=0:halt_on_error=1:abort_on_error=0:symbolize=1"
    for cand in ("/usr/lib/llvm-19/bin/llvm-symbolizer", "/usr/bin/llvm-symbolizer"):
        if os.path.exists(cand):
            env.setdefault("ASAN_SYMBOLIZER_PATH", cand)
            break
    return env


def run_asan(exe: Path, buffers: list[BufferSpec], p: LaunchParams, timeout: float = 300) -> RawResult:
    with tempfile.TemporaryDirectory(prefix="tqemu-asan-") as td:
        fin, fout = Path(td) / "launch.bin", Path(td) / "result.bin"
        _write_launch_file(fin, buffers, p)
        proc = subprocess.run([str(exe), str(fin), str(fout)], capture_output=True, text=True,
                              env=_asan_env(), timeout=timeout)
        if proc.returncode != 0 or not fout.exists():
            report = proc.stderr.strip()
            if "AddressSanitizer" in report:
                raise AsanReport(_trim_asan(report))
            raise RuntimeError(f"ASan driver failed (exit {proc.returncode}):\n{report}")
        data = fout.read_bytes()
    off = 0
    err, nwarn = struct.unpack_from("<ii", data, off)
    off += 8
    tgmem, switches, ntg = struct.unpack_from("<QQQ", data, off)
    off += 24
    n = len(buffers)
    flat = struct.unpack_from(f"<{4 * n}q", data, off)
    off += 32 * n
    (log_len,) = struct.unpack_from("<q", data, off)
    off += 8
    log = data[off : off + log_len].decode(errors="replace")
    off += log_len
    for b in buffers:
        if b.kind == KIND_OUTPUT:
            if not err:
                dst = (ctypes.c_char * b.nbytes).from_address(_data_ptr(b.array))
                ctypes.memmove(dst, data[off : off + b.nbytes], b.nbytes)
            off += b.nbytes
    return RawResult(bool(err), log, [tuple(flat[4 * i : 4 * i + 4]) for i in range(n)],
                     tgmem, switches, ntg)


def _trim_asan(report: str) -> str:
    """Keep the ASan headline and the frames that point into kernel code."""
    lines = report.splitlines()
    keep = [ln for ln in lines if "ERROR: AddressSanitizer" in ln or ".metal:" in ln
            or "SUMMARY:" in ln or ln.startswith(("READ of", "WRITE of"))]
    return "\n".join(keep or lines[:40])
