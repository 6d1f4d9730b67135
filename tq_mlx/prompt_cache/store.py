"""A disk store of compressed prompt caches, keyed by model, cache config and token prefix: found again by the
longest exact resume point (tq_mlx.prompt_cache.resume), least recently used first out past a byte cap, written atomically.

* **Files.** One safetensors file per cached token sequence, in the layout of mlx-lm's save_prompt_cache (so
  `tq_mlx.load_prompt_cache` and mlx-lm's loader read it), named
  `<model>--<model id>--<config id>--<tokens>-<token hash>.tqpc.safetensors`: the model's name, a fingerprint of
  its weights (model_id), of the TurboQuantConfig (config_id), and of the tokens. The header's metadata says the
  same in full (the config's fields, the tokens, each layer's token counts for resume_point) and holds a CRC-32 of
  the data. A file is written to a temporary name in the same folder, synced and renamed (os.replace): it is
  whole or absent.
* **The index** is rebuilt at start from the headers of the files of this model and config (a header read, no
  array loaded); a file whose header does not validate (truncated, another format, a name that does not match its
  header) is logged in one line and never used. Files of other models or configs are never read, but share the
  byte cap. A file is checked again when loaded (its CRC, its arrays against the model and config:
  integration.load_prompt_cache), and one that fails is logged and skipped: the caller prefills from scratch.
* **Eviction**: by last use (a file's mtime, set when it is written or loaded), oldest first, until every store
  file in the folder fits the byte cap. Only files matching the store's own naming pattern are ever deleted (and
  its own temporary files left behind by a process that died).
* **Writes** happen on a background thread: `save` takes a snapshot of the cache's arrays (new array objects on
  the same data, evaluated in the calling thread) and returns; a full disk or a read-only folder is one line in
  the log and the caller goes on.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import queue
import re
import stat
import threading
import time
from pathlib import Path
from typing import Any, Iterable, NamedTuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..config import TurboQuantConfig
from .file import data_crc, flatten_cache, read_header, write_file
from .resume import LayerCounts, cache_counts, counts_from_json, counts_to_json, resume_point

FORMAT = "tq-prompt-store/1"
FOLDER_ENV = "TQ_MLX_PROMPT_CACHE_DIR"  # the default folder, instead of <tq-mlx cache>/prompt-cache
DEFAULT_DISK_BYTES = 10 * 10**9  # 10 GB (mlx-lm's units: --prompt-cache-bytes 10G)
SUFFIX = ".tqpc.safetensors"
NAME = re.compile(r"^(?P<slug>[a-z0-9][a-z0-9._-]{0,47})--(?P<model>[0-9a-f]{12})--(?P<config>[0-9a-f]{12})--"
                  r"(?P<n>[1-9][0-9]{0,8})-(?P<tokens>[0-9a-f]{16})\.tqpc\.safetensors$")
TEMP = re.compile(r"^\.(?P<name>.+\.tqpc\.safetensors)\.(?P<pid>[0-9]{1,9})\.[0-9a-f]{8}\.tmp$")
STALE_TEMP_SECONDS = 3600  # a temporary file this old is a dead writer's, whatever its pid says
PENDING_BYTES = 4 << 30  # snapshots waiting to be written; past this a save is skipped (said at debug level)

log = logging.getLogger("tq_mlx.prompt_cache.store")

def default_folder() -> Path:
    """$TQ_MLX_PROMPT_CACHE_DIR, else cache_folder()."""
    env = os.environ.get(FOLDER_ENV)
    return Path(env).expanduser() if env else cache_folder()


def cache_folder() -> Path:
    """prompt-cache/ in tq-mlx's cache folder ($TQ_MLX_CACHE or ~/.cache/tq-mlx)."""
    from ..models.demo import CACHE_ENV

    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "tq-mlx").expanduser() / "prompt-cache"


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(8, "little") + p)
    return h.hexdigest()


def model_id(*models: Any) -> str:
    """A fingerprint of models' weights (12 hex digits): every parameter's name, shape and dtype and the first
    and last 64 bytes of its data, so another model, a fine-tune, an adapter or another dtype gets another id."""
    parts = []
    for i, m in enumerate(models):
        if m is None:
            continue
        for name, p in tree_flatten(m.parameters()):
            flat = p.reshape(-1)
            ends = [flat[: min(flat.size, 64)], flat[max(0, flat.size - 64):]]
            mx.eval(ends)
            parts += [f"{i}:{name}:{tuple(p.shape)}:{p.dtype}".encode(), *(bytes(memoryview(e)) for e in ends)]
    return _digest(*parts)[:12]


def config_id(config: TurboQuantConfig) -> str:
    """A fingerprint of a TurboQuantConfig (12 hex digits), from its fields."""
    return _digest(json.dumps(config.to_dict(), sort_keys=True).encode())[:12]


