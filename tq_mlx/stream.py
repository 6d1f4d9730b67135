"""One side (keys or values) of a layer's KV cache as a compressed stream of tokens, and its reference codec.

Token order in a stream, and the order of the attention mask's columns:

    [0, n_sinks)                          attention sinks: the first `sinks` tokens, in the model's dtype
    [n_sinks, n_sinks + n_decayed)        decayed codes: older compressed tokens re-coded at fewer bits
    [.., n_sinks + n_compressed)          TurboQuant codes (packed uint32) and float16 norms
    [n_sinks + n_compressed, n_tokens)    the recent-token window, in the model's dtype

(n_compressed counts decayed and fresh codes alike.)

New tokens go to the sinks until those are full, then to the window. When the window would overflow, its
oldest tokens are compressed in whole blocks of `compress_block` tokens (so the window keeps between
window - compress_block + 1 and window tokens). Compressed tokens exist only as codes: no float copy of them
is kept anywhere, and `nbytes` is the sum of every array the stream holds.

Temporal decay (`decay` = (age, quantizer)): once the fresh codes and the window hold more than `age` tokens,
the oldest fresh codes are decoded and re-coded with the decay quantizer, in whole compress blocks, so that at
most `age` tokens remain at the stream's own bits or in float. Both quantizers have one channel group and one
seed, so their codes share a rotated basis: attention rotates the query once for both, and the values of both
accumulate in one basis. Re-coding works in the quantizer's basis (mean, scale and channel order untouched), and
a token is re-coded exactly once, so the result does not depend on how the tokens were fed. Once tokens decay,
the fresh code buffer is allocated for the most fresh tokens there can be (`fresh_bound`) and the oldest are
shifted out in place; decayed codes grow in steps like fresh ones.

Centering (turboquant.md §4): with `center`, the mean μ per (batch, kv head) of the first compressed tokens
is subtracted before quantizing and fixed afterwards. With a `rope` as well (keys centered before RoPE,
tq_mlx.rope), μ0 is the mean of those tokens turned back by their RoPE, and the token at position p has
R(p) μ0 subtracted: a constant part of the keys before RoPE (Qwen2's k_proj bias) leaves the codes instead of
rotating through them. Position p of compressed token t is sinks + tokens a bound dropped + t.
Fractional bit widths (2.5, 3.5) quantize the d/4
channels of largest mean |x - μ| in those same tokens at one more bit (paper §4.3): the stream stores that
channel order per kv head as `perm` and feeds x[..., perm] to the quantizer, whose outlier group is its first
d/4 channels. Every stream also fixes a power-of-two scale per (batch, kv head) there (calibration_scale) and
quantizes (x - μ) / scale, so float16 norms neither overflow nor lose precision at any model scale. With a
window, the calibration tokens are exactly the first `window` tokens after the sinks (all of them are
at hand at the first compression), so it does not depend on how the prompt was fed (one shot, chunks, token by
token, or trimmed).

Query weights (`weigh`, keys only; query_weights): attention hands the stream the queries that attend it
(`observe`, called first by every attention entry on a view that carries it), and the stream sums the squares
of those at the calibration positions per channel. With the first compression it fixes weights w per (batch,
kv head, channel) and codes (x - c)·w; attention divides the query by w instead, so every score stays exact
while the codes' error moves to the channels the queries hardly read. A chunk whose own queries are among the
calibration's is coded when it is appended and again when its attention brings them (`_settle`, before anything
attends the codes; until then the stream keeps a reference to that chunk's float tokens, which the forward pass
holds anyway). The view update_and_fetch returns is then superseded by the one attention reads.

`encode` and `decode` are the reference codec (the Metal kernels' twins); `append` returns a `StreamView`,
the immutable view of the live tokens that attention reads.

Memory of one stream (batch B, H kv heads, head dim D; W words and G norms per token from the quantizer,
capacity C a multiple of `step`; F bytes per float of the model's dtype; the window and sink buffers exist
once first used):

    4·B·H·C·W + N·B·H·C·G  [+ 4·B·H·C·⌈D/32⌉ + N·B·H·C with QJL]     codes and norms (N = 2: float16, 1: uint8)
    [+ 4·B·H·C'·W' + N·B·H·C'·G' with decay: its own capacity C' and words W']
    + F·B·H·(window capacity + sinks)·D                               float window and sinks
    + 4·B·H·D if centered + 4·H·D for fractional bits + 4·B·H          μ, channel order, scale
    + 4·D + 4·P with a rope (P channel pairs)                          its channel order and frequencies
    + 4·B·H·D with query weights, once a query after the sinks came      summed queries, then the weights
    + the quantizer's constants (rotation signs or matrices, codebooks, QJL projection)
"""

from __future__ import annotations

import copy
import math
from typing import Callable, NamedTuple

import mlx.core as mx

from .quantizer import FLOAT_DTYPES, MSECodes, ProdCodes, TurboQuantMSE, TurboQuantProd, constant_arrays
from .rope import Rope, centers, pair_mean, rotate

WINDOW_STEP = 32  # the float window grows in steps of this many tokens up to `window`
# A stream's arrays, under "<name>_<part>" in a cache's state. `scale` came with state version 3 (None: 1).
# decayed: state version 6; rope (pre-RoPE key centering): version 7; weights and queries (query-aware key
# weights, and the queries summed before they are fixed): version 8
STATE_PARTS = ("codes", "sinks", "window", "mean", "perm", "scale", "decayed", "rope", "weights", "queries")


def unique_arrays(holders) -> list[mx.array]:
    """The arrays of every holder's held_arrays(), each once (holders may share constants)."""
    seen: dict[int, mx.array] = {}
    for h in holders:
        for a in h.held_arrays():
            seen.setdefault(id(a), a)
    return list(seen.values())


