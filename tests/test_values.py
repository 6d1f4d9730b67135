"""Values by their error (TurboQuantConfig.value_error, tq_mlx.stream.values): each layer's value stream measures on its
first window how much its attention outputs would move with old values re-coded at fewer bits, and decays them
to the fewest bits that keep that error under the target; the config, the choice, its independence from how the
prompt is fed, state, trim, bytes and host synchronization."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest

from tests.support.host_sync import forbid_host_sync
from tests.support.memory import config_dict, fill, held_estimate
from tests.support.tiny_models import tiny_llama
from tq_mlx.cache import held_bytes
from tq_mlx import TurboQuantConfig, TurboQuantKVCache, make_prompt_cache, turboquant_attention
from tq_mlx.config import derive_config, value_widths
from tq_mlx.layout import stream_bytes, value_error_span
from tq_mlx.planner.memory import chosen_value_widths, estimate_kv_bytes
from tq_mlx.stream.values import ValueSums
from tests.support.learning import learning

# the caches learn from the queries first, as the attention hook runs it (attention itself only reads)
turboquant_attention = learning(turboquant_attention)

D = 64
BASE = dict(value_bits=4, window=96, calibration_tokens=None, compress_block=32, sinks=4, decay_after=160)
N = 600


def data(n=N, seed=0):
    rng = np.random.default_rng(seed)
    mu = rng.normal(size=(1, 2, 1, D))
    k = mx.array(rng.normal(size=(1, 2, n, D)) + mu, dtype=mx.float32)
    v = mx.array(rng.normal(size=(1, 2, n, D)) - mu, dtype=mx.float32)
    q = mx.array(rng.normal(size=(1, 4, n, D)) * 3, dtype=mx.float32)
    return k, v, q


def cache(**kw):
    return TurboQuantKVCache(TurboQuantConfig(**{**BASE, "value_error": 0.1, **kw}), layer_index=2, head_dim=D)


def run(c, lengths, n=N, seed=0):
    """Feed c as a model's layer does, chunk by chunk, each chunk's attention after its update; the last output."""
    k, v, q = data(n, seed)
    t, out = 0, None
    for L in lengths:
        kv = c.update_and_fetch(k[:, :, t : t + L], v[:, :, t : t + L])
        out = turboquant_attention(q[:, :, t : t + L], *kv, D**-0.5, "causal" if L > 1 else None)
        mx.eval(out)
        t += L
    assert t == n
    return out


def worst_errors(monkeypatch):
    """Record the worst error per width that each choice reads back."""
    seen = []
    choose = ValueSums.choose

    def spy(self, bits):
        e = mx.sum(self.errors, axis=-1)
        seen.append(mx.max(mx.sqrt(e[..., :-1] / e[..., -1:]), axis=(0, 1)).tolist())
        return choose(self, bits)

    monkeypatch.setattr(ValueSums, "choose", spy)
    return seen


# --- config ---------------------------------------------------------------------------------------------------


def test_config_takes_value_error_and_says_what_is_allowed():
    c = TurboQuantConfig(value_bits=4, value_error=0.05)
    assert (c.value_error, c.decay_value_bits, c.decay_after) == (0.05, None, 6144)
    assert value_widths(4) == (2, 3) and value_widths(3) == (2,) and value_widths(2.5) == value_widths(8) == ()
    # values alone decay: decay_after resolves though K3 keys (at the floor) do not decay
    assert TurboQuantConfig(key_bits=3, value_error=0.1).decay_after == 6144
    assert TurboQuantConfig.from_dict(c.to_dict()) == c
    # decay_value_bits names the fewest bits they may take: V3 alone from V4
    least = TurboQuantConfig(value_bits=4, value_error=0.05, decay_value_bits=3)
    assert (least.narrowest_value_bits, c.narrowest_value_bits, value_widths(4, 3)) == (3, 2, (3,))
    assert TurboQuantConfig.from_dict(least.to_dict()) == least
    for bad, match in (({"value_error": 0}, "number > 0"), ({"value_error": "x"}, "number > 0"),
                       ({"value_bits": 2, "value_error": 0.1}, "integer value_bits of 3 to 7"),
                       ({"value_bits": 3.5, "value_error": 0.1}, "integer value_bits"),
                       ({"value_error": 0.1, "decay_value_bits": 4}, "integer below value_bits"),
                       ({"value_error": 0.1, "decay_after": None}, "needs decay_after"),
                       ({"value_error": 0.1, "window": 2, "compress_block": 1}, "window of 3 or more")):
        with pytest.raises(ValueError, match=match):
            TurboQuantConfig(**bad)
    # bits that cannot choose drop it when derived, as --tq-bits does; named fields keep it (and are checked)
    assert derive_config(c, bits=2.5).value_error is None
    assert derive_config(c, bits=3).value_error == 0.05
    with pytest.raises(ValueError, match="integer value_bits"):
        derive_config(c, bits=2.5, value_error=0.05)


def test_boundary_layers_and_float_fetches_do_not_choose():
    cfg = TurboQuantConfig(**BASE, value_error=0.1, boundary_layers=1)
    assert not TurboQuantKVCache(cfg, 0, 0, 3, head_dim=D).value_stream.value_sums
    assert TurboQuantKVCache(cfg, 1, 1, 3, head_dim=D).value_stream.value_sums is not None
    assert TurboQuantKVCache(cfg, 1, 1, 3, head_dim=D, fetch="float").value_stream.value_sums is None
    # the least they may take is no decay of its own: layers that do not choose keep their bits
    cfg = TurboQuantConfig(**BASE, value_error=0.1, decay_value_bits=3, boundary_layers=1)
    edge, floating = TurboQuantKVCache(cfg, 0, 0, 3, head_dim=D), TurboQuantKVCache(cfg, 1, 1, 3, head_dim=D, fetch="float")
    run(edge, (N,))
    k, v, _ = data()
    mx.eval(floating.update_and_fetch(k, v))  # a float fetch hands attention arrays, not views
    for c in (edge, floating):
        assert c.value_stream.decay is None and c.n_decayed == (c.n_decayed[0], 0) and c.offset == N


# --- the choice -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("target, width, least", [(0.01, 4, None), (0.12, 3, None), (0.5, 2, None), (0.5, 3, 3),
                                                  (0.01, 4, 3)])
def test_the_target_sets_the_width_and_old_values_decay_to_it(target, width, least):
    c = cache(value_error=target, decay_value_bits=least)
    run(c, (300, 300))
    assert c.value_width == width
    assert c.decay_bits[1] == (width if width < 4 else None)
    assert c.n_decayed[1] == (c.n_decayed[0] if width < 4 else 0) and c.n_decayed[0] > 0
    if width < 4:
        assert c.value_stream.decay.quantizer.bits == width


@pytest.mark.parametrize("lengths", [(N,), (50,) * 12, (100, 1, 499), (1,) * 130 + (470,)])
def test_the_choice_hardly_depends_on_how_the_prompt_is_fed(monkeypatch, lengths):
    seen = worst_errors(monkeypatch)
    c = cache()
    run(c, lengths)
    ref = cache()
    run(ref, (300, 300))
    assert len(seen) == 2 and c.value_width == ref.value_width == 3
    # the queries read keys and values as codes or floats, as the cache holds them when they come
    np.testing.assert_allclose(seen[0], seen[1], rtol=0.05)
    # tokens past the decay age are decayed whatever the feeding: one prefill decays them with its choice
    assert c.n_decayed == ref.n_decayed


# the span is the first window's: the window itself, or the calibration tokens a smaller window waits for
FIRST_WINDOWS = [{}, {"window": 32, "calibration_tokens": 96}]


@pytest.mark.parametrize("first_window", FIRST_WINDOWS, ids=["window", "calibration"])
def test_the_error_is_the_output_error_of_re_coded_old_values(first_window):
    """The sums against a direct computation: float attention of the span's queries, old values as coded at V4
    re-coded at V2 and V3."""
    c = cache(value_error=1e-9, **first_window)
    k, v, q = data()
    first, last = value_error_span(4, 96)
    sums = []
    orig = ValueSums.choose
    ValueSums.choose = lambda self, bits: (sums.append(mx.sum(self.errors, axis=-1)), orig(self, bits))[1]
    try:
        run(c, (N,))
    finally:
        ValueSums.choose = orig
    vs = c.value_stream
    keys_view, values_view = c.keys_and_values()
    from tq_mlx.stream.view import first_tokens

    kf, vf = first_tokens(keys_view, last), first_tokens(values_view, last)
    qs = q[:, :, first:last].reshape(1, 2, 2 * (last - first), D) * D**-0.5
    pos = mx.tile(mx.arange(first, last), 2)[:, None]
    p = mx.softmax(mx.where(mx.arange(last)[None] <= pos, qs @ kf.swapaxes(-1, -2), -mx.inf), axis=-1)
    o = p @ vf
    a, b = 4, 4 + 96 - 64
    old = vf[:, :, a:b]
    sc = vs.scale[:, :, None, None]
    for i, bits in enumerate((2, 3)):
        from tq_mlx.stream.codec import make_quantizer

        qb = make_quantizer(D, bits, False, vs.quantizer.seed, vs.quantizer.norm_dtype, vs.quantizer.correct_norms)
        e = p[..., a:b] @ (qb.dequantize(qb.quantize(old / sc)) * sc - old)
        np.testing.assert_allclose(np.array(sums[0][..., i]), np.array(mx.sum(e * e, axis=(2, 3))), rtol=1e-3)
    np.testing.assert_allclose(np.array(sums[0][..., 2]), np.array(mx.sum(o * o, axis=(2, 3))), rtol=1e-4)


def test_a_cache_filled_without_attention_keeps_its_value_bits():
    c = cache()
    k, v, _ = data()
    c.update_and_fetch(k, v)
    assert c.value_width is None and c.decay_bits[1] is None and c.n_decayed[1] == 0
    assert c.value_stream.value_sums.errors is None


def test_choosing_reads_back_once_and_decode_never(monkeypatch):
    c = cache(protect_factor=None, key_error=None)  # their readbacks at the first compression: tested on their own
    k, v, q = data()
    first, last = value_error_span(4, 96)
    reads = []
    choose = ValueSums.choose
    monkeypatch.setattr(ValueSums, "choose", lambda self, bits: (reads.append(1), choose(self, bits))[1])
    run_to = first + 5
    kv = c.update_and_fetch(k[:, :, :run_to], v[:, :, :run_to])
    mx.eval(turboquant_attention(q[:, :, :run_to], *kv, D**-0.5, "causal"))
    with forbid_host_sync(monkeypatch):  # the span's queries: graph only, until the last one
        for t in range(run_to, last - 1):
            kv = c.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
            out = turboquant_attention(q[:, :, t : t + 1], *kv, D**-0.5)
    mx.eval(out)
    for t in range(last - 1, last):
        kv = c.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        mx.eval(turboquant_attention(q[:, :, t : t + 1], *kv, D**-0.5))
    assert reads == [1] and c.value_width is not None
    with forbid_host_sync(monkeypatch):
        for t in range(last, 300):
            kv = c.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
            out = turboquant_attention(q[:, :, t : t + 1], *kv, D**-0.5)
    mx.eval(out)
    assert c.n_decayed[1] > 0


# --- state, copies, trim --------------------------------------------------------------------------------------


@pytest.mark.parametrize("stop", [90, 400])  # inside the span [68, 100) (sums saved), after the choice
def test_state_round_trip_then_both_continue_alike(stop):
    a = cache()
    run(a, (stop,), stop)
    meta, arrays = a.state
    assert meta["version"] >= 10 and meta["value_width"] == a.value_width
    assert (arrays["v_errors"] is not None) == (stop < 100)
    b = TurboQuantKVCache.from_state((meta, arrays))
    assert (b.value_width, b.nbytes, b.n_decayed) == (a.value_width, a.nbytes, a.n_decayed)
    k, v, q = data()
    for t in range(stop, N, 50):
        outs = []
        for c in (a, b):
            kv = c.update_and_fetch(k[:, :, t : t + 50], v[:, :, t : t + 50])
            outs.append(turboquant_attention(q[:, :, t : t + 50], *kv, D**-0.5, "causal"))
        np.testing.assert_array_equal(np.array(outs[0]), np.array(outs[1]))
    assert a.value_width == b.value_width is not None and a.n_decayed == b.n_decayed


def test_state_errors_name_what_is_wrong():
    a = cache()
    run(a, (400,), 400)
    meta, arrays = a.state
    with pytest.raises(ValueError, match="values decaying to 7 bits"):
        TurboQuantKVCache.from_state(({**meta, "value_width": 7}, arrays))
    with pytest.raises(ValueError, match="value_seen"):
        TurboQuantKVCache.from_state(({**meta, "value_seen": 3}, arrays))
    b = cache()
    run(b, (90,), 90)
    meta, arrays = b.state
    with pytest.raises(ValueError, match="v_errors"):
        TurboQuantKVCache.from_state((meta, {**arrays, "v_errors": arrays["v_errors"][..., :2, :]}))
    with pytest.raises(ValueError, match="values decaying to 3 bits"):
        TurboQuantKVCache.from_state(({**meta, "value_width": 3}, arrays))


def test_copies_choose_on_their_own():
    a = cache()
    run(a, (90,), 90)
    b = copy.deepcopy(a)
    k, v, q = data()
    kv = a.update_and_fetch(k[:, :, 90:200], v[:, :, 90:200])
    mx.eval(turboquant_attention(q[:, :, 90:200], *kv, D**-0.5, "causal"))
    assert a.value_width is not None and b.value_width is None and b.value_stream.value_sums.errors is not None


def test_trim_before_the_choice_forgets_the_sums_and_below_the_codes_forgets_the_choice():
    a = cache()
    run(a, (80, 10), 90)  # the span is [68, 100)
    a.trim(10)  # back below the queries summed: they go
    assert a.value_stream.value_seen == (68, 80)  # the sums of the queries at 80 .. 89 went
    k, v, q = data()
    kv = a.update_and_fetch(k[:, :, 80:200], v[:, :, 80:200])
    mx.eval(turboquant_attention(q[:, :, 80:200], *kv, D**-0.5, "causal"))
    ref = cache()
    run(ref, (200,), 200)
    assert a.value_width == ref.value_width is not None
    a.trim(a.offset - 4)  # no compressed token left (the sinks only): the stream chooses again
    assert a.n_coded == 0 and a.value_width is None and a.decay_bits[1] is None


# --- bytes ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("least", [None, 3])
@pytest.mark.parametrize("first_window", FIRST_WINDOWS, ids=["window", "calibration"])
def test_bytes_follow_the_choice_at_every_stage(first_window, least):
    cfg = TurboQuantConfig(**{**BASE, **first_window}, value_error=0.12, decay_value_bits=least)
    first, last = value_error_span(4, 96)
    for n in (50, first + 10, last, 300, N):
        c = TurboQuantKVCache(cfg, layer_index=2, head_dim=D)
        run(c, (n,), n)
        width = c.value_width if c.value_width is not None else 4
        assert (c.value_width is None) == (n < last)
        v = c.value_stream
        expected = stream_bytes(cfg, n, D, 4, center=False, batch=1, heads=2, narrow=width, float_bytes=4)
        assert v.nbytes == expected, n


def test_a_model_prices_the_widths_it_chose():
    model, args = tiny_llama(layers=3)
    cfg = TurboQuantConfig(value_bits=4, window=48, calibration_tokens=None, compress_block=16, step=32, decay_after=96,
                           value_error=0.08)
    for n, one_shot in ((200, True), (120, False)):
        cache = make_prompt_cache(model, cfg)
        fill(model, cache, n, one_shot)
        widths = chosen_value_widths(cache)
        assert all(w in (2, 3, 4) for w in widths), widths
        real = held_bytes(cache)
        assert held_estimate(config_dict(args), n, cfg, cache, dtype="float32") == real
        # without the widths the plan prices every layer keeping its bits: the most
        assert estimate_kv_bytes(config_dict(args), n, cfg, dtype="float32") >= real


def test_the_summary_names_each_layers_choice():
    from tq_mlx.planner.display import bits_summary

    model, _ = tiny_llama(layers=3)
    cfg = TurboQuantConfig(value_bits=4, window=48, calibration_tokens=None, compress_block=16, step=32, decay_after=96,
                           value_error=0.08)
    cache = make_prompt_cache(model, cfg)
    fill(model, cache, 200)
    text = bits_summary(cache)
    for c in cache:
        w = c.value_width
        assert f"/V4{'' if w == 4 else f'→{w}'} after 96" in text, (w, text)
    # a cache filled without attention keeps its values' bits, and says why
    bare = make_prompt_cache(model, cfg)
    k, v, _ = data(200)
    for c in bare:
        c.update_and_fetch(k, v)
    assert "(values kept: no queries seen)" in bits_summary(bare)


def test_a_converted_float_cache_does_not_choose_its_values():
    from tq_mlx.convert import converted_config

    for cfg in (TurboQuantConfig(value_bits=4, value_error=0.05), TurboQuantConfig(key_bits=3, value_bits=4, value_error=0.05),
                TurboQuantConfig(key_bits=3, value_bits=4, value_error=0.05, decay_value_bits=3)):
        c = converted_config(cfg)  # a float prompt cache holds no queries: its values follow decay_value_bits
        assert c.value_error is None and c.decay_value_bits is None
        assert c.decay_after == (None if cfg.key_bits == 3 else 6144)



# --- values by their output error (value_output_error): a width per layer at the first compression ---------------
from tq_mlx.plan import layer_bytes  # noqa: E402
from tq_mlx.stream.calibration import output_errors  # noqa: E402
from tq_mlx.stream.view import first_tokens  # noqa: E402
from tests.test_query_weights import float64_output_errors  # noqa: E402  (the keys' float64 reference serves both sides)

# sinks 2, first window 96: the span's queries are positions 66 .. 97, each reading the tokens more than 32 older as
# codes; keys keep K4 (no width of their own), so every value width is read with the same keys
VO = dict(key_bits=4, value_bits=4, window=32, calibration_tokens=96, sinks=2, compress_block=8, step=32,
          protect_factor=None, key_output_error=None, key_error=None, prefill_as_decode=False)
SPAN = (66, 98)


def vo_cache(target=None, **kw):
    return TurboQuantKVCache(TurboQuantConfig(**{**VO, "value_output_error": target, **kw}), layer_index=2, head_dim=D)


def test_value_output_error_is_validated_described_and_read_from_old_files():
    from tq_mlx.convert import converted_config
    from tq_mlx.planner.display import describe_config

    for bad in (0, -1, True, "0.1"):
        with pytest.raises(ValueError, match="value_output_error must be a number > 0"):
            TurboQuantConfig(value_output_error=bad)
    for bits in (3, 2.5, 8):
        with pytest.raises(ValueError, match="it needs value_bits above 3 and at most 6"):
            TurboQuantConfig(value_output_error=0.03, value_bits=bits)
    with pytest.raises(ValueError, match="does not go with value_error or decaying values"):
        TurboQuantConfig(value_output_error=0.03, value_error=0.05)
    with pytest.raises(ValueError, match="does not go with value_error or decaying values"):
        TurboQuantConfig(value_output_error=0.03, decay_after=512, decay_value_bits=3)
    with pytest.raises(ValueError, match="a window of 3 or more and a first window of at least"):
        TurboQuantConfig(value_output_error=0.03, window=2, calibration_tokens=None)
    with pytest.raises(ValueError, match="a window of 3 or more and a first window of at least"):
        TurboQuantConfig(value_output_error=0.03, window=32, calibration_tokens=None)
    c = TurboQuantConfig(value_output_error=0.03)
    assert TurboQuantConfig.from_dict(c.to_dict()) == c
    old = c.to_dict()
    del old["value_output_error"]  # a file from before it existed: values kept their bits
    assert TurboQuantConfig.from_dict(old).value_output_error is None
    assert "values V3 to V4 by their output error (at most 0.03), in half steps" in describe_config(c)
    assert converted_config(c).value_output_error is None  # a float prompt cache holds no queries to measure on


def test_value_output_errors_are_the_relative_output_error_of_reading_old_values_as_codes():
    rng = np.random.default_rng(3)
    k, v, q = (mx.array(rng.normal(size=s), dtype=mx.float32) for s in ((1, 2, 40, D), (1, 2, 40, D), (1, 4, 40, D)))
    c = v + mx.array(rng.normal(size=(1, 2, 40, D)) * 0.1, dtype=mx.float32)
    got = np.asarray(output_errors(q[:, :, 25:], k, [c, v], v, 3, 25, 8, side="values"))
    want = float64_output_errors(q, k, c, v, 3, 25, 40, 8, side="values")
    assert np.allclose(got[0, :, 0], want, rtol=1e-4) and np.all(got[..., 1] == 0)


def widths_errors():
    """Each width's error, computed in float64 from caches coding their values at that width alone (the same
    calibration: their codes are those the stream measures), with the keys as those caches hold them."""
    k, v, q = data(300)
    errors = {}
    for b in (3, 3.5, 4):
        c = vo_cache(None, value_bits=b)
        c.update_and_fetch(k[:, :, :100], v[:, :, :100])  # compressed, the span's tokens among them
        keys = first_tokens(c.key_stream.view(), SPAN[1])
        errors[b] = max(float64_output_errors(q, keys, first_tokens(c.value_stream.view(), SPAN[1]),
                                              v[:, :, : SPAN[1]], 2, *SPAN, 32, side="values"))
    return errors


def test_values_take_the_fewest_bits_whose_output_error_is_under_the_target():
    errors = widths_errors()
    assert errors[3] > errors[3.5] > errors[4] > 0, errors
    for b, below in ((3, None), (3.5, 3), (4, 3.5)):
        for target in (errors[b] * 1.02, 1.0 if below is None else (errors[b] + errors[below]) / 2):
            c = vo_cache(target)
            run(c, [300], n=300)
            assert c.value_bits == b and c.value_stream.widened == (b != 4), (b, target, errors)
            assert chosen_value_widths([c]) == [b] and c.key_bits == 4
    c = vo_cache(errors[4] / 2)
    run(c, [300], n=300)
    assert c.value_bits == 4  # none is under it: the widest, value_bits


@pytest.mark.parametrize("lengths", [(40, 1, 1, 100, 158), (1,) * 99 + (201,), (70, 30, 200)])
def test_the_value_width_does_not_depend_on_how_the_prompt_is_fed(lengths):
    errors = widths_errors()
    target = (errors[3.5] + errors[3]) / 2
    whole, fed = vo_cache(target), vo_cache(target)
    run(whole, [300], n=300)
    run(fed, list(lengths), n=300)
    assert whole.value_bits == fed.value_bits == 3.5
    for a, b in zip(whole.value_stream.view().codes, fed.value_stream.view().codes):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert whole.value_stream.span.queries is None and fed.value_stream.span.queries is None  # dropped once chosen


def test_value_width_state_round_trips_while_the_queries_are_held_and_after():
    errors = widths_errors()
    target = (errors[3.5] + errors[3]) / 2
    k, v, q = data(300)
    whole = vo_cache(target)
    run(whole, [300], n=300)
    for cut in (50, 85, 98, 150):
        first = vo_cache(target)
        kv = first.update_and_fetch(k[:, :, :cut], v[:, :, :cut])
        mx.eval(turboquant_attention(q[:, :, :cut], *kv, D**-0.5, "causal"))
        meta, arrays = first.state
        held = SPAN[0] < cut <= SPAN[1]  # held until the first compression chooses
        assert (arrays["v_span"] is not None) == held
        assert meta["value_span_seen"] == ([SPAN[0], cut] if held else [0, 0])
        assert meta["value_bits"] == (3.5 if cut > SPAN[1] else None)
        loaded = TurboQuantKVCache()
        loaded.state = (meta, arrays)
        kv = loaded.update_and_fetch(k[:, :, cut:], v[:, :, cut:])
        mx.eval(turboquant_attention(q[:, :, cut:], *kv, D**-0.5, "causal"))
        assert loaded.value_bits == whole.value_bits and loaded.nbytes == whole.nbytes, cut
        for a, b in zip(loaded.value_stream.view().codes, whole.value_stream.view().codes):
            assert np.array_equal(np.asarray(a), np.asarray(b)), cut
    meta, arrays = whole.state
    with pytest.raises(ValueError, match="values at 3.5 bits: V4 values take other bits only with value_output_error"):
        TurboQuantKVCache().state = (dict(meta, config=dict(meta["config"], value_output_error=None)), arrays)
    with pytest.raises(ValueError, match="values at 2 bits"):
        TurboQuantKVCache().state = (dict(meta, value_bits=2), arrays)
    first = vo_cache(target)
    kv = first.update_and_fetch(k[:, :, :85], v[:, :, :85])
    mx.eval(turboquant_attention(q[:, :, :85], *kv, D**-0.5, "causal"))
    meta, arrays = first.state
    with pytest.raises(ValueError, match="v_span: held queries, but this stream does not choose its width"):
        TurboQuantKVCache().state = (dict(meta, config=dict(meta["config"], value_output_error=None)), arrays)


def test_a_trim_forgets_the_values_held_queries_past_it_and_a_trim_to_nothing_chooses_again():
    k, v, q = data(300)
    c = vo_cache(1.0)
    kv = c.update_and_fetch(k[:, :, :90], v[:, :, :90])
    mx.eval(turboquant_attention(q[:, :, :90], *kv, D**-0.5, "causal"))
    c.trim(10)
    assert c.value_stream.span_seen == (66, 80)
    c.trim(20)
    assert c.value_stream.span_seen == (0, 0)
    whole = vo_cache(1.0)
    run(whole, [300], n=300)
    assert whole.value_bits == 3
    whole.trim(whole.offset)
    assert whole.value_bits == 4 and whole.value_stream.span.queries is None
    run(whole, [300], n=300)  # the same tokens again: the same choice
    assert whole.value_bits == 3


def test_bytes_follow_the_value_width_at_every_stage():
    k, v, q = data(300)
    for target, width in ((1.0, 3), (1e-6, 4)):
        c, t = vo_cache(target), 0
        for L in (50, 35, 13, 22, 180):
            kv = c.update_and_fetch(k[:, :, t : t + L], v[:, :, t : t + L])
            mx.eval(turboquant_attention(q[:, :, t : t + L], *kv, D**-0.5, "causal"))
            t += L
            chosen = chosen_value_widths([c])[0]
            assert chosen == (width if c.n_coded else None)
            want = layer_bytes(c.plan, t, 2, D, D, float_bytes=4, value_width=chosen, query_heads=2)
            assert c.nbytes == want, (target, t)


def test_choosing_the_value_width_reads_back_once_and_decode_never(monkeypatch):
    import tq_mlx.stream.compressed as compressed

    reads = []
    measure = compressed.CompressedStream._output_width
    monkeypatch.setattr(compressed.CompressedStream, "_output_width",
                        lambda self, *a: reads.append(self.name) or measure(self, *a))
    k, v, q = data(300)
    c = vo_cache(1.0)
    kv = c.update_and_fetch(k[:, :, :60], v[:, :, :60])
    mx.eval(turboquant_attention(q[:, :, :60], *kv, D**-0.5, "causal"))
    with forbid_host_sync(monkeypatch):  # the span's queries: graph only, until the first compression
        for t in range(60, 98):
            kv = c.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
            out = turboquant_attention(q[:, :, t : t + 1], *kv, D**-0.5)
    mx.eval(out)
    for t in range(98, 140):
        kv = c.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        mx.eval(turboquant_attention(q[:, :, t : t + 1], *kv, D**-0.5))
    assert reads == ["v"] and c.value_bits == 3
    with forbid_host_sync(monkeypatch):
        for t in range(140, 300):
            kv = c.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
            out = turboquant_attention(q[:, :, t : t + 1], *kv, D**-0.5)
    mx.eval(out)
