"""TurboQuantConfig and TurboQuantKVCache: the config, the cache protocol, token layout, pipelining (no host sync),
key protection. Memory honesty, state, trim and calibration: tests/test_cache_state.py."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from tests.support.host_sync import HostSync, forbid_host_sync
from tq_mlx import TurboQuantConfig, TurboQuantKVCache, turboquant_attention
from tq_mlx.config import KEY_ERROR, KEY_OUTPUT_ERROR, derive_config, output_error_first_window
from tq_mlx.plan import layer_plan
from tests.support.learning import learning

# the caches learn from the queries first, as the attention hook runs it (attention itself only reads)
turboquant_attention = learning(turboquant_attention)


def chunks(rng, lengths, B=1, H=2, D=64, shift=1.0):
    mu = shift * rng.normal(size=(1, H, 1, D))
    for L in lengths:
        yield (mx.array(rng.normal(size=(B, H, L, D)) + mu, dtype=mx.float32),
               mx.array(rng.normal(size=(B, H, L, D)) - mu, dtype=mx.float32))


def fill(cache, lengths, seed=0, **kw):
    out = None
    for k, v in chunks(np.random.default_rng(seed), lengths, **kw):
        out = cache.update_and_fetch(k, v)
    return out


# --- config ---------------------------------------------------------------------------------------


def test_config_defaults_and_from_bits():
    c = TurboQuantConfig()
    assert (c.key_bits, c.value_bits, c.qjl, c.center_keys, c.center_values) == (4, 4, False, "rope", False)
    assert (c.key_output_error, c.key_error) == (KEY_OUTPUT_ERROR, None)
    assert c.correct_norms is True and c.decay_after is None
    assert (c.window, c.calibration_tokens, c.sinks, c.boundary_layers, c.seed, c.step) == (128, 768, 4, 0, 0, 256)
    assert c.first_window == 768 and c.compress_block_size == 128
    assert (c.protect_factor, c.protect_bits) == (5.0, 8)
    assert (c.norm_bits, c.norm_steps) == (8, 32) and layer_plan(c).keys.norm_dtype == mx.int8
    assert c.weigh_keys is True
    assert c.compress_block is None and c.compress_block_size == 128  # at most the window:
    assert TurboQuantConfig(window=32, calibration_tokens=None).compress_block_size == 32
    d = TurboQuantConfig.from_bits(2.5, window=32, calibration_tokens=None)
    assert (d.key_bits, d.value_bits, d.window) == (2.5, 2.5, 32)
    assert TurboQuantConfig(key_bits=4.0).key_bits == 4 and isinstance(TurboQuantConfig(key_bits=4.0).key_bits, int)
    assert TurboQuantConfig.from_dict(d.to_dict()) == d
    assert TurboQuantConfig.from_dict(c.to_dict()) == c
    # a file from before weigh_keys existed coded plain keys
    old = {k: v for k, v in c.to_dict().items() if k not in ("weigh_keys", "key_error", "key_output_error")}
    assert TurboQuantConfig.from_dict(old).weigh_keys is False
    # ... and a file from before key_output_error existed kept the keys' widths by key_error alone
    old = dict(c.to_dict(), key_error=0.1)
    del old["key_output_error"]
    assert (TurboQuantConfig.from_dict(old).key_error, TurboQuantConfig.from_dict(old).key_output_error) == (0.1, None)


def test_config_keys_by_output_error_unless_asked_otherwise():
    # Left at AUTO, keys take their widths by the output error where it can be measured (weighed MSE K4 keys, a
    # window of 3 or more) and no key_error is given; else key_error's own AUTO applies
    widths = lambda c: (c.key_output_error, c.key_error)  # noqa: E731
    assert widths(TurboQuantConfig()) == (KEY_OUTPUT_ERROR, None)
    assert widths(TurboQuantConfig(key_error=0.2)) == (None, 0.2)
    assert widths(TurboQuantConfig(key_error=None)) == (None, None)  # keys keep key_bits
    assert widths(TurboQuantConfig(key_output_error=None)) == (None, KEY_ERROR)
    assert widths(TurboQuantConfig(key_output_error=0.04)) == (0.04, None)
    assert widths(TurboQuantConfig(window=2, calibration_tokens=None)) == (None, KEY_ERROR)
    # a first window that is the window itself leaves the queries of its last third no coded token to read (every
    # width would measure 0): the logit error decides, and asking for the output error there is refused
    assert widths(TurboQuantConfig(calibration_tokens=None)) == (None, KEY_ERROR)
    least = output_error_first_window(128)
    assert widths(TurboQuantConfig(calibration_tokens=least - 1)) == (None, KEY_ERROR)
    assert widths(TurboQuantConfig(calibration_tokens=least)) == (KEY_OUTPUT_ERROR, None)
    assert least - least // 3 > 128 >= (least - 1) - (least - 1) // 3
    with pytest.raises(ValueError, match=f"needs a first window of at least {least} tokens"):
        TurboQuantConfig(key_output_error=0.02, calibration_tokens=None)
    assert widths(derive_config(calibration_tokens=64)) == (None, KEY_ERROR)
    for other in (dict(key_bits=3), dict(key_bits=8), dict(qjl=True), dict(weigh_keys=False), dict(key_bits=3.5)):
        assert widths(TurboQuantConfig(**other)) == (None, None), other
    # derived configs follow their bits, as the flags derive them; a key_error named drops the AUTO output error
    assert widths(derive_config(bits=3)) == (None, None) and widths(derive_config(bits=4)) == (KEY_OUTPUT_ERROR, None)
    assert widths(derive_config(derive_config(bits=3), bits=4)) == (KEY_OUTPUT_ERROR, None)
    assert widths(derive_config(key_error=0.2)) == (None, 0.2)
    assert widths(derive_config(TurboQuantConfig(key_output_error=0.04), bits=5)) == (0.04, None)
    assert widths(derive_config(TurboQuantConfig(key_output_error=None), bits=4)) == (None, KEY_ERROR)
    assert widths(TurboQuantConfig.preset("quality")) == (None, None)
    assert widths(TurboQuantConfig.preset("compact")) == (None, None)
    with pytest.raises(ValueError, match="key_output_error must be a number > 0 or None"):
        TurboQuantConfig(key_output_error="often")


def decay_of(c: TurboQuantConfig) -> tuple:
    return c.decay_after, c.decay_key_bits, c.decay_value_bits


def test_decay_fields_left_at_auto_follow_the_default_bits():
    from tq_mlx.config import AUTO

    fields = {f.name: f.default for f in dataclasses.fields(TurboQuantConfig)}
    assert (fields["decay_after"], fields["decay_key_bits"], fields["decay_value_bits"]) == (AUTO,) * 3
    # Asked for no decay, nothing decays (the default); the resolved config holds no AUTO.
    assert decay_of(TurboQuantConfig()) == (None, None, None)
    assert decay_of(TurboQuantConfig(key_bits=5, value_bits=5)) == (None, None, None)
    # An age asks for it: the default bits (K4, no QJL) decay their keys to K3 (values keep theirs).
    assert decay_of(TurboQuantConfig(decay_after=6144, key_bits=4.0, value_bits=4.0, window=32,
                                     calibration_tokens=None)) == (6144, 3, None)
    # Asked without an age: 6144, or window + compress_block where a window alone reaches 6144 (one compress block
    # always stays at full bits).
    assert decay_of(TurboQuantConfig(window=6144, calibration_tokens=None, decay_key_bits=3)) == (6144 + 128, 3, None)
    # Every integer width by one rule: keys one bit less down to 3, values keep theirs; 8-bit, fractional and
    # floor widths, and QJL keys, keep their bits at every age (nothing decays when no side does).
    for kw, want in ((dict(key_bits=3), (None,) * 3), (dict(value_bits=3), (6144, 3, None)),
                     (dict(key_bits=5, value_bits=5), (6144, 4, None)), (dict(key_bits=2, value_bits=2), (None,) * 3),
                     (dict(key_bits=8, value_bits=8), (None,) * 3), (dict(qjl=True), (None,) * 3),
                     (dict(key_bits=8, value_bits=4), (None,) * 3), (dict(value_bits=8), (6144, 3, None))):
        assert decay_of(TurboQuantConfig(decay_after=6144, **kw) if want[0] else TurboQuantConfig(**kw)) == want, kw
    for kw in (dict(key_bits=3), dict(key_bits=2, value_bits=2), dict(key_bits=8, value_bits=8), dict(qjl=True)):
        with pytest.raises(ValueError, match="decay_after needs decay_key_bits or decay_value_bits"):
            TurboQuantConfig(decay_after=6144, **kw)  # an age where no side decays by itself says so
    assert decay_of(TurboQuantConfig.from_bits(2.5)) == (None, None, None)
    assert decay_of(TurboQuantConfig(key_bits=3.5, value_bits=3.5)) == (None, None, None)
    # decay_after=None turns decay off; the decay bits left at AUTO follow.
    assert decay_of(TurboQuantConfig(decay_after=None)) == (None, None, None)
    # Decay bits given, decay_after left at AUTO: 6144 (or window + compress_block if larger); the other side's
    # AUTO bits follow the rule.
    assert decay_of(TurboQuantConfig(value_bits=3, decay_value_bits=2)) == (6144, 3, 2)
    assert decay_of(TurboQuantConfig(key_bits=3, decay_key_bits=2)) == (6144, 2, None)
    assert decay_of(TurboQuantConfig(decay_key_bits=2)) == (6144, 2, None)
    assert decay_of(TurboQuantConfig(key_bits=3, decay_value_bits=2)) == (6144, None, 2)
    assert decay_of(TurboQuantConfig(value_bits=3, window=7000, calibration_tokens=None, compress_block=100, decay_value_bits=2)) == (
        7100, 3, 2)
    # An explicit decay_after with the default bits keeps the default decay bits.
    assert decay_of(TurboQuantConfig(decay_after=2048)) == (2048, 3, None)
    # Files written before norm_bits and decay existed meant float16 norms and no decay.
    old = {k: v for k, v in TurboQuantConfig().to_dict().items()
           if k not in ("norm_bits", "decay_after", "decay_key_bits", "decay_value_bits")}
    o = TurboQuantConfig.from_dict(old)
    assert o.norm_bits == 16 and decay_of(o) == (None, None, None)
    assert o == TurboQuantConfig(norm_bits=16, decay_after=None)
    # Presets: quality takes 8-bit keys and drops the decay, compact decays sooner and further.
    q, dflt, compact = (TurboQuantConfig.preset(n) for n in ("quality", "default", "compact"))
    assert (q.key_bits, q.value_bits, q.norm_bits, q.window, q.compress_block) == (8, 4, 8, 768, None)  # None: the library's block size
    assert q.weigh_keys and q.center_keys == "rope"
    assert decay_of(q) == (None, None, None)
    assert dflt == TurboQuantConfig()
    assert (compact.key_bits, compact.value_bits, compact.norm_bits) == (4, 3, 8)
    assert decay_of(compact) == (4096, 2, 2)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"key_bits": 7}, "key_bits must be one of (1, 2, 2.5, 3, 3.5, 4, 5, 6, 8)"),
        ({"value_bits": 0}, "value_bits must be one of"),
        ({"value_bits": True}, "value_bits must be one of"),
        ({"boundary_bits": 16}, "boundary_bits must be one of"),
        ({"key_bits": 2.5, "qjl": True}, "qjl=True needs integer key_bits in (1, 2, 3, 4)"),
        ({"key_bits": 8, "qjl": True}, "qjl=True needs integer key_bits"),
        ({"window": -1}, "window must be an integer >= 0"),
        ({"sinks": 1.5}, "sinks must be an integer >= 0"),
        ({"step": 0}, "step must be an integer >= 1"),
        ({"window": 16, "compress_block": 32}, "compress_block must be between 1 and window=16"),
        ({"norm_bits": 4}, "norm_bits must be one of (16, 8)"),
        ({"norm_bits": True}, "norm_bits must be one of (16, 8)"),
        ({"qjl": 1}, "qjl must be True or False"),
        ({"correct_norms": 1}, "correct_norms must be True, False, 'keys' or 'values'"),
        ({"correct_norms": "both"}, "correct_norms must be True, False, 'keys' or 'values'"),
        # temporal decay
        ({"decay_after": None, "decay_key_bits": 3}, "decay_key_bits needs decay_after"),
        ({"decay_after": None, "decay_value_bits": 2}, "decay_value_bits needs decay_after"),
        ({"decay_after": 2048, "decay_key_bits": None, "decay_value_bits": None},
         "decay_after needs decay_key_bits or decay_value_bits"),
        ({"key_bits": 3.5, "value_bits": 2.5, "decay_after": 2048}, "neither side decays by itself at K3.5/V2.5"),
        ({"decay_after": "soon"}, "decay_after must be a number, None or 'auto'"),
        ({"decay_key_bits": "auto3"}, "decay_key_bits must be a number, None or 'auto'"),
        ({"window": 6144, "decay_after": 6144}, "decay_after must be an integer >= 6272"),
        ({"decay_after": 200, "decay_key_bits": 3}, "decay_after must be an integer >= 256"),
        ({"decay_after": 2048, "decay_key_bits": 4}, "decay_key_bits=4 must be an integer below key_bits=4"),
        ({"decay_after": 2048, "decay_value_bits": 2.5}, "decay_value_bits must be one of (1, 2, 3, 4, 5) or None"),
        ({"key_bits": 3.5, "decay_after": 2048, "decay_key_bits": 2}, "itself an integer"),
        ({"qjl": True, "decay_after": 2048, "decay_key_bits": 2}, "does not apply to QJL keys"),
    ],
)
def test_config_rejects_bad_values(kwargs, words):
    with pytest.raises(ValueError) as e:
        TurboQuantConfig(**kwargs)
    assert words in str(e.value)


def test_layer_bits_boundary():
    c = TurboQuantConfig(key_bits=3, value_bits=2, boundary_layers=2, boundary_bits=8)
    got = [layer_plan(c, i, 6).bits for i in range(6)]
    assert got == [(8, 8), (8, 8), (3, 2), (3, 2), (8, 8), (8, 8)]
    assert layer_plan(TurboQuantConfig(key_bits=3), 0, 6).bits == (3, 4)  # the default value_bits
    cache = TurboQuantKVCache(c, layer_index=7, attention_index=5, n_attention_layers=6)
    assert (cache.key_bits, cache.value_bits, cache.bits) == (8, 8, 8)
    # QJL needs TurboQuant_prod's bits; 8-bit boundary layers fall back to MSE keys.
    q = TurboQuantKVCache(dataclasses.replace(c, qjl=True), layer_index=0, attention_index=0, n_attention_layers=6)
    assert not q.qjl and q.key_bits == 8


def test_boundary_sides_widen_one_side_and_keep_the_other_s_rules():
    c = TurboQuantConfig(key_bits=3, value_bits=2, boundary_layers=1, boundary_bits=4, boundary_sides="v",
                         decay_after=2048, decay_key_bits=2)
    assert [layer_plan(c, i, 4).bits for i in range(4)] == [(3, 4), (3, 2), (3, 2), (3, 4)]
    # the boundary values keep their bits at every age; the keys beside them decay as every layer's do
    assert layer_plan(c, 0, 4).decay_bits == (2, None) and layer_plan(c, 1, 4).decay_bits == (2, None)
    keys = dataclasses.replace(c, boundary_sides="k")
    assert [layer_plan(keys, i, 4).bits for i in range(4)] == [(4, 2), (3, 2), (3, 2), (4, 2)]
    assert layer_plan(keys, 0, 4).decay_bits == (None, None)
    # keys at their own bits in a values' boundary layer still widen by their error
    assert layer_plan(TurboQuantConfig(boundary_layers=1, boundary_sides="v"), 0, 4).keys.widen is not None
    assert layer_plan(TurboQuantConfig(boundary_layers=1), 0, 4).keys.widen is None
    with pytest.raises(ValueError, match="boundary_sides must be one of 'kv', 'k', 'v', got 'values'"):
        TurboQuantConfig(boundary_sides="values")


# --- layout -----------------------------------------------------------------------------------------


def test_token_layout_and_block_compression():
    cfg = TurboQuantConfig(window=16, calibration_tokens=None, compress_block=8, sinks=4)
    c = TurboQuantKVCache(cfg)
    counts = []
    for L in (2, 3, 10, 7, 1, 1, 40):
        fill(c, (L,))
        counts.append((c.n_sinks, c.n_coded, c.n_window, c.offset))
    # Sinks fill first; the window overflows in whole blocks and keeps between window-block+1 and window.
    assert counts == [(2, 0, 0, 2), (4, 0, 1, 5), (4, 0, 11, 15), (4, 8, 10, 22), (4, 8, 11, 23), (4, 8, 12, 24),
                      (4, 48, 12, 64)]
    assert c.size() == 64 and not c.empty() and c.is_trimmable()


# float16 norms: the 0.1 bound below is the 8-bit codes'; an 8-bit log norm alone is up to 2.2% off (norm_bits)
@pytest.mark.parametrize("cfg", [
    TurboQuantConfig.from_bits(8, window=16, calibration_tokens=None, compress_block=4, sinks=3, norm_bits=16),
    TurboQuantConfig.from_bits(8, window=16, calibration_tokens=None, sinks=0, center_keys=False, norm_bits=16),
    TurboQuantConfig(key_bits=8, value_bits=8, window=0, calibration_tokens=None, sinks=2, norm_bits=16),
])
def test_stored_tokens_are_the_input_tokens(cfg):
    """Whatever the chunking, the views stand for the tokens fed so far, in order: exact copies in the input's
    dtype for sinks and window, 8-bit codes (centering, scale and channel order undone) for the rest."""
    from tests.test_attention import dequantized

    rng = np.random.default_rng(2)
    c = TurboQuantKVCache(cfg)
    mu = 3 * rng.normal(size=(1, 2, 1, 64))
    seen_k, seen_v = [], []
    for L in (5, 1, 1, 30, 1, 1, 1, 7, 1, 1, 1, 1, 1, 1, 1, 1, 20, 1):
        k = rng.normal(size=(1, 2, L, 64)) + mu
        v = rng.normal(size=(1, 2, L, 64)) - mu
        seen_k.append(k)
        seen_v.append(v)
        kh, vh = c.update_and_fetch(mx.array(k, dtype=mx.float32), mx.array(v, dtype=mx.float32))
        for h, seen in ((kh, seen_k), (vh, seen_v)):
            ref = np.concatenate(seen, axis=2)
            got = dequantized(h)
            assert got.shape == ref.shape
            f32 = lambda x: x.astype(np.float32).astype(np.float64)  # noqa: E731
            s, w = h.n_sinks, h.n_window
            assert all(a is None or a.dtype == mx.float32 for a in (h.sinks, h.window))
            np.testing.assert_array_equal(got[:, :, :s], f32(ref[:, :, :s]))
            if w:
                np.testing.assert_array_equal(got[:, :, -w:], f32(ref[:, :, -w:]))
            assert np.abs(got - ref).max() < 0.1  # 8-bit codes


def test_chunked_and_one_shot_compress_the_same_tokens():
    cfg = TurboQuantConfig(window=32, calibration_tokens=None, compress_block=16, sinks=4)
    one, many = TurboQuantKVCache(cfg), TurboQuantKVCache(cfg)
    fill(one, (300,))
    fill(many, (100, 100, 100))
    assert (one.n_sinks, one.n_coded, one.n_window) == (many.n_sinks, many.n_coded, many.n_window)


@pytest.mark.parametrize("calibration", [None, 40])
@pytest.mark.parametrize("weigh", [False, True])
def test_prefill_as_decode_gives_every_chunking_the_token_by_token_attention(weigh, calibration):
    # prefill_as_decode: each query of a chunk reads what a decode step at its position would (the compressed
    # tokens a token-by-token cache holds then, the later ones in float), so a prompt fed whole or in chunks
    # longer than the window attends as it would fed token by token (the same codes: the calibration does not
    # depend on the feeding; weighed keys widen by their error too). Off, a chunk's first queries read their
    # neighbours as codes and the output moves. Keys, values and queries are quarter-integers, so that their sums
    # are exact in float32 whatever the feeding: through a model, a projection's rounding differs with the chunk's
    # length (about 1e-6), which moves a code across a boundary now and then (a rounding, not a reading).
    from tq_mlx.hook import fetched_attention

    rng = np.random.default_rng(1)
    T, H, Hq, D = 120, 2, 4, 64
    k, v, q = (mx.array(rng.integers(-8, 9, size=(1, h, T, D)) / 4, dtype=mx.float32) for h in (H, H, Hq))
    k = k + mx.array(rng.integers(-4, 5, size=(1, H, 1, D)) / 4, dtype=mx.float32)  # a mean to centre

    def attended(cfg, lengths):
        cache, out, a = TurboQuantKVCache(cfg), [], 0
        for n in lengths:
            keys, values = cache.update_and_fetch(k[:, :, a : a + n], v[:, :, a : a + n])
            out.append(fetched_attention(q[:, :, a : a + n], keys, values, D**-0.5, "causal" if n > 1 else None))
            a += n
        return mx.concatenate(out, axis=2)

    # calibration 40: the first compression waits for 40 tokens after the sinks, and the window holds 16 after it
    base = dict(window=16, compress_block=4, sinks=2, decay_after=None, weigh_keys=weigh, protect_factor=None,
                calibration_tokens=calibration)
    for on in (True, False):
        cfg = TurboQuantConfig(prefill_as_decode=on, **base)
        stepped = attended(cfg, [1] * T)
        for lengths in ([T], [19, 101], [30] * 4):
            error = mx.abs(attended(cfg, lengths) - stepped).max().item()
            assert error < 1e-4 if on else error > 0.05, (on, lengths, error)


def test_decode_runs_end_where_a_token_by_token_window_compresses():
    # layout.decode_runs in closed form against overflow token by token; without a window no stream reads as decode
    # (every query reads codes alone, which the plain view's causal mask already gives)
    from tq_mlx.layout import decode_runs, overflow

    # first: the calibration tokens a window that has compressed nothing yet waits for
    for held, n, W, K, first in [(h, n, W, K, f) for W in (1, 4, 16) for K in (1, 4, 16) if K <= W
                                 for f in (0, W + 5, 2 * W + 3) for h in range(max(W, f) + 1) for n in range(1, 40)]:
        counts = [overflow(held + m, W, K, first) for m in range(1, n + 1)]
        assert decode_runs(held, n, W, K, first) == [(r, c) for r, c in enumerate(counts)
                                                     if r == 0 or c != counts[r - 1]]
    assert not layer_plan(TurboQuantConfig(window=0, calibration_tokens=None, prefill_as_decode=True)).keys.as_decode
    assert layer_plan(TurboQuantConfig(prefill_as_decode=True)).keys.as_decode


def test_prefill_as_decode_views_by_run():
    # The views of an update that compressed its own tokens carry them in float (`recent`), and are read in runs:
    # each run's queries see the compressed tokens a decode step at their position sees, then float up to the
    # run's last query. Never held: the stream's own view and bytes are those of a cache without the option.
    from tq_mlx.stream.view import views_by_run

    cfg = TurboQuantConfig(window=16, calibration_tokens=None, compress_block=4, sinks=2, prefill_as_decode=True)
    cache, plain = TurboQuantKVCache(cfg), TurboQuantKVCache(dataclasses.replace(cfg, prefill_as_decode=False))
    fill(plain, (10, 40))
    fill(cache, (10,))
    k, v = cache.update_and_fetch(*next(chunks(np.random.default_rng(1), (40,))))
    assert k.recent is not None and v.recent is not None and cache.keys_and_values()[0].recent is None
    # 8 window tokens before (10 - 2 sinks): token i of the update makes a token-by-token window of 8 + i + 1,
    # which compresses 4 at 17, 21, ... (rows 8, 12, ..., 36)
    assert k.recent.first == 0 and k.recent.runs[0] == (0, 0) and k.recent.runs[-1] == (36, 32)
    assert [n for _, n in k.recent.runs] == list(range(0, 33, 4))
    assert cache.nbytes == plain.nbytes and cache.n_coded == plain.n_coded == 32
    runs = views_by_run(k, v, 40)
    assert sum(n for _, n, _, _ in runs) == 40
    for row, n, kr, vr in runs:
        assert kr.n_tokens == k.n_tokens - 40 + row + n and kr.recent is None and vr.n_tokens == kr.n_tokens
        assert kr.n_coded == dict(k.recent.runs)[row]
    # the runs are rows of the update's own 40 queries: other queries get a clear error, not a wrong read
    assert k.recent.queries == 40
    with pytest.raises(ValueError, match="read by that update's 40 queries, one per token, got 1"):
        turboquant_attention(mx.zeros((1, 4, 1, 64)), k, v, scale=0.125)


def test_make_mask_like_kvcache():
    c = TurboQuantKVCache(TurboQuantConfig())
    fill(c, (10,))
    assert c.make_mask(1) is None
    assert c.make_mask(5) == "causal"
    m = c.make_mask(5, return_array=True)
    assert m.shape == (5, 15) and m.dtype == mx.bool_
    assert c.make_mask(5, window_size=4).shape == (5, 15)



# --- pipelining -------------------------------------------------------------------------------------


def test_the_host_sync_guard_sees_numpy_and_the_buffer_protocol(monkeypatch):
    x = mx.ones((2, 3))
    # (looked up at call time, as library code does)
    for read in (lambda a: np.asarray(a), lambda a: np.array(a), lambda a: np.frombuffer(a, np.float32),
                 lambda a: memoryview(a), lambda a: a.item()):
        with forbid_host_sync(monkeypatch), pytest.raises(HostSync):
            read(x)
    np.asarray(x)  # and it is gone afterwards


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
def test_update_and_attention_build_the_graph_without_host_sync(monkeypatch, head_dim):
    # Building a cache may read constants back (make_prompt_cache builds them before the first forward);
    # storing tokens and attending to them never does, with key protection off. (With it on, the first
    # compression reads one number per key stream: test_key_protection_reads_one_number_at_calibration.)
    D = head_dim
    for cfg in (TurboQuantConfig(key_bits=3.5, value_bits=2.5, window=8, calibration_tokens=None, compress_block=4, sinks=2, protect_factor=None),
                TurboQuantConfig(key_bits=2, qjl=True, window=0, calibration_tokens=None, sinks=0, protect_factor=None)):
        c = TurboQuantKVCache(cfg, layer_index=0, head_dim=D)
        k = mx.random.normal((1, 2, 30, D))
        with forbid_host_sync(monkeypatch):
            for L in (9, 1, 1, 1, 1, 12):  # first compression (calibration), flushes, decode steps, a chunk
                kh, vh = c.update_and_fetch(k[:, :, :L], k[:, :, :L] * 2)
                out = turboquant_attention(mx.ones((1, 4, L, D)), kh, vh, 0.1, "causal" if L > 1 else None)
            _ = c.state, c.nbytes, c.offset
    assert out.shape == (1, 4, 12, D)


def test_decode_step_of_a_model_without_host_sync(monkeypatch):
    from tests.support.tiny_models import tiny_llama
    import tq_mlx

    model, _ = tiny_llama()
    cache = tq_mlx.make_prompt_cache(model, TurboQuantConfig(window=4, calibration_tokens=None, compress_block=2, sinks=1))
    mx.eval(model(mx.array([[1, 2, 3, 4, 5, 6]]), cache=cache))
    with forbid_host_sync(monkeypatch):
        logits = model(mx.array([[7]]), cache=cache)  # includes a window flush
        logits2 = model(mx.array([[8, 9, 10]]), cache=cache)
    assert logits.shape == (1, 1, 257) and logits2.shape == (1, 3, 257)
    assert bool(mx.all(mx.isfinite(logits2)))


# --- key protection (TurboQuantConfig.protect_factor, calibration.bias_outlier_factor) -------------------------------


def _biased_keys(T: int = 64, D: int = 64, offset: float = 30.0, seed: int = 0) -> mx.array:
    """Keys (1, 2, T, D): head 0 isotropic, head 1 with a large offset along a direction in which they hardly vary
    (the shape of Qwen2's key biases)."""
    x = mx.random.normal((1, 2, T, D), key=mx.random.key(seed))
    u = mx.random.normal((D,), key=mx.random.key(seed + 1))
    u = u / mx.linalg.norm(u)
    along = mx.sum(x[:, 1:] * u, axis=-1, keepdims=True)
    biased = x[:, 1:] - along * u + (offset + 0.05 * along) * u  # offset along u, spread 0.05 there
    return mx.concatenate([x[:, :1], biased], axis=1)


def test_bias_outlier_factor_is_one_for_isotropic_keys_and_large_for_biased_ones():
    from tq_mlx.stream.calibration import bias_outlier_factor, calibration_mean

    x = _biased_keys(T=4096)
    f = bias_outlier_factor(x, calibration_mean(x))
    assert f.shape == (1, 2)
    assert 0.8 < f[0, 0].item() < 1.25  # isotropic: a query along the (noise) mean sees the average error
    assert f[0, 1].item() > 15  # the error is ~1/0.05 of the spread of scores along the offset


def test_a_layer_with_biased_keys_protects_its_keys():
    x = _biased_keys()
    base = dict(key_bits=4, value_bits=3, window=8, calibration_tokens=None, compress_block=8, sinks=2, weigh_keys=False)  # no attention here
    fresh = lambda **kw: TurboQuantKVCache(TurboQuantConfig(**{**base, **kw}), layer_index=3, head_dim=64)  # noqa: E731
    on, off = fresh(), fresh(protect_factor=None)
    for c in (on, off):
        c.update_and_fetch(x, x)
    assert (on.key_bits, on.value_bits, on.protected) == (8, 3, True)
    assert (off.key_bits, off.protected) == (4, False)
    from tq_mlx.planner.display import bits_summary

    # protected keys do not decay, and the values keep their bits at every age by default
    assert bits_summary([on]) == "K8/V3 on its 1 attention layer"
    # The protected keys are 8-bit codes (no float copy): more bytes than 4-bit codes, far fewer than float.
    k_on, k_off = on.key_stream.codes.codes, off.key_stream.codes.codes
    assert k_on.shape[-1] == 2 * k_off.shape[-1] and k_on.dtype == mx.uint32
    # ... and a query along the offset attends far more like float (values at 8 bits with float16 norms, so keys
    # decide: an 8-bit log norm is up to 2.2% off, on values whose norm is ~30 here).
    k8 = [fresh(value_bits=8, norm_bits=16), fresh(value_bits=8, norm_bits=16, protect_factor=None)]
    for c in k8:
        c.update_and_fetch(x, x)
    q = 0.3 * mx.random.normal((1, 2, 1, 64), key=mx.random.key(5)) + mx.mean(x, axis=2, keepdims=True) / 3
    ref = mx.fast.scaled_dot_product_attention(q, x, x, scale=0.125)
    errs = [mx.abs(turboquant_attention(q, *c.keys_and_values(), 0.125) - ref)[0, 1].max().item() for c in k8]
    assert errs[0] < errs[1] / 4
    # Unbiased keys stay at the configured bits.
    iso = fresh()
    iso.update_and_fetch(x[:, :1], x[:, :1])
    assert (iso.key_bits, iso.protected) == (4, False)


def test_protection_before_rope_reads_the_bias_where_it_is_one_direction():
    # A key offset the model adds before RoPE (Qwen2's k_proj bias) turns with the position: tested on the keys as
    # the model makes them it reads as an outlier, tested turned back by their RoPE (protect_before_rope) it does
    # not, as the keys vary along it as much as along any direction. Keys that barely vary along their offset
    # before RoPE protect themselves either way. (Factor 2: these 64 tokens turn the offset less than a real
    # calibration's 768; Qwen2.5-Coder-0.5B's layer 0 reads 9.78 and 1.21, experiments/protection_factor.py.)
    from tq_mlx.models.rope import Rope, rotate

    D, T = 64, 64
    rope = Rope(mx.arange(D).astype(mx.int32), 10000.0 ** (-mx.arange(D // 2).astype(mx.float32) / (D // 2)))
    slow = mx.concatenate([mx.arange(D // 2) >= 24] * 2)  # the slowest quarter of the pairs hardly vary
    x = mx.random.normal((1, 2, T, D), key=mx.random.key(0)) * mx.where(slow, 0.05, 1.0)
    u = mx.random.normal((D,), key=mx.random.key(1))
    offset = mx.concatenate([x[:, :1], x[:, 1:] + 30 * u / mx.linalg.norm(u)], axis=1)
    base = dict(key_bits=4, value_bits=3, window=8, calibration_tokens=None, compress_block=8, sinks=2,
                weigh_keys=False, protect_factor=2.0)

    def protected(keys_before_rope, **kw):
        c = TurboQuantKVCache(TurboQuantConfig(**base, **kw), layer_index=3, head_dim=D, rope=rope)
        k = rotate(keys_before_rope, rope, 0)
        c.update_and_fetch(k, k)
        assert c.key_stream.rope is not None and c.plan.keys.protect.before_rope is kw.get("protect_before_rope", False)
        return c.protected

    assert protected(offset) and not protected(offset, protect_before_rope=True)
    assert protected(_biased_keys()) and protected(_biased_keys(), protect_before_rope=True)
    # without a RoPE to turn back (keys centered after it, or a layer whose RoPE is unknown) the test is the raw one
    assert layer_plan(TurboQuantConfig(protect_before_rope=True), rope=False).keys.protect.before_rope is False
    assert layer_plan(TurboQuantConfig(protect_before_rope=True, center_keys=True), rope=True).keys.protect.before_rope is False
    assert TurboQuantConfig.from_dict({k: v for k, v in TurboQuantConfig(protect_before_rope=True).to_dict().items()
                                       if k != "protect_before_rope"}).protect_before_rope is False
    with pytest.raises(ValueError, match="protect_before_rope must be True or False"):
        TurboQuantConfig(protect_before_rope="yes")


@pytest.mark.parametrize("side", [True, "keys", "values"])
def test_corrected_norms_reach_every_quantizer_of_a_cache_and_its_state(side):
    # correct_norms (both sides, or "keys" / "values" alone) reaches the keys' protected quantizer and the values'
    # own and decaying ones, the other side's storing plain norms; a cache rebuilt from the state codes as the
    # original did, and a config saved before the field codes plainly.
    keys, values = side in (True, "keys"), side in (True, "values")
    x = _biased_keys()
    cfg = TurboQuantConfig(key_bits=4, value_bits=3, window=8, calibration_tokens=None, compress_block=8, sinks=2,
                           decay_after=16, decay_key_bits=3, decay_value_bits=2, weigh_keys=False, correct_norms=side)
    c = TurboQuantKVCache(cfg, layer_index=1, head_dim=64)
    c.update_and_fetch(x, x)
    ks, vs = c.key_stream, c.value_stream
    assert c.protected and ks.quantizer.bits == 8 and vs.decay.quantizer.bits == 2 and vs.n_decayed > 0
    assert ks.quantizer.correct_norms is keys
    assert vs.quantizer.correct_norms is vs.decay.quantizer.correct_norms is values
    if side is not True:  # each side's norms: those of both corrected where it is, not where it is not
        both = TurboQuantKVCache(dataclasses.replace(cfg, correct_norms=True), layer_index=1, head_dim=64)
        both.update_and_fetch(x, x)
        for own, twin, corrected in ((ks, both.key_stream, keys), (vs, both.value_stream, values)):
            assert bool(mx.array_equal(own.view().codes.norms, twin.view().codes.norms)) is corrected
    d = TurboQuantKVCache()
    d.state = c.state
    assert d.config.correct_norms == side and d.key_stream.quantizer.correct_norms is keys
    assert d.value_stream.decay.quantizer.correct_norms is values
    more = mx.random.normal((1, 2, 16, 64), key=mx.random.key(9))
    for m in (c, d):
        m.update_and_fetch(more, more)
    from mlx.utils import tree_flatten

    got, want = tree_flatten(d.state[1]), tree_flatten(c.state[1])
    assert [k for k, _ in got] == [k for k, _ in want] and all(
        (a is None and b is None) or mx.array_equal(a, b) for (_, a), (_, b) in zip(got, want))
    plain = TurboQuantConfig.from_dict({k: v for k, v in cfg.to_dict().items() if k != "correct_norms"})
    assert plain.correct_norms is False and TurboQuantKVCache(plain).plan.values.correct_norms is False
    # the streams that score as keys follow the keys: a latent layer's rope key, a K=V layer's one stream
    assert layer_plan(cfg, fetch="latent").values.correct_norms is keys
    assert layer_plan(cfg, k_eq_v=True).keys.correct_norms is keys and layer_plan(cfg, k_eq_v=True).values is None


def test_protection_survives_state_round_trip_and_a_trim_to_no_codes_resets_it():
    x = _biased_keys()
    cfg = TurboQuantConfig(window=8, calibration_tokens=None, compress_block=8, sinks=2)
    c = TurboQuantKVCache(cfg, layer_index=1, head_dim=64)
    c.update_and_fetch(x, x)
    assert c.protected
    d = TurboQuantKVCache()
    d.state = c.state
    assert d.protected and d.key_bits == 8 and d.nbytes == c.nbytes
    q = mx.random.normal((1, 2, 3, 64))
    a, b = (turboquant_attention(q, *m.keys_and_values(), 0.125, "causal") for m in (c, d))
    assert mx.array_equal(a, b)
    c.trim(c.offset - 2)  # only the sinks left: calibration and protection are gone
    assert not c.protected and c.key_bits == 4
    meta, arrays = d.state
    with pytest.raises(ValueError, match="protected keys without compressed tokens"):
        TurboQuantKVCache().state = (dict(meta, key_protected=True, n_compressed=0, n_window=8, offset=10,
                                          calibrated=False), arrays)


def test_key_protection_reads_one_number_at_calibration(monkeypatch):
    import tq_mlx.stream.calibration as calibration

    reads = []
    real = calibration.bias_outlier_factor

    def counted(*a):
        out = real(*a)
        reads.append(out)
        return out

    monkeypatch.setattr(calibration, "bias_outlier_factor", counted)
    x = _biased_keys()
    c = TurboQuantKVCache(TurboQuantConfig(window=8, calibration_tokens=None, compress_block=8, sinks=2), layer_index=0, head_dim=64)
    c.update_and_fetch(x[:, :, :20], x[:, :, :20])  # the first compression: keys decide, values do not
    assert len(reads) == 1 and c.protected
    with forbid_host_sync(monkeypatch):  # every later update and attention is graph construction again
        for L in (1, 1, 9, 1):
            kh, vh = c.update_and_fetch(x[:, :, :L], x[:, :, :L])
            turboquant_attention(mx.ones((1, 4, L, 64)), kh, vh, 0.1, "causal" if L > 1 else None)
    assert len(reads) == 1


def test_keys_coded_without_queries_are_described_as_unweighed():
    """A cache filled by bare update_and_fetch calls (no attention, so no queries) cannot weigh its keys: it holds
    no weights, and bits_summary says so, while a cache whose attention ran holds them and says nothing."""
    from tq_mlx.planner.display import bits_summary

    rng = np.random.default_rng(0)
    kv = lambda n: mx.array(rng.standard_normal((1, 2, n, 64)).astype(np.float32))  # noqa: E731
    bare = TurboQuantKVCache(TurboQuantConfig(window=32, calibration_tokens=None, sinks=4))
    bare.update_and_fetch(kv(100), kv(100))
    mx.eval(bare.held_arrays())
    assert bare.config.weigh_keys and bare.key_stream.n_coded > 0 and bare.key_stream.weights is None
    assert "keys unweighed: no queries seen" in bits_summary([bare])
    attended = TurboQuantKVCache(TurboQuantConfig(window=32, calibration_tokens=None, sinks=4))
    k, v = attended.update_and_fetch(kv(100), kv(100))
    queries = mx.array(rng.standard_normal((1, 4, 100, 64)).astype(np.float32))
    mx.eval(turboquant_attention(queries, k, v, 0.125, mask="causal"), attended.held_arrays())
    assert attended.key_stream.weights is not None
    assert "unweighed" not in bits_summary([attended])


def test_a_bound_that_drops_every_coded_token_keeps_the_calibration_and_the_weights():
    """A bounded cache whose drop removes every compressed token keeps its calibration (the tokens still to come
    are coded as those dropped were): the key weights stay, and the planner's bytes still equal nbytes."""
    from tq_mlx.planner.memory import turboquant_layer_bytes

    rng = np.random.default_rng(1)
    kv = lambda n: mx.array(rng.standard_normal((1, 2, n, 64)).astype(np.float32))  # noqa: E731
    config = TurboQuantConfig(window=16, calibration_tokens=None, compress_block=8, sinks=2, center_keys=True)
    bound = config.sinks + config.window + config.compress_block_size - 1
    cache = TurboQuantKVCache(config, max_size=bound)
    k, v = cache.update_and_fetch(kv(40), kv(40))
    mx.eval(turboquant_attention(mx.repeat(kv(40), 2, axis=1), k, v, 0.125, mask="causal"), cache.held_arrays())
    weights, scale = cache.key_stream.weights, cache.key_stream.scale
    assert weights is not None
    seen_empty = False
    for _ in range(24):  # token by token: each drop takes the oldest compressed block
        k, v = cache.update_and_fetch(kv(1), kv(1))
        mx.eval(turboquant_attention(mx.repeat(kv(1), 2, axis=1), k, v, 0.125), cache.held_arrays())
        seen_empty |= cache.key_stream.n_coded == 0
        assert cache.key_stream.weights is weights and cache.key_stream.scale is scale
        planned = turboquant_layer_bytes(cache.offset, 2, 64, 64, config.key_bits, config.value_bits, config,
                                         float_bytes=4, max_kv_size=bound, key_width=cache.key_bits, query_heads=2)
        assert planned == cache.nbytes
    assert seen_empty  # the bound did empty the codes at some step
