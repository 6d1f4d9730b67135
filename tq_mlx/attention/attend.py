"""Launchers of the attention kernels on the codes, each beside its reference twin (turboquant_attention):
decode_attention for 1..8 query tokens (decode_partial.metal, then decode_merge.metal) and prefill_attention for
prefill chunks (prefill_attention.metal).

Launch design (grid counts threads; B batch, H kv heads, R = n_q_heads / H, L query tokens, D dims):
    decode_partial  grid (S·32·min(NR, 8), B·H, ceil(R·L / NR)): one threadgroup per (split of the compressed
                    tokens, kv head, chunk of NR query rows; one chunk unless threadgroup memory needs more);
                    tiles of 32 tokens staged in threadgroup memory (each word read once), lane = token for
                    scores, lane = dims for values; sparse V skips the values of weights < ε/n · running max
                    (SPARSE_V_EPSILON); where the keys are the values (MLA's latent) the staged key words and
                    norms serve as the values'
    decode_merge    grid (32·min(R·L, 8), B·H, ceil(R·L / 8)): one SIMD group per query row, starting at the
                    learned sink (m, l) = (sink logit, 1) if any: float sinks + window, LSE merge of the S
                    partials (+ q·μ), one inverse WHT, + l_c·ν, / l
    prefill         grid (32·min(NR, 8), B·H, ceil(R·L / NR)), NR = the query tile (up to 64 rows as threadgroup
                    memory allows): one online softmax per row over the float sinks and window, then the
                    compressed tokens in tiles of 32 as decode_partial (each word read once per tile); acc_f
                    (model basis) and acc_c (rotated) rescaled together; writes nothing but the output
The split size (_split_tokens) keeps pass 1's partials under 5% of the code bytes the split reads.

Codes: one group, or two for fractional bits, read in the keys' and values' rotated bases. One group under a
power-of-two WHT: the wht kernel rotates the queries and the kernel rotates values back; otherwise the host
rotates the query rows (attention.split_query) and the kernel writes the compressed part of each output row in
the rotated basis for attention.unrotate. Keys centered before RoPE: the kernels add q·R(p)μ0 per token from 2·P
terms per query row (_prepare; common.metal tq_rope_*). Masks (_mask_inputs) are read per (query row, token)
where a score is made; learned sinks are one logit per query head, a token of value 0 that starts each row.

Temporal decay: attention.aligned_segments cuts the compressed tokens into 1..3 spans of one key and one value
quantizer. Pass 1 runs once per span, its own compiled variant, with the span's token count, its first mask
column n_sinks + a and the causal limit lowered by a; the query rows (one rotated basis:
support._decay_unsupported) and q·μ are shared, and pass 2 merges every span's partials as one. Prefill chunks on
decayed views take the same two passes (prefill_attention.metal holds one codebook per side).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import mlx.core as mx

from .reference import keys_are_values, split_query, turboquant_attention, unrotate
from ..quant.quantizer import TurboQuantProd
from ..models.rope import bias_terms
from ..stream.view import StreamView
from .codes import rotate
from .launch import (SPARSE_V_EPSILON, THREADGROUP_MEMORY, _NO_LIMIT, _Codes, _decayed, _default_factory, _dummy,
                     _float_dtype, _floats, _ints, _kernel, _kv_codes, _mask_inputs, _mse, _mx, _partial_layout,
                     _partial_tg_bytes, _prefill_layout, _prefill_rows, _rope_pairs, _rows_per_threadgroup,
                     _sink_input, _spans, _tables)
from .support import _require, decode_unsupported, prefill_unsupported


# ------------------------------------------------------------------------ both kernels' inputs
class _Prepared(NamedTuple):
    """What both attention kernels take besides the cache views, computed once per call."""

    q: mx.array  # (B, H, RL, DK) float32 = scale·q, model basis; rows of a kv head: head_in_group·L + token
    q_rot: mx.array  # the keys' rotated basis (× s_k): one WHT, or each group's Π_g (q[order])_g side by side
    qs: mx.array  # S·s_k·scale·q (QJL), else a dummy
    qmu: mx.array | None  # (B, H, RL) scale·q·μ (keys centered before RoPE: its constant part, tq_mlx.models.rope)
    rterms: mx.array  # (B, H, RL, 2·NP) float32 [A | B] of scale·q (keys centered before RoPE), else a dummy
    rfreqs: mx.array  # (NP,) float32 pair frequencies, else a dummy
    np: int  # RoPE pairs (0: keys not centered before RoPE)
    kc: _Codes
    vc: _Codes
    qjl: bool
    tables: mx.array  # float32 [key centroids per group | value centroids per group | qjl scale | ε]
    keqv: bool  # the keys are the values (one view: MLA's latent): value codes are not read again

    def template(self) -> list[tuple[str, Any]]:
        return [("QJL", self.qjl), ("KEQV", self.keqv), *self.kc.template("K"), *self.vc.template("V"),
                ("ROTV", self.vc.wht)]


def _shape(queries: mx.array, keys: StreamView, values: StreamView) -> tuple[int, ...]:
    """(B, Hq, L, DK, H, DV, RL, N, n_s, n_w, T): queries' shape, kv heads and value dim, the R·L query rows of a
    kv head, its compressed, sink and window tokens, and all of them."""
    B, Hq, L, DK = queries.shape
    H = keys.n_heads
    N, n_s, n_w = keys.n_coded, keys.n_sinks, keys.n_window
    return B, Hq, L, DK, H, values.head_dim, (Hq // H) * L, N, n_s, n_w, n_s + N + n_w


def _prepare(queries: mx.array, keys: StreamView, values: StreamView, scale: float, sparse_epsilon: float,
             factory) -> _Prepared:
    B, Hq, L, DK = queries.shape
    H = keys.n_heads
    kc, vc, qjl = _kv_codes(keys, values)
    kq = keys.quantizer
    q = mx.contiguous((queries.astype(mx.float32) * scale).reshape(B, H, (Hq // H) * L, DK))
    # Compressed keys hold (k - μ) / s_k: the query is scaled instead, once per call.
    qk = q if keys.scale is None else q * keys.scale.astype(mx.float32)[:, :, None, None]
    if keys.weights is not None:  # ... and (k - μ)·w: the query is divided by w (calibration.query_weights)
        qk = qk / keys.weights.astype(mx.float32)[:, :, None, :]
    if kc.wht:
        q_rot = rotate(qk, _mse(kq).groups[0].rotation, metal_kernel=factory)
        qs = mx.contiguous(qk @ kq.projection.T) if qjl else _dummy(mx.float32)
    else:  # channel groups or another rotation: the reference's own query transform (a few rows)
        parts, sq = split_query(qk, keys)
        q_rot = mx.contiguous(parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1))
        qs = mx.contiguous(sq) if qjl else _dummy(mx.float32)
    qmu, rterms, rfreqs = None, _dummy(mx.float32), _dummy(mx.float32)
    if keys.rope is not None:  # q·R(p) μ0 = c + Σ_k A_k cos(p f_k) + B_k sin(p f_k): c here, the rest per token
        qmu, a, b = bias_terms(q, keys.mean, keys.rope)
        rterms, rfreqs = mx.contiguous(mx.concatenate([a, b], axis=-1)), keys.rope.freqs
    elif keys.mean is not None:
        qmu = mx.contiguous((q @ keys.mean.astype(mx.float32)[..., None]).reshape(q.shape[:3]))
    tables = _attention_tables(kq, values.quantizer, sparse_epsilon)
    return _Prepared(q, q_rot, qs, qmu, rterms, rfreqs, _rope_pairs(keys), kc, vc, qjl, tables,
                     keys_are_values(keys, values))


def _attention_tables(kq, vq, sparse_epsilon: float) -> mx.array:
    qjl = isinstance(kq, TurboQuantProd)
    return _tables(kq, ("attention", vq, sparse_epsilon), lambda: _floats(
        *[g.centroids for g in _mse(kq).groups], *[g.centroids for g in vq.groups],
        [kq.qjl_scale if qjl else 0.0, sparse_epsilon]))


def _for_span(p: _Prepared, ks: StreamView, vs: StreamView, sparse_epsilon: float) -> _Prepared:
    """The prepared call for one span of decayed or fresh codes: its code layouts and centroid tables; the
    query rows (one rotated basis for both ages, _decay_unsupported) and q·μ are the call's."""
    kc, vc, qjl = _kv_codes(ks, vs)
    if qjl != p.qjl:
        raise ValueError("decayed and fresh keys must both be QJL keys or neither")
    return p._replace(kc=kc, vc=vc, tables=_attention_tables(ks.quantizer, vs.quantizer, sparse_epsilon),
                      keqv=keys_are_values(ks, vs))


