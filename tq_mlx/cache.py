"""TurboQuantKVCache: mlx-lm's KV cache protocol with TurboQuant codes instead of floats.

Token order in one layer's cache, and the order of the mask's columns:

    [0, n_sinks)                          attention sinks: the first `sinks` tokens, float16
    [n_sinks, n_sinks + n_compressed)     TurboQuant codes (packed uint32) and float16 norms
    [n_sinks + n_compressed, offset)      the recent-token window, float16

New tokens go to the sinks until those are full, then to the window. When the window would overflow, its
oldest tokens are compressed in whole blocks of `block` tokens (so the window keeps between
window - block + 1 and window tokens). Compressed tokens exist only as codes: no float copy of them is kept
anywhere, and `nbytes` is the sum of every array the cache holds.

Keys (and values, if config.center_values) are centered before quantization (turboquant.md §4): μ (keys)
and ν (values) per (batch, kv head) are the means of the first tokens ever compressed, fixed afterwards.
Fractional bit widths (2.5, 3.5) quantize the d/4 channels of largest mean |x - μ| in those same tokens at one
more bit (paper §4.3); the cache stores that channel order per kv head as `perm` and feeds x[..., perm] to
the quantizer, whose outlier group is its first d/4 channels.

update_and_fetch returns two `CompressedKV` handles that carry everything attention needs; mlx-lm routes them
to `quantized_scaled_dot_product_attention` because the cache has `bits` (tq_mlx.integration hooks that).

Memory (batch B, H kv heads, head dims Dk/Dv; W words and G norms per token from the quantizer, capacity C a
multiple of `step`; the window and sink buffers exist once first used):

    nbytes = B·H·C·(4·W_k + 2·G_k  [+ 4·⌈Dk/32⌉ + 2 with QJL]  + 4·W_v + 2·G_v)    codes and float16 norms
           + 2·B·H·(window + sinks)·(Dk + Dv)                                    float16 window and sinks
           + 4·B·H·D per centered side + 4·H·D per fractional-bit side           μ/ν, channel orders
           + the quantizers' constants (rotation signs or matrices, codebooks, QJL projection)
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from .codebook import MIN_DIM
from .quantizer import MSE_BITS, PROD_BITS, MSECodes, ProdCodes, TurboQuantMSE, TurboQuantProd, split_dims

STATE_VERSION = 1
# The cache's arrays besides the codes buffers, by attribute name (also their names in `state`).
_FLOAT_AND_CENTERING = ("k_sinks", "v_sinks", "k_window", "v_window", "k_mean", "v_mean", "k_perm", "v_perm")


def _normalize_bits(name: str, bits: Any) -> float | int:
    if isinstance(bits, bool) or not isinstance(bits, (int, float)) or bits not in MSE_BITS:
        raise ValueError(f"{name} must be one of {MSE_BITS}, got {bits!r}")
    return int(bits) if bits == int(bits) else float(bits)


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


@dataclass(frozen=True)
class TurboQuantConfig:
    """How a model's KV cache is compressed. Every field is validated; errors name the allowed values.

    The defaults were chosen by measurement; the numbers are in benchmarks/DEFAULTS.md. In short (perplexity on
    the Britannica text, float cache = 0%): keys at 4 bits keep top-1 attention agreement at 0.98-0.99 on
    SmolLM2-135M and Qwen2.5-Coder-1.5B, while 3-bit keys cost +4.5% on SmolLM2; values at 3 bits cost +0.8
    points over V4 on SmolLM2 and nothing on Qwen, for 4.3x less memory than float16 at head_dim 128 instead of
    3.8x; QJL loses at equal bits (+6.9% vs +1.3% at K4); key centering rescues Qwen (PPL 629 -> 12.16 at 4/4),
    value centering helps with the window (SmolLM2 K4/V3 +2.1% vs +3.0%, K3/V3 +4.5% vs +7.3%; neutral on
    Qwen); the float16 window of 128 and 4 sinks are worth +13 points at 3/3 (+17.9% -> +4.5%); boundary layers
    buy less than spending the same bits on keys. μ, ν (and the outlier channels of 2.5/3.5 bits) are
    calibrated on the first `block_size` tokens after the sinks, however the prompt is fed.
    """

    key_bits: float = 4  # 1, 2, 2.5, 3, 3.5, 4 or 8
    value_bits: float = 3
    qjl: bool = False  # keys only: TurboQuant_prod (key_bits-1 MSE bits + 1 QJL bit); integer key_bits 1..4
    window: int = 128  # recent tokens kept in float16 (0: compress every token at once)
    block: int | None = None  # tokens compressed at a time when the window overflows; None = window
    sinks: int = 4  # first tokens of the sequence kept in float16
    boundary_layers: int = 0  # the first and last N attention layers use boundary_bits for keys and values
    boundary_bits: float = 8
    center_keys: bool = True  # subtract a per-(batch, kv head) key mean μ before quantizing (exact)
    center_values: bool = True  # same for values with ν (exact too)
    seed: int = 0
    step: int = 256  # compressed storage grows in steps of this many tokens, like KVCache

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        set_("key_bits", _normalize_bits("key_bits", self.key_bits))
        set_("value_bits", _normalize_bits("value_bits", self.value_bits))
        set_("boundary_bits", _normalize_bits("boundary_bits", self.boundary_bits))
        for name in ("qjl", "center_keys", "center_values"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.qjl and self.key_bits not in PROD_BITS:
            raise ValueError(f"qjl=True needs integer key_bits in {PROD_BITS}, got key_bits={self.key_bits}")
        _check_int("window", self.window, 0)
        _check_int("sinks", self.sinks, 0)
        _check_int("boundary_layers", self.boundary_layers, 0)
        _check_int("seed", self.seed, 0)
        _check_int("step", self.step, 1)
        if self.block is not None:
            _check_int("block", self.block, 1)
            if self.window and self.block > self.window:
                raise ValueError(f"block must be between 1 and window={self.window}, got {self.block}")

    @classmethod
    def from_bits(cls, bits: float, **kwargs) -> "TurboQuantConfig":
        """The same bit width for keys and values, other fields as given."""
        return cls(key_bits=bits, value_bits=bits, **kwargs)

    @property
    def block_size(self) -> int:
        """Tokens compressed at a time when the window overflows."""
        return self.block if self.block is not None else max(self.window, 1)

    def layer_bits(self, attention_index: int, n_attention_layers: int) -> tuple[float, float]:
        """(key_bits, value_bits) of the attention layer `attention_index` (0-based among attention layers)."""
        n = self.boundary_layers
        if n and (attention_index < n or attention_index >= n_attention_layers - n):
            return max(self.key_bits, self.boundary_bits), max(self.value_bits, self.boundary_bits)
        return self.key_bits, self.value_bits

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TurboQuantConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown TurboQuantConfig fields {sorted(unknown)}; allowed: {sorted(names)}")
        return cls(**d)


class CompressedKV(NamedTuple):
    """One side (keys or values) of a layer's cache as update_and_fetch returns it: everything attention needs.

    Arrays are views of the cache's buffers cut to the live tokens; None means that part holds no tokens.
    Token order is sinks, compressed, window (see the module docstring).
    """

    quantizer: TurboQuantMSE | TurboQuantProd
    codes: MSECodes | ProdCodes | None  # (B, H, n_compressed, ...) in the quantizer's input basis
    sinks: mx.array | None  # (B, H, n_sinks, D) float16, model basis
    window: mx.array | None  # (B, H, n_window, D) float16, model basis
    mean: mx.array | None  # (B, H, D) float32: subtracted from every compressed token before quantizing
    perm: mx.array | None  # (H, D) int32: compressed token t was quantized as (x_t - mean)[..., perm]

    @property
    def n_sinks(self) -> int:
        return 0 if self.sinks is None else self.sinks.shape[2]

    @property
    def n_compressed(self) -> int:
        return 0 if self.codes is None else self.codes.codes.shape[2]

    @property
    def n_window(self) -> int:
        return 0 if self.window is None else self.window.shape[2]

    @property
    def n_tokens(self) -> int:
        return self.n_sinks + self.n_compressed + self.n_window

    @property
    def n_heads(self) -> int:
        parts = (self.sinks, self.window, None if self.codes is None else self.codes.codes)
        return next(a.shape[1] for a in parts if a is not None)

    @property
    def head_dim(self) -> int:
        return self.quantizer.dim


def layer_seed(seed: int, layer_index: int, side: int) -> int:
    """The rotation/projection seed of one side (0 keys, 1 values) of one layer. Groups of a fractional-bit
    quantizer use seed and seed + 1, so seeds are spaced by 8."""
    return (seed * 100_003 + layer_index) * 16 + 8 * side


def _arrays_of(obj, seen=None):
    """Every mx.array reachable from a quantizer (rotations, codebooks, channel lists, projections)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, mx.array):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _arrays_of(x, seen)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("tq_mlx"):
        for x in vars(obj).values():
            yield from _arrays_of(x, seen)


