"""Why a kernel cannot take an input: the `*_unsupported` checks (None: it can), asked by the dispatchers before
a kernel runs and enforced by the launchers (`_require`).

The kernels take head dims 16..512 (key and value dims may differ), code groups of every width a quantizer packs
(KERNEL_BITS: 1, 2, 3, 4, 5, 6, 8 bits), so every bit width the config takes (1, 2, 2.5, 3, 3.5, 4, 5, 6, 8; QJL keys
2, 3, 4: an MSE stage of 1..3 bits + 1 QJL bit), float16 norms or their one-byte log codes (int8 fine, uint8 coarse),
float16/bfloat16/float32 inputs, masks None, "causal" or bool/additive arrays (L, T), (B or 1, 1 or Hq, L, T),
learned sinks, decayed codes (any of those widths in the fresh codes' basis, e.g. K6 -> K3; one side or both,
MLA's latent too), and trellis codes (config.trellis: their search on viterbi.metal, the steps around it as the
reference's MLX ops). The reference path runs: QJL at 1 bit (no MSE stage for the score loop to read), QJL keys'
encode at head dims without a WHT, head dims above 512 (threadgroup memory), other masks (integer dtypes, other
broadcasts, 2^31 elements or more: int32 offsets), decayed codes in another basis than the fresh ones (never built
by a cache). Views without compressed tokens need no kernel: they take mx.fast.scaled_dot_product_attention
(attention.uncompressed_attention).
"""

from __future__ import annotations

import mlx.core as mx

from .reference import keys_are_values
from ..quant.quantizer import FLOAT_DTYPES, LOG_NORM_DTYPES, MSECodes, TurboQuantMSE, TurboQuantProd
from ..quant.rotation import Rotation
from ..stream.view import StreamView
from .launch import (KERNEL_BITS, MAX_DIM, MAX_QUERY_TOKENS, MIN_DIM, SUPPORTED_DIMS, _mse, _mx_dtype, _rope_pairs,
                     _rotation_unsupported, _rows_per_threadgroup, _span_codes, _wht)

def _mse_unsupported(q: TurboQuantMSE) -> str | None:
    for g in q.groups:
        if g.bits not in KERNEL_BITS:
            return f"bits {g.bits}"
    if len({g.trellis for g in q.groups}) > 1:  # never built by the config: its trellis widths hold every group
        return "trellis codes in some groups only"
    if q.norm_dtype not in (mx.float16, *LOG_NORM_DTYPES.values()):
        return f"norm dtype {q.norm_dtype}: the kernels read float16 norms or their one-byte log codes"
    if not MIN_DIM <= q.dim <= MAX_DIM:
        return f"head dim {q.dim}: the kernels take head dims {MIN_DIM}..{MAX_DIM}"
    return None


def _quantizer_unsupported(q) -> str | None:
    if isinstance(q, TurboQuantProd):
        if q.mse is None:
            return "QJL at 1 bit (no MSE stage)"
        return _mse_unsupported(q.mse)
    if isinstance(q, TurboQuantMSE):
        return _mse_unsupported(q)
    return f"unknown quantizer {type(q).__name__}"


def rotation_unsupported(x: mx.array, rotation: Rotation) -> str | None:
    """Why `rotate` cannot run this case (None: it can)."""
    if x.dtype not in FLOAT_DTYPES:
        return f"dtype {x.dtype}"
    if x.ndim == 0 or x.shape[-1] != rotation.dim:
        return f"last axis of shape {tuple(x.shape)} is not the rotation's dim {rotation.dim}"
    return _rotation_unsupported(rotation)


