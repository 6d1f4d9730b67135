"""Keys centered before RoPE (TurboQuantConfig(center_keys="rope"), tq_mlx.models.rope).

* probe reads mlx-lm's rope modules (split and traditional pairs, partial rotary dims, Llama 3 and YaRN scaling)
  into pairs and frequencies that reproduce the module at far positions, and refuses what is not a rotation;
* the stream subtracts R(p) μ0 and adds it back: decoding gives the tokens to within the codes' error, the
  reference attention matches float attention, and everything is exact against a global-mean cache fed the
  same tokens at 8 bits; positions continue past sinks, decayed codes and tokens a bound dropped; state
  round-trips (the file's RoPE wins); bad files are refused with the array named;
* the attention kernels (decode, prefill, decayed spans) add q·R(p) μ0 per token on the codes and match the
  reference under the CPU MSL emulator in all three lane schedules, far out in position; dispatch self-checks
  the variant and takes the kernel path; decode reads no more bytes than with one mean; with RoPE pairs and
  without (NP = 0), they compile without a clang warning;
* make_prompt_cache probes every layer of a Qwen2 model, and on keys with a large k_proj bias the cache tracks
  float logits closer than with one mean after RoPE.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import mlx.core as mx
from mlx_lm.models.rope_utils import initialize_rope

from tests.emulator import metal_kernel as emulator_kernel
from tests.support.kernel_cases import (  # noqa: F401  (_clean_dispatch and emulator: the same fixtures)
    SCHEDULES, Emu, _clean_dispatch, assert_close, emulator, make_mask, normal,
)
from tq_mlx import attention as K
from tq_mlx import TurboQuantConfig, TurboQuantKVCache
from tq_mlx.attention.reference import turboquant_attention
from tq_mlx.models.rope import Rope, n_pairs, probe, rotate, score_bias, centers
from tq_mlx.stream.view import decode as stream_decode
from tests.support.learning import learning

# the caches learn from the queries first, as the attention hook runs it (attention itself only reads)
turboquant_attention = learning(turboquant_attention)

SCALINGS = {
    "plain": None,
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
    "yarn": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
}


def model_rope(dim=64, dims=None, traditional=False, scaling="plain", base=10000.0):
    return initialize_rope(dims or dim, base=base, traditional=traditional, scaling_config=SCALINGS[scaling],
                           max_position_embeddings=32768)


# ============================================================================================ 1. probe
@pytest.mark.parametrize("dim,dims,traditional,scaling", [
    (64, None, False, "plain"), (64, None, True, "plain"), (128, 32, False, "plain"), (128, 64, True, "plain"),
    (128, None, False, "llama3"), (128, None, False, "yarn"),
])
def test_probe_reproduces_the_model_rope(dim, dims, traditional, scaling):
    fn = model_rope(dim, dims, traditional, scaling)
    rope = probe(fn, dim)
    assert rope is not None and n_pairs(rope) == (dims or dim) // 2
    assert sorted(rope.order.tolist()) == list(range(dim))
    mscale = np.array(fn(mx.ones((1, 1, 1, dim)), offset=0)).reshape(-1)
    rng = np.random.default_rng(0)
    x = normal(rng, (1, 2, 16, dim))
    for offset in (0, 1000, 30000):
        want = np.array(fn(x, offset=offset))
        got = np.array(rotate(x, rope, offset)) * mscale
        # float32 angles of p radians are p·6e-8 off (mlx's rope's own rounding), and |x| < 5
        tol = 1e-5 + (3e-6 if scaling != "plain" else 3e-7) * (offset + 16) * 5
        assert np.abs(got - want).max() < tol, (offset, np.abs(got - want).max())
        back = rotate(rotate(x, rope, offset), rope, offset, inverse=True)
        assert np.abs(np.array(back) - np.array(x)).max() < 1e-5


def test_probe_refuses_what_is_not_a_rotation():
    assert probe(lambda x: x, 64) is None  # no offset argument
    assert probe(lambda x, offset=0: x * 2 + offset, 64) is None  # not linear in x
    assert probe(lambda x, offset=0: mx.roll(x, 1, axis=-1), 64) is None  # a permutation
    assert probe(lambda x, offset=0: x * (1.0 + 0.01 * offset), 64) is None  # scaled with the position
    unrotated = probe(lambda x, offset=0: x, 64)  # identity: no pair rotates, the one mean is what is left
    assert unrotated is not None and n_pairs(unrotated) == 0


def test_score_bias_is_the_dot_with_the_rotated_mean():
    rope = probe(model_rope(128, 64, True), 128)
    rng = np.random.default_rng(1)
    q, mu = normal(rng, (2, 3, 5, 128)), normal(rng, (2, 3, 128))
    want = q @ centers(mu, rope, 70000, 40).swapaxes(-1, -2)
    assert np.abs(np.array(score_bias(q, mu, rope, 70000, 40) - want)).max() < 1e-3


# ============================================================================ 2. the stream and the cache
def biased_keys(rng, fn, B, H, n, dim, first=0, bias=4.0, seed=0):
    """Keys as a Qwen2 layer makes them: RoPE of a large constant plus noise, at positions first.."""
    b = mx.array(np.random.default_rng(seed).standard_normal((1, H, 1, dim)).astype(np.float32)) * bias
    return fn(normal(rng, (B, H, n, dim)) + b, offset=first)


def rope_cache(dim=64, center="rope", fn=None, **config):
    # (prefill not read as decode unless asked: these views are read by queries of any count, as held)
    cfg = TurboQuantConfig(**(dict(window=64, calibration_tokens=None, compress_block=32, sinks=4, step=64, prefill_as_decode=False) | config),
                           center_keys=center)
    fn = fn or model_rope(dim)
    return TurboQuantKVCache(cfg, head_dim=dim, rope=probe(fn, dim)), fn


def test_tokens_decode_to_themselves_and_the_centering_pays():
    rng = np.random.default_rng(2)
    errors = {}
    for center in ("rope", True):
        cache, fn = rope_cache(center=center)
        k = biased_keys(np.random.default_rng(2), fn, 1, 2, 400, 64)
        v = normal(rng, (1, 2, 400, 64))
        keys, _ = cache.update_and_fetch(k, v)
        assert (keys.rope is not None) == (center == "rope") and keys.position == 4
        got = stream_decode(keys, mx.float32)
        want = k[:, :, 4 : 4 + keys.n_coded]
        errors[center] = float(mx.sqrt(mx.mean((got - want) ** 2)) / mx.sqrt(mx.mean(want**2)))
        # the centering is μ0 rotated: what is left is the noise, not the bias
        if center == "rope":
            left = want - keys.centers()
            assert float(mx.sqrt(mx.mean(left**2))) < 1.2
    assert errors["rope"] < 0.5 * errors[True], errors


@pytest.mark.parametrize("config", [dict(), dict(decay_after=160, decay_key_bits=4, decay_value_bits=4)],
                         ids=["fresh", "decayed-to-4-bits"])
def test_reference_attention_matches_float_at_8_bits(config):
    cache, fn = rope_cache(key_bits=8, value_bits=8, **config)
    rng = np.random.default_rng(3)
    k, v = biased_keys(rng, fn, 2, 2, 300, 64), normal(rng, (2, 2, 300, 64))
    keys, values = cache.update_and_fetch(k, v)
    assert keys.rope is not None and (keys.decayed is not None) == bool(config)
    q = normal(rng, (2, 4, 3, 64))
    got = turboquant_attention(q, keys, values, scale=0.125, mask="causal")
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    tol = 0.02 if not config else 0.15
    assert float(mx.max(mx.abs(got - want))) < tol


@pytest.mark.parametrize("fold_rows", [None, 16], ids=["bias-on-scores", "centers-on-keys"])
def test_same_attention_as_the_tokens_decoded(fold_rows, monkeypatch):
    """Scores on the codes plus q·R(p) μ0 equal scores on the decoded tokens (what decode-to-float attends):
    with few query rows the bias goes on the scores, with many (FOLD_ROWS, a prefill chunk; lowered here so the
    queries stay past the calibration tokens) the centers go on the tile's keys."""
    import tq_mlx.attention.reference as A

    L = 40
    if fold_rows is not None:
        monkeypatch.setattr(A, "FOLD_ROWS", fold_rows)
    cache, fn = rope_cache(decay_after=160, decay_key_bits=3, decay_value_bits=2)
    rng = np.random.default_rng(4)
    keys, values = cache.update_and_fetch(biased_keys(rng, fn, 1, 2, 333, 64), normal(rng, (1, 2, 333, 64)))
    q = normal(rng, (1, 2, L, 64)) * 3
    calls = {"bias": 0, "centers": 0}

    def counting(name, f):
        def counted(*args):
            calls[name] += 1
            return f(*args)
        return counted

    monkeypatch.setattr(A, "score_bias", counting("bias", A.score_bias))
    monkeypatch.setattr(A, "_with_centers", counting("centers", A._with_centers))
    got = turboquant_attention(q, keys, values, scale=0.125, tile_tokens=50)
    assert (calls["centers"] > 0, calls["bias"] > 0) == ((True, False) if L >= A.FOLD_ROWS else (False, True))
    parts = lambda kv: [x for x in (kv.sinks, stream_decode(kv, mx.float32), kv.window)]  # noqa: E731
    kf, vf = (mx.concatenate([p.astype(mx.float32) for p in parts(kv)], axis=2) for kv in (keys, values))
    want = mx.fast.scaled_dot_product_attention(q, kf, vf, scale=0.125)
    assert float(mx.max(mx.abs(got - want))) < 1e-4


