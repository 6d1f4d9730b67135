"""One chat conversation over one TurboQuant prompt cache, independent of the UI.

The cache is reused between turns: each turn renders the whole conversation with the tokenizer's chat template,
checks that it starts with exactly the tokens already in the cache, and feeds only the rest. If the template
rewrote earlier tokens (a thinking model dropping old <think> blocks, or a re-tokenized answer), the cache is
trimmed back to the first difference; a cache that cannot be trimmed (hybrid linear-attention state) is
rebuilt from scratch.

With a prompt store (tq_mlx.prompt_cache.store, the disk tier tq-server uses too) the session starts from the system
prompt's cache on disk when it is there (`warm_start`: else it prefills the system prompt at once and stores it),
looks a turn's tokens up there when the cache at hand keeps fewer of them, and stores the cache after every turn,
so that a later launch with the same model, config and system prompt continues without prefilling them again.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
from mlx.utils import tree_flatten, tree_reduce

from tq_mlx.planner import display
from tq_mlx.planner import memory
from tq_mlx.cache import TurboQuantConfig, TurboQuantKVCache
from tq_mlx.planner.display import describe_config

FILE_FORMAT = "tq-chat/1"
STORE_GAIN = 32  # a prompt-store cache is loaded only if it keeps at least this many more tokens than the one at hand


def materialize(cache: list) -> None:
    """Evaluate every array a cache holds, in this thread. MLX streams belong to the thread that made them: a
    lazy array built here (a cache loaded from a file) cannot be evaluated by the generation thread."""
    arrays = []
    for c in cache:
        inner = getattr(c, "caches", None)  # mlx-lm CacheList
        if isinstance(inner, (list, tuple)):
            materialize(list(inner))
        elif hasattr(c, "held_arrays"):  # TurboQuantKVCache: buffers and quantizer constants
            arrays += c.held_arrays()
        else:
            arrays += [a for _, a in tree_flatten(c.state) if isinstance(a, mx.array)]
    mx.eval(arrays)


class ContextFull(Exception):
    """The conversation has no room left under --ctx."""


class _Stopped(Exception):
    """Raised between prefill chunks to abandon a prefill the user stopped."""


@dataclass
class TurnResult:
    text: str
    finish: str  # "stop" (end of turn), "length" (--max-tokens), "context" (--ctx reached), "stopped" (user)
    new_tokens: int  # prompt tokens fed this turn
    reused_tokens: int  # prompt tokens that were already in the cache
    generated: int
    prompt_tps: float
    decode_tps: float
    stored_tokens: int = 0  # of reused_tokens, those loaded from the prompt store this turn


@dataclass
class Speeds:
    prompt_tps: float = 0.0
    decode_tps: float = 0.0
    prefill: tuple[int, int] | None = None  # (processed, total) while prefilling


@dataclass
class ChatSession:
    model: Any
    tokenizer: Any
    config: TurboQuantConfig | None
    ctx: int
    model_id: str = ""
    system: str | None = None
    max_tokens: int = 1024
    sampler: Callable | None = None
    prefill_step_size: int = 2048
    messages: list[dict] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # exactly the tokens the cache holds, in order
    speeds: Speeds = field(default_factory=Speeds)
    stop_event: threading.Event = field(default_factory=threading.Event)
    store: Any = None  # a tq_mlx.prompt_cache.store.PromptStore of this model and config, or None

    def __post_init__(self):
        self.weights = tree_reduce(lambda acc, x: acc + x.nbytes if isinstance(x, mx.array) else acc, self.model, 0)
        floats = (v.dtype for _, v in tree_flatten(self.model.parameters()) if mx.issubdtype(v.dtype, mx.floating))
        self.dtype = str(next(floats, "")).removeprefix("mlx.core.") or None  # what the model runs in
        self.clear()

    # --- conversation ---------------------------------------------------------------------------------------

    def new_cache(self) -> list:
        if self.config is None:
            from mlx_lm.models.cache import make_prompt_cache

            return make_prompt_cache(self.model)
        from tq_mlx.integration import make_prompt_cache

        return make_prompt_cache(self.model, self.config)

    def clear(self) -> None:
        """Start over: no messages but the system prompt, an empty cache."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.cache = self.new_cache()
        self.tokens = []
        self.speeds = Speeds()
        self._checkpoint: tuple[int, list] | None = None  # (tokens, saved caches): see _trim_to
        self.stored_tokens = 0  # tokens the last turn took from the prompt store

    def render(self, messages: list[dict]) -> list[int]:
        """Token ids of the conversation with the assistant's turn opened."""
        tok = self.tokenizer
        if getattr(tok, "has_chat_template", False):
            ids = tok.apply_chat_template(messages, add_generation_prompt=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return list(ids)
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        return list(tok.encode(text))

    def cache_offset(self, cache: list | None = None) -> int:
        """Tokens held by the (first attention layer of the) cache."""
        for c in self.cache if cache is None else cache:
            off = getattr(c, "offset", None)
            if isinstance(off, int) and (isinstance(c, TurboQuantKVCache) or hasattr(c, "keys")):
                return off
        return len(self.tokens)

    def _trim_to(self, n: int) -> None:
        """Keep at most the first n cached tokens: trim, or for a cache that cannot be trimmed (hybrid
        linear-attention state) go back to the checkpoint taken at the end of the last prompt, else rebuild."""
        drop = len(self.tokens) - n
        if drop <= 0:
            return
        if n > 0 and all(c.is_trimmable() for c in self.cache):
            for c in self.cache:
                c.trim(drop)
            self.tokens = self.tokens[:n]
        elif self._checkpoint is not None and self._checkpoint[0] <= n:
            at, saved = self._checkpoint
            # Trimmable caches trim back to the checkpoint; the others get their saved state back.
            self.cache = [copy.deepcopy(s) if s is not None else c for c, s in zip(self.cache, saved)]
            for c, s in zip(self.cache, saved):
                if s is None:
                    c.trim(len(self.tokens) - at)
            self.tokens = self.tokens[:at]
        else:
            self.cache = self.new_cache()
            self.tokens = []
        self._checkpoint = None

    def _take_checkpoint(self) -> None:
        # Only hybrids need it: their linear-attention state is small and fixed, and cannot be trimmed.
        if all(c.is_trimmable() for c in self.cache):
            self._checkpoint = None
            return
        self._checkpoint = (len(self.tokens), [None if c.is_trimmable() else copy.deepcopy(c) for c in self.cache])

    def prepare(self, user_text: str) -> tuple[list[dict], list[int], int]:
        """(messages with the new turn, tokens to feed, tokens reused from the cache)."""
        messages = self.messages + [{"role": "user", "content": user_text}]
        full = self.render(messages)
        p = 0
        limit = min(len(full), len(self.tokens))
        while p < limit and full[p] == self.tokens[p]:
            p += 1
        self.stored_tokens = self._from_store(full, p)
        p = max(p, self.stored_tokens)
        if p == len(full):  # nothing new to feed: re-feed the last token so there is something to run
            p -= 1
        self._trim_to(p)
        reused = len(self.tokens)
        return messages, full[reused:], reused

    # --- the prompt store --------------------------------------------------------------------------------------

    def _from_store(self, tokens: list[int], have: int, target: int | None = None) -> int:
        """If the prompt store resumes `tokens` (a prompt of `target` tokens, default these) exactly
        (tq_mlx.prompt_cache.resume) at least STORE_GAIN tokens further than the `have` the cache at hand keeps, take its cache:
        returns the tokens it keeps (0: none taken)."""
        if self.store is None:
            return 0
        hit = self.store.lookup(tokens, target)
        if hit is None or hit.point < have + STORE_GAIN:
            return 0
        cache = self.store.load(hit, self.model)
        if cache is None:  # logged by the store; the cache at hand goes on
            return 0
        self.cache, self.tokens, self._checkpoint = cache, list(tokens[: hit.point]), None
        return hit.point

    def _store_cache(self) -> None:
        """Keep the cache and its tokens in the prompt store (written on the store's thread)."""
        if self.store is not None and self.tokens:
            self.store.save(self.tokens, self.cache)

    def system_prefix(self) -> list[int]:
        """The tokens every conversation with this system prompt starts with: the rendered system prompt and what
        the template puts before a user's text (the common prefix of two renders with different user texts)."""
        if not self.system:
            return []
        system = [{"role": "system", "content": self.system}]
        a, b = (self.render(system + [{"role": "user", "content": t}]) for t in ("a", "b"))
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return a[:n]

    def warm_start(self, on_progress: Callable[[int, int], None] = lambda a, b: None) -> str | None:
        """Start from the system prompt's cache: loaded from the prompt store when it is there, else prefilled now
        and stored for the next launch. Returns the line that says which (None: no store or no system prompt)."""
        prefix = self.system_prefix()
        if self.store is None or not self.store.enabled or len(prefix) < 2:
            return None
        start = time.perf_counter()
        loaded = self._from_store(prefix, 0, target=len(prefix) + 1)  # a turn adds at least one token
        rest = prefix[len(self.tokens):]
        if not rest:
            return (f"System prompt: {loaded:,} tokens loaded from the prompt cache on disk ({self.store.folder}), "
                    f"no prefill.")

        def progress(done: int, total: int) -> None:
            if self.stop_event.is_set():
                raise _Stopped
            on_progress(done, total)

        try:
            self._prefill(rest, progress, keep_last=False)
        except _Stopped:
            self.clear()
            return None
        self._store_cache()
        seconds = time.perf_counter() - start
        if loaded:
            return (f"System prompt: {loaded:,} of {len(prefix):,} tokens loaded from the prompt cache on disk, "
                    f"{len(rest):,} prefilled in {seconds:.1f} s.")
        return (f"System prompt: {len(prefix):,} tokens prefilled in {seconds:.1f} s; its cache is kept on disk "
                f"({self.store.folder}) for the next launch.")

    def _prefill(self, tokens: list[int], on_progress: Callable[[int, int], None], keep_last: bool = True) -> None:
        """Feed all but the last of `tokens` (keep_last False: all of them) in chunks of prefill_step_size (as
        mlx-lm's generate_step does), reporting progress; the last token goes to stream_generate, which samples
        from it."""
        from mlx_lm.generate import generation_stream

        total, done, last = len(tokens), 0, int(keep_last)
        on_progress(0, total)
        while total - done > last:
            n = min(self.prefill_step_size, total - done - last)
            with mx.stream(generation_stream):
                self.model(mx.array(tokens[done : done + n])[None], cache=self.cache)
                mx.eval([c.state for c in self.cache])
            self.tokens.extend(tokens[done : done + n])
            done += n
            on_progress(done, total)
            mx.clear_cache()

    def generate(
        self,
        user_text: str,
        on_text: Callable[[str], None] = lambda s: None,
        on_progress: Callable[[int, int], None] = lambda a, b: None,
    ) -> TurnResult:
        """Run one turn: feed the new tokens, stream the answer through on_text, keep it in the conversation.

        Raises ContextFull (conversation unchanged) when --ctx leaves no room for the new turn.
        stop_event (set from another thread, e.g. Ctrl+C) ends the prefill or the answer at the next chunk or
        token; the partial answer stays in the conversation.
        """
        from mlx_lm.generate import stream_generate

        messages, new, reused = self.prepare(user_text)
        room = self.ctx - reused - len(new)
        if room < 1:
            raise ContextFull(
                f"context limit reached: this turn needs {reused + len(new):,} tokens, --ctx is {self.ctx:,}. "
                f"Use /clear to start a new conversation."
            )
        self.messages = messages
        self.stop_event.clear()
        max_tokens = min(self.max_tokens, room)
        text, finish, generated = "", "stop", 0

        def progress(done: int, total: int) -> None:
            if self.stop_event.is_set():
                raise _Stopped
            self.speeds.prefill = (done, total)
            on_progress(done, total)

        start = time.perf_counter()
        try:
            self._prefill(new, progress)
            self._take_checkpoint()
            self.tokens.append(new[-1])  # fed by stream_generate's first step
            for response in stream_generate(
                self.model, self.tokenizer, mx.array(new[-1:]), max_tokens=max_tokens, sampler=self.sampler,
                prompt_cache=self.cache,
            ):
                if generated == 0:
                    self.speeds.prompt_tps = len(new) / (time.perf_counter() - start)
                    self.speeds.prefill = None
                    on_progress(len(new), len(new))
                # Every token stream_generate reports has already been fed to the cache (pipelined decode).
                self.tokens.append(response.token)
                generated += 1
                text += response.text
                self.speeds.decode_tps = response.generation_tps
                if response.text:
                    on_text(response.text)
                if response.finish_reason is not None:
                    finish = response.finish_reason
                if self.stop_event.is_set():
                    finish = "stopped"
                    break
        except _Stopped:
            finish = "stopped"
        finally:
            self.speeds.prefill = None
            self.messages = messages + [{"role": "assistant", "content": text}]
            self._reconcile()
            self._store_cache()
        if finish == "length" and max_tokens < self.max_tokens:
            finish = "context"
        return TurnResult(
            text=text, finish=finish, new_tokens=len(new), reused_tokens=reused, generated=generated,
            prompt_tps=self.speeds.prompt_tps, decode_tps=self.speeds.decode_tps, stored_tokens=self.stored_tokens,
        )

    def _reconcile(self) -> None:
        """Make self.tokens match the cache's offset (an interrupted turn may leave them apart)."""
        offset = self.cache_offset()
        if offset < len(self.tokens):
            self.tokens = self.tokens[:offset]
        elif offset > len(self.tokens):
            if all(c.is_trimmable() for c in self.cache):
                for c in self.cache:
                    c.trim(offset - len(self.tokens))
            else:
                self.cache, self.tokens, self._checkpoint = self.new_cache(), [], None

    # --- numbers for the memory panel ------------------------------------------------------------------------

    def snapshot(self) -> dict:
        """Everything the memory panel shows. KV numbers come from memory.cache_bytes (what the caches hold, the
        codebooks their layers share counted once)."""
        s = memory.cache_bytes(self.cache)
        s["kv_dtype"] = s["kv_dtype"] or self.dtype  # an empty cache has no dtype yet: the model's
        s.update(
            ctx=self.ctx,
            context_tokens=self.cache_offset(),
            weights=self.weights,
            active=mx.get_active_memory(),
            peak=mx.get_peak_memory(),
            prompt_tps=self.speeds.prompt_tps,
            decode_tps=self.speeds.decode_tps,
            prefill=self.speeds.prefill,
            bits=display.bits_summary(self.cache),
            config=describe_config(self.config) if self.config else "mlx-lm's own KV cache (no TurboQuant)",
        )
        return s

    # --- /save and /load ---------------------------------------------------------------------------------------

    def save(self, path: str | Path) -> Path:
        """Write the compressed prompt cache and the conversation to a .safetensors file."""
        from mlx_lm.models.cache import save_prompt_cache

        path = Path(path).expanduser()
        if path.suffix != ".safetensors":
            path = path.with_name(path.name + ".safetensors")
        metadata = {
            "format": FILE_FORMAT,
            "model": self.model_id,
            "messages": json.dumps(self.messages),
            "tokens": json.dumps(self.tokens),
            "config": json.dumps(self.config.to_dict() if self.config else None),
        }
        if not path.parent.is_dir():
            raise ValueError(f"cannot save to {path}: the folder {path.parent} does not exist")
        try:
            save_prompt_cache(str(path), self.cache, metadata)
        except RuntimeError as e:  # MLX reports an unwritable file as RuntimeError("[save_safetensors] ...")
            raise OSError(f"cannot write {path}: {e}") from None
        return path

    def load(self, path: str | Path) -> list[str]:
        """Restore a conversation saved by save(); returns warnings. Raises ValueError (conversation unchanged)
        for a file that is not a tq-chat save or does not fit this model."""
        from tq_mlx.integration import load_prompt_cache

        path = Path(path).expanduser()
        if not path.exists() and path.with_name(path.name + ".safetensors").exists():
            path = path.with_name(path.name + ".safetensors")
        if not path.exists():
            raise ValueError(f"no such file: {path}")
        cache, meta = load_prompt_cache(str(path), model=self.model, return_metadata=True)
        if meta.get("format") != FILE_FORMAT:
            raise ValueError(f"{path}: not a tq-chat conversation (no '{FILE_FORMAT}' metadata)")
        try:
            messages, tokens = json.loads(meta["messages"]), json.loads(meta["tokens"])
            config = json.loads(meta["config"])
        except (KeyError, ValueError) as e:
            raise ValueError(f"{path}: damaged conversation metadata ({e})") from None
        warnings = []
        if meta.get("model") and meta["model"] != self.model_id:
            warnings.append(f"saved with model {meta['model']}, continuing with {self.model_id}")
        if config != (self.config.to_dict() if self.config else None):
            warnings.append("saved with other cache settings; its tokens keep them, new tokens use the current ones")
        offset = self.cache_offset(cache)
        if offset != len(tokens):
            raise ValueError(f"{path}: the cache holds {offset} tokens but the conversation {len(tokens)}")
        materialize(cache)
        self.cache, self.messages, self.tokens = cache, messages, tokens
        self.speeds, self._checkpoint = Speeds(), None
        return warnings
