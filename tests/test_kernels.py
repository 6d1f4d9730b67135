"""The Metal kernels (tq_mlx.kernels) against their pure-MLX reference twins, under the CPU MSL emulator.

Nothing here runs on a GPU: the emulator compiles the exact source MLX would build and runs every Metal
thread as a fiber (tests/emulator). Matrix:
* forward schedule: decode attention and the rotation on every supported head_dim (64, 128, 256; the rotation
  also 32 and 512) x bits (1, 2, 3, 4, 5, 6, 8; QJL keys 2, 3, 4) x dtype (float16, bfloat16, float32); encode and
  dequantize on every head_dim x bits in the dtype the cache uses, and every (head_dim, dtype) and (bits, dtype)
  pair (`covering`: their dtype only changes one load or store); head_dim 32 and 512 smoke tests;
* decode on real TurboQuantKVCache views (μ, ν, scale, channel order, strided capacity buffers), in all three
  schedules: every key/value bit pair the kernels take (the default K4/V4 first; 81 pairs of 1, 2, 2.5, 3, 3.5,
  4, 5, 6, 8 bits and 27 with QJL keys; decode reads each key code byte once) at head_dim 64 with batch 1 and 2, 1..8 query tokens, GQA 1..8 and all three
  dtypes; K4/V3, K4+qjl/V3 and K3.5/V2.5 at head dims 32, 64, 80, 96, 128, 192, 256, 512 with batch 2; the
  pairs with QJL at 1 bit and head dims above 512 must be refused by decode_unsupported with their reason and
  fall back to the reference; key/value head dims that differ (MLA's 192/128);
* 5- and 6-bit codes (bit planes 4+1 and 4+2) at head dims 80, 96 and 128; decode reads exactly the code bytes
  held; the dispatchers self-check them and take the kernels;
* encode_dense (channel groups, a per-head channel order, head dims 80, 96, 192) against the reference codes;
* all three lane schedules (forward, reverse, random) on a representative subset (GQA decode, QJL decode
  with a causal mask, many query rows split into chunks, encode and dequantize with QJL; on the cache with
  batch 2: K4/V3, K4+qjl/V3, K8/V2 with 8 query tokens, K1/V8 with 64 query rows);
* learned sinks and bool/additive array masks ((L, T), (B, 1, L, T), (B, Hq, L, T)) in all three schedules;
  multi-head latent attention's decode (keys = values = one latent view, R = 16..128 query heads, head dim 512
  and 32, additive rope scores): the kernel path, codes read once for keys and values; at 8 bits against
  mlx-lm's float attention and mx.fast SDPA(sinks=) through dispatch_attention; planted sink/mask bugs the
  self-check must catch; masks the kernels cannot read fall back;
* sparse V's bound (SPARSE_V_EPSILON) on an adversarial 20k-token pattern against a float64 exact result;
* planted bugs (a missing barrier, a shuffle to a wrong lane, a dropped packing shuffle) that must fail;
* byte counts: decode attention reads each compressed byte once per kv head and step, writes no float copy;
* the self-check/disable logic, the backend setting and environment variable, MLX's own source generator.
Cost is dominated by compiling ~250 kernel variants (about 0.4 s of CPU each, cached in ~/.cache/tq-mlx): 1.8
CPU-minutes cold (80 s wall on a 2-core machine at load 2), 30 CPU-seconds warm (28 s wall there); the bit-pair,
head_dim, schedule and sparse-V bound tests above take 24 s of that cold, 10 s warm. The 5- and 6-bit cases
(131 tests) bring the file to 46 CPU-seconds warm (92 s wall on that machine at load 10).
"""

from __future__ import annotations

import math
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import mlx.core as mx

from tests.emulator import metal_kernel as emulator_kernel
from tests.emulator import require_emulator
from tq_mlx import kernels as K
from tq_mlx import StreamView, TurboQuantConfig, TurboQuantKVCache
from tq_mlx.attention import keys_are_values
from tq_mlx.stream import encode as stream_encode
from tq_mlx.packing import packed_words, unpack
from tq_mlx.quantizer import MSE_BITS, PROD_BITS, TurboQuantMSE, TurboQuantProd, load_norms
from tq_mlx.rotation import Rotation

ROOT = Path(__file__).resolve().parent.parent
DIMS = (64, 128, 256)
BITS = (1, 2, 3, 4, 5, 6, 8)  # quantizer.CODE_BITS: the config takes all but 5 and 6 (yet)
QJL_BITS = (2, 3, 4)
DTYPES = (mx.float16, mx.bfloat16, mx.float32)
SCHEDULES = ("forward", "reverse", "random")
TOL = {mx.float32: 1e-4, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}  # atol = rtol: output rounding


@pytest.fixture(scope="module")
def emulator():
    return require_emulator()


@pytest.fixture(autouse=True)
def _clean_dispatch(monkeypatch):
    monkeypatch.delenv(K.ENV_VAR, raising=False)
    K.set_backend(None)
    K.set_kernel_factory(None)
    K.reset_self_checks()
    yield
    K.set_backend(None)
    K.set_kernel_factory(None)
    K.reset_self_checks()


@dataclass
class Launch:
    name: str
    make: dict  # metal_kernel(...) keywords
    call: dict  # kernel(...) keywords
    stats: object  # tests.emulator.LaunchStats


class Emu:
    """A `metal_kernel` factory on the emulator: applies a lane schedule and records every launch."""

    def __init__(self, schedule: str = "forward", seed: int = 0):
        self.schedule, self.seed = schedule, seed
        self.launches: list[Launch] = []

    def __call__(self, **make):
        kernel = emulator_kernel(**make)
        factory = self

        class Launcher:
            def __call__(self, **call):
                out = kernel(**call, schedule=factory.schedule, seed=factory.seed)
                factory.launches.append(Launch(make["name"], make, call, kernel.last_stats))
                return out

        return Launcher()

    def stats(self, name: str):
        return [launch.stats for launch in self.launches if launch.name == name]


def ids(x) -> str:
    return str(x).replace("mlx.core.", "")


def normal(rng, shape, dtype=mx.float32) -> mx.array:
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def quantizer(dim: int, bits: int, qjl: bool = False, seed: int = 1):
    return TurboQuantProd(dim, bits, seed=seed) if qjl else TurboQuantMSE(dim, bits, seed=seed)


def handle(rng, q, B=1, H=2, n_sinks=3, n=70, n_window=5, mean=True) -> StreamView:
    """A StreamView like TurboQuantKVCache returns: float16 sinks/window, codes of x - mean."""
    D = q.dim
    mu = normal(rng, (B, H, D)) * 0.3 if mean else None
    codes = K.encode_reference(normal(rng, (B, H, n, D)), q, mu)
    f16 = lambda k: normal(rng, (B, H, k, D), mx.float16) if k else None  # noqa: E731
    return StreamView(q, codes, f16(n_sinks), f16(n_window), mu, None)


def assert_close(got, want, dtype, what=""):
    g = np.asarray(got.astype(mx.float32))
    w = np.asarray(want.astype(mx.float32))
    assert g.shape == w.shape, what
    assert np.isfinite(g).all(), f"{what}: non-finite output"
    np.testing.assert_allclose(g, w, atol=TOL[dtype], rtol=TOL[dtype], err_msg=what)


