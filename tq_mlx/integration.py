"""Plugging TurboQuantKVCache into mlx-lm 0.32.2 (shared/docs/mlx-lm-integration.md), model by model.

* `make_prompt_cache(model, config)` replaces only the plain `KVCache` entries of the model's own cache
  list, those nested in a `CacheList` included: GatedDeltaNet `ArraysCache`, sliding-window `RotatingKVCache`
  and everything else stay as they are (`float_layers` lists them). A model with no such entry, or one whose
  attention cannot run on compressed keys, is refused with a ValueError naming the layer and the way out.
* `patch_model(model, config)` wraps `model.make_cache` on the instance, which every mlx-lm entry point
  (generate, stream_generate, chat, server, cache_prompt) calls through `make_prompt_cache`. Batched
  generation (batch_generate, BatchGenerator, the server's batching) builds one cache list per sequence that
  way and merges them (TurboQuantKVCache.merge -> tq_mlx.batch.BatchTurboQuantKVCache; the float layers of
  hybrid models use mlx-lm's own batch caches), so it needs no hook of its own.
* `load_prompt_cache(file, model)` reads a prompt-cache file with clear errors and checks it fits the model.
* `tune_malloc()` (Linux, CPU back end): keeps the per-step transient buffers of the reference path in the
  heap; the command-line tools and benchmarks call it.

Importing tq_mlx changes nothing in mlx-lm: make_prompt_cache, patch_model and load_prompt_cache install the
attention hook (tq_mlx.hook, where every name tq_mlx replaces in mlx-lm is installed and uninstalled), patch_model
also the make_prompt_cache that passes --max-kv-size on, and a cache built by hand installs the hook at its first
update.
"""

from __future__ import annotations

import ctypes
import dataclasses
import sys
from typing import Any, Callable

import mlx.core as mx

import mlx.nn as nn
import mlx_lm.models.cache as mlx_cache
from mlx_lm.models.cache import CacheList, KVCache

from .models.architectures import FLOAT_FETCH, fetch_for
from .blas import warn_reference_blas
from .cache import TurboQuantKVCache
from .config import TurboQuantConfig, check_max_size
from .hook import install, install_attention_hook
from .models.architectures import AttentionLayout, attention_layout
from .models.rope import Rope, probe

WAY_OUT = "use mlx-lm's own cache for this model (drop the TurboQuant options)"


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
MALLOC_THRESHOLD = 32 << 20  # glibc's largest mmap threshold


def tune_malloc(threshold: int = MALLOC_THRESHOLD) -> bool:
    """On Linux with glibc and MLX's CPU back end, serve allocations below `threshold` bytes from the heap and
    keep up to `threshold` bytes of freed heap mapped. Returns whether the setting took.

    Why: MLX's CPU allocator is plain malloc, and glibc gives each buffer over 128 KB its own mmap, so a decode
    step that dequantizes a 4 MB block pays ~1000 page faults for it, every layer and token (measured: the
    attention step at 4k tokens went from ~20-45 ms, erratic, to ~8 ms). Process-wide, like any allocator
    setting; freed memory up to `threshold` stays in the process. No-op elsewhere (Metal caches its buffers).
    """
    if not sys.platform.startswith("linux") or mx.default_device() != mx.cpu:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, int(threshold))
    return bool(ok and libc.mallopt(_M_TRIM_THRESHOLD, int(threshold)))


def _model_types(model: nn.Module) -> set[str]:
    types = set()
    for obj in (model, getattr(model, "args", None), getattr(model, "language_model", None)):
        t = getattr(obj, "model_type", None)
        if isinstance(t, str):
            types.add(t)
    text = getattr(getattr(model, "args", None), "text_config", None)
    if isinstance(text, dict) and isinstance(text.get("model_type"), str):
        types.add(text["model_type"])
    return types


def _base_cache(model: nn.Module) -> list[Any]:
    """The cache list mlx-lm would build for this model (ignoring any patch_model wrapper)."""
    make = getattr(model, "_tq_make_cache", None) or getattr(model, "make_cache", None)
    if make is not None:
        return make()
    return [KVCache() for _ in model.layers]


