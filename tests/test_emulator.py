"""Tests of the MSL CPU emulator (tests/emulator): it must reproduce MLX's
source generation, run kernels like Metal, and catch planted kernel bugs."""

from __future__ import annotations

import numpy as np
import pytest

import tests.emulator as emu
from tests.emulator import (
    AsanReport,
    Bf16,
    EmulatorCompileError,
    EmulatorError,
    generate_source,
    metal_kernel,
    require_emulator,
)

mx = pytest.importorskip("mlx.core")


@pytest.fixture(scope="module")
def emulator():
    """Skips without clang, unless TQ_REQUIRE_EMULATOR=1 (then it fails)."""
    return require_emulator()


def hadamard(n: int) -> np.ndarray:
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


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
# 2. Kernels run and match numpy.
# --------------------------------------------------------------------------
COPY = """
    uint i = thread_position_in_grid.x;
    if (i < uint(inp_shape[0])) out[i] = inp[i];
"""


@pytest.mark.emulator
def test_elementwise_kernel(emulator):
    k = metal_kernel("axpb", ["x", "a", "b"], ["out"], """
        uint i = thread_position_in_grid.x;
        if (i >= uint(x_shape[0])) return;
        out[i] = T(metal::fma(float(x[i]), a, b[i % 3]));
    """)
    x = np.linspace(-3, 3, 1000, dtype=np.float32)
    b = np.array([1, 2, 3], np.float32)
    (out,) = k(inputs=[x, 0.5, b], output_shapes=[x.shape], output_dtypes=[mx.float32],
               grid=(1000, 1, 1), threadgroup=(256, 1, 1), template=[("T", mx.float32)])
    np.testing.assert_allclose(out, x * 0.5 + b[np.arange(1000) % 3], rtol=1e-6)
    assert "const constant float& a" in k.last_stats.source  # Python float -> 0-d float32
    assert "const constant float* b" in k.last_stats.source  # < 8 elements -> constant
    assert k.last_stats.threadgroups == 4 and not k.last_stats.warnings


WHT128 = """
    // One simdgroup per row of 128, 4 consecutive elements per lane.
    uint lane = thread_index_in_simdgroup;
    uint row = thread_position_in_grid.x / 32;
    const device T* xr = x + row * 128 + lane * 4;
    float4 v = float4(float(xr[0]), float(xr[1]), float(xr[2]), float(xr[3]));
    float4 a = float4(v.x + v.y, v.x - v.y, v.z + v.w, v.z - v.w);
    v = float4(a.x + a.z, a.y + a.w, a.x - a.z, a.y - a.w);
    for (ushort m = 1; m < 32; m <<= 1) {
        float4 o = SHUFFLE;
        v = (lane & m) ? (o - v) : (v + o);
    }
    v *= 0.08838834764831845f;  // 1 / sqrt(128)
    device T* yr = y + row * 128 + lane * 4;
    yr[0] = T(v.x); yr[1] = T(v.y); yr[2] = T(v.z); yr[3] = T(v.w);
"""


def _wht_kernel(shuffle: str = "simd_shuffle_xor(v, m)", name: str = "wht128"):
    return metal_kernel(name, ["x"], ["y"], WHT128.replace("SHUFFLE", shuffle))


def _run_wht(k, x, mxdtype, **kw):
    rows = x.shape[0]
    (y,) = k(inputs=[x], output_shapes=[x.shape], output_dtypes=[mxdtype],
             grid=(rows * 32, 1, 1), threadgroup=(256, 1, 1), template=[("T", mxdtype)], **kw)
    return y


