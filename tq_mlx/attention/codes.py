"""Launchers of the codec kernels, each beside its pure-MLX reference twin (same arguments, the core's code).

    rotate / rotate_reference          randomized Walsh-Hadamard rotation Π (forward or inverse): wht.metal
    encode / encode_reference          centering, norm, rotation, Lloyd-Max codes, packing (+ QJL): encode.metal;
                                       encode_dense.metal for channel groups (2.5 / 3.5 bits) and head dims
                                       without a power-of-two WHT (80, 96, 192, ...)
    recode / recode_reference          codes re-coded at fewer bits in their rotated basis (temporal decay):
                                       recode.metal
    dequantize / dequantize_reference  codes -> float in the model basis (float fetches, tools and tests;
                                       attention never dequantizes): dequantize.metal, one launch per segment
                                       of decayed codes
    viterbi / viterbi_reference        trellis codes' search (tq_mlx.quant.trellis): viterbi.metal. Encode and
                                       recode of trellis codes run the reference's steps around it (centering,
                                       norms, rotation and packing are a few MLX ops a block; the search is d
                                       sequential steps, one kernel)

Launch design (grid counts threads; B batch, H kv heads, n tokens, D dims):
    wht           grid 32·rows, threadgroup 256: one SIMD group per vector, D/32 values per lane, log2(D/32)
                  butterfly stages in registers and 5 simd_shuffle_xor stages
    encode        grid 32·B·H·n, threadgroup 256: one SIMD group per token; codebook/boundaries in threadgroup
                  memory; packed words OR-ed across lanes with shuffles, each written once; QJL: S·r from a
                  per-SIMD-group residual in threadgroup memory
    encode_dense  as encode; the token (centered, in the stream's channel order) staged in threadgroup memory,
                  per group a dense Π_g from device memory (lane i: rows i, i+32, ...), then each packed word
                  built by one lane. Dense rather than padded to a power of two, which would store and read more
                  code bytes for the cache's life; Π_g is read at encode only, never at decode
    recode        grid 32·N, threadgroup 256: one SIMD group per token, its words staged once; per group the
                  old centroids' norm (simd_sum), the new indices, then each new word built by one lane
    dequantize    grid 32·B·H·n, threadgroup 256: one SIMD group per token, its words staged once
    viterbi       one threadgroup per vector (min(2^(L-b), 256) threads over the states), the codebook and the
                  vector staged; the choices of every step in a device scratch of d·2^(L-b) bytes a vector, so a
                  launch takes at most VITERBI_SCRATCH bytes' worth of vectors
Keys centered before RoPE (tq_mlx.models.rope): encode and dequantize see the centered tokens (the stream subtracts and
adds R(p)μ0 around them).
"""

from __future__ import annotations

import mlx.core as mx

from ..quant import trellis
from ..quant.packing import packed_words
from ..quant.quantizer import MSECodes, ProdCodes, TurboQuantMSE, TurboQuantProd
from ..quant.rotation import Rotation
from ..stream.codec import code_order
from ..stream.view import StreamView, decode, encode as stream_encode, recode as stream_recode
from .launch import _default_factory, _dummy, _floats, _ints, _kernel, _mx, _tables, _wht
from .support import _require, dequantize_unsupported, encode_unsupported, recode_unsupported, rotation_unsupported


# --------------------------------------------------------------------------- rotation (WHT)
def rotate(x: mx.array, rotation: Rotation, inverse: bool = False, *, metal_kernel=None) -> mx.array:
    """Πx (inverse: Πᵀx) along the last axis, float32: one SIMD group per vector, d/32 values per lane."""
    _require(rotation_unsupported(x, rotation), "rotate")
    factory = metal_kernel or _default_factory()
    D = rotation.dim
    rows = x.size // D
    k = _kernel(factory, "wht", ["x", "signs", "inverse"], ["y"])
    (y,) = k(
        inputs=[mx.contiguous(x), rotation.signs, bool(inverse)], output_shapes=[tuple(x.shape)],
        output_dtypes=[mx.float32], grid=(rows * 32, 1, 1), threadgroup=(256, 1, 1),
        template=[("T", x.dtype), ("D", D)],
    )
    return _mx(y, mx.float32)


def rotate_reference(x: mx.array, rotation: Rotation, inverse: bool = False, **_) -> mx.array:
    return rotation.inverse(x) if inverse else rotation.forward(x)


