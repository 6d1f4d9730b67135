"""One command for an Apple Silicon Mac: check every Metal kernel against the reference path on Metal, record
every kernel variant's first-use self-check, and time decode and prefill attention against
mx.fast.scaled_dot_product_attention on a float16 cache, with peak memory. Writes one JSON file to attach to an
issue (machine: chip, macOS, mlx version, Metal device info).

  checks       rotate / encode (and encode-corrected: correct_norms, first dtype) / dequantize / recode (first
               dtype) / decode attention
               (1 and 5 query tokens) / prefill attention (40 query tokens, causal), every head_dim (64, 80, 96, 128, 256) x bits (1, 2, 2.5, 3, 3.5, 4, 8;
               QJL keys 2, 3, 4; trellis codes 2, 2.5, 3, 3.5, 4, labelled "tc") x dtype (float16, bfloat16, float32):
               max |kernel - reference| and PASS/FAIL
               (a compile error or an exception is a FAIL with its message; a case a launcher does not take,
               such as the WHT at head_dim 80, is listed with the reason the reference path runs instead)
  self_checks  the same variants through tq_mlx.attention' dispatchers (plus the default K4/V3): each variant's
               first-use self-check, passed or disabled with its reason (what a user's run would do)
  decode       one decode step of one layer (1 query token) at 4k..128k context, model-like shapes (32 Q / 8 KV
               heads at head_dim 128; 16 Q / 2 KV heads at head_dim 256), the library's default sinks and window:
               the fused kernels vs mx.fast SDPA on float16 K/V of the same length vs the pure-MLX reference on
               the same codes; median of --iters after --warmup; K4/V3, K4/V4, K8/V4 and K4/V3 with trellis codes
  prefill      one prefill chunk of one layer (--chunk query tokens, causal, at the end of the context), the same
               shapes and contexts: prefill_attention vs SDPA vs the reference
  Every timing row also has each path's peak memory above what existed before the call (inputs), output
  included: mx.get_peak_memory after mx.reset_peak_memory.

    python benchmarks/mac_check.py [--quick] [--out-dir benchmarks/results] [--chunk 512] [--no-reference]
    python benchmarks/mac_check.py --dry-run [--out-dir DIR]

Prints the tables and writes <out-dir>/mac_check.json and .md. Without Metal it exits with status 2 and says so.
--dry-run needs no Metal: tiny sizes on the CPU, kernels on the CPU MSL emulator of tests/emulator when a
compiler is there (else kernel rows say why they were skipped), written to mac_check-dry-run.json with the same
schema; it checks the script, not Metal (its timings mean nothing).
"""

from __future__ import annotations

import argparse
import math
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

import mlx.core as mx  # noqa: E402

SCHEMA = "tq-mlx mac_check 3"
DIMS = (64, 80, 96, 128, 256)
BITS = (1, 2, 2.5, 3, 3.5, 4, 8)
QJL_BITS = (2, 3, 4)
TRELLIS_BITS = (2, 2.5, 3, 3.5, 4)  # config.trellis (encode and recode: the search on viterbi.metal)
DTYPES = ("float16", "bfloat16", "float32")
CONTEXTS = (4096, 8192, 16384, 32768, 65536, 131072)
QUICK_CONTEXTS = (4096, 16384)
SHAPES = (("32q/8kv d128", 32, 8, 128), ("16q/2kv d256", 16, 2, 256))
# (key bits, value bits, trellis codes): the library default first; trellis codes read their codebooks from device
# memory and gather a window of codes a value dim, which only a Mac can time
TIMING_BITS = ((4, 3, False), (4, 4, False), (8, 4, False), (4, 3, True))
# --dry-run: the smallest sizes that still take every path (prefill chunk > 8 queries, compressed tokens).
DRY = dict(dims=(64, 96), dtypes=("float16",), cases=((4, False, False), (3, True, False), (3.5, False, False),
                                                      (3, False, True)), contexts=(256, 512),
           shapes=(("4q/2kv d64", 4, 2, 64),), bits=((4, 3, False), (4, 3, True)), chunk=16, sinks=4, window=32)
