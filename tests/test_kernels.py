"""The Metal kernels (tq_mlx.attention) against their pure-MLX reference twins, under the CPU MSL emulator.

Nothing here runs on a GPU: the emulator compiles the exact source MLX would build and runs every Metal
thread as a fiber (tests/emulator). The matrix is split by job over four files, with their shared helpers and
fixtures in tests/support/kernel_cases.py: this file (random views), tests/test_kernel_cache.py (real caches,
byte counts), tests/test_kernel_dispatch.py (planted bugs, dispatch, source generation, mac_check, 8-bit norms)
and tests/test_kernel_masks.py (learned sinks, array masks, MLA). Here:
* forward schedule: decode attention and the rotation on every supported head_dim (64, 128, 256; the rotation
  also 32 and 512) x bits (1, 2, 3, 4, 5, 6, 8; QJL keys 2, 3, 4) x dtype (float16, bfloat16, float32); encode and
  dequantize on every head_dim x bits in the dtype the cache uses, and every (head_dim, dtype) and (bits, dtype)
  pair (`covering`: their dtype only changes one load or store); head_dim 32 and 512 smoke tests;
* 5- and 6-bit codes (bit planes 4+1 and 4+2): encode and dequantize in all three schedules;
* encode_dense (channel groups, a per-head channel order, head dims 80, 96, 192) against the reference codes;
* all three lane schedules (forward, reverse, random) on a representative subset (GQA decode, QJL decode
  with a causal mask, many query rows split into chunks, encode and dequantize with QJL);
* sparse V's bound (SPARSE_V_EPSILON) on an adversarial 20k-token pattern against a float64 exact result;
* trellis codes (config.trellis): decode and prefill attention with every trellis width on keys and values (and
  one side of Lloyd-Max codes beside them), dequantize at every width, a planted window bug in each read; the
  search (viterbi.metal) at every width, split over launches by its scratch bound, encode and recode through it,
  and a planted traceback bug.
Cost, for the four kernel files together, is dominated by compiling ~250 kernel variants (about 0.4 s of CPU
each, cached in ~/.cache/tq-mlx): 1.8 CPU-minutes cold (80 s wall on a 2-core machine at load 2), 30
CPU-seconds warm (28 s wall there); the bit-pair, head_dim, schedule and sparse-V bound tests take 24 s of that
cold, 10 s warm. The 5- and 6-bit cases (131 tests) bring the four files to 46 CPU-seconds warm (92 s wall on
that machine at load 10).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import mlx.core as mx

from tests.support.kernel_cases import (  # noqa: F401  (_clean_dispatch and emulator: the same fixtures)
    BITS, DIMS, DTYPES, QJL_BITS, SCHEDULES, Emu, _clean_dispatch, assert_close, assert_codes_equal, cache_step,
    emulator, handle, ids, normal, planted, quantizer, run_decode,
)
from tq_mlx import attention as K
from tq_mlx import StreamView
from tq_mlx.quant import trellis
from tq_mlx.quant.quantizer import TurboQuantMSE
from tq_mlx.quant.rotation import Rotation


# ==================================================================== 1. rotation
@pytest.mark.emulator
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("dim", (32,) + DIMS + (512,))
def test_rotate_matches_reference(emulator, dim, dtype, inverse):
    rot = Rotation(dim, seed=7)
    x = normal(np.random.default_rng(dim), (3, 5, dim), dtype)  # 15 rows: a partial threadgroup
    schedules = SCHEDULES if (dim, dtype) == (128, mx.float16) else ("forward",)
    for schedule in schedules:
        got = K.rotate(x, rot, inverse, metal_kernel=Emu(schedule))
        assert got.dtype == mx.float32
        np.testing.assert_allclose(np.asarray(got), np.asarray(K.rotate_reference(x, rot, inverse)),
                                   atol=2e-6 * math.sqrt(dim), err_msg=schedule)


# ====================================================================== 2. encode
def covering(primary) -> list[tuple]:
    """(dim, bits, qjl, dtype): every head_dim x bits (x QJL) in the `primary` dtype, plus a Latin square that
    pairs every head_dim and every bit width with every dtype. Encode's dtype only changes its input load and
    dequantize's only its output store, so this covers them at about half the compiles of the full product."""
    cases = []
    for qjl, bits in ((False, BITS), (True, QJL_BITS)):
        for i, d in enumerate(DIMS):
            for j, b in enumerate(bits):
                for t in dict.fromkeys([primary, DTYPES[(i + j) % 3]]):
                    cases.append((d, b, qjl, t))
    return cases


