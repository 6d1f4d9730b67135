"""tq_mlx.planner.memory: the estimate from config.json equals what the caches really hold: after a prefill and token by
token, with cache_bytes and the bits summaries; config.json layouts; weights and the machine; tq_mlx.layout's token
counts and bytes of every part, from the bit widths alone (issue 33); and one meaning of "saved".

MLA latents, Gemma 4 / gpt-oss layer kinds, decode-to-float and bounded caches (issue 21) are in
tests/test_memory_layer_kinds.py, temporal decay (issue 23) in tests/test_memory_decay.py; the helpers they share
in tests/support/memory.py."""

from __future__ import annotations

import dataclasses
import os

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, make_prompt_cache as mlx_make_prompt_cache

from tests.support.memory import (  # noqa: F401  (models: module fixture)
    CONFIGS,
    GEMMA4_TINY,
    MLA_TINY,
    config_dict,
    fed,
    fill,
    held_estimate,
    models,
    real_config,
)
from tq_mlx import TurboQuantConfig, TurboQuantKVCache, make_prompt_cache
from tq_mlx.cache import held_bytes
from tq_mlx.models.architectures import attention_layout
from tq_mlx.stream.codec import make_quantizer
from tq_mlx.config import KEY_ERROR, WIDEST_KEY_BITS, bits_label, output_error_first_window
from tq_mlx.planner.display import bits_summary, format_bytes
from tq_mlx.planner.machine import available_memory, weight_bytes
from tq_mlx.layout import code_bytes, constant_bytes, shared_constant_bytes, stream_bytes, token_layout
from tq_mlx.planner.memory import (
    affine_kv_bytes,
    cache_bytes,
    chosen_key_widths,
    estimate_kv_bytes,
    estimate_peak_bytes,
    float16_kv_bytes,
    protect_layer_bytes,
    turboquant_layer_bytes,
    widen_layer_bytes,
)
from tq_mlx.quant.quantizer import MSE_BITS, PROD_BITS, constant_arrays
from tq_mlx.plan import layer_plan


@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("name", ["llama", "qwen3", "hybrid"])
def test_estimate_equals_real_nbytes_after_a_prefill(models, name, cfg):
    model, args = models[name]
    # 1 token: sinks only; 40: window; then compressed blocks (with step padding)
    for n in (1, 40, 300) if cfg == CONFIGS["default"] else (40, 150):
        cache = make_prompt_cache(model, cfg)
        fill(model, cache, n)
        real = held_bytes([c for c in cache if hasattr(c, "key_bits")])
        assert cache_bytes(cache)["kv_bytes"] == real
        assert held_estimate(config_dict(args), n, cfg, cache, dtype="float32") == real, (name, n)


def test_estimate_equals_real_nbytes_token_by_token(models):
    model, args = models["llama"]
    cfg = CONFIGS["block"]
    cache = make_prompt_cache(model, cfg)
    fill(model, cache, 90, one_shot=False)
    assert held_estimate(config_dict(args), 90, cfg, cache, dtype="float32") == held_bytes(cache)


@pytest.mark.parametrize("n", [5, 37, 140])
def test_short_contexts_hold_only_the_window_they_use(models, n):
    # The float16 window grows in 32-token steps until the first compression, token by token or in one shot.
    model, args = models["llama"]
    cfg = TurboQuantConfig(window=128, calibration_tokens=None)  # 4 sinks
    for one_shot in (True, False):
        cache = make_prompt_cache(model, cfg)
        fill(model, cache, n, one_shot=one_shot)
        want = {5: 32, 37: 64, 140: 128}[n]
        assert all(c.key_stream.window.shape[2] == c.value_stream.window.shape[2] == want for c in cache)
        assert held_estimate(config_dict(args), n, cfg, cache, dtype="float32") == held_bytes(cache)


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
    cache = make_prompt_cache(model, TurboQuantConfig(window=16, calibration_tokens=None))
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
    # the default's bits at every age, the keys at the width their output error chose
    assert bits_summary(cache) == f"K{tq[0].key_bits}/V{TurboQuantConfig().value_bits} on its 1 attention layer"


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
    d = TurboQuantConfig()
    tq = bits_label(d.key_bits, d.value_bits)  # the default at every age (nothing fed: no layer chose its width)
    assert bits_summary(sliding) == f"L0 float (sliding window 16) · L1 {tq} · L2 float (sliding window 16) · L3 {tq}"
    nested = make_prompt_cache(zoo.build("falcon_h1"), TurboQuantConfig(boundary_layers=1))  # KVCache in CacheList
    assert bits_summary(nested) == f"L0 K8/V8 · L1-2 {tq} · L3 K8/V8"  # boundary layers do not decay
    hybrid = make_prompt_cache(zoo.build("qwen3_next"), TurboQuantConfig())  # linear-attention state left out
    assert bits_summary(hybrid) == f"{tq} on all 2 attention layers"
    plain = make_prompt_cache(zoo.build("qwen3_next"), TurboQuantConfig(value_bits=4))
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
    from tq_mlx.planner.memory import estimate_peak_bytes

    cfg = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
           "hidden_size": 576, "intermediate_size": 1536, "torch_dtype": "float32"}
    tq = TurboQuantConfig()  # (past 8k its codes outweigh the calibration tokens waiting in float)
    peak = {(c, n): estimate_peak_bytes(cfg, n, c, weights=10**8) for c in (None, tq) for n in (8192, 16384)}
    kv = {(c, n): estimate_kv_bytes(cfg, n, c) * (2 if c is None else 1) for c in (None, tq) for n in (8192, 16384)}
    transient = {k: peak[k] - 10**8 - kv[k] for k in peak}
    assert transient[tq, 16384] == transient[tq, 8192]  # tiles of scores, whatever the context
    assert transient[None, 16384] > 3 * transient[None, 8192] // 2  # a score matrix over the whole context
    assert peak[tq, 8192] < peak[None, 8192] and peak[tq, 16384] < peak[None, 16384]
    assert estimate_peak_bytes(cfg, 8192, tq, weights=10**8, prefill_step=512) < peak[tq, 8192]  # smaller chunks


