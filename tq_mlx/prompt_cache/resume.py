"""Where a held prompt cache can resume a longer prompt exactly: the longest prefix that, trimmed to and fed the rest
of the prompt, holds what a fresh prefill of that prompt would hold, part for part.

mlx-lm's prompt cache (LRUPromptCache) and tq_mlx.prompt_cache.store reuse a cache made for other tokens: one that
shares a prefix with a new prompt is trimmed back to the common prefix and fed the rest. For a float KVCache any
trim point gives what a fresh prefill would hold. A TurboQuantKVCache is not that simple (tq_mlx.stream):

* its window overflows in whole compress blocks counted from the sinks, so a cache trimmed into its codes, then
  fed, compresses other tokens than a fresh prefill (more of them, in blocks that start elsewhere);
* decayed tokens stay decayed after a trim, so a cache that decayed more tokens than a fresh prefill of the new
  prompt would cannot be trimmed to anything the fresh prefill holds but below its decayed codes;
* its calibration (mean, scale, query weights, key widths) comes from the first window's tokens after the sinks
  (config.first_window) and their queries: kept through a trim only while codes remain, and only right if the new prompt shares those
  tokens; a stream still summing queries (or choosing its values' bits) forgets what a trim cuts.

`resume_point` finds the longest prefix that avoids all three, from the token counts alone (`cache_counts`, which a
file's header keeps too): the common prefix itself where the trim leaves the codes as a fresh prefill would have
them, else the last compress-block boundary below it where it does; then the window is fed again. A point that
cannot be exact is never offered: the caller prefills from scratch instead. What it guarantees is the structure
(which tokens are float, coded, decayed, and with which calibration); the numbers of a re-fed token can still
differ from a fresh prefill's in the last bits, as mlx-lm's float cache's do, since prefill chunks start
elsewhere.
"""

from __future__ import annotations

from typing import Any, Iterable, NamedTuple, Sequence

from ..cache import TurboQuantKVCache
from ..layout import decayed_split, overflow


class StreamCounts(NamedTuple):
    """One stream's tokens, part by part, and the rules that move them (tq_mlx.stream)."""

    sinks: int
    decayed: int
    fresh: int
    window: int
    max_sinks: int
    max_window: int
    calibration: int  # tokens after the sinks the first compression waits for (at least max_window)
    block: int  # compress_block
    age: int | None  # decay_after where the stream decays (None: it does not)
    learns: bool  # still learning from its queries (calibration not fixed yet): a trim loses what it learned


class LayerCounts(NamedTuple):
    """One layer's cache: whether it trims, its bound, and its TurboQuant streams (none for other caches)."""

    trimmable: bool
    max_size: int | None = None
    streams: tuple[StreamCounts, ...] = ()


def _stream_counts(s) -> StreamCounts:
    choosing = s.value_sums is not None and s.value_width is None
    learns = choosing or (s.n_coded == 0 and bool(s.weigh))
    return StreamCounts(s.n_sinks, s.n_decayed, s.n_fresh, s.n_window, s.max_sinks, s.max_window, s.calibration,
                        s.compress_block,
                        s.decay.age if s.decaying else None, learns)


def _flat(prompt_cache: Iterable[Any]) -> list[Any]:
    out = []
    for c in prompt_cache:
        inner = getattr(c, "caches", None)  # mlx-lm's CacheList
        out += _flat(inner) if isinstance(inner, (list, tuple)) else [c]
    return out


def cache_counts(prompt_cache: Iterable[Any]) -> list[LayerCounts]:
    """The counts of every layer of a prompt cache (CacheList members in order)."""
    out = []
    for c in _flat(prompt_cache):
        if isinstance(c, TurboQuantKVCache):
            out.append(LayerCounts(c.is_trimmable(), c.max_size, tuple(_stream_counts(s) for s in c.streams)))
        else:
            out.append(LayerCounts(bool(c.is_trimmable())))
    return out


def counts_to_json(layers: Sequence[LayerCounts]) -> list:
    """The counts as plain JSON lists (a prompt-store file's header)."""
    return [[int(lay.trimmable), lay.max_size, [list(s) for s in lay.streams]] for lay in layers]


