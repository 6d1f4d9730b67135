"""Tiny random-weight models of every mlx-lm architecture (every module of mlx_lm.models with Model and
ModelArgs), built from their own ModelArgs: 4 layers, hidden 128, 4 q / 2 kv heads of head_dim 32 where the
architecture takes those fields. Architectures that cannot be built here are listed in NOT_BUILDABLE with why.
Where a real config nests (text_config, rope_parameters per layer type, block_configs) or mixes layer kinds
(sliding/full, KV-shared, MLA, MoE, sinks), the tiny one has every kind its checkpoints have.
"""

from __future__ import annotations

import importlib
import inspect
import re
import pkgutil
import sys
from collections import Counter
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import mlx_lm.models
import numpy as np

from tests.support.tiny_models import VOCAB, _randomize

H, L, HEADS, KV_HEADS, HD = 128, 4, 4, 2, 32

# Field names shared by many ModelArgs; each architecture picks the ones its from_dict accepts.
GENERIC: dict[str, Any] = dict(
    hidden_size=H, num_hidden_layers=L, intermediate_size=2 * H, num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS, head_dim=HD, vocab_size=VOCAB, rms_norm_eps=1e-5, layer_norm_eps=1e-5,
    layer_norm_epsilon=1e-5, norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
    tie_word_embeddings=False, attention_bias=False, mlp_bias=False, use_bias=False, use_qkv_bias=False,
    num_experts=4, num_local_experts=4, moe_num_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_topk=2,
    moe_intermediate_size=64, expert_ffn_hidden_size=64, shared_expert_intermediate_size=64, n_shared_experts=1,
    num_shared_experts=1, num_shared_expert=1, first_k_dense_replace=1, norm_topk_prob=True,
    routed_scaling_factor=1.0, n_group=1, topk_group=1, decoder_sparse_step=1, mlp_only_layers=[],
    moe_layer_freq=1, partial_rotary_factor=1.0, rope_scaling=None, sliding_window=16, sliding_window_pattern=2,
    use_qk_norm=False, qk_norm=False, post_norm=False, hidden_act="silu",
    # gpt2 / bigcode / dbrx / afm7 / openelm / lille spellings
    n_embd=H, n_head=HEADS, n_layer=L, n_ctx=4096, n_positions=4096, n_inner=2 * H, d_model=H, n_layers=L,
    n_heads=HEADS, num_layers=L, hidden_dim=H, num_heads=HEADS, num_kv_heads=KV_HEADS, n_kv_heads=KV_HEADS,
    num_transformer_layers=L, model_dim=H, num_query_heads=[HEADS] * L, block_size=4096,
    rotary_emb_base=10000, rotary_pct=1.0, ffn_hidden_size=2 * H,
    # MLA
    kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
    # linear attention / SSM
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32, linear_value_head_dim=32,
    linear_conv_kernel_dim=4, full_attention_interval=2, conv_kernel=4, state_size=16, ssm_state_size=16,
    n_groups=1, time_step_rank=8, use_conv_bias=True, mamba_d_conv=4, mamba_d_state=16, mamba_expand=2,
    mamba_num_heads=4, mamba_head_dim=32, mamba_proj_bias=False, conv1d_width=4, conv_bias=False,
    conv_L_cache=3, attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1, expert_layer_period=2,
    # granite / minicpm / minimax / gptj scalars
    logits_scaling=1.0, attention_multiplier=HD**-0.5, embedding_multiplier=1.0, residual_multiplier=1.0,
    dim_model_base=H, scale_depth=1.0, scale_emb=1.0, rotary_dim=HD, shared_intermediate_size=64,
)
SW = ["sliding_attention", "full_attention"] * (L // 2)
ROPE = {"rope_theta": 10000.0, "rope_type": "default", "type": "default"}
YARN = {"type": "yarn", "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
# Gemma 4, every kind of layer its checkpoints have: sliding (0, 2) and full (1, 3) layers; layers 2 and 3 share
# the K/V of layers 0 and 1 (num_kv_shared_layers, the E2B/E4B models); full layers with their own head_dim,
# K = V and their own KV head count (the 26B/31B models); MoE beside the MLP (26B); per-layer inputs (E2B/E4B).
GEMMA4 = dict(layer_types=SW, num_kv_shared_layers=2, global_head_dim=2 * HD, attention_k_eq_v=True,
              num_global_key_value_heads=1, enable_moe_block=True, num_experts=4, top_k_experts=2,
              moe_intermediate_size=64, hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB)
# Kimi K3: KDA linear attention on layers 0 and 2 (1-based kda_layers), NoPE MLA on 1 and 3, SiTU activation,
# attention residuals over blocks of 2 layers, latent MoE (experts at a narrower width) from layer 1.
KIMI_K3 = dict(hidden_act="situ", activation_situ_beta=1.0, num_experts_per_token=2, num_shared_experts=1,
               linear_attn_config={"kda_layers": [1, 3], "full_attn_layers": [2, 4], "head_dim": HD, "num_heads": 4,
                                   "short_conv_kernel_size": 4},
               attn_res_block_size=2, routed_expert_hidden_size=64, latent_moe_use_norm=True,
               mla_use_output_gate=True)

# Per-architecture fields GENERIC lacks or gets wrong.
OVERRIDES: dict[str, dict[str, Any]] = {
    "afm7": dict(num_kv_reuse_layers=1),
    "afmoe": dict(layer_types=SW),
    "baichuan_m1": dict(sliding_window_layers=[0, 2], conv_window=2),
    "bailing_hybrid": dict(layer_group_size=2, group_norm_size=1),
    "bailing_moe_linear": dict(layer_group_size=2, group_norm_size=1),
    "dbrx": dict(ffn_config={"ffn_hidden_size": 2 * H, "moe_num_experts": 4, "moe_top_k": 2},
                 attn_config={"kv_n_heads": KV_HEADS, "clip_qkv": 8.0, "rope_theta": 10000.0}),
    "exaone4": dict(sliding_window_pattern="LG"),
    "exaone_moe": dict(layer_types=SW, is_moe_layer=[False] + [True] * (L - 1)),
    "gear": dict(layer_types=SW),
    "mellum": dict(layer_types=SW, rope_parameters={"full_attention": dict(YARN, rope_theta=10000.0),
                                                    "sliding_attention": ROPE}),
    "gemma3n": dict(text_config=dict(
        num_kv_shared_layers=1, vocab_size_per_layer_input=VOCAB, rope_local_base_freq=10000.0,
        final_logit_softcapping=30.0, layer_types=SW, activation_sparsity_pattern=[0.0] * L,
        hidden_size_per_layer_input=16, altup_num_inputs=2, altup_coef_clip=120.0, altup_correct_scale=True,
        altup_active_idx=0, laurel_rank=16)),
    "glm_moe_dsa": dict(index_head_dim=32, index_n_heads=2, index_topk=8, topk_method="noaux_tc",
                        scoring_func="sigmoid", rope_parameters=ROPE),
    # DeepSeek-V3.2: the indexer keeps 8 of the 16-24 tokens (index_topk below the context, as 2048 of a long
    # one): its sparse attention indexes the fetched latent (test_zoo replays the float run's picks)
    "deepseek_v32": dict(index_head_dim=32, index_n_heads=2, index_topk=8),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"] * (L // 2), mamba_n_heads=4, mamba_d_head=32,
                             mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_conv_bias=True),
    # Hunyuan-Large: cross-layer attention (odd layers reuse the K/V projections of the layer before, each keeps
    # its own cache), a shared MLP beside the experts, QK norm, NTK-alpha RoPE.
    "hunyuan": dict(use_mixed_mlp_moe=True, use_cla=True, cla_share_factor=2, use_qk_norm=True, moe_topk=2,
                    rope_scaling={"alpha": 1000.0, "factor": 1.0, "type": "dynamic"}),
    "kimi_k3": dict(text_config=KIMI_K3),
    "kimi_linear": dict(model_max_length=4096, linear_attn_config={
        "kda_layers": [1, 3], "full_attn_layers": [2, 4], "head_dim": 32, "num_heads": 4, "short_conv_kernel_size": 4}),
    "lfm2": dict(block_dim=H, block_multiple_of=32, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False,
                 full_attn_idxs=[1, 3]),
    "lfm2-vl": dict(text_config=dict(block_dim=H, block_multiple_of=32, block_ffn_dim_multiplier=1.0,
                                     block_auto_adjust_ff_dim=False, full_attn_idxs=[1, 3], model_type="lfm2")),
    "lfm2_moe": dict(use_expert_bias=False, num_dense_layers=1, full_attn_idxs=[1, 3]),
    "llama4_text": dict(intermediate_size_mlp=2 * H, no_rope_layers=[1, 1, 1, 0], attention_chunk_size=16,
                        interleave_moe_layer_step=1),
    # Scout/Maverick: one routed expert per token, MoE every other layer (Maverick), chunked attention on the
    # RoPE layers (chunk 8 < the 24 tokens) and a NoPE full-attention layer with temperature tuning (layer 3).
    "llama4": dict(text_config=dict(intermediate_size_mlp=2 * H, attention_chunk_size=8, interleave_moe_layer_step=2,
                                    num_experts_per_tok=1, use_qk_norm=True, floor_scale=8,
                                    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                      high_freq_factor=4.0, original_max_position_embeddings=1024))),
    "longcat_flash": dict(attention_method="MLA", zero_expert_type="identity", zero_expert_num=1,
                          mla_scale_q_lora=True, mla_scale_kv_lora=True),
    "longcat_flash_ngram": dict(zero_expert_num=1, mla_scale_q_lora=True, mla_scale_kv_lora=True),
    "mamba2": dict(time_step_limit=(0.0, float("inf")), num_heads=8, head_dim=32),
    "ministral3": dict(rope_parameters=dict(ROPE, llama_4_scaling_beta=0.1, original_max_position_embeddings=4096)),
    "mistral3": dict(text_config=dict(model_type="ministral3", rope_parameters=dict(
        ROPE, llama_4_scaling_beta=0.1, original_max_position_embeddings=4096))),
    # Mistral Small 4: MLA with YaRN and Llama-4 attention scaling in one rope_parameters dict
    "mistral4": dict(rope_parameters=dict(YARN, rope_theta=10000.0, llama_4_scaling_beta=0.1)),
    "nemotron_h": dict(hybrid_override_pattern=["M", "*", "M", "*"]),
    "olmo_hybrid": dict(linear_allow_neg_eigval=False, layer_types=["linear_attention", "full_attention"] * 2),
    "openelm": dict(ffn_dim_divisor=8, ffn_multipliers=[2.0] * L, num_kv_heads=[KV_HEADS] * L),
    # A Hadamard pack on qwen3_5 (GDN + full attention, MoE): the embedding, every attention projection and the
    # lm_head as 2-bit affine weights (block 0: no rotation at width 128), the shared experts' down projections
    # (width 512) with a 512-wide Hadamard rotation folded in; _pack_hadamard fills the packed weights.
    "prism_hadamard_qwen35": dict(
        schema_version=1, tensor_namespace="mlx-lm-text", gdn_activation_layout="grouped",
        quantization={"bits": 2, "group_size": 128, "mode": "affine"},
        modules=[{"path": "model.embed_tokens", "embedding": True, "dtype": "float16", "block": 0},
                 {"path": "lm_head", "embedding": False, "dtype": "float16", "block": 0}]
        + [{"path": f"model.layers.{i}.self_attn.{p}_proj", "embedding": False, "dtype": "float16", "block": 0}
           for i in range(1, L, 2) for p in "qkvo"]
        + [{"path": f"model.layers.{i}.mlp.shared_expert.down_proj", "embedding": False, "dtype": "float16",
            "block": 512} for i in range(L)],
        text_config=dict(shared_expert_intermediate_size=512)),
    "plamo": dict(n_shared_head=2),  # 4 query heads over 2 K/V heads (the default 8 wants 8+ query heads)
    "phi3small": dict(dense_attention_every_n_layers=2, ff_intermediate_size=2 * H, gegelu_limit=20.0),
    "qwen": dict(intermediate_size=4 * H, kv_channels=HD),  # c_proj maps heads * kv_channels back to hidden
    "recurrent_gemma": dict(logits_soft_cap=30.0, attention_window_size=16,
                            block_types=["recurrent", "attention"]),
    "rwkv7": dict(a_low_rank_dim=16, v_low_rank_dim=16, gate_low_rank_dim=16, decay_low_rank_dim=16),
    # three sliding layers and one full layer (its default pattern), partial RoPE on the full layer
    "spark2_5": dict(hidden_act="gelu", rope_parameters={"sliding_attention": ROPE,
                                                         "full_attention": dict(ROPE, partial_rotary_factor=0.5)}),
    # Step-3.5-Flash: sliding layers with their own head counts, per-layer RoPE theta and partial factor, YaRN on
    # the full layers only, clamped SwiGLU, MoE from layer 1 with a shared expert.
    "step3p5": dict(num_attention_groups=KV_HEADS, layer_types=["full_attention", "sliding_attention"] * (L // 2),
                    attention_other_setting={"num_attention_heads": 4, "num_attention_groups": 4},
                    rope_theta=[10000.0, 5000.0] * (L // 2), partial_rotary_factors=[0.5, 1.0] * (L // 2),
                    yarn_only_types=["full_attention"], rope_scaling=YARN, moe_top_k=2, share_expert_dim=64,
                    swiglu_limits=[0.0] + [7.0] * (L - 1), swiglu_limits_shared=[0.0] + [16.0] * (L - 1)),
    # DeepSeek-V2: MLA with YaRN (mscale on the softmax scale), group-limited routing, first layer dense.
    "deepseek_v2": dict(rope_scaling=YARN, topk_method="group_limited_greedy", n_group=2, topk_group=1),
    # MiniCPM3: MLA with LongRoPE (per-frequency short/long factors, 8 = qk_rope_head_dim / 2).
    "minicpm3": dict(rope_scaling={"type": "longrope", "original_max_position_embeddings": 1024,
                                   "short_factor": [1.0 + 0.05 * i for i in range(8)],
                                   "long_factor": [1.0 + 0.5 * i for i in range(8)]}),
    "gemma4_text": GEMMA4,
    "gemma4": dict(text_config=GEMMA4),
    # full layers 0 and 3, sliding 1 and 2; attention sinks on both kinds; q/k head 48 with a 32 value head,
    # partial RoPE, value scale; the sliding layers have more KV heads (as the real 4 full / 8 sliding).
    "mimo_v2_flash": dict(hybrid_layer_pattern=[0, 1, 1, 0], moe_layer_freq=[0, 1, 1, 1],
                          add_swa_attention_sink_bias=True, add_full_attention_sink_bias=True,
                          sliding_window_size=8, topk_method="noaux_tc", scoring_func="sigmoid",
                          n_shared_experts=None, routed_scaling_factor=None, layernorm_epsilon=1e-5,
                          swa_rope_theta=10000.0, swa_num_attention_heads=HEADS, swa_num_key_value_heads=4,
                          head_dim=48, v_head_dim=HD, swa_head_dim=48, swa_v_head_dim=HD,
                          partial_rotary_factor=0.334, attention_value_scale=0.707),
    # MiniMax-M3: first layer dense, then MoE with a shared expert; block-sparse attention (an indexer with its own
    # key cache, CacheList(KVCache, KVCache)) on layers 1-3, full attention on layer 0; half-rotary RoPE.
    "minimax_m3_vl": dict(text_config=dict(
        moe_layer_freq=[0, 1, 1, 1], dense_intermediate_size=2 * H, intermediate_size=64, rotary_dim=None,
        rope_parameters=dict(ROPE, partial_rotary_factor=0.5),
        sparse_attention_config={"sparse_num_index_heads": 2, "sparse_index_dim": HD, "sparse_block_size": 4,
                                 "sparse_topk_blocks": 2, "sparse_local_block": 1,
                                 "sparse_attention_freq": [0, 1, 1, 1]})),
    # sliding and full layers, one without RoPE (layer_rope_theta 0), MoE at a compressed width on every layer
    "muse_spark": dict(text_config=dict(
        post_norm_eps=1e-5, rope_parameters=ROPE, layer_rope_theta=[10000.0, 10000.0, 10000.0, 0.0],
        layer_types=SW, final_logit_softcapping=30.0, output_multiplier=1.0, moe_hidden_size=64,
        num_shared_experts=0, mlp_layer_types=["sparse"] * L)),
    # Llama-3.1-Nemotron-51B style: a normal layer, one whose attention is gone, one whose attention and MLP are
    # single linear layers, one without an MLP; GQA group 2; llama3 RoPE scaling.
    "nemotron-nas": dict(block_configs=[
        {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 1.3}},
        {"attention": {"no_op": True}, "ffn": {"ffn_mult": 2.0}},
        {"attention": {"replace_with_linear": True}, "ffn": {"replace_with_linear": True}},
        {"attention": {"n_heads_in_group": 2}, "ffn": {"no_op": True}}],
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=1024)),
}

