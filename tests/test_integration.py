"""tq_mlx with mlx-lm's own models and entry points: tiny random-weight models, then SmolLM2 (slow)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm import generate, stream_generate
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import KVCache, QuantizedKVCache, save_prompt_cache

import tq_mlx
from tq_mlx.cache import held_bytes
from tq_mlx import TurboQuantConfig, TurboQuantKVCache
from tq_mlx import integration
from tq_mlx.hook import install_attention_hook, uninstall_attention_hook
from tests.support.blas import ran_on_reference_blas
from tests.support.tiny_models import TINY_MODELS, tiny_llama, tiny_tokenizer

# Small window and blocks, so that a 64-token run is mostly compressed tokens.
COMPRESSING = TurboQuantConfig(window=8, calibration_tokens=None, compress_block=4, sinks=2)
# The same at the defaults the accuracy tests below were written against (K4/V3, float16 norms, no decay), pinned:
# they vary the bits with dataclasses.replace, which would carry COMPRESSING's resolved decay bits (K3/V2) over.
PLAIN = TurboQuantConfig(window=8, calibration_tokens=None, compress_block=4, sinks=2, value_bits=3, norm_bits=16, decay_after=None,
                         key_error=None)


@pytest.fixture(scope="module")
def models():
    return {name: fn()[0] for name, fn in TINY_MODELS.items()}


def teacher_forced(model, cache, tokens, prefill=8):
    """Next-token logits after a prefill and then one token at a time: (len(tokens) - prefill + 1, vocab)."""
    out = [model(mx.array([tokens[:prefill]]), cache=cache)[0, -1]]
    for t in tokens[prefill:]:
        out.append(model(mx.array([[t]]), cache=cache)[0, -1])
    return mx.stack(out).astype(mx.float32)


def rel(a, b):
    return mx.linalg.norm(a - b, axis=-1) / mx.linalg.norm(b, axis=-1)


TOKENS = np.random.default_rng(0).integers(0, 256, 72).tolist()


# --- accuracy through real mlx-lm model code ---------------------------------------------------------


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_8bit_logits_track_the_float_cache(models, name):
    model = models[name]
    ref = teacher_forced(model, mlx_cache.make_prompt_cache(model), TOKENS)
    cache = tq_mlx.make_prompt_cache(model, dataclasses.replace(PLAIN, key_bits=8, value_bits=8))
    got = teacher_forced(model, cache, TOKENS)
    tq = [c for c in cache if isinstance(c, TurboQuantKVCache)]
    assert tq and all(c.n_coded >= 56 for c in tq)
    assert float(rel(got, ref).max()) < 1e-2


def test_error_falls_with_bits(models):
    model = models["llama"]
    ref = teacher_forced(model, mlx_cache.make_prompt_cache(model), TOKENS)
    errors = {}
    for bits in (2, 2.5, 3, 3.5, 4):
        cfg = dataclasses.replace(PLAIN, key_bits=bits, value_bits=bits)
        got = teacher_forced(model, tq_mlx.make_prompt_cache(model, cfg), TOKENS)
        errors[bits] = float(rel(got, ref).mean())
    assert list(errors.values()) == sorted(errors.values(), reverse=True), errors
    assert errors[4] < 0.05
    qjl = teacher_forced(model, tq_mlx.make_prompt_cache(model, dataclasses.replace(PLAIN, qjl=True)), TOKENS)
    assert errors[4] < float(rel(qjl, ref).mean()) < errors[2]  # 3 MSE bits + 1 QJL bit


def test_batch_of_two(models, request):
    if ran_on_reference_blas(request):  # a row equal to its sequence alone: see reference_blas_env
        return
    model = models["qwen3"]
    rng = np.random.default_rng(3)
    batch = mx.array(rng.integers(0, 256, (2, 40)))
    cfg = dataclasses.replace(PLAIN, key_bits=8, value_bits=8)
    ref_cache, cache = mlx_cache.make_prompt_cache(model), tq_mlx.make_prompt_cache(model, cfg)
    ref = [model(batch[:, :24], cache=ref_cache)[:, -1]]
    got = [model(batch[:, :24], cache=cache)[:, -1]]
    for i in range(24, 40):
        ref.append(model(batch[:, i : i + 1], cache=ref_cache)[:, -1])
        got.append(model(batch[:, i : i + 1], cache=cache)[:, -1])
    assert cache[0].batch_heads() == (2, 2) and cache[0].key_stream.mean.shape == (2, 2, 128)
    assert float(rel(mx.stack(got), mx.stack(ref)).max()) < 1e-2
    # Each row equals running that sequence alone.
    solo = tq_mlx.make_prompt_cache(model, cfg)
    out = model(batch[1:, :24], cache=solo)[:, -1]
    for i in range(24, 40):
        out = model(batch[1:, i : i + 1], cache=solo)[:, -1]
    assert float(rel(out[0], got[-1][1])) < 1e-4


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_precision_models(dtype):
    model, _ = tiny_llama(dtype=dtype, layers=2)
    tokens = TOKENS[:24]
    ref = teacher_forced(model, mlx_cache.make_prompt_cache(model), tokens)
    cache = tq_mlx.make_prompt_cache(model, dataclasses.replace(PLAIN, key_bits=8, value_bits=8))
    got = teacher_forced(model, cache, tokens)
    assert cache[0].n_coded >= 16
    assert float(rel(got, ref).max()) < 3e-2  # 16-bit activations on both sides


def test_chunked_prefill_equals_one_shot(models):
    model = models["llama"]
    cfg = TurboQuantConfig(window=32, calibration_tokens=None, compress_block=16, sinks=4)
    prompt = mx.array(np.random.default_rng(1).integers(0, 256, 300))
    outs, layouts = [], []
    for step in (2048, 64):
        cache = tq_mlx.make_prompt_cache(model, cfg)
        _, logprobs = next(generate_step(prompt, model, prompt_cache=cache, prefill_step_size=step, max_tokens=1))
        outs.append(logprobs)
        layouts.append([(c.offset, c.n_coded) for c in cache])
    assert layouts[0] == layouts[1]
    assert float(mx.abs(mx.exp(outs[0]) - mx.exp(outs[1])).max()) < 2e-3
    assert float(rel(outs[0], outs[1])) < 1e-2


# --- construction ------------------------------------------------------------------------------------


def test_make_prompt_cache_replaces_only_full_attention_kvcache(models):
    cache = tq_mlx.make_prompt_cache(models["hybrid"], TurboQuantConfig(boundary_layers=1))
    assert [type(c).__name__ for c in cache] == ["ArraysCache", "ArraysCache", "ArraysCache", "TurboQuantKVCache"]
    assert cache[3].layer_index == 3 and cache[3].attention_index == 0 and cache[3].key_bits == 8
    cache = tq_mlx.make_prompt_cache(models["llama"], TurboQuantConfig(boundary_layers=1, key_bits=3))
    assert [c.key_bits for c in cache] == [8, 3, 8] and [c.layer_index for c in cache] == [0, 1, 2]
    assert len({c.key_stream.quantizer.seed for c in cache} | {c.value_stream.quantizer.seed for c in cache}) == 6


def test_sliding_window_layers_keep_their_rotating_cache():
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=64, rms_norm_eps=1e-5,
                           vocab_size=257, layer_types=["sliding_attention", "full_attention"], sliding_window=16)
    model = llama.Model(args)
    cache = tq_mlx.make_prompt_cache(model)
    assert [type(c).__name__ for c in cache] == ["RotatingKVCache", "TurboQuantKVCache"]
    logits = model(mx.array([list(range(40))]), cache=cache)
    assert logits.shape == (1, 40, 257) and bool(mx.all(mx.isfinite(logits)))


def test_unsupported_models_fail_before_any_work(models):
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=8, num_key_value_heads=4, head_dim=8, rms_norm_eps=1e-5, vocab_size=257)
    with pytest.raises(ValueError, match=r"layer 0.*head_dim 8 is below the minimum 16"):
        tq_mlx.make_prompt_cache(llama.Model(args))
    with pytest.raises(ValueError, match=r"layer 0.*head_dim 32 at 2.5 bits"):
        tq_mlx.make_prompt_cache(tiny_small_head(), TurboQuantConfig.from_bits(2.5))
    model = tiny_small_head()
    with pytest.raises(ValueError, match=r"layer 0.*head_dim 32 at 2.5 bits"):
        tq_mlx.patch_model(model, TurboQuantConfig.from_bits(2.5))
    assert "make_cache" not in vars(model) and "_tq_make_cache" not in vars(model)  # untouched
    assert all(type(c) is KVCache for c in mlx_cache.make_prompt_cache(model))


def test_models_that_post_process_their_fetch_get_float_tensors_from_compressed_storage(models):
    model = models["qwen3"]
    model.model_type = "gemma2"  # tq_mlx.models.architectures.FLOAT_FETCH: gemma2 computes attention by hand
    try:
        cache = tq_mlx.make_prompt_cache(model, TurboQuantConfig(window=8, calibration_tokens=None, compress_block=4, sinks=2))
    finally:
        model.model_type = "qwen3"
    assert all(isinstance(c, TurboQuantKVCache) and c.fetch == "float" for c in cache)
    D = cache[0].key_dim
    keys, values = mx.random.normal((1, 2, 20, D)), mx.random.normal((1, 2, 20, D))
    k, v = cache[0].update_and_fetch(keys, values)
    assert isinstance(k, mx.array) and k.shape == keys.shape and k.dtype == keys.dtype
    assert cache[0].n_coded == 12  # stored as codes; the float tensors are the fetch's, not the cache's
    rel = float(mx.linalg.norm(k - keys) / mx.linalg.norm(keys))
    assert 0 < rel < 0.2
    floats = [a for a in cache[0].held_arrays() if a.ndim == 4 and a.dtype == keys.dtype]
    assert floats and all(a.shape[2] <= 8 for a in floats)  # the sinks and the window, no float copy of the rest


def tiny_small_head():
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=1, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5, vocab_size=257)
    return llama.Model(args)


def test_generate_with_prompt_cache_and_patch_model(models):
    model, tok = models["llama"], tiny_tokenizer()
    cache = tq_mlx.make_prompt_cache(model, COMPRESSING)
    text = generate(model, tok, "hello there, tiny model", prompt_cache=cache, max_tokens=12)
    # mlx-lm's pipelined decode feeds the last token too, so the cache holds prompt + 11 or 12 tokens.
    assert isinstance(text, str) and cache[0].offset - len(tok.encode("hello there, tiny model")) in (11, 12)

    built = []
    tq_mlx.patch_model(model, COMPRESSING)
    try:
        inner = model.make_cache
        model.make_cache = lambda: built.append(inner()) or built[-1]
        patched = generate(model, tok, "hello there, tiny model", max_tokens=12)
        responses = list(stream_generate(model, tok, "hello again", max_tokens=5))
        assert len(built) == 2 and all(isinstance(c, TurboQuantKVCache) for cs in built for c in cs)
        assert responses[-1].generation_tokens == 5
        assert patched == text  # same config, same tokens
    finally:
        tq_mlx.unpatch_model(model)
    assert all(type(c) is KVCache for c in mlx_cache.make_prompt_cache(model))


def test_chat_across_turns_reuses_the_cache(models):
    model, tok = models["qwen3"], tiny_tokenizer()
    cache = tq_mlx.make_prompt_cache(model, COMPRESSING)
    n = 0
    for turn in ("hi", "tell me more"):
        prompt = tok.apply_chat_template([{"role": "user", "content": turn}], add_generation_prompt=True)
        out = list(stream_generate(model, tok, prompt, prompt_cache=cache, max_tokens=6))
        n += len(prompt) + out[-1].generation_tokens
        assert cache[0].offset - n in (-1, 0) and cache[0].n_coded > 0


def test_mlx_lm_quantized_cache_unaffected_by_the_hook(models):
    model, tok = models["llama"], tiny_tokenizer()
    prompt = "quantized cache check " * 3
    uninstall_attention_hook()
    try:
        before = generate(model, tok, prompt, max_tokens=10, kv_bits=4, quantized_kv_start=0)
    finally:
        install_attention_hook(TurboQuantKVCache)
    after = generate(model, tok, prompt, max_tokens=10, kv_bits=4, quantized_kv_start=0)
    assert before == after
    cache = mlx_cache.make_prompt_cache(model)
    prompt_ids = mx.array(tok.encode(prompt))
    list(generate_step(prompt_ids, model, prompt_cache=cache, max_tokens=3, kv_bits=4, quantized_kv_start=0))
    assert all(isinstance(c, QuantizedKVCache) for c in cache)


def test_speculative_decoding_runs():
    model, _ = tiny_llama(seed=0)
    draft, _ = tiny_llama(seed=1, layers=1)
    cache = tq_mlx.make_prompt_cache(model, COMPRESSING) + tq_mlx.make_prompt_cache(draft, COMPRESSING)
    prompt = mx.array(TOKENS[:20])
    out = list(speculative_generate_step(prompt, model, draft, prompt_cache=cache, num_draft_tokens=3, max_tokens=16))
    assert len(out) == 16
    assert cache[0].offset == cache[1].offset == cache[2].offset
    assert 20 + 15 <= cache[0].offset <= 20 + 16
    # And through mlx_lm.generate with patched models.
    tok = tiny_tokenizer()
    tq_mlx.patch_model(model, COMPRESSING)
    tq_mlx.patch_model(draft, COMPRESSING)
    try:
        resp = list(stream_generate(model, tok, "spec", max_tokens=8, draft_model=draft))
        assert resp[-1].generation_tokens == 8
    finally:
        tq_mlx.unpatch_model(model)
        tq_mlx.unpatch_model(draft)


# --- prompt-cache files ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "hybrid"])
def test_save_load_round_trip_is_bit_exact(models, name, tmp_path):
    model = models[name]
    cfg = TurboQuantConfig(key_bits=3.5, value_bits=3, window=8, calibration_tokens=None, compress_block=4, sinks=2, seed=7)
    cache = tq_mlx.make_prompt_cache(model, cfg)
    model(mx.array([TOKENS[:40]]), cache=cache)
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, cache, metadata={"note": "tiny"})
    before = model(mx.array([[5]]), cache=cache)

    loaded, meta = mlx_cache.load_prompt_cache(path, return_metadata=True)  # mlx-lm's own loader
    assert meta == {"note": "tiny"}
    assert [type(c) for c in loaded] == [type(c) for c in cache]
    tq_loaded = [c for c in loaded if isinstance(c, TurboQuantKVCache)]
    assert tq_loaded and all(c.config == cfg and c.n_coded > 0 for c in tq_loaded)
    after = model(mx.array([[5]]), cache=loaded)
    np.testing.assert_array_equal(np.array(before), np.array(after))
    # The file holds codes, not floats of the compressed tokens.
    assert os.path.getsize(path) < sum(c.nbytes for c in cache if hasattr(c, "nbytes")) + 100_000


def test_corrupted_or_mismatched_files_raise_clear_errors(models, tmp_path):
    model = models["llama"]
    cache = tq_mlx.make_prompt_cache(model, COMPRESSING)
    model(mx.array([TOKENS[:30]]), cache=cache)
    good = str(tmp_path / "good.safetensors")
    save_prompt_cache(good, cache)
    snapshot = {k: np.array(v) for k, v in tree_flatten(model.parameters())}

    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(Path(good).read_bytes()[:5000])
    with pytest.raises(ValueError, match="truncated.safetensors"):
        tq_mlx.load_prompt_cache(str(truncated), model)

    # A codes array cut short: the cache's own state check names the layer and the array.
    arrays, metadata = mx.load(good, return_metadata=True)
    key = next(k for k in arrays if k.startswith("1.") and "k_codes.0" in k)
    arrays[key] = arrays[key][..., :-1]
    tampered = str(tmp_path / "tampered.safetensors")
    mx.save_safetensors(tampered, arrays, metadata)
    with pytest.raises(ValueError, match=r"layer 1.*k_codes"):
        mlx_cache.load_prompt_cache(tampered)
    with pytest.raises(ValueError, match=r"tampered.safetensors.*layer 1"):
        tq_mlx.load_prompt_cache(tampered, model)

    # Right file, wrong model / wrong config.
    with pytest.raises(ValueError, match=r"layers|head_dim"):
        tq_mlx.load_prompt_cache(good, models["qwen3"])
    with pytest.raises(ValueError, match=r"layer 0: prompt cache has head_dim 64, the model has head_dim 128"):
        tq_mlx.validate_prompt_cache(models["qwen3"], mlx_cache.load_prompt_cache(good)[:2])
    with pytest.raises(ValueError, match=r"layer 0: prompt cache was built with"):
        tq_mlx.load_prompt_cache(good, model, config=TurboQuantConfig())
    assert tq_mlx.load_prompt_cache(good, model, config=COMPRESSING)[0].offset == 30
    # Nothing was touched.
    after = dict(tree_flatten(model.parameters()))
    assert all(np.array_equal(snapshot[k], np.array(after[k])) for k in snapshot)


def test_server_lru_prompt_cache_reuse(models):
    """mlx-lm's server LRU: insert a cache, fetch it for a prompt that diverges (deep copy + trim), continue."""
    model = models["llama"]
    lru = mlx_cache.LRUPromptCache(max_size=4)
    cache = tq_mlx.make_prompt_cache(model, COMPRESSING)
    first = TOKENS[:40]
    model(mx.array([first]), cache=cache)
    lru.insert_cache("tiny", first, cache)
    # mlx-lm's LRU sums the layers' nbytes: the codebooks and tables the layers share count once a layer there
    assert lru.nbytes == sum(c.nbytes for c in cache) > held_bytes(cache) > 0

    second = TOKENS[:30] + TOKENS[50:60]  # shares a 30-token prefix
    reused, rest = lru.fetch_nearest_cache("tiny", second)
    assert rest == second[30:] and reused[0].offset == 30 and cache[0].offset == 40  # the stored one is untouched
    got = model(mx.array([rest]), cache=reused)[0, -1]
    fresh = tq_mlx.make_prompt_cache(model, COMPRESSING)
    model(mx.array([second[:30]]), cache=fresh)
    want = model(mx.array([rest]), cache=fresh)[0, -1]
    # Same tokens; the reused cache compressed tokens 30-39 of the first prompt before trimming them, so only
    # its compression schedule differs.
    assert float(rel(got, want)) < 0.05
    exact, rest = lru.fetch_nearest_cache("tiny", first)
    assert rest == [] and exact[0].offset == 40 and exact[0] is not cache[0]


