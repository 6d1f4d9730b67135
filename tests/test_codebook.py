"""The Lloyd-Max codebooks (tq_mlx.quant.codebook): the optimality conditions at every width, the paper's published
distortions, the Shannon and Panter-Dite bounds, memoization and bad arguments."""

import numpy as np
import pytest

from tq_mlx.quant.codebook import SUPPORTED_BITS, _lloyd_scaled, cell_conditional_means, lloyd_max

# Exact optimum d·C(f_X, b) for the Beta law at d = 128 (turboquant.md §1.3), and the paper's rounded values.
EXACT_128 = {1: 0.3609, 2: 0.1160, 3: 0.03397, 4: 0.00931}


@pytest.mark.parametrize("dim", [16, 17, 64, 80, 96, 128, 256, 1000, 4096])
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_lloyd_conditions(dim, bits):
    cb = lloyd_max(dim, bits)
    c, t = cb.centroids, cb.boundaries
    assert len(c) == 2**bits and len(t) == 2**bits - 1
    assert np.all(np.diff(c) > 0)
    # Boundary = midpoint of its neighbours; centroid = conditional mean of its cell (integrated independently
    # of the solver's own iteration).
    np.testing.assert_allclose(t, 0.5 * (c[1:] + c[:-1]), atol=1e-6 / np.sqrt(dim), rtol=0)
    np.testing.assert_allclose(cell_conditional_means(dim, t), c, atol=1e-6 / np.sqrt(dim), rtol=0)
    np.testing.assert_allclose(c, -c[::-1], atol=1e-12)


def test_matches_published_tables():
    for b, v in EXACT_128.items():
        assert lloyd_max(128, b).mse == pytest.approx(v, rel=2e-3)
    # √d·c for the exact Beta codebooks (turboquant.md §1.3).
    np.testing.assert_allclose(lloyd_max(128, 2).centroids[2:] * np.sqrt(128), [0.4525, 1.5052], atol=1e-4)
    np.testing.assert_allclose(
        lloyd_max(64, 3).centroids[4:] * 8, [0.2438, 0.7507, 1.3293, 2.1113], atol=1e-4
    )
    assert lloyd_max(256, 4).centroids[-1] * 16 == pytest.approx(2.7106, abs=1e-4)
    # Large d approaches the Gaussian Lloyd-Max quantizer (Max 1960).
    assert lloyd_max(1 << 20, 2).mse == pytest.approx(0.1175, abs=2e-4)


def test_mse_within_shannon_gap():
    for b in SUPPORTED_BITS:
        mse = lloyd_max(128, b).mse
        assert 4.0**-b < mse < np.sqrt(3) * np.pi / 2 * 4.0**-b


@pytest.mark.parametrize("dim", [64, 128])
def test_wide_codebooks_approach_panter_dite(dim):
    # The widths past 4 (5 and 6 bits are quantizer widths) against an independent reference: at high
    # resolution the optimal error tends to Panter-Dite's (∫f^(1/3))³/12 · 4^-b from below, the gap about
    # halving with each bit (5 bits: ~5% below it, 6 bits: ~3%).
    u = np.linspace(-np.sqrt(dim), np.sqrt(dim), 400_001)[1:-1]  # u = x·sqrt(d), as the solver scales it
    f = (1 - u * u / dim) ** ((dim - 3) / 2)
    du = u[1] - u[0]
    f /= f.sum() * du
    panter_dite = (np.sum(f ** (1 / 3)) * du) ** 3 / 12
    gap = {b: 1 - lloyd_max(dim, b).mse * 4.0**b / panter_dite for b in range(4, 9)}
    assert all(gap[b] > 0 for b in gap)
    assert all(0.4 < gap[b + 1] / gap[b] < 0.6 for b in range(4, 8)), gap
    assert 0.04 < gap[5] < 0.07 and 0.02 < gap[6] < 0.04, gap


def test_memoized():
    lloyd_max(96, 3)
    hits = _lloyd_scaled.cache_info().hits
    lloyd_max(96, 3)
    assert _lloyd_scaled.cache_info().hits == hits + 1


@pytest.mark.parametrize("dim,bits", [(15, 2), (0, 2), (128, 9), (128, 0), (128, 2.5), (128.0, 2), (True, 2)])
def test_bad_arguments(dim, bits):
    with pytest.raises(ValueError, match="must be"):
        lloyd_max(dim, bits)