def _attention_module(model: nn.Module, i: int):
    try:
        layer = model.layers[i]
    except (AttributeError, IndexError, TypeError):
        return None
    for name in ("self_attn", "attention", "attn"):
        attn = getattr(layer, name, None)
        if attn is not None:
            return attn
    return None


ROPE_NAMES = ("rope", "rotary_emb", "rotary", "rotary_embedding")  # what mlx-lm's model files call the module


def layer_rope(model: nn.Module, i: int) -> Rope | None:
    """The RoPE of layer i's keys, read off its rope module (tq_mlx.models.rope.probe), or None: the attention's own
    (`rope`, `rotary_emb`, ...), else the one module of the layer with such a name. Layers that apply RoPE as a
    function of a frequency array (nanochat), or not at all, give None: their keys keep the mean."""
    head_dim = layer_geometry(model, i)[0]
    try:
        layer = model.layers[i]
    except (AttributeError, IndexError, TypeError):
        return None
    attn = _attention_module(model, i)
    found = [getattr(m, n, None) for m in (attn, getattr(attn, "attention", None)) if m is not None for n in ROPE_NAMES]
    found = [f for f in found if isinstance(f, nn.Module)]
    if not found and isinstance(layer, nn.Module):
        found = [m for name, m in layer.named_modules() if name.rsplit(".", 1)[-1] in ROPE_NAMES]
        found = found if len(found) == 1 else []
    return probe(found[0], head_dim) if found and head_dim else None


def layer_geometry(model: nn.Module, i: int) -> tuple[int | None, int | None]:
    """(head_dim, n_kv_heads) of model layer i's attention: the module's own attributes, else what the planner
    reads from the model's config (architectures.attention_layout, one reading of a config for both); None where
    neither says."""

    def first_int(obj, names):
        return next((v for v in (getattr(obj, n, None) for n in names) if isinstance(v, int)), None)

    attn = _attention_module(model, i)
    head_dim = first_int(attn, ("head_dim",))
    n_kv = first_int(attn, ("n_kv_heads", "num_key_value_heads", "num_kv_heads"))
    if head_dim is None or n_kv is None:
        layout = _config_layout(model)
        if layout is not None:
            head_dim = head_dim or layout.head_dim or None
            n_kv = n_kv or layout.n_kv_heads or None
    return head_dim, n_kv


def _config_layout(model: nn.Module) -> AttentionLayout | None:
    """attention_layout of the model's ModelArgs (the config.json it was built from), None if it has none."""
    args = getattr(model, "args", None)
    try:
        cfg = dataclasses.asdict(args) if dataclasses.is_dataclass(args) else dict(vars(args))
        return attention_layout(cfg)
    except (TypeError, ValueError):
        return None


def pipeline_stage(model: nn.Module) -> tuple[int, int | None]:
    """(model index of model.layers[0], layers in the whole model or None) for a stage of mlx-lm's pipeline
    parallelism (PipelineMixin.pipeline keeps layers start_idx.. of the model); (0, None) otherwise."""
    for inner in (getattr(model, "model", None), getattr(getattr(model, "language_model", None), "model", None)):
        if getattr(inner, "pipeline_size", 1) > 1 and isinstance(getattr(inner, "start_idx", None), int):
            total = getattr(getattr(inner, "args", None) or getattr(model, "args", None), "num_hidden_layers", None)
            return inner.start_idx, total if isinstance(total, int) else None
    return 0, None


def model_fetch(model: nn.Module) -> str:
    """What this model's caches fetch (tq_mlx.models.architectures): "codes", "latent" or "float"."""
    return fetch_for(_model_types(model))


def fetch_reason(model: nn.Module) -> str | None:
    """Why this model's caches fetch float tensors (None when they do not)."""
    return next((FLOAT_FETCH[t] for t in sorted(_model_types(model)) if t in FLOAT_FETCH), None)


