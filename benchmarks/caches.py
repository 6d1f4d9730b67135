"""The cache settings the quality benchmarks run, and the caches they build.

A Setting names one cache: mlx-lm's KVCache (float) or QuantizedKVCache, a TurboQuantConfig spelled out in full, or
mlx-vlm's TurboQuantKVCache (a peer from PyPI, hooked into the mlx-lm model's attention the way mlx-vlm routes it).
quality.py, long_context.py, speed.py and experiments/experiments_lowbit.py build their caches here and count their
bits here.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (puts the repo on sys.path)
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx_lm.models.cache import KVCache, QuantizedKVCache, save_prompt_cache  # noqa: E402

import tq_mlx  # noqa: E402
from tq_mlx import TurboQuantConfig, TurboQuantKVCache  # noqa: E402
from tq_mlx.config import bits_label  # noqa: E402
from tq_mlx.planner.memory import estimate_kv_bytes  # noqa: E402
from tq_mlx.quant.quantizer import format_bits  # noqa: E402

LONG_CONTEXT = 32768

# Every TurboQuant setting spells out all its fields, so a change of the library's defaults does not change
# what a row measures. BASE is the reference tq()'s labels describe deviations from (quality.py's rows;
# long_context_settings.py spells its settings from its own BASE).
BASE = dict(window=128, sinks=4, center_keys=True, center_values=True, boundary_layers=0, boundary_bits=8, qjl=False,
            norm_bits=16, decay_after=None, key_error=None)  # the settings these rows measured (the defaults then;
# a row's label is its keys' width, which key_error would change per layer)


@dataclass
class Setting:
    name: str
    kind: str  # "float" | "mlx" | "tq" | "peer"
    bits: float | None = None  # mlx / peer
    config: TurboQuantConfig | None = None
    key_bits: float | None = None  # peer

    def to_dict(self) -> dict:
        d = {"name": self.name, "kind": self.kind, "bits": self.bits}
        if self.config is not None:
            d["config"] = self.config.to_dict()
        if self.key_bits is not None:
            d["key_bits"] = self.key_bits
        return d


def tq(key_bits: float, value_bits: float | None = None, **over) -> Setting:
    fields = {**BASE, **over}
    cfg = TurboQuantConfig(key_bits=key_bits, value_bits=key_bits if value_bits is None else value_bits, **fields)
    label = f"TQ {bits_label(cfg.key_bits, cfg.value_bits, cfg.qjl)}"
    extra = []
    if not cfg.center_keys and not cfg.center_values:
        extra.append("no centering")
    elif not cfg.center_keys:
        extra.append("values centered only")
    elif not cfg.center_values:
        extra.append("keys centered only")
    if cfg.window != BASE["window"] or cfg.sinks != BASE["sinks"]:
        extra.append(f"window {cfg.window}, sinks {cfg.sinks}")
    if cfg.boundary_layers:
        extra.append(f"boundary {cfg.boundary_layers}@{format_bits(cfg.boundary_bits)}")
    return Setting(label + (f" ({', '.join(extra)})" if extra else ""), "tq", config=cfg)


FLOAT = Setting("float (mlx-lm KVCache)", "float")  # the model's dtype: float32 in these CPU runs
MLX8 = Setting("mlx-lm QuantizedKVCache 8-bit", "mlx", bits=8)
MLX4 = Setting("mlx-lm QuantizedKVCache 4-bit", "mlx", bits=4)
PEER4 = Setting("peer: mlx-vlm TurboQuant 4-bit", "peer", bits=4)
PEER3 = Setting("peer: mlx-vlm TurboQuant 3-bit", "peer", bits=3)


# --- caches ------------------------------------------------------------------------------------------------


@dataclass
class Peer:
    """mlx-vlm's TurboQuantKVCache, run on an mlx-lm model (None + reason when it cannot run here)."""

    module: object | None = None
    version: str | None = None
    reason: str | None = None
    hooked: set = field(default_factory=set)


_PEER = Peer()


def peer() -> Peer:
    """The peer load_peer found (or why it cannot run); an empty Peer before load_peer."""
    return _PEER