ENCODE_CASES = covering(mx.float32)  # the cache encodes float32 blocks


@pytest.mark.emulator
@pytest.mark.parametrize("dim,bits,qjl,dtype", ENCODE_CASES, ids=ids)
def test_encode_matches_reference(emulator, dim, bits, qjl, dtype):
    rng = np.random.default_rng(dim * 10 + bits)
    q = quantizer(dim, bits, qjl)
    x = normal(rng, (2, 2, 5, dim), dtype) * 3.0
    mean = normal(rng, (2, 2, dim)) * 0.5
    x = mx.concatenate([x, mx.zeros((2, 2, 1, dim), dtype) + mean[:, :, None].astype(dtype)], axis=2)  # |x-μ| ~ 0
    got = K.encode(x, q, mean, metal_kernel=Emu())
    assert_codes_equal(got, K.encode_reference(x, q, mean), q)


@pytest.mark.emulator
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_encode_schedules_without_mean(emulator, schedule):
    q = quantizer(128, 3, qjl=True)
    x = normal(np.random.default_rng(5), (1, 3, 11, 128), mx.float16)  # 33 tokens: partial threadgroup
    assert_codes_equal(K.encode(x, q, None, metal_kernel=Emu(schedule)), K.encode_reference(x, q, None), q)


@pytest.mark.emulator
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dim,bits", [(128, 5), (512, 6), (96, 6)], ids=ids)
def test_encode_and_dequantize_5_and_6_bits_schedules(emulator, schedule, dim, bits):
    # 33 tokens, a partial threadgroup; words of the 4-bit plane shared by 2 lanes (d = 128) or 2 per lane (512);
    # d = 96 through encode_dense (dequantize takes one WHT group, at every width).
    q = quantizer(dim, bits)
    rng = np.random.default_rng(bits)
    x = normal(rng, (1, 3, 11, dim), mx.float16) * 2.0
    mean = normal(rng, (1, 3, dim)) * 0.5
    f = Emu(schedule, seed=bits)
    assert_codes_equal(K.encode(x, q, mean, metal_kernel=f), K.encode_reference(x, q, mean), q, schedule)
    assert f.launches[0].name == ("tq_encode_dense" if dim == 96 else "tq_encode")
    if dim != 96:
        h = handle(rng, q, n=21, n_sinks=0, n_window=0)
        assert_close(K.dequantize(h, mx.float16, metal_kernel=f), K.dequantize_reference(h, mx.float16), mx.float16,
                     schedule)


# Channel groups (2.5 / 3.5 bits, a per-head channel order) and head dims without a power-of-two WHT go through
# encode_dense.metal (a dense rotation per group).
DENSE_CASES = [(d, b) for d in (64, 128, 80, 96) for b in (2.5, 3.5)] + [(d, b) for d in (80, 96, 192) for b in BITS]


@pytest.mark.emulator
@pytest.mark.parametrize("dim,bits", DENSE_CASES, ids=ids)
def test_encode_groups_and_other_head_dims_match_reference(emulator, dim, bits):
    rng = np.random.default_rng(dim * 10 + int(2 * bits))
    q = quantizer(dim, bits)
    dtype = DTYPES[DENSE_CASES.index((dim, bits)) % 3]
    H = 3
    x = normal(rng, (2, H, 5, dim), dtype) * 3.0
    mean = normal(rng, (2, H, dim)) * 0.5
    x = mx.concatenate([x, mx.zeros((2, H, 1, dim), dtype) + mean[:, :, None].astype(dtype)], axis=2)  # |x-μ| ~ 0
    perm = mx.array(np.stack([rng.permutation(dim) for _ in range(H)]).astype(np.int32)) if bits % 1 else None
    f = Emu()
    got = K.encode(x, q, mean, perm, metal_kernel=f)
    assert [launch.name for launch in f.launches] == ["tq_encode_dense"]
    assert got.norms.shape == (2, H, 6, len(q.groups))
    assert_codes_equal(got, K.encode_reference(x, q, mean, perm), q, f"d={dim} b={bits}")