def assert_codes_equal(got, want, q, what=""):
    """Codes match (a value within rounding of a boundary may flip: at most 0.2%); norms and γ close."""
    prod = isinstance(q, TurboQuantProd)
    groups = (q.mse if prod else q).groups
    gi, wi = (np.concatenate([np.asarray(unpack(c.codes[..., g.words], g.bits, g.dim)) for g in groups], axis=-1)
              for c in (got, want))
    assert (gi != wi).mean() <= 0.002, f"{what}: {(gi != wi).mean():.2%} codes differ"
    np.testing.assert_allclose(np.asarray(load_norms(got.norms)), np.asarray(load_norms(want.norms)),
                               rtol=1e-3 if got.norms.dtype != mx.uint8 else 0.05, err_msg=what)
    if prod:
        gz, wz = (np.asarray(unpack(c.qjl, 1, q.dim)) for c in (got, want))
        assert (gz != wz).mean() <= 0.005, f"{what}: {(gz != wz).mean():.2%} QJL bits differ"
        ok = (gi == wi).all(axis=-1)  # γ depends on the codes: compare rows whose codes agree
        np.testing.assert_allclose(np.asarray(load_norms(got.gamma))[ok], np.asarray(load_norms(want.gamma))[ok],
                                   rtol=2e-3 if got.gamma.dtype != mx.uint8 else 0.05, atol=1e-4, err_msg=what)


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


def run_decode(rng, dk, kb, vb, qjl, dtype, R, L, mask, factory, dv=None, B=1, H=2, n_sinks=3, n=70, n_window=5,
               scale=None, mean=True, **kw):
    keys = handle(rng, quantizer(dk, kb, qjl, seed=2), B, H, n_sinks, n, n_window, mean)
    values = handle(rng, quantizer(dv or dk, vb, seed=3), B, H, n_sinks, n, n_window, mean)
    q = normal(rng, (B, H * R, L, dk), dtype)
    scale = scale or 1.0 / math.sqrt(dk)
    got = K.decode_attention(q, keys, values, scale, mask, metal_kernel=factory, **kw)
    want = K.decode_attention_reference(q, keys, values, scale, mask)
    return got, want, keys, values


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


# ---------------------------------------------------------------- on the real cache
def cache_handles(config, n_prompt, dim=64, B=1, H=2, seed=0):
    rng = np.random.default_rng(seed)
    cache = TurboQuantKVCache(config)
    keys = normal(rng, (B, H, n_prompt, dim)) + 0.7  # a key mean the cache removes
    cache.update_and_fetch(keys, normal(rng, (B, H, n_prompt, dim)))
    return cache, rng


def numpy_views(kv: StreamView) -> StreamView:
    """The handle with its cache views as strided numpy arrays, so the emulator sees MLX's real strides
    (ensure_row_contiguous=False) instead of contiguous copies."""
    # bfloat16 has no numpy buffer format: those float tokens stay mx arrays.
    view = lambda a: a if a is None or a.dtype == mx.bfloat16 else np.asarray(a)  # noqa: E731
    return kv._replace(codes=type(kv.codes)(*(view(a) for a in kv.codes)), sinks=view(kv.sinks),
                       window=view(kv.window))


@pytest.mark.emulator
@pytest.mark.parametrize("qjl", [False, True])
def test_decode_on_cache_handles_strided(emulator, qjl):
    config = TurboQuantConfig(key_bits=3, value_bits=2, qjl=qjl, window=16, sinks=4, compress_block=8, step=64)
    cache, rng = cache_handles(config, 70)
    for L in (1, 4):
        keys, values = cache.update_and_fetch(normal(rng, (1, 2, L, 64)), normal(rng, (1, 2, L, 64)))
        q = normal(rng, (1, 4, L, 64), mx.float16)
        mask = "causal" if L > 1 else None
        f = Emu()
        got = K.decode_attention(q, numpy_views(keys), numpy_views(values), 0.125, mask, split_tokens=32,
                                 metal_kernel=f)
        assert_close(got, K.decode_attention_reference(q, keys, values, 0.125, mask), mx.float16)
        (st,) = f.stats("tq_decode_partial")
        n, W = keys.codes.codes.shape[2:]
        assert np.asarray(keys.codes.codes).strides[2] == W * 4 and not np.asarray(keys.codes.codes).flags.c_contiguous
        # Only the live tokens of the capacity buffers are read, each word once.
        assert st.buffers["kc"].unique_bytes_read == st.buffers["kc"].total_bytes_read == 1 * 2 * n * W * 4


# ------------------------------------------ every bit pair, head_dim, batch and schedule, on real caches
# The config accepts key/value bits in MSE_BITS (QJL keys: PROD_BITS); the kernels take all of them (2.5 and
# 3.5 as two code groups) except QJL at 1 bit (no MSE stage), which decode_unsupported must refuse with its
# reason, so dispatch_attention takes the reference path.
KERNEL_KEY_BITS = {False: MSE_BITS, True: (2, 3, 4)}
KERNEL_VALUE_BITS = MSE_BITS
DEFAULT_PAIR = (4, 4, False)  # TurboQuantConfig's default K4/V4 (its decayed K3/V2 is among the others)
ALL_PAIRS = [(kb, vb, qjl) for qjl, kbits in ((False, MSE_BITS), (True, PROD_BITS)) for kb in kbits for vb in MSE_BITS]
KERNEL_PAIRS = [DEFAULT_PAIR] + [
    (kb, vb, qjl) for kb, vb, qjl in ALL_PAIRS
    if kb in KERNEL_KEY_BITS[qjl] and vb in KERNEL_VALUE_BITS and (kb, vb, qjl) != DEFAULT_PAIR
]
REFERENCE_PAIRS = [p for p in ALL_PAIRS if p not in KERNEL_PAIRS]
# (B, R, L, model dtype) cycled through the pairs: batch 1 and 2, 1..8 query tokens, GQA 1..8, every dtype.
PAIR_SHAPES = [(1, 4, 1, mx.float16), (2, 2, 3, mx.bfloat16), (1, 1, 1, mx.float32), (2, 8, 2, mx.float16),
               (1, 3, 4, mx.bfloat16), (2, 1, 8, mx.float32), (1, 2, 1, mx.float16)]


def bits_id(p) -> str:
    kb, vb, qjl = p
    return f"K{kb}{'+qjl' if qjl else ''}/V{vb}"


def cache_step(kb, vb, qjl, dim, B, R, L, dtype, H=2, n_prompt=70, seed=0, **config):
    """A decode step on a real TurboQuantKVCache (mean and scale from its calibration, strided views of its
    capacity buffers): queries and the views update_and_fetch returns after a prompt and L new tokens."""
    rng = np.random.default_rng(seed)
    cfg = dict(window=16, sinks=4, compress_block=8, step=64) | config
    cfg = TurboQuantConfig(key_bits=kb, value_bits=vb, qjl=qjl, **cfg)
    cache = TurboQuantKVCache(cfg)
    kv = lambda n, shift: ((normal(rng, (B, H, n, dim)) + shift) * 2.0).astype(dtype)  # noqa: E731
    cache.update_and_fetch(kv(n_prompt, 0.7), kv(n_prompt, -0.3))
    keys, values = cache.update_and_fetch(kv(L, 0.7), kv(L, -0.3))
    return normal(rng, (B, H * R, L, dim), dtype), keys, values


