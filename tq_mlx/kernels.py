"""Metal kernels for TurboQuant's hot paths, each launcher next to its pure-MLX reference twin.

Kernel bodies live in metal_kernels/<name>.metal (helpers in common.metal, passed as `header=`). Every
launcher computes shapes, grid (in threads) and threadgroup in Python and calls a kernel made by a
`metal_kernel` factory: `mx.fast.metal_kernel` by default, `tests.emulator.metal_kernel` in the test suite
(it returns numpy arrays, which `_mx` converts back, so the launcher code is the same on both). Each
launcher's twin (`*_reference`) takes the same arguments and runs the core's pure-MLX code.

    rotate / rotate_reference                 randomized Walsh-Hadamard rotation Π (forward or inverse)
    encode / encode_reference                 centering, norm, rotation, Lloyd-Max codes, packing (+ QJL);
                                              encode_dense.metal for channel groups (2.5 / 3.5 bits) and head
                                              dims without a power-of-two WHT (80, 96, 192, ...)
    dequantize / dequantize_reference         codes -> float in the model basis (float fetches, tools and tests;
                                              attention never dequantizes); decayed codes: one launch per segment
    decode_attention / decode_attention_reference
                                              attention of 1..8 query tokens on the codes: pass 1 (split-K
                                              partials) + pass 2 (merge with the float16 tokens)
    prefill_attention / prefill_attention_reference
                                              attention of any number of query tokens (prefill chunks) on the
                                              codes: one flash-attention-style pass per query tile

Keys centered before RoPE (tq_mlx.rope): encode and dequantize see the centered tokens (the stream subtracts and
adds R(p)μ0 around them); the attention kernels add q·R(p)μ0 per token from 2·P terms per query row (_prepare),
the angles staged per threadgroup and tile (common.metal, tq_rope_*), no sine and no byte per token.

Dispatch: `dispatch_attention` (decode_attention for 1..8 query tokens, prefill_attention for more; on views
with decayed codes both take decode_attention's two passes, see "Temporal decay" below),
`dispatch_encode`, `dispatch_dequantize` and `dispatch_rotate` run the kernel when the back end is Metal
(`set_backend` or TQ_MLX_KERNELS = auto | metal | reference; auto means Metal when `mx.metal.is_available()` and
the default device is the GPU) and the case is supported, else the reference.
Before a kernel variant is first used it runs once on a small random input against the reference: a compile
error, an exception or a disagreement disables that variant, warns once with the reason, and the reference
takes over. Never a silent wrong answer.

Launch design (grid counts threads; shapes for B batch, H kv heads, R = n_q_heads / H, L query tokens, D dims):
    wht             grid 32·rows, threadgroup 256: one SIMD group per vector, D/32 values per lane, log2(D/32)
                    butterfly stages in registers and 5 simd_shuffle_xor stages
    encode          grid 32·B·H·n, threadgroup 256: one SIMD group per token; codebook/boundaries in threadgroup
                    memory; packed words OR-ed across lanes with shuffles, each written once; QJL: S·r from a
                    per-SIMD-group residual in threadgroup memory
    encode_dense    as encode; the token (centered, in the stream's channel order) staged in threadgroup memory,
                    per group a dense Π_g from device memory (lane i: rows i, i+32, ...), indices as bytes, then
                    each packed word built by one lane. Dense rather than padding to a power of two: padding 80
                    or 96 dims to 128 would store and read 1.6x / 1.33x the code bytes of every token for the
                    cache's life; Π_g (D_g² floats) is read per token from cache at encode and never at decode
    dequantize      grid 32·B·H·n, threadgroup 256: one SIMD group per token, its words staged once
    decode_partial  grid (S·32·min(NR, 8), B·H, ceil(R·L / NR)): one threadgroup per (split of the compressed
                    tokens, kv head, chunk of NR query rows; one chunk unless R·L·D > ~4096); tiles of 32 tokens
                    staged in threadgroup memory (each word read once), lane = token for scores, lane = dims for
                    values, sparse V skips the reads and the accumulation of weights < ε/n · running max
                    (n = the split's tokens; see SPARSE_V_EPSILON for the bound); where the keys are the values
                    (one view, MLA's latent) the staged key words and norms serve as the values' (read once)
    decode_merge    grid (32·min(R·L, 8), B·H, ceil(R·L / 8)): one SIMD group per query row, starting at the
                    learned sink (m, l) = (sink logit, 1) if any: float sinks + window, LSE merge of the S
                    partials (+ q·μ), one inverse WHT, + l_c·ν, / l
    prefill_attention  grid (32·min(NR, 8), B·H, ceil(R·L / NR)), NR = the query tile, up to 64 rows as
                    threadgroup memory allows (D = 64: 64, D = 128: 32, 16 with QJL, D = 256: 16): one threadgroup
                    per (kv head, query tile), one online softmax per row over the float sinks and window (lane =
                    token, key rows read from device memory by each SIMD group), then the compressed tokens in
                    tiles of 32 as decode_partial (each word read once per query tile), acc_f (model basis) and
                    acc_c (rotated) rescaled together; per row one inverse WHT, · s_v, + l_c·ν, / l
Bytes per decode step and kv head (pass 1): n_compressed · (4·(W_k + W_v) + 4 [norms] (+ D/8 + 2 with QJL))
read once for all R·L rows, e.g. 132 B/token at D = 128, 4/4 bits vs 512 B/token for a float16 cache (3.9x
fewer); the split size keeps the (m, l, acc) partials (written by pass 1, read by pass 2) under 5% of that.
Pass 2 reads the float16 sinks/window (shared by the R·L rows through the cache). Prefill reads the compressed
bytes ceil(R·L / NR) times per kv head (once per query tile) and writes nothing but the output: its device
transient per layer is the float32 query rows (scaled; times s_k; rotated; S·q with QJL) and q·μ, at most
4·B·Hq·L·(4·D + 1) bytes plus the output (twice, in float32, without the in-kernel value rotation), flat in the
context and independent of the tile size.

Temporal decay (TurboQuantConfig.decay_after): a side's older compressed tokens are decayed codes, re-coded at
fewer integer bits by a quantizer of the same dim and seed (one group, one rotation: _decay_unsupported refuses
anything else), before its fresh codes; keys and values may change quantizer at different tokens (only one side
decays, or protected keys do not). attention.aligned_segments cuts the compressed tokens into spans [a, b) of one
key and one value quantizer (1..3 spans). Pass 1 (decode_partial, no change to its source) runs once per span,
its own compiled variant (code layouts, centroid tables, rows per threadgroup) on the span's codes, with
params[1] = b - a tokens, the mask column offset params[6] = n_sinks + a (the kernel uses it for nothing else)
and the causal limit lowered by a; the query rows (rotated once: one basis) and q·μ are shared. Each span's
partials (its splits, sized as above from the whole context and the span's own bytes per token) are concatenated
along the split axis, and pass 2 merges them all as one (N = every compressed token): the decayed and fresh
value accumulators are in one rotated basis. Costs against a view without decay: one pass-1 launch per span
instead of one, and a copy of the partials (the concatenation). Bytes per decode step: each span's codes once,
so n_decayed·(decayed bytes per token) + n_fresh·(fresh bytes per token), e.g. 84 B/token for decayed K3/V2
against 132 at K4/V4 (D = 128); partials B·H·S·R·L·(DV+2)·4 bytes, S = the splits of all spans, still under 5%
of the codes read (plus at most one split per span on short contexts).
Prefill chunks (more than 8 query tokens) on decayed views take the same two passes (prefill_attention.metal holds
one codebook per side): pass 1 with its query rows in tiles of up to 64 (chunks of R·L / NR, as prefill's tiles:
each compressed byte read once per tile), pass 2 with one SIMD group per query row over the float sinks and
window. There a split's partials are large against its codes, so the split rule gives one split per span unless
the context is long against the chunk: the device transient is the float32 query rows as in prefill plus the
partials, B·H·S·R·L·(DV+2)·4 bytes written by pass 1 and read by pass 2, twice (the concatenation's copy) when
there are two or three spans, S >= the spans (1..3), e.g. 34 MB per span for a 2048-token chunk at 32 query
heads, 8 kv heads, DV = 128; the float window is read once per query row (from the cache) instead of once per
SIMD group. Views without decayed codes are launched exactly as before.

Masks and learned sinks (both kernels): mask None, "causal" (limits computed on the host), or a bool or additive
array (L, T), (B or 1, 1, L, T) or (B or 1, Hq, L, T) over the view's tokens in order (sinks, compressed,
window), read per (query row, token) where a score is made (`_mask_inputs`: contiguous, with batch/head/token
strides, 0 where it broadcasts): mlx-lm's batched generation passes (B, 1, L, T) bool or additive masks, and
multi-head latent attention (DeepSeek-V3, Kimi K2, GLM-4.7-Flash) its rope scores (B, Hq, 1, T) as an additive
mask with keys = values = the latent (1 kv head, R = 16..128, D = 512): pass 1 then holds 8 query rows of 512
floats per threadgroup (4 at 8 bits), so it reads the latent's codes ceil(R / 8) times per step (once per
chunk; the chunks run concurrently). Learned sinks (gpt-oss) are one logit per query head, a token of value 0
that starts each row's softmax. A mask's dtype and broadcast, learned sinks, and keys being the values are
part of the self-checked variant.

Codes in the attention kernels: one group, or two for fractional bits (2.5 = d/4 channels at 3 bits + 3d/4 at
2, 3.5 = 4 + 3; each with its own centroids and float16 norm), read in the keys' and values' rotated bases
side by side. With one group under a power-of-two WHT (every integer width at head dims 32..512) queries are
rotated by the wht kernel and values rotated back inside the kernel; otherwise (channel groups, a per-head
channel order, head dims 80, 96, 192, ... whose rotation is MLX's Hadamard 12·2^k / 20·2^k or a dense Π) the
host rotates the few query rows (attention.split_query) and the kernel writes the compressed part of each
output row in the rotated basis (outc, float32) for attention.unrotate: B·Hq·L·Dv floats, no matrix per head.

Supported by the kernels: head dims 16..512 (key and value dims may differ), every bit width the config takes
(1, 2, 2.5, 3, 3.5, 4, 8; QJL keys 2, 3, 4, i.e. an MSE stage of 1..3 bits + 1 QJL bit), float16 norms or their uint8 log code,
float16/bfloat16/float32 inputs, masks and learned sinks as above, decayed codes (every decay the config takes:
1..4 bits, one side or both, MLA's latent too). Views without compressed tokens need no
kernel of ours: they take mx.fast.scaled_dot_product_attention (attention.float_attention, sinks included).
On a Mac the reference path runs only: QJL at 1 bit (no MSE stage: nothing for the kernels' score loop to
read), QJL keys' encode at head dims without a WHT (the QJL encode is written for the WHT kernel), head dims
above 512 (threadgroup memory), masks other than bool/float arrays of the shapes above (integer dtypes,
other broadcasts) or of 2^31 elements or more (int32 offsets), decayed codes in another basis than the fresh
ones (never built by a cache); and any variant whose self-check failed
(with a warning). Batch views (tq_mlx.batch) run row by row, each row through dispatch_attention.
"""

