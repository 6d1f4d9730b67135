"""Values by their error (TurboQuantConfig.value_error): how much a layer's attention outputs would move if its old
values were re-coded at fewer bits, measured on its first window, and the bits they decay to (ValueSums).

Layers differ by ten times in what their old values may lose: where attention spreads over many old tokens their
errors average away, where it parks on a few, or the outputs are small next to the values, they do not. The
first window (the calibration tokens, or the window when larger) shows it before any token is old: its last third
of queries (`span` = first_window // 3 of them, 256 at the default calibration) read the window's tokens at least `span` positions older than the first of them, far back and
among many as decayed tokens are read, and the relative error of their outputs,

    √(Σ_q ‖Σ_i p_qi (v̂ᵇ_i − v̂_i)‖² / Σ_q ‖o_q‖²),   the largest over (batch, kv head),

with v̂ the old values as the stream codes them and v̂ᵇ those re-coded at b bits (as decay re-codes them, from
their codes), gives the fewest bits whose error is at most the target. On three models the window's figure ranks
the layers as later queries reading decayed tokens see them (Pearson 0.93-0.95; experiments/HISTORY.md).

Both sums add over queries, so the choice hardly depends on how the prompt is fed (one chunk, chunks, token by
token): the queries read keys and values as the cache holds them when they come, codes or float (old values not
coded yet are coded here as the stream will code them). Attention hands the value stream its queries with the keys'
view (CompressedStream.observe) until every query of the span came; the sums are computed with the attention
output, and the choice reads one value back.
"""

from __future__ import annotations

import mlx.core as mx

from .calibration import calibration_scale, unseen
from .codec import remade
from ..config import value_widths
from ..layout import value_error_span
from .view import StreamView, first_tokens


def _recoded(x: mx.array, quantizer, scale: mx.array) -> mx.array:
    """x (B, H, n, D) coded by `quantizer` as a stream of that scale codes it, and decoded."""
    s = scale[:, :, None, None]
    return quantizer.dequantize(quantizer.quantize(x / s)) * s


class ValueSums:
    """The sums a value stream's choice of decay bits adds up over the queries of its first window's last third."""

    def __init__(self, sinks: int, first_window: int, quantizer, target: float, least: int | None = None):
        self.first, self.last = value_error_span(sinks, first_window)  # the queries' positions
        self.old = (sinks, sinks + first_window - 2 * (first_window // 3))  # the tokens they read far back
        self.quantizer, self.target = quantizer, target
        self.widths = value_widths(quantizer.bits, least)  # the bits the values may decay to
        self.reset()

    def reset(self) -> None:
        """No sums, and no quantizers at the narrower widths (made with the first sums)."""
        # (B, H, widths + 1, span) float32, per query position: Σ ‖error at b bits‖² (b in widths), then Σ ‖o‖², over
        # the query heads of a kv head; per position so that a trim takes out exactly the queries it drops
        self.errors: mx.array | None = None
        self.narrower: dict | None = None  # bits -> the quantizer at those bits
        self.start = self.end = 0  # the queries of positions [start, end) are in `errors`

    @property
    def complete(self) -> bool:
        return self.start <= self.first and self.end >= self.last

    def add(self, queries: mx.array, keys: StreamView, values: StreamView, scale: float, n_tokens: int) -> None:
        """Add the queries (B, n_q_heads, L, D) that attend the last L of n_tokens tokens, at positions of the span
        not added yet, reading the keys and values of these views (no token dropped before them). Graph only."""
        B, Hq, L, D = queries.shape
        lo, hi = unseen(n_tokens, L, self.end, self.first, self.last)
        if hi <= lo or keys.position != keys.n_sinks:  # nothing of the span, or its tokens were dropped
            return
        H = keys.n_heads
        self._make_narrower()
        G, n = Hq // H, hi - lo
        q = queries[:, :, lo - (n_tokens - L) : hi - (n_tokens - L)].astype(mx.float32) * scale
        q = q.reshape(B, H, G * n, D)
        k, v = first_tokens(keys, hi), first_tokens(values, hi)
        pos = mx.tile(mx.arange(lo, hi), G)[:, None]
        s = mx.where(mx.arange(hi)[None] <= pos, q @ k.swapaxes(-1, -2), -mx.inf)
        p = mx.softmax(s, axis=-1, precise=True)
        a, b = self.old
        old, p_old = v[:, :, a:b], p[..., a:b]
        coded = min(max(values.n_sinks + values.n_coded - a, 0), b - a)  # the old tokens the stream coded already
        sc = values.scale if values.scale is not None else calibration_scale(old, None)
        if coded < b - a:
            old = mx.concatenate([old[:, :, :coded], _recoded(old[:, :, coded:], self.quantizer, sc)], axis=2)
        def per_position(x):  # (B, H, G·n, D) -> (B, H, n): summed over query heads and channels
            return mx.sum(mx.square(x).reshape(B, H, G, n, -1), axis=(2, 4))

        sums = [per_position(p_old @ (_recoded(old, qb, sc) - old)) for qb in self.narrower.values()]
        part = mx.stack([*sums, per_position(p @ v)], axis=2)
        part = mx.pad(part, [(0, 0), (0, 0), (0, 0), (lo - self.first, self.last - hi)])
        self.errors = part if self.errors is None else self.errors + part
        if lo > self.end:
            self.start = lo
        self.end = hi

    def choose(self, bits: int) -> int:
        """The fewest bits whose error is at most the target, or `bits` (the values keep theirs): one readback."""
        e = mx.sum(self.errors, axis=-1)
        worst = mx.max(mx.sqrt(e[..., :-1] / mx.maximum(e[..., -1:], 1e-30)), axis=(0, 1)).tolist()
        return next((b for b, w in zip(self.narrower, worst) if w <= self.target), bits)

    def forget_after(self, n_tokens: int) -> None:
        """A trim left n_tokens tokens: the sums of the queries past them go."""
        if self.end > n_tokens:
            if self.errors is not None:
                self.errors = self.errors * (mx.arange(self.first, self.last) < n_tokens)
            self.end = max(n_tokens, self.start)

    def load(self, errors: mx.array, start: int, end: int) -> None:
        """Sums read from a file."""
        self.reset()
        self.errors, self.start, self.end = errors, start, end
        self._make_narrower()

    def _make_narrower(self) -> None:
        if self.narrower is None:
            q = self.quantizer
            self.narrower = {b: remade(q, b) for b in self.widths}
