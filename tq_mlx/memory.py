"""Memory numbers in one place: what a prompt cache holds, what a context would cost, what the machine has.

* `cache_bytes(prompt_cache)`: bytes the caches actually hold (each cache's own `nbytes`) against what mlx-lm's own
  `KVCache` would allocate for the same tokens in the model's dtype, and how much of the context is still in
  TurboQuant's float window. The tq-chat memory panel and tq-generate's summary both call it, and word it with
  `saving_text` and `window_text`.
* `estimate_kv_bytes(model_config, ctx, config)`: the same figure before any model is loaded, from config.json,
  for float16, mlx-lm's affine `--kv-bits` cache, or a TurboQuantConfig. The TurboQuant estimate follows the
  cache's storage layout (tq_mlx/stream.py) and equals `TurboQuantKVCache.nbytes` exactly when the cache was
  filled in one prefill or token by token (chunked prefill can add up to one `step` of padding per chunk),
  temporal decay included (decayed tokens at their bits, `code_capacity`).
* `weight_bytes(path)` from safetensors headers, `available_memory()` for MLX on this machine.

Float16 references (`fp16_bytes`, the planner's estimates) count exactly 2 · n_kv_heads · head_dim · 2 bytes per
token and attention layer, without KVCache's 256-token buffer padding; `cache_bytes`'s `mlx_lm_bytes` counts what
mlx-lm really allocates (whole 256-token steps in the model's dtype), the figure a user compares with.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

import mlx.core as mx

from .architectures import fetch_for
from .attention import tile_size
from .cache import TurboQuantKVCache, check_max_size
from .config import bits_label
from .quantizer import constant_arrays, format_bits
from .stream import decayed_split, fresh_bound, has_channel_order, make_quantizer, overflow, window_capacity

FLOAT16_BYTES = 2

# safetensors dtype names -> bytes per element
_ST_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8,
}
_ST_FLOATS = {"F16", "BF16", "F32", "F64"}


# --- model layout from config.json --------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionLayout:
    """Where a model keeps KV caches, read from its config.json.

    n_kv_heads, head_dim and v_head_dim are the geometry of the growing caches (`full_layers`, what TurboQuant
    compresses): per-head keys and values, or for multi-head latent attention one "kv head" whose keys are the
    latent (kv_lora_rank wide) and whose values are the rope key (qk_rope_head_dim wide), as mlx-lm caches them.
    Sliding-window layers have their own geometry where it differs (Gemma 4: `sliding_geometry`).
    """

    n_layers: int
    full_layers: tuple[int, ...]  # layers with a growing KV cache (what TurboQuant compresses)
    sliding_layers: tuple[tuple[int, int], ...] = ()  # (layer, window): bounded float caches, left alone
    n_kv_heads: int = 0
    head_dim: int = 0  # key dim of a full layer's cache (the latent's width for MLA)
    v_head_dim: int = 0  # value dim of a full layer's cache (the rope key's width for MLA)
    max_context: int | None = None  # the trained context (max_position_embeddings)
    linear_layers: tuple[int, ...] = field(default=())  # linear-attention / SSM layers: fixed-size state
    n_heads: int = 0  # query heads
    hidden_size: int = 0
    intermediate_size: int = 0  # the MLP's width (the widest activation of a prefill chunk)
    sliding_kv: tuple[int, int, int] | None = None  # (kv heads, key dim, value dim) of sliding layers; None: as full
    shared_layers: tuple[int, ...] = ()  # KV-shared layers (Gemma 4): no cache, they read an earlier layer's
    fetch: str = "codes"  # what a TurboQuant fetch gives the model: tq_mlx.architectures.fetch_for
    latent: bool = False  # multi-head latent attention caching (kv_latent, k_pe)
    latent_expansion: int = 0  # MLA prefill: qk_nope_head_dim + v_head_dim floats per query head and token
    k_eq_v: bool = False  # full layers' values are their keys (Gemma 4): TurboQuant holds one stream, fetch "float"
    rope_pairs: int | None = None  # channel pairs RoPE rotates in a full layer's keys (None: not rotated keys)

    @property
    def sliding_geometry(self) -> tuple[int, int, int]:
        """(kv heads, key dim, value dim) of a sliding-window layer's float cache."""
        return self.sliding_kv or (self.n_kv_heads, self.head_dim, self.v_head_dim)


def text_config(model_config: dict) -> dict:
    """The language model's settings: Qwen3.5 / Qwen3-Next / VLM configs nest them under text_config."""
    cfg = dict(model_config)
    inner = model_config.get("text_config")
    if isinstance(inner, dict):
        cfg.update(inner)
    return cfg


def model_types(model_config: dict) -> frozenset[str]:
    """The model_type names of a config: its own and its nested text model's (a VLM has both)."""
    inner = model_config.get("text_config")
    names = [model_config.get("model_type"), inner.get("model_type") if isinstance(inner, dict) else None]
    return frozenset(n for n in names if isinstance(n, str))


# MLA models whose mlx-lm cache holds per-head keys (qk_nope + qk_rope wide) and values (v_head_dim) for every
# query head, not the latent: they project the latent before caching (deepseek_v2.py:221-231).
PER_HEAD_MLA = frozenset({"deepseek_v2", "minicpm3", "youtu_llm"})


