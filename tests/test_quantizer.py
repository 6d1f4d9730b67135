"""The paper's quantizers (tq_mlx.quant.quantizer): TurboQuantMSE's distortion at the optimum, 5- and 6-bit codes,
fractional widths and outlier channels, TurboQuantProd's unbiased inner products, seeds, dtypes, degenerate vectors,
no host sync, 8-bit norms, and bad input."""

import math

import numpy as np
import pytest

import mlx.core as mx

from tq_mlx import TurboQuantMSE, TurboQuantProd
from tq_mlx.quant.codebook import lloyd_max

D_MSE_128 = {1: 0.3609, 2: 0.1160, 3: 0.03397, 4: 0.00931}


def unit_vectors(n, d, seed=0):
    x = mx.random.normal((n, d), key=mx.random.key(seed))
    return x / mx.linalg.norm(x, axis=-1, keepdims=True)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_mse_distortion_matches_optimum(bits):
    x = unit_vectors(20_000, 128, seed=bits)
    q = TurboQuantMSE(128, bits, seed=3)
    err = mx.sum((q.dequantize(q.quantize(x)) - x) ** 2, axis=-1)
    assert float(mx.mean(err)) == pytest.approx(D_MSE_128[bits], rel=0.02)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("bits", [5, 6])
def test_mse_5_and_6_bits_match_the_codebook(d, bits):
    # One channel group, a 4-bit plane plus a 1- or 2-bit plane, at the codebook's own optimum d·C(f_X, b)
    # (about 0.0025 at 5 bits and 0.00063 at 6), and strictly between the 4- and 8-bit errors on the same vectors.
    x = unit_vectors(20_000, d, seed=30 + bits + d)
    err = {}
    for b in (4, bits, 8):
        q = TurboQuantMSE(d, b, seed=2)
        err[b] = float(mx.mean(mx.sum((q.dequantize(q.quantize(x)) - x) ** 2, axis=-1)))
    assert err[bits] == pytest.approx(lloyd_max(d, bits).mse, rel=0.02)
    assert err[4] > err[bits] > err[8]
    q = TurboQuantMSE(d, bits)
    assert [(g.dim, g.bits) for g in q.groups] == [(d, bits)]
    assert q.words == d * bits // 32 and q.bits_per_value() == pytest.approx(bits + 16 / d)  # + one fp16 norm


@pytest.mark.parametrize("bits", [5, 6])
def test_5_and_6_bit_codes_are_the_nearest_centroids(bits):
    # The binary search over 2^bits - 1 boundaries picks the nearest centroid of every rotated coordinate.
    from tq_mlx.quant.packing import unpack

    d = 96
    x = mx.random.normal((300, d), key=mx.random.key(bits))
    q = TurboQuantMSE(d, bits, seed=1)
    (g,) = q.groups
    c = q.quantize(x)
    y = np.asarray(g.rotation.forward(x / mx.linalg.norm(x, axis=-1, keepdims=True)))
    want = np.argmin(np.abs(y[..., None] - np.asarray(g.centroids)), axis=-1)
    np.testing.assert_array_equal(np.asarray(unpack(c.codes, bits, d)), want)
    np.testing.assert_array_equal(np.asarray(q.rotated_units(c)[0]), np.asarray(g.centroids)[want])


def test_check_bits_keeps_the_config_widths():
    # 5 and 6 bits are config widths now that every kernel takes them (kernels.KERNEL_BITS); 7 is not.
    from tq_mlx.quant.quantizer import CODE_BITS, MSE_BITS, QUANTIZER_BITS, check_bits

    assert CODE_BITS == (1, 2, 3, 4, 5, 6, 8) and MSE_BITS == (1, 2, 2.5, 3, 3.5, 4, 5, 6, 8)
    # the quantizer also takes the half steps keys widen by (config.key_half_steps), which no config sets
    assert QUANTIZER_BITS == (1, 2, 2.5, 3, 3.5, 4, 4.5, 5, 5.5, 6, 8)
    assert check_bits(5.0, "key_bits") == 5 and check_bits(6, "key_bits") == 6
    for bits in (7, 4.5, 9):
        with pytest.raises(ValueError, match=r"key_bits must be one of \(1, 2, 2.5, 3, 3.5, 4, 5, 6, 8\)"):
            check_bits(bits, "key_bits")
    assert check_bits(6.0, allowed=QUANTIZER_BITS) == 6 and TurboQuantMSE(64, 5.0).groups[0].bits == 5
    assert [(g.dim, g.bits) for g in TurboQuantMSE(128, 5.5).groups] == [(32, 6), (96, 5)]