from __future__ import annotations

import math
import os
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable, NamedTuple

import numpy as np

import mlx.core as mx

from .attention import aligned_segments, keys_are_values, split_query, turboquant_attention, unrotate
from .packing import packed_words, unpack
from .quantizer import FLOAT_DTYPES, MSECodes, ProdCodes, TurboQuantMSE, TurboQuantProd, load_norms
from .rope import bias_terms, n_pairs
from .rotation import Rotation
from .stream import StreamView, code_order, decode, encode as stream_encode

ENV_VAR = "TQ_MLX_KERNELS"
BACKENDS = ("auto", "metal", "reference")
SUPPORTED_DIMS = (32, 64, 128, 256, 512)  # the WHT kernels (rotate, encode, dequantize, in-kernel value rotation)
MIN_DIM, MAX_DIM = 16, 512  # attention and encode_dense: any head dim in this range
KERNEL_BITS = (1, 2, 3, 4, 8)  # per code group: 2.5 and 3.5 bits are two groups (3+2, 4+3 bits)
MAX_QUERY_TOKENS = 8
# Sparse V: pass 1 skips a compressed token's value (neither read nor accumulated) when its weight relative
# to the running max, exp(s - m), is below ε/n, n = the tokens of its split; its weight still counts in l.
# Bound: the running max never exceeds the split's final max m_s, so each skipped weight is < ε/n·e^(m_s) and
# a split's skipped mass < ε·e^(m_s) <= ε·l_s; summed, < ε·l. The output misses Σ_skip p_i (v_i - ν) / l, so
# for every query row, at any context length, split count or GQA ratio:
#     ‖out - exact‖₂ <= ε · max_i ‖v_i - ν‖₂    (v_i the dequantized values, ν the value mean)
# i.e. 1e-5 relative to the largest centered value (tests/test_kernels.py measures 0.95e-5 on an adversarial
# 20k-token pattern, vs 1.8e-2 for the earlier fixed 1e-6 threshold). A fixed threshold has no such bound:
# n tokens just below it drop n times its mass.
SPARSE_V_EPSILON = 1e-5
SELF_CHECK_POSITION = 100_003  # where self-checks put keys centered before RoPE: angles of 1e5 radians
THREADGROUP_MEMORY = 32 * 1024
_NO_LIMIT = 1 << 30  # "no causal limit" in the kernels' int32 params