# --- tq_mlx.layout: the token counts and bytes of every part, from the bit widths alone (issue 33) ---------------


@pytest.mark.parametrize("trellis", [False, True])
def test_layers_share_one_codebook_a_width_and_a_model_counts_it_once(trellis):
    # Two layers (different seeds: their own rotations) at K4/V4 hold the same codebook (and table) arrays: each
    # layer's nbytes counts the set once (its keys and values share it), the pair's held_bytes once in all.
    cfg = TurboQuantConfig(window=8, calibration_tokens=None, compress_block=8, sinks=2, weigh_keys=False,
                           key_output_error=None, protect_factor=None, trellis=trellis)
    layers = [TurboQuantKVCache(cfg, layer_index=i) for i in (0, 1)]
    for i, c in enumerate(layers):
        k, v = (mx.random.normal((1, 2, 40, 64), key=mx.random.key(2 * i + j)) for j in (0, 1))
        c.update_and_fetch(k, v)
    (a,), (b,) = (c.key_stream.quantizer.groups for c in layers)
    (v,) = layers[0].value_stream.quantizer.groups
    assert a.centroids is b.centroids is v.centroids and a.table is b.table is v.table
    assert a.rotation is not b.rotation
    one = sum(shared_constant_bytes(64, 4, trellis=trellis).values())
    assert one == sum(x.nbytes for x in (a.centroids, a.boundaries, a.table) if x is not None) > 0
    assert held_bytes(layers) == layers[0].nbytes + layers[1].nbytes - one
    assert held_bytes(iter(layers)) == held_bytes(layers)  # any iterable, read once


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
    "default": dict(window=24, calibration_tokens=None, compress_block=8, sinks=3, step=16, decay_after=40),
    "fractional": dict(key_bits=3.5, value_bits=2.5, window=16, calibration_tokens=None, compress_block=4, sinks=2, step=32),
    "qjl, 16-bit norms": dict(key_bits=3, value_bits=2, qjl=True, window=16, calibration_tokens=None, compress_block=16, norm_bits=16,
                              step=16, weigh_keys=False),
    "8 bits": dict(key_bits=8, value_bits=8, window=8, calibration_tokens=None, compress_block=8, sinks=1, step=8),
    "no window": dict(key_bits=4, value_bits=3, window=0, calibration_tokens=None, sinks=2, step=16, decay_after=None),
    "values decay": dict(key_bits=4, value_bits=3, window=16, calibration_tokens=None, compress_block=8, sinks=0, step=16, decay_after=32,
                         decay_value_bits=1, center_values=True),
    "6 and 5 bits decaying": dict(key_bits=6, value_bits=5, window=16, calibration_tokens=None, compress_block=8, sinks=2, step=16,
                                  decay_after=32),  # K6 (float16 norms) -> K5, V5 -> V3
    "5 bits, 16-bit norms": dict(key_bits=5, value_bits=6, window=8, calibration_tokens=None, compress_block=8, sinks=1, step=16,
                                 norm_bits=16, decay_after=None),
    # fed()'s random keys and queries give a logit error of about 0.1 at K4, 0.05 at K5, 0.026 at K6
    "keys widened to 6": dict(window=24, calibration_tokens=None, compress_block=8, sinks=3, step=16, decay_after=40, key_error=0.03),
    "keys widened to 5": dict(key_bits=4, value_bits=3, window=16, calibration_tokens=None, compress_block=8, sinks=0, step=16,
                              decay_after=None, key_error=0.07),
    # keys K3-K6 by their output error: the queries of the first window's last third held until the first compression
    "keys by output error": dict(key_bits=4, value_bits=3, window=8, calibration_tokens=30, compress_block=4, sinks=2,
                                 step=16, decay_after=40, key_output_error=0.05),
    # the first compression waits for 30 tokens (held in float), the window holds 8 from then on
    "calibration tokens": dict(window=8, compress_block=4, sinks=2, step=16, decay_after=40, calibration_tokens=30),
}