def tokens_id(tokens: np.ndarray) -> str:
    return _digest(np.ascontiguousarray(tokens, dtype="<i4").tobytes())[:16]


def slug(name: str) -> str:
    """A model's name as a file name part: a folder's name, or a Hugging Face repo id's owner and name, in lower
    case, [a-z0-9._-] only, at most 48 characters."""
    path = Path(str(name or "model")).expanduser()
    base = path.name if path.exists() or len(path.parts) != 2 else "-".join(path.parts)
    s = re.sub(r"[^a-z0-9._-]+", "-", base.lower()).strip("-._")[:48].strip("-._")
    return s or "model"


def _tokens(tokens: Iterable[int]) -> np.ndarray:
    return np.asarray(list(tokens) if not isinstance(tokens, np.ndarray) else tokens, dtype=np.int32).reshape(-1)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


class Entry(NamedTuple):
    """One file of this model and config, as its header says."""

    path: Path
    tokens: np.ndarray
    counts: list[LayerCounts]
    size: int
    data_start: int
    crc: int

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.size)


class Hit(NamedTuple):
    """A file to load and the tokens of it to keep (resume_point)."""

    entry: Entry
    point: int


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _store_files(folder: Path) -> list[tuple[Path, os.stat_result]]:
    """Every regular file of the store's naming pattern in `folder` (any model or config), with its stat."""
    out = []
    try:
        names = os.listdir(folder)
    except OSError:
        return out
    for name in names:
        if NAME.match(name):
            p = folder / name
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                out.append((p, st))
    return out


