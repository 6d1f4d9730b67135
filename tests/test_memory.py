"""tq_mlx.memory: the estimate from config.json equals what the caches really hold."""

from __future__ import annotations

import dataclasses
import json
import os

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, make_prompt_cache as mlx_make_prompt_cache

from tests.support.tiny_models import tiny_hybrid, tiny_llama, tiny_qwen3
from tq_mlx import TurboQuantConfig, TurboQuantKVCache, make_prompt_cache
from tq_mlx.architectures import attention_layout
from tq_mlx.display import bits_summary, format_bytes
from tq_mlx.memory import (
    affine_kv_bytes,
    available_memory,
    cache_bytes,
    chosen_key_widths,
    estimate_kv_bytes,
    float16_kv_bytes,
    weight_bytes,
)


def fed(cache, keys: mx.array, values: mx.array) -> None:
    """update_and_fetch as a model's layer calls it: its attention then takes the key view, so a key stream that
    weighs its keys sums the queries and fixes its weights (CompressedStream.observe), as it does in a model."""
    kh, _ = cache.update_and_fetch(keys, values)
    if getattr(kh, "observe", None) is not None:
        B, H, L, _ = keys.shape
        kh.observe(mx.random.normal((B, 2 * H, L, kh.head_dim), key=mx.random.key(L)))


def held_estimate(model_config: dict, n: int, cfg, caches, **kw) -> int:
    """estimate_kv_bytes with the key widths `caches` chose by their error (key_error): what they hold, exactly.
    Without a cache the estimate prices the most each layer may take (test_estimate_bounds_widened_keys)."""
    return estimate_kv_bytes(model_config, n, cfg, key_widths=chosen_key_widths(caches), **kw)


def config_dict(args) -> dict:
    """A model's ModelArgs as the config.json dict it came from."""
    return json.loads(json.dumps(dataclasses.asdict(args), default=lambda o: None))


def fill(model, cache, n: int, one_shot: bool = True) -> None:
    tokens = mx.array([[(7 * i) % 256 for i in range(n)]])
    if one_shot:
        model(tokens, cache=cache)
    else:
        for i in range(n):
            model(tokens[:, i : i + 1], cache=cache)
    mx.eval([c.state for c in cache])


@pytest.fixture(scope="module")
def models():
    return {"llama": tiny_llama(), "qwen3": tiny_qwen3(), "hybrid": tiny_hybrid()}


CONFIGS = {
    "default": TurboQuantConfig(),
    "fractional+boundary": TurboQuantConfig(key_bits=3.5, value_bits=2.5, boundary_layers=1, window=32, sinks=2,
                                           step=64),
    "qjl, no window": TurboQuantConfig(key_bits=3, value_bits=2, qjl=True, window=0, center_values=False),
    "block": TurboQuantConfig(key_bits=2, value_bits=4, window=48, compress_block=16, step=32),
    "8-bit norms": TurboQuantConfig(key_bits=3, value_bits=3.5, norm_bits=8, window=32, step=64),
    "keys centered before RoPE": TurboQuantConfig(center_keys="rope", window=32, compress_block=16, step=64,
                                                  decay_after=64),
}


@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("name", ["llama", "qwen3", "hybrid"])
def test_estimate_equals_real_nbytes_after_a_prefill(models, name, cfg):
    model, args = models[name]
    # 1 token: sinks only; 40: window; then compressed blocks (with step padding)
    for n in (1, 40, 300) if cfg == CONFIGS["default"] else (40, 150):
        cache = make_prompt_cache(model, cfg)
        fill(model, cache, n)
        real = sum(c.nbytes for c in cache if hasattr(c, "key_bits"))
        assert cache_bytes(cache)["kv_bytes"] == real
        assert held_estimate(config_dict(args), n, cfg, cache, dtype="float32") == real, (name, n)


def test_estimate_equals_real_nbytes_token_by_token(models):
    model, args = models["llama"]
    cfg = CONFIGS["block"]
    cache = make_prompt_cache(model, cfg)
    fill(model, cache, 90, one_shot=False)
    assert held_estimate(config_dict(args), 90, cfg, cache, dtype="float32") == sum(c.nbytes for c in cache)


@pytest.mark.parametrize("n", [5, 37, 140])
def test_short_contexts_hold_only_the_window_they_use(models, n):
    # The float16 window grows in 32-token steps until the first compression, token by token or in one shot.
    model, args = models["llama"]
    cfg = TurboQuantConfig(window=128)  # 4 sinks
    for one_shot in (True, False):
        cache = make_prompt_cache(model, cfg)
        fill(model, cache, n, one_shot=one_shot)
        want = {5: 32, 37: 64, 140: 128}[n]
        assert all(c.key_stream.window.shape[2] == c.value_stream.window.shape[2] == want for c in cache)
        assert held_estimate(config_dict(args), n, cfg, cache, dtype="float32") == sum(c.nbytes for c in cache)


def test_float16_and_affine_estimates_equal_mlx_lm_caches(models):
    model, args = models["llama"]
    model = model.__class__(args)  # fresh float16 weights: a float16 KVCache
    model.set_dtype(mx.float16)
    cache = mlx_make_prompt_cache(model)
    fill(model, cache, 256)  # KVCache grows in 256-token steps: no padding at 256
    assert estimate_kv_bytes(config_dict(args), 256, None) == sum(c.nbytes for c in cache)
    quantized = [c.to_quantized(group_size=64, bits=4) for c in cache]
    mx.eval([c.state for c in quantized])
    assert estimate_kv_bytes(config_dict(args), 256, None, kv_bits=4) == sum(c.nbytes for c in quantized)
    s = cache_bytes(quantized)
    assert s["kv_bytes"] == sum(c.nbytes for c in quantized) and s["tokens"] == 256
    assert s["fp16_bytes"] == sum(c.nbytes for c in cache)
    assert bits_summary(quantized) == "4-bit affine on all 3 attention layers"


def test_cache_bytes_on_a_hybrid_counts_linear_state_as_other(models):
    model, args = models["hybrid"]
    cache = make_prompt_cache(model, TurboQuantConfig(window=16))
    fill(model, cache, 100)
    s = cache_bytes(cache)
    tq = [c for c in cache if hasattr(c, "key_bits")]
    others = [c for c in cache if not hasattr(c, "key_bits")]
    assert len(tq) == 1 and len(others) == 3
    assert s["kv_bytes"] == tq[0].nbytes and s["other_bytes"] == sum(c.nbytes for c in others) > 0
    # float16 reference: 1 attention layer, 1 kv head, head_dim 256, keys + values, 2 bytes each
    assert s["fp16_bytes"] == 100 * 1 * 256 * 2 * 2
    assert s["tokens"] == 100 and s["attention_layers"] == 1 and s["turboquant_layers"] == 1
    # saved: against mlx-lm's own cache for the same tokens as it allocates it (one 256-token step, float32)
    assert s["mlx_lm_bytes"] == 1 * 1 * 256 * 2 * 256 * 4
    assert s["ratio"] == pytest.approx(s["mlx_lm_bytes"] / s["kv_bytes"])
    assert s["saved_bytes"] == s["mlx_lm_bytes"] - s["kv_bytes"]
    assert bits_summary(cache) == "K4→3/V4 after 6144 on its 1 attention layer"  # the default decays


def test_empty_cache():
    s = cache_bytes([KVCache(), KVCache()])
    assert (s["kv_bytes"], s["fp16_bytes"], s["tokens"], s["ratio"]) == (0, 0, 0, 1.0)


def test_bits_summary_shows_boundary_layers(models):
    model, _ = models["llama"]
    cache = make_prompt_cache(model, TurboQuantConfig(key_bits=3, value_bits=2, boundary_layers=1))
    assert bits_summary(cache) == "L0 K8/V8 · L1 K3/V2 · L2 K8/V8"


