"""turboquant_attention against a float64 numpy reference of the same math.

The reference dequantizes every compressed token to the model basis (quantizer.dequantize, un-permute, add the
mean back), lays out sinks, compressed and window tokens in token order, and runs plain softmax attention in
float64. The codes path must agree to float32 rounding, whatever the head_dim, bit widths, QJL, centering,
GQA, batch, mask kind and block size.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from tq_mlx import StreamView, TurboQuantConfig, TurboQuantKVCache, turboquant_attention
from tests.support.learning import learning

# the caches learn from the queries first, as the attention hook runs it (attention itself only reads)
turboquant_attention = learning(turboquant_attention)


def dequantized(h: StreamView) -> np.ndarray:
    """(B, H, T, D) float64: what the handle stands for, in token order (sinks, compressed, window)."""
    parts = []
    if h.sinks is not None:
        parts.append(np.asarray(h.sinks.astype(mx.float32)).astype(np.float64))
    if h.codes is not None:
        x = np.asarray(h.quantizer.dequantize(h.codes)).astype(np.float64)
        if h.scale is not None:
            x = x * np.asarray(h.scale).astype(np.float64)[:, :, None, None]
        if h.perm is not None:
            inv = np.argsort(np.asarray(h.perm), axis=-1)
            x = np.take_along_axis(x, np.broadcast_to(inv[None, :, None, :], x.shape), -1)
        if h.weights is not None:
            x = x / np.asarray(h.weights).astype(np.float64)[:, :, None, :]
        if h.mean is not None:
            x = x + np.asarray(h.mean).astype(np.float64)[:, :, None, :]
        parts.append(x)
    if h.window is not None:
        parts.append(np.asarray(h.window.astype(mx.float32)).astype(np.float64))
    return np.concatenate(parts, axis=2)


def attended(h: StreamView, queries: mx.array) -> StreamView:
    """The view attention reads for these queries: a key stream that weighs its keys takes the queries of its
    calibration tokens first (its cache's learning step, TurboQuantKVCache.learn), which may code its first
    compression again."""
    return h if h.learn is None else h.learn(queries, h, None)[0]


def reference_attention(queries, K, V, scale, mask, sinks=None) -> np.ndarray:
    """float64 softmax attention; sinks (n_q_heads,): a sink column of score sinks[h] and value 0."""
    q = np.asarray(queries.astype(mx.float32)).astype(np.float64)
    B, Hq, L, _ = q.shape
    R = Hq // K.shape[1]
    K, V = np.repeat(K, R, axis=1), np.repeat(V, R, axis=1)
    s = scale * (q @ K.swapaxes(-1, -2))
    T = K.shape[2]
    if isinstance(mask, str):
        s = np.where(np.arange(T - L, T)[:, None] >= np.arange(T)[None], s, -np.inf)
    elif mask is not None:
        m = np.asarray(mask)
        s = np.where(m, s, -np.inf) if m.dtype == bool else s + m
    if sinks is not None:
        sink = np.asarray(sinks.astype(mx.float32)).astype(np.float64)[None, :, None, None]
        s = np.concatenate([np.broadcast_to(sink, (B, Hq, L, 1)), s], axis=-1)
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    p = p / p.sum(-1, keepdims=True)
    return (p if sinks is None else p[..., 1:]) @ V


def rel_err(out: mx.array, ref: np.ndarray) -> float:
    return float(np.abs(np.asarray(out.astype(mx.float32)) - ref).max() / np.abs(ref).max())


def feed(cache, rng, lengths, B, H, D, Dv=None, shift=2.0):
    """Yield (keys, values) chunks with a per-channel mean (so centering matters)."""
    Dv = Dv or D
    mu_k = shift * rng.normal(size=(1, H, 1, D))
    mu_v = shift * rng.normal(size=(1, H, 1, Dv))
    for L in lengths:
        k = mx.array(rng.normal(size=(B, H, L, D)) + mu_k, dtype=mx.float32)
        v = mx.array(rng.normal(size=(B, H, L, Dv)) + mu_v, dtype=mx.float32)
        yield L, cache.update_and_fetch(k, v)


CASES = [
    # head_dim, key_bits, value_bits, qjl, center
    (64, 4, 4, False, True),
    (64, 3, 2, True, True),
    (80, 2.5, 3.5, False, True),
    (96, 3.5, 2.5, False, False),
    (128, 3, 4, False, True),
    (128, 2, 3, True, False),
    (128, 1, 1, True, True),
    (256, 4, 2, False, True),
    (64, 8, 8, False, True),
]


@pytest.mark.parametrize("D,kb,vb,qjl,center", CASES)
def test_matches_float64_reference(D, kb, vb, qjl, center):
    rng = np.random.default_rng(D + int(2 * kb))
    B, H, R = 2, 2, 3
    # (prefill not read as decode: the reference is the held codes decoded)
    cfg = TurboQuantConfig(key_bits=kb, value_bits=vb, qjl=qjl, window=8, calibration_tokens=None, compress_block=4, sinks=3, step=16,
                           center_keys=center, center_values=center, prefill_as_decode=False)
    cache = TurboQuantKVCache(cfg, layer_index=1)
    # Prefill chunks, decode steps and a chunk larger than the window; block_size=5 splits the compressed
    # tokens into several blocks and puts block edges inside the causal triangle.
    for L, (kh, vh) in feed(cache, rng, (7, 1, 20, 1, 1, 3, 9), B, H, D):
        q = mx.array(2 * rng.normal(size=(B, H * R, L, D)), dtype=mx.float32)
        mask = "causal" if L > 1 else None
        out = turboquant_attention(q, kh, vh, D**-0.5, mask, tile_tokens=5)
        ref = reference_attention(q, dequantized(attended(kh, q)), dequantized(vh), D**-0.5, mask)
        assert out.shape == (B, H * R, L, D)
        assert rel_err(out, ref) < 2e-5, (L, rel_err(out, ref))
    assert cache.n_coded > 10 and cache.n_sinks == 3 and cache.n_window > 0


def test_array_masks_and_per_head_masks():
    rng = np.random.default_rng(5)
    B, H, R, D = 2, 2, 2, 64
    cache = TurboQuantKVCache(TurboQuantConfig(key_bits=3, value_bits=3, window=6, calibration_tokens=None, compress_block=3, sinks=2,
                                               prefill_as_decode=False), layer_index=0)
    *_, (L, (kh, vh)) = feed(cache, rng, (17, 5), B, H, D)
    T = kh.n_tokens
    q = mx.array(rng.normal(size=(B, H * R, L, D)), dtype=mx.float32)
    # Left padding for the second sequence (columns 0..3 hidden) on top of causal, as BatchKVCache masks are.
    causal = np.arange(T - L, T)[:, None] >= np.arange(T)[None]
    pad = np.ones((B, 1, 1, T), bool)
    pad[1, ..., :4] = False
    masks = [
        mx.array(causal),  # (L, T) bool
        mx.array(causal[None, None] & pad),  # (B, 1, L, T) bool
        mx.array(np.where(causal[None, None] & pad, 0.0, -1e9).astype(np.float32)),  # additive
        mx.array(np.broadcast_to(causal[None, None] & pad, (B, H * R, L, T)) & (rng.random((B, H * R, L, T)) > 0.2)
                 | np.eye(L, T, T - L, dtype=bool)),  # per query head, never a fully masked row
    ]
    for mask in masks:
        out = turboquant_attention(q, kh, vh, 0.125, mask, tile_tokens=4)
        ref = reference_attention(q, dequantized(kh), dequantized(vh), 0.125, mask)
        assert rel_err(out, ref) < 2e-5


def test_bf16_fp16_queries_and_value_dim():
    rng = np.random.default_rng(7)
    cache = TurboQuantKVCache(TurboQuantConfig(window=4, calibration_tokens=None, sinks=1), layer_index=2)
    B, H, D, Dv = 1, 2, 64, 128  # value head_dim different from key head_dim
    *_, (L, (kh, vh)) = feed(cache, rng, (12, 1), B, H, D, Dv)
    for dtype in (mx.float16, mx.bfloat16):
        q = mx.array(rng.normal(size=(B, 4, L, D)), dtype=mx.float32).astype(dtype)
        out = turboquant_attention(q, kh, vh, D**-0.5, None)
        assert out.dtype == dtype and out.shape == (B, 4, L, Dv)
        ref = reference_attention(q, dequantized(kh), dequantized(vh), D**-0.5, None)
        assert rel_err(out, ref) < 1e-2  # the output's own 16-bit rounding


def test_queries_untouched_and_only_float_parts():
    rng = np.random.default_rng(3)
    cache = TurboQuantKVCache(TurboQuantConfig(window=64, calibration_tokens=None, sinks=4), layer_index=0)
    (L, (kh, vh)), = feed(cache, rng, (20,), 1, 2, 128)
    assert kh.codes is None and kh.n_sinks == 4 and kh.n_window == 16
    q = mx.array(rng.normal(size=(1, 4, L, 128)), dtype=mx.float32)
    before = np.array(q)
    out = turboquant_attention(q, kh, vh, 128**-0.5, "causal")
    np.testing.assert_array_equal(np.array(q), before)
    # Nothing compressed yet: exact attention on the float16 tokens.
    k16 = mx.concatenate([kh.sinks, kh.window], axis=2).astype(mx.float32)
    v16 = mx.concatenate([vh.sinks, vh.window], axis=2).astype(mx.float32)
    ref = mx.fast.scaled_dot_product_attention(q, k16, v16, scale=128**-0.5, mask="causal")
    assert float(mx.abs(out - ref).max()) < 1e-5


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_before_the_first_compression_a_model_runs_as_with_the_float_cache(dtype):
    # A context shorter than the window holds float tokens only: the logits are those of mlx-lm's KVCache, bit for
    # bit, through prefill chunks (causal masks) and single-token decode steps (no mask), in every float dtype.
    from mlx_lm.models.cache import KVCache

    from tests.support.tiny_models import tiny_llama
    import tq_mlx

    model = tiny_llama(dtype=dtype)[0]
    tokens = mx.array(np.random.default_rng(7).integers(0, 256, (1, 40)))
    cfg = TurboQuantConfig(window=64, calibration_tokens=None, sinks=4)
    caches = {"float": [KVCache() for _ in model.layers], "tq": tq_mlx.make_prompt_cache(model, cfg)}
    logits = {}
    for name, cache in caches.items():
        out = [model(tokens[:, :24], cache=cache)]
        out += [model(tokens[:, i : i + 1], cache=cache) for i in range(24, 40)]
        logits[name] = mx.concatenate(out, axis=1)
    assert all(c.n_coded == 0 and c.offset == 40 for c in caches["tq"])
    assert mx.array_equal(logits["tq"], logits["float"])


def test_block_size_does_not_change_result():
    rng = np.random.default_rng(11)
    cache = TurboQuantKVCache(TurboQuantConfig(key_bits=2, value_bits=2, window=16, calibration_tokens=None, sinks=0), layer_index=0)
    *_, (L, (kh, vh)) = feed(cache, rng, (300, 1), 1, 2, 64)
    q = mx.array(rng.normal(size=(1, 2, L, 64)), dtype=mx.float32)
    outs = [turboquant_attention(q, kh, vh, 0.125, None, tile_tokens=b) for b in (7, 64, 4096)]
    for o in outs[1:]:
        assert float(mx.abs(o - outs[0]).max()) < 1e-5


def test_runs_in_a_worker_thread_with_a_cache_made_elsewhere():
    # MLX streams belong to threads: tq-chat and tq-server decode in worker threads, on caches and quantizers
    # built in another thread, and the reference path uses a second stream of its own.
    import threading

    rng = np.random.default_rng(5)
    cache = TurboQuantKVCache(TurboQuantConfig(key_bits=4, value_bits=3, qjl=False, window=8, calibration_tokens=None, sinks=2), layer_index=0)
    *_, (L, (kh, vh)) = feed(cache, rng, (200, 1), 1, 2, 64)
    q = mx.array(rng.normal(size=(1, 4, L, 64)), dtype=mx.float32)
    expected = np.array(turboquant_attention(q, kh, vh, 0.125, None, tile_tokens=64))
    got, errors = [], []

    def work():
        try:
            s = mx.new_stream(mx.default_device())  # as mlx-lm's generation_stream
            with mx.stream(s):
                got.append(np.array(turboquant_attention(q, kh, vh, 0.125, None, tile_tokens=64)))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not errors, errors
    np.testing.assert_allclose(got[0], expected, atol=1e-6)


def _attend(dtype, magnitude: float, cfg: TurboQuantConfig | None):
    """Attention of one query over 300 tokens whose keys and values are `magnitude` times unit-scale ones
    (the query divided by it, so the scores stay the same), as the unit-scale result: TurboQuant with `cfg`,
    or the float cache (mx.fast SDPA on the same dtype-rounded arrays) when cfg is None."""
    rng = np.random.default_rng(8)
    k = mx.array(rng.normal(size=(1, 2, 300, 64)) + 1.0, dtype=mx.float32) * magnitude
    v = mx.array(rng.normal(size=(1, 2, 300, 64)) - 0.5, dtype=mx.float32) * magnitude
    q = mx.array(rng.normal(size=(1, 4, 1, 64)), dtype=mx.float32) / magnitude
    k, v, q = k.astype(dtype), v.astype(dtype), q.astype(dtype)
    if cfg is None:
        f32 = lambda a: a.astype(mx.float32)  # noqa: E731
        out = mx.fast.scaled_dot_product_attention(f32(q), f32(k), f32(v), scale=0.125)
    else:
        # (one query reads a 300-token update's views: as the cache holds them)
        kh, vh = TurboQuantKVCache(dataclasses.replace(cfg, prefill_as_decode=False)).update_and_fetch(k, v)
        assert kh.sinks.dtype == kh.window.dtype == dtype  # the float parts keep the model's dtype
        out = turboquant_attention(q, kh, vh, 0.125)
    return np.array(out.astype(mx.float32)) / magnitude


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=str)
@pytest.mark.parametrize("magnitude", [1e-8, 1e5])
def test_extreme_scales_stay_finite_and_track_the_float_cache(dtype, magnitude):
    # 1e5 overflows float16 (a float16 window or norm would give inf, then NaN); 1e-8 is below float16's
    # normal range (a float16 norm would lose its precision). Neither may change what compression does.
    for cfg, tol in ((TurboQuantConfig.from_bits(8, window=32, calibration_tokens=None, sinks=4), 0.02), (TurboQuantConfig(window=32, calibration_tokens=None), 0.2)):
        out = _attend(dtype, magnitude, cfg)
        assert np.isfinite(out).all()
        ref = _attend(dtype, magnitude, None)
        err = np.abs(out - ref).max() / np.abs(ref).max()
        unit = _attend(dtype, 1.0, cfg)
        err_unit = np.abs(unit - _attend(dtype, 1.0, None)).max() / np.abs(ref).max()
        assert err < tol, (cfg.key_bits, err)
        assert err <= 1.1 * err_unit + 1e-3, (cfg.key_bits, err, err_unit)  # as good as at unit scale


def _chunk_transient(T: int, as_decode: bool, H=2, D=64, Hq=8, L=1024) -> int:
    """Peak bytes beyond what is held of one L-token chunk's attention over a cache of T tokens (the default's
    codes, read as decode or at once)."""
    c = TurboQuantKVCache(TurboQuantConfig(prefill_as_decode=as_decode), head_dim=D)
    for i in range(0, T - L, 1024):
        c.update_and_fetch(*(mx.random.normal((1, H, 1024, D), key=mx.random.key(i + j)) for j in (0, 1)))
        mx.eval(c.held_arrays())
    kh, vh = c.update_and_fetch(mx.random.normal((1, H, L, D)), mx.random.normal((1, H, L, D)))
    assert (kh.recent is not None) == as_decode
    q = mx.random.normal((1, Hq, L, D))
    mx.eval(kh, vh, q)
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(turboquant_attention(q, kh, vh, 0.125, "causal"))
    return mx.get_peak_memory() - base


def test_long_prefill_chunk_transient_is_flat_in_context():
    # A prefill chunk attending to a compressed context: the lazy graph must not hold every tile's scores at
    # once, so the transient memory is bounded by a few tiles, whatever the context length. The two-stream
    # schedule moves the peak by +-15% from run to run, so the contexts are far apart (8x the compressed tokens):
    # a graph holding every tile would add 0.5 GB at the longer one. (Read as decode: the next test.)
    L = 1024
    transients = {T: _chunk_transient(T, as_decode=False) for T in (L + 2048, L + 16384)}
    scores = 8 * L * (L + 16384) * 4  # what one float32 score matrix over the whole context would take
    assert transients[L + 16384] < 1.5 * transients[L + 2048], transients
    assert transients[L + 16384] < 0.25 * scores, (transients, scores)


def test_a_chunk_read_as_decode_holds_no_more_transient_than_read_at_once():
    # Read as decode (prefill_as_decode), a chunk's queries attend run by run, each run over the whole compressed
    # context: the runs go one after another, so their tiles are never all held at once (a lazy graph of 8
    # independent runs held 146 MB here where the chunk read at once holds 79-90).
    transients = {as_decode: _chunk_transient(1024 + 16384, as_decode) for as_decode in (False, True)}
    assert transients[True] < 1.25 * transients[False], transients


def _sdpa_float(queries, k, v, scale, mask, sinks):
    """mlx-lm's float cache: mx.fast SDPA on the float32 tokens."""
    f32 = lambda a: a.astype(mx.float32)  # noqa: E731
    return mx.fast.scaled_dot_product_attention(f32(queries), f32(k), f32(v), scale=scale, mask=mask,
                                                sinks=None if sinks is None else f32(sinks))


