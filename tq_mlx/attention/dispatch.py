"""The backend and the dispatchers: whether a kernel or its reference runs, call by call.

`dispatch_attention` (decode_attention for 1..8 query tokens, prefill_attention for more; on views with decayed
codes both take decode_attention's two passes), `dispatch_encode`, `dispatch_recode`, `dispatch_dequantize` and `dispatch_rotate` run
the kernel when the backend is Metal (`set_backend` or TQ_MLX_KERNELS = auto | metal | reference; auto means Metal
when `mx.metal.is_available()` and the default device is the GPU), the case is supported (support.py) and the
variant passed its self-check (selfcheck.py); else the reference. Batch views (tq_mlx.batch) run row by row, each
row through dispatch_attention.
"""

from __future__ import annotations

import math
import os
from typing import Callable, NamedTuple

import numpy as np

import mlx.core as mx

from .reference import attention_by_run, check_learned, keys_are_values, turboquant_attention
from ..quant.quantizer import MSECodes, TurboQuantMSE, TurboQuantProd
from ..quant.rotation import Rotation
from ..stream.view import StreamView
from .attend import decode_attention, decode_attention_reference, prefill_attention, prefill_attention_reference
from .codes import (dequantize, dequantize_reference, encode, encode_reference, recode, recode_reference, rotate,
                    rotate_reference)
from .launch import (MAX_QUERY_TOKENS, _Codes, _codes, _decayed, _default_factory, _float_dtype, _kv_codes,
                     _mask_kind, _prefill_rows, _rope_pairs, _rows_per_threadgroup, _span_codes)
from .selfcheck import _codes_mismatch, _mismatch, _normal, _random_mask, _random_view, _random_views, _rng, _self_check
from .support import (decode_unsupported, dequantize_unsupported, encode_unsupported, prefill_unsupported,
                      recode_unsupported, rotation_unsupported)

ENV_VAR = "TQ_MLX_KERNELS"
BACKENDS = ("auto", "metal", "reference")
_backend: str | None = None
_factory: Callable | None = None


def set_backend(mode: str | None) -> None:
    """'auto' (Metal kernels when Metal is the default device), 'metal' (force the kernels), 'reference'
    (force pure MLX). None returns to the TQ_MLX_KERNELS environment variable (default auto)."""
    if mode is not None and mode not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {mode!r}")
    global _backend
    _backend = mode


def get_backend() -> str:
    """The backend setting: set_backend's, else $TQ_MLX_KERNELS, else 'auto'."""
    if _backend is not None:
        return _backend
    env = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if env not in BACKENDS:
        raise ValueError(f"{ENV_VAR} must be one of {BACKENDS}, got {env!r}")
    return env


def set_kernel_factory(factory: Callable | None) -> None:
    """The `metal_kernel` factory the dispatchers use (None: mx.fast.metal_kernel). Tests inject the emulator."""
    global _factory
    _factory = factory


def metal_available() -> bool:
    try:
        return bool(mx.metal.is_available()) and mx.default_device().type == mx.DeviceType.gpu
    except Exception:
        return False


def kernels_enabled() -> bool:
    """Whether the dispatchers try the Metal kernels (each variant still has to pass its self-check)."""
    mode = get_backend()
    return mode == "metal" or (mode == "auto" and metal_available())


# ------------------------------------------------------------------------------------------ dispatch
def dispatch_rotate(x: mx.array, rotation: Rotation, inverse: bool = False, *, metal_kernel=None) -> mx.array:
    """rotate on Metal when enabled, supported and self-checked; rotate_reference otherwise."""
    factory = metal_kernel or _factory or _default_factory()
    if kernels_enabled() and rotation_unsupported(x, rotation) is None:
        def run():
            xs = _normal(_rng(1), (5, rotation.dim), x.dtype)
            return _mismatch(rotate(xs, rotation, inverse, metal_kernel=factory),
                             rotate_reference(xs, rotation, inverse))

        if _self_check("rotate", (rotation.dim, str(x.dtype), bool(inverse)), factory, run):
            return rotate(x, rotation, inverse, metal_kernel=factory)
    return rotate_reference(x, rotation, inverse)


