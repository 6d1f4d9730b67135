"""One side (keys or values) of a layer's KV cache as a compressed stream of tokens, in the token order of
tq_mlx.stream.view (sinks, decayed codes, fresh codes, the window).

Names: n_<part> counts the tokens a part holds now (n_coded = n_decayed + n_fresh, on a stream and a view
alike); max_sinks and max_window are the most the sinks and the window hold (the config's `sinks` and
`window`); `sinks`, `window`, `codes` and `decayed` are the buffers.

New tokens go to the sinks until those are full, then to the window. When the window would overflow, its
oldest tokens are compressed in whole blocks of `compress_block` tokens (so the window keeps between
window - compress_block + 1 and window tokens). Compressed tokens exist only as codes: no float copy of them
is kept anywhere, and `nbytes` is the sum of every array the stream holds.

Temporal decay (`decay` = (age, quantizer)): once the fresh codes and the window hold more than `age` tokens,
the oldest fresh codes are re-coded with the decay quantizer in their rotated basis (recode), in whole compress
blocks, so that at most `age` tokens remain at the stream's own bits or in float. Both quantizers have the same
channel groups (one, or two for keys widened by a half step) and seed, so their codes share a rotated basis:
attention rotates the query once for both, and the values of both accumulate in one basis. Re-coding works in the quantizer's basis (mean, scale and channel order untouched), and
a token is re-coded exactly once, so the result does not depend on how the tokens were fed. Once tokens decay,
the fresh code buffer is allocated for the most fresh tokens there can be (`fresh_bound`) and the oldest are
shifted out in place; decayed codes grow in steps like fresh ones.

Calibration (tq_mlx.stream.calibration): the first compression fixes, from the calibration tokens, μ (with `center`;
turboquant.md §4), the scale, the channel order of fractional bit widths (paper §4.3) and the query weights
(`weigh`), and compressed token t is coded as ((x_t - c_t)·w / scale)[..., perm]. With a `rope` (keys centered
before RoPE, tq_mlx.models.rope) μ0 is the mean of those tokens turned back by their RoPE and c_t = R(p) μ0 at the
token's position p = sinks + tokens a bound dropped + t, so a constant part of the keys before RoPE (Qwen2's
k_proj bias) leaves the codes instead of rotating through them; otherwise c_t = μ. With a window, the
calibration tokens are exactly the first `calibration` tokens after the sinks (the window's, or the config's
calibration_tokens when more: the window holds them in float until the first compression, which then leaves it
its own size), all at hand at the first compression, so it does not depend on how the prompt was fed (one shot,
chunks, token by token, or trimmed).
Query weights need the queries of those tokens: the cache's learning step hands them over (`observe`, from
TurboQuantKVCache.learn, before attention reads the views), and a first compression
coded before they came is coded again when they do (`_settle`, before anything attends the codes); the view
update_and_fetch returns is then superseded by the one attention reads.

`append` returns a `StreamView` (tq_mlx.stream.view, with the reference `encode` and `decode` of its codes),
the immutable view of the live tokens that attention reads. tq_mlx.stream.codec writes and reads its state (the
arrays a cache saves); tq_mlx.layout counts its parts and their bytes (stream_bytes).
"""

from __future__ import annotations

import copy
from typing import Callable, NamedTuple

import numpy as np

import mlx.core as mx

from .calibration import (QuerySums, SpanQueries, calibrate, has_channel_order, key_width, needs_protection,
                          output_errors)
from .codec import (STATE_PARTS, BatchHeads, Counts, StreamState, appended, batch_heads_of, check_state, make_quantizer, remade,
                    moved, quantizer_as_written, read_state, state_arrays)
from ..layout import decayed_split, decode_runs, fresh_bound, overflow, window_capacity
from ..plan import StreamPlan
from ..quant.quantizer import MSECodes, ProdCodes, TurboQuantMSE, TurboQuantProd, constant_arrays
from ..models.rope import Rope, centers
from .values import ValueSums
from .view import Recent, StreamView, decode, encode, first_tokens, recode



class Decay(NamedTuple):
    """Temporal decay: fresh codes older than `age` tokens are re-coded with `quantizer`."""

    age: int
    quantizer: TurboQuantMSE


HELD_BY_SUMS = ("queries", "errors", "span")  # state parts the query sums, value sums and span queries hold


