"""A stream's calibration: the mean, scale, channel order and query weights its first compressed tokens fix, and
the queries summed for those weights until then (QuerySums).

Every stream fixes, with its first compression, from the calibration tokens (the first window's tokens after the
sinks: calibration_tokens, or window if larger): μ per (batch, kv head) if centered (calibration_mean; μ0 before RoPE with a rope), a power-of-two scale
per (batch, kv head) (calibration_scale), for fractional bit widths the channel order whose first d/4 channels get
the extra bit (outlier_order), and with query weights the weights w (query_weights). Keys of a layer whose
queries read along a large key offset may protect themselves (needs_protection, bias_outlier_factor), and with a
key error target keys may take more bits (logit_error, key_width), or with an output error target the fewest bits
whose attention outputs on the first window's last third of queries err at most that (SpanQueries, output_errors).

Query weights (`weigh`, keys only): the cache's learning step (TurboQuantKVCache.learn, before attention reads the
views) hands the stream the queries that attend it (CompressedStream.observe), and QuerySums adds the squares of those at the
calibration positions per channel. With the first compression the stream fixes weights w per (batch, kv head,
channel) and codes (x - c)·w; attention divides the query by w instead, so every score stays exact while the
codes' error moves to the channels the queries hardly read. A chunk whose own queries are among the
calibration's is coded when it is appended and again when its attention brings them (QuerySums.pending, settled
before anything attends the codes; until then the stream keeps a reference to that chunk's float tokens, which
the forward pass holds anyway).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

import mlx.core as mx

from ..layout import value_error_span
from ..quant.codebook import lloyd_max
from ..quant.quantizer import TurboQuantMSE, split_dims
from ..models.rope import Rope, centers, pair_mean, rotate

WEIGHT_RANGE = 4.0  # query weights stay within [1/4, 4] of their geometric mean


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
    scores 9.5, every other layer of it and of SmolLM2 at most 2.7 (experiments/HISTORY.md)."""
    d = x - mean[:, :, None, :]
    ok, n = _finite_tokens(d)
    d = mx.where(ok, d, 0.0)
    n = mx.maximum(n[..., 0], 1)
    u = mean / mx.maximum(mx.linalg.norm(mean, axis=-1, keepdims=True), 1e-30)
    s = mx.sum(d * u[:, :, None, :], axis=-1)  # (B, H, n): the centered scores of a unit query along μ
    spread = mx.sqrt(mx.maximum(mx.sum(s * s, axis=-1) / n - (mx.sum(s, axis=-1) / n) ** 2, 0.0))
    error = mx.sqrt(mx.sum(d * d, axis=(2, 3)) / (n * x.shape[-1]))
    return error / mx.maximum(spread, 1e-30 * mx.maximum(error, 1e-30))


def needs_protection(x: mx.array, factor: float, rope: Rope | None = None, position: int = 0) -> bool:
    """Whether calibration keys x exceed bias_outlier_factor `factor` in any (batch, kv head): the one value a
    stream reads back from the device, once per sequence, at its first compression. With a rope, on x turned
    back by it (x's first token at `position`): the frame a mean taken before RoPE is one direction in."""
    if rope is not None:
        x = rotate(x, rope, position, inverse=True)
    return mx.max(bias_outlier_factor(x, calibration_mean(x))).item() > factor


def outlier_order(x: mx.array, mean: mx.array | None, quantizer, always: bool = False,
                  rope: Rope | None = None) -> mx.array | None:
    """Channels per kv head by decreasing mean |x - mean| over batch and finite tokens (the first d/4 get the
    extra bit of a fractional width); None for quantizers with one channel group, unless `always`. With the
    keys' rope, a RoPE pair's two channels rank together (pair_mean): the position turns a pair's energy from
    one to the other, so a pair split across the groups would move its energy to the narrower codes later."""
    if not (always or has_channel_order(quantizer)):
        return None
    if mean is not None:
        x = x - mean[:, :, None, :]
    ok, _ = _finite_tokens(x)
    score = mx.sum(mx.where(ok, mx.abs(x), 0.0), axis=(0, 2))  # a sum ranks channels as the mean does
    if rope is not None:
        score = pair_mean(score, rope)
    return mx.argsort(-score, axis=-1).astype(mx.int32)


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
    full exponent (experiments/HISTORY.md). Statistics are per RoPE pair (pair_mean); the weights have geometric
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