# ------------------------------------------------------------------------------------------ sources
_DIRS = (Path(__file__).resolve().parent.parent / "metal_kernels", Path(__file__).resolve().parent / "metal_kernels")
KERNEL_NAMES = ("common", "wht", "encode", "encode_dense", "dequantize", "decode_partial", "decode_merge",
                "prefill_attention")


def _load_sources() -> dict[str, str]:
    for d in _DIRS:
        if (d / "common.metal").is_file():
            return {n: (d / f"{n}.metal").read_text() for n in KERNEL_NAMES}
    return {}


# name -> Metal text. Tests may replace an entry (a planted bug); kernels are cached by their text.
SOURCES: dict[str, str] = _load_sources()
_KERNELS: dict[tuple, Any] = {}


def _default_factory():
    return mx.fast.metal_kernel


def _kernel(factory, name: str, inputs: list[str], outputs: list[str], row_contiguous: bool = True):
    if name not in SOURCES:
        raise RuntimeError(f"Metal source metal_kernels/{name}.metal not found (looked in {[str(d) for d in _DIRS]})")
    key = (factory, name, tuple(inputs), tuple(outputs), SOURCES[name], SOURCES["common"], row_contiguous)
    k = _KERNELS.get(key)
    if k is None:
        k = factory(
            name=f"tq_{name}", input_names=inputs, output_names=outputs, source=SOURCES[name],
            header=SOURCES["common"], ensure_row_contiguous=row_contiguous,
        )
        _KERNELS[key] = k
    return k


def _mx(x, dtype: mx.Dtype) -> mx.array:
    """A kernel output as an mx.array (the emulator returns numpy; bfloat16 as uint16 bits or ml_dtypes)."""
    if isinstance(x, mx.array):
        return x
    a = np.asarray(x)
    if dtype == mx.bfloat16:
        if a.dtype == np.uint16:
            return mx.array(a).view(mx.bfloat16)
        return mx.array(a.astype(np.float32)).astype(mx.bfloat16)
    return mx.array(a)


def _dummy(dtype: mx.Dtype, ndim: int = 1) -> mx.array:
    # 8 elements keep an unused input in `device` memory (MLX passes < 8 as `constant`), so pointer
    # expressions on it type-check; ndim matches the real input so its strides can be indexed.
    return mx.zeros((1,) * (ndim - 1) + (8,), dtype)


def _floats(*parts) -> mx.array:
    return mx.concatenate([mx.array(p, dtype=mx.float32).reshape(-1) for p in parts])