def test_positions_continue_past_a_bound_and_through_state():
    cache, fn = rope_cache(decay_after=160, decay_key_bits=3, decay_value_bits=2)
    cache.max_size = 256
    rng = np.random.default_rng(5)
    first = 0
    for n in (200, 100, 90):
        k = biased_keys(rng, fn, 1, 2, n, 64, first=first)
        keys, _ = cache.update_and_fetch(k, normal(rng, (1, 2, n, 64)))
        first += n
    assert cache.n_dropped > 0 and keys.position == 4 + cache.n_dropped
    assert keys.decayed.position == keys.position
    fresh = keys.segments()[-1][1]
    assert fresh.position == keys.position + keys.n_decayed
    # the decoded last compressed token is the key fed at its position
    t = keys.n_coded - 1
    pos = keys.position + t
    fed_index = pos - (first - 90)
    got = stream_decode(keys, mx.float32)[:, :, t]
    assert float(mx.max(mx.abs(got - k[:, :, fed_index]))) < 0.6  # K4 codes of a 4-sigma bias: the noise
    # state: a fresh cache, no model at hand, continues exactly
    again = TurboQuantKVCache()
    again.state = cache.state
    assert again.key_stream.rope is not None and again.key_stream.n_dropped == cache.n_dropped
    new_k, new_v = biased_keys(rng, fn, 1, 2, 1, 64, first=first), normal(rng, (1, 2, 1, 64))
    q = normal(rng, (1, 2, 1, 64))
    outs = [turboquant_attention(q, *c.update_and_fetch(new_k, new_v), scale=0.125) for c in (cache, again)]
    assert float(mx.max(mx.abs(outs[0] - outs[1]))) == 0.0


