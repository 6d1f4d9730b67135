"""tq-server's prompt cache (tq_mlx.prompt_cache.lru.PromptCache), in process on a tiny random llama: mlx-lm's trie, LRU
and byte cap over TurboQuant caches counted by their real bytes, a hit resumed only where it equals a fresh
prefill, the disk tier taken when it resumes more, and what memory evicts found again on disk. The server around
it (flags, log lines, GET /v1/prompt_cache, restarts) is tests/test_server_prompt_cache.py's."""

from __future__ import annotations

import logging

import pytest

from tests.support.tiny_models import prefilled, random_tokens as ids, tiny_llama
from tq_mlx.cache import held_bytes
from tq_mlx import TurboQuantConfig
from tq_mlx.planner.memory import cache_bytes
from tq_mlx.prompt_cache.store import PromptStore, model_id
from tq_mlx.prompt_cache.resume import cache_counts
from tq_mlx.prompt_cache.lru import PromptCache

CFG = TurboQuantConfig(window=32, calibration_tokens=None, compress_block=16, sinks=4, decay_after=96)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(layers=2)[0]


def fed(model, tokens, cache=None):
    return prefilled(model, tokens, CFG, cache)


def disk(folder, model):
    store = PromptStore(folder, 10**9, model_id=model_id(model), config=CFG, model_name="tiny", background=False)
    return lambda key: (store, model) if key == "m" else None


def test_a_memory_hit_resumes_where_a_fresh_prefill_agrees_and_counts_real_bytes(model):
    lru = PromptCache(10)
    held = ids(150) + ids(60, 1)
    cache = fed(model, held)
    lru.insert_cache("m", held, cache)
    assert lru.nbytes == held_bytes(cache) > 0
    stats = lru.stats("m")
    assert stats["memory"]["bytes"] == lru.nbytes and stats["memory"]["mlx_lm_bytes"] == cache_bytes(cache)[
        "mlx_lm_bytes"] > lru.nbytes
    prompt = held[:150] + ids(20, 2)  # the common prefix ends inside the cache's codes
    got, rest = lru.fetch_nearest_cache("m", prompt)
    point = len(prompt) - len(rest)
    assert 4 < point <= 150 and rest == prompt[point:]
    fed(model, rest, got)
    assert cache_counts(got) == cache_counts(fed(model, prompt))
    assert cache_counts(lru._trie.get("m", held).prompt_cache) == cache_counts(cache)  # the entry is untouched
    assert lru.counters["memory_hits"] == 1 and lru.counters["cached_tokens"] == point
    assert lru.fetch_nearest_cache("m", ids(30, 5)) == (None, ids(30, 5)) and lru.counters["misses"] == 1


def test_a_shorter_entry_stays_where_the_longer_one_cannot_resume_at_its_end(model):
    lru = PromptCache(10)
    system = ids(120)
    lru.insert_cache("m", system, fed(model, system), cache_type="system")
    longer = system + ids(100, 1)  # decays past the system prompt's end: cannot stand in for it
    lru.insert_cache("m", longer, fed(model, longer))
    assert len(lru) == 2
    got, rest = lru.fetch_nearest_cache("m", system + ids(10, 2))
    assert len(rest) == 10  # the system prompt's own cache: everything shared kept
    near = system + ids(3, 3)
    lru.insert_cache("m", near, fed(model, near))  # resumes exactly at the system prompt's end: it replaces it
    assert len(lru) == 2 and lru.nbytes == sum(e.nbytes for e in (
        lru._trie.get("m", longer), lru._trie.get("m", near)))


def test_the_byte_cap_holds_in_every_serving_path_and_evicts_the_oldest(model):
    one = fed(model, ids(100))
    cap = sum(c.nbytes for c in one) * 2 + 1000
    lru = PromptCache(10, cap)
    for seed in range(4):
        lru.insert_cache("m", ids(100, 10 + seed), fed(model, ids(100, 10 + seed)))
        assert lru.nbytes <= cap
    assert len(lru) == 2
    assert lru.fetch_nearest_cache("m", ids(100, 10)[:90] + [1])[0] is None  # the first two went
    assert lru.fetch_nearest_cache("m", ids(100, 13)[:90] + [1])[0] is not None
    lru.trim_to(n_bytes=0)
    assert len(lru) == 0 and lru.nbytes == 0 and lru.stats()["memory"]["mlx_lm_bytes"] == 0


def test_what_memory_evicts_is_found_on_disk_and_the_tier_that_resumes_more_wins(model, tmp_path):
    stores = disk(tmp_path, model)
    lru = PromptCache(1, stores=stores)
    a, b = ids(150), ids(150, 1)
    lru.insert_cache("m", a, fed(model, a))
    lru.insert_cache("m", b, fed(model, b))  # evicts a from memory: it was written when it came in
    assert len(lru) == 1 and len(list(tmp_path.iterdir())) == 2
    prompt = a[:140] + ids(5, 2)
    got, rest = lru.fetch_nearest_cache("m", prompt)
    assert got is not None and lru.counters["disk_hits"] == 1
    fed(model, rest, got)
    assert cache_counts(got) == cache_counts(fed(model, prompt))
    # b is in memory and on disk: memory serves it
    got, rest = lru.fetch_nearest_cache("m", b[:140] + ids(5, 3))
    assert lru.counters["memory_hits"] == 1 and lru.counters["disk_hits"] == 1
    assert lru.stats("m")["disk"]["files"] == 2


def test_a_disk_file_that_fails_to_load_is_one_line_and_the_request_prefills(model, tmp_path, caplog):
    stores = disk(tmp_path, model)
    lru = PromptCache(0, stores=stores)  # nothing stays in memory
    a = ids(150)
    lru.insert_cache("m", a, fed(model, a))
    (path,) = tmp_path.iterdir()
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x55
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, "tq_mlx.prompt_cache.store"):
        got, rest = lru.fetch_nearest_cache("m", a[:140] + [1])
    assert got is None and len(rest) == 141
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1 and path.exists()


def test_a_requests_cache_is_written_when_it_comes_in_other_segments_when_memory_evicts_them(model, tmp_path):
    lru = PromptCache(1, stores=disk(tmp_path, model))
    user, system, done = ids(150), ids(150, 1), ids(150, 2)
    lru.insert_cache("m", user, fed(model, user), cache_type="user")
    assert list(tmp_path.iterdir()) == []  # a segment's cache: in memory only while memory keeps it
    lru.insert_cache("m", system, fed(model, system), cache_type="system")  # evicts user: now written
    assert len(list(tmp_path.iterdir())) == 2  # user's (evicted) and the system prompt's (on insert)
    lru.insert_cache("m", done, fed(model, done))
    assert len(list(tmp_path.iterdir())) == 3
    near, far = user + ids(3, 3), user + ids(100, 4)
    lru = PromptCache(5, stores=disk(tmp_path / "b", model))
    lru.insert_cache("m", user, fed(model, user), cache_type="user")
    lru.insert_cache("m", near, fed(model, near))  # stands in for user exactly: user's cache is never written
    assert len(lru) == 1 and len(list((tmp_path / "b").iterdir())) == 1
    lru = PromptCache(5, stores=disk(tmp_path / "c", model))
    lru.insert_cache("m", user, fed(model, user), cache_type="user")
    lru.insert_cache("m", far, fed(model, far))  # decays past user's end: both stay, and user's is written now
    assert len(lru) == 2 and len(list((tmp_path / "c").iterdir())) == 2
