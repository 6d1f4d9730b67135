"""Where a held prompt cache resumes a longer prompt exactly (tq_mlx.prompt_cache.resume): trimmed to the resume point and fed the
rest, a cache holds what a fresh prefill of the prompt holds, part for part and with the same calibration, for every
kind of hit (a shorter cache, a trim inside the window, a trim into the codes, into decayed codes); mlx-lm's own trim
to the common prefix does not. On a tiny random llama with a small window, so that a few hundred tokens compress and
decay; the greedy tokens of a real model after each kind of hit are tests/test_prompt_cache_hits.py's."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest

from tests.support.tiny_models import tiny_llama
from tq_mlx import TurboQuantConfig, make_prompt_cache
from tq_mlx.prompt_cache.resume import (LayerCounts, StreamCounts, cache_counts, counts_from_json, counts_to_json, resume,
                           resume_point)

CFG = TurboQuantConfig(window=32, calibration_tokens=None, compress_block=16, sinks=4, decay_after=96)
# the first compression waits for 100 tokens and calibrates on them; the window holds 32 from then on
CALIBRATED = TurboQuantConfig(window=32, compress_block=16, sinks=4, decay_after=96, calibration_tokens=100)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(layers=2)[0]


def fed(model, tokens, cache=None, config=CFG, chunk=64):
    """A cache fed `tokens` in prefill chunks (as mlx-lm's generate_step feeds them), and the last logits."""
    cache = make_prompt_cache(model, config) if cache is None else cache
    logits = None
    for i in range(0, len(tokens), chunk):
        logits = model(mx.array(tokens[i:i + chunk])[None], cache=cache)
        mx.eval(logits, [c.state for c in cache])
    return cache, logits[0, -1]


def parts(cache) -> list[tuple]:
    """Every stream's (sinks, decayed, fresh, window) and its calibration's presence, layer by layer."""
    return [(s.n_sinks, s.n_decayed, s.n_fresh, s.n_window, s.mean is not None, s.quantizer.bits)
            for c in cache for s in c.streams]


def tokens(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def hit(model, held_tokens, prompt, how="resume", config=CFG):
    """The cache for `prompt` made from one of held_tokens: trimmed to the resume point (how="resume") or to the
    common prefix as mlx-lm trims (how="common"), then fed the rest."""
    cache, _ = fed(model, held_tokens, config=config)
    common = next((i for i, (a, b) in enumerate(zip(held_tokens, prompt)) if a != b), min(len(held_tokens),
                                                                                          len(prompt)))
    point = resume(cache, len(held_tokens), common, len(prompt)) if how == "resume" else min(common, len(prompt) - 1)
    cache = copy.deepcopy(cache)
    for c in cache:
        c.trim(len(held_tokens) - point)
    return fed(model, prompt[point:], cache, config), point, common


BASE = tokens(400, 0)
KINDS = {
    # name: (the held cache's tokens, the new prompt)
    "a shorter cache": (BASE[:200], BASE[:200] + tokens(40, 1)),
    "a trim inside the window": (BASE[:150] + tokens(10, 2), BASE[:150] + tokens(30, 3)),
    "a trim into the codes": (BASE[:150] + tokens(60, 4), BASE[:150] + tokens(20, 5)),
    "a trim into decayed codes": (BASE[:300] + tokens(100, 6), BASE[:250] + tokens(30, 7)),
}


@pytest.mark.parametrize("config", [CFG, CALIBRATED], ids=["window", "calibration tokens"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_cache_resumed_at_its_point_holds_what_a_fresh_prefill_holds(model, kind, config):
    held, prompt = KINDS[kind]
    (cache, logits), point, common = hit(model, held, prompt, config=config)
    fresh, fresh_logits = fed(model, prompt, config=config)
    assert 4 < point <= common and point < len(prompt)
    assert parts(cache) == parts(fresh), (point, common)
    assert cache[0].offset == fresh[0].offset == len(prompt)
    # The same parts from the same calibration: the logits agree to what the prefill chunks' boundaries leave.
    assert mx.max(mx.abs(logits - fresh_logits)).item() < 0.05 * mx.max(mx.abs(fresh_logits)).item()


@pytest.mark.parametrize("kind", ["a trim into the codes", "a trim into decayed codes"])
def test_mlx_lms_trim_to_the_common_prefix_holds_other_parts(model, kind):
    # What the resume point avoids: trimmed into its codes (or decayed codes) and fed, a cache compresses other
    # tokens than a fresh prefill, in blocks that start elsewhere, or keeps tokens decayed that a fresh one holds fresh.
    held, prompt = KINDS[kind]
    (cache, _), point, common = hit(model, held, prompt, how="common")
    fresh, _ = fed(model, prompt)
    assert parts(cache) != parts(fresh)
    assert resume(fed(model, held)[0], len(held), common, len(prompt)) < common  # so resume goes further back


def test_a_trim_that_decays_fewer_tokens_goes_below_the_decayed_codes(model):
    held, prompt = KINDS["a trim into decayed codes"]
    cache, _ = fed(model, held)
    fresh, _ = fed(model, prompt)
    point = resume(cache, len(held), 250, len(prompt))
    kept_decayed = max(s.n_decayed for c in cache for s in c.streams)
    assert kept_decayed > max(s.n_decayed for c in fresh for s in c.streams)  # the held cache decayed more
    assert point <= CFG.sinks + max(s.n_decayed for c in fresh for s in c.streams)


def test_no_point_where_the_calibration_is_not_shared_or_still_learning(model):
    # Codes calibrated on tokens the new prompt does not share (common < sinks + window) cannot be kept; a cache
    # that has not compressed yet and still sums its queries for the key weights cannot be trimmed at all.
    held = BASE[:200]
    cache, _ = fed(model, held)
    assert resume(cache, 200, 30, 240) == 0
    # calibrated on the first 100 tokens after the sinks: a prompt that shares 60 cannot keep the codes
    assert resume(cache, 200, 60, 240) > 0
    assert resume(fed(model, held, config=CALIBRATED)[0], 200, 60, 240) == 0
    short, _ = fed(model, BASE[:30])  # 30 < sinks + window: nothing compressed, the queries still being summed
    assert all(lay.streams[0].learns for lay in cache_counts(short))  # the key streams (the values weigh nothing)
    assert resume(short, 30, 20, 60) == 0
    assert resume(short, 30, 30, 60) == 30  # a shorter cache continues as it is


def test_a_cache_that_cannot_trim_only_resumes_where_it_ends():
    layers = [LayerCounts(False)]  # mlx-lm's ArraysCache (linear attention state)
    assert resume_point(layers, 100, 100, 150) == 100
    assert resume_point(layers, 100, 80, 150) == 0
    assert resume_point(layers, 100, 100, 100) == 0  # one token must be left to feed


def test_counts_round_trip_through_json_and_refuse_garbage(model):
    cache, _ = fed(model, BASE[:300])
    counts = cache_counts(cache)
    assert counts_from_json(counts_to_json(counts)) == counts
    assert all(isinstance(s, StreamCounts) for lay in counts for s in lay.streams)
    for bad in ([[1, None, [[1, 2, 3]]]], [[1, None, [[-1, 0, 0, 0, 4, 32, 32, 16, None, 0]]]], "x", [[1, "big", []]]):
        with pytest.raises(ValueError):
            counts_from_json(bad)