def test_bits_summary_of_a_pipeline_stage_names_model_layers():
    # The second stage of a pipeline holds the caches of model layers 2 and 3 (its list starts at 0).
    config = TurboQuantConfig(key_bits=3, value_bits=2, boundary_layers=1)
    stage = [TurboQuantKVCache(config, layer_index=i, attention_index=i, n_attention_layers=4) for i in (2, 3)]
    assert bits_summary(stage) == "L2 K3/V2 · L3 K8/V8"


# --- config.json layouts -------------------------------------------------------------------------------------

QWEN35_35B_A3B = {  # the parts of the real config.json that matter (text settings nested, as shipped)
    "model_type": "qwen3_5_moe",
    "text_config": {
        "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "hidden_size": 2048, "full_attention_interval": 4, "max_position_embeddings": 262144,
    },
}


def test_qwen35_hybrid_counts_only_its_attention_layers():
    lay = attention_layout(QWEN35_35B_A3B)
    assert lay.full_layers == tuple(range(3, 40, 4)) and len(lay.linear_layers) == 30
    assert (lay.n_kv_heads, lay.head_dim, lay.max_context) == (2, 256, 262144)
    # mlx-lm-integration.md §7: 20 KB per token in 16-bit, 5.4 GB at 262,144 tokens
    assert estimate_kv_bytes(QWEN35_35B_A3B, 1, None) == 20480
    assert estimate_kv_bytes(QWEN35_35B_A3B, 262144, None) == 20480 * 262144
    # 3 bits + one float16 norm per 256-vector, without decay: about 1.0 GB
    tq3 = estimate_kv_bytes(QWEN35_35B_A3B, 262144, TurboQuantConfig.from_bits(3, decay_after=None, key_error=None))
    assert 0.98e9 < tq3 < 1.1e9


def test_layer_types_and_sliding_windows():
    cfg = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512,
           "sliding_window": 100,
           "layer_types": ["sliding_attention", "full_attention", "linear_attention", "full_attention"]}
    lay = attention_layout(cfg)
    assert lay.head_dim == 64 and lay.full_layers == (1, 3) and lay.sliding_layers == ((0, 100),)
    assert lay.linear_layers == (2,)
    # sliding layers stay float16 and stop growing at the window
    assert estimate_kv_bytes(cfg, 1000, None) == 3 * float16_kv_bytes(1000, 2, 64) - float16_kv_bytes(900, 2, 64)
    gemma = {"num_hidden_layers": 12, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
             "sliding_window": 512, "sliding_window_pattern": 6}
    assert attention_layout(gemma).full_layers == (5, 11)


def test_bad_config_names_what_is_missing():
    with pytest.raises(ValueError, match="num_hidden_layers"):
        attention_layout({"hidden_size": 64})


def test_affine_bytes_formula():
    # 64 values at 4 bits = 32 bytes + float16 scale + float16 bias, per group
    assert affine_kv_bytes(1, 1, 64, bits=4) == 2 * (32 + 4)
    assert affine_kv_bytes(10, 2, 128, bits=8) == 10 * 2 * 2 * 2 * (64 + 4)


# --- weights and the machine ---------------------------------------------------------------------------------


def test_weight_bytes_from_safetensors_headers(tmp_path):
    arrays = {"a": mx.zeros((3, 5), mx.float16), "b": mx.zeros((7,), mx.float32), "q": mx.zeros((4, 4), mx.uint32)}
    mx.save_safetensors(str(tmp_path / "model-00001-of-00002.safetensors"), {k: arrays[k] for k in "ab"})
    mx.save_safetensors(str(tmp_path / "model-00002-of-00002.safetensors"), {"q": arrays["q"]})
    exact = sum(a.nbytes for a in arrays.values())
    assert weight_bytes(tmp_path) == exact
    assert weight_bytes(tmp_path, "float32") == 15 * 4 + 7 * 4 + 64  # float tensors cast, uint32 unchanged
    assert weight_bytes(tmp_path, "float16") == 15 * 2 + 7 * 2 + 64
    with pytest.raises(FileNotFoundError):
        weight_bytes(tmp_path / "nope")


def test_weight_bytes_of_a_saved_model(tmp_path, models):
    model, _ = models["qwen3"]
    params = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), params)
    assert weight_bytes(tmp_path) == sum(p.nbytes for p in params.values())


def test_available_memory_is_physical_memory_off_apple_silicon():
    got = available_memory()
    if not mx.metal.is_available():
        assert got == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert got > 2**28


@pytest.mark.parametrize(
    "n, text",
    [(0, "0 B"), (999, "999 B"), (1536, "1.54 KB"), (53_200_000, "53.2 MB"), (269_060_179, "269 MB"),
     (5.4e9, "5.40 GB"), (-28_000, "-28.0 KB"), (3e12, "3.00 TB")],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_bits_summary_names_the_layers_that_stay_float():
    from tests.support import zoo

    sliding = make_prompt_cache(zoo.build("gemma3"), TurboQuantConfig())  # global layer every second layer
    tq = "K4→3/V4 after 6144"  # the default: K4/V4, decaying to K3/V2 after 6144 tokens
    assert bits_summary(sliding) == f"L0 float (sliding window 16) · L1 {tq} · L2 float (sliding window 16) · L3 {tq}"
    nested = make_prompt_cache(zoo.build("falcon_h1"), TurboQuantConfig(boundary_layers=1))  # KVCache in CacheList
    assert bits_summary(nested) == f"L0 K8/V8 · L1-2 {tq} · L3 K8/V8"  # boundary layers do not decay
    hybrid = make_prompt_cache(zoo.build("qwen3_next"), TurboQuantConfig())  # linear-attention state left out
    assert bits_summary(hybrid) == f"{tq} on all 2 attention layers"
    plain = make_prompt_cache(zoo.build("qwen3_next"), TurboQuantConfig(decay_after=None))
    assert bits_summary(plain) == "K4/V4 on all 2 attention layers"


def test_plan_says_which_layers_are_compressed_and_which_stay_float():
    from tq_chat.plan import format_plan, make_plan

    cfg = {"num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128,
           "sliding_window": 512, "sliding_window_pattern": 3}
    text = format_plan(make_plan("m", cfg, 10**9, 8192, TurboQuantConfig(), 48 * 10**9))
    assert "2 full-attention layers compressed; 4 sliding-window layers stay float (window 512: bounded)" in text
    text = format_plan(make_plan("q", QWEN35_35B_A3B, 10**9, 8192, TurboQuantConfig(), 48 * 10**9))
    assert "10 full-attention layers compressed; 30 linear-attention layers keep a fixed-size state" in text


def test_peak_estimate_is_flat_for_turboquant_and_grows_with_the_float_cache():
    from tq_mlx.memory import estimate_peak_bytes

    cfg = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
           "hidden_size": 576, "intermediate_size": 1536, "torch_dtype": "float32"}
    tq = TurboQuantConfig()
    peak = {(c, n): estimate_peak_bytes(cfg, n, c, weights=10**8) for c in (None, tq) for n in (4096, 16384)}
    kv = {(c, n): estimate_kv_bytes(cfg, n, c) * (2 if c is None else 1) for c in (None, tq) for n in (4096, 16384)}
    transient = {k: peak[k] - 10**8 - kv[k] for k in peak}
    assert transient[tq, 16384] == transient[tq, 4096]  # tiles of scores, whatever the context
    assert transient[None, 16384] > 3 * transient[None, 4096] // 2  # a score matrix over the whole context
    assert peak[tq, 4096] < peak[None, 4096] and peak[tq, 16384] < peak[None, 16384]
    assert estimate_peak_bytes(cfg, 4096, tq, weights=10**8, prefill_step=512) < peak[tq, 4096]  # smaller chunks