def check_cache_decode(kb, vb, qjl, dim, B, R, L, dtype, schedule="forward", strided=False, **config):
    q, keys, values = cache_step(kb, vb, qjl, dim, B, R, L, dtype, **config)
    assert keys.mean is not None and keys.scale is not None  # as in production
    assert (values.mean is not None) == config.get("center_values", TurboQuantConfig().center_values)
    assert keys.n_coded > 32  # two splits of 32, the second partial
    mask = "causal" if L > 1 else None
    assert K.decode_unsupported(q, keys, values, mask) is None
    f = Emu(schedule, seed=13)
    kv = (numpy_views(keys), numpy_views(values)) if strided else (keys, values)
    got = K.decode_attention(q, *kv, 1.0 / math.sqrt(dim), mask, split_tokens=32, metal_kernel=f)
    assert got.dtype == dtype and got.shape == (B, 2 * R, L, dim)
    assert_close(got, K.decode_attention_reference(q, keys, values, 1.0 / math.sqrt(dim), mask), dtype,
                 f"{bits_id((kb, vb, qjl))} d={dim} B={B} R={R} L={L} {schedule}")
    return f


@pytest.mark.slow
@pytest.mark.emulator
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("pair", KERNEL_PAIRS, ids=bits_id)
def test_decode_every_kernel_bit_pair_on_cache(emulator, pair, schedule):
    i = KERNEL_PAIRS.index(pair)
    B, R, L, dtype = PAIR_SHAPES[i % len(PAIR_SHAPES)]
    # values as the default leaves them (not centered), and centered (center_values=True) in every third pair
    f = check_cache_decode(*pair, 64, B, R, L, dtype, schedule, strided=i % 2 == 1, center_values=i % 3 == 0)
    (p1,) = f.stats("tq_decode_partial")
    for name in ("kc", "kn"):  # decode reads each byte of the key codes and norms it holds once
        if name in p1.buffers:
            assert p1.buffers[name].unique_bytes_read == p1.buffers[name].total_bytes_read, (pair, name)


def test_bit_pair_matrix_covers_the_config():
    assert KERNEL_PAIRS[0] == DEFAULT_PAIR
    n = len(MSE_BITS)  # 1, 2, 2.5, 3, 3.5, 4, 5, 6, 8
    assert n == 9 and len(KERNEL_PAIRS) == n * n + 3 * n and len(ALL_PAIRS) == n * n + 4 * n
    assert {p for p in ALL_PAIRS if p not in KERNEL_PAIRS} == {(1, vb, True) for vb in MSE_BITS}
    for kb, vb, qjl in ALL_PAIRS:
        TurboQuantConfig(key_bits=kb, value_bits=vb, qjl=qjl)  # every pair here is one the config accepts


@pytest.mark.parametrize("pair", REFERENCE_PAIRS, ids=bits_id)
def test_bit_pairs_without_a_kernel_say_why_and_fall_back(monkeypatch, pair):
    kb, vb, qjl = pair
    q, keys, values = cache_step(kb, vb, qjl, 64, 1, 2, 1, mx.float16, n_prompt=40)
    assert K.decode_unsupported(q, keys, values, None) == "QJL at 1 bit (no MSE stage)"
    assert_falls_back(monkeypatch, q, keys, values)


def assert_falls_back(monkeypatch, q, keys, values) -> None:
    """With the kernels forced on, dispatch gives the reference result and builds no kernel."""
    monkeypatch.setenv(K.ENV_VAR, "metal")
    never = Counting()
    K.set_kernel_factory(never)
    out = K.dispatch_attention(q, keys, values, 0.125, None)
    assert mx.array_equal(out, K.decode_attention_reference(q, keys, values, 0.125))
    assert never.made == 0


@pytest.mark.emulator
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("kb,vb,dim,R,L,dtype", [(5, 6, 128, 4, 1, mx.float16), (6, 5, 80, 2, 3, mx.bfloat16),
                                                 (6, 3.5, 96, 3, 2, mx.float32)], ids=ids)
def test_decode_5_and_6_bit_codes_on_cache_at_other_head_dims(emulator, schedule, kb, vb, dim, R, L, dtype):
    check_cache_decode(kb, vb, False, dim, 2, R, L, dtype, schedule, strided=schedule != "forward")


def test_5_and_6_bit_views_hold_every_code_of_their_width():
    # 5- and 6-bit caches (cache_step): every code of the width occurs, bits·d/32 words per token (the high plane
    # packs as tightly as the low one), and the tokens decode within the width's own error (0.0025 and 0.00063
    # of |x|², quantizer.py) of the 8-bit codes of the same tokens.
    q, keys, values = cache_step(5, 6, False, 64, 1, 2, 1, mx.float16, n_prompt=200)
    _, keys8, values8 = cache_step(8, 8, False, 64, 1, 2, 1, mx.float16, n_prompt=200)
    for kv, kv8, bits, err in ((keys, keys8, 5, 0.0025), (values, values8, 6, 0.00063)):
        assert kv.quantizer.bits == bits and kv.codes.codes.shape[-1] == packed_words(64, bits) == 2 * bits
        assert kv.codes.norms.dtype == (mx.uint8 if bits < 6 else mx.float16) and kv.n_coded > 150
        assert set(np.unique(np.asarray(unpack(kv.codes.codes, bits, 64))).tolist()) == set(range(1 << bits))
        x, x8 = (np.asarray(v.quantizer.dequantize(v.codes)) for v in (kv, kv8))
        rel = ((x - x8) ** 2).sum(-1) / (x8**2).sum(-1)
        assert rel.mean() < 1.3 * err + 2e-4, (bits, rel.mean())  # + the uint8 norms' 1.6e-4
    assert K.decode_unsupported(q, keys, values) is None and K.prefill_unsupported(q, keys, values) is None


# (B, R, L, dtype) per head_dim: 512 keeps R·L small (threadgroup memory), 32 takes the most rows. Besides the
# powers of two (the in-kernel WHT), the non-power-of-two head dims of mlx-lm's common models: 80 (phi-2,
# stablelm), 96 (phi-3), 192 (MLA keys; see test_mla_key_and_value_dims_differ).
DIM_SHAPES = {32: (2, 8, 4, mx.float16), 64: (2, 4, 2, mx.bfloat16), 80: (2, 4, 1, mx.float16),
              96: (2, 3, 2, mx.bfloat16), 128: (2, 4, 1, mx.float16), 192: (2, 2, 1, mx.float32),
              256: (2, 2, 3, mx.float32), 512: (2, 4, 2, mx.float16)}


@pytest.mark.slow
@pytest.mark.emulator
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(  # fractional bits need d/4 >= 16 channels in the outlier group
    "dim,pair", [(d, p) for d in sorted(DIM_SHAPES) for p in [(4, 3, False), (4, 3, True), (3.5, 2.5, False)]
                 if d >= 64 or p[0] % 1 == 0], ids=ids)
def test_decode_every_head_dim_on_cache(emulator, dim, pair, schedule):
    assert set(K.SUPPORTED_DIMS) <= set(DIM_SHAPES)
    check_cache_decode(*pair, dim, *DIM_SHAPES[dim], schedule, strided=pair[2])


@pytest.mark.emulator
@pytest.mark.parametrize("dk,dv,kb,vb", [(192, 128, 4, 3), (96, 64, 3.5, 4), (64, 80, 4, 2.5)], ids=ids)
def test_mla_key_and_value_dims_differ(emulator, dk, dv, kb, vb):
    # DeepSeek-style MLA caches keys of 192 dims (nope + rope) and values of 128.
    got, want, *_ = run_decode(np.random.default_rng(dk), dk, kb, vb, False, mx.float32, 2, 2, "causal", Emu(),
                               dv=dv, B=2, split_tokens=32)
    assert_close(got, want, mx.float32)


@pytest.mark.parametrize("dim", [640, 1024])
def test_head_dims_without_a_kernel_say_why_and_fall_back(monkeypatch, dim):
    q, keys, values = cache_step(4, 3, False, dim, 1, 2, 1, mx.float16, n_prompt=40)
    assert f"head dim {dim}" in (K.decode_unsupported(q, keys, values, None) or "")
    assert_falls_back(monkeypatch, q, keys, values)