ROW_KEYS = ("shape", "q_heads", "kv_heads", "head_dim", "key_bits", "value_bits", "trellis", "context", "query_tokens",
            "fused_ms", "sdpa_fp16_ms", "reference_ms", "speedup_vs_sdpa", "fused_peak_bytes", "sdpa_peak_bytes",
            "reference_peak_bytes", "cache_bytes", "fp16_cache_bytes", "error")


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


def machine_info(metal: bool) -> dict:
    """Chip, macOS and software versions: what a bug report needs."""
    import mlx_lm

    import tq_mlx

    chip = None
    if sys.platform == "darwin":
        try:
            chip = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  timeout=10).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            pass
    device_info = {}
    if metal:
        try:
            device_info = {k: str(v) for k, v in mx.metal.device_info().items()}
        except Exception as e:  # noqa: BLE001 - report, don't fail
            device_info = {"error": f"{type(e).__name__}: {e}"}
    return {
        "chip": chip or device_info.get("device_name") or platform.processor() or platform.machine(),
        "macos": platform.mac_ver()[0] or None,
        "os": platform.platform(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "tq_mlx": tq_mlx.__version__,
        "python": platform.python_version(),
        "metal_available": metal,
        "device": str(mx.default_device()),
        "metal_device_info": device_info,
    }


def emulator_factory():
    """(factory, why not): tests/emulator's metal_kernel when a compiler is installed (the --dry-run runner)."""
    try:
        from tests import emulator
    except Exception as e:  # noqa: BLE001
        return None, f"tests.emulator not importable ({type(e).__name__}: {e})"
    if emulator.find_compiler() is None:
        return None, "no C++ compiler for the emulator (clang++ >= 17 or the ziglang package)"
    return emulator.metal_kernel, None


def _normal(rng, shape, dtype=mx.float32):
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


# ------------------------------------------------------------------------------------------ check
def _cases(dry: bool):
    if dry:
        return DRY["dims"], DRY["dtypes"], DRY["cases"]
    return DIMS, DTYPES, ([(b, False, False) for b in BITS] + [(b, True, False) for b in QJL_BITS]
                          + [(b, False, True) for b in TRELLIS_BITS])


def check_rows(quick: bool, factory, dry: bool = False, skip: str | None = None) -> list[dict]:
    """Each kernel launcher against its reference twin; `factory` None means mx.fast.metal_kernel."""
    from tq_mlx import attention as K
    from tq_mlx.quant.quantizer import TurboQuantMSE, TurboQuantProd
    from tq_mlx.quant.rotation import Rotation
    from tq_mlx.stream.view import StreamView

    rng = np.random.default_rng(0)
    rows = []
    kw = {"metal_kernel": factory} if factory else {}

    def record(kernel, dim, bits, dtype, fn, unsupported=None):
        t0 = time.perf_counter()
        if skip or unsupported:
            reason = "skipped: " + skip if skip else "reference path: " + unsupported
            rows.append(dict(kernel=kernel, dim=dim, bits=bits, dtype=dtype, max_abs_err=math.nan, ok=None,
                             reason=reason, seconds=0.0))
            return
        try:
            got, want, tol_dtype = fn()
            mx.eval(got, want)
            g, w = np.asarray(got.astype(mx.float32)), np.asarray(want.astype(mx.float32))
            err = float(np.abs(g - w).max()) if g.size else 0.0
            why = K._mismatch(got, want, tol_dtype)
        except Exception as e:  # noqa: BLE001 - a compile error is a result
            err, why = math.nan, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        rows.append(dict(kernel=kernel, dim=dim, bits=bits, dtype=dtype, max_abs_err=err, ok=why is None,
                         reason=why, seconds=time.perf_counter() - t0))

    dims, dtypes, cases = _cases(dry)
    dims = (128,) if quick and not dry else dims
    for dim in dims:
        for name in dtypes:
            dt = getattr(mx, name)
            rot = Rotation(dim, seed=1)
            x = _normal(rng, (64, dim), dt)
            for inverse in (False, True):
                record("rotate" + ("-inverse" if inverse else ""), dim, "-", name,
                       lambda: (K.rotate(x, rot, inverse, **kw), K.rotate_reference(x, rot, inverse), mx.float32),
                       K.rotation_unsupported(x, rot))
        for bits, qjl, tc in cases:
            if bits % 1 and dim % 4:
                continue  # fractional bits split the channels 1:3
            label = f"{bits}{'+qjl' if qjl else ''}{'tc' if tc else ''}"
            kq = TurboQuantProd(dim, bits, seed=2) if qjl else TurboQuantMSE(dim, bits, seed=2, trellis=tc)
            vq = TurboQuantMSE(dim, bits, seed=3, trellis=tc)
            for name in dtypes:
                dt = getattr(mx, name)
                xs = _normal(rng, (2, 4, 33, dim), dt)
                mean = _normal(rng, (2, 4, dim)) * 0.3

                def encoding(q):
                    def enc():
                        got, want = K.encode(xs, q, mean, **kw), K.encode_reference(xs, q, mean)
                        why = K._codes_mismatch(got, want, q)
                        if why:
                            raise AssertionError(why)
                        return q.dequantize(got), q.dequantize(want), mx.float32
                    return enc

                record("encode", dim, label, name, encoding(kq), K.encode_unsupported(xs, kq, mean))
                if name == dtypes[0]:  # correct_norms: the same kernels with CN on
                    cq = type(kq)(dim, bits, seed=2, correct_norms=True, **({"trellis": tc} if tc else {}))
                    record("encode-corrected", dim, label, name, encoding(cq), K.encode_unsupported(xs, cq, mean))

                def handle(q, n=300):
                    codes = K.encode_reference(_normal(rng, (1, 4, n, dim)), q, mean[:1])
                    f16 = lambda k: _normal(rng, (1, 4, k, dim), mx.float16)  # noqa: E731
                    return StreamView(q, codes, f16(4), f16(20), mean[:1], None)

                keys, values = handle(kq), handle(vq)
                record("dequantize", dim, label, name,
                       lambda: (K.dequantize(keys, dt, **kw), K.dequantize_reference(keys, dt), dt),
                       K.dequantize_unsupported(keys))
                if name == dtypes[0] and bits > 1:  # temporal decay: a bit fewer in the same basis (K3.5 -> K2.5)
                    to = TurboQuantMSE(dim, bits - 1, seed=3, trellis=tc)

                    def recoding():
                        got = K.recode(values.codes, vq, to, **kw)
                        want = K.recode_reference(values.codes, vq, to)
                        why = K._codes_mismatch(got, want, to)
                        if why:
                            raise AssertionError(why)
                        return to.dequantize(got), to.dequantize(want), mx.float32

                    record("recode", dim, f"{label}->{bits - 1:g}", name, recoding,
                           K.recode_unsupported(values.codes, vq, to))
                for R, L, mask in ((4, 1, None), (2, 5, "causal")):
                    q = _normal(rng, (1, 4 * R, L, dim), dt)
                    record(f"decode R={R} L={L}", dim, label, name,
                           lambda: (K.decode_attention(q, keys, values, dim ** -0.5, mask, split_tokens=64, **kw),
                                    K.decode_attention_reference(q, keys, values, dim ** -0.5, mask), dt))
                q = _normal(rng, (1, 4 * 2, 40, dim), dt)
                record("prefill R=2 L=40", dim, label, name,
                       lambda: (K.prefill_attention(q, keys, values, dim ** -0.5, "causal", **kw),
                                K.prefill_attention_reference(q, keys, values, dim ** -0.5, "causal"), dt))
    return rows


def self_check_rows(quick: bool, factory, dry: bool = False, skip: str | None = None) -> list[dict]:
    """Every variant through the dispatchers with the kernels forced on: what each first-use self-check decided."""
    from tq_mlx import attention as K
    from tq_mlx.batch import learned
    from tq_mlx.cache import TurboQuantConfig, TurboQuantKVCache

    if skip:
        return [dict(kernel="*", variant="*", passed=None, reason="skipped: " + skip)]
    rng = np.random.default_rng(1)
    dims, dtypes, cases = _cases(dry)
    dims = (128,) if quick and not dry else dims
    # (key bits, value bits, QJL, norm bits, trellis): the default first, then with 8-bit (log-coded) norms
    pairs = [(4, 3, False, 16, False), (4, 3, False, 8, False)] + [(b, b, q, 16, tc) for b, q, tc in cases]
    K.set_backend("metal")
    K.set_kernel_factory(factory)
    K.reset_self_checks()
    errors = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a failed self-check is recorded below
            for dim in dims:
                for kb, vbits, qjl, nb, tc in pairs:
                    for name in dtypes:
                        dt = getattr(mx, name)
                        try:
                            # keys that decay (integer MSE widths from 4 to 6: one bit fewer) after 40 tokens:
                            # the old keys re-coded (dispatch_recode), then read as a second span
                            decays = not qjl and kb == int(kb) and 3 < kb < 8
                            # (prefill not read as decode: one view read by queries of any count, as below)
                            cache = TurboQuantKVCache(TurboQuantConfig(key_bits=kb, value_bits=vbits, qjl=qjl,
                                                                       window=16, calibration_tokens=None, sinks=4,
                                                                       compress_block=8,
                                                                       norm_bits=nb, decay_after=40 if decays else None,
                                                                       prefill_as_decode=False, trellis=tc))
                            k = (_normal(rng, (1, 2, 70, dim)) + 0.5).astype(dt)  # dispatch_encode on compression
                            keys, values = cache.update_and_fetch(k, _normal(rng, (1, 2, 70, dim)).astype(dt))
                            for L, mask in ((1, None), (40, "causal")):
                                q = _normal(rng, (1, 8, L, dim), dt)
                                keys, values = learned(q, keys, values, dim ** -0.5)  # as the attention hook does
                                mx.eval(K.dispatch_attention(q, keys, values, dim ** -0.5, mask))
                            # a prefill read as decode (prefill_as_decode): a 70-token chunk's queries run by run
                            # (16 a run, the prefill kernel's), each with the compressed tokens a decode step reads
                            pd = TurboQuantKVCache(TurboQuantConfig(key_bits=kb, value_bits=vbits, qjl=qjl, window=16,
                                                                    calibration_tokens=None, sinks=4, compress_block=16,
                                                                    norm_bits=nb, trellis=tc,
                                                                    prefill_as_decode=True))
                            pk, pv = pd.update_and_fetch(k, _normal(rng, (1, 2, 70, dim)).astype(dt))
                            q = _normal(rng, (1, 8, 70, dim), dt)
                            pk, pv = learned(q, pk, pv, dim ** -0.5)
                            mx.eval(K.dispatch_attention(q, pk, pv, dim ** -0.5, "causal"))
                            mx.eval(K.dispatch_dequantize(keys, dt))
                            rot = values.quantizer.groups[0].rotation  # d/4 dims for fractional bits
                            mx.eval(K.dispatch_rotate(_normal(rng, (3, rot.dim), dt), rot, True))
                        except Exception as e:  # noqa: BLE001 - a dispatcher must never raise: report it
                            errors.append(dict(kernel="dispatch", variant=f"d={dim} K{kb}{'+qjl' if qjl else ''}"
                                               f"/V{vbits}{' tc' if tc else ''} n{nb} {name}", passed=False,
                                               reason=f"{type(e).__name__}: {e}"))
        status = K.self_check_status()
    finally:
        K.set_backend(None)  # back to $TQ_MLX_KERNELS
        K.set_kernel_factory(None)
    rows = [dict(kernel=kernel, variant=[str(v) for v in variant], passed=reason is None, reason=reason)
            for (kernel, variant), reason in sorted(status.items(), key=str)]
    return rows + errors


# ----------------------------------------------------------------------------------------- timing
def _median_ms(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        mx.eval(fn())
    times = []
    for _ in range(max(1, iters)):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def _peak_bytes(fn) -> int:
    """Peak memory of one call above what was allocated before it (its inputs), output included."""
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    out = fn()
    mx.eval(out)
    peak = mx.get_peak_memory() - base
    del out
    return int(peak)


def random_handle(quantizer, H: int, n: int, n_sinks: int, n_window: int, seed: int):
    """A cache handle of n compressed tokens: random words are valid codes, so nothing needs encoding."""
    from tq_mlx.quant.quantizer import ProdCodes, TurboQuantProd
    from tq_mlx.stream.view import StreamView

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
    f16 = lambda k: _normal(rng, (1, H, k, D), mx.float16) if k else None  # noqa: E731
    return StreamView(quantizer, c, f16(n_sinks), f16(n_window), _normal(rng, (1, H, D)) * 0.1, None)


def timing_rows(kind: str, contexts, shapes, bits, chunk: int, sinks: int, window: int, warmup: int, iters: int,
                with_reference: bool, factory, skip: str | None = None) -> list[dict]:
    """kind 'decode' (1 query token) or 'prefill' (`chunk` query tokens, causal): fused kernel vs SDPA fp16 vs
    the reference, one layer, with each path's peak memory."""
    from tq_mlx import attention as K
    from tq_mlx.quant.quantizer import TurboQuantMSE

    kw = {"metal_kernel": factory} if factory else {}
    L = 1 if kind == "decode" else chunk
    mask = None if kind == "decode" else "causal"
    fused_fn = K.decode_attention if kind == "decode" else K.prefill_attention
    rows = []
    for shape, Hq, H, D in shapes:
        for kb, vb, tc in bits:
            kq, vq = TurboQuantMSE(D, kb, seed=2, trellis=tc), TurboQuantMSE(D, vb, seed=3, trellis=tc)
            for T in contexts:
                n = T - sinks - window
                row = dict.fromkeys(ROW_KEYS)
                row.update(shape=shape, q_heads=Hq, kv_heads=H, head_dim=D, key_bits=kb, value_bits=vb, trellis=tc,
                           context=T, query_tokens=L)
                try:
                    keys = random_handle(kq, H, n, sinks, window, seed=T)
                    values = random_handle(vq, H, n, sinks, window, seed=T + 1)
                    rng = np.random.default_rng(T)
                    q = _normal(rng, (1, Hq, L, D), mx.float16)
                    kf, vf = _normal(rng, (1, H, T, D), mx.float16), _normal(rng, (1, H, T, D), mx.float16)
                    mx.eval(keys, values, q, kf, vf)
                    scale = D ** -0.5
                    sdpa = lambda: mx.fast.scaled_dot_product_attention(q, kf, vf, scale=scale, mask=mask)  # noqa: E731
                    row["sdpa_fp16_ms"] = _median_ms(sdpa, warmup, iters)
                    row["sdpa_peak_bytes"] = _peak_bytes(sdpa)
                    if with_reference:
                        ref_fn = K.decode_attention_reference if kind == "decode" else K.prefill_attention_reference
                        ref = lambda: ref_fn(q, keys, values, scale, mask)  # noqa: E731
                        row["reference_ms"] = _median_ms(ref, warmup, iters)
                        row["reference_peak_bytes"] = _peak_bytes(ref)
                    row["cache_bytes"] = sum(a.nbytes for kv in (keys, values) for a in kv.codes) + sum(
                        a.nbytes for kv in (keys, values) for a in (kv.sinks, kv.window) if a is not None)
                    row["fp16_cache_bytes"] = kf.nbytes + vf.nbytes
                    if skip:
                        row["error"] = "fused kernel skipped: " + skip
                    else:
                        fused = lambda: fused_fn(q, keys, values, scale, mask, **kw)  # noqa: E731
                        row["fused_ms"] = _median_ms(fused, warmup, iters)
                        row["fused_peak_bytes"] = _peak_bytes(fused)
                        row["speedup_vs_sdpa"] = row["sdpa_fp16_ms"] / row["fused_ms"]
                except Exception as e:  # noqa: BLE001 - one failing row must not lose the others
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                rows.append(row)
                print(f"  {kind} {shape} K{kb}V{vb}{' tc' if tc else ''} {T:>6}: fused {_f(row['fused_ms'])} ms, "
                      f"sdpa {_f(row['sdpa_fp16_ms'])} ms" + (f" ({row['error']})" if row["error"] else ""), flush=True)
    return rows


def _finite(o):
    """NaN and infinities as null: the file is strict JSON for any reader."""
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def _f(x, digits: int | None = 3) -> str:
    """A number for the tables (None / NaN as '–'; digits None: scientific)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.2e}" if digits is None else f"{x:.{digits}f}"


def _mb(x) -> str:
    return "–" if x is None else f"{x / 2**20:.1f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="head_dim 128 checks, 4k and 16k contexts")
    ap.add_argument("--dry-run", action="store_true",
                    help="no Metal: tiny sizes on the CPU, kernels on the tests/emulator CPU emulator if it can "
                         "compile; checks the script and its JSON, not Metal")
    ap.add_argument("--out-dir", default=None, help="where mac_check.json/.md go (default benchmarks/results)")
    ap.add_argument("--chunk", type=int, default=512, help="query tokens of the prefill chunk (512)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--no-reference", action="store_true", help="skip timing the pure-MLX reference path")
    args = ap.parse_args(argv)

    why = metal_missing()
    if why and not args.dry_run:
        print(f"Metal is not available on this machine ({why}). Nothing was checked or timed. "
              f"(--dry-run checks the script itself on the CPU.)", file=sys.stderr)
        return 2

    import common

    from tq_mlx import TurboQuantConfig

    factory, skip, runner = None, None, "metal"
    if args.dry_run:
        factory, skip = emulator_factory()
        runner = "emulator (CPU)" if factory else "none"
        print(f"DRY RUN on {mx.default_device()}: kernels on {runner}{f' ({skip})' if skip else ''}; "
              "nothing here says anything about Metal.", flush=True)
    defaults = TurboQuantConfig()
    if args.dry_run:
        contexts, shapes, bits, chunk = DRY["contexts"], DRY["shapes"], DRY["bits"], DRY["chunk"]
        sinks, window, warmup, iters = DRY["sinks"], DRY["window"], 0, 1
    else:
        contexts, shapes, bits, chunk = (QUICK_CONTEXTS if args.quick else CONTEXTS), SHAPES, TIMING_BITS, args.chunk
        sinks, window, warmup, iters = defaults.sinks, defaults.window, args.warmup, args.iters

    print("Checking every kernel against the reference path ...", flush=True)
    checks = check_rows(args.quick, factory, args.dry_run, skip)
    failed = [r for r in checks if r["ok"] is False]
    check_table = [[r["kernel"], r["dim"], r["bits"], r["dtype"], _f(r["max_abs_err"], None),
                    "PASS" if r["ok"] else ("FAIL: " if r["ok"] is False else "") + (r["reason"] or "")[:80]]
                   for r in checks]
    check_headers = ["kernel", "head_dim", "bits", "dtype", "max abs err", "result"]
    print(common.text_table(check_headers, check_table, "lrrlrl"))
    print(f"{len(checks) - len(failed)}/{len(checks)} passed", flush=True)

    print("\nSelf-checks of every kernel variant through the dispatchers ...", flush=True)
    self_checks = self_check_rows(args.quick, factory, args.dry_run, skip)
    sc_failed = [r for r in self_checks if r["passed"] is False]
    for r in self_checks:
        if not r["passed"]:
            print(f"  {r['kernel']} {r['variant']}: {r['reason']}")
    print(f"{len(self_checks) - len(sc_failed)}/{len(self_checks)} variants passed", flush=True)

    timings = {}
    for kind in ("decode", "prefill"):
        print(f"\nTiming {kind} ({'1 query token' if kind == 'decode' else f'{chunk} query tokens, causal'}, "
              "one layer) ...", flush=True)
        timings[kind] = timing_rows(kind, contexts, shapes, bits, chunk, sinks, window, warmup, iters,
                                    not args.no_reference, factory, skip)
    time_headers = ["shape", "K/V bits", "context", "fused ms", "SDPA fp16 ms", "reference ms", "fused vs SDPA",
                    "fused peak MB", "SDPA peak MB", "reference peak MB", "cache MB", "fp16 MB"]

    def time_table(rows):
        return [[r["shape"], f"{r['key_bits']}/{r['value_bits']}{' tc' if r['trellis'] else ''}", r["context"], _f(r["fused_ms"]),
                 _f(r["sdpa_fp16_ms"]), _f(r["reference_ms"]), _f(r["speedup_vs_sdpa"], 2),
                 _mb(r["fused_peak_bytes"]), _mb(r["sdpa_peak_bytes"]), _mb(r["reference_peak_bytes"]),
                 _mb(r["cache_bytes"]), _mb(r["fp16_cache_bytes"])] for r in rows]

    for kind in timings:
        print(common.text_table(time_headers, time_table(timings[kind])))

    machine = machine_info(why is None)
    meta = common.metadata()
    payload = {
        "schema": SCHEMA, "dry_run": bool(args.dry_run), "kernel_runner": runner, "machine": machine, "meta": meta,
        "settings": dict(quick=bool(args.quick), chunk=chunk, sinks=sinks, window=window, warmup=warmup,
                         iters=iters, contexts=list(contexts)),
        "checks": checks, "self_checks": self_checks, "decode": timings["decode"], "prefill": timings["prefill"],
        "summary": dict(checks=len(checks), checks_failed=len(failed), self_checks=len(self_checks),
                        self_checks_failed=len(sc_failed)),
    }
    md = "\n\n".join([
        common.meta_line(meta) + f" · chip {machine['chip']}, macOS {machine['macos']}"
        + (" · **DRY RUN (CPU, no Metal)**" if args.dry_run else ""),
        "### Kernels vs reference", common.markdown_table(check_headers, check_table, "lrrlrl"),
        f"### Self-checks: {len(self_checks) - len(sc_failed)}/{len(self_checks)} variants passed",
        "\n".join(f"* {r['kernel']} {r['variant']}: {r['reason']}" for r in self_checks if not r["passed"])
        or "all passed",
        "### Decode attention, one layer, 1 query token",
        common.markdown_table(time_headers, time_table(timings["decode"])),
        f"### Prefill attention, one layer, {chunk} query tokens (causal)",
        common.markdown_table(time_headers, time_table(timings["prefill"])),
    ])
    name = "mac_check-dry-run" if args.dry_run else "mac_check"
    jp, _ = common.write_results(name, _finite(payload), md, args.out_dir)
    print(f"\nwrote {jp}: attach it to the issue")
    return 1 if failed or sc_failed else 0


if __name__ == "__main__":
    sys.exit(main())