# architecture -> (why no tiny model runs here, where it fails: "build", "forward" (the float model's own
# forward) or None (it aborts the process, so the test cannot re-check it)). The zoo test checks that each
# entry still fails where it says, so an architecture that starts working shows up.
NOT_BUILDABLE: dict[str, tuple[str, str | None]] = {
    # ai2-olmo pins numpy<2 and pulls torch; with its import probe stubbed the model builds, but its prefill
    # still fails: it adds create_attention_mask's "causal" (a string) to the scores.
    "olmo": ("needs the ai2-olmo package (hf_olmo); mlx_lm.models.olmo exits at import without it, and its "
             "prefill adds the string mask \"causal\" to the scores (olmo.py:93)", "build"),
    "bitnet": ("its BitLinear layers run a Metal kernel; no CPU path", "forward"),
    "muse_spark": ("its attention, norms and expert routing run Metal kernels (mlx_lm.kernels); no CPU path",
                   "forward"),
}


def architectures() -> list[str]:
    """Every mlx_lm.models module that defines Model and ModelArgs (those that fail to import included)."""
    names = []
    for m in sorted(pkgutil.iter_modules(mlx_lm.models.__path__), key=lambda m: m.name):
        path = f"{mlx_lm.models.__path__[0]}/{m.name}.py"
        try:
            src = open(path).read()
        except OSError:
            continue
        if re.search(r"^class ModelArgs\b", src, re.M) and re.search(r"^class Model\b|^from .* import Model\b", src, re.M):
            names.append(m.name)
    return names