def test_state_refuses_a_bad_rope():
    cache, fn = rope_cache()
    rng = np.random.default_rng(6)
    cache.update_and_fetch(biased_keys(rng, fn, 1, 2, 100, 64), normal(rng, (1, 2, 100, 64)))
    meta, arrays = cache.state
    order, freqs = arrays["k_rope"]
    for bad, what in (((order[:10], freqs), "order"), ((mx.zeros_like(order), freqs), "permutation"),
                      ((order, mx.zeros((40,), mx.float32)), "freqs")):
        with pytest.raises(ValueError, match=what):
            TurboQuantKVCache().state = (meta, {**arrays, "k_rope": bad})
    plain = dict(meta, config=dict(meta["config"], center_keys=False))
    with pytest.raises(ValueError, match="does not center"):
        TurboQuantKVCache().state = (plain, arrays)


def test_config_center_keys_values():
    assert TurboQuantConfig(center_keys="rope").center_keys == "rope"
    with pytest.raises(ValueError, match="True, False or 'rope'"):
        TurboQuantConfig(center_keys="before")
    # without a RoPE (a cache built without its model) the keys keep the one mean
    cache = TurboQuantKVCache(TurboQuantConfig(center_keys="rope"), head_dim=64)
    assert cache.key_stream.rope is None and cache.key_stream.center


# ================================================================================== 3. the kernels
def rope_views(dim=64, B=1, L=1, dtype=mx.float16, first=90_000, decay=False, n_prompt=300, traditional=False,
               **config):
    """Views of a real rope-centered cache whose tokens sit at positions first.. (a bound that dropped that
    many), the keys biased as Qwen2's."""
    extra = dict(decay_after=160, decay_key_bits=3, decay_value_bits=2) if decay else {}
    cache, fn = rope_cache(dim, fn=model_rope(dim, traditional=traditional, base=1e6), **extra, **config)
    for s in cache.streams:
        s.n_dropped = first  # the positions of a long conversation's tail
    rng = np.random.default_rng(dim + L)
    kv = lambda n, at: (biased_keys(rng, fn, B, 2, n, dim, first=at).astype(dtype),  # noqa: E731
                        normal(rng, (B, 2, n, dim), dtype))
    cache.update_and_fetch(*kv(n_prompt, first))
    return cache.update_and_fetch(*kv(L, first + n_prompt))