def attention_layout(model_config: dict) -> AttentionLayout:
    """Which layers hold a KV cache and its shape, from a config.json dict (hybrids included).

    Layer kinds come from `layer_types` when present ("full_attention", "sliding_attention", anything else is
    linear), else from `full_attention_interval` (Qwen3-Next / Qwen3.5: layer i is full attention iff
    (i + 1) % interval == 0), else from `sliding_window_pattern` (every pattern-th layer global), else every
    layer is full attention (kimi_linear's `linear_attn_config.kda_layers` and the bailing MLA hybrids'
    `layer_group_size` name their linear layers their own way). Gemma 4's last `num_kv_shared_layers` layers hold no cache; its full-attention layers
    use `global_head_dim` and, with `attention_k_eq_v`, `num_global_key_value_heads` (gemma4_text.py:185-201).
    Multi-head latent attention (kv_lora_rank and qk_rope_head_dim set) caches one "head" of the latent and the
    rope key (deepseek_v3.py:137-150), except the PER_HEAD_MLA models, which cache per-head keys and values.
    """
    cfg = text_config(model_config)
    types = model_types(model_config)
    n_layers = _first_int(cfg, "num_hidden_layers", "n_layer", "num_layers", "n_layers")
    if n_layers is None:
        raise ValueError("model config has no num_hidden_layers (or n_layer / num_layers)")
    n_heads = _first_int(cfg, "num_attention_heads", "n_head", "num_heads")
    n_kv = _first_int(cfg, "num_key_value_heads", "num_kv_heads", "n_kv_heads") or n_heads
    head_dim = _first_int(cfg, "head_dim")
    kv_lora, rope_dim = _first_int(cfg, "kv_lora_rank"), _first_int(cfg, "qk_rope_head_dim")
    nope_dim, mla_v_dim = _first_int(cfg, "qk_nope_head_dim") or 0, _first_int(cfg, "v_head_dim")
    latent = bool(kv_lora and rope_dim) and not (types & PER_HEAD_MLA)
    if head_dim is None and kv_lora and rope_dim:
        head_dim = nope_dim + rope_dim  # per-head MLA keys (deepseek_v2, minicpm3, youtu_llm)
    if head_dim is None:
        hidden = _first_int(cfg, "hidden_size", "n_embd", "d_model")
        if not (hidden and n_heads):
            raise ValueError("model config has neither head_dim nor hidden_size and num_attention_heads")
        head_dim = hidden // n_heads
    if not n_kv:
        raise ValueError("model config has no num_key_value_heads or num_attention_heads")
    v_head_dim = mla_v_dim or head_dim
    if kv_lora and rope_dim and not latent:
        n_kv = n_heads or n_kv  # per-head MLA caches a key and a value for every query head

    sliding_kv, k_eq_v = None, False
    if latent:
        sliding_kv = (n_kv, head_dim, v_head_dim)
        n_kv, head_dim, v_head_dim = 1, kv_lora, rope_dim
    else:
        global_dim = _first_int(cfg, "global_head_dim")
        k_eq_v = cfg.get("attention_k_eq_v") is True
        global_kv = _first_int(cfg, "num_global_key_value_heads") if k_eq_v else None
        if global_dim or global_kv:  # Gemma 4: full-attention layers have their own geometry
            sliding_kv = (n_kv, head_dim, v_head_dim)
            n_kv, head_dim = global_kv or n_kv, global_dim or head_dim
            v_head_dim = head_dim

    n_shared = _first_int(cfg, "num_kv_shared_layers") or 0
    first_shared = n_layers - n_shared if 0 < n_shared < n_layers else n_layers
    full, sliding, linear = [], [], []
    window = _first_int(cfg, "sliding_window") or 0
    layer_types = cfg.get("layer_types")
    interval = _first_int(cfg, "full_attention_interval")
    pattern = _first_int(cfg, "sliding_window_pattern")
    linear_cfg = cfg.get("linear_attn_config")
    kda = linear_cfg.get("kda_layers") if isinstance(linear_cfg, dict) else None  # kimi_linear: 1-based, linear
    group = _first_int(cfg, "layer_group_size") if kv_lora else None  # bailing MLA hybrids: MLA closes each group
    for i in range(first_shared):
        if isinstance(layer_types, list) and i < len(layer_types):
            kind = str(layer_types[i])
            if kind in ("full_attention", "attention", "global_attention"):
                full.append(i)
            elif kind in ("sliding_attention", "local_attention", "chunked_attention") and window:
                sliding.append((i, window))
            elif kind in ("sliding_attention", "local_attention", "chunked_attention"):
                full.append(i)
            else:
                linear.append(i)
        elif isinstance(kda, list):
            (linear if i + 1 in kda else full).append(i)
        elif group:
            (full if (i + 1) % group == 0 or i >= n_layers // group * group else linear).append(i)
        elif interval:
            (full if (i + 1) % interval == 0 else linear).append(i)
        elif pattern and window:
            if (i + 1) % pattern == 0:
                full.append(i)
            else:
                sliding.append((i, window))
        else:
            full.append(i)
    if sliding_kv == (n_kv, head_dim, v_head_dim) or not sliding:
        sliding_kv = None
    max_ctx = _first_int(cfg, "max_position_embeddings", "n_positions", "max_seq_len", "seq_length")
    return AttentionLayout(
        n_layers=n_layers,
        full_layers=tuple(full),
        sliding_layers=tuple(sliding),
        n_kv_heads=n_kv,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        max_context=max_ctx,
        linear_layers=tuple(linear),
        n_heads=n_heads or n_kv,
        hidden_size=_first_int(cfg, "hidden_size", "n_embd", "d_model") or 0,
        intermediate_size=_first_int(cfg, "intermediate_size", "moe_intermediate_size", "ffn_hidden_size",
                                     "n_inner") or 0,
        sliding_kv=sliding_kv,
        shared_layers=tuple(range(first_shared, n_layers)),
        fetch="float" if k_eq_v and fetch_for(types) == "codes" else fetch_for(types),  # K=V keys are derived
        latent=latent,
        k_eq_v=k_eq_v,
        latent_expansion=(nope_dim + (mla_v_dim or 0)) if latent else 0,
        rope_pairs=None if latent or k_eq_v else _rope_pairs(cfg, head_dim),
    )


def _rope_pairs(cfg: dict, head_dim: int) -> int | None:
    """Channel pairs a config's RoPE rotates per head (rotary_dim, or partial_rotary_factor of head_dim), None
    for configs that name no RoPE: what tq_mlx.rope.probe reads off the model (its `rope` module)."""
    names = ("rope_theta", "rope_scaling", "rope_parameters", "rotary_emb_base", "rotary_dim", "partial_rotary_factor")
    if not any(n in cfg for n in names):
        return None
    dims = _first_int(cfg, "rotary_dim")
    if dims is None:  # Qwen3.5 names the factor inside rope_parameters
        nested = [d for d in (cfg, cfg.get("rope_parameters"), cfg.get("rope_scaling")) if isinstance(d, dict)]
        factor = next((d["partial_rotary_factor"] for d in nested
                       if isinstance(d.get("partial_rotary_factor"), (int, float))), 1.0)
        dims = int(head_dim * factor)
    return min(dims, head_dim) // 2


def _first_int(cfg: dict, *names: str) -> int | None:
    for n in names:
        v = cfg.get(n)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v:
            return int(v)
    return None


def load_model_config(model_path: str | os.PathLike) -> dict:
    """config.json of a local model folder as a dict."""
    p = Path(model_path) / "config.json"
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"no config.json in {model_path}") from None


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


