"""The Metal kernels' checks and dispatch, under the CPU MSL emulator (tests/emulator): nothing here runs on a
GPU. Shared helpers and fixtures: tests/support/kernel_cases.py; the rest of the kernels' matrix:
tests/test_kernels.py.
* planted bugs (a missing barrier, a shuffle to a wrong lane, a dropped packing shuffle) that must fail;
* the self-check/disable logic, the backend setting and environment variable, MLX's own source generator;
* 5- and 6-bit codes: the dispatchers self-check them and take the kernels;
* mac_check without Metal; the streams' scale and float tokens in the model's dtype; 8-bit (log-coded) norms in
  every kernel, a self-checked variant of their own.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import mlx.core as mx

from tests.support.kernel_cases import (  # noqa: F401  (_clean_dispatch and emulator: the same fixtures)
    BARRIER, SCHEDULES, Counting, Emu, _clean_dispatch, assert_close, assert_codes_equal, cache_step, emulator,
    handle, ids, normal, planted, quantizer, run_decode, small_problem,
)
from tq_mlx import attention as K
from tq_mlx import TurboQuantConfig, TurboQuantKVCache
from tq_mlx.batch import learned
from tq_mlx.stream.view import encode as stream_encode
from tq_mlx.quant.quantizer import TurboQuantMSE, TurboQuantProd
from tq_mlx.quant.rotation import Rotation

ROOT = Path(__file__).resolve().parent.parent


# ===================================================================== 6. planted bugs
def decode_fails(**kw) -> list[str]:
    """Schedules under which decode attention disagrees with the reference (or the emulator errors)."""
    bad = []
    for schedule in SCHEDULES:
        try:
            got, want, *_ = run_decode(np.random.default_rng(8), 64, 4, 4, False, mx.float32, 2, 1, None,
                                       Emu(schedule, seed=5), n=70, split_tokens=32, **kw)
            K._mismatch(got, want) and bad.append(schedule)
        except Exception:
            bad.append(schedule)
    return bad


@pytest.mark.emulator
def test_planted_missing_barrier_after_key_staging_is_detected(emulator, monkeypatch):
    assert decode_fails() == []
    # The first barrier in the tile loop: scores would read key words other threads have not staged yet.
    src = K.SOURCES["decode_partial"]
    i = src.index(BARRIER, src.index("// 1. Stage keys."))
    monkeypatch.setitem(K.SOURCES, "decode_partial", src[:i] + src[i + len(BARRIER):])
    assert decode_fails(), "a missing barrier went unnoticed"


@pytest.mark.emulator
def test_planted_missing_barrier_before_value_accumulation_is_detected(emulator, monkeypatch):
    src = K.SOURCES["decode_partial"]
    i = src.index(BARRIER, src.index("// 3. Stage the values"))
    monkeypatch.setitem(K.SOURCES, "decode_partial", src[:i] + src[i + len(BARRIER):])
    assert decode_fails()


@pytest.mark.emulator
def test_planted_wrong_shuffle_lane_is_detected(emulator, monkeypatch):
    planted(monkeypatch, "common", "simd_shuffle_xor(v[i], m)", "simd_shuffle_xor(v[i], m == 4 ? 8 : m)")
    rot = Rotation(128, seed=1)
    x = normal(np.random.default_rng(0), (4, 128))
    assert K._mismatch(K.rotate(x, rot, metal_kernel=Emu()), K.rotate_reference(x, rot))
    assert decode_fails() == list(SCHEDULES)
    q = quantizer(128, 4)
    x4 = x.reshape(1, 1, 4, 128)
    assert K._codes_mismatch(K.encode(x4, q, metal_kernel=Emu()), K.encode_reference(x4, q), q)


@pytest.mark.emulator
def test_planted_packing_bug_is_detected(emulator, monkeypatch):
    # Lanes of one word no longer OR their fields together: 4-bit codes at d=128 lose half their bits.
    planted(monkeypatch, "common", "bits |= simd_shuffle_xor(bits, m);", "bits |= 0u;")
    q = quantizer(128, 4)
    x = normal(np.random.default_rng(0), (1, 2, 4, 128))
    assert K._codes_mismatch(K.encode(x, q, metal_kernel=Emu()), K.encode_reference(x, q), q)


# ============================================ 7. dispatch: setting, env var, self-check
def test_backend_setting_and_env_var(monkeypatch):
    assert K.get_backend() == "auto"
    assert K.kernels_enabled() == K.metal_available()  # here (Linux): no Metal, auto -> reference
    for mode in K.BACKENDS:
        monkeypatch.setenv(K.ENV_VAR, mode)
        assert K.get_backend() == mode
    monkeypatch.setenv(K.ENV_VAR, "metal")
    assert K.kernels_enabled()
    K.set_backend("reference")  # the setting wins over the environment
    assert K.get_backend() == "reference" and not K.kernels_enabled()
    with pytest.raises(ValueError, match="must be one of"):
        K.set_backend("cuda")
    K.set_backend(None)
    monkeypatch.setenv(K.ENV_VAR, "gpu")
    with pytest.raises(ValueError, match="TQ_MLX_KERNELS must be one of"):
        K.get_backend()


@pytest.mark.parametrize("mode", ["auto", "reference"])
def test_reference_path_without_metal(monkeypatch, mode):
    if mode == "auto" and K.metal_available():
        pytest.skip("on a Mac, auto runs the kernels")
    monkeypatch.setenv(K.ENV_VAR, mode)
    never = Counting()
    K.set_kernel_factory(never)
    q, keys, values = small_problem()
    out = K.dispatch_attention(q, keys, values, 0.125, None)
    assert mx.array_equal(out, K.decode_attention_reference(q, keys, values, 0.125))
    assert never.made == 0


@pytest.mark.emulator
def test_forced_metal_runs_self_checked_kernels(emulator, monkeypatch):
    monkeypatch.setenv(K.ENV_VAR, "metal")
    factory = Counting(Emu())
    K.set_kernel_factory(factory)
    q, keys, values = small_problem()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a passing self-check warns about nothing
        out = K.dispatch_attention(q, keys, values, 0.125, None)
        assert_close(out, K.decode_attention_reference(q, keys, values, 0.125), mx.float16)
        assert factory.made == 3  # wht, decode_partial, decode_merge
        assert all(v is None for v in K.self_check_status().values())
        x = normal(np.random.default_rng(1), (1, 2, 3, 64))
        assert_codes_equal(K.dispatch_encode(x, keys.quantizer, keys.mean),
                           K.encode_reference(x, keys.quantizer, keys.mean), keys.quantizer)
        assert_close(K.dispatch_dequantize(keys), K.dequantize_reference(keys), mx.float16)
        rot = keys.quantizer.groups[0].rotation
        assert_close(K.dispatch_rotate(x, rot, True), K.rotate_reference(x, rot, True), mx.float32)
    assert {k[0] for k in K.self_check_status()} == {"decode_attention", "encode", "dequantize", "rotate"}


@pytest.mark.emulator
@pytest.mark.parametrize("kb,vb,dim", [(3.5, 2.5, 64), (4, 3, 96), (2.5, 4, 80)], ids=ids)
def test_dispatch_runs_kernels_for_channel_groups_and_other_head_dims(emulator, monkeypatch, kb, vb, dim):
    monkeypatch.setenv(K.ENV_VAR, "metal")
    factory = Counting(Emu())
    K.set_kernel_factory(factory)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every self-check passes
        for L in (2, 12):  # decode_attention, then prefill_attention
            q, keys, values = cache_step(kb, vb, False, dim, 1, 2, L, mx.float16)
            mask = "causal"
            assert_close(K.dispatch_attention(q, keys, values, 0.1, mask),
                         K.decode_attention_reference(q, keys, values, 0.1, mask), mx.float16)
        x = normal(np.random.default_rng(1), (1, 2, 3, dim))
        for kv in (keys, values):
            args = (x, kv.quantizer, kv.mean, kv.perm, kv.scale)
            assert_codes_equal(K.dispatch_encode(*args), K.encode_reference(*args), kv.quantizer)
    assert {k[0] for k, v in K.self_check_status().items() if v is None} == {
        "decode_attention", "prefill_attention", "encode"}
    assert factory.made == 4  # decode_partial, decode_merge, prefill_attention, encode_dense: no WHT kernel


@pytest.mark.emulator
@pytest.mark.parametrize("kb,vb,dim,trellis", [(5, 4, 128, False), (6, 6, 64, False), (6, 5, 80, False),
                                               (4, 3, 128, True), (3.5, 2.5, 64, True)], ids=ids)
def test_dispatch_takes_the_kernels_at_5_and_6_bits_and_for_trellis_codes(emulator, monkeypatch, kb, vb, dim, trellis):
    # Where the kernels run, no 5- or 6-bit view and no trellis codes take the reference path: decode and prefill
    # attention, encode (trellis codes: the search on viterbi.metal) and dequantize each pass their self-check and run.
    monkeypatch.setenv(K.ENV_VAR, "metal")
    f = Emu()
    K.set_kernel_factory(f)
    dequantized = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every self-check passes
        for L in (1, 12):  # decode_attention, then prefill_attention
            q, keys, values = cache_step(kb, vb, False, dim, 1, 2, L, mx.float16, trellis=trellis)
            assert all(g.trellis is trellis for kv in (keys, values) for g in kv.quantizer.groups)
            mask = "causal" if L > 1 else None
            assert_close(K.dispatch_attention(q, keys, values, 0.1, mask),
                         K.decode_attention_reference(q, keys, values, 0.1, mask), mx.float16)
        x = normal(np.random.default_rng(1), (1, 2, 3, dim))
        for kv in (keys, values):
            args = (x, kv.quantizer, kv.mean, kv.perm, kv.scale)
            assert_codes_equal(K.dispatch_encode(*args), K.encode_reference(*args), kv.quantizer)
            if K.dequantize_unsupported(kv) is None:  # one WHT group (as at every width)
                dequantized = True
                assert_close(K.dispatch_dequantize(kv), K.dequantize_reference(kv), mx.float16)
    status = K.self_check_status()
    assert all(why is None for why in status.values())
    assert {k[0] for k in status} == {"decode_attention", "prefill_attention", "encode"} | (
        {"dequantize"} if dequantized else set())
    assert dequantized is (dim != 80 and kb == int(kb))  # a WHT dim, one code group
    names = {launch.name for launch in f.launches}
    assert {"tq_decode_partial", "tq_prefill_attention"} <= names
    assert ("tq_viterbi" in names) is trellis


@pytest.mark.emulator
@pytest.mark.parametrize(
    "bug",
    [
        ("decode_partial", "const float p = valid ? fast::exp(sk - mn) : 0.0f;",
         "const float p = valid ? fast::exp(sk - m[k]) : 0.0f;"),  # wrong softmax reference point
        ("decode_partial", BARRIER, ""),  # every barrier gone
        ("decode_merge", "/ l);", "/ l) +;"),  # a compile error
    ],
    ids=["wrong-math", "no-barriers", "compile-error"],
)
def test_self_check_disables_a_bad_kernel_and_warns_once(emulator, monkeypatch, bug):
    name, old, new = bug
    planted(monkeypatch, name, old, new, count=10 if old == BARRIER else 1)
    monkeypatch.setenv(K.ENV_VAR, "metal")
    K.set_kernel_factory(Emu())
    q, keys, values = small_problem()
    want = K.decode_attention_reference(q, keys, values, 0.125)
    with pytest.warns(RuntimeWarning, match=r"'decode_attention' .* disabled; the reference path is used"):
        out = K.dispatch_attention(q, keys, values, 0.125, None)
    assert mx.array_equal(out, want)  # never a silent wrong answer
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: the second call is quiet and still right
        assert mx.array_equal(K.dispatch_attention(q, keys, values, 0.125, None), want)
    (reason,) = [v for k, v in K.self_check_status().items() if k[0] == "decode_attention"]
    assert reason


@pytest.mark.parametrize(
    "case",
    ["head_dim_640", "float32_norms", "int_mask", "qjl_1bit"],
)
def test_unsupported_cases_fall_back_to_reference(monkeypatch, case):
    monkeypatch.setenv(K.ENV_VAR, "metal")
    never = Counting()
    K.set_kernel_factory(never)
    rng = np.random.default_rng(0)
    dim, kq, L, mask = 64, quantizer(64, 4, seed=2), 1, None
    if case == "head_dim_640":
        dim, kq = 640, quantizer(640, 4, seed=2)
    elif case == "float32_norms":
        kq = TurboQuantMSE(64, 4, seed=2, norm_dtype=mx.float32)
    elif case == "qjl_1bit":
        kq = TurboQuantProd(64, 1, seed=2)
    keys = handle(rng, kq, n=20)
    values = handle(rng, quantizer(dim, 4, seed=3), n=20)
    if case == "int_mask":  # bool and float array masks run in the kernels (section 11)
        mask = mx.ones((1, keys.n_tokens), dtype=mx.int32)
    q = normal(rng, (1, 2, L, dim))
    assert K.decode_unsupported(q, keys, values, mask)
    out = K.dispatch_attention(q, keys, values, 0.1, mask)
    assert mx.array_equal(out, K.decode_attention_reference(q, keys, values, 0.1, mask))
    assert never.made == 0


# ================================================= 8. source generation = MLX's own
@pytest.mark.emulator
def test_every_kernel_source_matches_mlx_generator(emulator):
    from tests.emulator import generate_source
    from tests.emulator.mlx_reference import mlx_generated_source

    f = Emu()
    rng = np.random.default_rng(0)
    run_decode(rng, 64, 3, 4, True, mx.bfloat16, 2, 2, "causal", f, split_tokens=32)
    x = normal(rng, (1, 2, 3, 64), mx.float16)
    K.encode(x, quantizer(64, 2), None, metal_kernel=f)
    K.encode(x, quantizer(64, 3, qjl=True), normal(rng, (1, 2, 64)), metal_kernel=f)
    K.dequantize(handle(rng, quantizer(64, 1), n=4), mx.bfloat16, metal_kernel=f)
    K.rotate(x, Rotation(64), True, metal_kernel=f)
    K.encode(x, quantizer(64, 3.5), None, mx.array(np.stack([rng.permutation(64)] * 2).astype(np.int32)),
             metal_kernel=f)
    run_decode(rng, 80, 2.5, 4, False, mx.float16, 1, 1, None, f, split_tokens=32)  # outc, no in-kernel rotation
    K.encode(x, quantizer(64, 6), None, metal_kernel=f)  # bit planes 4 + 2
    K.dequantize(handle(rng, quantizer(64, 5), n=4), mx.float16, metal_kernel=f)  # 4 + 1
    names = {launch.name for launch in f.launches}
    assert names == {"tq_wht", "tq_encode", "tq_encode_dense", "tq_dequantize", "tq_decode_partial", "tq_decode_merge"}
    for launch in f.launches:
        m, c = launch.make, launch.call
        ours = generate_source(m["name"], m["input_names"], m["output_names"], m["source"], m["header"],
                               c["inputs"], c["output_dtypes"], c["template"])[1]
        theirs = mlx_generated_source(m["name"], m["input_names"], m["output_names"], m["source"], c["inputs"],
                                      c["output_shapes"], c["output_dtypes"], header=m["header"],
                                      template=c["template"])
        assert ours == theirs, launch.name
        assert ours == launch.stats.source


# ========================================================================== 9. mac_check
@pytest.mark.skipif(K.metal_available(), reason="on a Mac the script runs the real check")
def test_mac_check_exits_cleanly_without_metal(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "mac_check.py"), "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Metal is not available on this machine (" in proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.emulator
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32], ids=ids)
@pytest.mark.parametrize("magnitude", [1e-8, 1e5])
def test_kernels_take_the_streams_scale_and_float_tokens_in_the_models_dtype(emulator, dtype, magnitude):
    # A bfloat16 or float32 model's cache keeps its sinks and window in that dtype and stores codes of
    # (x - μ) / scale: decode attention, encode and dequantize all agree with the reference on it.
    rng = np.random.default_rng(5)
    # the default's K4/V4 and 8-bit norms at a small window (prefill not read as decode: the views are read by queries of any count)
    cache = TurboQuantKVCache(TurboQuantConfig(window=16, calibration_tokens=None, sinks=4, compress_block=8, prefill_as_decode=False))
    k = ((normal(rng, (1, 2, 70, 64)) + 0.7) * magnitude).astype(dtype)
    v = (normal(rng, (1, 2, 70, 64)) * magnitude).astype(dtype)
    keys, values = cache.update_and_fetch(k, v)
    # the cache learns from the prefill's queries first, as in the hook (its own generator: the draws below stay)
    prefill_q = (normal(np.random.default_rng(6), (1, 4, 70, 64)) / magnitude).astype(dtype)
    keys, values = learned(prefill_q, keys, values, 0.125)
    assert keys.window.dtype == keys.sinks.dtype == dtype and keys.scale is not None and values.scale is not None
    for L in (1, 3):
        q = (normal(rng, (1, 4, L, 64)) / magnitude).astype(dtype)
        mask = "causal" if L > 1 else None
        assert K.decode_unsupported(q, keys, values, mask) is None
        got = K.decode_attention(q, keys, values, 0.125, mask, split_tokens=32, metal_kernel=Emu())
        want = K.decode_attention_reference(q, keys, values, 0.125, mask)
        assert_close(got.astype(mx.float32) / magnitude, want.astype(mx.float32) / magnitude, dtype)
    x = (normal(rng, (1, 2, 8, 64)) + 0.7) * magnitude
    kq = keys.quantizer
    assert_codes_equal(K.encode(x, kq, keys.mean, None, keys.scale, metal_kernel=Emu()),
                       stream_encode(x, kq, keys.mean, None, keys.scale), kq)
    assert_close(K.dequantize(keys, mx.float32, metal_kernel=Emu()) / magnitude,
                 K.dequantize_reference(keys, mx.float32) / magnitude, mx.float32)


# ================================================================ 10. 8-bit (log-coded) norms
# the fine code (int8, norm_steps 32, the default) and the coarse one (uint8, 16: caches and files before 2026-12-06)
LOG_CODES = {"int8": dict(norm_bits=8), "uint8": dict(norm_bits=8, norm_steps=16)}


@pytest.mark.emulator
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("code", list(LOG_CODES))
@pytest.mark.parametrize("kb,vb,qjl,dim", [(4, 3, False, 64), (3.5, 2.5, False, 96), (3, 2, True, 128)], ids=ids)
def test_log_coded_norms_on_cache_in_every_kernel(emulator, schedule, code, kb, vb, qjl, dim):
    for L in (2, 12):  # decode_attention, prefill_attention
        q, keys, values = cache_step(kb, vb, qjl, dim, 2, 2, L, mx.float16, **LOG_CODES[code])
        assert keys.codes.norms.dtype == values.codes.norms.dtype == getattr(mx, code)
        f = Emu(schedule, seed=3)
        if L <= K.MAX_QUERY_TOKENS:
            got = K.decode_attention(q, keys, values, 0.1, "causal", split_tokens=32, metal_kernel=f)
        else:
            got = K.prefill_attention(q, keys, values, 0.1, "causal", metal_kernel=f)
        assert_close(got, K.decode_attention_reference(q, keys, values, 0.1, "causal"), mx.float16, f"L={L}")
    x = normal(np.random.default_rng(2), (2, 2, 33, dim)) * 3.0
    for kv in (keys, values):
        args = (x, kv.quantizer, kv.mean, kv.perm, kv.scale)
        if K.encode_unsupported(*args) is None:
            got = K.encode(*args, metal_kernel=Emu(schedule))
            want = K.encode_reference(*args)
            assert got.norms.dtype == getattr(mx, code)
            assert int(mx.sum(got.norms != want.norms)) <= 1  # a log2 within rounding of a half step may flip
            assert_codes_equal(got, want, kv.quantizer)
        if K.dequantize_unsupported(kv) is None:
            assert_close(K.dequantize(kv, mx.float32, metal_kernel=Emu(schedule)), K.dequantize_reference(kv, mx.float32),
                         mx.float32)


@pytest.mark.emulator
def test_log_coded_norms_are_self_checked_variants_of_their_own(emulator, monkeypatch):
    monkeypatch.setenv(K.ENV_VAR, "metal")
    K.set_kernel_factory(Emu())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for norms in (dict(norm_bits=16), *LOG_CODES.values()):
            q, keys, values = cache_step(4, 3, False, 64, 1, 2, 1, mx.float16, **norms)
            assert_close(K.dispatch_attention(q, keys, values, 0.1), K.decode_attention_reference(q, keys, values, 0.1),
                         mx.float16)
    dtypes = {"mlx.core.float16", "mlx.core.int8", "mlx.core.uint8"}
    checked = [v for (kernel, v), reason in K.self_check_status().items() if kernel == "decode_attention"]
    assert len(checked) == 3 and {v[2].norms for v in checked} == dtypes
    encodes = [v for (kernel, v) in K.self_check_status() if kernel == "encode"]
    assert {v[-1] for v in encodes} == dtypes