def test_mse_8bit_near_lossless():
    x = unit_vectors(5000, 128)
    q = TurboQuantMSE(128, 8)
    err = float(mx.mean(mx.sum((q.dequantize(q.quantize(x)) - x) ** 2, axis=-1)))
    assert err == pytest.approx(lloyd_max(128, 8).mse, rel=0.05)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_prod_unbiased_and_variance_bound(bits):
    n, d = 40_000, 128
    x = unit_vectors(n, d, seed=10 + bits)
    y = mx.random.normal((n, d), key=mx.random.key(99 + bits))
    q = TurboQuantProd(d, bits, seed=bits)
    err = np.array(q.inner_product(y, q.quantize(x)) - mx.sum(x * y, -1), dtype=np.float64)
    se = err.std() / math.sqrt(n)
    assert abs(err.mean()) < 3 * se  # statistically zero mean
    # Theorem 2: Var <= (π/(2d))·‖y‖²·D_mse(b-1), with D_mse(0) = 1; measured per unit ‖y‖².
    v = err**2 / np.array(mx.sum(y * y, -1), dtype=np.float64) * d
    bound = math.pi / 2 * (lloyd_max(d, bits - 1).mse if bits > 1 else 1.0)
    assert v.mean() <= bound + 3 * v.std() / math.sqrt(n)
    assert v.mean() > 0.8 * bound  # and QJL is really on (a mis-scaled QJL would be far below or above)


def test_prod_dequantize_matches_inner_product():
    x = mx.random.normal((64, 64))
    y = mx.random.normal((64, 64))
    q = TurboQuantProd(64, 3, seed=5)
    c = q.quantize(x)
    np.testing.assert_allclose(
        np.array(mx.sum(y * q.dequantize(c), -1)), np.array(q.inner_product(y, c)), rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("bits", [2.5, 3.5])
def test_fractional_bits_split(bits):
    d = 128
    q = TurboQuantMSE(d, bits, seed=1)
    assert [(g.dim, g.bits) for g in q.groups] == [(32, int(bits) + 1), (96, int(bits))]
    assert q.bits_per_value() == pytest.approx(bits)  # code bits + two fp16 norms
    x = unit_vectors(20_000, d, seed=4)
    err = float(mx.mean(mx.sum((q.dequantize(q.quantize(x)) - x) ** 2, -1)))
    # Isotropic input: each group carries its share of the energy at its own group-size optimum.
    expect = (32 * lloyd_max(32, int(bits) + 1).mse + 96 * lloyd_max(96, int(bits)).mse) / 128
    assert err == pytest.approx(expect, rel=0.03)
    assert lloyd_max(128, int(bits) + 1).mse < err < lloyd_max(128, int(bits)).mse


def test_outlier_channels_get_the_extra_bit():
    d = 64
    x = mx.random.normal((4000, d))
    scale = mx.ones((d,)).at[mx.array([3, 9, 17, 40, 41, 42, 50, 63, 0, 1, 2, 4, 5, 6, 7, 8])].multiply(10.0)
    x = x * scale
    hot = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 40, 41, 42, 50, 63]
    good = TurboQuantMSE(d, 2.5, outlier_channels=hot)
    blind = TurboQuantMSE(d, 2.5, outlier_channels=list(range(20, 36)))
    e_good = float(mx.mean((good.dequantize(good.quantize(x)) - x) ** 2))
    e_blind = float(mx.mean((blind.dequantize(blind.quantize(x)) - x) ** 2))
    assert e_good < 0.8 * e_blind
    np.testing.assert_array_equal(np.array(good.outlier_channels), sorted(hot))


