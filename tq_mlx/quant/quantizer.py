"""TurboQuant quantizers (Zandieh et al., arXiv:2504.19874): Algorithm 1 (MSE) and Algorithm 2 (inner product).

Algorithm 1, TurboQuant_mse(d, b):
    Quant(x):   y = Π·(x/‖x‖);  idx_j = argmin_k |y_j - c_k|;  store (pack(idx), ‖x‖)
    DeQuant:    x̃ = ‖x‖ · Πᵀ c[idx]
Algorithm 2, TurboQuant_prod(d, b):
    Quant(x):   idx = Quant_mse(x) at b-1 bits;  r = x - DeQuant_mse(idx);  z = sign(S·r);  store (idx, z, ‖r‖)
    DeQuant:    x̃ = DeQuant_mse(idx) + (√(π/2)/d)·‖r‖·Sᵀz,   S with i.i.d. N(0, 1) entries (paper Definition 1)

Fractional widths (2.5, 3.5) follow the paper's channel split (§4.3): the channels are cut into an outlier
group of d/4 channels at ⌊b⌋+1 bits and a regular group of 3d/4 channels at ⌊b⌋ bits, each an independent
TurboQuant_mse instance with its own rotation, codebook and norm. At d = 128 and 2.5 bits that is 32 channels
at 3 bits and 96 at 2 (2.25 code bits plus two fp16 norms = 2.5 bits per value). Which channels are outliers
is data-dependent: pass `outlier_channels` (the cache picks the channels of largest mean |x| in the first
tokens it sees); without it the first d/4 channels are the outlier group.

Norm correction (correct_norms, TurboQuant+'s): each group stores ‖x‖ / ‖c[idx]‖ instead of ‖x‖, so the decoded
vector's norm is exactly the token's. Lloyd-Max codes shrink a vector (E‖c[idx]‖² = 1 - MSE): uncorrected, every
decoded key's logits and every decoded value are scaled down alike, most at 2-3 bits. The codes are the same and
decoding is unchanged; only the stored norm differs.

Trellis codes (trellis=True; tq_mlx.quant.trellis): each group of 2 to 6 bits codes its rotated coordinates as a
bitshift trellis instead, the same symbols and packing decoded through a 2^L-entry codebook by a window of the last
L/b symbols, chosen by Viterbi; groups of 1 and 8 bits keep Lloyd-Max codes. Norm correction, recoding and decoding
work alike, and the Metal kernels read and write them (tq_mlx.attention.support).

Codebooks, boundaries and lookup tables depend only on a group's (dim, bits, kind): every quantizer shares one set
(shared_constants), and its rotation (by its seed) is its own.

Widths: the config takes MSE_BITS (CODE_BITS: every whole width a group of codes is packed at; the Metal kernels
take each: kernels.KERNEL_BITS). The quantizer stores norms in the norm_dtype it is given at every width (the
streams keep float16 norms for codes of 6 bits or more: layout.WIDE_BITS).

All arithmetic is float32; inputs may be float16, bfloat16 or float32 with any leading shape.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple, Sequence

import numpy as np

import mlx.core as mx

from .codebook import MIN_DIM, lloyd_max
from .packing import lookup_table, pack, packed_words, unpack, unpack_lookup
from .rotation import Rotation
from .trellis import TRELLIS_BITS, decode as trellis_decode, standard_book, viterbi

MSE_BITS = (1, 2, 2.5, 3, 3.5, 4, 5, 6, 8)  # the widths a config takes (config.py validates with check_bits)
CODE_BITS = (1, 2, 3, 4, 5, 6, 8)  # the whole widths a group of codes takes (packing.SUPPORTED_BITS)
KEY_STEP_BITS = (4.5, 5.5)  # the half steps keys widen by (config.key_half_steps): no config's own width
QUANTIZER_BITS = tuple(sorted({*MSE_BITS, *CODE_BITS, *KEY_STEP_BITS}))  # what TurboQuantMSE takes
PROD_BITS = (1, 2, 3, 4)
FLOAT_DTYPES = (mx.float16, mx.bfloat16, mx.float32)
# Stored norms: a float dtype, or a one-byte log code (streams scale tokens so that their norms sit near 1).
# int8, the fine code (config.norm_steps 32): c in -127..126 is 2^(c / 32 + 1/2), i.e. 2^-3.47 .. 2^4.44, what the
# scaled norms of every model measured span (2^-3.4 .. 2^2.3) with two octaves to spare above; -128 is zero
# (anything below half the smallest code), 127 not a number, and norms beyond the range saturate. Its relative
# error is at most 2^(1/64) - 1 = 1.1% (RMS 0.63%). uint8, the coarse code (norm_steps 16, every 8-bit cache
# before 2026-12-06): c in 1..254 is 2^((c - 128) / 16), i.e. 2^-7.94 .. 2^7.88, 0 zero and 255 not a number, at
# most 2.2% off (RMS 1.25%). A norm's error scales a key's whole logit, which is why it counts more than its
# share of the squared error (1.6e-4·|x|² coarse, 6% of 5-bit codes' own): on the logits of the queries that
# read a key most, the coarse code's error was as large as 5-bit codes' (experiments/HISTORY.md, 2026-12-06).
# Kernels decode both with tq_norm (common.metal).
LOG_NORM_STEPS = 16  # the coarse uint8 code's steps per octave
FINE_NORM_STEPS, FINE_NORM_CENTER = 32, 0.5  # the fine int8 code's steps per octave and the log2 norm of code 0
LOG_NORM_DTYPES = {FINE_NORM_STEPS: mx.int8, LOG_NORM_STEPS: mx.uint8}  # each log code's dtype by its steps an octave
NORM_DTYPES = (*FLOAT_DTYPES, *LOG_NORM_DTYPES.values())
_SIGN_TABLE = lookup_table([-1.0, 1.0], 1)  # QJL sign bits -> ±1, shared by every TurboQuantProd


class MSECodes(NamedTuple):
    """A TurboQuant_mse-compressed tensor of leading shape S."""

    codes: mx.array  # uint32 (*S, words): packed indices, group after group
    norms: mx.array  # (*S, groups), float16 by default (or a one-byte log code): each group's L2 norm


class ProdCodes(NamedTuple):
    """A TurboQuant_prod-compressed tensor of leading shape S."""

    codes: mx.array  # uint32 (*S, words): the (b-1)-bit MSE stage (0 words when b = 1)
    norms: mx.array  # (*S, groups): the MSE stage's norms (0 groups when b = 1)
    qjl: mx.array  # uint32 (*S, ceil(d/32)): sign bits of S·r, bit set = +1
    gamma: mx.array  # (*S,): ‖r‖, the residual norm


def check_bits(bits, name: str = "bits", allowed: tuple = MSE_BITS) -> int | float:
    """bits as the canonical number (4, not 4.0), unless it is not one of `allowed` (ValueError naming `name`)."""
    if isinstance(bits, bool) or not isinstance(bits, (int, float, np.integer, np.floating)) or bits not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {bits!r}")
    return int(bits) if bits == int(bits) else float(bits)


def format_bits(bits: float) -> str:
    """4 -> "4", 2.5 -> "2.5"."""
    return str(int(bits)) if bits == int(bits) else str(float(bits))


def check_input(x: mx.array, dim: int) -> None:
    """Raise ValueError unless x is a float16/bfloat16/float32 array whose last axis is `dim` (no sync)."""
    if not isinstance(x, mx.array):
        raise ValueError(f"expected an mx.array, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"input dtype must be float16, bfloat16 or float32, got {x.dtype}")
    if x.ndim == 0 or x.shape[-1] != dim:
        raise ValueError(f"input's last axis must be dim={dim}, got shape {tuple(x.shape)}")


def saturate(norms: mx.array, dtype: mx.Dtype) -> mx.array:
    """Norms (>= 0 or NaN) stored in `dtype`, the largest finite value where they exceed its range: a stored
    norm is never inf. Streams scale tokens so that their norms sit near 1 (calibration.calibration_scale); only a
    token far outside its head's range can reach the limit. uint8 and int8: the log codes of NORM_DTYPES."""
    if dtype == mx.int8:
        c = mx.clip(mx.round(FINE_NORM_STEPS * (mx.log2(norms) - FINE_NORM_CENTER)), -127, 126)
        c = mx.where(norms < 2.0 ** (-127 / FINE_NORM_STEPS + FINE_NORM_CENTER - 1), -128, c)
        return mx.where(mx.isnan(norms), 127, c).astype(mx.int8)
    if dtype == mx.uint8:
        c = mx.clip(mx.round(LOG_NORM_STEPS * mx.log2(norms)) + 128, 1, 254)  # log2(0) = -inf clips to 1
        c = mx.where(norms < 2.0 ** (-127 / LOG_NORM_STEPS - 1), 0, c)
        return mx.where(mx.isnan(norms), 255, c).astype(mx.uint8)
    return mx.minimum(norms, mx.finfo(dtype).max).astype(dtype)