# --- MLA latents, Gemma 4 / gpt-oss layer kinds, decode-to-float and bounded caches (issue 21) ------------------

from pathlib import Path  # noqa: E402

from mlx_lm.models.cache import RotatingKVCache  # noqa: E402

from tq_mlx.layout import buffer_layout  # noqa: E402
from tq_mlx.memory import (  # noqa: E402
    bounded_tokens,
    estimate_peak_bytes,
    fetch_transient_bytes,
    turboquant_layer_bytes,
)

BENCH_CONFIGS = Path(__file__).resolve().parent.parent / "benchmarks" / "configs"


def real_config(name: str) -> dict:
    """config.json fields of a real model, as the memory benchmark keeps them (sources in the file)."""
    return json.loads((BENCH_CONFIGS / name).read_text())["config"]


# DeepSeek-V3-shaped multi-head latent attention: mlx-lm caches kv_latent (512) and k_pe (64), one "head".
MLA_TINY = {"model_type": "deepseek_v3", "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
            "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 48,
            "hidden_size": 256, "intermediate_size": 512}


def latent_caches(cfg: TurboQuantConfig, n: int, one_shot: bool = True, layers: int = 3) -> list[TurboQuantKVCache]:
    """One latent TurboQuantKVCache per layer holding n tokens of a latent (1, 1, n, 512) and a rope key
    (1, 1, n, 64); the rope key is stored at the key bits, centered like keys."""
    caches = [TurboQuantKVCache(cfg, layer_index=i, attention_index=i, n_attention_layers=layers, fetch="latent")
              for i in range(layers)]
    latent, rope = mx.random.normal((1, 1, n, 512)), mx.random.normal((1, 1, n, 64))
    for c in caches:
        if one_shot:
            fed(c, latent, rope)
        else:
            for t in range(n):
                fed(c, latent[:, :, t : t + 1], rope[:, :, t : t + 1])
        mx.eval(c.held_arrays())
    return caches


@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS.keys())
def test_mla_estimate_equals_a_real_latent_cache(cfg):
    lay = attention_layout(MLA_TINY)
    assert (lay.n_kv_heads, lay.head_dim, lay.v_head_dim, lay.latent, lay.fetch) == (1, 512, 64, True, "latent")
    for n in (1, 40, 900) if cfg == CONFIGS["default"] else (40, 150):
        caches = latent_caches(cfg, n)
        assert all((c.key_dim, c.value_dim, c.value_bits) == (512, 64, c.key_bits) for c in caches)
        real = sum(c.nbytes for c in caches)
        assert estimate_kv_bytes(MLA_TINY, n, cfg, dtype="float32") == real, n
        assert cache_bytes(caches)["kv_bytes"] == real


def test_mla_estimate_equals_a_latent_cache_filled_token_by_token():
    cfg = CONFIGS["block"]
    caches = latent_caches(cfg, 90, one_shot=False)
    assert estimate_kv_bytes(MLA_TINY, 90, cfg, dtype="float32") == sum(c.nbytes for c in caches)


def test_mla_references_hold_mlx_lms_latent_layout():
    # 576 values per token and layer (not 4 heads x (32 + 64) keys and 4 x 48 values)
    assert estimate_kv_bytes(MLA_TINY, 100, None) == 3 * 100 * (512 + 64) * 2
    # affine: 8 groups of 64 for the latent, 1 for the rope key, each 32 bytes of codes + scale + bias
    assert estimate_kv_bytes(MLA_TINY, 100, None, kv_bits=4) == 3 * 100 * (8 + 1) * (32 + 4)


GPT_OSS_TINY = {"model_type": "gpt_oss", "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 64, "hidden_size": 256, "sliding_window": 16,
                "layer_types": ["sliding_attention", "full_attention"] * 2}
# Gemma 4: sliding layers 2 kv heads x 32; full layers global_head_dim 64 with K=V's single global kv head; the
# last 2 layers (one sliding, one full) are KV-shared and hold nothing.
GEMMA4_TINY = {"model_type": "gemma4", "text_config": {
    "model_type": "gemma4_text", "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "global_head_dim": 64, "attention_k_eq_v": True, "num_global_key_value_heads": 1,
    "num_kv_shared_layers": 2, "sliding_window": 16, "hidden_size": 128,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2}}


def test_gemma4_and_gpt_oss_layouts_from_tiny_configs():
    lay = attention_layout(GEMMA4_TINY)
    assert lay.full_layers == (2,) and lay.sliding_layers == ((0, 16), (1, 16), (3, 16)) and lay.shared_layers == (4, 5)
    assert (lay.n_kv_heads, lay.head_dim, lay.v_head_dim, lay.sliding_geometry) == (1, 64, 64, (2, 32, 32))
    assert lay.k_eq_v and lay.fetch == "float"  # one stream; the keys are derived on every fetch
    no_k_eq_v = {"text_config": {**GEMMA4_TINY["text_config"], "attention_k_eq_v": False}}
    assert attention_layout(no_k_eq_v).n_kv_heads == 2  # the global kv heads belong to K=V layers only
    assert not attention_layout(no_k_eq_v).k_eq_v and attention_layout(no_k_eq_v).fetch == "codes"
    lay = attention_layout(GPT_OSS_TINY)
    assert lay.full_layers == (1, 3) and lay.sliding_layers == ((0, 16), (2, 16)) and lay.sliding_kv is None
    assert lay.shared_layers == () and lay.fetch == "codes"


def sliding_cache(n: int, heads: int, dim: int, window: int = 16) -> RotatingKVCache:
    """mlx-lm's sliding-window cache, fed token by token as decoding does (float32)."""
    c = RotatingKVCache(max_size=window, keep=0)
    k = mx.random.normal((1, heads, n, dim))
    for t in range(n):
        fed(c, k[:, :, t : t + 1], k[:, :, t : t + 1])
    mx.eval(c.keys, c.values)
    return c


@pytest.mark.parametrize("n", [40, 900])
def test_gemma4_estimate_equals_real_caches(n):
    cfg = TurboQuantConfig()
    full = TurboQuantKVCache(cfg, layer_index=2, attention_index=0, n_attention_layers=1, derive_keys=lambda v: v)
    kv = mx.random.normal((1, 1, n, 64))
    fed(full, kv, kv)
    mx.eval(full.held_arrays())
    assert full.value_stream is None  # K=V: one stream
    sliding = [sliding_cache(n, 2, 32) for _ in range(3)]
    real = full.nbytes + sum(c.nbytes for c in sliding)
    assert estimate_kv_bytes(GEMMA4_TINY, n, cfg, dtype="float32") == real
    # float16 reference: 3 sliding layers at 16 tokens of 2 x (32 + 32), the full layer at n tokens of 1 x (64 + 64)
    assert estimate_kv_bytes(GEMMA4_TINY, n, None) == 3 * 16 * 2 * 64 * 2 + n * 128 * 2


def test_gpt_oss_estimate_equals_real_caches():
    cfg, n = CONFIGS["fractional+boundary"], 150
    full = [TurboQuantKVCache(cfg, layer_index=i, attention_index=a, n_attention_layers=2) for a, i in enumerate((1, 3))]
    for c in full:
        fed(c, mx.random.normal((1, 2, n, 64)), mx.random.normal((1, 2, n, 64)))
        mx.eval(c.held_arrays())
    real = sum(c.nbytes for c in full) + sum(sliding_cache(n, 2, 64).nbytes for _ in range(2))
    assert held_estimate(GPT_OSS_TINY, n, cfg, full, dtype="float32") == real


