"""mlx-lm patched in one place: every name tq_mlx replaces in mlx-lm, in one table with one install and one
uninstall, and the attention entry mlx-lm's attention reaches for what a TurboQuant cache fetched.

The attention entry. mlx-lm's attention layers call `scaled_dot_product_attention(queries, keys, values, cache,
scale, mask, sinks)`, imported by name from mlx_lm.models.base into each model file; for caches that have `bits`, as
ours do, base's version sends keys and values to `quantized_scaled_dot_product_attention`. The "attention" part
points both at this module's stand-ins, which send what a TurboQuant cache fetched to `fetched_attention` and
anything else to mlx-lm's own functions:

  StreamView          (one cache's views on the codes; MLA's latent is one view as keys and values)
                      -> tq_mlx.attention.dispatch_attention: a kernel on Metal, else the reference
                      (tq_mlx.attention.reference.turboquant_attention)
  BatchView           (a batch cache's rows) -> row by row, each row as above (tq_mlx.batch.batch_view_attention)
  float arrays        (a float fetch, decoded from the codes) -> mx.fast.scaled_dot_product_attention

The patch. Every assignment tq_mlx makes into an mlx-lm module is `install`'s: the table (`replaced()`) holds each
name's owner, name and original, and `uninstall` puts every original back (and deletes the names that were new),
in the loaded mlx-lm modules that imported a replaced name by name meanwhile too. The parts:

  "attention"          base's quantized_scaled_dot_product_attention and the by-name scaled_dot_product_attention
                       of every loaded mlx_lm.models module -> the stand-ins; BatchTurboQuantKVCache and the given
                       cache classes registered by name in mlx_lm.models.cache, where load_prompt_cache looks a
                       file's classes up
  "make_prompt_cache"  mlx_lm.models.cache.make_prompt_cache and its by-name imports in loaded mlx_lm modules
                       (generate, server, chat, cache_prompt, evaluate) -> make_prompt_cache here: mlx-lm's drops
                       max_kv_size for a model with make_cache (cache.py:31-32), this one passes it to a make_cache
                       that takes it (`takes_max_kv_size`: tq_mlx.integration.patch_model's)
  "load_model", "tq-generate", "tq-server"
                       the names tq-generate and tq-server give (mlx_lm.utils.load_model; mlx_lm.generate's parser,
                       generate, load and load_prompt_cache; mlx_lm.server's ModelProvider, ResponseGenerator,
                       _run_http_server, scan_cache_dir, argparse and LRUPromptCache), each installed while the
                       command runs (`installed`)

Importing tq_mlx changes nothing in mlx-lm. tq_mlx.integration's make_prompt_cache and load_prompt_cache install
"attention", patch_model "attention" and "make_prompt_cache", and a cache's first update_and_fetch "attention" (a
cache built by hand); installing a part again also covers the mlx-lm modules loaded since.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Any, Iterator, Mapping, NamedTuple

import mlx.core as mx
import mlx_lm.models.base as mlx_base
import mlx_lm.models.cache as mlx_cache

from .batch import BatchTurboQuantKVCache, BatchView, batch_view_attention, causal_if_plain, learned
from .attention import dispatch_attention
from .stream.view import StreamView

_VIEWS = (BatchView, StreamView)
PARTS = ("attention", "make_prompt_cache", "load_model", "tq-generate", "tq-server")
MISSING = object()  # the original of a name that did not exist (uninstall deletes it)


class Replaced(NamedTuple):
    """One name tq_mlx replaced in mlx-lm: owner.name was `original` (MISSING: no such name), is `value`."""

    owner: Any
    name: str
    original: Any
    value: Any
    part: str


_TABLE: dict[tuple[int, str], Replaced] = {}  # (id(owner), name) -> what install replaced there
_SCANNED: dict[str, int] = {}  # part -> len(sys.modules) at its last scan of by-name imports


# --- the attention entry ---------------------------------------------------------------------------------------


def fetched_attention(queries: mx.array, keys, values, scale: float, mask=None, sinks: mx.array | None = None):
    """softmax(scale·q·Kᵀ + mask)·V over what a TurboQuant cache fetched (see the module docstring): views on the
    codes through the kernels or the reference, batch views row by row, float fetches with mx.fast's SDPA.
    sinks: learned per-head sink logits, as mx.fast.scaled_dot_product_attention's. The caches learn from the
    queries first (tq_mlx.batch.learned), in one step before the attention that reads their views."""
    keys, values = learned(queries, keys, values, scale)
    if isinstance(keys, BatchView):
        return batch_view_attention(queries, keys, values, scale, causal_if_plain(mask), sinks,
                                    attend=dispatch_attention)
    if isinstance(keys, StreamView):
        return dispatch_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)


def scaled_dot_product_attention(queries, keys, values, cache, scale: float, mask, sinks=None):
    """Stands in for mlx_lm.models.base.scaled_dot_product_attention in the model files that import it by name.
    It sees what the quantized entry cannot: learned sinks (which base's version refuses for caches with `bits`),
    and views attended without their cache (Gemma 4's KV-shared layers pass cache=None). Views are ours, and so
    are float arrays from a cache with `bits` (mlx-lm's own quantized caches fetch tuples)."""
    if isinstance(keys, _VIEWS) or (isinstance(keys, mx.array) and hasattr(cache, "bits")):
        return fetched_attention(queries, keys, values, scale, mask, sinks)
    mlx_sdpa = original(mlx_base, "scaled_dot_product_attention")
    return mlx_sdpa(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)


def quantized_scaled_dot_product_attention(queries, keys, values, scale, mask, group_size: int = 64,
                                           bits: int = 8):
    """Stands in for mlx_lm.models.base.quantized_scaled_dot_product_attention, which base's attention calls for
    caches that have `bits`. mlx-lm's own quantized keys are tuples of arrays; views and float arrays are ours."""
    if isinstance(keys, (*_VIEWS, mx.array)):
        return fetched_attention(queries, keys, values, scale, mask)
    mlx_quantized = original(mlx_base, "quantized_scaled_dot_product_attention")
    return mlx_quantized(queries, keys, values, scale=scale, mask=mask, group_size=group_size, bits=bits)


def make_prompt_cache(model, max_kv_size: int | None = None) -> list[Any]:
    """Stands in for mlx_lm.models.cache.make_prompt_cache: a model whose make_cache takes the bound (it has
    `takes_max_kv_size`, as tq_mlx.integration.patch_model's does) gets max_kv_size, which mlx-lm's version drops
    for any model with a make_cache (cache.py:31-32); every other call is mlx-lm's."""
    make = getattr(model, "make_cache", None)
    if max_kv_size is not None and getattr(make, "takes_max_kv_size", False):
        return make(max_kv_size=max_kv_size)
    return original(mlx_cache, "make_prompt_cache")(model, max_kv_size)


# --- the patch: one table, one install, one uninstall ---------------------------------------------------------


def replaced() -> list[Replaced]:
    """The table: every name tq_mlx holds replaced in mlx-lm now, in the order it was installed."""
    return list(_TABLE.values())


def original(owner: Any, name: str) -> Any:
    """What owner.name was before tq_mlx replaced it (MISSING if there was no such name); its value now if tq_mlx
    has not replaced it."""
    entry = _TABLE.get((id(owner), name))
    return entry.original if entry is not None else getattr(owner, name)


def _replace(part: str, owner: Any, name: str, value: Any) -> None:
    """owner.name = value, recorded in the table. Again (idempotent): the first original is kept, and a name that
    someone replaced since (a wrapper of ours, say) is left to them."""
    here = vars(owner).get(name, MISSING)
    entry = _TABLE.get((id(owner), name))
    if entry is not None:
        if entry.part != part:
            raise ValueError(f"{owner.__name__}.{name} is already replaced by tq_mlx's {entry.part!r} part")
        if here is not entry.value or value is entry.value:
            return
    setattr(owner, name, value)
    _TABLE[id(owner), name] = Replaced(owner, name, here if entry is None else entry.original, value, part)


def _owner(dotted: str) -> tuple[Any, str]:
    module, _, name = dotted.rpartition(".")
    if module != "mlx_lm" and not module.startswith("mlx_lm."):
        raise ValueError(f"{dotted}: tq_mlx.hook replaces names in mlx-lm's modules only")
    return importlib.import_module(module), name


def _mlx_lm_modules(prefix: str = "mlx_lm") -> Iterator[tuple[str, Any]]:
    for name, module in list(sys.modules.items()):
        if (name == prefix or name.startswith(prefix + ".")) and module is not None:
            yield name, module


def _by_name(part: str, prefix: str, owner: Any, name: str, stand_in: Any) -> None:
    """Point every loaded module under `prefix` whose `name` is owner's original (an import by name, owner's own
    included) at stand_in. Scans only when modules were loaded since the part's last scan."""
    if _SCANNED.get(part) == len(sys.modules):
        return
    _SCANNED[part] = len(sys.modules)
    target = original(owner, name)
    for _, module in _mlx_lm_modules(prefix):
        if getattr(module, "__dict__", {}).get(name) is target:
            _replace(part, module, name, stand_in)


def install(part: str, names: Mapping[str, Any] | None = None) -> None:
    """Install one part of the patch (PARTS, the module docstring): `names` maps dotted mlx-lm names
    ("mlx_lm.utils.load_model") to what they become, and "attention" and "make_prompt_cache" add their stand-ins.
    Idempotent; installing again also covers the mlx-lm modules loaded since."""
    if part not in PARTS:
        raise ValueError(f"no part {part!r} in tq_mlx.hook: one of {', '.join(PARTS)}")
    if part == "attention":
        _replace(part, mlx_base, "quantized_scaled_dot_product_attention", quantized_scaled_dot_product_attention)
        _by_name(part, "mlx_lm.models", mlx_base, "scaled_dot_product_attention", scaled_dot_product_attention)
        names = {f"mlx_lm.models.cache.{BatchTurboQuantKVCache.__name__}": BatchTurboQuantKVCache, **(names or {})}
    elif part == "make_prompt_cache":
        _by_name(part, "mlx_lm", mlx_cache, "make_prompt_cache", make_prompt_cache)
    for dotted, value in (names or {}).items():
        _replace(part, *_owner(dotted), value)


def uninstall(*parts: str) -> None:
    """Put back every name install replaced (of `parts`, or of every part): the original object, or no name where
    there was none; a name that holds something else than tq_mlx's value (someone replaced it since) is left to
    them. A loaded mlx-lm module that imported a replaced name by name after its install holds tq_mlx's value
    too: it gets the original back as well."""
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"no part {sorted(unknown)[0]!r} in tq_mlx.hook: one of {', '.join(PARTS)}")
    undone: dict[int, Replaced] = {}
    for key in reversed([k for k, e in _TABLE.items() if not parts or e.part in parts]):
        e = _TABLE.pop(key)
        if vars(e.owner).get(e.name, MISSING) is e.value:
            if e.original is MISSING:
                delattr(e.owner, e.name)
            else:
                setattr(e.owner, e.name, e.original)
        if e.original is not MISSING:
            undone[id(e.value)] = e
    for _, module in _mlx_lm_modules():
        for name, value in list(getattr(module, "__dict__", {}).items()):
            e = undone.get(id(value))
            if e is not None and e.value is value:
                setattr(module, name, e.original)
    for part in parts or PARTS:
        _SCANNED.pop(part, None)


@contextlib.contextmanager
def installed(part: str, names: Mapping[str, Any] | None = None) -> Iterator[None]:
    """install(part, names) while the block runs, then uninstall(part)."""
    install(part, names)
    try:
        yield
    finally:
        uninstall(part)


def install_attention_hook(*cache_classes: type) -> None:
    """install("attention") with `cache_classes` registered by name in mlx_lm.models.cache (tq_mlx.cache and
    tq_mlx.integration pass TurboQuantKVCache, which sits above this module)."""
    install("attention", {f"mlx_lm.models.cache.{cls.__name__}": cls for cls in cache_classes})


def uninstall_attention_hook() -> None:
    """Leave mlx-lm exactly as it was before tq_mlx patched it: uninstall() (every part)."""
    uninstall()


def hook_installed() -> bool:
    """Whether mlx-lm's attention reaches fetched_attention (base's quantized entry or a model module's)."""
    return any(e.part == "attention" and e.name.endswith("scaled_dot_product_attention") for e in _TABLE.values())