@pytest.mark.slow
@pytest.mark.emulator
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(
    "kb,vb,qjl,dim,R,L,dtype",
    [
        (4, 3, False, 128, 4, 1, mx.float16),  # the default, Llama-like GQA decode
        (4, 3, True, 64, 2, 3, mx.bfloat16),  # QJL keys, speculative verify
        (8, 2, False, 256, 1, 8, mx.float32),  # 8 query tokens
        (1, 8, False, 32, 8, 8, mx.float16),  # 64 query rows in one threadgroup, 8 per SIMD group
    ],
    ids=ids,
)
def test_decode_schedules_on_cache_batch_2(emulator, schedule, kb, vb, qjl, dim, R, L, dtype):
    check_cache_decode(kb, vb, qjl, dim, 2, R, L, dtype, schedule, strided=schedule != "forward")


@pytest.mark.emulator
def test_encode_matches_cache_compression(emulator):
    config = TurboQuantConfig(key_bits=4, value_bits=3, window=0, sinks=0, qjl=True)
    cache, rng = cache_handles(config, 24)
    x = normal(rng, (1, 2, 8, 64))
    for q, mean in ((cache.key_stream.quantizer, cache.key_stream.mean), (cache.value_stream.quantizer, cache.value_stream.mean)):
        assert_codes_equal(K.encode(x, q, mean, metal_kernel=Emu()), stream_encode(x, q, mean, None), q)


# ==================================================================== 5. byte counts
def compressed_bytes(kv: StreamView) -> int:
    return sum(np.asarray(a).nbytes for a in kv.codes)