def model_args(arch: str):
    mod = importlib.import_module(f"mlx_lm.models.{arch}")
    params = dict(GENERIC, model_type=arch)
    extra = OVERRIDES.get(arch, {})
    params.update({k: v for k, v in extra.items() if k != "text_config"})
    if "text_config" in extra or "text_config" in _fields(mod.ModelArgs):
        text = dict(GENERIC, model_type=arch)
        text.update(extra.get("text_config", {}))
        params["text_config"] = text
    if hasattr(mod.ModelArgs, "from_dict"):
        return mod, mod.ModelArgs.from_dict(params)
    fields = _fields(mod.ModelArgs)  # phixtral's ModelArgs has no from_dict
    return mod, mod.ModelArgs(**{k: v for k, v in params.items() if k in fields})


def _fields(cls) -> set[str]:
    return set(inspect.signature(cls).parameters)


def tolerance(arch: str) -> float:
    return LOOSER.get(arch, (TOLERANCE, ""))[0]


TOLERANCE = 1e-2  # 8-bit logits vs the float cache, max relative error over the tokens (test_integration's measure), best of three token draws
# These tiny random models miss the 1e-2 target at 8 bits: measured max 1.0-3.6e-2 (mlx-lm's own 8-bit affine
# cache, group 32, all tokens quantized, measured beside it: bailing_moe 1.5e-2, dbrx 1.1e-2, lille-130m 1.1e-2,
# nemotron 2.1e-2, openelm 1.7e-2, olmo2 0.9e-2, mixtral 0.5e-2, bailing_moe_linear 0.7e-2: the first five are
# as sensitive to any 8-bit cache; the two MoE models flip expert routes). Each keeps a bound of about 1.5x its
# measurement, so a regression still fails, and its README row says it misses the target.
LOOSER: dict[str, tuple[float, str]] = {
    a: (t, "misses the 1e-2 target on this random-weight model") for a, t in {
        "bailing_moe": 3e-2, "bailing_moe_linear": 6e-2, "dbrx": 1.7e-2, "mixtral": 3e-2, "nemotron": 4e-2,
        "olmo2": 2e-2, "openelm": 2e-2, "lille-130m": 1.5e-2}.items()
}
# Models that were refused until issue 21, measured the same way. gemma4: mlx-lm's own 8-bit cache is worse on
# the same model (0.19-0.28 without KV sharing; with it, it raises). longcat_flash (+ngram): 1.5-2.7e-2 on
# every draw, the latent path equal to decode-to-float to 1e-7.
# afm7, at a checkpoint's int8 scale (_afm7_quant_scale; its initial scale 1.0 rounded the keys to integers and
# let 0.12 through): 1.51, 1.83, 1.27e-2 on the three draws, its KV-reuse layers attending the last layer's
# keys with the error of every layer before. The same run with the decoded codes moved by noise (noisy_codes)
# gives, best of three, 1.9e-2 at 0.5% of each token's norm, 2.9e-2 at 1% and 4.6e-2 at 2%: a bound of 2e-2
# (1.6x the 8-bit measurement) fails 1% noise and fails 2% by 2.3x (test_afm7_bound_fails_noisy_codes).
LOOSER.update({a: (t, "misses the 1e-2 target on this random-weight model") for a, t in {
    "afm7": 2e-2, "gemma4": 6.5e-2, "gemma4_text": 6.5e-2, "longcat_flash": 3e-2, "longcat_flash_ngram": 2.5e-2,
}.items()})


