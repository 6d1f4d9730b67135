"""Converting mlx-lm's float prompt cache (mlx_lm cache_prompt's file) into TurboQuant caches."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from .cache import TurboQuantKVCache
from .config import TurboQuantConfig
from .integration import make_prompt_cache


def converted_config(config: TurboQuantConfig) -> TurboQuantConfig:
    """The config a converted cache has: `config` with keys not weighed and at their configured bits, and values
    following decay_value_bits, since a float cache holds no queries to weigh the keys by or to measure either
    side's error on (key_error, key_output_error, value_error, value_output_error), so the cache, its description and
    the planner agree on what it holds."""
    config = dataclasses.replace(config, weigh_keys=False, key_error=None, key_output_error=None,
                                 value_output_error=None)
    if config.value_error is None:
        return config
    decays = config.decay_key_bits is not None  # values keep their bits (decay_value_bits: value_error's least)
    return dataclasses.replace(config, value_error=None, decay_value_bits=None,
                               decay_after=config.decay_after if decays else None)


def compress_float_cache(model, cache: list, config: TurboQuantConfig, file_name: str,
                         chunk: int = 2048) -> tuple[list, int]:
    """A prompt cache of mlx-lm's float KVCaches (mlx_lm cache_prompt's file) as TurboQuant caches of
    converted_config(config): each float layer's keys and values are fed, chunk by chunk as a prefill feeds them,
    into the TurboQuantKVCache built for that layer; the other layers are kept. Returns (cache, layers compressed). Raises ValueError
    for a layer tq-generate cannot compress (mlx-lm's affine QuantizedKVCache, or a layout the model does not have)."""
    fresh = make_prompt_cache(model, converted_config(config))
    if len(fresh) != len(cache):
        raise ValueError(f"{file_name}: holds {len(cache)} layer caches, the model has {len(fresh)}")
    out, n = [], 0
    for i, (new, old) in enumerate(zip(fresh, cache)):
        if isinstance(new, TurboQuantKVCache) and type(old) is KVCache:
            if old.offset:
                keys, values = old.keys[..., : old.offset, :], old.values[..., : old.offset, :]
                for at in range(0, old.offset, chunk):
                    new.update_and_fetch(keys[..., at : at + chunk, :], values[..., at : at + chunk, :])
                    mx.eval(new.held_arrays())
            out.append(new)
            n += 1
        elif type(new) is type(old) or isinstance(old, TurboQuantKVCache):
            out.append(old)
        else:
            raise ValueError(
                f"{file_name}: layer {i} holds {type(old).__name__}, which tq-generate cannot turn into "
                f"{type(new).__name__} (a --kv-bits cache cannot be recompressed): run it with mlx_lm.generate, or "
                f"make the file again without --kv-bits"
            )
    return out, n