@pytest.mark.emulator
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_encode_dense_schedules_on_cache_streams(emulator, schedule):
    # A real fractional-bit cache's calibration (channel order, mean, power-of-two scale), 33 tokens: a
    # partial threadgroup.
    q, keys, values = cache_step(3.5, 2.5, False, 96, 1, 2, 1, mx.float16)
    x = normal(np.random.default_rng(5), (1, 2, 33, 96), mx.float16) * 2.0
    for kv in (keys, values):
        assert kv.perm is not None and kv.scale is not None
        args = (x, kv.quantizer, kv.mean, kv.perm, kv.scale)
        assert K.encode_unsupported(*args) is None
        assert_codes_equal(K.encode(*args, metal_kernel=Emu(schedule)), K.encode_reference(*args), kv.quantizer)


# Norm correction (correct_norms): the norm each kernel stores is |x| / |c[idx]|, as the reference's, on the WHT
# path (MSE and QJL keys, float16 and both log codes' norms) and on encode_dense (channel groups, other head dims).
CORRECTED_CASES = [(128, 2, False, mx.float16, "tq_encode"), (64, 4, False, mx.uint8, "tq_encode"),
                   (64, 4, False, mx.int8, "tq_encode"),
                   (128, 3, True, mx.float16, "tq_encode"), (128, 2.5, False, mx.uint8, "tq_encode_dense"),
                   (128, 2.5, False, mx.int8, "tq_encode_dense"),
                   (96, 3, False, mx.float16, "tq_encode_dense"), (80, 2, False, mx.float16, "tq_encode_dense")]


@pytest.mark.emulator
@pytest.mark.parametrize("dim,bits,qjl,norms,kernel", CORRECTED_CASES, ids=ids)
def test_encode_with_corrected_norms_matches_reference(emulator, dim, bits, qjl, norms, kernel):
    from tq_mlx.stream.codec import make_quantizer

    rng = np.random.default_rng(dim + int(4 * bits))
    q = make_quantizer(dim, bits, qjl, 3, norms, correct_norms=True)
    plain = make_quantizer(dim, bits, qjl, 3, norms)
    x = normal(rng, (1, 2, 33, dim), mx.float32) * 2.0
    mean = normal(rng, (1, 2, dim)) * 0.5
    perm = mx.array(np.stack([rng.permutation(dim) for _ in range(2)]).astype(np.int32)) if bits % 1 else None
    f = Emu()
    got = K.encode(x, q, mean, perm, metal_kernel=f)
    assert [launch.name for launch in f.launches] == [kernel]
    want = K.encode_reference(x, q, mean, perm)
    assert_codes_equal(got, want, q)
    # the correction changed the norms (upwards on average: Lloyd-Max codes are shorter than the unit vector), not
    # the codes
    base = K.encode_reference(x, plain, mean, perm)
    assert np.array_equal(np.asarray(base.codes), np.asarray(want.codes))
    from tq_mlx.quant.quantizer import load_norms

    ratio = np.asarray(load_norms(want.norms)) / np.asarray(load_norms(base.norms))
    assert ratio.mean() > 1.002 and (ratio != 1).mean() > 0.3, ratio.mean()


# ====================================================================== 2b. recode (temporal decay)
# (dim, fresh bits, decayed bits, fresh norms, decayed norms, corrected): whole widths K4 -> K3 and the widened
# K6 -> K5 (float16 norms to the log code), half steps K4.5 -> K3.5 and K5.5 -> K4.5 (two groups), V4 -> V2,
# head dims 64, 96 (a dense rotation), 128
RECODE_CASES = [(128, 4, 3, mx.int8, mx.int8, False), (64, 6, 5, mx.float16, mx.uint8, False),
                (128, 4.5, 3.5, mx.uint8, mx.uint8, False), (64, 5.5, 4.5, mx.int8, mx.int8, True),
                (64, 6, 5, mx.float16, mx.int8, True),
                (96, 4, 2, mx.float16, mx.float16, True), (128, 3, 1, mx.float16, mx.float16, False)]