WINDOW_STEP = 32  # the float16 window grows in steps of this many tokens up to `window`


def window_capacity(recent: int, window: int) -> int:
    """Tokens the float16 window buffer holds once `recent` tokens have arrived after the sinks: steps of
    WINDOW_STEP while they fit in the window, the whole window from the first compression on. A function of
    the token count alone, so a short chat holds only what it uses and tq_mlx.memory stays exact."""
    if window == 0 or recent <= 0:
        return 0
    if recent > window:
        return window
    return min(window, -(-recent // WINDOW_STEP) * WINDOW_STEP)


def _grow(buf, n_keep: int, n_new: int, step: int, template):
    """Buffers (a NamedTuple of arrays, token axis 2) holding n_keep + n_new tokens, capacity a multiple of step."""
    need = n_keep + n_new
    if buf is not None and need <= buf[0].shape[2]:
        return buf
    capacity = -(-need // step) * step
    if buf is None:
        return type(template)(*(mx.zeros((*t.shape[:2], capacity, *t.shape[3:]), t.dtype) for t in template))
    fresh = [mx.zeros((*b.shape[:2], capacity - n_keep, *b.shape[3:]), b.dtype) for b in buf]
    return type(template)(*(mx.concatenate([b[:, :, :n_keep], f], axis=2) for b, f in zip(buf, fresh)))


class TurboQuantKVCache(_BaseCache):
    """One attention layer's KV cache, compressed with TurboQuant. Implements mlx-lm's cache protocol.

    layer_index is the model layer (used for seeds and error messages); attention_index and
    n_attention_layers place it among the attention layers for config.boundary_layers.
    """

    def __init__(
        self,
        config: TurboQuantConfig | None = None,
        layer_index: int = 0,
        attention_index: int | None = None,
        n_attention_layers: int | None = None,
        head_dim: int | None = None,
    ):
        from .integration import install

        install()  # attention on the handles needs the hook; idempotent
        self.config = config or TurboQuantConfig()
        self.layer_index = int(layer_index)
        self.attention_index = self.layer_index if attention_index is None else int(attention_index)
        self.n_attention_layers = n_attention_layers
        if n_attention_layers is None:
            self.key_bits, self.value_bits = self.config.key_bits, self.config.value_bits
        else:
            self.key_bits, self.value_bits = self.config.layer_bits(self.attention_index, n_attention_layers)
        # QJL needs TurboQuantProd's integer bits; a boundary layer at 8 bits uses plain MSE codes.
        self.qjl = self.config.qjl and self.key_bits in PROD_BITS
        self.expected_head_dim = head_dim
        self.offset = 0
        self.n_sinks = self.n_compressed = self.n_window = 0
        self.key_dim = self.value_dim = 0  # head dims: from head_dim if given, else from the first update
        self.k_codes = self.v_codes = None  # MSECodes/ProdCodes buffers (B, H, capacity, ...)
        self.k_sinks = self.v_sinks = None  # (B, H, sinks, D) float16
        self.k_window = self.v_window = None  # (B, H, window, D) float16
        self.k_mean = self.v_mean = None  # (B, H, D) float32
        self.k_perm = self.v_perm = None  # (H, D) int32
        self.calibrated = False
        self.k_quantizer = self.v_quantizer = None
        if head_dim is not None:
            # Build the quantizers now, so the first update does no setup work (some rotations read an
            # array back to the host when built).
            self.check_dims(head_dim, head_dim)
            self.key_dim = self.value_dim = int(head_dim)
            self._make_quantizers()

    # mlx-lm's base.scaled_dot_product_attention sends caches that have `bits` to the quantized attention
    # path, which tq_mlx.integration hooks. group_size is passed along and ignored.
    @property
    def bits(self):
        return self.key_bits

    @property
    def group_size(self):
        return 0

    def _where(self) -> str:
        return f"TurboQuantKVCache (layer {self.layer_index})"

    def _make_quantizers(self) -> None:
        k_seed, v_seed = (layer_seed(self.config.seed, self.layer_index, side) for side in (0, 1))
        if self.qjl:
            self.k_quantizer = TurboQuantProd(self.key_dim, int(self.key_bits), seed=k_seed)
        else:
            self.k_quantizer = TurboQuantMSE(self.key_dim, self.key_bits, seed=k_seed)
        self.v_quantizer = TurboQuantMSE(self.value_dim, self.value_bits, seed=v_seed)

    def check_dims(self, key_dim: int, value_dim: int) -> None:
        """Raise ValueError, naming the layer, unless this cache can store heads of these sizes."""
        for name, d, bits in (("key", key_dim, self.key_bits), ("value", value_dim, self.value_bits)):
            if d < MIN_DIM:
                raise ValueError(f"{self._where()}: {name} head_dim {d} is below the minimum {MIN_DIM}")
            try:
                split_dims(d, bits)
            except ValueError as e:
                raise ValueError(f"{self._where()}: {name} head_dim {d} at {bits} bits: {e}") from None

    def _check_input(self, keys: mx.array, values: mx.array) -> None:
        if keys.ndim != 4 or values.ndim != 4 or keys.shape[:3] != values.shape[:3]:
            raise ValueError(
                f"{self._where()}: expected keys and values of shape (B, n_kv_heads, L, head_dim), "
                f"got {tuple(keys.shape)} and {tuple(values.shape)}"
            )
        B, H, _, dk = keys.shape
        dv = values.shape[3]
        if self.k_quantizer is None:
            self.check_dims(dk, dv)
            self.key_dim, self.value_dim = dk, dv
            self._make_quantizers()
            return
        if (dk, dv) != (self.key_dim, self.value_dim):
            raise ValueError(
                f"{self._where()}: keys/values head_dim ({dk}, {dv}) do not match this cache's "
                f"({self.key_dim}, {self.value_dim})"
            )
        held = self.batch_heads()
        if held is not None and held != (B, H):
            raise ValueError(
                f"{self._where()}: keys have batch {B} and {H} kv heads, this cache holds "
                f"batch {held[0]} and {held[1]} kv heads"
            )

    def batch_heads(self) -> tuple[int, int] | None:
        """(batch, n_kv_heads) of the stored arrays, None before the first update."""
        for a in (self.k_sinks, self.k_window, self.k_mean, None if self.k_codes is None else self.k_codes[0]):
            if isinstance(a, mx.array) and a.ndim >= 2:
                return tuple(a.shape[:2])
        return None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[CompressedKV, CompressedKV]:
        """Store keys/values (B, n_kv_heads, L, head_dim) and return handles to everything stored.

        Pure graph construction: every branch depends on Python ints only, never on array values.
        """
        self._check_input(keys, values)
        B, H, L, _ = keys.shape
        k, v = keys, values
        S = self.config.sinks
        if self.n_sinks < S:
            t = min(S - self.n_sinks, L)
            if self.k_sinks is None:
                self.k_sinks = mx.zeros((B, H, S, self.key_dim), mx.float16)
                self.v_sinks = mx.zeros((B, H, S, self.value_dim), mx.float16)
            self.k_sinks[:, :, self.n_sinks : self.n_sinks + t] = k[:, :, :t].astype(mx.float16)
            self.v_sinks[:, :, self.n_sinks : self.n_sinks + t] = v[:, :, :t].astype(mx.float16)
            self.n_sinks += t
            k, v = k[:, :, t:], v[:, :, t:]
        if k.shape[2]:
            self._append_recent(k, v)
        self.offset += L
        return self._handles()

    def _append_recent(self, k: mx.array, v: mx.array) -> None:
        W, K = self.config.window, self.config.block_size
        n_new = k.shape[2]
        total = self.n_window + n_new
        cap = window_capacity(total, W)
        if W and (self.k_window is None or self.k_window.shape[2] < cap):
            B, H = k.shape[:2]
            kw, vw = mx.zeros((B, H, cap, self.key_dim), mx.float16), mx.zeros((B, H, cap, self.value_dim), mx.float16)
            if self.n_window:
                kw[:, :, : self.n_window] = self.k_window[:, :, : self.n_window]
                vw[:, :, : self.n_window] = self.v_window[:, :, : self.n_window]
            self.k_window, self.v_window = kw, vw
        if total <= W:
            self.k_window[:, :, self.n_window : total] = k.astype(mx.float16)
            self.v_window[:, :, self.n_window : total] = v.astype(mx.float16)
            self.n_window = total
            return
        n_c = total if W == 0 else -(-(total - W) // K) * K
        if self.n_window:
            k = mx.concatenate([self.k_window[:, :, : self.n_window].astype(mx.float32), k.astype(mx.float32)], axis=2)
            v = mx.concatenate([self.v_window[:, :, : self.n_window].astype(mx.float32), v.astype(mx.float32)], axis=2)
        self._compress(k[:, :, :n_c], v[:, :, :n_c])
        self.n_window = total - n_c
        if self.n_window:
            self.k_window[:, :, : self.n_window] = k[:, :, n_c:].astype(mx.float16)
            self.v_window[:, :, : self.n_window] = v[:, :, n_c:].astype(mx.float16)

    def _calibrate(self, k: mx.array, v: mx.array) -> None:
        """μ, ν and the outlier channel order, from the first tokens ever compressed (lazy, no sync).

        With a window, from exactly the first block_size of them (the tokens right after the sinks): every first
        compression holds at least one block, so the calibration does not depend on how the prompt was fed
        (one shot, chunks, token by token, or a trimmed and reused cache).
        """
        if self.config.window:
            k, v = k[:, :, : self.config.block_size], v[:, :, : self.config.block_size]
        if self.config.center_keys:
            self.k_mean = mx.mean(k, axis=2)
        if self.config.center_values:
            self.v_mean = mx.mean(v, axis=2)
        self.k_perm = self._outlier_order(k, self.k_mean, self.k_quantizer)
        self.v_perm = self._outlier_order(v, self.v_mean, self.v_quantizer)
        self.calibrated = True

    @staticmethod
    def _outlier_order(x: mx.array, mean: mx.array | None, quantizer) -> mx.array | None:
        if not isinstance(quantizer, TurboQuantMSE) or len(quantizer.groups) == 1:
            return None
        if mean is not None:
            x = x - mean[:, :, None, :]
        # Channels by decreasing mean |x| over batch and tokens, per kv head: the first d/4 get the extra bit.
        score = mx.mean(mx.abs(x), axis=(0, 2))
        return mx.argsort(-score, axis=-1).astype(mx.int32)

    @staticmethod
    def _encode(x: mx.array, mean: mx.array | None, perm: mx.array | None, quantizer):
        if mean is not None:
            x = x - mean[:, :, None, :]
        if perm is not None:
            x = mx.take_along_axis(x, mx.broadcast_to(perm[None, :, None, :], x.shape), axis=-1)
        return quantizer.quantize(x)

    def _compress(self, k: mx.array, v: mx.array) -> None:
        k, v = k.astype(mx.float32), v.astype(mx.float32)
        if not self.calibrated:
            self._calibrate(k, v)
        from .kernels import fused_encode  # late: kernels imports this module

        kc = fused_encode(k, self.k_quantizer, self.k_mean, self.k_perm)
        vc = fused_encode(v, self.v_quantizer, self.v_mean, self.v_perm)
        start, n = self.n_compressed, k.shape[2]
        self.k_codes = _grow(self.k_codes, start, n, self.config.step, kc)
        self.v_codes = _grow(self.v_codes, start, n, self.config.step, vc)
        for buf, new in ((self.k_codes, kc), (self.v_codes, vc)):
            for b, x in zip(buf, new):
                b[:, :, start : start + n] = x
        self.n_compressed += n

    def _handles(self) -> tuple[CompressedKV, CompressedKV]:
        s, c, w = self.n_sinks, self.n_compressed, self.n_window

        def side(quantizer, codes, sinks, window, mean, perm):
            return CompressedKV(
                quantizer=quantizer,
                codes=type(codes)(*(a[:, :, :c] for a in codes)) if c else None,
                sinks=sinks[:, :, :s] if s else None,
                window=window[:, :, :w] if w else None,
                mean=mean,
                perm=perm,
            )

        return (
            side(self.k_quantizer, self.k_codes, self.k_sinks, self.k_window, self.k_mean, self.k_perm),
            side(self.v_quantizer, self.v_codes, self.v_sinks, self.v_window, self.v_mean, self.v_perm),
        )

    # --- the rest of mlx-lm's cache protocol ---------------------------------------------------------

    def __deepcopy__(self, memo):
        # mlx-lm's prompt-cache LRU deep-copies caches. Quantizers are immutable (and hold mx.Dtype, which
        # cannot be copied), so copies share them; every stored array is copied.
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        shared = ("k_quantizer", "v_quantizer", "config")
        for name, value in vars(self).items():
            setattr(new, name, value if name in shared else copy.deepcopy(value, memo))
        return new

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.batch_heads() is None

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last n tokens (as many as exist): window first, then compressed tokens, then sinks.
        A trim that leaves no compressed token also drops the calibration (μ, ν, channel order)."""
        n = min(self.offset, n)
        left = n
        for part in ("n_window", "n_compressed", "n_sinks"):
            d = min(getattr(self, part), left)
            setattr(self, part, getattr(self, part) - d)
            left -= d
        self.offset -= n
        if self.n_compressed == 0 and self.calibrated:
            # Nothing encoded with μ, ν or the channel order is left: calibrate again from the next tokens
            # compressed, exactly as a fresh cache fed the same tokens would.
            self.k_mean = self.v_mean = self.k_perm = self.v_perm = None
            self.calibrated = False
        return n

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return create_attention_mask(N, offset=self.offset, return_array=return_array, window_size=window_size)

    def held_arrays(self) -> list[mx.array]:
        """Every array this cache holds (storage buffers, centering, channel orders, quantizer constants)."""
        out = []
        for a in (self.k_codes, self.v_codes):
            out.extend(a or ())
        for name in _FLOAT_AND_CENTERING:
            a = getattr(self, name)
            if a is not None:
                out.append(a)
        seen: set[int] = set()
        for q in (self.k_quantizer, self.v_quantizer):
            if q is not None:
                out.extend(_arrays_of(q, seen))
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of every array the cache holds, buffers at full capacity (see held_arrays)."""
        return sum(a.nbytes for a in self.held_arrays())

    # --- state: everything needed to rebuild the cache, as stored references -----------------------

    @property
    def state(self):
        meta = {
            "version": STATE_VERSION,
            "config": self.config.to_dict(),
            "layer_index": self.layer_index,
            "attention_index": self.attention_index,
            "n_attention_layers": self.n_attention_layers,
            "head_dim": self.expected_head_dim,
            "offset": self.offset,
            "n_sinks": self.n_sinks,
            "n_compressed": self.n_compressed,
            "n_window": self.n_window,
            "key_dim": self.key_dim,
            "value_dim": self.value_dim,
            "calibrated": self.calibrated,
        }
        arrays = {
            "k_codes": None if self.k_codes is None else tuple(self.k_codes),
            "v_codes": None if self.v_codes is None else tuple(self.v_codes),
            **{name: getattr(self, name) for name in _FLOAT_AND_CENTERING},
        }
        return meta, arrays

    @state.setter
    def state(self, v):
        try:
            meta, arrays = v
            meta, arrays = dict(meta), dict(arrays)
        except (TypeError, ValueError):
            raise ValueError("TurboQuantKVCache state must be (meta dict, arrays dict)") from None
        if meta.get("version") != STATE_VERSION:
            raise ValueError(f"TurboQuantKVCache state version {meta.get('version')!r}, expected {STATE_VERSION}")
        try:
            config = TurboQuantConfig.from_dict(dict(meta["config"]))
            self.__init__(config, meta["layer_index"], meta["attention_index"], meta["n_attention_layers"])
            self.expected_head_dim = meta["head_dim"]
            for name in ("offset", "n_sinks", "n_compressed", "n_window", "key_dim", "value_dim"):
                setattr(self, name, _check_int(name, meta[name], 0))
            self.calibrated = bool(meta["calibrated"])
        except KeyError as e:
            raise ValueError(f"TurboQuantKVCache state is missing {e}") from None
        names = ("k_codes", "v_codes", *_FLOAT_AND_CENTERING)
        unknown = set(arrays) - set(names)
        if unknown:
            raise ValueError(f"{self._where()}: unknown state arrays {sorted(unknown)}")
        # mx.array(a) shares a's data but is a new object, so the in-place slice updates of this cache never
        # reach another cache built from the same state.
        own = lambda a: mx.array(a) if isinstance(a, mx.array) else a  # noqa: E731
        for name, codes_type in (("k_codes", ProdCodes if self.qjl else MSECodes), ("v_codes", MSECodes)):
            a = arrays.get(name)
            if a is not None:
                if not isinstance(a, (list, tuple)) or len(a) != len(codes_type._fields):
                    raise ValueError(f"{self._where()}: invalid state: {name} must hold {codes_type._fields}")
                a = codes_type(*map(own, a))
            setattr(self, name, a)
        for name in names[2:]:
            setattr(self, name, own(arrays.get(name)))
        if self.key_dim:
            self.check_dims(self.key_dim, self.value_dim)
            self._make_quantizers()
        self._validate_state()

    def _validate_state(self) -> None:
        """Check every array's shape and dtype against the counts and the config (corrupted-file guard)."""
        cfg = self.config

        def bad(msg):
            return ValueError(f"{self._where()}: invalid state: {msg}")

        if self.offset != self.n_sinks + self.n_compressed + self.n_window:
            raise bad(f"offset {self.offset} != n_sinks + n_compressed + n_window")
        if self.n_sinks > cfg.sinks or self.n_window > cfg.window:
            raise bad(f"{self.n_sinks} sinks / {self.n_window} window tokens exceed the config's "
                      f"{cfg.sinks} / {cfg.window}")
        if self.n_compressed and not self.calibrated:
            raise bad("compressed tokens without calibration")
        if self.key_dim == 0:
            if self.offset or any(a is not None for a in self.held_arrays()):
                raise bad("arrays but no head_dim")
            return
        B, H = self.batch_heads() or (None, None)

        def check(name, a, expected, dtype, min_tokens=0):
            # expected: the full shape, with None on the token axis of growable buffers (>= min_tokens)
            if not isinstance(a, mx.array) or a.dtype != dtype:
                raise bad(f"{name} must be a {dtype} array, got {getattr(a, 'dtype', type(a).__name__)}")
            got = tuple(a.shape)
            ok = len(got) == len(expected)
            ok = ok and all(e is None and g >= min_tokens or e == g for g, e in zip(got, expected))
            if not ok:
                raise bad(f"{name} has shape {got}, expected {expected} (None: at least {min_tokens})")

        for side, q, codes, dim in (
            ("k", self.k_quantizer, self.k_codes, self.key_dim),
            ("v", self.v_quantizer, self.v_codes, self.value_dim),
        ):
            if self.n_sinks or getattr(self, f"{side}_sinks") is not None:
                check(f"{side}_sinks", getattr(self, f"{side}_sinks"), (B, H, cfg.sinks, dim), mx.float16)
            if self.n_window or getattr(self, f"{side}_window") is not None:
                w = getattr(self, f"{side}_window")
                check(f"{side}_window", w, (B, H, None, dim), mx.float16, max(self.n_window, 1))
                if w.shape[2] > cfg.window:
                    raise bad(f"{side}_window holds {w.shape[2]} tokens, more than the config's window {cfg.window}")
            if self.n_compressed or codes is not None:
                # A lazy probe gives each field's trailing shape and dtype without evaluating anything.
                probe = q.quantize(mx.zeros((1, 1, 1, dim), mx.float32))
                if codes is None or len(codes) != len(probe):
                    raise bad(f"{side}_codes must hold {probe._fields}")
                for fname, a, p in zip(probe._fields, codes, probe):
                    check(f"{side}_codes.{fname}", a, (B, H, None, *p.shape[3:]), p.dtype, self.n_compressed)
            if self.calibrated:
                if cfg.center_keys if side == "k" else cfg.center_values:
                    check(f"{side}_mean", getattr(self, f"{side}_mean"), (B, H, dim), mx.float32)
                if isinstance(q, TurboQuantMSE) and len(q.groups) == 2:
                    check(f"{side}_perm", getattr(self, f"{side}_perm"), (H, dim), mx.int32)