# The default config at low bits (test_zoo.LOW: K4/V4, decaying to K3/V2), logits vs the float cache, max relative
# error over the tokens, best of three draws: median 0.17 and 90th percentile 0.34 over the zoo. A cache that
# returned noise gives about 1.4 (uncorrelated logits); what attention does on the codes is checked to rounding
# against the same codes decoded (test_default_config_at_low_bits). Models above 0.33 keep 1.5x their measurement.
LOW_TOLERANCE = 0.5
LOW_LOOSER: dict[str, float] = {
    "mixtral": 0.51, "longcat_flash_ngram": 0.52, "minimax": 0.56, "lille-130m": 0.59, "openelm": 0.64,
    "nemotron": 0.7, "bailing_moe": 0.78, "dbrx": 0.79, "ernie4_5_moe": 0.84, "longcat_flash": 0.84,
    # its K=V layer's keys derive from decoded values; mlx-lm's own 8-bit cache is already 3x worse than ours
    "gemma4": 1.7, "gemma4_text": 1.7,
}


def low_tolerance(arch: str) -> float:
    return LOW_LOOSER.get(arch, LOW_TOLERANCE)


def build(arch: str, seed: int = 0, dtype: mx.Dtype = mx.float32) -> nn.Module:
    """A tiny random-weight model of `arch`, float32 by default."""
    mod, args = model_args(arch)
    model = _randomize(mod.Model(args), seed, dtype)
    if arch in _FINISH:
        _FINISH[arch](model, seed, dtype)
    return model


