"""Attention on TurboQuant codes: the reference path, in pure MLX.

`turboquant_attention(queries, keys, values, scale, mask)` has the signature of mlx-lm's
`quantized_scaled_dot_product_attention` (tq_mlx.integration routes it there) and takes the two
`StreamView`s a `TurboQuantKVCache` returns (one per side). A kernel path shares the signature.

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
plain float attention: mx.fast.scaled_dot_product_attention in the model's dtype (float_attention).
"""

from __future__ import annotations

import threading
from typing import Callable, NamedTuple

import mlx.core as mx

from .quantizer import MSECodes, TurboQuantProd, load_norms
from .rope import centers, score_bias
from .stream import StreamView, code_order

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
    n = keys.n_compressed
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


class BatchView(NamedTuple):
    """One side of a batch of TurboQuant caches (tq_mlx.batch), as attention reads it: one B=1 StreamView per
    row, so every row keeps its own calibration and attends only to its own tokens (padding is never stored).

    Row i's real tokens in the update are the query positions [start, start + count) of `spans[i]`; the other
    positions are padding and get zeros. `ends[i]` is the column, in the padded layout of mlx-lm's
    BatchKVCache (what the batch cache's make_mask covers), just past row i's last stored token: an array
    mask is read there. A row with no token in the update has the view None.
    """

    rows: tuple[StreamView | None, ...]
    spans: tuple[tuple[int, int], ...]
    ends: tuple[int, ...]


def _row_mask(mask, i: int, start: int, count: int, end: int, n_tokens: int):
    """Row i's part of a batch mask: None/"causal" become the row's own (what it gets alone: "causal" for
    more than one query); an array (.., L, T) in the padded layout is cut to the row's queries and tokens."""
    if mask is None or isinstance(mask, str):
        return mask if count > 1 else None
    if mask.shape[-1] < end:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not cover the batch's {end} cached columns")
    m = mask[i : i + 1] if mask.ndim == 4 and mask.shape[0] > 1 else mask  # (B, ...) or broadcast (1, ...)
    return m[..., start : start + count, end - n_tokens : end]


def batched_attention(queries: mx.array, keys: BatchView, values: BatchView, scale: float, mask=None,
                      attend: Callable | None = None, sinks: mx.array | None = None) -> mx.array:
    """Attention of a batch view, row by row with `attend` (default turboquant_attention) on each row's own
    views and queries, stacked; padding query positions get zeros. queries (B, n_q_heads, L, D); sinks (learned
    per-head logits) go to every row."""
    attend = attend or turboquant_attention
    B, Hq, L, _ = queries.shape
    if len(keys.rows) != B:
        raise ValueError(f"queries have batch {B}, the batch view holds {len(keys.rows)} rows")
    Dv = next((v.head_dim for v in values.rows if v is not None), queries.shape[3])
    out = []
    for i, (k, v, (start, count), end) in enumerate(zip(keys.rows, values.rows, keys.spans, keys.ends)):
        if k is None or count == 0:
            out.append(mx.zeros((1, Hq, L, Dv), queries.dtype))
            continue
        q = queries[i : i + 1, :, start : start + count] if count < L else queries[i : i + 1]
        o = attend(q, k, v, scale=scale, mask=_row_mask(mask, i, start, count, end, k.n_tokens), sinks=sinks)
        pad = [(0, 0), (0, 0), (start, L - start - count), (0, 0)]
        out.append(mx.pad(o, pad) if count < L else o)
    return out[0] if B == 1 else mx.concatenate(out, axis=0)