def dispatch_encode(x: mx.array, quantizer, mean=None, perm=None, scale=None, *, metal_kernel=None):
    """encode on Metal when enabled, supported and self-checked; encode_reference otherwise. A stream's
    encoder (tq_mlx.stream.compressed.CompressedStream)."""
    factory = metal_kernel or _factory or _default_factory()
    if kernels_enabled() and encode_unsupported(x, quantizer, mean, perm, scale) is None:
        prod = isinstance(quantizer, TurboQuantProd)

        def run():
            rng = _rng(2)
            s = None if scale is None else mx.full((1, 2), 2.0**-3)
            xs = _normal(rng, (1, 2, 9, quantizer.dim), x.dtype)
            mu = None if mean is None else _normal(rng, (1, 2, quantizer.dim)) * 0.1
            order = None if perm is None else mx.array(np.stack([rng.permutation(quantizer.dim)
                                                                 for _ in range(2)]).astype(np.int32))
            return _codes_mismatch(encode(xs, quantizer, mu, order, s, metal_kernel=factory),
                                   encode_reference(xs, quantizer, mu, order, s), quantizer)

        kind = "qjl" if prod else "trellis" if _codes(quantizer).trellis else "mse"
        variant = (quantizer.dim, quantizer.bits, kind, str(x.dtype), mean is not None, scale is not None,
                   perm is not None, quantizer.correct_norms, str(quantizer.norm_dtype))
        if _self_check("encode", variant, factory, run):
            return encode(x, quantizer, mean, perm, scale, metal_kernel=factory)
    return encode_reference(x, quantizer, mean, perm, scale)


def dispatch_recode(codes: MSECodes, quantizer: TurboQuantMSE, to: TurboQuantMSE, *, metal_kernel=None) -> MSECodes:
    """recode on Metal when enabled, supported and self-checked; recode_reference otherwise. A stream's
    recoder (temporal decay)."""
    factory = metal_kernel or _factory or _default_factory()
    if kernels_enabled() and recode_unsupported(codes, quantizer, to) is None:
        def run():
            c = encode_reference(_normal(_rng(4), (1, 2, 9, quantizer.dim)), quantizer)
            return _codes_mismatch(recode(c, quantizer, to, metal_kernel=factory), recode_reference(c, quantizer, to),
                                   to)

        variant = (quantizer.dim, quantizer.bits, to.bits, len(quantizer.groups), to.correct_norms,
                   str(codes.norms.dtype), str(to.norm_dtype), _codes(quantizer).trellis, _codes(to).trellis)
        if _self_check("recode", variant, factory, run):
            return recode(codes, quantizer, to, metal_kernel=factory)
    return recode_reference(codes, quantizer, to)


def dispatch_dequantize(kv: StreamView, dtype: mx.Dtype = mx.float16, *, metal_kernel=None) -> mx.array:
    """dequantize on Metal when enabled, supported and self-checked; dequantize_reference otherwise."""
    factory = metal_kernel or _factory or _default_factory()
    if kv.decayed is not None:  # each segment as its own view, with its own variant and self-check
        return mx.concatenate([dispatch_dequantize(seg, dtype, metal_kernel=metal_kernel)
                               for _, seg in kv.segments()], axis=2)
    if kernels_enabled() and dequantize_unsupported(kv) is None:
        def run():
            h = _random_view(_rng(3), kv.quantizer, 0, 7, 0, kv)
            return _mismatch(dequantize(h, dtype, metal_kernel=factory), dequantize_reference(h, dtype), dtype)

        q = kv.quantizer
        kind = "qjl" if isinstance(q, TurboQuantProd) else "trellis" if _codes(q).trellis else "mse"
        variant = (q.dim, q.bits, kind, str(dtype), kv.mean is not None, kv.scale is not None, str(q.norm_dtype),
                   kv.weights is not None)
        if _self_check("dequantize", variant, factory, run):
            return dequantize(kv, dtype, metal_kernel=factory)
    return dequantize_reference(kv, dtype)


class AttentionVariant(NamedTuple):
    """What makes an attention kernel a separately compiled and self-checked variant (a self-check's key)."""

    key_dim: int
    value_dim: int
    key_codes: _Codes
    value_codes: _Codes
    keys: str  # "qjl" or "mse"
    rows: int | tuple[int, ...]  # decode: the R·L query rows; prefill: rows per threadgroup (per span if decayed)
    dtype: str  # the queries'
    mask: object  # _mask_kind: None, "causal" or (dtype, per batch, per head)
    floats: tuple[str, str]  # the keys' and values' float tokens' dtype
    key_mean: bool
    value_mean: bool
    key_scale: bool
    value_scale: bool
    key_perm: bool
    value_perm: bool
    key_weights: bool
    rope_pairs: int
    spans: tuple  # each span's code layouts with decayed codes, else ()
    sinks: bool
    keys_are_values: bool


def attention_variant(queries, keys: StreamView, values: StreamView, rows, mask_kind, sinks) -> AttentionVariant:
    kc, vc, qjl = _kv_codes(keys, values)
    return AttentionVariant(
        queries.shape[3], values.head_dim, kc, vc, "qjl" if qjl else "mse", rows, str(queries.dtype), mask_kind,
        tuple(str(_float_dtype(kv)) for kv in (keys, values)), keys.mean is not None, values.mean is not None,
        keys.scale is not None, values.scale is not None, keys.perm is not None, values.perm is not None,
        keys.weights is not None, _rope_pairs(keys), _span_codes(keys, values) if _decayed(keys, values) else (),
        sinks is not None, keys_are_values(keys, values))