@pytest.mark.emulator
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_wht128_simd_shuffle_matches_numpy_all_schedules(emulator, dtype):
    rows = 100  # 3200 threads, 256 per threadgroup: the last threadgroup is partial
    x = np.random.default_rng(0).standard_normal((rows, 128)).astype(dtype)
    ref = x.astype(np.float64) @ hadamard(128).T / np.sqrt(128)
    tol = 1e-5 if dtype == "float32" else 4e-3
    k = _wht_kernel()
    for schedule in ("forward", "reverse", "random"):
        y = _run_wht(k, x, getattr(mx, dtype), schedule=schedule, seed=7)
        assert y.dtype == np.dtype(dtype)
        np.testing.assert_allclose(y.astype(np.float64), ref, atol=tol, err_msg=schedule)
        st = k.last_stats
        assert not st.warnings
        assert st.threadgroups == 13 and st.group == (256, 1, 1)
        # Each input byte is read exactly once, each output byte written once.
        assert st.buffers["x"].unique_bytes_read == st.buffers["x"].total_bytes_read == x.nbytes
        assert st.buffers["y"].unique_bytes_written == x.nbytes


@pytest.mark.emulator
def test_wht128_wrong_lane_shuffle_gives_wrong_result(emulator):
    x = np.random.default_rng(1).standard_normal((16, 128)).astype(np.float32)
    ref = x @ hadamard(128).T / np.sqrt(128)
    good = _run_wht(_wht_kernel(), x, mx.float32)
    np.testing.assert_allclose(good, ref, atol=1e-5)
    # Planted bug: partner lane off by one bit for the m == 4 stage.
    bad = _run_wht(_wht_kernel("simd_shuffle_xor(v, m == 4 ? 8 : m)", "wht128_bad"), x,
                   mx.float32)
    assert np.abs(bad - ref).max() > 0.1


# tq-mlx's bit planes (metal_kernels/common.metal, as the codec and attention kernels use them) against
# tq_mlx/packing.py at every code width: 1, 2, 4, 8 bits one plane; 3, 5, 6 bits a low plane of 2, 4, 4 bits and
# a high plane of 1, 1, 2 bits.
PLANES = """
    // One SIMD group per vector of D codes: lane l reads codes [l*E, l*E + E) with tq_code and packs them again
    // with tq_pack_plane, lanes OR-ing shared words with shuffles (encode.metal); every word is also built alone
    // by tq_pack_word from the reference codes (encode_dense.metal).
    constexpr int E = D / 32;
    constexpr int LB = tq_lo_bits(B);
    constexpr int HB = tq_hi_bits(B);
    const uint lane = thread_index_in_simdgroup;
    const uint row = thread_position_in_grid.x / 32;
    uint code[E];
    for (int e = 0; e < E; ++e) {
        code[e] = tq_code<B, D>(words + row * W, lane * E + e);
        codes[row * D + lane * E + e] = code[e];
    }
    device uint* out = planes + row * W;
    tq_pack_plane<LB, E>(code, 0, lane, out);
    if (HB > 0) {
        tq_pack_plane<(HB > 0 ? HB : 1), E>(code, LB, lane, out + D * LB / 32);
    }
    for (uint w = lane; w < uint(W); w += 32) {
        single[row * W + w] = tq_pack_word<B, D>(ref + row * D, w);
    }
"""


