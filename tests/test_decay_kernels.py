"""The attention kernels on views with decayed codes (temporal decay: TurboQuantConfig.decay_after), against the
reference `turboquant_attention`, under the CPU MSL emulator (tests/emulator): nothing here runs on a GPU.

A decayed view holds, per side, older compressed tokens re-coded at fewer bits before its fresh codes, in one
rotated basis. The kernels run pass 1 (decode_partial) once per span of one key and one value quantizer
(tq_mlx.attention.reference.aligned_segments) and pass 2 (decode_merge) once over every span's splits; prefill chunks on
decayed views take the same two passes (prefill_attention.metal holds one codebook).

* decode (1..8 query tokens) and prefill (more) on real TurboQuantKVCache views: both sides decaying (K4 -> K3,
  V3 -> V2), only the keys, only the values (QJL keys, which do not decay), keys and values decaying at
  different tokens (three spans), one view as keys and values (MLA's latent), only decayed codes left (a trim);
  masks None, "causal" (in prefill reaching into the codes: chunks longer than the window), bool and additive
  arrays; learned sinks; GQA 1..4; batch 1 and 2; head dims 64 and 128; float16 norms and both log codes (norm_bits 8);
  every float dtype; all three lane schedules;
* 5- and 6-bit fresh codes decaying to 5, 4 and 3 bits (K6 -> K5, as keys widened by key_error decay), so one
  stream holds two code segments of different bit-plane layouts; decode and prefill, keys and values;
* values decayed to the width their error chose (value_error: V4 -> V3 or V2 on the cache's own first window),
  decode and prefill through dispatch_attention;
* byte counts: pass 1 reads each decayed and fresh code byte once per kv head and step (decayed tokens fewer
  bytes each; at 5 and 6 bits exactly bits·d/8 code bytes per token), and writes nothing near a float copy;
* dispatch_attention: the decayed variants pass their self-checks (random views with the same spans) and take
  the kernel path; dequantize per segment; a decay quantizer in another basis is refused with its reason.
Cost: about 30 s warm, 40 s cold (compiling the new variants) on a 2-core machine.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

import mlx.core as mx

from tests.support.kernel_cases import (  # noqa: F401  (_clean_dispatch and emulator: the same fixtures)
    SCHEDULES, Emu, _clean_dispatch, assert_close, emulator, ids, make_mask, normal,
)
from tests.test_values import cache as value_cache, data as value_data
from tq_mlx import attention as K
from tq_mlx import TurboQuantConfig, TurboQuantKVCache
from tq_mlx.attention.reference import aligned_segments, keys_are_values
from tq_mlx.batch import learned
from tq_mlx.config import PRESETS
from tq_mlx.quant.quantizer import TurboQuantMSE
from tq_mlx.stream.view import decode as stream_decode

# (prefill not read as decode: the kernels read what the cache holds, with queries of any count)
DECAY = dict(window=64, calibration_tokens=None, compress_block=32, decay_after=160, sinks=4, step=64, prefill_as_decode=False)


def decayed_views(dim=64, kb=4, vb=3, dkb=3, dvb=2, qjl=False, B=1, H=2, n_prompt=300, L=1, dtype=mx.float16,
                  norm_bits=16, seed=0, **config):
    """Views of a real cache with decay after a prompt of n_prompt tokens and L new ones: (keys, values)."""
    rng = np.random.default_rng(seed)
    cfg = TurboQuantConfig(key_bits=kb, value_bits=vb, qjl=qjl, decay_key_bits=dkb,
                           decay_value_bits=dvb, norm_bits=norm_bits, **(DECAY | config))
    cache = TurboQuantKVCache(cfg, head_dim=dim)
    kv = lambda n, shift: ((normal(rng, (B, H, n, dim)) + shift) * 2.0).astype(dtype)  # noqa: E731
    cache.update_and_fetch(kv(n_prompt, 0.7), kv(n_prompt, -0.3))
    keys, values = cache.update_and_fetch(kv(L, 0.7), kv(L, -0.3))
    return keys, values


def span_counts(keys, values) -> list[int]:
    return [b - a for a, b, *_ in aligned_segments(keys, values)]


def run(kernel, q, keys, values, mask, sinks, factory, **kw):
    scale = 1 / math.sqrt(q.shape[-1])
    unsupported = K.decode_unsupported if kernel == "decode" else K.prefill_unsupported
    assert unsupported(q, keys, values, mask, sinks) is None
    launch = K.decode_attention if kernel == "decode" else K.prefill_attention
    got = launch(q, keys, values, scale, mask, sinks, metal_kernel=factory, **kw)
    want = K.decode_attention_reference(q, keys, values, scale, mask, sinks)
    assert got.dtype == q.dtype and got.shape == want.shape
    return got, want


def masks(rng, kind, B, Hq, L, T):
    return kind if kind in (None, "causal") else make_mask(rng, kind, B, Hq, L, T)


# ================================================================ 1. decode and prefill against the reference
CASES = [
    # kernel, dim, kb, vb, decay kb, decay vb, qjl, dtype, B, R, L, mask, learned sinks, norms (NORMS)
    ("decode", 64, 4, 3, 3, 2, False, mx.float16, 1, 2, 1, None, False, 16),  # K4/V3, both decaying
    ("decode", 128, 4, 3, 3, None, False, mx.bfloat16, 2, 4, 3, "causal", True, 16),  # only keys; GQA 4, sinks
    ("decode", 64, 4, 3, 3, 2, False, mx.float32, 2, 2, 2, "bool-batch", False, "8c"),  # uint8 norms, bool mask
    ("decode", 64, 4, 4, None, 2, True, mx.float16, 1, 2, 4, "add-heads-float16", True, 16),  # QJL keys: values
    ("decode", 128, 3, 2, 2, 1, False, mx.float16, 2, 1, 1, "bool-2d", False, 8),  # K3 -> K2, V2 -> V1
    ("prefill", 64, 4, 3, 3, 2, False, mx.float16, 1, 2, 100, "causal", False, 16),  # chunk > window: causal in codes
    ("prefill", 128, 4, 3, 3, None, False, mx.bfloat16, 2, 4, 12, "causal", True, 8),  # only keys, GQA 4, sinks
    ("prefill", 64, 4, 3, 3, 2, False, mx.float32, 2, 1, 20, "add-heads-float32", True, 16),  # additive, sinks
    # 5- and 6-bit fresh codes (bit planes 4+1, 4+2) decaying to 4 and 3 bits (one and two planes)
    ("decode", 64, 5, 4, 4, 2, False, mx.float16, 1, 2, 1, None, False, 8),  # K5 -> K4
    ("decode", 128, 6, 3, 3, 2, False, mx.bfloat16, 2, 4, 3, "causal", True, 16),  # K6 -> K3, GQA 4, sinks
    ("decode", 64, 6, 5, 4, 3, False, mx.float32, 2, 2, 2, "bool-batch", False, 8),  # V5 -> V3 too
    ("decode", 64, 4, 6, None, 4, True, mx.float16, 1, 2, 4, "add-heads-float16", True, 16),  # QJL keys, V6 -> V4
    ("prefill", 64, 5, 4, 3, 2, False, mx.float16, 1, 2, 100, "causal", False, "8c"),  # K5 -> K3, causal in codes
    ("prefill", 128, 6, 6, 4, 3, False, mx.float32, 2, 1, 20, "add-heads-float32", True, 16),  # K6 -> K4, V6 -> V3
]


# norms: float16, the int8 fine log code (norm_bits 8), the uint8 coarse one (norm_steps 16)
NORMS = {16: dict(norm_bits=16), 8: dict(norm_bits=8), "8c": dict(norm_bits=8, norm_steps=16)}
NORM_DTYPE = {16: mx.float16, 8: mx.int8, "8c": mx.uint8}


def case_id(c) -> str:
    kernel, dim, kb, vb, dkb, dvb, qjl, dtype, B, R, L, mask, sinks, nb = c
    return (f"{kernel}-d{dim}-K{kb}{'+qjl' if qjl else ''}->{dkb}-V{vb}->{dvb}-{ids(dtype)}-B{B}R{R}L{L}-{mask}"
            f"{'-sinks' if sinks else ''}-n{nb}")


@pytest.mark.emulator
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_decayed_views_match_reference(emulator, schedule, case):
    kernel, dim, kb, vb, dkb, dvb, qjl, dtype, B, R, L, mask, sinks, nb = case
    keys, values = decayed_views(dim, kb, vb, dkb, dvb, qjl, B, n_prompt=300, L=L, dtype=dtype, **NORMS[nb])
    assert (keys.decayed is not None) == (dkb is not None) and (values.decayed is not None) == (dvb is not None)
    for kv, bits in ((keys, dkb), (values, dvb)):
        if bits is not None:
            assert kv.decayed.quantizer.bits == bits and kv.n_fresh > 32 and kv.n_decayed > 32
            assert kv.decayed.quantizer.norm_dtype == NORM_DTYPE[nb]
    if kernel == "prefill" and mask == "causal" and L > DECAY["window"]:
        assert keys.n_window < L  # the chunk's first tokens are compressed: the causal limit lies in the codes
    rng = np.random.default_rng(L)
    q = normal(rng, (B, 2 * R, L, dim), dtype)
    m = masks(rng, mask, B, 2 * R, L, keys.n_tokens)
    ls = normal(rng, (2 * R,), dtype) * 2 + 4 if sinks else None
    f = Emu(schedule, seed=7)
    kw = dict(split_tokens=64) if kernel == "decode" else {}
    got, want = run(kernel, q, keys, values, m, ls, f, **kw)
    assert_close(got, want, dtype, schedule)
    # pass 1 ran once per span, prefill_attention.metal never
    assert len(f.stats("tq_decode_partial")) == len(span_counts(keys, values)) >= 2
    assert not f.stats("tq_prefill_attention")


def three_spans(dim=64, B=1, L=1, dtype=mx.float16, **kw):
    """Keys from a cache decaying after 160 tokens, values from one decaying after 224: the sides change
    quantizer at different tokens, so the compressed tokens are three spans (Kd Vd, Kf Vd... as it falls)."""
    keys, _ = decayed_views(dim, B=B, L=L, dtype=dtype, seed=1, **kw)
    _, values = decayed_views(dim, B=B, L=L, dtype=dtype, seed=2, decay_after=224, **kw)
    assert keys.n_decayed != values.n_decayed and keys.n_coded == values.n_coded
    assert len(span_counts(keys, values)) == 3
    return keys, values


@pytest.mark.emulator
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("kernel,L,mask", [("decode", 2, "causal"), ("prefill", 90, "bool-2d")], ids=ids)
def test_keys_and_values_decayed_at_different_tokens(emulator, schedule, kernel, L, mask):
    keys, values = three_spans(L=L, B=2)
    rng = np.random.default_rng(3)
    q = normal(rng, (2, 4, L, 64), mx.float16)
    f = Emu(schedule, seed=3)
    got, want = run(kernel, q, keys, values, masks(rng, mask, 2, 4, L, keys.n_tokens), None, f,
                    **(dict(split_tokens=32) if kernel == "decode" else {}))
    assert_close(got, want, mx.float16, schedule)
    assert len(f.stats("tq_decode_partial")) == 3


@pytest.mark.emulator
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_latent_keys_are_values_decayed(emulator, schedule):
    # MLA's decode: one view (the latent, decayed too) as keys and values, 16 query heads on one kv head, an
    # additive rope-score mask: each span's codes are read once for keys and values.
    kv, _ = decayed_views(64, 4, 4, 3, 3, B=2, H=1, dtype=mx.bfloat16)
    rng = np.random.default_rng(5)
    q = normal(rng, (2, 16, 1, 64), mx.bfloat16)
    pe = make_mask(rng, "add-heads-bfloat16", 2, 16, 1, kv.n_tokens)
    f = Emu(schedule, seed=5)
    got, want = run("decode", q, kv, kv, pe, None, f)
    assert_close(got, want, mx.bfloat16, schedule)
    for st in f.stats("tq_decode_partial"):
        assert st.buffers["vc"].total_bytes_read == st.buffers["vn"].total_bytes_read == 0  # the key words serve


@pytest.mark.emulator
def test_only_decayed_codes_left_after_a_trim(emulator):
    # A trim that takes the window and every fresh code leaves sinks and decayed codes: one span (K3, V2).
    rng = np.random.default_rng(9)
    cache = TurboQuantKVCache(TurboQuantConfig(decay_key_bits=3, decay_value_bits=2, **DECAY), head_dim=64)
    x = lambda n: normal(rng, (1, 2, n, 64)) + 0.5  # noqa: E731
    keys, _ = cache.update_and_fetch(x(300), x(300))
    cache.trim(keys.n_fresh + keys.n_window)
    keys, values = cache.update_and_fetch(x(2), x(2))
    assert keys.codes is None and values.codes is None and keys.n_decayed > 0 and keys.n_window == 2
    assert span_counts(keys, values) == [keys.n_decayed]
    q = normal(rng, (1, 4, 2, 64), mx.float16)
    f = Emu()
    got, want = run("decode", q, keys, values, "causal", None, f, split_tokens=32)
    assert_close(got, want, mx.float16)
    assert len(f.stats("tq_decode_partial")) == 1
    assert_close(K.dequantize(values, mx.float32, metal_kernel=f), stream_decode(values, mx.float32), mx.float32)


# ============================================================================== 2. byte counts
def codes_bytes(kv) -> int:
    return sum(np.asarray(a).nbytes for _, seg in kv.segments() for a in seg.codes)


@pytest.mark.emulator
@pytest.mark.parametrize("kb, vb, dkb, norm_bits", [(4, 3, 3, 16), (4, 4, 3, 8), (5, 4, 4, 8), (6, 3, 3, 16)],
                         ids=["K4-V3-float16-norms", "the-default-K4-V4-int8-norms", "K5-to-K4-V4-int8-norms",
                              "K6-to-K3-V3-float16-norms"])
def test_decode_reads_each_decayed_and_fresh_byte_once(emulator, kb, vb, dkb, norm_bits):
    B, R, dim = 2, 4, 128
    keys, values = decayed_views(dim, kb=kb, vb=vb, dkb=dkb, B=B, n_prompt=1000, norm_bits=norm_bits)
    assert keys.n_decayed > 500 and keys.n_fresh > 32
    per_token = {name: sum(a.itemsize * math.prod(a.shape[3:]) for a in seg.codes)
                 for name, seg in (("decayed", keys.decayed), ("fresh", keys.segments()[1][1]))}
    # exactly bits·d/8 code bytes per token at every width (K3 against K4: 48 + 2 against 64 + 2 bytes at d = 128;
    # 1 norm byte with log-coded norms; K5 and K6: 80 and 96 code bytes, a 4-bit plane and a 1- or 2-bit plane)
    assert per_token == {"decayed": dim * dkb // 8 + norm_bits // 8, "fresh": dim * kb // 8 + norm_bits // 8}
    q = normal(np.random.default_rng(0), (B, 2 * R, 1, dim), mx.float16)
    f = Emu()
    got, want = run("decode", q, keys, values, None, None, f)
    assert_close(got, want, mx.float16)
    launches = f.stats("tq_decode_partial")
    assert len(launches) == 2
    names = ["kc", "kn", "vc", "vn"]
    for st in launches:
        for name in names:
            b = st.buffers[name]
            assert b.unique_bytes_read == b.nbytes, name  # every byte of every kv head, for all R rows
            assert b.total_bytes_read <= 1.1 * b.nbytes, name
            assert b.total_bytes_written == 0
        for name in ("kc", "kn"):  # the R rows are one chunk: each key byte held is read exactly once
            assert st.buffers[name].total_bytes_read == st.buffers[name].nbytes, name
    read = sum(st.buffers[n].total_bytes_read for st in launches for n in names)
    assert read <= 1.1 * (codes_bytes(keys) + codes_bytes(values))
    # less than the same context at the fresh bits would read
    fresh_rate = sum(a.itemsize * math.prod(a.shape[3:]) for kv in (keys, values) for a in kv.codes)
    assert read < 0.9 * B * 2 * keys.n_coded * fresh_rate
    # No float copy of the cache: pass 1's partials and pass 2's rows are small against it.
    float_cache = B * 2 * keys.n_coded * 2 * dim * 2
    written = sum(b.nbytes for launch in f.launches for b in launch.stats.buffers.values() if b.kind == "output")
    assert written < 0.1 * float_cache


# ============================================================================== 3. dispatch and support
@pytest.mark.emulator
@pytest.mark.parametrize("L,sinks", [(1, False), (3, True), (24, False)])
def test_dispatch_self_checks_decayed_variants(emulator, L, sinks):
    K.set_backend("metal")
    f = Emu()
    K.set_kernel_factory(f)
    keys, values = decayed_views(64, dvb=None, L=L)  # only keys decay
    rng = np.random.default_rng(L)
    q = normal(rng, (1, 4, L, 64), mx.float16)
    ls = normal(rng, (4,), mx.float16) if sinks else None
    got = K.dispatch_attention(q, keys, values, 0.125, "causal", ls)
    assert_close(got, K.decode_attention_reference(q, keys, values, 0.125, "causal", ls), mx.float16)
    status = K.self_check_status()
    kernel = "decode_attention" if L <= K.MAX_QUERY_TOKENS else "prefill_attention"
    (variant,) = [v for (k, v), why in status.items() if k == kernel]
    assert status[(kernel, variant)] is None
    assert variant[-3] == K._span_codes(keys, values) and len(variant[-3]) == 2  # spans: (K3, V3), (K4, V3)
    assert len(f.stats("tq_decode_partial")) == 2 * 2  # self-check (2 spans), then the call
    assert not f.stats("tq_prefill_attention")


@pytest.mark.emulator
@pytest.mark.parametrize("L", [1, 24])
def test_dispatch_takes_the_kernels_on_5_and_6_bit_codes_that_decay(emulator, L):
    # K6 -> K3 and V5 -> V4: every variant (pass 1 per span, dequantize per segment) passes its self-check and
    # runs; nothing takes the reference path.
    keys, values = decayed_views(64, kb=6, vb=5, dkb=3, dvb=4, L=L, norm_bits=8)
    K.set_backend("metal")
    f = Emu()
    K.set_kernel_factory(f)
    assert span_counts(keys, values) == [keys.n_decayed, keys.n_fresh] and keys.quantizer.bits == 6
    rng = np.random.default_rng(L)
    q = normal(rng, (1, 4, L, 64), mx.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every self-check passes
        got = K.dispatch_attention(q, keys, values, 0.125, "causal")
        for kv in (keys, values):
            assert_close(K.dispatch_dequantize(kv, mx.float32), stream_decode(kv, mx.float32), mx.float32)
    assert_close(got, K.decode_attention_reference(q, keys, values, 0.125, "causal"), mx.float16)
    status = K.self_check_status()
    kernel = "decode_attention" if L <= K.MAX_QUERY_TOKENS else "prefill_attention"
    assert {k for k, _ in status} == {kernel, "dequantize"} and all(why is None for why in status.values())
    assert len([v for k, v in status if k == "dequantize"]) == 4  # K3, K6, V4, V5
    assert len(f.stats("tq_decode_partial")) == 2 * 2  # self-check (2 spans), then the call


@pytest.mark.parametrize("sides", ["both", "keys", "values", "different", "latent"])
def test_self_check_views_have_the_same_spans(sides):
    if sides == "different":
        keys, values = three_spans()
    else:
        dkb, dvb = {"both": (3, 2), "keys": (3, None), "values": (None, 2), "latent": (3, 2)}[sides]
        keys, values = decayed_views(dkb=dkb, dvb=dvb)
        if sides == "latent":
            values = keys
    k, v = K._random_views(np.random.default_rng(0), keys, values, 2, 45, 3, tail=5)
    assert K._span_codes(k, v) == K._span_codes(keys, values)
    assert keys_are_values(k, v) == keys_are_values(keys, values)
    counts = span_counts(k, v)
    assert all(n > 0 for n in counts) and sum(counts) == 45 * len(counts) + 5


@pytest.mark.emulator
def test_dequantize_per_segment(emulator):
    keys, values = decayed_views(64, norm_bits=8)
    for kv in (keys, values):
        assert K.dequantize_unsupported(kv) is None
        want = stream_decode(kv, mx.float32)
        assert want.shape[2] == kv.n_coded
        assert_close(K.dequantize(kv, mx.float32, metal_kernel=Emu()), want, mx.float32)
    K.set_backend("metal")
    K.set_kernel_factory(Emu())
    assert_close(K.dispatch_dequantize(values, mx.float16), stream_decode(values, mx.float16), mx.float16)
    assert all(why is None for (k, _), why in K.self_check_status().items() if k == "dequantize")


def test_decay_in_another_basis_is_refused():
    keys, values = decayed_views(64)
    q = mx.zeros((1, 4, 1, 64), mx.float16)
    assert K.decode_unsupported(q, keys, values) is None
    other = keys._replace(decayed=keys.decayed._replace(quantizer=TurboQuantMSE(64, 3, seed=12345)))
    assert "another rotated basis" in K.decode_unsupported(q, other, values)
    assert "another rotated basis" in K.prefill_unsupported(mx.zeros((1, 4, 12, 64), mx.float16), other, values)
    K.set_backend("metal")
    K.set_kernel_factory(lambda **_: pytest.fail("no kernel for a view the kernels refuse"))
    got = K.dispatch_attention(q, other, values, 0.125)
    assert_close(got, K.decode_attention_reference(q, other, values, 0.125), mx.float16)


# the settings DEFAULTS.md measures beside the presets: the default's window (128 tokens read as decode,
# calibrating on 768 tokens) and the 3.88-bit setting (its V3 values with corrected norms and keys to logit error 0.2)
CANDIDATE = dict(window=128, prefill_as_decode=True, calibration_tokens=768)
NAMED = {**{p: TurboQuantConfig.preset(p) for p in PRESETS}, "candidate": TurboQuantConfig(**CANDIDATE),
         "3.88-bit": TurboQuantConfig(**CANDIDATE, value_bits=3, correct_norms=True, key_error=0.2)}


@pytest.mark.parametrize("name", list(NAMED))
def test_every_preset_takes_the_kernels_once_tokens_decayed(name):
    # The Metal path stays whole: on a Mac no named setting falls back to the reference path, before or after
    # its oldest tokens decay (head_dim 128, GQA 4, a decode step and a causal prefill chunk).
    rng = np.random.default_rng(3)
    cfg = NAMED[name]
    cache = TurboQuantKVCache(cfg)
    n = (cfg.decay_after or 2048) + 1100
    k = mx.array(rng.standard_normal((1, 2, n, 128)).astype(np.float16))
    v = mx.array(rng.standard_normal((1, 2, n, 128)).astype(np.float16))
    for a in range(0, n, 2048):
        keys, values = cache.update_and_fetch(k[:, :, a : a + 2048], v[:, :, a : a + 2048])
        if keys.learn is not None:  # the queries a model's attention hands a stream that weighs its keys
            L = min(2048, n - a)
            # errs above either error target (key_error's 0.1, key_output_error's 0.024): the keys widen
            keys.learn(mx.array(4 * rng.standard_normal((1, 8, L, 128)).astype(np.float32)), keys, values)
    # each side decays as the setting says (keys at whatever width their error chose)
    assert (keys.n_decayed > 0) == (cfg.decay_after is not None and cfg.decay_key_bits is not None)
    assert (values.n_decayed > 0) == (cfg.decay_after is not None and cfg.decay_value_bits is not None)
    by_error = cfg.key_error is not None or cfg.key_output_error is not None
    assert cache.key_stream.widened == by_error, cache.key_bits  # the default's keys widen
    assert K.decode_unsupported(mx.zeros((1, 8, 1, 128), mx.float16), keys, values) is None
    assert K.prefill_unsupported(mx.zeros((1, 8, 512, 128), mx.float16), keys, values, "causal") is None
    assert K.dequantize_unsupported(keys) is None and K.dequantize_unsupported(values) is None


@pytest.mark.emulator
@pytest.mark.parametrize("target, width", [(0.12, 3), (0.5, 2)])
def test_values_decayed_to_the_width_their_error_chose_take_the_kernels(emulator, target, width):
    # value_error: a layer's values decay to the width chosen on its first window (tq_mlx.stream.values), so one value
    # stream holds V4 codes after V3 or V2 ones; decode and prefill take the kernels on it and agree with the
    # reference, and the chosen width's recode (decay re-codes on the kernels), encode and dequantize pass their
    # self-checks.
    k, v, q = value_data(340)
    cache = value_cache(value_error=target)  # test_values' layer: head_dim 64, window 96, decay after 160
    kv = cache.update_and_fetch(k[:, :, :300], v[:, :, :300])
    kv = learned(q[:, :, :300], *kv, 0.125)  # the cache learns from the queries first, as in the hook
    mx.eval(K.dispatch_attention(q[:, :, :300], *kv, 0.125, "causal"))  # the reference path: the choice
    assert cache.value_width == width and cache.n_decayed[1] > 0
    K.set_backend("metal")
    f = Emu()
    K.set_kernel_factory(f)
    t = 300
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every self-check passes
        for L in (1, 24, 1):
            keys, values = cache.update_and_fetch(k[:, :, t : t + L], v[:, :, t : t + L])
            assert values.decayed.quantizer.bits == width and values.quantizer.bits == 4
            mask = "causal" if L > 1 else None
            qs = q[:, :, t : t + L]
            keys, values = learned(qs, keys, values, 0.125)
            got = K.dispatch_attention(qs, keys, values, 0.125, mask)
            assert_close(got, K.decode_attention_reference(qs, keys, values, 0.125, mask), mx.float32)
            t += L
        assert_close(K.dispatch_dequantize(values, mx.float32), stream_decode(values, mx.float32), mx.float32)
    status = K.self_check_status()
    assert {k for k, _ in status} == {"encode", "recode", "decode_attention", "prefill_attention", "dequantize"}
    assert all(why is None for why in status.values())
    assert f.stats("tq_decode_partial") and f.stats("tq_dequantize") and f.stats("tq_recode")


def half_step_views(dim=64, L=1, B=1, norm_bits=8, dtype=mx.float16, seed=0):
    """Views of a cache whose keys widened by a half step (key_half_steps: K4.5 or K5.5, a quarter of the
    channels one bit wider, in the channel order of their energy) and decay in the same groups (K3.5 or K4.5):
    keys whose first quarter of channels holds most of their energy, weighed by queries that read every channel."""
    rng = np.random.default_rng(seed)
    spread = np.ones(dim, np.float32)
    spread[rng.permutation(dim)[: dim // 4]] = 4.0
    for target in (0.2, 0.14, 0.1, 0.07, 0.05, 0.035, 0.025):
        cfg = TurboQuantConfig(key_bits=4, value_bits=4, decay_key_bits=3, decay_value_bits=2, norm_bits=norm_bits,
                               key_error=target, key_half_steps=True, protect_factor=None, **DECAY)
        cache = TurboQuantKVCache(cfg, head_dim=dim)
        r = np.random.default_rng(seed)
        kv = lambda n, s: (mx.array(r.standard_normal((B, 2, n, dim)).astype(np.float32) * s)).astype(dtype)  # noqa: E731
        keys, values = cache.update_and_fetch(kv(300, spread), kv(300, 1.0))
        learned(mx.concatenate([kv(300, 1.0)] * 2, axis=1).astype(mx.float32), keys, values, dim**-0.5)
        keys, values = cache.update_and_fetch(kv(L, spread), kv(L, 1.0))
        if cache.key_bits != int(cache.key_bits):
            assert keys.decayed.quantizer.bits == cache.key_bits - 1 and keys.decayed.perm is keys.perm
            return keys, values
    pytest.fail("no target gave a half step")


@pytest.mark.emulator
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("kernel,dim,L,mask", [("decode", 64, 1, None), ("decode", 128, 3, "causal"),
                                               ("prefill", 64, 40, "causal")], ids=ids)
def test_half_step_keys_decayed_in_their_groups_match_reference(emulator, schedule, kernel, dim, L, mask):
    # keys widened by a half step: two channel groups (their own rotations, one channel order) at both ages, so
    # the decayed span shares the fresh codes' rotated query; pass 1 runs per span, as for whole widths
    keys, values = half_step_views(dim, L)
    assert span_counts(keys, values) == [keys.n_decayed, keys.n_fresh]
    rng = np.random.default_rng(L)
    q = normal(rng, (1, 4, L, dim), mx.float16)
    f = Emu(schedule, seed=7)
    kw = dict(split_tokens=64) if kernel == "decode" else {}
    got, want = run(kernel, q, keys, values, mask, None, f, **kw)
    assert_close(got, want, mx.float16, schedule)
    assert len(f.stats("tq_decode_partial")) == 2


@pytest.mark.emulator
def test_dispatch_takes_the_kernels_on_half_step_keys(emulator):
    keys, values = half_step_views(64, 1)
    K.set_backend("metal")
    K.set_kernel_factory(Emu())
    q = normal(np.random.default_rng(0), (1, 4, 1, 64), mx.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every self-check passes
        got = K.dispatch_attention(q, keys, values, 0.125, None)
    assert_close(got, K.decode_attention_reference(q, keys, values, 0.125, None), mx.float16)
    assert all(why is None for why in K.self_check_status().values())