@pytest.mark.parametrize("sink_dtype", [mx.float32, mx.bfloat16], ids=str)
def test_learned_sinks_match_fast_sdpa_on_the_float_cache_at_8_bits(sink_dtype):
    # gpt-oss's learned sinks: a virtual token of score sinks[h] and value 0 in each query head's softmax.
    # At 8 bits the codes path tracks mx.fast SDPA(sinks=) on the float tokens; on the codes it matches the
    # float64 softmax with the sink column exactly.
    rng = np.random.default_rng(21)
    B, H, R, D = 1, 2, 3, 64
    cache = TurboQuantKVCache(TurboQuantConfig.from_bits(8, window=8, calibration_tokens=None, sinks=2, compress_block=4, prefill_as_decode=False),
                              layer_index=1)
    sinks = mx.array(rng.normal(size=(H * R,)) * 2 + 1, dtype=sink_dtype)
    ks, vs = [], []
    for L in (30, 1, 5, 1):
        k = mx.array(rng.normal(size=(B, H, L, D)) + 0.5, dtype=mx.float32)
        v = mx.array(rng.normal(size=(B, H, L, D)), dtype=mx.float32)
        ks.append(k)
        vs.append(v)
        kh, vh = cache.update_and_fetch(k, v)
        q = mx.array(rng.normal(size=(B, H * R, L, D)), dtype=mx.float32)
        for mask in ([None] if L == 1 else ["causal"]) + [None if L == 1 else "causal"]:
            out = turboquant_attention(q, kh, vh, D**-0.5, mask, tile_tokens=7, sinks=sinks)
            ref = _sdpa_float(q, mx.concatenate(ks, 2), mx.concatenate(vs, 2), D**-0.5, mask, sinks)
            assert float(mx.abs(out - ref).max()) < 0.02 * float(mx.abs(ref).max()), L
            # Exact on the codes: the float64 softmax with the sink column.
            K, V = dequantized(attended(kh, q)), dequantized(vh)
            with_sink = reference_attention(q, K, V, D**-0.5, mask, sinks)
            assert rel_err(out, with_sink) < 2e-5
        # The sinks change the result (the sink takes some of the mass).
        plain = turboquant_attention(q, kh, vh, D**-0.5, None if L == 1 else "causal")
        assert float(mx.abs(plain - out).max()) > 1e-3
    assert cache.n_coded > 10


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
def test_learned_sinks_without_compressed_tokens_are_fast_sdpa(dtype):
    # A context shorter than the window: exactly mx.fast SDPA(sinks=) on the float tokens, in the model's dtype
    # (sinks of another dtype are cast to the queries' where SDPA would refuse them).
    rng = np.random.default_rng(4)
    cache = TurboQuantKVCache(TurboQuantConfig(window=64, calibration_tokens=None, sinks=4), layer_index=0)
    (L, (kh, vh)), = feed(cache, rng, (20,), 1, 2, 64)
    assert kh.codes is None
    q = mx.array(rng.normal(size=(1, 4, L, 64)), dtype=mx.float32).astype(dtype)
    sinks = mx.array(rng.normal(size=(4,)), dtype=mx.float32)
    k = mx.concatenate([kh.sinks, kh.window], axis=2).astype(dtype)
    v = mx.concatenate([vh.sinks, vh.window], axis=2).astype(dtype)
    for mask in ("causal", None):
        out = turboquant_attention(q, kh, vh, 0.125, mask, sinks=sinks)
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask, sinks=sinks.astype(dtype))
        assert out.dtype == dtype
        assert mx.array_equal(out, ref)