def test_layouts_of_real_configs():
    ds = real_config("deepseek-v3.json")
    lay = attention_layout(ds)
    assert (len(lay.full_layers), lay.n_kv_heads, lay.head_dim, lay.v_head_dim) == (61, 1, 512, 64)
    assert (lay.fetch, lay.latent_expansion, lay.n_heads, lay.max_context) == ("latent", 128 + 128, 128, 163840)
    # issue 21: "at 128k context a DeepSeek-V3 latent cache is ~9 GB in float16"
    assert estimate_kv_bytes(ds, 131072, None) == 61 * 576 * 2 * 131072 == 9_210_691_584
    kimi = attention_layout(real_config("kimi-k2.5.json"))  # kimi_k25 wrapping a kimi_k2 text_config
    assert (len(kimi.full_layers), kimi.n_kv_heads, kimi.head_dim, kimi.v_head_dim, kimi.fetch) == (61, 1, 512, 64,
                                                                                                      "latent")
    assert (kimi.n_heads, kimi.max_context) == (64, 262144)
    glm = attention_layout(real_config("glm-4.7-flash.json"))
    assert (len(glm.full_layers), glm.n_kv_heads, glm.head_dim, glm.v_head_dim) == (47, 1, 512, 64)
    assert (glm.fetch, glm.latent_expansion, glm.n_heads) == ("latent", 192 + 256, 20)
    oss = attention_layout(real_config("gpt-oss-20b.json"))
    assert oss.full_layers == tuple(range(1, 24, 2)) and oss.sliding_layers == tuple((i, 128) for i in range(0, 24, 2))
    assert (oss.n_kv_heads, oss.head_dim, oss.v_head_dim, oss.fetch) == (8, 64, 64, "codes")
    gemma = attention_layout(real_config("gemma-4-31b.json"))
    assert gemma.full_layers == tuple(range(5, 60, 6)) and len(gemma.sliding_layers) == 50
    assert (gemma.n_kv_heads, gemma.head_dim, gemma.sliding_geometry) == (4, 512, (16, 256, 256))
    assert gemma.shared_layers == () and {w for _, w in gemma.sliding_layers} == {1024}
    assert gemma.k_eq_v and gemma.fetch == "float"
    # per-head MLA (DeepSeek-V2.5's config.json): every query head caches a 192-wide key and a 128-wide value
    v2 = {"model_type": "deepseek_v2", "num_hidden_layers": 60, "num_attention_heads": 128, "num_key_value_heads": 128,
          "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "hidden_size": 5120}
    lay = attention_layout(v2)
    assert (lay.n_kv_heads, lay.head_dim, lay.v_head_dim, lay.latent, lay.fetch) == (128, 192, 128, False, "codes")


def test_peak_prices_the_decode_to_float_copy_and_the_mla_prefill_expansion():
    base = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
            "hidden_size": 512, "intermediate_size": 1024, "torch_dtype": "float16"}
    llama, olmo, tq = {**base, "model_type": "llama"}, {**base, "model_type": "olmo"}, TurboQuantConfig()
    assert fetch_transient_bytes(llama, 8192, tq) == 0
    assert fetch_transient_bytes(olmo, 8192, tq) == 2 * 8192 * (64 + 64) * 2  # one layer's K+V decoded to float16
    assert fetch_transient_bytes(olmo, 8192, None) == 0  # mlx-lm's float cache has nothing to decode

    def transient(cfg, n):
        return estimate_peak_bytes(cfg, n, tq, weights=0) - estimate_kv_bytes(cfg, n, tq)

    assert transient(llama, 16384) == transient(llama, 4096)  # attention on the codes: flat in the context
    assert transient(olmo, 16384) > 3 * transient(olmo, 4096) // 2  # float tensors and scores over the context
    assert transient(olmo, 4096) - transient(llama, 4096) >= fetch_transient_bytes(olmo, 4096, tq)
    # MLA prefill: embed_q / unembed_out over the context (4 heads x (32 + 48)) and the rope scores (4 heads x
    # chunk x context), in the model's dtype; TurboQuant adds the latent + rope key decoded to float
    expansion = 4 * 4096 * (32 + 48) * 2 + 4 * 512 * 4096 * 2
    assert fetch_transient_bytes(MLA_TINY, 4096, None, prefill_step=512) == expansion
    assert fetch_transient_bytes(MLA_TINY, 4096, tq, prefill_step=512) == expansion + 4096 * 576 * 2
    assert estimate_peak_bytes(MLA_TINY, 4096, None, weights=0, prefill_step=512) > expansion


@pytest.mark.parametrize("cfg", [TurboQuantConfig(window=64, compress_block=16, sinks=4, step=32),
                                 TurboQuantConfig(key_bits=3.5, value_bits=2.5, window=40, compress_block=8, sinks=2,
                                                  step=64)], ids=["K16-step32", "fractional-K8-step64"])
