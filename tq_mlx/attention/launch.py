"""How every kernel is built and launched: the Metal sources, the compiled-kernel cache, argument helpers, and
the code, threadgroup-memory and mask layouts that the launchers and the support checks share.

Kernel bodies live beside this file, tq_mlx/attention/<name>.metal (helpers in common.metal, passed as `header=`). A launcher
computes shapes, grid (in threads) and threadgroup in Python and calls a kernel made by a `metal_kernel` factory:
`mx.fast.metal_kernel` by default, `tests.emulator.metal_kernel` in the test suite (it returns numpy arrays, which
`_mx` converts back, so the launcher code is the same on both).
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any, Callable, NamedTuple

import numpy as np

import mlx.core as mx

from .reference import aligned_segments
from ..quant.quantizer import TurboQuantMSE, TurboQuantProd
from ..models.rope import n_pairs
from ..quant.rotation import Rotation
from ..stream.view import StreamView

SUPPORTED_DIMS = (32, 64, 128, 256, 512)  # the WHT kernels (rotate, encode, dequantize, in-kernel value rotation)
MIN_DIM, MAX_DIM = 16, 512  # attention and encode_dense: any head dim in this range
KERNEL_BITS = (1, 2, 3, 4, 5, 6, 8)  # per code group (quantizer.CODE_BITS): 2.5 and 3.5 bits are two groups
# (3+2, 4+3 bits); 3, 5 and 6 bits are bit planes (2+1, 4+1, 4+2: common.metal tq_lo_bits, tq_hi_bits)
MAX_QUERY_TOKENS = 8
# Sparse V: pass 1 skips a compressed token's value (neither read nor accumulated) when its weight relative
# to the running max, exp(s - m), is below ε/n, n = the tokens of its split; its weight still counts in l.
# Bound: the running max never exceeds the split's final max m_s, so each skipped weight is < ε/n·e^(m_s) and
# a split's skipped mass < ε·e^(m_s) <= ε·l_s; summed, < ε·l. The output misses Σ_skip p_i (v_i - ν) / l, so
# for every query row, at any context length, split count or GQA ratio:
#     ‖out - exact‖₂ <= ε · max_i ‖v_i - ν‖₂    (v_i the dequantized values, ν the value mean)
# i.e. 1e-5 relative to the largest centered value (tests/test_kernels.py checks it on an adversarial pattern).
# A fixed threshold has no such bound: n tokens just below it drop n times its mass.
SPARSE_V_EPSILON = 1e-5
THREADGROUP_MEMORY = 32 * 1024
_NO_LIMIT = 1 << 30  # "no causal limit" in the kernels' int32 params


# ------------------------------------------------------------------------------------------ sources
# Beside their launchers, in a checkout and in a wheel alike (package data of tq_mlx.attention).
_DIRS = (Path(__file__).resolve().parent,)
KERNEL_NAMES = ("common", "wht", "encode", "encode_dense", "recode", "dequantize", "decode_partial", "decode_merge",
                "prefill_attention", "viterbi")


def _load_sources() -> dict[str, str]:
    for d in _DIRS:
        if (d / "common.metal").is_file():
            return {n: (d / f"{n}.metal").read_text() for n in KERNEL_NAMES}
    return {}


# name -> Metal text. Tests may replace an entry (a planted bug); kernels are cached by their text.
SOURCES: dict[str, str] = _load_sources()
_KERNELS: dict[tuple, Any] = {}


def _default_factory():
    return mx.fast.metal_kernel


def _kernel(factory, name: str, inputs: list[str], outputs: list[str], row_contiguous: bool = True):
    if name not in SOURCES:
        raise RuntimeError(f"Metal source tq_mlx/attention/{name}.metal not found (looked in {[str(d) for d in _DIRS]})")
    key = (factory, name, tuple(inputs), tuple(outputs), SOURCES[name], SOURCES["common"], row_contiguous)
    k = _KERNELS.get(key)
    if k is None:
        k = factory(
            name=f"tq_{name}", input_names=inputs, output_names=outputs, source=SOURCES[name],
            header=SOURCES["common"], ensure_row_contiguous=row_contiguous,
        )
        _KERNELS[key] = k
    return k


def _mx(x, dtype: mx.Dtype) -> mx.array:
    """A kernel output as an mx.array (the emulator returns numpy; bfloat16 as uint16 bits or ml_dtypes)."""
    if isinstance(x, mx.array):
        return x
    a = np.asarray(x)
    if dtype == mx.bfloat16:
        if a.dtype == np.uint16:
            return mx.array(a).view(mx.bfloat16)
        return mx.array(a.astype(np.float32)).astype(mx.bfloat16)
    return mx.array(a)


def _dummy(dtype: mx.Dtype, ndim: int = 1) -> mx.array:
    # 8 elements keep an unused input in `device` memory (MLX passes < 8 as `constant`), so pointer
    # expressions on it type-check; ndim matches the real input so its strides can be indexed.
    return mx.zeros((1,) * (ndim - 1) + (8,), dtype)


def _floats(*parts) -> mx.array:
    return mx.concatenate([mx.array(p, dtype=mx.float32).reshape(-1) for p in parts])


_TABLES: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def _tables(owner, key: tuple, make: Callable[[], mx.array]) -> mx.array:
    """A kernel's constant table (signs, codebooks, ...) built once per quantizer, not on every decode step."""
    per = _TABLES.setdefault(owner, {})
    if key not in per:
        per[key] = mx.contiguous(make())
    return per[key]


