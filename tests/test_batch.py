"""BatchTurboQuantKVCache and mlx-lm's batched generation (batch_generate, BatchGenerator) on TurboQuant caches:
the batch protocol against mlx-lm's BatchKVCache, padding never stored nor attended, and every sequence of a
batch generating exactly what it generates alone."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import batch_generate
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import BatchKVCache, KVCache

import tq_mlx
from tests.support.blas import ran_on_reference_blas, reference_blas_env
from tests.support.host_sync import forbid_host_sync
from tests.support.server import stop, wait_until_healthy
from tests.support.tiny_models import EOS, TINY_MODELS, tiny_tokenizer
from tq_mlx.cache import held_bytes
from tq_mlx import TurboQuantConfig, TurboQuantKVCache, turboquant_attention
from tq_mlx.batch import BatchTurboQuantKVCache, BatchView, batch_view_attention
from tq_mlx.blas import openblas_preloaded
from tq_mlx.config import KEY_OUTPUT_ERROR
from tq_mlx.hook import quantized_scaled_dot_product_attention as hooked_attention

REPO = Path(__file__).resolve().parent.parent

# Small window and blocks, so that prompts of a few dozen tokens are mostly compressed.
CFG = TurboQuantConfig(window=16, calibration_tokens=None, compress_block=8, sinks=2)
LENGTHS = (40, 23, 57)  # different lengths: left and right padding in every batch


def kv(rng, n, H=2, D=64):
    return (mx.array(rng.normal(size=(1, H, n, D)) + 0.5, dtype=mx.float32),
            mx.array(rng.normal(size=(1, H, n, D)) - 0.5, dtype=mx.float32))


def filled(lengths, seed=0, cfg=CFG):
    """One TurboQuantKVCache and one KVCache per length, fed the same keys/values; and those keys/values."""
    rng = np.random.default_rng(seed)
    tq, fl, data = [], [], []
    for n in lengths:
        k, v = kv(rng, n)
        c, f = TurboQuantKVCache(cfg, head_dim=64), KVCache()
        if n:
            c.update_and_fetch(k, v)
            f.update_and_fetch(k, v)
        tq.append(c)
        fl.append(f)
        data.append((k, v))
    return tq, fl, data


def same_layout(ours: BatchTurboQuantKVCache, ref: BatchKVCache, N: int = 3):
    assert ours.offset.tolist() == ref.offset.tolist()
    assert ours.size() == ref.size()
    for n in (1, N):
        got, want = ours.make_mask(n), ref.make_mask(n)
        assert got.shape == want.shape == (len(ours.rows), 1, n, ref.size() + n)
        assert mx.array_equal(got, want)


# --- the batch protocol, against mlx-lm's BatchKVCache --------------------------------------------------------


def test_layout_offsets_and_masks_follow_batch_kv_cache():
    rng = np.random.default_rng(1)
    tq, fl, _ = filled([12, 5, 30])
    ours, ref = TurboQuantKVCache.merge(tq), KVCache.merge(fl)
    assert isinstance(ours, BatchTurboQuantKVCache) and isinstance(ref, BatchKVCache)
    same_layout(ours, ref)
    # A right-padded prompt of 3 rows (real lengths 6, 2, 9), fed in two chunks, then finalized.
    lengths = [6, 2, 9]
    pad = [9 - n for n in lengths]
    for c in (ours, ref):
        c.prepare(lengths=lengths, right_padding=pad)
    k = mx.array(rng.normal(size=(3, 2, 9, 64)), dtype=mx.float32)
    for a, b in ((0, 4), (4, 9)):
        same_layout(ours, ref)
        ours.update_and_fetch(k[:, :, a:b], k[:, :, a:b])
        ref.update_and_fetch(k[:, :, a:b], k[:, :, a:b])
    for c in (ours, ref):
        c.finalize()
    same_layout(ours, ref)
    assert [r.offset for r in ours.rows] == [12 + 6, 5 + 2, 30 + 9]  # the padding was never stored
    # Decode steps, filter (drops common left padding), extend with another batch, more decode.
    for _ in range(2):
        x = mx.array(rng.normal(size=(3, 2, 1, 64)), dtype=mx.float32)
        ours.update_and_fetch(x, x)
        ref.update_and_fetch(x, x)
    same_layout(ours, ref)
    for c in (ours, ref):
        c.filter([2, 0])
    same_layout(ours, ref)
    tq2, fl2, _ = filled([3, 50], seed=2)
    ours.extend(TurboQuantKVCache.merge(tq2))
    ref.extend(KVCache.merge(fl2))
    same_layout(ours, ref)
    x = mx.array(rng.normal(size=(4, 2, 1, 64)), dtype=mx.float32)
    ours.update_and_fetch(x, x)
    ref.update_and_fetch(x, x)
    same_layout(ours, ref)
    assert [r.offset for r in ours.rows] == [30 + 9 + 3, 12 + 6 + 3, 3 + 1, 50 + 1]
    assert ours.trim(2) == ref.trim(2) == 2
    same_layout(ours, ref)


def test_left_padding_of_an_empty_batch_is_skipped():
    ours = TurboQuantKVCache.merge([TurboQuantKVCache(CFG, head_dim=64) for _ in range(2)])
    ref = KVCache.merge([KVCache(), KVCache()])
    ours.prepare(left_padding=[3, 0])
    ref.prepare(left_padding=[3, 0])
    same_layout(ours, ref)
    x = mx.array(np.random.default_rng(0).normal(size=(2, 2, 5, 64)), dtype=mx.float32)
    ours.update_and_fetch(x, x)
    ref.update_and_fetch(x, x)
    same_layout(ours, ref)
    assert [r.offset for r in ours.rows] == [2, 5]
    with pytest.raises(ValueError, match="empty batch cache"):
        ours.prepare(left_padding=[1, 1])


def test_merge_copies_and_extract_gives_the_single_cache():
    tq, _, data = filled(LENGTHS)
    before = [c.state[1]["k_codes"][0] for c in tq]
    batch = TurboQuantKVCache.merge(tq)
    x = mx.ones((3, 2, 1, 64))
    batch.update_and_fetch(x, x)
    assert [c.offset for c in tq] == list(LENGTHS)  # the caller's caches are untouched
    assert all(c.state[1]["k_codes"][0] is b for c, b in zip(tq, before))
    one = batch.extract(1)
    assert type(one) is TurboQuantKVCache and one.offset == LENGTHS[1] + 1 and one.batch_heads() == (1, 2)
    assert one.n_coded > 0 and one is not batch.rows[1]
    batch.update_and_fetch(x, x)
    assert one.offset == LENGTHS[1] + 1  # the extracted copy does not move with the batch
    # Memory: exactly the rows' arrays, no padding and no float copy of compressed tokens.
    solo = []
    for (k, v), c in zip(data, tq):
        s = TurboQuantKVCache(CFG, head_dim=64)
        s.update_and_fetch(k, v)
        for _ in range(2):
            s.update_and_fetch(x[:1], x[:1])
        solo.append(s)
    assert batch.nbytes == held_bytes(solo) == held_bytes(batch.rows)  # the rows share their codebooks


def test_merge_refuses_what_is_not_one_sequence_per_cache():
    c = TurboQuantKVCache(CFG, head_dim=64)
    c.update_and_fetch(mx.ones((2, 2, 4, 64)), mx.ones((2, 2, 4, 64)))
    with pytest.raises(ValueError, match=r"layer 0.*single-sequence caches.*batch 2"):
        TurboQuantKVCache.merge([c, TurboQuantKVCache(CFG, head_dim=64)])
    with pytest.raises(ValueError, match=r"different layers \[0, 3\]"):
        TurboQuantKVCache.merge([TurboQuantKVCache(CFG, head_dim=64), TurboQuantKVCache(CFG, layer_index=3)])
    other = TurboQuantKVCache(CFG)
    other.update_and_fetch(mx.ones((1, 2, 4, 32)), mx.ones((1, 2, 4, 32)))
    with pytest.raises(ValueError, match=r"layer 0.*different \(kv heads, key dim, value dim\) \[\(2, 32, 32\), "):
        TurboQuantKVCache.merge([filled([5])[0][0], other])
    batch = TurboQuantKVCache.merge([TurboQuantKVCache(CFG, head_dim=64)])
    with pytest.raises(ValueError, match="keys have batch 2, the cache holds 1 rows"):
        batch.update_and_fetch(mx.ones((2, 2, 4, 64)), mx.ones((2, 2, 4, 64)))


# --- attention on batch views -----------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["reference", "hook"])
def test_each_row_attends_as_it_would_alone_and_padding_gets_zeros(route):
    rng = np.random.default_rng(3)
    tq, _, data = filled(LENGTHS)
    batch = TurboQuantKVCache.merge(tq)
    lengths = [7, 3, 0]  # row 2 has no token in this prompt: all its queries are padding
    batch.prepare(lengths=lengths, right_padding=[7 - n for n in lengths])
    k = mx.array(rng.normal(size=(3, 2, 7, 64)), dtype=mx.float32)
    q = mx.array(rng.normal(size=(3, 4, 7, 64)), dtype=mx.float32)
    mask = batch.make_mask(7)
    kb, vb = batch.update_and_fetch(k, 2 * k)
    assert isinstance(kb, BatchView) and [r is None for r in kb.rows] == [False, False, True]
    if route == "hook":
        out = hooked_attention(q, kb, vb, scale=0.125, mask=mask)
    else:
        out = batch_view_attention(q, kb, vb, 0.125, mask)
    assert out.shape == (3, 4, 7, 64) and bool(mx.all(mx.isfinite(out)))
    for i, n in enumerate(lengths):
        solo = TurboQuantKVCache(CFG, head_dim=64)
        solo.update_and_fetch(*data[i])
        if n:
            ks, vs = solo.update_and_fetch(k[i : i + 1, :, :n], 2 * k[i : i + 1, :, :n])
            want = turboquant_attention(q[i : i + 1, :, :n], ks, vs, 0.125, "causal" if n > 1 else None)
            assert mx.array_equal(out[i : i + 1, :, :n], want)
        assert not bool(mx.any(out[i, :, n:]))  # padding queries: zeros
    # An array mask that is not the plain one (a window) is read per row in the padded layout.
    x = mx.array(rng.normal(size=(3, 2, 1, 64)), dtype=mx.float32)
    batch.finalize()
    windowed = batch.make_mask(1, window_size=4)
    kb, vb = batch.update_and_fetch(x, x)
    out = hooked_attention(q[:, :, :1], kb, vb, scale=0.125, mask=windowed)
    for i in range(3):
        view_k, view_v = kb.rows[i], vb.rows[i]
        n = view_k.n_tokens
        m = mx.arange(n) >= n - 4
        want = turboquant_attention(q[i : i + 1, :, :1], view_k, view_v, 0.125, m[None, None, None])
        assert mx.allclose(out[i : i + 1], want, atol=1e-6)


def test_batched_decode_builds_the_graph_without_host_sync(monkeypatch):
    cfg = TurboQuantConfig(window=16, calibration_tokens=None, compress_block=8, sinks=2, protect_factor=None)
    tq, _, _ = filled(LENGTHS, cfg=cfg)
    batch = TurboQuantKVCache.merge(tq)
    q = mx.ones((3, 4, 1, 64))
    x = mx.ones((3, 2, 1, 64))
    with forbid_host_sync(monkeypatch):
        for _ in range(20):  # crosses compression boundaries of every row
            _ = batch.offset
            mask = batch.make_mask(1)
            kb, vb = batch.update_and_fetch(x, x)
            out = hooked_attention(q, kb, vb, scale=0.125, mask=mask)
        _ = batch.state, batch.nbytes
    assert out.shape == (3, 4, 1, 64)


def test_state_round_trips_through_mlx_lm_files(tmp_path):
    tq, _, _ = filled(LENGTHS)
    batch = TurboQuantKVCache.merge(tq)
    batch.prepare(lengths=[2, 1, 0], right_padding=[0, 1, 2])
    x = mx.array(np.random.default_rng(5).normal(size=(3, 2, 2, 64)), dtype=mx.float32)
    batch.update_and_fetch(x, x)  # mid-prompt: the right padding is part of the state
    path = str(tmp_path / "batch.safetensors")
    mlx_cache.save_prompt_cache(path, [batch])
    (loaded,) = tq_mlx.load_prompt_cache(path)
    assert type(loaded) is BatchTurboQuantKVCache
    assert (loaded._idx, loaded._left, loaded._ends, loaded._right) == (batch._idx, batch._left, batch._ends,
                                                                        batch._right)
    loaded.finalize()
    batch.finalize()
    assert loaded.offset.tolist() == batch.offset.tolist()
    q = mx.ones((3, 4, 1, 64))
    outs = []
    for c in (batch, loaded):
        kb, vb = c.update_and_fetch(x[:, :, :1], x[:, :, :1])
        outs.append(batch_view_attention(q, kb, vb, 0.125))
    assert mx.array_equal(*outs)


# --- mlx-lm's batched generation on a patched model -------------------------------------------------------------


@pytest.fixture(scope="module")
def patched():
    out = {}
    for name in ("llama", "qwen3", "hybrid"):
        model = TINY_MODELS[name]()[0]
        out[name] = tq_mlx.patch_model(model, CFG)
    return out


def prompts_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n).tolist() for n in lengths]


def alone(model, prompt, max_tokens, prompt_cache=None, eos=(EOS,), **kw):
    """Greedy tokens and their log-probabilities generating one sequence with mlx-lm's generate_step, up to the
    first end-of-sequence token (which batch_generate leaves out)."""
    tokens, logprobs = [], []
    for y, lp in generate_step(mx.array(prompt), model, max_tokens=max_tokens, prompt_cache=prompt_cache, **kw):
        if int(y) in eos:
            break
        tokens.append(int(y))
        logprobs.append(float(lp[int(y)]))
    return tokens, logprobs


@pytest.mark.parametrize("name", ["llama", "qwen3", "hybrid"])
@pytest.mark.parametrize("prefill_step_size", [2048, 16])
def test_batch_generate_equals_generating_alone(request, patched, name, prefill_step_size):
    if ran_on_reference_blas(request):  # rows equal to their sequences alone, bit for bit: see reference_blas_env
        return
    model = patched[name]
    prompts = prompts_of(LENGTHS)
    r = batch_generate(model, tiny_tokenizer(), prompts, max_tokens=12, prefill_step_size=prefill_step_size,
                       return_token_ids=True, return_logprobs=True, return_prompt_caches=True)
    for p, got, lps, caches in zip(prompts, r.token_ids, r.logprobs, r.caches):
        want, want_lps = alone(model, p, 12, prefill_step_size=prefill_step_size)
        assert got == want and np.allclose(lps, want_lps, atol=1e-4)
        tq = [c for c in caches if isinstance(c, TurboQuantKVCache)]
        assert tq and all(c.offset == len(p) + len(got) and c.n_coded > 0 for c in tq)
    assert sum(map(len, r.token_ids)) >= 24
    if name == "hybrid":
        assert [type(c).__name__ for c in r.caches[0]] == ["ArraysCache"] * 3 + ["TurboQuantKVCache"]


def test_batch_generate_with_prefill_as_decode_equals_generating_alone(request):
    # Rows whose prompts compress their own tokens within one prefill chunk read them run by run, each with its
    # own runs (prefill_as_decode): as they would alone
    if ran_on_reference_blas(request):
        return
    import dataclasses

    model = tq_mlx.patch_model(TINY_MODELS["llama"]()[0], dataclasses.replace(CFG, prefill_as_decode=True))
    prompts = prompts_of(LENGTHS)
    r = batch_generate(model, tiny_tokenizer(), prompts, max_tokens=12, prefill_step_size=2048,
                       return_token_ids=True, return_logprobs=True)
    for p, got, lps in zip(prompts, r.token_ids, r.logprobs):
        want, want_lps = alone(model, p, 12, prefill_step_size=2048)
        assert got == want and np.allclose(lps, want_lps, atol=1e-4)


def test_batch_generate_continues_prompt_caches_of_different_lengths(patched):
    # Histories of different lengths: merge left-pads them; the caches given are not modified.
    model = patched["qwen3"]
    prompts = prompts_of((50, 20, 33), seed=1)
    cut = (30, 19, 8)
    caches = []
    for p, n in zip(prompts, cut):
        c = tq_mlx.make_prompt_cache(model, CFG)
        model(mx.array([p[:n]]), cache=c)
        caches.append(c)
    r = batch_generate(model, tiny_tokenizer(), [p[n:] for p, n in zip(prompts, cut)], prompt_caches=caches,
                       max_tokens=10, return_token_ids=True)
    assert [c[0].offset for c in caches] == list(cut)
    for p, n, c, got in zip(prompts, cut, caches, r.token_ids):
        want, _ = alone(model, p[n:], 10, prompt_cache=copy.deepcopy(c))
        assert got == want
    assert sum(map(len, r.token_ids)) >= 20


def test_batch_generator_inserting_and_finishing_mid_generation(patched):
    # Continuous batching: a sequence joins while others decode (extend), others finish early (filter).
    model = patched["qwen3"]
    prompts = prompts_of((31, 18, 44), seed=2)
    max_tokens = [6, 14, 9]
    gen = BatchGenerator(model, stop_tokens=[], prefill_step_size=16)
    uids = gen.insert(prompts[:2], max_tokens[:2])
    got = {}
    steps = 0
    while True:
        responses = gen.next_generated()
        if not responses:
            break
        steps += 1
        if steps == 3:
            uids += gen.insert(prompts[2:], max_tokens[2:])
        for r in responses:
            got.setdefault(r.uid, []).append(r.token)
    gen.close()
    for uid, p, m in zip(uids, prompts, max_tokens):
        # alone with the generator's prefill chunks: which tokens a chunk's queries see as codes, and so every
        # later query and the keys' query weights, depend on where the chunks end
        want, _ = alone(model, p, m, eos=(), prefill_step_size=16)
        assert got[uid] == want


@pytest.mark.parametrize("arch", ["afmoe", "cohere2", "falcon_h1", "gemma3n", "qwen3_next"])
def test_hybrid_models_batch_with_mlx_lm_batch_caches_for_their_other_layers(arch):
    # Sliding-window (BatchRotatingKVCache), recurrent (ArraysCache), CacheList members and gemma3n's KV-shared
    # layers (keys_and_values) next to TurboQuant layers.
    from tests.support import zoo

    model = tq_mlx.patch_model(zoo.build(arch), TurboQuantConfig(window=16, calibration_tokens=None, compress_block=8, sinks=2, key_bits=8,
                                                                 value_bits=8))
    prompts = prompts_of((30, 19, 41))
    r = batch_generate(model, tiny_tokenizer(), prompts, max_tokens=6, return_token_ids=True,
                       return_prompt_caches=True)
    for p, got, caches in zip(prompts, r.token_ids, r.caches):
        assert got == alone(model, p, 6)[0]
    flat = [m for c in r.caches[0] for m in getattr(c, "caches", [c])]
    assert any(isinstance(c, TurboQuantKVCache) and c.n_coded for c in flat)
    assert any(not isinstance(c, TurboQuantKVCache) for c in flat)


def test_patched_model_is_batchable_for_the_server(patched):
    # mlx_lm.server batches a model only if every cache of make_prompt_cache(model) has merge.
    for model in patched.values():
        assert all(hasattr(c, "merge") for c in mlx_cache.make_prompt_cache(model))


def test_server_flow_keeps_the_prompt_cache_compressed_and_batches_cache_hits(patched):
    # What mlx_lm.server does with a batchable model: finished sequences' caches (extracted from the batch) go
    # into its LRU; a follow-up request fetches the nearest one and joins a batch with it.
    model = patched["qwen3"]
    lru = mlx_cache.LRUPromptCache(max_size=8)
    gen = BatchGenerator(model, stop_tokens=[])
    uids = gen.insert(prompts_of((40, 25), seed=4), [8, 8])
    done = {}
    while responses := gen.next_generated():
        done.update({r.uid: r for r in responses if r.finish_reason})
    gen.close()
    for uid in uids:
        r = done[uid]
        assert all(type(c) is TurboQuantKVCache and c.n_coded for c in r.prompt_cache)
        lru.insert_cache("m", r.all_tokens, r.prompt_cache)
    assert lru.nbytes == sum(c.nbytes for r in done.values() for c in r.prompt_cache) > 0
    follow = [done[uid].all_tokens + t for uid, t in zip(uids, prompts_of((9, 3), seed=5))]
    fetched = [lru.fetch_nearest_cache("m", f) for f in follow]
    assert [len(rest) for _, rest in fetched] == [9, 3]
    gen = BatchGenerator(model, stop_tokens=[])
    uids = gen.insert([rest for _, rest in fetched], [6, 6], caches=[copy.deepcopy(c) for c, _ in fetched])
    got = {}
    while responses := gen.next_generated():
        for r in responses:
            got.setdefault(r.uid, []).append(r.token)
    gen.close()
    for uid, (cache, rest) in zip(uids, fetched):
        assert got[uid] == alone(model, rest, 6, prompt_cache=cache, eos=())[0]


# --- tq-server (real model) ------------------------------------------------------------------------------------


def _needle_messages(tok, question: str, n_tokens: int = 2000) -> list[dict]:
    """A user message of about n_tokens: Britannica text with a magic number in the middle, then question."""
    from tests.support.texts import britannica_text

    hay = tok.decode(tok.encode(britannica_text()[: 8 * n_tokens])[: n_tokens - 60])
    at = hay.find(". ", len(hay) // 2) + 1
    return [{"role": "user", "content": f"{hay[:at]}{NEEDLE}{hay[at:].lstrip()}\n\n{question}"}]


NEEDLE = " The special magic number for the archive is 7314926. "


@pytest.mark.slow
def test_tq_server_batches_and_answers_the_same_after_a_prompt_cache_hit(tmp_path):
    import socket
    import threading
    import urllib.request

    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from tests.support.real_models import SMOLLM2, prepare_model

    path = prepare_model(SMOLLM2, "float32")  # float16 matmuls bypass BLAS on a CPU (~4x slower here)
    tok = load_tokenizer(path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "server.log"
    cmd = [sys.executable, "-c", "import sys; from tq_mlx.cli.server import server_main; sys.exit(server_main())",
           "--model", str(path), "--host", "127.0.0.1", "--port", str(port), "--tq-bits", "4"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)

    def ask(messages, results=None, key=None):
        body = json.dumps({"messages": messages, "max_tokens": 16, "temperature": 0.0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(req, timeout=900).read())
        out = reply["choices"][0]["message"]["content"], reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        if results is not None:
            results[key] = out
        return out

    try:
        wait_until_healthy(proc, port, log, 120)
        question = "What is the special magic number for the archive? Answer with the number."
        cold, cached = ask(_needle_messages(tok, question))
        assert cached == 0 and "7314926" in cold
        hit, cached = ask(_needle_messages(tok, question))  # the same request: the LRU holds its cache
        assert cached > 1900 and hit == cold
        other, cached = ask(_needle_messages(tok, "Which number is the special magic number for the archive?"))
        assert cached > 1900 and "7314926" in other  # a prefix hit, then new tokens
        # Two requests at once share a batch.
        results = {}
        threads = [threading.Thread(target=ask, args=([{"role": "user", "content": q}], results, q))
                   for q in ("What is the capital of France?", "Name three colours of the rainbow.")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert len(results) == 2 and all(isinstance(a, str) and a for a, _ in results.values())
    finally:
        stop(proc, grace=20)
    # --tq-bits 4: K4/V4, keys by their output error, every token at its bits
    assert ("TurboQuant K4/V4, window 128, sinks 4, calibrating on 768 tokens, keys K3 to K6 by their output error "
            f"(at most {format(KEY_OUTPUT_ERROR, 'g')}); batching on") in log.read_text()


# --- SmolLM2 (real model) -----------------------------------------------------------------------------------

QUESTIONS = [
    "What is the capital of France?",
    "Write one sentence about the sea, then list three colours of the rainbow and say which one you like most.",
    "Explain in two sentences why the sky is blue. Keep it simple, as if for a ten-year-old child who asked.",
]


def smollm2_agreement(max_tokens: int = 16) -> dict:
    """batch_generate of QUESTIONS (chat prompts of three lengths) on SmolLM2 patched with CFG, against each
    generated alone: counts of equal sequences and of equal tokens at the same position."""
    from tests.support.real_models import load_smollm2

    model, tok = load_smollm2(mx.float32)
    tq_mlx.patch_model(model, CFG)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in QUESTIONS]
    r = batch_generate(model, tok, prompts, max_tokens=max_tokens, return_token_ids=True, return_prompt_caches=True)
    out = {"lengths": [len(p) for p in prompts], "sequences": len(prompts), "equal_sequences": 0, "tokens": 0,
           "equal_tokens": 0, "compressed": all(c.n_coded > 0 for cs in r.caches for c in cs)}
    for p, got in zip(prompts, r.token_ids):
        want, _ = alone(model, p, max_tokens, eos=tok.eos_token_ids)
        out["tokens"] += max(len(got), len(want))
        out["equal_tokens"] += sum(a == b for a, b in zip(got, want))
        out["equal_sequences"] += got == want
    return out


@pytest.mark.slow
def test_smollm2_batch_generate_equals_generating_alone():
    # Rows equal to "alone" bit for bit: on the reference BLAS (reference_blas_env), in a subprocess if OpenBLAS
    # is preloaded here.
    if openblas_preloaded():
        code = "import json; from tests.test_batch import smollm2_agreement; print(json.dumps(smollm2_agreement()))"
        run = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=reference_blas_env(), capture_output=True,
                             text=True, timeout=1800)
        assert run.returncode == 0, run.stderr[-3000:]
        r = json.loads(run.stdout.strip().splitlines()[-1])
    else:
        r = smollm2_agreement()
    assert len(set(r["lengths"])) == 3 and min(r["lengths"]) > CFG.window + CFG.sinks and r["compressed"]
    assert r["equal_sequences"] == r["sequences"] and r["equal_tokens"] == r["tokens"] >= 30, r


# --- temporal decay (issue 23): rows whose streams hold decayed codes ---------------------------------------------

# Tokens decay once more than 24 fresh and window tokens are held: rows of 40 and 57 tokens hold decayed codes when
# merged, the row of 23 starts decaying while the batch decodes.
DECAY_CFG = TurboQuantConfig(window=16, calibration_tokens=None, compress_block=8, sinks=2, decay_after=24, decay_key_bits=3,
                             decay_value_bits=2)


def decaying_rows(lengths, fetch: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    rows = []
    for n in lengths:
        c = TurboQuantKVCache(DECAY_CFG, head_dim=64, fetch=fetch)
        c.update_and_fetch(*kv(rng, n))
        rows.append(c)
    return rows


@pytest.mark.parametrize("fetch", ["codes", "float"])
def test_rows_with_decayed_codes_batch_as_they_would_alone(fetch, tmp_path):
    # merge, decode across decay boundaries, filter, extend, extract and trim: every row's views (codes) or padded
    # float tensors (float fetch, BatchTurboQuantKVCache._side) are those of the same cache alone
    rng = np.random.default_rng(7)
    rows = decaying_rows(LENGTHS, fetch)
    assert [c.n_decayed[0] > 0 for c in rows] == [True, False, True]
    solo = [copy.deepcopy(c) for c in rows]
    batch = TurboQuantKVCache.merge(rows)

    def step(n_new: int = 1):
        B = len(batch.rows)
        x = mx.array(rng.normal(size=(B, 2, n_new, 64)), dtype=mx.float32)
        q = mx.array(rng.normal(size=(B, 4, 1, 64)), dtype=mx.float32)
        kb, vb = batch.update_and_fetch(x, 2 * x)
        for i, s in enumerate(solo):
            ks, vs = s.update_and_fetch(x[i : i + 1], 2 * x[i : i + 1])
            if fetch == "codes":
                assert kb.rows[i].n_decayed == ks.n_decayed == s.n_decayed[0]
                got = batch_view_attention(q, kb, vb, 0.125)[i : i + 1]
                assert mx.array_equal(got, turboquant_attention(q[i : i + 1], ks, vs, 0.125))
            else:  # right-aligned at the last column of the padded layout
                n = ks.shape[2]
                assert mx.array_equal(kb[i : i + 1, :, batch.size() - n :], ks)
                assert mx.array_equal(vb[i : i + 1, :, batch.size() - n :], vs)

    for _ in range(10):
        step()
    assert all(c.n_decayed[0] > 0 for c in solo)
    batch.filter([2, 0])
    solo = [solo[2], solo[0]]
    other = decaying_rows([33], fetch, seed=1)
    solo.append(copy.deepcopy(other[0]))
    batch.extend(TurboQuantKVCache.merge(other))
    for _ in range(9):
        step()
    step(3)
    one = batch.extract(1)
    assert one.n_decayed == solo[1].n_decayed and one.nbytes == solo[1].nbytes
    assert batch.nbytes == held_bytes(solo)
    assert batch.trim(5) == 5
    for s in solo:
        s.trim(5)
    assert [r.n_decayed for r in batch.rows] == [s.n_decayed for s in solo]
    step()
    path = str(tmp_path / "batch.safetensors")  # decayed codes in a saved batch (state version 6 rows)
    mlx_cache.save_prompt_cache(path, [batch])
    (batch,) = tq_mlx.load_prompt_cache(path)
    assert [r.n_decayed for r in batch.rows] == [s.n_decayed for s in solo]
    step()


@pytest.mark.parametrize("arch", ["llama", "plamo", "deepseek_v3"])  # on the codes, decode-to-float, latent
def test_batch_generate_with_decay_equals_generating_alone(request, arch):
    if ran_on_reference_blas(request):  # rows equal to their sequences alone, bit for bit: see reference_blas_env
        return
    from tests.support import zoo

    model = TINY_MODELS[arch]()[0] if arch in TINY_MODELS else zoo.build(arch)
    tq_mlx.patch_model(model, DECAY_CFG)
    prompts = prompts_of(LENGTHS)
    r = batch_generate(model, tiny_tokenizer(), prompts, max_tokens=10, prefill_step_size=16,
                       return_token_ids=True, return_prompt_caches=True)
    for p, got, caches in zip(prompts, r.token_ids, r.caches):
        assert got == alone(model, p, 10, prefill_step_size=16)[0]
        tq = [c for c in caches if isinstance(c, TurboQuantKVCache)]
        assert tq and all(c.n_decayed[0] > 0 for c in tq)


def test_rows_choose_their_keys_widths_by_output_error_as_they_would_alone(request):
    # keys by their output error: each row holds its own first window's queries and chooses from its own values
    if ran_on_reference_blas(request):  # rows equal to their sequences alone, bit for bit: see reference_blas_env
        return
    model = TINY_MODELS["llama"]()[0]
    # (a first window of 30 tokens: its last third's queries read the tokens more than the window older as codes)
    tq_mlx.patch_model(model, TurboQuantConfig(window=16, calibration_tokens=30, compress_block=8, sinks=2,
                                               key_output_error=0.05))
    prompts = prompts_of(LENGTHS)
    r = batch_generate(model, tiny_tokenizer(), prompts, max_tokens=10, prefill_step_size=16,
                       return_token_ids=True, return_prompt_caches=True)
    widths = set()
    for p, got, caches in zip(prompts, r.token_ids, r.caches):
        solo = model.make_cache()
        assert got == alone(model, p, 10, prompt_cache=solo, prefill_step_size=16)[0]
        tq = [c for c in caches if isinstance(c, TurboQuantKVCache)]
        assert tq and [c.key_bits for c in tq] == [c.key_bits for c in solo if isinstance(c, TurboQuantKVCache)]
        widths.update(c.key_bits for c in tq)
    assert widths - {4}  # the target moves some layer off the configured bits