_TABLES: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def _tables(owner, key: tuple, make: Callable[[], mx.array]) -> mx.array:
    """A kernel's constant table (signs, codebooks, ...) built once per quantizer, not on every decode step."""
    per = _TABLES.setdefault(owner, {})
    if key not in per:
        per[key] = mx.contiguous(make())
    return per[key]


def _ints(*values: int) -> mx.array:
    return mx.array([int(v) for v in values], dtype=mx.int32)


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# ------------------------------------------------------------------------------------- support checks
def _rotation_unsupported(rot: Rotation) -> str | None:
    if rot.kind != "hadamard" or rot.base != 1 or rot.dim not in SUPPORTED_DIMS:
        return f"head dim {rot.dim}: the kernels need a power-of-two Walsh-Hadamard rotation, dims {SUPPORTED_DIMS}"
    return None


def _mse(q) -> TurboQuantMSE | None:
    return q.mse if isinstance(q, TurboQuantProd) else q


def _wht(q) -> bool:
    """Whether q's codes are one group under a power-of-two WHT the kernels run themselves (encode.metal, the
    in-kernel value rotation); otherwise encode_dense.metal encodes and the host rotates queries and outputs."""
    mse = _mse(q)
    return len(mse.groups) == 1 and _rotation_unsupported(mse.groups[0].rotation) is None


def _mse_unsupported(q: TurboQuantMSE) -> str | None:
    for g in q.groups:
        if g.bits not in KERNEL_BITS:
            return f"bits {g.bits}"
    if q.norm_dtype not in (mx.float16, mx.uint8):
        return f"norm dtype {q.norm_dtype}: the kernels read float16 norms or their uint8 log code"
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


class _Codes(NamedTuple):
    """One side's code layout as the attention kernels see it: one group, or two for fractional bits."""

    dim: int
    groups: tuple[tuple[int, int, int], ...]  # (dims, bits, packed words) per group, in code order
    wht: bool  # one group under a power-of-two WHT (rotated in-kernel); else the host rotates
    norms: str  # the stored norms' dtype (float16, or uint8 for the log code): a separate compiled variant

    @property
    def words(self) -> int:
        return sum(w for _, _, w in self.groups)

    def template(self, side: str) -> list[tuple[str, int]]:
        """KB, KG, KD0, KB1, WK0 (side "K") or VB, VG, VD0, VB1, WV0 (side "V")."""
        (d0, b0, w0), *rest = self.groups
        b1 = rest[0][1] if rest else b0
        return [(f"{side}B", b0), (f"{side}G", len(self.groups)), (f"{side}D0", d0), (f"{side}B1", b1),
                (f"W{side}0", w0)]

    def centroids(self) -> int:
        return sum(2**b for _, b, _ in self.groups)


def _codes(q) -> _Codes:
    mse = _mse(q)
    return _Codes(q.dim, tuple((g.dim, g.bits, g.words.stop - g.words.start) for g in mse.groups), _wht(q),
                  str(q.norm_dtype))


