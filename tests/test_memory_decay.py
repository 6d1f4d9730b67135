"""tq_mlx.planner.memory: the estimate from config.json equals what the caches really hold under temporal decay (issue 23):
decayed tokens at the decay bits, fresh codes in a buffer of fixed size."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import mlx.core as mx
import pytest

from tests.support.memory import (  # noqa: F401  (models: module fixture)
    GEMMA4_TINY,
    MLA_TINY,
    config_dict,
    fed,
    fill,
    held_estimate,
    latent_caches,
    models,
    sliding_cache,
)
from tq_mlx.cache import held_bytes
from tq_mlx import TurboQuantConfig, TurboQuantKVCache, make_prompt_cache
from tq_mlx.stream.codec import make_quantizer
from tq_mlx.planner.display import bits_summary, config_label, decay_label, window_text
from tq_mlx.layout import buffer_layout, shared_constant_bytes
from tq_mlx.plan import layer_plan
from tq_mlx.planner.memory import (
    bounded_tokens,
    cache_bytes,
    decayed_tokens,
    estimate_kv_bytes,
    turboquant_layer_bytes,
)
from tq_mlx.quant.quantizer import constant_arrays



# Small window and blocks so that a few hundred tokens decay; no protection (a layer that protects its keys is
# priced on its own, below).
DECAY = dict(window=32, calibration_tokens=None, compress_block=8, sinks=2, step=32, decay_after=48, protect_factor=None)
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
            real = held_bytes(cache)
            assert held_estimate(config_dict(args), n, cfg, cache, dtype="float32") == real, (one_shot, n)
            assert cache[1].n_decayed == tuple(decayed_tokens(n, None, cfg) if d else 0 for d in decays), n
            assert cache[0].n_decayed == cache[2].n_decayed == (0, 0)
    # 150 tokens: 2 sinks, 120 compressed, 28 in the window; fresh and window tokens at most 48, in whole blocks
    assert max(cache[1].n_decayed) == decayed_tokens(150, None, cfg) == 104
    s = cache_bytes(cache)
    assert s["kv_bytes"] == real and s["decayed_tokens"] == 104 and s["compressed_tokens"] == cache[1].n_coded
    assert s["compressed_tokens"] == 120 and "120 tokens compressed (104 decayed), 30 in float32" in window_text(s)
    # layer 1's keys at the width their output error chose (the default's rule at K4), decaying a step below it
    kb = cache[1].key_bits
    label = decay_label(kb, 3, False, tuple(b if d else None for b, d in zip(
        (None if cfg.decay_key_bits is None else kb - (cfg.key_bits - cfg.decay_key_bits), cfg.decay_value_bits), decays)), 48)
    assert bits_summary(cache) == f"L0 K8/V8 · L1 {label} · L2 K8/V8"


def test_decay_labels():
    assert decay_label(4, 3, False, (3, 2), 2048) == "K4→3/V3→2 after 2048"
    assert decay_label(4, 3, True, (None, 2), 2048) == "K4+qjl/V3→2 after 2048"
    assert decay_label(4, 3, False, (3, None), 2048) == "K4→3/V3 after 2048"
    assert decay_label(4, 3, False, (None, None), 2048) == decay_label(4, 3) == "K4/V3"
    cfg = TurboQuantConfig(value_bits=4, decay_after=2048, decay_key_bits=3, decay_value_bits=2, boundary_layers=1)
    assert config_label(cfg) == "K4→3/V4→2 after 2048" and config_label(cfg, 0, 4) == "K8/V8"
    assert config_label(TurboQuantConfig()) == "K4/V4"
    assert config_label(TurboQuantConfig(decay_after=6144)) == "K4→3/V4 after 6144"
    assert config_label(TurboQuantConfig(decay_after=6144), 0, 4) == "K4→3/V4 after 6144"
    assert config_label(TurboQuantConfig(boundary_layers=1), 3, 4) == "K8/V8"
    assert config_label(TurboQuantConfig(value_bits=4, decay_after=None)) == "K4/V4"
    assert config_label(TurboQuantConfig(value_bits=4, decay_after=6144)) == "K4→3/V4 after 6144"  # every width decays by one rule (values keep theirs)
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
        assert estimate_kv_bytes(MLA_TINY, n, cfg, dtype="float32") == held_bytes(caches), n
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
    from tq_mlx.planner.memory import protect_layer_bytes

    cfg = TurboQuantConfig(value_bits=4, protect_factor=1.0, window=32, calibration_tokens=None, step=64, decay_after=64,
                           decay_key_bits=3, decay_value_bits=2)
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
        # the rope key decays at the key's decay bits, plain values at theirs (K4/V4)
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
        cfg = TurboQuantConfig(key_bits=4, value_bits=3, window=768, calibration_tokens=None, compress_block=128, decay_after=2048,
                               decay_key_bits=3, decay_value_bits=2, norm_bits=norm_bits, weigh_keys=False)
        assert bounded_tokens(ctx, None, cfg) == (4, 32000, 764) and decayed_tokens(ctx, None, cfg) == 30720
        assert (buffer_layout(cfg, ctx).fresh, buffer_layout(cfg, ctx).decayed) == (1536, 30720)
        norm = norm_bits // 8
        per_token = {b: D * b // 8 + norm for b in (4, 3, 2)}  # packed codes and one norm per token and head
        codes = 1536 * (per_token[4] + per_token[3]) + 30720 * (per_token[3] + per_token[2])
        floats = (4 + 768) * 2 * D * 2  # sinks and window, keys and values
        centering = 4 * (D + 2)  # μ (keys), a scale per stream
        norms = layer_plan(cfg).keys.norm_dtype
        held = {id(a): a for b in (4, 3, 3, 2) for a in constant_arrays(make_quantizer(D, b, False, 0, norms))}
        constants = sum(a.nbytes for a in held.values())  # the two 3-bit quantizers share a codebook and table
        layer = H * (codes + floats + centering) + constants
        model = {"num_hidden_layers": 1, "num_attention_heads": H, "num_key_value_heads": H, "head_dim": D}
        assert estimate_kv_bytes(model, ctx, cfg, dtype="float16") == layer
        weighed = dataclasses.replace(cfg, weigh_keys=True)  # and the keys' query weights: B·H·D float32
        assert estimate_kv_bytes(model, ctx, weighed, dtype="float16") == layer + H * 4 * D
        assert round(layer * 8 / (ctx * H * D * 2), 2) == want


def test_the_planned_bound_names_what_a_protecting_layer_adds():
    # A layer whose keys protect themselves (a channel that barely varies: bias_outlier_factor above
    # protect_factor) holds K8 codes that do not decay: more than the estimate's "every layer's keys at the most
    # key_error gives". The bound a plan states is the estimate plus protect_layer_bytes per such layer.
    from tests.support.memory import fed
    from tq_mlx.planner.memory import estimate_kv_bytes, protect_layer_bytes

    cfg = TurboQuantConfig(window=64, calibration_tokens=None)
    H, D, n = 2, 64, 3000
    model = {"num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": H, "head_dim": D}
    k1, k2 = mx.random.split(mx.random.key(3))
    keys = mx.concatenate([40.0 + 0.01 * mx.random.normal((1, H, n, 1), key=k1),
                           mx.random.normal((1, H, n, D - 1), key=k2)], axis=-1)
    cache = TurboQuantKVCache(cfg, head_dim=D)
    fed(cache, keys, mx.random.normal((1, H, n, D)))
    mx.eval(cache.held_arrays())
    assert cache.protected
    estimate = estimate_kv_bytes(model, n, cfg, dtype="float32")
    extra = protect_layer_bytes(model, n, cfg, dtype="float32")
    # one layer: the K6 codebook and table the estimate priced (its keys at the most) are not held; protect_layer_bytes
    # does not take them off, other layers may hold them
    six = sum(shared_constant_bytes(D, 6).values())
    assert estimate < cache.nbytes == estimate + extra - six, (estimate, cache.nbytes, extra)
    # and the README, where it calls the planner's figure a bound, says so
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    bound = next(line for line in readme.splitlines() if "so a real cache holds at most this" in line)
    assert "for each layer whose keys protect themselves" in bound
