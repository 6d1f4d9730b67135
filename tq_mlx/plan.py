"""One plan per layer: what each stream of an attention layer holds and does, and its bytes at N tokens.

`layer_plan(config, ...)` is the one function that turns a TurboQuantConfig and the facts of one layer (its
place among the attention layers, its fetch, K=V, whether its RoPE can be read) into a frozen LayerPlan: the
bits each side starts at, the widest its keys may take (key_error) or protect at, the bits and age its old
tokens decay at, the window, sinks, compress block and step, whether keys are weighed and centered (before
RoPE or not), the norms, and whether values choose their decay bits or their width by their error. TurboQuantKVCache builds its
streams from it (tq_mlx.stream.compressed reads a StreamPlan) and the planner prices it (`layer_bytes`, tq_mlx.planner.memory):
neither derives a per-layer rule of its own, so a rule changes in one place.

Pure: no array is built here; bytes come from tq_mlx.layout's arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import mlx.core as mx

from .config import DECAY_FLOOR, NARROWEST_KEY_BITS, NARROWEST_VALUE_BITS, WIDEST_KEY_BITS, TurboQuantConfig
from .layout import stream_bytes, widened_decay
from .quant.quantizer import LOG_NORM_DTYPES, PROD_BITS


class Protect(NamedTuple):
    """Key protection: quantize at `bits` when the calibration's bias_outlier_factor exceeds `factor` (tested on
    the keys turned back by their RoPE where before_rope: config.protect_before_rope, keys centered before RoPE)."""

    factor: float
    bits: float
    before_rope: bool = False


class Widen(NamedTuple):
    """Widths by error: keys take the fewest bits up to `max_bits` whose logit error on the calibration queries is
    at most `target` (config.key_error, calibration.key_width), or with `least` (config.key_output_error) the fewest
    from `least` whose attention-output error on the first window's last third of queries is (output_errors);
    values (config.value_output_error) take the fewest from `least` up to their bits by that output error."""

    target: float
    max_bits: int
    step: float = 1  # 0.5 (config.key_half_steps): half steps too, the extra half bit on a quarter of the channels
    least: int | None = None  # keys by their output error: the narrowest width (None: by their logit error)

    @property
    def output(self) -> bool:
        return self.least is not None

    def widths(self, bits: float) -> tuple[float, ...]:
        """Every width keys configured at `bits` may take: bits (or `least`), then steps of `step` up to max_bits."""
        start = bits if self.least is None else min(self.least, bits)
        n = int(round((self.max_bits - start) / self.step))
        return tuple(int(w) if w == int(w) else w for w in (start + i * self.step for i in range(n + 1)))


class Narrow(NamedTuple):
    """Values by their error (config.value_error): tokens older than `age` decay to the fewest bits from `least`
    (config.value_widths) whose attention-output error on the window's queries is at most `target`
    (tq_mlx.stream.values), or keep theirs."""

    target: float
    age: int
    least: int = DECAY_FLOOR["value"]


@dataclass(frozen=True)
class StreamPlan:
    """What one stream (one side of a layer) holds and does; tq_mlx.stream.compressed.CompressedStream follows it.

    bits, qjl: its codes at the start. decay (age, bits): compressed tokens older than `age` re-coded at `bits`
    (None: never; decay_at gives the bits for codes of another width). protect: keys that protect themselves
    at calibration (codes at protect.bits that do not decay). widen: keys that choose their width by their error
    (only weighed keys: the error is measured on their queries). narrow: values that choose the bits they decay
    to. center: a mean subtracted per head; rope: the keys' mean taken before RoPE (the layer's RoPE read off the
    model). weigh: keys coded times weights from the queries. seed: the rotations' seed.
    """

    name: str
    bits: float
    qjl: bool
    seed: int
    norm_bits: int
    sinks: int
    window: int
    compress_block: int
    step: int
    center: bool = False
    rope: bool = False
    weigh: bool = False
    decay: tuple[int, int] | None = None
    protect: Protect | None = None
    widen: Widen | None = None
    narrow: Narrow | None = None
    correct_norms: bool = False  # norms stored so the decoded vector's norm is exact (config.correct_norms)
    norm_steps: int = 32  # the 8-bit norms' code: 32 steps an octave (int8) or 16 (uint8; config.norm_steps)
    as_decode: bool = False  # prefill queries read the stream as a decode step would (config.prefill_as_decode)
    first_window: int = 0  # the tokens the first compression waits for and calibrates on, if more than the window
    trellis: bool = False  # MSE codes of 2-6 bits as a trellis's (config.trellis; tq_mlx.quant.trellis)

    @property
    def calibration(self) -> int:
        """Tokens after the sinks the first compression waits for and calibrates on (config.first_window)."""
        return max(self.window, self.first_window)

    @property
    def least_value_bits(self) -> float | None:
        """The fewest bits values that choose by their error may take (narrow: old values' decay, widen: their width);
        None where the stream does not choose."""
        choice = self.narrow if self.narrow is not None else self.widen if self.name == "v" else None
        return None if choice is None else choice.least

    @property
    def decay_bits(self) -> int | None:
        return None if self.decay is None else self.decay[1]

    def decay_at(self, bits: float) -> int | None:
        """The bits codes at `bits` decay to (layout.widened_decay: K4 -> K3 becomes K6 -> K5 for keys widened by
        their error); None where the stream does not decay."""
        return None if self.decay is None else widened_decay(self.decay[1], self.bits, bits)

    @property
    def norm_dtype(self) -> mx.Dtype:
        """How stored norms are kept (quantizer.NORM_DTYPES): float16, or at norm_bits 8 the int8 fine log code
        (norm_steps 32) or the uint8 coarse one (16)."""
        return mx.float16 if self.norm_bits == 16 else LOG_NORM_DTYPES[self.norm_steps]


@dataclass(frozen=True)
class LayerPlan:
    """What one attention layer's cache holds: its fetch (tq_mlx.models.architectures; K=V layers "float"), its key
    stream, its value stream (None for K=V: the key stream holds the values and serves both sides), and the
    configured bits of the layer (`bits`: boundary layers have their own)."""

    config: TurboQuantConfig
    fetch: str
    k_eq_v: bool
    bits: tuple[float, float]
    keys: StreamPlan
    values: StreamPlan | None

    @property
    def bound_floor(self) -> int:
        """The least max_kv_size: the float sinks and window are never dropped (config.bound_floor)."""
        return self.config.bound_floor

    @property
    def decay_bits(self) -> tuple[int | None, int | None]:
        """(keys, values): the bits old tokens decay to at the start (None: that side does not decay)."""
        return self.keys.decay_bits, None if self.values is None else self.values.decay_bits

    @property
    def streams(self) -> tuple[StreamPlan, ...]:
        return tuple(s for s in (self.keys, self.values) if s is not None)


def layer_seed(seed: int, layer_index: int, side: int) -> int:
    """The rotation/projection seed of one side (0 keys, 1 values) of one layer. Groups of a fractional-bit
    quantizer use seed and seed + 1, so seeds are spaced by 8."""
    return (seed * 100_003 + layer_index) * 16 + 8 * side


def layer_plan(config: TurboQuantConfig, attention_index: int = 0, n_attention_layers: int | None = None, *,
               fetch: str = "codes", k_eq_v: bool = False, rope: bool = False, layer_index: int = 0) -> LayerPlan:
    """The plan of one attention layer: attention_index among n_attention_layers (None: not a boundary layer),
    its fetch, whether its values are its keys (K=V), whether its RoPE was read off the model (rope), and the
    model layer (layer_index: seeds). Every per-layer rule of the cache is here.

    - Boundary layers (config.boundary_layers) take boundary_bits on their boundary_sides, which do not decay.
    - A latent layer's "values" are its rope key, which scores like a key: key bits, centered, the key's decay.
    - Keys are weighed, and so may widen by their error, only where attention takes the cache's views ("codes").
    - Values choose their decay bits by their error (value_error) only in "codes" layers that decay, or their
      width by their output error (value_output_error) only in "codes" layers whose values are not boundary ones.
    - Keys are centered before RoPE where the layer's RoPE is known, in per-head layers (not latent, not K=V).
    """
    c = config
    fetch = "float" if k_eq_v else fetch
    latent = fetch == "latent"
    n = c.boundary_layers
    boundary = bool(n) and n_attention_layers is not None and (
        attention_index < n or attention_index >= n_attention_layers - n)
    k_edge, v_edge = (boundary and "k" in c.boundary_sides), (boundary and "v" in c.boundary_sides)
    kb = max(c.key_bits, c.boundary_bits) if k_edge else c.key_bits
    vb = max(c.value_bits, c.boundary_bits) if v_edge else c.value_bits
    kd, vd = None if k_edge else c.decay_key_bits, None if v_edge else c.decay_value_bits  # (None without decay_after)
    age = c.decay_after
    tokens = dict(sinks=c.sinks, window=c.window, first_window=c.first_window, compress_block=c.compress_block_size,
                  step=c.step,
                  norm_bits=c.norm_bits, norm_steps=c.norm_steps, trellis=c.trellis,
                  # without a window every query reads codes alone: the plain view's causal mask is decode's
                  as_decode=c.prefill_as_decode and fetch == "codes" and c.window > 0)
    # each side's norms corrected (config.correct_norms: both, neither or one side); the streams that score as keys
    # (a latent layer's rope key, a K=V layer's one stream) follow the keys
    correct = {side: c.correct_norms in (True, name) for side, name in (("k", "keys"), ("v", "values"))}
    weigh = c.weigh_keys and fetch == "codes"
    target = c.key_error if c.key_error is not None else c.key_output_error
    widens = target is not None and kb == c.key_bits and kb < WIDEST_KEY_BITS and weigh
    protects = c.protect_factor is not None and c.protect_bits > kb
    key_rope = rope and c.center_keys == "rope" and not k_eq_v and not latent
    keys = StreamPlan("k", kb, c.qjl and kb in PROD_BITS, layer_seed(c.seed, layer_index, 0),
                      center=bool(c.center_keys), rope=key_rope,
                      weigh=weigh, decay=None if kd is None else (age, kd),
                      protect=Protect(c.protect_factor, c.protect_bits,
                                      c.protect_before_rope and key_rope) if protects else None,
                      widen=Widen(target, WIDEST_KEY_BITS, 0.5 if c.key_half_steps else 1,
                                  None if c.key_output_error is None else NARROWEST_KEY_BITS) if widens else None,
                      correct_norms=correct["k"], **tokens)
    values = None
    if latent:  # the rope key: key bits, centered like keys, decaying at the key's decay bits
        values = StreamPlan("v", kb, False, layer_seed(c.seed, layer_index, 1), center=bool(c.center_keys),
                            decay=keys.decay, correct_norms=correct["k"], **tokens)
    elif not k_eq_v:
        narrows = c.value_error is not None and c.decay_after is not None and not v_edge and fetch == "codes"
        chooses = c.value_output_error is not None and not v_edge and fetch == "codes"
        values = StreamPlan("v", vb, False, layer_seed(c.seed, layer_index, 1), center=c.center_values,
                            # with value_error, vd is the least narrowing takes: layers that do not narrow keep theirs
                            decay=None if vd is None or c.value_error is not None else (age, vd),
                            narrow=Narrow(c.value_error, age, c.narrowest_value_bits) if narrows else None,
                            widen=Widen(c.value_output_error, vb, 0.5, NARROWEST_VALUE_BITS) if chooses else None,
                            correct_norms=correct["v"], **tokens)
    return LayerPlan(c, fetch, k_eq_v, (kb, vb), keys, values)


def layer_bytes(plan: LayerPlan, tokens: int, n_kv_heads: int, key_dim: int, value_dim: int, *, batch: int = 1,
                float_bytes: int = 2, max_kv_size: int | None = None, rope_pairs: int | None = None,
                protected: bool = False, key_width: float | None = None, value_width: int | None = None,
                query_heads: int = 1, shared: dict | None = None) -> int:
    """TurboQuantKVCache.nbytes of a layer built from `plan` after `tokens` tokens (filled in one prefill or
    token by token; bounded caches token by token), each stream priced by layout.stream_bytes.

    What a plan cannot know until the layer's first compression is given: protected (the keys protected
    themselves), key_width (the width the keys chose by their error; None: their bits), value_width (the bits
    old values chose to decay to, or their own bits: kept; values by their output error: the width they chose; None:
    not chosen yet). rope_pairs: the channel pairs the layer's RoPE rotates (priced where the plan centers keys
    before RoPE). value_dim 0: zero-wide values (an indexer's keys-only cache), no value stream. query_heads: query
    heads per kv head (keys and values by their output error hold the queries of their first window's last third
    until their first compression). shared: a dict that collects the quantizers' shared constants
    (layout.constant_bytes) for a caller that counts each once over several layers; None: the layer's, each once."""
    k, v, c = plan.keys, plan.values, plan.config
    held = {} if shared is None else shared
    common = dict(max_kv_size=max_kv_size, float_bytes=float_bytes, batch=batch, heads=n_kv_heads, shared=held)
    total = stream_bytes(c, tokens, key_dim, k.bits, qjl=k.qjl, decay_bits=k.decay_bits, protected=protected,
                         widened=key_width, center=k.center, weigh=k.weigh, rope_pairs=rope_pairs if k.rope else None,
                         span_heads=query_heads if k.widen is not None and k.widen.output else None, **common)
    if v is not None and value_dim:
        chooses = v.widen is not None
        total += stream_bytes(c, tokens, value_dim, v.bits, decay_bits=v.decay_bits, center=v.center,
                              narrow=value_width if v.narrow is not None else None,
                              widened=value_width if chooses else None,
                              span_heads=query_heads if chooses else None, span_dim=key_dim, **common)
    return total + (sum(held.values()) if shared is None else 0)