def _partial_layout(nr: int, dk: int, dv: int, kc: _Codes, vc: _Codes, qjl: bool, np: int = 0
                    ) -> list[tuple[str, int]]:
    """decode_partial.metal's template values past DK, DV, QJL, NR and the code layouts: words per token and
    the size of each threadgroup array, in 4-byte elements. The kernel declares its arrays with these values,
    so this is the one place its threadgroup-memory layout (and so its budget) is defined."""
    wk, wv = kc.words, vc.words
    ws = max(wk, wv) | 1  # odd row stride: lanes reading one word per token hit distinct banks
    wjs = -(-dk // 32) | 1
    norms = 32 * max(len(kc.groups), len(vc.groups))
    return [
        ("WK", wk), ("WV", wv), ("WS", ws), ("WJS", wjs),
        ("TG_Q", nr * dk), ("TG_QS", nr * dk if qjl else 1),  # rotated query rows; S·q rows (QJL)
        ("TG_W", 32 * ws), ("TG_J", 32 * wjs if qjl else 1),  # a tile's key then value words; its QJL words
        ("TG_NORM", norms), ("TG_GAMMA", 32), ("TG_P", nr * 32),  # per-token norms, γ; weights (row, token)
        ("TG_KEEP", min(nr, 8)), ("TG_C", kc.centroids() + vc.centroids()),  # kept-token masks; centroids
        # keys centered before RoPE: each row's [A | B] and the np pair frequencies (tq_rope_scores)
        # and cos, sin of φ_l (8 per pair) and of a tile's θ_h (5 blocks per pair): tq_rope_stage_*
        ("NP", np), ("TG_R", 2 * nr * np or 1), ("TG_F", np or 1), ("TG_RL", 2 * 8 * np or 1),
        ("TG_RH", 2 * 5 * np or 1),
    ]


def _partial_tg_bytes(layout: list[tuple[str, int]]) -> int:
    return 4 * sum(v for k, v in layout if k.startswith("TG_"))


def _rows_per_threadgroup(rl: int, dk: int, dv: int, kc: _Codes, vc: _Codes, qjl: bool, np: int = 0) -> int:
    """Query rows pass 1 handles per threadgroup: all R·L rows if they fit (codes read once), else chunks."""
    nr = min(64, _pow2_ceil(rl))
    while nr > 1 and _partial_tg_bytes(_partial_layout(nr, dk, dv, kc, vc, qjl, np)) > THREADGROUP_MEMORY:
        nr //= 2
    return nr if _partial_tg_bytes(_partial_layout(nr, dk, dv, kc, vc, qjl, np)) <= THREADGROUP_MEMORY else 0


def _rope_pairs(keys: StreamView) -> int:
    """RoPE pairs the attention kernels add per token (keys centered before RoPE), 0 without."""
    return 0 if keys.rope is None else n_pairs(keys.rope)


def _kv_codes(keys: StreamView, values: StreamView) -> tuple[_Codes, _Codes, bool]:
    return _codes(keys.quantizer), _codes(values.quantizer), isinstance(keys.quantizer, TurboQuantProd)


def _decayed(keys: StreamView, values: StreamView) -> bool:
    return keys.decayed is not None or values.decayed is not None


def _spans(keys: StreamView, values: StreamView) -> list[tuple[int, int, StreamView, StreamView]]:
    """The compressed tokens in spans [a, b) with one key and one value quantizer each, and each side's
    codes-only view of the span (attention.aligned_segments: decayed codes, then fresh ones; keys and values
    may change quantizer at different tokens). Without decayed codes, one span: the views themselves."""
    if not _decayed(keys, values):
        return [(0, keys.n_compressed, keys, values)]
    return aligned_segments(keys, values)


def _span_codes(keys: StreamView, values: StreamView) -> tuple[tuple[_Codes, _Codes, bool], ...]:
    """Each span's code layouts (keys, values, QJL keys): one pass-1 variant per span."""
    return tuple(_kv_codes(ks, vs) for _, _, ks, vs in _spans(keys, values))


def _basis(q) -> tuple | None:
    """What fixes the rotated basis of a one-group quantizer: its rotation (dim, kind, seed); None for groups."""
    groups = _mse(q).groups
    return (groups[0].rotation.dim, groups[0].rotation.kind, groups[0].rotation.seed) if len(groups) == 1 else None


def _decay_unsupported(kv: StreamView) -> str | None:
    """Why the attention kernels cannot read a view's decayed codes (None: they can, or it has none). They
    share the query rotation and the value accumulator with the fresh codes, so both must be in one basis."""
    d = kv.decayed
    if d is None:
        return None
    if not isinstance(d.quantizer, TurboQuantMSE) or isinstance(kv.quantizer, TurboQuantProd):
        return "decayed codes with QJL keys"
    if kv.perm is not None or d.perm is not None or _basis(d.quantizer) is None or (
            _basis(d.quantizer) != _basis(kv.quantizer)):
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
    if keys.n_compressed == 0:
        return "no compressed tokens (float tokens only)"
    if values.n_compressed != keys.n_compressed:
        return f"{keys.n_compressed} compressed keys and {values.n_compressed} compressed values"
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


def _mask_kind(mask):
    """A mask's compiled variant and self-check shape: None, "causal", or (dtype, per batch, per head)."""
    if mask is None or isinstance(mask, str):
        return mask
    shape = (1,) * (4 - mask.ndim) + tuple(mask.shape)
    return str(mask.dtype), shape[0] > 1, shape[1] > 1


def _mask_inputs(mask, L: int, T: int) -> tuple[mx.array, list[tuple[str, Any]], tuple[int, int, int]]:
    """An array mask as the kernels read it: the contiguous (mb, mh, L, T) array, the MASK/MT template (1 bool,
    2 additive; 0 for None or "causal", with a dummy) and the element strides of batch, query head and query
    token (0 where the mask broadcasts). Columns are the view's tokens in order (sinks, compressed, window)."""
    if mask is None or isinstance(mask, str):
        return _dummy(mx.float32), [("MASK", 0), ("MT", mx.float32)], (0, 0, 0)
    m = mx.contiguous(mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape)))
    mb, mh = m.shape[:2]
    template = [("MASK", 1 if m.dtype == mx.bool_ else 2), ("MT", m.dtype)]
    return m, template, (mh * L * T if mb > 1 else 0, L * T if mh > 1 else 0, T)


def _sink_input(sinks) -> mx.array:
    return _dummy(mx.float32) if sinks is None else mx.contiguous(sinks.astype(mx.float32))


def _mx_dtype(a) -> mx.Dtype | None:
    # Views hold mx.arrays; the emulator tests also pass numpy views to exercise strided inputs.
    if isinstance(a, mx.array):
        return a.dtype
    return {"float16": mx.float16, "float32": mx.float32, "bfloat16": mx.bfloat16}.get(np.dtype(a.dtype).name)


def _prefill_layout(nr: int, dk: int, dv: int, kc: _Codes, vc: _Codes, qjl: bool, np: int = 0
                    ) -> list[tuple[str, int]]:
    """prefill_attention.metal's layout: decode_partial's (one query array holds the model-basis rows for the
    float tokens, then the rotated rows for the codes), so the same budget rule applies."""
    return _partial_layout(nr, dk, dv, kc, vc, qjl, np)


def _prefill_rows(rl: int, dk: int, dv: int, kc: _Codes, vc: _Codes, qjl: bool, np: int = 0) -> int:
    """Query rows per prefill threadgroup (the query tile): up to 64, as many as threadgroup memory holds.
    Each compressed byte is read once per tile, so ceil(R·L / rows) times per kv head."""
    nr = min(64, _pow2_ceil(rl))
    while nr > 1 and _partial_tg_bytes(_prefill_layout(nr, dk, dv, kc, vc, qjl, np)) > THREADGROUP_MEMORY:
        nr //= 2
    return nr if _partial_tg_bytes(_prefill_layout(nr, dk, dv, kc, vc, qjl, np)) <= THREADGROUP_MEMORY else 0


