"""What attention reads of a stream: StreamView (the immutable view of its live tokens, in the token order below),
and the reference encode, recode and decode of its codes in MLX (the Metal kernels' twins).

Token order in a stream, and the order of the attention mask's columns:

    [0, n_sinks)                          attention sinks: the first `sinks` tokens, in the model's dtype
    [n_sinks, n_sinks + n_decayed)        decayed codes: older compressed tokens re-coded at fewer bits
    [.., n_sinks + n_coded)               fresh codes: TurboQuant codes (packed uint32) and their norms
    [n_sinks + n_coded, n_tokens)         the recent-token window, in the model's dtype
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import mlx.core as mx

from ..quant.quantizer import MSECodes, ProdCodes, TurboQuantMSE, TurboQuantProd
from ..models.rope import Rope, centers


class Segment(NamedTuple):
    """A codes-only view with one quantizer, and the position of its first token among the compressed ones."""

    start: int
    view: "StreamView"


class Recent(NamedTuple):
    """What a prefill's queries read as a decode step would (config.prefill_as_decode): the float tokens from
    compressed token `first` on (the window before the update, then the update's own), and per run of the update's
    queries that a token-by-token cache would show the same compressed tokens, (its first query row, those
    compressed tokens). Carried by the views of one update only, never held by a stream (views_by_run)."""

    tokens: mx.array  # (B, H, n, D) the model's float dtype
    first: int
    runs: tuple[tuple[int, int], ...]
    queries: int  # the update's tokens: the queries that read these views, one per token


class StreamView(NamedTuple):
    """The live tokens of one stream, as attention reads them (update_and_fetch returns one per side).

    Arrays are views of the stream's buffers cut to the live tokens; None means that part holds no tokens.
    """

    quantizer: TurboQuantMSE | TurboQuantProd
    codes: MSECodes | ProdCodes | None  # (B, H, n_fresh, ...) in the quantizer's input basis
    sinks: mx.array | None  # (B, H, n_sinks, D) the model's float dtype, model basis
    window: mx.array | None  # (B, H, n_window, D) the model's float dtype, model basis
    mean: mx.array | None  # (B, H, D) float32: subtracted from every compressed token before quantizing
    perm: mx.array | None  # (H, D) int32: compressed token t was quantized as (x_t - mean)[..., perm]
    scale: mx.array | None = None  # (B, H) float32, a power of two: ... and divided by scale (None: 1)
    # The older compressed tokens, re-coded at fewer bits (temporal decay): a codes-only view (no sinks or
    # window; the same mean and scale; its quantizer shares the fresh codes' rotation). They come before `codes`.
    decayed: "StreamView | None" = None
    # Pre-RoPE centering (tq_mlx.models.rope): `mean` is μ0, and the token at position p had R(p) μ0 subtracted.
    rope: Rope | None = None
    position: int = 0  # the position of the first compressed token of this view (decayed ones first)
    # Query-aware key weights (B, H, D) float32: compressed token t holds (x_t - c_t)·w / scale (None: 1).
    weights: mx.array | None = None
    # Set on a key view while its cache still wants the queries attending it (key weights and widths, value
    # widths): the cache's learning step, TurboQuantKVCache.learn(queries, keys, values, scale) -> the views to
    # attend, called once per forward before attention (tq_mlx.batch.learned); attention only reads views.
    learn: Callable | None = None
    # Set on the views of an update whose chunk compressed tokens its queries would read in float at decode
    # (config.prefill_as_decode): attention reads the view run by run (views_by_run).
    recent: Recent | None = None

    @property
    def n_sinks(self) -> int:
        return 0 if self.sinks is None else self.sinks.shape[2]

    @property
    def n_decayed(self) -> int:
        return 0 if self.decayed is None else self.decayed.n_fresh

    @property
    def n_fresh(self) -> int:
        """Compressed tokens at the stream's own bits (`codes`)."""
        return 0 if self.codes is None else self.codes.codes.shape[2]

    @property
    def n_coded(self) -> int:
        """Every compressed token: decayed and fresh."""
        return self.n_decayed + self.n_fresh

    @property
    def dtype(self) -> mx.Dtype:
        """The model's float dtype, as its sinks and window hold it (float32, the codes' attention, without them),
        so model files that read `values.dtype` or cast what they fetch (stablelm, phi) keep the view."""
        held = self.sinks if self.sinks is not None else self.window
        return mx.float32 if held is None else held.dtype

    def astype(self, dtype: mx.Dtype) -> "StreamView":
        """The view itself: attention on the codes computes in float32 whatever a model casts its keys to."""
        return self

    def segments(self) -> list[Segment]:
        """The compressed tokens as codes-only views with one quantizer each, oldest first:
        [(0, decayed), (n_decayed, fresh)], without empty ones."""
        parts = []
        if self.decayed is not None:
            parts.append(Segment(0, self.decayed))
        if self.codes is not None:
            parts.append(Segment(self.n_decayed, self._replace(sinks=None, window=None, decayed=None,
                                                               position=self.position + self.n_decayed)))
        return parts

    def centers(self, first: int = 0, n: int | None = None) -> mx.array | None:
        """What was subtracted from compressed tokens first .. first + n - 1 of this view before quantizing,
        (B, H, n, D) float32 (n: to the last), or broadcastable (B, H, 1, D) without RoPE; None if nothing."""
        if self.mean is None:
            return None
        if self.rope is None:
            return self.mean[:, :, None, :]
        n = self.n_coded - first if n is None else n
        return centers(self.mean, self.rope, self.position + first, n)

    @property
    def n_window(self) -> int:
        return 0 if self.window is None else self.window.shape[2]

    @property
    def n_tokens(self) -> int:
        return self.n_sinks + self.n_coded + self.n_window

    @property
    def n_heads(self) -> int:
        parts = (self.sinks, self.window, None if self.codes is None else self.codes.codes,
                 None if self.decayed is None else self.decayed.codes.codes)
        return next(a.shape[1] for a in parts if a is not None)

    @property
    def head_dim(self) -> int:
        return self.quantizer.dim


def views_by_run(keys: StreamView, values: StreamView, n_queries: int) -> list[tuple[int, int, StreamView, StreamView]]:
    """A view pair whose update carries `recent`, as its queries read it at decode: per run, (first query row,
    rows, the keys' and the values' view holding exactly the tokens those queries read: the sinks, the compressed
    tokens a token-by-token cache would show them, the later tokens in float, up to the run's last query). Each
    run's queries are the last rows of its views, so "causal" holds in each as in the whole. n_queries: the update's
    tokens (the views' last ones)."""
    runs = keys.recent.runs
    if n_queries != keys.recent.queries:  # the runs are rows of the update's own queries
        raise ValueError(f"views that carry their update's float tokens (prefill_as_decode) are read by that update's "
                         f"{keys.recent.queries} queries, one per token, got {n_queries}: attend the views a cache "
                         f"returns with the queries of the same tokens, or set prefill_as_decode=False")
    out = []
    for i, (row, coded) in enumerate(runs):
        end = runs[i + 1][0] if i + 1 < len(runs) else n_queries
        tokens = keys.n_tokens - n_queries + end  # what the run's last query reads
        v = _as_read(values, coded, tokens) if isinstance(values, StreamView) else values[:, :, :tokens]  # zero-wide
        out.append((row, end - row, _as_read(keys, coded, tokens), v))
    return out


def with_recent(view: StreamView, recent: Recent | None) -> StreamView:
    """A view that a learning step built again, carrying its update's `recent` again: its float tokens then wait
    for what the view's own float tokens wait for (the sums observe ties to them)."""
    if recent is None:
        return view
    held = view.window if view.window is not None else view.sinks
    tokens = recent.tokens if held is None else mx.depends(recent.tokens, held)
    return view._replace(recent=recent._replace(tokens=tokens))


def _as_read(view: StreamView, coded: int, tokens: int) -> StreamView:
    """view cut to its first `tokens` tokens, of which compressed ones from `coded` on come in float from
    view.recent (the codes-only segments keep their quantizers)."""
    r = view.recent
    n_s = min(view.n_sinks, tokens)
    coded = max(0, min(coded, tokens - n_s))
    d = min(view.n_decayed, coded)
    cut = lambda c, n: type(c)(*(a[:, :, :n] for a in c)) if n else None  # noqa: E731
    decayed = None if not d else view.decayed._replace(codes=cut(view.decayed.codes, d))
    n_w = tokens - n_s - coded
    return view._replace(
        codes=cut(view.codes, coded - d) if view.codes is not None else None,
        decayed=decayed,
        sinks=view.sinks[:, :, :n_s] if n_s else None,
        window=r.tokens[:, :, coded - r.first : coded - r.first + n_w] if n_w else None,
        recent=None,
    )


# --- reference encode, recode and decode ---------------------------------------------------------------------------


def encode(x: mx.array, quantizer, mean: mx.array | None = None, perm: mx.array | None = None,
           scale: mx.array | None = None, search=None):
    """Codes of tokens x (B, H, n, D): (x - mean (B, H, D)) / scale (B, H), channels in `perm` (H, D) order,
    then quantized (`search`: the trellis encoder to use, TurboQuantMSE.quantize's; None: the reference's)."""
    if mean is not None:
        x = x - mean[:, :, None, :]
    if scale is not None:
        x = x / scale[:, :, None, None]
    if perm is not None:
        x = mx.take_along_axis(x, mx.broadcast_to(perm[None, :, None, :], x.shape), axis=-1)
    return quantizer.quantize(x) if search is None else quantizer.quantize(x, search)


def recode(codes, quantizer, to, search=None):
    """Codes of `quantizer` re-coded by `to` in their rotated basis (temporal decay; TurboQuantMSE.recode)."""
    return quantizer.recode(codes, to) if search is None else quantizer.recode(codes, to, search)


def decode(view: StreamView, dtype: mx.Dtype = mx.float16) -> mx.array:
    """The compressed tokens of a view back in the model basis, (B, H, n_coded, D) `dtype`, mean added
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


def first_tokens(view: StreamView, n: int) -> mx.array:
    """The first n tokens of a view (sinks, compressed tokens decoded, window) in the model basis, float32."""
    parts = [] if view.sinks is None else [view.sinks[:, :, :n]]
    left = n - view.n_sinks
    for _, seg in view.segments():
        if left <= 0:
            break
        k = min(left, seg.n_fresh)
        parts.append(decode(seg._replace(codes=type(seg.codes)(*(a[:, :, :k] for a in seg.codes))), mx.float32))
        left -= k
    if left > 0 and view.window is not None:
        parts.append(view.window[:, :, :left])
    parts = [a.astype(mx.float32) for a in parts]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)
