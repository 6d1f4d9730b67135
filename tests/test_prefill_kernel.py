"""prefill_attention (tq_mlx/attention/prefill_attention.metal) against the reference attention, under the CPU MSL
emulator (tests/emulator): nothing here runs on a GPU.

* shapes: K4/V3 (the default until 2026-11-26) first, QJL keys, K != V bits, head_dim 64 and 128 (32, 256, 512 and K 128 / V 64
  too; fractional bits and head dims 80 and 96 on real caches in every lane schedule), GQA 1..8, batch 1 and 2, mask None and "causal" (including chunks longer than the window, so the mask
  reaches into the codes, and fewer compressed tokens than a tile), no key/value mean, every float dtype, real
  TurboQuantKVCache views (mean, scale, strided capacity buffers);
* a chunk of 512 queries over 3,000 compressed tokens (+ 600 window tokens), and (slow) over 1,500 at head_dim
  128, GQA 4, batch 2, with byte counts: each compressed byte is read once per query tile (never more), nothing
  but the output is written, and the device buffers the call adds besides the cache are sized by the chunk,
  never by the context;
* reverse and random lane schedules, a planted missing barrier, the self-check and dispatch_attention wiring,
  and MLX's own source generator;
* learned sinks and bool/additive array masks in all three schedules, one view as keys and values (its codes
  read once), and MLX's generator on the masked and sinks variants of both attention kernels;
* 5- and 6-bit codes (bit planes 4+1 and 4+2): built from quantizers, and on real caches built at those widths
  (tests.support.kernel_cases.cache_step) in all three schedules, each code byte read at most once per query tile.
Cost: about 40 s warm, 50 s cold on a 2-core machine at load 10 (the two 512-query chunks take 8 s and 23 s).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

import mlx.core as mx

from tests.support.kernel_cases import (  # noqa: F401  (_clean_dispatch and emulator: the same fixtures)
    BARRIER, SCHEDULES, Counting, Emu, _clean_dispatch, assert_close, cache_step, case_id, emulator, handle, ids,
    make_mask, mla_step, normal, numpy_views, quantizer, run_masked,
)
from tq_mlx import attention as K
from tq_mlx import TurboQuantConfig, TurboQuantKVCache



def run_prefill(rng, dk, kb, vb, qjl, dtype, R, L, mask, factory, dv=None, B=1, H=2, n_sinks=3, n=70, n_window=5,
                mean=True, **kw):
    keys = handle(rng, quantizer(dk, kb, qjl, seed=2), B, H, n_sinks, n, n_window, mean)
    values = handle(rng, quantizer(dv or dk, vb, seed=3), B, H, n_sinks, n, n_window, mean)
    q = normal(rng, (B, H * R, L, dk), dtype)
    scale = 1.0 / math.sqrt(dk)
    assert K.prefill_unsupported(q, keys, values, mask) is None
    got = K.prefill_attention(q, keys, values, scale, mask, metal_kernel=factory, **kw)
    want = K.prefill_attention_reference(q, keys, values, scale, mask)
    assert got.dtype == dtype and got.shape == want.shape == (B, H * R, L, dv or dk)
    return got, want, keys, values


# ============================================================================== 1. agreement
@pytest.mark.emulator
@pytest.mark.parametrize(
    "dk,dv,kb,vb,qjl,dtype,B,R,L,mask,mean",
    [
        (64, 64, 4, 3, False, mx.float16, 1, 2, 40, "causal", True),  # K4/V3; 40 > window: mask in codes
        (128, 128, 4, 3, False, mx.float16, 2, 4, 12, "causal", True),  # head_dim 128, GQA 4, batch 2
        (64, 64, 3, 2, True, mx.bfloat16, 2, 1, 9, None, True),  # QJL keys, no mask
        (128, 128, 8, 4, False, mx.float32, 1, 3, 33, "causal", False),  # GQA 3: 99 rows, a partial tile; no μ, ν
        (64, 64, 1, 8, False, mx.float32, 1, 2, 70, "causal", True),  # K1/V8, 140 rows over 3 query tiles
        (128, 128, 2, 3, True, mx.float16, 1, 2, 20, "causal", True),  # QJL at head_dim 128: 16-row query tiles
        (128, 64, 4, 2, False, mx.bfloat16, 2, 2, 10, "causal", True),  # key and value head dims differ
        (64, 64, 5, 4, False, mx.float16, 1, 2, 40, "causal", True),  # K5/V4: a 4-bit and a 1-bit plane
        (128, 128, 6, 6, False, mx.bfloat16, 2, 2, 12, "causal", False),  # K6/V6: 4-bit and 2-bit planes, no μ, ν
        (64, 64, 3, 5, True, mx.float32, 1, 3, 33, "causal", True),  # QJL keys, V5; 99 rows, a partial tile
        (128, 64, 6, 5, False, mx.float16, 1, 2, 10, None, True),  # head dims differ, K6/V5
    ],
    ids=ids,
)
def test_prefill_matches_reference(emulator, dk, dv, kb, vb, qjl, dtype, B, R, L, mask, mean):
    got, want, *_ = run_prefill(np.random.default_rng(L), dk, kb, vb, qjl, dtype, R, L, mask, Emu(), dv=dv, B=B,
                                mean=mean)
    assert_close(got, want, dtype)


@pytest.mark.emulator
@pytest.mark.parametrize(
    "dk,kb,vb,qjl,dtype,R,L",
    [(32, 3, 4, False, mx.float16, 8, 12), (256, 4, 3, False, mx.float32, 2, 10), (512, 4, 8, True, mx.bfloat16, 1, 9)],
    ids=ids,
)
def test_prefill_head_dims_32_256_512(emulator, dk, kb, vb, qjl, dtype, R, L):
    got, want, *_ = run_prefill(np.random.default_rng(1), dk, kb, vb, qjl, dtype, R, L, "causal", Emu("random", seed=3),
                                B=2)
    assert_close(got, want, dtype)


@pytest.mark.emulator
@pytest.mark.parametrize("n,n_sinks,n_window", [(1, 0, 0), (33, 1, 3)])
def test_prefill_few_compressed_tokens_under_the_causal_mask(emulator, n, n_sinks, n_window):
    # Fewer cached tokens than a tile, the chunk longer than the window: the mask reaches into the codes.
    got, want, *_ = run_prefill(np.random.default_rng(n), 64, 2, 2, False, mx.float32, 3, 30, "causal", Emu(),
                                n=n + 30, n_sinks=n_sinks, n_window=n_window)
    assert_close(got, want, mx.float32)


@pytest.mark.emulator
@pytest.mark.parametrize("schedule", SCHEDULES[1:])
def test_prefill_schedules(emulator, schedule):
    got, want, *_ = run_prefill(np.random.default_rng(3), 64, 4, 3, False, mx.float32, 2, 24, "causal",
                                Emu(schedule, seed=7), B=2, n_window=0, n_sinks=0)
    assert_close(got, want, mx.float32, schedule)


@pytest.mark.emulator
@pytest.mark.parametrize("center_values", [False, True], ids=["default", "values centered"])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=ids)
def test_prefill_on_cache_views(emulator, dtype, center_values):
    # A real cache (K4/V3, a key mean and a value mean if centered, power-of-two scales, strided capacity buffers):
    # a 70-token prompt, then a 40-token chunk, longer than the 16-token window, so part of the chunk itself is
    # compressed and the causal mask reaches into the codes.
    rng = np.random.default_rng(11)
    cache = TurboQuantKVCache(TurboQuantConfig(window=16, calibration_tokens=None, sinks=4, compress_block=8, step=64,
                                               center_values=center_values, prefill_as_decode=False))
    kv = lambda n, shift: ((normal(rng, (2, 2, n, 64)) + shift) * 2.0).astype(dtype)  # noqa: E731
    cache.update_and_fetch(kv(70, 0.7), kv(70, -0.3))
    keys, values = cache.update_and_fetch(kv(40, 0.7), kv(40, -0.3))
    assert keys.mean is not None and keys.scale is not None and values.scale is not None
    assert (values.mean is not None) == center_values
    assert keys.n_coded > 40 + 32 and keys.n_window < 40
    q = normal(rng, (2, 4, 40, 64), dtype)
    got = K.prefill_attention(q, numpy_views(keys), numpy_views(values), 0.125, "causal", metal_kernel=Emu())
    assert_close(got, K.prefill_attention_reference(q, keys, values, 0.125, "causal"), dtype)


@pytest.mark.emulator
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(
    "kb,vb,qjl,dim,B,R,L,dtype",
    [
        (3.5, 2.5, False, 64, 2, 2, 40, mx.float16),  # channel groups and a channel order on both sides
        (4, 3, False, 80, 1, 4, 20, mx.bfloat16),  # phi-2's head dim: Hadamard 20·4, rotated by the host
        (2.5, 4, False, 96, 2, 3, 12, mx.float32),  # phi-3's: grouped keys, WHT-free values
        (4, 3, True, 96, 1, 2, 24, mx.float16),  # QJL keys at 96
    ],
    ids=ids,
)
def test_prefill_channel_groups_and_other_head_dims_on_cache(emulator, schedule, kb, vb, qjl, dim, B, R, L, dtype):
    q, keys, values = cache_step(kb, vb, qjl, dim, B, R, L, dtype)
    assert keys.n_coded > 32 and K.prefill_unsupported(q, keys, values, "causal") is None
    got = K.prefill_attention(q, numpy_views(keys), numpy_views(values), 0.1, "causal", metal_kernel=Emu(schedule, 5))
    assert got.dtype == dtype
    assert_close(got, K.prefill_attention_reference(q, keys, values, 0.1, "causal"), dtype, schedule)


@pytest.mark.emulator
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(
    "kb,vb,qjl,dim,B,R,L,dtype",
    [
        (5, 4, False, 64, 2, 2, 40, mx.float16),  # K5/V4, the chunk longer than the window: causal in the codes
        (6, 3, False, 128, 1, 4, 12, mx.bfloat16),  # K6/V3, GQA 4
        (4, 6, True, 64, 2, 2, 20, mx.float32),  # QJL keys, V6
        (6, 5, False, 80, 1, 2, 24, mx.float16),  # no WHT at 80: host-rotated queries and outputs
        (5, 2.5, False, 96, 2, 2, 12, mx.bfloat16),  # channel groups for values
    ],
    ids=ids,
)
def test_prefill_5_and_6_bit_codes_on_cache(emulator, schedule, kb, vb, qjl, dim, B, R, L, dtype):
    q, keys, values = cache_step(kb, vb, qjl, dim, B, R, L, dtype)
    assert keys.n_coded > 32 and K.prefill_unsupported(q, keys, values, "causal") is None
    f = Emu(schedule, 5)
    got = K.prefill_attention(q, numpy_views(keys), numpy_views(values), 0.1, "causal", metal_kernel=f)
    assert got.dtype == dtype
    assert_close(got, K.prefill_attention_reference(q, keys, values, 0.1, "causal"), dtype, schedule)
    (launch,) = [x for x in f.launches if x.name == "tq_prefill_attention"]
    side = keys if kb in (5, 6) else values  # the 5- or 6-bit side (a strided view of its capacity buffer)
    codes, held = launch.stats.buffers["kc" if kb in (5, 6) else "vc"], side.codes.codes.nbytes
    assert codes.unique_bytes_read == held  # every code byte held, at most once per query tile
    assert codes.total_bytes_read <= launch.call["grid"][2] * held


# =================================================================== 2. a long chunk, byte counts
@pytest.mark.emulator
@pytest.mark.parametrize(
    "dim,B,R,n,n_window,nr",
    [
        (64, 1, 2, 3000, 600, 64),  # 1,024 query rows in 16 tiles of 64
        pytest.param(128, 2, 4, 1500, 128, 32, marks=pytest.mark.slow),  # GQA 4, batch 2: 2,048 rows per kv head
    ],
)
def test_512_query_chunk_over_thousands_of_compressed_tokens_reads_each_byte_once_per_query_tile(
        emulator, dim, B, R, n, n_window, nr):
    f = Emu()
    L = 512
    got, want, keys, values = run_prefill(np.random.default_rng(7), dim, 4, 3, False, mx.float16, R, L, "causal", f,
                                          B=B, H=1, n_sinks=4, n=n, n_window=n_window)
    assert_close(got, want, mx.float16)
    (launch,) = [x for x in f.launches if x.name == "tq_prefill_attention"]
    st = launch.stats
    assert dict(launch.call["template"])["NR"] == nr  # query tile: as many rows as threadgroup memory holds
    tiles = launch.call["grid"][2]
    assert tiles == R * L // nr
    for name in ("kc", "kn", "vc", "vn"):
        b = st.buffers[name]
        # Every compressed byte is read, at most once per query tile: exactly once when every row sees every
        # compressed token (random data: sparse V skips nothing). A chunk longer than the window has some of its
        # own tokens compressed: query tiles whose rows the causal mask hides them from never read them.
        assert b.unique_bytes_read == b.nbytes, name
        assert b.total_bytes_written == 0
        if n_window >= L:
            assert b.total_bytes_read == tiles * b.nbytes, (name, b.total_bytes_read / b.nbytes)
        else:
            hidden = (L - n_window) / n  # the chunk's compressed share, seen by ~half its rows
            assert (1 - hidden) * tiles * b.nbytes < b.total_bytes_read < (1 - hidden / 3) * tiles * b.nbytes, \
                (name, b.total_bytes_read / b.nbytes)
    # The only output written is the attention output (outc, the rotated part for value codes the kernel
    # cannot rotate back itself, is a 4-byte placeholder here); the query rows are read once.
    assert [k for k, b in st.buffers.items() if b.kind == "output"] == ["out", "outc"]
    assert st.buffers["outc"].nbytes == 4 and st.buffers["outc"].total_bytes_written == 0
    assert st.buffers["out"].unique_bytes_written == st.buffers["out"].nbytes == B * R * L * dim * 2
    for name in ("qf", "qr"):
        assert st.buffers[name].total_bytes_read == st.buffers[name].nbytes == B * R * L * dim * 4


@pytest.mark.emulator
def test_device_buffers_besides_the_cache_are_sized_by_the_chunk_not_the_context(emulator):
    # The stated bound: besides the cache and the output, the call's device buffers (float32 query rows, q·μ)
    # total at most 4·B·Hq·L·(4·D + 1) bytes, the same at 40 and 400 compressed tokens.
    B, R, L, D = 2, 2, 16, 64
    sizes = []
    for n in (40, 400):
        f = Emu()
        got, want, *_ = run_prefill(np.random.default_rng(n), D, 4, 3, True, mx.float16, R, L, "causal", f, B=B, n=n)
        assert_close(got, want, mx.float16)
        (st,) = f.stats("tq_prefill_attention")
        queries = {k: st.buffers[k].nbytes for k in ("qf", "qr", "qs", "qmu")}
        sizes.append(queries)
        assert sum(queries.values()) <= 4 * B * (2 * R) * L * (4 * D + 1)
        written = sum(b.nbytes for launch in f.launches for b in launch.stats.buffers.values() if b.kind == "output")
        # the output (and outc's 4-byte placeholder) and the rotated queries
        assert written == st.buffers["out"].nbytes + st.buffers["outc"].nbytes + st.buffers["qr"].nbytes
    assert sizes[0] == sizes[1]


# ======================================================================= 3. planted bugs
@pytest.mark.emulator
def test_planted_missing_barrier_after_key_staging_is_detected(emulator, monkeypatch):
    def fails():
        bad = []
        for schedule in SCHEDULES:
            try:
                got, want, *_ = run_prefill(np.random.default_rng(8), 64, 4, 4, False, mx.float32, 2, 10, "causal",
                                            Emu(schedule, seed=5))
                K._mismatch(got, want) and bad.append(schedule)
            except Exception:
                bad.append(schedule)
        return bad

    assert fails() == []
    src = K.SOURCES["prefill_attention"]
    i = src.index(BARRIER, src.index("// Stage keys."))
    monkeypatch.setitem(K.SOURCES, "prefill_attention", src[:i] + src[i + len(BARRIER):])
    assert fails(), "a missing barrier went unnoticed"


# ============================================================= 4. dispatch and self-check
def chunk_problem(L, seed=0, dim=64, R=2):
    rng = np.random.default_rng(seed)
    keys = handle(rng, quantizer(dim, 4, seed=2), n=50)
    values = handle(rng, quantizer(dim, 3, seed=3), n=50)
    return normal(rng, (1, 2 * R, L, dim), mx.float16), keys, values


@pytest.mark.emulator
def test_dispatch_runs_the_self_checked_prefill_kernel_for_long_chunks(emulator, monkeypatch):
    monkeypatch.setenv(K.ENV_VAR, "metal")
    f = Emu()
    K.set_kernel_factory(f)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a passing self-check warns about nothing
        for L, R, kernel in ((20, 2, "tq_prefill_attention"), (24, 2, "tq_prefill_attention"),
                             (8, 2, "tq_decode_partial"), (50, 1, "tq_prefill_attention")):
            q, keys, values = chunk_problem(L, R=R)
            f.launches.clear()
            out = K.dispatch_attention(q, keys, values, 0.125, "causal")
            assert_close(out, K.prefill_attention_reference(q, keys, values, 0.125, "causal"), mx.float16)
            assert kernel in {launch.name for launch in f.launches}, L
    status = K.self_check_status()
    assert {k[0] for k in status} == {"prefill_attention", "decode_attention"}
    assert all(v is None for v in status.values())
    # One variant for every chunk here (40, 48 and 50 rows: the same 64-row query tile): one self-check.
    assert len([k for k in status if k[0] == "prefill_attention"]) == 1


@pytest.mark.emulator
def test_dispatch_reads_a_prefill_as_decode_chunk_run_by_run(emulator, monkeypatch):
    # A chunk that compressed its own tokens (prefill_as_decode) reaches the kernels run by run, each run a plain
    # view (codes, then float up to its last query): the same output as the reference's runs, on the kernels.
    monkeypatch.setenv(K.ENV_VAR, "metal")
    f = Emu()
    K.set_kernel_factory(f)
    cache = TurboQuantKVCache(TurboQuantConfig(window=16, calibration_tokens=None, compress_block=16, sinks=4, weigh_keys=False,
                                               prefill_as_decode=True))
    rng = np.random.default_rng(0)
    cache.update_and_fetch(normal(rng, (1, 2, 60, 64), mx.float16), normal(rng, (1, 2, 60, 64), mx.float16))
    keys, values = cache.update_and_fetch(normal(rng, (1, 2, 50, 64), mx.float16),
                                          normal(rng, (1, 2, 50, 64), mx.float16))
    assert len(keys.recent.runs) == 4  # 16 queries a run: the prefill kernel's
    q = normal(rng, (1, 4, 50, 64), mx.float16)
    out = K.dispatch_attention(q, keys, values, 0.125, "causal")
    assert_close(out, K.turboquant_attention(q, keys, values, scale=0.125, mask="causal"), mx.float16)
    assert "tq_prefill_attention" in {launch.name for launch in f.launches}
    plain = K.turboquant_attention(q, keys._replace(recent=None), values._replace(recent=None), scale=0.125,
                                   mask="causal")
    assert not mx.allclose(out, plain, atol=1e-2)  # the runs read other tokens in float than the held view


def test_integer_masks_and_no_codes_take_the_reference_path(monkeypatch):
    monkeypatch.setenv(K.ENV_VAR, "metal")
    never = Counting()
    K.set_kernel_factory(never)
    q, keys, values = chunk_problem(20)
    mask = mx.ones((20, keys.n_tokens), dtype=mx.int32)  # bool and float masks run in the kernel (section 6)
    assert "dtype mlx.core.int32" in K.prefill_unsupported(q, keys, values, mask)
    assert mx.array_equal(K.dispatch_attention(q, keys, values, 0.1, mask),
                          K.prefill_attention_reference(q, keys, values, 0.1, mask))
    floats_only = keys._replace(codes=None), values._replace(codes=None)
    assert "no compressed tokens" in K.prefill_unsupported(q, *floats_only, "causal")
    long_q = normal(np.random.default_rng(0), (1, 4, keys.n_tokens + 1, 64), mx.float16)
    assert "causal queries over" in K.prefill_unsupported(long_q, keys, values, "causal")  # a query seeing nothing
    assert never.made == 0


@pytest.mark.emulator
def test_self_check_disables_a_wrong_prefill_kernel_and_warns_once(emulator, monkeypatch):
    monkeypatch.setitem(K.SOURCES, "prefill_attention", K.SOURCES["prefill_attention"].replace(
        "lc[k] = lc[k] * alpha + ps;", "lc[k] = lc[k] + ps;"))  # the value mean's share is not rescaled
    monkeypatch.setenv(K.ENV_VAR, "metal")
    K.set_kernel_factory(Emu())
    q, keys, values = chunk_problem(16, seed=1)
    want = K.prefill_attention_reference(q, keys, values, 0.125, "causal")
    with pytest.warns(RuntimeWarning, match=r"'prefill_attention' .* disabled; the reference path is used"):
        out = K.dispatch_attention(q, keys, values, 0.125, "causal")
    assert mx.array_equal(out, want)  # never a silent wrong answer
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mx.array_equal(K.dispatch_attention(q, keys, values, 0.125, "causal"), want)
    (reason,) = [v for k, v in K.self_check_status().items() if k[0] == "prefill_attention"]
    assert reason and "tolerance" in reason


# ================================================================ 5. MLX's own source generator
@pytest.mark.emulator
def test_prefill_source_matches_mlx_generator(emulator):
    from tests.emulator import generate_source
    from tests.emulator.mlx_reference import mlx_generated_source

    f = Emu()
    run_prefill(np.random.default_rng(0), 64, 3, 4, True, mx.bfloat16, 2, 9, "causal", f)
    (launch,) = [x for x in f.launches if x.name == "tq_prefill_attention"]
    m, c = launch.make, launch.call
    ours = generate_source(m["name"], m["input_names"], m["output_names"], m["source"], m["header"],
                           c["inputs"], c["output_dtypes"], c["template"])[1]
    theirs = mlx_generated_source(m["name"], m["input_names"], m["output_names"], m["source"], c["inputs"],
                                  c["output_shapes"], c["output_dtypes"], header=m["header"], template=c["template"])
    assert ours == theirs == launch.stats.source


# ================================================== 6. learned sinks, array masks, keys that are the values
PREFILL_SINK_MASK_CASES = [
    # dk, kb, vb, qjl, dtype, R, L, mask, learned sinks
    (64, 4, 3, False, mx.float16, 2, 40, "causal", True),  # gpt-oss-like prefill: sinks, chunk > window
    (64, 4, 3, False, mx.bfloat16, 2, 12, "bool-batch", True),  # batched prefill's (B, 1, L, T) mask
    (128, 3, 2, True, mx.float32, 1, 20, "add-heads-float32", False),  # per-head additive, QJL: 16-row tiles
    (64, 4, 3, False, mx.float16, 4, 16, "bool-2d", False),  # (L, T), 64 rows in one tile
    (80, 3.5, 2.5, False, mx.bfloat16, 2, 10, "add-heads-bfloat16", True),  # groups; host-rotated outc
]


@pytest.mark.emulator
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("case", PREFILL_SINK_MASK_CASES, ids=case_id)
def test_prefill_learned_sinks_and_array_masks(emulator, schedule, case):
    dk, kb, vb, qjl, dtype, R, L, mask, sinks = case
    got, want = run_masked(np.random.default_rng(L), dk, kb, vb, qjl, dtype, R, L, mask, sinks, "prefill",
                           Emu(schedule, seed=6))
    assert got.dtype == dtype
    assert_close(got, want, dtype, schedule)


@pytest.mark.emulator
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_prefill_keys_are_values_reads_the_codes_once(emulator, schedule):
    # One view as keys and values (a latent cache), an additive mask over 12 queries of 8 heads.
    _, kv, _, _ = mla_step(8, 64)
    rng = np.random.default_rng(1)
    q = normal(rng, (2, 8, 12, 64), mx.bfloat16)
    pe = make_mask(rng, "add-heads-bfloat16", 2, 8, 12, kv.n_tokens)
    f = Emu(schedule, seed=2)
    got = K.prefill_attention(q, kv, kv, 0.1, pe, metal_kernel=f)
    assert_close(got, K.prefill_attention_reference(q, kv, kv, 0.1, pe), mx.bfloat16, schedule)
    (st,) = f.stats("tq_prefill_attention")
    assert st.buffers["vc"].total_bytes_read == st.buffers["vn"].total_bytes_read == 0
    assert st.buffers["kc"].unique_bytes_read == st.buffers["kc"].nbytes


@pytest.mark.emulator
def test_prefill_with_sinks_and_a_mask_matches_mlx_generator(emulator):
    from tests.emulator import generate_source
    from tests.emulator.mlx_reference import mlx_generated_source

    f = Emu()
    run_masked(np.random.default_rng(0), 64, 4, 3, False, mx.float16, 2, 12, "bool-batch", True, "prefill", f)
    run_masked(np.random.default_rng(0), 64, 4, 3, False, mx.float16, 2, 2, "add-heads-bfloat16", True, "decode", f)
    for launch in f.launches:
        m, c = launch.make, launch.call
        ours = generate_source(m["name"], m["input_names"], m["output_names"], m["source"], m["header"],
                               c["inputs"], c["output_dtypes"], c["template"])[1]
        theirs = mlx_generated_source(m["name"], m["input_names"], m["output_names"], m["source"], c["inputs"],
                                      c["output_shapes"], c["output_dtypes"], header=m["header"], template=c["template"])
        assert ours == theirs == launch.stats.source, launch.name