def prefill_unsupported(queries: mx.array, keys, values, mask=None, sinks=None) -> str | None:
    """Why `prefill_attention` cannot run this case (None: it can). Any number of query tokens."""
    reason = _views_unsupported(queries, keys, values, mask, sinks)
    if reason:
        return reason
    if isinstance(mask, str) and queries.shape[2] > keys.n_tokens:  # a query that sees no token (never in mlx-lm)
        return f"{queries.shape[2]} causal queries over {keys.n_tokens} cached tokens"
    return _rows_unsupported(1, queries, keys, values)  # _prefill_rows: the same budget as pass 1


def _float_dtype(kv: StreamView) -> mx.Dtype:
    """The dtype of a view's float tokens (float16 when it has none)."""
    held = next((a for a in (kv.sinks, kv.window) if a is not None), None)
    return mx.float16 if held is None else _mx_dtype(held)


def _require(reason: str | None, what: str) -> None:
    if reason:
        raise ValueError(f"{what}: no Metal kernel for this case ({reason}); use the reference path")


# --------------------------------------------------------------------------- 1. rotation (WHT)
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


# ------------------------------------------------------------------------------------ 2. encode
def encode(x: mx.array, quantizer, mean: mx.array | None = None, perm=None, scale=None, *, metal_kernel=None):
    """Codes of the tokens (x (B, H, n, D) - mean (B, H, D)) / scale (B, H), as stream.encode: MSECodes, or
    ProdCodes for a TurboQuantProd (keys with QJL). One SIMD group per token."""
    _require(encode_unsupported(x, quantizer, mean, perm, scale), "encode")
    if scale is not None:  # a power of two: x/s - μ/s is exactly (x - μ)/s
        s = scale.astype(mx.float32)
        x = x.astype(mx.float32) / s[:, :, None, None]
        mean = None if mean is None else mean.astype(mx.float32) / s[:, :, None]
    factory = metal_kernel or _default_factory()
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
        template=[("T", x.dtype), ("NT", nd), ("D", D), ("B", g.bits), ("QJL", prod), ("W", W)],
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
    mean_in = _dummy(mx.float32) if mean is None else mx.contiguous(mean.astype(mx.float32)).reshape(B * H, D)
    g0, g1 = groups[0], groups[-1]
    k = _kernel(factory, "encode_dense", ["x", "mean", "order", "rot", "bnd", "params"], ["codes", "norms"])
    codes, norms = k(
        inputs=[mx.contiguous(x).reshape(N, D), mean_in, _channel_order(quantizer, perm, H), rot, bnd,
                _ints(n, mean is not None, H)],
        output_shapes=[(N, W), (N, len(groups))], output_dtypes=[mx.uint32, quantizer.norm_dtype],
        grid=(N * 32, 1, 1), threadgroup=(256, 1, 1),
        template=[("T", x.dtype), ("NT", quantizer.norm_dtype), ("D", D), ("G", len(groups)), ("D0", g0.dim), ("B0", g0.bits), ("B1", g1.bits),
                  ("W0", g0.words.stop - g0.words.start), ("W", W)],
    )
    norms = _mx(norms, quantizer.norm_dtype).reshape(B, H, n, len(groups))
    return MSECodes(_mx(codes, mx.uint32).reshape(B, H, n, W), norms)


def encode_reference(x: mx.array, quantizer, mean: mx.array | None = None, perm=None, scale=None, **_):
    return stream_encode(x, quantizer, mean, perm, scale)


# -------------------------------------------------------------------------------- 3. dequantize
def dequantize(kv: StreamView, dtype: mx.Dtype = mx.float16, *, metal_kernel=None) -> mx.array:
    """The compressed tokens of a view in the model basis, (B, H, n_compressed, D) `dtype`, mean added."""
    _require(dequantize_unsupported(kv), "dequantize")
    factory = metal_kernel or _default_factory()
    if kv.rope is not None:  # centered before RoPE: decode the centered tokens, add R(p) μ0 (tq_mlx.rope)
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
        template=[("T", dtype), ("D", D), ("B", g.bits), ("QJL", prod), ("W", packed_words(D, g.bits))],
    )
    return _mx(out, dtype)


def dequantize_reference(kv: StreamView, dtype: mx.Dtype = mx.float16, **_) -> mx.array:
    return decode(kv, dtype)


# ------------------------------------------------------------- 4. attention (decode and prefill)
class _Prepared(NamedTuple):
    """What both attention kernels take besides the cache views, computed once per call."""

    q: mx.array  # (B, H, RL, DK) float32 = scale·q, model basis; rows of a kv head: head_in_group·L + token
    q_rot: mx.array  # the keys' rotated basis (× s_k): one WHT, or each group's Π_g (q[order])_g side by side
    qs: mx.array  # S·s_k·scale·q (QJL), else a dummy
    qmu: mx.array | None  # (B, H, RL) scale·q·μ (keys centered before RoPE: its constant part, tq_mlx.rope)
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
    N, n_s, n_w = keys.n_compressed, keys.n_sinks, keys.n_window
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
    if keys.weights is not None:  # ... and (k - μ)·w: the query is divided by w (stream.query_weights)
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


# -------------------------------------------------------------------------- 4a. decode attention
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

    Same semantics as tq_mlx.attention.turboquant_attention: mask None, "causal" or a bool/additive array,
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


