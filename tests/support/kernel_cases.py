"""Helpers and fixtures shared by the kernel tests (tests/test_kernels.py, test_kernel_cache.py,
test_kernel_dispatch.py, test_kernel_masks.py, and test_decay_kernels.py, test_rope.py, test_prefill_kernel.py,
test_query_weights.py), which run the Metal kernels (tq_mlx.attention) under the CPU MSL emulator (tests/emulator):

- the matrix's axes `DIMS`, `BITS`, `QJL_BITS`, `DTYPES`, `SCHEDULES` and the output tolerance `TOL`;
- the fixtures `emulator` (module scope: skips without the emulator) and `_clean_dispatch` (autouse: a fresh
  backend setting, kernel factory and self-check state around each test); a test module uses them by importing
  them by name;
- `Emu`: a `metal_kernel` factory on the emulator that applies a lane schedule and records every `Launch`;
  `Counting`: a factory that counts the kernels built (none, on the reference path);
- random inputs: `ids`, `normal`, `quantizer`, `handle` (a StreamView like the cache's), `small_problem`;
  `assert_close` and `assert_codes_equal` against the reference twins;
- `run_decode`: decode attention and its reference on random views; `cache_step`: a decode step on a real
  TurboQuantKVCache; `numpy_views`: its views as strided numpy arrays;
- `planted` and `BARRIER`: bugs planted in the kernel sources;
- `make_mask`, `run_masked`, `case_id`: learned sinks and array masks; `mla_step`: multi-head latent
  attention's decode step on a real cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest

import mlx.core as mx

from tests.emulator import metal_kernel as emulator_kernel
from tests.emulator import require_emulator
from tq_mlx import attention as K
from tq_mlx import StreamView, TurboQuantConfig, TurboQuantKVCache
from tq_mlx.quant.packing import unpack
from tq_mlx.quant.quantizer import LOG_NORM_DTYPES, TurboQuantMSE, TurboQuantProd, load_norms

DIMS = (64, 128, 256)
BITS = (1, 2, 3, 4, 5, 6, 8)  # quantizer.CODE_BITS, every width the config takes
QJL_BITS = (2, 3, 4)
DTYPES = (mx.float16, mx.bfloat16, mx.float32)
SCHEDULES = ("forward", "reverse", "random")
TOL = {mx.float32: 1e-4, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}  # atol = rtol: output rounding


@pytest.fixture(scope="module")
def emulator():
    return require_emulator()


@pytest.fixture(autouse=True)
def _clean_dispatch(monkeypatch):
    monkeypatch.delenv(K.ENV_VAR, raising=False)
    K.set_backend(None)
    K.set_kernel_factory(None)
    K.reset_self_checks()
    yield
    K.set_backend(None)
    K.set_kernel_factory(None)
    K.reset_self_checks()


@dataclass
class Launch:
    name: str
    make: dict  # metal_kernel(...) keywords
    call: dict  # kernel(...) keywords
    stats: object  # tests.emulator.LaunchStats


class Emu:
    """A `metal_kernel` factory on the emulator: applies a lane schedule and records every launch."""

    def __init__(self, schedule: str = "forward", seed: int = 0):
        self.schedule, self.seed = schedule, seed
        self.launches: list[Launch] = []

    def __call__(self, **make):
        kernel = emulator_kernel(**make)
        factory = self

        class Launcher:
            def __call__(self, **call):
                out = kernel(**call, schedule=factory.schedule, seed=factory.seed)
                factory.launches.append(Launch(make["name"], make, call, kernel.last_stats))
                return out

        return Launcher()

    def stats(self, name: str):
        return [launch.stats for launch in self.launches if launch.name == name]


def ids(x) -> str:
    return str(x).replace("mlx.core.", "")


def normal(rng, shape, dtype=mx.float32) -> mx.array:
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def quantizer(dim: int, bits: int, qjl: bool = False, seed: int = 1):
    return TurboQuantProd(dim, bits, seed=seed) if qjl else TurboQuantMSE(dim, bits, seed=seed)


def handle(rng, q, B=1, H=2, n_sinks=3, n=70, n_window=5, mean=True) -> StreamView:
    """A StreamView like TurboQuantKVCache returns: float16 sinks/window, codes of x - mean."""
    D = q.dim
    mu = normal(rng, (B, H, D)) * 0.3 if mean else None
    codes = K.encode_reference(normal(rng, (B, H, n, D)), q, mu)
    f16 = lambda k: normal(rng, (B, H, k, D), mx.float16) if k else None  # noqa: E731
    return StreamView(q, codes, f16(n_sinks), f16(n_window), mu, None)


def assert_close(got, want, dtype, what=""):
    g = np.asarray(got.astype(mx.float32))
    w = np.asarray(want.astype(mx.float32))
    assert g.shape == w.shape, what
    assert np.isfinite(g).all(), f"{what}: non-finite output"
    np.testing.assert_allclose(g, w, atol=TOL[dtype], rtol=TOL[dtype], err_msg=what)


def assert_codes_equal(got, want, q, what=""):
    """Codes match (a value within rounding of a boundary may flip: at most 0.2%); norms and γ close."""
    prod = isinstance(q, TurboQuantProd)
    groups = (q.mse if prod else q).groups
    gi, wi = (np.concatenate([np.asarray(unpack(c.codes[..., g.words], g.bits, g.dim)) for g in groups], axis=-1)
              for c in (got, want))
    assert (gi != wi).mean() <= 0.002, f"{what}: {(gi != wi).mean():.2%} codes differ"
    np.testing.assert_allclose(np.asarray(load_norms(got.norms)), np.asarray(load_norms(want.norms)),
                               rtol=1e-3 if got.norms.dtype not in LOG_NORM_DTYPES.values() else 0.05, err_msg=what)
    if prod:
        gz, wz = (np.asarray(unpack(c.qjl, 1, q.dim)) for c in (got, want))
        assert (gz != wz).mean() <= 0.005, f"{what}: {(gz != wz).mean():.2%} QJL bits differ"
        ok = (gi == wi).all(axis=-1)  # γ depends on the codes: compare rows whose codes agree
        np.testing.assert_allclose(np.asarray(load_norms(got.gamma))[ok], np.asarray(load_norms(want.gamma))[ok],
                                   rtol=2e-3 if got.gamma.dtype not in LOG_NORM_DTYPES.values() else 0.05, atol=1e-4, err_msg=what)


def run_decode(rng, dk, kb, vb, qjl, dtype, R, L, mask, factory, dv=None, B=1, H=2, n_sinks=3, n=70, n_window=5,
               scale=None, mean=True, **kw):
    keys = handle(rng, quantizer(dk, kb, qjl, seed=2), B, H, n_sinks, n, n_window, mean)
    values = handle(rng, quantizer(dv or dk, vb, seed=3), B, H, n_sinks, n, n_window, mean)
    q = normal(rng, (B, H * R, L, dk), dtype)
    scale = scale or 1.0 / math.sqrt(dk)
    got = K.decode_attention(q, keys, values, scale, mask, metal_kernel=factory, **kw)
    want = K.decode_attention_reference(q, keys, values, scale, mask)
    return got, want, keys, values


def numpy_views(kv: StreamView) -> StreamView:
    """The handle with its cache views as strided numpy arrays, so the emulator sees MLX's real strides
    (ensure_row_contiguous=False) instead of contiguous copies."""
    # bfloat16 has no numpy buffer format: those float tokens stay mx arrays.
    view = lambda a: a if a is None or a.dtype == mx.bfloat16 else np.asarray(a)  # noqa: E731
    return kv._replace(codes=type(kv.codes)(*(view(a) for a in kv.codes)), sinks=view(kv.sinks),
                       window=view(kv.window))


def cache_step(kb, vb, qjl, dim, B, R, L, dtype, H=2, n_prompt=70, seed=0, **config):
    """A decode step on a real TurboQuantKVCache (mean and scale from its calibration, strided views of its
    capacity buffers): queries and the views update_and_fetch returns after a prompt and L new tokens."""
    rng = np.random.default_rng(seed)
    cfg = dict(window=16, calibration_tokens=None, sinks=4, compress_block=8, step=64) | config
    # (prefill not read as decode unless asked: these views are read by queries of any count, as held)
    cfg = TurboQuantConfig(key_bits=kb, value_bits=vb, qjl=qjl, **{"prefill_as_decode": False, **cfg})
    cache = TurboQuantKVCache(cfg)
    kv = lambda n, shift: ((normal(rng, (B, H, n, dim)) + shift) * 2.0).astype(dtype)  # noqa: E731
    cache.update_and_fetch(kv(n_prompt, 0.7), kv(n_prompt, -0.3))
    keys, values = cache.update_and_fetch(kv(L, 0.7), kv(L, -0.3))
    return normal(rng, (B, H * R, L, dim), dtype), keys, values


def planted(monkeypatch, name: str, old: str, new: str, count: int = 1):
    src = K.SOURCES[name]
    assert old in src, f"{old!r} not in {name}.metal"
    monkeypatch.setitem(K.SOURCES, name, src.replace(old, new, count))


BARRIER = "threadgroup_barrier(mem_flags::mem_threadgroup);"


def small_problem(seed=0, dim=64, bits=4):
    rng = np.random.default_rng(seed)
    keys = handle(rng, quantizer(dim, bits, seed=2), n=40)
    values = handle(rng, quantizer(dim, bits, seed=3), n=40)
    return normal(rng, (1, 4, 1, dim), mx.float16), keys, values


class Counting:
    def __init__(self, inner=None):
        self.inner, self.made = inner, 0

    def __call__(self, **kw):
        self.made += 1
        if self.inner is None:
            raise AssertionError("the reference path must not build kernels")
        return self.inner(**kw)


def make_mask(rng, kind: str, B: int, Hq: int, L: int, T: int):
    """A mask of `kind`: "bool-2d" (L, T), "bool-batch" (B, 1, L, T) with left padding on row 1, as mlx-lm's
    batched generation; "add-heads-<dtype>" (B, Hq, L, T) additive scores with a bool mask folded in at the
    dtype's most negative value, as multi-head latent attention's rope scores (each row shows its last token)."""
    hidden = rng.random((B, Hq, L, T)) < 0.3
    hidden[..., -1] = False
    if kind == "bool-2d":
        return mx.array(~hidden[0, 0])
    if kind == "bool-batch":
        shown = ~hidden[:, :1]
        shown[-1, ..., :3] = False  # the last row's left padding
        return mx.array(shown)
    dtype = getattr(mx, kind.rsplit("-", 1)[1])
    scores = np.where(hidden, float(mx.finfo(dtype).min), 2 * rng.standard_normal((B, Hq, L, T)))
    return mx.array(scores.astype(np.float32)).astype(dtype)


def run_masked(rng, dk, kb, vb, qjl, dtype, R, L, mask_kind, sinks, kernel, factory, B=2, dv=None, **kw):
    """decode_attention or prefill_attention (`kernel`) and its reference twin on random views, with a mask of
    `mask_kind` (make_mask, or None / "causal") and random learned sinks if `sinks`."""
    keys = handle(rng, quantizer(dk, kb, qjl, seed=2), B, 2)
    values = handle(rng, quantizer(dv or dk, vb, seed=3), B, 2)
    q = normal(rng, (B, 2 * R, L, dk), dtype)
    T = keys.n_tokens
    mask = mask_kind if mask_kind in (None, "causal") else make_mask(rng, mask_kind, B, 2 * R, L, T)
    ls = normal(rng, (2 * R,), dtype) * 2 + 4 if sinks else None  # against ~log(80) of the tokens
    run, ref = ((K.decode_attention, K.decode_attention_reference) if kernel == "decode" else
                (K.prefill_attention, K.prefill_attention_reference))
    assert (K.decode_unsupported if kernel == "decode" else K.prefill_unsupported)(q, keys, values, mask, ls) is None
    got = run(q, keys, values, 1 / math.sqrt(dk), mask, ls, metal_kernel=factory, **kw)
    want = ref(q, keys, values, 1 / math.sqrt(dk), mask, ls)
    if sinks:  # the sinks matter
        assert float(mx.abs(want - ref(q, keys, values, 1 / math.sqrt(dk), mask)).max()) > 1e-2
    return got, want


def case_id(c) -> str:
    dk, kb, vb, qjl, dtype, R, L, mask, sinks = c
    return f"d{dk}-K{kb}{'+qjl' if qjl else ''}V{vb}-{ids(dtype)}-R{R}L{L}-{mask}{'-sinks' if sinks else ''}"


def mla_step(R: int, D: int, bits=4, B=2, n_prompt=80, seed=0):
    """A multi-head latent attention decode step (DeepSeek-V3's L == 1 path) on a real cache: one kv head whose
    latent is both keys and values, R query heads, and the additive rope scores (B, R, 1, T) in bfloat16 with
    the batch's left padding folded in at finfo.min. Returns (queries, latent view, mask, float latent)."""
    rng = np.random.default_rng(seed)
    cache = TurboQuantKVCache(TurboQuantConfig.from_bits(bits, window=8, calibration_tokens=None, sinks=2, compress_block=8, step=64))
    latent = (normal(rng, (B, 1, n_prompt + 1, D)) + 0.3).astype(mx.bfloat16)
    cache.update_and_fetch(latent[:, :, :n_prompt], latent[:, :, :n_prompt])
    kv, _ = cache.update_and_fetch(latent[:, :, n_prompt:], latent[:, :, n_prompt:])
    T = kv.n_tokens
    pe = 2 * rng.standard_normal((B, R, 1, T))
    pe[-1, ..., :5] = float(mx.finfo(mx.bfloat16).min)  # the last row's left padding
    return normal(rng, (B, R, 1, D), mx.bfloat16), kv, mx.array(pe.astype(np.float32)).astype(mx.bfloat16), latent
