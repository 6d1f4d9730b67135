"""Tests of the MSL CPU emulator (tests/emulator): it must reproduce MLX's
source generation, and run kernels like Metal: its dispatch, SIMD semantics and
types, compile errors and (pure Python) source rewrites. Kernels that run and
match numpy, and planted kernel bugs caught: tests/test_emulator_execution.py."""

from __future__ import annotations

import numpy as np
import pytest

import tests.emulator as emu
from tests.emulator import (
    Bf16,
    EmulatorCompileError,
    generate_source,
    metal_kernel,
    require_emulator,
)

mx = pytest.importorskip("mlx.core")


@pytest.fixture(scope="module")
def emulator():
    """Skips without clang, unless TQ_REQUIRE_EMULATOR=1 (then it fails)."""
    return require_emulator()


# --------------------------------------------------------------------------
# 1. The source generator equals MLX's own output (no compiler needed).
# --------------------------------------------------------------------------
ALL_ATTRIBUTES_COMMENT = "// " + " ".join(a for a, _ in emu.source.METAL_ATTRIBUTES) + "\n"

SOURCE_CASES = {
    "templates": dict(
        input_names=["inp"], output_names=["out"],
        source="uint i = thread_position_in_grid.x;\nout[i] = T(inp[i]) * N * (FLAG ? 1 : 2);\n",
        header="#define SCALE 2\n",
        inputs=lambda: [mx.zeros((4, 16))], output_shapes=[(4, 16)],
        output_dtypes=[mx.float16],
        template=[("T", mx.float16), ("N", 3), ("FLAG", True), ("NEG", -2), ("OFF", False),
                  ("U", mx.uint8)],
    ),
    "shape_strides_ndim": dict(
        input_names=["a", "b"], output_names=["out"],
        source=("uint i = thread_position_in_grid.x;\n"
                "out[i] = a[elem_to_loc(i, a_shape, a_strides, a_ndim)] + b_ndim;\n"),
        inputs=lambda: [mx.zeros((3, 5, 7)), mx.zeros((9, 2), dtype=mx.int32)],
        output_shapes=[(105,)], output_dtypes=[mx.float32],
    ),
    "scalar_and_small": dict(
        input_names=["x", "alpha", "count", "small", "eight"], output_names=["out"],
        source="out[thread_position_in_grid.x] = x[0] * alpha + count + small[1] + eight[7];\n",
        inputs=lambda: [mx.zeros((64,)), 2.5, mx.array(3), mx.zeros((7,), dtype=mx.float16),
                        mx.zeros((8,))],
        output_shapes=[(64,)], output_dtypes=[mx.float32],
    ),
    "multiple_outputs": dict(
        input_names=["x"], output_names=["o1", "o2", "o3"],
        source="uint i = thread_index_in_threadgroup; o1[i] = x[i]; o2[i] = 1; o3[i] = 2;\n",
        inputs=lambda: [mx.zeros((32,))], output_shapes=[(32,), (32,), (4, 8)],
        output_dtypes=[mx.float32, mx.int32, mx.bfloat16],
    ),
    "atomic_outputs": dict(
        input_names=["x"], output_names=["hist", "total"],
        source=("uint i = thread_position_in_grid.x;\n"
                "atomic_fetch_add_explicit(&hist[0], 1, memory_order_relaxed);\n"),
        inputs=lambda: [mx.zeros((100,), dtype=mx.uint32)], output_shapes=[(16,), (1,)],
        output_dtypes=[mx.int32, mx.float32], atomic_outputs=True,
    ),
    "mlx_comma_bug": dict(
        input_names=["a"], output_names=["out", "o2"],
        source="out[0] = a[a_shape[0] - 1]; o2[0] = 1;\n",
        inputs=lambda: [mx.zeros((16,))], output_shapes=[(1,), (1,)],
        output_dtypes=[mx.float32, mx.int32],
    ),
    "all_attributes": dict(
        input_names=["x"], output_names=["out"], source=ALL_ATTRIBUTES_COMMENT + "out[0] = x[0];\n",
        inputs=lambda: [mx.zeros((10,))], output_shapes=[(1,)], output_dtypes=[mx.float32],
    ),
    "dtypes": dict(
        input_names=["b", "u8", "i64", "bf", "u32"], output_names=["out"],
        source="out[thread_position_in_grid.x] = u8[0];\n",
        inputs=lambda: [mx.zeros((9,), dtype=mx.bool_), mx.zeros((9,), dtype=mx.uint8),
                        mx.zeros((9,), dtype=mx.int64), mx.zeros((9,), dtype=mx.bfloat16),
                        mx.zeros((2,), dtype=mx.uint32)],
        output_shapes=[(9,)], output_dtypes=[mx.uint64],
    ),
}