def _outputs(p: _Prepared, queries: mx.array, DV: int) -> tuple[list, list, list]:
    """Output shapes and dtypes of the kernel writing the rows, and its T/TO template: with the value rotation
    in-kernel the output in queries' dtype; else float32 `out` (float tokens and l_c·ν) and `outc` (the
    compressed part in the rotated basis) for `_finish`."""
    B, H, RL = p.q.shape[:3]
    if p.vc.wht:
        return [(B, H, RL, DV), (1,)], [queries.dtype, mx.float32], [("T", queries.dtype), ("TO", queries.dtype)]
    return [(B, H, RL, DV)] * 2, [mx.float32] * 2, [("T", queries.dtype), ("TO", mx.float32)]


def _finish(p: _Prepared, out, outc, values: StreamView, queries: mx.array, times_scale: bool) -> mx.array:
    """The rows in the model basis and queries' shape and dtype: adds Πᵀ·outc (· s_v) where the kernel did
    not rotate values back (attention.unrotate: groups, channel order, any rotation)."""
    B, Hq, L, _ = queries.shape
    out = _mx(out, queries.dtype if p.vc.wht else mx.float32)
    if not p.vc.wht:
        outc = _mx(outc, mx.float32)
        d0 = p.vc.groups[0][0]
        y = unrotate(values, [outc] if len(p.vc.groups) == 1 else [outc[..., :d0], outc[..., d0:]])
        if times_scale and values.scale is not None:
            y = y * values.scale.astype(mx.float32)[:, :, None, None]
        out = (out + y).astype(queries.dtype)
    return out.reshape(B, Hq, L, -1)


