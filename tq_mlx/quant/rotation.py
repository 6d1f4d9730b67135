"""Seeded random rotations of the last axis.

The rotation is Π = H · diag(s) with random signs s and a normalized Walsh-Hadamard matrix H, applied with
`mx.hadamard_transform` in O(d log d). MLX accepts sizes d = m·2^k with m in {1, 12, 20, 28} but does not fully
validate them (36 gives a wrong result, 60/100/144/200 corrupt the heap), so sizes are checked here first and any
other d falls back to a seeded dense random orthogonal matrix (QR of a Gaussian, the paper's own Π).

All rotations act on the last axis of a row vector x: forward(x) = Πx, inverse(y) = Πᵀy, in float32.
"""

from __future__ import annotations

import numpy as np

import mlx.core as mx

_HADAMARD_BASES = (1, 12, 20, 28)
_MAX_POW2 = 8192  # float32 limit of mx.hadamard_transform


def hadamard_base(d: int) -> int | None:
    """The m in d = m·2^k that MLX's hadamard_transform supports correctly, or None for any other d."""
    for m in _HADAMARD_BASES:
        if d % m == 0:
            k = d // m
            if k & (k - 1) == 0 and k <= _MAX_POW2 and (m > 1 or k >= 2):
                return m
    return None


def _signs(dim: int, seed: int) -> np.ndarray:
    # numpy's PCG64 is identical on every platform and back end, so the same seed gives the same Π everywhere.
    rng = np.random.default_rng([int(seed), dim, 0x5151])
    return np.where(rng.integers(0, 2, size=dim) == 1, 1.0, -1.0).astype(np.float32)


def _dense_orthogonal(dim: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng([int(seed), dim, 0x0D5E])
    q, r = np.linalg.qr(rng.standard_normal((dim, dim)))
    # Fixing the signs of R's diagonal makes Q Haar-distributed rather than biased by QR's convention.
    return (q * np.sign(np.diag(r))[None, :]).astype(np.float32)


class Rotation:
    """A seeded orthogonal rotation Π of R^dim: randomized Hadamard where MLX supports d, dense otherwise."""

    def __init__(self, dim: int, seed: int = 0, kind: str = "auto"):
        if kind not in ("auto", "hadamard", "dense"):
            raise ValueError(f"rotation kind must be 'auto', 'hadamard' or 'dense', got {kind!r}")
        base = hadamard_base(dim)
        if kind == "hadamard" and base is None:
            raise ValueError(
                f"no Hadamard transform of size {dim}: allowed sizes are m·2^k with m in {_HADAMARD_BASES}"
            )
        self.dim = dim
        self.seed = int(seed)
        self.kind = "dense" if kind == "dense" or base is None else "hadamard"
        self.base = base
        if self.kind == "hadamard":
            self.signs = mx.array(_signs(dim, seed))
            # For m = 20, 28, MLX's H is orthonormal but not symmetric, so the inverse needs Hᵀ explicitly.
            self._h_transpose = None
            if base in (20, 28):
                h = np.asarray(mx.hadamard_transform(mx.eye(dim, dtype=mx.float32)))
                self._h_transpose = mx.array(h.T.copy())
        else:
            self.matrix = mx.array(_dense_orthogonal(dim, seed))  # rows of Π

    def forward(self, x: mx.array) -> mx.array:
        """Πx along the last axis, float32."""
        x = x.astype(mx.float32)
        if self.kind == "dense":
            return x @ self.matrix.T
        return mx.hadamard_transform(x * self.signs)

    def inverse(self, y: mx.array) -> mx.array:
        """Πᵀy along the last axis, float32."""
        y = y.astype(mx.float32)
        if self.kind == "dense":
            return y @ self.matrix
        if self._h_transpose is not None:
            # hadamard_transform(x) = x @ M with M = hadamard_transform(I); so Hᵀ applied to a row is y @ Mᵀ.
            return (y @ self._h_transpose) * self.signs
        return mx.hadamard_transform(y) * self.signs

    def as_matrix(self) -> mx.array:
        """Π as a dense (dim, dim) float32 matrix (for references and tests)."""
        return self.forward(mx.eye(self.dim, dtype=mx.float32)).T