@pytest.mark.emulator
@pytest.mark.parametrize("dim", [64, 512])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 8])
def test_tq_bit_planes_match_packing_all_schedules(emulator, bits, dim):
    from tq_mlx.kernels import SOURCES
    from tq_mlx.packing import pack, packed_words, planes

    rows, W = 9, packed_words(dim, bits)  # 9 SIMD groups, 4 per threadgroup: the last threadgroup is partial
    assert 32 * W == dim * bits  # exactly b bits per code: no padding at these dims
    ref = np.random.default_rng(bits).integers(0, 1 << bits, (rows, dim)).astype(np.uint32)
    words = np.asarray(pack(mx.array(ref), bits))
    k = metal_kernel(f"planes{bits}", ["words", "ref"], ["codes", "planes", "single"], PLANES,
                     header=SOURCES["common"])
    for schedule in ("forward", "reverse", "random"):
        codes, packed, single = k(
            inputs=[words, ref], output_shapes=[(rows, dim), (rows, W), (rows, W)], output_dtypes=[mx.uint32] * 3,
            grid=(rows * 32, 1, 1), threadgroup=(128, 1, 1), template=[("B", bits), ("D", dim), ("W", W)],
            schedule=schedule, seed=bits)
        np.testing.assert_array_equal(codes, ref, err_msg=schedule)
        np.testing.assert_array_equal(packed, words, err_msg=schedule)
        np.testing.assert_array_equal(single, words, err_msg=schedule)
        st = k.last_stats
        assert not st.warnings
        # every packed word read: once per code of its plane (`tq_code` reads a word per code)
        assert st.buffers["words"].unique_bytes_read == words.nbytes
        assert st.buffers["planes"].unique_bytes_written == st.buffers["planes"].total_bytes_written == words.nbytes
    assert len(planes(bits)) == (2 if bits in (3, 5, 6) else 1)


REDUCE = """
    // Sum of each row: one threadgroup per row, tree reduction in threadgroup memory.
    uint tid = thread_index_in_threadgroup;
    uint row = threadgroup_position_in_grid.x;
    uint n = threads_per_threadgroup.x;
    threadgroup float shared[256];
    float acc = 0.0f;
    for (uint j = tid; j < uint(x_shape[1]); j += n) acc += float(x[row * x_shape[1] + j]);
    shared[tid] = acc;
    BARRIER
    for (uint s = n / 2; s > 0; s >>= 1) {
        if (tid < s) shared[tid] += shared[tid + s];
        BARRIER
    }
    if (tid == 0) out[row] = shared[0];
"""
BARRIER = "threadgroup_barrier(mem_flags::mem_threadgroup);"


def _run_reduce(k, x, **kw):
    rows = x.shape[0]
    (out,) = k(inputs=[x], output_shapes=[(rows,)], output_dtypes=[mx.float32],
               grid=(rows * 256, 1, 1), threadgroup=(256, 1, 1), **kw)
    return out


@pytest.mark.emulator
def test_threadgroup_memory_reduction(emulator):
    x = np.random.default_rng(2).standard_normal((37, 1000)).astype(np.float32)
    k = metal_kernel("tg_reduce", ["x"], ["out"], REDUCE.replace("BARRIER", BARRIER))
    for schedule in ("forward", "reverse", "random"):
        out = _run_reduce(k, x, schedule=schedule)
        np.testing.assert_allclose(out, x.sum(axis=1), atol=1e-4, err_msg=schedule)
    assert k.last_stats.threadgroup_memory == 256 * 4


@pytest.mark.emulator
def test_planted_bug_missing_barrier_is_detected(emulator):
    x = np.random.default_rng(2).standard_normal((37, 1000)).astype(np.float32)
    k = metal_kernel("tg_reduce_nobarrier", ["x"], ["out"], REDUCE.replace("BARRIER", ""))
    wrong = []
    for schedule in ("forward", "reverse", "random"):
        out = _run_reduce(k, x, schedule=schedule)
        if not np.allclose(out, x.sum(axis=1), atol=1e-4):
            wrong.append(schedule)
    # Threadgroup memory starts as NaN, so a reader that runs ahead of the
    # writers sees poison under at least one lane order.
    assert "forward" in wrong and "random" in wrong