def _cache_head_dim(model: nn.Module, i: int, fetch: str, member: int | None = None) -> int | None:
    """head_dim to build layer i's streams with now, or None to build them at the first update: latent layers
    (a latent and a rope key of different widths), attention modules whose keys and values differ in width
    (deepseek_v2's 192 / 128) and CacheList members (an indexer's cache beside the attention's) learn theirs
    from the first tokens."""
    if fetch == "latent" or member is not None:
        return None
    attn = _attention_module(model, i)
    head_dim, _ = layer_geometry(model, i)
    if not isinstance(head_dim, int):
        return None
    if any(isinstance(getattr(attn, n, None), int) for n in ("q_head_dim", "qk_nope_head_dim", "kv_lora_rank")):
        return None  # MLA attention (deepseek_v2 style: keys of qk_nope + qk_rope dims)
    layout = _config_layout(model)
    v_dims = [getattr(attn, n, None) for n in ("v_head_dim", "value_head_dim", "v_dim")]
    v_dims += [layout.v_head_dim] if layout is not None and layout.head_dim == head_dim else []
    if any(isinstance(d, int) and d and d != head_dim for d in v_dims):
        return None
    return head_dim


def k_eq_v_keys(model: nn.Module, i: int) -> Callable[[mx.array], mx.array] | None:
    """For a layer whose values are its keys (Gemma 4's attention_k_eq_v), the keys as a function of the values
    held: the model computes keys = rope(k_norm(x)) and values = v_norm(x) from one projection x, and k_norm is
    v_norm times its weight (gemma4_text.py:252-266), so keys = rope(weight · values) at positions 0, 1, ...
    None for every other layer."""
    attn = _attention_module(model, i)
    if not getattr(attn, "use_k_eq_v", False) or getattr(attn, "k_norm", None) is None:
        return None

    def keys(values: mx.array) -> mx.array:
        return attn.rope(values * attn.k_norm.weight.astype(values.dtype), offset=0)

    return keys


def _layer_derive_keys(model: nn.Module, i: int, member: int | None, max_kv_size: int | None):
    """derive_keys for the cache of layer i (CacheList member `member`): K=V layers hold one stream unless bounded
    (the positions of a bounded cache's held tokens have gaps, which the derivation's rope cannot see)."""
    return k_eq_v_keys(model, i) if member is None and max_kv_size is None else None


def _kv_slots(base: list[Any]) -> list[tuple[int, int | None]]:
    """(layer, member) of every plain KVCache: member is None at the top level, else the index in a CacheList."""
    slots = []
    for i, c in enumerate(base):
        if type(c) is KVCache:
            slots.append((i, None))
        elif type(c) is CacheList:
            slots += [(i, j) for j, m in enumerate(c.caches) if type(m) is KVCache]
    return slots


_WHY_FLOAT = {"RotatingKVCache": "sliding window", "ArraysCache": "recurrent state", "MambaCache": "recurrent state",
              "ConcatenateKVCache": "not a KVCache"}


def _kind(c: Any) -> str:
    if type(c) is CacheList:
        return f"CacheList({', '.join(_kind(m) for m in c.caches)})"
    name = type(c).__name__
    return f"{name} ({_WHY_FLOAT[name]})" if name in _WHY_FLOAT else name


def _describe(base: list[Any]) -> str:
    groups: dict[str, list[int]] = {}
    for i, c in enumerate(base):
        groups.setdefault(_kind(c), []).append(i)
    return "; ".join(f"layer{'s' if len(ix) > 1 else ''} {', '.join(map(str, ix))}: {k}" for k, ix in groups.items())


def float_layers(model: nn.Module) -> dict[int, str]:
    """Layers whose cache TurboQuant leaves as mlx-lm builds it, with the cache kind (e.g. sliding window)."""
    base = _base_cache(model)
    compressed = {i for i, _ in _kv_slots(base)}
    return {i: _kind(c) for i, c in enumerate(base) if i not in compressed}


