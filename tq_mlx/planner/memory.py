"""Bytes held and planned: what a prompt cache holds, what a context would cost, what the machine has.

* `cache_bytes(prompt_cache)`: bytes the caches actually hold (tq_mlx.cache.held_bytes: their `nbytes`, the
  constants TurboQuant layers share counted once) against what mlx-lm's own `KVCache` would allocate for the same
  tokens in the model's dtype, and how much of the context is still in TurboQuant's float window
  (tq_mlx.planner.display words it for the tq-chat panel and tq-generate's summary).
* `estimate_kv_bytes(model_config, ctx, config)`: the same figure before any model is loaded, from config.json,
  for float16, mlx-lm's affine `--kv-bits` cache, or a TurboQuantConfig. TurboQuant layers are priced by
  tq_mlx.layout (the storage rules the streams follow, no quantizer built; shared constants once) and equal
  `held_bytes` of the caches exactly when the cache was filled in one prefill or token by token (chunked prefill can
  add up to one `step` of padding per chunk), temporal decay and bounds included. `estimate_peak_bytes` adds the
  weights and the transient of a prefill chunk; `max_context` is the largest context whose peak fits a budget.

"Saved" has one meaning everywhere (SAVED_AGAINST): against mlx-lm's own cache for the same tokens, as mlx-lm
allocates it: a KVCache in the model's dtype, in whole 256-token steps (a RotatingKVCache of max_kv_size tokens
when bounded); `Saving` is the one computation (cache_bytes's saved_bytes and ratio, the plan's, the panel's and
the summary's). `estimate_mlx_lm_bytes` is that reference before any model is loaded. Float16 references
(`fp16_bytes`, estimate_kv_bytes with config None: the README's tables) count exactly 2 · n_kv_heads · head_dim ·
2 bytes per token and attention layer, without KVCache's buffer padding.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterable, NamedTuple, Sequence

import mlx.core as mx

from ..models.architectures import attention_layout, text_config
from ..attention.reference import tile_size
from ..cache import TurboQuantKVCache, held_bytes
from ..config import check_max_size
from ..layout import token_layout
from ..plan import LayerPlan, layer_bytes, layer_plan
from ..quant.quantizer import PROD_BITS

FLOAT16_BYTES = 2
SAVED_AGAINST = "against mlx-lm's own cache for the same tokens (KVCache in the model's dtype, 256 tokens at a time)"


class Saving(NamedTuple):
    """What TurboQuant saves, SAVED_AGAINST: `held` bytes against mlx-lm's `reference` bytes for the same tokens.
    The one computation of "saved" and its ratio, for a live cache (cache_bytes) and a plan alike."""

    held: int
    reference: int

    @property
    def saved(self) -> int:
        """reference - held: negative while TurboQuant's float window and constants outweigh mlx-lm's buffers."""
        return self.reference - self.held

    @property
    def ratio(self) -> float:
        """reference / held (1.0 when nothing is held)."""
        return self.reference / self.held if self.held else 1.0

# --- per-layer sizes -----------------------------------------------------------------------------------


def float16_kv_bytes(tokens: int, n_kv_heads: int, head_dim: int, v_head_dim: int | None = None, batch: int = 1) -> int:
    """What a float16 KVCache holds for `tokens` tokens of one layer (no buffer padding)."""
    v = head_dim if v_head_dim is None else v_head_dim
    return batch * n_kv_heads * tokens * (head_dim + v) * FLOAT16_BYTES


def affine_kv_bytes(
    tokens: int, n_kv_heads: int, head_dim: int, v_head_dim: int | None = None, bits: int = 4,
    group_size: int = 64, batch: int = 1,
) -> int:
    """mlx-lm's QuantizedKVCache (`--kv-bits`) for one layer: per group of `group_size` values,
    bits·group_size/8 bytes of codes plus a float16 scale and a float16 bias (no buffer padding)."""
    v = head_dim if v_head_dim is None else v_head_dim

    def side(d: int) -> int:
        groups = -(-d // group_size)
        return groups * (bits * group_size // 8 + 2 * FLOAT16_BYTES)

    return batch * n_kv_heads * tokens * (side(head_dim) + side(v))


def bounded_tokens(ctx: int, max_kv_size: int | None, config) -> tuple[int, int, int]:
    """(sinks, compressed, window) tokens a TurboQuantKVCache holds after ctx tokens (bounded to max_kv_size:
    fed token by token, as decoding does; layout.token_layout has the rule)."""
    t = token_layout(config, ctx, max_kv_size)
    return t.sinks, t.compressed, t.window


def decayed_tokens(ctx: int, max_kv_size: int | None, config) -> int:
    """Compressed tokens a decaying stream (config.decay_after) holds at the decay bits after ctx tokens; 0
    without decay (layout.token_layout)."""
    return token_layout(config, ctx, max_kv_size).decayed


def turboquant_layer_bytes(
    tokens: int, n_kv_heads: int, key_dim: int, value_dim: int, key_bits: float, value_bits: float,
    config, batch: int = 1, float_bytes: int = FLOAT16_BYTES, max_kv_size: int | None = None,
    latent: bool = False, k_eq_v: bool = False, protected: bool = False,
    decay_bits: tuple[int | None, int | None] | None = None, rope_pairs: int | None = None,
    weighted: bool | None = None, key_width: float | None = None, value_width: float | None = None,
    query_heads: int = 1, shared: dict | None = None,
) -> int:
    """TurboQuantKVCache.nbytes for one layer after `tokens` tokens (filled in one prefill or token by token;
    bounded caches token by token): tq_mlx.plan.layer_bytes of the plan of a layer of this kind (latent, K=V,
    RoPE-centered where rope_pairs is given), its bits and decay as given.

    key_bits, value_bits: the layer's configured bits (a latent layer's rope key takes key_bits). decay_bits =
    (keys, values): the bits its old tokens decay to (None: the plan's, a middle layer's). weighted: the keys
    are weighed by the queries (None: as the plan says). protected, key_width, value_width: what the layer chose
    at its first compression, and query_heads the query heads per kv head; shared collects the shared constants
    (plan.layer_bytes).
    """
    plan = layer_plan(config, fetch="latent" if latent else "codes", k_eq_v=k_eq_v, rope=rope_pairs is not None)
    kd, vd = plan.decay_bits if decay_bits is None else decay_bits
    age = config.decay_after
    keys = replace(plan.keys, bits=key_bits, qjl=config.qjl and key_bits in PROD_BITS,
                   decay=None if kd is None else (age, kd),
                   weigh=plan.keys.weigh if weighted is None else weighted)
    values = plan.values
    if latent:
        values = replace(values, bits=key_bits, decay=keys.decay)
    elif values is not None:
        values = replace(values, bits=value_bits, decay=None if vd is None else (age, vd),
                         narrow=values.narrow if value_width is not None else None,
                         widen=values.widen if value_width is not None else None)
    plan = replace(plan, keys=keys, values=values)
    return layer_bytes(plan, tokens, n_kv_heads, key_dim, value_dim, batch=batch, float_bytes=float_bytes,
                       max_kv_size=max_kv_size, rope_pairs=rope_pairs, protected=protected, key_width=key_width,
                       value_width=value_width, query_heads=query_heads, shared=shared)


FLOAT_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


def kv_float_dtype(model_config: dict, dtype: str | None = None) -> str:
    """The float dtype of the model's keys and values: `dtype` (what --dtype casts to) if given, else the config's
    torch_dtype, else float16."""
    name = dtype or model_config.get("torch_dtype") or text_config(model_config).get("torch_dtype") or "float16"
    if name not in FLOAT_BYTES:
        if dtype is not None:
            raise ValueError(f"dtype must be one of {', '.join(FLOAT_BYTES)}, got {dtype!r}")
        name = "float16"  # a config's unusual torch_dtype: the weights' dtype, not a KV dtype
    return name


def kv_float_bytes(model_config: dict, dtype: str | None = None) -> int:
    """Bytes per value of the model's keys and values (kv_float_dtype)."""
    return FLOAT_BYTES[kv_float_dtype(model_config, dtype)]