DECODE_ATTENTION = """
    // One threadgroup per head, 4 simdgroups split the keys (split-K), each lane
    // owns 4 of the D = 128 dims; online softmax, merged in threadgroup memory.
    constexpr int D = 128, SG = 4;
    uint head = threadgroup_position_in_grid.x;
    uint sg = simdgroup_index_in_threadgroup, lane = thread_index_in_simdgroup;
    int n = k_shape[1];
    const device T* qh = q + head * D + lane * 4;
    float4 qv = float4(float(qh[0]), float(qh[1]), float(qh[2]), float(qh[3])) * scale;
    float m = -INFINITY, l = 0.0f;
    float4 acc = float4(0.0f);
    for (int j = sg; j < n; j += SG) {
        const device T* kj = k + (head * n + j) * D + lane * 4;
        const device T* vj = v + (head * n + j) * D + lane * 4;
        float s = simd_sum(dot(qv, float4(float(kj[0]), float(kj[1]), float(kj[2]), float(kj[3]))));
        float m_new = max(m, s);
        float a = fast::exp(m - m_new), p = fast::exp(s - m_new);
        l = l * a + p;
        acc = acc * a + p * float4(float(vj[0]), float(vj[1]), float(vj[2]), float(vj[3]));
        m = m_new;
    }
    threadgroup float ms[SG], ls[SG];
    threadgroup float4 accs[SG][32];
    if (lane == 0) { ms[sg] = m; ls[sg] = l; }
    accs[sg][lane] = acc;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (sg == 0) {
        float mx = ms[0];
        for (int i = 1; i < SG; ++i) mx = max(mx, ms[i]);
        float total = 0.0f;
        float4 o = float4(0.0f);
        for (int i = 0; i < SG; ++i) {
            float w = fast::exp(ms[i] - mx);
            total += ls[i] * w;
            o += accs[i][lane] * w;
        }
        o /= total;
        device T* oh = out + head * D + lane * 4;
        oh[0] = T(o.x); oh[1] = T(o.y); oh[2] = T(o.z); oh[3] = T(o.w);
    }
"""


@pytest.mark.emulator
def test_decode_attention_online_softmax_reads_kv_once(emulator):
    h, n, d = 3, 37, 128
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal(s).astype(np.float16) for s in ((h, d), (h, n, d), (h, n, d)))
    scale = 1 / np.sqrt(d)
    s = np.einsum("hd,hnd->hn", q.astype(np.float64), k.astype(np.float64)) * scale
    p = np.exp(s - s.max(axis=1, keepdims=True))
    ref = np.einsum("hn,hnd->hd", p / p.sum(axis=1, keepdims=True), v.astype(np.float64))
    kern = metal_kernel("decode_attention", ["q", "k", "v", "scale"], ["out"], DECODE_ATTENTION)
    for schedule in ("forward", "reverse", "random"):
        (out,) = kern(inputs=[q, k, v, float(scale)], output_shapes=[(h, d)],
                      output_dtypes=[mx.float16], grid=(h * 128, 1, 1), threadgroup=(128, 1, 1),
                      template=[("T", mx.float16)], schedule=schedule)
        np.testing.assert_allclose(out.astype(np.float64), ref, atol=2e-3, err_msg=schedule)
        st = kern.last_stats
        assert not st.warnings and st.threadgroup_memory == 2 * 4 * 4 + 4 * 32 * 16
        for name, arr in (("k", k), ("v", v)):  # every K/V byte read exactly once
            b = st.buffers[name]
            assert b.unique_bytes_read == b.total_bytes_read == arr.nbytes
        assert st.buffers["q"].total_bytes_read == 4 * q.nbytes  # once per simdgroup


@pytest.mark.emulator
def test_unwritten_output_stays_nan_and_init_value_fills(emulator):
    k = metal_kernel("half_writer", ["x"], ["out"], """
        uint i = thread_position_in_grid.x;
        if (i % 2 == 0) out[i] = x[i];
    """)
    x = np.arange(64, dtype=np.float32)
    (out,) = k(inputs=[x], output_shapes=[x.shape], output_dtypes=[mx.float32],
               grid=(64, 1, 1), threadgroup=(32, 1, 1))
    assert np.isnan(out[1::2]).all() and np.array_equal(out[::2], x[::2])
    (out,) = k(inputs=[x], output_shapes=[x.shape], output_dtypes=[mx.float32],
               grid=(64, 1, 1), threadgroup=(32, 1, 1), init_value=-1.0)
    assert (out[1::2] == -1).all()


