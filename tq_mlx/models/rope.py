"""Pre-RoPE key centering: a layer's rotary embedding as the key stream needs it.

Keys reach the cache after RoPE: k_p = R(p) k'_p at position p. A constant part of k' (Qwen2's k_proj bias)
turns into R(p) μ0, which rotates with the position, so one mean μ after RoPE leaves most of it in the vectors
and the codes spend their bits on it (experiments/key_error.py: Qwen2.5-Coder-0.5B's score error halves when the
mean is taken before RoPE). With a `Rope`, the key stream subtracts R(p) μ0 from the key at position p, μ0
the mean of R(p)⁻¹ k_p over the calibration tokens, and adds it back: decoding adds R(p) μ0, attention adds
q·R(p) μ0 to each compressed token's score (or, in the reference with a prefill chunk's many query rows, R(p) μ0
to the tile's dequantized keys: `centers`). Subtracting and adding one vector is exact whatever it is, so a
Rope that does not match the model's costs quality, never correctness.

R(p) rotates pairs of channels (a_k, b_k) by the angle p·f_k:  a ← a cos - b sin,  b ← a sin + b cos; other
channels stay. `probe` reads the pairs and f off a model's own rope module, so mlx's traditional and split
pairings, partial rotary dims and scaled frequencies (Llama 3, YaRN, LongRoPE) all come out of one test; anything
that is not a rotation of channel pairs at angles linear in the position gives None, and the stream keeps the one
mean. What attention adds per token, for a query q:

    q·R(p) μ0 = c + Σ_k A_k cos(p f_k) + B_k sin(p f_k)
    A_k = q_a μ_a + q_b μ_b,  B_k = q_b μ_a - q_a μ_b,  c = Σ_(channels not rotated) q_j μ_j

(`bias_terms`; the attention kernels take c, A, B and f). Every path turns position p = 8h + l by θ_h + φ_l,
θ_h = (8h)·f and φ_l = l·f in float32, by angle addition: so the attention kernels need no sine per token (the
8 φ_l are staged once, the θ_h once per tile of 32 tokens), the reference evaluates n/8 + 8 sines instead of
n, and every path subtracts and adds back the same vector to rounding. The angle differs from mlx's rope's p·f
by float32 rounding (1e-2 radians at p·f = 1e5), which costs the centering nothing.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import mlx.core as mx
import numpy as np

REFINE = (64, 4096, 65536)  # positions the frequencies are re-read at
SPLIT = 8  # position p = SPLIT·h + l (the kernels' tq_rope_* helpers use the same)


class Rope(NamedTuple):
    order: mx.array  # (D,) int32: the channels as [a_1..a_P, b_1..b_P, the rest]
    freqs: mx.array  # (P,) float32: f_k, the angle per position of pair k


def n_pairs(rope: Rope) -> int:
    return rope.freqs.shape[0]


def _halves(rope: Rope, first: int, n: int):
    """cos, sin of θ_h for the blocks h that positions first .. first + n - 1 touch, (nh, P) each; cos, sin of
    φ_l, (SPLIT, P) each; and the offset of `first` in the first block."""
    h0, off = divmod(first, SPLIT)
    nh = (off + n - 1) // SPLIT + 1
    th = (mx.arange(h0, h0 + nh, dtype=mx.int32) * SPLIT).astype(mx.float32)[:, None] * rope.freqs[None]
    ph = mx.arange(SPLIT, dtype=mx.float32)[:, None] * rope.freqs[None]
    return mx.cos(th), mx.sin(th), mx.cos(ph), mx.sin(ph), off


def angles(rope: Rope, first: int, n: int) -> tuple[mx.array, mx.array]:
    """cos and sin of the pairs' angles θ_h + φ_l at positions first .. first + n - 1, (n, P) float32 each."""
    P = n_pairs(rope)
    if P == 0:  # nothing rotates
        return mx.zeros((n, 0)), mx.zeros((n, 0))
    ch, sh, cl, sl, off = _halves(rope, first, n)
    cos = (ch[:, None] * cl[None] - sh[:, None] * sl[None]).reshape(-1, P)
    sin = (sh[:, None] * cl[None] + ch[:, None] * sl[None]).reshape(-1, P)
    return cos[off : off + n], sin[off : off + n]


def _split(x: mx.array, rope: Rope) -> tuple[mx.array, mx.array, mx.array]:
    P = n_pairs(rope)
    x = mx.take(x, rope.order, axis=-1)
    return x[..., :P], x[..., P : 2 * P], x[..., 2 * P :]


def _join(a: mx.array, b: mx.array, rest: mx.array, rope: Rope) -> mx.array:
    """_split undone: the pairs' channels back in the model's order."""
    return mx.take(mx.concatenate([a, b, rest], axis=-1), mx.argsort(rope.order), axis=-1)


def pair_mean(x: mx.array, rope: Rope) -> mx.array:
    """x (..., D) with each channel pair's two entries replaced by their mean: RoPE turns a pair's energy from one
    channel to the other with the position, so per-pair statistics hold at every position."""
    a, b, rest = _split(x, rope)
    m = (a + b) / 2
    return _join(m, m, rest, rope)


def rotate(x: mx.array, rope: Rope, first: int, inverse: bool = False) -> mx.array:
    """R(p) x_t (or R(p)⁻¹ x_t) for tokens x (B, H, n, D) at positions p = first + t."""
    cos, sin = angles(rope, first, x.shape[2])
    sin = -sin if inverse else sin
    a, b, rest = _split(x, rope)
    return _join(a * cos - b * sin, a * sin + b * cos, rest, rope)