def estimate_kv_bytes(
    model_config: dict, ctx: int, config=None, *, kv_bits: int | None = None, kv_group_size: int = 64,
    batch: int = 1, dtype: str | None = None, max_kv_size: int | None = None,
    key_widths: Sequence[float | None] | None = None, value_widths: Sequence[float | None] | None = None,
) -> int:
    """KV cache bytes at `ctx` tokens for a model's config.json dict.

    config: a TurboQuantConfig (boundary layers included), or None for float16, or None with kv_bits for
    mlx-lm's affine QuantizedKVCache. Only full-attention layers grow with the context, each with its layout's
    geometry (per-head keys and values, or MLA's latent + rope key, as mlx-lm caches them: the same layout for
    every column); sliding-window layers hold min(ctx, window) float tokens with their own geometry (float16 in
    the references, the model's dtype next to TurboQuant, as RotatingKVCache holds); KV-shared layers hold
    nothing; linear-attention state (fixed size) is not counted. TurboQuant's float sinks and window hold the
    model's dtype (kv_float_bytes: `dtype`, else torch_dtype). Temporal decay (config.decay_after) is priced per
    layer (tq_mlx.plan.layer_plan: a boundary layer's boundary sides do not decay), as turboquant_layer_bytes says.

    max_kv_size: a bounded cache. The references hold min(ctx, max_kv_size) tokens per full layer (mlx-lm's
    RotatingKVCache, decoding); TurboQuant follows layout.token_layout (decoding token by token).

    Keys by their error (config.key_error) choose their bits at calibration, from their own tokens and queries:
    key_widths gives each attention layer's choice (chosen_key_widths of a live cache; None: the layer kept its
    bits), and without it every layer that may widen is priced at WIDEST_KEY_BITS, so the estimate bounds the
    cache (it equals it when every layer took the most) but for layers whose keys protect themselves at
    protect_bits (chosen by their calibration tokens, which no plan knows): each adds protect_layer_bytes. Values by their error (config.value_error) choose the
    bits they decay to once the window's last queries came, and values by their output error
    (config.value_output_error) their width at their first compression: value_widths gives each attention layer's
    choice (chosen_value_widths; None: not chosen), and a layer without one is priced at its value bits, the most.
    """
    if ctx < 0:
        raise ValueError(f"ctx must be >= 0, got {ctx}")
    if max_kv_size is not None and max_kv_size < 1:
        raise ValueError(f"max_kv_size must be a positive number of tokens or None, got {max_kv_size}")
    if max_kv_size is not None and config is not None:
        check_max_size(max_kv_size, config)
    float_bytes = kv_float_bytes(model_config, dtype)
    lay = attention_layout(model_config)
    H, dk, dv = lay.n_kv_heads, lay.head_dim, lay.v_head_dim
    Hs, sk, sv = lay.sliding_geometry
    sliding_bytes = float_bytes if config is not None else FLOAT16_BYTES
    total = sum(float16_kv_bytes(min(ctx, w), Hs, sk, sv, batch) for _, w in lay.sliding_layers)
    total = total * sliding_bytes // FLOAT16_BYTES
    n_att = len(lay.full_layers)
    ref_tokens = ctx if max_kv_size is None else min(ctx, max_kv_size)
    if key_widths is not None and len(key_widths) != n_att:
        raise ValueError(f"key_widths has {len(key_widths)} entries, the model {n_att} attention layers")
    if value_widths is not None and len(value_widths) != n_att:
        raise ValueError(f"value_widths has {len(value_widths)} entries, the model {n_att} attention layers")
    shared: dict = {}  # the quantizers' codebooks and tables: every layer's caches hold one of each
    for a in range(n_att):
        if config is not None:
            plan = model_layer_plan(config, lay, a, n_att)
            width = v_width = None
            if plan.keys.widen is not None:
                width = plan.keys.widen.max_bits if key_widths is None else key_widths[a]
            if plan.values is not None and plan.values.least_value_bits is not None:
                v_width = plan.values.bits if value_widths is None or value_widths[a] is None else value_widths[a]
            total += layer_bytes(plan, ctx, H, dk, dv, batch=batch, float_bytes=float_bytes, max_kv_size=max_kv_size,
                                 rope_pairs=lay.rope_pairs, key_width=width, value_width=v_width,
                                 query_heads=max(1, lay.n_heads // max(H, 1)), shared=shared)
        elif kv_bits is not None:
            total += affine_kv_bytes(ref_tokens, H, dk, dv, kv_bits, kv_group_size, batch)
        else:
            total += float16_kv_bytes(ref_tokens, H, dk, dv, batch)
    return total + sum(shared.values())


def model_layer_plan(config, lay, attention_index: int, n_attention_layers: int) -> LayerPlan:
    """The plan of one attention layer of a model whose config.json reads as `lay` (attention_layout): what
    make_prompt_cache builds for it (tq_mlx.plan.layer_plan with the layout's fetch, K=V and RoPE)."""
    return layer_plan(config, attention_index, n_attention_layers, fetch=lay.fetch, k_eq_v=lay.k_eq_v,
                      rope=lay.rope_pairs is not None)


def chosen_value_widths(prompt_cache: Iterable[Any]) -> list[float | None]:
    """Each TurboQuant attention layer's value bits chosen by their error: the bits old values decay to
    (value_error) or the values' width (value_output_error, once chosen at the first compression); None: not
    chosen, or the layer does not choose. In layer order: estimate_kv_bytes's value_widths for this cache."""
    return [c.value_bits if c.value_stream is not None and c.value_stream.width_chosen else c.value_width
            for c in flat_caches(prompt_cache) if hasattr(c, "key_stream")]


def chosen_key_widths(prompt_cache: Iterable[Any]) -> list[float | None]:
    """Each TurboQuant attention layer's key width chosen by its error (None: it kept its bits, or has not
    calibrated yet), in layer order: estimate_kv_bytes's key_widths for this cache."""
    return [c.key_bits if c.key_stream is not None and c.key_stream.widened else None
            for c in flat_caches(prompt_cache) if hasattr(c, "key_stream")]


def estimate_mlx_lm_bytes(model_config: dict, ctx: int, *, dtype: str | None = None, batch: int = 1,
                          max_kv_size: int | None = None) -> int:
    """What mlx-lm's own cache holds at ctx tokens (decoding token by token), the reference of every saving
    (SAVED_AGAINST): each full layer a KVCache in the model's dtype in whole 256-token steps (bounded: a
    RotatingKVCache of max_kv_size tokens); sliding-window layers as estimate_kv_bytes counts them next to
    TurboQuant (they are float in both); cache_bytes's mlx_lm_bytes for the same state."""
    F = kv_float_bytes(model_config, dtype)
    lay = attention_layout(model_config)
    Hs, sk, sv = lay.sliding_geometry
    total = sum(float16_kv_bytes(min(ctx, w), Hs, sk, sv, batch) for _, w in lay.sliding_layers) * F // FLOAT16_BYTES
    layer = mlx_lm_kv_bytes(ctx, lay.n_kv_heads, lay.head_dim, lay.v_head_dim, F, batch, max_kv_size)
    return total + len(lay.full_layers) * layer


def planned_saving(model_config: dict, ctx: int, config, *, dtype: str | None = None, batch: int = 1,
                   max_kv_size: int | None = None, key_widths: Sequence[float | None] | None = None,
                   value_widths: Sequence[float | None] | None = None) -> Saving:
    """The Saving a plan shows at ctx: estimate_kv_bytes with `config` (a TurboQuantConfig; None: mlx-lm's float
    cache, which saves nothing; key_widths and value_widths as estimate_kv_bytes takes them) against
    estimate_mlx_lm_bytes."""
    reference = estimate_mlx_lm_bytes(model_config, ctx, dtype=dtype, batch=batch, max_kv_size=max_kv_size)
    if config is None:
        return Saving(reference, reference)
    return Saving(estimate_kv_bytes(model_config, ctx, config, batch=batch, dtype=dtype, max_kv_size=max_kv_size,
                                    key_widths=key_widths, value_widths=value_widths), reference)


def protect_layer_bytes(model_config: dict, ctx: int, config, *, dtype: str | None = None, batch: int = 1,
                        max_kv_size: int | None = None) -> int:
    """What one attention layer adds at ctx if its keys protect themselves (config.protect_bits, chosen by the
    layer's own calibration tokens, so a plan can only price one): its key stream at protect_bits, its values
    unchanged (a latent layer's rope key keeps the key bits), and the stream keeps its configured quantizer's
    constants next to the protecting one. Protected keys do not decay (config.decay_after): with decay this is
    also the decayed key codes turned back into protect_bits codes. 0 where the middle layer's keys do not
    protect (protection off, or not above the key bits)."""
    plan = _middle_plan(model_config, config)
    if plan is None or plan.keys.protect is None:
        return 0
    # beyond what the estimate priced the layer at: the most its keys may widen to, where they may
    base = {"key_width": plan.keys.widen.max_bits} if plan.keys.widen is not None else {}
    return _layer_extra(model_config, ctx, plan, dtype, batch, max_kv_size, base, protected=True)


def widen_layer_bytes(model_config: dict, ctx: int, config, *, dtype: str | None = None, batch: int = 1,
                      max_kv_size: int | None = None) -> int:
    """What one attention layer's keys hold at ctx at the most bits key_error gives (WIDEST_KEY_BITS) beyond their
    key_bits: the widened codes, decaying by the configured step, and the widened quantizers' constants. Each
    layer chooses by its own calibration tokens and queries, so estimate_kv_bytes prices the most and overstates
    a layer that keeps its bits by this. 0 where keys do not widen (no key_error, unweighed, latent, K=V)."""
    plan = _middle_plan(model_config, config)
    if plan is None or plan.keys.widen is None:
        return 0
    return -_layer_extra(model_config, ctx, plan, dtype, batch, max_kv_size, {"key_width": plan.keys.widen.max_bits})


def narrow_layer_bytes(model_config: dict, ctx: int, config, *, dtype: str | None = None, batch: int = 1,
                       max_kv_size: int | None = None) -> int:
    """What one attention layer's values hold at ctx keeping their bits beyond decaying to the fewest value_error
    gives them (config.narrowest_value_bits: decay_value_bits, else 2), or beyond the fewest value_output_error gives
    them (NARROWEST_VALUE_BITS, at every age). Each layer chooses by its own window's queries, so estimate_kv_bytes
    prices them kept and overstates a layer that takes the fewest by this. 0 where values do not choose (neither
    target, a layer whose attention does not take the cache's views, latent, K=V)."""
    plan = _middle_plan(model_config, config)
    v = None if plan is None else plan.values
    if v is None or v.least_value_bits is None or not attention_layout(model_config).v_head_dim:
        return 0
    return -_layer_extra(model_config, ctx, plan, dtype, batch, max_kv_size, {"value_width": v.bits},
                         value_width=v.least_value_bits)


def _middle_plan(model_config: dict, config) -> LayerPlan | None:
    """The plan of the middle attention layer (boundary layers have their own bits), None without one."""
    lay = attention_layout(model_config)
    n_att = len(lay.full_layers)
    return model_layer_plan(config, lay, n_att // 2, n_att) if n_att else None


def _layer_extra(model_config: dict, ctx: int, plan: LayerPlan, dtype, batch: int, max_kv_size, base: dict,
                 **change) -> int:
    """The bytes a layer of `plan` adds at ctx with `change` (a keyword of plan.layer_bytes) over `base`
    (keywords too). A shared constant (layout.constant_bytes) the change brings counts in full, and one it no longer
    needs is not taken off (other layers may hold it): what one layer adds is at most this, what it saves (a
    negative figure) at least."""
    lay = attention_layout(model_config)
    args = (ctx, lay.n_kv_heads, lay.head_dim, lay.v_head_dim)
    common = dict(batch=batch, float_bytes=kv_float_bytes(model_config, dtype), max_kv_size=max_kv_size)
    held, base_held = {}, {}
    # the keys' RoPE is not priced here: it is the same with and without the change
    extra = layer_bytes(plan, *args, **change, **common, shared=held) - layer_bytes(plan, *args, **base, **common,
                                                                                  shared=base_held)
    return extra + sum(b for k, b in held.items() if k not in base_held)


# --- the peak: weights + KV + the transient of one prefill chunk ---------------------------------------------

# The transient of one prefill chunk of C tokens, beyond weights and KV. Activations: the residual stream and
# its normed copy (2·hidden) and the MLP's gate, up and product (3·intermediate) per token, in the model's
# dtype. Attention: mx.fast.scaled_dot_product_attention on MLX's CPU back end materializes the chunk's
# float32 scores against the whole context (FLOAT_SCORE_COPIES of them, measured), growing with the context;
# TurboQuant attention holds about TQ_SCORE_TILES tiles of scores and softmax temporaries (tq_mlx.attention.reference:
# two MLX streams, each tile scored after the previous merge), flat in the context. Both constants were
# measured on SmolLM2-135M (float32, CPU, 2048-token chunks at 2k-8k: benchmarks/peak.py) and checked on
# Qwen2.5-Coder-0.5B. On Metal, SDPA runs fused (no score matrix): the float figure there is a bound, not a
# measurement; nobody here has measured a Mac.
FLOAT_SCORE_COPIES = 1.1
TQ_SCORE_TILES = 10


def fetch_transient_bytes(model_config: dict, ctx: int, config=None, *, prefill_step: int = 2048,
                          dtype: str | None = None, batch: int = 1, max_kv_size: int | None = None) -> int:
    """Float tensors one layer's attention materializes at ctx beyond the scores (freed after the layer).

    * MLA prefill (mlx-lm's float cache and TurboQuant alike): embed_q(kv_latent) (B, n_heads, T, qk_nope_head_dim)
      and unembed_out(kv_latent) (B, n_heads, T, v_head_dim) over the whole context T, and the rope scores
      pe_scores (B, n_heads, chunk, T) passed as the mask, in the model's dtype (deepseek_v3.py:152-165).
    * TurboQuant "float" fetch (architectures.FLOAT_FETCH) and the latent fetch at prefill: the layer's cache
      decoded to float, B·H·T·(key_dim + value_dim) in the model's dtype.
    * A prefill read as decode (the plan's as_decode): the update's recent tokens (the window before the chunk and
      the chunk, StreamView.recent) joined in float32 and cast to the model's dtype, on each side.
    T is the tokens a prefill chunk attends to: ctx, or with max_kv_size at most max_kv_size - 1 + chunk.
    """
    lay = attention_layout(model_config)
    if not lay.full_layers:
        return 0
    F = kv_float_bytes(model_config, dtype)
    chunk = max(1, min(prefill_step, ctx))
    T = ctx if max_kv_size is None else min(ctx, max_kv_size - 1 + chunk)  # a prefill chunk's keys
    out = 0
    if lay.latent:
        out += batch * lay.n_heads * T * lay.latent_expansion * F + batch * lay.n_heads * chunk * T * F
    if config is not None and (lay.fetch == "float" or lay.latent):
        out += batch * lay.n_kv_heads * T * (lay.head_dim + lay.v_head_dim) * F
    plan = _middle_plan(model_config, config) if config is not None else None
    if plan is not None and any(s.as_decode for s in plan.streams) and ctx > config.first_window + config.sinks:
        recent = min(T, config.first_window + chunk)  # most at the first compression: the calibration tokens wait
        out += batch * lay.n_kv_heads * recent * (lay.head_dim + lay.v_head_dim) * (4 + F)
    return out


def estimate_peak_bytes(
    model_config: dict, ctx: int, config=None, *, weights: int, prefill_step: int = 2048,
    dtype: str | None = None, batch: int = 1, max_kv_size: int | None = None,
) -> int:
    """Peak MLX memory of a prefill of `ctx` tokens in `prefill_step` chunks, then decoding: the weights, the KV
    cache at ctx (estimate_kv_bytes) and the largest transient of one chunk (see FLOAT_SCORE_COPIES), plus what
    one layer's fetch materializes (fetch_transient_bytes: MLA's per-head expansion at prefill, the decode-to-float
    copy of one layer). config: a TurboQuantConfig, or None for mlx-lm's float cache. Models whose TurboQuant
    fetch is float tensors ("float", and "latent" at prefill) score them like the float cache does."""
    lay = attention_layout(model_config)
    chunk = max(1, min(prefill_step, ctx))
    F = kv_float_bytes(model_config, dtype)
    T = ctx if max_kv_size is None else min(ctx, max_kv_size - 1 + chunk)  # a prefill chunk's keys
    activations = batch * chunk * F * (2 * lay.hidden_size + 3 * lay.intermediate_size)
    if config is None or lay.fetch == "float" or lay.latent:
        attention = FLOAT_SCORE_COPIES * batch * lay.n_heads * chunk * T * 4
    else:
        tile = min(tile_size(batch, lay.n_heads, chunk), max(1, token_layout(config, ctx, max_kv_size).compressed))
        attention = TQ_SCORE_TILES * batch * lay.n_heads * chunk * tile * 4
        if lay.sliding_layers or ctx <= config.first_window + config.sinks:
            # float tokens (window, sinks, sliding layers) go through float scores too
            attention = max(attention, FLOAT_SCORE_COPIES * batch * lay.n_heads * chunk * min(
                ctx, max([config.first_window + config.sinks] + [w for _, w in lay.sliding_layers])) * 4)
    attention += fetch_transient_bytes(model_config, ctx, config, prefill_step=prefill_step, dtype=dtype,
                                       batch=batch, max_kv_size=max_kv_size)
    kv = estimate_kv_bytes(model_config, ctx, config, batch=batch, dtype=dtype, max_kv_size=max_kv_size)
    if config is not None and config.first_window > config.window:
        # the calibration tokens wait in float until the first compression: more than the window holds after it
        kv = max(kv, estimate_kv_bytes(model_config, min(ctx, config.sinks + config.first_window), config,
                                       batch=batch, dtype=dtype, max_kv_size=max_kv_size))
    if max_kv_size is not None and ctx > max_kv_size:
        # right after a prefill chunk a bounded cache (and RotatingKVCache) holds up to max_kv_size - 1 + chunk
        kv = max(kv, estimate_kv_bytes(model_config, min(ctx, max_kv_size - 1 + chunk), config, batch=batch,
                                       dtype=dtype))
    if config is None:
        kv = kv * F // FLOAT16_BYTES  # mlx-lm's KVCache holds the model's dtype
    return weights + kv + int(activations + attention)


def max_context(model_config: dict, budget: int, config=None, *, weights: int = 0, prefill_step: int = 2048,
                max_kv_size: int | None = None) -> int:
    """The largest context whose planned peak (estimate_peak_bytes) fits in `budget` bytes; 0 if none does.
    tq-chat's plan and tq-server's default context bound both ask this."""
    lo, hi = 0, 1 << 24
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if estimate_peak_bytes(model_config, mid, config, weights=weights, prefill_step=prefill_step,
                               max_kv_size=max_kv_size) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


# --- what a live prompt cache holds ---------------------------------------------------------------------


def flat_caches(prompt_cache: Iterable[Any]) -> list[Any]:
    """Every cache of a prompt cache, the members of a mlx-lm CacheList in its place."""
    out = []
    for c in prompt_cache:
        inner = getattr(c, "caches", None)  # mlx-lm CacheList
        if isinstance(inner, (list, tuple)):
            out.extend(flat_caches(inner))
        else:
            out.append(c)
    return out


def _kv_geometry(c) -> tuple[int, int, int, int, int] | None:
    """(batch, kv heads, tokens, key_dim, value_dim) of an attention cache, None if empty or not one."""
    if isinstance(c, TurboQuantKVCache):
        bh = c.batch_heads() if c.key_dim else None
        return None if bh is None else (*bh, c.offset, c.key_dim, c.value_dim)
    keys, values = getattr(c, "keys", None), getattr(c, "values", None)
    if keys is None or values is None:
        return None
    if isinstance(keys, (tuple, list)):  # QuantizedKVCache: (packed uint32, scales, biases)
        g = c.group_size
        k_shape, dk, dv = keys[0].shape, keys[1].shape[-1] * g, values[1].shape[-1] * g
    else:
        k_shape, dk, dv = keys.shape, keys.shape[-1], values.shape[-1]
    offset = getattr(c, "offset", k_shape[2])
    tokens = offset if isinstance(offset, int) else k_shape[2]
    max_size = getattr(c, "max_size", None)  # RotatingKVCache keeps at most max_size tokens
    if isinstance(max_size, int):
        tokens = min(tokens, max_size)
    return k_shape[0], k_shape[1], tokens, dk, dv


KVCACHE_STEP = 256  # mlx_lm.models.cache.KVCache.step: its buffers grow 256 tokens at a time


def mlx_lm_kv_bytes(tokens: int, n_kv_heads: int, head_dim: int, v_head_dim: int | None = None,
                    float_bytes: int = FLOAT16_BYTES, batch: int = 1, max_size: int | None = None) -> int:
    """What mlx-lm's own KVCache allocates for `tokens` tokens of one layer: buffers of whole 256-token steps in
    the model's dtype (filled in one prefill, then token by token); max_size: its RotatingKVCache (--max-kv-size),
    whose buffers grow the same way up to max_size tokens (token by token)."""
    v = head_dim if v_head_dim is None else v_head_dim
    capacity = -(-tokens // KVCACHE_STEP) * KVCACHE_STEP
    if max_size is not None:
        capacity = min(capacity, max_size)
    return batch * n_kv_heads * capacity * (head_dim + v) * float_bytes


def _float_dtype(c) -> mx.Dtype | None:
    """The dtype a cache keeps floats in (the model's): TurboQuant's sinks and window, KVCache's keys,
    QuantizedKVCache's scales."""
    if isinstance(c, TurboQuantKVCache):
        held = [a for s in c.streams for a in (getattr(s, "window", None), getattr(s, "sinks", None))]
    else:
        keys = getattr(c, "keys", None)
        held = [keys[1] if isinstance(keys, (tuple, list)) else keys]
    return next((a.dtype for a in held if isinstance(a, mx.array)), None)


def cache_bytes(prompt_cache: Iterable[Any]) -> dict:
    """Bytes a prompt cache (a list of per-layer caches, as mlx-lm builds them) holds, against mlx-lm's own cache.

    Returns a dict:
      kv_bytes       bytes the attention caches hold (TurboQuant, KVCache, QuantizedKVCache, ...): their `nbytes`,
                     the constants TurboQuant layers share counted once (tq_mlx.cache.held_bytes)
      mlx_lm_bytes   what mlx-lm's own caches would hold for the same tokens: a KVCache's real allocation (whole
                     256-token steps, the model's dtype) for each compressed or quantized layer, the cache's own
                     nbytes for the layers that stay float
      kv_dtype       the model's dtype the float tokens are kept in ("float32"; None for an empty cache)
      float_tokens, compressed_tokens   TurboQuant layers: tokens still in float (sinks + window) and compressed
                     (decayed ones included), the most of any layer
      decayed_tokens TurboQuant layers: compressed tokens re-coded at the decay bits (config.decay_after), the most
                     of any layer and side
      sinks, window  TurboQuant layers: the config's float sinks and window, also before the first token (None
                     without TurboQuant layers)
      calibration    TurboQuant layers: the tokens after the sinks the first compression waits for (config.first_window:
                     the window, or calibration_tokens if more); compression starts at token sinks + calibration + 1
      fp16_bytes     what float16 KVCaches would hold for the same tokens (2·heads·head_dim·2 bytes per token)
      other_bytes    sum of `nbytes` of the other caches (e.g. hybrid linear-attention ArraysCache state)
      total_bytes    kv_bytes + other_bytes
      saved_bytes    mlx_lm_bytes - kv_bytes: Saving(kv_bytes, mlx_lm_bytes).saved, SAVED_AGAINST (negative while
                     TurboQuant's float window, sinks and constants outweigh mlx-lm's buffers)
      ratio          mlx_lm_bytes / kv_bytes (1.0 for an empty cache)
      tokens         tokens in the longest attention cache (the context used)
      attention_layers, turboquant_layers  counts
    """

    fp16 = mlx_lm = other = tokens = n_att = n_tq = float_tokens = compressed = decayed = 0
    attention = []
    dtype, sinks, window, calibration = None, None, None, None
    for c in flat_caches(prompt_cache):
        geo = _kv_geometry(c)
        is_attention = geo is not None or isinstance(c, TurboQuantKVCache) or hasattr(c, "keys")
        if not is_attention:
            other += c.nbytes
            continue
        n_att += 1
        n_tq += isinstance(c, TurboQuantKVCache)
        if isinstance(c, TurboQuantKVCache):
            sinks, window, calibration = c.config.sinks, c.config.window, c.config.first_window
        if geo is None:
            continue
        B, H, T, dk, dv = geo
        attention.append(c)
        fp16 += float16_kv_bytes(T, H, dk, dv, B)
        tokens = max(tokens, T)
        dtype = dtype or _float_dtype(c)
        compressing = isinstance(c, TurboQuantKVCache) or isinstance(getattr(c, "keys", None), (tuple, list))
        float_bytes = (_float_dtype(c) or mx.float16).size
        bound = getattr(c, "max_size", None) if isinstance(c, TurboQuantKVCache) else None
        mlx_lm += mlx_lm_kv_bytes(T, H, dk, dv, float_bytes, B, bound) if compressing else c.nbytes
        if isinstance(c, TurboQuantKVCache):
            float_tokens = max(float_tokens, c.n_sinks + c.n_window)
            compressed = max(compressed, c.n_coded)  # decayed tokens included
            decayed = max(decayed, *c.n_decayed)
    kv = held_bytes(attention)
    saving = Saving(kv, mlx_lm)
    return {
        "kv_bytes": kv,
        "mlx_lm_bytes": mlx_lm,
        "kv_dtype": str(dtype).removeprefix("mlx.core.") if dtype is not None else None,
        "float_tokens": float_tokens,
        "compressed_tokens": compressed,
        "decayed_tokens": decayed,
        "sinks": sinks,
        "window": window,
        "calibration": calibration,
        "fp16_bytes": fp16,
        "other_bytes": other,
        "total_bytes": kv + other,
        "saved_bytes": saving.saved,
        "ratio": saving.ratio,
        "tokens": tokens,
        "attention_layers": n_att,
        "turboquant_layers": n_tq,
    }
