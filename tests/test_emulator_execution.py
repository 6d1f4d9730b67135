"""Tests of the MSL CPU emulator (tests/emulator): it must run kernels like
Metal, and catch planted kernel bugs: kernels match numpy under every schedule,
byte counts are exact, and missing barriers, out-of-bounds accesses and
threadgroups over Metal's limits are reported. Source generation, dispatch, SIMD
semantics and types: tests/test_emulator.py."""

from __future__ import annotations

import numpy as np
import pytest

import tests.emulator as emu
from tests.emulator import (
    AsanReport,
    EmulatorError,
    metal_kernel,
)
from tests.test_emulator import emulator  # noqa: F401  (module fixture)

mx = pytest.importorskip("mlx.core")


def hadamard(n: int) -> np.ndarray:
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


# --------------------------------------------------------------------------
# Kernels run and match numpy.
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


# tq-mlx's bit planes (tq_mlx/attention/common.metal, as the codec and attention kernels use them) against
# tq_mlx/quant/packing.py at every code width: 1, 2, 4, 8 bits one plane; 3, 5, 6 bits a low plane of 2, 4, 4 bits and
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
    from tq_mlx.attention import SOURCES
    from tq_mlx.quant.packing import pack, packed_words, planes

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
