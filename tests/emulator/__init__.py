"""CPU emulator for Metal kernels written for ``mx.fast.metal_kernel``.

Test-support code: compiles the exact source MLX would generate (see
source.py) as C++ with clang against a Metal prelude, and runs every Metal
thread as a fiber, dispatched exactly like MLX does. See README.md.

    from tests.emulator import metal_kernel

    k = metal_kernel(name="copy", input_names=["inp"], output_names=["out"],
                     source="uint i = thread_position_in_grid.x; out[i] = inp[i];")
    (out,) = k(inputs=[x], output_shapes=[x.shape], output_dtypes=[x.dtype],
               grid=(x.size, 1, 1), threadgroup=(256, 1, 1))
    k.last_stats.buffers["inp"].unique_bytes_read  # == x.nbytes
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .build import (
    BuildMode,
    Compiler,
    build_kernel_binary,
    find_compiler,
    require_compiler,
    syntax_check,
)
from .dtypes import (
    bf16_bits_to_float32,
    dtype_name,
    float32_to_bf16_bits,
    numpy_dtype,
)
from .errors import AsanReport, EmulatorCompileError, EmulatorError, EmulatorUnavailable
from .launch import (
    KIND_AUX,
    KIND_INPUT,
    KIND_OUTPUT,
    BufferSpec,
    LaunchParams,
    run_asan,
    run_in_process,
)
from .rewrite import lint
from .source import ArgSpec, GeneratedKernel, build_kernel, generate_source

__all__ = [
    "AsanReport",
    "Bf16",
    "BufferStats",
    "EmulatorCompileError",
    "EmulatorError",
    "EmulatorUnavailable",
    "LaunchResult",
    "LaunchStats",
    "MetalKernel",
    "bf16_bits_to_float32",
    "emulator_available",
    "find_compiler",
    "float32_to_bf16_bits",
    "generate_source",
    "metal_kernel",
    "require_asan",
    "require_compiler",
    "require_emulator",
]

MAX_THREADS_PER_THREADGROUP = 1024
MAX_THREADGROUP_MEMORY = 32 * 1024


# ------------------------------------------------------------------ results
@dataclass(frozen=True)
class BufferStats:
    """Device traffic of one input or output buffer during one launch.

    ``total_*`` counts every byte of every load/store the kernel executed (as
    compiled at -O1); ``unique_*`` counts distinct bytes touched, so a kernel
    that reads each byte exactly once has total == unique == nbytes.
    """

    name: str
    kind: str  # "input" | "output"
    nbytes: int
    total_bytes_read: int
    unique_bytes_read: int
    total_bytes_written: int
    unique_bytes_written: int


@dataclass
class LaunchStats:
    kernel_name: str
    source: str  # the Metal source MLX would compile (without MLX's preamble)
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    group: tuple[int, int, int]  # min(threadgroup, grid), what MLX dispatches
    threadgroups: int
    threads: int
    schedule: str
    seed: int
    buffers: dict[str, BufferStats] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # "msg (xN)"
    threadgroup_memory: int = 0  # bytes, largest threadgroup
    fiber_switches: int = 0
    elapsed_s: float = 0.0
    compile_warnings: str = ""
    lint_warnings: list[str] = field(default_factory=list)


@dataclass
class LaunchResult:
    outputs: list[np.ndarray]
    stats: LaunchStats


@dataclass(frozen=True)
class Bf16:
    """Marks an input as bfloat16: ``Bf16.from_float(x)`` rounds float data,
    ``Bf16(bits)`` takes raw uint16 bit patterns."""

    bits: np.ndarray

    @staticmethod
    def from_float(x: Any) -> "Bf16":
        return Bf16(float32_to_bf16_bits(np.asarray(x, dtype=np.float32)))


# ------------------------------------------------------------ availability
def emulator_available() -> bool:
    return find_compiler() is not None


def require_emulator() -> Compiler:
    """For tests: skip when no compiler is installed, unless the environment
    sets TQ_REQUIRE_EMULATOR=1 (CI), in which case the test fails."""
    import pytest

    c = find_compiler()
    if c is None:
        msg = (
            "MSL emulator unavailable: no clang >= 17 (pip install -e \".[test]\" brings ziglang's; "
            "or apt-get install -y clang-19, or set TQ_EMULATOR_CXX)"
        )
        if os.environ.get("TQ_REQUIRE_EMULATOR") == "1":
            pytest.fail(msg + " and TQ_REQUIRE_EMULATOR=1")
        pytest.skip(msg)
    return c


def require_asan() -> Compiler:
    """Like require_emulator, for tests that need the ASan build (Debian's
    clang; zig's bundled clang ships no ASan runtime)."""
    import pytest

    c = require_emulator()
    if c.is_zig:
        msg = "the ASan build needs Debian's clang (apt-get install -y clang-19), not ziglang"
        if os.environ.get("TQ_REQUIRE_EMULATOR") == "1":
            pytest.fail(msg + " and TQ_REQUIRE_EMULATOR=1")
        pytest.skip(msg)
    return c


# ------------------------------------------------------------------ inputs
def _is_mx_array(x: Any) -> bool:
    return type(x).__module__.startswith("mlx") and type(x).__name__ == "array"


def to_input_array(x: Any) -> tuple[np.ndarray, str]:
    """(storage array, MLX dtype name) for one kernel input, converting like
    MLX's ``to_array``: Python bool -> bool, int -> int32, float -> float32."""
    if isinstance(x, Bf16):
        return np.asarray(x.bits, dtype=np.uint16), "bfloat16"
    if isinstance(x, bool):
        return np.array(x, dtype=np.bool_), "bool"
    if isinstance(x, int):
        return np.array(x, dtype=np.int32), "int32"
    if isinstance(x, float):
        return np.array(x, dtype=np.float32), "float32"
    if _is_mx_array(x):
        import mlx.core as mx

        if x.dtype == mx.bfloat16:
            return np.array(x.view(mx.uint16)), "bfloat16"
        return np.array(x), dtype_name(x.dtype)
    arr = np.asarray(x)
    if arr.dtype == np.float64:  # mx.array(float64 numpy) is float32
        arr = arr.astype(np.float32)
    name = dtype_name(arr.dtype)
    if name == "bfloat16":
        arr = arr.view(np.uint16)
    return arr, name


def _strided_view(arr: np.ndarray) -> tuple[np.ndarray, int, list[int]] | None:
    """For ensure_row_contiguous=False: (array, bytes spanned, element strides)
    of a non-negatively strided array, or None if it must be copied."""
    item = arr.itemsize
    if arr.size == 0 or any(s < 0 or s % item for s in arr.strides):
        return None
    span = sum((d - 1) * s for d, s in zip(arr.shape, arr.strides)) + item
    return arr, span, [s // item for s in arr.strides]


def _triple(v: Sequence[int], what: str) -> tuple[int, int, int]:
    t = tuple(int(x) for x in v)
    if len(t) != 3 or any(x < 1 for x in t):
        raise ValueError(f"[metal_kernel] {what} must be 3 positive integers, got {v}")
    return t  # type: ignore[return-value]


# ------------------------------------------------------------------ kernel
class MetalKernel:
    """Callable mirroring the object ``mx.fast.metal_kernel`` returns."""

    def __init__(
        self,
        name: str,
        input_names: Sequence[str],
        output_names: Sequence[str],
        source: str,
        header: str = "",
        ensure_row_contiguous: bool = True,
        atomic_outputs: bool = False,
    ) -> None:
        if not output_names:
            raise ValueError("[metal_kernel] Must specify at least one output.")
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.source = source
        self.header = header
        self.ensure_row_contiguous = ensure_row_contiguous
        self.atomic_outputs = atomic_outputs
        self.last_stats: LaunchStats | None = None
        errors, self._lint_warnings = lint(source, header)
        self._lint_errors = errors

    # -- source -----------------------------------------------------------
    def generate(
        self,
        inputs: Sequence[Any],
        output_dtypes: Sequence[Any],
        template: Sequence[tuple[str, Any]] | None = None,
    ) -> GeneratedKernel:
        """The kernel as MLX would generate it for these input dtypes/shapes."""
        specs = []
        for x in inputs:
            if isinstance(x, ArgSpec):
                specs.append(x)
            else:
                arr, dt = to_input_array(x)
                specs.append(ArgSpec(dt, tuple(arr.shape)))
        return build_kernel(
            self.name, self.input_names, self.output_names, self.source, self.header,
            specs, [dtype_name(d) for d in output_dtypes], template, self.atomic_outputs,
        )

    def check_syntax(
        self,
        inputs: Sequence[Any],
        output_dtypes: Sequence[Any],
        template: Sequence[tuple[str, Any]] | None = None,
        address_spaces: bool = True,
    ) -> str:
        """Compile only (clang -fsyntax-only); returns clang's warnings."""
        self._raise_lint()
        return syntax_check(self.generate(inputs, output_dtypes, template),
                            self.atomic_outputs, address_spaces)

    def _raise_lint(self) -> None:
        if self._lint_errors:
            raise EmulatorCompileError(f"kernel '{self.name}': " + "; ".join(self._lint_errors))

    # -- launch -----------------------------------------------------------
    def __call__(self, **kwargs: Any) -> list[np.ndarray]:
        """Same keywords as MLX's kernel call (inputs, output_shapes,
        output_dtypes, grid, threadgroup, template, init_value, verbose, stream)
        plus the emulator's: schedule ("forward" | "reverse" | "random"), seed,
        strict, workers, address_spaces, asan. Returns numpy outputs; launch
        statistics are in ``self.last_stats``. bfloat16 outputs are
        ml_dtypes.bfloat16 arrays if ml_dtypes is installed, else uint16 bits."""
        return self.launch(**kwargs).outputs

    def launch(
        self,
        *,
        inputs: Sequence[Any],
        output_shapes: Sequence[Sequence[int]],
        output_dtypes: Sequence[Any],
        grid: Sequence[int],
        threadgroup: Sequence[int],
        template: Sequence[tuple[str, Any]] | None = None,
        init_value: float | None = None,
        verbose: bool = False,
        stream: Any = None,
        schedule: str = "forward",
        seed: int = 0,
        strict: bool = True,
        workers: int | None = None,
        address_spaces: bool = True,
        asan: bool = False,
    ) -> LaunchResult:
        del stream  # accepted for signature compatibility
        self._raise_lint()
        if len(inputs) != len(self.input_names):
            raise ValueError(
                f"[metal_kernel] Expected `inputs` to have size {len(self.input_names)} "
                f"but got size {len(inputs)}."
            )
        for what, seq in (("output_shapes", output_shapes), ("output_dtypes", output_dtypes)):
            if len(seq) != len(self.output_names):
                raise ValueError(
                    f"[metal_kernel] Expected `{what}` to have size {len(self.output_names)} "
                    f"but got size {len(seq)}."
                )
        if schedule not in ("forward", "reverse", "random"):
            raise ValueError(f"unknown schedule {schedule!r}")
        grid3 = _triple(grid, "grid")
        tg3 = _triple(threadgroup, "threadgroup")
        tg_size = tg3[0] * tg3[1] * tg3[2]
        if tg_size > MAX_THREADS_PER_THREADGROUP:
            # MLX's wording, double space included.
            raise ValueError(
                f"Thread group size ({tg_size}) is greater than  the maximum allowed threads "
                f"per threadgroup ({MAX_THREADS_PER_THREADGROUP})."
            )

        converted = [to_input_array(x) for x in inputs]
        specs = [ArgSpec(dt, tuple(a.shape)) for a, dt in converted]
        out_names = [dtype_name(d) for d in output_dtypes]
        if "complex64" in out_names + [dt for _, dt in converted]:
            raise NotImplementedError("complex64_t is not supported by the emulator")
        gen = build_kernel(
            self.name, self.input_names, self.output_names, self.source, self.header,
            specs, out_names, template, self.atomic_outputs,
        )
        if verbose:
            print(f"Generated source code for `{self.name}`:\n```\n{gen.source}\n```")
        mode = BuildMode(address_spaces=address_spaces and not asan, asan=asan)
        built = build_kernel_binary(gen, self.atomic_outputs, mode)

        buffers, outputs = self._buffers(gen, converted, output_shapes, out_names, init_value)
        params = LaunchParams(
            grid=grid3,
            threadgroup=tg3,
            schedule=schedule,
            seed=seed,
            strict=strict,
            workers=workers or int(os.environ.get("TQ_EMULATOR_WORKERS", min(2, os.cpu_count() or 1))),
            stack_bytes=(1024 if asan else 256) * 1024,
            max_threads_per_threadgroup=MAX_THREADS_PER_THREADGROUP,
            max_threadgroup_memory=MAX_THREADGROUP_MEMORY,
            guard_buffers=not asan,
        )
        t0 = time.perf_counter()
        stats = self._stats_skeleton(gen, grid3, tg3, schedule, seed, built.warnings)
        try:
            raw = (run_asan if asan else run_in_process)(built.path, buffers, params)
        except AsanReport as e:
            e.stats = stats
            self.last_stats = stats
            raise
        stats.elapsed_s = time.perf_counter() - t0
        stats.threadgroup_memory = raw.threadgroup_memory
        stats.fiber_switches = raw.fiber_switches
        for b, (trd, twr, urd, uwr) in zip(buffers, raw.stats):
            if b.kind == KIND_AUX:
                continue
            stats.buffers[b.name] = BufferStats(
                b.name, "input" if b.kind == KIND_INPUT else "output", b.nbytes,
                total_bytes_read=trd, unique_bytes_read=urd,
                total_bytes_written=twr, unique_bytes_written=uwr,
            )
        error = None
        for line in raw.log.splitlines():
            if line.startswith("E:"):
                error = line[2:]
            elif line.startswith("W:"):
                count, _, msg = line[2:].partition(":")
                stats.warnings.append(msg + (f" (x{count})" if count != "1" else ""))
        self.last_stats = stats
        if raw.error:
            raise EmulatorError(f"kernel '{self.name}': {error or 'launch failed'}", stats)
        return LaunchResult(outputs, stats)

    # -- helpers ----------------------------------------------------------
    def _stats_skeleton(self, gen, grid3, tg3, schedule, seed, compile_warnings) -> LaunchStats:
        group = tuple(min(t, g) for t, g in zip(tg3, grid3))
        ntg = 1
        for g, gr in zip(grid3, group):
            ntg *= -(-g // gr)
        return LaunchStats(
            kernel_name=gen.kernel_name, source=gen.source, grid=grid3, threadgroup=tg3,
            group=group, threadgroups=ntg, threads=grid3[0] * grid3[1] * grid3[2],
            schedule=schedule, seed=seed, compile_warnings=compile_warnings,
            lint_warnings=list(self._lint_warnings),
        )

    def _buffers(self, gen, converted, output_shapes, out_names, init_value):
        buffers: list[BufferSpec] = []
        keep: list[np.ndarray] = []
        strides_of: dict[int, list[int]] = {}
        arrays: dict[int, tuple[np.ndarray, int]] = {}
        for i, (arr, _) in enumerate(converted):
            view = None if self.ensure_row_contiguous else _strided_view(arr)
            if view is None:
                a = np.ascontiguousarray(arr)
                if a.ndim == 0:
                    a = a.reshape(())
                arrays[i] = (a, a.nbytes)
                strides_of[i] = [int(np.prod(a.shape[k + 1:], dtype=np.int64)) for k in range(a.ndim)]
            else:
                a, span, st = view
                arrays[i] = (a, span)
                strides_of[i] = st
        outputs: list[np.ndarray] = []
        for shape, dt in zip(output_shapes, out_names):
            out = np.empty(tuple(int(s) for s in shape), dtype=numpy_dtype(dt))
            if init_value is None:
                out.reshape(-1).view(np.uint8).fill(0xFF)  # MLX leaves outputs uninitialised
            elif dt == "bfloat16":
                out.reshape(-1).view(np.uint16)[:] = float32_to_bf16_bits(np.float32(init_value))
            elif dt == "bool":
                out.fill(init_value != 0)
            else:
                out[...] = np.array(init_value, dtype=np.float32).astype(out.dtype)
            outputs.append(out)
        for p in gen.params:
            if p.kind == "input":
                a, nbytes = arrays[p.index]
                buffers.append(BufferSpec(p.name, KIND_INPUT, a, nbytes))
            elif p.kind in ("shape", "strides", "ndim"):
                a = arrays[p.index][0]
                if p.kind == "shape":
                    aux = np.array(a.shape, dtype=np.int32)
                elif p.kind == "strides":
                    aux = np.array(strides_of[p.index], dtype=np.int64)
                else:
                    aux = np.array([a.ndim], dtype=np.int32)
                aux = np.ascontiguousarray(aux) if aux.size else np.zeros(1, aux.dtype)
                keep.append(aux)
                buffers.append(BufferSpec(p.name, KIND_AUX, aux, aux.nbytes))
            elif p.kind == "output":
                o = outputs[p.index]
                buffers.append(BufferSpec(p.name, KIND_OUTPUT, o, o.nbytes))
        return buffers, outputs


def metal_kernel(
    name: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    source: str,
    header: str = "",
    ensure_row_contiguous: bool = True,
    atomic_outputs: bool = False,
) -> MetalKernel:
    """Drop-in for ``mx.fast.metal_kernel`` that runs on the CPU emulator."""
    return MetalKernel(name, input_names, output_names, source, header,
                       ensure_row_contiguous, atomic_outputs)
