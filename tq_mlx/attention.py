"""Attention on TurboQuant codes: the reference path, in pure MLX.

`turboquant_attention(queries, keys, values, scale, mask)` has the signature of mlx-lm's
`quantized_scaled_dot_product_attention` (tq_mlx.integration routes it there) and takes the two
`CompressedKV` handles a `TurboQuantKVCache` returns. A kernel path shares the signature.

For one query q (already times `scale`) and kv head, with compressed tokens t quantized as
x_t - μ in the quantizer's input basis (channels in `perm` order, each group rotated by its Π_g):

    score_t = Σ_g (Π_g q[perm]_g) · ŷ_t,g  (+ QJL term)  + q·μ      ŷ = codebook value × norm, rotated basis
    out     = (Σ_float p_t v_t  +  Πᵀ Σ_compressed p_t ŷᵛ_t  [un-permuted]  +  (Σ_compressed p_t)·ν) / Σ p_t

Queries are rotated once per call, values are accumulated in the rotated basis and rotated back once per
query and head. Sinks and the window (float16, model basis) merge with the compressed tokens by an online
log-sum-exp, and the compressed tokens are read in blocks of at most `block_size` tokens (fewer for long
query chunks, so one block's scores stay under SCORE_BUDGET elements): transient memory is bounded by the
block, never a float copy of the whole cache. Everything is float32; the result has queries' dtype.
"""

from __future__ import annotations

import mlx.core as mx

from .cache import CompressedKV
from .packing import unpack
from .quantizer import MSECodes, TurboQuantProd

BLOCK_SIZE = 4096
# Cap on the float32 scores of one block, (B, n_q_heads, L, block): long prefill chunks get shorter blocks.
SCORE_BUDGET = 1 << 24  # elements (64 MB)
_NEG = float(mx.finfo(mx.float32).min)


def _split_query(q: mx.array, kv: CompressedKV):
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


def _codes_block(codes, a: int, b: int):
    return type(codes)(*(x[:, :, a:b] for x in codes))


def _rotated(kv: CompressedKV, codes) -> list[mx.array]:
    """Per group, the block's dequantized tokens (B, H, t, d_g) in that group's rotated basis."""
    q = kv.quantizer
    if isinstance(q, TurboQuantProd):
        return [] if q.mse is None else q.mse.rotated_values(MSECodes(codes.codes, codes.norms))
    return q.rotated_values(MSECodes(codes.codes, codes.norms))


def _unrotate(kv: CompressedKV, parts: list[mx.array]) -> mx.array:
    """Rotated-basis accumulators per group -> the model basis (inverse rotations, then channel order)."""
    q = kv.quantizer
    y = [g.rotation.inverse(p) for g, p in zip(q.groups, parts)]
    y = y[0] if len(y) == 1 else mx.concatenate(y, axis=-1)
    # Position j of y is quantizer channel channels[j], which is model channel perm[channels[j]].
    order = None if len(q.groups) == 1 else mx.concatenate([g.channels for g in q.groups])
    if kv.perm is not None:
        order = kv.perm if order is None else mx.take(kv.perm, order, axis=-1)
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