def channel_reads(queries: mx.array, count: int, weights: mx.array) -> mx.array:
    """(B, H, D): how much attention reads each channel's code error, mean q_c²/w_c² over the calibration queries
    (their squares summed over `count` query vectors per kv head) of keys coded times the weights w."""
    return queries / max(count, 1) / (weights * weights)


def logit_error(x: mx.array, weights: mx.array, queries: mx.array, count: int, scale: float | None = None
                ) -> mx.array:
    """Per (batch, kv head): the RMS error of the attention logits q·k/√D that keys coded with a unit distortion
    (E‖e‖² = ‖x‖², spread evenly by the rotation) would give the calibration queries; times √D_mse(b) it is the
    error at b bits (key_width). x (B, H, n, D): the calibration keys as they are coded (centered and weighed),
    weights w (B, H, D), queries: their squares summed over `count` query vectors per kv head, which attention
    scales by `scale` (None: 1/√D, mlx-lm's usual).

    The code's error e is isotropic in the coded basis, E e_c² = ‖x‖²/D per channel; attention reads it as
    (q/w)·e, so E (q·e/w)² = Σ_c q_c²/w_c² · ‖x‖²/D, averaged over the queries and the tokens."""
    ok, n = _finite_tokens(x)
    norm_sq = mx.sum(mx.where(ok, x * x, 0.0), axis=(2, 3)) / mx.maximum(n[..., 0], 1)  # mean ‖x‖² (B, H)
    D = x.shape[-1]
    read = mx.sum(channel_reads(queries, count, weights), axis=-1)  # mean Σ_c q_c²/w_c² (B, H)
    return mx.sqrt(norm_sq * read / D) * (D**-0.5 if scale is None else scale)


def key_width(unit_error, widths, target: float, dim: int, split=None) -> float:
    """The first of `widths` (plan.Widen.widths: ascending) whose logit error is at most `target` in every kv head;
    the last if none is. unit_error: a number or an array per kv head (logit_error); a whole width's error is
    unit_error · √D_mse(b). A half step (b.5: the first d/4 channels of the stream's channel order at ⌊b⌋+1 bits,
    the rest at ⌊b⌋, each group rotated on its own) errs √(u_0² D_mse(b_0) + u_1² D_mse(b_1)), u_g the unit errors
    of the two groups, split (..., 2) (group_logit_errors)."""
    u = np.asarray(unit_error, dtype=np.float64)
    for b in widths[:-1]:
        if b == int(b):
            error = u * math.sqrt(lloyd_max(dim, int(b)).mse)
        else:
            (d0, b0), (d1, b1) = split_dims(dim, b)
            g = np.asarray(split, dtype=np.float64)
            error = np.sqrt(g[..., 0] ** 2 * lloyd_max(d0, b0).mse + g[..., 1] ** 2 * lloyd_max(d1, b1).mse)
        if np.max(error) <= target:
            return b
    return widths[-1]