def float_attention(queries: mx.array, keys: StreamView, values: StreamView, scale: float, mask=None,
                    sinks: mx.array | None = None) -> mx.array:
    """Attention over a view that holds no compressed token (sinks and window only, as every context shorter
    than the window): mx.fast.scaled_dot_product_attention on the float tokens, as mlx-lm's KVCache does, so
    until its first compression the cache attends exactly like the float cache, with the fused kernel on a Mac.
    Learned `sinks` go to SDPA as they are, in queries' dtype if theirs would not promote to it (SDPA refuses)."""
    def tokens(kv: StreamView) -> mx.array:
        parts = [p for p in (kv.sinks, kv.window) if p is not None]
        x = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)  # at most sinks + window tokens
        return x.astype(queries.dtype)

    if sinks is not None and queries.dtype != mx.float32 and sinks.dtype != queries.dtype:
        sinks = sinks.astype(queries.dtype)
    return mx.fast.scaled_dot_product_attention(queries, tokens(keys), tokens(values), scale=scale, mask=mask,
                                                sinks=sinks)


def sink_logits(sinks, B: int, H: int, R: int, L: int) -> mx.array:
    """Learned attention sinks (n_q_heads,) as float32 (B, H, R·L, 1) in the query-row layout: query head
    h·R + r, token i is row r·L + i of kv head h."""
    if sinks.shape != (H * R,):
        raise ValueError(f"sinks of shape {tuple(sinks.shape)}: expected ({H * R},), one logit per query head")
    s = sinks.astype(mx.float32).reshape(1, H, R, 1)
    return mx.broadcast_to(s, (B, H, R, L)).reshape(B, H, R * L, 1)


