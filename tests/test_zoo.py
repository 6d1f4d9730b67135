"""The model zoo: every mlx-lm architecture (tests/support/zoo.py builds a tiny random-weight model of each) is
either compressed on every full-attention KVCache layer (nested CacheList members included) with 8-bit logits
within 1e-2 of the float cache, or refused with a ValueError before any forward that names the layer, the
reason and the way out. A crash mid-forward or a silently float model fails.

The fetch path each model takes (on the codes, latent, decode-to-float) is the one that ran: tq_mlx's attention
on the codes and its float decode are wrapped and counted (tests/support/zoo.watch_paths), and what ran must be
what tq_mlx.models.architectures says. The default's codes (LOW: query-weighed keys centered before RoPE, widened by
their error, plus old keys decayed to K3, which the default does not do) run at their low bits too, attention on the codes checked against the same
codes decoded. Sparse attention
(deepseek_v32, glm_moe_dsa) picks its tokens below the context and is compared on the float run's picks.

`python -m tests.test_zoo --table` prints the README's "Model support" table; the test checks the README row of
each architecture against the outcome it measured.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import CacheList, KVCache

import tq_mlx
from tq_mlx import TurboQuantConfig, TurboQuantKVCache
from tq_mlx.attention import kernels_enabled
from tests.support import zoo

CONFIG = TurboQuantConfig(key_bits=8, value_bits=8, window=8, calibration_tokens=None, compress_block=4, sinks=2)
TOKENS = np.random.default_rng(0).integers(0, 256, 24).tolist()
# The 8-bit check runs on three token draws and bounds the best of their max errors: on these random-weight
# MoE models any perturbation of the cache can flip an expert route on a draw, and the logits after it (olmoe:
# 5.5e-3, 0.16, 0.11; mixtral 0.24, 5.2e-3, 8.0e-3), while a real regression of the cache moves every draw.
DRAWS = [TOKENS] + [np.random.default_rng(s).integers(0, 256, 24).tolist() for s in (1, 2)]
PREFILL = 16
# The default's codes at the zoo's window: K4/V4 with 8-bit norms, keys weighed by the queries and centered before
# RoPE. With no calibration window the keys widen by their logit error (key_error) where the default's widen by
# their output error, and the keys of tokens older than 12 decay to K3 (the default decays nothing) so that every
# architecture runs decayed codes too.
LOW = TurboQuantConfig(window=8, calibration_tokens=None, compress_block=4, sinks=2, decay_after=12)
PATH_WORDS = {"codes": "on the codes", "latent": "latent (MLA): decode on the codes, prefill decoded to float",
              "float": "decode-to-float"}
README = Path(__file__).resolve().parent.parent / "docs" / "models.md"
WAY_OUT = re.compile(r"use mlx-lm's own cache|change key_bits")


def teacher_forced(model, cache, tokens: list[int] = TOKENS) -> mx.array:
    out = [model(mx.array([tokens[:PREFILL]]), cache=cache)[0, -1]]
    for t in tokens[PREFILL:]:
        out.append(model(mx.array([[t]]), cache=cache)[0, -1])
    return mx.stack(out).astype(mx.float32)


def _flat(cache) -> list[tuple[int, object]]:
    """(layer, cache) of every cache, CacheList members included."""
    return [(i, m) for i, c in enumerate(cache) for m in (c.caches if type(c) is CacheList else [c])]


def _layers(ix) -> str:
    ix = sorted(set(ix))
    return f"layer{'s' if len(ix) > 1 else ''} {', '.join(map(str, ix))}"


def outcome(arch: str) -> tuple[str, str]:
    """(kind, detail) for one architecture, asserting the zoo's contract on the way."""
    if arch in zoo.NOT_BUILDABLE:
        reason, where = zoo.NOT_BUILDABLE[arch]
        if where == "build":
            with pytest.raises(BaseException):  # olmo exits at import (SystemExit)
                zoo.build(arch)
        elif where == "forward":
            model = zoo.build(arch)
            with pytest.raises(Exception):
                teacher_forced(model, mlx_cache.make_prompt_cache(model))
        return "not buildable", reason

    model = zoo.build(arch)
    try:
        cache = tq_mlx.make_prompt_cache(model, CONFIG)
    except ValueError as e:
        msg = str(e)
        assert re.search(r"\blayers? \d+", msg), f"refusal does not name the layer: {msg}"
        assert WAY_OUT.search(msg), f"refusal gives no way out: {msg}"
        with pytest.raises(ValueError):  # patch_model refuses the same way and leaves the model untouched
            tq_mlx.patch_model(model, CONFIG)
        assert "make_cache" not in vars(model) and "_tq_make_cache" not in vars(model)
        reason = msg.split("; use mlx-lm")[0]
        reason = re.sub(r"^layer \d+: ", "", reason).replace("|", "/")
        return "refused", reason

    base = mlx_cache.make_prompt_cache(model)
    flat, base_flat = _flat(cache), _flat(base)
    assert [i for i, _ in flat] == [i for i, _ in base_flat]
    tq = []
    for (i, c), (_, b) in zip(flat, base_flat):
        if type(b) is KVCache:
            assert isinstance(c, TurboQuantKVCache), f"layer {i}: full-attention KVCache left float"
            tq.append(i)
        else:
            assert type(c) is type(b), f"layer {i}: {type(b).__name__} replaced by {type(c).__name__}"
    assert tq, "nothing compressed"
    errs = []
    sparse = zoo.has_indexer(model)
    with pytest.MonkeyPatch.context() as mp:
        counts = zoo.watch_paths(mp)
        topk = zoo.TopK(mp) if sparse else None
        for tokens in DRAWS:
            if errs:
                cache, base = tq_mlx.make_prompt_cache(model, CONFIG), mlx_cache.make_prompt_cache(model)
            if sparse:
                topk.start("record")
            ref = teacher_forced(model, base, tokens)
            assert bool(mx.all(mx.isfinite(ref))), "the float model itself is not finite"
            if sparse:
                topk.start("replay")
            got = teacher_forced(model, cache, tokens)
            for (i, c), (_, b) in zip(_flat(cache), _flat(base)):
                if isinstance(c, TurboQuantKVCache):
                    # a layer the model never feeds (nemotron-nas's attention replaced by a linear layer) stays
                    # empty in mlx-lm's cache too; every other one compressed
                    assert c.offset == b.offset, f"layer {i}: {c.offset} tokens, mlx-lm's cache holds {b.offset}"
                    assert c.n_coded > 0 or b.offset == 0, f"layer {i}: no token compressed"
            if sparse:
                # the indexer kept index_topk of more tokens (not dense attention), and reading its own compressed
                # cache it picks what the float run picked but for near ties (measured 99.5-99.7%)
                assert topk.sparse_calls() > 0, "the sparse attention never picked: index_topk >= the context"
                assert topk.agreement() > 0.97, f"the cached run's top-k agrees {topk.agreement():.3f} with the float run's"
            errs.append(float((mx.linalg.norm(got - ref, axis=-1) / mx.linalg.norm(ref, axis=-1)).max()))
    err = min(errs)
    assert err < zoo.tolerance(arch), f"8-bit logits {err:.2e} from the float cache (best of {errs})"
    ran, expected = zoo.paths_ran(counts), expected_paths(model, cache)
    assert ran == expected, f"ran {sorted(ran)} ({dict(counts)}), tq_mlx.models.architectures says {sorted(expected)}"
    if not kernels_enabled():  # every attention on the codes ran the reference
        assert counts["reference"] == counts["codes"] + counts["latent"], dict(counts)
    nested = any(type(c) is CacheList for c in cache)
    detail = f"{_layers(tq)} of {len(base)} caches" + (" (inside CacheList)" if nested else "")
    detail += "; " + " and ".join(PATH_WORDS[p] for p in PATH_WORDS if p in ran)
    k_eq_v = [i for i, c in _flat(cache) if isinstance(c, TurboQuantKVCache) and c.k_eq_v]
    if k_eq_v:
        detail += f" (K=V {_layers(k_eq_v)}: one stream, keys derived)"
    if sparse:
        detail += f"; sparse attention (index_topk {topk_of(model)}) on the float run's picks"
    floating = tq_mlx.integration.float_layers(model)
    if floating:
        kinds: dict[str, list[int]] = {}
        for i, k in floating.items():
            kinds.setdefault(k, []).append(i)
        detail += "; float: " + "; ".join(f"{_layers(ix)} {k}" for k, ix in kinds.items())
    if arch in zoo.LOOSER:
        detail += f"; 8-bit bound {zoo.LOOSER[arch][0]:g} ({zoo.LOOSER[arch][1]})"
    return "compressed", detail


