"""tq-server's prompt cache: mlx-lm's LRUPromptCache (its trie, its LRU, its byte cap) over TurboQuant caches,
resumed only where a hit equals a fresh prefill (tq_mlx.prompt_cache.resume), with a disk tier (tq_mlx.prompt_cache.store).

mlx_lm.server builds one LRUPromptCache in `run` and calls three of its methods from the generation thread:
`fetch_nearest_cache` before a prompt is prefilled, `insert_cache` when a request ends (and, batched, at the end
of a system-prompt segment), `trim_to` under --prompt-cache-bytes. tq-server puts PromptCache in its place
(tq_mlx.hook's "tq-server" part, mlx_lm.server.LRUPromptCache), which keeps mlx-lm's data structures and changes
what they do as follows:

* fetch: of the trie's nearest entries (exact, the longest shorter, the shortest longer) and the store's files,
  the one that keeps the most tokens at its exact resume point wins (memory on a tie); its copy is trimmed to that
  point and the rest of the prompt is prefilled. A file that fails to load is logged and the next best is taken.
* insert: a finished request's cache and a system prompt's are written to the store when they come in (on its
  thread; short ones are not), so what memory evicts is on disk. A shorter entry is dropped as mlx-lm drops it
  only where the longer one resumes exactly at its end, and is then never written; where it cannot (with decay it
  often cannot) both stay, and the shorter one is written then (other segments' caches wait for that, or for
  memory to evict them).
* --prompt-cache-bytes caps the memory tier in every serving path (mlx-lm applies it to batched requests only),
  counting each entry's real bytes (tq_mlx.planner.memory.cache_bytes: its caches' `nbytes`, the constants its
  layers share once); `stats()` adds what mlx-lm's float cache would hold for the same tokens (cache_bytes too), the
  hits and misses, and the store's figures, which the server logs and serves at GET /v1/prompt_cache.
"""

from __future__ import annotations

import copy
import logging
import threading
from typing import Any, Callable

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache

from ..planner.display import format_bytes
from ..planner.memory import cache_bytes
from .store import PromptStore
from .resume import resume

MIN_STORED_TOKENS = 256  # shorter caches are not written to disk: they prefill again in well under a second
STORED_ON_INSERT = ("assistant", "system")  # a request's final cache, a system prompt's; others when evicted
NO_CAP = 1 << 63

log = logging.getLogger("tq_mlx.cli.server")

# model key -> (the model's store, the model), or None: no disk tier for that model
Stores = Callable[[Any], "tuple[PromptStore, Any] | None"]