def make_prompt_cache(model: nn.Module, config: TurboQuantConfig | None = None,
                      max_kv_size: int | None = None) -> list[Any]:
    """The model's prompt cache with every full-attention KVCache replaced by a TurboQuantKVCache, those
    nested in a mlx-lm CacheList included.

    What the caches hand back to the model (views for attention on the codes, the latent of multi-head latent
    attention, or float tensors decoded from the codes for models that post-process them) comes from
    tq_mlx.models.architectures; the storage is compressed in every case.

    Raises ValueError naming the layer, the reason and the way out, before building anything, if a layer
    cannot be compressed (head_dim too small or incompatible with fractional bits), if no layer holds a
    full-attention KVCache (nothing would be compressed), or if max_kv_size is below what the float sinks and
    window hold (tq_mlx.config.check_max_size). max_kv_size bounds every compressed layer as mlx-lm's
    --max-kv-size bounds its RotatingKVCache (the oldest compressed tokens are dropped; TurboQuantKVCache).
    Installs the attention hook (tq_mlx.hook).
    """
    warn_reference_blas()  # once per process: on Linux's reference BLAS everything runs ~20x slower
    config = config or TurboQuantConfig()
    if max_kv_size is not None:
        check_max_size(max_kv_size, config)
    base = _base_cache(model)
    slots = _kv_slots(base)
    if not slots:
        types = ", ".join(repr(t) for t in sorted(_model_types(model))) or "this model"
        raise ValueError(
            f"{types}: no layer holds a full-attention KVCache for TurboQuant to compress ({_describe(base)}); "
            f"{WAY_OUT}"
        )
    fetch = model_fetch(model)
    # A pipeline stage numbers its layers from the stage's first: seeds follow the whole model's numbering, and
    # so do the boundary layers when every layer is an attention layer (else they are counted within the stage),
    # so that the stages compress as one process would.
    start, total = pipeline_stage(model)
    whole = total is not None and len(slots) == len(base) and all(m is None for _, m in slots)
    caches = {}
    for j, (i, member) in enumerate(slots):
        try:
            caches[i, member] = TurboQuantKVCache(
                config, layer_index=start + i, attention_index=start + j if whole else j,
                n_attention_layers=total if whole else len(slots), head_dim=_cache_head_dim(model, i, fetch, member),
                fetch=fetch, max_size=max_kv_size, derive_keys=_layer_derive_keys(model, i, member, max_kv_size),
                # one KV cache in the layer: the attention's keys (a second is an indexer's or another stream)
                rope=layer_rope(model, i) if config.center_keys == "rope" and sum(s[0] == i for s in slots) == 1
                else None,
            )
        except ValueError as e:
            raise ValueError(f"{e}; change key_bits/value_bits, or {WAY_OUT}") from None
    out = []
    for i, c in enumerate(base):
        if type(c) is CacheList and any((i, m) in caches for m in range(len(c.caches))):
            c = CacheList(*(caches.get((i, m), x) for m, x in enumerate(c.caches)))
        out.append(caches.get((i, None), c))
    install_attention_hook(TurboQuantKVCache)
    return out


def patch_model(model: nn.Module, config: TurboQuantConfig | None = None) -> nn.Module:
    """From now on mlx-lm builds TurboQuant caches for this model (generate, stream_generate, chat, server).

    Validates the model at once (raises like make_prompt_cache). Calling it again changes the config. A later
    mlx-lm make_prompt_cache(model, max_kv_size=N) (--max-kv-size) builds bounded TurboQuant caches: it installs
    tq_mlx.hook's "make_prompt_cache" part, which passes the bound to model.make_cache(max_kv_size=N) (a
    make_prompt_cache imported by name before this call, outside mlx-lm, is mlx-lm's own, which drops it).
    """
    config = config or TurboQuantConfig()
    make_prompt_cache(model, config)  # validate now (raises before touching the model), not at the first request
    if getattr(model, "_tq_make_cache", None) is None:
        original = getattr(model, "make_cache", None)
        model._tq_make_cache = original if original is not None else (lambda: [KVCache() for _ in model.layers])

    def make_cache(max_kv_size: int | None = None) -> list[Any]:
        return make_prompt_cache(model, config, max_kv_size=max_kv_size)

    # mlx-lm's make_prompt_cache(model, max_kv_size) calls model.make_cache() without the bound (cache.py:31-32);
    # tq_mlx.hook's stand-in for it (the "make_prompt_cache" part) passes the bound to a make_cache that takes it.
    make_cache.takes_max_kv_size = True
    model.make_cache = make_cache
    model._tq_config = config
    install("make_prompt_cache")
    return model


def unpatch_model(model: nn.Module) -> nn.Module:
    """Undo patch_model: the model builds mlx-lm's own caches again."""
    original = getattr(model, "_tq_make_cache", None)
    if original is not None:
        vars(model).pop("make_cache", None)  # the instance attribute patch_model set; the class's stays
        del vars(model)["_tq_make_cache"]
        vars(model).pop("_tq_config", None)
    return model