def run(kernel, q, keys, values, mask, factory, **kw):
    scale = 1 / math.sqrt(q.shape[-1])
    unsupported = K.decode_unsupported if kernel == "decode" else K.prefill_unsupported
    assert unsupported(q, keys, values, mask, None) is None
    launch = K.decode_attention if kernel == "decode" else K.prefill_attention
    got = launch(q, keys, values, scale, mask, None, metal_kernel=factory, **kw)
    return got, K.decode_attention_reference(q, keys, values, scale, mask, None)


CASES = [  # kernel, dim, dtype, B, R, L, mask, decayed, traditional
    ("decode", 64, mx.float16, 1, 2, 1, None, False, False),
    ("decode", 128, mx.float32, 2, 4, 3, "causal", True, True),
    ("prefill", 64, mx.float16, 1, 2, 40, "causal", False, False),
    ("prefill", 128, mx.bfloat16, 2, 1, 12, "bool-2d", True, False),
]


@pytest.mark.emulator
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-d{c[1]}-L{c[5]}-{c[6]}{'-decayed' if c[7] else ''}")
def test_kernels_match_reference_far_out(emulator, schedule, case):
    kernel, dim, dtype, B, R, L, mask, decayed, traditional = case
    keys, values = rope_views(dim, B, L, dtype, decay=decayed, traditional=traditional)
    assert keys.rope is not None and keys.position >= 90_000 and (keys.decayed is not None) == decayed
    rng = np.random.default_rng(L)
    q = normal(rng, (B, 2 * R, L, dim), dtype)
    m = mask if mask in (None, "causal") else make_mask(rng, mask, B, 2 * R, L, keys.n_tokens)
    f = Emu(schedule, seed=3)
    got, want = run(kernel, q, keys, values, m, f, **(dict(split_tokens=64) if kernel == "decode" else {}))
    assert_close(got, want, dtype, schedule)
    # and the bias matters: without it the kernels would be far off
    plain = keys._replace(rope=None, decayed=keys.decayed and keys.decayed._replace(rope=None))
    off = K.decode_attention_reference(q, plain, values, 1 / math.sqrt(dim), m, None)
    assert float(mx.max(mx.abs(off.astype(mx.float32) - want.astype(mx.float32)))) > 0.05


class SyntaxOnly:
    """A metal_kernel factory that only compiles each kernel asked for (clang -fsyntax-only, the emulator's build
    flags) and keeps clang's warnings by kernel name; every launch returns zeros."""

    def __init__(self):
        self.warnings: dict[str, str] = {}
        self.templates: dict[str, dict] = {}

    def __call__(self, **make):
        kernel = emulator_kernel(**make)

        def launch(**call):
            self.templates[make["name"]] = dict(call["template"])
            self.warnings[make["name"]] = kernel.check_syntax(call["inputs"], call["output_dtypes"], call["template"])
            return [mx.zeros(shape, dtype) for shape, dtype in zip(call["output_shapes"], call["output_dtypes"])]

        return launch


@pytest.mark.emulator
@pytest.mark.parametrize("center", ["rope", True], ids=["rope-pairs", "no-rope-pairs"])
@pytest.mark.parametrize("kernel,L", [("decode", 1), ("prefill", 20)])
def test_the_attention_kernels_compile_without_warnings_with_and_without_rope_pairs(emulator, kernel, L, center):
    # A variant without RoPE pairs (NP = 0) instantiates the RoPE stages of common.metal behind `if (NP > 0)`:
    # their `i / NP` once drew clang's -Wdivision-by-zero there, in dead code.
    keys, values = rope_views(64, 1, L, mx.float16, n_prompt=200, center=center)
    assert (keys.rope is not None) == (center == "rope")
    f = SyntaxOnly()
    run(kernel, normal(np.random.default_rng(0), (1, 4, L, 64), mx.float16), keys, values,
        "causal" if L > 1 else None, f)
    main = "tq_decode_partial" if kernel == "decode" else "tq_prefill_attention"
    assert (f.templates[main]["NP"] > 0) == (center == "rope"), f.templates[main]
    assert not [w for w in f.warnings.values() if w.strip()], "\n".join(f.warnings.values())


