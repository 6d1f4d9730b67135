"""Each fetch path of issue 21 against mlx-lm's float cache at 8 bits: learned sinks and KV-shared layers on the
codes, multi-head latent attention (decode on the codes, prefill decoded to float), decode-to-float for models
that post-process their fetch, and the bounded cache (max_kv_size). The zoo (test_zoo.py) runs every
architecture; these tests check that each path is the one taken, and what the cache holds."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import CacheList, RotatingKVCache

import tq_mlx
import tq_mlx.hook as tq_hook
from tq_mlx import TurboQuantConfig, TurboQuantKVCache
from tq_mlx.stream.view import StreamView
from tests.support import zoo
from tests.test_zoo import CONFIG, DRAWS, teacher_forced

TOKENS = np.random.default_rng(0).integers(0, 256, 24).tolist()


def rel_err(got: mx.array, ref: mx.array) -> float:
    return float((mx.linalg.norm(got - ref, axis=-1) / mx.linalg.norm(ref, axis=-1)).max())


def best_err(model, config=CONFIG) -> float:
    """8-bit logits against mlx-lm's float cache: the max relative error over the tokens, best of the zoo's three
    token draws (a random MoE model can flip an expert route on one draw; a real regression moves all three)."""
    errs = []
    for tokens in DRAWS:
        ref = teacher_forced(model, mlx_cache.make_prompt_cache(model), tokens)
        errs.append(rel_err(teacher_forced(model, tq_mlx.make_prompt_cache(model, config), tokens), ref))
    return min(errs)


def tq_caches(cache) -> list[TurboQuantKVCache]:
    return [m for c in cache for m in (c.caches if type(c) is CacheList else [c]) if isinstance(m, TurboQuantKVCache)]


def no_float_copy(cache, config=CONFIG) -> None:
    """Float arrays a cache holds are its sinks and window, never the compressed tokens."""
    for c in tq_caches(cache):
        assert c.n_coded > 0
        for a in c.held_arrays():
            if a.ndim == 4 and a.dtype in (mx.float32, mx.float16, mx.bfloat16) and a.shape[-1] > 1:  # not norms
                assert a.shape[2] <= max(config.sinks, config.window), (c.layer_index, a.shape)


@pytest.fixture
def calls(monkeypatch):
    """Every call of the attention on the codes: (keys, values, mask, sinks)."""
    seen = []
    original = tq_hook.dispatch_attention

    def spy(queries, keys, values, scale, mask=None, sinks=None, **kw):
        seen.append((keys, values, mask, sinks))
        return original(queries, keys, values, scale, mask=mask, sinks=sinks, **kw)

    monkeypatch.setattr(tq_hook, "dispatch_attention", spy)
    return seen


def test_learned_sinks_reach_attention_on_the_codes(calls):
    model = zoo.build("gpt_oss")
    assert best_err(model) < zoo.tolerance("gpt_oss")
    calls.clear()
    cache = tq_mlx.make_prompt_cache(model, CONFIG)
    teacher_forced(model, cache)
    on_codes = [c for c in calls if isinstance(c[0], StreamView) and c[0].n_coded]
    assert on_codes and all(c[3] is not None for c in on_codes)  # the sinks came along
    assert all(c.fetch == "codes" for c in tq_caches(cache))
    no_float_copy(cache)


def test_sinks_change_the_answer():
    """The sinks are not dropped on the way: attention with and without them differs, and with them it matches
    mx.fast's attention on the same float tokens."""
    c = TurboQuantKVCache(TurboQuantConfig(key_bits=8, value_bits=8, window=4, calibration_tokens=None, compress_block=4, sinks=2,
                                           prefill_as_decode=False))  # (its views read by one query)
    k, v = mx.random.normal((1, 2, 30, 32), key=mx.random.key(1)), mx.random.normal((1, 2, 30, 32), key=mx.random.key(2))
    kv, vv = c.update_and_fetch(k, v)
    q = mx.random.normal((1, 4, 1, 32), key=mx.random.key(3))
    sinks = mx.array([2.0, -1.0, 0.5, 3.0])
    with_sinks = tq_hook.scaled_dot_product_attention(q, kv, vv, c, scale=32**-0.5, mask=None, sinks=sinks)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=32**-0.5, sinks=sinks)
    assert rel_err(with_sinks, ref) < 2e-2
    assert rel_err(tq_hook.scaled_dot_product_attention(q, kv, vv, c, scale=32**-0.5, mask=None), ref) > 5e-2


def gemma4_text(k_eq_v: bool):
    mod, args = zoo.model_args("gemma4_text")
    args.attention_k_eq_v = k_eq_v
    return zoo._randomize(mod.Model(args), 0, mx.float32)