def test_deterministic_from_seed():
    x = mx.random.normal((10, 96))
    a, b, c = TurboQuantMSE(96, 3, seed=4), TurboQuantMSE(96, 3, seed=4), TurboQuantMSE(96, 3, seed=5)
    assert mx.array_equal(a.quantize(x).codes, b.quantize(x).codes)
    assert not mx.array_equal(a.quantize(x).codes, c.quantize(x).codes)
    p1, p2 = TurboQuantProd(96, 3, seed=4), TurboQuantProd(96, 3, seed=4)
    assert mx.array_equal(p1.quantize(x).qjl, p2.quantize(x).qjl)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
@pytest.mark.parametrize(
    "cls,bits", [(TurboQuantMSE, 3), (TurboQuantMSE, 2.5), (TurboQuantMSE, 5), (TurboQuantMSE, 6), (TurboQuantProd, 3)]
)
def test_dtypes_and_leading_shapes(dtype, cls, bits):
    x = mx.random.normal((2, 3, 5, 128), key=mx.random.key(3)).astype(dtype)  # fixed: rel sits near its bound
    q = cls(128, bits, seed=1)
    c = q.quantize(x)
    assert c.codes.dtype == mx.uint32 and c.codes.shape[:3] == (2, 3, 5)
    assert c.norms.dtype == mx.float16
    xh = q.dequantize(c)
    assert xh.dtype == mx.float32 and xh.shape == x.shape
    x32 = x.astype(mx.float32)
    rel = float(mx.sum((xh - x32) ** 2) / mx.sum(x32 * x32))
    assert rel < 0.2
    # Same codes whatever the input dtype once the values are equal.
    assert mx.array_equal(q.quantize(x32).codes, c.codes)


@pytest.mark.parametrize(
    "cls,bits",
    [(TurboQuantMSE, 4), (TurboQuantMSE, 3.5), (TurboQuantMSE, 5), (TurboQuantMSE, 6), (TurboQuantProd, 2),
     (TurboQuantProd, 1)],
)
def test_zero_and_nonfinite_vectors_are_isolated(cls, bits):
    x = mx.random.normal((6, 64), key=mx.random.key(7))
    x = x.at[1].multiply(0.0)
    x = x.at[3, 5].add(float("nan"))
    x = x.at[4, 0].add(float("inf"))
    q = cls(64, bits)
    keep = mx.array([0, 2, 5])
    clean_codes = q.quantize(x[keep])
    codes = q.quantize(x)
    out = q.dequantize(codes)
    assert mx.array_equal(out[1], mx.zeros((64,)))  # exact zeros, no NaN
    # The other rows' codes are exactly those they get without the bad rows beside them ...
    for got, want in zip(codes, clean_codes):
        assert mx.array_equal(got[keep], want)
    # ... and so are their values, up to the last bit a BLAS matmul may round differently for 6 rows than for 3.
    assert mx.allclose(out[keep], q.dequantize(clean_codes), rtol=1e-6, atol=1e-6)


def test_no_host_sync_inside_quantize():
    # Evaluating an array is forbidden while mx.compile traces, so this fails if quantize syncs.
    x = mx.random.normal((4, 128))
    for q in (TurboQuantMSE(128, 3), TurboQuantMSE(128, 2.5), TurboQuantMSE(128, 6), TurboQuantProd(128, 3),
              TurboQuantMSE(128, 3.5, trellis=True)):
        f = mx.compile(lambda a, q=q: q.dequantize(q.quantize(a)))
        assert mx.allclose(f(x), q.dequantize(q.quantize(x)), atol=1e-5)


@pytest.mark.parametrize(
    "args,match",
    [
        ((8, 2), "dim must be an integer >= 16"),
        ((128, 7), r"bits must be one of \(1, 2, 2.5, 3, 3.5, 4, 4.5, 5, 5.5, 6, 8\)"),
        ((128, 6.5), "bits must be one of"),
        ((128, 1.5), "bits must be one of"),
        ((40, 2.5), "divisible by 4 and >= 64"),
        ((66, 3.5), "divisible by 4"),
    ],
)
def test_bad_construction(args, match):
    with pytest.raises(ValueError, match=match):
        TurboQuantMSE(*args)