def _turboquant_split(tokens: int, config) -> tuple[int, int, int]:
    """(sinks, compressed, window) token counts after `tokens` tokens fed in one prefill or token by token."""
    s = min(tokens, config.sinks)
    c = overflow(tokens - s, config.window, config.compress_block_size)
    return s, c, tokens - s - c


def bounded_tokens(ctx: int, max_kv_size: int | None, config) -> tuple[int, int, int]:
    """(sinks, compressed, window) tokens a TurboQuantKVCache bounded to `max_kv_size` holds after `ctx` tokens
    fed token by token (decoding).

    The cache's rule (TurboQuantKVCache._drop_for, as RotatingKVCache keeps max_size - 1 tokens before each
    update): before each update the oldest compressed tokens are dropped in whole compress blocks (K =
    config.compress_block_size) so that at most max_kv_size - 1 earlier tokens remain; the sinks and the float
    window are never dropped. Token by token that is D(ctx) = K·⌈(ctx − max_kv_size)/K⌉ tokens dropped in all, so
    between max_kv_size − K + 1 and max_kv_size tokens are held. A prefill chunk of L tokens drops only for the
    tokens before it: right after it up to max_kv_size − 1 + L are held (estimate_peak_bytes prices that).
    max_kv_size None: unbounded. The cache refuses max_kv_size < sinks + window + K − 1 (cache.check_max_size).
    """
    s, c, w = _turboquant_split(ctx, config)
    return s, max(0, c - dropped_tokens(ctx, max_kv_size, config)), w