class PromptStore:
    """The prompt caches of one model and config in a folder (the module docstring), with a byte cap shared by
    every model and config there. max_bytes 0: off (nothing read or written). min_tokens: shorter caches are not
    written (they are quick to prefill again). background False writes in the caller's thread (tests)."""

    def __init__(self, folder: str | Path, max_bytes: int, *, model_id: str, config: TurboQuantConfig,
                 model_name: str = "", min_tokens: int = 1, background: bool = True):
        self.folder = Path(folder).expanduser()
        self.max_bytes, self.model_id, self.config = int(max_bytes), model_id, config
        self.config_id, self.model_name, self.slug = config_id(config), model_name, slug(model_name)
        self.min_tokens, self.background = max(1, int(min_tokens)), background
        self.enabled = self.max_bytes > 0
        self.counters = {"written": 0, "loaded": 0, "write_errors": 0, "load_errors": 0, "evicted": 0}
        self._entries: dict[str, Entry] = {}  # file name -> entry (this model and config)
        self._rejected: set[str] = set()  # names that did not validate: never used, said once
        self._said: set[str] = set()  # write errors already logged (one line each)
        self._lock = threading.RLock()
        self._pending: dict[str, int] = {}  # names being written -> bytes
        self._queue: queue.Queue | None = None
        self._scanned_mtime: float | None = None
        if self.enabled:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                log.warning(f"Prompt store: cannot use {self.folder}: {e.strerror or e}; caches stay in memory only")
                self.enabled = False
        if self.enabled:
            self._remove_stale_temps()
            self.refresh()

    # --- the index ----------------------------------------------------------------------------------------

    def _own(self, m: re.Match) -> bool:
        return m["model"] == self.model_id and m["config"] == self.config_id

    def refresh(self) -> None:
        """Read the headers of files of this model and config not in the index yet; forget files gone since."""
        try:
            mtime = self.folder.stat().st_mtime
        except OSError:
            return
        with self._lock:
            if mtime == self._scanned_mtime:
                return
            self._scanned_mtime = mtime
            present = set()
            for path, _ in _store_files(self.folder):
                m = NAME.match(path.name)
                if not self._own(m):
                    continue
                present.add(path.name)
                if path.name in self._entries or path.name in self._rejected:
                    continue
                try:
                    self._entries[path.name] = self._entry(path, m)
                except (OSError, ValueError) as e:
                    self._reject(path, f"{e}")
            for gone in set(self._entries) - present:
                del self._entries[gone]

    def _reject(self, path: Path, why: str) -> None:
        self._rejected.add(path.name)
        self._entries.pop(path.name, None)
        log.warning(f"Prompt store: not using {path}: {why}")

    def _entry(self, path: Path, m: re.Match) -> Entry:
        """The index entry of one file of this model and config, from its header alone; ValueError if the header
        does not validate."""
        tensors, meta, start = read_header(path)
        if meta.get("0.format") != FORMAT:
            raise ValueError(f"not a {FORMAT} file (format {meta.get('0.format')!r})")
        if meta.get("0.model_id") != m["model"] or meta.get("0.config_id") != m["config"]:
            raise ValueError(f"its header names model {meta.get('0.model_id')} and config {meta.get('0.config_id')}, "
                             f"its file name {m['model']} and {m['config']}")
        try:
            tokens = np.frombuffer(base64.b64decode(meta["0.tokens"], validate=True), dtype="<i4").astype(np.int32)
            counts = counts_from_json(json.loads(meta["0.counts"]))
            crc = int(meta["0.crc32"], 16)
            config = TurboQuantConfig.from_dict(json.loads(meta["0.config"]))
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(f"damaged metadata ({type(e).__name__}: {e})") from None
        if tokens.size != int(m["n"]) or tokens_id(tokens) != m["tokens"]:
            raise ValueError("its tokens are not the ones its name says")
        if config_id(config) != self.config_id:
            raise ValueError("its config is not the one its name says")
        return Entry(path, tokens, counts, path.stat().st_size, start, crc)

    def entries(self) -> list[Entry]:
        with self._lock:
            return list(self._entries.values())

    # --- finding and loading --------------------------------------------------------------------------------

    def lookup(self, tokens: Iterable[int], target: int | None = None) -> Hit | None:
        """The file that resumes the most of `tokens` exactly (resume_point for a prompt of `target` tokens,
        default all of them), the smallest of equals (the quickest to load); None if none resumes any."""
        if not self.enabled:
            return None
        self.refresh()
        ids = _tokens(tokens)
        target = ids.size if target is None else int(target)
        best: Hit | None = None
        for e in self.entries():
            common = common_prefix(e.tokens, ids)
            if common == 0:
                continue
            point = resume_point(e.counts, e.n_tokens, common, target)
            if point > 0 and (best is None or (point, -e.size) > (best.point, -best.entry.size)):
                best = Hit(e, point)
        return best

    def load(self, hit: Hit, model: Any) -> list | None:
        """The cache of a hit, trimmed to its point and evaluated in this thread; None (said in one line, the
        file never used again by this store) if it no longer validates: a changed or damaged file, a cache that
        does not fit the model or config."""
        from ..integration import load_prompt_cache

        e = hit.entry
        try:
            if data_crc(e.path, e.data_start) != e.crc:
                raise ValueError("its data does not match its checksum (a damaged file)")
            cache = load_prompt_cache(str(e.path), model, self.config)
            counts = cache_counts(cache)
            if counts != e.counts:
                raise ValueError("its caches do not hold the tokens its header says")
        except FileNotFoundError:
            with self._lock:  # removed since (another process evicted it)
                self._entries.pop(e.path.name, None)
            return None
        except (OSError, ValueError) as ex:
            self.counters["load_errors"] += 1
            with self._lock:
                self._reject(e.path, f"{ex}")
            return None
        trim = e.n_tokens - hit.point
        if trim:
            for c in cache:
                c.trim(trim)
        _materialize(cache)
        self._touch(e.path)
        self.counters["loaded"] += 1
        return cache

    def _touch(self, path: Path) -> None:
        try:
            os.utime(path)
        except OSError:
            pass

    # --- writing and evicting -------------------------------------------------------------------------------

    def name_for(self, tokens: np.ndarray) -> str:
        return f"{self.slug}--{self.model_id}--{self.config_id}--{tokens.size}-{tokens_id(tokens)}{SUFFIX}"

    def save(self, tokens: Iterable[int], prompt_cache: list) -> bool:
        """Write the cache of `tokens` (the tokens it holds, in order) unless it is short, already stored (its
        use is then recorded) or already being written. The arrays are snapshot and evaluated here; the file is
        written on the store's thread (background) or here. Returns whether a write was started."""
        if not self.enabled:
            return False
        ids = _tokens(tokens)
        if ids.size < self.min_tokens:
            return False
        name = self.name_for(ids)
        with self._lock:
            if name in self._pending:
                return False
            if name in self._entries:
                self._touch(self._entries[name].path)
                return False
        try:
            counts = cache_counts(prompt_cache)
            meta = {"format": FORMAT, "model": self.model_name, "model_id": self.model_id,
                    "config": json.dumps(self.config.to_dict(), sort_keys=True), "config_id": self.config_id,
                    "tokens": base64.b64encode(ids.astype("<i4").tobytes()).decode(),
                    "counts": json.dumps(counts_to_json(counts)), "created": f"{time.time():.3f}"}
            arrays, metadata = flatten_cache(prompt_cache, meta)
        except ValueError as e:
            log.warning(f"Prompt store: cannot store this cache: {e}")
            return False
        size = sum(a.nbytes for a in arrays.values())
        with self._lock:
            if sum(self._pending.values()) + size > PENDING_BYTES:
                log.debug("Prompt store: skipped a write (too many waiting)")
                return False
            self._pending[name] = size
        job = (name, ids, counts, arrays, metadata)
        if not self.background:
            self._write(*job)
            return True
        if self._queue is None:
            self._queue = queue.Queue()
            threading.Thread(target=self._writer, name="tq-prompt-store", daemon=True).start()
        self._queue.put(job)
        return True

    def _writer(self) -> None:
        while True:
            job = self._queue.get()
            try:
                self._write(*job)
            finally:
                self._queue.task_done()

    def _write(self, name: str, ids: np.ndarray, counts: list, arrays: dict, metadata: dict) -> None:
        try:
            self._write_file(name, ids, counts, arrays, metadata)
        finally:
            with self._lock:
                self._pending.pop(name, None)

    def _write_file(self, name: str, ids: np.ndarray, counts: list, arrays: dict, metadata: dict) -> None:
        path = self.folder / name
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            size = write_file(path, arrays, metadata)
        except Exception as e:  # noqa: BLE001 (OSError above all: a full disk, a read-only folder; never fatal)
            self.counters["write_errors"] += 1
            key = f"{type(e).__name__}:{getattr(e, 'errno', None)}"
            if key not in self._said:  # one line per kind of failure until a write succeeds again
                self._said.add(key)
                why = e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}"
                log.warning(f"Prompt store: cannot write to {self.folder}: {why}; this cache stays in memory only "
                            f"(the request was answered)")
            return
        self._said.clear()
        try:
            _, meta, start = read_header(path)
            entry = Entry(path, ids, counts, size, start, int(meta["0.crc32"], 16))
        except (OSError, ValueError, KeyError):
            entry = None
        with self._lock:
            if entry is not None:
                self._entries[name] = entry
            self.counters["written"] += 1
        log.info(f"Prompt store: wrote {ids.size:,} tokens ({size / 1e6:,.1f} MB) to {path.name}")
        self.evict()

    def evict(self) -> int:
        """Delete store files (any model or config), least recently used first, until they fit max_bytes;
        returns how many."""
        files = sorted(_store_files(self.folder), key=lambda f: f[1].st_mtime)
        total, n = sum(st.st_size for _, st in files), 0
        for path, st in files:
            if total <= self.max_bytes:
                break
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning(f"Prompt store: cannot delete {path} to keep under the cap: {e.strerror or e}")
                continue
            total -= st.st_size
            n += 1
            with self._lock:
                self._entries.pop(path.name, None)
        self.counters["evicted"] += n
        return n

    def _remove_stale_temps(self) -> None:
        try:
            names = os.listdir(self.folder)
        except OSError:
            return
        for name in names:
            m = TEMP.match(name)
            if m is None or not NAME.match(m["name"]):
                continue
            path = self.folder / name
            try:
                st = os.lstat(path)
                if stat.S_ISREG(st.st_mode) and (not _pid_alive(int(m["pid"]))
                                                 or time.time() - st.st_mtime > STALE_TEMP_SECONDS):
                    path.unlink()
            except OSError:
                pass

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every started write ended (at most `timeout` seconds); whether they did."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if not self._pending:
                    return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.02)

    # --- figures ----------------------------------------------------------------------------------------------

    def stats(self) -> dict:
        """The folder's figures: this model and config's files and bytes, every store file's, the cap, writes
        waiting, and the counters (written, loaded, write and load errors, evicted)."""
        files = _store_files(self.folder) if self.enabled else []
        own = [(p, st) for p, st in files if self._own(NAME.match(p.name))]
        with self._lock:
            pending = len(self._pending)
        return {"enabled": self.enabled, "folder": str(self.folder), "max_bytes": self.max_bytes,
                "files": len(own), "bytes": sum(st.st_size for _, st in own), "all_files": len(files),
                "all_bytes": sum(st.st_size for _, st in files), "pending_writes": pending, **self.counters}

    def describe(self) -> str:
        """One line for the log: where, how much, the cap."""
        from ..planner.display import format_bytes

        if not self.enabled:
            return "off"
        s = self.stats()
        others = s["all_files"] - s["files"]
        return (f"{self.folder}: {s['files']} caches of this model and config ({format_bytes(s['bytes'])})"
                + (f", {others} of other models or configs" if others else "")
                + f"; at most {format_bytes(self.max_bytes)} on disk")


def _materialize(prompt_cache: list) -> None:
    """Evaluate every array a cache holds, in this thread (a loaded cache's arrays are lazy; MLX streams belong
    to the thread that made them)."""
    arrays = []
    for c in prompt_cache:
        inner = getattr(c, "caches", None)
        if isinstance(inner, (list, tuple)):
            _materialize(list(inner))
        elif hasattr(c, "held_arrays"):
            arrays += c.held_arrays()
        else:
            arrays += [a for _, a in tree_flatten(c.state) if isinstance(a, mx.array)]
    mx.eval(arrays)