def test_bad_prod_bits():
    with pytest.raises(ValueError, match=r"TurboQuantProd bits must be one of \(1, 2, 3, 4\)"):
        TurboQuantProd(128, 8)
    with pytest.raises(ValueError, match="outlier_channels"):
        TurboQuantMSE(64, 3, outlier_channels=[1, 2])
    with pytest.raises(ValueError, match="16 distinct channel indices"):
        TurboQuantMSE(64, 2.5, outlier_channels=[0] * 16)


@pytest.mark.parametrize(
    "x,match",
    [
        (mx.zeros((3, 64)), "last axis must be dim=128"),
        (mx.zeros((3, 128), dtype=mx.int32), "float16, bfloat16 or float32"),
        (mx.zeros(()), "last axis"),
        (np.zeros((3, 128), np.float32), "expected an mx.array"),
    ],
)
def test_bad_input(x, match):
    for q in (TurboQuantMSE(128, 4), TurboQuantProd(128, 4)):
        with pytest.raises(ValueError, match=match):
            q.quantize(x)


# --- 8-bit norms: one-byte log codes, fine (int8, 32 steps an octave) and coarse (uint8, 16) -----------------------
def test_uint8_norms_are_a_log_code_within_2_2_percent():
    from tq_mlx.quant.quantizer import load_norms, saturate

    n = mx.array(np.geomspace(2.0**-7.9, 2.0**7.8, 4001).astype(np.float32))
    back = load_norms(saturate(n, mx.uint8))
    rel = np.abs(np.asarray(back) / np.asarray(n) - 1)
    assert rel.max() <= 2 ** (1 / 32) - 1 + 1e-6 and 0.01 < math.sqrt((rel**2).mean()) < 0.014
    special = mx.array([0.0, 1e-9, float("inf"), 1e9, float("nan")])
    codes = saturate(special, mx.uint8)
    assert codes.dtype == mx.uint8 and codes.tolist() == [0, 0, 254, 254, 255]
    out = np.asarray(load_norms(codes))
    assert out[0] == out[1] == 0 and out[2] == out[3] == 2 ** (126 / 16) and np.isnan(out[4])


def test_int8_norms_are_a_log_code_within_1_1_percent_over_their_range():
    from tq_mlx.quant.quantizer import load_norms, saturate

    # 2^-3.47 .. 2^4.44: the scaled norms measured on SmolLM2 and both Qwen models span 2^-3.4 .. 2^2.3
    n = mx.array(np.geomspace(2.0**-3.45, 2.0**4.4, 4001).astype(np.float32))
    back = load_norms(saturate(n, mx.int8))
    rel = np.abs(np.asarray(back) / np.asarray(n) - 1)
    assert rel.max() <= 2 ** (1 / 64) - 1 + 1e-6 and 0.005 < math.sqrt((rel**2).mean()) < 0.007
    # zero below half the smallest code; saturating at both ends; 127 is not a number
    special = mx.array([0.0, 2.0**-4.6, 2.0**-4.2, float("inf"), 1e9, float("nan")])
    codes = saturate(special, mx.int8)
    assert codes.dtype == mx.int8 and codes.tolist() == [-128, -128, -127, 126, 126, 127]
    out = np.asarray(load_norms(codes))
    assert out[0] == out[1] == 0 and out[2] == pytest.approx(2 ** (-127 / 32 + 0.5))
    assert out[3] == out[4] == pytest.approx(2 ** (126 / 32 + 0.5)) and np.isnan(out[5])