@pytest.mark.emulator
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dim,bits,to_bits,norms,to_norms,corrected", RECODE_CASES, ids=ids)
def test_recode_matches_reference_and_decode_then_encode(emulator, schedule, dim, bits, to_bits, norms, to_norms,
                                                         corrected):
    from tq_mlx.quant.quantizer import load_norms

    rng = np.random.default_rng(dim + int(4 * bits))
    q = TurboQuantMSE(dim, bits, seed=5, norm_dtype=norms, correct_norms=corrected)
    to = TurboQuantMSE(dim, to_bits, seed=5, norm_dtype=to_norms, correct_norms=corrected)
    codes = q.quantize(normal(rng, (2, 2, 37, dim), mx.float32) * 1.5)
    f = Emu(schedule)
    got = K.recode(codes, q, to, metal_kernel=f)
    assert [launch.name for launch in f.launches] == ["tq_recode"]
    want = K.recode_reference(codes, q, to)
    assert_codes_equal(got, want, to)
    # the reference is the decoded vector coded again, without its two rotations
    again = to.quantize(q.dequantize(codes))
    assert_codes_equal(want, again, to)
    assert np.allclose(np.asarray(load_norms(want.norms)), np.asarray(load_norms(again.norms)), rtol=2e-3)


def test_recode_refuses_another_basis():
    q = TurboQuantMSE(64, 4, seed=5)
    codes = q.quantize(mx.ones((1, 64)))
    for to in (TurboQuantMSE(64, 3, seed=6), TurboQuantMSE(64, 3.5, seed=5)):
        assert "another rotated basis" in K.recode_unsupported(codes, q, to)
        with pytest.raises(ValueError, match="same groups and rotations"):
            q.recode(codes, to)


# ================================================================== 3. dequantize
DEQUANT_CASES = covering(mx.float16)  # "dequantize to float16 for long prefill chunks"


@pytest.mark.emulator
@pytest.mark.parametrize("dim,bits,qjl,dtype", DEQUANT_CASES, ids=ids)
def test_dequantize_matches_reference(emulator, dim, bits, qjl, dtype):
    h = handle(np.random.default_rng(dim + bits), quantizer(dim, bits, qjl), B=2, n=9, n_sinks=0, n_window=0,
               mean=bits % 2 == 0)
    got = K.dequantize(h, dtype, metal_kernel=Emu())
    assert got.dtype == dtype
    assert_close(got, K.dequantize_reference(h, dtype), dtype)


@pytest.mark.emulator
@pytest.mark.parametrize("qjl", [False, True])
def test_dequantize_tiny_inputs_in_constant_memory(emulator, qjl):
    # One token of one head at 1 bit (2 with QJL), d=32: its code word, norm and γ are single elements, which
    # MLX passes in the constant address space (fewer than 8 elements).
    h = handle(np.random.default_rng(2), quantizer(32, 2 if qjl else 1, qjl), B=1, H=1, n=1, n_sinks=0, n_window=0)
    f = Emu()
    assert_close(K.dequantize(h, mx.float32, metal_kernel=f), K.dequantize_reference(h, mx.float32), mx.float32)
    assert "const constant uint32_t* codes" in f.launches[0].stats.source


@pytest.mark.emulator
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_dequantize_schedules(emulator, schedule):
    h = handle(np.random.default_rng(9), quantizer(128, 4, qjl=True), n=21, n_sinks=0, n_window=0)
    assert_close(K.dequantize(h, mx.float16, metal_kernel=Emu(schedule)), K.dequantize_reference(h, mx.float16),
                 mx.float16)


# ============================================================ 4. decode attention
# (R query heads per kv head, L query tokens, mask) cycle through (dim, bits) so each shape meets every dim and
# bit width; the three dtypes of one (dim, bits) share the shape, hence pass 1's compiled variant.
SHAPES = [(2, 1, None), (1, 3, "causal"), (4, 2, "causal"), (1, 1, None), (3, 8, "causal")]
DECODE_CASES = [(d, b, False, t) for d in DIMS for b in BITS for t in DTYPES] + [
    (d, b, True, t) for d in DIMS for b in QJL_BITS for t in DTYPES
]