@pytest.mark.parametrize("M", [None, 40, 57])
@pytest.mark.parametrize("name", LAYOUT_SWEEP)
def test_layout_equals_a_real_cache_at_every_token(name, M):
    # configs x token counts x max_kv_size: token_layout says where every token of a real cache fed token by token
    # is (sinks, decayed, fresh, window, dropped), stream_bytes what each stream holds, turboquant_layer_bytes and
    # estimate_kv_bytes what the cache holds, byte for byte; and the same after one prefill (unbounded)
    cfg = TurboQuantConfig(protect_factor=None, **LAYOUT_SWEEP[name])
    if M is not None and M < cfg.bound_floor:
        M = cfg.bound_floor  # the least bound the cache takes
    H, D, n_max = 2, 64, 150
    model = {"num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": H, "head_dim": D}
    decays = [b is not None for b in layer_plan(cfg, 0, None).decay_bits]
    k, v = mx.random.normal((1, H, n_max, D), key=mx.random.key(1)), mx.random.normal((1, H, n_max, D))
    cache = TurboQuantKVCache(cfg, max_size=M)

    def check(cache, n):
        lays = [token_layout(cfg, n, M if cache.max_size else None, decaying=d) for d in decays]
        assert (cache.n_sinks, cache.n_window, cache.n_coded, cache.n_dropped) == (
            lays[0].sinks, lays[0].window, lays[0].compressed, lays[0].dropped), (name, M, n)
        assert cache.n_decayed == tuple(lay.decayed for lay in lays), (name, M, n)
        bound = dict(max_kv_size=cache.max_size, float_bytes=4, heads=H)
        by_output = cfg.key_output_error is not None  # the model's 4 query heads: 2 per kv head
        q = dict(qjl=layer_plan(cfg).keys.qjl, center=bool(cfg.center_keys), weigh=cfg.weigh_keys,
                 span_heads=2 if by_output else None)
        kd, vd = layer_plan(cfg, 0, None).decay_bits
        width = cache.key_bits if cache.key_stream.widened else None  # the keys' choice (key_error)
        assert cache.key_stream.nbytes == stream_bytes(cfg, n, D, cfg.key_bits, decay_bits=kd, widened=width, **q,
                                                       **bound)
        assert cache.value_stream.nbytes == stream_bytes(cfg, n, D, cfg.value_bits, decay_bits=vd,
                                                         center=cfg.center_values, **bound)
        layer = turboquant_layer_bytes(n, H, D, D, cfg.key_bits, cfg.value_bits, cfg, float_bytes=4,
                                       max_kv_size=cache.max_size, key_width=width, query_heads=2)
        bound = dict(dtype="float32", max_kv_size=cache.max_size)
        assert cache.nbytes == layer == estimate_kv_bytes(model, n, cfg, key_widths=[width], **bound), (name, M, n)
        # without the cache, the plan prices the most the keys may take (the least: widen_layer_bytes less)
        most = estimate_kv_bytes(model, n, cfg, **bound)
        extra = widen_layer_bytes(model, n, cfg, **bound)
        assert (extra > 0) == ((cfg.key_error is not None or by_output) and cfg.key_bits < WIDEST_KEY_BITS), (name, n)
        if width is None:
            # one layer: the codebooks and tables only its keys at the most hold go with them too (widen_layer_bytes,
            # a layer's saving among others that may hold them, does not count them)
            held, most_held = {}, {}
            for w, d in ((None, held), (WIDEST_KEY_BITS if extra else None, most_held)):
                turboquant_layer_bytes(n, H, D, D, cfg.key_bits, cfg.value_bits, cfg, float_bytes=4, query_heads=2,
                                       max_kv_size=cache.max_size, key_width=w, shared=d)
            assert set(held) <= set(most_held)
            assert most == layer + extra + sum(b for k, b in most_held.items() if k not in held), (name, M, n)
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
    from tq_mlx.quant import quantizer
    from tq_mlx.quant import rotation

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

    from tq_mlx.planner.memory import SAVED_AGAINST, Saving, estimate_mlx_lm_bytes, planned_saving

    model, args = models["llama"]
    cfg = TurboQuantConfig(window=16, calibration_tokens=None, sinks=2)
    cache = make_prompt_cache(model, cfg)
    fill(model, cache, n)
    s = cache_bytes(cache)
    reference = mlx_make_prompt_cache(model)  # what mlx-lm itself holds for the same tokens
    fill(model, reference, n)
    assert s["mlx_lm_bytes"] == sum(c.nbytes for c in reference) == estimate_mlx_lm_bytes(config_dict(args), n,
                                                                                          dtype="float32")
    saving = Saving(s["kv_bytes"], s["mlx_lm_bytes"])
    assert (s["saved_bytes"], s["ratio"]) == (saving.saved, saving.ratio)
    assert s["saved_bytes"] == held_bytes(reference) - held_bytes(cache)
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
    from tq_mlx.planner.display import window_text

    model, _ = models["llama"]
    s = cache_bytes(make_prompt_cache(model, TurboQuantConfig()))
    assert (s["kv_bytes"], s["sinks"], s["window"], s["calibration"]) == (0, 4, 128, 768)
    s["kv_dtype"] = "float32"  # tq-chat's snapshot names the model's dtype before the first token
    # the default's window is smaller than its calibration: it holds the calibration tokens until the first compression
    assert window_text(s) == ("no tokens yet; the first 772 stay in float32 (4 sinks + 128-token window, 768 tokens "
                              "until the first compression calibrates on them): compression starts at token 773")
    s = cache_bytes(make_prompt_cache(model, TurboQuantConfig(window=768, calibration_tokens=None)))
    assert (s["window"], s["calibration"]) == (768, 768)
    s["kv_dtype"] = "float32"
    assert window_text(s) == ("no tokens yet; the first 772 stay in float32 (4 sinks + 768-token window): "
                              "compression starts at token 773")