class PromptCache(LRUPromptCache):
    """LRUPromptCache with exact resume points and a disk tier (the module docstring)."""

    def __init__(self, max_size: int = 10, max_bytes: int | None = None, stores: Stores | None = None):
        super().__init__(max_size, NO_CAP if max_bytes is None else max_bytes)
        self.stores: Stores = stores or (lambda key: None)
        self.counters = {"memory_hits": 0, "disk_hits": 0, "misses": 0, "cached_tokens": 0, "prefilled_tokens": 0}
        self._mlx_lm_bytes = 0
        self._lock = threading.Lock()

    # --- fetch ------------------------------------------------------------------------------------------------

    def _memory_best(self, model: Any, tokens: list[int]) -> tuple[int, Any, int]:
        """(point, entry, tokens it holds) of the trie's best candidate; point 0: none."""
        result = self._trie.search(model, tokens)
        best = (0, None, 0)
        shorter = result.shorter
        for found, common in ((result.exact, len(tokens)), (shorter, len(shorter or ())),
                              (result.longer, result.common_prefix)):
            if not found:
                continue
            entry = self._trie.get(result.model, found)
            point = resume(entry.prompt_cache, len(found), common, len(tokens))
            if point > best[0]:
                best = (point, entry, len(found))
        return best

    def fetch_nearest_cache(self, model: Any, tokens: list[int]):
        point, entry, held = self._memory_best(model, tokens)
        found = self.stores(model)
        if found is not None:
            store, model_object = found
            hit = store.lookup(tokens)
            while hit is not None and hit.point > point:
                cache = store.load(hit, model_object)
                if cache is not None:
                    return self._hit("disk", cache, tokens, hit.point, hit.entry.n_tokens)
                hit = store.lookup(tokens)  # that file was logged and set aside: the next best
        if entry is None:
            self.counters["misses"] += 1
            self.counters["prefilled_tokens"] += len(tokens)
            log.info(f"Prompt cache: miss: {len(tokens):,} tokens to prefill")
            return None, tokens
        cache = copy.deepcopy(entry.prompt_cache)
        if held > point:
            for c in cache:
                c.trim(held - point)
        return self._hit("memory", cache, tokens, point, held)

    def _hit(self, tier: str, cache: list, tokens: list[int], point: int, held: int):
        self.counters[f"{tier}_hits"] += 1
        self.counters["cached_tokens"] += point
        self.counters["prefilled_tokens"] += len(tokens) - point
        log.info(f"Prompt cache: {tier} hit: {point:,} of {len(tokens):,} tokens cached (from a cache of "
                 f"{held:,}), {len(tokens) - point:,} to prefill")
        return cache, tokens[point:]

    # --- insert and evict ---------------------------------------------------------------------------------------

    def _add(self, entry) -> None:
        with self._lock:
            self._n_bytes += entry.nbytes
            self._n_bytes_by_type[entry.cache_type] += entry.nbytes
            self._mlx_lm_bytes += entry.mlx_lm_bytes

    def _remove(self, entry) -> None:
        with self._lock:
            self._n_bytes -= entry.nbytes
            self._n_bytes_by_type[entry.cache_type] -= entry.nbytes
            self._mlx_lm_bytes -= getattr(entry, "mlx_lm_bytes", 0)

    def _evict_one(self) -> None:
        model, tokens = self._lru.pop()
        entry = self._trie.pop(model, tokens)
        self._remove(entry)
        found = self.stores(model)
        if found is not None and not getattr(entry, "stored", True):
            found[0].save(tokens, entry.prompt_cache)  # what memory evicts is kept on disk

    def insert_cache(self, model: Any, tokens: list[int], prompt_cache: list[Any], *,
                     cache_type: str = "assistant") -> None:
        held = cache_bytes(prompt_cache)
        entry = LRUPromptCache.CacheEntry(prompt_cache, held["total_bytes"], cache_type)
        entry.mlx_lm_bytes = held["mlx_lm_bytes"]
        entry.stored = cache_type in STORED_ON_INSERT  # else written when memory evicts it
        prev = self._trie.add(model, tokens, entry)
        if prev is not None:
            self._remove(prev)
            self._lru.remove(model, tokens)
        self._add(entry)
        self._lru.push(model, tokens, cache_type)
        if can_trim_prompt_cache(prompt_cache):
            self._drop_served_prefixes(model, tokens, prompt_cache)
        found = self.stores(model)
        if found is not None and entry.stored:
            found[0].save(tokens, prompt_cache)
        if len(self._lru) > self.max_size:
            self._evict_one()
        while self._n_bytes > self.max_bytes and len(self._lru):
            self._evict_one()

    def _drop_served_prefixes(self, model: Any, tokens: list[int], prompt_cache: list[Any]) -> None:
        """Drop the entries on the path of `tokens` that the new cache resumes exactly at their end (mlx-lm drops
        every one: a float cache trims to any point); write the others to disk now if they are not there yet (the
        new cache cannot stand in for them after a restart either)."""
        node, held = self._trie._trie[model], len(tokens)
        found = self.stores(model)
        for i, tok in enumerate(tokens):
            value = node.get("__value__")
            if value is not None and resume(prompt_cache, held, i, i + 1) == i:
                node.pop("__value__")
                self._remove(value)
                self._lru.remove(model, tokens[:i])
            elif value is not None and found is not None and not getattr(value, "stored", True):
                value.stored = True
                found[0].save(tokens[:i], value.prompt_cache)
            node = node[tok]

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        n_sequences = max(0, n_sequences) if n_sequences is not None else NO_CAP
        n_bytes = max(0, n_bytes) if n_bytes is not None else NO_CAP
        while len(self._lru) > n_sequences:
            self._evict_one()
        while self._n_bytes > n_bytes and len(self._lru):
            self._evict_one()

    # --- figures ------------------------------------------------------------------------------------------------

    def stats(self, model: Any = None) -> dict:
        """The memory tier's sequences and bytes (held, and what mlx-lm's own cache would hold for them), its caps,
        the hits, and the disk tier's figures (PromptStore.stats) for `model`'s store."""
        with self._lock:
            memory = {"sequences": len(self._lru), "bytes": self._n_bytes, "mlx_lm_bytes": self._mlx_lm_bytes,
                      "max_sequences": self.max_size,
                      "max_bytes": None if self.max_bytes >= NO_CAP else self.max_bytes,
                      "by_type": {k: dict(v) for k, v in self.stats_by_type().items()}}
        found = self.stores(model) if model is not None else None
        disk = found[0].stats() if found is not None else {"enabled": False}
        return {"object": "prompt_cache", "memory": memory, "disk": disk, **dict(self.counters)}

    def describe(self, model: Any = None) -> str:
        """One line for the log: what memory holds against mlx-lm's own cache, hits, and the disk tier."""
        s = self.stats(model)
        m, d = s["memory"], s["disk"]
        held = f"{m['sequences']} sequences, {format_bytes(m['bytes'])}"
        if m["bytes"]:
            held += f" (mlx-lm's own cache: {format_bytes(m['mlx_lm_bytes'])})"
        disk = (f"disk {d['files']} files, {format_bytes(d['bytes'])} of {format_bytes(d['max_bytes'])}"
                if d.get("enabled") else "disk off")
        return (f"Prompt cache: {held}; {disk}; hits: {s['memory_hits']} memory, {s['disk_hits']} disk, "
                f"{s['misses']} misses")