def expected_paths(model, cache) -> frozenset[str]:
    """The fetch paths tq_mlx.models.architectures sends the model's fed TurboQuant layers to: its fetch, or
    decode-to-float for K=V layers (one stream, keys derived from the values)."""
    fetch = tq_mlx.integration.model_fetch(model)
    return frozenset("float" if c.k_eq_v else fetch for _, c in _flat(cache)
                     if isinstance(c, TurboQuantKVCache) and c.offset > 0)


def topk_of(model) -> int:
    from mlx_lm.models.deepseek_v32 import Indexer

    return next(m.index_topk for m in model.modules() if isinstance(m, Indexer))


def row(arch: str, kind: str, detail: str) -> str:
    return f"| `{arch}` | {kind} | {detail} |"


# Most architectures take 0.2-1 s; the whole zoo about a minute on 2 cores.
@pytest.mark.slow
@pytest.mark.parametrize("arch", zoo.architectures())
def test_zoo(arch):
    kind, detail = outcome(arch)
    readme_rows = [line for line in README.read_text().splitlines() if line.startswith(f"| `{arch}` |")]
    assert readme_rows == [row(arch, kind, detail)], "README's Model support table is stale: python -m tests.test_zoo --table"


def _rel(got: mx.array, ref: mx.array) -> float:
    return float((mx.linalg.norm(got - ref, axis=-1) / mx.linalg.norm(ref, axis=-1)).max())