def counts_from_json(data: Any) -> list[LayerCounts]:
    """counts_to_json's lists back; ValueError for anything else."""
    try:
        layers = []
        for trimmable, max_size, streams in data:
            parsed = []
            for s in streams:
                if len(s) != len(StreamCounts._fields):
                    raise ValueError(f"a stream has {len(s)} counts")
                *ints, age, learns = s
                if not all(isinstance(i, int) and i >= 0 for i in ints) or not (age is None or isinstance(age, int)):
                    raise ValueError(f"bad stream counts {s!r}")
                parsed.append(StreamCounts(*ints, age, bool(learns)))
            if max_size is not None and not isinstance(max_size, int):
                raise ValueError(f"bad max_size {max_size!r}")
            layers.append(LayerCounts(bool(trimmable), max_size, tuple(parsed)))
        return layers
    except (TypeError, ValueError) as e:
        raise ValueError(f"layer counts: {e}") from None


def _trimmed(s: StreamCounts, n: int) -> StreamCounts:
    """The counts after a trim of n tokens: window first, then fresh codes, decayed codes, sinks (stream.trim)."""
    parts = {}
    for part in ("window", "fresh", "decayed", "sinks"):
        d = min(getattr(s, part), n)
        parts[part] = getattr(s, part) - d
        n -= d
    return s._replace(**parts)


def _fed(s: StreamCounts, n: int) -> tuple[int, int, int, int]:
    """(sinks, decayed, fresh, window) after n more tokens, however they are fed (tq_mlx.layout's rules)."""
    sinks, decayed, fresh, window = s.sinks, s.decayed, s.fresh, s.window
    t = min(s.max_sinks - sinks, n)
    sinks, n = sinks + t, n - t
    if n:
        recent = window + n
        c = overflow(recent, s.max_window, s.block, 0 if decayed + fresh else s.calibration)
        fresh, window = fresh + c, recent - c
        d = decayed_split(fresh, window, s.age, s.block)
        decayed, fresh = decayed + d, fresh - d
    return sinks, decayed, fresh, window


def _exact(lay: LayerCounts, held: int, point: int, common: int, target: int) -> bool:
    """Whether this layer, trimmed to `point` tokens and fed up to `target`, holds what a fresh prefill would."""
    if point >= held:
        return True  # nothing trimmed: the cache continues as if the prompt had been fed in one go
    if not lay.trimmable or (lay.max_size is not None and target > lay.max_size):
        return False  # a trim cannot be undone by a bound's drops
    for s in lay.streams:
        if s.learns:
            return False
        kept = _trimmed(s, held - point)
        if kept.decayed + kept.fresh and common < s.max_sinks + s.calibration:
            return False  # the calibration came from tokens the new prompt does not share
        empty = s._replace(sinks=0, decayed=0, fresh=0, window=0)
        if _fed(kept, target - point) != _fed(empty, target):
            return False
    return True


def resume_point(layers: Sequence[LayerCounts], held: int, common: int, target: int) -> int:
    """The most tokens of a cache holding `held` tokens (counts `layers`) to keep for a prompt of `target` tokens
    whose first `common` tokens it shares, such that trimming to them and feeding the rest of the prompt holds
    what a fresh prefill of the prompt would (the module docstring); 0: none (prefill from scratch). At least one
    token is always left to feed, and a point within the sinks is no hit."""
    first = min(common, target - 1, held)
    if first <= 0:
        return 0
    streams = [s for lay in layers for s in lay.streams]
    floor = max((s.max_sinks for s in streams), default=0)
    points = {first}
    for s in streams:  # compress-block boundaries below the common prefix: the window empty, the codes whole
        points.update(range(s.max_sinks + s.block, first, s.block))
    for point in sorted(points, reverse=True):
        if point <= floor:
            break
        if all(_exact(lay, held, point, common, target) for lay in layers):
            return point
    return 0


def resume(prompt_cache: Iterable[Any], held: int, common: int, target: int) -> int:
    """resume_point of a prompt cache itself."""
    return resume_point(cache_counts(prompt_cache), held, common, target)
