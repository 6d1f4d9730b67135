"""BatchTurboQuantKVCache (mlx-lm's batch cache protocol over one TurboQuant cache per row), its batch views
and their attention.

mlx-lm batches sequences by merging their single caches (`TurboQuantKVCache.merge`, called by BatchGenerator and
thus batch_generate and the server) into one cache whose arrays are left-padded to a common length. Padding a
compressed cache that way would change what each row calibrates on and where its compression blocks fall, and
store padding as codes. So the batch holds one B=1 TurboQuantKVCache per row and keeps the padded layout only as
bookkeeping (`_left`, `_idx`, as BatchKVCache's `left_padding` and `_idx`): update_and_fetch hands each row
only its real tokens (left padding from merge/prepare, right padding before finalize are dropped) and returns
a `BatchView` per side, and attention runs row by row on each row's own views (batch_view_attention), padding
queries getting zeros. Each row therefore stores and computes exactly what it would alone, temporal decay
included (a row's streams re-code their old tokens as the same cache alone would: its views carry the decayed
codes, and its float fetches decode them).

What mlx-lm sees is BatchKVCache's: `offset` an mx.array (B,) (RoPE), make_mask an array (B, 1, N, T) over the
padded layout, prepare/finalize, filter/extend, extract(i) -> a TurboQuantKVCache, size(), nbytes, state.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any, Callable, NamedTuple

import mlx.core as mx
import mlx_lm.models.cache as mlx_cache
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache

from .attention.reference import turboquant_attention
from .stream.codec import unique_arrays
from .stream.view import StreamView

BATCH_STATE_VERSION = 1
NO_END = -1  # a row whose real tokens are not cut by right padding (an int32, for save_prompt_cache)

# Masks this module's make_mask built without a window, by id: those are plain causal + left padding, which
# is each row's own causal mask, so attention may pass rows "causal"/None (the kernels' fast path) instead of
# an array. Weak: a mask is forgotten with the forward pass that used it.
_PLAIN_MASKS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class BatchView(NamedTuple):
    """One side of a batch of TurboQuant caches, as attention reads it: one B=1 StreamView per row, so every
    row keeps its own calibration and attends only to its own tokens (padding is never stored).

    Row i's real tokens in the update are the query positions [start, start + count) of `spans[i]`; the other
    positions are padding and get zeros. `ends[i]` is the column, in the padded layout of mlx-lm's
    BatchKVCache (what the batch cache's make_mask covers), just past row i's last stored token: an array
    mask is read there. A row with no token in the update has the view None.
    """

    rows: tuple[StreamView | None, ...]
    spans: tuple[tuple[int, int], ...]
    ends: tuple[int, ...]


def _row_mask(mask, i: int, start: int, count: int, end: int, n_tokens: int):
    """Row i's part of a batch mask: None/"causal" become the row's own (what it gets alone: "causal" for
    more than one query); an array (.., L, T) in the padded layout is cut to the row's queries and tokens."""
    if mask is None or isinstance(mask, str):
        return mask if count > 1 else None
    if mask.shape[-1] < end:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not cover the batch's {end} cached columns")
    m = mask[i : i + 1] if mask.ndim == 4 and mask.shape[0] > 1 else mask  # (B, ...) or broadcast (1, ...)
    return m[..., start : start + count, end - n_tokens : end]


def causal_if_plain(mask):
    """"causal" for a mask this module's make_mask built without a window (plain causal + left padding: every
    row's own causal mask, which the kernels take without reading an array), else the mask itself."""
    return "causal" if isinstance(mask, mx.array) and _PLAIN_MASKS.get(id(mask)) is mask else mask


def learned(queries: mx.array, keys, values, scale: float):
    """The views to attend once their caches learned from these queries (TurboQuantKVCache.learn: key weights
    and widths, value widths, the re-coding they cause): the one step, once per forward and layer, before the
    attention that reads them. A key view carries its cache's step while the cache wants the queries; batch
    views learn row by row with each row's own queries. Anything else is returned as it is."""
    if isinstance(keys, StreamView):
        return keys.learn(queries, keys, values, scale) if keys.learn is not None else (keys, values)
    if not isinstance(keys, BatchView) or all(k is None or k.learn is None for k in keys.rows):
        return keys, values
    L = queries.shape[2]
    rows_k, rows_v = list(keys.rows), list(values.rows)
    for i, (k, v, (start, count)) in enumerate(zip(keys.rows, values.rows, keys.spans)):
        if k is not None and count and k.learn is not None:
            q = queries[i : i + 1, :, start : start + count] if count < L else queries[i : i + 1]
            rows_k[i], rows_v[i] = k.learn(q, k, v, scale)
    return keys._replace(rows=tuple(rows_k)), values._replace(rows=tuple(rows_v))


def batch_view_attention(queries: mx.array, keys: BatchView, values: BatchView, scale: float, mask=None,
                         sinks: mx.array | None = None, attend: Callable = turboquant_attention) -> mx.array:
    """Attention over batch views, row by row with `attend` (the reference by default; tq_mlx.hook passes
    tq_mlx.attention.dispatch_attention) on each row's own views and queries, stacked; padding query positions
    get zeros. queries (B, n_q_heads, L, D); sinks (learned per-head logits) go to every row."""
    B, Hq, L, _ = queries.shape
    if len(keys.rows) != B:
        raise ValueError(f"queries have batch {B}, the batch view holds {len(keys.rows)} rows")
    Dv = next((v.head_dim for v in values.rows if v is not None), queries.shape[3])
    out = []
    for i, (k, v, (start, count), end) in enumerate(zip(keys.rows, values.rows, keys.spans, keys.ends)):
        if k is None or count == 0:
            out.append(mx.zeros((1, Hq, L, Dv), queries.dtype))
            continue
        q = queries[i : i + 1, :, start : start + count] if count < L else queries[i : i + 1]
        o = attend(q, k, v, scale=scale, mask=_row_mask(mask, i, start, count, end, k.n_tokens), sinks=sinks)
        pad = [(0, 0), (0, 0), (start, L - start - count), (0, 0)]
        out.append(mx.pad(o, pad) if count < L else o)
    return out[0] if B == 1 else mx.concatenate(out, axis=0)


def _row_from_state(state) -> Any:
    """A saved row, rebuilt as mlx-lm's load_prompt_cache builds a TurboQuantKVCache entry: by the class's name
    in mlx_lm.models.cache, where tq_mlx.hook registers it beside this module's class (tq_mlx.cache sits above
    this module)."""
    row_class = getattr(mlx_cache, "TurboQuantKVCache", None)
    if row_class is None:
        raise ValueError("BatchTurboQuantKVCache state: TurboQuantKVCache is not registered with mlx-lm; load the "
                         "file with tq_mlx.load_prompt_cache")
    return row_class.from_state(state)


class BatchTurboQuantKVCache(_BaseCache):
    """A batch of TurboQuant caches for mlx-lm's batched generation (see the module docstring).

    rows: one single-sequence cache per row (TurboQuantKVCache, batch 1 or empty); left_padding: the padded
    layout's left padding per row, as BatchKVCache(left_padding).
    """

    def __init__(self, rows: list[Any], left_padding: list[int] | None = None):
        self.rows = list(rows)
        n = len(self.rows)
        self._left = [int(p) for p in left_padding] if left_padding is not None else [0] * n
        if len(self._left) != n:
            raise ValueError(f"left_padding has {len(self._left)} entries for {n} rows")
        self._idx = 0  # columns of the padded layout so far
        self._ends = [NO_END] * n  # column where each row's real tokens end, while a right-padded prompt is fed
        self._right = [0] * n
        self._last = ((0, 0),) * n, (0,) * n  # spans and ends of the last update, for keys_and_values

    # --- construction -------------------------------------------------------------------------------------

    @classmethod
    def merge(cls, caches: list[Any]) -> "BatchTurboQuantKVCache":
        """A batch of copies of single-sequence caches (the caller's caches are left as they are, as with
        BatchKVCache.merge), right-aligned in the padded layout."""
        rows = []
        for c in caches:
            if isinstance(c, cls):
                raise ValueError("merge takes single-sequence caches; extract the rows of a batch first")
            bh = c.batch_heads()
            if bh is not None and bh[0] != 1:
                raise ValueError(f"{c._where()}: a batch merges single-sequence caches, this one holds batch {bh[0]}")
            rows.append(copy.deepcopy(c))
        layers = sorted({r.layer_index for r in rows})
        if len(layers) > 1:
            raise ValueError(f"merge of caches of different layers {layers}")
        # Refused here, before any forward, rather than by one row in the middle of the batch's forward.
        shapes = sorted({(r.batch_heads()[1], r.key_dim, r.value_dim) for r in rows if not r.empty()})
        if len(shapes) > 1:
            raise ValueError(f"{rows[0]._where()}: merge of caches of different (kv heads, key dim, value dim) "
                             f"{shapes}")
        lengths = [r.size() for r in rows]
        longest = max(lengths, default=0)
        batch = cls(rows, [longest - n for n in lengths])
        batch._idx = longest
        return batch

    def _where(self) -> str:
        return f"BatchTurboQuantKVCache (layer {self.rows[0].layer_index})" if self.rows else "BatchTurboQuantKVCache"

    # --- mlx-lm's protocol ----------------------------------------------------------------------------------

    @property
    def offset(self) -> mx.array:
        """Position of each row's next token (BatchKVCache's offset: -left_padding + columns), for RoPE."""
        return mx.array([self._idx - p for p in self._left])

    @property
    def left_padding(self) -> mx.array:
        return mx.array(self._left)

    @property
    def bits(self):  # routes mlx-lm's attention to quantized_scaled_dot_product_attention (tq_mlx.hook)
        return self.rows[0].bits if self.rows else 0

    @property
    def group_size(self):
        return 0

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Append each row's real tokens of keys/values (B, n_kv_heads, L, head_dim) to that row's cache and
        return the batch views. Padding columns are dropped here, so they are never stored or attended. Rows
        that fetch float tensors (TurboQuantKVCache.fetch) give one padded float array per side instead, in
        BatchKVCache's layout: row i's tokens right-aligned at its last column, zeros where the mask pads."""
        B, L = keys.shape[0], keys.shape[2]
        if B != len(self.rows):
            raise ValueError(f"{self._where()}: keys have batch {B}, the cache holds {len(self.rows)} rows")
        a = self._idx
        kv, vv, spans, ends = [], [], [], []
        for i, row in enumerate(self.rows):
            start = min(max(self._left[i] - a, 0), L)
            stop = L if self._ends[i] == NO_END else min(max(self._ends[i] - a, 0), L)
            count = max(stop - start, 0)
            k = v = None
            if count:
                k, v = row.update_and_fetch(keys[i : i + 1, :, start : start + count],
                                            values[i : i + 1, :, start : start + count])
            kv.append(k)
            vv.append(v)
            spans.append((start, count))
            ends.append(a + start + count)
        self._idx = a + L
        self._last = tuple(spans), tuple(ends)
        return self._side(kv, 0, keys.dtype), self._side(vv, 1, values.dtype)

    def _side(self, fetched: list, side: int, dtype: mx.Dtype):
        """One side of an update: a BatchView of the rows' views, or (float fetches) the padded float array."""
        if not any(isinstance(f, mx.array) for f in fetched):
            return BatchView(tuple(fetched), *self._last)
        like = next(x for x in fetched if isinstance(x, mx.array))
        rows = []
        for i, (row, f) in enumerate(zip(self.rows, fetched)):
            if f is None and not row.empty():  # no token in this update: the row's tokens so far
                f = row.keys_and_values()[side]
            if f is None:
                f = mx.zeros((1, like.shape[1], 0, like.shape[3]), dtype)
            end = self._idx if self._ends[i] == NO_END else min(self._ends[i], self._idx)
            rows.append(mx.pad(f.astype(dtype), [(0, 0), (0, 0), (end - f.shape[2], self._idx - end), (0, 0)]))
        return rows[0] if len(rows) == 1 else mx.concatenate(rows, axis=0)

    def keys_and_values(self):
        """The batch views of the last update without appending (KV-shared layers, see TurboQuantKVCache)."""
        spans, ends = self._last
        views = [r.keys_and_values() if count else (None, None) for r, (_, count) in zip(self.rows, spans)]
        dtype = next((x.dtype for kv in views for x in kv if isinstance(x, mx.array)), mx.float16)
        return self._side([k for k, _ in views], 0, dtype), self._side([v for _, v in views], 1, dtype)

    def prepare(self, *, left_padding: list[int] | None = None, lengths: list[int] | None = None,
                right_padding: list[int] | None = None) -> None:
        """As BatchKVCache.prepare. Right padding needs `lengths` (each row's real tokens in the prompt that
        follows), which mlx-lm's BatchGenerator always passes: rows stop storing at their length."""
        if left_padding is not None:
            if self._idx or any(r.size() for r in self.rows):
                raise ValueError(f"{self._where()}: left padding can only be added to an empty batch cache")
            self._left = [p + int(x) for p, x in zip(self._left, left_padding)]
        if right_padding is not None and max(right_padding) > 0:
            if lengths is None:
                raise ValueError(f"{self._where()}: prepare(right_padding=...) needs lengths=")
            self._right = [int(x) for x in right_padding]
            self._ends = [max(self._idx, p) + int(n) for p, n in zip(self._left, lengths)]

    def finalize(self) -> None:
        """The right padding just fed becomes left padding (BatchKVCache rolls its arrays; here only the
        layout moves, the rows never stored it)."""
        if any(self._right):
            self._left = [p + r for p, r in zip(self._left, self._right)]
        self._right = [0] * len(self.rows)
        self._ends = [NO_END] * len(self.rows)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **kwargs):
        """Always an array (B, 1, N, T) over the padded layout, as BatchKVCache's."""
        mask = create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, window_size=window_size,
                                  **kwargs)
        if window_size is None and not kwargs:
            _PLAIN_MASKS[id(mask)] = mask
        return mask

    def filter(self, batch_indices) -> None:
        """Keep the rows batch_indices (in that order), then drop the left padding every row has."""
        idx = [int(i) for i in batch_indices]
        seen = set()
        rows = []
        for i in idx:  # a row kept twice must not share its arrays
            rows.append(copy.deepcopy(self.rows[i]) if i in seen else self.rows[i])
            seen.add(i)
        self.rows = rows
        self._left, self._ends, self._right = ([x[i] for i in idx] for x in (self._left, self._ends, self._right))
        spans, ends = self._last
        shift = min(self._left, default=0)
        self._last = tuple(spans[i] for i in idx), tuple(ends[i] - shift for i in idx)
        if shift > 0:
            self._idx -= shift
            self._left = [p - shift for p in self._left]
            self._ends = [e if e == NO_END else e - shift for e in self._ends]

    def extend(self, other: "BatchTurboQuantKVCache") -> None:
        """Append other's rows, both right-aligned at the longer layout."""
        idx = max(self._idx, other._idx)

        def moved(c):
            d = idx - c._idx
            return ([p + d for p in c._left], [e if e == NO_END else e + d for e in c._ends],
                    tuple(e + d for e in c._last[1]))

        (l1, e1, n1), (l2, e2, n2) = moved(self), moved(other)
        self.rows = self.rows + other.rows
        self._left, self._ends, self._right = l1 + l2, e1 + e2, self._right + other._right
        self._idx = idx
        self._last = self._last[0] + other._last[0], n1 + n2

    def extract(self, idx: int):
        """Row idx as a single TurboQuantKVCache (a copy: the batch goes on without it)."""
        return copy.deepcopy(self.rows[idx])

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return all(r.empty() for r in self.rows)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last n columns of the padded layout: each row's last n tokens (as many as it has)."""
        n = min(self._idx, n)
        for r in self.rows:
            r.trim(n)
        self._idx -= n
        self._left = [min(p, self._idx) for p in self._left]
        return n

    def held_arrays(self) -> list[mx.array]:
        return unique_arrays(self.rows)

    @property
    def nbytes(self) -> int:
        """Bytes of every array the rows hold, each once (codes, norms, float sinks and windows, constants)."""
        return sum(a.nbytes for a in self.held_arrays())

    # --- state: the layout's bookkeeping and each row's own state --------------------------------------------

    @property
    def state(self):
        meta = {"version": BATCH_STATE_VERSION, "idx": self._idx, "left_padding": list(self._left),
                "ends": list(self._ends), "right_padding": list(self._right)}
        return meta, [r.state for r in self.rows]

    @state.setter
    def state(self, v):
        try:
            meta, rows = v
            meta = dict(meta)
            version = meta["version"]
            if version != BATCH_STATE_VERSION:
                raise ValueError(f"BatchTurboQuantKVCache state version {version!r}; this tq-mlx reads "
                                 f"{BATCH_STATE_VERSION}")
            rows = [_row_from_state(s) for s in rows]
            left, ends, right = (meta[k] for k in ("left_padding", "ends", "right_padding"))
            self.__init__(rows, [int(x) for x in left])
            self._idx = int(meta["idx"])
            self._ends, self._right = [int(x) for x in ends], [int(x) for x in right]
        except (KeyError, TypeError) as e:
            raise ValueError(f"invalid BatchTurboQuantKVCache state ({type(e).__name__}: {e})") from None
        if not len(self._ends) == len(self._right) == len(self.rows):
            raise ValueError("invalid BatchTurboQuantKVCache state: per-row lists of different lengths")