def group_logit_errors(x: mx.array, weights: mx.array, queries: mx.array, count: int, perm: mx.array,
                       scale: float | None = None) -> mx.array:
    """(B, H, 2): logit_error's unit errors of a half-step width's two groups, the first d/4 channels of `perm`
    (H, D) and the rest, each coded on its own: a group's code error is isotropic within it, E e_c² = ‖x_g‖²/d_g
    per channel, and attention reads it as Σ_{c in g} q_c²/w_c² · ‖x_g‖²/d_g."""
    ok, n = _finite_tokens(x)
    D = x.shape[-1]
    order = mx.broadcast_to(perm[None, :, None, :], x.shape)
    sq = mx.sum(mx.where(ok, mx.take_along_axis(x, order, axis=-1) ** 2, 0.0), axis=2) / mx.maximum(n, 1)  # (B, H, D)
    read = mx.take_along_axis(channel_reads(queries, count, weights), mx.broadcast_to(perm[None], sq.shape), axis=-1)
    d0 = D // 4
    parts = [mx.sum(sq[..., :d0], axis=-1) * mx.sum(read[..., :d0], axis=-1) / d0,
             mx.sum(sq[..., d0:], axis=-1) * mx.sum(read[..., d0:], axis=-1) / (D - d0)]
    return mx.sqrt(mx.stack(parts, axis=-1)) * (D**-0.5 if scale is None else scale)


class Calibration(NamedTuple):
    """What a stream's first compression fixes; compressed token t is coded as ((x_t - c_t)·weights / scale)
    with channels in `perm` order, c_t = mean (or R(p) mean with a rope)."""

    mean: mx.array | None  # (B, H, D) float32 if centered: μ, or μ0 before RoPE
    perm: mx.array | None  # (H, D) int32 for fractional bits
    scale: mx.array  # (B, H) float32, a power of two
    weights: mx.array | None  # (B, H, D) float32 with query weights
    error: mx.array | None = None  # (B, H) float32 with query weights: logit_error of the calibration keys
    split: mx.array | None = None  # (B, H, 2) float32 with `split`: group_logit_errors of the channel order's groups


def calibrate(x: mx.array, quantizer, *, center: bool, rope: Rope | None, position: int,
              queries: mx.array | None, query_count: int = 0, query_scale: float | None = None,
              split: bool = False) -> Calibration:
    """The calibration of tokens x (B, H, n, D) float32 at positions position .. position + n - 1, for codes of
    `quantizer`: μ if center (μ0, the mean of the tokens turned back by their RoPE, with a rope), weights from
    the summed squared queries if given (and the keys' logit_error for those `query_count` queries), then the
    channel order and the scale of the tokens as they will be quantized. split (keys that may widen by half
    steps): the channel order whatever the quantizer, and its two groups' unit errors."""
    mean = calibration_mean(x) if center else None
    shift = mean  # what is subtracted from every token, in the basis the quantizer sees
    if rope is not None:
        mean = calibration_mean(rotate(x, rope, position, inverse=True))
        x = x - centers(mean, rope, position, x.shape[2])
        shift = None
    weights = error = groups = None
    if queries is not None:
        weights = query_weights(queries, x if shift is None else x - shift[:, :, None, :], rope)
        x = x * weights[:, :, None, :]
        shift = None if shift is None else shift * weights
        error = logit_error(x if shift is None else x - shift[:, :, None, :], weights, queries, query_count,
                            query_scale)
    order = outlier_order(x, shift, quantizer, always=split, rope=rope)
    if split and weights is not None:
        groups = group_logit_errors(x if shift is None else x - shift[:, :, None, :], weights, queries, query_count,
                                    order, query_scale)
    return Calibration(mean, order, calibration_scale(x, shift), weights, error, groups)


def unseen(n_tokens: int, L: int, end: int, first: int, last: int) -> tuple[int, int]:
    """The positions [lo, hi) in [first, last), from `end` on (those before were taken), of the queries attending the
    last L of n_tokens tokens: what the query sums, the span queries and the value sums take of an update."""
    return max(n_tokens - L, end, first), min(n_tokens, last)


class PendingCode(NamedTuple):
    """A first compression coded before the queries of all its calibration tokens came."""

    x: mx.array  # the tokens it compressed and kept in the window, float32 (B, H, n + window_after, D)
    n: int  # how many it compressed
    window_after: int  # how many stayed in the window
    observed: int  # QuerySums.end when it was coded
    force: bool = False  # coded again at the next settle whatever came (keys by their output error: with the values)


