"""One command for an Apple Silicon Mac: check every Metal kernel against the reference path on Metal, then
time fused decode attention against mx.fast.scaled_dot_product_attention on a float16 cache.

  check    rotate / encode / dequantize / decode attention, every head_dim (64, 128, 256) x bits (1, 2, 3, 4, 8)
           x dtype (float16, bfloat16, float32), QJL keys (2, 3, 4 bits): max |kernel - reference| and PASS/FAIL
           (a compile error or exception is a FAIL with its message)
  timing   one decode step of one layer (1 query token) at 4k..128k context, model-like shapes (32 Q / 8 KV heads
           at head_dim 128; 16 Q / 2 KV heads at head_dim 256): the fused kernels vs mx.fast SDPA on float16 K/V of
           the same length vs the pure-MLX reference on the same codes; median of --iters after --warmup

    python benchmarks/mac_check.py [--quick] [--out-dir benchmarks/results]

Prints both tables and writes <out-dir>/mac_check.json and .md. Without Metal it exits with status 2 and says so.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

import mlx.core as mx  # noqa: E402

DIMS = (64, 128, 256)
BITS = (1, 2, 3, 4, 8)
QJL_BITS = (2, 3, 4)
DTYPES = ("float16", "bfloat16", "float32")
CONTEXTS = (4096, 8192, 16384, 32768, 65536, 131072)
QUICK_CONTEXTS = (4096, 16384)
SHAPES = (("32q/8kv d128", 32, 8, 128), ("16q/2kv d256", 16, 2, 256))
TIMING_BITS = ((4, 4), (3, 3), (8, 4))  # (key bits, value bits)


def metal_missing() -> str | None:
    """Why Metal cannot run here (None: it can)."""
    try:
        available = bool(mx.metal.is_available())
    except Exception as e:  # pragma: no cover - very old MLX
        return f"mx.metal.is_available() failed: {e}"
    if not available:
        return (f"mx.metal.is_available() is False on {platform.system()} {platform.machine()}, "
                f"default device {mx.default_device()}; run this on an Apple Silicon Mac")
    if mx.default_device().type != mx.DeviceType.gpu:
        return f"the default device is {mx.default_device()}, not the GPU"
    return None


def _normal(rng, shape, dtype=mx.float32):
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


# ------------------------------------------------------------------------------------------ check
def check_rows(quick: bool) -> list[dict]:
    from tq_mlx import kernels as K
    from tq_mlx.stream import StreamView
    from tq_mlx.quantizer import TurboQuantMSE, TurboQuantProd

    rng = np.random.default_rng(0)
    rows = []

    def record(kernel, dim, bits, dtype, fn):
        t0 = time.perf_counter()
        try:
            got, want, tol_dtype = fn()
            mx.eval(got, want)
            g, w = np.asarray(got.astype(mx.float32)), np.asarray(want.astype(mx.float32))
            err = float(np.abs(g - w).max()) if g.size else 0.0
            why = K._mismatch(got, want, tol_dtype)
        except Exception as e:
            err, why = math.nan, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        rows.append(dict(kernel=kernel, dim=dim, bits=bits, dtype=dtype, max_abs_err=err, ok=why is None,
                         reason=why, seconds=time.perf_counter() - t0))

    dims = (128,) if quick else DIMS
    for dim in dims:
        for name in DTYPES:
            dt = getattr(mx, name)
            rot = K.Rotation(dim, seed=1)
            x = _normal(rng, (64, dim), dt)
            for inverse in (False, True):
                record("rotate" + ("-inverse" if inverse else ""), dim, "-", name,
                       lambda: (K.rotate(x, rot, inverse), K.rotate_reference(x, rot, inverse), mx.float32))
        cases = [(b, False) for b in BITS] + [(b, True) for b in QJL_BITS]
        for bits, qjl in cases:
            label = f"{bits}{'+qjl' if qjl else ''}"
            kq = TurboQuantProd(dim, bits, seed=2) if qjl else TurboQuantMSE(dim, bits, seed=2)
            vq = TurboQuantMSE(dim, bits, seed=3)
            for name in DTYPES:
                dt = getattr(mx, name)
                xs = _normal(rng, (2, 4, 33, dim), dt)
                mean = _normal(rng, (2, 4, dim)) * 0.3

                def enc():
                    got, want = K.encode(xs, kq, mean), K.encode_reference(xs, kq, mean)
                    why = K._codes_mismatch(got, want, kq)
                    if why:
                        raise AssertionError(why)
                    return kq.dequantize(got), kq.dequantize(want), mx.float32

                record("encode", dim, label, name, enc)

                def handle(q, n=300):
                    codes = K.encode_reference(_normal(rng, (1, 4, n, dim)), q, mean[:1])
                    f16 = lambda k: _normal(rng, (1, 4, k, dim), mx.float16)  # noqa: E731
                    return StreamView(q, codes, f16(4), f16(20), mean[:1], None)

                keys, values = handle(kq), handle(vq)
                record("dequantize", dim, label, name,
                       lambda: (K.dequantize(keys, dt), K.dequantize_reference(keys, dt), dt))
                for R, L, mask in ((4, 1, None), (2, 5, "causal")):
                    q = _normal(rng, (1, 4 * R, L, dim), dt)
                    record(f"decode R={R} L={L}", dim, label, name,
                           lambda: (K.decode_attention(q, keys, values, dim ** -0.5, mask, split_tokens=64),
                                    K.decode_attention_reference(q, keys, values, dim ** -0.5, mask), dt))
    return rows


# ----------------------------------------------------------------------------------------- timing
def _median_ms(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        mx.eval(fn())
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def random_handle(quantizer, H: int, n: int, n_sinks: int, n_window: int, seed: int):
    """A cache handle of n compressed tokens: random words are valid codes, so nothing needs encoding."""
    from tq_mlx.stream import StreamView
    from tq_mlx.quantizer import ProdCodes, TurboQuantProd

    rng = np.random.default_rng(seed)
    D = quantizer.dim
    prod = isinstance(quantizer, TurboQuantProd)
    probe = quantizer.quantize(mx.zeros((1, 1, 1, D)))
    words = probe.codes.shape[-1]
    codes = mx.array(rng.integers(0, 2**32, size=(1, H, n, words), dtype=np.uint32))
    norms = mx.array(rng.uniform(0.5, 2.0, size=(1, H, n, 1)).astype(np.float16))
    if prod:
        qjl = mx.array(rng.integers(0, 2**32, size=(1, H, n, D // 32), dtype=np.uint32))
        gamma = mx.array(rng.uniform(0.0, 0.3, size=(1, H, n)).astype(np.float16))
        c = ProdCodes(codes, norms, qjl, gamma)
    else:
        c = type(probe)(codes, norms)
    f16 = lambda k: _normal(rng, (1, H, k, D), mx.float16)  # noqa: E731
    return StreamView(quantizer, c, f16(n_sinks), f16(n_window), _normal(rng, (1, H, D)) * 0.1, None)


def timing_rows(contexts, warmup: int, iters: int, with_reference: bool) -> list[dict]:
    from tq_mlx import kernels as K
    from tq_mlx.quantizer import TurboQuantMSE

    rows = []
    for shape, Hq, H, D in SHAPES:
        for kb, vb in TIMING_BITS:
            kq, vq = TurboQuantMSE(D, kb, seed=2), TurboQuantMSE(D, vb, seed=3)
            for T in contexts:
                n_sinks, n_window = 4, 128
                n = T - n_sinks - n_window
                keys = random_handle(kq, H, n, n_sinks, n_window, seed=T)
                values = random_handle(vq, H, n, n_sinks, n_window, seed=T + 1)
                rng = np.random.default_rng(T)
                q = _normal(rng, (1, Hq, 1, D), mx.float16)
                kf, vf = _normal(rng, (1, H, T, D), mx.float16), _normal(rng, (1, H, T, D), mx.float16)
                mx.eval(keys, values, q, kf, vf)
                scale = D ** -0.5
                fused = _median_ms(lambda: K.decode_attention(q, keys, values, scale), warmup, iters)
                sdpa = _median_ms(lambda: mx.fast.scaled_dot_product_attention(q, kf, vf, scale=scale), warmup, iters)
                ref = (_median_ms(lambda: K.decode_attention_reference(q, keys, values, scale), warmup, iters)
                       if with_reference else math.nan)
                compressed = sum(a.nbytes for kv in (keys, values) for a in kv.codes)
                floats = sum(a.nbytes for kv in (keys, values) for a in (kv.sinks, kv.window))
                rows.append(dict(shape=shape, q_heads=Hq, kv_heads=H, head_dim=D, key_bits=kb, value_bits=vb,
                                 context=T, fused_ms=fused, sdpa_fp16_ms=sdpa, reference_ms=ref,
                                 speedup_vs_sdpa=sdpa / fused, cache_bytes=compressed + floats,
                                 fp16_cache_bytes=kf.nbytes + vf.nbytes))
                r = rows[-1]
                print(f"  {shape} K{kb}V{vb} {T:>6}: fused {fused:.3f} ms, sdpa {sdpa:.3f} ms, "
                      f"x{r['speedup_vs_sdpa']:.2f}", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="head_dim 128 checks, 4k and 16k contexts")
    ap.add_argument("--out-dir", default=None, help="where mac_check.json/.md go (default benchmarks/results)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--no-reference", action="store_true", help="skip timing the pure-MLX reference path")
    args = ap.parse_args(argv)

    why = metal_missing()
    if why:
        print(f"Metal is not available on this machine ({why}). Nothing was checked or timed.", file=sys.stderr)
        return 2

    import common

    print("Checking every kernel against the reference path on Metal ...", flush=True)
    checks = check_rows(args.quick)
    failed = [r for r in checks if not r["ok"]]
    check_table = [[r["kernel"], r["dim"], r["bits"], r["dtype"], f"{r['max_abs_err']:.2e}",
                    "PASS" if r["ok"] else "FAIL: " + (r["reason"] or "")[:80]] for r in checks]
    check_headers = ["kernel", "head_dim", "bits", "dtype", "max abs err", "result"]
    print(common.text_table(check_headers, check_table, "lrrlrl"))
    print(f"{len(checks) - len(failed)}/{len(checks)} passed", flush=True)

    print("\nTiming one decode step (1 query token, one layer) ...", flush=True)
    timings = timing_rows(QUICK_CONTEXTS if args.quick else CONTEXTS, args.warmup, args.iters, not args.no_reference)
    time_headers = ["shape", "K/V bits", "context", "fused ms", "SDPA fp16 ms", "reference ms", "fused vs SDPA",
                    "cache MB", "fp16 MB"]
    time_table = [[r["shape"], f"{r['key_bits']}/{r['value_bits']}", r["context"], common.fmt(r["fused_ms"], 3),
                   common.fmt(r["sdpa_fp16_ms"], 3), common.fmt(r["reference_ms"], 3),
                   common.fmt(r["speedup_vs_sdpa"], 2, "x"), common.fmt(r["cache_bytes"] / 2**20, 1),
                   common.fmt(r["fp16_cache_bytes"] / 2**20, 1)] for r in timings]
    print(common.text_table(time_headers, time_table))

    meta = common.metadata(device_info={k: str(v) for k, v in mx.metal.device_info().items()})
    payload = {"meta": meta, "checks": checks, "timings": timings, "failed": len(failed)}
    md = "\n\n".join([common.meta_line(meta), "### Kernels vs reference on Metal",
                      common.markdown_table(check_headers, check_table, "lrrlrl"),
                      "### Decode attention, one layer, 1 query token",
                      common.markdown_table(time_headers, time_table)])
    jp, _ = common.write_results("mac_check", payload, md, args.out_dir)
    print(f"\nwrote {jp}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