def test_bounded_estimate_equals_a_real_bounded_cache_token_by_token(cfg):
    M, n_max = 120, 420
    llama = {"num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
    cache = TurboQuantKVCache(cfg, max_size=M)
    k, v = mx.random.normal((1, 2, n_max, 64)), mx.random.normal((1, 2, n_max, 64))
    for t in range(n_max):
        fed(cache, k[:, :, t : t + 1], v[:, :, t : t + 1])
        mx.eval(cache.held_arrays())
        n = t + 1
        assert (cache.n_sinks, cache.n_coded, cache.n_window) == bounded_tokens(n, M, cfg), n
        assert cache.nbytes == held_estimate(llama, n, cfg, [cache], dtype="float32", max_kv_size=M), n
        assert M - cfg.compress_block_size < sum(bounded_tokens(n, M, cfg)) <= M or n <= M


def test_a_bounded_cache_stops_growing():
    cfg, M = TurboQuantConfig(window=64, compress_block=16, sinks=4, step=32), 200
    llama = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
    for n in (50, 200):  # within the bound: the unbounded figure
        assert estimate_kv_bytes(llama, n, cfg, max_kv_size=M) == estimate_kv_bytes(llama, n, cfg)
    big = [estimate_kv_bytes(llama, n, cfg, max_kv_size=M) for n in range(1000, 1064)]
    assert big == [estimate_kv_bytes(llama, n + 16 * 40, cfg, max_kv_size=M) for n in range(1000, 1064)]
    assert max(big) < estimate_kv_bytes(llama, 1000, cfg)
    assert buffer_layout(cfg, 1000, M, decaying=False).fresh < buffer_layout(cfg, 1000, decaying=False).fresh
    # mlx-lm's RotatingKVCache references keep max_kv_size tokens
    assert estimate_kv_bytes(llama, 5000, None, max_kv_size=M) == estimate_kv_bytes(llama, M, None)
    # the peak: right after a prefill chunk of 512, up to M - 1 + 512 tokens are held
    peak = estimate_peak_bytes(llama, 5000, cfg, weights=0, prefill_step=512, max_kv_size=M)
    assert peak >= estimate_kv_bytes(llama, M - 1 + 512, cfg) > estimate_kv_bytes(llama, 5000, cfg, max_kv_size=M)
    with pytest.raises(ValueError, match="max_kv_size"):
        estimate_kv_bytes(llama, 10, cfg, max_kv_size=0)
    with pytest.raises(ValueError, match="sinks \\+ window \\+ compress_block"):
        estimate_kv_bytes(llama, 10, cfg, max_kv_size=64)  # the float sinks and window alone exceed it


def test_plan_names_the_fetch_path_of_each_layer_kind():
    from tq_chat.plan import format_plan, make_plan

    tq = TurboQuantConfig()
    text = format_plan(make_plan("ds", real_config("deepseek-v3.json"), 10**9, 32768, tq, 10**12))
    assert "(61 layers, MLA latent 512 + rope key 64)" in text and "61 latent-attention (MLA) layers compressed" in text
    assert "fetch       latent: decode attends to the compressed latent on the codes" in text
    plan = make_plan("g", real_config("gemma-4-31b.json"), 10**9, 32768, tq, 10**12)
    text = format_plan(plan)
    assert "10 full-attention layers compressed; 50 sliding-window layers stay float (window 1,024: bounded)" in text
    assert "4 KV heads x 512 full, 16 x 256 sliding" in text and "fetch       decode-to-float" in text
    assert "derives its K=V layers' keys from the stored values" in text
    text = format_plan(make_plan("o", real_config("gpt-oss-20b.json"), 10**9, 32768, tq, 10**12))
    assert "12 full-attention layers compressed; 12 sliding-window layers stay float (window 128" in text
    assert "fetch       on the codes" in text
    assert plan.kv == estimate_kv_bytes(real_config("gemma-4-31b.json"), 32768, tq)
    text = format_plan(make_plan("g", GEMMA4_TINY, 10**6, 4096, tq, 10**10))
    assert "2 KV-shared layers hold no cache" in text
    olmo = {"model_type": "olmo", "num_hidden_layers": 4, "num_attention_heads": 8, "head_dim": 64}
    plan = make_plan("o", olmo, 10**6, 8192, tq, 10**10)
    assert plan.fetch_transient == fetch_transient_bytes(olmo, 8192, tq) > 0
    text = format_plan(plan)
    assert "fetch       decode-to-float" in text and format_bytes(plan.fetch_transient) in text
    assert "computes attention by hand" in text
    assert "\nfetch " not in format_plan(make_plan("o", olmo, 10**6, 8192, None, 10**10))  # no TurboQuant, no fetch
    bounded = make_plan("o", olmo, 10**6, 8192, tq, 10**10, max_kv_size=4096)
    assert bounded.kv == estimate_kv_bytes(olmo, 8192, tq, max_kv_size=4096) < plan.kv
    assert bounded.kv_fp16 == estimate_kv_bytes(olmo, 4096, None)
    assert "each full layer keeps at most 4,096 tokens while decoding" in format_plan(bounded)


def test_mla_hybrids_count_only_their_latent_layers():
    mla = {k: v for k, v in MLA_TINY.items() if k not in ("model_type", "num_hidden_layers")}
    kimi = attention_layout({**mla, "model_type": "kimi_linear", "num_hidden_layers": 8,
                             "linear_attn_config": {"kda_layers": [1, 2, 3, 5, 6, 7]}})
    assert kimi.full_layers == (3, 7) and kimi.linear_layers == (0, 1, 2, 4, 5, 6) and kimi.latent
    bailing = attention_layout({**mla, "model_type": "bailing_hybrid", "num_hidden_layers": 10, "layer_group_size": 4})
    assert bailing.full_layers == (3, 7, 8, 9) and len(bailing.linear_layers) == 6
    assert (bailing.n_kv_heads, bailing.head_dim, bailing.v_head_dim) == (1, 512, 64)


def test_a_protected_latent_layer_keeps_its_rope_key_at_the_key_bits():
    from tq_mlx.memory import protect_layer_bytes

    cfg = TurboQuantConfig(protect_factor=1.0, window=32, step=64)
    cache = TurboQuantKVCache(cfg, fetch="latent")
    k1, k2 = mx.random.split(mx.random.key(0))
    # a latent that never varies along its mean (channel 0 constant): its keys protect themselves
    latent = mx.concatenate([mx.full((1, 1, 200, 1), 20.0), mx.random.normal((1, 1, 200, 511), key=k1)], axis=-1)
    fed(cache, latent, mx.random.normal((1, 1, 200, 64), key=k2))
    mx.eval(cache.held_arrays())
    assert cache.protected and (cache.key_bits, cache.value_bits) == (8, 4)
    protected = turboquant_layer_bytes(200, 1, 512, 64, 4, 3, cfg, float_bytes=4, latent=True, protected=True)
    assert cache.nbytes == protected
    plain = turboquant_layer_bytes(200, 1, 512, 64, 4, 3, cfg, float_bytes=4, latent=True)
    assert protect_layer_bytes(MLA_TINY, 200, cfg, dtype="float32") == protected - plain > 0
    assert protect_layer_bytes(MLA_TINY, 200, TurboQuantConfig(protect_factor=None)) == 0


# --- temporal decay (issue 23): decayed tokens at the decay bits, fresh codes in a buffer of fixed size ----------

from tq_mlx.display import config_label, decay_label, window_text  # noqa: E402
from tq_mlx.memory import decayed_tokens, protect_layer_bytes  # noqa: E402
from tq_mlx.quantizer import constant_arrays  # noqa: E402
from tq_mlx.codec import make_quantizer  # noqa: E402

# Small window and blocks so that a few hundred tokens decay; no protection (a layer that protects its keys is
# priced on its own, below).
DECAY = dict(window=32, compress_block=8, sinks=2, step=32, decay_after=48, protect_factor=None)
DECAY_SIDES = {"both": dict(decay_key_bits=3, decay_value_bits=2), "keys": dict(decay_key_bits=2),
               "values": dict(decay_value_bits=1)}


@pytest.mark.parametrize("sides", DECAY_SIDES.values(), ids=DECAY_SIDES.keys())
def test_decay_estimate_equals_real_nbytes_in_one_prefill_and_token_by_token(models, sides):
    model, args = models["llama"]
    cfg = TurboQuantConfig(key_bits=4, value_bits=3, boundary_layers=1, **DECAY, **sides)  # L0 and L2: no decay
    decays = (cfg.decay_key_bits is not None, cfg.decay_value_bits is not None)
    # 30: window only; 60: the first decayed block; 150 and 230: decayed codes past a step, fresh codes at the bound
    for one_shot, ns in ((True, (30, 60, 150, 230)), (False, (150,))):
        for n in ns:
            cache = make_prompt_cache(model, cfg)
            fill(model, cache, n, one_shot)
            real = sum(c.nbytes for c in cache)
            assert held_estimate(config_dict(args), n, cfg, cache, dtype="float32") == real, (one_shot, n)
            assert cache[1].n_decayed == tuple(decayed_tokens(n, None, cfg) if d else 0 for d in decays), n
            assert cache[0].n_decayed == cache[2].n_decayed == (0, 0)
    # 150 tokens: 2 sinks, 120 compressed, 28 in the window; fresh and window tokens at most 48, in whole blocks
    assert max(cache[1].n_decayed) == decayed_tokens(150, None, cfg) == 104
    s = cache_bytes(cache)
    assert s["kv_bytes"] == real and s["decayed_tokens"] == 104 and s["compressed_tokens"] == cache[1].n_coded
    assert s["compressed_tokens"] == 120 and "120 tokens compressed (104 decayed), 30 in float32" in window_text(s)
    label = decay_label(4, 3, False, tuple(b if d else None for b, d in zip((cfg.decay_key_bits,
                                                                              cfg.decay_value_bits), decays)), 48)
    assert bits_summary(cache) == f"L0 K8/V8 · L1 {label} · L2 K8/V8"


def test_decay_labels():
    assert decay_label(4, 3, False, (3, 2), 2048) == "K4→3/V3→2 after 2048"
    assert decay_label(4, 3, True, (None, 2), 2048) == "K4+qjl/V3→2 after 2048"
    assert decay_label(4, 3, False, (3, None), 2048) == "K4→3/V3 after 2048"
    assert decay_label(4, 3, False, (None, None), 2048) == decay_label(4, 3) == "K4/V3"
    cfg = TurboQuantConfig(decay_after=2048, decay_key_bits=3, decay_value_bits=2, boundary_layers=1)
    assert config_label(cfg) == "K4→3/V4→2 after 2048" and config_label(cfg, 0, 4) == "K8/V8"
    assert config_label(TurboQuantConfig()) == "K4→3/V4 after 6144"
    assert config_label(TurboQuantConfig(), 0, 4) == "K4→3/V4 after 6144"
    assert config_label(TurboQuantConfig(boundary_layers=1), 3, 4) == "K8/V8"
    assert config_label(TurboQuantConfig(decay_after=None)) == "K4/V4"
    assert config_label(TurboQuantConfig(value_bits=3)) == "K4→3/V3 after 6144"  # every width decays by one rule (values keep theirs)
    assert config_label(TurboQuantConfig(key_bits=3.5, value_bits=3.5)) == "K3.5/V3.5"  # ... but fractional ones
    assert config_label(TurboQuantConfig(value_bits=3, decay_value_bits=2)) == "K4→3/V3→2 after 6144"
    assert config_label(TurboQuantConfig(value_bits=3, decay_key_bits=None)) == "K4/V3"  # nothing left to decay
    assert config_label(TurboQuantConfig(value_bits=3, decay_key_bits=None, decay_value_bits=2)) == "K4/V3→2 after 6144"


@pytest.mark.parametrize("sides", DECAY_SIDES.values(), ids=DECAY_SIDES.keys())
def test_decay_estimate_equals_a_latent_cache(sides):
    # the rope key (the value stream) decays at the key's decay bits: values-only decay leaves a latent layer alone
    cfg = TurboQuantConfig(**DECAY, **sides)
    kd = cfg.decay_key_bits
    for one_shot, n in ((True, 60), (True, 230), (False, 150)):
        caches = latent_caches(cfg, n, one_shot=one_shot)
        assert estimate_kv_bytes(MLA_TINY, n, cfg, dtype="float32") == sum(c.nbytes for c in caches), n
        d = decayed_tokens(n, None, cfg) if kd else 0
        assert all(c.n_decayed == (d, d) for c in caches)
    if kd:
        assert caches[0].value_stream.decay[1].bits == kd and d > 0
        assert bits_summary(caches) == f"K4→{kd}/V4→{kd} after 48 on all 3 attention layers"


@pytest.mark.parametrize("sides", DECAY_SIDES.values(), ids=DECAY_SIDES.keys())
def test_decay_estimate_equals_a_k_eq_v_cache(sides):
    # Gemma 4's K=V layer holds one stream of values at the key bits: it decays at the key's decay bits
    cfg = TurboQuantConfig(**DECAY, **sides)
    for one_shot, n in ((True, 230), (False, 150)):
        full = TurboQuantKVCache(cfg, layer_index=2, attention_index=0, n_attention_layers=1, derive_keys=lambda v: v)
        kv = mx.random.normal((1, 1, n, 64))
        if one_shot:
            fed(full, kv, kv)
        else:
            for t in range(n):
                fed(full, kv[:, :, t : t + 1], kv[:, :, t : t + 1])
        mx.eval(full.held_arrays())
        assert full.n_decayed == (decayed_tokens(n, None, cfg) if cfg.decay_key_bits else 0, 0)
        real = full.nbytes + sum(sliding_cache(n, 2, 32).nbytes for _ in range(3))
        assert estimate_kv_bytes(GEMMA4_TINY, n, cfg, dtype="float32") == real, (one_shot, n)


@pytest.mark.parametrize("M", [50, 51, 56, 90, 200])
def test_decay_estimate_equals_a_bounded_cache_token_by_token(M):
    # M <= sinks + decay_after (50): the bound keeps too few tokens for any to decay; above it drops take decayed
    # tokens only (one block decays for each block dropped), so fresh codes and window are the unbounded cache's
    cfg = TurboQuantConfig(key_bits=4, value_bits=3, **dict(DECAY, step=16), decay_key_bits=3, decay_value_bits=2)
    llama = {"num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
    cache = TurboQuantKVCache(cfg, max_size=M)
    n_max = 260
    k, v = mx.random.normal((1, 2, n_max, 64)), mx.random.normal((1, 2, n_max, 64))
    decayed = set()
    for t in range(n_max):
        fed(cache, k[:, :, t : t + 1], v[:, :, t : t + 1])
        mx.eval(cache.held_arrays())
        n = t + 1
        assert (cache.n_sinks, cache.n_coded, cache.n_window) == bounded_tokens(n, M, cfg), n
        assert cache.n_decayed == (decayed_tokens(n, M, cfg),) * 2, n
        fresh, held = buffer_layout(cfg, n, M).fresh, buffer_layout(cfg, n, M).decayed
        assert cache.key_stream.capacity == fresh and held == (cache.key_stream.decayed[0].shape[2]
                                                               if cache.key_stream.decayed else 0), n
        assert cache.nbytes == held_estimate(llama, n, cfg, [cache], dtype="float32", max_kv_size=M), n
        decayed.add(cache.n_decayed[0])
    assert (max(decayed) == 0) == (M <= cfg.sinks + cfg.decay_after)


def test_a_protected_layer_does_not_decay_its_keys_but_its_rope_key_decays():
    from tq_mlx.memory import protect_layer_bytes

    cfg = TurboQuantConfig(protect_factor=1.0, window=32, step=64, decay_after=64, decay_key_bits=3,
                           decay_value_bits=2)
    k1, k2 = mx.random.split(mx.random.key(0))
    latent = mx.concatenate([mx.full((1, 1, 300, 1), 20.0), mx.random.normal((1, 1, 300, 511), key=k1)], axis=-1)
    rope = mx.random.normal((1, 1, 300, 64), key=k2)
    for fetch, dims in (("latent", (512, 64)), ("codes", (512, 512))):
        cache = TurboQuantKVCache(cfg, fetch=fetch)
        fed(cache, latent, rope if fetch == "latent" else latent)
        mx.eval(cache.held_arrays())
        assert cache.protected and cache.n_decayed == (0, decayed_tokens(300, None, cfg)) == (0, 256)
        flags = dict(float_bytes=4, latent=fetch == "latent")
        protected = turboquant_layer_bytes(300, 1, *dims, cfg.key_bits, cfg.value_bits, cfg, protected=True, **flags)
        assert cache.nbytes == protected
        # the rope key decays at the key's decay bits, plain values at theirs (the default K4/V4)
        label = "K8/V4→3 after 64" if fetch == "latent" else "K8/V4→2 after 64"
        assert bits_summary([cache]) == f"{label} on its 1 attention layer"
    protected, plain = (turboquant_layer_bytes(300, 1, 512, 64, cfg.key_bits, cfg.value_bits, cfg, float_bytes=4,
                                               latent=True, protected=p) for p in (True, False))
    assert protect_layer_bytes(MLA_TINY, 300, cfg, dtype="float32") == protected - plain > 0


def test_decay_bits_per_value_at_32k_by_hand():
    # K4/V3, window 768, blocks of 128, 4 sinks, decaying to K3/V2 after 2048 tokens; float parts in float16; 8 kv
    # heads (the constants of a layer's four quantizers are shared by its heads).
    # At 32,768 tokens: 32,000 compressed, 764 in the window; all but the newest 2,048 - 764 = 1,284 fresh and window
    # tokens, rounded to whole blocks, decayed: 30,720. The fresh buffer holds the most fresh codes there can be,
    # 2,048 - 641 = 1,407, in steps of 256: 1,536.
    ctx, H = 32768, 8
    for D, norm_bits, want in ((128, 16, 3.01), (128, 8, 2.95), (64, 16, 3.13), (64, 8, 3.01)):
        cfg = TurboQuantConfig(key_bits=4, value_bits=3, window=768, compress_block=128, decay_after=2048,
                               decay_key_bits=3, decay_value_bits=2, norm_bits=norm_bits, weigh_keys=False)
        assert bounded_tokens(ctx, None, cfg) == (4, 32000, 764) and decayed_tokens(ctx, None, cfg) == 30720
        assert (buffer_layout(cfg, ctx).fresh, buffer_layout(cfg, ctx).decayed) == (1536, 30720)
        norm = norm_bits // 8
        per_token = {b: D * b // 8 + norm for b in (4, 3, 2)}  # packed codes and one norm per token and head
        codes = 1536 * (per_token[4] + per_token[3]) + 30720 * (per_token[3] + per_token[2])
        floats = (4 + 768) * 2 * D * 2  # sinks and window, keys and values
        centering = 4 * (D + 2)  # μ (keys), a scale per stream
        constants = sum(a.nbytes for b in (4, 3, 3, 2) for a in constant_arrays(make_quantizer(D, b, False, 0,
                                                                                               cfg.norm_dtype)))
        layer = H * (codes + floats + centering) + constants
        model = {"num_hidden_layers": 1, "num_attention_heads": H, "num_key_value_heads": H, "head_dim": D}
        assert estimate_kv_bytes(model, ctx, cfg, dtype="float16") == layer
        weighed = dataclasses.replace(cfg, weigh_keys=True)  # and the keys' query weights: B·H·D float32
        assert estimate_kv_bytes(model, ctx, weighed, dtype="float16") == layer + H * 4 * D
        assert round(layer * 8 / (ctx * H * D * 2), 2) == want


# --- tq_mlx.layout: the token counts and bytes of every part, from the bit widths alone (issue 33) ---------------

from tq_mlx.layout import code_bytes, constant_bytes, stream_bytes, token_layout  # noqa: E402
from tq_mlx.quantizer import MSE_BITS, PROD_BITS  # noqa: E402
from tq_mlx.config import WIDEST_KEY_BITS  # noqa: E402
from tq_mlx.memory import widen_layer_bytes  # noqa: E402


def test_layout_code_and_constant_bytes_equal_real_quantizers():
    # Pricing builds no quantizer: the bytes per token (packed words, norms, QJL bits, channel groups) and the
    # constants (rotations dense or Hadamard, codebooks, lookup tables, channel lists, QJL projection) come from
    # the bit widths, and equal what a real quantizer stores and holds.
    import math

    for dim in (16, 48, 64, 80, 96, 128, 192, 256, 576):
        for bits in MSE_BITS:
            for qjl in (False, True) if bits in PROD_BITS else (False,):
                if bits != int(bits) and (dim % 4 or dim < 64):
                    continue
                for norm_bits in (16, 8):
                    q = make_quantizer(dim, bits, qjl, 3, mx.float16 if norm_bits == 16 else mx.uint8)
                    probe = q.quantize(mx.zeros((1, 1, 1, dim), mx.float32))
                    per_token = sum(math.prod(a.shape[3:]) * a.dtype.size for a in probe)
                    assert code_bytes(dim, bits, qjl, norm_bits) == per_token, (dim, bits, qjl, norm_bits)
                    assert constant_bytes(dim, bits, qjl) == sum(a.nbytes for a in constant_arrays(q)), (dim, bits)


LAYOUT_SWEEP = {
    "default": dict(window=24, compress_block=8, sinks=3, step=16, decay_after=40),
    "fractional": dict(key_bits=3.5, value_bits=2.5, window=16, compress_block=4, sinks=2, step=32),
    "qjl, 16-bit norms": dict(key_bits=3, value_bits=2, qjl=True, window=16, compress_block=16, norm_bits=16,
                              step=16, weigh_keys=False),
    "8 bits": dict(key_bits=8, value_bits=8, window=8, compress_block=8, sinks=1, step=8),
    "no window": dict(key_bits=4, value_bits=3, window=0, sinks=2, step=16, decay_after=None),
    "values decay": dict(key_bits=4, value_bits=3, window=16, compress_block=8, sinks=0, step=16, decay_after=32,
                         decay_value_bits=1, center_values=True),
    "6 and 5 bits decaying": dict(key_bits=6, value_bits=5, window=16, compress_block=8, sinks=2, step=16,
                                  decay_after=32),  # K6 (float16 norms) -> K5, V5 -> V3
    "5 bits, 16-bit norms": dict(key_bits=5, value_bits=6, window=8, compress_block=8, sinks=1, step=16,
                                 norm_bits=16, decay_after=None),
    # fed()'s random keys and queries give a logit error of about 0.1 at K4, 0.05 at K5, 0.026 at K6
    "keys widened to 6": dict(window=24, compress_block=8, sinks=3, step=16, decay_after=40, key_error=0.03),
    "keys widened to 5": dict(key_bits=4, value_bits=3, window=16, compress_block=8, sinks=0, step=16,
                              decay_after=None, key_error=0.07),
}


@pytest.mark.parametrize("M", [None, 40, 57])
@pytest.mark.parametrize("name", LAYOUT_SWEEP)
def test_layout_equals_a_real_cache_at_every_token(name, M):
    # configs x token counts x max_kv_size: token_layout says where every token of a real cache fed token by token
    # is (sinks, decayed, fresh, window, dropped), stream_bytes what each stream holds, turboquant_layer_bytes and
    # estimate_kv_bytes what the cache holds, byte for byte; and the same after one prefill (unbounded)
    cfg = TurboQuantConfig(protect_factor=None, **LAYOUT_SWEEP[name])
    K = cfg.compress_block_size
    if M is not None and M < cfg.sinks + cfg.window + K - 1:
        M = cfg.sinks + cfg.window + K - 1  # the least bound the cache takes
    H, D, n_max = 2, 64, 150
    model = {"num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": H, "head_dim": D}
    decays = [b is not None for b in cfg.layer_decay_bits(0, None)]
    k, v = mx.random.normal((1, H, n_max, D), key=mx.random.key(1)), mx.random.normal((1, H, n_max, D))
    cache = TurboQuantKVCache(cfg, max_size=M)

    def check(cache, n):
        lays = [token_layout(cfg, n, M if cache.max_size else None, decaying=d) for d in decays]
        assert (cache.n_sinks, cache.n_window, cache.n_coded, cache.n_dropped) == (
            lays[0].sinks, lays[0].window, lays[0].compressed, lays[0].dropped), (name, M, n)
        assert cache.n_decayed == tuple(lay.decayed for lay in lays), (name, M, n)
        bound = dict(max_kv_size=cache.max_size, float_bytes=4, heads=H)
        q = dict(qjl=cfg.layer_qjl(cfg.key_bits), center=bool(cfg.center_keys), weigh=cfg.weigh_keys)
        kd, vd = cfg.layer_decay_bits(0, None)
        width = cache.key_bits if cache.key_stream.widened else None  # the keys' choice (key_error)
        assert cache.key_stream.nbytes == stream_bytes(cfg, n, D, cfg.key_bits, decay_bits=kd, widened=width, **q,
                                                       **bound)
        assert cache.value_stream.nbytes == stream_bytes(cfg, n, D, cfg.value_bits, decay_bits=vd,
                                                         center=cfg.center_values, **bound)
        layer = turboquant_layer_bytes(n, H, D, D, cfg.key_bits, cfg.value_bits, cfg, float_bytes=4,
                                       max_kv_size=cache.max_size, key_width=width)
        bound = dict(dtype="float32", max_kv_size=cache.max_size)
        assert cache.nbytes == layer == estimate_kv_bytes(model, n, cfg, key_widths=[width], **bound), (name, M, n)
        # without the cache, the plan prices the most the keys may take (the least: widen_layer_bytes less)
        most = estimate_kv_bytes(model, n, cfg, **bound)
        extra = widen_layer_bytes(model, n, cfg, **bound)
        assert (extra > 0) == (cfg.key_error is not None and cfg.key_bits < WIDEST_KEY_BITS), (name, n)
        if width is None:
            assert most == layer + extra, (name, M, n)
        else:
            assert layer <= most and (layer == most) == (width == WIDEST_KEY_BITS), (name, M, n)
        if name.startswith("keys widened") and cache.n_coded:
            assert cache.key_stream.widened and cache.key_bits == (6 if cfg.key_error < 0.05 else 5), (name, n)

    for t in range(n_max):
        fed(cache, k[:, :, t : t + 1], v[:, :, t : t + 1])
        mx.eval(cache.held_arrays())
        check(cache, t + 1)
    if M is None:
        for n in (1, cfg.sinks + cfg.window + 1, 77, n_max):
            one = TurboQuantKVCache(cfg)
            fed(one, k[:, :, :n], v[:, :, :n])
            mx.eval(one.held_arrays())
            check(one, n)


def test_pricing_builds_no_quantizer_or_rotation(monkeypatch):
    from tq_mlx import quantizer, rotation

    def refuse(*args, **kwargs):
        raise AssertionError("pricing a cache built a quantizer or a rotation")

    for cls in (quantizer.TurboQuantMSE, quantizer.TurboQuantProd, rotation.Rotation):
        monkeypatch.setattr(cls, "__init__", refuse)
    for cfg in (*CONFIGS.values(), TurboQuantConfig(protect_factor=1.0, boundary_layers=1)):
        for model in (MLA_TINY, GEMMA4_TINY, real_config("deepseek-v3.json")):
            assert estimate_kv_bytes(model, 40_000, cfg) > 0
            assert estimate_peak_bytes(model, 40_000, cfg, weights=0, max_kv_size=20_000) > 0
            protect_layer_bytes(model, 40_000, cfg)


# --- one meaning of "saved": against mlx-lm's own cache for the same tokens, as mlx-lm allocates it ---------------


@pytest.mark.parametrize("n", [42, 300])
def test_saved_is_against_mlx_lm_own_cache_and_the_plan_agrees(models, n):
    from mlx_lm.models.cache import RotatingKVCache

    from tq_mlx.memory import SAVED_AGAINST, Saving, estimate_mlx_lm_bytes, planned_saving

    model, args = models["llama"]
    cfg = TurboQuantConfig(window=16, sinks=2)
    cache = make_prompt_cache(model, cfg)
    fill(model, cache, n)
    s = cache_bytes(cache)
    reference = mlx_make_prompt_cache(model)  # what mlx-lm itself holds for the same tokens
    fill(model, reference, n)
    assert s["mlx_lm_bytes"] == sum(c.nbytes for c in reference) == estimate_mlx_lm_bytes(config_dict(args), n,
                                                                                          dtype="float32")
    saving = Saving(s["kv_bytes"], s["mlx_lm_bytes"])
    assert (s["saved_bytes"], s["ratio"]) == (saving.saved, saving.ratio)
    assert s["saved_bytes"] == sum(c.nbytes for c in reference) - sum(c.nbytes for c in cache)
    # the planner, from config.json alone, gives the same two numbers for the same state
    widths = chosen_key_widths(cache)
    assert planned_saving(config_dict(args), n, cfg, dtype="float32", key_widths=widths) == saving
    assert planned_saving(config_dict(args), n, cfg, dtype="float32").held >= saving.held  # the most keys take
    assert "mlx-lm's own cache for the same tokens" in SAVED_AGAINST
    # bounded: mlx-lm's RotatingKVCache, token by token, against the bounded TurboQuant cache's reference
    M = 40
    rotating, bounded = RotatingKVCache(max_size=M, keep=4), TurboQuantKVCache(cfg, max_size=M)
    k, v = mx.random.normal((1, 2, n, 64)), mx.random.normal((1, 2, n, 64))
    for t in range(n):
        rotating.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        fed(bounded, k[:, :, t : t + 1], v[:, :, t : t + 1])
    mx.eval(rotating.state, bounded.held_arrays())
    llama1 = {"num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
    assert cache_bytes([bounded])["mlx_lm_bytes"] == rotating.nbytes == estimate_mlx_lm_bytes(
        llama1, n, dtype="float32", max_kv_size=M)


def test_an_empty_turboquant_cache_already_says_where_compression_starts(models):
    from tq_mlx.display import window_text

    model, _ = models["llama"]
    s = cache_bytes(make_prompt_cache(model, TurboQuantConfig()))
    assert (s["kv_bytes"], s["sinks"], s["window"]) == (0, 4, 768)
    s["kv_dtype"] = "float32"  # tq-chat's snapshot names the model's dtype before the first token
    assert window_text(s) == ("no tokens yet; the first 772 stay in float32 (4 sinks + 768-token window): "
                              "compression starts at token 773")


@pytest.mark.parametrize("M", [1, 3, 4, 5, 24, 100, 256, 259, 898, 899, 5000])
def test_any_max_kv_size_fits_by_shrinking_the_window_and_block(M):
    from tq_mlx.cache import check_max_size
    from tq_mlx.config import derive_config, fit_max_kv_size

    for base in (TurboQuantConfig(), TurboQuantConfig.preset("compact"), TurboQuantConfig(window=0, sinks=2),
                 TurboQuantConfig(window=64, compress_block=16)):
        fitted = fit_max_kv_size(base, M)
        least = base.sinks + base.window + base.compress_block_size - 1
        if least <= M:
            assert fitted == base
            continue
        assert check_max_size(M, fitted) == M  # a cache bounded to M takes the fitted config
        K = fitted.compress_block_size
        if base.window and K > 1:  # the largest window that leaves one block of compressed tokens next to it
            assert fitted.sinks + fitted.window + 2 * K - 1 == M
        else:  # tiny bounds (or no window): blocks of 1, the bound holds the float parts and nothing more
            assert fitted.sinks + fitted.window + K - 1 == M
        assert fitted.sinks == min(base.sinks, M) and fitted.window <= base.window
        assert fitted.compress_block_size <= max(fitted.window, 1)
        # nothing else changes
        assert dataclasses.replace(fitted, sinks=base.sinks, window=base.window,
                                   compress_block=base.compress_block) == base
    # derive_config is where the commands fit it; the library's explicit config is refused, naming the way out
    assert derive_config("default", max_kv_size=M) == fit_max_kv_size(TurboQuantConfig(), M)
    if M < 899:
        with pytest.raises(ValueError, match="fit_max_kv_size"):
            check_max_size(M, TurboQuantConfig())


@pytest.mark.parametrize("M", [10, 24, 100])
def test_a_fitted_bounded_cache_holds_at_most_its_bound_and_the_planner_prices_it(M):
    from tq_mlx.config import fit_max_kv_size

    cfg = fit_max_kv_size(TurboQuantConfig(step=32), M)
    llama = {"num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
    cache = TurboQuantKVCache(cfg, max_size=M)
    n = 3 * M + 40
    k, v = (mx.random.normal((1, 2, n, 64), key=mx.random.key(M + s)) for s in (0, 1))
    for t in range(n):
        fed(cache, k[:, :, t : t + 1], v[:, :, t : t + 1])
        mx.eval(cache.held_arrays())
        assert cache.n_held <= M
        assert cache.nbytes == held_estimate(llama, t + 1, cfg, [cache], dtype="float32", max_kv_size=M), t + 1
        if t + 1 > M:  # compressed tokens remain next to the window after every drop
            assert cache.n_coded > 0, t + 1