@pytest.mark.parametrize("M", [1, 3, 4, 5, 24, 100, 256, 259, 898, 899, 5000])
def test_any_max_kv_size_fits_by_shrinking_the_window_and_block(M):
    from tq_mlx.config import check_max_size
    from tq_mlx.config import derive_config, fit_max_kv_size

    for base in (TurboQuantConfig(), TurboQuantConfig.preset("compact"), TurboQuantConfig(window=0, calibration_tokens=None, sinks=2),
                 TurboQuantConfig(window=64, calibration_tokens=None, compress_block=16), TurboQuantConfig(window=128, calibration_tokens=768)):
        fitted = fit_max_kv_size(base, M)
        if base.bound_floor <= M:
            assert fitted == base
            continue
        assert check_max_size(M, fitted) == M  # a cache bounded to M takes the fitted config
        least = base.sinks + base.window + base.compress_block_size - 1
        if least <= M:  # the window fits: the calibration tokens come down to what the bound holds
            calibration = M - base.sinks - base.compress_block_size + 1
            keys = {}  # ... and keys by their output error, where that leaves too few to measure on, by their logit error
            if base.key_output_error is not None and max(base.window, calibration) < output_error_first_window(base.window):
                keys = dict(key_output_error=None, key_error=KEY_ERROR)
            assert fitted == dataclasses.replace(base, calibration_tokens=calibration, **keys)
            assert fitted.bound_floor == M
            continue
        assert fitted.calibration_tokens is None
        K = fitted.compress_block_size
        if base.window and K > 1:  # the largest window that leaves one block of compressed tokens next to it
            assert fitted.sinks + fitted.window + 2 * K - 1 == M
        else:  # tiny bounds (or no window): blocks of 1, the bound holds the float parts and nothing more
            assert fitted.sinks + fitted.window + K - 1 == M
        assert fitted.sinks == min(base.sinks, M) and fitted.window <= base.window
        assert fitted.compress_block_size <= max(fitted.window, 1)
        # nothing else changes, but keys by their output error where the fitted first window cannot measure it
        # (too few tokens older than the window for its last third of queries to read): by their logit error instead
        if base.key_output_error is not None:
            measurable = fitted.window >= 3 and fitted.first_window >= output_error_first_window(fitted.window)
            assert (fitted.key_output_error, fitted.key_error) == (
                (base.key_output_error, None) if measurable else (None, KEY_ERROR)), (M, fitted)
        assert dataclasses.replace(fitted, sinks=base.sinks, window=base.window, compress_block=base.compress_block,
                                   calibration_tokens=base.calibration_tokens, key_output_error=base.key_output_error,
                                   key_error=base.key_error) == base
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