def test_learned_sinks_with_array_masks_and_batch_views():
    # Sinks with every mask kind, and a batch view (row by row, the same sinks per row) through batch_view_attention.
    from tq_mlx.batch import BatchView, batch_view_attention

    rng = np.random.default_rng(9)
    B, H, R, D = 2, 2, 2, 64
    cache = TurboQuantKVCache(TurboQuantConfig(key_bits=3, value_bits=4, window=6, calibration_tokens=None, compress_block=3, sinks=2), layer_index=0)
    *_, (L, (kh, vh)) = feed(cache, rng, (17, 3), B, H, D)
    T = kh.n_tokens
    q = mx.array(rng.normal(size=(B, H * R, L, D)), dtype=mx.float32)
    sinks = mx.array(rng.normal(size=(H * R,)) + 1.0, dtype=mx.float16)
    causal = np.arange(T - L, T)[:, None] >= np.arange(T)[None]
    pad = np.ones((B, 1, 1, T), bool)
    pad[1, ..., :4] = False
    for mask in (None, "causal", mx.array(causal[None, None] & pad),
                 mx.array(np.where(causal[None, None] & pad, 0.0, -1e9).astype(np.float32))):
        out = turboquant_attention(q, kh, vh, 0.125, mask, tile_tokens=4, sinks=sinks)
        ref = reference_attention(q, dequantized(kh), dequantized(vh), 0.125, mask, sinks)
        assert rel_err(out, ref) < 2e-5
    # A batch view of the two rows (B=1 views each): the same as the batched call.
    rows = tuple(kh._replace(**{f: (None if getattr(kh, f) is None else _row(getattr(kh, f), i))
                                for f in ("codes", "sinks", "window", "mean", "scale")}) for i in range(B))
    vrows = tuple(vh._replace(**{f: (None if getattr(vh, f) is None else _row(getattr(vh, f), i))
                                 for f in ("codes", "sinks", "window", "mean", "scale")}) for i in range(B))
    spans, ends = ((0, L),) * B, (T,) * B
    out = batch_view_attention(q, BatchView(rows, spans, ends), BatchView(vrows, spans, ends), 0.125, "causal",
                               sinks=sinks)
    ref = reference_attention(q, dequantized(kh), dequantized(vh), 0.125, "causal", sinks)
    assert rel_err(out, ref) < 2e-5


