"""Reference attention on the codes of one cache's stream views, in pure MLX.

`turboquant_attention(queries, keys, values, scale, mask)` has the signature of mlx-lm's
`quantized_scaled_dot_product_attention` and takes the two `StreamView`s a `TurboQuantKVCache` returns (one per
side); tq_mlx.attention.dispatch_attention shares the signature and falls back to it, and tq_mlx.hook calls that.

For one query q (already times `scale`) and kv head, with compressed tokens t quantized as
(x_t - μ) / s in the quantizer's input basis (channels in `perm` order, each group rotated by its Π_g; s the
stream's power-of-two scale):

    score_t = Σ_g (Π_g (s_k q)[perm]_g) · ŷ_t,g  (+ QJL term)  + q·μ      ŷ = codebook value × norm, rotated
    out     = (Σ_float p_t v_t  +  s_v Πᵀ Σ_compressed p_t ŷᵛ_t  [un-permuted]  +  (Σ_compressed p_t)·ν) / Σ p_t

Queries are rotated once per call, values are accumulated in the rotated basis and rotated back once per
query and head. Codes are read into codebook values a byte at a time (packing.unpack_lookup) and the norms
scale the scores and probabilities, not every coordinate. Sinks, the window (model dtype and basis) and each
tile of compressed tokens give partial softmaxes that merge exactly by log-sum-exp (learned sinks, gpt-oss's
`sinks=` logit per query head, are one more: a single token of score sinks[h] and value 0); compressed tokens are
read in tiles of at most `tile_tokens` tokens (fewer for long query chunks, so one tile's scores stay under
SCORE_BUDGET elements, 16 MB, or 256 tokens): never a float copy of the whole cache, and for long query chunks
each tile is scored once the previous one is merged, so a few tiles' scores are the whole transient, flat in
the context (measured: 125 MB for a 2048-token chunk of SmolLM2's 9 query heads at 3k, 4k and 8k tokens,
against 320 MB at 4k for mx.fast.scaled_dot_product_attention on a float cache, which grows with the context).
Keys and values of a tile are worked on two MLX streams, which on a CPU means two cores. Everything is
float32; the result has queries' dtype. A view with no compressed token (a context shorter than the window) is
plain float attention: mx.fast.scaled_dot_product_attention in the model's dtype (uncompressed_attention).
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import mlx.core as mx

from ..quant.quantizer import MSECodes, TurboQuantProd, load_norms
from ..models.rope import centers, score_bias
from ..stream.codec import code_order
from ..stream.view import StreamView, views_by_run

TILE_TOKENS = 4096  # compressed tokens read at a time (fewer for long query chunks)
# Cap on the float32 scores of one tile, (B, n_q_heads, L, tile): long prefill chunks get shorter tiles.
SCORE_BUDGET = 1 << 22  # elements (16 MB)
SERIAL_SCORES = 1 << 20  # score blocks above this many elements are computed one tile after another
# Keys centered before RoPE: with at least this many query rows per kv head (a prefill chunk), R(p) μ0 is added
# to the tile's dequantized keys (a few passes over the tile) instead of q·R(p) μ0 to its scores (D per score).
# Measured on the CPU at 4k tokens: the two cost the same near 256-512 rows; at 2048-token prefill chunks the
# keys' way doubles prefill speed, at decode (a few rows) it is 3x slower.
FOLD_ROWS = 512
_NEG = float(mx.finfo(mx.float32).min)


_SIDE = threading.local()  # MLX streams belong to the thread that made them


def _side_stream() -> mx.Stream:
    """A second stream on the default device (one per thread and device), so independent work runs concurrently."""
    streams = getattr(_SIDE, "streams", None)
    if streams is None:
        streams = _SIDE.streams = {}
    device = mx.default_device()
    key = str(device)
    if key not in streams:
        streams[key] = mx.new_stream(device)
    return streams[key]


def tile_size(batch: int, n_q_heads: int, n_queries: int, tile_tokens: int = TILE_TOKENS) -> int:
    """Compressed tokens read per tile for this many query rows: tile_tokens, fewer for long query chunks so
    that one tile's scores stay under SCORE_BUDGET elements, but never fewer than 256."""
    return max(1, min(tile_tokens, max(256, SCORE_BUDGET // (batch * n_q_heads * n_queries))))


def split_query(q: mx.array, kv: StreamView):
    """The query in the compressed keys' bases: per group Π_g (q[perm])_g, plus S·q for QJL."""
    quantizer = kv.quantizer
    mse = quantizer.mse if isinstance(quantizer, TurboQuantProd) else quantizer
    qp = q
    if kv.perm is not None:
        qp = mx.take_along_axis(q, mx.broadcast_to(kv.perm[None, :, None, :], q.shape), axis=-1)
    groups = []
    if mse is not None:
        for g in mse.groups:
            qg = qp if g.channels is None else mx.take(qp, g.channels, axis=-1)
            groups.append(g.rotation.forward(qg))
    sq = qp @ quantizer.projection.T if isinstance(quantizer, TurboQuantProd) else None
    return groups, sq


def keys_are_values(keys: StreamView, values: StreamView) -> bool:
    """Whether one compressed view serves as both keys and values (MLA's latent at decode, k = v): its codes
    are then read once, for the scores and the values."""
    return values is keys or (values.quantizer is keys.quantizer and values.codes is keys.codes
                              and values.mean is keys.mean and values.scale is keys.scale
                              and values.decayed is keys.decayed)


def _codes_tile(codes, a: int, b: int):
    return type(codes)(*(x[:, :, a:b] for x in codes))


def aligned_segments(keys: StreamView, values: StreamView) -> list[tuple[int, int, StreamView, StreamView]]:
    """The compressed tokens in spans [a, b) (positions among them) where each side has one quantizer, with
    each side's codes-only view cut to the span. With temporal decay a side has decayed and fresh codes, and
    the sides may split at different tokens (only one side decays, or the keys protected themselves)."""
    def cut(kv: StreamView, a: int, b: int) -> StreamView:
        off, seg = next((o, v) for o, v in reversed(kv.segments()) if o <= a)
        return seg._replace(codes=_codes_tile(seg.codes, a - off, b - off), position=seg.position + a - off)

    same = keys_are_values(keys, values)
    n = keys.n_coded
    cuts = sorted({0, n, *(o for o, _ in keys.segments()), *(() if same else (o for o, _ in values.segments()))})
    out = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        k = cut(keys, a, b)
        out.append((a, b, k, k if same else cut(values, a, b)))
    return out


def _units(kv: StreamView, codes) -> list[tuple[mx.array, mx.array]]:
    """Per group, the tile's codebook values c[idx] (B, H, t, d_g) in that group's rotated basis and the
    group's norms (B, H, 1, t) float32. The norm is applied to the (few) scores and probabilities instead of
    to every dequantized coordinate."""
    q = kv.quantizer
    if isinstance(q, TurboQuantProd):
        q = q.mse
        if q is None:
            return []
    units = q.rotated_units(MSECodes(codes.codes, codes.norms))
    norms = load_norms(codes.norms)
    return [(u, norms[..., i][:, :, None, :]) for i, u in enumerate(units)]


def _with_centers(units: list[tuple[mx.array, mx.array]], kv: StreamView, keys: StreamView, first: int,
                  n: int) -> list[tuple[mx.array, None]]:
    """A tile's key units with the centers R(p) μ0 of its tokens added, in the units' bases: per group
    u·norm + Π_g (R(p) μ0 · w / scale)_g, so the query's product with them is its score, bias included (the
    norms are then applied, as there is no separate factor left)."""
    c = centers(keys.mean, keys.rope, keys.position + first, n)  # (B, H, n, D), the model basis
    if keys.scale is not None:  # the codes hold (x - μ)·w / scale (the query is scaled by the inverse)
        c = c / keys.scale[:, :, None, None]
    if keys.weights is not None:
        c = c * keys.weights[:, :, None, :]
    parts, _ = split_query(c, kv)
    return [(u * norm.swapaxes(-1, -2) + cg, None) for (u, norm), cg in zip(units, parts)]


def unrotate(kv: StreamView, parts: list[mx.array]) -> mx.array:
    """Rotated-basis accumulators per group -> the model basis (inverse rotations, then channel order)."""
    q = kv.quantizer
    y = [g.rotation.inverse(p) for g, p in zip(q.groups, parts)]
    y = y[0] if len(y) == 1 else mx.concatenate(y, axis=-1)
    order = code_order(q, kv.perm)
    if order is not None:
        inv = mx.argsort(order, axis=-1)
        inv = inv[None, :, None, :] if inv.ndim == 2 else inv
        y = mx.take_along_axis(y, mx.broadcast_to(inv, y.shape), axis=-1)
    return y


def _mask_fn(mask, B: int, H: int, R: int, L: int, T: int):
    """Returns f(a, b) -> the mask for token columns [a, b), shaped to broadcast against (B, H, R, L, b-a),
    or None when nothing is masked there."""
    if mask is None:
        return lambda a, b: None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unsupported mask {mask!r}: expected None, 'causal' or an array")
        first = T - L  # lower-right aligned: query i sits at position T - L + i

        def causal(a, b):
            if b - 1 <= first:
                return None
            return (mx.arange(first, T)[:, None] >= mx.arange(a, b)[None]).reshape(1, 1, 1, L, b - a)

        return causal
    if mask.shape[-1] != T or mask.shape[-2] != L:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not cover {L} queries x {T} cached tokens")
    m = mask
    if m.ndim < 4:
        m = m.reshape((1,) * (4 - m.ndim) + tuple(m.shape))
    mb, mh = m.shape[:2]
    if mh == 1:
        m = m.reshape(mb, 1, 1, L, T)
    elif mh == H * R:
        m = m.reshape(mb, H, R, L, T)
    else:
        raise ValueError(f"mask with {mh} heads for {H * R} query heads")
    return lambda a, b: m[..., a:b]


def uncompressed_attention(queries: mx.array, keys: StreamView, values: StreamView, scale: float, mask=None,
                           sinks: mx.array | None = None) -> mx.array:
    """Attention over a view that holds no compressed token (sinks and window only, as every context shorter
    than the window): mx.fast.scaled_dot_product_attention on the float tokens, as mlx-lm's KVCache does, so
    until its first compression the cache attends exactly like the float cache, with the fused kernel on a Mac.
    Learned `sinks` go to SDPA as they are, in queries' dtype if theirs would not promote to it (SDPA refuses)."""
    if sinks is not None and queries.dtype != mx.float32 and sinks.dtype != queries.dtype:
        sinks = sinks.astype(queries.dtype)
    return mx.fast.scaled_dot_product_attention(queries, _float_tokens(keys, queries.dtype),
                                                _float_tokens(values, queries.dtype), scale=scale, mask=mask,
                                                sinks=sinks)


def _float_tokens(kv: StreamView, dtype: mx.Dtype) -> mx.array:
    """A view's float tokens (sinks, then window) as one array in `dtype`."""
    parts = [p for p in (kv.sinks, kv.window) if p is not None]
    x = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)  # at most sinks + window tokens
    return x.astype(dtype)


def sink_logits(sinks, B: int, H: int, R: int, L: int) -> mx.array:
    """Learned attention sinks (n_q_heads,) as float32 (B, H, R·L, 1) in the query-row layout: query head
    h·R + r, token i is row r·L + i of kv head h."""
    if sinks.shape != (H * R,):
        raise ValueError(f"sinks of shape {tuple(sinks.shape)}: expected ({H * R},), one logit per query head")
    s = sinks.astype(mx.float32).reshape(1, H, R, 1)
    return mx.broadcast_to(s, (B, H, R, L)).reshape(B, H, R * L, 1)


class Softmax(NamedTuple):
    """The partial softmax of a span of tokens, float32 per query row (B, H, R·L, ·). Partials of disjoint spans
    merge exactly by log-sum-exp, in any order (merge)."""

    max: mx.array  # m: the largest score (B, H, R·L, 1)
    total: mx.array  # l: Σ exp(s - m)
    compressed: mx.array | None  # the part of `total` over compressed tokens (it weighs the values' mean ν)
    out: mx.array | None  # Σ exp(s - m)·v over float tokens, model basis (B, H, R·L, Dv)
    rotated: list[mx.array] | None  # Σ exp(s - m)·ŷ over compressed tokens, per value group, rotated basis


def _weighted_sum(x, y, w0, w1):
    """x·w0 + y·w1, where None is a zero."""
    if x is None or y is None:
        return None if x is None and y is None else (y * w1 if x is None else x * w0)
    return x * w0 + y * w1


def merge(state: Softmax | None, part: Softmax) -> Softmax:
    """Two partial softmaxes (state None: none yet) as one, rescaled to their common max."""
    if state is None:
        return part
    m = mx.maximum(state.max, part.max)
    w0, w1 = mx.exp(state.max - m), mx.exp(part.max - m)
    r0, r1 = state.rotated, part.rotated
    r = r0 or r1
    if r is not None:
        n = len(r)
        r = [_weighted_sum(x, y, w0, w1) for x, y in zip(r0 or [None] * n, r1 or [None] * n)]
    return Softmax(m, state.total * w0 + part.total * w1, _weighted_sum(state.compressed, part.compressed, w0, w1),
                   _weighted_sum(state.out, part.out, w0, w1), r)


def _exp_scores(s: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """(max, exp(s - max), Σ exp(s - max)) over the tokens (the last axis) of scores s."""
    mb = mx.max(s, axis=-1, keepdims=True)
    p = mx.exp(s - mb)
    return mb, p, mx.sum(p, axis=-1, keepdims=True)


def _masked(s: mx.array, mk, B: int, H: int, R: int, L: int) -> mx.array:
    """Scores (B, H, R·L, n) with the mask of their n token columns applied (None: nothing masked)."""
    if mk is None:
        return s
    n = s.shape[-1]
    s5 = s.reshape(B, H, R, L, n)
    s5 = mx.where(mk, s5, _NEG) if mk.dtype == mx.bool_ else s5 + mk.astype(mx.float32)
    return s5.reshape(B, H, R * L, n)


def _tiles(keys: StreamView, values: StreamView, tile: int) -> list[tuple[int, int, StreamView, StreamView, int]]:
    """(a, b, keys' segment, values' segment, a0): the compressed tokens [a, b) in tiles of at most `tile`
    tokens, evenly cut within each aligned segment (whose first token is a0)."""
    spans = []
    for a0, b0, ks, vs in aligned_segments(keys, values):
        n_tiles = -(-(b0 - a0) // tile)
        cuts = [a0 + (b0 - a0) * i // n_tiles for i in range(n_tiles + 1)]
        spans += [(a, b, ks, vs, a0) for a, b in zip(cuts[:-1], cuts[1:])]
    return spans


def _tile_scores(q_groups, sq, k_units, kc, ks: StreamView) -> mx.array:
    """A tile's scores before the mean's term: per group the query in the group's basis times the codebook
    values (times the norms), plus the QJL term."""
    s = None
    for qg, (u, n) in zip(q_groups, k_units):
        sg = qg @ u.swapaxes(-1, -2)
        sg = sg if n is None else sg * n
        s = sg if s is None else s + sg
    if sq is not None:  # QJL: √(π/2)/d · γ_t · ⟨S q, z_t⟩, z = ±1
        kq = ks.quantizer
        z = kq.signs(kc)
        sj = (sq @ z.swapaxes(-1, -2)) * (kq.qjl_scale * load_norms(kc.gamma)[:, :, None, :])
        s = sj if s is None else s + sj
    return s


def _compressed_softmax(state: Softmax | None, q: mx.array, keys: StreamView, values: StreamView, mask_at,
                        shape: tuple[int, int, int, int, int], tile_tokens: int) -> Softmax | None:
    """`state` merged with the partial softmax of every tile of compressed tokens. q: the queries times scale,
    (B, H, R·L, D) float32; shape: (B, H, R, L, Hq)."""
    B, H, R, L, Hq = shape
    n_s = keys.n_sinks
    # Compressed keys hold (x - μ) / scale: scaling the query instead costs one multiply per step.
    qk = q if keys.scale is None else q * keys.scale[:, :, None, None]
    if keys.weights is not None:  # ... and (x - μ)·w: the query is divided by w (query_weights)
        qk = qk / keys.weights[:, :, None, :]
    queries_in = {}  # per key quantizer (decayed codes have their own): the query in its bases
    # q·μ per query row, or (keys centered before RoPE) q·R(p) μ0 per row and token, per tile
    q_mu = (q @ keys.mean[..., None]) if keys.mean is not None and keys.rope is None else None  # (B, H, R·L, 1)
    tile = tile_size(B, Hq, L, tile_tokens)
    spans = _tiles(keys, values, tile)
    # Two MLX streams (two cores on a CPU): a tile's values dequantize on one while its keys are scored on
    # the other, and the next tile swaps them. Tiles are independent; only the small merges are serial.
    streams = [mx.default_stream(mx.default_device()), _side_stream()]
    # A lazy graph would hold every tile's scores at once (memory growing with the context); for large
    # score blocks (long prefill chunks) each tile's scoring waits for the previous merge, so at most two
    # tiles' scores exist. Small blocks (decode) keep scoring tiles on both streams at once.
    serial = B * Hq * L * tile > SERIAL_SCORES
    same = keys_are_values(keys, values)
    fold = keys.rope is not None and R * L >= FOLD_ROWS and not same
    for i, (a, b, ks, vs, a0) in enumerate(spans):
        if id(ks.quantizer) not in queries_in:
            queries_in[id(ks.quantizer)] = split_query(qk, ks)
        q_groups, sq = queries_in[id(ks.quantizer)]
        kc, vc = _codes_tile(ks.codes, a - a0, b - a0), _codes_tile(vs.codes, a - a0, b - a0)
        if serial and state is not None:
            done = [x for x in (state.max, state.total, state.compressed, state.out, *(state.rotated or ()))
                    if x is not None]
            kc = type(kc)(*mx.depends(list(kc), done))
        if not same:
            with mx.stream(streams[(i + 1) % 2]):
                v_units = _units(vs, vc)
        with mx.stream(streams[i % 2]):
            k_units = _units(ks, kc)
            if same:  # one view as keys and values (MLA's latent): its codes are unpacked once
                v_units = k_units
            folded = fold and bool(k_units)
            if folded:
                k_units = _with_centers(k_units, ks, keys, a, b - a)
            s = _tile_scores(q_groups, sq, k_units, kc, ks)
            if q_mu is not None:
                s = s + q_mu
            elif keys.rope is not None and not folded:
                s = s + score_bias(q, keys.mean, keys.rope, keys.position + a, b - a)
            mb, p, lb = _exp_scores(_masked(s, mask_at(n_s + a, n_s + b), B, H, R, L))
            # decayed and fresh values share one rotated basis: their accumulators add
            part = Softmax(mb, lb, lb, None, [(p * n) @ u for u, n in v_units])
        state = merge(state, part)
    return state


def _output(state: Softmax, values: StreamView) -> mx.array:
    """The attention output (B, H, R·L, Dv) float32 of the merged softmax: the compressed values' accumulators
    rotated back, scaled and their mean added, plus the float tokens', over the total."""
    out, acc_r = state.out, state.rotated
    if acc_r is not None:
        y = unrotate(values, acc_r)
        if values.scale is not None:
            y = y * values.scale[:, :, None, None]
        out = y if out is None else out + y
        if values.mean is not None:
            out = out + state.compressed * values.mean[:, :, None, :]
    return out / state.total


def check_learned(keys: StreamView) -> None:
    """Attention only reads: a key view whose cache still wants the queries must go through that cache's learning
    step first (tq_mlx.batch.learned, which the attention hook calls), else its codes may be superseded."""
    if keys.learn is not None:
        raise ValueError("these views' cache still learns from the queries that attend them (key weights and "
                         "widths, value widths): call tq_mlx.batch.learned(queries, keys, values, scale) first and "
                         "attend the views it returns (the attention hook, tq_mlx.hook.fetched_attention, does)")


def attention_by_run(attend, queries: mx.array, keys: StreamView, values: StreamView, scale: float, mask=None,
                     sinks: mx.array | None = None) -> mx.array:
    """`attend` over views that carry an update's `recent` (config.prefill_as_decode), run by run: each run of
    queries with the views it reads at decode (tq_mlx.stream.view.views_by_run), its rows and columns of an array
    mask ("causal" holds in each run as in the whole); the outputs in query order."""
    out = []
    for row, n, k, v in views_by_run(keys, values, queries.shape[2]):
        m = mask[..., row : row + n, : k.n_tokens] if isinstance(mask, mx.array) else mask
        q = queries[:, :, row : row + n]
        if out:  # each run reads the whole compressed context: one after another, or a lazy graph holds every run's tiles
            (q,) = mx.depends([q], [out[-1]])
        out.append(attend(q, k, v, scale=scale, mask=m, sinks=sinks))
    return out[0] if len(out) == 1 else mx.concatenate(out, axis=2)


def turboquant_attention(
    queries: mx.array,
    keys: StreamView,
    values: StreamView,
    scale: float,
    mask=None,
    tile_tokens: int = TILE_TOKENS,
    sinks: mx.array | None = None,
) -> mx.array:
    """softmax(scale·q·Kᵀ + mask)·V over the views of one TurboQuant cache. queries (B, n_q_heads, L, D) ->
    (B, n_q_heads, L, Dv).

    mask: None, "causal" (lower-right aligned), or a bool/additive array (L, T) / (B, 1, L, T) /
    (B, n_q_heads, L, T) over the cache's T tokens in order (sinks, compressed, window). Batch views run row by
    row through tq_mlx.batch.batch_view_attention.
    sinks: learned attention sinks (gpt-oss), one logit per query head (n_q_heads,), any float dtype: a
    virtual token of score sinks[h] and value 0 in the softmax denominator, as
    mx.fast.scaled_dot_product_attention(sinks=). Not the cache's sink tokens (the first tokens kept float).
    """
    if not isinstance(keys, StreamView):
        raise TypeError(f"turboquant_attention takes a StreamView, got {type(keys).__name__} (batch views: "
                        f"tq_mlx.batch.batch_view_attention)")
    check_learned(keys)
    if keys.recent is not None:
        return attention_by_run(turboquant_attention, queries, keys, values, scale, mask, sinks)
    if values.weights is not None:
        raise ValueError("values view with query weights: only key streams weigh their tokens")
    if keys.n_coded == 0 and 0 < keys.n_tokens and (mask is None or queries.shape[2] <= keys.n_tokens):
        return uncompressed_attention(queries, keys, values, scale, mask, sinks)
    B, Hq, L, D = queries.shape
    T, H, Dv = keys.n_tokens, keys.n_heads, values.head_dim
    R = Hq // H
    # (B, H, R·L, D): query heads of one kv head are consecutive, as in mlx-lm's GQA reshape. A new array:
    # the caller's queries are never modified.
    q = (queries.astype(mx.float32) * scale).reshape(B, H, R * L, D)
    mask_at = _mask_fn(mask, B, H, R, L, T)

    # Each span of tokens gives a partial softmax; learned sinks are one of a virtual token, score sinks[h],
    # weight 1 at its own max, value 0.
    state = None
    if sinks is not None:
        ms = sink_logits(sinks, B, H, R, L)
        state = merge(state, Softmax(ms, mx.ones_like(ms), None, None, None))

    # Float tokens: sinks at [0, n_sinks), window at [n_sinks + n_coded, T).
    n_s, n_c = keys.n_sinks, keys.n_coded
    for kf, vf, a in ((keys.sinks, values.sinks, 0), (keys.window, values.window, n_s + n_c)):
        if kf is None:
            continue
        b = a + kf.shape[2]
        mb, p, lb = _exp_scores(_masked(q @ kf.astype(mx.float32).swapaxes(-1, -2), mask_at(a, b), B, H, R, L))
        state = merge(state, Softmax(mb, lb, None, p @ vf.astype(mx.float32), None))

    if n_c:
        state = _compressed_softmax(state, q, keys, values, mask_at, (B, H, R, L, Hq), tile_tokens)
    if state is None:
        raise ValueError("attention over an empty cache: no tokens to attend to")
    return _output(state, values).reshape(B, Hq, L, Dv).astype(queries.dtype)