@pytest.mark.emulator
@pytest.mark.parametrize("dim,kb,vb,qjl,R,L,split", [
    (128, 4, 4, False, 4, 1, 64), (128, 4, 4, True, 4, 1, None), (128, 4, 4, False, 4, 8, None),
    (96, 3.5, 2.5, False, 4, 1, None), (80, 4, 3, False, 2, 4, None),  # channel groups; a head dim without WHT
    (128, 5, 4, False, 4, 1, None), (128, 6, 6, False, 4, 8, None), (128, 3, 5, True, 4, 1, None),  # 5/6 bits
    (80, 6, 5, False, 2, 4, None), (96, 5, 3.5, False, 4, 1, None),
], ids=ids)
def test_decode_reads_each_compressed_byte_once(emulator, dim, kb, vb, qjl, R, L, split):
    f = Emu()
    mask = "causal" if L > 1 else None
    n = 1000
    got, want, keys, values = run_decode(np.random.default_rng(7), dim, kb, vb, qjl, mx.float16, R, L, mask, f,
                                         B=2, n=n, n_window=16, split_tokens=split)
    assert_close(got, want, mx.float16)
    (p1,) = f.stats("tq_decode_partial")
    for kv, bits in ((keys, kb), (values, vb)):  # 5, 6 bits: a 4-bit plane and a 1- or 2-bit plane (d=80: 10 + 3)
        if bits in (5, 6):
            assert kv.codes.codes.shape[-1] == packed_words(dim, bits) == -(-dim // 8) + -(-dim * (bits - 4) // 32)
    names = ["kc", "kn", "vc", "vn"] + (["kj", "kg"] if qjl else [])
    for name in names:
        b = p1.buffers[name]
        # Every byte of every kv head is read, once, for all R*L query rows of the GQA group.
        assert b.unique_bytes_read == b.nbytes, name
        assert b.total_bytes_read <= 1.1 * b.nbytes, name
        assert b.total_bytes_written == 0
    total = sum(p1.buffers[n].total_bytes_read for n in names)
    assert total <= 1.1 * (compressed_bytes(keys) + compressed_bytes(values))
    # No float copy of the cache: everything written by all launches of the step is small against the
    # float16 size of the compressed tokens (pass 1 writes one (m, l, acc) per row and split).
    float_cache = 2 * n * 2 * (dim + dim) * 2  # B * n * H * (DK + DV) * sizeof(half)
    written = sum(b.nbytes for launch in f.launches for b in launch.stats.buffers.values() if b.kind == "output")
    assert written < 0.1 * float_cache


# ===================================================================== 6. planted bugs
def planted(monkeypatch, name: str, old: str, new: str, count: int = 1):
    src = K.SOURCES[name]
    assert old in src, f"{old!r} not in {name}.metal"
    monkeypatch.setitem(K.SOURCES, name, src.replace(old, new, count))


BARRIER = "threadgroup_barrier(mem_flags::mem_threadgroup);"


def decode_fails(**kw) -> list[str]:
    """Schedules under which decode attention disagrees with the reference (or the emulator errors)."""
    bad = []
    for schedule in SCHEDULES:
        try:
            got, want, *_ = run_decode(np.random.default_rng(8), 64, 4, 4, False, mx.float32, 2, 1, None,
                                       Emu(schedule, seed=5), n=70, split_tokens=32, **kw)
            K._mismatch(got, want) and bad.append(schedule)
        except Exception:
            bad.append(schedule)
    return bad


@pytest.mark.emulator
def test_planted_missing_barrier_after_key_staging_is_detected(emulator, monkeypatch):
    assert decode_fails() == []
    # The first barrier in the tile loop: scores would read key words other threads have not staged yet.
    src = K.SOURCES["decode_partial"]
    i = src.index(BARRIER, src.index("// 1. Stage keys."))
    monkeypatch.setitem(K.SOURCES, "decode_partial", src[:i] + src[i + len(BARRIER):])
    assert decode_fails(), "a missing barrier went unnoticed"


@pytest.mark.emulator
def test_planted_missing_barrier_before_value_accumulation_is_detected(emulator, monkeypatch):
    src = K.SOURCES["decode_partial"]
    i = src.index(BARRIER, src.index("// 3. Stage the values"))
    monkeypatch.setitem(K.SOURCES, "decode_partial", src[:i] + src[i + len(BARRIER):])
    assert decode_fails()


@pytest.mark.emulator
def test_planted_wrong_shuffle_lane_is_detected(emulator, monkeypatch):
    planted(monkeypatch, "common", "simd_shuffle_xor(v[i], m)", "simd_shuffle_xor(v[i], m == 4 ? 8 : m)")
    rot = Rotation(128, seed=1)
    x = normal(np.random.default_rng(0), (4, 128))
    assert K._mismatch(K.rotate(x, rot, metal_kernel=Emu()), K.rotate_reference(x, rot))
    assert decode_fails() == list(SCHEDULES)
    q = quantizer(128, 4)
    x4 = x.reshape(1, 1, 4, 128)
    assert K._codes_mismatch(K.encode(x4, q, metal_kernel=Emu()), K.encode_reference(x4, q), q)


@pytest.mark.emulator
def test_planted_packing_bug_is_detected(emulator, monkeypatch):
    # Lanes of one word no longer OR their fields together: 4-bit codes at d=128 lose half their bits.
    planted(monkeypatch, "common", "bits |= simd_shuffle_xor(bits, m);", "bits |= 0u;")
    q = quantizer(128, 4)
    x = normal(np.random.default_rng(0), (1, 2, 4, 128))
    assert K._codes_mismatch(K.encode(x, q, metal_kernel=Emu()), K.encode_reference(x, q), q)


# ============================================ 7. dispatch: setting, env var, self-check
def small_problem(seed=0, dim=64, bits=4):
    rng = np.random.default_rng(seed)
    keys = handle(rng, quantizer(dim, bits, seed=2), n=40)
    values = handle(rng, quantizer(dim, bits, seed=3), n=40)
    return normal(rng, (1, 4, 1, dim), mx.float16), keys, values


class Counting:
    def __init__(self, inner=None):
        self.inner, self.made = inner, 0

    def __call__(self, **kw):
        self.made += 1
        if self.inner is None:
            raise AssertionError("the reference path must not build kernels")
        return self.inner(**kw)


def test_backend_setting_and_env_var(monkeypatch):
    assert K.get_backend() == "auto"
    assert K.kernels_enabled() == K.metal_available()  # here (Linux): no Metal, auto -> reference
    for mode in K.BACKENDS:
        monkeypatch.setenv(K.ENV_VAR, mode)
        assert K.get_backend() == mode
    monkeypatch.setenv(K.ENV_VAR, "metal")
    assert K.kernels_enabled()
    K.set_backend("reference")  # the setting wins over the environment
    assert K.get_backend() == "reference" and not K.kernels_enabled()
    with pytest.raises(ValueError, match="must be one of"):
        K.set_backend("cuda")
    K.set_backend(None)
    monkeypatch.setenv(K.ENV_VAR, "gpu")
    with pytest.raises(ValueError, match="TQ_MLX_KERNELS must be one of"):
        K.get_backend()


@pytest.mark.parametrize("mode", ["auto", "reference"])
def test_reference_path_without_metal(monkeypatch, mode):
    if mode == "auto" and K.metal_available():
        pytest.skip("on a Mac, auto runs the kernels")
    monkeypatch.setenv(K.ENV_VAR, mode)
    never = Counting()
    K.set_kernel_factory(never)
    q, keys, values = small_problem()
    out = K.dispatch_attention(q, keys, values, 0.125, None)
    assert mx.array_equal(out, K.decode_attention_reference(q, keys, values, 0.125))
    assert never.made == 0


@pytest.mark.emulator
def test_forced_metal_runs_self_checked_kernels(emulator, monkeypatch):
    monkeypatch.setenv(K.ENV_VAR, "metal")
    factory = Counting(Emu())
    K.set_kernel_factory(factory)
    q, keys, values = small_problem()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a passing self-check warns about nothing
        out = K.dispatch_attention(q, keys, values, 0.125, None)
        assert_close(out, K.decode_attention_reference(q, keys, values, 0.125), mx.float16)
        assert factory.made == 3  # wht, decode_partial, decode_merge
        assert all(v is None for v in K.self_check_status().values())
        x = normal(np.random.default_rng(1), (1, 2, 3, 64))
        assert_codes_equal(K.dispatch_encode(x, keys.quantizer, keys.mean),
                           K.encode_reference(x, keys.quantizer, keys.mean), keys.quantizer)
        assert_close(K.dispatch_dequantize(keys), K.dequantize_reference(keys), mx.float16)
        rot = keys.quantizer.groups[0].rotation
        assert_close(K.dispatch_rotate(x, rot, True), K.rotate_reference(x, rot, True), mx.float32)
    assert {k[0] for k in K.self_check_status()} == {"decode_attention", "encode", "dequantize", "rotate"}


@pytest.mark.emulator
@pytest.mark.parametrize("kb,vb,dim", [(3.5, 2.5, 64), (4, 3, 96), (2.5, 4, 80)], ids=ids)
def test_dispatch_runs_kernels_for_channel_groups_and_other_head_dims(emulator, monkeypatch, kb, vb, dim):
    monkeypatch.setenv(K.ENV_VAR, "metal")
    factory = Counting(Emu())
    K.set_kernel_factory(factory)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every self-check passes
        for L in (2, 12):  # decode_attention, then prefill_attention
            q, keys, values = cache_step(kb, vb, False, dim, 1, 2, L, mx.float16)
            mask = "causal"
            assert_close(K.dispatch_attention(q, keys, values, 0.1, mask),
                         K.decode_attention_reference(q, keys, values, 0.1, mask), mx.float16)
        x = normal(np.random.default_rng(1), (1, 2, 3, dim))
        for kv in (keys, values):
            args = (x, kv.quantizer, kv.mean, kv.perm, kv.scale)
            assert_codes_equal(K.dispatch_encode(*args), K.encode_reference(*args), kv.quantizer)
    assert {k[0] for k, v in K.self_check_status().items() if v is None} == {
        "decode_attention", "prefill_attention", "encode"}
    assert factory.made == 4  # decode_partial, decode_merge, prefill_attention, encode_dense: no WHT kernel


@pytest.mark.emulator
@pytest.mark.parametrize("kb,vb,dim", [(5, 4, 128), (6, 6, 64), (6, 5, 80)], ids=ids)
def test_dispatch_takes_the_kernels_at_5_and_6_bits(emulator, monkeypatch, kb, vb, dim):
    # Where the kernels run, no 5- or 6-bit view takes the reference path: decode and prefill attention, encode
    # and dequantize each pass their self-check and run.
    monkeypatch.setenv(K.ENV_VAR, "metal")
    f = Emu()
    K.set_kernel_factory(f)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every self-check passes
        for L in (1, 12):  # decode_attention, then prefill_attention
            q, keys, values = cache_step(kb, vb, False, dim, 1, 2, L, mx.float16)
            mask = "causal" if L > 1 else None
            assert_close(K.dispatch_attention(q, keys, values, 0.1, mask),
                         K.decode_attention_reference(q, keys, values, 0.1, mask), mx.float16)
        x = normal(np.random.default_rng(1), (1, 2, 3, dim))
        for kv in (keys, values):
            args = (x, kv.quantizer, kv.mean, kv.perm, kv.scale)
            assert_codes_equal(K.dispatch_encode(*args), K.encode_reference(*args), kv.quantizer)
            if dim != 80:  # dequantize takes one WHT group (as at every width)
                assert_close(K.dispatch_dequantize(kv), K.dequantize_reference(kv), mx.float16)
    status = K.self_check_status()
    assert all(why is None for why in status.values())
    assert {k[0] for k in status} == {"decode_attention", "prefill_attention", "encode"} | (
        set() if dim == 80 else {"dequantize"})
    assert {"tq_decode_partial", "tq_prefill_attention"} <= {launch.name for launch in f.launches}


@pytest.mark.emulator
@pytest.mark.parametrize(
    "bug",
    [
        ("decode_partial", "const float p = valid ? fast::exp(sk - mn) : 0.0f;",
         "const float p = valid ? fast::exp(sk - m[k]) : 0.0f;"),  # wrong softmax reference point
        ("decode_partial", BARRIER, ""),  # every barrier gone
        ("decode_merge", "/ l);", "/ l) +;"),  # a compile error
    ],
    ids=["wrong-math", "no-barriers", "compile-error"],
)
def test_self_check_disables_a_bad_kernel_and_warns_once(emulator, monkeypatch, bug):
    name, old, new = bug
    planted(monkeypatch, name, old, new, count=10 if old == BARRIER else 1)
    monkeypatch.setenv(K.ENV_VAR, "metal")
    K.set_kernel_factory(Emu())
    q, keys, values = small_problem()
    want = K.decode_attention_reference(q, keys, values, 0.125)
    with pytest.warns(RuntimeWarning, match=r"'decode_attention' .* disabled; the reference path is used"):
        out = K.dispatch_attention(q, keys, values, 0.125, None)
    assert mx.array_equal(out, want)  # never a silent wrong answer
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: the second call is quiet and still right
        assert mx.array_equal(K.dispatch_attention(q, keys, values, 0.125, None), want)
    (reason,) = [v for k, v in K.self_check_status().items() if k[0] == "decode_attention"]
    assert reason


@pytest.mark.parametrize(
    "case",
    ["head_dim_640", "float32_norms", "int_mask", "qjl_1bit"],
)
def test_unsupported_cases_fall_back_to_reference(monkeypatch, case):
    monkeypatch.setenv(K.ENV_VAR, "metal")
    never = Counting()
    K.set_kernel_factory(never)
    rng = np.random.default_rng(0)
    dim, kq, L, mask = 64, quantizer(64, 4, seed=2), 1, None
    if case == "head_dim_640":
        dim, kq = 640, quantizer(640, 4, seed=2)
    elif case == "float32_norms":
        kq = TurboQuantMSE(64, 4, seed=2, norm_dtype=mx.float32)
    elif case == "qjl_1bit":
        kq = TurboQuantProd(64, 1, seed=2)
    keys = handle(rng, kq, n=20)
    values = handle(rng, quantizer(dim, 4, seed=3), n=20)
    if case == "int_mask":  # bool and float array masks run in the kernels (section 11)
        mask = mx.ones((1, keys.n_tokens), dtype=mx.int32)
    q = normal(rng, (1, 2, L, dim))
    assert K.decode_unsupported(q, keys, values, mask)
    out = K.dispatch_attention(q, keys, values, 0.1, mask)
    assert mx.array_equal(out, K.decode_attention_reference(q, keys, values, 0.1, mask))
    assert never.made == 0


# ================================================= 8. source generation = MLX's own
@pytest.mark.emulator
def test_every_kernel_source_matches_mlx_generator(emulator):
    from tests.emulator import generate_source
    from tests.emulator.mlx_reference import mlx_generated_source

    f = Emu()
    rng = np.random.default_rng(0)
    run_decode(rng, 64, 3, 4, True, mx.bfloat16, 2, 2, "causal", f, split_tokens=32)
    x = normal(rng, (1, 2, 3, 64), mx.float16)
    K.encode(x, quantizer(64, 2), None, metal_kernel=f)
    K.encode(x, quantizer(64, 3, qjl=True), normal(rng, (1, 2, 64)), metal_kernel=f)
    K.dequantize(handle(rng, quantizer(64, 1), n=4), mx.bfloat16, metal_kernel=f)
    K.rotate(x, Rotation(64), True, metal_kernel=f)
    K.encode(x, quantizer(64, 3.5), None, mx.array(np.stack([rng.permutation(64)] * 2).astype(np.int32)),
             metal_kernel=f)
    run_decode(rng, 80, 2.5, 4, False, mx.float16, 1, 1, None, f, split_tokens=32)  # outc, no in-kernel rotation
    K.encode(x, quantizer(64, 6), None, metal_kernel=f)  # bit planes 4 + 2
    K.dequantize(handle(rng, quantizer(64, 5), n=4), mx.float16, metal_kernel=f)  # 4 + 1
    names = {launch.name for launch in f.launches}
    assert names == {"tq_wht", "tq_encode", "tq_encode_dense", "tq_dequantize", "tq_decode_partial", "tq_decode_merge"}
    for launch in f.launches:
        m, c = launch.make, launch.call
        ours = generate_source(m["name"], m["input_names"], m["output_names"], m["source"], m["header"],
                               c["inputs"], c["output_dtypes"], c["template"])[1]
        theirs = mlx_generated_source(m["name"], m["input_names"], m["output_names"], m["source"], c["inputs"],
                                      c["output_shapes"], c["output_dtypes"], header=m["header"],
                                      template=c["template"])
        assert ours == theirs, launch.name
        assert ours == launch.stats.source


# ========================================================================== 9. mac_check
@pytest.mark.skipif(K.metal_available(), reason="on a Mac the script runs the real check")
def test_mac_check_exits_cleanly_without_metal(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "mac_check.py"), "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Metal is not available on this machine (" in proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.emulator
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32], ids=ids)
@pytest.mark.parametrize("magnitude", [1e-8, 1e5])
def test_kernels_take_the_streams_scale_and_float_tokens_in_the_models_dtype(emulator, dtype, magnitude):
    # A bfloat16 or float32 model's cache keeps its sinks and window in that dtype and stores codes of
    # (x - μ) / scale: decode attention, encode and dequantize all agree with the reference on it.
    rng = np.random.default_rng(5)
    cache = TurboQuantKVCache(TurboQuantConfig(window=16, sinks=4, compress_block=8))  # the default K4/V4, uint8 norms
    k = ((normal(rng, (1, 2, 70, 64)) + 0.7) * magnitude).astype(dtype)
    v = (normal(rng, (1, 2, 70, 64)) * magnitude).astype(dtype)
    keys, values = cache.update_and_fetch(k, v)
    assert keys.window.dtype == keys.sinks.dtype == dtype and keys.scale is not None and values.scale is not None
    for L in (1, 3):
        q = (normal(rng, (1, 4, L, 64)) / magnitude).astype(dtype)
        mask = "causal" if L > 1 else None
        assert K.decode_unsupported(q, keys, values, mask) is None
        got = K.decode_attention(q, keys, values, 0.125, mask, split_tokens=32, metal_kernel=Emu())
        want = K.decode_attention_reference(q, keys, values, 0.125, mask)
        assert_close(got.astype(mx.float32) / magnitude, want.astype(mx.float32) / magnitude, dtype)
    x = (normal(rng, (1, 2, 8, 64)) + 0.7) * magnitude
    kq = keys.quantizer
    assert_codes_equal(K.encode(x, kq, keys.mean, None, keys.scale, metal_kernel=Emu()),
                       stream_encode(x, kq, keys.mean, None, keys.scale), kq)
    assert_close(K.dequantize(keys, mx.float32, metal_kernel=Emu()) / magnitude,
                 K.dequantize_reference(keys, mx.float32) / magnitude, mx.float32)