EARLY_RETURN = """
    uint i = thread_position_in_grid.x;
    if (i >= 90) return;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[i] = x[i];
"""


@pytest.mark.emulator
def test_barrier_after_early_return_raises_in_strict_mode(emulator):
    k = metal_kernel("early_return", ["x"], ["out"], EARLY_RETURN)
    x = np.arange(100, dtype=np.float32)
    args = dict(inputs=[x], output_shapes=[x.shape], output_dtypes=[mx.float32],
                grid=(100, 1, 1), threadgroup=(64, 1, 1))
    with pytest.raises(EmulatorError, match=r"threadgroup_barrier at .*\.metal:8:\d+ reached after"):
        k(**args)
    (out,) = k(**args, strict=False)
    assert np.array_equal(out[:90], x[:90])
    assert any("reached after" in w for w in k.last_stats.warnings)


@pytest.mark.emulator
def test_threadgroup_over_1024_threads_raises(emulator):
    k = metal_kernel("copy", ["inp"], ["out"], COPY)
    x = np.zeros(4096, np.float32)
    with pytest.raises(ValueError, match=r"Thread group size \(1056\) is greater"):
        k(inputs=[x], output_shapes=[x.shape], output_dtypes=[mx.float32],
          grid=(4096, 1, 1), threadgroup=(32, 33, 1))


@pytest.mark.emulator
def test_threadgroup_memory_over_32k_raises(emulator):
    k = metal_kernel("tg_too_big", ["x"], ["out"], """
        threadgroup float a[4096];
        threadgroup float4 b[1024];
        threadgroup float c[4];
        uint t = thread_index_in_threadgroup;
        a[t] = 1.0f; b[t] = 2.0f; c[0] = 3.0f;
        out[thread_position_in_grid.x] = a[0] + b[0].x + c[0];
    """)
    x = np.zeros(32, np.float32)
    with pytest.raises(EmulatorError, match=r"'c' .* 32784 bytes, above the 32768-byte limit"):
        k(inputs=[x], output_shapes=[x.shape], output_dtypes=[mx.float32],
          grid=(32, 1, 1), threadgroup=(32, 1, 1))


@pytest.mark.emulator
def test_byte_counts_of_copy_kernel_are_exact(emulator):
    k = metal_kernel("copy", ["inp"], ["out"], COPY)
    x = np.random.default_rng(3).standard_normal(10_000).astype(np.float32)
    (out,) = k(inputs=[x], output_shapes=[x.shape], output_dtypes=[mx.float32],
               grid=(10_000, 1, 1), threadgroup=(256, 1, 1))
    assert np.array_equal(out, x)
    b = k.last_stats.buffers
    assert b["inp"].nbytes == x.nbytes
    assert b["inp"].unique_bytes_read == b["inp"].total_bytes_read == x.nbytes
    assert b["inp"].total_bytes_written == 0
    assert b["out"].unique_bytes_written == b["out"].total_bytes_written == x.nbytes
    assert b["out"].total_bytes_read == 0


@pytest.mark.emulator
def test_byte_counts_see_copy_loops_from_private_arrays(emulator):
    # clang turns such loops into memcpy unless told not to; the bytes must still be counted.
    src = (
        "uint i = thread_position_in_grid.x;\n"
        "float acc[4];\n"
        "for (int e = 0; e < 4; e++) acc[e] = inp[i * 4 + e] * 2.0f;\n"
        "for (int e = 0; e < 4; e++) out[i * 4 + e] = acc[e];\n"
    )
    k = metal_kernel("copyloop", ["inp"], ["out"], src)
    x = np.arange(64, dtype=np.float32)
    (out,) = k(inputs=[x], output_shapes=[x.shape], output_dtypes=[mx.float32],
               grid=(16, 1, 1), threadgroup=(16, 1, 1))
    assert np.array_equal(out, 2 * x)
    assert k.last_stats.buffers["out"].total_bytes_written == x.nbytes