def turboquant_attention(
    queries: mx.array,
    keys: StreamView,
    values: StreamView,
    scale: float,
    mask=None,
    tile_tokens: int = TILE_TOKENS,
    sinks: mx.array | None = None,
) -> mx.array:
    """softmax(scale·q·Kᵀ + mask)·V over a TurboQuant cache. queries (B, n_q_heads, L, D) -> (B, n_q_heads, L, Dv).

    mask: None, "causal" (lower-right aligned), or a bool/additive array (L, T) / (B, 1, L, T) /
    (B, n_q_heads, L, T) over the cache's T tokens in order (sinks, compressed, window). Batch views
    (tq_mlx.batch) run row by row (batched_attention).
    sinks: learned attention sinks (gpt-oss), one logit per query head (n_q_heads,), any float dtype: a
    virtual token of score sinks[h] and value 0 in the softmax denominator, as
    mx.fast.scaled_dot_product_attention(sinks=). Not the cache's sink tokens (the first tokens kept float).
    """
    if isinstance(keys, BatchView):
        return batched_attention(
            queries, keys, values, scale, mask,
            lambda q, k, v, scale, mask, sinks: turboquant_attention(q, k, v, scale, mask, tile_tokens, sinks),
            sinks=sinks)
    if keys.observe is not None:  # the stream sums these queries for its weights first (query_weights)
        keys = keys.observe(queries)
    if values.weights is not None:
        raise ValueError("values view with query weights: only key streams weigh their tokens")
    if keys.n_compressed == 0 and 0 < keys.n_tokens and (mask is None or queries.shape[2] <= keys.n_tokens):
        return float_attention(queries, keys, values, scale, mask, sinks)
    B, Hq, L, D = queries.shape
    T, H, Dv = keys.n_tokens, keys.n_heads, values.head_dim
    R = Hq // H
    # (B, H, R·L, D): query heads of one kv head are consecutive, as in mlx-lm's GQA reshape. A new array:
    # the caller's queries are never modified.
    q = (queries.astype(mx.float32) * scale).reshape(B, H, R * L, D)
    mask_at = _mask_fn(mask, B, H, R, L, T)

    def masked(s, a, b):
        mk = mask_at(a, b)
        if mk is None:
            return s
        s5 = s.reshape(B, H, R, L, b - a)
        s5 = mx.where(mk, s5, _NEG) if mk.dtype == mx.bool_ else s5 + mk.astype(mx.float32)
        return s5.reshape(B, H, R * L, b - a)

    # Each span of tokens gives a partial softmax (m, Σp, Σp·v in the model basis, Σp·ŷ per value group in
    # the rotated basis); partials merge exactly by log-sum-exp, in any order.
    state = None

    def merge(part):
        nonlocal state
        if state is None:
            state = part
            return
        m0, l0, c0, a0, r0 = state
        m1, l1, c1, a1, r1 = part
        m = mx.maximum(m0, m1)
        w0, w1 = mx.exp(m0 - m), mx.exp(m1 - m)

        def add(x, y):
            if x is None or y is None:
                return None if x is None and y is None else (y * w1 if x is None else x * w0)
            return x * w0 + y * w1

        r = r0 or r1
        if r is not None:
            n = len(r)
            r = [add(x, y) for x, y in zip(r0 or [None] * n, r1 or [None] * n)]
        state = (m, l0 * w0 + l1 * w1, add(c0, c1), add(a0, a1), r)

    def softmax(s):
        mb = mx.max(s, axis=-1, keepdims=True)
        p = mx.exp(s - mb)
        return mb, p, mx.sum(p, axis=-1, keepdims=True)

    # Learned sinks: a partial softmax of one virtual token, score sinks[h], weight 1 at its own max, value 0.
    if sinks is not None:
        ms = sink_logits(sinks, B, H, R, L)
        merge((ms, mx.ones_like(ms), None, None, None))

    # Float tokens: sinks at [0, n_sinks), window at [n_sinks + n_compressed, T).
    n_s, n_c = keys.n_sinks, keys.n_compressed
    for kf, vf, a in ((keys.sinks, values.sinks, 0), (keys.window, values.window, n_s + n_c)):
        if kf is None:
            continue
        b = a + kf.shape[2]
        mb, p, lb = softmax(masked(q @ kf.astype(mx.float32).swapaxes(-1, -2), a, b))
        merge((mb, lb, None, p @ vf.astype(mx.float32), None))

    if n_c:
        # Compressed keys hold (x - μ) / scale: scaling the query instead costs one multiply per step.
        qk = q if keys.scale is None else q * keys.scale[:, :, None, None]
        if keys.weights is not None:  # ... and (x - μ)·w: the query is divided by w (query_weights)
            qk = qk / keys.weights[:, :, None, :]
        queries_in = {}  # per key quantizer (decayed codes have their own): the query in its bases
        # q·μ per query row, or (keys centered before RoPE) q·R(p) μ0 per row and token, per tile
        q_mu = (q @ keys.mean[..., None]) if keys.mean is not None and keys.rope is None else None  # (B, H, R·L, 1)
        tile = tile_size(B, Hq, L, tile_tokens)
        spans = []
        for a0, b0, ks, vs in aligned_segments(keys, values):
            n_tiles = -(-(b0 - a0) // tile)
            cuts = [a0 + (b0 - a0) * i // n_tiles for i in range(n_tiles + 1)]
            spans += [(a, b, ks, vs, a0) for a, b in zip(cuts[:-1], cuts[1:])]
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
                done = [x for x in (*state[:4], *(state[4] or ())) if x is not None]
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
                if q_mu is not None:
                    s = s + q_mu
                elif keys.rope is not None and not folded:
                    s = s + score_bias(q, keys.mean, keys.rope, keys.position + a, b - a)
                mb, p, lb = softmax(masked(s, n_s + a, n_s + b))
                # decayed and fresh values share one rotated basis: their accumulators add
                part = (mb, lb, lb, None, [(p * n) @ u for u, n in v_units])
            merge(part)
    if state is None:
        raise ValueError("attention over an empty cache: no tokens to attend to")
    m, l, l_c, out, acc_r = state
    if acc_r is not None:
        y = unrotate(values, acc_r)
        if values.scale is not None:
            y = y * values.scale[:, :, None, None]
        out = y if out is None else out + y
        if values.mean is not None:
            out = out + l_c * values.mean[:, :, None, :]
    out = out / l
    return out.reshape(B, Hq, L, Dv).astype(queries.dtype)