def load_peer(enabled: bool = True) -> Peer:
    global _PEER
    if _PEER.module is not None or _PEER.reason is not None:
        return _PEER
    if not enabled:
        _PEER = Peer(reason="skipped (--no-peers)")
        return _PEER
    mod, version, reason = common.load_mlx_vlm_turboquant()
    _PEER = Peer(mod, version, reason)
    return _PEER


def _hook_peer_attention(model: nn.Module, peer: Peer) -> None:
    """Route attention of mlx-vlm caches the way mlx_vlm/models/base.py does, inside this mlx-lm model's module."""
    mod = sys.modules[type(model).__module__]
    if mod.__name__ in peer.hooked:
        return
    PeerCache = peer.module.TurboQuantKVCache

    def peer_attention(attend, queries, keys, values, cache, scale, mask, sinks):
        if isinstance(cache, PeerCache):
            if queries.shape[-2] == 1:
                return cache.decode_attention(queries, keys_state=keys, values_state=values, scale=scale, mask=mask)
            out = cache.prefill_attention(queries, keys_state=keys, values_state=values, scale=scale, mask=mask)
            if out is not None:
                return out
            k, v = cache.dequantize(keys, values)
            return mx.fast.scaled_dot_product_attention(queries, k.astype(queries.dtype), v.astype(queries.dtype), scale=scale, mask=mask)
        return attend(queries, keys, values, cache, scale, mask, sinks)

    common.wrap_attention(mod, peer_attention)  # for the rest of the process
    peer.hooked.add(mod.__name__)


def make_cache(model: nn.Module, s: Setting) -> list:
    if s.kind == "tq":
        return tq_mlx.make_prompt_cache(model, s.config)
    base = model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.layers]
    if s.kind == "float":
        return base
    if s.kind == "mlx":
        return [QuantizedKVCache(group_size=64, bits=int(s.bits)) if type(c) is KVCache else c for c in base]
    if s.kind == "peer":
        found = _PEER
        if found.module is None:
            raise RuntimeError(found.reason)
        _hook_peer_attention(model, found)
        att = [i for i, c in enumerate(base) if type(c) is KVCache]
        # mlx-vlm's own policy (models/cache.py should_quantize_kv_layer): the last attention layer stays float.
        keep = set(att[-1:]) if len(att) > 2 else set()
        return [found.module.TurboQuantKVCache(bits=s.bits, key_bits=s.key_bits) if i in att and i not in keep else c
                for i, c in enumerate(base)]
    raise ValueError(f"unknown setting kind {s.kind!r}")


def eval_cache(cache: list) -> None:
    arrays = []
    for c in cache:
        for name in ("keys", "values"):
            a = getattr(c, name, None)
            if isinstance(a, mx.array):
                arrays.append(a)
            elif isinstance(a, (tuple, list)):
                arrays.extend(x for x in a if isinstance(x, mx.array))
        if isinstance(c, TurboQuantKVCache):
            arrays.extend(c.held_arrays())
    mx.eval(arrays)


def kv_geometry(model_config: dict) -> tuple[int, int, int]:
    """(attention layers, kv heads, head_dim)."""
    from tq_mlx.models.architectures import attention_layout

    lay = attention_layout(model_config)
    return len(lay.full_layers), lay.n_kv_heads, lay.head_dim


def bits_per_value(cache: list, tokens: int, geometry: tuple[int, int, int]) -> float:
    """What a prompt cache holds at `tokens` tokens (its caches' own nbytes), in common.bits_per_value."""
    total = sum(c.nbytes for c in cache if hasattr(c, "keys") or isinstance(c, TurboQuantKVCache) or _is_peer(c))
    return common.bits_per_value(total, tokens, geometry)


def _is_peer(c) -> bool:
    return _PEER.module is not None and isinstance(c, _PEER.module.TurboQuantKVCache)