def load_norms(stored: mx.array) -> mx.array:
    """Stored norms (saturate's output) as float32."""
    if stored.dtype == mx.int8:
        c = stored.astype(mx.float32)
        v = mx.exp((c / FINE_NORM_STEPS + FINE_NORM_CENTER) * math.log(2))
        return mx.where(c == -128, 0.0, mx.where(c == 127, float("nan"), v))
    if stored.dtype != mx.uint8:
        return stored.astype(mx.float32)
    c = stored.astype(mx.float32)
    v = mx.exp((c - 128) * (math.log(2) / LOG_NORM_STEPS))
    return mx.where(c == 0, 0.0, mx.where(c == 255, float("nan"), v))


def check_norm_dtype(norm_dtype) -> None:
    if norm_dtype not in NORM_DTYPES:
        raise ValueError(f"norm_dtype must be float16, bfloat16, float32, uint8 or int8 (log codes), got {norm_dtype}")


class Group(NamedTuple):
    """One independent TurboQuant_mse instance over a subset of the channels (all of them for integer bits)."""

    channels: mx.array | None  # int32 channel indices in the model basis, None = all channels in order
    dim: int
    bits: int
    rotation: Rotation
    centroids: mx.array  # (2^bits,) float32, raw unit-vector scale; trellis codes: the (2^L,) codebook
    boundaries: mx.array | None  # (2^bits - 1,) float32 (None: trellis codes)
    words: slice  # where this group's packed words sit in MSECodes.codes
    table: mx.array | None  # packing.lookup_table(centroids, bits): dequantizes a byte of codes per lookup (None: trellis)
    trellis: bool = False  # codes decoded by a window of symbols (tq_mlx.quant.trellis)


