"""tq_mlx.planner.memory: the estimate from config.json equals what the caches really hold, for MLA latents, Gemma 4 /
gpt-oss layer kinds, decode-to-float and bounded caches (issue 21)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from tests.support.memory import (
    CONFIGS,
    GEMMA4_TINY,
    MLA_TINY,
    fed,
    held_estimate,
    latent_caches,
    real_config,
    sliding_cache,
)
from tq_mlx.cache import held_bytes
from tq_mlx import TurboQuantConfig, TurboQuantKVCache
from tq_mlx.models.architectures import attention_layout
from tq_mlx.planner.display import format_bytes
from tq_mlx.layout import buffer_layout
from tq_mlx.planner.memory import (
    bounded_tokens,
    cache_bytes,
    estimate_kv_bytes,
    estimate_peak_bytes,
    fetch_transient_bytes,
    turboquant_layer_bytes,
)


@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS.keys())
def test_mla_estimate_equals_a_real_latent_cache(cfg):
    lay = attention_layout(MLA_TINY)
    assert (lay.n_kv_heads, lay.head_dim, lay.v_head_dim, lay.latent, lay.fetch) == (1, 512, 64, True, "latent")
    for n in (1, 40, 900) if cfg == CONFIGS["default"] else (40, 150):
        caches = latent_caches(cfg, n)
        assert all((c.key_dim, c.value_dim, c.value_bits) == (512, 64, c.key_bits) for c in caches)
        real = held_bytes(caches)
        assert estimate_kv_bytes(MLA_TINY, n, cfg, dtype="float32") == real, n
        assert cache_bytes(caches)["kv_bytes"] == real


def test_mla_estimate_equals_a_latent_cache_filled_token_by_token():
    cfg = CONFIGS["block"]
    caches = latent_caches(cfg, 90, one_shot=False)
    assert estimate_kv_bytes(MLA_TINY, 90, cfg, dtype="float32") == held_bytes(caches)


def test_mla_references_hold_mlx_lms_latent_layout():
    # 576 values per token and layer (not 4 heads x (32 + 64) keys and 4 x 48 values)
    assert estimate_kv_bytes(MLA_TINY, 100, None) == 3 * 100 * (512 + 64) * 2
    # affine: 8 groups of 64 for the latent, 1 for the rope key, each 32 bytes of codes + scale + bias
    assert estimate_kv_bytes(MLA_TINY, 100, None, kv_bits=4) == 3 * 100 * (8 + 1) * (32 + 4)


GPT_OSS_TINY = {"model_type": "gpt_oss", "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 64, "hidden_size": 256, "sliding_window": 16,
                "layer_types": ["sliding_attention", "full_attention"] * 2}


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
    real = held_bytes(full) + sum(sliding_cache(n, 2, 64).nbytes for _ in range(2))
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
    # (prefill not read as decode: its transient is priced below, on its own)
    llama, olmo = {**base, "model_type": "llama"}, {**base, "model_type": "olmo"}
    tq = TurboQuantConfig(prefill_as_decode=False)
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
    # a prefill read as decode joins the window before the chunk and the chunk in float32, cast to float16, per side;
    # a float-fetch layer (olmo) and a context inside the window have none
    pd = TurboQuantConfig(prefill_as_decode=True)
    assert fetch_transient_bytes(llama, 8192, pd) == 2 * (768 + 2048) * (64 + 64) * (4 + 2)
    assert fetch_transient_bytes(olmo, 8192, pd) == fetch_transient_bytes(olmo, 8192, tq)
    assert fetch_transient_bytes(llama, 700, pd) == 0
    # with calibration tokens the most is at the first compression: the calibration tokens waiting, then the chunk
    pdc = TurboQuantConfig(prefill_as_decode=True, window=128, calibration_tokens=1024)
    assert fetch_transient_bytes(llama, 8192, pdc) == 2 * (1024 + 2048) * (64 + 64) * (4 + 2)
    assert fetch_transient_bytes(llama, 1000, pdc) == 0
    # and the peak holds the calibration tokens in float, more than the window and codes just after them
    cal = TurboQuantConfig(window=128, calibration_tokens=1024, prefill_as_decode=False)
    assert estimate_kv_bytes(llama, 1028, cal) > estimate_kv_bytes(llama, 1100, cal)
    plain = TurboQuantConfig(window=128, calibration_tokens=None, prefill_as_decode=False)  # the same cache at 1,100 tokens, which never held more
    assert estimate_kv_bytes(llama, 1100, cal) == estimate_kv_bytes(llama, 1100, plain)
    assert estimate_peak_bytes(llama, 1100, cal, weights=0) - estimate_peak_bytes(llama, 1100, plain, weights=0) == (
        estimate_kv_bytes(llama, 1028, cal) - estimate_kv_bytes(llama, 1100, cal))


@pytest.mark.parametrize("cfg", [TurboQuantConfig(window=64, calibration_tokens=None, compress_block=16, sinks=4, step=32),
                                 TurboQuantConfig(key_bits=3.5, value_bits=2.5, window=40, calibration_tokens=None, compress_block=8, sinks=2,
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
    cfg, M = TurboQuantConfig(window=64, calibration_tokens=None, compress_block=16, sinks=4, step=32), 200
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
    from tq_mlx.planner.memory import protect_layer_bytes

    cfg = TurboQuantConfig(protect_factor=1.0, window=32, calibration_tokens=None, step=64)
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
