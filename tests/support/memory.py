"""Helpers shared by the tq_mlx.planner.memory tests (tests/test_memory.py, tests/test_memory_layer_kinds.py and
tests/test_memory_decay.py), which check that the estimate from config.json equals what the caches really hold:

- `fed`, `fill`: caches fed as a model's layers feed them; `held_estimate`: the estimate with the key widths a
  cache chose; `config_dict`: a tiny model's ModelArgs as its config.json;
- `models`: the tiny llama, qwen3 and hybrid models (a module fixture: import it into a test module to use it);
- `CONFIGS`: the cache configs the estimates are checked on;
- `real_config`: config.json fields of real models (benchmarks/configs); `MLA_TINY`, `GEMMA4_TINY`: tiny MLA and
  Gemma 4 layouts, with `latent_caches` and `sliding_cache` to hold them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import RotatingKVCache

from tests.support.tiny_models import tiny_hybrid, tiny_llama, tiny_qwen3
from tq_mlx import TurboQuantConfig, TurboQuantKVCache
from tq_mlx.batch import learned
from tq_mlx.planner.memory import chosen_key_widths, chosen_value_widths, estimate_kv_bytes


def fed(cache, keys: mx.array, values: mx.array) -> None:
    """update_and_fetch as a model's layer calls it: its attention then hands the views the queries they want, so
    a key stream that weighs its keys sums them and fixes its weights, and a value stream choosing its decay bits
    measures them (the cache's learning step, tq_mlx.batch.learned), as they do in a model."""
    kh, vh = cache.update_and_fetch(keys, values)
    if getattr(kh, "learn", None) is not None:
        B, H, L, _ = keys.shape
        learned(mx.random.normal((B, 2 * H, L, kh.head_dim), key=mx.random.key(L)), kh, vh, kh.head_dim**-0.5)


def held_estimate(model_config: dict, n: int, cfg, caches, **kw) -> int:
    """estimate_kv_bytes with the key widths and value decay bits `caches` chose by their error (key_error,
    value_error): what they hold, exactly. Without a cache the estimate prices the most each layer may take
    (test_estimate_bounds_widened_keys)."""
    return estimate_kv_bytes(model_config, n, cfg, key_widths=chosen_key_widths(caches),
                             value_widths=chosen_value_widths(caches), **kw)


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
    "fractional+boundary": TurboQuantConfig(key_bits=3.5, value_bits=2.5, boundary_layers=1, window=32, calibration_tokens=None, sinks=2,
                                           step=64),
    "qjl, no window": TurboQuantConfig(key_bits=3, value_bits=2, qjl=True, window=0, calibration_tokens=None, center_values=False),
    "block": TurboQuantConfig(key_bits=2, value_bits=4, window=48, calibration_tokens=None, compress_block=16, step=32),
    "8-bit norms": TurboQuantConfig(key_bits=3, value_bits=3.5, norm_bits=8, window=32, calibration_tokens=None, step=64),
    "keys centered before RoPE": TurboQuantConfig(center_keys="rope", window=32, calibration_tokens=None, compress_block=16, step=64,
                                                  decay_after=64),
    "values by their error": TurboQuantConfig(window=48, calibration_tokens=None, compress_block=16, step=32, decay_after=96, value_error=0.08,
                                              boundary_layers=1),
    # each middle layer's values at V3, V3.5 or V4 by their output error, holding their window's queries until then
    "values by their output error": TurboQuantConfig(window=32, calibration_tokens=64, compress_block=16, step=32,
                                                     value_output_error=0.1, boundary_layers=1),
    # the boundary layers' values at V4 and kept, their keys widening and decaying as the middle layers' do
    "boundary values": TurboQuantConfig(value_bits=3, boundary_layers=1, boundary_bits=4, boundary_sides="v", window=32, calibration_tokens=None,
                                        compress_block=16, step=64, decay_after=64, decay_value_bits=2),
}



BENCH_CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"


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


# Gemma 4: sliding layers 2 kv heads x 32; full layers global_head_dim 64 with K=V's single global kv head; the
# last 2 layers (one sliding, one full) are KV-shared and hold nothing.
GEMMA4_TINY = {"model_type": "gemma4", "text_config": {
    "model_type": "gemma4_text", "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "global_head_dim": 64, "attention_k_eq_v": True, "num_global_key_value_heads": 1,
    "num_kv_shared_layers": 2, "sliding_window": 16, "hidden_size": 128,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2}}


def sliding_cache(n: int, heads: int, dim: int, window: int = 16) -> RotatingKVCache:
    """mlx-lm's sliding-window cache, fed token by token as decoding does (float32)."""
    c = RotatingKVCache(max_size=window, keep=0)
    k = mx.random.normal((1, heads, n, dim))
    for t in range(n):
        fed(c, k[:, :, t : t + 1], k[:, :, t : t + 1])
    mx.eval(c.keys, c.values)
    return c
