"""Lloyd-Max scalar codebooks for one coordinate of a random unit vector.

After a random rotation, each coordinate of a unit vector in R^d has the density
f(x) ∝ (1 - x^2)^((d-3)/2) on [-1, 1] (paper Lemma 1). The MSE-optimal b-bit scalar quantizer for it is
found by Lloyd's iteration: every centroid is the conditional mean of its cell, every boundary the midpoint
of its two centroids. Everything is computed in numpy (float64) on the scaled variable u = x·sqrt(d), whose
law tends to N(0, 1), so the numbers are O(1) for every d.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import numpy as np

# Every width up to 8: the quantizers use 1-6 and 8 (quantizer.CODE_BITS); experiments/key_error.py also codes
# channel groups at 7 bits (bits ± 1 around 2-7) to measure bit allocation.
SUPPORTED_BITS = (1, 2, 3, 4, 5, 6, 7, 8)
MIN_DIM = 16

# Gauss-Legendre nodes per cell: the density is smooth inside a cell, so 64 nodes integrate it to ~1e-15.
_GL_NODES, _GL_WEIGHTS = np.polynomial.legendre.leggauss(64)
# Beyond |u| = 14 the mass is below 1e-40 for every d >= 16: truncating there changes nothing in float64.
_U_MAX = 14.0


class Codebook(NamedTuple):
    """A symmetric Lloyd-Max quantizer in the raw (unit-vector) scale."""

    centroids: np.ndarray  # (2^b,) increasing, float64
    boundaries: np.ndarray  # (2^b - 1,) midpoints between consecutive centroids
    mse: float  # d · C(f_X, b): the expected squared error of a unit vector, D_mse in the paper


def check_dim_bits(dim: int, bits: int) -> None:
    if not isinstance(dim, (int, np.integer)) or isinstance(dim, bool) or dim < MIN_DIM:
        raise ValueError(f"dim must be an integer >= {MIN_DIM}, got {dim!r}")
    if bits not in SUPPORTED_BITS or isinstance(bits, bool):
        raise ValueError(f"codebook bits must be one of {SUPPORTED_BITS}, got {bits!r}")


def _log_density(u: np.ndarray, d: int) -> np.ndarray:
    # Unnormalized log-density of u = x·sqrt(d); normalization cancels in every ratio we take.
    with np.errstate(divide="ignore"):  # log(0) = -inf at |x| = 1 is the right limit (density 0)
        return 0.5 * (d - 3) * np.log1p(-np.minimum(u * u / d, 1.0))


def _cell_moments(edges: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Zeroth, first and second moments of the density over each cell [edges[i], edges[i+1]]."""
    a, b = edges[:-1, None], edges[1:, None]
    half = 0.5 * (b - a)
    u = 0.5 * (a + b) + half * _GL_NODES[None, :]
    w = half * _GL_WEIGHTS[None, :] * np.exp(_log_density(u, d))
    return w.sum(1), (w * u).sum(1), (w * u * u).sum(1)


def _initial_centroids(n: int, d: int) -> np.ndarray:
    # Panter-Dite: optimal high-resolution point density is ∝ f^(1/3). Starting there, Lloyd needs few
    # iterations even at 256 levels, where plain quantile starts take minutes to converge.
    grid = np.linspace(-_U_MAX, _U_MAX, 200001)
    pdf = np.exp(_log_density(grid, d) / 3.0)
    cdf = np.cumsum(pdf)
    cdf /= cdf[-1]
    return np.interp((np.arange(n) + 0.5) / n, cdf, grid)


def _centroids(t: np.ndarray, d: int, umax: float) -> tuple[np.ndarray, np.ndarray]:
    m0, m1, _ = _cell_moments(np.concatenate([[-umax], t, [umax]]), d)
    return m1 / m0, m0


@lru_cache(maxsize=None)
def _lloyd_scaled(d: int, bits: int, tol: float = 1e-12, max_iter: int = 100) -> tuple:
    """Solve the Lloyd conditions in the scaled variable: returns (centroids, boundaries, d·C)."""
    n = 2**bits
    umax = min(_U_MAX, float(np.sqrt(d)))
    c = _initial_centroids(n, d)
    t = 0.5 * (c[1:] + c[:-1])
    # Newton on F(t) = t - midpoints(centroids(t)); plain Lloyd is the same fixed point but needs ~1e5
    # iterations at 256 levels. The Jacobian is tridiagonal with closed-form entries:
    # d m_i / d b_i = f(b_i)(b_i - m_i)/M0_i and d m_i / d a_i = f(a_i)(m_i - a_i)/M0_i for cell [a_i, b_i].
    for _ in range(max_iter):
        c, m0 = _centroids(t, d, umax)
        f_t = np.exp(_log_density(t, d))
        d_right = f_t * (t - c[:-1]) / m0[:-1]  # d c_k / d t_k (t_k is the right edge of cell k)
        d_left = f_t * (c[1:] - t) / m0[1:]  # d c_{k+1} / d t_k (t_k is the left edge of cell k+1)
        residual = t - 0.5 * (c[:-1] + c[1:])
        jac = np.diag(1.0 - 0.5 * (d_right + d_left))
        jac -= 0.5 * np.diag(d_left[:-1], -1)  # d c_k / d t_{k-1} enters F_k through the left edge
        jac -= 0.5 * np.diag(d_right[1:], 1)  # d c_{k+1} / d t_{k+1}
        step = np.linalg.solve(jac, residual)
        t = t - step
        t = 0.5 * (t - t[::-1])  # the density is symmetric; this removes round-off drift
        if np.max(np.abs(step)) < tol:
            break
    else:  # pragma: no cover - never seen for the supported (d, bits)
        raise RuntimeError(f"Lloyd-Max did not converge for d={d}, bits={bits}")
    c, _ = _centroids(t, d, umax)
    c = 0.5 * (c - c[::-1])
    t = 0.5 * (c[1:] + c[:-1])
    edges = np.concatenate([[-umax], t, [umax]])
    m0, m1, m2 = _cell_moments(edges, d)
    # E[(u - c_i)^2] summed over cells = d·C in the raw scale, since u = x·sqrt(d).
    mse = float(((m2 - 2 * c * m1 + c * c * m0).sum()) / m0.sum())
    return c, t, mse


def lloyd_max(dim: int, bits: int) -> Codebook:
    """The b-bit Lloyd-Max codebook for one coordinate of a uniformly random unit vector in R^dim.

    Memoized per (dim, bits). Centroids and boundaries are in the raw scale (a unit vector's coordinates).
    """
    check_dim_bits(dim, bits)
    c, t, mse = _lloyd_scaled(int(dim), int(bits))
    s = 1.0 / np.sqrt(dim)
    return Codebook(c * s, t * s, mse)


def cell_conditional_means(dim: int, boundaries: np.ndarray) -> np.ndarray:
    """E[X | X in cell] for cells split at `boundaries` (raw scale): the Lloyd centroid condition."""
    umax = min(_U_MAX, float(np.sqrt(dim)))
    edges = np.concatenate([[-umax], np.asarray(boundaries, np.float64) * np.sqrt(dim), [umax]])
    m0, m1, _ = _cell_moments(edges, dim)
    return m1 / m0 / np.sqrt(dim)
