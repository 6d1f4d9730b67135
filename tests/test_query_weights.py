"""Query-aware key weights (TurboQuantConfig(weigh_keys=True), tq_mlx.stream.calibration.query_weights).

* query_weights: w² ∝ rms(q)/rms(k) per channel (per RoPE pair), geometric mean 1, bounded; exact scores;
* the stream takes the queries of its calibration tokens from its cache's learning step (observe): whether the prompt comes in
  one piece, in chunks or token by token, the weights and the codes are the same; a first compression coded
  before its queries came is coded again before anything attends it, and no float copy is kept once attention
  ran; where queries and keys load different channels, the weights cut the attention error;
* state keeps the weights (and the queries summed before calibration); trim, float fetches and K=V layers;
* the attention kernels and dequantize divide by the weights under the CPU MSL emulator.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

import mlx.core as mx
import tq_mlx.attention.reference

from tests.support.kernel_cases import (  # noqa: F401  (_clean_dispatch and emulator: the same fixtures)
    Emu, _clean_dispatch, assert_close, emulator, normal,
)
from tests.test_rope import model_rope, rope_views
from tq_mlx import attention as K
from tq_mlx import TurboQuantConfig, TurboQuantKVCache
from tq_mlx.config import KEY_ERROR, KEY_OUTPUT_ERROR
from tq_mlx.attention.reference import turboquant_attention
from tq_mlx.batch import learned
from tq_mlx.models.rope import probe
from tq_mlx.stream.calibration import WEIGHT_RANGE, query_weights
from tq_mlx.stream.view import decode as stream_decode
from tests.support.learning import learning

# the caches learn from the queries first, as the attention hook runs it (attention itself only reads)
turboquant_attention = learning(turboquant_attention)

D = 64


def anisotropic(rng, B, H, n, spread, shift=0.0, seed=0):
    """Tokens whose channel c has standard deviation spread[c] (plus a fixed offset per channel)."""
    off = np.random.default_rng(seed).normal(size=(1, H, 1, D)) * shift
    return mx.array(rng.normal(size=(B, H, n, D)) * spread + off, dtype=mx.float32)


def spreads(seed=1):
    """Key and query channel scales that load different channels (keys: the first half, queries the last)."""
    r = np.random.default_rng(seed)
    k = np.exp(r.normal(size=D) * 0.8)
    k[: D // 2] *= 4
    q = np.exp(r.normal(size=D) * 0.8)
    q[D // 2 :] *= 4
    return k, q


def tokens(seed, T, q_heads=4, shift=0.0, q_gain=1.0):
    """keys (1, 2, T, D) loading the first channels, values, and queries (1, q_heads, T, D) loading the last."""
    rng = np.random.default_rng(seed)
    ks, qs = spreads(seed)
    keys = anisotropic(rng, 1, 2, T, ks, shift=shift)
    values = mx.array(rng.normal(size=(1, 2, T, D)), dtype=mx.float32)
    return keys, values, anisotropic(rng, 1, q_heads, T, qs) * q_gain


def cfg(**kw):
    # (prefill not read as decode: the attention checked is the one over what the cache holds)
    return TurboQuantConfig(**(dict(key_bits=3, value_bits=4, window=32, calibration_tokens=None, compress_block=8, sinks=2, step=32,
                                    weigh_keys=True, prefill_as_decode=False) | kw))


def run_cache(config, keys, values, queries, chunks, rope=None, attend=True):
    """Feed keys/values (B, H, T, D) in chunks, attending each chunk with its queries; returns the cache and
    the outputs, in token order."""
    cache = TurboQuantKVCache(config, head_dim=D, rope=rope)
    outs, at = [], 0
    for L in chunks:
        kh, vh = cache.update_and_fetch(keys[:, :, at : at + L], values[:, :, at : at + L])
        if attend:
            outs.append(turboquant_attention(queries[:, :, at : at + L], kh, vh, D**-0.5,
                                             "causal" if L > 1 else None))
        at += L
    return cache, (mx.concatenate(outs, axis=2) if outs else None)


def float_attention(queries, keys, values):
    q, k, v = (np.asarray(a).astype(np.float64) for a in (queries, keys, values))
    R = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, R, axis=1), np.repeat(v, R, axis=1)
    s = (q @ k.swapaxes(-1, -2)) * D**-0.5
    T = k.shape[2]
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


# ===================================================================================== query_weights
def test_weights_follow_the_queries_over_the_keys():
    rng = np.random.default_rng(0)
    ks, qs = spreads()
    calib = anisotropic(rng, 2, 2, 400, ks)
    q = anisotropic(rng, 2, 2, 400, qs)
    w = query_weights(mx.sum(q * q, axis=2), calib, None)
    assert w.shape == (2, 2, D) and w.dtype == mx.float32
    logw = np.log(np.asarray(w))
    assert np.allclose(logw.mean(-1), 0, atol=1e-5)  # geometric mean 1
    want = np.log(qs / ks) / 4  # w² ∝ (rms(q)/rms(k))^½
    want -= want.mean()
    assert np.abs(logw - want).max() < 0.1
    # bounded: a channel no query looks at, and one the keys never use
    qz = np.asarray(mx.sum(q * q, axis=2)).copy()
    qz[..., 0] = 0
    kz = np.asarray(calib).copy()
    kz[..., 1] = 0
    w = np.asarray(query_weights(mx.array(qz), mx.array(kz), None))
    assert np.isfinite(w).all() and w.min() >= 1 / WEIGHT_RANGE - 1e-6 and w.max() <= WEIGHT_RANGE + 1e-4


def test_weights_are_one_per_rope_pair():
    rope = probe(model_rope(D), D)
    rng = np.random.default_rng(1)
    ks, qs = spreads(2)
    w = np.asarray(query_weights(mx.sum(anisotropic(rng, 1, 2, 300, qs) ** 2, axis=2),
                                 anisotropic(rng, 1, 2, 300, ks), rope))
    order = np.asarray(rope.order)
    P = rope.freqs.shape[0]
    assert np.allclose(w[..., order[:P]], w[..., order[P : 2 * P]])
    assert w.std() > 0.1  # and not all one


# ============================================================================ the stream and its cache
def test_feeding_does_not_change_weights_or_codes():
    T = 90
    keys, values, queries = tokens(3, T, q_heads=6, shift=1.0)
    caches = {name: run_cache(cfg(), keys, values, queries, chunks)[0]
              for name, chunks in (("one", [T]), ("chunks", [20, 25, 45]), ("tokens", [1] * T))}
    ref = caches["one"].key_stream
    assert ref.weights is not None and ref.query_sums.total is None and ref.query_sums.pending is None
    for name, c in caches.items():
        s = c.key_stream
        assert np.allclose(np.asarray(s.weights), np.asarray(ref.weights), rtol=1e-5), name
        assert np.array_equal(np.asarray(s.codes.codes[:, :, : s.n_fresh]),
                              np.asarray(ref.codes.codes[:, :, : ref.n_fresh])), name


def test_first_compression_is_coded_again_before_it_is_attended():
    keys, values, queries = tokens(4, 80)
    cache = TurboQuantKVCache(cfg(key_error=None), head_dim=D)  # widths by error: their own tests below
    kh, vh = cache.update_and_fetch(keys, values)  # one chunk: its queries come with its attention
    s = cache.key_stream
    assert kh.learn is not None and kh.weights is None and s.query_sums.pending is not None
    with pytest.raises(ValueError, match="learns from the queries"):  # attention only reads: learning comes first
        tq_mlx.attention.reference.turboquant_attention(queries, kh, vh, D**-0.5, "causal")
    out = turboquant_attention(queries, *learned(queries, kh, vh, D**-0.5), D**-0.5, "causal")
    assert s.query_sums.pending is None and s.query_sums.total is None and s.weights is not None  # no float copy left behind
    k2, _ = cache.keys_and_values()
    assert k2.learn is None and k2.weights is s.weights
    # the output is attention over the codes the stream now holds
    again = turboquant_attention(queries, k2, vh, D**-0.5, "causal")
    assert float(mx.max(mx.abs(out - again))) < 1e-5
    # and nbytes holds the weights: B·H·D float32
    off = TurboQuantKVCache(cfg(weigh_keys=False, key_error=None), head_dim=D)
    off.update_and_fetch(keys, values)
    assert cache.nbytes - off.nbytes == 4 * 2 * D


def test_weights_cut_the_attention_error():
    T = 300
    keys, values, queries = tokens(5, T, shift=1.0, q_gain=3.0)
    want = float_attention(queries, keys, values)[:, :, -64:]
    err = {}
    for weigh in (True, False):
        # 8-bit values: the error left is the keys'
        _, out = run_cache(cfg(weigh_keys=weigh, value_bits=8), keys, values, queries, [T - 64] + [1] * 64)
        got = np.asarray(out)[:, :, -64:]
        err[weigh] = np.sqrt(np.mean((got - want) ** 2))
    assert err[True] < 0.8 * err[False], err


def test_state_round_trip_before_and_after_calibration():
    T = 100
    keys, values, queries = tokens(6, T)
    whole, _ = run_cache(cfg(), keys, values, queries, [20, 80])
    # saved after 20 tokens: queries summed, no weights yet; the loaded cache goes on as the whole one did
    first, _ = run_cache(cfg(), keys, values, queries, [20])
    meta, arrays = first.state
    assert arrays["k_queries"] is not None and arrays["k_weights"] is None and meta["version"] >= 9
    loaded = TurboQuantKVCache()
    loaded.state = (meta, arrays)
    kh, vh = loaded.update_and_fetch(keys[:, :, 20:], values[:, :, 20:])
    turboquant_attention(queries[:, :, 20:], kh, vh, D**-0.5, "causal")
    assert np.allclose(np.asarray(loaded.key_stream.weights), np.asarray(whole.key_stream.weights), rtol=1e-5)
    # saved after calibration: the weights, and no queries
    meta, arrays = whole.state
    assert arrays["k_weights"] is not None and arrays["k_queries"] is None and arrays["v_weights"] is None
    again = TurboQuantKVCache()
    again.state = (meta, arrays)
    assert np.array_equal(np.asarray(again.key_stream.weights), np.asarray(whole.key_stream.weights))
    bad = dict(arrays, k_weights=mx.ones((1, 2, D + 1)))
    with pytest.raises(ValueError, match="k_weights"):
        TurboQuantKVCache().state = (meta, bad)


def test_queries_summed_on_a_worker_thread_can_be_saved_from_another(tmp_path):
    # tq-chat attends on a worker thread (its own stream) and saves from the app's: the queries summed before
    # calibration feed no output, so the stream has them computed where attention ran instead of leaving a graph
    # that only the worker's stream can run (and that would grow by one step per token)
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    keys, values, queries = tokens(0, 20)
    mx.eval(keys, values, queries)
    held = {}

    def work():
        with mx.stream(mx.new_stream(mx.cpu)):  # the worker's own, as tq-chat's generation thread has
            cache, out = run_cache(cfg(), keys, values, queries, [12, 1, 1])
            mx.eval(out)
        held["cache"] = cache

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    cache = held["cache"]
    assert cache.key_stream.query_sums.total is not None and cache.key_stream.weights is None  # 14 tokens: calibrating
    save_prompt_cache(str(tmp_path / "c.safetensors"), [cache])
    loaded = load_prompt_cache(str(tmp_path / "c.safetensors"))[0]
    assert mx.array_equal(loaded.key_stream.query_sums.total, cache.key_stream.query_sums.total)


def test_trim_forgets_what_it_cannot_take_back():
    keys, values, queries = tokens(7, 100)
    cache, _ = run_cache(cfg(), keys, values, queries, [20])
    s = cache.key_stream
    assert s.query_sums.total is not None and s.query_sums.end == 20
    cache.trim(5)  # back into the calibration tokens: their queries are summed in and cannot come out
    assert s.query_sums.total is None and s.query_sums.start == s.query_sums.end == 15
    cache, _ = run_cache(cfg(), keys, values, queries, [100])
    cache.trim(cache.offset - 2)  # every token but the sinks: the calibration and the weights go
    assert cache.key_stream.weights is None and cache.key_stream.mean is None


def test_float_fetches_and_k_eq_v_layers_do_not_weigh():
    for cache in (TurboQuantKVCache(cfg(), head_dim=D, fetch="float"),
                  TurboQuantKVCache(cfg(), head_dim=D, derive_keys=lambda v: v),
                  TurboQuantKVCache(cfg(weigh_keys=False), head_dim=D)):
        assert not cache.key_stream.weigh
    with pytest.raises(ValueError, match="weigh_keys"):
        TurboQuantConfig(weigh_keys="yes")


# ====================================================================================== the kernels
def weighted(views, seed=0):
    keys, values = views
    w = mx.exp(normal(np.random.default_rng(seed), (keys.sinks.shape[0] if keys.sinks is not None else 1,
                                                    keys.n_heads, keys.head_dim)) * 0.5)
    return keys._replace(weights=w, decayed=keys.decayed and keys.decayed._replace(weights=w)), values


@pytest.mark.emulator
@pytest.mark.parametrize("kernel,L,decay,kb", [("decode", 1, False, 4), ("decode", 2, True, 4), ("prefill", 20, True, 4),
                                              ("decode", 1, False, 8), ("prefill", 20, False, 8)])
def test_kernels_divide_the_query_by_the_weights(emulator, kernel, L, decay, kb):
    # kb = 8: the quality preset's keys (8-bit, weighed, centered before RoPE) beside 4-bit values
    keys, values = weighted(rope_views(64, 1, L, mx.float16, decay=decay, key_bits=kb, value_bits=4))
    assert keys.codes is not None and keys.quantizer.bits == kb
    q = normal(np.random.default_rng(L), (1, 4, L, 64), mx.float16)
    mask = "causal" if L > 1 else None
    launch = K.decode_attention if kernel == "decode" else K.prefill_attention
    f = Emu()
    got = launch(q, keys, values, 0.125, mask, None, metal_kernel=f)
    want = K.decode_attention_reference(q, keys, values, 0.125, mask, None)
    assert_close(got, want, mx.float16)
    plain = K.decode_attention_reference(q, keys._replace(weights=None, decayed=keys.decayed and keys.decayed._replace(
        weights=None)), values, 0.125, mask, None)
    assert float(mx.max(mx.abs(plain.astype(mx.float32) - want.astype(mx.float32)))) > 0.01  # they matter


@pytest.mark.emulator
def test_dispatch_and_dequantize_with_weights(emulator):
    keys, values = weighted(rope_views(64, 1, 20, mx.float16, decay=True))
    f = Emu()
    K.set_kernel_factory(f)
    K.set_backend("metal")
    q = normal(np.random.default_rng(9), (1, 4, 20, 64), mx.float16)
    got = K.dispatch_attention(q, keys, values, 0.125, "causal")
    assert_close(got, turboquant_attention(q, keys, values, 0.125, "causal"), mx.float16)
    status = K.self_check_status()
    assert any(k == "prefill_attention" and v[-5] is True and why is None for (k, v), why in status.items())
    deq = K.dispatch_dequantize(keys, mx.float32)
    assert float(mx.max(mx.abs(deq - stream_decode(keys, mx.float32)))) < 1e-3 * max(
        1.0, float(mx.max(mx.abs(deq))))
    assert math.isfinite(float(mx.sum(deq)))


@pytest.mark.parametrize("kb,qjl,center", [(4, False, "rope"), (3, False, True), (2.5, False, True), (3, True, False)])
def test_attention_on_weighted_codes_matches_float64(kb, qjl, center):
    from tests.test_attention import attended, dequantized, feed, reference_attention, rel_err

    rng = np.random.default_rng(int(4 * kb))
    B, H, R = 2, 2, 3
    config = TurboQuantConfig(key_bits=kb, value_bits=3, qjl=qjl, window=8, calibration_tokens=None, compress_block=4, sinks=3, step=16,
                              center_keys=center, weigh_keys=True, prefill_as_decode=False)
    rope = probe(model_rope(D), D) if center == "rope" else None
    cache = TurboQuantKVCache(config, layer_index=1, head_dim=D, rope=rope)
    for L, (kh, vh) in feed(cache, rng, (7, 1, 20, 1, 3, 9), B, H, D):
        q = mx.array(2 * rng.normal(size=(B, H * R, L, D)), dtype=mx.float32)
        mask = "causal" if L > 1 else None
        out = turboquant_attention(q, kh, vh, D**-0.5, mask, tile_tokens=5)
        k = attended(kh, q)
        K = dequantized(k) if rope is None else None
        if rope is not None:  # centered before RoPE: the reference codec adds R(p) μ0 back
            K = np.concatenate([np.asarray(a.astype(mx.float32)).astype(np.float64) for a in
                                (k.sinks, stream_decode(k, mx.float32) if k.n_coded else None, k.window)
                                if a is not None], axis=2)
        assert rel_err(out, reference_attention(q, K, dequantized(vh), D**-0.5, mask)) < 2e-5, L
    assert cache.key_stream.weights is not None and cache.n_coded > 10


# ===================================================================================== key widths by error
from tq_mlx.stream.calibration import key_width, logit_error  # noqa: E402
from tq_mlx.quant.codebook import lloyd_max  # noqa: E402
from tq_mlx.planner.display import bits_summary, describe_config  # noqa: E402
from tq_mlx.quant.quantizer import TurboQuantMSE  # noqa: E402


def weighed_sample(seed):
    """Anisotropic queries (1, 2, 3000, D), their key weights and the weighed keys (1, 2, 2000, D)."""
    rng = np.random.default_rng(seed)
    ks, qs = spreads(seed)
    x = anisotropic(rng, 1, 2, 2000, ks)
    q = anisotropic(rng, 1, 2, 3000, qs)
    w = query_weights(mx.sum(q * q, axis=2), x, None)
    return q, w, x * w[:, :, None]


def logit_rms(q, err):
    """The RMS of 0.3·q·e over 500 queries and every key error e (model basis), per kv head."""
    return np.sqrt(np.mean(np.asarray(0.3 * (q[:, :, :500] @ err.swapaxes(-1, -2))) ** 2, axis=(2, 3)))


@pytest.mark.parametrize("bits", [4, 5, 6])
def test_logit_error_predicts_the_error_the_codes_give(bits):
    # anisotropic keys and queries, weighed: logit_error x sqrt(D_mse(b)) is the RMS of scale·(q/w)·(k̃ - k) that
    # real codes at b bits give those queries, to the rounding of a sample (and the codes' norm error)
    q, w, xw = weighed_sample(3)
    unit = logit_error(xw, w, mx.sum(q * q, axis=2), 3000, scale=0.3)
    quant = TurboQuantMSE(D, bits, seed=0)
    measured = logit_rms(q, (quant.dequantize(quant.quantize(xw)) - xw) / w[:, :, None])
    predicted = np.asarray(unit) * math.sqrt(lloyd_max(D, bits).mse)
    assert np.allclose(predicted, measured, rtol=0.12), (predicted, measured)
    # the default scale is 1/sqrt(D)
    assert np.allclose(np.asarray(logit_error(xw, w, mx.sum(q * q, axis=2), 3000)),
                       np.asarray(unit) / 0.3 * D**-0.5, rtol=1e-6)


def test_key_width_is_the_fewest_bits_whose_error_is_under_the_target():
    e = {b: math.sqrt(lloyd_max(D, b).mse) for b in (3, 4, 5, 6)}
    assert key_width(1.0, (4, 5, 6), e[4] * 1.01, D) == 4
    assert key_width(1.0, (4, 5, 6), e[4] * 0.99, D) == 5
    assert key_width(1.0, (4, 5, 6), e[5] * 0.99, D) == 6
    assert key_width(1.0, (4, 5, 6), e[6] * 0.5, D) == 6  # none is: the most
    assert key_width(1.0, (3, 4, 5, 6), e[3] * 1.01, D) == 3
    assert key_width(1.0, (6,), 1e-9, D) == 6


def test_key_width_takes_half_steps_by_the_groups_errors():
    from tq_mlx.plan import Widen

    # a half step (b.5) errs sqrt(u0² D(d/4, b+1) + u1² D(3d/4, b)): with the energy in the first group it
    # comes before the next whole width; without split, whole widths only
    d = {b: lloyd_max(D // 4, b).mse for b in (4, 5, 6)} | {(3, b): lloyd_max(3 * D // 4, b).mse for b in (4, 5)}
    HALF = Widen(0.1, 6, 0.5).widths(4)
    assert HALF == (4, 4.5, 5, 5.5, 6) and Widen(0.1, 6).widths(4) == (4, 5, 6)
    u = np.array([[1.0, 1.2]])  # the worst kv head's whole error is its own, not the other's
    split = np.array([[[0.8, 0.5], [1.0, 0.7]]])
    half = math.sqrt(max(0.8**2 * d[5] + 0.5**2 * d[(3, 4)], 1.0**2 * d[5] + 0.7**2 * d[(3, 4)]))
    e4 = 1.2 * math.sqrt(lloyd_max(D, 4).mse)
    assert half < e4
    assert key_width(u, HALF, e4 * 1.01, D, split) == 4
    assert key_width(u, HALF, half * 1.01, D, split) == 4.5
    assert key_width(u, (4, 5, 6), half * 1.01, D) == 5  # whole steps
    assert key_width(u, HALF, half * 0.99, D, split) == 5
    assert key_width(u, HALF, 1e-9, D, split) == 6


def test_group_logit_errors_predict_the_error_half_step_codes_give():
    # keys whose energy sits in a quarter of the channels: group_logit_errors' two unit errors, with D_mse of each
    # group's codes, give the RMS logit error that real K4.5 codes (that quarter at 5 bits) give the queries
    from tq_mlx.stream.calibration import group_logit_errors, outlier_order

    q, w, xw = weighed_sample(5)
    quant = TurboQuantMSE(D, 4.5, seed=0)
    perm = outlier_order(xw, None, quant)
    u = np.asarray(group_logit_errors(xw, w, mx.sum(q * q, axis=2), 3000, perm, scale=0.3))
    order = mx.broadcast_to(perm[None, :, None, :], xw.shape)
    xp = mx.take_along_axis(xw, order, axis=-1)
    err = mx.take_along_axis(quant.dequantize(quant.quantize(xp)) - xp, mx.argsort(order, axis=-1), axis=-1)
    measured = logit_rms(q, err / w[:, :, None])
    predicted = np.sqrt(u[..., 0] ** 2 * lloyd_max(D // 4, 5).mse + u[..., 1] ** 2 * lloyd_max(3 * D // 4, 4).mse)
    assert np.allclose(predicted, measured, rtol=0.12), (predicted, measured)
    whole = np.asarray(logit_error(xw, w, mx.sum(q * q, axis=2), 3000, scale=0.3)) * math.sqrt(lloyd_max(D, 4).mse)
    assert np.all(predicted < whole)  # the energy's quarter at one more bit: less error than K4


def widened(key_error, chunks=(300,), **kw):
    keys, values, queries = tokens(11, sum(chunks), q_gain=0.1)
    config = cfg(key_bits=4, value_bits=4, decay_after=96, decay_key_bits=3, decay_value_bits=2,
                 key_error=key_error, protect_factor=None, **kw)
    return run_cache(config, keys, values, queries, list(chunks))[0]


def test_keys_take_the_bits_their_error_asks_for_and_decay_a_step():
    # these keys and queries give a logit error of 0.101 / 0.052 / 0.026 at K4 / K5 / K6
    for target, bits, decay in [(None, 4, 3), (1.0, 4, 3), (0.07, 5, 4), (0.03, 6, 5), (1e-4, 6, 5)]:
        c = widened(target)
        assert (c.key_bits, c.decay_bits, c.key_stream.widened) == (bits, (decay, 2), bits != 4), target
        assert c.key_stream.decayed is not None and c.key_stream.view().decayed.quantizer.bits == decay
        assert c.n_decayed[0] > 0 and c.value_bits == 4
        assert bits_summary([c]) == f"K{bits}→{decay}/V4→2 after 96 on its 1 attention layer"
    assert "keys up to K6 where their logit error exceeds 0.03" in describe_config(cfg(key_error=0.03))
    assert "keys up to" not in describe_config(cfg(key_error=None))
    # automatic: where the keys are weighed integer MSE codes at K4 and their output error does not choose
    # (key_output_error off), and nowhere else
    assert cfg(key_bits=4, key_output_error=None).key_error == TurboQuantConfig(key_output_error=None).key_error == KEY_ERROR
    assert TurboQuantConfig().key_error is None  # the default: the output error's
    assert cfg(key_bits=4, calibration_tokens=64).key_error is None  # ... where the first window can measure it
    assert cfg(key_bits=4).key_error == KEY_ERROR  # ... and where it cannot (the window itself): the logit error's
    assert cfg(key_bits=4, weigh_keys=False).key_error is None and cfg(key_bits=4, qjl=True).key_error is None
    assert cfg().key_error is None and cfg(key_bits=5).key_error is None  # a width you set is kept
    assert cfg(key_error=0.2).key_error == 0.2  # ... unless you ask


def test_keys_widen_by_half_steps_and_decay_in_their_groups():
    # key_half_steps: these keys' error asks for more than K4; K4.5 (a quarter of the channels at 5 bits) holds
    # a target K4 misses, decaying to K3.5 in the same channel groups and rotations (one basis)
    from tq_mlx.plan import layer_bytes

    for target, bits, decay in [(1.0, 4, 3), (0.09, 4.5, 3.5), (0.05, 5.5, 4.5), (1e-4, 6, 5)]:
        c = widened(target, key_half_steps=True)
        s = c.key_stream
        assert (c.key_bits, c.decay_bits) == (bits, (decay, 2)), target
        assert (s.perm is not None) == (bits != int(bits))
        view = s.view()
        assert view.decayed.quantizer.bits == decay and view.decayed.perm is view.perm
        assert [g.dim for g in view.quantizer.groups] == [g.dim for g in view.decayed.quantizer.groups]
        width = bits if bits != 4 else None
        assert c.nbytes == layer_bytes(c.plan, c.offset, 2, D, D, float_bytes=4, key_width=width)
        # the loaded cache holds the same width, bytes and codes
        again = TurboQuantKVCache()
        again.state = c.state
        assert (again.key_bits, again.decay_bits, again.nbytes) == (bits, (decay, 2), c.nbytes)
        assert np.array_equal(np.asarray(again.key_stream.perm), np.asarray(s.perm)) if s.perm is not None else True
    assert widened(0.09).key_bits == 5  # whole steps: the next whole width
    assert "in half steps" in describe_config(cfg(key_error=0.03, key_half_steps=True))
    meta, arrays = widened(0.09, key_half_steps=True).state
    with pytest.raises(ValueError, match="to 4, 4.5, 5, 5.5, 6 bits"):
        TurboQuantKVCache().state = (dict(meta, key_bits=6.5), arrays)
    with pytest.raises(ValueError, match="to 4, 5, 6 bits"):
        TurboQuantKVCache().state = (dict(meta, config=dict(meta["config"], key_half_steps=False)), arrays)


@pytest.mark.parametrize("traditional", [False, True])
def test_half_step_groups_keep_rope_pairs_whole(traditional):
    # with the layer's RoPE, the channel order ranks pairs: each pair's two channels in one group, since the
    # position turns a pair's energy from one channel to the other
    from tq_mlx.stream.calibration import outlier_order

    rope = probe(model_rope(D, traditional=traditional), D)
    P = rope.freqs.shape[0]
    order = np.asarray(rope.order)
    partner = {int(order[i]): int(order[i + P]) for i in range(P)} | {int(order[i + P]): int(order[i]) for i in range(P)}
    x = anisotropic(np.random.default_rng(2), 1, 2, 200, np.exp(np.random.default_rng(3).normal(size=D)))
    for r, whole in ((rope, True), (None, False)):
        perm = np.asarray(outlier_order(x, None, TurboQuantMSE(D, 4), always=True, rope=r))
        top = [set(map(int, h[: D // 4])) for h in perm]
        assert all(all(partner[c] in t for c in t) for t in top) == whole


def test_attention_on_half_step_keys_is_their_decoded_keys_attention():
    # the reference attention reads the grouped, permuted, decayed codes as their decoded keys say
    keys, values, queries = tokens(11, 300, q_gain=0.1)
    config = cfg(key_bits=4, value_bits=4, decay_after=96, decay_key_bits=3, decay_value_bits=2, key_error=0.09,
                 protect_factor=None, key_half_steps=True)
    cache = TurboQuantKVCache(config, head_dim=D)
    kh, vh = cache.update_and_fetch(keys, values)
    out = turboquant_attention(queries, kh, vh, D**-0.5, "causal")
    kh, vh = cache.update_and_fetch(keys[:, :, :0], values[:, :, :0])  # the view once the queries came
    assert cache.key_bits == 4.5 and kh.decayed is not None and kh.n_tokens == 300
    out = turboquant_attention(queries, kh, vh, D**-0.5, "causal")
    whole = lambda v: mx.concatenate([v.sinks.astype(mx.float32), stream_decode(v, mx.float32),  # noqa: E731
                                      v.window.astype(mx.float32)], axis=2)
    want = float_attention(queries, whole(kh), whole(vh))
    assert np.allclose(np.asarray(out), want, atol=2e-4), np.abs(np.asarray(out) - want).max()


def test_the_width_does_not_depend_on_how_the_prompt_is_fed():
    # the first compression of a prompt fed in one piece comes before its calibration queries: it codes at
    # the configured bits and again at the chosen ones when they come
    one, chunks, tokens_ = widened(0.07), widened(0.07, (40, 1, 1, 100, 158)), widened(0.07, (1,) * 60 + (240,))
    assert one.key_bits == chunks.key_bits == tokens_.key_bits == 5
    assert np.array_equal(np.asarray(one.key_stream.view().codes.codes), np.asarray(chunks.key_stream.view().codes.codes))


def test_unweighed_keys_keep_their_bits_and_a_trim_chooses_again():
    c = widened(1e-4, weigh_keys=False)
    assert c.key_bits == 4 and c.key_stream.widen is None
    c = widened(1e-4)
    assert c.key_bits == 6
    c.trim(c.offset)  # no compressed token left: calibration, weights and width go
    assert c.key_bits == 4 and c.decay_bits == (3, 2)


def test_widened_state_round_trips_before_and_after_the_choice():
    keys, values, queries = tokens(11, 300, q_gain=0.1)
    config = cfg(key_bits=4, value_bits=4, decay_after=96, decay_key_bits=3, decay_value_bits=2, key_error=0.07,
                 protect_factor=None)
    whole, _ = run_cache(config, keys, values, queries, [20, 280])
    # after the choice: the file says K5 and its codes are K5's
    meta, arrays = whole.state
    assert meta["key_bits"] == 5
    again = TurboQuantKVCache()
    again.state = (meta, arrays)
    assert (again.key_bits, again.decay_bits, again.nbytes) == (5, (4, 2), whole.nbytes)
    with pytest.raises(ValueError, match="keys at 7 bits"):
        TurboQuantKVCache().state = (dict(meta, key_bits=7), arrays)
    with pytest.raises(ValueError, match="widen only with key_error"):
        TurboQuantKVCache().state = (dict(meta, config=dict(meta["config"], key_error=None)), arrays)
    # before it: the queries summed and how many they were; the loaded cache chooses as the whole one did
    first, _ = run_cache(config, keys, values, queries, [20])
    meta, arrays = first.state
    assert meta["query_count"] == 18 * 2  # 18 calibration positions x 2 query heads per kv head
    loaded = TurboQuantKVCache()
    loaded.state = (meta, arrays)
    kh, vh = loaded.update_and_fetch(keys[:, :, 20:], values[:, :, 20:])
    turboquant_attention(queries[:, :, 20:], kh, vh, D**-0.5, "causal")
    assert loaded.key_bits == 5 and loaded.nbytes == whole.nbytes


def test_key_error_is_validated_and_derived():
    from tq_mlx.config import derive_config

    for bad in (0, -1, True, "0.1"):
        with pytest.raises(ValueError, match="key_error must be a number > 0"):
            TurboQuantConfig(key_error=bad)
    with pytest.raises(ValueError, match="key_error needs integer key_bits without QJL"):
        TurboQuantConfig(key_bits=3.5, key_error=0.1)
    with pytest.raises(ValueError, match="key_error needs integer key_bits without QJL"):
        TurboQuantConfig(key_bits=3, qjl=True, key_error=0.1)
    base = TurboQuantConfig(key_error=0.2)  # asked for: kept at any integer MSE width
    assert derive_config(base, key_bits=3.5).key_error is None and derive_config(base, qjl=True, key_bits=3).key_error is None
    assert derive_config(base, key_bits=5).key_error == 0.2
    # the automatic one (0.1 at K4 where the output error does not choose) follows the width: a width you set is kept
    off = TurboQuantConfig(key_output_error=None)
    assert derive_config(off, key_bits=5).key_error is None
    assert derive_config(off, key_bits=4).key_error == KEY_ERROR
    assert derive_config(derive_config(TurboQuantConfig(), key_bits=5), key_bits=4).key_output_error == KEY_OUTPUT_ERROR
    assert TurboQuantConfig.from_dict(off.to_dict() | {"key_error": 0.2}).key_error == 0.2


def test_the_width_reads_one_number_per_stream_and_decode_then_reads_none(monkeypatch):
    # key_error chooses widths (auto at K4, the output error off): the first compression reads its logit error back once, as key
    # protection reads its factor; every later update and attention builds its graph without a host sync.
    import tq_mlx.stream.compressed as stream
    from tests.support.host_sync import forbid_host_sync

    reads = []
    real = stream.key_width

    def counted(*a):
        reads.append(a)
        return real(*a)

    monkeypatch.setattr(stream, "key_width", counted)
    config = cfg(key_bits=4, protect_factor=None, decay_after=64, decay_key_bits=3, key_output_error=None)
    assert config.key_error == KEY_ERROR  # auto at K4
    keys, values, queries = tokens(11, 140, q_gain=0.1)
    cache, _ = run_cache(config, keys[:, :, :40], values[:, :, :40], queries[:, :, :40], [40])
    assert len(reads) == 1 and cache.key_stream.widened  # these keys err 0.101 at K4 (widened above)
    with forbid_host_sync(monkeypatch):
        at = 40
        for L in (1, 1, 9, 1, 40, 1):  # decode steps, window flushes, a chunk, tokens decaying past 64
            kh, vh = cache.update_and_fetch(keys[:, :, at : at + L], values[:, :, at : at + L])
            turboquant_attention(queries[:, :, at : at + L], kh, vh, D**-0.5, "causal" if L > 1 else None)
            at += L
        _ = cache.state, cache.nbytes
    assert len(reads) == 1 and cache.n_decayed[0] > 0


# ===================================================================================== keys by their output error
from tq_mlx.stream.calibration import output_errors  # noqa: E402
from tq_mlx.stream.view import first_tokens  # noqa: E402

SPAN_CFG = dict(key_bits=4, value_bits=4, window=32, calibration_tokens=96, protect_factor=None, decay_after=96,
                decay_key_bits=3, decay_value_bits=2)  # sinks 2: the span is positions 66 .. 97


def by_output(target, chunks=(300,), **kw):
    keys, values, queries = tokens(11, sum(chunks))
    return run_cache(cfg(**(SPAN_CFG | dict(key_output_error=target) | kw)), keys, values, queries, list(chunks))[0]


def float64_output_errors(queries, keys, coded, values, sinks, first, last, window, side="keys"):
    """Per kv head, √(Σ‖ô − o‖² / Σ‖o‖²) over the queries of positions first .. last - 1 (all query heads), each
    reading the tokens after the sinks at least window + 1 older than itself as `coded` (keys, or with side
    "values" values), the rest as `keys` and `values`."""
    q, k, c, v = (np.asarray(a, dtype=np.float64) for a in (queries, keys, coded, values))
    G = q.shape[1] // k.shape[1]
    out = []
    for h in range(k.shape[1]):
        num = den = 0.0
        for p in range(first, last):
            j = np.arange(p + 1)
            old = (j >= sinks) & (j < p - window)
            kr = np.where(old[:, None], c[0, h, : p + 1], k[0, h, : p + 1]) if side == "keys" else k[0, h, : p + 1]
            vr = np.where(old[:, None], c[0, h, : p + 1], v[0, h, : p + 1]) if side == "values" else v[0, h, : p + 1]
            for g in range(G):
                qv = q[0, h * G + g, p] * D**-0.5
                s_exact, s = k[0, h, : p + 1] @ qv, kr @ qv
                o = np.exp(s_exact - s_exact.max()) @ v[0, h, : p + 1] / np.exp(s_exact - s_exact.max()).sum()
                oh = np.exp(s - s.max()) @ vr / np.exp(s - s.max()).sum()
                num, den = num + ((oh - o) ** 2).sum(), den + (o**2).sum()
        out.append(math.sqrt(num / den))
    return out


def test_output_errors_are_the_relative_output_error_of_reading_old_keys_as_codes():
    rng = np.random.default_rng(3)
    k = mx.array(rng.normal(size=(1, 2, 40, D)), dtype=mx.float32)
    c = k + mx.array(rng.normal(size=(1, 2, 40, D)) * 0.1, dtype=mx.float32)
    v = mx.array(rng.normal(size=(1, 2, 40, D)), dtype=mx.float32)
    q = mx.array(rng.normal(size=(1, 4, 40, D)), dtype=mx.float32)
    got = np.asarray(output_errors(q[:, :, 25:], k, [c, k], v, 3, 25, 8))
    want = float64_output_errors(q, k, c, v, 3, 25, 40, 8)
    assert np.allclose(got[0, :, 0], want, rtol=1e-4) and np.all(got[..., 1] == 0)


def test_keys_take_the_fewest_bits_whose_output_error_is_under_the_target():
    # each width's error, computed in float64 from caches coding at that width alone (the same calibration: their
    # codes are those the stream measures), sets which width each target gives
    keys, values, queries = tokens(11, 300)
    one = by_output(1.0)
    v = first_tokens(one.value_stream.view(), 98)
    errors = {}
    for b in (3, 4, 5, 6):
        c, _ = run_cache(cfg(**(SPAN_CFG | dict(key_bits=b, key_error=None, decay_key_bits=None if b == 3 else b - 1))),
                         keys, values, queries, [100])  # compressed, nothing decayed yet
        errors[b] = max(float64_output_errors(queries, keys[:, :, :98], first_tokens(c.key_stream.view(), 98), v,
                                              2, 66, 98, 32))
    assert errors[3] > errors[4] > errors[5] > errors[6] > 0, errors
    for b in (3, 4, 5, 6):
        for target in (errors[b] * 1.02, (errors[b] + errors[b - 1]) / 2 if b > 3 else 1.0):
            c = by_output(target)
            assert c.key_bits == b and c.key_stream.widened == (b != 4), (b, target, errors)
            assert c.decay_bits == (b - 1, 2) and c.key_stream.view().decayed.quantizer.bits == b - 1
    assert by_output(errors[6] / 2).key_bits == 6  # none is under it: the widest
    assert "keys K3 to K6 by their output error (at most 0.02)" in describe_config(cfg(key_output_error=0.02, calibration_tokens=96))


def test_the_output_width_does_not_depend_on_how_the_prompt_is_fed():
    cuts = [(300,), (40, 1, 1, 100, 158), (1,) * 99 + (201,), (70, 30, 200)]
    caches = [by_output(0.2, c) for c in cuts]
    assert len({c.key_bits for c in caches}) == 1 and caches[0].key_bits not in (4, 6)
    for c in caches[1:]:
        assert np.array_equal(np.asarray(c.key_stream.view().codes.codes), np.asarray(caches[0].key_stream.view().codes.codes))
    assert all(c.key_stream.span.queries is None for c in caches)  # dropped once chosen


def test_output_width_state_round_trips_while_the_queries_are_held():
    keys, values, queries = tokens(11, 300)
    config = cfg(**(SPAN_CFG | dict(key_output_error=0.2)))
    whole, _ = run_cache(config, keys, values, queries, [300])
    for cut in (50, 85, 98):
        first, _ = run_cache(config, keys, values, queries, [cut])
        meta, arrays = first.state
        held = cut > 66
        assert (arrays["k_span"] is not None) == held and meta["key_span_seen"] == ([66, cut] if held else [0, 0])
        loaded = TurboQuantKVCache()
        loaded.state = (meta, arrays)
        kh, vh = loaded.update_and_fetch(keys[:, :, cut:], values[:, :, cut:])
        turboquant_attention(queries[:, :, cut:], kh, vh, D**-0.5, "causal")
        assert loaded.key_bits == whole.key_bits and loaded.nbytes == whole.nbytes
        assert np.array_equal(np.asarray(loaded.key_stream.view().codes.codes), np.asarray(whole.key_stream.view().codes.codes))
    meta, arrays = run_cache(config, keys, values, queries, [85])[0].state
    with pytest.raises(ValueError, match="k_span: held queries, but this stream does not choose"):
        TurboQuantKVCache().state = (dict(meta, config=dict(meta["config"], key_output_error=None)), arrays)
    with pytest.raises(ValueError, match="k_span has shape"):
        TurboQuantKVCache().state = (meta, dict(arrays, k_span=arrays["k_span"][..., :8]))


def test_a_trim_forgets_the_held_queries_past_it_and_a_trim_to_nothing_chooses_again():
    keys, values, queries = tokens(11, 300)
    config = cfg(**(SPAN_CFG | dict(key_output_error=0.2)))
    c, _ = run_cache(config, keys, values, queries, [90])
    c.trim(10)
    assert c.key_stream.span_seen == (66, 80)
    c.trim(20)
    assert c.key_stream.span_seen == (0, 0)
    whole = by_output(0.2)
    whole.trim(whole.offset)
    assert whole.key_bits == 4 and whole.key_stream.span.queries is None
    # the same tokens again choose again, into code buffers of the chosen width (a trim to nothing keeps none)
    kh, vh = whole.update_and_fetch(keys, values)
    mx.eval(turboquant_attention(queries, kh, vh, D**-0.5, "causal"))
    fresh = by_output(0.2)
    assert whole.key_bits == fresh.key_bits != 4 and whole.nbytes == fresh.nbytes
    assert np.array_equal(np.asarray(whole.key_stream.view().codes.codes), np.asarray(fresh.key_stream.view().codes.codes))


def test_key_output_error_is_validated_and_derived():
    from tq_mlx.config import derive_config

    for bad in (0, -1, True, "0.1"):
        with pytest.raises(ValueError, match="key_output_error must be a number > 0"):
            TurboQuantConfig(key_output_error=bad)
    with pytest.raises(ValueError, match="key_output_error and key_error both choose"):
        TurboQuantConfig(key_output_error=0.02, key_error=0.1)
    for kw in (dict(key_bits=3.5), dict(key_bits=3, qjl=True), dict(weigh_keys=False)):
        with pytest.raises(ValueError, match="key_output_error needs weighed"):
            TurboQuantConfig(key_output_error=0.02, **kw)
    with pytest.raises(ValueError, match="needs a window of 3 or more"):
        TurboQuantConfig(key_output_error=0.02, window=2, calibration_tokens=None)
    c = TurboQuantConfig(key_output_error=0.02)  # key_error's automatic logit error gives way
    assert c.key_error is None and c.key_output_error == 0.02
    assert derive_config(c, key_bits=3.5).key_output_error is None and derive_config(c, key_bits=5).key_output_error == 0.02
    assert derive_config("default", key_output_error=0.02).key_error is None
    assert TurboQuantConfig.from_dict(c.to_dict()) == c and TurboQuantConfig.from_dict(
        TurboQuantConfig().to_dict()).key_output_error == KEY_OUTPUT_ERROR
    # a file written before the rule existed chose its widths by key_error alone
    before = {k: v for k, v in TurboQuantConfig(key_output_error=None).to_dict().items() if k != "key_output_error"}
    assert (TurboQuantConfig.from_dict(before).key_output_error, TurboQuantConfig.from_dict(before).key_error) == (None, KEY_ERROR)


def test_the_output_width_reads_one_number_and_decode_then_reads_none(monkeypatch):
    from tests.support.host_sync import forbid_host_sync

    keys, values, queries = tokens(11, 250)
    cache, _ = run_cache(cfg(**(SPAN_CFG | dict(key_output_error=0.2))), keys, values, queries, [130])
    assert cache.key_stream.widened
    with forbid_host_sync(monkeypatch):
        at = 130
        for L in (1, 1, 9, 1, 40, 1):
            kh, vh = cache.update_and_fetch(keys[:, :, at : at + L], values[:, :, at : at + L])
            turboquant_attention(queries[:, :, at : at + L], kh, vh, D**-0.5, "causal" if L > 1 else None)
            at += L
        _ = cache.state, cache.nbytes