# ------------------------------------------------------------------------------------------ viterbi
VITERBI_SCRATCH = 64 << 20  # bytes of step choices a launch may hold (vectors per launch = this / (d·states))


def viterbi(y: mx.array, book: mx.array, bits: int, *, metal_kernel=None) -> mx.array:
    """trellis.viterbi's symbols (y's shape, uint32) of the rotated unit coordinates y (..., d) under `book`."""
    factory = metal_kernel or _default_factory()
    L = trellis.window_bits(bits)
    lead, d = y.shape[:-1], y.shape[-1]
    rows = mx.contiguous(y.astype(mx.float32)).reshape(-1, d)
    states = 1 << (L - bits)
    nt = min(states, 256)
    per = max(1, VITERBI_SCRATCH // (d * states))
    book = mx.contiguous(book.astype(mx.float32))
    k = _kernel(factory, "viterbi", ["y", "book"], ["sym", "back"])
    parts = []
    for a in range(0, rows.shape[0], per):
        n = min(per, rows.shape[0] - a)
        sym, _ = k(inputs=[rows[a : a + n], book],
                   output_shapes=[(n, d), (n, d * states)], output_dtypes=[mx.uint32, mx.uint8],
                   grid=(n * nt, 1, 1), threadgroup=(nt, 1, 1),
                   template=[("B", bits), ("L", L), ("D", d), ("NT", nt)])
        parts.append(_mx(sym, mx.uint32))
    return (parts[0] if len(parts) == 1 else mx.concatenate(parts)).reshape(*lead, d)


def viterbi_reference(y: mx.array, book: mx.array, bits: int, **_) -> mx.array:
    return trellis.viterbi(y, book, bits)


def _trellis(q) -> bool:
    return isinstance(q, TurboQuantMSE) and any(g.trellis for g in q.groups)


def _search(factory):
    """The trellis search the quantizer calls (TurboQuantMSE.quantize's `search`), on the kernel."""
    return lambda y, book, bits: viterbi(y, book, bits, metal_kernel=factory)


# ------------------------------------------------------------------------------------------- encode
def encode(x: mx.array, quantizer, mean: mx.array | None = None, perm=None, scale=None, *, metal_kernel=None):
    """Codes of the tokens (x (B, H, n, D) - mean (B, H, D)) / scale (B, H), as view.encode: MSECodes, or
    ProdCodes for a TurboQuantProd (keys with QJL). One SIMD group per token; trellis codes: the reference's
    steps with the search on viterbi.metal."""
    _require(encode_unsupported(x, quantizer, mean, perm, scale), "encode")
    factory = metal_kernel or _default_factory()
    if _trellis(quantizer):
        return stream_encode(x, quantizer, mean, perm, scale, search=_search(factory))
    if scale is not None:  # a power of two: x/s - μ/s is exactly (x - μ)/s
        s = scale.astype(mx.float32)
        x = x.astype(mx.float32) / s[:, :, None, None]
        mean = None if mean is None else mean.astype(mx.float32) / s[:, :, None]
    if perm is not None or not _wht(quantizer):
        return _encode_dense(x, quantizer, mean, perm, factory)
    B, H, n, D = x.shape
    N = B * H * n
    prod = isinstance(quantizer, TurboQuantProd)
    g = (quantizer.mse if prod else quantizer).groups[0]
    W = packed_words(D, g.bits)
    nd = quantizer.norm_dtype
    tables = _tables(quantizer, ("encode",), lambda: _floats(g.rotation.signs, g.boundaries, g.centroids))
    mean_in = _dummy(mx.float32) if mean is None else mx.contiguous(mean.astype(mx.float32)).reshape(B * H, D)
    k = _kernel(factory, "encode", ["x", "mean", "tables", "proj", "params"], ["codes", "norms", "qjl", "gamma"])
    codes, norms, qjl, gamma = k(
        inputs=[mx.contiguous(x).reshape(N, D), mean_in, tables,
                quantizer.projection if prod else _dummy(mx.float32), _ints(n, mean is not None)],
        output_shapes=[(N, W), (N,), (N, D // 32) if prod else (1,), (N,) if prod else (1,)],
        output_dtypes=[mx.uint32, nd, mx.uint32, nd],
        grid=(N * 32, 1, 1), threadgroup=(256, 1, 1),
        template=[("T", x.dtype), ("NT", nd), ("D", D), ("B", g.bits), ("QJL", prod), ("W", W),
                  ("CN", quantizer.correct_norms)],
    )
    codes = _mx(codes, mx.uint32).reshape(B, H, n, W)
    norms = _mx(norms, nd).reshape(B, H, n, 1)
    if not prod:
        return MSECodes(codes, norms)
    return ProdCodes(codes, norms, _mx(qjl, mx.uint32).reshape(B, H, n, D // 32), _mx(gamma, nd).reshape(B, H, n))


def _channel_order(quantizer: TurboQuantMSE, perm: mx.array | None, H: int) -> mx.array:
    """(H, D) int32: the model channel at each code position (the stream's order, then the groups' channels)."""
    D = quantizer.dim
    if perm is not None:
        return mx.contiguous(code_order(quantizer, perm).astype(mx.int32))

    def per_head():
        order = code_order(quantizer, None)
        return mx.broadcast_to(mx.arange(D) if order is None else order, (H, D)).astype(mx.int32)

    return _tables(quantizer, ("order", H), per_head)


def _encode_dense(x: mx.array, quantizer: TurboQuantMSE, mean, perm, factory) -> MSECodes:
    """encode_dense.metal: channel groups (fractional bits) and rotations other than a power-of-two WHT."""
    B, H, n, D = x.shape
    N = B * H * n
    groups = quantizer.groups
    W = quantizer.words
    rot = _tables(quantizer, ("dense",), lambda: _floats(*[g.rotation.as_matrix() for g in groups]))
    bnd = _tables(quantizer, ("boundaries",), lambda: _floats(*[g.boundaries for g in groups]))
    cent = _tables(quantizer, ("centroids",), lambda: _floats(*[g.centroids for g in groups]))
    mean_in = _dummy(mx.float32) if mean is None else mx.contiguous(mean.astype(mx.float32)).reshape(B * H, D)
    g0, g1 = groups[0], groups[-1]
    k = _kernel(factory, "encode_dense", ["x", "mean", "order", "rot", "bnd", "cent", "params"], ["codes", "norms"])
    codes, norms = k(
        inputs=[mx.contiguous(x).reshape(N, D), mean_in, _channel_order(quantizer, perm, H), rot, bnd, cent,
                _ints(n, mean is not None, H)],
        output_shapes=[(N, W), (N, len(groups))], output_dtypes=[mx.uint32, quantizer.norm_dtype],
        grid=(N * 32, 1, 1), threadgroup=(256, 1, 1),
        template=[("T", x.dtype), ("NT", quantizer.norm_dtype), ("D", D), ("G", len(groups)), ("D0", g0.dim), ("B0", g0.bits), ("B1", g1.bits),
                  ("W0", g0.words.stop - g0.words.start), ("W", W), ("CN", quantizer.correct_norms)],
    )
    norms = _mx(norms, quantizer.norm_dtype).reshape(B, H, n, len(groups))
    return MSECodes(_mx(codes, mx.uint32).reshape(B, H, n, W), norms)


def encode_reference(x: mx.array, quantizer, mean: mx.array | None = None, perm=None, scale=None, **_):
    return stream_encode(x, quantizer, mean, perm, scale)


# ------------------------------------------------------------------------------------------- recode
def recode(codes: MSECodes, quantizer: TurboQuantMSE, to: TurboQuantMSE, *, metal_kernel=None) -> MSECodes:
    """`quantizer`'s codes (leading shape S) as `to` codes them, in their rotated basis (TurboQuantMSE.recode:
    temporal decay). One SIMD group per token; trellis codes (either side): the reference's steps with the search
    on viterbi.metal."""
    _require(recode_unsupported(codes, quantizer, to), "recode")
    factory = metal_kernel or _default_factory()
    if _trellis(quantizer) or _trellis(to):
        return stream_recode(codes, quantizer, to, search=_search(factory))
    S = tuple(codes.codes.shape[:-1])
    N = codes.codes.size // quantizer.words
    G = len(quantizer.groups)
    g0, g1, t0, t1 = quantizer.groups[0], quantizer.groups[-1], to.groups[0], to.groups[-1]
    tables = _tables(quantizer, ("recode", tuple(t.bits for t in to.groups)), lambda: _floats(
        *[g.centroids for g in quantizer.groups], *[t.boundaries for t in to.groups], *[t.centroids for t in to.groups]))
    k = _kernel(factory, "recode", ["codes", "norms", "tables"], ["out", "onorms"])
    out, norms = k(
        inputs=[mx.contiguous(codes.codes).reshape(N, quantizer.words), mx.contiguous(codes.norms).reshape(N, G), tables],
        output_shapes=[(N, to.words), (N, G)], output_dtypes=[mx.uint32, to.norm_dtype],
        grid=(N * 32, 1, 1), threadgroup=(256, 1, 1),
        template=[("NT", to.norm_dtype), ("D", quantizer.dim), ("G", G), ("D0", g0.dim), ("B0", g0.bits),
                  ("B1", g1.bits), ("C0", t0.bits), ("C1", t1.bits), ("W0", g0.words.stop - g0.words.start),
                  ("W", quantizer.words), ("V0", t0.words.stop - t0.words.start), ("V", to.words),
                  ("CN", to.correct_norms)],
    )
    return MSECodes(_mx(out, mx.uint32).reshape(*S, to.words), _mx(norms, to.norm_dtype).reshape(*S, G))


def recode_reference(codes: MSECodes, quantizer: TurboQuantMSE, to: TurboQuantMSE, **_) -> MSECodes:
    return stream_recode(codes, quantizer, to)


# --------------------------------------------------------------------------------------- dequantize
def dequantize(kv: StreamView, dtype: mx.Dtype = mx.float16, *, metal_kernel=None) -> mx.array:
    """The compressed tokens of a view in the model basis, (B, H, n_coded, D) `dtype`, mean added."""
    _require(dequantize_unsupported(kv), "dequantize")
    factory = metal_kernel or _default_factory()
    if kv.rope is not None:  # centered before RoPE: decode the centered tokens, add R(p) μ0 (tq_mlx.models.rope)
        y = dequantize(kv._replace(mean=None, rope=None, decayed=kv.decayed and kv.decayed._replace(mean=None, rope=None)),
                       mx.float32, metal_kernel=factory)
        return (y + kv.centers()).astype(dtype)
    if kv.weights is not None:  # codes hold (x - μ)·w: decode with μ·w, then divide by w
        w = kv.weights.astype(mx.float32)
        mean = None if kv.mean is None else kv.mean.astype(mx.float32) * w
        strip = dict(mean=mean, weights=None)
        y = dequantize(kv._replace(**strip, decayed=kv.decayed and kv.decayed._replace(**strip)), mx.float32,
                       metal_kernel=factory)
        return (y / w[:, :, None, :]).astype(dtype)
    if kv.decayed is not None:  # one launch per segment (its own quantizer), decayed tokens first
        return mx.concatenate([dequantize(seg, dtype, metal_kernel=factory) for _, seg in kv.segments()], axis=2)
    if kv.scale is not None:  # codes hold (x - μ) / s: decode with μ / s, then scale back
        s = kv.scale.astype(mx.float32)
        mean = None if kv.mean is None else kv.mean.astype(mx.float32) / s[:, :, None]
        y = dequantize(kv._replace(mean=mean, scale=None), mx.float32, metal_kernel=factory)
        return (y * s[:, :, None, None]).astype(dtype)
    q = kv.quantizer
    prod = isinstance(q, TurboQuantProd)
    g = (q.mse if prod else q).groups[0]
    B, H, n = kv.codes.codes.shape[:3]
    D = q.dim
    c = kv.codes
    tables = _tables(q, ("dequantize",), lambda: _floats(g.rotation.signs, g.centroids, [q.qjl_scale if prod else 0.0]))
    mean_in = _dummy(mx.float32) if kv.mean is None else mx.contiguous(kv.mean.astype(mx.float32)).reshape(B * H, D)
    k = _kernel(factory, "dequantize",
                ["codes", "norms", "qjlw", "gamma", "tables", "proj", "mean", "params"], ["out"],
                row_contiguous=False)
    (out,) = k(
        inputs=[c.codes, c.norms, c.qjl if prod else _dummy(mx.uint32, 4), c.gamma if prod else _dummy(mx.float16, 3),
                tables, q.projection if prod else _dummy(mx.float32), mean_in, _ints(n, H, kv.mean is not None)],
        output_shapes=[(B, H, n, D)], output_dtypes=[dtype],
        grid=(B * H * n * 32, 1, 1), threadgroup=(256, 1, 1),
        template=[("T", dtype), ("D", D), ("B", g.bits), ("QJL", prod), ("W", packed_words(D, g.bits)),
                  ("TR", g.trellis)],
    )
    return _mx(out, dtype)


def dequantize_reference(kv: StreamView, dtype: mx.Dtype = mx.float16, **_) -> mx.array:
    return decode(kv, dtype)