def window_capacity(recent: int, window: int) -> int:
    """Tokens the float window buffer holds once `recent` tokens have arrived after the sinks: steps of
    WINDOW_STEP while they fit in the window, the whole window from the first compression on. A function of
    the token count alone, so a short chat holds only what it uses and tq_mlx.memory stays exact."""
    if window == 0 or recent <= 0:
        return 0
    if recent > window:
        return window
    return min(window, -(-recent // WINDOW_STEP) * WINDOW_STEP)


def overflow(recent: int, window: int, compress_block: int) -> int:
    """Tokens compressed when the window holds `recent` tokens: none while they fit, else whole blocks until
    what is left fits (everything when window is 0)."""
    if recent <= window:
        return 0
    return recent if window == 0 else -(-(recent - window) // compress_block) * compress_block


def decayed_split(n_fresh: int, n_window: int, age: int | None, compress_block: int) -> int:
    """Fresh codes to re-code at the decay bits when the stream holds n_fresh fresh codes and n_window window
    tokens: whole blocks, until at most `age` fresh and window tokens remain (none without decay)."""
    if age is None or n_fresh + n_window <= age:
        return 0
    return min(n_fresh, -(-(n_fresh + n_window - age) // compress_block) * compress_block)


def fresh_bound(age: int, window: int, compress_block: int) -> int:
    """The most fresh codes a decaying stream can hold: the window keeps at least window - compress_block + 1
    tokens once anything is compressed, and fresh plus window tokens stay within `age`."""
    return age - max(0, window - compress_block + 1)


WIDE_BITS = 8  # protected keys, boundary layers, K8/V8: codes that want their norms exact


def make_quantizer(dim: int, bits: float, qjl: bool, seed: int, norm_dtype: mx.Dtype = mx.float16
                   ) -> TurboQuantMSE | TurboQuantProd:
    """The quantizer of one stream: TurboQuant_prod for QJL keys, TurboQuant_mse otherwise; norms stored as
    float16 or (norm_bits 8) a uint8 log code (quantizer.NORM_DTYPES). Codes of WIDE_BITS or more keep float16
    norms: the log code's error (RMS 1.25%) is three times 8-bit codes' own, a small part of 4-bit codes'."""
    if bits >= WIDE_BITS and norm_dtype == mx.uint8:
        norm_dtype = mx.float16
    if qjl:
        return TurboQuantProd(dim, int(bits), seed=seed, norm_dtype=norm_dtype)
    return TurboQuantMSE(dim, bits, seed=seed, norm_dtype=norm_dtype)


class StreamView(NamedTuple):
    """The live tokens of one stream, as attention reads them (update_and_fetch returns one per side).

    Arrays are views of the stream's buffers cut to the live tokens; None means that part holds no tokens.
    """

    quantizer: TurboQuantMSE | TurboQuantProd
    codes: MSECodes | ProdCodes | None  # (B, H, n_compressed, ...) in the quantizer's input basis
    sinks: mx.array | None  # (B, H, n_sinks, D) the model's float dtype, model basis
    window: mx.array | None  # (B, H, n_window, D) the model's float dtype, model basis
    mean: mx.array | None  # (B, H, D) float32: subtracted from every compressed token before quantizing
    perm: mx.array | None  # (H, D) int32: compressed token t was quantized as (x_t - mean)[..., perm]
    scale: mx.array | None = None  # (B, H) float32, a power of two: ... and divided by scale (None: 1)
    # The older compressed tokens, re-coded at fewer bits (temporal decay): a codes-only view (no sinks or
    # window; the same mean and scale; its quantizer shares the fresh codes' rotation). They come before `codes`.
    decayed: "StreamView | None" = None
    # Pre-RoPE centering (tq_mlx.rope): `mean` is μ0, and the token at position p had R(p) μ0 subtracted.
    rope: Rope | None = None
    position: int = 0  # the position of the first compressed token of this view (decayed ones first)
    # Query-aware key weights (B, H, D) float32: compressed token t holds (x_t - c_t)·w / scale (None: 1).
    weights: mx.array | None = None
    # Set while the stream still wants the queries attending it (query_weights): attention calls
    # observe(queries) first and attends the view it returns (see CompressedStream.observe).
    observe: Callable | None = None

    @property
    def n_sinks(self) -> int:
        return 0 if self.sinks is None else self.sinks.shape[2]

    @property
    def n_decayed(self) -> int:
        return 0 if self.decayed is None else self.decayed.n_compressed

    @property
    def n_fresh(self) -> int:
        """Compressed tokens at the stream's own bits (`codes`)."""
        return 0 if self.codes is None else self.codes.codes.shape[2]

    @property
    def n_compressed(self) -> int:
        """Every compressed token: decayed and fresh."""
        return self.n_decayed + self.n_fresh

    def segments(self) -> list[tuple[int, "StreamView"]]:
        """The compressed tokens as codes-only views with one quantizer each, oldest first, with the position
        of each one's first token among the compressed tokens: [(0, decayed), (n_decayed, fresh)], without
        empty ones."""
        parts = []
        if self.decayed is not None:
            parts.append((0, self.decayed))
        if self.codes is not None:
            parts.append((self.n_decayed, self._replace(sinks=None, window=None, decayed=None,
                                                        position=self.position + self.n_decayed)))
        return parts

    def centers(self, first: int = 0, n: int | None = None) -> mx.array | None:
        """What was subtracted from compressed tokens first .. first + n - 1 of this view before quantizing,
        (B, H, n, D) float32 (n: to the last), or broadcastable (B, H, 1, D) without RoPE; None if nothing."""
        if self.mean is None:
            return None
        if self.rope is None:
            return self.mean[:, :, None, :]
        n = self.n_compressed - first if n is None else n
        return centers(self.mean, self.rope, self.position + first, n)

    @property
    def n_window(self) -> int:
        return 0 if self.window is None else self.window.shape[2]

    @property
    def n_tokens(self) -> int:
        return self.n_sinks + self.n_compressed + self.n_window

    @property
    def n_heads(self) -> int:
        parts = (self.sinks, self.window, None if self.codes is None else self.codes.codes,
                 None if self.decayed is None else self.decayed.codes.codes)
        return next(a.shape[1] for a in parts if a is not None)

    @property
    def head_dim(self) -> int:
        return self.quantizer.dim


# --- the reference codec -----------------------------------------------------------------------------------


def encode(x: mx.array, quantizer, mean: mx.array | None = None, perm: mx.array | None = None,
           scale: mx.array | None = None):
    """Codes of tokens x (B, H, n, D): (x - mean (B, H, D)) / scale (B, H), channels in `perm` (H, D) order,
    then quantized."""
    if mean is not None:
        x = x - mean[:, :, None, :]
    if scale is not None:
        x = x / scale[:, :, None, None]
    if perm is not None:
        x = mx.take_along_axis(x, mx.broadcast_to(perm[None, :, None, :], x.shape), axis=-1)
    return quantizer.quantize(x)


def decode(view: StreamView, dtype: mx.Dtype = mx.float16) -> mx.array:
    """The compressed tokens of a view back in the model basis, (B, H, n_compressed, D) `dtype`, mean added
    (decayed tokens first)."""
    if view.decayed is not None:
        return mx.concatenate([decode(seg, dtype) for _, seg in view.segments()], axis=2)
    x = view.quantizer.dequantize(view.codes)
    if view.scale is not None:
        x = x * view.scale[:, :, None, None]
    if view.perm is not None:
        inv = mx.argsort(view.perm, axis=-1)
        x = mx.take_along_axis(x, mx.broadcast_to(inv[None, :, None, :], x.shape), axis=-1)
    if view.weights is not None:
        x = x / view.weights[:, :, None, :]
    if view.mean is not None:
        x = x + view.centers()
    return x.astype(dtype)


def code_order(quantizer: TurboQuantMSE, perm: mx.array | None) -> mx.array | None:
    """The model channel at each code position, (H, D) or (D,) int: code position j holds quantizer channel
    channels[j] (the groups' channels side by side), which is model channel perm[channels[j]]. None: model
    order (one group, no stream order)."""
    groups = quantizer.groups
    order = None if len(groups) == 1 else mx.concatenate([g.channels for g in groups])
    if perm is not None:
        order = perm if order is None else mx.take(perm, order, axis=-1)
    return order


def has_channel_order(quantizer) -> bool:
    """Whether a stream with this quantizer stores a channel order (fractional bits: two channel groups)."""
    return isinstance(quantizer, TurboQuantMSE) and len(quantizer.groups) == 2


def _finite_tokens(x: mx.array) -> tuple[mx.array, mx.array]:
    """(mask of the tokens of x (B, H, n, D) whose every coordinate is finite, how many per (B, H))."""
    ok = mx.all(mx.isfinite(x), axis=-1, keepdims=True)
    return ok, mx.sum(ok, axis=2)


def calibration_mean(x: mx.array) -> mx.array:
    """μ per (batch, kv head) over the finite tokens of x: one NaN or Inf token affects only itself (0 when
    no token is finite)."""
    ok, n = _finite_tokens(x)
    return mx.sum(mx.where(ok, x, 0.0), axis=2) / mx.maximum(n, 1)


def calibration_scale(x: mx.array, mean: mx.array | None) -> mx.array:
    """A power of two per (batch, kv head) near the RMS norm of the finite tokens of x - mean (1 where there
    is none). Streams divide tokens by it before quantizing (exact: a power of two), so stored float16 norms
    sit near 1 whatever the model's scale: 1e-8 or 1e5 keys keep float16's full precision and never overflow."""
    if mean is not None:
        x = x - mean[:, :, None, :]
    ok, n = _finite_tokens(x)
    rms = mx.sqrt(mx.sum(mx.where(ok, x * x, 0.0), axis=(2, 3)) / mx.maximum(n[..., 0], 1))
    # 2^floor(log2(rms)), exactly: the float's exponent bits alone. 0 (rms subnormal or 0) and inf fall back to 1.
    power = mx.view(mx.view(rms.astype(mx.float32), mx.uint32) & 0x7F800000, mx.float32)
    return mx.where((power > 0) & mx.isfinite(power), power, 1.0)


def bias_outlier_factor(x: mx.array, mean: mx.array) -> mx.array:
    """Per (batch, kv head) of calibration tokens x (B, H, n, D) with mean μ: how many times larger the score
    error of quantized keys is, relative to the spread of scores, for a query along μ than for keys that vary
    evenly in every direction (1 for those, at any bit width).

    TurboQuant's error is isotropic after the rotation: per direction it is ε·mean‖x - μ‖²/D. A query along μ
    sees scores that spread by std(u·(x - μ)), u = μ/‖μ‖. Queries of layers with large key offsets (Qwen2's
    key biases) point there, and in such layers the keys hardly vary along it: Qwen2.5-Coder-0.5B's layer 0
    scores 9.5, every other layer of it and of SmolLM2 at most 2.7 (benchmarks/DEFAULTS.md)."""
    d = x - mean[:, :, None, :]
    ok, n = _finite_tokens(d)
    d = mx.where(ok, d, 0.0)
    n = mx.maximum(n[..., 0], 1)
    u = mean / mx.maximum(mx.linalg.norm(mean, axis=-1, keepdims=True), 1e-30)
    s = mx.sum(d * u[:, :, None, :], axis=-1)  # (B, H, n): the centered scores of a unit query along μ
    spread = mx.sqrt(mx.maximum(mx.sum(s * s, axis=-1) / n - (mx.sum(s, axis=-1) / n) ** 2, 0.0))
    error = mx.sqrt(mx.sum(d * d, axis=(2, 3)) / (n * x.shape[-1]))
    return error / mx.maximum(spread, 1e-30 * mx.maximum(error, 1e-30))


def outlier_order(x: mx.array, mean: mx.array | None, quantizer) -> mx.array | None:
    """Channels per kv head by decreasing mean |x - mean| over batch and finite tokens (the first d/4 get the
    extra bit of a fractional width); None for quantizers with one channel group."""
    if not has_channel_order(quantizer):
        return None
    if mean is not None:
        x = x - mean[:, :, None, :]
    ok, _ = _finite_tokens(x)
    score = mx.sum(mx.where(ok, mx.abs(x), 0.0), axis=(0, 2))  # a sum ranks channels as the mean does
    return mx.argsort(-score, axis=-1).astype(mx.int32)


WEIGHT_RANGE = 4.0  # query weights stay within [1/4, 4] of their geometric mean


def query_weights(q_sq: mx.array, calib: mx.array, rope: Rope | None) -> mx.array:
    """Channel weights w (B, H, D) for keys, from the summed squares of the queries q_sq (B, H, D) that attended
    the calibration tokens and those tokens as they will be quantized, calib (B, H, n, D) (centered).

    A query's score error on TurboQuant keys is q·e with e isotropic after the rotation, its size set by the
    coded vector's norm. Coding k·w and attending with q/w keeps every score exact and makes the error
    (q/w)·e with E‖e‖² ∝ Σ w²k², so E(score error²) ∝ Σ q²/w² · Σ w²k², least at w² ∝ rms(q)/rms(k) per channel
    (Cauchy-Schwarz). Queries and keys of a layer put their energy in different channels, most of all where
    biases or massive activations sit. That optimum fits the calibration queries, summed over a kv head's query
    heads; later queries and single heads differ, and where the weights are small the keys' error grows by 1/w.
    So the weights take half its exponent, w² ∝ (rms(q)/rms(k))^½: on Qwen2.5-Coder-0.5B's keys at 4 bits the
    relative score error goes from 0.077 to 0.059 (0.054 at the optimum), and KL at 8k is lower than with the
    full exponent (benchmarks/DEFAULTS.md). Statistics are per RoPE pair (pair_mean); the weights have geometric
    mean 1 and stay within WEIGHT_RANGE of it."""
    ok, n = _finite_tokens(calib)
    k_sq = mx.sum(mx.where(ok, calib * calib, 0.0), axis=2) / mx.maximum(n, 1)
    if rope is not None:
        q_sq, k_sq = pair_mean(q_sq, rope), pair_mean(k_sq, rope)
    tiny = 1e-30
    q_sq = mx.maximum(q_sq, 1e-12 * mx.max(q_sq, axis=-1, keepdims=True) + tiny)
    k_sq = mx.maximum(k_sq, 1e-12 * mx.max(k_sq, axis=-1, keepdims=True) + tiny)
    log_w = (mx.log(q_sq) - mx.log(k_sq)) / 8
    log_w = log_w - mx.mean(log_w, axis=-1, keepdims=True)
    bound = math.log(WEIGHT_RANGE)
    return mx.exp(mx.clip(log_w, -bound, bound)).astype(mx.float32)


def _grow(buf, n_keep: int, n_new: int, step: int, template, capacity: int | None = None):
    """Buffers (a NamedTuple of arrays, token axis 2) holding n_keep + n_new tokens, capacity a multiple of step
    (or `capacity`, when given and enough)."""
    need = n_keep + n_new
    if buf is not None and need <= buf[0].shape[2]:
        return buf
    capacity = capacity if capacity is not None and capacity >= need else -(-need // step) * step
    if buf is None:
        return type(template)(*(mx.zeros((*t.shape[:2], capacity, *t.shape[3:]), t.dtype) for t in template))
    fresh = [mx.zeros((*b.shape[:2], capacity - n_keep, *b.shape[3:]), b.dtype) for b in buf]
    return type(template)(*(mx.concatenate([b[:, :, :n_keep], f], axis=2) for b, f in zip(buf, fresh)))


def _appended(buf, held: int, new, step: int, capacity: int | None = None):
    """Buffers holding their `held` tokens, then the tokens of `new` (same NamedTuple type), grown by _grow."""
    n = new[0].shape[2]
    buf = _grow(buf, held, n, step, new, capacity)
    for b, a in zip(buf, new):
        b[:, :, held : held + n] = a
    return buf


def _batch_heads_of(sinks, window, mean, codes) -> tuple[int, int] | None:
    for a in (sinks, window, mean, codes[0] if codes else None):
        if isinstance(a, mx.array) and a.ndim >= 2:
            return tuple(a.shape[:2])
    return None


def batch_heads(state: dict, name: str) -> tuple[int, int] | None:
    """(batch, kv heads) of a stream's arrays in a state dict (CompressedStream.state), None if it has none."""
    return _batch_heads_of(*(state.get(f"{name}_{part}") for part in ("sinks", "window", "mean", "codes")))


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


# --- the stream --------------------------------------------------------------------------------------------


class CompressedStream:
    """One side of a layer's cache: float sinks, TurboQuant codes, a float window (see the module docstring).

    The sinks and the window keep the dtype of the tokens appended (the model's, as mlx-lm's KVCache does), so
    they overflow exactly when the model does.

    protect = (factor, bits): when the calibration tokens' bias_outlier_factor exceeds `factor` in any (batch,
    kv head), the stream quantizes at `bits` instead (self.protected). Deciding reads one number back from the
    device, once per stream and sequence, at its first compression; every later append is graph construction.

    name ("k" or "v") prefixes the stream's arrays in a cache's state and in error messages. `encoder` has
    `encode`'s signature and `decoder` `decode`'s; the cache passes the kernel dispatch
    (tq_mlx.kernels.dispatch_encode, dispatch_dequantize).

    decay = (age, quantizer): temporal decay (the module docstring). A protected stream does not decay: what
    made it protect its keys holds at every age.
    """

    def __init__(
        self,
        quantizer: TurboQuantMSE | TurboQuantProd,
        *,
        name: str,
        sinks: int,
        window: int,
        compress_block: int,
        step: int,
        center: bool,
        encoder: Callable = encode,
        decoder: Callable = decode,
        protect: tuple[float, float] | None = None,
        decay: tuple[int, TurboQuantMSE] | None = None,
        rope: Rope | None = None,
        weigh: bool = False,
    ):
        if decay is not None and (has_channel_order(quantizer) or has_channel_order(decay[1])
                                  or isinstance(quantizer, TurboQuantProd) or decay[1].dim != quantizer.dim
                                  or decay[1].seed != quantizer.seed):
            raise ValueError(f"stream {name}: decay needs one-group MSE quantizers of one dim and seed")
        self.quantizer, self.name, self.encoder, self.decoder = quantizer, name, encoder, decoder
        self.decay = decay
        self.decayed = None  # MSECodes buffers (B, H, capacity, ...) of the decay quantizer
        self.n_decayed = 0
        self.base_quantizer, self.protect = quantizer, protect
        self.max_sinks, self.max_window, self.compress_block, self.step, self.center = (
            sinks, window, compress_block, step, center)
        self.n_sinks = self.n_compressed = self.n_window = 0
        self.codes = None  # MSECodes / ProdCodes buffers (B, H, capacity, ...)
        self.sinks = None  # (B, H, max_sinks, D) the tokens' float dtype
        self.window = None  # (B, H, window capacity, D) the tokens' float dtype
        self.mean = None  # (B, H, D) float32, with the first compressed tokens (if center)
        self.perm = None  # (H, D) int32, with the first compressed tokens (fractional bits)
        self.scale = None  # (B, H) float32 power of two, with the first compressed tokens
        self.rope = rope if center else None  # center before RoPE (tq_mlx.rope): mean is then μ0
        self.n_dropped = 0  # compressed tokens a bound dropped: positions continue past them
        # Query-aware weights (query_weights): the queries of the calibration tokens, summed per channel as
        # attention shows them (observe), fix `weights` with the first compression.
        self.weigh = weigh
        self.weights = None  # (B, H, D) float32, with the first compressed tokens (weigh)
        self.queries = None  # (B, H, D) float32: Σ q² over the calibration positions observed so far
        self._q_lo = self._q_hi = 0  # the queries of positions [_q_lo, _q_hi) are in `queries`
        self._redo = None  # (x, n, window_after, _q_hi): a first compression coded before its queries came

    @property
    def dim(self) -> int:
        return self.quantizer.dim

    @property
    def n_tokens(self) -> int:
        return self.n_sinks + self.n_decayed + self.n_compressed + self.n_window

    @property
    def decaying(self) -> bool:
        """Whether old tokens are re-coded (decay configured, and the stream did not protect itself)."""
        return self.decay is not None and not self.protected

    def _float_dtype(self, x: mx.array) -> mx.Dtype:
        """The dtype of the float buffers: theirs once they exist, else that of the first tokens."""
        held = self.sinks if self.sinks is not None else self.window
        return x.dtype if held is None else held.dtype

    @property
    def capacity(self) -> int:
        """Compressed tokens the code buffers can hold before they grow (a multiple of step)."""
        return 0 if self.codes is None else self.codes[0].shape[2]

    def append(self, x: mx.array) -> StreamView:
        """Store tokens x (B, H, L, D) and return the view of every live token. Pure graph construction:
        every branch depends on token counts, never on array values."""
        self._settle()
        B, H, L, D = x.shape
        if self.n_sinks < self.max_sinks:
            t = min(self.max_sinks - self.n_sinks, L)
            if self.sinks is None:
                self.sinks = mx.zeros((B, H, self.max_sinks, D), self._float_dtype(x))
            self.sinks[:, :, self.n_sinks : self.n_sinks + t] = x[:, :, :t].astype(self.sinks.dtype)
            self.n_sinks += t
            x = x[:, :, t:]
        if x.shape[2]:
            self._append_recent(x)
        return self.view()

    def _append_recent(self, x: mx.array) -> None:
        W = self.max_window
        total = self.n_window + x.shape[2]
        cap = window_capacity(total, W)
        if W and (self.window is None or self.window.shape[2] < cap):
            grown = mx.zeros((*x.shape[:2], cap, x.shape[3]), self._float_dtype(x))
            if self.n_window:
                grown[:, :, : self.n_window] = self.window[:, :, : self.n_window]
            self.window = grown
        n_c = overflow(total, W, self.compress_block)
        if n_c == 0:
            self.window[:, :, self.n_window : total] = x.astype(self.window.dtype)
            self.n_window = total
            self._decay_fresh()  # ages grow with every token
            return
        if self.n_window:
            x = mx.concatenate([self.window[:, :, : self.n_window].astype(mx.float32), x.astype(mx.float32)], axis=2)
        self._compress(x, n_c, window_after=total - n_c)
        self.n_window = total - n_c
        if self.n_window:
            self.window[:, :, : self.n_window] = x[:, :, n_c:].astype(self.window.dtype)

    def _compress(self, x: mx.array, n: int, window_after: int = 0, final: bool = False) -> None:
        """Compress the first n tokens of x (the window's tokens, then the new ones), window_after tokens
        staying in the window; then decay what is old enough."""
        x = x.astype(mx.float32)
        if self.n_compressed == 0 and self.n_decayed == 0:  # calibrate on the first tokens after the sinks
            # With a window, the first compression sees at least `window + 1` tokens after the sinks, however
            # the prompt is fed: calibrating on the first `window` gives the most tokens independent of feeding.
            calib = x[:, :, : self.max_window] if self.max_window else x
            if self.weigh and not final and not self._queries_cover(calib.shape[2]):
                # the queries of some calibration tokens come with this chunk's attention: code now, and again
                # with them when attention hands them over (observe), before anything reads these codes
                self._redo = (x, n, window_after, self._q_hi)
            self._calibrate(calib, decide_protection=not final)
            if self._redo is None:
                self.queries = None  # the weights are fixed
        new = x[:, :, :n]
        mean = self.mean
        if self.rope is not None:
            new, mean = new - centers(self.mean, self.rope, self._position(self.n_decayed + self.n_compressed), n), None
        if self.weights is not None:  # (x - c)·w: weigh the token and its center alike
            new = new * self.weights[:, :, None, :]
            mean = None if mean is None else mean * self.weights
        new = self.encoder(new, self.quantizer, mean, self.perm, self.scale)
        d = decayed_split(self.n_compressed + n, window_after, self.decay[0] if self.decaying else None,
                          self.compress_block)
        if d > self.n_compressed:  # new codes that decay at once never enter the fresh buffer (a long prefill)
            k = d - self.n_compressed
            self._decay_fresh(self.n_compressed)
            self._append_decayed(type(new)(*(a[:, :, :k] for a in new)))
            new, n = type(new)(*(a[:, :, k:] for a in new)), n - k
        else:
            self._decay_fresh(d)
        if n == 0:
            return
        self.codes = _appended(self.codes, self.n_compressed, new, self.step, self._fresh_capacity())
        self.n_compressed += n

    def _calibrate(self, calib: mx.array, decide_protection: bool = True) -> None:
        """Fix μ (or μ0), the query weights, the channel order and the scale from the calibration tokens (and
        whether to protect the keys: a settle keeps the first compression's decision, one value read back)."""
        mean = calibration_mean(calib)
        if decide_protection and self.protect is not None and self.protect[1] > self.base_quantizer.bits:
            self.set_protected(mx.max(bias_outlier_factor(calib, mean)).item() > self.protect[0])
        self.mean = mean if self.center else None
        if self.rope is not None:  # μ0 before RoPE; calibrate on the tokens as they will be quantized
            self.mean = calibration_mean(rotate(calib, self.rope, self._position(0), inverse=True))
            calib = calib - centers(self.mean, self.rope, self._position(0), calib.shape[2])
            mean = None
        else:
            mean = self.mean
        if self.weigh and self.queries is not None:
            centered = calib if mean is None else calib - mean[:, :, None, :]
            self.weights = query_weights(self.queries, centered, self.rope)
            calib = calib * self.weights[:, :, None, :]
            mean = None if mean is None else mean * self.weights
        self.perm = outlier_order(calib, mean, self.quantizer)
        self.scale = calibration_scale(calib, mean)

    def _queries_cover(self, n_calib: int) -> bool:
        """Whether the queries of every calibration token (the n_calib after the sinks) were observed."""
        return self._q_lo <= self.n_sinks and self._q_hi >= self.n_sinks + n_calib

    @property
    def wants_queries(self) -> bool:
        """Whether attention should hand this stream its queries (observe): weights not fixed yet."""
        return self.weigh and (self._redo is not None or (self.n_compressed == 0 and self.n_decayed == 0))

    def observe(self, queries: mx.array) -> StreamView:
        """Take the queries (B, n_q_heads, L, D) that attend this stream's last L tokens, adding the squares of
        those at calibration positions (the first `window` after the sinks) to `queries`; then finish a first
        compression that waited for them. Returns the view to attend (no further observe): graph construction
        only, no value read back."""
        B, Hq, L, D = queries.shape
        T = self.n_tokens
        lo = max(T - L, self._q_hi, self.max_sinks)
        hi = min(T, self.max_sinks + self.max_window) if self.max_window else T
        if hi > lo and D == self.dim:
            H = self.batch_heads()[1]
            q = queries[:, :, lo - (T - L) : hi - (T - L)].astype(mx.float32)
            q = mx.where(mx.isfinite(q), q, 0.0)
            sq = mx.sum((q * q).reshape(B, H, Hq // H, hi - lo, D), axis=(2, 3))
            self.queries = sq if self.queries is None else self.queries + sq
            if lo > self._q_hi:  # the first queries summed, or a gap before these: coverage starts here
                self._q_lo = lo
            self._q_hi = hi
        self._settle()
        view = self.view()._replace(observe=None)
        if self.queries is not None:
            # Still calibrating, so every token is float: the float tokens attention reads carry the sum, which
            # is then computed with the output, on the thread that attends. Left out of the graph it would hold
            # every step's queries until the first compression, and a save from another thread (tq-chat's
            # /save) could not evaluate it.
            part = "window" if view.window is not None else "sinks"
            if getattr(view, part) is not None:
                view = view._replace(**{part: mx.depends(getattr(view, part), self.queries)})
        return view

    def _settle(self) -> None:
        """Finish a first compression that waited for queries: code it again (the same tokens) if queries came
        since; the weights are then fixed and the summed queries dropped."""
        if self._redo is None:
            return
        x, n, window_after, q_hi = self._redo
        self._redo = None
        if self._q_hi > q_hi:
            self.codes = self.decayed = self.mean = self.perm = self.scale = self.weights = None
            self.n_compressed = self.n_decayed = 0
            self._compress(x, n, window_after, final=True)  # the same tokens: the same protection
        self.queries = None

    def _position(self, t: int) -> int:
        """The position of compressed token t (decayed ones first): sinks and dropped tokens come before."""
        return self.n_sinks + self.n_dropped + t

    def _fresh_capacity(self) -> int | None:
        """The fresh buffer's capacity once tokens decayed: room for the most fresh codes there can be, so it
        is allocated once and its size is a function of the config (tq_mlx.memory); None before."""
        if not self.n_decayed:
            return None
        return -(-fresh_bound(self.decay[0], self.max_window, self.compress_block) // self.step) * self.step

    def _decay_fresh(self, n: int | None = None) -> None:
        """Re-code the n oldest fresh codes (None: as many as their age calls for) at the decay bits."""
        if n is None:
            n = decayed_split(self.n_compressed, self.n_window, self.decay[0] if self.decaying else None,
                              self.compress_block)
        if n <= 0:
            return
        self._append_decayed(type(self.codes)(*(a[:, :, :n] for a in self.codes)))
        # the kept codes move to the front of a buffer of the bound's size (no slice keeps the old one alive)
        self.codes = self._dropped(self.codes, self.n_compressed, n, 0, self._fresh_capacity())
        self.n_compressed -= n

    def _append_decayed(self, codes) -> None:
        """Re-code fresh codes with the decay quantizer (in the quantizer's basis: mean, scale and channel
        order stay as they are) and append them to the decayed codes."""
        x = self.decoder(StreamView(self.quantizer, codes, None, None, None, None, None), mx.float32)
        new = self.encoder(x, self.decay[1])
        self.decayed = _appended(self.decayed, self.n_decayed, new, self.step)
        self.n_decayed += new[0].shape[2]

    def drop_oldest(self, n: int, room: int) -> None:
        """Drop the n oldest compressed tokens (a bounded cache), decayed ones first. The rest of a buffer
        dropped from move to a new one with room for `room` more tokens (capacity a multiple of step; a decaying
        stream's fresh buffer keeps its bound's size), so no slice of the old buffer keeps it alive. The
        calibration stays: the tokens kept were quantized with it."""
        self._settle()
        self.n_dropped += min(n, self.n_decayed + self.n_compressed)
        d = min(n, self.n_decayed)
        if d > 0:
            self.decayed, self.n_decayed = self._dropped(self.decayed, self.n_decayed, d, room), self.n_decayed - d
        n = min(n - d, self.n_compressed)
        if n > 0:
            self.codes, self.n_compressed = self._dropped(self.codes, self.n_compressed, n, room,
                                                          self._fresh_capacity()), self.n_compressed - n

    def _dropped(self, buf, held: int, n: int, room: int, capacity: int | None = None):
        keep = held - n
        capacity = capacity or -(-(keep + room) // self.step) * self.step
        return type(buf)(*(mx.concatenate([a[:, :, n:held], mx.zeros((*a.shape[:2], capacity - keep, *a.shape[3:]),
                                                                     a.dtype)], axis=2) for a in buf))

    @property
    def protected(self) -> bool:
        return self.quantizer is not self.base_quantizer

    def set_protected(self, protected: bool) -> None:
        """Quantize at the protection bits (plain MSE codes, same seed), or at the configured quantizer."""
        q = self.base_quantizer
        self.quantizer = make_quantizer(q.dim, self.protect[1], False, q.seed, q.norm_dtype) if protected else q

    def view(self) -> StreamView:
        s, c, w, d = self.n_sinks, self.n_compressed, self.n_window, self.n_decayed
        decayed = None
        if d:
            decayed = StreamView(self.decay[1], type(self.decayed)(*(a[:, :, :d] for a in self.decayed)), None, None,
                                 self.mean, None, self.scale, rope=self.rope, position=self._position(0),
                                 weights=self.weights)
        return StreamView(
            quantizer=self.quantizer,
            codes=type(self.codes)(*(a[:, :, :c] for a in self.codes)) if c else None,
            sinks=self.sinks[:, :, :s] if s else None,
            window=self.window[:, :, :w] if w else None,
            mean=self.mean,
            perm=self.perm,
            scale=self.scale,
            decayed=decayed,
            rope=self.rope,
            position=self._position(0),
            weights=self.weights,
            observe=self.observe if self.wants_queries else None,
        )

    def trim(self, n: int) -> None:
        """Drop the last n tokens (at most n_tokens): window first, then fresh codes, decayed codes, sinks.
        Decayed tokens that remain keep their decayed codes (their fresh codes are gone). A trim that leaves no
        compressed token drops the calibration, so the next tokens compressed calibrate again exactly as in a
        fresh stream fed the same tokens. Queries summed for the weights cannot be taken out again: a trim
        below the last one observed forgets them, and the weights then come from the queries seen after it."""
        self._settle()
        for part in ("n_window", "n_compressed", "n_decayed", "n_sinks"):
            d = min(getattr(self, part), n)
            setattr(self, part, getattr(self, part) - d)
            n -= d
        if self.n_compressed == 0 and self.n_decayed == 0:
            self.mean = self.perm = self.scale = self.weights = None
            self.quantizer = self.base_quantizer
            if self._q_hi > self.n_tokens:
                self.queries, self._q_lo, self._q_hi = None, self.n_tokens, self.n_tokens

    def batch_heads(self) -> tuple[int, int] | None:
        """(batch, kv heads) of the stored arrays, None before the first tokens."""
        return _batch_heads_of(self.sinks, self.window, self.mean, self.codes)  # every update: no state dict

    def held_arrays(self) -> list[mx.array]:
        """Every array this stream holds: buffers at full capacity, μ, channel order, quantizer constants."""
        parts = [*(self.codes or ()), *(self.decayed or ()), *(self.rope or ()), self.sinks, self.window, self.mean,
                 self.perm, self.scale, self.weights, self.queries]
        quantizers = (self.quantizer, self.base_quantizer) if self.protected else (self.quantizer,)
        quantizers += (self.decay[1],) if self.decay is not None else ()
        return [a for a in parts if a is not None] + [a for q in quantizers for a in constant_arrays(q)]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.held_arrays())

    def __deepcopy__(self, memo):
        # Quantizers are immutable (and hold mx.Dtype, which cannot be copied), so copies share them and the
        # encoder; every stored array is copied.
        self._settle()
        new = copy.copy(self)
        memo[id(self)] = new
        for name in STATE_PARTS:
            setattr(new, name, copy.deepcopy(getattr(self, name), memo))
        return new

    # --- state: the arrays under "<name>_codes", "<name>_sinks", ... (the token counts are the cache's) -----

    @property
    def state(self) -> dict:
        self._settle()
        codes = ("codes", "decayed", "rope")
        return {
            **{f"{self.name}_{p}": None if getattr(self, p) is None else tuple(getattr(self, p)) for p in codes},
            **{f"{self.name}_{part}": getattr(self, part) for part in STATE_PARTS if part not in codes},
        }

    def load_state(self, arrays: dict, n_sinks: int, n_compressed: int, n_window: int,
                   bh: tuple[int, int] | None, n_decayed: int = 0, n_dropped: int = 0) -> None:
        """Take the arrays of `state` and the token counts, checking every shape and dtype against them and
        this stream's settings (a corrupted file raises ValueError naming the array, nothing else happens)."""
        # mx.array(a) shares a's data but is a new object, so this stream's in-place slice updates never reach
        # another stream built from the same state.
        own = lambda a: mx.array(a) if isinstance(a, mx.array) else a  # noqa: E731

        def codes_of(part, codes_type):
            codes = arrays.get(f"{self.name}_{part}")
            if codes is None:
                return None
            if not isinstance(codes, (list, tuple)) or len(codes) != len(codes_type._fields):
                raise ValueError(f"{self.name}_{part} must hold {codes_type._fields}")
            return codes_type(*map(own, codes))

        codes = codes_of("codes", ProdCodes if isinstance(self.quantizer, TurboQuantProd) else MSECodes)
        self._read_norms_as_written(codes)
        decayed = codes_of("decayed", MSECodes)
        rope = codes_of("rope", Rope)
        parts = {p: own(arrays.get(f"{self.name}_{p}")) for p in STATE_PARTS[1:] if p not in ("decayed", "rope")}
        self._check_state(codes, parts, n_sinks, n_compressed, n_window, bh)
        if n_decayed or decayed is not None:
            if self.decay is None:
                raise ValueError(f"{self.name}_decayed: decayed tokens, but the config has no decay")
            self._check_codes("decayed", decayed, self.decay[1], n_decayed, bh)
        if rope is not None:
            self._check_rope(rope)
        # the file's RoPE is what its codes were centered with, whatever the model at hand says
        self.rope = rope if self.center else None
        self.n_dropped = n_dropped
        self.codes, self.decayed = codes, decayed
        for p, a in parts.items():
            setattr(self, p, a)
        self.n_sinks, self.n_compressed, self.n_window, self.n_decayed = n_sinks, n_compressed, n_window, n_decayed
        # queries summed before the file was written are those of every token it holds (attention saw them all)
        self._q_lo, self._q_hi, self._redo = 0, (self.n_tokens if self.queries is not None else 0), None
        if not self.weigh:
            self.queries = None

    def _read_norms_as_written(self, codes) -> None:
        """A file written before codes of WIDE_BITS kept float16 norms holds their uint8 log code: this stream
        then keeps that code (its quantizer otherwise the same), so the file loads and continues as it was."""
        q, norms = self.quantizer, getattr(codes, "norms", None)
        if (q.bits < WIDE_BITS or q.norm_dtype == mx.uint8 or not isinstance(norms, mx.array)
                or norms.dtype != mx.uint8):
            return
        legacy = type(q)(q.dim, q.bits, seed=q.seed, norm_dtype=mx.uint8)
        if self.base_quantizer is q:
            self.base_quantizer = legacy
        self.quantizer = legacy

    def _check_rope(self, rope: Rope) -> None:
        D, name = self.dim, f"{self.name}_rope"
        order, freqs = rope
        if not isinstance(order, mx.array) or order.dtype != mx.int32 or tuple(order.shape) != (D,):
            raise ValueError(f"{name}.order must be an int32 array of shape ({D},)")
        if not isinstance(freqs, mx.array) or freqs.dtype != mx.float32 or freqs.ndim != 1 or 2 * freqs.shape[0] > D:
            raise ValueError(f"{name}.freqs must be a float32 array of shape (P,), 2·P <= {D}")
        if not self.center:
            raise ValueError(f"{name}: keys centered before RoPE, but the config does not center them")
        if sorted(order.tolist()) != list(range(D)):
            raise ValueError(f"{name}.order must be a permutation of the {D} channels")

    def _check_codes(self, part: str, codes, quantizer, n: int, bh) -> None:
        B, H = bh or (None, None)
        # A lazy probe gives each field's trailing shape and dtype without evaluating anything.
        probe = quantizer.quantize(mx.zeros((1, 1, 1, quantizer.dim), mx.float32))
        if codes is None or len(codes) != len(probe):
            raise ValueError(f"{self.name}_{part} must hold {probe._fields}")
        for field, a, p in zip(probe._fields, codes, probe):
            got = tuple(a.shape) if isinstance(a, mx.array) else None
            if (got is None or a.dtype != p.dtype or len(got) != p.ndim or got[2] < n
                    or got[:2] != (B, H) or got[3:] != tuple(p.shape[3:])):
                raise ValueError(f"{self.name}_{part}.{field} must be a {_dtype_name(p.dtype)} array of shape "
                                 f"{(B, H, None, *p.shape[3:])} (None: at least {n}), got "
                                 f"{got if got is not None else type(a).__name__}")

    def _check_state(self, codes, parts: dict, n_sinks: int, n_compressed: int, n_window: int, bh) -> None:
        B, H = bh or (None, None)
        D, name = self.dim, self.name

        def check(field, a, expected, dtype, min_tokens=0):
            # expected: the full shape, with None on the token axis of growable buffers (>= min_tokens);
            # dtype: one dtype or a tuple of the allowed ones
            allowed = dtype if isinstance(dtype, tuple) else (dtype,)
            if not isinstance(a, mx.array) or a.dtype not in allowed:
                raise ValueError(f"{name}_{field} must be a {' or '.join(map(_dtype_name, allowed))} array, got "
                                 f"{_dtype_name(a.dtype) if isinstance(a, mx.array) else type(a).__name__}")
            got = tuple(a.shape)
            ok = len(got) == len(expected)
            ok = ok and all(e is None and g >= min_tokens or e == g for g, e in zip(got, expected))
            if not ok:
                raise ValueError(f"{name}_{field} has shape {got}, expected {expected} (None: at least {min_tokens})")

        if n_sinks or parts["sinks"] is not None:
            check("sinks", parts["sinks"], (B, H, self.max_sinks, D), FLOAT_DTYPES)
        if n_window or parts["window"] is not None:
            check("window", parts["window"], (B, H, None, D), FLOAT_DTYPES, max(n_window, 1))
            if parts["window"].shape[2] > self.max_window:
                raise ValueError(f"{name}_window holds {parts['window'].shape[2]} tokens, more than the "
                                 f"config's window {self.max_window}")
            if parts["sinks"] is not None and parts["sinks"].dtype != parts["window"].dtype:
                raise ValueError(f"{name}_sinks ({_dtype_name(parts['sinks'].dtype)}) and {name}_window "
                                 f"({_dtype_name(parts['window'].dtype)}) must have one dtype")
        if n_compressed or codes is not None:
            # A lazy probe gives each field's trailing shape and dtype without evaluating anything.
            probe = self.quantizer.quantize(mx.zeros((1, 1, 1, D), mx.float32))
            if codes is None or len(codes) != len(probe):
                raise ValueError(f"{name}_codes must hold {probe._fields}")
            for field, a, p in zip(probe._fields, codes, probe):
                check(f"codes.{field}", a, (B, H, None, *p.shape[3:]), p.dtype, n_compressed)
        if n_compressed:
            if self.center:
                check("mean", parts["mean"], (B, H, D), mx.float32)
            if has_channel_order(self.quantizer):
                check("perm", parts["perm"], (H, D), mx.int32)
            if parts["scale"] is not None:
                check("scale", parts["scale"], (B, H), mx.float32)
        for part in ("weights", "queries"):
            if parts[part] is not None:
                check(part, parts[part], (B, H, D), mx.float32)