# ================================================================ 10. 8-bit (log-coded) norms
@pytest.mark.emulator
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("kb,vb,qjl,dim", [(4, 3, False, 64), (3.5, 2.5, False, 96), (3, 2, True, 128)], ids=ids)
def test_uint8_norms_on_cache_in_every_kernel(emulator, schedule, kb, vb, qjl, dim):
    for L in (2, 12):  # decode_attention, prefill_attention
        q, keys, values = cache_step(kb, vb, qjl, dim, 2, 2, L, mx.float16, norm_bits=8)
        assert keys.codes.norms.dtype == values.codes.norms.dtype == mx.uint8
        f = Emu(schedule, seed=3)
        if L <= K.MAX_QUERY_TOKENS:
            got = K.decode_attention(q, keys, values, 0.1, "causal", split_tokens=32, metal_kernel=f)
        else:
            got = K.prefill_attention(q, keys, values, 0.1, "causal", metal_kernel=f)
        assert_close(got, K.decode_attention_reference(q, keys, values, 0.1, "causal"), mx.float16, f"L={L}")
    x = normal(np.random.default_rng(2), (2, 2, 33, dim)) * 3.0
    for kv in (keys, values):
        args = (x, kv.quantizer, kv.mean, kv.perm, kv.scale)
        if K.encode_unsupported(*args) is None:
            got = K.encode(*args, metal_kernel=Emu(schedule))
            want = K.encode_reference(*args)
            assert got.norms.dtype == mx.uint8
            assert int(mx.sum(got.norms != want.norms)) <= 1  # a log2 within rounding of a half step may flip
            assert_codes_equal(got, want, kv.quantizer)
        if K.dequantize_unsupported(kv) is None:
            assert_close(K.dequantize(kv, mx.float32, metal_kernel=Emu(schedule)), K.dequantize_reference(kv, mx.float32),
                         mx.float32)