@pytest.mark.emulator
@pytest.mark.parametrize("dim,bits,qjl,dtype", DECODE_CASES, ids=ids)
def test_decode_attention_matches_reference(emulator, dim, bits, qjl, dtype):
    i = DIMS.index(dim) + BITS.index(bits) + 2 * qjl
    R, L, mask = SHAPES[i % len(SHAPES)]
    got, want, *_ = run_decode(np.random.default_rng(i), dim, bits, bits, qjl, dtype, R, L, mask, Emu(),
                               split_tokens=32)  # 70 tokens: 3 splits, the last one partial
    assert got.dtype == dtype and got.shape == (1, 2 * R, L, dim)
    assert_close(got, want, dtype)


@pytest.mark.emulator
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(
    "dk,dv,kb,vb,qjl,dtype,R,L,mask",
    [
        (128, 128, 4, 4, False, mx.float16, 4, 1, None),  # GQA decode, Llama-like
        (64, 64, 3, 2, True, mx.bfloat16, 2, 3, "causal"),  # QJL keys, speculative verify
        (256, 256, 8, 8, False, mx.float32, 4, 8, "causal"),  # 32 rows > 16 per threadgroup: row chunks
        (128, 64, 8, 3, False, mx.float16, 2, 2, "causal"),  # head dims differ, K8/V3
        (64, 64, 5, 6, False, mx.float16, 2, 3, "causal"),  # 5- and 6-bit planes (4+1, 4+2)
        (128, 128, 6, 5, False, mx.bfloat16, 8, 8, "causal"),  # 64 rows, 8 per SIMD group, at 6/5 bits
        (80, 80, 6, 5, False, mx.float32, 3, 1, None),  # no WHT: host-rotated queries and outputs
    ],
    ids=ids,
)
def test_decode_attention_schedules(emulator, schedule, dk, dv, kb, vb, qjl, dtype, R, L, mask):
    got, want, *_ = run_decode(np.random.default_rng(3), dk, kb, vb, qjl, dtype, R, L, mask, Emu(schedule, seed=11),
                               dv=dv, B=2, split_tokens=32)
    assert_close(got, want, dtype, schedule)


@pytest.mark.emulator
@pytest.mark.parametrize("n_window", [0, 2])
def test_decode_causal_mask_reaches_compressed_tokens(emulator, n_window):
    # With fewer window tokens than query tokens, the causal mask cuts into the compressed tokens.
    got, want, *_ = run_decode(np.random.default_rng(4), 64, 4, 4, False, mx.float32, 2, 6, "causal", Emu(),
                               n_sinks=0, n=40, n_window=n_window, split_tokens=32)
    assert_close(got, want, mx.float32)


@pytest.mark.emulator
@pytest.mark.parametrize("n", [1, 33])
def test_decode_few_tokens_without_centering(emulator, n):
    got, want, *_ = run_decode(np.random.default_rng(n), 64, 2, 3, True, mx.float16, 2, 2, "causal", Emu(),
                               n=n, n_sinks=1, n_window=0, mean=False, split_tokens=32)
    assert_close(got, want, mx.float16)


@pytest.mark.emulator
def test_decode_default_split_and_no_float_tokens(emulator):
    f = Emu()
    got, want, *_ = run_decode(np.random.default_rng(5), 128, 2, 4, False, mx.float16, 1, 1, None, f,
                               n_sinks=0, n=300, n_window=0)
    assert_close(got, want, mx.float16)
    (st,) = f.stats("tq_decode_partial")
    assert st.grid[0] // st.threadgroup[0] == 2  # 300 tokens -> 2 splits of 256 (the default's minimum)


@pytest.mark.emulator
def test_sparse_v_skips_negligible_weights(emulator):
    # A large scale makes most softmax weights < ε/64 of the max: their values are neither read nor added.
    f = Emu()
    got, want, _, values = run_decode(np.random.default_rng(6), 64, 4, 4, False, mx.float32, 2, 1, None, f,
                                      n=200, scale=4.0, split_tokens=64)
    assert_close(got, want, mx.float32)
    (st,) = f.stats("tq_decode_partial")
    vc = st.buffers["vc"]
    assert vc.total_bytes_read < 0.5 * vc.nbytes, "sparse V should skip most value words"
    assert st.buffers["kc"].total_bytes_read == st.buffers["kc"].nbytes
    # Threshold 0 keeps every token: all value words are read.
    f0 = Emu()
    got0, *_ = run_decode(np.random.default_rng(6), 64, 4, 4, False, mx.float32, 2, 1, None, f0,
                          n=200, scale=4.0, split_tokens=64, sparse_epsilon=-1.0)
    assert f0.stats("tq_decode_partial")[0].buffers["vc"].total_bytes_read == vc.nbytes
    assert_close(got0, want, mx.float32)