def _row(x, i):
    if isinstance(x, tuple):
        return type(x)(*(a[i : i + 1] for a in x))
    return x[i : i + 1]


def test_keys_that_are_the_values_with_an_additive_mask():
    # Multi-head latent attention's decode: one view (the latent) as keys and values, many query heads on one kv
    # head, the rope scores as an additive mask (a bool padding mask folded in at finfo.min): the same result as
    # the float64 softmax over the dequantized latent, and at 8 bits mlx-lm's float attention on the latent.
    from mlx_lm.models.base import scaled_dot_product_attention

    from tq_mlx.attention.reference import keys_are_values

    rng = np.random.default_rng(12)
    B, R, D = 2, 16, 64
    for bits, tol in ((4, None), (8, 0.02)):
        cache = TurboQuantKVCache(TurboQuantConfig.from_bits(bits, window=8, calibration_tokens=None, sinks=2, compress_block=4), layer_index=0)
        latent = mx.array(rng.normal(size=(B, 1, 60, D)) + 0.3, dtype=mx.float32)
        cache.update_and_fetch(latent[:, :, :59], latent[:, :, :59])
        kv, _ = cache.update_and_fetch(latent[:, :, 59:], latent[:, :, 59:])
        assert keys_are_values(kv, kv) and kv.n_coded > 32
        pe = rng.normal(size=(B, R, 1, kv.n_tokens))
        pe[1, ..., :4] = float(mx.finfo(mx.float32).min)
        pe = mx.array(pe, dtype=mx.float32)
        q = mx.array(rng.normal(size=(B, R, 1, D)), dtype=mx.float32)
        out = turboquant_attention(q, kv, kv, 0.125, pe, tile_tokens=16)
        K = dequantized(kv)
        assert rel_err(out, reference_attention(q, K, K, 0.125, pe)) < 2e-5
        if tol:
            want = scaled_dot_product_attention(q, latent, latent, cache=None, scale=0.125, mask=pe)
            assert float(mx.abs(out - want).max()) < tol * float(mx.abs(want).max())
