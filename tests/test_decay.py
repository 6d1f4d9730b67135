"""Temporal decay: compressed tokens past an age are re-coded at fewer bits, in the one stream per side.

What must hold: the decayed codes are the re-coding of the fresh codes (nothing float kept, nothing re-quantized
twice), the result does not depend on how the tokens were fed, attention reads both segments exactly as
attention on their decoded tokens, and state, trim, bounds, protection and boundary layers all know it.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest

from tests.support.host_sync import forbid_host_sync
from tq_mlx import TurboQuantConfig, TurboQuantKVCache, turboquant_attention
from tq_mlx.attention.reference import aligned_segments
from tq_mlx.attention import float_tokens
from tq_mlx.layout import decayed_split, fresh_bound
from tq_mlx.plan import layer_plan
from tests.support.learning import learning

# the caches learn from the queries first, as the attention hook runs it (attention itself only reads)
turboquant_attention = learning(turboquant_attention)

D = 64
# (prefill not read as decode: the tests read what the cache holds, with queries of any count)
BASE = dict(window=64, calibration_tokens=None, compress_block=32, sinks=4, decay_after=160, decay_key_bits=3, decay_value_bits=2,
            prefill_as_decode=False)


def tokens(n, seed=0, B=1, H=2, d=D):
    rng = np.random.default_rng(seed)
    mu = rng.normal(size=(1, H, 1, d))
    k = mx.array(rng.normal(size=(B, H, n, d)) + mu, dtype=mx.float32)
    v = mx.array(rng.normal(size=(B, H, n, d)) - mu, dtype=mx.float32)
    return k, v


def feed(cache, k, v, lengths):
    out, t = None, 0
    for L in lengths:
        out = cache.update_and_fetch(k[:, :, t : t + L], v[:, :, t : t + L])
        t += L
    assert t == k.shape[2]
    return out


def cache(**kw):
    return TurboQuantKVCache(TurboQuantConfig(**{**BASE, **kw}), layer_index=2, head_dim=D)


def sdpa_on_decoded(q, kv, scale=0.125, mask=None):
    k, v = (float_tokens(x, mx.float32) for x in kv)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


# --- config -------------------------------------------------------------------------------------------------


def test_config_round_trips_and_boundary_layers_do_not_decay():
    c = TurboQuantConfig(decay_after=2048, decay_key_bits=3.0, decay_value_bits=2, boundary_layers=1)
    assert TurboQuantConfig.from_dict(c.to_dict()) == c and isinstance(c.decay_key_bits, int)
    assert layer_plan(c, 0, 4).decay_bits == (None, None) and layer_plan(c, 3, 4).decay_bits == (None, None)
    assert layer_plan(c, 1, 4).decay_bits == (3, 2)
    # The default does not decay; an age decays its keys (K4 to K3; values keep theirs), but not in its boundary
    # layers, nor with decay_after=None. Every integer width decays by one rule (keys one bit less down to 3,
    # values not unless asked); fractional, 8-bit and floor widths keep theirs, and with nothing to decay nothing does.
    assert layer_plan(TurboQuantConfig(), 1, 4).decay_bits == (None, None)
    assert layer_plan(TurboQuantConfig(decay_after=6144), 1, 4).decay_bits == (3, None)
    assert layer_plan(TurboQuantConfig(decay_after=6144, boundary_layers=1), 0, 4).decay_bits == (None, None)
    assert layer_plan(TurboQuantConfig(decay_after=None), 1, 4).decay_bits == (None, None)
    assert layer_plan(TurboQuantConfig(value_bits=4, decay_after=6144), 1, 4).decay_bits == (3, None)
    assert layer_plan(TurboQuantConfig(key_bits=5, value_bits=5, decay_after=6144), 1, 4).decay_bits == (4, None)
    assert TurboQuantConfig(key_bits=3, value_bits=3).decay_after is None
    assert TurboQuantConfig(key_bits=8, value_bits=8).decay_after is None
    assert TurboQuantConfig(key_bits=3.5, value_bits=2.5).decay_after is None
    assert TurboQuantConfig(key_bits=4, value_bits=4, qjl=True).decay_after is None
    # values decay when asked, by the same validation as keys
    assert layer_plan(TurboQuantConfig(decay_value_bits=2), 1, 4).decay_bits == (3, 2)
    d = TurboQuantConfig()
    assert TurboQuantConfig.from_dict(d.to_dict()) == d


# --- the stream ---------------------------------------------------------------------------------------------


def test_counts_follow_the_age_rule_in_whole_blocks():
    c = cache()
    k, v = tokens(700)
    seen = []
    for t in range(700):
        c.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        s = c.key_stream
        # fresh and window tokens stay within decay_after once anything decayed; decayed in whole blocks
        assert s.n_decayed % 32 == 0 and s.n_fresh % 32 == 0
        if s.n_decayed:
            assert s.n_fresh + s.n_window <= 160 and s.n_fresh >= 32
        assert s.n_fresh <= fresh_bound(160, 64, 32)
        seen.append(s.n_decayed)
    assert seen[-1] == 700 - 4 - c.key_stream.n_fresh - c.key_stream.n_window > 0
    assert c.n_decayed == (seen[-1], seen[-1]) and c.n_coded == 700 - 4 - c.n_window
    assert decayed_split(100, 64, None, 32) == 0 and decayed_split(128, 64, 160, 32) == 32 and decayed_split(128, 65, 160, 32) == 64


@pytest.mark.parametrize("lengths", [(700,), (1,) * 700, (5, 100, 1, 1, 300, 293), (200, 500)])
def test_the_result_does_not_depend_on_how_tokens_are_fed(lengths):
    k, v = tokens(700)
    one = cache()
    a = feed(one, k, v, (700,))
    other = cache()
    b = feed(other, k, v, lengths)
    assert (one.n_sinks, one.n_coded, one.n_decayed, one.n_window) == (
        other.n_sinks, other.n_coded, other.n_decayed, other.n_window)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.array(float_tokens(x, mx.float32)), np.array(float_tokens(y, mx.float32)))
    assert one.nbytes == other.nbytes


def test_decayed_codes_are_the_fresh_codes_re_coded():
    # The same tokens in a cache that does not decay: its codes of the old tokens, decoded and coded with the
    # decay quantizer, are exactly the decaying cache's decayed codes (in the quantizer's basis).
    k, v = tokens(600)
    c, plain = cache(), cache(decay_after=None, decay_key_bits=None, decay_value_bits=None)
    kv, kv_plain = c.update_and_fetch(k, v), plain.update_and_fetch(k, v)
    for side, view, ref in zip("kv", kv, kv_plain):
        n = view.n_decayed
        assert n > 0 and view.decayed.quantizer.bits == (3 if side == "k" else 2)
        old = type(ref.codes)(*(a[:, :, :n] for a in ref.codes))
        again = view.decayed.quantizer.quantize(ref.quantizer.dequantize(old))
        for x, y in zip(again, view.decayed.codes):
            np.testing.assert_array_equal(np.array(x), np.array(y))
        # the fresh tokens are untouched
        for x, y in zip(view.codes, ref.codes):
            np.testing.assert_array_equal(np.array(x), np.array(y[:, :, n:]))
        # decayed codes hold fewer bytes per token: no float copy, no fresh copy
        per_token = lambda codes: sum(a.nbytes for a in codes) // codes[0].shape[2]  # noqa: E731
        assert per_token(view.decayed.codes) < per_token(view.codes)
    held = {id(a) for a in c.held_arrays()}
    assert all(id(a) in held for a in c.key_stream.decayed)


def test_decayed_tokens_cost_accuracy_only_past_the_age():
    k, v = tokens(700)
    kv = cache().update_and_fetch(k, v)
    x = float_tokens(kv[0], mx.float32)
    err = np.sqrt(np.mean(np.array(x - k) ** 2, axis=(0, 1, 3)))
    s, d, f = 4, kv[0].n_decayed, kv[0].n_fresh
    assert err[:s].max() == 0 and err[s + d + f :].max() == 0  # sinks and window exact
    assert err[s : s + d].mean() > 1.3 * err[s + d : s + d + f].mean() > 0  # 3-bit keys worse than 4-bit


# --- attention ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sides", ["both", "keys", "values"])
@pytest.mark.parametrize("L, mask", [(1, None), (3, "causal"), (40, "causal")])
def test_attention_reads_both_segments_like_their_decoded_tokens(sides, L, mask):
    kw = {"both": {}, "keys": dict(decay_value_bits=None), "values": dict(decay_key_bits=None)}[sides]
    c = cache(**kw)
    k, v = tokens(600 + L)
    feed(c, k[:, :, :600], v[:, :, :600], (600,))
    kv = c.update_and_fetch(k[:, :, 600:], v[:, :, 600:])
    assert (kv[0].decayed is not None) == (sides != "values") and (kv[1].decayed is not None) == (sides != "keys")
    spans = aligned_segments(*kv)
    assert spans[0][0] == 0 and spans[-1][1] == kv[0].n_coded
    assert all(a < b for a, b, _, _ in spans) and len(spans) == 2
    q = mx.array(np.random.default_rng(3).normal(size=(1, 4, L, D)), dtype=mx.float32)
    got = turboquant_attention(q, *kv, 0.125, mask, tile_tokens=100)  # tiles cross the segments' boundary
    np.testing.assert_allclose(np.array(got), np.array(sdpa_on_decoded(q, kv, mask=mask)), atol=2e-5)


def test_attention_with_decay_builds_no_host_sync(monkeypatch):
    # key protection and key widths by error read one number per stream at the first compression (the tests
    # of each count it); decay itself never reads back
    c = cache(protect_factor=None, key_error=None)
    k, v = tokens(400)
    with forbid_host_sync(monkeypatch):
        for a, b in ((0, 250), (250, 251), (251, 252), (252, 400)):
            kv = c.update_and_fetch(k[:, :, a:b], v[:, :, a:b])
            out = turboquant_attention(mx.ones((1, 4, b - a, D)), *kv, 0.1, "causal" if b - a > 1 else None)
        _ = c.state, c.nbytes
    assert c.key_stream.n_decayed > 0 and out.shape == (1, 4, 148, D)


# --- state, trim, copies, bounds, protection -------------------------------------------------------------------


def test_state_round_trip_then_both_continue_alike():
    k, v = tokens(700)
    c = cache(decay_value_bits=None)
    feed(c, k[:, :, :500], v[:, :, :500], (500,))
    d = TurboQuantKVCache.from_state(c.state)
    assert (d.n_coded, d.n_decayed, d.n_window, d.nbytes) == (c.n_coded, c.n_decayed, c.n_window, c.nbytes)
    assert c.state[0]["version"] >= 6 and c.state[0]["n_decayed"] == [c.n_decayed[0], 0]
    q = mx.ones((1, 4, 1, D))
    for t in range(500, 700, 40):
        a, b = (x.update_and_fetch(k[:, :, t : t + 40], v[:, :, t : t + 40]) for x in (c, d))
    np.testing.assert_array_equal(np.array(turboquant_attention(q, *a, 0.1)), np.array(turboquant_attention(q, *b, 0.1)))


def test_state_errors_name_the_decayed_arrays():
    c = cache()
    feed(c, *tokens(500), (500,))
    meta, arrays = c.state
    with pytest.raises(ValueError, match="k_decayed.codes"):
        TurboQuantKVCache.from_state((meta, {**arrays, "k_decayed": (arrays["k_decayed"][0][:, :1],
                                                                     arrays["k_decayed"][1])}))
    with pytest.raises(ValueError, match="decayed"):
        TurboQuantKVCache.from_state(({**meta, "n_decayed": [10_000, 0]}, arrays))
    plain = {**meta, "config": {**meta["config"], "decay_after": None, "decay_key_bits": None,
                                "decay_value_bits": None}}
    with pytest.raises(ValueError, match="the config has no decay"):
        TurboQuantKVCache.from_state((plain, arrays))


def test_trim_takes_window_then_fresh_then_decayed_codes():
    k, v = tokens(700)
    c = cache()
    c.update_and_fetch(k, v)
    s = c.key_stream
    n_w, n_f, n_d = s.n_window, s.n_fresh, s.n_decayed
    c.trim(n_w + n_f + 10)
    assert (s.n_window, s.n_fresh, s.n_decayed) == (0, 0, n_d - 10) and c.calibrated
    # what is left still reads like its decoded tokens, and new tokens go to the window, then to fresh codes
    kv = c.update_and_fetch(k[:, :, :100], v[:, :, :100])
    q = mx.ones((1, 4, 1, D))
    np.testing.assert_allclose(np.array(turboquant_attention(q, *kv, 0.1)), np.array(sdpa_on_decoded(q, kv, 0.1)),
                               atol=2e-5)
    c.trim(c.offset)
    assert c.offset == 0 and not c.calibrated and c.key_stream.n_decayed == 0


def test_copies_are_independent():
    k, v = tokens(600)
    c = cache()
    feed(c, k[:, :, :400], v[:, :, :400], (400,))
    d = copy.deepcopy(c)
    c.update_and_fetch(k[:, :, 400:], v[:, :, 400:])
    assert d.offset == 400 and d.key_stream.decayed[0] is not c.key_stream.decayed[0]
    e = cache()
    feed(e, k[:, :, :400], v[:, :, :400], (400,))
    np.testing.assert_array_equal(np.array(float_tokens(d.keys_and_values()[0], mx.float32)),
                                  np.array(float_tokens(e.keys_and_values()[0], mx.float32)))


def test_a_bound_drops_decayed_tokens_first():
    c = TurboQuantKVCache(TurboQuantConfig(**BASE), layer_index=0, head_dim=D, max_size=400)
    k, v = tokens(900)
    for t in range(900):
        kv = c.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        assert kv[0].n_tokens <= 400
    s = c.key_stream
    assert c.n_dropped > 0 and s.n_decayed > 0 and s.n_fresh + s.n_window <= 160
    q = mx.ones((1, 4, 1, D))
    np.testing.assert_allclose(np.array(turboquant_attention(q, *kv, 0.1)), np.array(sdpa_on_decoded(q, kv, 0.1)),
                               atol=2e-5)


def test_protected_keys_do_not_decay_and_values_still_do():
    rng = np.random.default_rng(1)
    # keys far from the origin that barely vary along their mean direction (tests/test_cache.py::_biased_keys)
    mu = np.zeros(D)
    mu[0] = 40.0
    x = rng.normal(size=(1, 2, 600, D))
    x[..., 0] *= 0.01
    k = mx.array(x + mu, dtype=mx.float32)
    c = cache()
    kv = c.update_and_fetch(k, k)
    assert c.protected and c.key_bits == 8 and c.decay_bits == (None, 2)
    assert kv[0].decayed is None and kv[1].n_decayed > 0
    d = TurboQuantKVCache.from_state(c.state)
    assert d.protected and d.n_decayed == c.n_decayed