def encode_unsupported(x: mx.array, quantizer, mean=None, perm=None, scale=None) -> str | None:
    """Why `encode` cannot run this case (None: it can)."""
    if scale is not None and tuple(scale.shape) != tuple(x.shape[:2]):
        return f"scale of shape {tuple(scale.shape)}"
    if perm is not None and (x.ndim != 4 or tuple(perm.shape) != (x.shape[1], x.shape[-1])):
        return f"channel order of shape {tuple(perm.shape)}"
    if x.dtype not in FLOAT_DTYPES:
        return f"dtype {x.dtype}"
    if x.ndim != 4 or x.shape[-1] != quantizer.dim or x.shape[2] == 0:
        return f"x of shape {tuple(x.shape)}: expected (B, H, n >= 1, {quantizer.dim})"
    if mean is not None and tuple(mean.shape) != (x.shape[0], x.shape[1], x.shape[3]):
        return f"mean of shape {tuple(mean.shape)}"
    reason = _quantizer_unsupported(quantizer)
    if reason is None and isinstance(quantizer, TurboQuantProd) and (perm is not None or not _wht(quantizer)):
        return f"QJL keys at head dim {quantizer.dim}: the QJL encode runs with the WHT kernel, dims {SUPPORTED_DIMS}"
    return reason


def dequantize_unsupported(kv: StreamView) -> str | None:
    """Why `dequantize` cannot run this view (None: it can)."""
    if kv.decayed is not None:  # decayed codes, then fresh ones: each segment is its own launch
        return next((f"{'decayed' if off == 0 and seg is kv.decayed else 'fresh'} codes: {r}"
                     for off, seg in kv.segments() if (r := dequantize_unsupported(seg))), None)
    if kv.codes is None:
        return "no compressed tokens"
    if kv.perm is not None:
        return "channel permutation (fractional bits)"
    reason = _quantizer_unsupported(kv.quantizer)
    if reason is None and not _wht(kv.quantizer):
        mse = _mse(kv.quantizer)
        reason = (f"fractional bits {mse.bits}: channel groups (the dequantize kernel takes one WHT group)"
                  if len(mse.groups) > 1 else _rotation_unsupported(mse.groups[0].rotation))
    return reason


def recode_unsupported(codes, quantizer, to) -> str | None:
    """Why `recode` cannot run this case (None: it can)."""
    if not isinstance(quantizer, TurboQuantMSE) or not isinstance(to, TurboQuantMSE):
        return "recode takes MSE codes"
    if quantizer.basis != to.basis:
        return "another rotated basis"
    if not isinstance(codes, MSECodes) or codes.codes.shape[-1] != quantizer.words or codes.codes.size == 0:
        return f"codes of shape {tuple(getattr(getattr(codes, 'codes', None), 'shape', ()))}"
    return _mse_unsupported(quantizer) or _mse_unsupported(to)


def _decay_unsupported(kv: StreamView) -> str | None:
    """Why the attention kernels cannot read a view's decayed codes (None: they can, or it has none). They
    share the query rotation and the value accumulator with the fresh codes, so both must be in one basis."""
    d = kv.decayed
    if d is None:
        return None
    if not isinstance(d.quantizer, TurboQuantMSE) or isinstance(kv.quantizer, TurboQuantProd):
        return "decayed codes with QJL keys"
    if d.quantizer.basis != _mse(kv.quantizer).basis or d.perm is not kv.perm:  # a half step: one channel order
        return "decayed codes in another rotated basis than the fresh codes"
    if d.quantizer.dim != kv.quantizer.dim:
        return f"decayed codes of dim {d.quantizer.dim} for fresh codes of dim {kv.quantizer.dim}"
    reason = _quantizer_unsupported(d.quantizer)
    return reason and f"decayed codes: {reason}"


def _rows_unsupported(rl: int, queries: mx.array, keys, values) -> str | None:
    """Threadgroup memory: pass 1 (and prefill_attention) must fit one query row of every span's layout."""
    for kc, vc, qjl in _span_codes(keys, values):
        if _rows_per_threadgroup(rl, queries.shape[3], values.head_dim, kc, vc, qjl, _rope_pairs(keys)) == 0:
            return "threadgroup memory"
    return None