def adversarial_sparse_v(n, per, weight, anchor_value, D=32, R=8, L=4, A=30.0):
    """Keys and values of n tokens built so every split of `per` tokens opens with one anchor (score A) and
    holds per - 1 tokens of relative weight just below `weight`: the most a skip rule lets through per split.
    All keys share one code word (score = its float16 norm: the query is scaled so), all values one code word
    (the anchors' values scaled by anchor_value). Returns q, keys, values, scale, the low tokens' actual
    weight, the exact output (float64) and the largest value norm."""
    rng = np.random.default_rng(0)
    kq, vq = quantizer(D, 4, seed=2), quantizer(D, 3, seed=3)
    kc, vc = (K.encode_reference(normal(rng, (1, 1, 1, D)), q, None) for q in (kq, vq))
    khat = np.asarray(K.dequantize_reference(StreamView(kq, kc._replace(norms=mx.ones_like(kc.norms)), None, None,
                                                        None, None), mx.float32)).reshape(D).astype(np.float64)
    low = np.float16(A + math.log(weight))
    if float(low) > A + math.log(weight):  # round down: the weight must stay below `weight`
        low = np.nextafter(low, np.float16(-np.inf))
    knorm = np.full(n, low, np.float16)
    knorm[::per] = A
    vnorm = np.full(n, np.asarray(vc.norms.astype(mx.float32)).item(), np.float16)
    vnorm[::per] *= anchor_value
    many = lambda c, norms: c._replace(codes=mx.broadcast_to(c.codes, (1, 1, n, c.codes.shape[-1])),  # noqa: E731
                                       norms=mx.array(norms).reshape(1, 1, n, 1))
    keys = StreamView(kq, many(kc, knorm), None, None, None, None)
    values = StreamView(vq, many(vc, vnorm), None, None, None, None)
    scale = 1.0 / math.sqrt(D)
    qv = khat / (khat @ khat) / scale  # scale·q·k_t = |k_t|
    q = mx.array(np.broadcast_to(qv, (1, R, L, D)).astype(np.float32))
    p = np.exp((scale * qv @ khat) * (knorm.astype(np.float64) - A))
    V = np.asarray(K.dequantize_reference(values, mx.float32)).reshape(n, D).astype(np.float64)
    exact = (p @ V) / p.sum()
    return q, keys, values, scale, float(np.exp(float(low) - A)), exact, np.linalg.norm(V, axis=-1).max()


@pytest.mark.emulator
@pytest.mark.parametrize("per", [20000, 2720], ids=["one-split", "2720-token-splits"])
def test_sparse_v_departure_is_bounded_at_20k_tokens(emulator, per):
    # GQA 8 x 4 query rows at 20k tokens. Low tokens just under ε/n each drop (n - 1)·0.95ε/n of the split's
    # mass, the most the rule allows: the departure is close to, and below, ε · max |v| (SPARSE_V_EPSILON).
    n, eps = 20000, K.SPARSE_V_EPSILON

    def departure(weight, anchor_value, sparse_epsilon, f=None):
        q, keys, values, scale, w, exact, vmax = adversarial_sparse_v(n, per, weight, anchor_value)
        got = K.decode_attention(q, keys, values, scale, None, split_tokens=per, sparse_epsilon=sparse_epsilon,
                                 metal_kernel=f or Emu())
        g = np.asarray(got, np.float64).reshape(-1, q.shape[-1])
        return np.linalg.norm(g - exact, axis=-1).max() / vmax, w

    # Anchors hold a zero value, so the output is the low tokens' share alone: skipping them all is the worst.
    f = Emu()
    dep, w = departure(0.95 * eps / per, 0.0, eps, f)
    assert 0.9 * eps / per < w < eps / per
    vc = f.stats("tq_decode_partial")[0].buffers["vc"]
    assert vc.total_bytes_read < 0.01 * vc.nbytes, "the low tokens' values should be skipped"
    assert 0.8 * eps < dep <= eps * (1 + 1e-3), dep
    assert dep < 1e-4
    # The earlier rule (a fixed 1e-6 of the running max) drops up to n·1e-6 on the same pattern.
    old, _ = departure(0.95e-6, 0.0, 1e-6 * per)
    assert old > 1e-3, old
    # Every token kept (ε < 0): float32 accumulation of many tiny weights into a large sum (every value
    # equal) stays within the same 1e-4 (summed one token at a time it was off by 4e-4).
    f = Emu()
    dep, _ = departure(0.95e-6, 1.0, -1.0, f)
    assert f.stats("tq_decode_partial")[0].buffers["vc"].total_bytes_read == vc.nbytes
    assert dep < 1e-4, dep