def _pack_hadamard(model: nn.Module, seed: int, dtype: mx.Dtype) -> None:
    """Packed weights for the Hadamard modules _randomize filled with floats: random float weights quantized to
    2 bits (group 128, as the packs), random +-1 signs for the rotated ones."""
    from mlx_lm.models.prism_hadamard_qwen35 import HadamardQuantizedEmbedding, HadamardQuantizedLinear

    packed = [(n, m) for n, m in model.named_modules() if isinstance(m, HadamardQuantizedLinear)]
    for i, (name, m) in enumerate(sorted(packed, key=lambda nm: nm[0])):
        rng = np.random.default_rng([seed, 1_000_003, i])
        rows, width = m.scales.shape[0], m.scales.shape[1] * m.group_size
        std = 1.0 if isinstance(m, HadamardQuantizedEmbedding) else width**-0.5
        w = mx.array((std * rng.standard_normal((rows, width))).astype(np.float32))
        m.weight, scales, biases = mx.quantize(w, group_size=m.group_size, bits=m.bits)
        m.scales, m.biases = scales.astype(dtype), biases.astype(dtype)
        if m.block:
            m.signs = mx.array(rng.choice([-1.0, 1.0], width).astype(np.float32))


def _unmask_phi3small(model: nn.Module, seed: int, dtype: mx.Dtype) -> None:
    """phi3small sets the logits of 91 unused ids of its 100352-token vocabulary (100256 and up) to -inf; the
    tiny vocabulary has none of them, and writing past its end corrupted the heap. Nothing to mask here."""
    model._dummy_tokenizer_ids = mx.array([], dtype=mx.int32)