# ------------------------------------------------------------------------- 5. prefill attention
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


# ==================================================================================== dispatch
_backend: str | None = None
_factory: Callable | None = None
_checks: dict[tuple, str | None] = {}  # (kernel, variant, factory, sources) -> None if passed, else why not


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


def reset_self_checks() -> None:
    """Forget self-check results (tests; a new kernel factory or source is checked again anyway)."""
    _checks.clear()


def self_check_status() -> dict[tuple, str | None]:
    """(kernel, variant) -> None if the variant passed its self-check, else the reason it is disabled."""
    return {k[:2]: v for k, v in _checks.items()}


_TOL = {mx.float32: (2e-3, 2e-3), mx.float16: (1e-2, 1e-2), mx.bfloat16: (4e-2, 4e-2)}


def _mismatch(got, want, dtype=mx.float32) -> str | None:
    """Why `got` disagrees with the reference `want` (None: it agrees within the dtype's tolerance)."""
    g = np.asarray(got.astype(mx.float32)) if isinstance(got, mx.array) else np.asarray(got, np.float32)
    w = np.asarray(want.astype(mx.float32))
    if g.shape != w.shape:
        return f"shape {g.shape} != reference {w.shape}"
    if not np.isfinite(g).all():
        return f"{int((~np.isfinite(g)).sum())} non-finite values"
    atol, rtol = _TOL.get(dtype, _TOL[mx.float32])
    err = np.abs(g - w)
    bad = err > atol + rtol * np.abs(w)
    if bad.any():
        return f"max abs error {err.max():.3g} vs reference ({int(bad.sum())}/{bad.size} values out of tolerance)"
    return None


def _codes_mismatch(got, want, quantizer) -> str | None:
    """Encode agreement: codes may differ where a rotated value sits within rounding of a boundary."""
    prod = isinstance(quantizer, TurboQuantProd)
    groups = _mse(quantizer).groups
    gi, wi = (np.concatenate([np.asarray(unpack(c.codes[..., g.words], g.bits, g.dim)) for g in groups], axis=-1)
              for c in (got, want))
    frac = float((gi != wi).mean())
    if frac > 0.01:
        return f"{frac:.1%} of the codes differ from the reference"
    why = _mismatch(load_norms(got.norms), load_norms(want.norms), mx.float16)
    if why:
        return "norms: " + why
    if prod:
        gz, wz = (np.asarray(unpack(c.qjl, 1, quantizer.dim)) for c in (got, want))
        frac = float((gz != wz).mean())
        if frac > 0.02:
            return f"{frac:.1%} of the QJL sign bits differ from the reference"
        gg, wg = np.asarray(load_norms(got.gamma)), np.asarray(load_norms(want.gamma))
        if not np.isfinite(gg).all() or np.median(np.abs(gg - wg) / np.maximum(wg, 1e-6)) > 0.01:
            return "residual norms (gamma) differ from the reference"
    return None


def _self_check(kernel: str, variant: tuple, factory, run: Callable[[], str | None]) -> bool:
    """Run `run` (kernel vs reference on a small random input) once per kernel variant; on failure disable
    the variant and warn once."""
    key = (kernel, variant, factory, tuple(SOURCES.get(n) for n in KERNEL_NAMES))
    if key not in _checks:
        try:
            reason = run()
        except Exception as e:  # a compile error in the Metal source surfaces here
            reason = f"{type(e).__name__}: {e}"
        _checks[key] = reason
        if reason:
            warnings.warn(
                f"tq_mlx Metal kernel '{kernel}' {variant} failed its self-check and is disabled; the reference "
                f"path is used instead. Reason: {reason}",
                RuntimeWarning, stacklevel=3,
            )
    return _checks[key] is None


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng([0x7C, seed])