@pytest.mark.emulator
def test_uint8_norms_are_a_self_checked_variant_of_their_own(emulator, monkeypatch):
    monkeypatch.setenv(K.ENV_VAR, "metal")
    K.set_kernel_factory(Emu())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for norm_bits in (16, 8):
            q, keys, values = cache_step(4, 3, False, 64, 1, 2, 1, mx.float16, norm_bits=norm_bits)
            assert_close(K.dispatch_attention(q, keys, values, 0.1), K.decode_attention_reference(q, keys, values, 0.1),
                         mx.float16)
    checked = [v for (kernel, v), reason in K.self_check_status().items() if kernel == "decode_attention"]
    assert len(checked) == 2 and {v[2].norms for v in checked} == {"mlx.core.float16", "mlx.core.uint8"}
    encodes = [v for (kernel, v) in K.self_check_status() if kernel == "encode"]
    assert {v[-1] for v in encodes} == {"mlx.core.float16", "mlx.core.uint8"}


# ====================================== 11. learned sinks, array masks, MLA (keys are values, additive mask)
def make_mask(rng, kind: str, B: int, Hq: int, L: int, T: int):
    """A mask of `kind`: "bool-2d" (L, T), "bool-batch" (B, 1, L, T) with left padding on row 1, as mlx-lm's
    batched generation; "add-heads-<dtype>" (B, Hq, L, T) additive scores with a bool mask folded in at the
    dtype's most negative value, as multi-head latent attention's rope scores (each row shows its last token)."""
    hidden = rng.random((B, Hq, L, T)) < 0.3
    hidden[..., -1] = False
    if kind == "bool-2d":
        return mx.array(~hidden[0, 0])
    if kind == "bool-batch":
        shown = ~hidden[:, :1]
        shown[-1, ..., :3] = False  # the last row's left padding
        return mx.array(shown)
    dtype = getattr(mx, kind.rsplit("-", 1)[1])
    scores = np.where(hidden, float(mx.finfo(dtype).min), 2 * rng.standard_normal((B, Hq, L, T)))
    return mx.array(scores.astype(np.float32)).astype(dtype)


SINK_MASK_CASES = [
    # dk, kb, vb, qjl, dtype, R, L, mask, learned sinks
    (128, 4, 4, False, mx.float16, 4, 1, None, True),  # gpt-oss-like decode with sinks
    (64, 3, 2, True, mx.bfloat16, 2, 3, "causal", True),  # sinks, QJL keys, speculative verify
    (64, 4, 3, False, mx.float16, 2, 2, "bool-batch", False),  # batched generation's (B, 1, L, T) mask
    (64, 4, 3, False, mx.float32, 4, 4, "add-heads-float32", True),  # per-head additive mask and sinks
    (128, 8, 3, False, mx.float16, 2, 2, "bool-2d", True),  # (L, T) bool
    (80, 3.5, 2.5, False, mx.bfloat16, 8, 1, "add-heads-bfloat16", False),  # groups; host-rotated outc
]


def run_masked(rng, dk, kb, vb, qjl, dtype, R, L, mask_kind, sinks, kernel, factory, B=2, dv=None, **kw):
    """decode_attention or prefill_attention (`kernel`) and its reference twin on random views, with a mask of
    `mask_kind` (make_mask, or None / "causal") and random learned sinks if `sinks`."""
    keys = handle(rng, quantizer(dk, kb, qjl, seed=2), B, 2)
    values = handle(rng, quantizer(dv or dk, vb, seed=3), B, 2)
    q = normal(rng, (B, 2 * R, L, dk), dtype)
    T = keys.n_tokens
    mask = mask_kind if mask_kind in (None, "causal") else make_mask(rng, mask_kind, B, 2 * R, L, T)
    ls = normal(rng, (2 * R,), dtype) * 2 + 4 if sinks else None  # against ~log(80) of the tokens
    run, ref = ((K.decode_attention, K.decode_attention_reference) if kernel == "decode" else
                (K.prefill_attention, K.prefill_attention_reference))
    assert (K.decode_unsupported if kernel == "decode" else K.prefill_unsupported)(q, keys, values, mask, ls) is None
    got = run(q, keys, values, 1 / math.sqrt(dk), mask, ls, metal_kernel=factory, **kw)
    want = ref(q, keys, values, 1 / math.sqrt(dk), mask, ls)
    if sinks:  # the sinks matter
        assert float(mx.abs(want - ref(q, keys, values, 1 / math.sqrt(dk), mask)).max()) > 1e-2
    return got, want


def case_id(c) -> str:
    dk, kb, vb, qjl, dtype, R, L, mask, sinks = c
    return f"d{dk}-K{kb}{'+qjl' if qjl else ''}V{vb}-{ids(dtype)}-R{R}L{L}-{mask}{'-sinks' if sinks else ''}"


@pytest.mark.emulator
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("case", SINK_MASK_CASES, ids=case_id)
def test_decode_learned_sinks_and_array_masks(emulator, schedule, case):
    dk, kb, vb, qjl, dtype, R, L, mask, sinks = case
    got, want = run_masked(np.random.default_rng(R * L), dk, kb, vb, qjl, dtype, R, L, mask, sinks, "decode",
                           Emu(schedule, seed=9), split_tokens=32)  # 70 tokens: 3 splits
    assert got.dtype == dtype
    assert_close(got, want, dtype, schedule)


def mla_step(R: int, D: int, bits=4, B=2, n_prompt=80, seed=0):
    """A multi-head latent attention decode step (DeepSeek-V3's L == 1 path) on a real cache: one kv head whose
    latent is both keys and values, R query heads, and the additive rope scores (B, R, 1, T) in bfloat16 with
    the batch's left padding folded in at finfo.min. Returns (queries, latent view, mask, float latent)."""
    rng = np.random.default_rng(seed)
    cache = TurboQuantKVCache(TurboQuantConfig.from_bits(bits, window=8, sinks=2, compress_block=8, step=64))
    latent = (normal(rng, (B, 1, n_prompt + 1, D)) + 0.3).astype(mx.bfloat16)
    cache.update_and_fetch(latent[:, :, :n_prompt], latent[:, :, :n_prompt])
    kv, _ = cache.update_and_fetch(latent[:, :, n_prompt:], latent[:, :, n_prompt:])
    T = kv.n_tokens
    pe = 2 * rng.standard_normal((B, R, 1, T))
    pe[-1, ..., :5] = float(mx.finfo(mx.bfloat16).min)  # the last row's left padding
    return normal(rng, (B, R, 1, D), mx.bfloat16), kv, mx.array(pe.astype(np.float32)).astype(mx.bfloat16), latent


@pytest.mark.emulator
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("R,D", [(16, 512), (128, 512), (128, 32), (20, 512)])
def test_mla_decode_keys_are_values_with_additive_mask(emulator, schedule, R, D):
    # k = v = the compressed latent (head dim 512 in DeepSeek-V3 / Kimi K2 / GLM-4.7-Flash, the zoo's 32), 16..128
    # query heads on one kv head: the kernel takes it (query rows in chunks where threadgroup memory needs) and
    # reads the codes once for keys and values.
    q, kv, pe, _ = mla_step(R, D)
    assert K.decode_unsupported(q, kv, kv, pe) is None and keys_are_values(kv, kv)
    f = Emu(schedule, seed=4)
    got = K.decode_attention(q, kv, kv, 0.1, pe, metal_kernel=f)
    assert_close(got, K.decode_attention_reference(q, kv, kv, 0.1, pe), mx.bfloat16, schedule)
    (p1,) = f.stats("tq_decode_partial")
    chunks = p1.grid[2]
    assert p1.buffers["kc"].unique_bytes_read == p1.buffers["kc"].nbytes
    assert p1.buffers["kc"].total_bytes_read == chunks * p1.buffers["kc"].nbytes  # once per chunk of query rows
    assert p1.buffers["vc"].total_bytes_read == p1.buffers["vn"].total_bytes_read == 0  # the key words serve