@pytest.mark.emulator
def test_byte_counts_distinguish_repeated_reads(emulator):
    # Every thread reads its neighbour too: total = 2x, unique = 1x (+ edge).
    k = metal_kernel("stencil", ["inp"], ["out"], """
        uint i = thread_position_in_grid.x;
        uint n = uint(inp_shape[0]);
        out[i] = inp[i] + inp[(i + 1) % n];
    """)
    x = np.ones(1024, np.float32)
    k(inputs=[x], output_shapes=[x.shape], output_dtypes=[mx.float32],
      grid=(1024, 1, 1), threadgroup=(128, 1, 1))
    b = k.last_stats.buffers["inp"]
    assert b.unique_bytes_read == x.nbytes and b.total_bytes_read == 2 * x.nbytes


OOB_WRITE = """
    uint i = thread_position_in_grid.x;
    out[i + 1] = inp[i];   // planted off-by-one
"""


@pytest.mark.emulator
def test_out_of_bounds_write_detected(emulator):
    k = metal_kernel("oob", ["inp"], ["out"], OOB_WRITE)
    x = np.arange(64, dtype=np.float32)
    with pytest.raises(EmulatorError, match=r"out-of-bounds device write of 4 bytes at byte "
                                            r"offset 256 of buffer 'out' \(256 bytes\)"):
        k(inputs=[x], output_shapes=[x.shape], output_dtypes=[mx.float32],
          grid=(64, 1, 1), threadgroup=(32, 1, 1))


@pytest.mark.emulator
@pytest.mark.slow
def test_out_of_bounds_write_detected_by_asan_build(emulator):
    emu.require_asan()
    k = metal_kernel("oob", ["inp"], ["out"], OOB_WRITE)
    x = np.arange(64, dtype=np.float32)
    args = dict(inputs=[x], output_shapes=[x.shape], output_dtypes=[mx.float32],
                grid=(64, 1, 1), threadgroup=(32, 1, 1), asan=True)
    with pytest.raises(AsanReport, match=r"heap-buffer-overflow(.|\n)*custom_kernel_oob_float_float"
                                         r"\.metal:7:"):
        k(**args)
    # The fixed kernel runs clean under ASan and gives the right answer.
    k2 = metal_kernel("copy", ["inp"], ["out"], COPY)
    (out,) = k2(**args)
    assert np.array_equal(out, x)
    # What only ASan sees: overflowing a thread-private array.
    k3 = metal_kernel("private_oob", ["inp"], ["out"], """
        uint i = thread_position_in_grid.x;
        float acc[4];
        for (int j = 0; j <= int(inp[0]); ++j) acc[j] = inp[i];
        out[i] = acc[0];
    """)
    with pytest.raises(AsanReport, match=r"stack-buffer-overflow(.|\n)*private_oob_float_float"
                                         r"\.metal:8:"):
        k3(**{**args, "inputs": [np.full(64, 4.0, np.float32)]})


@pytest.mark.emulator
def test_threadgroup_memory_out_of_bounds_detected(emulator):
    k = metal_kernel("tg_oob", ["x"], ["out"], """
        threadgroup float buf[64];
        uint t = thread_index_in_threadgroup;
        buf[t + 1] = x[thread_position_in_grid.x];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[thread_position_in_grid.x] = buf[t];
    """)
    x = np.zeros(128, np.float32)
    with pytest.raises(EmulatorError, match=r"out-of-bounds threadgroup memory write .* of 'buf'"):
        k(inputs=[x], output_shapes=[x.shape], output_dtypes=[mx.float32],
          grid=(128, 1, 1), threadgroup=(64, 1, 1))


# --------------------------------------------------------------------------
# 3. Dispatch, SIMD semantics, types.
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
# 4. Source rewrites (pure Python).
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