def _normal(rng, shape, dtype=mx.float32) -> mx.array:
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


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
    encoder (tq_mlx.stream.CompressedStream)."""
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

        variant = (quantizer.dim, quantizer.bits, "qjl" if prod else "mse", str(x.dtype), mean is not None,
                   scale is not None, perm is not None, str(quantizer.norm_dtype))
        if _self_check("encode", variant, factory, run):
            return encode(x, quantizer, mean, perm, scale, metal_kernel=factory)
    return encode_reference(x, quantizer, mean, perm, scale)


def _random_view(rng, quantizer, n_sinks: int, n: int, n_window: int, like: StreamView,
                 n_decayed: int = 0) -> StreamView:
    """A small random StreamView compressed by `quantizer`, with a mean, a scale and float tokens of the
    dtype where `like` has them (for self-checks); its first n_decayed compressed tokens coded by like's decay
    quantizer."""
    D = quantizer.dim
    mean = _normal(rng, (1, 1, D)) * 0.2 if like.mean is not None else None
    scale = mx.full((1, 1), 2.0**-2) if like.scale is not None else None
    perm = mx.array(rng.permutation(D).astype(np.int32))[None] if like.perm is not None else None
    x = _normal(rng, (1, 1, n, D))
    codes = encode_reference(x[:, :, n_decayed:], quantizer, mean, perm, scale) if n > n_decayed else None
    decayed = None
    if n_decayed:
        dq = like.decayed.quantizer
        decayed = StreamView(dq, encode_reference(x[:, :, :n_decayed], dq, mean, None, scale), None, None, mean,
                             None, scale)
    floats = lambda k: _normal(rng, (1, 1, k, D), _float_dtype(like)) if k else None  # noqa: E731
    # keys centered before RoPE: the same pairs, at positions far enough out that the angles are large
    where = dict(rope=like.rope, position=SELF_CHECK_POSITION) if like.rope is not None else {}
    if like.weights is not None:  # query-aware key weights: the kernels' query and decode divide by them
        where["weights"] = mx.exp(_normal(rng, (1, 1, D)) * 0.5)
    if decayed is not None and where:
        decayed = decayed._replace(**where)
    return StreamView(quantizer, codes, floats(n_sinks), floats(n_window), mean, perm, scale, decayed, **where)


def _random_views(rng, keys: StreamView, values: StreamView, n_sinks: int, n: int, n_window: int, tail: int = 0):
    """Small random (keys, values) like the real ones for a self-check: the same quantizers and parts, n
    compressed tokens; with decayed codes, the same spans of one key and one value quantizer in the same order
    (each side's decayed count mapped onto n spans' worth of tokens: n per span, the last one `tail` more)."""
    same = keys_are_values(keys, values)
    if not _decayed(keys, values):
        k = _random_view(rng, keys.quantizer, n_sinks, n + tail, n_window, keys)
        return k, (k if same else _random_view(rng, values.quantizer, n_sinks, n + tail, n_window, values))
    N = keys.n_compressed
    cuts = sorted({0, N, keys.n_decayed, values.n_decayed})
    total = n * (len(cuts) - 1) + tail
    small = {c: (n * i if c < N else total) for i, c in enumerate(cuts)}
    k = _random_view(rng, keys.quantizer, n_sinks, total, n_window, keys, small[keys.n_decayed])
    return k, (k if same else _random_view(rng, values.quantizer, n_sinks, total, n_window, values,
                                           small[values.n_decayed]))


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
        variant = (q.dim, q.bits, "qjl" if isinstance(q, TurboQuantProd) else "mse", str(dtype), kv.mean is not None,
                   kv.scale is not None, str(q.norm_dtype), kv.weights is not None)
        if _self_check("dequantize", variant, factory, run):
            return dequantize(kv, dtype, metal_kernel=factory)
    return dequantize_reference(kv, dtype)


def _random_mask(rng, kind, R: int, L: int, T: int):
    """A small random mask of `kind` (_mask_kind) for a self-check on one batch row of R query heads: bool
    (70% shown, the first and next-to-last tokens hidden, the last shown) or additive (scores ±2, 30% at the dtype's most negative value, as
    models fold a bool mask into an additive one)."""
    if kind is None or isinstance(kind, str):
        return kind
    dtype, _, per_head = kind
    shape = (1, R if per_head else 1, L, T)
    hidden = rng.random(shape) < 0.3
    hidden[..., 0] = hidden[..., -2] = True  # a sink token and a window token (the view has 2 and 3)
    hidden[..., -1] = False
    if dtype == str(mx.bool_):
        return mx.array(~hidden)
    dt = {str(d): d for d in FLOAT_DTYPES}[dtype]
    add = np.where(hidden, float(mx.finfo(dt).min), 2 * rng.standard_normal(shape)).astype(np.float32)
    return mx.array(add).astype(dt)


def dispatch_attention(queries, keys, values, scale, mask=None, sinks=None, *, metal_kernel=None) -> mx.array:
    """Drop-in for tq_mlx.attention.turboquant_attention on a Metal back end (after a self-check per variant):
    decode_attention for 1..8 query tokens, prefill_attention for longer chunks, both with mask None, "causal"
    or a bool/additive array, learned sinks or none, and a compressed context; the reference path for
    everything else."""
    if isinstance(keys, StreamView) and keys.observe is not None:  # its stream sums these queries first
        keys = keys.observe(queries)
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

        floats = tuple(str(_float_dtype(kv)) for kv in (keys, values))
        variant = (D, values.head_dim, kc, vc, "qjl" if qjl else "mse", nr, str(queries.dtype), kind, floats,
                   keys.mean is not None, values.mean is not None, keys.scale is not None, values.scale is not None,
                   keys.perm is not None, values.perm is not None, keys.weights is not None, npairs, spans, sinks is not None,
                   keys_are_values(keys, values))
        if _self_check("prefill_attention", variant, factory, run):
            return prefill_attention(queries, keys, values, scale, mask, sinks, rows_per_threadgroup=nr,
                                     metal_kernel=factory)
        return turboquant_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
    if kernels_enabled() and decode_unsupported(queries, keys, values, mask, sinks) is None:
        B, Hq, L, D = queries.shape
        R = Hq // keys.n_heads
        kc, vc, qjl = _kv_codes(keys, values)

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

        floats = tuple(str(_float_dtype(kv)) for kv in (keys, values))
        variant = (D, values.head_dim, kc, vc, "qjl" if qjl else "mse", R * L, str(queries.dtype), kind, floats,
                   keys.mean is not None, values.mean is not None, keys.scale is not None, values.scale is not None,
                   keys.perm is not None, values.perm is not None, keys.weights is not None, _rope_pairs(keys),
                   _span_codes(keys, values) if _decayed(keys, values) else (), sinks is not None,
                   keys_are_values(keys, values))
        if _self_check("decode_attention", variant, factory, run):
            return decode_attention(queries, keys, values, scale, mask, sinks, metal_kernel=factory)
    return turboquant_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
