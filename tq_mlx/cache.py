"""TurboQuantKVCache: mlx-lm's KV cache protocol over two compressed streams, one for keys, one for values.

It reads like mlx-lm's KVCache with codes instead of floats: update_and_fetch appends to both streams
(tq_mlx.stream.compressed: float16 sinks, TurboQuant codes, a float16 window) and returns their `StreamView`s, which
mlx-lm's attention routes to `quantized_scaled_dot_product_attention` because the cache has `bits`; the
attention hook (tq_mlx.hook) takes them from there. tq_mlx.integration installs it when it builds or loads
caches, and a cache installs it at its first update_and_fetch (a cache built by hand), never at import or
construction. mlx-lm's batching merges caches (`merge`) into a tq_mlx.batch.BatchTurboQuantKVCache.

Memory: `nbytes` is the sum of every array the two streams hold (their docstring has the formula), and no
float copy of a compressed token exists anywhere.
"""

from __future__ import annotations

import copy
import types
from typing import Callable

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from .batch import BatchTurboQuantKVCache
from .quant.codebook import MIN_DIM
from .config import WIDEST_KEY_BITS, TurboQuantConfig, check_int, check_max_size
from .plan import LayerPlan, layer_plan
from .models.architectures import FETCHES
from .hook import install_attention_hook
from .attention import dispatch_encode, dispatch_recode, float_tokens
from .quant.quantizer import FLOAT_DTYPES, QUANTIZER_BITS, TurboQuantProd, check_bits, format_bits, split_dims
from .models.rope import Rope
from .stream.codec import STATE_PARTS, batch_heads, unique_arrays
from .stream.compressed import CompressedStream
from .stream.view import StreamView, with_recent

STATE_VERSION = 12
READABLE_STATE_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12)
# The fields of a state's meta each version added, with the meaning their absence had before (version 2 renamed
# the config's `block`, TurboQuantConfig.from_dict reads either; 3 added each stream's `scale` and float buffers in
# the model's dtype, 7 each stream's RoPE: arrays, read by tq_mlx.stream.codec).
ADDED_FIELDS = {
    4: {"key_protected": False},  # whether the keys protected themselves
    5: {"fetch": "codes", "max_size": None, "n_dropped": 0, "k_eq_v": False},  # fetch (tq_mlx.models.architectures), bounds
    6: {"n_decayed": [0, 0]},  # temporal decay
    9: {"key_bits": None, "query_count": None},  # widths by error; the queries summed for the weights
    10: {"value_width": None, "value_seen": [0, 0]},  # values by their error and the sums they come from
    11: {"key_span_seen": [0, 0]},  # keys by their output error: the positions of the queries they hold
    12: {"value_bits": None, "value_span_seen": [0, 0]},  # values by their output error: their width, those positions
}

__all__ = ["TurboQuantConfig", "TurboQuantKVCache", "held_bytes"]


def held_bytes(caches) -> int:
    """Bytes a prompt cache's caches hold together, each array once. TurboQuant layers (and batch caches of them)
    share their quantizers' codebooks and lookup tables (tq_mlx.quant.quantizer.shared_constants): each layer's
    nbytes counts what it holds, these included, so a sum of nbytes would count them once a layer. Any other
    cache counts its nbytes."""
    caches = list(caches)
    holders = [c for c in caches if hasattr(c, "held_arrays")]
    others = [c for c in caches if not hasattr(c, "held_arrays")]
    return sum(a.nbytes for a in unique_arrays(holders)) + sum(c.nbytes for c in others)


def migrated(meta: dict) -> dict:
    """A state's meta (TurboQuantKVCache.state) as this version writes it, from any readable version: the one place
    earlier files are read (ADDED_FIELDS). ValueError for a version this tq-mlx cannot read; KeyError for a field
    no version lets a file leave out."""
    version = meta.get("version")
    if version not in READABLE_STATE_VERSIONS:
        newer = isinstance(version, int) and version > STATE_VERSION
        raise ValueError(
            f"TurboQuantKVCache state version {version!r} was written by "
            f"{'a newer' if newer else 'an unknown'} tq-mlx; this tq-mlx reads versions "
            f"{', '.join(map(str, READABLE_STATE_VERSIONS))}"
        )
    out = dict(meta)
    fields = dict(meta["config"])
    if version < 4 and fields.get("compress_block", fields.get("block")) is None and fields.get("window"):
        fields["compress_block"] = fields.pop("block", None) or fields["window"]  # None meant the window
    out["config"] = fields
    for added in ADDED_FIELDS.values():  # a field left out reads as its absence did, whatever the version says
        for name, absent in added.items():
            out.setdefault(name, absent)
    out["version"] = STATE_VERSION
    return out