# --- SmolLM2 (real model) ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2():
    real_models = pytest.importorskip("tests.support.real_models")
    return real_models.load_smollm2(mx.float32)


@pytest.mark.slow
def test_smollm2_chat_answer_at_4_bits(smollm2):
    # At 4 bits with a 16-token window (the prompt itself compressed), the cache's next-token distributions along
    # float's answer stay near float's: KL 0.002 on average and 0.011 at most measured (2-bit codes: 0.12 and 0.27).
    # Not an argmax: float's own first token is a near tie ("The" 0.152, "L" 0.140) that any cache may tip.
    model, tok = smollm2
    question = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(question, add_generation_prompt=True)
    text = generate(model, tok, prompt, prompt_cache=mlx_cache.make_prompt_cache(model), max_tokens=16)
    assert "Paris" in text
    answer = tok.encode(text, add_special_tokens=False)

    def along_the_answer(cache):
        out = [model(mx.array([prompt]), cache=cache)[0, -1]]
        out += [model(mx.array([[t]]), cache=cache)[0, -1] for t in answer[:-1]]
        return mx.softmax(mx.stack(out).astype(mx.float32), axis=-1)

    p = along_the_answer(mlx_cache.make_prompt_cache(model))
    cache = tq_mlx.make_prompt_cache(model, TurboQuantConfig.from_bits(4, window=16, calibration_tokens=None, sinks=4))
    q = along_the_answer(cache)
    kl = mx.sum(p * (mx.log(p) - mx.log(q)), axis=-1)
    assert cache[0].n_coded > 0
    assert float(kl.mean()) < 0.02 and float(kl.max()) < 0.1, kl.tolist()