def _ints(*values: int) -> mx.array:
    return mx.array([int(v) for v in values], dtype=mx.int32)


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# ------------------------------------------------------------------------------------- code layouts
def _rotation_unsupported(rot: Rotation) -> str | None:
    if rot.kind != "hadamard" or rot.base != 1 or rot.dim not in SUPPORTED_DIMS:
        return f"head dim {rot.dim}: the kernels need a power-of-two Walsh-Hadamard rotation, dims {SUPPORTED_DIMS}"
    return None


def _mse(q) -> TurboQuantMSE | None:
    return q.mse if isinstance(q, TurboQuantProd) else q


def _wht(q) -> bool:
    """Whether q's codes are one group under a power-of-two WHT the kernels run themselves (encode.metal, the
    in-kernel value rotation); otherwise encode_dense.metal encodes and the host rotates queries and outputs."""
    mse = _mse(q)
    return len(mse.groups) == 1 and _rotation_unsupported(mse.groups[0].rotation) is None


class _Codes(NamedTuple):
    """One side's code layout as the attention kernels see it: one group, or two for fractional bits."""

    dim: int
    groups: tuple[tuple[int, int, int], ...]  # (dims, bits, packed words) per group, in code order
    wht: bool  # one group under a power-of-two WHT (rotated in-kernel); else the host rotates
    norms: str  # the stored norms' dtype (float16, or uint8 for the log code): a separate compiled variant
    trellis: bool = False  # every group's codes are trellis codes (common.metal tq_trellis): read from device memory

    @property
    def words(self) -> int:
        return sum(w for _, _, w in self.groups)

    def template(self, side: str) -> list[tuple[str, int]]:
        """KB, KG, KD0, KB1, WK0, KT (side "K") or VB, VG, VD0, VB1, WV0, VT (side "V")."""
        (d0, b0, w0), *rest = self.groups
        b1 = rest[0][1] if rest else b0
        return [(f"{side}B", b0), (f"{side}G", len(self.groups)), (f"{side}D0", d0), (f"{side}B1", b1),
                (f"W{side}0", w0), (f"{side}T", int(self.trellis))]

    def centroids(self) -> int:
        """The entries the attention kernels stage in threadgroup memory: Lloyd-Max centroids; a trellis
        side's codebooks stay in device memory (two of them would fill threadgroup memory)."""
        return 0 if self.trellis else sum(2**b for _, b, _ in self.groups)