# ------------------------------------------------------------------------------- decode attention
def _split_tokens(n: int, groups: int, partial_bytes: int, token_bytes: int) -> int:
    """Tokens per split, a multiple of 32: about 1024 threadgroups in flight, at least 256 tokens, and enough
    tokens that a split's partial result (partial_bytes, written and read back) stays under 5% of the
    compressed bytes it reads (token_bytes per token)."""
    per = max(256, -(-n // max(1, -(-1024 // groups))), -(-20 * partial_bytes // token_bytes))
    return -(-per // 32) * 32


def decode_attention(
    queries: mx.array,
    keys: StreamView,
    values: StreamView,
    scale: float,
    mask=None,
    sinks=None,
    *,
    split_tokens: int | None = None,
    sparse_epsilon: float = SPARSE_V_EPSILON,
    metal_kernel=None,
) -> mx.array:
    """softmax(scale·q·Kᵀ)·V on the codes for 1..8 query tokens, (B, Hq, L, D) -> (B, Hq, L, Dv).

    Same semantics as tq_mlx.attention.reference.turboquant_attention: mask None, "causal" or a bool/additive array,
    learned `sinks` (n_q_heads,) or None. Queries are rotated once (WHT kernel); pass 1 reads each compressed
    byte of a kv head once for all R·L query rows of its GQA group (once per chunk of rows where threadgroup
    memory needs chunks), per split of the context, and writes (m, l, acc) with acc in the rotated basis; pass
    2 starts each row at its learned sink, merges the splits with the float sinks and window, rotates back once
    and adds the value mean. With decayed codes (temporal decay) pass 1 runs once per span of one key and one
    value quantizer (attention.aligned_segments), each with its own variant, and pass 2 merges all their splits.
    Sparse V departs from the exact result by at most sparse_epsilon · max_i ‖v_i - ν‖₂ per row
    (SPARSE_V_EPSILON); < 0 keeps all.
    """
    _require(decode_unsupported(queries, keys, values, mask, sinks), "decode_attention")
    return _two_pass(queries, keys, values, scale, mask, sinks, split_tokens, None, sparse_epsilon,
                     metal_kernel or _default_factory())


def _two_pass(queries, keys, values, scale, mask, sinks, split_tokens, rows, sparse_epsilon, factory) -> mx.array:
    """decode_partial per span and split, then decode_merge: decode attention, and prefill on decayed views.
    rows: query rows per pass-1 threadgroup, one int for every span or one per span (None: as many as fit)."""
    B, Hq, L, DK, H, DV, RL, N, n_s, n_w, T = _shape(queries, keys, values)
    causal = isinstance(mask, str)
    amask, mask_template, mask_strides = _mask_inputs(mask, L, T)
    p = _prepare(queries, keys, values, scale, sparse_epsilon, factory)
    if split_tokens is not None and (split_tokens % 32 or split_tokens <= 0):
        raise ValueError(f"split_tokens must be a positive multiple of 32, got {split_tokens}")
    spans = _spans(keys, values)
    if rows is not None and not isinstance(rows, int) and len(rows) != len(spans):
        raise ValueError(f"rows per threadgroup for {len(rows)} spans of codes, the view has {len(spans)}")

    # Pass 1: split-K partials over the compressed tokens, span by span (decayed codes, then fresh ones).
    p1 = _kernel(factory, "decode_partial",
                 ["q", "qs", "kc", "kn", "kj", "kg", "vc", "vn", "tables", "amask", "rterms", "rfreqs", "params"],
                 ["pm", "pl", "pacc"], row_contiguous=False)
    partials = []
    for i, (a, b, ks, vs) in enumerate(spans):
        sp = p if (ks is keys and vs is values) else _for_span(p, ks, vs, sparse_epsilon)
        nr = (rows if isinstance(rows, int) else rows[i]) if rows is not None else (
            _rows_per_threadgroup(RL, DK, DV, sp.kc, sp.vc, sp.qjl, p.np))
        layout = _partial_layout(nr, DK, DV, sp.kc, sp.vc, sp.qjl, p.np)
        if nr < 1 or nr & (nr - 1) or _partial_tg_bytes(layout) > THREADGROUP_MEMORY:
            raise ValueError(f"rows per threadgroup must be a power of two within threadgroup memory, got {nr}")
        chunks = -(-RL // nr)
        kc, vc = ks.codes, vs.codes
        read = kc if sp.keqv else (*kc, *vc)  # what pass 1 reads per token
        token_bytes = sum(x.itemsize * math.prod(x.shape[3:]) for x in read)
        # Split sizes from the whole context's token count (about 1024 threadgroups over all spans) and the
        # span's own bytes per token (the partials stay under 5% of what the split reads).
        per = split_tokens or _split_tokens(N, B * H * chunks, 4 * RL * (DV + 2), token_bytes)
        n = b - a
        S = -(-n // per)
        nt = 32 * min(nr, 8)
        partials.append(p1(
            inputs=[sp.q_rot, sp.qs, kc.codes, kc.norms, kc.qjl if sp.qjl else _dummy(mx.uint32, 4),
                    kc.gamma if sp.qjl else _dummy(mx.float16, 3), vc.codes, vc.norms, sp.tables, amask,
                    p.rterms, p.rfreqs,
                    # the span's token 0 is compressed token a: mask column n_s + a, causal limit shifted by a
                    _ints(H, n, RL, L, per, T - L - n_s - a if causal else _NO_LIMIT, n_s + a, *mask_strides,
                          keys.position + a)],
            output_shapes=[(B, H, S, RL), (B, H, S, RL), (B, H, S, RL, DV)],
            output_dtypes=[mx.float32] * 3,
            grid=(S * nt, B * H, chunks), threadgroup=(nt, 1, 1),
            template=[("DK", DK), ("DV", DV), ("NR", nr), *sp.template(), *mask_template, *layout],
        ))
    if len(partials) == 1:
        pm, pl, pacc = partials[0]
    else:  # the splits of every span side by side: pass 2 merges them all alike
        pm, pl, pacc = (mx.concatenate([_mx(part[j], mx.float32) for part in partials], axis=2) for j in range(3))
    S = pm.shape[2]

    if values.scale is not None:  # compressed values hold (v - ν) / s_v (decayed ones too)
        pacc = _mx(pacc, mx.float32) * values.scale.astype(mx.float32)[:, :, None, None, None]

    # Pass 2: merge with the float tokens, rotate back, add the value mean. An absent part is a dummy of its
    # side's float dtype (sinks and window share one in the kernel).
    kdum, vdum = _dummy(_float_dtype(keys), 4), _dummy(_float_dtype(values), 4)
    nsg = min(RL, 8)  # one SIMD group per query row, 8 rows per threadgroup (MLA: 16..128 rows of one kv head)
    shapes, dtypes, types = _outputs(p, queries, DV)
    p2 = _kernel(factory, "decode_merge",
                 ["q", "qmu", "ks", "vs", "kw", "vw", "pm", "pl", "pacc", "vmean", "vsigns", "lsink", "amask",
                  "params"],
                 ["out", "outc"], row_contiguous=False)
    out, outc = p2(
        inputs=[p.q, _dummy(mx.float32) if p.qmu is None else p.qmu,
                keys.sinks if n_s else kdum, values.sinks if n_s else vdum,
                keys.window if n_w else kdum, values.window if n_w else vdum,
                _mx(pm, mx.float32), _mx(pl, mx.float32), _mx(pacc, mx.float32),
                _dummy(mx.float32) if values.mean is None else mx.contiguous(values.mean.astype(mx.float32)),
                values.quantizer.groups[0].rotation.signs if p.vc.wht else _dummy(mx.float32),
                _sink_input(sinks), amask,
                _ints(H, RL, L, S, n_s, n_w, p.qmu is not None, values.mean is not None,
                      T - L if causal else _NO_LIMIT, T - L - n_s - N if causal else _NO_LIMIT, sinks is not None,
                      N, *mask_strides)],
        output_shapes=shapes, output_dtypes=dtypes,
        grid=(32 * nsg, B * H, -(-RL // nsg)), threadgroup=(32 * nsg, 1, 1),
        template=[*types, ("DK", DK), ("DV", DV), ("ROTV", p.vc.wht), *mask_template],
    )
    return _finish(p, out, outc, values, queries, times_scale=False)  # pacc already carries s_v


def decode_attention_reference(queries, keys, values, scale, mask=None, sinks=None, **_) -> mx.array:
    return turboquant_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)


# ------------------------------------------------------------------------------ prefill attention
def prefill_attention(
    queries: mx.array,
    keys: StreamView,
    values: StreamView,
    scale: float,
    mask=None,
    sinks=None,
    *,
    rows_per_threadgroup: int | tuple[int, ...] | None = None,
    sparse_epsilon: float = SPARSE_V_EPSILON,
    metal_kernel=None,
) -> mx.array:
    """softmax(scale·q·Kᵀ)·V on the codes for any number of query tokens (prefill chunks), (B, Hq, L, D) ->
    (B, Hq, L, Dv), mask None, "causal" (queries at the end of the cache) or a bool/additive array, learned
    `sinks` or None, as turboquant_attention.

    One launch (after the query rotation): a threadgroup per (batch·kv head, tile of `rows_per_threadgroup`
    query rows of the GQA group) runs one online softmax over the float sinks, every compressed token (32 per
    tile, read from device memory once per query tile) and the float window, and writes the output rows. Device
    memory beyond the inputs and the output: the float32 query rows in three bases (model, rotated, S·q with
    QJL; times s_k) and q·μ, 4·B·Hq·L·(4·D + 1) bytes at most, whatever the context length; no partials, no
    scores.
    Sparse V departs by at most sparse_epsilon · max_i ‖v_i - ν‖₂ per row, as in decode_attention.

    Views with decayed codes (temporal decay: two codebooks per side, where prefill_attention.metal holds one)
    take decode_attention's two passes instead, for all R·L rows: decode_partial per span of one key and one
    value quantizer (query rows in tiles as here, `rows_per_threadgroup` one int for every span or one per
    span), then decode_merge; see the module docstring for what that costs.
    """
    _require(prefill_unsupported(queries, keys, values, mask, sinks), "prefill_attention")
    factory = metal_kernel or _default_factory()
    if _decayed(keys, values):
        return _two_pass(queries, keys, values, scale, mask, sinks, None, rows_per_threadgroup, sparse_epsilon,
                         factory)
    if rows_per_threadgroup is not None and not isinstance(rows_per_threadgroup, int):
        raise ValueError("rows_per_threadgroup: one int without decayed codes")
    B, Hq, L, DK, H, DV, RL, N, n_s, n_w, T = _shape(queries, keys, values)
    causal = isinstance(mask, str)
    amask, mask_template, mask_strides = _mask_inputs(mask, L, T)
    p = _prepare(queries, keys, values, scale, sparse_epsilon, factory)
    nr = rows_per_threadgroup or _prefill_rows(RL, DK, DV, p.kc, p.vc, p.qjl, p.np)
    layout = _prefill_layout(nr, DK, DV, p.kc, p.vc, p.qjl, p.np)
    if nr & (nr - 1) or _partial_tg_bytes(layout) > THREADGROUP_MEMORY:
        raise ValueError(f"rows_per_threadgroup must be a power of two within threadgroup memory, got {nr}")
    kdum, vdum = _dummy(_float_dtype(keys), 4), _dummy(_float_dtype(values), 4)
    kc, vc = keys.codes, values.codes
    nsg = min(nr, 8)
    shapes, dtypes, types = _outputs(p, queries, DV)
    k = _kernel(factory, "prefill_attention",
                ["qf", "qr", "qs", "qmu", "ksink", "vsink", "kwin", "vwin", "kc", "kn", "kj", "kg", "vc", "vn",
                 "tables", "vsigns", "vmean", "vscale", "lsink", "amask", "rterms", "rfreqs", "params"], ["out", "outc"],
                row_contiguous=False)
    out, outc = k(
        inputs=[p.q, p.q_rot, p.qs, _dummy(mx.float32) if p.qmu is None else p.qmu,
                keys.sinks if n_s else kdum, values.sinks if n_s else vdum,
                keys.window if n_w else kdum, values.window if n_w else vdum,
                kc.codes, kc.norms, kc.qjl if p.qjl else _dummy(mx.uint32, 4),
                kc.gamma if p.qjl else _dummy(mx.float16, 3), vc.codes, vc.norms, p.tables,
                values.quantizer.groups[0].rotation.signs if p.vc.wht else _dummy(mx.float32),
                _dummy(mx.float32) if values.mean is None else mx.contiguous(values.mean.astype(mx.float32)),
                _dummy(mx.float32) if values.scale is None else mx.contiguous(values.scale.astype(mx.float32)),
                _sink_input(sinks), amask, p.rterms, p.rfreqs,
                _ints(H, N, RL, L, n_s, n_w,
                      T - L - n_s if causal else _NO_LIMIT,  # compressed token t: t <= this + query token
                      T - L if causal else _NO_LIMIT,  # sink t
                      T - L - n_s - N if causal else _NO_LIMIT,  # window token t
                      p.qmu is not None, values.mean is not None, values.scale is not None, sinks is not None,
                      *mask_strides, keys.position)],
        output_shapes=shapes, output_dtypes=dtypes,
        grid=(32 * nsg, B * H, -(-RL // nr)), threadgroup=(32 * nsg, 1, 1),
        template=[*types, ("DK", DK), ("DV", DV), ("NR", nr), *p.template(), *mask_template, *layout],
    )
    return _finish(p, out, outc, values, queries, times_scale=True)


def prefill_attention_reference(queries, keys, values, scale, mask=None, sinks=None, **_) -> mx.array:
    return turboquant_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