@pytest.mark.parametrize("bits", [2, 3, 3.5, 5, 6])
def test_log_code_norms_add_little_to_the_reconstruction_error(bits):
    x = mx.array(np.random.default_rng(4).standard_normal((4000, 64)).astype(np.float32)) * 1.7
    err = {}
    for dtype in (mx.float16, mx.int8, mx.uint8):
        q = TurboQuantMSE(64, bits, seed=1, norm_dtype=dtype)
        c = q.quantize(x)
        assert c.norms.dtype == dtype
        err[dtype] = float(mx.mean(mx.sum((q.dequantize(c) - x) ** 2, axis=-1) / mx.sum(x * x, axis=-1)))
        assert q.bits_per_value() == pytest.approx(q.words * 32 / 64 + 8 * dtype.size * len(q.groups) / 64)
    # The coarse code's 1.25% RMS adds ~1.6e-4 of |x|² to a squared error of 0.03-0.12 |x|² (2-3.5 bits), but of
    # 0.0024 and 0.0006 |x|² at 5 and 6 bits: a 6-bit code with a uint8 norm errs about a quarter more; the fine
    # code adds a quarter of that.
    assert err[mx.float16] < err[mx.int8] < err[mx.uint8] < err[mx.float16] * 1.01 + 2.5e-4, err
    if bits >= 5:
        assert err[mx.uint8] - err[mx.float16] == pytest.approx((2 ** (1 / 32) - 1) ** 2 / 3, rel=0.25), err
        assert err[mx.int8] - err[mx.float16] == pytest.approx((2 ** (1 / 64) - 1) ** 2 / 3, rel=0.3), err


def test_the_fine_norm_code_halves_the_error_a_norm_gives_a_keys_logit():
    # A key's stored norm scales its whole logit q·k: on the queries that read a key most (q along k) that error is
    # the norm's relative error, as large as 5-bit codes' own there with the coarse code; the fine one halves it.
    # norms 2^-1 .. 2^2, as a stream's scale (calibration.calibration_scale) leaves them
    rng = np.random.default_rng(5)
    k = rng.standard_normal((2000, 128)).astype(np.float32) / math.sqrt(128)
    k *= 2.0 ** rng.uniform(-1, 2, (2000, 1)).astype(np.float32)
    err = {}
    for dtype in (mx.float16, mx.int8, mx.uint8):
        q = TurboQuantMSE(128, 5, seed=2, norm_dtype=dtype, correct_norms=True)
        back = np.asarray(q.dequantize(q.quantize(mx.array(k))))
        unit = k / np.linalg.norm(k, axis=-1, keepdims=True)
        err[dtype] = float(np.sqrt(np.mean((np.sum(unit * (back - k), -1) / np.linalg.norm(k, axis=-1)) ** 2)))
    assert err[mx.float16] < 0.002 < err[mx.int8] < 0.0075 < err[mx.uint8] < 0.0135, err
    assert err[mx.int8] < 0.55 * err[mx.uint8], err


def test_norm_dtype_is_checked():
    with pytest.raises(ValueError, match="norm_dtype must be float16, bfloat16, float32, uint8 or int8"):
        TurboQuantMSE(64, 4, norm_dtype=mx.int16)


@pytest.mark.parametrize("bits", [1, 2, 2.5, 3, 4, 6])
def test_corrected_norms_decode_to_the_tokens_norms_with_the_same_codes(bits):
    # correct_norms stores |x| / |c[idx]|: the decoded vector's norm is the token's (float32 norms: exactly, up to
    # rounding), its codes (and with one group its direction) are the plain quantizer's; a zero vector stays zero.
    x = mx.random.normal((4, 9, 64), key=mx.random.key(int(4 * bits)))
    x = mx.concatenate([x, mx.zeros((4, 1, 64))], axis=1)
    q = TurboQuantMSE(64, bits, seed=2, norm_dtype=mx.float32, correct_norms=True)
    plain = TurboQuantMSE(64, bits, seed=2, norm_dtype=mx.float32)
    c, p = q.quantize(x), plain.quantize(x)
    assert np.array_equal(np.asarray(c.codes), np.asarray(p.codes))
    got, base = np.asarray(q.dequantize(c)), np.asarray(plain.dequantize(p))
    want = np.linalg.norm(np.asarray(x), axis=-1)
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), want, rtol=1e-5, atol=1e-6)
    assert (np.linalg.norm(base, axis=-1)[:, :9] / want[:, :9]).mean() < 1  # Lloyd-Max codes shrink on average
    if bits == int(bits):  # one group: the same direction (two groups are each scaled to their own norm)
        cos = (got * base).sum(-1)[:, :9] / np.linalg.norm(got, axis=-1)[:, :9] / np.linalg.norm(base, axis=-1)[:, :9]
        np.testing.assert_allclose(cos, 1.0, atol=1e-5)
    assert not np.asarray(got[:, 9]).any()