class _unbounded_only:
    """A classmethod that bounded instances do not have. mlx-lm batches a model only when its caches have
    `merge` (server.py:459-463 serves the others one sequence at a time; batch_generate says "does not yet
    support batching", generate.py:833): a batch's padded layout counts every column, and a bound's dropped
    tokens would leave unmasked holes in it."""

    def __init__(self, f):
        self.f = f

    def __get__(self, obj, cls=None):
        if obj is not None and obj.max_size is not None:
            raise AttributeError(f"{type(obj).__name__} with max_size {obj.max_size} cannot be batched yet")
        return types.MethodType(self.f, cls if cls is not None else type(obj))


class TurboQuantKVCache(_BaseCache):
    """One attention layer's KV cache, compressed with TurboQuant. Implements mlx-lm's cache protocol.

    layer_index is the model layer (seeds and error messages); attention_index and n_attention_layers place
    it among the attention layers for config.boundary_layers. Given head_dim, the streams are built now, so
    the first update does no setup work (some rotations read an array back to the host when built).

    fetch (tq_mlx.models.architectures) says what update_and_fetch returns; storage is the same two compressed
    streams whatever it is:
      "codes"   views of both streams, for attention on the codes (the attention hook)
      "latent"  multi-head latent attention: the keys are the latent, the values the rope key. A one-token
                update gets the latent's view (the model attends to it as keys and values); longer updates
                get it as float, and the rope key is always float
      "float"   both sides as float tensors decoded from the codes (models that post-process what they fetch)
    Float fetches are transients of one layer, in the dtype of the tokens given, never kept.

    derive_keys (K=V layers, Gemma 4's attention_k_eq_v): the layer's keys are a function of its values, so one
    stream (the key stream, at the key bits) holds the values and serves both sides: each fetch decodes it to
    float and derives the keys with derive_keys(values) (fetch "float"); the layer holds half the streams.
    Saved and loaded, `k_eq_v` says so; tq_mlx.load_prompt_cache(file, model) attaches derive_keys again.

    max_size bounds the tokens held, as mlx-lm's RotatingKVCache does for --max-kv-size: before each update the
    oldest compressed tokens are dropped in whole compress blocks (K), so that decode attends to at most
    max_size tokens (a prefill chunk of L to max_size - 1 + L, as RotatingKVCache); the sinks and the float
    window are never dropped (tq_mlx.planner.memory.bounded_tokens prices it).
    """

    def __init__(
        self,
        config: TurboQuantConfig | None = None,
        layer_index: int = 0,
        attention_index: int | None = None,
        n_attention_layers: int | None = None,
        head_dim: int | None = None,
        fetch: str = "codes",
        max_size: int | None = None,
        derive_keys: Callable[[mx.array], mx.array] | None = None,
        rope: Rope | None = None,
    ):
        if fetch not in FETCHES:
            raise ValueError(f"fetch={fetch!r}: expected one of {', '.join(FETCHES)}")
        self.k_eq_v = derive_keys is not None
        self.derive_keys = derive_keys
        self.fetch = "float" if self.k_eq_v else fetch
        self.config = config or TurboQuantConfig()
        self.layer_index = int(layer_index)
        self.attention_index = self.layer_index if attention_index is None else int(attention_index)
        self.n_attention_layers = n_attention_layers
        self.expected_head_dim = head_dim
        self.plan = self._plan(rope is not None)
        # the keys' RoPE (tq_mlx.models.rope.probe of the model's layer), for centering before it where the plan says;
        # None: one mean after RoPE
        self.rope = rope if self.plan.keys.rope else None
        self.max_size = None if max_size is None else check_max_size(max_size, self.config)
        self.n_dropped = 0  # tokens dropped by the bound (offset = held tokens + n_dropped)
        self.offset = 0
        self._hooked = False  # whether this cache installed the attention hook (its first update_and_fetch does)
        self.key_stream: CompressedStream | None = None  # built once the head dims are known
        self.value_stream: CompressedStream | None = None
        if head_dim is not None:
            self._make_streams(head_dim, head_dim)

    # mlx-lm's base.scaled_dot_product_attention sends caches that have `bits` to the quantized attention
    # path, which install_attention_hook routes to us. group_size is passed along and ignored.
    @property
    def bits(self):
        return self.key_bits

    def _plan(self, rope: bool) -> LayerPlan:
        """This layer's plan (tq_mlx.plan): every per-layer rule of the streams it builds."""
        return layer_plan(self.config, self.attention_index, self.n_attention_layers, fetch=self.fetch,
                          k_eq_v=self.k_eq_v, rope=rope, layer_index=self.layer_index)

    @property
    def key_bits(self) -> float:
        """Bits of the keys' codes: the layer's configured bits, protect_bits once the key stream protected
        itself at calibration (TurboQuantConfig.protect_factor), or the width it chose (key_error)."""
        return self.key_stream.quantizer.bits if self.key_stream else self.plan.keys.bits

    @property
    def value_bits(self) -> float:
        """Bits of the values' codes: the layer's configured bits (a latent layer's rope key takes the key bits:
        tq_mlx.plan), or the width the values chose by their output error (value_output_error)."""
        if self.value_stream is not None:
            return self.value_stream.quantizer.bits
        return self.plan.values.bits if self.plan.values is not None else self.plan.bits[1]

    @property
    def qjl(self) -> bool:
        return isinstance(self.key_stream.quantizer, TurboQuantProd) if self.key_stream else self.plan.keys.qjl

    @property
    def protected(self) -> bool:
        """Whether the keys protected themselves (stored at protect_bits; see stream.bias_outlier_factor)."""
        return bool(self.key_stream and self.key_stream.protected)

    @property
    def group_size(self):
        return 0

    def _where(self) -> str:
        return f"TurboQuantKVCache (layer {self.layer_index})"

    def check_dims(self, key_dim: int, value_dim: int) -> None:
        """Raise ValueError, naming the layer, unless this cache can store heads of these sizes (values may be
        zero-wide: an indexer's cache that stores keys alone, minimax_m3_vl.py:264) at every width its plan lets
        them take."""
        p = self.plan
        for name, d, plan in (("key", key_dim, p.keys), ("value", value_dim, p.values)):
            if name == "value" and (d == 0 or self.k_eq_v):
                continue
            if d < MIN_DIM:
                raise ValueError(f"{self._where()}: {name} head_dim {d} is below the minimum {MIN_DIM}")
            bits = p.bits[1] if plan is None else plan.bits
            for b in (bits,) if plan is None or plan.widen is None else plan.widen.widths(bits):
                try:
                    split_dims(d, b)
                except ValueError as e:
                    raise ValueError(f"{self._where()}: {name} head_dim {d} at {format_bits(b)} bits: {e}") from None

    @property
    def decay_bits(self) -> tuple[int | None, int | None]:
        """(keys, values): the bits compressed tokens decay to (config.decay_after), None where they do not: the
        plan's, a widened key stream's by the same step, none for protected keys, and the bits values chose by
        their error (value_error) where fewer than theirs."""
        kb, vb = self.plan.decay_bits
        if self.key_stream is not None and self.key_stream.widened:
            kb = self.plan.keys.decay_at(self.key_bits)
        v = self.value_stream
        if v is not None and v.value_sums is not None:  # values by their error: the bits chosen, if fewer
            vb = v.value_width if v.value_width is not None and v.value_width < self.value_bits else None
        return (None if self.protected else kb), vb

    def _make_streams(self, key_dim: int, value_dim: int) -> None:
        self.check_dims(key_dim, value_dim)
        self.plan = p = self._plan(self.rope is not None)  # a loaded state may have changed fetch or K=V
        coders = dict(encoder=dispatch_encode, recoder=dispatch_recode)
        rope = self.rope if self.rope is not None and self.rope.order.shape[0] == key_dim else None
        self.key_stream = CompressedStream(p.keys, key_dim, rope=rope, **coders)
        self.value_stream = None if value_dim == 0 or p.values is None else CompressedStream(p.values, value_dim,
                                                                                             **coders)

    @property
    def key_dim(self) -> int:
        return 0 if self.key_stream is None else self.key_stream.dim

    @property
    def value_dim(self) -> int:
        if self.k_eq_v:
            return self.key_dim
        return 0 if self.value_stream is None else self.value_stream.dim

    @property
    def streams(self) -> tuple[CompressedStream, ...]:
        return tuple(s for s in (self.key_stream, self.value_stream) if s is not None)

    # Token counts are the same on both sides; the key stream's are read.
    @property
    def n_sinks(self) -> int:
        return self.key_stream.n_sinks if self.key_stream else 0

    @property
    def n_coded(self) -> int:
        """Compressed tokens, decayed ones included."""
        s = self.key_stream
        return s.n_coded if s else 0

    @property
    def n_decayed(self) -> tuple[int, int]:
        """(keys, values): compressed tokens re-coded at the decay bits (config.decay_after) on each side."""
        return tuple(s.n_decayed if s else 0 for s in (self.key_stream, self.value_stream))

    @property
    def n_window(self) -> int:
        return self.key_stream.n_window if self.key_stream else 0

    @property
    def value_width(self) -> int | None:
        """The bits old values chose to decay to (value_error; value_bits: none), None: not chosen or not choosing."""
        return self.value_stream.value_width if self.value_stream else None

    @property
    def calibrated(self) -> bool:
        """Whether μ, ν and the channel orders are fixed (from the first tokens compressed)."""
        return self.n_coded > 0

    def batch_heads(self) -> tuple[int, int] | None:
        """(batch, n_kv_heads) of the stored arrays, None before the first update."""
        return self.key_stream.batch_heads() if self.key_stream else None

    def _check_input(self, keys: mx.array, values: mx.array) -> None:
        if keys.ndim != 4 or values.ndim != 4 or keys.shape[:3] != values.shape[:3]:
            raise ValueError(
                f"{self._where()}: expected keys and values of shape (B, n_kv_heads, L, head_dim), "
                f"got {tuple(keys.shape)} and {tuple(values.shape)}"
            )
        if keys.dtype not in FLOAT_DTYPES or values.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{self._where()}: keys and values must be float16, bfloat16 or float32, got "
                             f"{keys.dtype} and {values.dtype}")
        B, H, _, dk = keys.shape
        dv = values.shape[3]
        if self.key_stream is None:
            self._make_streams(dk, dv)
            return
        if (dk, dv) != (self.key_dim, self.value_dim):
            raise ValueError(
                f"{self._where()}: keys/values head_dim ({dk}, {dv}) do not match this cache's "
                f"({self.key_dim}, {self.value_dim})"
            )
        held = self.batch_heads()
        if held is not None and held != (B, H):
            raise ValueError(
                f"{self._where()}: keys have batch {B} and {H} kv heads, this cache holds "
                f"batch {held[0]} and {held[1]} kv heads"
            )

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[StreamView, StreamView]:
        """Store keys/values (B, n_kv_heads, L, head_dim) and return views of everything stored."""
        if not self._hooked:  # a cache built by hand: its model's attention reaches the hook from this forward on
            install_attention_hook(TurboQuantKVCache)
            self._hooked = True
        self._check_input(keys, values)
        self.offset += keys.shape[2]
        if self.max_size is not None:
            self._drop_for(keys.shape[2])
        if self.k_eq_v:  # one stream, of the values
            return self._fetched(self.key_stream.append(values), None, values, keys.shape[2])
        k = self.key_stream.append(keys)
        v = self.value_stream.append(values) if self.value_stream else None
        return self._fetched(k, v, keys, keys.shape[2])

    def _derived_keys(self, values: mx.array) -> mx.array:
        if self.derive_keys is None:
            raise ValueError(f"{self._where()}: a K=V layer loaded without its model cannot derive its keys; load "
                             f"the file with tq_mlx.load_prompt_cache(file, model)")
        return self.derive_keys(values)

    def _drop_for(self, n_new: int) -> None:
        """Before an update, drop the oldest compressed tokens (whole blocks of K) so that at most max_size - 1
        earlier tokens remain, as RotatingKVCache(max_size, keep=sinks) keeps max_size - 1 tokens before each
        update: decode attends to at most max_size tokens, a prefill chunk of L to max_size - 1 + L. Token by
        token, K·⌈(offset - max_size)/K⌉ are dropped in all (tq_mlx.planner.memory.bounded_tokens)."""
        drop = self._pending_drop(self.offset - n_new)
        if drop > 0:
            for s in self.streams:
                s.drop_oldest(drop, self.config.compress_block_size)
            self.n_dropped += drop

    def _pending_drop(self, before: int) -> int:
        """Compressed tokens the next update drops, `before` tokens having been fed."""
        if self.max_size is None or before <= self.max_size - 1:
            return 0
        K = self.config.compress_block_size
        return max(0, min(K * -(-(before - self.max_size + 1) // K) - self.n_dropped, self.n_coded))

    def _fetched(self, k: StreamView, v: StreamView | None, new: mx.array | None, n_new: int = 0):
        """What the model gets for the views of its streams (see `fetch`): float tensors in the dtype of `new`
        (the tokens just stored; None: the stored float tokens'). Decoding waits for `new`, so a forward pass
        decodes one layer at a time rather than every layer's cache up front (they depend on nothing else): the
        float transient stays one layer's."""
        dtype = new.dtype if new is not None else next(
            (a.dtype for a in (k.window, k.sinks) if a is not None), mx.float16)

        def floats(view):
            return float_tokens(view, dtype, new)

        if self.k_eq_v:  # k holds the values; the keys derive from them
            values = floats(k)
            return self._derived_keys(values), values
        if v is None:  # zero-wide values
            return (self._learning(k) if self.fetch == "codes" else floats(k)), mx.zeros(
                (*self.batch_heads(), k.n_tokens, 0), dtype)
        if self.fetch == "codes":
            return self._learning(k), v
        if self.fetch == "latent" and n_new == 1:
            return k, floats(v)
        return floats(k), floats(v)

    def _learning(self, keys: StreamView) -> StreamView:
        """The key view, carrying this cache's learning step while a stream wants the queries that attend it."""
        wants = any(s.wants_queries for s in self.streams)
        return keys._replace(learn=self.learn) if wants else keys

    def learn(self, queries: mx.array, keys: StreamView, values, scale: float | None = None):
        """What the cache learns from the queries (B, n_q_heads, L, D) that attend its last L tokens, in one step
        before attention reads its views (tq_mlx.batch.learned calls it, from the attention hook): the key stream
        sums them for its weights and width (a first compression coded before they came is coded again; keys by
        their output error hold them and read the value stream's first tokens), then the
        value stream measures, on the keys' view, the error its old values would give at fewer bits (by their output
        error: holds them, and chooses its width reading the keys' first tokens as the key stream holds them). Returns the
        views to attend (keys, values); `values` as given when the value stream learns nothing."""
        given = keys
        v = self.value_stream
        if self.key_stream.wants_queries:  # keys by their output error read the values at their first compression
            keys = self.key_stream.observe(queries, scale, values=None if v is None else v.view())
        else:
            keys = self.key_stream.view()
        if v is not None and v.wants_queries and isinstance(values, StreamView):
            values = with_recent(v.observe(queries, scale, keys), values.recent)
        return with_recent(keys, given.recent)._replace(learn=None), values

    def keys_and_values(self) -> tuple[StreamView, StreamView]:
        """Views of everything stored, without appending: for models whose KV-shared layers read another
        layer's cache back and attend through it (gemma3n.py:133)."""
        if self.key_stream is None:
            raise ValueError(f"{self._where()}: keys_and_values() before any update")
        return self._fetched(self.key_stream.view(), self.value_stream.view() if self.value_stream else None, None)

    # mlx-lm's pipelined models tie a stage's send to its last cache, `cache[-1].keys = mx.depends(
    # cache[-1].keys, h)` (qwen2.py:165-167 and every PipelineMixin model), so that generate's mx.eval of the
    # cache state after each prefill chunk runs the send. `keys` is one buffer of the key stream that the state
    # holds (the float window, else the sinks, else the codes); assigning replaces that buffer.
    @staticmethod
    def _buffer(s: CompressedStream | None) -> mx.array | None:
        """The buffer of a stream that `keys` / `values` stand for: the float window, else the sinks, else the codes."""
        if s is None:
            return None
        codes = s.codes or s.decayed
        return next((a for a in (s.window, s.sinks) if a is not None), codes[0] if codes else None)

    @property
    def keys(self) -> mx.array | None:
        return self._buffer(self.key_stream)

    @keys.setter
    def keys(self, value: mx.array) -> None:
        self._set_buffer(self.key_stream, value, "keys")

    # minimax_m3_vl ties its indexer cache into the graph through `cache.keys` and `cache.values` (:348).
    @property
    def values(self) -> mx.array | None:
        if self.value_stream is None and not self.k_eq_v and self.key_stream is not None:
            return mx.zeros((0,), mx.float16)  # zero-wide values
        return self._buffer(self.key_stream if self.k_eq_v else self.value_stream)

    @values.setter
    def values(self, value: mx.array) -> None:
        if self.value_stream is not None:
            self._set_buffer(self.value_stream, value, "values")

    def _set_buffer(self, s: CompressedStream | None, value: mx.array, name: str) -> None:
        if self._buffer(s) is None:
            raise ValueError(f"{self._where()}: {name} assigned before any update")
        if s.window is not None:
            s.window = value
        elif s.sinks is not None:
            s.sinks = value
        elif s.codes:
            s.codes = type(s.codes)(value, *s.codes[1:])
        else:
            s.decayed = type(s.decayed)(value, *s.decayed[1:])

    # --- the rest of mlx-lm's cache protocol ---------------------------------------------------------

    def __deepcopy__(self, memo):
        # mlx-lm's prompt-cache LRU deep-copies caches; the streams copy their arrays and share quantizers.
        new = copy.copy(self)
        memo[id(self)] = new
        new.key_stream, new.value_stream = copy.deepcopy(self.key_stream, memo), copy.deepcopy(self.value_stream, memo)
        return new

    def size(self) -> int:
        return self.offset

    @property
    def n_held(self) -> int:
        """Tokens held: the offset less what a bound dropped."""
        return self.offset - self.n_dropped

    @_unbounded_only
    def merge(cls, caches: list[TurboQuantKVCache]) -> BatchTurboQuantKVCache:
        """mlx-lm's batching (BatchGenerator, batch_generate, the server) merges one cache per sequence: a
        BatchTurboQuantKVCache of copies, one row each (tq_mlx.batch)."""
        return BatchTurboQuantKVCache.merge(caches)

    def empty(self) -> bool:
        return self.batch_heads() is None

    def is_trimmable(self) -> bool:
        return self.n_dropped == 0  # once a bound dropped tokens, trimming cannot bring them back (RotatingKVCache)

    def trim(self, n: int) -> int:
        """Drop the last n tokens (as many as are held): window first, then compressed tokens, then sinks.
        A trim that leaves no compressed token also drops the calibration (μ, ν, channel orders)."""
        n = min(self.n_held, n)
        for s in self.streams:
            s.trim(n)
        self.offset -= n
        return n

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        # columns are the tokens held once this update has dropped its share (fewer than the offset once a
        # bound dropped some)
        held = self.n_held - self._pending_drop(self.offset)
        if self.max_size is not None and N > 1:
            # as RotatingKVCache.make_mask: a prefill chunk attends within a window of max_size held tokens
            window_size = window_size or self.max_size
            if held + N > window_size or return_array:
                return create_causal_mask(N, held, window_size=window_size)
            return "causal"
        return create_attention_mask(N, offset=held, return_array=return_array, window_size=window_size)

    def held_arrays(self) -> list[mx.array]:
        """Every array this cache holds (both streams: buffers, centering, channel orders, quantizer constants),
        each once."""
        return unique_arrays(self.streams)

    @property
    def nbytes(self) -> int:
        """Bytes of every array the cache holds, buffers at full capacity (see held_arrays)."""
        return sum(a.nbytes for a in self.held_arrays())

    # --- state: everything needed to rebuild the cache, as stored references -----------------------

    @property
    def state(self):
        meta = {
            "version": STATE_VERSION,
            "config": self.config.to_dict(),
            "layer_index": self.layer_index,
            "attention_index": self.attention_index,
            "n_attention_layers": self.n_attention_layers,
            "head_dim": self.expected_head_dim,
            "offset": self.offset,
            "n_sinks": self.n_sinks,
            "n_compressed": self.n_coded,  # the file format's name for n_coded (every version carries it)
            "n_decayed": list(self.n_decayed),
            "n_window": self.n_window,
            "key_dim": self.key_dim,
            "value_dim": self.value_dim,
            "calibrated": self.calibrated,
            "key_protected": self.protected,
            "key_bits": self.key_bits,  # the width the keys chose (key_error)
            "query_count": self.key_stream.query_sums.count if self.key_stream else 0,
            "value_width": self.value_width,  # the bits old values chose (value_error; None: not chosen)
            "value_seen": list(self.value_stream.value_seen if self.value_stream else (0, 0)),
            "key_span_seen": list(self.key_stream.span_seen if self.key_stream else (0, 0)),
            "value_bits": self.value_bits if self.value_stream and self.value_stream.widened else None,
            "value_span_seen": list(self.value_stream.span_seen if self.value_stream else (0, 0)),
            "fetch": self.fetch,
            "max_size": self.max_size,
            "n_dropped": self.n_dropped,
            "k_eq_v": self.k_eq_v,
        }
        arrays = {}
        for s in self.streams:
            arrays.update(s.state)
        # the array names are fixed, whether or not the streams exist (zero-wide values have none)
        arrays = {**{f"{side}_{part}": None for side in "kv" for part in STATE_PARTS}, **arrays}
        return meta, arrays

    @state.setter
    def state(self, v):
        try:
            meta, arrays = v
            meta, arrays = dict(meta), dict(arrays)
        except (TypeError, ValueError):
            raise ValueError("TurboQuantKVCache state must be (meta dict, arrays dict)") from None
        try:
            meta = migrated(meta)
            config = TurboQuantConfig.from_dict(meta["config"])
            self.__init__(config, meta["layer_index"], meta["attention_index"], meta["n_attention_layers"])
            self.expected_head_dim = meta["head_dim"]
            counts = {n: check_int(n, meta[n], 0) for n in ("offset", "n_sinks", "n_compressed", "n_window",
                                                             "key_dim", "value_dim")}
            calibrated = bool(meta["calibrated"])
            protected = bool(meta["key_protected"])
            key_bits = meta["key_bits"]  # None: the configured (or protected) bits
            query_count = meta["query_count"]
            query_count = None if query_count is None else check_int("query_count", query_count, 0)
            value_width = meta["value_width"]
            value_seen = meta["value_seen"]
            if not isinstance(value_seen, (list, tuple)) or len(value_seen) != 2:
                raise ValueError(f"TurboQuantKVCache state has value_seen {value_seen!r}; expected [start, end]")
            value_seen = tuple(check_int("value_seen", t, 0) for t in value_seen)
            span_seen = []
            for name in ("key_span_seen", "value_span_seen"):
                seen = meta[name]
                if not isinstance(seen, (list, tuple)) or len(seen) != 2:
                    raise ValueError(f"TurboQuantKVCache state has {name} {seen!r}; expected [start, end]")
                span_seen.append(tuple(check_int(name, t, 0) for t in seen))
            value_bits = meta["value_bits"]  # None: the configured bits
            fetch = meta["fetch"]
            if fetch not in FETCHES:
                raise ValueError(f"TurboQuantKVCache state has fetch {fetch!r}; expected one of {', '.join(FETCHES)}")
            self.fetch = fetch
            max_size = meta["max_size"]
            self.max_size = None if max_size is None else check_max_size(max_size, config)
            n_dropped = check_int("n_dropped", meta["n_dropped"], 0)
            n_decayed = meta["n_decayed"]
            if not isinstance(n_decayed, (list, tuple)) or len(n_decayed) != 2:
                raise ValueError(f"TurboQuantKVCache state has n_decayed {n_decayed!r}; expected [keys, values]")
            n_decayed = [check_int("n_decayed", d, 0) for d in n_decayed]
            self.k_eq_v = bool(meta["k_eq_v"])
        except KeyError as e:
            raise ValueError(f"TurboQuantKVCache state is missing {e}") from None

        def bad(msg):
            return ValueError(f"{self._where()}: invalid state: {msg}")

        names = {f"{side}_{part}" for side in "kv" for part in STATE_PARTS}
        unknown = set(arrays) - names
        if unknown:
            raise ValueError(f"{self._where()}: unknown state arrays {sorted(unknown)}")
        n_s, n_c, n_w = counts["n_sinks"], counts["n_compressed"], counts["n_window"]
        if counts["offset"] != n_s + n_c + n_w + n_dropped:
            raise bad(f"offset {counts['offset']} != n_sinks + n_compressed + n_window + n_dropped")
        if n_dropped and self.max_size is None:
            raise bad(f"{n_dropped} dropped tokens without a max_size")
        self.n_dropped = n_dropped
        window = config.window if calibrated else config.first_window  # the calibration tokens wait in the window
        if n_s > config.sinks or n_w > window:
            raise bad(f"{n_s} sinks / {n_w} window tokens exceed the config's {config.sinks} / {window}")
        if calibrated != (n_c > 0):
            raise bad("compressed tokens without calibration" if n_c else "calibration without compressed tokens")
        if protected and not (n_c and config.protect_factor is not None):
            raise bad("protected keys without compressed tokens or a protect_factor")
        self.offset = counts["offset"]
        if counts["key_dim"] == 0:
            if self.offset or any(a is not None for a in arrays.values()):
                raise bad("arrays but no head_dim")
            return
        self._make_streams(counts["key_dim"], counts["value_dim"])
        if protected:
            if self.key_stream.protect is None:
                raise bad(f"protected keys, but K{self.key_bits:g} keys do not protect at "
                          f"protect_bits={config.protect_bits:g}")
            self.key_stream.set_protected(True)
        elif key_bits is not None and key_bits != self.key_bits:
            widen = self.key_stream.widen
            widths = () if widen is None else widen.widths(self.key_bits)
            if not n_c or key_bits not in widths:
                raise bad(f"keys at {key_bits!r} bits: K{self.key_bits:g} keys widen only with key_error or key_output_error and compressed "
                          f"tokens, to {', '.join(map(format_bits, widths or (self.key_bits, WIDEST_KEY_BITS)))} bits")
            self.key_stream.set_bits(check_bits(key_bits, allowed=QUANTIZER_BITS))
        if value_bits is not None and value_bits != self.value_bits:
            v = self.value_stream
            widths = () if v is None or v.widen is None else v.widen.widths(self.value_bits)
            if not n_c or value_bits not in widths:
                raise bad(f"values at {value_bits!r} bits: V{self.value_bits:g} values take other bits only with "
                          f"value_output_error and compressed tokens, "
                          f"{', '.join(map(format_bits, widths)) + ' bits' if widths else 'none here'}")
            v.set_bits(check_bits(value_bits, allowed=QUANTIZER_BITS))
        if value_width is not None:
            v = self.value_stream
            if v is None or v.value_sums is None or not n_c or value_width not in (*v.value_sums.widths, self.value_bits):
                raise bad(f"values decaying to {value_width!r} bits: only value_error chooses, with compressed tokens, "
                          f"among {', '.join(map(str, v.value_sums.widths)) if v and v.value_sums else 'none'} and "
                          f"V{self.value_bits:g}")
            v.set_value_width(value_width)
        bh = batch_heads(arrays, "k")
        try:
            for s, d, seen in zip(self.streams, n_decayed, span_seen):
                if d > n_c:
                    raise ValueError(f"{s.name}: {d} decayed of {n_c} compressed tokens")
                s.load_state(arrays, n_s, n_c - d, n_w, bh, d, n_dropped, query_count, value_seen, seen)
        except ValueError as e:
            raise bad(str(e)) from None