class QuerySums:
    """The queries that attended a stream's calibration positions, their squares summed per (batch, kv head,
    channel) until the first compression fixes the key weights (query_weights)."""

    def __init__(self):
        self.total: mx.array | None = None  # (B, H, D) float32: Σ q² over the positions observed so far
        self.count = 0  # query vectors per kv head in `total` (positions x query heads per kv head)
        self.scale: float | None = None  # attention's scale of those queries (None: not seen)
        self.start = self.end = 0  # the queries of positions [start, end) are in `total`
        self.pending: PendingCode | None = None

    def covers(self, first: int, n: int) -> bool:
        """Whether the queries of positions first .. first + n - 1 were all observed."""
        return self.start <= first and self.end >= first + n

    def add(self, queries: mx.array, n_tokens: int, first: int, last: int, heads: int | None,
            scale: float | None = None) -> None:
        """Add the squares of queries (B, n_q_heads, L, D) attending the last L of n_tokens tokens, at the
        positions in [first, last) not summed yet, per kv head (`heads` of them), which attention scales by
        `scale`. Graph construction only."""
        B, Hq, L, D = queries.shape
        self.scale = self.scale if scale is None else float(scale)
        lo, hi = unseen(n_tokens, L, self.end, first, last)
        if hi <= lo:
            return
        q = queries[:, :, lo - (n_tokens - L) : hi - (n_tokens - L)].astype(mx.float32)
        q = mx.where(mx.isfinite(q), q, 0.0)
        sq = mx.sum((q * q).reshape(B, heads, Hq // heads, hi - lo, D), axis=(2, 3))
        self.total = sq if self.total is None else self.total + sq
        self.count += (hi - lo) * (Hq // heads)
        if lo > self.end:  # the first queries summed, or a gap before these: coverage starts here
            self.start = lo
        self.end = hi

    def wait(self, x: mx.array, n: int, window_after: int, force: bool = False) -> None:
        """A first compression was coded before its queries came: code it again once they do (settle), or at the
        next settle whatever came (force)."""
        self.pending = PendingCode(x, n, window_after, self.end, force)

    def fix(self) -> None:
        """The weights are fixed: the sums are dropped."""
        self.total, self.count = None, 0

    def settle(self) -> PendingCode | None:
        """End a wait: the pending compression if queries came since (to be coded again with them, which drops
        the sums), else None (the sums are dropped now)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        if self.end > pending.observed or pending.force:
            return pending
        self.fix()
        return None

    def forget_after(self, n_tokens: int) -> None:
        """A trim left n_tokens tokens: sums that reach past them cannot be taken apart, so they are forgotten."""
        if self.end > n_tokens:
            self.total, self.count, self.start, self.end = None, 0, n_tokens, n_tokens

    def load(self, total: mx.array | None, n_tokens: int, count: int | None) -> None:
        """Sums read from a file: those of every token it holds (attention saw them all), `count` query vectors
        per kv head (None, a file from before it was written: one per token, which overstates the queries' size
        by the query heads per kv head, so keys err towards more bits)."""
        self.total, self.start, self.end, self.pending = total, 0, (n_tokens if total is not None else 0), None
        self.count = 0 if total is None else n_tokens if count is None else count


def output_errors(queries: mx.array, keys: mx.array, coded: list[mx.array], values: mx.array, n_sinks: int,
                  first: int, window: int, scale: float | None = None, side: str = "keys") -> mx.array:
    """(B, H, len(coded)): per kv head, how far the attention outputs of `queries` (B, n_q_heads, S, D), those of
    positions first .. first + S - 1, move when they read the keys of `coded` (each (B, H, T, D), float32: `keys` with
    the compressed ones as some width codes them) instead of `keys` (B, H, T, D) for the tokens at least `window` + 1
    older than themselves after the n_sinks sinks (what a query reads as codes at decode), as the relative error
    √(Σ_q ‖ô_q − o_q‖² / Σ_q ‖o_q‖²) over the queries of the kv head's query heads. values (B, H, T, Dv); scale: the
    attention's (None: 1/√D). side "values": `coded` are the values so coded (each (B, H, T, Dv)), read instead of
    `values` for those tokens, the keys as given."""
    B, Hq, S, D = queries.shape
    H, T = keys.shape[1], keys.shape[2]
    G = Hq // H
    q = queries.astype(mx.float32).reshape(B, H, G * S, D) * (D**-0.5 if scale is None else scale)
    pos = mx.tile(mx.arange(first, first + S), G)[:, None]
    j = mx.arange(T)[None]
    seen, read_coded = j <= pos, (j >= n_sinks) & (j < pos - window)
    exact = q @ keys.swapaxes(-1, -2)
    o = mx.softmax(mx.where(seen, exact, -mx.inf), axis=-1, precise=True) @ values
    norm = mx.sum(o * o, axis=(2, 3))
    errors = []
    for c in coded:
        if side == "values":  # ô − o = Σ_j p_j (v̂_j − v_j) over the tokens read as codes
            d = (mx.softmax(mx.where(seen, exact, -mx.inf), axis=-1, precise=True) * read_coded) @ (c - values)
        else:
            s = mx.where(read_coded, q @ c.swapaxes(-1, -2), exact)
            d = mx.softmax(mx.where(seen, s, -mx.inf), axis=-1, precise=True) @ values - o
        errors.append(mx.sum(d * d, axis=(2, 3)))
    return mx.sqrt(mx.stack(errors, axis=-1) / mx.maximum(norm, 1e-30)[..., None])


class SpanQueries:
    """The queries of a stream's first window's last third (layout.value_error_span: those the values' error is
    measured on too), held in the stream's float dtype until its first compression chooses the width of its keys or
    values by their output error (output_errors), then dropped; with attention's scale of them."""

    def __init__(self, sinks: int, first_window: int):
        self.first, self.last = value_error_span(sinks, first_window)
        self.reset()

    def reset(self) -> None:
        self.queries: mx.array | None = None  # (B, n_q_heads, last - first, D), rows of positions not seen zero
        self.start = self.end = 0  # the queries of positions [start, end) are held
        self.scale: float | None = None  # attention's scale of them (None: not seen, or 1/√D)

    @property
    def complete(self) -> bool:
        return self.start <= self.first and self.end >= self.last

    def add(self, queries: mx.array, n_tokens: int, dtype: mx.Dtype, scale: float | None = None) -> None:
        """Hold the queries (B, n_q_heads, L, D) attending the last L of n_tokens tokens at the span's positions
        not held yet, which attention scales by `scale`. Graph construction only."""
        B, Hq, L, D = queries.shape
        self.scale = self.scale if scale is None else float(scale)
        lo, hi = unseen(n_tokens, L, self.end, self.first, self.last)
        if hi <= lo:
            return
        if self.queries is None:
            self.queries = mx.zeros((B, Hq, self.last - self.first, D), dtype)
        self.queries[:, :, lo - self.first : hi - self.first] = queries[:, :, lo - (n_tokens - L) : hi - (n_tokens - L)
                                                                        ].astype(dtype)
        if lo > self.end:  # the first held, or a gap before these: coverage starts here
            self.start = lo
        self.end = hi

    def forget_after(self, n_tokens: int) -> None:
        """A trim left n_tokens tokens: the queries past them go."""
        if self.end > n_tokens:
            if n_tokens <= self.start:
                self.reset()
            else:
                self.end = n_tokens

    def load(self, queries: mx.array | None, start: int, end: int) -> None:
        """Queries read from a file, those of positions [start, end)."""
        self.queries, self.start, self.end = queries, (start if queries is not None else 0), (
            end if queries is not None else 0)