@pytest.mark.slow
def test_smollm2_save_load_trim_nbytes_chunked(smollm2, tmp_path):
    model, tok = smollm2
    from tests.support.texts import britannica_text

    ids = tok.encode(britannica_text()[:1500])[:128]
    cfg = TurboQuantConfig(window=16, calibration_tokens=None, compress_block=8, sinks=4)

    def kl(p, q):
        return float(mx.sum(p * (mx.log(p) - mx.log(q))))

    one = tq_mlx.make_prompt_cache(model, cfg)
    chunked = tq_mlx.make_prompt_cache(model, cfg)
    p_one = mx.softmax(model(mx.array([ids]), cache=one)[0, -1], -1)
    for i in range(0, len(ids), 64):
        p_chunk = mx.softmax(model(mx.array([ids[i : i + 64]]), cache=chunked)[0, -1], -1)
    # Chunked and one-shot prefill differ by quantization noise only (calibration on a different first chunk,
    # a chunk attending to its own compressed tokens): KL 0.003-0.004 at 4 bits on 192-400 tokens, about as
    # far as either is from the float cache.
    assert one[0].n_coded == chunked[0].n_coded == 112
    assert int(p_one.argmax()) == int(p_chunk.argmax()) and kl(p_one, p_chunk) < 0.01
    # nbytes honesty: every held array counted; well under a float16 KVCache of the same tokens.
    for c in one:
        assert c.nbytes == sum(a.nbytes for a in c.held_arrays())
    fp16_bytes = 30 * 2 * 3 * 256 * 64 * 2  # 30 layers, K+V, 3 kv heads, one 256-token KVCache step, head_dim 64
    # (well under: 16 float window tokens per layer, and keys widened by their error up to K6 on most layers)
    assert sum(c.nbytes for c in one) < fp16_bytes / 1.5
    assert any(c.key_stream.widened for c in one)  # the default widens this model's keys
    path = str(tmp_path / "smol.safetensors")
    save_prompt_cache(path, one)
    nxt = mx.array([[ids[-1]]])
    before = model(nxt, cache=one)
    loaded = tq_mlx.load_prompt_cache(path, model, config=cfg)
    np.testing.assert_array_equal(np.array(before), np.array(model(nxt, cache=loaded)))
    # Trim the extra token and 24 more, then feed those 24 again: the next-token distribution comes back.
    assert mlx_cache.trim_prompt_cache(loaded, 25) == 25 and loaded[0].offset == len(ids) - 24
    again = mx.softmax(model(mx.array([ids[-24:]]), cache=loaded)[0, -1], -1)
    assert int(again.argmax()) == int(p_one.argmax()) and kl(p_one, again) < 0.01