# Most architectures take 1-3 s.
@pytest.mark.slow
@pytest.mark.parametrize("arch", [a for a in zoo.architectures() if a not in zoo.NOT_BUILDABLE])
def test_default_config_at_low_bits(arch):
    # The default's codes (LOW: its bits, query weights, keys centered before RoPE, plus decay) on each architecture's
    # own path: the path that ran is the one the 8-bit run takes; tokens decayed; on the codes the keys were
    # weighed; attention on the codes gives the logits of the same codes decoded and attended by mlx's SDPA (to
    # rounding: both read the same stored tokens, so this holds at any bits); and the logits stay within the low-bit
    # bound of the float cache's (zoo.low_tolerance).
    model = zoo.build(arch)
    try:
        tq_mlx.make_prompt_cache(model, LOW)
    except ValueError as e:
        with pytest.raises(ValueError, match=re.escape(str(e).split(";")[0])):  # refused at 8 bits alike (test_zoo)
            tq_mlx.make_prompt_cache(model, CONFIG)
        return
    sparse = zoo.has_indexer(model)
    errs, got = [], []
    with pytest.MonkeyPatch.context() as mp:
        counts = zoo.watch_paths(mp)
        topk = zoo.TopK(mp) if sparse else None
        for tokens in DRAWS:
            if sparse:
                topk.start("record")
            ref = teacher_forced(model, mlx_cache.make_prompt_cache(model), tokens)
            if sparse:
                topk.start("replay")
            cache = tq_mlx.make_prompt_cache(model, LOW)
            got.append(teacher_forced(model, cache, tokens))
            errs.append(_rel(got[-1], ref))
            fed = [c for _, c in _flat(cache) if isinstance(c, TurboQuantKVCache) and c.offset > 0]
            assert fed and all(c.n_coded > 0 for c in fed), "no token compressed"
            assert any(c.n_decayed[0] > 0 for c in fed), "no token decayed"
    ran = zoo.paths_ran(counts)
    assert ran == expected_paths(model, cache), f"ran {sorted(ran)} ({dict(counts)})"
    if "codes" in ran:
        assert counts["weighed"] > 0, "no attention on keys weighed by the queries"
    if ran & {"codes", "latent"}:
        same = []
        with pytest.MonkeyPatch.context() as mp:
            zoo.decoded_attention(mp)
            for tokens, g in zip(DRAWS, got):
                same.append(_rel(g, teacher_forced(model, tq_mlx.make_prompt_cache(model, LOW), tokens)))
        # rounding apart, both runs store the same codes; a code that lands on a decision boundary can still
        # flip in one draw (7.8e-4 once, llama), so the best of the draws
        assert min(same) < 1e-5, f"attention on the codes vs the codes decoded: {same}"
    err = min(errs)
    assert err < zoo.low_tolerance(arch), f"low-bit logits {err:.3f} from the float cache (best of {errs})"


