"""The kernels' self-checks: before a kernel variant is first used it runs once on a small random input against
its reference; a compile error, an exception or a disagreement disables that variant, warns once with the reason,
and the reference takes over. Never a silent wrong answer.

Here too: the tolerances (`_mismatch`, `_codes_mismatch`) and the small random views and masks the checks run on.
A mask's dtype and broadcast, learned sinks and keys being the values are part of a checked variant.
"""

from __future__ import annotations

import warnings
from typing import Callable

import numpy as np

import mlx.core as mx

from .reference import keys_are_values
from ..quant.packing import unpack
from ..quant.quantizer import FLOAT_DTYPES, TurboQuantProd, load_norms
from ..stream.view import StreamView
from . import launch
from .codes import encode_reference
from .launch import KERNEL_NAMES, _decayed, _float_dtype, _mse

SELF_CHECK_POSITION = 100_003  # where self-checks put keys centered before RoPE: angles of 1e5 radians
_checks: dict[tuple, str | None] = {}  # (kernel, variant, factory, sources) -> None if passed, else why not


def reset_self_checks() -> None:
    """Forget self-check results (tests; a new kernel factory or source is checked again anyway)."""
    _checks.clear()


def self_check_status() -> dict[tuple, str | None]:
    """(kernel, variant) -> None if the variant passed its self-check, else the reason it is disabled."""
    return {k[:2]: v for k, v in _checks.items()}


_TOL = {mx.float32: (2e-3, 2e-3), mx.float16: (1e-2, 1e-2), mx.bfloat16: (4e-2, 4e-2)}


def _mismatch(got, want, dtype=mx.float32) -> str | None:
    """Why `got` disagrees with the reference `want` (None: it agrees within the dtype's tolerance)."""
    g = np.asarray(got.astype(mx.float32)) if isinstance(got, mx.array) else np.asarray(got, np.float32)
    w = np.asarray(want.astype(mx.float32))
    if g.shape != w.shape:
        return f"shape {g.shape} != reference {w.shape}"
    if not np.isfinite(g).all():
        return f"{int((~np.isfinite(g)).sum())} non-finite values"
    atol, rtol = _TOL.get(dtype, _TOL[mx.float32])
    err = np.abs(g - w)
    bad = err > atol + rtol * np.abs(w)
    if bad.any():
        return f"max abs error {err.max():.3g} vs reference ({int(bad.sum())}/{bad.size} values out of tolerance)"
    return None


def _codes_mismatch(got, want, quantizer) -> str | None:
    """Encode agreement: codes may differ where a rotated value sits within rounding of a boundary."""
    prod = isinstance(quantizer, TurboQuantProd)
    groups = _mse(quantizer).groups
    gi, wi = (np.concatenate([np.asarray(unpack(c.codes[..., g.words], g.bits, g.dim)) for g in groups], axis=-1)
              for c in (got, want))
    frac = float((gi != wi).mean())
    if frac > 0.01:
        return f"{frac:.1%} of the codes differ from the reference"
    why = _mismatch(load_norms(got.norms), load_norms(want.norms), mx.float16)
    if why:
        return "norms: " + why
    if prod:
        gz, wz = (np.asarray(unpack(c.qjl, 1, quantizer.dim)) for c in (got, want))
        frac = float((gz != wz).mean())
        if frac > 0.02:
            return f"{frac:.1%} of the QJL sign bits differ from the reference"
        gg, wg = np.asarray(load_norms(got.gamma)), np.asarray(load_norms(want.gamma))
        if not np.isfinite(gg).all() or np.median(np.abs(gg - wg) / np.maximum(wg, 1e-6)) > 0.01:
            return "residual norms (gamma) differ from the reference"
    return None


def _self_check(kernel: str, variant: tuple, factory, run: Callable[[], str | None]) -> bool:
    """Run `run` (kernel vs reference on a small random input) once per kernel variant; on failure disable
    the variant and warn once."""
    key = (kernel, variant, factory, tuple(launch.SOURCES.get(n) for n in KERNEL_NAMES))
    if key not in _checks:
        try:
            reason = run()
        except Exception as e:  # a compile error in the Metal source surfaces here
            reason = f"{type(e).__name__}: {e}"
        _checks[key] = reason
        if reason:
            warnings.warn(
                f"tq_mlx Metal kernel '{kernel}' {variant} failed its self-check and is disabled; the reference "
                f"path is used instead. Reason: {reason}",
                RuntimeWarning, stacklevel=3,
            )
    return _checks[key] is None


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng([0x7C, seed])