@pytest.mark.emulator
def test_mla_decode_at_8_bits_tracks_mlx_lm_float_attention(emulator, monkeypatch):
    # Through dispatch_attention (the hook's call), self-checked, against mlx-lm's attention on the float latent.
    from mlx_lm.models.base import scaled_dot_product_attention

    monkeypatch.setenv(K.ENV_VAR, "metal")
    f = Emu()
    K.set_kernel_factory(f)
    for R, D in ((16, 512), (20, 32)):
        q, kv, pe, latent = mla_step(R, D, bits=8)
        f.launches.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the self-check passes
            got = K.dispatch_attention(q, kv, kv, scale=0.1, mask=pe)
        assert {"tq_decode_partial", "tq_decode_merge"} <= {x.name for x in f.launches}
        want = scaled_dot_product_attention(q, latent, latent, cache=None, scale=0.1, mask=pe)
        err = float(mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max())
        assert err < 0.03 * float(mx.abs(want.astype(mx.float32)).max()), (R, D, err)
    variants = [v for (k, v) in K.self_check_status() if k == "decode_attention"]
    assert all(v[7] == ("mlx.core.bfloat16", True, True) and v[-1] is True for v in variants)  # mask kind; k = v


@pytest.mark.emulator
def test_dispatch_self_checks_each_sinks_and_mask_variant(emulator, monkeypatch):
    monkeypatch.setenv(K.ENV_VAR, "metal")
    f = Emu()
    K.set_kernel_factory(f)
    rng = np.random.default_rng(2)
    keys, values = handle(rng, quantizer(64, 4, seed=2), 2, 2), handle(rng, quantizer(64, 3, seed=3), 2, 2)
    sinks = normal(rng, (4,)) * 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for L, mask in ((1, None), (2, "bool-batch"), (12, "bool-batch"), (12, "add-heads-float16")):
            q = normal(rng, (2, 4, L, 64), mx.float16)
            m = mask if mask is None else make_mask(rng, mask, 2, 4, L, keys.n_tokens)
            f.launches.clear()
            out = K.dispatch_attention(q, keys, values, 0.125, m, sinks=sinks)
            assert_close(out, K.decode_attention_reference(q, keys, values, 0.125, m, sinks), mx.float16)
            assert ("tq_decode_merge" if L == 1 or L == 2 else "tq_prefill_attention") in {x.name for x in f.launches}
    status = K.self_check_status()
    assert len(status) == 4 and all(v is None for v in status.values())
    assert {v[7] for (_, v) in status} == {None, ("mlx.core.bool", True, False), ("mlx.core.float16", True, True)}
    assert all(v[-2] is True for (_, v) in status)  # sinks


@pytest.mark.emulator
@pytest.mark.parametrize("kernel,old,new", [
    ("decode_merge", "tq_mask_score<MASK>(d,", "tq_mask_score<0>(d,"),  # the mask ignored on the float tokens
    ("decode_partial", "amask[moff[k] + t]", "amask[moff[k] + t + 1]"),  # the mask read one column off
    ("decode_merge", "float l = has_sinks ? 1.0f : 0.0f;", "float l = 0.0f;"),  # the sink's weight lost
], ids=["mask-ignored", "mask-column-off", "sink-weight-lost"])
def test_planted_sink_and_mask_bugs_are_caught_by_the_self_check(emulator, monkeypatch, kernel, old, new):
    planted(monkeypatch, kernel, old, new)
    monkeypatch.setenv(K.ENV_VAR, "metal")
    K.set_kernel_factory(Emu())
    rng = np.random.default_rng(3)
    keys, values = handle(rng, quantizer(64, 4, seed=2)), handle(rng, quantizer(64, 3, seed=3))
    q = normal(rng, (1, 4, 1, 64))
    mask, sinks = make_mask(rng, "bool-batch", 1, 4, 1, keys.n_tokens), normal(rng, (4,))
    want = K.decode_attention_reference(q, keys, values, 0.125, mask, sinks)
    with pytest.warns(RuntimeWarning, match=r"'decode_attention' .* disabled"):
        out = K.dispatch_attention(q, keys, values, 0.125, mask, sinks=sinks)
    assert mx.array_equal(out, want)


def test_masks_the_kernels_cannot_read_take_the_reference_path(monkeypatch):
    monkeypatch.setenv(K.ENV_VAR, "metal")
    never = Counting()
    K.set_kernel_factory(never)
    q, keys, values = small_problem()
    T = keys.n_tokens
    for mask, why in ((mx.ones((1, T), dtype=mx.int32), "dtype mlx.core.int32"),
                      (mx.ones((1, 2, 1, T), dtype=mx.bool_), "mask of shape (1, 2, 1"),  # 2 heads for 4
                      ("sliding", "mask 'sliding'")):
        assert why in K.decode_unsupported(q, keys, values, mask)
    assert "learned sinks of shape (2,)" in K.decode_unsupported(q, keys, values, None, mx.zeros(2))
    mask = mx.ones((1, T), dtype=mx.int32)
    assert mx.array_equal(K.dispatch_attention(q, keys, values, 0.1, mask),
                          K.decode_attention_reference(q, keys, values, 0.1, mask))
    assert never.made == 0


@pytest.mark.emulator
def test_learned_sinks_at_8_bits_track_fast_sdpa_on_the_float_cache(emulator, monkeypatch):
    # gpt-oss's full-attention layers: GQA, learned sinks; decode and a prefill chunk through dispatch_attention
    # (the hook's call, self-checked) against mx.fast.scaled_dot_product_attention(sinks=) on the float tokens.
    monkeypatch.setenv(K.ENV_VAR, "metal")
    f = Emu()
    K.set_kernel_factory(f)
    rng = np.random.default_rng(6)
    cache = TurboQuantKVCache(TurboQuantConfig.from_bits(8, window=8, sinks=2, compress_block=8, step=64))
    sinks = (normal(rng, (8,)) + 2).astype(mx.bfloat16)
    ks, vs = [], []
    for L in (70, 1, 12):
        k, v = normal(rng, (1, 2, L, 64), mx.bfloat16), normal(rng, (1, 2, L, 64), mx.bfloat16)
        ks.append(k)
        vs.append(v)
        keys, values = cache.update_and_fetch(k, v)
        if L == 70:
            continue
        q = normal(rng, (1, 8, L, 64), mx.bfloat16)
        mask = "causal" if L > 1 else None
        f.launches.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = K.dispatch_attention(q, keys, values, scale=0.125, mask=mask, sinks=sinks)
        assert ("tq_decode_merge" if L == 1 else "tq_prefill_attention") in {x.name for x in f.launches}
        want = mx.fast.scaled_dot_product_attention(q, mx.concatenate(ks, 2), mx.concatenate(vs, 2), scale=0.125,
                                                    mask=mask, sinks=sinks)
        err = float(mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max())
        assert err < 0.03 * float(mx.abs(want.astype(mx.float32)).max()), (L, err)