def long_bits(s: Setting, model_config: dict, geometry: tuple[int, int, int], ctx: int = LONG_CONTEXT,
              key_widths: list | None = None) -> float | None:
    """Bits/value at ctx tokens; TurboQuant's with the key widths its layers chose in the run (key_error)."""
    if s.kind == "tq":
        b = estimate_kv_bytes(model_config, ctx, s.config, key_widths=key_widths)
    elif s.kind == "mlx":
        b = estimate_kv_bytes(model_config, ctx, kv_bits=int(s.bits))
    elif s.kind == "float":
        b = estimate_kv_bytes(model_config, ctx)
    else:
        return None
    return common.bits_per_value(b, ctx, geometry)


# --- passes that outlive a session ------------------------------------------------------------------------------

CHECKPOINT_SECONDS = 600


def digest(x) -> str:
    """A stable name for what a file on disk was computed from (tokens, a setting's fields)."""
    return hashlib.sha256(json.dumps(x, sort_keys=True).encode()).hexdigest()


def pass_code(s: Setting) -> str | None:
    """The library code a pass of setting s runs, which its checkpoint records (Checkpoint's `code`): None for
    mlx-lm's own caches (float, mlx), which run no tq_mlx code, so that their checkpoints (and the float log-probs
    on disk) hold across library changes; common.library_fingerprint() for every other."""
    # sources, not commit + dirty: a docs/benchmarks commit keeps an hours-long pass; a shared tree is always dirty
    return None if s.kind in ("float", "mlx") else common.library_fingerprint()


def saved_metadata(path: Path) -> dict[str, str]:
    """A checkpoint's metadata (save_prompt_cache's `metadata`) from its safetensors header, its arrays not read."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return {k[2:]: v for k, v in header.get("__metadata__", {}).items() if k.startswith("0.")}


class Checkpoint:
    """A long pass's cache on disk: saved with the pass's offset and figures so far at most every
    CHECKPOINT_SECONDS, so that the same command resumes the pass after a stop (a 32k pass on Qwen2.5-Coder-1.5B
    outlives a working session here), and removed when the pass is done. Name it by what the pass reads (tokens,
    setting). With `code` (pass_code: the fingerprint of the library code the pass runs) the checkpoint records it,
    and one made by other library code (or before checkpoints recorded it) is not resumed: the pass starts afresh,
    so that no pass mixes library versions."""

    def __init__(self, path: Path, code: str | None = None):
        self.path, self.code = path, code
        self.started = self.saved_at = time.perf_counter()
        self.seconds_before = 0.0  # what the pass ran before its last stop

    def seconds(self) -> float:
        """The pass's time so far, over every session it ran in."""
        return self.seconds_before + time.perf_counter() - self.started

    def resume(self, cache: list) -> tuple[int, dict]:
        """(offset, figures so far) of the saved pass, its cache put in `cache`; (0, {}) when none is saved."""
        if not self.path.exists():
            return 0, {}
        if self.code is not None and (made := saved_metadata(self.path).get("library")) != self.code:
            print(f"    not resuming {self.path}: made by "
                  + (f"other library code ({made[:12]}, this is {self.code[:12]})" if made else
                     "library code it does not record") + "; starting afresh", flush=True)
            return 0, {}
        saved, meta = tq_mlx.load_prompt_cache(str(self.path), return_metadata=True)
        cache[:] = saved
        self.seconds_before = float(meta.get("seconds", 0.0))
        print(f"    resumed at {meta['offset']} tokens from {self.path}", flush=True)
        return int(meta["offset"]), json.loads(meta.get("out", "{}"))

    def save(self, cache: list, offset: int, out: dict | None = None) -> None:
        if time.perf_counter() - self.saved_at <= CHECKPOINT_SECONDS:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name.replace(".partial.", ".partial-tmp."))
        save_prompt_cache(str(tmp), cache, metadata={"offset": str(offset), "out": json.dumps(out or {}),
                                                  "seconds": str(self.seconds()),
                                                  **({"library": self.code} if self.code is not None else {})})
        tmp.rename(self.path)  # whole or absent: a session that stops mid-write leaves the previous checkpoint
        self.saved_at = time.perf_counter()

    def done(self) -> None:
        self.path.unlink(missing_ok=True)
