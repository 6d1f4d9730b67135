"""TurboQuantKVCache: memory honesty, state, bad input, trim, calibration (μ, ν, channel order). The config, the
cache protocol, token layout, pipelining and key protection: tests/test_cache.py."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import tq_mlx
from tests.test_cache import chunks, fill
from tq_mlx import TurboQuantConfig, TurboQuantKVCache, turboquant_attention
from tq_mlx.quant.packing import packed_words
from tq_mlx.quant.rotation import hadamard_base
from tests.support.learning import learning

# the caches learn from the queries first, as the attention hook runs it (attention itself only reads)
turboquant_attention = learning(turboquant_attention)


# --- memory honesty -----------------------------------------------------------------------------


def rotation_bytes(d: int) -> int:
    base = hadamard_base(d)
    if base is None:
        return 4 * d * d  # dense orthogonal matrix
    return 4 * d + (4 * d * d if base in (20, 28) else 0)  # signs (+ explicit Hᵀ for bases 20, 28)


def table_bytes(bits: int) -> int:
    """packing.lookup_table: float32 rows of 8/bits codes per byte (3 bits: 64 rows of 2 codes)."""
    return 4 * 64 * 2 if bits == 3 else 4 * 256 * (8 // bits)


def mse_layout(d: int, bits) -> tuple[int, int, int]:
    """(code words, norms, constant bytes) per token of TurboQuant_mse(d, bits)."""
    groups = [(d, int(bits))] if bits == int(bits) else [(d // 4, int(bits) + 1), (d - d // 4, int(bits))]
    words = sum(packed_words(gd, gb) for gd, gb in groups)
    const = sum(rotation_bytes(gd) + 4 * (2 * 2**gb - 1) + table_bytes(gb) for gd, gb in groups)  # + codebook
    if len(groups) == 2:
        const += 4 * d + 4 * d  # each group's channel list + the inverse permutation
    return words, len(groups), const


def layout_nbytes(cfg: TurboQuantConfig, B: int, H: int, D: int, capacity: int, have_sinks: bool,
                  have_window: bool, float_bytes: int = 4) -> int:
    """The cache's memory, from the layout alone (nothing read from the cache). float_bytes: the input's
    dtype, which the sinks and the window keep (fill feeds float32)."""
    per_token = 0
    const = 0
    assert cfg.decay_after is None  # decaying streams hold a second code buffer (test_decay prices those)
    for bits, qjl, center in ((cfg.key_bits, cfg.qjl, cfg.center_keys), (cfg.value_bits, False, cfg.center_values)):
        # bytes of each stored norm (and QJL's γ): float16 or a uint8 log code; 8-bit codes keep float16 ones
        norm = 2 if bits >= 8 else cfg.norm_bits // 8
        if qjl:
            words, groups, c = mse_layout(D, bits - 1) if bits > 1 else (0, 0, 0)
            per_token += 4 * words + norm * groups + 4 * math.ceil(D / 32) + norm  # + sign bits + γ
            const += c + 4 * D * D  # + the Gaussian projection S
        else:
            words, groups, c = mse_layout(D, bits)
            per_token += 4 * words + norm * groups
            const += c
            if bits != int(bits):
                const += 4 * H * D  # per-head channel order
        if center:
            const += 4 * B * H * D  # μ or ν, float32
        if capacity:
            const += 4 * B * H  # the power-of-two scale, float32
    floats = 2 * float_bytes * B * H * D * (cfg.window * have_window + cfg.sinks * have_sinks)  # keys + values
    return B * H * capacity * per_token + floats + const


@pytest.mark.parametrize(
    "cfg, D",
    [
        (TurboQuantConfig(key_bits=4, value_bits=2, window=16, calibration_tokens=None, sinks=4, decay_after=None), 128),
        (TurboQuantConfig(key_bits=3, value_bits=3.5, qjl=True, window=8, calibration_tokens=None, sinks=0, center_values=False), 64),
        (TurboQuantConfig(key_bits=2.5, value_bits=8, window=0, calibration_tokens=None, sinks=2, center_keys=False), 80),
        (TurboQuantConfig(key_bits=1, value_bits=1, qjl=True, window=32, calibration_tokens=None, sinks=4), 96),
        (TurboQuantConfig(key_bits=4, value_bits=2, window=16, calibration_tokens=None, sinks=4, norm_bits=16, decay_after=None), 128),
        (TurboQuantConfig(key_bits=3, value_bits=3.5, qjl=True, window=8, calibration_tokens=None, sinks=0, norm_bits=16), 64),
    ],
)
def test_nbytes_equals_layout_formula(cfg, D):
    B, H = 2, 3
    c = TurboQuantKVCache(cfg, layer_index=3)
    fill(c, (100, 1, 1, 300), B=B, H=H, D=D)
    capacity = -(-c.n_coded // 256) * 256
    assert c.n_coded > 256 or cfg.window > 0
    assert c.nbytes == layout_nbytes(cfg, B, H, D, capacity, cfg.sinks > 0, cfg.window > 0)
    assert c.nbytes == sum(a.nbytes for a in c.held_arrays())
    # Compressed tokens exist only as codes: the float arrays with a token axis are the float window and
    # sinks (fixed sizes) and the per-token norms (at most two per vector).
    for a in c.held_arrays():
        if a.dtype in (mx.float16, mx.bfloat16, mx.float32) and a.ndim == 4:
            assert a.shape[2] in (cfg.window, cfg.sinks) or a.shape[3] <= 2, a.shape


def test_nbytes_counts_state_arrays_only_once_and_grows_in_steps():
    c = TurboQuantKVCache(TurboQuantConfig(window=0, calibration_tokens=None, sinks=0, step=64, center_values=True))
    sizes = []
    for _ in range(5):
        fill(c, (50,))
        sizes.append(c.nbytes)
    meta, arrays = c.state
    state_bytes = sum(a.nbytes for a in (*arrays["k_codes"], *arrays["v_codes"], arrays["k_mean"], arrays["v_mean"],
                                         arrays["k_scale"], arrays["v_scale"]))
    assert arrays["k_mean"].shape == arrays["v_mean"].shape == (1, 2, 64)  # keys and values centered
    assert arrays["k_scale"].shape == arrays["v_scale"].shape == (1, 2)
    const = c.nbytes - state_bytes
    # Rotation signs, codebooks and lookup tables only, at fill's D = 64: the config's quantizers and those the
    # streams decay to (held from the start though 250 tokens are far from decay_after); each quantizer its own
    # rotation, one codebook and table per width (keys and values share them).
    cfg = c.config
    assert arrays["k_decayed"] is None and arrays["v_decayed"] is None and c.n_decayed == (0, 0)
    widths = [b for b in (cfg.key_bits, cfg.value_bits, cfg.decay_key_bits, cfg.decay_value_bits) if b is not None]
    assert all(b == int(b) for b in widths) and len(set(widths)) < len(widths)
    assert const == len(widths) * rotation_bytes(64) + sum(4 * (2 * 2**b - 1) + table_bytes(b) for b in set(widths))
    # capacity in 64-token steps: 64, 128, 192, 256, 256
    per_step = (sizes[1] - sizes[0])
    assert [s - sizes[0] for s in sizes] == [0, per_step, 2 * per_step, 3 * per_step, 3 * per_step]


# --- state ------------------------------------------------------------------------------------------


def assert_continue_alike(c, d, seed: int) -> None:
    """Two caches fed the same tokens, one and six at a time, attend to the same outputs, bit for bit."""
    rng = np.random.default_rng(seed)
    for k, v in chunks(rng, (1, 6)):
        a, b = c.update_and_fetch(k, v), d.update_and_fetch(k, v)
        q = mx.array(rng.normal(size=(1, 4, k.shape[2], 64)), dtype=mx.float32)
        mask = "causal" if k.shape[2] > 1 else None
        np.testing.assert_array_equal(np.array(turboquant_attention(q, *a, 0.125, mask)),
                                      np.array(turboquant_attention(q, *b, 0.125, mask)))


@pytest.mark.parametrize("norm_bits", [16, 8])
def test_state_round_trip_is_exact(norm_bits):
    cfg = TurboQuantConfig(key_bits=3.5, value_bits=2, qjl=False, window=8, calibration_tokens=None, compress_block=4, sinks=2, seed=3,
                           norm_bits=norm_bits)
    c = TurboQuantKVCache(cfg, layer_index=4, attention_index=1, n_attention_layers=3)
    fill(c, (30, 1, 1))
    d = TurboQuantKVCache.from_state(c.state)
    assert (d.offset, d.n_sinks, d.n_coded, d.n_window, d.layer_index, d.config) == (
        c.offset, c.n_sinks, c.n_coded, c.n_window, c.layer_index, c.config)
    assert d.nbytes == c.nbytes
    assert_continue_alike(c, d, seed=9)


def test_a_state_saved_while_the_calibration_tokens_wait_round_trips():
    # window 8, calibration 24: after 20 tokens the window holds 18 (more than the window, in a buffer for 24);
    # after the first compression its buffer is the window's 8 again, in the file as in memory
    cfg = TurboQuantConfig(window=8, compress_block=4, sinks=2, calibration_tokens=24)
    c = TurboQuantKVCache(cfg)
    fill(c, (20,))
    assert (c.n_coded, c.n_window, c.key_stream.window.shape[2]) == (0, 18, 24)
    d = TurboQuantKVCache.from_state(c.state)
    assert (d.n_window, d.nbytes) == (c.n_window, c.nbytes)
    rng = np.random.default_rng(2)
    for k, v in chunks(rng, (3, 9, 1)):
        a, b = c.update_and_fetch(k, v), d.update_and_fetch(k, v)
        q = mx.array(rng.normal(size=(1, 4, k.shape[2], 64)), dtype=mx.float32)
        mask = "causal" if k.shape[2] > 1 else None
        np.testing.assert_array_equal(np.array(turboquant_attention(q, *a, 0.125, mask)),
                                      np.array(turboquant_attention(q, *b, 0.125, mask)))
    assert c.n_coded > 0 and c.key_stream.window.shape[2] == 8 and c.nbytes == d.nbytes
    e = TurboQuantKVCache.from_state(c.state)
    assert (e.n_coded, e.n_window, e.nbytes) == (c.n_coded, c.n_window, c.nbytes)


def test_eight_bit_codes_keep_float16_norms_and_older_files_with_uint8_ones_still_load(monkeypatch):
    # norm_bits=8's log code (RMS 1.25% off) is three times 8-bit codes' own error: protected keys, boundary
    # layers and K8/V8 keep float16 norms; 2-4-bit streams take the uint8 code. A file written before that
    # (8-bit codes with uint8 norms) loads with the norms it holds and continues exactly as its cache would.
    from tq_mlx.stream import codec

    cfg = TurboQuantConfig(key_bits=8, value_bits=3, window=8, calibration_tokens=None, compress_block=4, sinks=2, norm_bits=8,
                           norm_steps=16)  # the coarse code: every 8-bit file before 2026-12-06
    c = TurboQuantKVCache(cfg)
    fill(c, (30,))
    assert c.key_stream.codes.norms.dtype == mx.float16 and c.value_stream.codes.norms.dtype == mx.uint8
    monkeypatch.setattr(codec, "WIDE_BITS", 99)  # the rule before: every stream's norms in uint8
    old = TurboQuantKVCache(cfg)
    fill(old, (30,))
    assert old.key_stream.codes.norms.dtype == mx.uint8
    monkeypatch.undo()
    d = TurboQuantKVCache.from_state(old.state)
    assert d.key_stream.quantizer.norm_dtype == mx.uint8 and d.nbytes == old.nbytes
    rng = np.random.default_rng(4)
    monkeypatch.setattr(codec, "WIDE_BITS", 99)
    for k, v in chunks(rng, (1, 6)):
        a = old.update_and_fetch(k, v)
        monkeypatch.undo()
        b = d.update_and_fetch(k, v)
        monkeypatch.setattr(codec, "WIDE_BITS", 99)
        q = mx.array(rng.normal(size=(1, 4, k.shape[2], 64)), dtype=mx.float32)
        mask = "causal" if k.shape[2] > 1 else None
        np.testing.assert_array_equal(np.array(turboquant_attention(q, *a, 0.125, mask)),
                                      np.array(turboquant_attention(q, *b, 0.125, mask)))


def test_eight_bit_norms_take_the_fine_code_and_older_files_keep_the_coarse_one():
    # norm_bits 8 stores the int8 fine code (32 steps an octave) since 2026-12-06; a file whose config does not name
    # norm_steps was written with the uint8 coarse code (16 steps) and loads with it, continuing as its cache would.
    cfg = TurboQuantConfig(window=8, calibration_tokens=None, compress_block=4, sinks=2, weigh_keys=False,
                           key_output_error=None)
    assert cfg.norm_bits == 8 and cfg.norm_steps == 32
    fine = TurboQuantKVCache(cfg)
    fill(fine, (30,))
    assert fine.key_stream.codes.norms.dtype == mx.int8 and fine.value_stream.codes.norms.dtype == mx.int8
    coarse = TurboQuantKVCache(dataclasses.replace(cfg, norm_steps=16))
    fill(coarse, (30,))
    assert coarse.key_stream.codes.norms.dtype == mx.uint8 and coarse.nbytes == fine.nbytes
    meta, arrays = coarse.state
    older = dict(meta, config={k: v for k, v in meta["config"].items() if k != "norm_steps"})
    d = TurboQuantKVCache.from_state((older, arrays))
    assert d.config.norm_steps == 16 and d.key_stream.quantizer.norm_dtype == mx.uint8
    assert_continue_alike(coarse, d, seed=6)
    with pytest.raises(ValueError, match="norm_steps must be one of"):
        TurboQuantConfig(norm_steps=8)


def test_state_is_stored_references():
    c = TurboQuantKVCache(TurboQuantConfig(window=4, calibration_tokens=None, sinks=1))
    fill(c, (20,))
    meta, arrays = c.state
    assert arrays["k_window"] is c.key_stream.window and arrays["k_codes"][0] is c.key_stream.codes[0]
    assert meta["offset"] == 20


def test_empty_cache_state_round_trip():
    c = TurboQuantKVCache(TurboQuantConfig(), layer_index=2)
    assert c.empty() and c.nbytes == 0
    d = TurboQuantKVCache.from_state(c.state)
    assert d.empty() and d.layer_index == 2
    fill(d, (3,))
    assert d.offset == 3


def test_corrupted_state_raises_clear_errors():
    c = TurboQuantKVCache(TurboQuantConfig(window=4, calibration_tokens=None, sinks=1), layer_index=6)
    fill(c, (20,))
    meta, arrays = c.state

    def broken(meta_changes=None, array_changes=None):
        m = {**meta, **(meta_changes or {})}
        a = {**arrays, **(array_changes or {})}
        with pytest.raises(ValueError) as e:
            TurboQuantKVCache.from_state((m, a))
        return str(e.value)

    assert "layer 6" in broken(array_changes={"k_window": arrays["k_window"].astype(mx.int32)})
    assert "k_sinks (float32) and k_window (float16) must have one dtype" in broken(
        array_changes={"k_window": arrays["k_window"].astype(mx.float16)})
    assert "k_scale" in broken(array_changes={"k_scale": arrays["k_scale"][:, :1]})
    assert "k_codes.codes" in broken(array_changes={"k_codes": (arrays["k_codes"][0][..., :-1], arrays["k_codes"][1])})
    assert "k_mean" in broken(array_changes={"k_mean": None})
    assert "offset" in broken(meta_changes={"offset": 21})
    assert "key_bits must be one of" in broken(meta_changes={"config": {**meta["config"], "key_bits": 7}})
    assert "unknown TurboQuantConfig fields" in broken(meta_changes={"config": {**meta["config"], "bogus": 1}})
    m = dict(meta)
    del m["n_window"]
    with pytest.raises(ValueError, match="missing"):
        TurboQuantKVCache.from_state((m, arrays))
    with pytest.raises(ValueError, match=r"version 99 was written by a newer tq-mlx; this tq-mlx reads versions 1, 2"):
        TurboQuantKVCache.from_state(({**meta, "version": 99}, arrays))


DATA = Path(__file__).parent / "data"


def test_prompt_cache_files_written_before_the_stream_restructuring_still_load():
    # prompt_cache_v1.safetensors was written by tq-mlx at commit ce86924 (state version 1, one class holding
    # both sides) with mlx_lm.save_prompt_cache: K4/V3 with a window and compress block, fractional 3.5/2.5 bits
    # (channel orders), and QJL keys at 3 bits with no window. The attention outputs it gave then are in the .npz.
    caches = tq_mlx.load_prompt_cache(str(DATA / "prompt_cache_v1.safetensors"))
    expected = np.load(DATA / "prompt_cache_v1_expected.npz")
    # v1's "block" field; None meant "the window" before version 4 and is spelled out on load (window 32; the
    # third cache has no window)
    assert [c.config.compress_block for c in caches] == [16, 32, None]
    assert [(c.offset, c.n_coded) for c in caches] == [(97, 64), (97, 64), (97, 97)]
    stored = mx.load(str(DATA / "prompt_cache_v1.safetensors"))
    for i, c in enumerate(caches):
        # The codes are taken bit for bit; attention on them gives what it gave then (to float32 rounding,
        # which depends on the BLAS the matmuls run on).
        for name, a in c.state[1].items():
            for j, x in enumerate(a if isinstance(a, tuple) else (a,)):
                if x is not None:
                    key = f"{i}.1.{name}" + (f".{j}" if isinstance(a, tuple) else "")
                    assert mx.array_equal(x, stored[key]).item(), key
        got = turboquant_attention(mx.array(expected[f"q{i}"]), c.key_stream.view(), c.value_stream.view(), 0.125)
        np.testing.assert_allclose(np.array(got), expected[f"out{i}"], rtol=1e-5, atol=1e-6)
    # and they keep working: one more token goes through both streams
    k, v = c.update_and_fetch(mx.ones((1, 2, 1, 64)), mx.ones((1, 2, 1, 64)))
    assert k.n_tokens == v.n_tokens == 98


# --- bad input ----------------------------------------------------------------------------------


def test_bad_shapes_name_the_layer():
    with pytest.raises(ValueError, match=r"layer 5.*head_dim 8 is below the minimum 16"):
        TurboQuantKVCache(TurboQuantConfig(), layer_index=5, head_dim=8)
    with pytest.raises(ValueError, match=r"layer 1.*head_dim 32 at 2.5 bits"):
        TurboQuantKVCache(TurboQuantConfig.from_bits(2.5), layer_index=1, head_dim=32)
    c = TurboQuantKVCache(TurboQuantConfig(), layer_index=2)
    fill(c, (5,))
    with pytest.raises(ValueError, match=r"layer 2.*head_dim \(128, 128\)"):
        fill(c, (1,), D=128)
    with pytest.raises(ValueError, match=r"layer 2.*batch 2 and 2 kv heads"):
        fill(c, (1,), B=2)
    with pytest.raises(ValueError, match=r"layer 2"):
        c.update_and_fetch(mx.zeros((1, 2, 3, 64)), mx.zeros((1, 2, 4, 64)))


# --- trim -------------------------------------------------------------------------------------------


def test_trim_window_compressed_sinks_and_beyond():
    c = TurboQuantKVCache(TurboQuantConfig(window=8, calibration_tokens=None, compress_block=4, sinks=3))
    fill(c, (40,))
    assert (c.n_sinks, c.n_coded, c.n_window) == (3, 32, 5)
    assert c.trim(2) == 2 and (c.n_coded, c.n_window, c.offset) == (32, 3, 38)
    assert c.trim(10) == 10 and (c.n_coded, c.n_window, c.offset) == (25, 0, 28)
    assert c.trim(26) == 26 and (c.n_sinks, c.n_coded, c.offset) == (2, 0, 2)
    assert c.trim(100) == 2 and c.offset == 0  # beyond the offset: trims what exists, as KVCache does
    assert c.trim(1) == 0
    # Refill after trimming to nothing: sinks first again, and attention works.
    kh, vh = fill(c, (12,), seed=4)
    assert (c.n_sinks, c.n_coded, c.n_window, c.offset) == (3, 4, 5, 12)
    out = turboquant_attention(mx.ones((1, 2, 12, 64)), kh, vh, 0.125, "causal")
    assert out.shape == (1, 2, 12, 64) and bool(mx.all(mx.isfinite(out)))


def test_trim_then_readd_equals_never_added():
    """What speculative decoding does: append drafts, trim the rejected ones, append again."""
    cfg = TurboQuantConfig(window=16, calibration_tokens=None, compress_block=8, sinks=2)
    rng = np.random.default_rng(1)
    data = list(chunks(rng, (20, 3, 1)))
    a, b = TurboQuantKVCache(cfg), TurboQuantKVCache(cfg)
    a.update_and_fetch(*data[0])
    b.update_and_fetch(*data[0])
    a.update_and_fetch(*data[1])
    assert a.trim(3) == 3
    ha, hb = a.update_and_fetch(*data[2]), b.update_and_fetch(*data[2])
    q = mx.array(rng.normal(size=(1, 2, 1, 64)), dtype=mx.float32)
    np.testing.assert_array_equal(np.array(turboquant_attention(q, *ha, 0.125, None)),
                                  np.array(turboquant_attention(q, *hb, 0.125, None)))


# --- calibration (μ, ν, channel order) ---------------------------------------------------------------


def _feed16(cache, x, sizes):
    """Feed float16 keys/values x (B, H, T, D) in chunks of the given sizes (float16: every path sees the same
    numbers, whether a token goes straight to the codes or waits in the float16 window first)."""
    a = 0
    for n in sizes:
        cache.update_and_fetch(x[:, :, a : a + n], -x[:, :, a : a + n])
        a += n
    mx.eval(cache.held_arrays())


@pytest.mark.parametrize("calibration", [None, 80])
@pytest.mark.parametrize("bits", [3, 3.5])
def test_calibration_does_not_depend_on_how_the_prompt_is_fed(bits, calibration):
    x = mx.array(np.random.default_rng(4).normal(1.0, 1.0, size=(1, 2, 300, 64)), dtype=mx.float16)
    cfg = TurboQuantConfig(key_bits=bits, value_bits=bits, window=32, compress_block=16, sinks=3,
                           calibration_tokens=calibration)
    caches = []
    for sizes in ([300], [100, 200], [7] * 42 + [6], [1] * 300):
        c = TurboQuantKVCache(cfg)
        _feed16(c, x, sizes)
        caches.append(c)
    first = caches[0]
    # Exactly the `window` tokens after the sinks (the calibration tokens, when more).
    end = 3 + (calibration or 32)
    np.testing.assert_allclose(np.array(first.key_stream.mean), np.array(x[:, :, 3:end].astype(mx.float32).mean(axis=2)),
                               rtol=1e-6)
    for c in caches[1:]:
        for name in ("k_mean", "v_mean", "k_perm", "v_perm"):
            a, b = first.state[1][name], c.state[1][name]
            assert (a is None) == (b is None) and (a is None or mx.array_equal(a, b).item()), name


def test_trim_below_the_compressed_tokens_recalibrates_like_a_fresh_cache():
    # A reused prompt cache that shares only its float16 sinks with the new prompt: nothing encoded with the old
    # μ, ν is left, so it must end up exactly where a fresh cache fed the new prompt does.
    x = mx.array(np.random.default_rng(5).normal(0.5, 1.0, size=(1, 2, 200, 64)), dtype=mx.float16)
    cfg = TurboQuantConfig(window=16, calibration_tokens=None, compress_block=8, sinks=2, center_values=True)  # μ and ν both recalibrate
    reused = TurboQuantKVCache(cfg)
    _feed16(reused, mx.concatenate([x[:, :, :2], -x[:, :, 2:]], axis=2), [200])  # diverges after the sinks
    assert reused.n_coded > 0 and reused.calibrated
    reused.trim(198)
    assert reused.offset == 2 and reused.n_coded == 0 and not reused.calibrated
    assert reused.key_stream.mean is None and reused.value_stream.mean is None
    _feed16(reused, x[:, :, 2:], [198])
    fresh = TurboQuantKVCache(cfg)
    _feed16(fresh, x, [2, 198])
    for a, b in zip(reused.state[1]["k_codes"], fresh.state[1]["k_codes"]):
        assert mx.array_equal(a, b).item()
    assert mx.array_equal(reused.key_stream.mean, fresh.key_stream.mean).item() and mx.array_equal(reused.value_stream.mean, fresh.value_stream.mean).item()
    # A trim that keeps compressed tokens keeps the calibration they were encoded with.
    mean = reused.key_stream.mean
    reused.trim(150)
    assert reused.n_coded > 0 and reused.calibrated and reused.key_stream.mean is mean


@pytest.mark.parametrize("bits, bad", [(4, float("nan")), (3.5, float("inf")), (3, -float("inf"))])
def test_a_non_finite_token_in_the_calibration_block_affects_only_itself(bits, bad):
    rng = np.random.default_rng(11)
    x = rng.normal(0.5, 1.0, size=(1, 2, 40, 64)).astype(np.float32)
    poisoned = x.copy()
    poisoned[:, :, 7, 5] = bad  # token 7: inside the calibration block (tokens 2..17 after 2 sinks)
    cfg = TurboQuantConfig(key_bits=bits, value_bits=bits, window=16, calibration_tokens=None, compress_block=16, sinks=2, center_values=True)
    clean, dirty = TurboQuantKVCache(cfg), TurboQuantKVCache(cfg)
    clean.update_and_fetch(mx.array(x), mx.array(x))
    kh, vh = dirty.update_and_fetch(mx.array(poisoned), mx.array(poisoned))
    finite = np.delete(x[:, :, 2:18], 5, axis=2)  # the calibration block without token 7
    for s in dirty.streams:
        np.testing.assert_allclose(np.array(s.mean), finite.mean(axis=2), rtol=1e-5, atol=1e-6)
        assert s.perm is None or np.isfinite(np.array(s.perm)).all()
    # Every other compressed token decodes as well as in a cache that never saw the bad value.
    from tq_mlx.stream.view import decode

    got = np.array(decode(kh, mx.float32))
    want = np.array(decode(clean.key_stream.view(), mx.float32))
    others = [t for t in range(got.shape[2]) if t != 5]  # compressed index 5 = token 7
    assert np.isfinite(got[:, :, others]).all()
    err_dirty = np.abs(got[:, :, others] - x[:, :, 2:2 + got.shape[2]][:, :, others]).mean()
    err_clean = np.abs(want[:, :, others] - x[:, :, 2:2 + got.shape[2]][:, :, others]).mean()
    assert err_dirty < 1.1 * err_clean