def dropped_tokens(ctx: int, max_kv_size: int | None, config) -> int:
    """Compressed tokens a cache bounded to max_kv_size dropped after ctx tokens fed token by token:
    K·⌈(ctx − max_kv_size)/K⌉ (bounded_tokens), 0 unbounded or within the bound."""
    if max_kv_size is None or ctx <= max_kv_size:
        return 0
    K = config.compress_block_size
    return K * -(-(ctx - max_kv_size) // K)


def bounded_capacity(ctx: int, max_kv_size: int | None, config) -> int:
    """Tokens the compressed storage of one stream is allocated for after `ctx` tokens fed token by token (a
    multiple of config.step), for a stream that does not decay (code_capacity prices one that does).

    Unbounded: the compressed tokens rounded up to `step`. Bounded: each drop moves the kept codes to a new buffer
    with room for one more block (stream.drop_oldest(n, room=K)), and drops come every K tokens (before the
    updates at t = max_kv_size + jK tokens), so the capacity is that of the last drop: ⌈(kept + K)/step⌉·step,
    kept = the compressed tokens held right after it (max_kv_size − K tokens held, less sinks and window).
    """
    s, c, w = _turboquant_split(ctx, config)
    if max_kv_size is None or ctx <= max_kv_size:
        return -(-c // config.step) * config.step
    K = config.compress_block_size
    before = max_kv_size + (ctx - 1 - max_kv_size) // K * K  # tokens fed before the last drop
    s, _, w = _turboquant_split(before, config)
    kept = max(0, max_kv_size - K - s - w)
    return -(-(kept + K) // config.step) * config.step


def decayed_tokens(ctx: int, max_kv_size: int | None, config) -> int:
    """Compressed tokens a decaying stream (config.decay_after) holds at the decay bits after ctx tokens, fed in
    one prefill or token by token (bounded: token by token); 0 without decay. The rest of bounded_tokens'
    compressed tokens are fresh codes.

    Unbounded: the stream re-codes its oldest fresh codes in whole compress blocks so that at most decay_after
    fresh and window tokens remain (stream.decayed_split), whatever the feeding. Bounded to M = max_kv_size, drops
    take decayed tokens first. If M <= sinks + decay_after nothing ever decays: a bound that keeps at most M
    tokens keeps at most decay_after fresh and window tokens. Otherwise the first drop (at M + 1 tokens) finds at
    least one decayed block, and after it one block decays for each block dropped (both every K tokens), so drops
    never reach the fresh codes: the fresh codes and the window are the unbounded cache's, and the decayed tokens
    its decayed tokens less the dropped ones (dropped_tokens).
    """
    A = config.decay_after
    if A is None:
        return 0
    _, c, w = _turboquant_split(ctx, config)
    if max_kv_size is not None and ctx > max_kv_size and max_kv_size <= config.sinks + A:
        return 0
    return decayed_split(c, w, A, config.compress_block_size) - dropped_tokens(ctx, max_kv_size, config)


def code_capacity(ctx: int, max_kv_size: int | None, config, decaying: bool = False) -> tuple[int, int]:
    """(fresh, decayed): tokens the fresh and the decayed code buffers of one stream are allocated for after ctx
    tokens (one prefill or token by token; bounded: token by token), multiples of config.step. decaying: the
    stream re-codes old tokens (decay configured for its side and layer, keys not protected).

    Until a token decays (and without decay): bounded_capacity, no decayed buffer. From the first decayed token
    on, the fresh buffer holds ⌈fresh_bound/step⌉·step codes for good (stream._fresh_capacity: at most
    decay_after − (window − K + 1) fresh codes) and the decayed codes grow in steps: ⌈decayed/step⌉·step.
    Bounded (see decayed_tokens), each drop moves the decayed codes kept to a buffer with room for one more
    block, and one block decays before the next drop, so their capacity is that of the last drop:
    ⌈(decayed tokens held just before it)/step⌉·step.
    """
    step, K = config.step, config.compress_block_size
    A = config.decay_after if decaying else None
    if A is None:
        return bounded_capacity(ctx, max_kv_size, config), 0
    _, c, w = _turboquant_split(ctx, config)
    if decayed_split(c, w, A, K) == 0 or (max_kv_size is not None and ctx > max_kv_size
                                          and max_kv_size <= config.sinks + A):
        return bounded_capacity(ctx, max_kv_size, config), 0
    fresh = -(-fresh_bound(A, config.window, K) // step) * step
    if max_kv_size is None or ctx <= max_kv_size:
        return fresh, -(-decayed_split(c, w, A, K) // step) * step
    before = max_kv_size + (ctx - 1 - max_kv_size) // K * K  # tokens fed before the last drop
    return fresh, -(-decayed_tokens(before, max_kv_size, config) // step) * step


def held_tokens(ctx: int, max_kv_size: int | None, config=None) -> int:
    """Tokens one full-attention layer's cache holds after ctx tokens: ctx; with max_kv_size, mlx-lm's
    RotatingKVCache (config None) holds min(ctx, max_kv_size), a bounded TurboQuantKVCache `bounded_tokens`."""
    if max_kv_size is None:
        return ctx
    if config is None:
        return min(ctx, max_kv_size)
    return sum(bounded_tokens(ctx, max_kv_size, config))


@lru_cache(maxsize=None)
def _quantizer_layout(dim: int, bits: float, qjl: bool, norm_dtype=mx.float16) -> tuple[int, int, bool]:
    """(bytes per compressed token and head, constant bytes of the quantizer, has a channel order)."""
    q = make_quantizer(dim, bits, qjl, seed=0, norm_dtype=norm_dtype)
    # A lazy probe gives each stored field's trailing shape and dtype (as a stream stores them).
    probe = q.quantize(mx.zeros((1, 1, 1, dim), mx.float32))
    per_token = sum(math.prod(a.shape[3:]) * a.dtype.size for a in probe)
    constants = sum(a.nbytes for a in constant_arrays(q))
    return per_token, constants, has_channel_order(q)


def turboquant_layer_bytes(
    tokens: int, n_kv_heads: int, key_dim: int, value_dim: int, key_bits: float, value_bits: float,
    config, batch: int = 1, float_bytes: int = FLOAT16_BYTES, max_kv_size: int | None = None,
    latent: bool = False, k_eq_v: bool = False, protected: bool = False,
    decay_bits: tuple[int | None, int | None] | None = None, rope_pairs: int | None = None,
    weighted: bool | None = None,
) -> int:
    """TurboQuantKVCache.nbytes for one layer after `tokens` tokens (filled in one prefill or token by token;
    bounded caches token by token).

    rope_pairs: keys centered before RoPE (config.center_keys "rope" on a layer whose RoPE rotates that many
    channel pairs): the key stream holds the pairs' channel order (int32, key_dim) and frequencies (float32) from
    the start; None: not.

    weighted: the keys are weighed by the queries (config.weigh_keys on a per-head layer whose attention sees the
    cache's views; None: config.weigh_keys unless latent or K=V): once attention has seen a query after the sinks,
    the key stream holds B·H·key_dim float32, the queries summed until the first compression, then the weights.

    Keys and values are two streams with their own widths (key_dim != value_dim for MLA: latent and rope key). A
    latent layer stores its rope key (the value stream) at the key bits, centered like keys (it enters the
    scores); a K=V layer (Gemma 4's attention_k_eq_v) holds one stream, its values at the key bits, and derives
    the keys on each fetch; zero-wide values (an indexer's keys-only cache) hold no value stream. protected: the
    key stream protected itself at calibration (plain MSE codes at config.protect_bits; the values keep theirs).
    Sinks (float_bytes per value: the model's dtype) are allocated whole on first use, the window as
    stream.window_capacity says (steps of 32 tokens, then whole); codes grow in `config.step` tokens;
    means (float32), scales (float32) and channel orders (int32, fractional bits) appear with the first
    compressed tokens; the quantizers' rotations and codebooks are a constant per layer. max_kv_size: a bounded
    cache (bounded_tokens, bounded_capacity).

    Temporal decay: decay_bits = (keys, values), the bits this layer's old tokens decay to (None: that side keeps
    its bits; config.layer_decay_bits gives a layer's, (None, None) in boundary layers); None: the config's own.
    A latent layer's rope key decays at the key's decay bits, a K=V layer's one stream too. A decaying stream
    holds decayed_tokens at the decay bits in a buffer of its own and its fresh codes in one of a fixed size
    (code_capacity), and the decay quantizer's constants from the start; a protected key stream does not decay,
    but holds those constants all the same (the stream was built to decay before its keys chose protection).
    """
    if tokens <= 0:
        return 0
    B, H = batch, n_kv_heads
    n_s = min(tokens, config.sinks)
    n_c = _turboquant_split(tokens, config)[1]  # ever compressed: centering and channel orders exist from then on
    value_dim = 0 if k_eq_v else value_dim
    value_bits, v_center = (key_bits, bool(config.center_keys)) if latent else (value_bits, config.center_values)
    k_decay, v_decay = config.layer_decay_bits(0, None) if decay_bits is None else decay_bits
    if latent:
        v_decay = k_decay
    base_bits = key_bits
    if protected:
        key_bits, qjl = config.protect_bits, False
    else:
        qjl = config.layer_qjl(key_bits)
    total = 0
    streams = [(key_dim, key_bits, qjl, k_decay, not protected), (value_dim, value_bits, False, v_decay, True)]
    for dim, bits, q, decay, decays in streams[: 1 + bool(value_dim)]:
        per_token, constants, _ = _quantizer_layout(dim, bits, q, config.norm_dtype)
        decayed_token = 0
        if decay is not None:  # the decay quantizer: held once the stream exists, whether or not anything decayed
            decayed_token, decay_constants, _ = _quantizer_layout(dim, decay, False, config.norm_dtype)
            constants += decay_constants
        total += constants
        if n_c:
            fresh, decayed = code_capacity(tokens, max_kv_size, config, decaying=decay is not None and decays)
            total += B * H * (fresh * per_token + decayed * decayed_token)
    if rope_pairs is not None and config.center_keys == "rope":
        total += 4 * (key_dim + rope_pairs)
    if weighted is None:
        weighted = config.weigh_keys and not latent and not k_eq_v
    if weighted and tokens > config.sinks:
        total += B * H * 4 * key_dim
    if protected:  # the stream keeps its configured quantizer next to the protecting one
        total += _quantizer_layout(key_dim, base_bits, config.layer_qjl(base_bits), config.norm_dtype)[1]
    if config.sinks:
        total += B * H * config.sinks * (key_dim + value_dim) * float_bytes
    total += B * H * window_capacity(tokens - n_s, config.window) * (key_dim + value_dim) * float_bytes
    if n_c:
        k_perm = _quantizer_layout(key_dim, key_bits, qjl, config.norm_dtype)[2]
        v_perm = _quantizer_layout(value_dim, value_bits, False, config.norm_dtype)[2] if value_dim else False
        total += B * H * 4 * (key_dim * bool(config.center_keys) + value_dim * v_center + 1 + bool(value_dim))  # μ, ν, scales
        total += H * 4 * (key_dim * k_perm + value_dim * v_perm)
    return total


FLOAT_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


def kv_float_bytes(model_config: dict, dtype: str | None = None) -> int:
    """Bytes per value of the model's keys and values: `dtype` (what --dtype casts to) if given, else the
    config's torch_dtype, else 2."""
    name = dtype or model_config.get("torch_dtype") or text_config(model_config).get("torch_dtype") or "float16"
    if name not in FLOAT_BYTES:
        if dtype is not None:
            raise ValueError(f"dtype must be one of {', '.join(FLOAT_BYTES)}, got {dtype!r}")
        name = "float16"  # a config's unusual torch_dtype: the weights' dtype, not a KV dtype
    return FLOAT_BYTES[name]


def estimate_kv_bytes(
    model_config: dict, ctx: int, config=None, *, kv_bits: int | None = None, kv_group_size: int = 64,
    batch: int = 1, dtype: str | None = None, max_kv_size: int | None = None,
) -> int:
    """KV cache bytes at `ctx` tokens for a model's config.json dict.

    config: a TurboQuantConfig (boundary layers included), or None for float16, or None with kv_bits for
    mlx-lm's affine QuantizedKVCache. Only full-attention layers grow with the context, each with its layout's
    geometry (per-head keys and values, or MLA's latent + rope key, as mlx-lm caches them: the same layout for
    every column); sliding-window layers hold min(ctx, window) float tokens with their own geometry (float16 in
    the references, the model's dtype next to TurboQuant, as RotatingKVCache holds); KV-shared layers hold
    nothing; linear-attention state (fixed size) is not counted. TurboQuant's float sinks and window hold the
    model's dtype (kv_float_bytes: `dtype`, else torch_dtype). Temporal decay (config.decay_after) is priced per
    layer (config.layer_decay_bits: boundary layers do not decay), as turboquant_layer_bytes says.

    max_kv_size: a bounded cache. The references hold min(ctx, max_kv_size) tokens per full layer (mlx-lm's
    RotatingKVCache, decoding); TurboQuant follows bounded_tokens / code_capacity (decoding token by token).
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
    ref_tokens = held_tokens(ctx, max_kv_size)
    for a in range(n_att):
        if config is not None:
            kb, vb = config.layer_bits(a, n_att)
            total += turboquant_layer_bytes(ctx, H, dk, dv, kb, vb, config, batch, float_bytes, max_kv_size,
                                            latent=lay.latent, k_eq_v=lay.k_eq_v,
                                            decay_bits=config.layer_decay_bits(a, n_att), rope_pairs=lay.rope_pairs,
                                            weighted=config.weigh_keys and lay.fetch == "codes")
        elif kv_bits is not None:
            total += affine_kv_bytes(ref_tokens, H, dk, dv, kv_bits, kv_group_size, batch)
        else:
            total += float16_kv_bytes(ref_tokens, H, dk, dv, batch)
    return total


def protect_layer_bytes(model_config: dict, ctx: int, config, *, dtype: str | None = None, batch: int = 1,
                        max_kv_size: int | None = None) -> int:
    """What one attention layer adds at ctx if its keys protect themselves (config.protect_bits, chosen by the
    layer's own calibration tokens, so a plan can only price one): its key stream at protect_bits, its values
    unchanged (a latent layer's rope key keeps the key bits), and the stream keeps its configured quantizer's
    constants next to the protecting one. Protected keys do not decay (config.decay_after): with decay this is
    also the decayed key codes turned back into protect_bits codes. 0 if protection is off or not above the key
    bits."""
    if config.protect_factor is None or config.protect_bits <= config.key_bits:
        return 0
    lay = attention_layout(model_config)
    n_att = len(lay.full_layers)
    if not n_att:
        return 0
    kb, vb = config.layer_bits(n_att // 2, n_att)  # a middle layer: boundary layers have their own bits
    args = (ctx, lay.n_kv_heads, lay.head_dim, lay.v_head_dim, kb, vb, config, batch,
            kv_float_bytes(model_config, dtype), max_kv_size)
    flags = dict(latent=lay.latent, k_eq_v=lay.k_eq_v, decay_bits=config.layer_decay_bits(n_att // 2, n_att))
    return turboquant_layer_bytes(*args, protected=True, **flags) - turboquant_layer_bytes(*args, **flags)


# --- the peak: weights + KV + the transient of one prefill chunk ---------------------------------------------

# The transient of one prefill chunk of C tokens, beyond weights and KV. Activations: the residual stream and
# its normed copy (2·hidden) and the MLP's gate, up and product (3·intermediate) per token, in the model's
# dtype. Attention: mx.fast.scaled_dot_product_attention on MLX's CPU back end materializes the chunk's
# float32 scores against the whole context (FLOAT_SCORE_COPIES of them, measured), growing with the context;
# TurboQuant attention holds about TQ_SCORE_TILES tiles of scores and softmax temporaries (tq_mlx.attention:
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
        tile = min(tile_size(batch, lay.n_heads, chunk), max(1, bounded_tokens(ctx, max_kv_size, config)[1]))
        attention = TQ_SCORE_TILES * batch * lay.n_heads * chunk * tile * 4
        if lay.sliding_layers or ctx <= config.window + config.sinks:
            # float tokens (window, sinks, sliding layers) go through float scores too
            attention = max(attention, FLOAT_SCORE_COPIES * batch * lay.n_heads * chunk * min(
                ctx, max([config.window + config.sinks] + [w for _, w in lay.sliding_layers])) * 4)
    attention += fetch_transient_bytes(model_config, ctx, config, prefill_step=prefill_step, dtype=dtype,
                                       batch=batch, max_kv_size=max_kv_size)
    kv = estimate_kv_bytes(model_config, ctx, config, batch=batch, dtype=dtype, max_kv_size=max_kv_size)
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


def _flatten(prompt_cache: Iterable[Any]) -> list[Any]:
    out = []
    for c in prompt_cache:
        inner = getattr(c, "caches", None)  # mlx-lm CacheList
        if isinstance(inner, (list, tuple)):
            out.extend(_flatten(inner))
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
                    float_bytes: int = FLOAT16_BYTES, batch: int = 1) -> int:
    """What mlx-lm's own KVCache allocates for `tokens` tokens of one layer: buffers of whole 256-token steps in
    the model's dtype (filled in one prefill, then token by token)."""
    v = head_dim if v_head_dim is None else v_head_dim
    capacity = -(-tokens // KVCACHE_STEP) * KVCACHE_STEP
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
      kv_bytes       sum of `nbytes` of the attention caches (TurboQuant, KVCache, QuantizedKVCache, ...)
      mlx_lm_bytes   what mlx-lm's own caches would hold for the same tokens: a KVCache's real allocation (whole
                     256-token steps, the model's dtype) for each compressed or quantized layer, the cache's own
                     nbytes for the layers that stay float
      kv_dtype       the model's dtype the float tokens are kept in ("float32"; None for an empty cache)
      float_tokens, compressed_tokens   TurboQuant layers: tokens still in float (sinks + window) and compressed
                     (decayed ones included), the most of any layer
      decayed_tokens TurboQuant layers: compressed tokens re-coded at the decay bits (config.decay_after), the most
                     of any layer and side
      sinks, window  TurboQuant layers: the config's float sinks and window (None without TurboQuant layers);
                     compression starts at token sinks + window + 1
      fp16_bytes     what float16 KVCaches would hold for the same tokens (2·heads·head_dim·2 bytes per token)
      other_bytes    sum of `nbytes` of the other caches (e.g. hybrid linear-attention ArraysCache state)
      total_bytes    kv_bytes + other_bytes
      saved_bytes    fp16_bytes - kv_bytes (negative while the float16 window and sinks dominate a short context)
      ratio          fp16_bytes / kv_bytes (1.0 for an empty cache)
      tokens         tokens in the longest attention cache (the context used)
      attention_layers, turboquant_layers  counts
    """

    kv = fp16 = mlx_lm = other = tokens = n_att = n_tq = float_tokens = compressed = decayed = 0
    dtype, sinks, window = None, None, None
    for c in _flatten(prompt_cache):
        geo = _kv_geometry(c)
        is_attention = geo is not None or isinstance(c, TurboQuantKVCache) or hasattr(c, "keys")
        if not is_attention:
            other += c.nbytes
            continue
        n_att += 1
        n_tq += isinstance(c, TurboQuantKVCache)
        if geo is None:
            continue
        B, H, T, dk, dv = geo
        kv += c.nbytes
        fp16 += float16_kv_bytes(T, H, dk, dv, B)
        tokens = max(tokens, T)
        dtype = dtype or _float_dtype(c)
        compressing = isinstance(c, TurboQuantKVCache) or isinstance(getattr(c, "keys", None), (tuple, list))
        float_bytes = (_float_dtype(c) or mx.float16).size
        mlx_lm += mlx_lm_kv_bytes(T, H, dk, dv, float_bytes, B) if compressing else c.nbytes
        if isinstance(c, TurboQuantKVCache):
            float_tokens = max(float_tokens, c.n_sinks + c.n_window)
            compressed = max(compressed, c.n_compressed)  # decayed tokens included
            decayed = max(decayed, *c.n_decayed)
            sinks, window = c.config.sinks, c.config.window
    return {
        "kv_bytes": kv,
        "mlx_lm_bytes": mlx_lm,
        "kv_dtype": str(dtype).removeprefix("mlx.core.") if dtype is not None else None,
        "float_tokens": float_tokens,
        "compressed_tokens": compressed,
        "decayed_tokens": decayed,
        "sinks": sinks,
        "window": window,
        "fp16_bytes": fp16,
        "other_bytes": other,
        "total_bytes": kv + other,
        "saved_bytes": fp16 - kv,
        "ratio": fp16 / kv if kv else 1.0,
        "tokens": tokens,
        "attention_layers": n_att,
        "turboquant_layers": n_tq,
    }


def _layer_caches(prompt_cache: Iterable[Any]) -> list[tuple[int, Any]]:
    """(model layer, cache) of every cache, the members of a mlx-lm CacheList under their layer. A pipeline
    stage holds the caches of a slice of the layers: the TurboQuant caches know their model layer, and the
    others are numbered by the same offset."""
    caches = [(i, m) for i, c in enumerate(prompt_cache) for m in _flatten([c])]
    offset = next((m.layer_index - i for i, m in caches if isinstance(m, TurboQuantKVCache)), 0)
    return [(i + offset, m) for i, m in caches]


def decay_label(key_bits: float, value_bits: float, qjl: bool = False,
                decay_bits: tuple[int | None, int | None] = (None, None), after: int | None = None) -> str:
    """config.bits_label with temporal decay: "K4→3/V3→2 after 2048" (keys 4 bits, 3 once decay_after tokens
    old; values 3, then 2), "K4/V3→2 after 2048" when only the values decay; "K4/V3" without decay."""
    if after is None or decay_bits == (None, None):
        return bits_label(key_bits, value_bits, qjl)

    def to(decayed: int | None) -> str:
        return "" if decayed is None else f"→{format_bits(decayed)}"

    return (f"K{format_bits(key_bits)}{'+qjl' if qjl else ''}{to(decay_bits[0])}/V{format_bits(value_bits)}"
            f"{to(decay_bits[1])} after {after}")


def config_label(config, attention_index: int = 0, n_attention_layers: int | None = None) -> str:
    """A config's bits as decay_label words them, for one attention layer (by default one that is not a boundary
    layer): "K4→3/V3→2 after 2048"."""
    kb, vb = config.key_bits, config.value_bits
    if n_attention_layers is not None:
        kb, vb = config.layer_bits(attention_index, n_attention_layers)
    return decay_label(kb, vb, config.layer_qjl(kb), config.layer_decay_bits(attention_index, n_attention_layers),
                       config.decay_after)


def cache_decay_bits(c: TurboQuantKVCache) -> tuple[int | None, int | None]:
    """(keys, values): the bits a cache's streams re-code old tokens at (None: that side does not decay), as
    the streams do it: a protected key stream does not decay, a latent layer's rope key (its values) decays at
    the key's decay bits, protected or not. Before the first tokens: the cache's decay_bits."""
    if c.key_stream is None:
        return c.decay_bits
    return tuple(s.decay[1].bits if s is not None and s.decaying else None for s in (c.key_stream, c.value_stream))


def _layer_label(c) -> str | None:
    """How bits_summary names one cache: its bits (with temporal decay, decay_label's "K4→3/V3→2 after 2048"),
    "float" (with a sliding window's size), None for caches without keys and values (recurrent state)."""
    if isinstance(c, TurboQuantKVCache):
        return decay_label(c.key_bits, c.value_bits, c.qjl, cache_decay_bits(c), c.config.decay_after)
    if not hasattr(c, "keys"):
        return None
    bits = getattr(c, "bits", None)
    if bits:
        return f"{bits}-bit affine"
    window = getattr(c, "max_size", None)  # RotatingKVCache: a bounded float cache, left uncompressed
    return f"float (sliding window {window})" if isinstance(window, int) else "float"


def bits_summary(prompt_cache: Iterable[Any]) -> str:
    """Which layers hold what, compactly: "K4/V3 on all 28 attention layers", or per run of layers, e.g.
    "L0-1 K8/V8 · L2-27 K4→3/V3→2 after 2048 · L28-29 K8/V8" (temporal decay: decay_label) or
    "L0 float (sliding window 512) · L1 K4/V3 · ..." (layers that stay float are named; recurrent-state layers
    are left out)."""
    runs: list[tuple[str, list[int]]] = []  # (label, layers), consecutive attention layers with one label
    labelled = [(i, lab) for i, c in _layer_caches(prompt_cache) if (lab := _layer_label(c)) is not None]
    for i, label in labelled:
        if runs and runs[-1][0] == label:
            runs[-1][1].append(i)
        else:
            runs.append((label, [i]))
    if len(runs) == 1:
        n = len(labelled)
        return f"{runs[0][0]} on all {n} attention layers" if n > 1 else f"{runs[0][0]} on its 1 attention layer"
    return " · ".join(f"L{_layer_list(layers)} {label}" for label, layers in runs)


def _layer_list(layers: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8"."""
    spans: list[list[int]] = []
    for i in sorted(set(layers)):
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


# --- weights and the machine ------------------------------------------------------------------------------


def safetensors_header(path: str | os.PathLike) -> dict:
    """The JSON header of a .safetensors file (tensor name -> dtype, shape, data_offsets)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100_000_000:
            raise ValueError(f"{path}: not a safetensors file (header length {n})")
        return json.loads(f.read(n))


def weight_bytes(model_path: str | os.PathLike, dtype: str | None = None) -> int:
    """Bytes the model's weights take in memory, from the safetensors headers of a local model folder.

    dtype ("float16", "bfloat16", "float32") counts floating tensors as cast to it, as `--dtype` does at load
    time; quantized weights (uint32) keep their size. A file whose header cannot be read counts its size.
    """
    target = {None: None, "float16": 2, "bfloat16": 2, "float32": 4}
    if dtype not in target:
        raise ValueError(f"dtype must be one of float16, bfloat16, float32, got {dtype!r}")
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model_path}")
    total = 0
    for f in files:
        try:
            header = safetensors_header(f)
        except (OSError, ValueError, struct.error):
            total += f.stat().st_size
            continue
        for name, t in header.items():
            if name == "__metadata__":
                continue
            begin, end = t["data_offsets"]
            n = end - begin
            if target[dtype] and t["dtype"] in _ST_FLOATS:
                n = n // _ST_DTYPE_BYTES[t["dtype"]] * target[dtype]
            total += n
    return total


def available_memory() -> int:
    """Bytes this machine can give MLX: on Apple silicon MLX's recommended working set (what mlx-lm wires),
    elsewhere the physical memory."""
    try:
        if mx.metal.is_available():
            info = mx.device_info()
            if "max_recommended_working_set_size" in info:
                return int(info["max_recommended_working_set_size"])
    except (AttributeError, RuntimeError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    raise RuntimeError(f"cannot tell how much memory this machine has ({sys.platform})")


def saving_text(s: dict) -> str:
    """What cache_bytes(...) saves against mlx-lm's own cache, never as a negative number: "8.57 MB (3.65x)"
    (mlx-lm's bytes / the bytes held), or "none yet" while TurboQuant's float window and constants outweigh it."""
    saved = s["mlx_lm_bytes"] - s["kv_bytes"]
    if not s["kv_bytes"]:
        return "-"
    if saved == 0:
        return "none"  # mlx-lm's own cache
    if saved < 0:
        return "none yet"
    return f"{format_bytes(saved)} ({s['mlx_lm_bytes'] / s['kv_bytes']:.2f}x)"


def window_text(s: dict) -> str | None:
    """How much of the context cache_bytes(...) found still in TurboQuant's float window (None without
    TurboQuant layers): "all 85 tokens in float32 (4 sinks + 768-token window): compression starts at token 773",
    or "3,228 tokens compressed (1,152 decayed), 772 in float16 (4 sinks + 768-token window)"."""
    if s.get("window") is None:
        return None
    kept = f"{s['kv_dtype'] or 'float'} ({s['sinks']} sinks + {s['window']:,}-token window)"
    if not s["compressed_tokens"]:
        start = s["sinks"] + s["window"] + 1
        return f"all {s['float_tokens']:,} tokens in {kept}: compression starts at token {start:,}"
    decayed = f" ({s['decayed_tokens']:,} decayed)" if s.get("decayed_tokens") else ""
    return f"{s['compressed_tokens']:,} tokens compressed{decayed}, {s['float_tokens']:,} in {kept}"


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KB'; decimal units (as Activity Monitor and MLX's GB figures use)."""
    sign, n = ("-" if n < 0 else ""), abs(n)
    for unit in ("B", "KB", "MB", "GB"):
        if n < 999.5:
            break
        n /= 1000
    else:
        unit = "TB"
    digits = 0 if unit == "B" or n >= 100 else 1 if n >= 10 else 2
    return f"{sign}{n:.{digits}f} {unit}"