@pytest.mark.emulator
def test_decode_reads_each_code_byte_once_and_no_more_than_with_one_mean(emulator):
    names = ["kc", "kn", "vc", "vn"]
    reads = {}
    for center in ("rope", True):
        cache, fn = rope_cache(center=center, key_bits=4, value_bits=4, norm_bits=8)
        rng = np.random.default_rng(7)
        cache.update_and_fetch(biased_keys(rng, fn, 1, 2, 600, 64), normal(rng, (1, 2, 600, 64), mx.float16))
        keys, values = cache.update_and_fetch(biased_keys(rng, fn, 1, 2, 1, 64, first=600),
                                              normal(rng, (1, 2, 1, 64), mx.float16))
        f = Emu()
        got, want = run("decode", normal(rng, (1, 4, 1, 64), mx.float16), keys, values, None, f)
        assert_close(got, want, mx.float16)
        (st,) = f.stats("tq_decode_partial")
        for name in names:
            assert st.buffers[name].unique_bytes_read == st.buffers[name].nbytes, name
            assert st.buffers[name].total_bytes_read <= 1.1 * st.buffers[name].nbytes, name
        reads[center] = {k: b.total_bytes_read for k, b in st.buffers.items()}
        if center == "rope":  # the RoPE terms: 2·NP floats per query row, read per split as the rows are
            terms, rows = st.buffers["rterms"], st.buffers["q"]
            assert terms.nbytes == 4 * 2 * 32 * 4 and terms.unique_bytes_read == terms.nbytes
            assert terms.total_bytes_read / terms.nbytes == rows.total_bytes_read / rows.nbytes
    # the same code bytes; beyond them the terms, the frequencies and one more int of parameters per thread
    rope, plain = reads["rope"], reads[True]
    assert all(rope[n] == plain[n] for n in names)
    extra = {k: rope[k] - plain[k] for k in rope if rope[k] != plain[k]}
    assert set(extra) == {"rterms", "rfreqs", "params"}, extra
    splits = rope["q"] // 1024
    assert 0 < extra["params"] <= 4 * 256 * splits  # one int per thread (256 threads per split)


@pytest.mark.emulator
@pytest.mark.parametrize("L", [1, 20])
def test_dispatch_self_checks_and_takes_the_kernel(emulator, L):
    keys, values = rope_views(64, 1, L, mx.float16, decay=True)
    f = Emu()
    K.set_kernel_factory(f)
    K.set_backend("metal")
    q = normal(np.random.default_rng(8), (1, 4, L, 64), mx.float16)
    mask = "causal" if L > 1 else None
    got = K.dispatch_attention(q, keys, values, 0.125, mask)
    assert_close(got, turboquant_attention(q, keys, values, 0.125, mask), mx.float16)
    status = K.self_check_status()
    kernel = "decode_attention" if L <= K.MAX_QUERY_TOKENS else "prefill_attention"
    (variant,) = [v for (k, v), why in status.items() if k == kernel]
    assert status[(kernel, variant)] is None and variant[-4] == 32  # checked with the 32 pairs, and passed
    assert len(f.stats("tq_decode_partial")) == 2 * 2  # self-check (2 spans), then the call
    deq = K.dispatch_dequantize(keys, mx.float32)
    assert float(mx.max(mx.abs(deq - stream_decode(keys, mx.float32)))) < 1e-3


# ============================================================================= 4. a model's caches
def test_make_prompt_cache_probes_every_layer_and_tracks_float_closer():
    from mlx_lm.models import qwen2
    from mlx_lm.models.cache import make_prompt_cache as float_cache
    from tq_mlx.integration import make_prompt_cache

    args = qwen2.ModelArgs(model_type="qwen2", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=300,
                           rope_theta=10000.0)
    mx.random.seed(0)
    model = qwen2.Model(args)
    for layer in model.model.layers:  # Qwen2's k_proj bias, large
        layer.self_attn.k_proj.bias = mx.random.normal(layer.self_attn.k_proj.bias.shape) * 3
    tokens = mx.array(np.random.default_rng(0).integers(0, 300, (1, 600)))
    ref = model(tokens, cache=float_cache(model))
    logp = lambda x: x - mx.logsumexp(x, axis=-1, keepdims=True)  # noqa: E731
    kl = {}
    for center in (True, "rope"):
        cache = make_prompt_cache(model, TurboQuantConfig(window=128, calibration_tokens=None, compress_block=64, center_keys=center,
                                                          key_bits=3, value_bits=4))
        assert all((c.key_stream.rope is not None) == (center == "rope") for c in cache)
        out = mx.concatenate([model(tokens[:, a : a + 100], cache=cache) for a in range(0, 600, 100)], axis=1)
        kl[center] = float(mx.mean(mx.sum(mx.exp(logp(ref)) * (logp(ref) - logp(out)), axis=-1)[:, 300:]))
    assert kl["rope"] < 0.8 * kl[True], kl
