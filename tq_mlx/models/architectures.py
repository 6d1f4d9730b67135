"""What a model's config.json says: which layers hold a KV cache and their shape, and which fetch each mlx-lm
architecture (model_type) takes from a TurboQuantKVCache.

`attention_layout(config)` reads the layer kinds and geometry (hybrids, sliding windows, MLA latents, Gemma 4's
K=V and KV-shared layers) from a config.json dict, `load_model_config(path)` a model folder's config.json.

Every model with a growing KV cache gets compressed storage; what differs is what `update_and_fetch` hands back:

* "codes" (the default): `StreamView`s, which the attention hook (tq_mlx.cache) runs on the codes. Learned sinks
  (gpt-oss) and layers that attend to another layer's fetched view (Gemma 4's KV-shared layers) take this path.
* "latent": multi-head latent attention (DeepSeek-V3 style: the cache holds `kv_latent` and the rope key `k_pe`).
  Decode (one query token) gets the latent as a view, which the model passes as both keys and values with its
  rope scores as an additive mask: attention on the codes. Prefill chunks and the rope key get float tensors
  decoded from the codes, one layer at a time.
* "float" (decode-to-float): models that post-process what they fetch (cast, tile, index, compute attention by
  hand, or call mx.fast.scaled_dot_product_attention directly) get float tensors decoded from the codes on every
  fetch: a transient the size of one layer's float cache, never kept.

Model files are mlx-lm 0.32.2's; tests/test_zoo.py checks every architecture end to end.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

# model_type -> why its fetched keys/values must be float tensors (decode-to-float).
FLOAT_FETCH: dict[str, str] = {
    "gemma2": "computes attention by hand on the fetched keys, with a tanh soft-cap of the scores (gemma2.py:89-92)",
    "olmo": "computes attention by hand on the fetched keys (olmo.py:91)",
    "plamo": "tiles the fetched keys (plamo.py:93)",
    "plamo2": "calls mx.fast.scaled_dot_product_attention directly",
    "phi3small": "expands and tiles the fetched keys for block-sparse attention",
    "afm7": "its KV-reuse layers attend to the last layer's fetched keys outside the attention hook (afm7.py:361)",
    "iquestloopcoder": "its second loop attends to the first loop's fetched keys (iquestloopcoder.py:196)",
    "deepseek_v32": "its sparse attention indexes the fetched latent (deepseek_v32.py:214-230)",
    "glm_moe_dsa": "its sparse attention indexes the fetched latent (deepseek_v32.py:214-230)",
    "deepseek_v41": "calls mx.fast.scaled_dot_product_attention directly",
    "muse_spark": "calls mx.fast.scaled_dot_product_attention directly",
    "minimax_m3_vl": "post-processes the fetched keys (minimax_m3_vl.py:268-282)",
}

# model_type of multi-head latent attention whose cache holds (kv_latent, k_pe) and whose decode attends to the
# latent directly (deepseek_v3.py:143-165 and the files built on it; "kimi_k2" configs load as deepseek_v3). deepseek_v2, minicpm3 and youtu_llm cache
# per-head keys and values instead: plain "codes".
LATENT: frozenset[str] = frozenset({
    "deepseek_v3", "kimi_k2", "kimi_k25", "kimi_vl", "kimi_linear", "kimi_k3", "glm4_moe_lite", "mistral4",
    "longcat_flash", "longcat_flash_ngram", "bailing_moe_v3", "bailing_hybrid",
})

FETCHES = ("codes", "latent", "float")


def fetch_for(model_types: set[str] | frozenset[str]) -> str:
    """The fetch of a model with these model_type names (a VLM has its own and its text model's)."""
    if any(t in FLOAT_FETCH for t in model_types):
        return "float"
    if any(t in LATENT for t in model_types):
        return "latent"
    return "codes"


# --- model config parsing -----------------------------------------------------------------------------


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
    fetch: str = "codes"  # what a TurboQuant fetch gives the model: fetch_for
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
    for configs that name no RoPE: what tq_mlx.models.rope.probe reads off the model (its `rope` module)."""
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