@pytest.mark.emulator
@pytest.mark.parametrize("dim,bits", [(32, 3), (512, 4), (512, 8)])
def test_head_dims_32_and_512(emulator, dim, bits):
    rng = np.random.default_rng(dim)
    q = quantizer(dim, bits)
    x = normal(rng, (1, 2, 3, dim), mx.bfloat16)
    assert_codes_equal(K.encode(x, q, None, metal_kernel=Emu()), K.encode_reference(x, q, None), q)
    h = handle(rng, q, n=5, n_sinks=0, n_window=0)
    assert_close(K.dequantize(h, mx.float16, metal_kernel=Emu()), K.dequantize_reference(h, mx.float16), mx.float16)
    got, want, *_ = run_decode(rng, dim, bits, bits, False, mx.float16, 4, 2, "causal", Emu(), n=40, split_tokens=32)
    assert_close(got, want, mx.float16)


# ================================================================= 6. trellis codes
# Each side's codes as trellis codes (config.trellis) or Lloyd-Max codes: every trellis width (2..6 bits, and the
# groups of 2.5 and 3.5) on keys and values, head dims with and without a WHT. The codebooks stay in device memory.
TRELLIS_CASES = [  # (dim, key bits, value bits, keys trellis, values trellis, dtype, R, L, mask)
    (128, 3, 4, True, True, mx.float16, 2, 1, None),
    (64, 4, 2, True, False, mx.float32, 1, 3, "causal"),
    (64, 2, 6, False, True, mx.bfloat16, 4, 2, "causal"),
    (64, 2.5, 3.5, True, True, mx.float32, 2, 3, "causal"),
    (80, 6, 5, True, True, mx.float16, 3, 1, None),
    (128, 5, 2, True, True, mx.float32, 8, 8, "causal"),
]


def trellis_views(rng, dim, kb, vb, kt, vt, B=1):
    keys = handle(rng, TurboQuantMSE(dim, kb, seed=2, trellis=kt), B=B)
    return keys, handle(rng, TurboQuantMSE(dim, vb, seed=3, trellis=vt), B=B)


@pytest.mark.emulator
@pytest.mark.parametrize("dim,kb,vb,kt,vt,dtype,R,L,mask", TRELLIS_CASES, ids=ids)
def test_attention_on_trellis_codes_matches_reference(emulator, dim, kb, vb, kt, vt, dtype, R, L, mask):
    rng = np.random.default_rng(int(10 * kb + vb))
    keys, values = trellis_views(rng, dim, kb, vb, kt, vt)
    assert keys.quantizer.groups[0].trellis is kt and values.quantizer.groups[-1].trellis is vt
    q = normal(rng, (1, 2 * R, L, dim), dtype)
    want = K.decode_attention_reference(q, keys, values, 0.1, mask)
    assert K.decode_unsupported(q, keys, values, mask) is None
    f = Emu()
    assert_close(K.decode_attention(q, keys, values, 0.1, mask, metal_kernel=f, split_tokens=32), want, dtype)
    assert_close(K.prefill_attention(q, keys, values, 0.1, mask, metal_kernel=f), want, dtype)
    # the key codes are read once per kv head and chunk of query rows (the window rolls along them, never re-reads)
    (launch,) = [la for la in f.launches if la.name == "tq_decode_partial"]
    chunks = -(-R * L // dict(launch.call["template"])["NR"])
    assert launch.stats.buffers["kc"].total_bytes_read == chunks * np.asarray(keys.codes.codes).nbytes


@pytest.mark.emulator
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6])
def test_dequantize_trellis_codes_matches_reference(emulator, bits):
    h = handle(np.random.default_rng(bits), TurboQuantMSE(128, bits, seed=4, trellis=True), B=2, n=9, n_sinks=0,
               n_window=0, mean=bits % 2 == 0)
    schedules = SCHEDULES if bits == 3 else ("forward",)
    for schedule in schedules:
        assert_close(K.dequantize(h, mx.float16, metal_kernel=Emu(schedule)), K.dequantize_reference(h, mx.float16),
                     mx.float16, schedule)