def test_kv_shared_layers_attend_to_the_view_of_the_layer_they_share(calls):
    model = gemma4_text(k_eq_v=False)
    assert best_err(model) < zoo.tolerance("gemma4_text")
    calls.clear()
    cache = tq_mlx.make_prompt_cache(model, CONFIG)
    n_full = len(tq_caches(cache))
    teacher_forced(model, cache)
    shared = [layer for layer in model.model.layers if not layer.self_attn.has_kv and not layer.self_attn.is_sliding]
    assert shared, "the zoo's gemma4 has no KV-shared full-attention layer"
    # every forward: each compressed layer and each layer sharing its view attends on the codes
    forwards = 1 + len(TOKENS) - 16
    assert len([c for c in calls if isinstance(c[0], StreamView)]) == forwards * (n_full + len(shared))
    no_float_copy(cache)


def test_k_eq_v_layers_hold_one_stream_and_derive_their_keys(tmp_path):
    model = gemma4_text(k_eq_v=True)
    assert best_err(model) < zoo.tolerance("gemma4_text")
    base = mlx_cache.make_prompt_cache(model)
    teacher_forced(model, base)
    cache = tq_mlx.make_prompt_cache(model, CONFIG)
    teacher_forced(model, cache)
    (i, c), = [(i, c) for i, c in enumerate(cache) if isinstance(c, TurboQuantKVCache)]
    assert c.k_eq_v and len(c.streams) == 1 and c.value_stream is None
    # the keys derived from the held values are the model's keys, to 8-bit precision
    k, v = c.keys_and_values()
    b = base[i]
    assert rel_err(k, b.keys[:, :, : b.offset]) < 2e-2 and rel_err(v, b.values[:, :, : b.offset]) < 2e-2
    # half the streams: the same tokens in a two-stream cache hold about twice the codes
    two = tq_mlx.make_prompt_cache(model, CONFIG, max_kv_size=1000)[i]  # bounded caches keep two streams
    assert not two.k_eq_v
    teacher_forced(model, tq_mlx.make_prompt_cache(model, CONFIG))
    two.update_and_fetch(b.keys[:, :, : b.offset], b.values[:, :, : b.offset])
    assert 0.4 < c.nbytes / two.nbytes < 0.6
    # saved and loaded with the model, the keys are derived again
    path = str(tmp_path / "g.safetensors")
    mlx_cache.save_prompt_cache(path, cache)
    loaded = tq_mlx.load_prompt_cache(path, model, config=CONFIG)
    nxt = mx.array([[7]])
    np.testing.assert_array_equal(np.array(model(nxt, cache=cache)), np.array(model(nxt, cache=loaded)))
    bare = mlx_cache.load_prompt_cache(path)[i]  # mlx-lm's loader knows no model
    with pytest.raises(ValueError, match="K=V layer loaded without its model.*tq_mlx.load_prompt_cache"):
        bare.keys_and_values()


def test_latent_attention_decodes_on_the_codes_and_prefills_from_float(calls):
    model = zoo.build("deepseek_v3")
    assert best_err(model) < zoo.tolerance("deepseek_v3")
    calls.clear()
    cache = tq_mlx.make_prompt_cache(model, CONFIG)
    teacher_forced(model, cache)
    layers = tq_caches(cache)
    assert all(c.fetch == "latent" for c in layers)
    # the latent is the key stream, the rope key the value stream
    attn = model.model.layers[0].self_attn
    assert (layers[0].key_dim, layers[0].value_dim) == (attn.kv_lora_rank, attn.qk_rope_head_dim)
    # the rope key scores like a key: both streams take the key bits, and are centered like keys
    four = tq_mlx.make_prompt_cache(model, TurboQuantConfig(key_bits=4, value_bits=2))[0]
    assert four.value_bits == four.key_bits == 4
    decode = [c for c in calls if isinstance(c[0], StreamView)]
    assert len(decode) == len(layers) * (len(TOKENS) - 16)  # every decode step, no prefill chunk
    assert all(k is v and isinstance(m, mx.array) for k, v, m, _ in decode)  # latent as keys and values, rope mask
    no_float_copy(cache)


@pytest.mark.parametrize("arch", ["gemma2", "phi3small", "plamo"])
def test_models_that_post_process_their_fetch_decode_to_float(arch, calls):
    model = zoo.build(arch)
    assert best_err(model) < zoo.tolerance(arch)
    cache = tq_mlx.make_prompt_cache(model, CONFIG)
    teacher_forced(model, cache)
    assert all(c.fetch == "float" for c in tq_caches(cache)) and not calls
    no_float_copy(cache)
    assert tq_mlx.integration.fetch_reason(model)


def test_bounded_caches_are_not_batched_and_mlx_lm_says_so():
    from mlx_lm.generate import _merge_caches

    model = zoo.build("llama")
    bounded = [tq_mlx.make_prompt_cache(model, CONFIG, max_kv_size=64) for _ in range(2)]
    assert not hasattr(bounded[0][0], "merge") and hasattr(TurboQuantKVCache, "merge")
    with pytest.raises(ValueError, match="does not yet support batching"):
        _merge_caches(bounded)
    assert hasattr(tq_mlx.make_prompt_cache(zoo.build("gemma2"), CONFIG)[0], "merge")