AFM7_QUANT_SCALE = 1 / 30


def _afm7_quant_scale(model: nn.Module, seed: int, dtype: mx.Dtype) -> None:
    """afm7 rounds its keys and values to an int8 grid before they reach the cache (fake_8bit_quant, afm7.py:157):
    x -> clip(round(x / scale), -128, 127) * scale, with per-layer scales a checkpoint calibrates to its range,
    max |x| / 127. The module's initial scale, 1.0, which _randomize keeps, rounds these unit-RMS keys to the
    integers -4..4. The tiny model's keys (RMS-normalized) reach |k| <= 3.7 and its values |v| <= 4.1 over the
    zoo's token draws: at 1/30 the int8 grid spans +-4.2 in 255 steps and holds both, as a checkpoint's does."""
    for m in model.modules():
        if hasattr(m, "quant_key_scale"):
            m.quant_key_scale = mx.array(AFM7_QUANT_SCALE, dtype=dtype)
            m.quant_value_scale = mx.array(AFM7_QUANT_SCALE, dtype=dtype)


# arch -> what build does after _randomize
_FINISH = {"prism_hadamard_qwen35": _pack_hadamard, "phi3small": _unmask_phi3small, "afm7": _afm7_quant_scale}


# --- which fetch path ran -------------------------------------------------------------------------------------
# What a fetch path runs, by the name of the tq_mlx function that does it; watch_paths wraps each wherever a tq_mlx
# module binds that name (so a function that moves between modules is still found):
#   dispatch_attention    attention on the codes, kernel or reference: every view the attention hook gets. Keys
#                         and values one view: the latent (MLA decode); two views: the codes
#   turboquant_attention  the reference attention on the codes (on the CPU, what dispatch_attention runs)
#   float_tokens          a view decoded to float tensors: decode-to-float; MLA prefill chunks and its rope key;
#                         K=V layers
WATCHED = ("dispatch_attention", "turboquant_attention", "float_tokens")