def split_dims(dim: int, bits: float) -> list[tuple[int, int]]:
    """[(channels, bits)] per group: one group for integer bits, (d/4 at ⌊b⌋+1, 3d/4 at ⌊b⌋) for x.5 bits.
    bits: one of QUANTIZER_BITS."""
    bits = check_bits(bits, allowed=QUANTIZER_BITS)
    if bits == int(bits):
        return [(dim, int(bits))]
    if dim % 4 or dim // 4 < MIN_DIM:
        raise ValueError(
            f"fractional bits {bits} split the channels 1:3 and need dim divisible by 4 and >= {4 * MIN_DIM}, "
            f"got dim={dim}"
        )
    low = int(bits)
    return [(dim // 4, low + 1), (dim - dim // 4, low)]


def _code(y: mx.array, g: Group, search=viterbi) -> mx.array:
    """The codes (uint32, y's shape) of a group's rotated unit coordinates y: the nearest centroid each, or the
    trellis path of least squared error found by `search` (trellis.viterbi, or a kernel of the same contract)."""
    return search(y, g.centroids, g.bits) if g.trellis else _quantize_indices(y, g.boundaries, g.bits)


def _decoded(idx: mx.array, g: Group) -> mx.array:
    """The values (float32) a group's codes decode to, in its rotated basis at unit scale."""
    return trellis_decode(idx, g.centroids, g.bits) if g.trellis else g.centroids[idx]


def _quantize_indices(y: mx.array, boundaries: mx.array, bits: int) -> mx.array:
    # Binary search over the sorted boundaries: idx = #{k : y > t_k}, the nearest centroid. NaN compares
    # false everywhere and lands on index 0, so a bad vector only ever affects itself.
    idx = mx.zeros(y.shape, dtype=mx.uint32)
    for s in reversed(range(bits)):
        cand = idx + (1 << s)
        idx = mx.where(y > mx.take(boundaries, cand - 1), cand, idx)
    return idx


@lru_cache(maxsize=None)
def shared_constants(dim: int, bits: int, trellis: bool = False) -> tuple:
    """(centroids, boundaries, table) of a group of `dim` channels at `bits`: Lloyd-Max's (its centroids, boundaries
    and packing.lookup_table), or trellis codes' (their codebook at a unit vector's scale, None, None). One set per
    (dim, bits, kind) in the process, shared by every quantizer that codes so (arrays are immutable), so that a
    model's caches hold each once (tq_mlx.cache.held_bytes; layout.shared_constant_bytes prices them)."""
    if trellis:
        return mx.array(standard_book(bits) / np.float32(np.sqrt(dim))), None, None
    cb = lloyd_max(dim, bits)
    return (mx.array(cb.centroids.astype(np.float32)), mx.array(cb.boundaries.astype(np.float32)),
            lookup_table(cb.centroids, bits))


class TurboQuantMSE:
    """TurboQuant_mse (paper Algorithm 1): rotation, then a Lloyd-Max scalar code per coordinate.

    quantize(x) -> MSECodes, dequantize(MSECodes) -> float32 x̃, for x of shape (..., dim).
    """

    def __init__(
        self,
        dim: int,
        bits: float,
        seed: int = 0,
        outlier_channels: Sequence[int] | mx.array | None = None,
        norm_dtype: mx.Dtype = mx.float16,
        correct_norms: bool = False,
        trellis: bool = False,
    ):
        if not isinstance(dim, (int, np.integer)) or isinstance(dim, bool) or dim < MIN_DIM:
            raise ValueError(f"dim must be an integer >= {MIN_DIM}, got {dim!r}")
        check_norm_dtype(norm_dtype)
        self.dim, self.bits, self.seed, self.norm_dtype = int(dim), bits, int(seed), norm_dtype
        self.correct_norms, self.trellis = bool(correct_norms), bool(trellis)
        sizes = split_dims(self.dim, bits)
        channels: list[np.ndarray | None] = [None]
        if len(sizes) == 2:
            channels = _split_channels(self.dim, sizes[0][0], outlier_channels)
        elif outlier_channels is not None:
            raise ValueError(f"outlier_channels only applies to fractional bits (2.5, 3.5), not bits={bits}")
        self.groups: list[Group] = []
        start = 0
        for g, ((gdim, gbits), ch) in enumerate(zip(sizes, channels)):
            nw = packed_words(gdim, gbits)
            common = dict(channels=None if ch is None else mx.array(ch), dim=gdim, bits=gbits,
                          rotation=Rotation(gdim, seed=self.seed + g), words=slice(start, start + nw))
            trellis = self.trellis and gbits in TRELLIS_BITS
            centroids, boundaries, table = shared_constants(gdim, gbits, trellis)
            self.groups.append(Group(centroids=centroids, boundaries=boundaries, table=table, trellis=trellis,
                                     **common))
            start += nw
        self.words = start
        # Gathering the groups back into model order: the inverse of the channel permutation.
        self._inverse_perm = None
        if len(self.groups) == 2:
            perm = np.concatenate(channels)  # numpy: building a quantizer reads nothing back from MLX
            self._inverse_perm = mx.array(np.argsort(perm).astype(np.int32))

    @property
    def outlier_channels(self) -> mx.array | None:
        return self.groups[0].channels if len(self.groups) == 2 else None

    def bits_per_value(self) -> float:
        """Stored bits per coordinate, norms included."""
        norm_bits = 8 * self.norm_dtype.size * len(self.groups)
        return (32 * self.words + norm_bits) / self.dim

    def quantize(self, x: mx.array, search=viterbi) -> MSECodes:
        """Codes of x (..., dim); `search` finds trellis codes' paths (trellis.viterbi, or the attention layer's
        kernel of the same contract)."""
        check_input(x, self.dim)
        x = x.astype(mx.float32)
        codes, norms = [], []
        for g in self.groups:
            xg = x if g.channels is None else mx.take(x, g.channels, axis=-1)
            norm = mx.sqrt(mx.sum(xg * xg, axis=-1, keepdims=True))
            # A zero vector stays zero (codes of 0, times a zero norm) instead of 0/0 = NaN.
            unit = xg / mx.where(norm > 0, norm, 1.0)
            y = g.rotation.forward(unit)
            idx = _code(y, g, search)
            codes.append(pack(idx, g.bits))
            if self.correct_norms:  # ‖x‖ / ‖c[idx]‖: the decoded vector's norm is ‖x‖ (a zero code keeps ‖x‖)
                c = _decoded(idx, g)
                cn = mx.sqrt(mx.sum(c * c, axis=-1, keepdims=True))
                norm = norm / mx.where(cn > 0, cn, 1.0)
            norms.append(norm)
        codes = codes[0] if len(codes) == 1 else mx.concatenate(codes, axis=-1)
        norms = norms[0] if len(norms) == 1 else mx.concatenate(norms, axis=-1)
        return MSECodes(codes, saturate(norms, self.norm_dtype))

    def rotated_units(self, c: MSECodes) -> list[mx.array]:
        """Per group, the codebook values c[idx] in that group's rotated basis (norm not applied), float32."""
        return [_decoded(unpack(c.codes[..., g.words], g.bits, g.dim), g) if g.trellis
                else unpack_lookup(c.codes[..., g.words], g.bits, g.dim, g.table) for g in self.groups]

    def rotated_values(self, c: MSECodes) -> list[mx.array]:
        """Per group, the dequantized vector in that group's rotated basis (norm included), float32."""
        units = self.rotated_units(c)
        norms = load_norms(c.norms)
        return [u * norms[..., i : i + 1] for i, u in enumerate(units)]

    def dequantize(self, c: MSECodes) -> mx.array:
        parts = [g.rotation.inverse(y) for g, y in zip(self.groups, self.rotated_values(c))]
        if len(parts) == 1:
            return parts[0]
        return mx.take(mx.concatenate(parts, axis=-1), self._inverse_perm, axis=-1)

    @property
    def basis(self) -> tuple:
        """What fixes the rotated basis: each group's (dims, rotation kind, seed), in code order (trellis codes or
        not: the same basis)."""
        return tuple((g.dim, g.rotation.kind, g.rotation.seed) for g in self.groups)

    def recode(self, c: MSECodes, to: "TurboQuantMSE", search=viterbi) -> MSECodes:
        """These codes as `to` codes them (temporal decay: the same groups and rotations at other bits), without
        leaving the rotated basis: per group, the unit vector c[idx]/‖c[idx]‖ takes to's nearest codes and the
        norm becomes the decoded vector's, stored·‖c[idx]‖ (divided by ‖c'[idx']‖ if `to` corrects norms). That
        is to.quantize(self.dequantize(c)) without its two rotations (`search`: as in quantize)."""
        if not isinstance(to, TurboQuantMSE) or to.basis != self.basis:
            raise ValueError(f"recode needs a quantizer of the same groups and rotations {self.basis}, got "
                             f"{getattr(to, 'basis', type(to).__name__)}")
        stored = load_norms(c.norms)
        codes, norms = [], []
        for i, (t, u) in enumerate(zip(to.groups, self.rotated_units(c))):
            r = mx.sqrt(mx.sum(u * u, axis=-1, keepdims=True))  # centroids are never all zero: r > 0
            idx = _code(u / r, t, search)
            norm = stored[..., i : i + 1] * r
            if to.correct_norms:
                cc = _decoded(idx, t)
                cn = mx.sqrt(mx.sum(cc * cc, axis=-1, keepdims=True))
                norm = norm / mx.where(cn > 0, cn, 1.0)
            codes.append(pack(idx, t.bits))
            norms.append(norm)
        codes = codes[0] if len(codes) == 1 else mx.concatenate(codes, axis=-1)
        norms = norms[0] if len(norms) == 1 else mx.concatenate(norms, axis=-1)
        return MSECodes(codes, saturate(norms, to.norm_dtype))


def _split_channels(dim: int, n_hi: int, outliers) -> list[np.ndarray]:
    if outliers is None:
        hi = np.arange(n_hi)
    else:
        hi = np.asarray(outliers).astype(np.int64).reshape(-1)
        if hi.size != n_hi or len(set(hi.tolist())) != n_hi or hi.min() < 0 or hi.max() >= dim:
            raise ValueError(f"outlier_channels must be {n_hi} distinct channel indices in [0, {dim}), got {hi.tolist()}")
        hi = np.sort(hi)
    lo = np.setdiff1d(np.arange(dim), hi)
    return [hi.astype(np.int32), lo.astype(np.int32)]


def gaussian_projection(dim: int, seed: int) -> mx.array:
    """The QJL matrix S: (dim, dim) with i.i.d. N(0, 1) entries, from a seeded numpy generator."""
    rng = np.random.default_rng([int(seed), dim, 0x971])
    return mx.array(rng.standard_normal((dim, dim)).astype(np.float32))


class TurboQuantProd:
    """TurboQuant_prod (paper Algorithm 2): (b-1)-bit TurboQuant_mse plus a 1-bit QJL code of the residual.

    inner_product(q, c) is an unbiased estimate of ⟨q, x⟩ (Theorem 2). S is Gaussian as in the paper, so the
    QJL dequantization constant is √(π/2)/d (it would be √(π/(2d)) for an orthonormal S).
    """

    def __init__(self, dim: int, bits: int, seed: int = 0, norm_dtype: mx.Dtype = mx.float16,
                 correct_norms: bool = False):
        if bits not in PROD_BITS or isinstance(bits, bool):
            raise ValueError(f"TurboQuantProd bits must be one of {PROD_BITS}, got {bits!r}")
        if not isinstance(dim, (int, np.integer)) or isinstance(dim, bool) or dim < MIN_DIM:
            raise ValueError(f"dim must be an integer >= {MIN_DIM}, got {dim!r}")
        check_norm_dtype(norm_dtype)
        self.dim, self.bits, self.seed, self.norm_dtype = int(dim), bits, int(seed), norm_dtype
        self.correct_norms = bool(correct_norms)  # the MSE stage's norms (the residual is measured after them)
        self.mse = (TurboQuantMSE(dim, bits - 1, seed=seed, norm_dtype=norm_dtype, correct_norms=correct_norms)
                    if bits > 1 else None)
        self.projection = gaussian_projection(self.dim, seed)
        self.qjl_scale = math.sqrt(math.pi / 2) / self.dim

    def bits_per_value(self) -> float:
        mse_bits = self.mse.bits_per_value() if self.mse else 0.0
        return mse_bits + (32 * packed_words(self.dim, 1) + 8 * self.norm_dtype.size) / self.dim

    def quantize(self, x: mx.array) -> ProdCodes:
        check_input(x, self.dim)
        x = x.astype(mx.float32)
        lead = x.shape[:-1]
        if self.mse is None:
            codes = mx.zeros((*lead, 0), dtype=mx.uint32)
            norms = mx.zeros((*lead, 0), dtype=self.norm_dtype)
            r = x
        else:
            codes, norms = self.mse.quantize(x)
            r = x - self.mse.dequantize(MSECodes(codes, norms))
        gamma = mx.sqrt(mx.sum(r * r, axis=-1))
        signs = (r @ self.projection.T) >= 0
        return ProdCodes(codes, norms, pack(signs, 1), saturate(gamma, self.norm_dtype))

    def signs(self, c: ProdCodes) -> mx.array:
        """The QJL sign bits z as ±1, float32 (..., dim)."""
        return unpack_lookup(c.qjl, 1, self.dim, _SIGN_TABLE)

    def dequantize(self, c: ProdCodes) -> mx.array:
        qjl = self.qjl_scale * load_norms(c.gamma)[..., None] * (self.signs(c) @ self.projection)
        if self.mse is None:
            return qjl
        return self.mse.dequantize(MSECodes(c.codes, c.norms)) + qjl

    def inner_product(self, q: mx.array, c: ProdCodes) -> mx.array:
        """Unbiased ⟨q, x⟩ from the codes, pairwise over the leading shape: q (..., d) -> (...).

        Computed as attention does: ⟨Πq, c[idx]⟩·‖x‖ for the MSE part and ⟨Sq, z⟩ for QJL; x̃ is never built.
        """
        check_input(q, self.dim)
        q = q.astype(mx.float32)
        qjl = self.qjl_scale * load_norms(c.gamma) * mx.sum((q @ self.projection.T) * self.signs(c), -1)
        if self.mse is None:
            return qjl
        (g,) = self.mse.groups
        (y,) = self.mse.rotated_values(MSECodes(c.codes, c.norms))
        return mx.sum(g.rotation.forward(q) * y, axis=-1) + qjl


def constant_arrays(quantizer, seen: set[int] | None = None):
    """Every mx.array a quantizer holds (rotation signs or matrices, codebooks, lookup tables, channel lists,
    QJL projection), each once: what it adds to a cache's bytes besides the codes."""
    seen = set() if seen is None else seen
    if id(quantizer) in seen:
        return
    seen.add(id(quantizer))
    if isinstance(quantizer, mx.array):
        yield quantizer
    elif isinstance(quantizer, (list, tuple)):
        for x in quantizer:
            yield from constant_arrays(x, seen)
    elif hasattr(quantizer, "__dict__") and type(quantizer).__module__.startswith("tq_mlx"):
        for x in vars(quantizer).values():
            yield from constant_arrays(x, seen)
