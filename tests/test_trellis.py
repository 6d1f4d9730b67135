"""Trellis codes (tq_mlx.quant.trellis): the Viterbi encoder is optimal, the shipped codebooks are what their
training gives and code Gaussian coordinates with less error than Lloyd-Max codes of the same bits, and a
quantizer and a cache of trellis codes hold the same bytes as Lloyd-Max ones, round-trip their state and run on the
reference path (the kernels refuse them with a reason)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import mlx.core as mx

from tq_mlx import TurboQuantConfig, TurboQuantKVCache, turboquant_attention
from tq_mlx.attention import encode_unsupported
from tq_mlx.attention.support import dequantize_unsupported
from tq_mlx.layout import constant_bytes, shared_constant_bytes
from tq_mlx.quant import trellis as T
from tq_mlx.quant.codebook import lloyd_max
from tq_mlx.quant.quantizer import MSECodes, TurboQuantMSE, constant_arrays, load_norms


def _brute_force(y: np.ndarray, book: np.ndarray, bits: int) -> float:
    """The least squared error of any symbol sequence for one vector y (d,)."""
    best = np.inf
    for seq in itertools.product(range(1 << bits), repeat=y.size):
        yh = np.array(T.decode(mx.array(np.array([seq], np.uint32)), mx.array(book), bits))[0]
        best = min(best, float(np.sum((y - yh) ** 2)))
    return best


@pytest.mark.parametrize("bits, d", [(2, 5), (3, 4), (4, 3), (5, 2), (6, 2)])
def test_viterbi_finds_the_least_error_of_every_symbol_sequence(bits, d):
    rng = np.random.default_rng(bits)
    book = rng.standard_normal(1 << T.WINDOW_BITS[bits]).astype(np.float32)
    y = rng.standard_normal((3, d)).astype(np.float32)
    symbols = T.viterbi(mx.array(y), mx.array(book), bits)
    assert symbols.dtype == mx.uint32 and symbols.shape == (3, d)
    got = np.sum((y - np.array(T.decode(symbols, mx.array(book), bits))) ** 2, axis=1)
    want = [_brute_force(v, book, bits) for v in y]
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_a_coordinate_decodes_from_its_window_of_symbols():
    s = np.array([[1, 2, 3, 4, 5, 6]], np.uint32)
    idx = np.array(T.window_index(mx.array(s), 3))[0]  # 12-bit windows: four 3-bit symbols, the newest lowest
    assert idx.tolist() == [1, (1 << 3) | 2, (1 << 6) | (2 << 3) | 3, (1 << 9) | (2 << 6) | (3 << 3) | 4,
                            (2 << 9) | (3 << 6) | (4 << 3) | 5, (3 << 9) | (4 << 6) | (5 << 3) | 6]
    assert np.array(T.window_index(mx.array(s[:, :2] % 32), 5))[0].tolist() == [1, (1 << 5) | 2]


def test_bad_widths_and_codebooks_are_refused():
    with pytest.raises(ValueError, match=r"trellis codes take bits in \(2, 3, 4, 5, 6\), got 8"):
        T.window_bits(8)
    with pytest.raises(ValueError, match="a 3-bit trellis takes a codebook of 4096 entries, got shape \\(1024,\\)"):
        T.viterbi(mx.zeros((1, 4)), mx.zeros((1024,)), 3)


def test_the_shipped_codebooks_are_what_their_training_gives():
    # the 5-bit book (32 states) trains in seconds; every width is trained by the same function
    np.testing.assert_array_equal(T.train_book(5, **T.TRAINING), T.standard_book(5))
    for b in T.TRELLIS_BITS:
        book = T.standard_book(b)
        assert book.shape == (1 << T.WINDOW_BITS[b],) and book.dtype == np.float32 and np.isfinite(book).all()


@pytest.mark.parametrize("bits", T.TRELLIS_BITS)
def test_trellis_codes_err_less_than_lloyd_max_codes_of_the_same_bits(bits):
    # held-out unit vectors at head_dim 128, norms not corrected: the codes alone
    dim = 128
    g = np.random.default_rng(5).standard_normal((256, dim)).astype(np.float32)
    x = mx.array(g / np.linalg.norm(g, axis=1, keepdims=True))
    err = {}
    for trellis in (False, True):
        q = TurboQuantMSE(dim, bits, seed=2, norm_dtype=mx.float32, trellis=trellis)
        err[trellis] = float(mx.mean(mx.sum(mx.square(q.dequantize(q.quantize(x)) - x), axis=-1)))
    assert err[False] == pytest.approx(lloyd_max(dim, bits).mse, rel=0.1)  # a unit vector's MSE: a scaled coordinate's
    assert err[True] < 0.8 * err[False], err  # measured 0.57-0.69 of it
    assert err[True] > 2.0 ** (-2 * bits)  # never below the rate-distortion bound


def test_a_trellis_quantizer_holds_the_same_codes_and_its_codebooks():
    x = mx.array(np.random.default_rng(1).standard_normal((2, 3, 5, 128)).astype(np.float32))
    for bits in (3, 3.5, 4, 8):
        lm = TurboQuantMSE(128, bits, seed=4, norm_dtype=mx.int8, correct_norms=True)
        tr = TurboQuantMSE(128, bits, seed=4, norm_dtype=mx.int8, correct_norms=True, trellis=True)
        a, b = lm.quantize(x), tr.quantize(x)
        assert [(p.shape, p.dtype) for p in a] == [(p.shape, p.dtype) for p in b]
        assert tr.bits_per_value() == lm.bits_per_value()
        assert [g.trellis for g in tr.groups] == [g.bits in T.TRELLIS_BITS for g in tr.groups]
        assert constant_bytes(128, bits, trellis=True) == sum(a.nbytes for a in constant_arrays(tr)), bits
        # corrected norms: every group decodes to the token's own norm (within the int8 code's 1.1%)
        xh = tr.dequantize(b)
        np.testing.assert_allclose(np.linalg.norm(np.array(xh), axis=-1), np.linalg.norm(np.array(x), axis=-1),
                                   rtol=0.012 * len(tr.groups))


def test_recoding_trellis_codes_equals_coding_what_they_decode_to():
    x = mx.array(np.random.default_rng(2).standard_normal((1, 2, 16, 64)).astype(np.float32))
    q4, q3 = (TurboQuantMSE(64, b, seed=7, norm_dtype=mx.float32, correct_norms=True, trellis=True) for b in (4, 3))
    c = q4.quantize(x)
    np.testing.assert_allclose(np.array(q3.dequantize(q4.recode(c, q3))),
                               np.array(q3.dequantize(q3.quantize(q4.dequantize(c)))), atol=1e-5)
    zero = q3.quantize(mx.zeros((1, 64)))
    assert float(load_norms(zero.norms)[0, 0]) == 0.0 and not np.isnan(np.array(q3.dequantize(zero))).any()


def test_the_kernels_take_trellis_codes_where_they_take_lloyd_max_codes():
    x = mx.zeros((1, 1, 2, 64))
    for bits in (2, 2.5, 3, 3.5, 4, 5, 6):
        assert encode_unsupported(x, TurboQuantMSE(64, bits, trellis=True)) is None  # tests/test_kernels.py
    assert "head dim 600" in encode_unsupported(mx.zeros((1, 1, 2, 600)), TurboQuantMSE(600, 4, trellis=True))


def _fill(cache, n: int, seed: int, D: int = 64):
    rng = np.random.default_rng(seed)
    k, v = (mx.array(rng.standard_normal((1, 2, n, D)).astype(np.float32)) for _ in range(2))
    return cache.update_and_fetch(k, v)


def test_a_cache_of_trellis_codes_round_trips_its_state_and_attends_closer_to_float():
    cfg = dict(window=8, calibration_tokens=None, compress_block=8, sinks=2, key_bits=3, value_bits=3, weigh_keys=False,
               prefill_as_decode=False)
    caches = {t: TurboQuantKVCache(TurboQuantConfig(**cfg, trellis=t), layer_index=1) for t in (False, True)}
    rng = np.random.default_rng(3)
    k, v = (mx.array(rng.standard_normal((1, 2, 200, 64)).astype(np.float32)) for _ in range(2))
    q = mx.array(rng.standard_normal((1, 4, 1, 64)).astype(np.float32))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125)
    err = {}
    for t, c in caches.items():
        views = c.update_and_fetch(k, v)
        assert views[0].quantizer.trellis is t and views[1].quantizer.trellis is t
        assert dequantize_unsupported(views[1]) is None  # the kernels read trellis codes (tests/test_kernels.py)
        err[t] = float(mx.sqrt(mx.mean(mx.square(turboquant_attention(q, *views, 0.125) - want))))
    assert err[True] < err[False], err
    c = caches[True]
    # K3 and V3 share one codebook: the layer holds one trellis book where it held one Lloyd-Max set
    assert c.nbytes == caches[False].nbytes + sum(shared_constant_bytes(64, 3, trellis=True).values()) - sum(
        shared_constant_bytes(64, 3).values())
    d = TurboQuantKVCache.from_state(c.state)
    assert d.config.trellis and d.key_stream.quantizer.trellis
    k2, v2 = (mx.array(rng.standard_normal((1, 2, 9, 64)).astype(np.float32)) for _ in range(2))
    a, b = c.update_and_fetch(k2, v2), d.update_and_fetch(k2, v2)
    q2 = mx.array(rng.standard_normal((1, 4, 9, 64)).astype(np.float32))
    np.testing.assert_array_equal(np.array(turboquant_attention(q2, *a, 0.125, "causal")),
                                  np.array(turboquant_attention(q2, *b, 0.125, "causal")))


def test_the_config_takes_trellis_as_a_flag():
    with pytest.raises(ValueError, match="trellis must be True or False, got 'yes'"):
        TurboQuantConfig(trellis="yes")
    assert TurboQuantConfig.from_dict({k: v for k, v in TurboQuantConfig().to_dict().items() if k != "trellis"}) \
        == TurboQuantConfig()


def test_the_encoder_holds_one_block_of_vectors_at_a_time():
    # a block's backpointers (d x BLOCK_VECTORS x states bytes) and a few of its steps' candidates (2^L floats a
    # vector), whatever the vectors: searched all at once, a 2048-token prefill chunk of 2 kv heads held 0.6 GB
    # (and a lazy graph that kept every step's candidates, 2 GB for 1024 vectors)
    rng = np.random.default_rng(4)
    n = 8 * T.BLOCK_VECTORS
    book = mx.array(rng.standard_normal(4096).astype(np.float32))
    y = mx.array(rng.standard_normal((n, 128)).astype(np.float32))
    mx.eval(book, y)
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(T.viterbi(y, book, 3))
    back, step, out = 128 * T.BLOCK_VECTORS * 512, T.BLOCK_VECTORS * 4096 * 4, n * 128 * 4
    # measured: 51 MB above the inputs run alone (back + 8 steps); every block at once: 8 backs and steps of 8 blocks
    assert mx.get_peak_memory() - base < back + 48 * step + 4 * out, (mx.get_peak_memory() - base) / 1e6


def test_a_prefill_chunk_of_trellis_codes_holds_no_more_than_one_of_lloyd_max_codes():
    # The planner's peak (tq_mlx.planner.memory, checked against measured peaks with Lloyd-Max codes) has no term
    # for the trellis search: a 2048-token chunk's encode must hold no more than the same chunk's with Lloyd-Max
    # codes (measured: 34 MB against 81 MB; all the chunk's vectors searched at once held 558 MB)
    rng = np.random.default_rng(5)
    k, v = (mx.array(rng.standard_normal((1, 2, 2048, 128)).astype(np.float32)) for _ in range(2))
    mx.eval(k, v)
    held = {}
    for trellis in (False, True):
        cache = TurboQuantKVCache(TurboQuantConfig(trellis=trellis), layer_index=3, n_attention_layers=28)
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        mx.eval(*cache.update_and_fetch(k, v)[0].codes, *cache.held_arrays())
        held[trellis] = mx.get_peak_memory() - base
    assert held[True] <= held[False], {t: b / 1e6 for t, b in held.items()}