def _validate_entry(model: nn.Module, i: int, c: Any, b: Any, config: TurboQuantConfig | None,
                    member: int | None = None) -> None:
    if isinstance(c, TurboQuantKVCache):
        if type(b) is not KVCache:
            raise ValueError(f"layer {i}: prompt cache holds a TurboQuantKVCache, the model uses {type(b).__name__}")
        if c.layer_index != pipeline_stage(model)[0] + i:
            raise ValueError(f"layer {i}: prompt cache entry was built for layer {c.layer_index}")
        _, n_kv = layer_geometry(model, i)
        k_eq_v = _layer_derive_keys(model, i, member, c.max_size) is not None
        if c.k_eq_v != k_eq_v:
            raise ValueError(f"layer {i}: prompt cache {'holds' if c.k_eq_v else 'has no'} a K=V layer, the model "
                             f"{'has' if k_eq_v else 'has none'} there")
        fetch = "float" if k_eq_v else model_fetch(model)
        if c.fetch != fetch:
            raise ValueError(f"layer {i}: prompt cache fetches {c.fetch!r}, this model needs {fetch!r}")
        head_dim = _cache_head_dim(model, i, c.fetch, member)
        n_kv = n_kv if head_dim is not None else None
        if c.key_dim and head_dim is not None and c.key_dim != head_dim:
            raise ValueError(f"layer {i}: prompt cache has head_dim {c.key_dim}, the model has head_dim {head_dim}")
        bh = c.batch_heads()
        if bh is not None and n_kv is not None and bh[1] != n_kv:
            raise ValueError(f"layer {i}: prompt cache has {bh[1]} kv heads, the model has {n_kv}")
        if config is not None and c.config != config:
            raise ValueError(f"layer {i}: prompt cache was built with {c.config}, expected {config}")
    elif type(c) is CacheList and type(b) is CacheList:
        if len(c.caches) != len(b.caches):
            raise ValueError(f"layer {i}: prompt cache holds {len(c.caches)} caches, the model uses {len(b.caches)}")
        for j, (m, n) in enumerate(zip(c.caches, b.caches)):
            _validate_entry(model, i, m, n, config, j)
    elif type(c) is not type(b) and not (type(b) is KVCache and type(c).__name__ == "QuantizedKVCache"):
        raise ValueError(f"layer {i}: prompt cache holds a {type(c).__name__}, the model uses {type(b).__name__}")


def validate_prompt_cache(model: nn.Module, cache: list[Any], config: TurboQuantConfig | None = None) -> None:
    """Raise ValueError, naming the layer, unless `cache` fits `model` (and was built with `config`, if given)."""
    base = _base_cache(model)
    if len(cache) != len(base):
        raise ValueError(f"prompt cache has {len(cache)} layers, the model has {len(base)}")
    for i, (c, b) in enumerate(zip(cache, base)):
        _validate_entry(model, i, c, b, config)


def load_prompt_cache(file_name: str, model: nn.Module | None = None, config: TurboQuantConfig | None = None,
                      return_metadata: bool = False):
    """mlx_lm's load_prompt_cache, with clear errors: a corrupted file or one that does not fit `model`
    raises ValueError naming the file (and the layer), and nothing is modified."""
    warn_reference_blas()
    install_attention_hook(TurboQuantKVCache)  # registers the cache classes, which mlx-lm's loader looks up by name
    try:
        cache, metadata = mlx_cache.load_prompt_cache(file_name, return_metadata=True)
    except ValueError as e:
        raise ValueError(f"{file_name}: {e}") from None
    except (KeyError, RuntimeError, OSError, TypeError, IndexError) as e:
        raise ValueError(f"{file_name}: not a readable prompt cache ({type(e).__name__}: {e})") from None
    if model is not None:
        try:
            validate_prompt_cache(model, cache, config)
        except ValueError as e:
            raise ValueError(f"{file_name}: {e}") from None
        for i, c in enumerate(cache):
            if isinstance(c, TurboQuantKVCache) and c.k_eq_v:
                c.derive_keys = k_eq_v_keys(model, i)
    return (cache, metadata) if return_metadata else cache