def test_fetch_and_bound_survive_save_and_load(tmp_path):
    model = zoo.build("deepseek_v3")
    cache = tq_mlx.make_prompt_cache(model, CONFIG, max_kv_size=16)
    teacher_forced(model, cache)
    path = str(tmp_path / "c.safetensors")
    mlx_cache.save_prompt_cache(path, cache)
    loaded = tq_mlx.load_prompt_cache(path, model, config=CONFIG)
    for a, b in zip(tq_caches(cache), tq_caches(loaded)):
        assert (b.fetch, b.max_size, b.n_dropped, b.offset) == (a.fetch, a.max_size, a.n_dropped, a.offset)
        assert b.n_dropped > 0
    nxt = mx.array([[7]])
    np.testing.assert_array_equal(np.array(model(nxt, cache=cache)), np.array(model(nxt, cache=loaded)))


# --- the bounded cache ---------------------------------------------------------------------------------------

BOUNDED = TurboQuantConfig(key_bits=8, value_bits=8, window=4, calibration_tokens=None, compress_block=1, sinks=4)


def test_bounded_cache_keeps_what_rotating_kv_cache_keeps():
    """With single-token blocks the bound keeps the sinks and the newest tokens, as mlx-lm's
    RotatingKVCache(max_size, keep=4) does: the logits agree at 8 bits, and the held tokens never pass the bound."""
    model = zoo.build("llama")
    ref_cache = [RotatingKVCache(max_size=12, keep=4) for _ in model.layers]
    ref = teacher_forced(model, ref_cache, TOKENS[:10] + TOKENS * 2)
    cache = tq_mlx.make_prompt_cache(model, BOUNDED, max_kv_size=12)
    got = teacher_forced(model, cache, TOKENS[:10] + TOKENS * 2)
    assert rel_err(got, ref) < 1e-2
    for c in tq_caches(cache):
        assert c.n_held == 12 and c.offset == 10 + 2 * len(TOKENS) and c.n_dropped == c.offset - 12
        assert not c.is_trimmable()


def test_bounded_cache_drops_whole_blocks_and_prices_as_the_planner_says():
    from tq_mlx.planner.memory import bounded_tokens

    config = TurboQuantConfig(window=8, calibration_tokens=None, compress_block=4, sinks=2)
    c = TurboQuantKVCache(config, max_size=20)
    for n in (13, 7, 30, 1, 1, 1, 1, 1, 1):
        held = c.n_held
        kv = c.update_and_fetch(mx.random.normal((1, 2, n, 64)), mx.random.normal((1, 2, n, 64)))
        assert kv[0].n_tokens == c.n_held <= 20 - 1 + n  # what this update attends to: at most 19 earlier tokens
        assert c.n_held >= min(held, 20 - config.compress_block_size) + n - 0  # never more dropped than a block's worth
        if n == 1:  # token by token the planner's counts hold exactly
            assert (c.n_sinks, c.n_coded, c.n_window) == bounded_tokens(c.offset, 20, config)
    assert c.n_held <= 20


def test_max_kv_size_reaches_the_patched_model_and_bad_bounds_are_refused():
    from mlx_lm import generate

    from tests.support.tiny_models import tiny_llama, tiny_tokenizer

    model, _ = tiny_llama(layers=1)
    with pytest.raises(ValueError, match=r"max_kv_size=8: a bounded TurboQuant cache needs at least .* = 10"):
        tq_mlx.make_prompt_cache(model, TurboQuantConfig(window=4, calibration_tokens=None, compress_block=4, sinks=3), max_kv_size=8)
    tq_mlx.patch_model(model, CONFIG)
    try:
        cache = mlx_cache.make_prompt_cache(model, max_kv_size=64)  # what --max-kv-size reaches
        assert all(isinstance(c, TurboQuantKVCache) and c.max_size == 64 for c in cache)
        text = generate(model, tiny_tokenizer(), "hi", max_tokens=20, max_kv_size=16)
        assert isinstance(text, str)
    finally:
        tq_mlx.unpatch_model(model)


# --- batching ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["plamo", "deepseek_v3", "gpt_oss", "gemma4_text"])
def test_batch_generate_serves_every_path_as_each_sequence_alone(arch):
    """Float fetches come back as one padded array in BatchKVCache's layout, latent decode as batch views; each
    row generates what it generates alone."""
    from mlx_lm import batch_generate

    from tests.support.tiny_models import tiny_tokenizer
    from tests.test_batch import alone, prompts_of

    model = tq_mlx.patch_model(zoo.build(arch), TurboQuantConfig(window=16, calibration_tokens=None, compress_block=8, sinks=2, key_bits=8,
                                                                 value_bits=8))
    prompts = prompts_of((30, 19, 41))
    r = batch_generate(model, tiny_tokenizer(), prompts, max_tokens=6, return_token_ids=True,
                       return_prompt_caches=True)
    for p, got in zip(prompts, r.token_ids):
        assert got == alone(model, p, 6)[0]
    flat = [m for c in r.caches[0] for m in getattr(c, "caches", [c])]
    assert any(isinstance(c, TurboQuantKVCache) and c.n_coded for c in flat)