def _codes(q) -> _Codes:
    mse = _mse(q)
    return _Codes(q.dim, tuple((g.dim, g.bits, g.words.stop - g.words.start) for g in mse.groups), _wht(q),
                  str(q.norm_dtype), all(g.trellis for g in mse.groups))


def _partial_layout(nr: int, dk: int, dv: int, kc: _Codes, vc: _Codes, qjl: bool, np: int = 0
                    ) -> list[tuple[str, int]]:
    """decode_partial.metal's template values past DK, DV, QJL, NR and the code layouts: words per token and
    the size of each threadgroup array, in 4-byte elements. The kernel declares its arrays with these values,
    so this is the one place its threadgroup-memory layout (and so its budget) is defined."""
    wk, wv = kc.words, vc.words
    ws = max(wk, wv) | 1  # odd row stride: lanes reading one word per token hit distinct banks
    wjs = -(-dk // 32) | 1
    norms = 32 * max(len(kc.groups), len(vc.groups))
    return [
        ("WK", wk), ("WV", wv), ("WS", ws), ("WJS", wjs),
        ("TG_Q", nr * dk), ("TG_QS", nr * dk if qjl else 1),  # rotated query rows; S·q rows (QJL)
        ("TG_W", 32 * ws), ("TG_J", 32 * wjs if qjl else 1),  # a tile's key then value words; its QJL words
        ("TG_NORM", norms), ("TG_GAMMA", 32), ("TG_P", nr * 32),  # per-token norms, γ; weights (row, token)
        ("TG_KEEP", min(nr, 8)), ("TG_C", kc.centroids() + vc.centroids() or 1),  # kept-token masks; staged centroids
        # keys centered before RoPE: each row's [A | B] and the np pair frequencies (tq_rope_scores)
        # and cos, sin of φ_l (8 per pair) and of a tile's θ_h (5 blocks per pair): tq_rope_stage_*
        ("NP", np), ("TG_R", 2 * nr * np or 1), ("TG_F", np or 1), ("TG_RL", 2 * 8 * np or 1),
        ("TG_RH", 2 * 5 * np or 1),
    ]


def _partial_tg_bytes(layout: list[tuple[str, int]]) -> int:
    return 4 * sum(v for k, v in layout if k.startswith("TG_"))


def _rows_per_threadgroup(rl: int, dk: int, dv: int, kc: _Codes, vc: _Codes, qjl: bool, np: int = 0) -> int:
    """Query rows pass 1 handles per threadgroup: all R·L rows if they fit (codes read once), else chunks."""
    nr = min(64, _pow2_ceil(rl))
    while nr > 1 and _partial_tg_bytes(_partial_layout(nr, dk, dv, kc, vc, qjl, np)) > THREADGROUP_MEMORY:
        nr //= 2
    return nr if _partial_tg_bytes(_partial_layout(nr, dk, dv, kc, vc, qjl, np)) <= THREADGROUP_MEMORY else 0


def _prefill_layout(nr: int, dk: int, dv: int, kc: _Codes, vc: _Codes, qjl: bool, np: int = 0
                    ) -> list[tuple[str, int]]:
    """prefill_attention.metal's layout: decode_partial's (one query array holds the model-basis rows for the
    float tokens, then the rotated rows for the codes), so the same budget rule applies."""
    return _partial_layout(nr, dk, dv, kc, vc, qjl, np)


def _prefill_rows(rl: int, dk: int, dv: int, kc: _Codes, vc: _Codes, qjl: bool, np: int = 0) -> int:
    """Query rows per prefill threadgroup (the query tile): up to 64, as many as threadgroup memory holds.
    Each compressed byte is read once per tile, so ceil(R·L / rows) times per kv head."""
    nr = min(64, _pow2_ceil(rl))
    while nr > 1 and _partial_tg_bytes(_prefill_layout(nr, dk, dv, kc, vc, qjl, np)) > THREADGROUP_MEMORY:
        nr //= 2
    return nr if _partial_tg_bytes(_prefill_layout(nr, dk, dv, kc, vc, qjl, np)) <= THREADGROUP_MEMORY else 0


# -------------------------------------------------------------------------------------------- views
def _rope_pairs(keys: StreamView) -> int:
    """RoPE pairs the attention kernels add per token (keys centered before RoPE), 0 without."""
    return 0 if keys.rope is None else n_pairs(keys.rope)


def _kv_codes(keys: StreamView, values: StreamView) -> tuple[_Codes, _Codes, bool]:
    return _codes(keys.quantizer), _codes(values.quantizer), isinstance(keys.quantizer, TurboQuantProd)


def _decayed(keys: StreamView, values: StreamView) -> bool:
    return keys.decayed is not None or values.decayed is not None


def _spans(keys: StreamView, values: StreamView) -> list[tuple[int, int, StreamView, StreamView]]:
    """The compressed tokens in spans [a, b) with one key and one value quantizer each, and each side's
    codes-only view of the span (attention.aligned_segments: decayed codes, then fresh ones; keys and values
    may change quantizer at different tokens). Without decayed codes, one span: the views themselves."""
    if not _decayed(keys, values):
        return [(0, keys.n_coded, keys, values)]
    return aligned_segments(keys, values)


def _span_codes(keys: StreamView, values: StreamView) -> tuple[tuple[_Codes, _Codes, bool], ...]:
    """Each span's code layouts (keys, values, QJL keys): one pass-1 variant per span."""
    return tuple(_kv_codes(ks, vs) for _, _, ks, vs in _spans(keys, values))


def _mx_dtype(a) -> mx.Dtype | None:
    # Views hold mx.arrays; the emulator tests also pass numpy views to exercise strided inputs.
    if isinstance(a, mx.array):
        return a.dtype
    return {"float16": mx.float16, "float32": mx.float32, "bfloat16": mx.bfloat16}.get(np.dtype(a.dtype).name)


def _float_dtype(kv: StreamView) -> mx.Dtype:
    """The dtype of a view's float tokens (float16 when it has none)."""
    held = next((a for a in (kv.sinks, kv.window) if a is not None), None)
    return mx.float16 if held is None else _mx_dtype(held)


# -------------------------------------------------------------------------------------------- masks
def _mask_kind(mask):
    """A mask's compiled variant and self-check shape: None, "causal", or (dtype, per batch, per head)."""
    if mask is None or isinstance(mask, str):
        return mask
    shape = (1,) * (4 - mask.ndim) + tuple(mask.shape)
    return str(mask.dtype), shape[0] > 1, shape[1] > 1


def _mask_inputs(mask, L: int, T: int) -> tuple[mx.array, list[tuple[str, Any]], tuple[int, int, int]]:
    """An array mask as the kernels read it: the contiguous (mb, mh, L, T) array, the MASK/MT template (1 bool,
    2 additive; 0 for None or "causal", with a dummy) and the element strides of batch, query head and query
    token (0 where the mask broadcasts). Columns are the view's tokens in order (sinks, compressed, window)."""
    if mask is None or isinstance(mask, str):
        return _dummy(mx.float32), [("MASK", 0), ("MT", mx.float32)], (0, 0, 0)
    m = mx.contiguous(mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape)))
    mb, mh = m.shape[:2]
    template = [("MASK", 1 if m.dtype == mx.bool_ else 2), ("MT", m.dtype)]
    return m, template, (mh * L * T if mb > 1 else 0, L * T if mh > 1 else 0, T)


def _sink_input(sinks) -> mx.array:
    return _dummy(mx.float32) if sinks is None else mx.contiguous(sinks.astype(mx.float32))