@pytest.mark.emulator
@pytest.mark.parametrize("bug", [
    ("win = TRL ? (((win << B) | code) & WM) : code;", "win = code;"),  # scores: no window
    ("      if (j >= uint(t)) {", "      if (j > uint(t)) {"),  # values: one older symbol dropped
    ("((win << B0) | tq_code<B0, D0>(w, j))", "(win << B0)"),  # values: the window rolled without its new code
], ids=["scores", "values", "values-rolled"])
def test_a_planted_trellis_window_bug_is_detected(emulator, monkeypatch, bug):
    planted(monkeypatch, "common", *bug)
    rng = np.random.default_rng(5)
    keys, values = trellis_views(rng, 64, 3, 3, True, True)
    q = normal(rng, (1, 4, 1, 64))
    got = K.decode_attention(q, keys, values, 0.1, None, metal_kernel=Emu(), split_tokens=32)
    assert np.abs(np.asarray(got) - np.asarray(K.decode_attention_reference(q, keys, values, 0.1, None))).max() > 1e-3


@pytest.mark.emulator
@pytest.mark.parametrize("bits,dim", [(2, 64), (3, 128), (4, 80), (5, 64), (6, 32)], ids=ids)
def test_viterbi_matches_reference(emulator, monkeypatch, bits, dim):
    # The same symbols as the reference's search (ties alike); a scratch bound of a few vectors splits the launch
    book = mx.array(trellis.standard_book(bits) / math.sqrt(dim))
    y = normal(np.random.default_rng(bits), (2, 5, dim)) / math.sqrt(dim)
    monkeypatch.setattr("tq_mlx.attention.codes.VITERBI_SCRATCH", 4 * dim << (trellis.window_bits(bits) - bits))
    f = Emu()
    got = K.viterbi(y, book, bits, metal_kernel=f)
    assert got.dtype == mx.uint32 and got.shape == y.shape
    np.testing.assert_array_equal(np.asarray(got), np.asarray(K.viterbi_reference(y, book, bits)))
    assert len(f.launches) == 3  # 10 vectors, 4 a launch


@pytest.mark.emulator
@pytest.mark.parametrize("dim,bits,to_bits", [(128, 4, 3), (64, 3.5, 2.5), (80, 6, 5)], ids=ids)
def test_encode_and_recode_trellis_codes_match_reference(emulator, dim, bits, to_bits):
    # the steps around the search are the reference's, so the codes and norms are equal, not merely close
    rng = np.random.default_rng(dim)
    q = TurboQuantMSE(dim, bits, seed=5, trellis=True, correct_norms=True)
    to = TurboQuantMSE(dim, to_bits, seed=5, trellis=True)
    x, mean = normal(rng, (2, 2, 7, dim)) * 2.0, normal(rng, (2, 2, dim))
    f = Emu()
    got = K.encode(x, q, mean, metal_kernel=f)
    want = K.encode_reference(x, q, mean)
    for a, b in ((got, want), (K.recode(got, q, to, metal_kernel=f), K.recode_reference(want, q, to))):
        np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(b.codes))
        np.testing.assert_array_equal(np.asarray(a.norms), np.asarray(b.norms))
    assert {la.name for la in f.launches} == {"tq_viterbi"}


@pytest.mark.emulator
def test_a_planted_viterbi_traceback_bug_is_detected(emulator, monkeypatch):
    planted(monkeypatch, "viterbi", "* uint(U) + (state >> B);", "* uint(U) + (state >> 1);")
    book = mx.array(trellis.standard_book(3) / 8.0)
    y = normal(np.random.default_rng(0), (4, 64)) / 8.0
    got = K.viterbi(y, book, 3, metal_kernel=Emu())
    assert (np.asarray(got) != np.asarray(K.viterbi_reference(y, book, 3))).any()