def _normal(rng, shape, dtype=mx.float32) -> mx.array:
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def _random_view(rng, quantizer, n_sinks: int, n: int, n_window: int, like: StreamView,
                 n_decayed: int = 0) -> StreamView:
    """A small random StreamView compressed by `quantizer`, with a mean, a scale and float tokens of the
    dtype where `like` has them (for self-checks); its first n_decayed compressed tokens coded by like's decay
    quantizer."""
    D = quantizer.dim
    mean = _normal(rng, (1, 1, D)) * 0.2 if like.mean is not None else None
    scale = mx.full((1, 1), 2.0**-2) if like.scale is not None else None
    perm = mx.array(rng.permutation(D).astype(np.int32))[None] if like.perm is not None else None
    x = _normal(rng, (1, 1, n, D))
    codes = encode_reference(x[:, :, n_decayed:], quantizer, mean, perm, scale) if n > n_decayed else None
    decayed = None
    if n_decayed:
        dq = like.decayed.quantizer
        decayed = StreamView(dq, encode_reference(x[:, :, :n_decayed], dq, mean, perm, scale), None, None, mean,
                             perm, scale)  # one channel order at both ages (keys widened by a half step)
    floats = lambda k: _normal(rng, (1, 1, k, D), _float_dtype(like)) if k else None  # noqa: E731
    # keys centered before RoPE: the same pairs, at positions far enough out that the angles are large
    where = dict(rope=like.rope, position=SELF_CHECK_POSITION) if like.rope is not None else {}
    if like.weights is not None:  # query-aware key weights: the kernels' query and decode divide by them
        where["weights"] = mx.exp(_normal(rng, (1, 1, D)) * 0.5)
    if decayed is not None and where:
        decayed = decayed._replace(**where)
    return StreamView(quantizer, codes, floats(n_sinks), floats(n_window), mean, perm, scale, decayed, **where)


def _random_views(rng, keys: StreamView, values: StreamView, n_sinks: int, n: int, n_window: int, tail: int = 0):
    """Small random (keys, values) like the real ones for a self-check: the same quantizers and parts, n
    compressed tokens; with decayed codes, the same spans of one key and one value quantizer in the same order
    (each side's decayed count mapped onto n spans' worth of tokens: n per span, the last one `tail` more)."""
    same = keys_are_values(keys, values)
    if not _decayed(keys, values):
        k = _random_view(rng, keys.quantizer, n_sinks, n + tail, n_window, keys)
        return k, (k if same else _random_view(rng, values.quantizer, n_sinks, n + tail, n_window, values))
    N = keys.n_coded
    cuts = sorted({0, N, keys.n_decayed, values.n_decayed})
    total = n * (len(cuts) - 1) + tail
    small = {c: (n * i if c < N else total) for i, c in enumerate(cuts)}
    k = _random_view(rng, keys.quantizer, n_sinks, total, n_window, keys, small[keys.n_decayed])
    return k, (k if same else _random_view(rng, values.quantizer, n_sinks, total, n_window, values,
                                           small[values.n_decayed]))


def _random_mask(rng, kind, R: int, L: int, T: int):
    """A small random mask of `kind` (_mask_kind) for a self-check on one batch row of R query heads: bool
    (70% shown, the first and next-to-last tokens hidden, the last shown) or additive (scores ±2, 30% at the dtype's most negative value, as
    models fold a bool mask into an additive one)."""
    if kind is None or isinstance(kind, str):
        return kind
    dtype, _, per_head = kind
    shape = (1, R if per_head else 1, L, T)
    hidden = rng.random(shape) < 0.3
    hidden[..., 0] = hidden[..., -2] = True  # a sink token and a window token (the view has 2 and 3)
    hidden[..., -1] = False
    if dtype == str(mx.bool_):
        return mx.array(~hidden)
    dt = {str(d): d for d in FLOAT_DTYPES}[dtype]
    add = np.where(hidden, float(mx.finfo(dt).min), 2 * rng.standard_normal(shape)).astype(np.float32)
    return mx.array(add).astype(dt)
