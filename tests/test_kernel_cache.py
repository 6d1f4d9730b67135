"""The Metal decode kernels on real TurboQuantKVCache views against their pure-MLX reference twins, under the
CPU MSL emulator (tests/emulator): nothing here runs on a GPU. Shared helpers and fixtures:
tests/support/kernel_cases.py; the rest of the kernels' matrix: tests/test_kernels.py.
* decode on real TurboQuantKVCache views (μ, ν, scale, channel order, strided capacity buffers), in all three
  schedules: every key/value bit pair the kernels take (the default K4/V4 first; 81 pairs of 1, 2, 2.5, 3, 3.5,
  4, 5, 6, 8 bits and 27 with QJL keys; decode reads each key code byte once) at head_dim 64 with batch 1 and 2, 1..8 query tokens, GQA 1..8 and all three
  dtypes; K4/V3, K4+qjl/V3 and K3.5/V2.5 at head dims 32, 64, 80, 96, 128, 192, 256, 512 with batch 2; the
  pairs with QJL at 1 bit and head dims above 512 must be refused by decode_unsupported with their reason and
  fall back to the reference; key/value head dims that differ (MLA's 192/128);
* 5- and 6-bit codes (bit planes 4+1 and 4+2) at head dims 80, 96 and 128; decode reads exactly the code bytes
  held;
* all three lane schedules (forward, reverse, random) on the cache with batch 2: K4/V3, K4+qjl/V3, K8/V2 with 8
  query tokens, K1/V8 with 64 query rows;
* byte counts: decode attention reads each compressed byte once per kv head and step, writes no float copy.
"""

from __future__ import annotations

import dataclasses

import math

import numpy as np
import pytest

import mlx.core as mx

from tests.support.kernel_cases import (  # noqa: F401  (_clean_dispatch and emulator: the same fixtures)
    SCHEDULES, Counting, Emu, _clean_dispatch, assert_close, assert_codes_equal, cache_step, emulator, ids, normal,
    numpy_views, run_decode,
)
from tq_mlx import attention as K
from tq_mlx import StreamView, TurboQuantConfig, TurboQuantKVCache
from tq_mlx.stream.view import encode as stream_encode
from tq_mlx.quant.packing import packed_words, unpack
from tq_mlx.quant.quantizer import MSE_BITS, PROD_BITS


# ---------------------------------------------------------------- on the real cache
def cache_handles(config, n_prompt, dim=64, B=1, H=2, seed=0):
    rng = np.random.default_rng(seed)
    # (prefill not read as decode: the kernels read what the cache holds, with queries of any count)
    cache = TurboQuantKVCache(dataclasses.replace(config, prefill_as_decode=False))
    keys = normal(rng, (B, H, n_prompt, dim)) + 0.7  # a key mean the cache removes
    cache.update_and_fetch(keys, normal(rng, (B, H, n_prompt, dim)))
    return cache, rng


@pytest.mark.emulator
@pytest.mark.parametrize("qjl", [False, True])
def test_decode_on_cache_handles_strided(emulator, qjl):
    config = TurboQuantConfig(key_bits=3, value_bits=2, qjl=qjl, window=16, calibration_tokens=None, sinks=4, compress_block=8, step=64)
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
DEFAULT_PAIR = (4, 3, False)  # TurboQuantConfig's default K4/V3 (decayed pairs are among the others)
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
        assert kv.codes.norms.dtype == (mx.int8 if bits < 6 else mx.float16) and kv.n_coded > 150
        assert set(np.unique(np.asarray(unpack(kv.codes.codes, bits, 64))).tolist()) == set(range(1 << bits))
        x, x8 = (np.asarray(v.quantizer.dequantize(v.codes)) for v in (kv, kv8))
        rel = ((x - x8) ** 2).sum(-1) / (x8**2).sum(-1)
        assert rel.mean() < 1.3 * err + 2e-4, (bits, rel.mean())  # + the log-coded norms' 0.4e-4
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
        (4, 3, False, 128, 4, 1, mx.float16),  # K4/V3, Llama-like GQA decode
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
    config = TurboQuantConfig(key_bits=4, value_bits=3, window=0, calibration_tokens=None, sinks=0, qjl=True)
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