def dispatch_attention(queries, keys, values, scale, mask=None, sinks=None, *, metal_kernel=None) -> mx.array:
    """Drop-in for tq_mlx.attention.reference.turboquant_attention on a Metal back end (after a self-check per variant):
    decode_attention for 1..8 query tokens, prefill_attention for longer chunks, both with mask None, "causal"
    or a bool/additive array, learned sinks or none, and a compressed context; the reference path for
    everything else."""
    if isinstance(keys, StreamView):
        check_learned(keys)
        if keys.recent is not None:  # each run of the chunk's queries as a decode step reads the cache
            attend = lambda q, k, v, **kw: dispatch_attention(q, k, v, metal_kernel=metal_kernel, **kw)  # noqa: E731
            return attention_by_run(attend, queries, keys, values, scale, mask, sinks)
    factory = metal_kernel or _factory or _default_factory()
    kind = _mask_kind(mask) if isinstance(queries, mx.array) else None
    if (kernels_enabled() and isinstance(queries, mx.array) and queries.ndim == 4
            and queries.shape[2] > MAX_QUERY_TOKENS and prefill_unsupported(queries, keys, values, mask, sinks) is None):
        B, Hq, L, D = queries.shape
        R = Hq // keys.n_heads
        kc, vc, qjl = _kv_codes(keys, values)
        decayed = _decayed(keys, values)
        spans = _span_codes(keys, values) if decayed else ()
        # rows per threadgroup: prefill_attention's query tile; on decayed views pass 1's rows, one per span
        npairs = _rope_pairs(keys)
        nr = (tuple(_rows_per_threadgroup(R * L, D, values.head_dim, *c, npairs) for c in spans) if decayed
              else _prefill_rows(R * L, D, values.head_dim, kc, vc, qjl, npairs))

        def run():
            # The same compiled variant (rows per threadgroup) on a small cache: 2 query tiles, the last partial,
            # 40 compressed tokens before the chunk's (2 tiles of 32 or more; per span with decayed codes), the
            # causal mask reaching into them.
            rng = _rng(5)
            lc = max(MAX_QUERY_TOKENS + 1, -(-((max(nr) if decayed else nr) + 1) // R))
            k, v = _random_views(rng, keys, values, 2, 40, 3, tail=lc)
            qs = _normal(rng, (1, R, lc, D), queries.dtype)
            ms = _random_mask(np.random.default_rng(5), kind, R, lc, k.n_tokens)
            ls = None if sinks is None else _normal(rng, (R,), sinks.dtype)
            sc = 1.0 / math.sqrt(D)
            got = prefill_attention(qs, k, v, sc, ms, ls, rows_per_threadgroup=nr, metal_kernel=factory)
            return _mismatch(got, prefill_attention_reference(qs, k, v, sc, ms, ls), queries.dtype)

        variant = attention_variant(queries, keys, values, nr, kind, sinks)
        if _self_check("prefill_attention", variant, factory, run):
            return prefill_attention(queries, keys, values, scale, mask, sinks, rows_per_threadgroup=nr,
                                     metal_kernel=factory)
        return turboquant_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
    if kernels_enabled() and decode_unsupported(queries, keys, values, mask, sinks) is None:
        B, Hq, L, D = queries.shape
        R = Hq // keys.n_heads

        def run():
            # 45 compressed tokens (per span with decayed codes): splits of 32, the last partial
            rng = _rng(4)
            k, v = _random_views(rng, keys, values, 2, 45, 3)
            qs = _normal(rng, (1, R, L, D), queries.dtype)
            ms = _random_mask(np.random.default_rng(4), kind, R, L, k.n_tokens)
            ls = None if sinks is None else _normal(rng, (R,), sinks.dtype)
            sc = 1.0 / math.sqrt(D)
            got = decode_attention(qs, k, v, sc, ms, ls, split_tokens=32, metal_kernel=factory)
            return _mismatch(got, decode_attention_reference(qs, k, v, sc, ms, ls), queries.dtype)

        variant = attention_variant(queries, keys, values, R * L, kind, sinks)
        if _self_check("decode_attention", variant, factory, run):
            return decode_attention(queries, keys, values, scale, mask, sinks, metal_kernel=factory)
    return turboquant_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)


def float_tokens(view: StreamView, dtype: mx.Dtype, after: mx.array | None = None) -> mx.array:
    """Every token of a view as one float tensor (B, H, n_tokens, D) `dtype` in the model basis: the sinks, the
    compressed tokens decoded (the dequantize kernel on Metal), the window. `after`: decode only once it exists."""
    parts = [view.sinks]
    for _, seg in view.segments():  # decayed codes, then fresh ones
        codes = seg.codes if after is None else type(seg.codes)(*mx.depends(list(seg.codes), [after]))
        parts.append(dispatch_dequantize(seg._replace(codes=codes), dtype))
    parts.append(view.window)
    parts = [p.astype(dtype) for p in parts if p is not None]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)