@pytest.mark.parametrize("case", sorted(SOURCE_CASES))
def test_source_generator_matches_mlx_export(case):
    from tests.emulator.mlx_reference import mlx_generated_source

    c = dict(SOURCE_CASES[case])
    inputs = c.pop("inputs")()
    name = "k_" + case
    reference = mlx_generated_source(name=name, inputs=inputs, **c)
    kernel_name, source = generate_source(
        name, c["input_names"], c["output_names"], c["source"], c.get("header", ""), inputs,
        c["output_dtypes"], c.get("template"), c.get("atomic_outputs", False),
    )
    assert source == reference
    assert f"[[kernel]] void {kernel_name}(" in reference


def test_source_generator_reproduces_comma_bug():
    _, src = generate_source("bug", ["a"], ["out", "o2"], "out[0] = a_shape[0];", "",
                             [np.zeros(16, np.float32)], [np.float32, np.int32])
    assert "device float* out [[buffer(2)]]) {\n  device int32_t* o2" in src


# --------------------------------------------------------------------------
# 2. Dispatch, SIMD semantics, types.
# --------------------------------------------------------------------------
@pytest.mark.emulator
def test_thread_attributes_follow_mlx_dispatch_with_edge_threadgroups(emulator):
    k = metal_kernel("attrs", ["x"], ["out"], """
        uint2 p = thread_position_in_grid.xy;
        uint o = (p.y * threads_per_grid.x + p.x) * 6;
        out[o + 0] = threads_per_threadgroup.x * 100 + threads_per_threadgroup.y;
        out[o + 1] = dispatch_threads_per_threadgroup.x * 100 + dispatch_threads_per_threadgroup.y;
        out[o + 2] = threadgroup_position_in_grid.x * 100 + threadgroup_position_in_grid.y;
        out[o + 3] = thread_index_in_threadgroup;
        out[o + 4] = simdgroup_index_in_threadgroup * 100 + thread_index_in_simdgroup;
        out[o + 5] = threadgroups_per_grid.x * 100 + threadgroups_per_grid.y + x[0];
    """)
    gx, gy, tx, ty = 21, 13, 8, 4  # 3 x 4 threadgroups, the last row/column smaller
    (out,) = k(inputs=[np.zeros(1, np.uint32)], output_shapes=[(gy, gx, 6)],
               output_dtypes=[mx.uint32], grid=(gx, gy, 1), threadgroup=(tx, ty, 1))
    for y in range(gy):
        for x in range(gx):
            ax, ay = min(tx, gx - x // tx * tx), min(ty, gy - y // ty * ty)
            lid = (x % tx) + ax * (y % ty)
            want = [ax * 100 + ay, tx * 100 + ty, (x // tx) * 100 + y // ty, lid,
                    (lid // 32) * 100 + lid % 32, 3 * 100 + 4]
            assert out[y, x].tolist() == want, (x, y)
    # grid smaller than the threadgroup: the group shrinks to the grid.
    (out,) = k(inputs=[np.zeros(1, np.uint32)], output_shapes=[(1, 5, 6)],
               output_dtypes=[mx.uint32], grid=(5, 1, 1), threadgroup=(256, 1, 1))
    assert out[0, :, 0].tolist() == [501] * 5 and out[0, :, 1].tolist() == [501] * 5


@pytest.mark.emulator
def test_simd_and_quad_functions(emulator):
    k = metal_kernel("simd_zoo", ["x"], ["out"], """
        uint g = thread_position_in_grid.x;
        float v = x[g];
        out[g * 8 + 0] = simd_sum(v);
        out[g * 8 + 1] = simd_max(v);
        out[g * 8 + 2] = simd_min(v);
        out[g * 8 + 3] = simd_prefix_exclusive_sum(v);
        out[g * 8 + 4] = simd_shuffle_down(v, 1);
        out[g * 8 + 5] = simd_broadcast(v, 3);
        out[g * 8 + 6] = float(uint64_t(simd_ballot(v > 0.0f)) & 0xFFFFu);
        out[g * 8 + 7] = quad_sum(v) + (simd_is_first() ? 100.0f : 0.0f);
    """)
    x = np.random.default_rng(4).standard_normal(64).astype(np.float32)
    (out,) = k(inputs=[x], output_shapes=[(64 * 8,)], output_dtypes=[mx.float32],
               grid=(64, 1, 1), threadgroup=(64, 1, 1), schedule="random", seed=3)
    out = out.reshape(2, 32, 8)
    for s, xs in enumerate(x.reshape(2, 32)):
        o = out[s]
        np.testing.assert_allclose(o[:, 0], xs.sum(), atol=1e-5)
        assert (o[:, 1] == xs.max()).all() and (o[:, 2] == xs.min()).all()
        np.testing.assert_allclose(o[:, 3], np.concatenate([[0], np.cumsum(xs)[:-1]]), atol=1e-5)
        assert np.array_equal(o[:, 4], np.concatenate([xs[1:], xs[-1:]]))  # top lane keeps its own
        assert (o[:, 5] == xs[3]).all()
        assert (o[:, 6] == sum(1 << i for i in range(16) if xs[i] > 0)).all()
        quads = xs.reshape(8, 4).sum(axis=1).repeat(4) + np.eye(1, 32, 0)[0] * 100
        np.testing.assert_allclose(o[:, 7], quads, atol=1e-5)
    assert not k.last_stats.warnings


@pytest.mark.emulator
def test_divergent_simd_op_and_inactive_lane_reads_warn(emulator):
    k = metal_kernel("divergent", ["x"], ["out"], """
        uint i = thread_position_in_grid.x;
        float v = x[i];
        if (thread_index_in_simdgroup < 16) v = simd_sum(v);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[i] = v + simd_shuffle_down(x[i], 16);
    """)
    x = np.ones(48, np.float32)  # 48 threads: the second simdgroup has 16 lanes
    (out,) = k(inputs=[x], output_shapes=[x.shape], output_dtypes=[mx.float32],
               grid=(48, 1, 1), threadgroup=(48, 1, 1))
    assert out[0] == 16 + 1  # sum over the 16 active lanes + lane 16's value
    assert np.isnan(out[32:48]).all()  # lanes 48..63 do not exist: poisoned
    text = "\n".join(k.last_stats.warnings)
    assert "divergent control flow" in text and "result poisoned" in text


@pytest.mark.emulator
def test_atomic_outputs_histogram_across_workers(emulator):
    k = metal_kernel("hist", ["x"], ["counts"], """
        uint i = thread_position_in_grid.x;
        atomic_fetch_add_explicit(&counts[x[i] % 16], 1, memory_order_relaxed);
    """, atomic_outputs=True)
    x = np.random.default_rng(5).integers(0, 1000, 5000).astype(np.uint32)
    (counts,) = k(inputs=[x], output_shapes=[(16,)], output_dtypes=[mx.int32],
                  grid=(5000, 1, 1), threadgroup=(128, 1, 1), init_value=0, workers=2)
    assert np.array_equal(counts, np.bincount(x % 16, minlength=16))
    c = k.last_stats.buffers["counts"]
    assert c.total_bytes_written == 5000 * 4 and c.unique_bytes_written == 64


@pytest.mark.emulator
def test_half_rounds_every_operation(emulator):
    k = metal_kernel("half_round", ["a", "e"], ["out"], """
        half s = a[0] + e[0];
        out[0] = s + e[0];                                  // stays 1: each op rounds to half
        out[1] = half(float(a[0]) + float(e[0]) + float(e[0]));  // float path: 1 + 2^-10
    """)
    a = np.array([1], np.float16)
    e = np.array([2.0**-11], np.float16)
    (out,) = k(inputs=[a, e], output_shapes=[(2,)], output_dtypes=[mx.float16],
               grid=(1, 1, 1), threadgroup=(1, 1, 1))
    assert out[0] == 1 and out[1] == np.float16(1 + 2.0**-10)


@pytest.mark.emulator
def test_bfloat16_inputs_from_mlx_and_bits(emulator):
    k = metal_kernel("bf16", ["x"], ["out"], """
        uint i = thread_position_in_grid.x;
        out[i] = float(x[i] * bfloat(2.0f));
    """)
    vals = np.array([1.5, -2.25, 32768.0, 0.0078125], np.float32)  # exact in bf16
    for inp in (mx.array(vals).astype(mx.bfloat16), Bf16.from_float(vals)):
        (out,) = k(inputs=[inp], output_shapes=[(4,)], output_dtypes=[mx.float32],
                   grid=(4, 1, 1), threadgroup=(4, 1, 1))
        assert np.array_equal(out, vals * 2)


@pytest.mark.emulator
def test_non_contiguous_input_with_strides(emulator):
    src = """
        uint i = thread_position_in_grid.x;
        out[i] = x[elem_to_loc(i, x_shape, x_strides, x_ndim)];
    """
    base = np.arange(60, dtype=np.float32).reshape(6, 10)
    view = base[:, ::3]  # strides (10, 3) elements
    for contiguous in (True, False):
        k = metal_kernel("gather", ["x"], ["out"], src, ensure_row_contiguous=contiguous)
        (out,) = k(inputs=[view], output_shapes=[(view.size,)], output_dtypes=[mx.float32],
                   grid=(view.size, 1, 1), threadgroup=(32, 1, 1))
        assert np.array_equal(out, view.reshape(-1))


@pytest.mark.emulator
def test_compile_errors_point_at_metal_source_lines(emulator):
    x = np.zeros(32, np.float32)
    args = dict(inputs=[x], output_shapes=[x.shape], output_dtypes=[mx.float32],
                grid=(32, 1, 1), threadgroup=(32, 1, 1))
    # device pointer into a thread pointer: an address-space error, as in Metal.
    k = metal_kernel("addrspace", ["x"], ["out"], """
        uint i = thread_position_in_grid.x;
        float* p = out;
        p[i] = x[i];
    """)
    with pytest.raises(EmulatorCompileError, match=r"addrspace_float_float\.metal:7:16"):
        k(**args)
    # MLX's ") {" bug (2 outputs, x_shape used, no thread attribute) cannot compile.
    k = metal_kernel("comma", ["x"], ["out", "o2"], "out[0] = x[x_shape[0] - 1]; o2[0] = 1;")
    with pytest.raises(EmulatorCompileError, match=r"error:"):
        k(inputs=[x], output_shapes=[(1,), (1,)], output_dtypes=[mx.float32, mx.int32],
          grid=(1, 1, 1), threadgroup=(1, 1, 1))
    # A vector constructor with the wrong number of components.
    k = metal_kernel("ctor", ["x"], ["out"], """
        float4 v = float4(x[0], 2.0f, 3.0f);
        out[thread_position_in_grid.x] = v.x;
    """)
    with pytest.raises(EmulatorCompileError, match=r"ctor_float_float\.metal:6:"):
        k(**args)


@pytest.mark.emulator
def test_lint_rejects_execution_width_with_threads_per_simdgroup(emulator):
    k = metal_kernel("widths", ["x"], ["out"],
                     "out[0] = x[0] + thread_execution_width + threads_per_simdgroup;")
    with pytest.raises(EmulatorCompileError, match="thread_execution_width and threads_per_simdgroup"):
        k(inputs=[np.zeros(8, np.float32)], output_shapes=[(1,)], output_dtypes=[mx.float32],
          grid=(1, 1, 1), threadgroup=(1, 1, 1))


def test_require_emulator_fails_instead_of_skipping_when_ci_demands(monkeypatch):
    monkeypatch.setattr(emu, "find_compiler", lambda: None)
    monkeypatch.delenv("TQ_REQUIRE_EMULATOR", raising=False)
    with pytest.raises(pytest.skip.Exception):
        require_emulator()
    monkeypatch.setenv("TQ_REQUIRE_EMULATOR", "1")
    with pytest.raises(pytest.fail.Exception):
        require_emulator()


@pytest.mark.emulator
def test_strict_address_spaces_reject_what_plain_mode_accepts(emulator):
    # Passing a device pointer where a thread pointer is expected is a Metal
    # error; only the strict (default) build sees it.
    k = metal_kernel("as_helper", ["x"], ["out"],
                     "out[thread_position_in_grid.x] = first(x);",
                     header="#include <metal_stdlib>\ninline float first(const thread float* p) "
                            "{ return p[0]; }\n")
    x = np.full(4, 3.0, np.float32)
    with pytest.raises(EmulatorCompileError, match="address space"):
        k.check_syntax([x], [mx.float32])
    (out,) = k(inputs=[x], output_shapes=[(4,)], output_dtypes=[mx.float32],
               grid=(4, 1, 1), threadgroup=(4, 1, 1), address_spaces=False)
    assert (out == 3).all()


# --------------------------------------------------------------------------
# 3. Source rewrites (pure Python).
# --------------------------------------------------------------------------
def test_rewrite_threadgroup_declarations():
    from tests.emulator.rewrite import RewriteError, rewrite_source

    src = (
        "threadgroup float a[32], b[4][2];\n"
        "  threadgroup metal::vec<T, 4> v[N];  // comment threadgroup float c[2];\n"
        "threadgroup float* p = a;\n"
        "threadgroup_barrier(mem_flags::mem_threadgroup);\n"
        "void f(threadgroup float* q);\n"
        "{ threadgroup atomic<uint> counter; }\n"
    )
    out = rewrite_source(src)
    assert out.count("\n") == src.count("\n")  # line numbers are preserved
    assert "using tqemu_tg_t_a = threadgroup float [32];" in out
    assert "using tqemu_tg_t_b = threadgroup float [4][2];" in out
    assert "using tqemu_tg_t_v = threadgroup metal::vec<T, 4> [N];" in out
    assert "using tqemu_tg_t_counter = threadgroup atomic<uint> ;" in out
    assert "// comment threadgroup float c[2];" in out  # comments untouched
    assert "threadgroup float* p = a;" in out and "void f(threadgroup float* q);" in out
    with pytest.raises(RewriteError, match="initializer"):
        rewrite_source("threadgroup float z[4] = {0};")
    # A "*" in the bounds is arithmetic: still an array declaration.
    assert "using tqemu_tg_t_w = threadgroup float [2 * N];" in rewrite_source("threadgroup float w[2 * N];")


def test_rewrite_instantiation_and_literals():
    from tests.emulator.rewrite import rewrite_source

    src = ('half h = 1.0h + 2h + .5H; bfloat b = 0.25bf; float f = x1h + 1.5f;\n'
           'template [[host_name("k_float")]] [[kernel]] decltype(k<float>) k<float>;\n')
    out = rewrite_source(src)
    assert "((half)1.0f) + ((half)2.0f) + ((half).5f)" in out
    assert "((bfloat)0.25f)" in out and "x1h + 1.5f" in out
    assert "template decltype(k<float>) k<float>;" in out