def test_a_converted_float_cache_says_its_keys_are_unweighed_and_the_planner_agrees():
    """A float prompt cache holds no queries, so its conversion cannot weigh the keys: the converted caches' config
    says so (weigh_keys False, which describe_config names), they hold no weights, and the planner's bytes for
    that config equal what they hold (it counts no weights they do not have)."""
    from tq_mlx.convert import compress_float_cache, converted_config
    from tq_mlx.planner.display import describe_config
    from tq_mlx.planner.memory import turboquant_layer_bytes

    model, _ = tiny_llama()
    float_cache = mlx_cache.make_prompt_cache(model)
    model(mx.array(np.random.default_rng(0).integers(0, 64, (1, 300))), cache=float_cache)
    config = TurboQuantConfig(window=64, calibration_tokens=None, sinks=4, key_error=0.01)  # key widths need queries too
    assert config.weigh_keys
    cache, n = compress_float_cache(model, float_cache, config, "float.safetensors", chunk=128)
    assert n == len(cache) == len(float_cache)
    assert converted_config(config) == dataclasses.replace(config, weigh_keys=False, key_error=None)
    assert "keys not weighed" in describe_config(converted_config(config))
    assert "keys up to" not in describe_config(converted_config(config))
    by_output = TurboQuantConfig(window=64, calibration_tokens=128, sinks=4, key_output_error=0.02)
    assert converted_config(by_output) == dataclasses.replace(by_output, weigh_keys=False, key_output_error=None)
    for i, c in enumerate(cache):
        assert isinstance(c, TurboQuantKVCache) and c.config == converted_config(config)
        assert c.offset == 300 and c.n_coded > 0
        mx.eval(c.held_arrays())
        ks = c.streams[0]
        assert ks.weights is None
        H, D = c.keys_and_values()[0].n_heads, c.key_dim
        planned = turboquant_layer_bytes(300, H, D, D, c.key_bits, c.value_bits, c.config, float_bytes=4,
                                         rope_pairs=D // 2 if ks.rope is not None else None)
        assert planned == c.nbytes, (i, planned, c.nbytes)