def tq_function(name: str) -> tuple[Callable, list]:
    """The function `name` defined in a tq_mlx module, and every loaded tq_mlx module that binds it by name."""
    import tq_mlx  # noqa: F401  (loads the modules the package imports)

    mods = {n: m for n, m in list(sys.modules.items()) if m is not None and (n == "tq_mlx" or n.startswith("tq_mlx."))}
    found = {f for n, m in mods.items() for f in [getattr(m, name, None)] if inspect.isfunction(f) and f.__module__ == n}
    assert len(found) == 1, f"tq_mlx defines {len(found)} functions called {name}: update tests/support/zoo.WATCHED"
    (f,) = found
    return f, [m for m in mods.values() if getattr(m, name, None) is f]


def replace_function(mp, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace tq_mlx's function `name` by make(original) in every tq_mlx module that binds it (mp: a
    pytest.MonkeyPatch, which puts them back)."""
    f, modules = tq_function(name)
    new = make(f)
    for m in modules:
        mp.setattr(m, name, new)


def watch_paths(mp) -> Counter:
    """Count what runs while mp (a pytest.MonkeyPatch) is active: "codes" and "latent" (dispatch_attention on two
    views, on one view as keys and values), "reference" (turboquant_attention), "float" (float_tokens), "weighed"
    (attention on keys coded with query weights)."""
    counts: Counter = Counter()

    def attention(kind):
        def make(f):
            def counted(queries, keys, values, *args, **kwargs):
                if getattr(keys, "recent", None) is not None:  # read as decode: each run counts as it attends
                    return f(queries, keys, values, *args, **kwargs)
                if kind == "dispatch":
                    counts["latent" if keys is values else "codes"] += 1
                    counts["weighed"] += getattr(keys, "weights", None) is not None
                else:
                    counts["reference"] += 1
                return f(queries, keys, values, *args, **kwargs)
            return counted
        return make

    def decoded(f):
        def counted(*args, **kwargs):
            counts["float"] += 1
            return f(*args, **kwargs)
        return counted

    replace_function(mp, "dispatch_attention", attention("dispatch"))
    replace_function(mp, "turboquant_attention", attention("reference"))
    replace_function(mp, "float_tokens", decoded)
    return counts


def paths_ran(counts: Counter) -> frozenset[str]:
    """The fetch paths watch_paths saw run: "codes", "latent" (its prefill and rope key decode to float: part of
    it), "float"."""
    ran = {k for k in ("codes", "latent") if counts[k]}
    if counts["float"] and "latent" not in ran:
        ran.add("float")
    return frozenset(ran)


def decoded_attention(mp) -> None:
    """While mp is active, attention on views decodes them to float (float_tokens) and runs mlx's SDPA instead of
    attending the codes: the same stored tokens, so the codes path must give the same logits to rounding. The
    caches' learning step (query weights) runs first, as on the codes."""
    from tq_mlx.attention.reference import attention_by_run

    floats, _ = tq_function("float_tokens")

    def make(_):
        def attend(queries, keys, values, scale, mask=None, sinks=None, **_kwargs):
            same = keys is values
            if getattr(keys, "learn", None) is not None:  # the caches learn first, as in the hook
                keys, values = keys.learn(queries, keys, values, scale)
            if getattr(keys, "recent", None) is not None:  # a prefill read as decode: run by run, as on the codes
                return attention_by_run(attend, queries, keys, values, scale, mask, sinks)
            k = floats(keys, mx.float32)
            v = k if same else floats(values, mx.float32)
            out = mx.fast.scaled_dot_product_attention(queries.astype(mx.float32), k, v, scale=scale, mask=mask,
                                                       sinks=sinks)
            return out.astype(queries.dtype)
        return attend

    replace_function(mp, "dispatch_attention", make)