# --- the stream --------------------------------------------------------------------------------------------


class CompressedStream:
    """One side of a layer's cache: float sinks, TurboQuant codes, a float window (see the module docstring).

    It does what its plan (tq_mlx.plan.StreamPlan, of the layer's LayerPlan) says, for heads of `dim` channels;
    `rope` is the layer's RoPE where the plan centers keys before it. The sinks and the window keep the dtype of
    the tokens appended (the model's, as mlx-lm's KVCache does), so they overflow exactly when the model does.
    The plan's name ("k" or "v") prefixes the stream's arrays in a cache's state and in error messages.
    `encoder` has `encode`'s signature and `recoder` `recode`'s (codes, their quantizer, the decay quantizer); the
    cache passes the kernel dispatch (tq_mlx.attention.dispatch_encode, dispatch_recode).

    protect (plan.Protect): deciding reads one number back from the device, once per stream and sequence, at its
    first compression; every later append is graph construction. decay (Decay): temporal decay (the module
    docstring). A protected stream does not decay: what made it protect its keys holds at every age. widen
    (plan.Widen): with query weights, the first compression also chooses the keys' width from their logit error on
    the calibration queries (one more number read back, once the queries came); a widened stream decays by
    the same step (K6 -> K5 where K4 -> K3). With an output target (widen.output) a stream of either side holds the
    queries of its first window's last third and chooses its width by the attention-output error they read,
    with the other side's view (observe). narrow (target, age): values by their error (tq_mlx.stream.values): the
    stream decays its tokens older than `age` to the bits it chooses once attention handed it the queries of its
    first window's last third (observe, with the keys' view; one number read back), and until then keeps its bits.
    """

    def __init__(self, plan: StreamPlan, dim: int, *, encoder: Callable = encode, recoder: Callable = recode,
                 rope: Rope | None = None):
        self.plan = plan
        quantizer = make_quantizer(int(dim), plan.bits, plan.qjl, plan.seed, plan.norm_dtype, plan.correct_norms,
                                   plan.trellis)
        decay = None if plan.decay is None else Decay(plan.decay[0], make_quantizer(
            int(dim), plan.decay[1], False, plan.seed, plan.norm_dtype, plan.correct_norms, plan.trellis))
        name = plan.name
        if decay is not None and (has_channel_order(quantizer) or has_channel_order(decay.quantizer)
                                  or isinstance(quantizer, TurboQuantProd)):
            raise ValueError(f"stream {name}: decay needs one-group MSE quantizers of one dim and seed")
        self.quantizer, self.name, self.encoder, self.recoder = quantizer, name, encoder, recoder
        self.decay = self.base_decay = decay  # decay: that of the width the stream codes at (widen)
        self.decayed = None  # MSECodes buffers (B, H, capacity, ...) of the decay quantizer
        self.base_quantizer, self.protect, self.widen = quantizer, plan.protect, plan.widen
        self._protected = False
        # the most tokens the sinks and the window hold (the config's sinks and window; self.sinks and
        # self.window are their buffers)
        self.max_sinks, self.max_window, self.compress_block, self.step, self.center = (
            plan.sinks, plan.window, plan.compress_block, plan.step, plan.center)
        self.calibration = plan.calibration  # tokens after the sinks the first compression waits for, calibrating
        self.as_decode = plan.as_decode  # an update's views read as its queries would at decode (views_by_run)
        self.n_sinks = self.n_decayed = self.n_fresh = self.n_window = 0  # tokens held, part by part
        self.codes = None  # MSECodes / ProdCodes buffers (B, H, capacity, ...)
        self.sinks = None  # (B, H, max_sinks, D) the tokens' float dtype
        self.window = None  # (B, H, window capacity, D) the tokens' float dtype
        self.mean = None  # (B, H, D) float32, with the first compressed tokens (if center)
        self.perm = None  # (H, D) int32, with the first compressed tokens (fractional bits)
        self.scale = None  # (B, H) float32 power of two, with the first compressed tokens
        self.rope = rope if plan.center else None  # center before RoPE (tq_mlx.models.rope): mean is then μ0
        self.n_dropped = 0  # compressed tokens a bound dropped: positions continue past them
        # Query-aware weights (tq_mlx.stream.calibration): the queries of the calibration tokens, summed per channel as
        # attention shows them (observe), fix `weights` with the first compression.
        self.weigh = plan.weigh
        self.weights = None  # (B, H, D) float32, with the first compressed tokens (weigh)
        self.query_sums = QuerySums()
        # keys by their output error: the queries of the first window's last third, held until the width is chosen
        self.span = SpanQueries(plan.sinks, plan.calibration) if plan.widen is not None and plan.widen.output else None
        # values by their error: the decay's age, the bits chosen (None: not yet) and the sums they come from
        self.narrow_age, self.value_width, self.value_sums = None, None, None
        if plan.narrow is not None and plan.window:
            self.narrow_age = plan.narrow.age
            self.value_sums = ValueSums(plan.sinks, plan.calibration, quantizer, plan.narrow.target, plan.narrow.least)

    @property
    def dim(self) -> int:
        return self.quantizer.dim

    @property
    def n_coded(self) -> int:
        """Every compressed token: decayed and fresh."""
        return self.n_decayed + self.n_fresh

    @property
    def n_tokens(self) -> int:
        return self.n_sinks + self.n_coded + self.n_window

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
        """Store tokens x (B, H, L, D) and return the view of every live token (with `recent`, as_decode: the
        float tokens some of its queries read instead of codes). Pure graph construction: every branch depends on
        token counts, never on array values."""
        self._settle()
        B, H, L, D = x.shape
        t = 0
        if self.n_sinks < self.max_sinks:
            t = min(self.max_sinks - self.n_sinks, L)
            if self.sinks is None:
                self.sinks = mx.zeros((B, H, self.max_sinks, D), self._float_dtype(x))
            self.sinks[:, :, self.n_sinks : self.n_sinks + t] = x[:, :, :t].astype(self.sinks.dtype)
            self.n_sinks += t
            x = x[:, :, t:]
        if not x.shape[2]:
            return self.view()
        coded, held, first = self.n_coded, self.n_window, self._first
        recent = self._append_recent(x)
        if not self.as_decode or self.n_coded == coded:
            return self.view()
        # Queries that a token-by-token cache would show fewer compressed tokens read the rest in float: the
        # window before this update and the update's own tokens, in this update's views only (never held).
        runs = [(0, coded)] * bool(t) + [(t + row, coded + c) for row, c in decode_runs(
            held, x.shape[2], self.max_window, self.compress_block, first)]
        runs = tuple(r for i, r in enumerate(runs) if i == 0 or r[1] != runs[i - 1][1])
        if runs == ((0, self.n_coded),):  # every query reads what the stream holds (a decode step)
            return self.view()
        return self.view()._replace(recent=Recent(recent.astype(self._float_dtype(x)), coded, runs, t + x.shape[2]))

    def _append_recent(self, x: mx.array) -> mx.array | None:
        """Put tokens x after the window, compressing its overflow; returns, when it compressed, the float tokens
        from the first it compressed on (the window's, then x), else None."""
        W, first = self.max_window, self._first
        total = self.n_window + x.shape[2]
        cap = window_capacity(total, W, first)
        if cap and (self.window is None or self.window.shape[2] < cap):
            grown = mx.zeros((*x.shape[:2], cap, x.shape[3]), self._float_dtype(x))
            if self.n_window:
                grown[:, :, : self.n_window] = self.window[:, :, : self.n_window]
            self.window = grown
        n_c = overflow(total, W, self.compress_block, first)
        if n_c == 0:
            self.window[:, :, self.n_window : total] = x.astype(self.window.dtype)
            self.n_window = total
            self._decay_fresh()  # ages grow with every token
            return None
        if self.n_window:
            x = mx.concatenate([self.window[:, :, : self.n_window].astype(mx.float32), x.astype(mx.float32)], axis=2)
        self._compress(x, n_c, window_after=total - n_c)
        self.n_window = total - n_c
        if self.window is not None and self.window.shape[2] > W:  # held the calibration tokens: the window's size now
            self.window = mx.zeros((*x.shape[:2], W, x.shape[3]), self.window.dtype) if W else None
        if self.n_window:
            self.window[:, :, : self.n_window] = x[:, :, n_c:].astype(self.window.dtype)
        return x

    def _compress(self, x: mx.array, n: int, window_after: int = 0, final: bool = False,
                  other: StreamView | None = None) -> None:
        """Compress the first n tokens of x (the window's tokens, then the new ones), window_after tokens
        staying in the window; then decay what is old enough. other: the other side's view, which keys (values) by
        their output error read at their first compression (from the learning step: observe)."""
        x = x.astype(mx.float32)
        if self.scale is None:  # calibrate on the first tokens after the sinks (a bound's drops keep it)
            # With a window, the first compression sees at least `window + 1` tokens after the sinks, however
            # the prompt is fed: calibrating on the first `window` gives the most tokens independent of feeding.
            calib = x[:, :, : self.calibration] if self.calibration else x
            sums = self.query_sums
            # protection: one value read back; a settle keeps the first compression's decision
            if not final and self.protect is not None and self.protect.bits > self.base_quantizer.bits:
                self.set_protected(needs_protection(calib, self.protect.factor,
                                                    self.rope if self.protect.before_rope else None, self._position(0)))
            by_output = self.span is not None and not self.protected
            if not final and (by_output or self.weigh and not sums.covers(self.n_sinks, calib.shape[2])):
                # the queries of some calibration tokens come with this chunk's attention (or, by their output
                # error, the other side they are read with): code now, and again with them when attention hands them
                # over (observe), before anything reads these codes
                sums.wait(x, n, window_after, force=by_output)
            halves = self.widen is not None and self.widen.step != 1 and not self.protected
            cal = calibrate(calib, self.quantizer, center=self.center, rope=self.rope, position=self._position(0),
                            queries=sums.total if self.weigh else None, query_count=sums.count,
                            query_scale=sums.scale, split=halves)
            self.mean, self.perm, self.scale, self.weights = cal.mean, cal.perm, cal.scale, cal.weights
            if self.widen is not None and not self.protected:
                # the width: one value read back once the queries came (a first compression that waits for
                # them codes at the configured bits and is coded again at the chosen ones when they come)
                bits = self.base_quantizer.bits
                if by_output:
                    if sums.pending is None and other is not None and self.span.complete:
                        bits = self._output_width(calib, cal, other)
                elif sums.pending is None and cal.error is not None:
                    errors = np.array(cal.error if cal.split is None else mx.concatenate(
                        [cal.error[..., None], cal.split], axis=-1))  # every kv head's, read back at once
                    split = None if cal.split is None else errors[..., 1:]
                    bits = key_width(errors if split is None else errors[..., 0], self.widen.widths(bits),
                                     self.widen.target, self.dim, split)
                self.set_bits(bits)
                if not has_channel_order(self.quantizer):
                    self.perm = None  # a whole width: one group, no channel order
            if sums.pending is None:
                sums.fix()  # the weights are fixed
                if self.span is not None:
                    self.span.reset()  # and the width chosen
        new, mean = self._quantizer_input(x[:, :, :n], self._position(self.n_coded), self.mean, self.weights)
        new = self.encoder(new, self.quantizer, mean, self.perm, self.scale)
        d = decayed_split(self.n_fresh + n, window_after, self.decay.age if self.decaying else None,
                          self.compress_block)
        if d > self.n_fresh:  # new codes that decay at once never enter the fresh buffer (a long prefill)
            k = d - self.n_fresh
            self._decay_fresh(self.n_fresh)
            self._append_decayed(type(new)(*(a[:, :, :k] for a in new)))
            new, n = type(new)(*(a[:, :, k:] for a in new)), n - k
        else:
            self._decay_fresh(d)
        if n == 0:
            return
        self.codes = appended(self.codes, self.n_fresh, new, self.step, self._fresh_capacity())
        self.n_fresh += n

    @property
    def wants_queries(self) -> bool:
        """Whether the cache's learning step should hand this stream its queries (observe): weights or a width by
        the output error not fixed yet, or the values' decay bits not chosen yet."""
        return ((self.weigh or self.span is not None) and (self.query_sums.pending is not None or self.scale is None)
                or self.value_sums is not None and self.value_width is None)

    def observe(self, queries: mx.array, scale: float | None = None, keys: StreamView | None = None,
                values: StreamView | None = None) -> StreamView:
        """Take the queries (B, n_q_heads, L, D) that attend this stream's last L tokens, adding the squares of
        those at calibration positions (the first `window` after the sinks) to the query sums; then finish a
        first compression that waited for them (by their output error, with the other side's view: `values` for
        keys, `keys` for values). A value stream choosing its decay bits (narrow) takes them with
        the keys' view they read, and chooses once the last of its window's came (one value read back).
        Returns the view to attend; otherwise graph construction only."""
        if self.value_sums is not None and self.value_width is None and keys is not None:
            self.value_sums.add(queries, keys, self.view(), queries.shape[3] ** -0.5 if scale is None else scale,
                                self.n_tokens)
            if self.value_sums.complete:  # tokens already old enough decay now, as in a stream fed one by one
                self.set_value_width(self.value_sums.choose(int(self.quantizer.bits)))
                self._decay_fresh()
        if self.weigh and queries.shape[3] == self.dim:
            bh = self.batch_heads()
            end = self.max_sinks + self.calibration if self.calibration else self.n_tokens
            self.query_sums.add(queries, self.n_tokens, self.max_sinks, end, bh and bh.heads, scale)
        if self.span is not None:
            self.span.add(queries, self.n_tokens, self._float_dtype(queries), scale)
        self._settle(keys if values is None else values)
        view = self.view()
        sums = [a for a in (self.query_sums.total, self.value_sums and self.value_sums.errors,
                            self.span and self.span.queries) if a is not None]
        if sums:
            # Still calibrating or choosing, so the window holds tokens: the float tokens attention reads carry the
            # sums, which are then computed with the output, on the thread that attends. Left out of the graph
            # they would hold every step's queries (and keys) until they are used, and a save from another thread
            # (tq-chat's /save) could not evaluate them.
            part = "window" if view.window is not None else "sinks"
            if getattr(view, part) is not None:
                view = view._replace(**{part: mx.depends(getattr(view, part), sums)})
        return view

    def _settle(self, other: StreamView | None = None) -> None:
        """Finish a first compression that waited for queries: code it again (the same tokens) if queries came
        since (or, by their output error, with the other side's view `other`: without it, at the configured
        bits); the weights are then fixed and the summed queries dropped."""
        redo = self.query_sums.settle()
        if redo is not None:
            self.codes = self.decayed = self.mean = self.perm = self.scale = self.weights = None
            self.n_fresh = self.n_decayed = 0
            # the same tokens: the same protection
            self._compress(redo.x, redo.n, redo.window_after, final=True, other=other)

    def _quantizer_input(self, x: mx.array, position: int, mean: mx.array | None, weights: mx.array | None):
        """(tokens x at positions position .. as the encoder takes them, the mean it subtracts): with the rope
        centered by R(p) μ0 (no mean left), times the weights (the token and its center alike: (x - c)·w)."""
        if self.rope is not None:
            x, mean = x - centers(mean, self.rope, position, x.shape[2]), None
        if weights is not None:
            x = x * weights[:, :, None, :]
            mean = None if mean is None else mean * weights
        return x, mean

    def _output_width(self, calib: mx.array, cal, other: StreamView) -> float:
        """The fewest bits of the widths this stream may take whose output error (calibration.output_errors) on
        the held queries is at most the target in every (batch, kv head): the calibration tokens coded at each width
        as this stream codes them, read with the other side's first tokens (keys: the values' as they are held;
        values: the keys'). One value read back."""
        span, n_s = self.span, self.n_sinks
        widths = self.widen.widths(self.base_quantizer.bits)
        position = self._position(0)
        x, mean = self._quantizer_input(calib, position, cal.mean, cal.weights)
        coded = []
        for b in widths:
            q = remade(self.base_quantizer, b)
            perm = cal.perm if has_channel_order(q) else None
            view = StreamView(q, encode(x, q, mean, perm, cal.scale), None, None, cal.mean, perm, cal.scale,
                              rope=self.rope, position=position, weights=cal.weights)
            coded.append(decode(view, mx.float32))
        sinks = [] if not n_s else [self.sinks[:, :, :n_s].astype(mx.float32)]
        mine = mx.concatenate([*sinks, calib], axis=2)[:, :, : span.last]
        coded = [mx.concatenate([*sinks, c], axis=2)[:, :, : span.last] for c in coded]
        theirs = first_tokens(other, span.last)
        keys, values = (mine, theirs) if self.name == "k" else (theirs, mine)
        errors = output_errors(span.queries, keys, coded, values, n_s, span.first, self.max_window, span.scale,
                               side="keys" if self.name == "k" else "values")
        worst = np.asarray(mx.max(errors, axis=(0, 1)))  # every width's, read back at once
        return next((b for b, e in zip(widths, worst) if e <= self.widen.target), widths[-1])

    @property
    def _first(self) -> int:
        """The tokens the window holds before a compression: the calibration's until the first calibrates, else 0
        (the window's). A bound's drops keep the calibration; a trim to no compressed token drops it."""
        return self.calibration if self.scale is None else 0

    def _position(self, t: int) -> int:
        """The position of compressed token t (decayed ones first): sinks and dropped tokens come before."""
        return self.n_sinks + self.n_dropped + t

    def _fresh_capacity(self) -> int | None:
        """The fresh buffer's capacity once tokens decayed: room for the most fresh codes there can be, so it
        is allocated once and its size is a function of the config (tq_mlx.planner.memory); None before."""
        if not self.n_decayed:
            return None
        return -(-fresh_bound(self.decay.age, self.max_window, self.compress_block) // self.step) * self.step

    def _decay_fresh(self, n: int | None = None) -> None:
        """Re-code the n oldest fresh codes (None: as many as their age calls for) at the decay bits."""
        if n is None:
            n = decayed_split(self.n_fresh, self.n_window, self.decay.age if self.decaying else None,
                              self.compress_block)
        if n <= 0:
            return
        self._append_decayed(type(self.codes)(*(a[:, :, :n] for a in self.codes)))
        # the kept codes move to the front of a buffer of the bound's size (no slice keeps the old one alive)
        self.codes = self._dropped(self.codes, self.n_fresh, n, 0, self._fresh_capacity())
        self.n_fresh -= n

    def _append_decayed(self, codes) -> None:
        """Re-code fresh codes with the decay quantizer (in the quantizer's basis: mean, scale and channel
        order stay as they are) and append them to the decayed codes."""
        new = self.recoder(codes, self.quantizer, self.decay.quantizer)
        self.decayed = appended(self.decayed, self.n_decayed, new, self.step)
        self.n_decayed += new[0].shape[2]

    def drop_oldest(self, n: int, room: int) -> None:
        """Drop the n oldest compressed tokens (a bounded cache), decayed ones first. The rest of a buffer
        dropped from move to a new one with room for `room` more tokens (capacity a multiple of step; a decaying
        stream's fresh buffer keeps its bound's size), so no slice of the old buffer keeps it alive. The
        calibration stays: the tokens kept were quantized with it."""
        self._settle()
        self.n_dropped += min(n, self.n_coded)
        d = min(n, self.n_decayed)
        if d > 0:
            self.decayed, self.n_decayed = self._dropped(self.decayed, self.n_decayed, d, room), self.n_decayed - d
        n = min(n - d, self.n_fresh)
        if n > 0:
            self.codes, self.n_fresh = self._dropped(self.codes, self.n_fresh, n, room,
                                                     self._fresh_capacity()), self.n_fresh - n

    def _dropped(self, buf, held: int, n: int, room: int, capacity: int | None = None):
        return moved(buf, n, held, capacity or -(-(held - n + room) // self.step) * self.step)

    @property
    def protected(self) -> bool:
        return self._protected

    @property
    def width_chosen(self) -> bool:
        """Whether a stream that chooses its width by its error (widen) chose it: its first compression settled."""
        return self.widen is not None and self.scale is not None and self.query_sums.pending is None

    @property
    def widened(self) -> bool:
        """Whether the keys chose more bits than configured (widen), the protection's aside."""
        return not self._protected and self.quantizer.bits != self.base_quantizer.bits

    def set_protected(self, protected: bool) -> None:
        """Quantize at the protection bits (plain MSE codes, same seed), or at the configured quantizer."""
        q = self.base_quantizer
        self._protected = protected
        self.quantizer = remade(q, self.protect.bits) if protected else q
        self.decay = self.base_decay

    def set_bits(self, bits: float) -> None:
        """Code at `bits` (widen's choice: plain MSE codes, same seed), decaying by the configured step."""
        q, d = self.base_quantizer, self.base_decay
        self._protected = False
        if bits == q.bits:
            self.quantizer, self.decay = q, d
            return
        self.quantizer = remade(q, bits)
        if d is not None:
            self.decay = Decay(d.age, remade(d.quantizer, self.plan.decay_at(bits)))

    @property
    def span_seen(self) -> tuple[int, int]:
        """The positions [start, end) whose queries a stream by its output error holds while its width is not chosen."""
        sp = self.span
        return (0, 0) if sp is None or sp.queries is None else (sp.start, sp.end)

    @property
    def value_seen(self) -> tuple[int, int]:
        """The positions [start, end) whose queries the value sums hold while the decay bits are not chosen."""
        vs = self.value_sums
        return (0, 0) if vs is None or self.value_width is not None else (vs.start, vs.end)

    def set_value_width(self, bits: int | None) -> None:
        """Decay old tokens to `bits` (narrow's choice; the stream's own bits: no decay; None: not chosen yet)."""
        self.value_width, q = bits, self.quantizer
        narrower = bits is not None and bits < q.bits
        self.decay = self.base_decay = Decay(self.narrow_age, remade(q, bits)) if narrower else None
        if bits is not None:
            self.value_sums.reset()  # the choice is made: the sums are dropped

    def view(self) -> StreamView:
        s, f, w, d = self.n_sinks, self.n_fresh, self.n_window, self.n_decayed
        decayed = None
        if d:
            decayed = StreamView(self.decay.quantizer, type(self.decayed)(*(a[:, :, :d] for a in self.decayed)),
                                 None, None, self.mean, self.perm, self.scale, rope=self.rope, position=self._position(0),
                                 weights=self.weights)
        return StreamView(
            quantizer=self.quantizer,
            codes=type(self.codes)(*(a[:, :, :f] for a in self.codes)) if f else None,
            sinks=self.sinks[:, :, :s] if s else None,
            window=self.window[:, :, :w] if w else None,
            mean=self.mean,
            perm=self.perm,
            scale=self.scale,
            decayed=decayed,
            rope=self.rope,
            position=self._position(0),
            weights=self.weights,
        )

    def trim(self, n: int) -> None:
        """Drop the last n tokens (at most n_tokens): window first, then fresh codes, decayed codes, sinks.
        Decayed tokens that remain keep their decayed codes (their fresh codes are gone). A trim that leaves no
        compressed token drops the calibration, so the next tokens compressed calibrate again exactly as in a
        fresh stream fed the same tokens. Queries summed for the weights cannot be taken out again: a trim
        below the last one observed forgets them, and the weights then come from the queries seen after it."""
        self._settle()
        for part in ("n_window", "n_fresh", "n_decayed", "n_sinks"):
            d = min(getattr(self, part), n)
            setattr(self, part, getattr(self, part) - d)
            n -= d
        if self.value_sums is not None and (self.n_coded == 0 or self.value_width is None):
            self.value_sums.forget_after(self.n_tokens)
            if self.n_coded == 0:
                self.set_value_width(None)
        if self.n_coded == 0:
            self.mean = self.perm = self.scale = self.weights = None
            self.codes = self.decayed = None  # their width may change with the next calibration
            self.quantizer, self.decay, self._protected = self.base_quantizer, self.base_decay, False
            self.query_sums.forget_after(self.n_tokens)
            if self.span is not None:
                self.span.forget_after(self.n_tokens)

    def batch_heads(self) -> BatchHeads | None:
        """(batch, kv heads) of the stored arrays, None before the first tokens."""
        return batch_heads_of(self.sinks, self.window, self.mean, self.codes)  # every update: no state dict

    def _parts(self) -> StreamState:
        return StreamState(self.codes, self.sinks, self.window, self.mean, self.perm, self.scale, self.decayed,
                           self.rope, self.weights, self.query_sums.total,
                           None if self.value_sums is None else self.value_sums.errors,
                           None if self.span is None else self.span.queries)

    def held_arrays(self) -> list[mx.array]:
        """Every array this stream holds, each once: buffers at full capacity, μ, channel order, quantizer constants
        (its quantizers may share codebooks and tables)."""
        p = self._parts()
        parts = [*(p.codes or ()), *(p.decayed or ()), *(p.rope or ()), p.sinks, p.window, p.mean, p.perm, p.scale,
                 p.weights, p.queries, p.errors, p.span]
        quantizers = (self.quantizer,) + ((self.base_quantizer,) if self.quantizer is not self.base_quantizer else ())
        if self.decay is not None:  # a widened stream keeps the configured decay quantizer too
            quantizers += tuple(dict.fromkeys((self.decay.quantizer, self.base_decay.quantizer)))
        if self.value_sums is not None and self.value_sums.narrower:  # choosing the values' decay bits
            quantizers += tuple(self.value_sums.narrower.values())
        held = [a for a in parts if a is not None] + [a for q in quantizers for a in constant_arrays(q)]
        return list({id(a): a for a in held}.values())

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
            if name not in HELD_BY_SUMS:
                setattr(new, name, copy.deepcopy(getattr(self, name), memo))
        new.query_sums = copy.deepcopy(self.query_sums, memo)
        new.span = copy.deepcopy(self.span, memo)  # its queries are written in place
        new.value_sums = copy.copy(self.value_sums)  # its sums are replaced, never written in place
        return new

    # --- state: the arrays under "<name>_codes", "<name>_sinks", ... (tq_mlx.stream.codec; the counts are the cache's)

    @property
    def state(self) -> dict:
        self._settle()
        return state_arrays(self.name, self._parts())

    def load_state(self, arrays: dict, n_sinks: int, n_fresh: int, n_window: int, bh: BatchHeads | None,
                   n_decayed: int = 0, n_dropped: int = 0, query_count: int | None = None,
                   value_seen: tuple[int, int] = (0, 0), span_seen: tuple[int, int] = (0, 0)) -> None:
        """Take the arrays of `state` and the token counts, checking every shape and dtype against them and
        this stream's settings (a corrupted file raises ValueError naming the array, nothing else happens).
        value_seen: the positions [start, end) whose queries the value sums (narrow, not chosen yet) hold; span_seen:
        those whose queries keys by their output error hold (not chosen yet)."""
        parts = read_state(arrays, self.name, ProdCodes if isinstance(self.quantizer, TurboQuantProd) else MSECodes)
        quantizer = quantizer_as_written(self.quantizer, parts.codes)
        check_state(parts, Counts(n_sinks, n_fresh, n_window, n_decayed), bh, name=self.name, quantizer=quantizer,
                    decay_quantizer=self.decay and self.decay.quantizer, center=self.center,
                    channel_order=has_channel_order(quantizer), max_sinks=self.max_sinks,
                    max_window=self.max_window if parts.scale is not None else self.calibration)
        if self.base_quantizer is self.quantizer:
            self.base_quantizer = quantizer
        self.quantizer = quantizer
        # every part is the file's; its RoPE is what its codes were centered with, whatever the model at hand says
        for name, a in zip(STATE_PARTS, parts):
            if name not in HELD_BY_SUMS:
                setattr(self, name, a)
        self.n_sinks, self.n_fresh, self.n_window, self.n_decayed = n_sinks, n_fresh, n_window, n_decayed
        self.n_dropped = n_dropped
        if parts.errors is not None:
            vs = self.value_sums
            if vs is None or self.value_width is not None or parts.errors.shape[2:] != (len(vs.widths) + 1,
                                                                                         vs.last - vs.first):
                raise ValueError(f"{self.name}_errors: value sums, but this stream does not choose its decay bits or "
                                 f"holds {() if vs is None else (len(vs.widths) + 1, vs.last - vs.first)} sums per kv "
                                 f"head, got {parts.errors.shape[2:]}")
            vs.load(parts.errors, *value_seen)
        if parts.span is not None:
            sp = self.span
            if sp is None or parts.span.shape[2] != sp.last - sp.first:
                raise ValueError(f"{self.name}_span: held queries, but this stream does not choose its width by its "
                                 f"output error or holds {None if sp is None else sp.last - sp.first} positions, got "
                                 f"{parts.span.shape[2]}")
            sp.load(parts.span, *span_seen)
        elif self.span is not None:
            self.span.reset()
        # queries summed before the file was written are those of every token it holds (attention saw them all)
        self.query_sums.load(parts.queries, self.n_tokens, query_count)
        if not self.weigh:
            self.query_sums.fix()
