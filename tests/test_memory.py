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
from tq_mlx.memory import (
    affine_kv_bytes,
    attention_layout,
    available_memory,
    bits_summary,
    cache_bytes,
    estimate_kv_bytes,
    float16_kv_bytes,
    format_bytes,
    weight_bytes,
)


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
        assert estimate_kv_bytes(config_dict(args), n, cfg, dtype="float32") == real, (name, n)


def test_estimate_equals_real_nbytes_token_by_token(models):
    model, args = models["llama"]
    cfg = CONFIGS["block"]
    cache = make_prompt_cache(model, cfg)
    fill(model, cache, 90, one_shot=False)
    assert estimate_kv_bytes(config_dict(args), 90, cfg, dtype="float32") == sum(c.nbytes for c in cache)


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
        assert estimate_kv_bytes(config_dict(args), n, cfg, dtype="float32") == sum(c.nbytes for c in cache)


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
    assert s["ratio"] == pytest.approx(s["fp16_bytes"] / s["kv_bytes"])
    assert s["saved_bytes"] == s["fp16_bytes"] - s["kv_bytes"]
    assert bits_summary(cache) == "K4/V3 on its 1 attention layer"


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
    # 3 bits + one float16 norm per 256-vector: about 1.0 GB
    tq3 = estimate_kv_bytes(QWEN35_35B_A3B, 262144, TurboQuantConfig.from_bits(3))
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
    assert bits_summary(sliding) == "L0 float (sliding window 16) · L1 K4/V3 · L2 float (sliding window 16) · L3 K4/V3"
    nested = make_prompt_cache(zoo.build("falcon_h1"), TurboQuantConfig(boundary_layers=1))  # KVCache in CacheList
    assert bits_summary(nested) == "L0 K8/V8 · L1-2 K4/V3 · L3 K8/V8"
    hybrid = make_prompt_cache(zoo.build("qwen3_next"), TurboQuantConfig())  # linear-attention state left out
    assert bits_summary(hybrid) == "K4/V3 on all 2 attention layers"


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
