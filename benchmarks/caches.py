"""The cache settings the quality benchmarks run, and the caches they build.

A Setting names one cache: mlx-lm's KVCache (float) or QuantizedKVCache, a TurboQuantConfig spelled out in full, or
a peer from PyPI: mlx-vlm's TurboQuantKVCache (hooked into the mlx-lm model's attention the way mlx-vlm routes it) or
turboquant-mlx-full's (its update_and_fetch gives float16 keys and values to mlx-lm's own attention: no hook).
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
from tq_mlx.cache import held_bytes as tq_held_bytes  # noqa: E402
from tq_mlx.config import bits_label  # noqa: E402
from tq_mlx.planner.memory import estimate_kv_bytes  # noqa: E402
from tq_mlx.quant.quantizer import format_bits  # noqa: E402

LONG_CONTEXT = 32768

# Every TurboQuant setting spells out all its fields, so a change of the library's defaults does not change
# what a row measures. BASE is the reference tq()'s labels describe deviations from (quality.py's rows;
# long_context_settings.py spells its settings from its own BASE).
BASE = dict(window=128, sinks=4, center_keys=True, center_values=True, boundary_layers=0, boundary_bits=8, qjl=False,
            norm_bits=16, decay_after=None, key_error=None, calibration_tokens=None, correct_norms=False)  # the settings these rows measured (the defaults then;
# a row's label is its keys' width, which key_error would change per layer)


@dataclass
class Setting:
    name: str
    kind: str  # "float" | "mlx" | "tq" | "peer"
    bits: float | None = None  # mlx / peer (the values' bits, and the keys' without key_bits)
    config: TurboQuantConfig | None = None
    key_bits: float | None = None  # peer
    peer: str | None = None  # kind "peer": which (MLX_VLM when None, TQ_FULL)
    fp16_tokens: int | None = None  # TQ_FULL: its first tokens kept in float16 (min_tokens_before_quant)

    def to_dict(self) -> dict:
        d = {"name": self.name, "kind": self.kind, "bits": self.bits}
        if self.config is not None:
            d["config"] = self.config.to_dict()
        if self.key_bits is not None:
            d["key_bits"] = self.key_bits
        if self.peer is not None:
            d["peer"] = self.peer
        if self.fp16_tokens:
            d["fp16_tokens"] = self.fp16_tokens
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

MLX_VLM, TQ_FULL = "mlx-vlm", "turboquant-mlx-full"  # the peers, by distribution
TQ_FULL_GROUP = 64  # turboquant-mlx-full's group_size (its default and its CLIs'): one float16 scale per group


def tq_full(key_bits: int, value_bits: int, fp16_tokens: int = 0) -> Setting:
    """turboquant-mlx-full's TurboQuantKVCache(k_bits, v_bits, min_tokens_before_quant=fp16_tokens) (its recommended
    default: K8/V3 with no float16 tokens, as its CLIs' --kv-min-tokens 0)."""
    for b in (key_bits, value_bits):
        if b not in range(1, 9):
            raise ValueError(f"turboquant-mlx-full codes 1 to 8 bits, not {b}")
    name = f"peer: {TQ_FULL} K{key_bits}/V{value_bits}"
    name += f" (first {fp16_tokens} tokens float16)" if fp16_tokens else ""
    return Setting(name, "peer", bits=value_bits, key_bits=key_bits, peer=TQ_FULL, fp16_tokens=fp16_tokens or None)


TQFULL8V3 = tq_full(8, 3)


# --- caches ------------------------------------------------------------------------------------------------


@dataclass
class Peer:
    """A peer's TurboQuantKVCache module, run on an mlx-lm model (None + reason when it cannot run here): mlx-vlm's
    mlx_vlm.turboquant or turboquant-mlx-full's turboquant_mlx.layers.polar_kv_cache."""

    module: object | None = None
    version: str | None = None
    reason: str | None = None
    hooked: set = field(default_factory=set)


_PEERS: dict[str, Peer] = {}
_LOADERS = {MLX_VLM: common.load_mlx_vlm_turboquant, TQ_FULL: common.load_turboquant_mlx_full}


def peer(name: str = MLX_VLM) -> Peer:
    """The peer load_peer found (or why it cannot run); an empty Peer before load_peer."""
    return _PEERS.get(name, Peer())


def peer_of(s: Setting) -> Peer:
    """The peer a "peer" setting runs."""
    return peer(s.peer or MLX_VLM)


