"""The attention hook: the one entry mlx-lm's attention reaches for what a TurboQuant cache fetched, and its install.

mlx-lm's attention layers call `scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks)`,
imported by name from mlx_lm.models.base into each model file; for caches that have `bits`, as ours do, base's
version sends keys and values to `quantized_scaled_dot_product_attention`. install_attention_hook points both at
this module's stand-ins (base's quantized entry, and the by-name import of every loaded mlx_lm.models module),
which send what a TurboQuant cache fetched to `fetched_attention` and anything else to mlx-lm's own functions:

  StreamView          (one cache's views on the codes; MLA's latent is one view as keys and values)
                      -> tq_mlx.kernels.dispatch_attention: a kernel on Metal, else the reference
                      (tq_mlx.attention.turboquant_attention)
  BatchView           (a batch cache's rows) -> row by row, each row as above (tq_mlx.batch.batch_view_attention)
  float arrays        (a float fetch, decoded from the codes) -> mx.fast.scaled_dot_product_attention

Importing tq_mlx changes nothing in mlx-lm: tq_mlx.integration's make_prompt_cache, patch_model and
load_prompt_cache install the hook, and so does a cache's first update_and_fetch (a cache built by hand).
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
import mlx_lm.models.base as mlx_base
import mlx_lm.models.cache as mlx_cache

from .batch import BatchTurboQuantKVCache, BatchView, batch_view_attention, causal_if_plain
from .kernels import dispatch_attention
from .view import StreamView

_VIEWS = (BatchView, StreamView)


def fetched_attention(queries: mx.array, keys, values, scale: float, mask=None, sinks: mx.array | None = None):
    """softmax(scale·q·Kᵀ + mask)·V over what a TurboQuant cache fetched (see the module docstring): views on the
    codes through the kernels or the reference, batch views row by row, float fetches with mx.fast's SDPA.
    sinks: learned per-head sink logits, as mx.fast.scaled_dot_product_attention's."""
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
    return _ORIGINAL_SDPA(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)


def quantized_scaled_dot_product_attention(queries, keys, values, scale, mask, group_size: int = 64,
                                           bits: int = 8):
    """Stands in for mlx_lm.models.base.quantized_scaled_dot_product_attention, which base's attention calls for
    caches that have `bits`. mlx-lm's own quantized keys are tuples of arrays; views and float arrays are ours."""
    if isinstance(keys, (*_VIEWS, mx.array)):
        return fetched_attention(queries, keys, values, scale, mask)
    return _ORIGINAL_QUANTIZED(queries, keys, values, scale=scale, mask=mask, group_size=group_size, bits=bits)


_ORIGINAL_SDPA = mlx_base.scaled_dot_product_attention
_ORIGINAL_QUANTIZED = mlx_base.quantized_scaled_dot_product_attention  # what install_attention_hook replaced
_SDPA_MODULES: dict[str, Any] = {}  # model modules whose scaled_dot_product_attention is ours
_MODULES_SEEN = 0  # len(sys.modules) at the last scan
_REGISTERED: dict[str, type] = {}  # cache classes registered by name in mlx_lm.models.cache


def _hook_model_modules() -> None:
    """Point every loaded mlx_lm.models module's by-name `scaled_dot_product_attention` at ours. Model files
    import it by name (mlx-lm-integration.md §2), so base's attribute alone reaches none of them; a model's
    module is loaded before its caches are built or first updated, which call this."""
    global _MODULES_SEEN
    if len(sys.modules) == _MODULES_SEEN:  # called for every cache: scan only when modules were loaded
        return
    _MODULES_SEEN = len(sys.modules)
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and name not in _SDPA_MODULES and module is not None:
            if getattr(module, "scaled_dot_product_attention", None) is _ORIGINAL_SDPA:
                module.scaled_dot_product_attention = scaled_dot_product_attention
                _SDPA_MODULES[name] = module


def install_attention_hook(*cache_classes: type) -> None:
    """Route mlx-lm's attention entries to fetched_attention for what TurboQuant caches fetch (anything else
    still reaches mlx-lm's own functions), and register BatchTurboQuantKVCache and `cache_classes` by name in
    mlx_lm.models.cache, where mlx-lm's load_prompt_cache looks a file's classes up (tq_mlx.cache and
    tq_mlx.integration pass TurboQuantKVCache, which sits above this module). Idempotent; each call also hooks
    the model modules loaded since the last."""
    global _ORIGINAL_QUANTIZED
    current = mlx_base.quantized_scaled_dot_product_attention
    if current is not quantized_scaled_dot_product_attention:
        _ORIGINAL_QUANTIZED = current
        mlx_base.quantized_scaled_dot_product_attention = quantized_scaled_dot_product_attention
    _hook_model_modules()
    for cls in (BatchTurboQuantKVCache, *cache_classes):
        setattr(mlx_cache, cls.__name__, cls)
        _REGISTERED[cls.__name__] = cls


def uninstall_attention_hook() -> None:
    """Leave mlx-lm exactly as it was before install_attention_hook."""
    global _MODULES_SEEN
    if mlx_base.quantized_scaled_dot_product_attention is quantized_scaled_dot_product_attention:
        mlx_base.quantized_scaled_dot_product_attention = _ORIGINAL_QUANTIZED
    for module in _SDPA_MODULES.values():
        if getattr(module, "scaled_dot_product_attention", None) is scaled_dot_product_attention:
            module.scaled_dot_product_attention = _ORIGINAL_SDPA
    _SDPA_MODULES.clear()
    _MODULES_SEEN = 0
    for name, cls in _REGISTERED.items():
        if getattr(mlx_cache, name, None) is cls:
            delattr(mlx_cache, name)
    _REGISTERED.clear()


def hook_installed() -> bool:
    """Whether mlx-lm's attention reaches fetched_attention (base's quantized entry or a model module's)."""
    return mlx_base.quantized_scaled_dot_product_attention is quantized_scaled_dot_product_attention or \
        bool(_SDPA_MODULES)