def noisy_codes(mp, rel: float) -> None:
    """While mp is active, views decoded to float (float_tokens) have each compressed token moved by noise of
    `rel` times its norm, a fixed random direction per position (a token gets the same noise at every step): what
    codes `rel` less accurate would give, for bounding a decode-to-float model's error."""
    def make(f):
        def noisy(view, dtype, *args, **kwargs):
            x = f(view, dtype, *args, **kwargs)
            s, n = view.n_sinks, view.n_coded
            if n == 0:
                return x
            H, D = x.shape[1], x.shape[3]
            e = np.random.default_rng([H, D]).standard_normal((H, s + n, D))[:, s:] / np.sqrt(D)
            part = x[:, :, s : s + n].astype(mx.float32)
            part = part + rel * mx.linalg.norm(part, axis=-1, keepdims=True) * mx.array(e.astype(np.float32))
            return mx.concatenate([x[:, :, :s], part.astype(x.dtype), x[:, :, s + n :]], axis=2)
        return noisy

    replace_function(mp, "float_tokens", make)


class TopK:
    """Sparse attention's top-k picks (deepseek_v32's Indexer, which glm_moe_dsa's model uses too), call by call:
    `record` keeps what the indexer picks; `replay` runs the indexer (which updates its own cache) but hands back
    the picks of the recorded run, keeping its own in `own`. A near tie between two tokens' index scores flips
    under any change of the cache, 8-bit included, and a flipped pick changes the output outright; replaying the
    float run's picks compares the cached run with the float one on the same tokens."""

    def __init__(self, mp):
        from mlx_lm.models.deepseek_v32 import Indexer

        self.mode, self.picks, self.own, self.calls = "record", {}, {}, Counter()
        original = Indexer.__call__

        def call(indexer, x, qr, mask, cache=None):
            picked = original(indexer, x, qr, mask, cache=cache)
            key = (id(indexer), self.calls[id(indexer)])
            self.calls[id(indexer)] += 1
            if self.mode == "record":
                self.picks[key] = picked
                return picked
            self.own[key] = picked
            return self.picks[key]

        mp.setattr(Indexer, "__call__", call)

    def start(self, mode: str) -> None:
        self.mode = mode
        self.calls.clear()
        if mode == "record":
            self.picks, self.own = {}, {}

    def sparse_calls(self) -> int:
        """Recorded calls that picked (the keys outnumbered index_topk), not attended densely."""
        return sum(p is not None for p in self.picks.values())

    def agreement(self) -> float:
        """Over the replayed calls that picked, the share of the float run's picks the cached run picked too."""
        same = total = 0
        for key, own in self.own.items():
            ref = self.picks[key]
            if own is None or ref is None:
                continue
            a, b = np.sort(np.array(own), axis=-1), np.sort(np.array(ref), axis=-1)
            same += sum(len(np.intersect1d(x, y)) for x, y in zip(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])))
            total += b.size
        return same / total if total else float("nan")


def has_indexer(model) -> bool:
    """Whether the model's attention picks its tokens with deepseek_v32's Indexer (sparse attention)."""
    from mlx_lm.models.deepseek_v32 import Indexer

    return any(isinstance(m, Indexer) for m in model.modules())