def load_peer(enabled: bool = True, name: str = MLX_VLM) -> Peer:
    """Load peer `name` once per process (enabled False: skipped, with that reason)."""
    found = _PEERS.get(name)
    if found is not None and (found.module is not None or found.reason is not None):
        return found
    found = _PEERS[name] = Peer(reason="skipped (--no-peers)") if not enabled else Peer(*_LOADERS[name]())
    return found


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
    if s.kind == "peer" and s.peer == TQ_FULL:
        found = peer(TQ_FULL)
        if found.module is None:
            raise RuntimeError(found.reason)
        # Its own policy (convert_cache_to_turboquant, what its CLIs build): every plain KVCache layer, the last
        # too. No hook: update_and_fetch returns the whole cache dequantized to float16 for mlx-lm's own attention
        # (its fused decode kernel is opt-in, enable_fused_attend, and Metal only).
        return [found.module.TurboQuantKVCache(k_bits=int(s.key_bits), v_bits=int(s.bits), group_size=TQ_FULL_GROUP,
                                               min_tokens_before_quant=s.fp16_tokens or 0)
                if type(c) is KVCache else c for c in base]
    if s.kind == "peer":
        found = peer(MLX_VLM)
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
        elif _is_tq_full(c):
            arrays.extend(tq_full_arrays(c))
    mx.eval(arrays)


def kv_geometry(model_config: dict) -> tuple[int, int, int]:
    """(attention layers, kv heads, head_dim)."""
    from tq_mlx.models.architectures import attention_layout

    lay = attention_layout(model_config)
    return len(lay.full_layers), lay.n_kv_heads, lay.head_dim


def held_bytes(cache: list) -> int:
    """Bytes a prompt cache's attention caches hold: their own nbytes (tq_mlx.cache.held_bytes: the constants our
    layers share once); turboquant-mlx-full's, every array it holds,
    each once (tq_full_arrays: its nbytes counts its codes up to the offset, not its buffers, nor the float16 tier's
    whole buffer, nor its constants)."""
    total = tq_held_bytes([c for c in cache if not _is_tq_full(c)
                           and (hasattr(c, "keys") or isinstance(c, TurboQuantKVCache) or _is_peer(c))])
    return total + sum(a.nbytes for a in _unique([a for c in cache if _is_tq_full(c) for a in tq_full_arrays(c)]))


def bits_per_value(cache: list, tokens: int, geometry: tuple[int, int, int]) -> float:
    """What a prompt cache holds at `tokens` tokens (held_bytes), in common.bits_per_value."""
    return common.bits_per_value(held_bytes(cache), tokens, geometry)


def _is_peer(c) -> bool:
    return any(p.module is not None and isinstance(c, p.module.TurboQuantKVCache) for p in _PEERS.values())


def _is_tq_full(c) -> bool:
    p = _PEERS.get(TQ_FULL)
    return p is not None and p.module is not None and isinstance(c, p.module.TurboQuantKVCache)


def _unique(arrays: list) -> list:
    return list({id(a): a for a in arrays}.values())


def tq_full_arrays(c) -> list:
    """Every array a turboquant-mlx-full TurboQuantKVCache holds, each once: its attributes that are arrays or
    tuples of them. That is its codes (uint32, 32 // bits codes a word) and float16 group scales for keys and values
    in buffers of whole 256-token steps, its float16 tier (min_tokens_before_quant tokens, the whole buffer from the
    first token), the rotations' float16 signs and its codebooks (float32 ones shared by every cache of a width)."""
    out = []
    for v in vars(c).values():
        for a in v if isinstance(v, (tuple, list)) else (v,):
            if isinstance(a, mx.array):
                out.append(a)
    return _unique(out)


def tq_full_bytes(s: Setting, ctx: int, geometry: tuple[int, int, int]) -> int:
    """What turboquant-mlx-full's caches hold at ctx tokens (every attention layer, as tq_full_arrays counts them),
    its buffers counted without their padding to 256 tokens: per token and kv head, its codes (whole uint32 words
    of 32 // bits codes) and one float16 scale per TQ_FULL_GROUP values, for keys and values; its float16 tier's
    buffer of fp16_tokens tokens; per layer the float16 rotation signs and codebooks; once per width the float32
    codebook and boundaries. Float parts are float16 whatever the model's dtype, so a Mac holds the same."""
    n_att, H, D = geometry
    kb, vb, first = int(s.key_bits), int(s.bits), s.fp16_tokens or 0
    gs = min(TQ_FULL_GROUP, D)
    while D % gs:
        gs //= 2
    words = -(-D // (32 // kb)) + -(-D // (32 // vb))
    coded = H * max(0, ctx - first) * (4 * words + 2 * 2 * (D // gs))
    fp16 = 2 * H * first * D * 2 if first and ctx else 0
    constants = 2 * D * 2 + (2**kb + 2**vb) * 2
    shared = sum((2 * 2**b - 1) * 4 for b in {kb, vb})
    return n_att * (coded + fp16 + constants) + shared


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