def turboquant_attention(
    queries: mx.array,
    keys: CompressedKV,
    values: CompressedKV,
    scale: float,
    mask=None,
    block_size: int = BLOCK_SIZE,
) -> mx.array:
    """softmax(scale·q·Kᵀ + mask)·V over a TurboQuant cache. queries (B, n_q_heads, L, D) -> (B, n_q_heads, L, Dv).

    mask: None, "causal" (lower-right aligned), or a bool/additive array (L, T) / (B, 1, L, T) /
    (B, n_q_heads, L, T) over the cache's T tokens in order (sinks, compressed, window).
    """
    B, Hq, L, D = queries.shape
    T, H, Dv = keys.n_tokens, keys.n_heads, values.head_dim
    R = Hq // H
    # (B, H, R·L, D): query heads of one kv head are consecutive, as in mlx-lm's GQA reshape. A new array:
    # the caller's queries are never modified.
    q = (queries.astype(mx.float32) * scale).reshape(B, H, R * L, D)
    mask_at = _mask_fn(mask, B, H, R, L, T)

    m = mx.full((B, H, R * L, 1), _NEG, mx.float32)  # running max
    l = mx.zeros((B, H, R * L, 1), mx.float32)  # running Σ p
    acc = mx.zeros((B, H, R * L, Dv), mx.float32)  # Σ p·v over float tokens, model basis
    l_c = mx.zeros((B, H, R * L, 1), mx.float32)  # Σ p over compressed tokens (for ν)
    acc_r = None  # per value group, Σ p·ŷ over compressed tokens, rotated basis

    def softmax_step(s, a, b):
        nonlocal m, l, acc, l_c, acc_r
        mk = mask_at(a, b)
        if mk is not None:
            s5 = s.reshape(B, H, R, L, b - a)
            s5 = mx.where(mk, s5, _NEG) if mk.dtype == mx.bool_ else s5 + mk.astype(mx.float32)
            s = s5.reshape(B, H, R * L, b - a)
        m_new = mx.maximum(m, mx.max(s, axis=-1, keepdims=True))
        alpha = mx.exp(m - m_new)
        p = mx.exp(s - m_new)
        m = m_new
        l = l * alpha + mx.sum(p, axis=-1, keepdims=True)
        acc = acc * alpha
        l_c = l_c * alpha
        if acc_r is not None:
            acc_r = [x * alpha for x in acc_r]
        return p

    # Float tokens: sinks at [0, n_sinks), window at [n_sinks + n_compressed, T).
    n_s, n_c = keys.n_sinks, keys.n_compressed
    for kf, vf, a in ((keys.sinks, values.sinks, 0), (keys.window, values.window, n_s + n_c)):
        if kf is None:
            continue
        b = a + kf.shape[2]
        p = softmax_step(q @ kf.astype(mx.float32).swapaxes(-1, -2), a, b)
        acc = acc + p @ vf.astype(mx.float32)

    if n_c:
        q_groups, sq = _split_query(q, keys)
        q_mu = (q @ keys.mean[..., None]) if keys.mean is not None else None  # (B, H, R·L, 1)
        block = max(1, min(block_size, max(256, SCORE_BUDGET // (B * Hq * L))))
        for a in range(0, n_c, block):
            b = min(a + block, n_c)
            kc, vc = _codes_block(keys.codes, a, b), _codes_block(values.codes, a, b)
            s = None
            for qg, y in zip(q_groups, _rotated(keys, kc)):
                sg = qg @ y.swapaxes(-1, -2)
                s = sg if s is None else s + sg
            if sq is not None:  # QJL: √(π/2)/d · γ_t · ⟨S q, z_t⟩, z = ±1
                kq = keys.quantizer
                z = unpack(kc.qjl, 1, kq.dim).astype(mx.float32) * 2.0 - 1.0
                sj = (sq @ z.swapaxes(-1, -2)) * (kq.qjl_scale * kc.gamma.astype(mx.float32)[:, :, None, :])
                s = sj if s is None else s + sj
            if q_mu is not None:
                s = s + q_mu
            p = softmax_step(s, n_s + a, n_s + b)
            l_c = l_c + mx.sum(p, axis=-1, keepdims=True)
            yv = _rotated(values, vc)
            contrib = [p @ y for y in yv]
            acc_r = contrib if acc_r is None else [x + c for x, c in zip(acc_r, contrib)]
        out = acc + _unrotate(values, acc_r)
        if values.mean is not None:
            out = out + l_c * values.mean[:, :, None, :]
    else:
        out = acc
    out = out / l
    return out.reshape(B, Hq, L, Dv).astype(queries.dtype)