def test_afm7_bound_fails_noisy_codes():
    # afm7's 8-bit bound (zoo.LOOSER) is loose enough for its measurement and tight enough that codes 2% less
    # accurate fail it: the same run, every decoded compressed token moved by 2% of its norm, misses the bound on
    # every draw (by 2.3x at best). Its attention sees real int8 scales (zoo._afm7_quant_scale), not 1.0.
    from mlx_lm.models.afm7 import Attention

    model = zoo.build("afm7")
    scales = [float(s) for m in model.modules() if isinstance(m, Attention) for s in (m.quant_key_scale, m.quant_value_scale)]
    assert scales and scales == pytest.approx([zoo.AFM7_QUANT_SCALE] * len(scales))
    bound = zoo.tolerance("afm7")
    with pytest.MonkeyPatch.context() as mp:
        zoo.noisy_codes(mp, 0.02)
        for tokens in DRAWS:
            ref = teacher_forced(model, mlx_cache.make_prompt_cache(model), tokens)
            err = _rel(teacher_forced(model, tq_mlx.make_prompt_cache(model, CONFIG), tokens), ref)
            assert err > 1.5 * bound, f"2% noise on the codes gives {err:.2e}, within 1.5x of the bound {bound:g}"


@pytest.mark.parametrize("arch", ["stablelm", "phi", "phixtral"])
def test_models_that_only_cast_what_they_fetch_stay_on_the_codes(arch):
    # stablelm casts the fetched keys to float32 (stablelm.py:119-120), phi and phixtral read the fetched values'
    # dtype to cast the output back (phi.py:102, phixtral.py:80): nothing that needs the tokens in float.
    from tq_mlx.models.architectures import fetch_for

    assert fetch_for({arch}) == "codes"
    kind, detail = outcome(arch)
    assert kind == "compressed" and detail.endswith("; on the codes") and arch not in zoo.LOOSER, detail


def test_every_architecture_is_accounted_for():
    archs = zoo.architectures()
    assert len(archs) > 100 and {"llama", "qwen3", "falcon_h1", "gemma3n", "olmo"} <= set(archs)
    assert set(zoo.NOT_BUILDABLE) <= set(archs) and set(zoo.OVERRIDES) <= set(archs)


# --- CacheList, keys_and_values, max_kv_size -----------------------------------------------------------------


def test_cache_list_members_are_compressed_and_round_trip(tmp_path):
    model = zoo.build("falcon_h1")
    cache = tq_mlx.make_prompt_cache(model, CONFIG)
    assert all(type(c) is CacheList and isinstance(c.caches[1], TurboQuantKVCache) for c in cache)
    assert [c.caches[1].layer_index for c in cache] == [0, 1, 2, 3]
    teacher_forced(model, cache)
    path = str(tmp_path / "falcon.safetensors")
    mlx_cache.save_prompt_cache(path, cache)
    loaded = tq_mlx.load_prompt_cache(path, model, config=CONFIG)
    nxt = mx.array([[7]])
    np.testing.assert_array_equal(np.array(model(nxt, cache=cache)), np.array(model(nxt, cache=loaded)))


def test_keys_and_values_serves_kv_shared_layers():
    model = zoo.build("gemma3n")
    cache = tq_mlx.make_prompt_cache(model, CONFIG)
    teacher_forced(model, cache)
    c = next(c for c in cache if isinstance(c, TurboQuantKVCache))
    k, v = c.keys_and_values()
    assert k.n_tokens == v.n_tokens == c.offset == len(TOKENS) and k.n_coded > 0


def test_models_with_nothing_to_compress_are_refused():
    with pytest.raises(ValueError, match=r"no layer holds a full-attention KVCache.*layers 0, 1, 2, 3: ArraysCache"):
        tq_mlx.make_prompt_cache(zoo.build("mamba"))
    with pytest.raises(ValueError, match=r"layers 1, 3: RotatingKVCache \(sliding window\).*mlx-lm's own cache"):
        tq_mlx.make_prompt_cache(zoo.build("recurrent_gemma"))


def table() -> str:
    counts: dict[str, int] = {}
    rows = ["| architecture | outcome | detail |", "|---|---|---|"]
    for arch in zoo.architectures():
        try:
            kind, detail = outcome(arch)
        except AssertionError as e:
            kind, detail = "FAILS THE ZOO TEST", str(e).splitlines()[0]
        counts[kind] = counts.get(kind, 0) + 1
        rows.append(row(arch, kind, detail))
    summary = ", ".join(f"{n} {k}" for k, n in counts.items())
    return f"{len(rows) - 2} architectures: {summary}.\n\n" + "\n".join(rows)


if __name__ == "__main__":
    if "--table" in sys.argv:
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()):  # olmo prints an install hint at import
            text = table()
        print(text)
