"""Distortion of TurboQuant_mse and TurboQuant_prod against the paper and the Shannon lower bound.

For d in 64/128/256 and b = 1..4 it measures, on random unit vectors:
  D_mse  = E‖x - x̃‖²                              (TurboQuantMSE, b bits)
  D_prod = E(⟨y, x⟩ - est)² · d / ‖y‖²            (TurboQuantProd, b bits, y Gaussian)
and prints them next to the exact Lloyd-Max optimum for that d, the paper's values, the lower bound 4^-b and the
ratio to it, plus quantize and dequantize throughput on this machine.

    python benchmarks/distortion.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time

import mlx.core as mx

from tq_mlx import TurboQuantMSE, TurboQuantProd, lloyd_max

PAPER_MSE = {1: 0.36, 2: 0.117, 3: 0.03, 4: 0.009}
PAPER_PROD = {1: 1.57, 2: 0.56, 3: 0.18, 4: 0.047}


def _rate(fn, arg, n: int, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn(arg))
        best = min(best, time.perf_counter() - t)
    return n / best


def measure(dim: int, bits: int, n: int, seed: int = 0) -> dict:
    kx, ky = mx.random.split(mx.random.key(seed + 1000 * bits + dim))
    x = mx.random.normal((n, dim), key=kx)
    x = x / mx.linalg.norm(x, axis=-1, keepdims=True)
    y = mx.random.normal((n, dim), key=ky)

    q = TurboQuantMSE(dim, bits, seed=seed)
    c = q.quantize(x)
    d_mse = mx.mean(mx.sum((q.dequantize(c) - x) ** 2, axis=-1))
    p = TurboQuantProd(dim, bits, seed=seed)
    err = p.inner_product(y, p.quantize(x)) - mx.sum(x * y, axis=-1)
    d_prod = mx.mean(err * err / mx.sum(y * y, axis=-1)) * dim
    bias = mx.mean(err) / (mx.std(err) / math.sqrt(n))
    mx.eval(d_mse, d_prod, bias, c)
    bound = 4.0**-bits
    return {
        "dim": dim,
        "bits": bits,
        "vectors": n,
        "d_mse": float(d_mse),
        "d_mse_optimum": lloyd_max(dim, bits).mse,
        "d_mse_paper": PAPER_MSE[bits],
        "d_prod": float(d_prod),
        "d_prod_paper": PAPER_PROD[bits],
        "prod_bias_in_se": float(bias),
        "lower_bound": bound,
        "mse_ratio_to_bound": float(d_mse) / bound,
        "quantize_vec_per_s": _rate(q.quantize, x, n),
        "dequantize_vec_per_s": _rate(q.dequantize, c, n),
    }


HEADER = (
    f"{'d':>4} {'b':>2} | {'D_mse':>8} {'optimum':>8} {'paper':>6} {'4^-b':>7} {'ratio':>5} | "
    f"{'D_prod·d':>8} {'paper':>6} {'bias/SE':>7} | {'quant vec/s':>11} {'dequant vec/s':>13}"
)


def row_text(r: dict) -> str:
    """One row of the table, as printed (and as docs/benchmarks.md shows it: tools/docs/docs_assets.py)."""
    return (
        f"{r['dim']:>4} {r['bits']:>2} | {r['d_mse']:8.5f} {r['d_mse_optimum']:8.5f} {r['d_mse_paper']:6.3f} "
        f"{r['lower_bound']:7.4f} {r['mse_ratio_to_bound']:5.2f} | {r['d_prod']:8.4f} "
        f"{r['d_prod_paper']:6.3f} {r['prod_bias_in_se']:7.2f} | {r['quantize_vec_per_s']:11,.0f} "
        f"{r['dequantize_vec_per_s']:13,.0f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4k vectors instead of 20k (for CI)")
    ap.add_argument("--vectors", type=int, default=None)
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    n = args.vectors or (4000 if args.quick else 20000)

    rows = []
    print(f"TurboQuant distortion, {n} random unit vectors per row, {platform.machine()} {mx.default_device()}")
    print(HEADER)
    print("-" * len(HEADER))
    for dim in (64, 128, 256):
        for bits in (1, 2, 3, 4):
            r = measure(dim, bits, n)
            rows.append(r)
            print(row_text(r))
    if args.json:
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import common  # the code version every results file records (imported late: it tunes the allocator)

        meta = {"machine": platform.platform(), "device": str(mx.default_device()), "date": time.strftime("%Y-%m-%d"),
                **common.code_version()}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