def centers(mean0: mx.array, rope: Rope, first: int, n: int) -> mx.array:
    """R(p) μ0 at positions first .. first + n - 1, (B, H, n, D) float32, for μ0 (B, H, D)."""
    m = mx.broadcast_to(mean0.astype(mx.float32)[:, :, None, :], (*mean0.shape[:2], n, mean0.shape[-1]))
    return rotate(m, rope, first)


def bias_terms(q: mx.array, mean0: mx.array, rope: Rope) -> tuple[mx.array, mx.array, mx.array]:
    """(c (B, H, R), A (B, H, R, P), B (B, H, R, P)) of queries q (B, H, R, D) and μ0 (B, H, D), float32."""
    qa, qb, qr = _split(q.astype(mx.float32), rope)
    ma, mb, mr = (x[:, :, None, :] for x in _split(mean0.astype(mx.float32), rope))
    return mx.sum(qr * mr, axis=-1), qa * ma + qb * mb, qb * ma - qa * mb


def score_bias(q: mx.array, mean0: mx.array, rope: Rope, first: int, n: int) -> mx.array:
    """q·R(p) μ0 for queries q (B, H, R, D) and positions first .. first + n - 1: (B, H, R, n) float32.
    A and B turned by each φ_l, then one product with every block's θ_h."""
    c, a, b = bias_terms(q, mean0, rope)
    if n_pairs(rope) == 0:
        return mx.broadcast_to(c[..., None], (*c.shape, n))
    ch, sh, cl, sl, off = _halves(rope, first, n)
    a, b = a[..., None, :], b[..., None, :]  # (B, H, R, 1, P) against (SPLIT, P)
    u, w = a * cl + b * sl, b * cl - a * sl  # what each φ_l makes of A and B
    bias = (u @ ch.T + w @ sh.T).swapaxes(-1, -2)  # (B, H, R, nh, SPLIT): BLAS does the per-block work
    return c[..., None] + bias.reshape(*bias.shape[:-2], -1)[..., off : off + n]


def probe(rope_fn: Callable, dim: int) -> Rope | None:
    """The Rope of a model's rope module (called as rope_fn(x, offset=p) on (B, H, L, D) tokens, as mlx-lm's
    attention calls it), or None when it is not a rotation of channel pairs at angles linear in the position."""
    try:
        eye = mx.eye(dim, dtype=mx.float32).reshape(1, dim, 1, dim)  # e_j as head j, one token
        at = {p: np.array(rope_fn(eye, offset=p).astype(mx.float32)).reshape(dim, dim) for p in (0, 1, 7, *REFINE)}
    except Exception:  # any module that does not take (x, offset=) is not one we can read
        return None
    scale = np.diag(at[0])  # YaRN-style mscale multiplies the rotated channels: divide it out
    if not (np.all(np.isfinite(scale)) and np.all(scale > 0)) or not np.allclose(at[0], np.diag(scale), atol=1e-6):
        return None
    # r[p][i, j] = R(p)[i, j]: R(p)[i, i] = cos(p f_i), R(p)[i, π(i)] = s_i sin(p f_i), every other entry 0
    r = {p: a.T / scale[None, :] for p, a in at.items()}
    idx = np.arange(dim)
    offdiag = {p: a - np.diag(np.diag(a)) for p, a in r.items()}
    # pairs from every position at once: Llama 3's slowest pairs turn by 1e-7 per token
    partner = np.argmax(sum(np.abs(o) for o in offdiag.values()), axis=1)
    rotated = np.max([np.abs(o[idx, partner]) for o in offdiag.values()], axis=0) > 1e-6
    partner = np.where(rotated, partner, idx)
    side = r[1][idx, partner]
    sign = np.where(rotated, np.where(side != 0, np.sign(side), np.sign(r[64][idx, partner])), 0.0)
    freqs = np.where(rotated, np.arctan2(np.abs(side), np.diag(r[1])), 0.0)
    for o in offdiag.values():
        o[idx, partner] = 0.0
    if (max(np.abs(o).max() for o in offdiag.values()) > 1e-5 or np.any(partner[partner] != idx)
            or np.any(sign[partner] != -sign) or np.any(np.abs(freqs[partner] - freqs) > 1e-5)
            or np.any(freqs >= np.pi / 2)):
        return None
    for p in REFINE:  # f from one position is good to float32's 1e-7; unwrapping farther ones sharpens it
        phase = np.arctan2(r[p][idx, partner] * sign, np.diag(r[p]))
        turns = np.round((p * freqs - phase) / (2 * np.pi))
        freqs = np.where(rotated, (phase + 2 * np.pi * turns) / p, 0.0)
    firsts = np.flatnonzero(sign < 0)
    rest = np.flatnonzero(sign == 0)
    order = np.concatenate([firsts, partner[firsts], rest]).astype(np.int32)
    rope = Rope(mx.array(order), mx.array(freqs[firsts].astype(np.float32)))
    # angles linear in the position: R(7) must be what the frequencies say
    expected = np.array(rotate(eye, rope, 7)).reshape(dim, dim)  # row j: R(7) e_j
    if not np.allclose(at[7] / scale[:, None], expected, atol=1e-4):
        return None
    return rope
