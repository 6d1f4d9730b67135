"""The Metal attention kernels with learned sinks, array masks and multi-head latent attention, under the CPU
MSL emulator (tests/emulator): nothing here runs on a GPU. Shared helpers and fixtures:
tests/support/kernel_cases.py; the rest of the kernels' matrix: tests/test_kernels.py.
* learned sinks and bool/additive array masks ((L, T), (B, 1, L, T), (B, Hq, L, T)) in all three schedules;
  multi-head latent attention's decode (keys = values = one latent view, R = 16..128 query heads, head dim 512
  and 32, additive rope scores): the kernel path, codes read once for keys and values; at 8 bits against
  mlx-lm's float attention and mx.fast SDPA(sinks=) through dispatch_attention; planted sink/mask bugs the
  self-check must catch; masks the kernels cannot read fall back.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import mlx.core as mx

from tests.support.kernel_cases import (  # noqa: F401  (_clean_dispatch and emulator: the same fixtures)
    SCHEDULES, Counting, Emu, _clean_dispatch, assert_close, case_id, emulator, handle, make_mask, mla_step, normal,
    planted, quantizer, run_masked, small_problem,
)
from tq_mlx import attention as K
from tq_mlx import TurboQuantConfig, TurboQuantKVCache
from tq_mlx.attention.reference import keys_are_values


# ====================================== 11. learned sinks, array masks, MLA (keys are values, additive mask)
SINK_MASK_CASES = [
    # dk, kb, vb, qjl, dtype, R, L, mask, learned sinks
    (128, 4, 4, False, mx.float16, 4, 1, None, True),  # gpt-oss-like decode with sinks
    (64, 3, 2, True, mx.bfloat16, 2, 3, "causal", True),  # sinks, QJL keys, speculative verify
    (64, 4, 3, False, mx.float16, 2, 2, "bool-batch", False),  # batched generation's (B, 1, L, T) mask
    (64, 4, 3, False, mx.float32, 4, 4, "add-heads-float32", True),  # per-head additive mask and sinks
    (128, 8, 3, False, mx.float16, 2, 2, "bool-2d", True),  # (L, T) bool
    (80, 3.5, 2.5, False, mx.bfloat16, 8, 1, "add-heads-bfloat16", False),  # groups; host-rotated outc
]


@pytest.mark.emulator
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("case", SINK_MASK_CASES, ids=case_id)
def test_decode_learned_sinks_and_array_masks(emulator, schedule, case):
    dk, kb, vb, qjl, dtype, R, L, mask, sinks = case
    got, want = run_masked(np.random.default_rng(R * L), dk, kb, vb, qjl, dtype, R, L, mask, sinks, "decode",
                           Emu(schedule, seed=9), split_tokens=32)  # 70 tokens: 3 splits
    assert got.dtype == dtype
    assert_close(got, want, dtype, schedule)


@pytest.mark.emulator
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("R,D", [(16, 512), (128, 512), (128, 32), (20, 512)])
def test_mla_decode_keys_are_values_with_additive_mask(emulator, schedule, R, D):
    # k = v = the compressed latent (head dim 512 in DeepSeek-V3 / Kimi K2 / GLM-4.7-Flash, the zoo's 32), 16..128
    # query heads on one kv head: the kernel takes it (query rows in chunks where threadgroup memory needs) and
    # reads the codes once for keys and values.
    q, kv, pe, _ = mla_step(R, D)
    assert K.decode_unsupported(q, kv, kv, pe) is None and keys_are_values(kv, kv)
    f = Emu(schedule, seed=4)
    got = K.decode_attention(q, kv, kv, 0.1, pe, metal_kernel=f)
    assert_close(got, K.decode_attention_reference(q, kv, kv, 0.1, pe), mx.bfloat16, schedule)
    (p1,) = f.stats("tq_decode_partial")
    chunks = p1.grid[2]
    assert p1.buffers["kc"].unique_bytes_read == p1.buffers["kc"].nbytes
    assert p1.buffers["kc"].total_bytes_read == chunks * p1.buffers["kc"].nbytes  # once per chunk of query rows
    assert p1.buffers["vc"].total_bytes_read == p1.buffers["vn"].total_bytes_read == 0  # the key words serve


@pytest.mark.emulator
def test_mla_decode_at_8_bits_tracks_mlx_lm_float_attention(emulator, monkeypatch):
    # Through dispatch_attention (the hook's call), self-checked, against mlx-lm's attention on the float latent.
    from mlx_lm.models.base import scaled_dot_product_attention

    monkeypatch.setenv(K.ENV_VAR, "metal")
    f = Emu()
    K.set_kernel_factory(f)
    for R, D in ((16, 512), (20, 32)):
        q, kv, pe, latent = mla_step(R, D, bits=8)
        f.launches.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the self-check passes
            got = K.dispatch_attention(q, kv, kv, scale=0.1, mask=pe)
        assert {"tq_decode_partial", "tq_decode_merge"} <= {x.name for x in f.launches}
        want = scaled_dot_product_attention(q, latent, latent, cache=None, scale=0.1, mask=pe)
        err = float(mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max())
        assert err < 0.03 * float(mx.abs(want.astype(mx.float32)).max()), (R, D, err)
    variants = [v for (k, v) in K.self_check_status() if k == "decode_attention"]
    assert all(v[7] == ("mlx.core.bfloat16", True, True) and v[-1] is True for v in variants)  # mask kind; k = v


@pytest.mark.emulator
def test_dispatch_self_checks_each_sinks_and_mask_variant(emulator, monkeypatch):
    monkeypatch.setenv(K.ENV_VAR, "metal")
    f = Emu()
    K.set_kernel_factory(f)
    rng = np.random.default_rng(2)
    keys, values = handle(rng, quantizer(64, 4, seed=2), 2, 2), handle(rng, quantizer(64, 3, seed=3), 2, 2)
    sinks = normal(rng, (4,)) * 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for L, mask in ((1, None), (2, "bool-batch"), (12, "bool-batch"), (12, "add-heads-float16")):
            q = normal(rng, (2, 4, L, 64), mx.float16)
            m = mask if mask is None else make_mask(rng, mask, 2, 4, L, keys.n_tokens)
            f.launches.clear()
            out = K.dispatch_attention(q, keys, values, 0.125, m, sinks=sinks)
            assert_close(out, K.decode_attention_reference(q, keys, values, 0.125, m, sinks), mx.float16)
            assert ("tq_decode_merge" if L == 1 or L == 2 else "tq_prefill_attention") in {x.name for x in f.launches}
    status = K.self_check_status()
    assert len(status) == 4 and all(v is None for v in status.values())
    assert {v[7] for (_, v) in status} == {None, ("mlx.core.bool", True, False), ("mlx.core.float16", True, True)}
    assert all(v[-2] is True for (_, v) in status)  # sinks


@pytest.mark.emulator
@pytest.mark.parametrize("kernel,old,new", [
    ("decode_merge", "tq_mask_score<MASK>(d,", "tq_mask_score<0>(d,"),  # the mask ignored on the float tokens
    ("decode_partial", "amask[moff[k] + t]", "amask[moff[k] + t + 1]"),  # the mask read one column off
    ("decode_merge", "float l = has_sinks ? 1.0f : 0.0f;", "float l = 0.0f;"),  # the sink's weight lost
], ids=["mask-ignored", "mask-column-off", "sink-weight-lost"])
def test_planted_sink_and_mask_bugs_are_caught_by_the_self_check(emulator, monkeypatch, kernel, old, new):
    planted(monkeypatch, kernel, old, new)
    monkeypatch.setenv(K.ENV_VAR, "metal")
    K.set_kernel_factory(Emu())
    rng = np.random.default_rng(3)
    keys, values = handle(rng, quantizer(64, 4, seed=2)), handle(rng, quantizer(64, 3, seed=3))
    q = normal(rng, (1, 4, 1, 64))
    mask, sinks = make_mask(rng, "bool-batch", 1, 4, 1, keys.n_tokens), normal(rng, (4,))
    want = K.decode_attention_reference(q, keys, values, 0.125, mask, sinks)
    with pytest.warns(RuntimeWarning, match=r"'decode_attention' .* disabled"):
        out = K.dispatch_attention(q, keys, values, 0.125, mask, sinks=sinks)
    assert mx.array_equal(out, want)


def test_masks_the_kernels_cannot_read_take_the_reference_path(monkeypatch):
    monkeypatch.setenv(K.ENV_VAR, "metal")
    never = Counting()
    K.set_kernel_factory(never)
    q, keys, values = small_problem()
    T = keys.n_tokens
    for mask, why in ((mx.ones((1, T), dtype=mx.int32), "dtype mlx.core.int32"),
                      (mx.ones((1, 2, 1, T), dtype=mx.bool_), "mask of shape (1, 2, 1"),  # 2 heads for 4
                      ("sliding", "mask 'sliding'")):
        assert why in K.decode_unsupported(q, keys, values, mask)
    assert "learned sinks of shape (2,)" in K.decode_unsupported(q, keys, values, None, mx.zeros(2))
    mask = mx.ones((1, T), dtype=mx.int32)
    assert mx.array_equal(K.dispatch_attention(q, keys, values, 0.1, mask),
                          K.decode_attention_reference(q, keys, values, 0.1, mask))
    assert never.made == 0


@pytest.mark.emulator
def test_learned_sinks_at_8_bits_track_fast_sdpa_on_the_float_cache(emulator, monkeypatch):
    # gpt-oss's full-attention layers: GQA, learned sinks; decode and a prefill chunk through dispatch_attention
    # (the hook's call, self-checked) against mx.fast.scaled_dot_product_attention(sinks=) on the float tokens.
    monkeypatch.setenv(K.ENV_VAR, "metal")
    f = Emu()
    K.set_kernel_factory(f)
    rng = np.random.default_rng(6)
    cache = TurboQuantKVCache(TurboQuantConfig.from_bits(8, window=8, calibration_tokens=None, sinks=2, compress_block=8, step=64,
                                                         prefill_as_decode=False))
    sinks = (normal(rng, (8,)) + 2).astype(mx.bfloat16)
    ks, vs = [], []
    for L in (70, 1, 12):
        k, v = normal(rng, (1, 2, L, 64), mx.bfloat16), normal(rng, (1, 2, L, 64), mx.bfloat16)
        ks.append(k)
        vs.append(v)
        keys, values = cache.update_and_fetch(k, v)
        if L == 70:
            continue
        q = normal(rng, (1, 8, L, 64), mx.bfloat16)
        mask = "causal" if L > 1 else None
        f.launches.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = K.dispatch_attention(q, keys, values, scale=0.125, mask=mask, sinks=sinks)
        assert ("tq_decode_merge" if L == 1 else "tq_prefill_attention") in {x.name for x in f.launches}
        want = mx.fast.scaled_dot_product_attention(q, mx.concatenate(ks, 2), mx.concatenate(vs, 2), scale=0.125,
                                                    mask=mask, sinks=sinks)
        err = float(mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max())
        assert err < 0.03 * float(mx.abs(want.astype(mx.float32)).max()), (L, err)