def decode_unsupported(queries: mx.array, keys, values, mask=None, sinks=None) -> str | None:
    """Why `decode_attention` cannot run this case (None: it can)."""
    if isinstance(queries, mx.array) and queries.ndim == 4 and not 1 <= queries.shape[2] <= MAX_QUERY_TOKENS:
        return f"{queries.shape[2]} query tokens (the kernel handles 1..{MAX_QUERY_TOKENS})"
    reason = _views_unsupported(queries, keys, values, mask, sinks)
    if reason:
        return reason
    return _rows_unsupported((queries.shape[1] // keys.n_heads) * queries.shape[2], queries, keys, values)


def _views_unsupported(queries: mx.array, keys, values, mask=None, sinks=None) -> str | None:
    """What both attention kernels refuse, whatever the number of query tokens (None: nothing)."""
    if not isinstance(keys, StreamView) or not isinstance(values, StreamView):
        return "keys/values are not TurboQuant stream views"
    if queries.ndim != 4 or queries.dtype not in FLOAT_DTYPES:
        return f"queries of shape {tuple(queries.shape)} and dtype {queries.dtype}"
    B, Hq, L, D = queries.shape
    if L < 1:
        return "no query tokens"
    if keys.n_coded == 0:
        return "no compressed tokens (float tokens only)"
    if values.n_coded != keys.n_coded:
        return f"{keys.n_coded} compressed keys and {values.n_coded} compressed values"
    H = keys.n_heads
    if Hq % H or D != keys.head_dim:
        return f"queries of shape {tuple(queries.shape)} for {H} kv heads of dim {keys.head_dim}"
    reason = _mask_unsupported(mask, B, Hq, L, keys.n_tokens)
    if reason:
        return reason
    if sinks is not None and (not isinstance(sinks, mx.array) or tuple(sinks.shape) != (Hq,)
                              or sinks.dtype not in FLOAT_DTYPES):
        return f"learned sinks of shape {tuple(getattr(sinks, 'shape', ()))}: expected ({Hq},) float"
    for kv in (keys, values):
        if kv.perm is not None and tuple(kv.perm.shape) != (H, kv.head_dim):
            return f"channel order of shape {tuple(kv.perm.shape)}"
        dtypes = {_mx_dtype(a) for a in (kv.sinks, kv.window) if a is not None}
        if len(dtypes) > 1 or not dtypes <= set(FLOAT_DTYPES):
            return f"float tokens of dtypes {sorted(map(str, dtypes))}"
        if kv.scale is not None and tuple(kv.scale.shape) != (queries.shape[0], H):
            return f"scale of shape {tuple(kv.scale.shape)}"
    if values.rope is not None and not keys_are_values(keys, values):
        return "values centered before RoPE"
    reason = _quantizer_unsupported(keys.quantizer) or (
        "QJL values" if isinstance(values.quantizer, TurboQuantProd) else _quantizer_unsupported(values.quantizer)
    ) or _decay_unsupported(keys) or _decay_unsupported(values)
    return reason or None


def _mask_unsupported(mask, B: int, Hq: int, L: int, T: int) -> str | None:
    """Why the kernels cannot read this mask (None: they can): None, "causal", or a bool/additive array (L, T),
    (B or 1, 1 or Hq, L, T) over the view's T tokens, as turboquant_attention takes."""
    if mask is None:
        return None
    if isinstance(mask, str):
        return None if mask == "causal" else f"mask {mask!r}"
    if not isinstance(mask, mx.array) or mask.dtype not in (mx.bool_, *FLOAT_DTYPES):
        return f"mask of type {type(mask).__name__} and dtype {getattr(mask, 'dtype', None)}"
    shape = (1,) * (4 - mask.ndim) + tuple(mask.shape)
    if len(shape) != 4 or shape[2:] != (L, T) or shape[0] not in (1, B) or shape[1] not in (1, Hq):
        return f"mask of shape {tuple(mask.shape)} for {B} x {Hq} heads x {L} queries x {T} tokens"
    if mask.size >= 1 << 31:
        return f"mask of {mask.size} elements (int32 offsets)"
    return None


def prefill_unsupported(queries: mx.array, keys, values, mask=None, sinks=None) -> str | None:
    """Why `prefill_attention` cannot run this case (None: it can). Any number of query tokens."""
    reason = _views_unsupported(queries, keys, values, mask, sinks)
    if reason:
        return reason
    if isinstance(mask, str) and queries.shape[2] > keys.n_tokens:  # a query that sees no token (never in mlx-lm)
        return f"{queries.shape[2]} causal queries over {keys.n_tokens} cached tokens"
    return _rows_unsupported(1, queries, keys, values)  # _prefill_rows: the same budget as pass 1


def _require(reason: str | None, what: str) -> None:
    if reason:
        raise ValueError(f"{what}: no Metal kernel for this case ({reason}); use the reference path")
