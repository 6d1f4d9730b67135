"""Whether a layer's first window tells how much its old values may lose: per attention layer, the relative error
of the attention outputs that values coded at 2, 3 and 4 bits give, on the first window (its last 256 queries
reading the tokens at least 256 positions older, as decayed tokens are read: far back, among many; real codes) and
on the tokens a later query reads past its float window; then the decay widths a value error target E would give
each layer from the window (the fewest bits from 2 up to 4 whose error there is at most E).

Beside it, a forecast without codes (output_error): an error e_i isotropic after the rotation with E‖e_i‖² =
D_mse(b)·‖v_i‖², independent across tokens, moves output o_q = Σ p_qi v_i by Σ p_qi e_i, relatively by
√(D_mse(b) · Σ_q Σ_i p_qi² ‖v_i‖² / Σ_q ‖o_q‖²): attention spread over many old tokens averages their errors
away, a layer whose outputs are small next to its values (they cancel) does not. Values that share a large common
part break the independence (their errors correlate), and there the forecast falls short of real codes.
Queries are those of a --context-token Britannica prefix; not a quality figure (long_context.py is).

    python experiments/value_widths.py --models qwen05,qwen15,smollm2 --context 2048 --targets 0.05,0.1,0.15
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

# the probes beside this one, then the benchmarks' modules they measure with
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "benchmarks")]

import common  # noqa: E402  (puts the repo on sys.path)
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import quality  # noqa: E402
from key_error import MODELS, QUERIES  # noqa: E402
from tq_mlx import TurboQuantConfig  # noqa: E402
from tq_mlx.quant.codebook import lloyd_max  # noqa: E402
from tq_mlx.quant.quantizer import TurboQuantMSE  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"  # experiments/results/, beside the probes

BITS = (2, 3, 4)
AGE = 256  # the window's old tokens: at least this many positions before its first query read


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float, queries: slice) -> tuple[mx.array, mx.array]:
    """(p, o): float attention of the queries at positions `queries` over every key up to their own position,
    per kv head with its query heads in one axis: p (B, H, G·n, N), o (B, H, G·n, D)."""
    B, Hq, N, D = q.shape
    H = k.shape[1]
    G = Hq // H
    n = queries.stop - queries.start
    qs = q.reshape(B, H, G, N, D)[:, :, :, queries].reshape(B, H, G * n, D) * scale
    pos = mx.array(np.tile(np.arange(queries.start, queries.stop), G))[None, None, :, None]
    p = mx.softmax(mx.where(mx.arange(N)[None, None, None, :] <= pos, qs @ k.swapaxes(-1, -2), -1e30), axis=-1)
    return p, p @ v


def output_error(p: mx.array, o: mx.array, v: mx.array, old: slice) -> mx.array:
    """Per (batch, kv head): the relative output error √(Σ_q Σ_i p_qi² ‖v_i‖² / Σ_q ‖o_q‖²) that a unit isotropic
    error on the values at positions `old` gives (times √D_mse(b): the error at b bits)."""
    norm_sq = mx.sum(v[:, :, old] * v[:, :, old], axis=-1)  # (B, H, n_old)
    num = mx.sum(p[..., old] ** 2 * norm_sq[:, :, None, :], axis=(2, 3))
    return mx.sqrt(num / mx.maximum(mx.sum(o * o, axis=(2, 3)), 1e-30))


def coded_error(p: mx.array, o: mx.array, v: mx.array, old: slice, bits: int, seed: int = 1) -> mx.array:
    """Per (batch, kv head): the relative output error √(Σ_q ‖Σ_i p_qi (v̂_i - v_i)‖² / Σ_q ‖o_q‖²) of real
    TurboQuant codes at `bits` on the values at positions `old`."""
    quant = TurboQuantMSE(v.shape[-1], bits, seed=seed)
    x = v[:, :, old]
    e = quant.dequantize(quant.quantize(x)) - x
    d = p[..., old] @ e
    return mx.sqrt(mx.sum(d * d, axis=(2, 3)) / mx.maximum(mx.sum(o * o, axis=(2, 3)), 1e-30))


def value_width(errors: dict[int, float], bits: int, target: float) -> int:
    """The fewest bits among `errors` (bits -> output error) whose error is at most `target`; `bits` (no decay) if
    none is."""
    return next((b for b in sorted(errors) if b < bits and errors[b] <= target), bits)


def layer_row(i: int, q: mx.array, k: mx.array, v: mx.array, scale: float, sinks: int, window: int) -> dict:
    N = q.shape[2]
    end = sinks + window  # the window: the calibration tokens
    old = slice(sinks, end - 2 * AGE)  # what the window's last AGE queries read at least AGE positions back
    p, o = attention(q, k, v, scale, slice(end - AGE, end))
    unit = output_error(p, o, v, old)[0]
    on_window = {b: float(mx.max(coded_error(p, o, v, old, b)[0])) for b in BITS}
    late = slice(N - QUERIES, N)
    decayed = slice(sinks, N - QUERIES - window)  # what a later query reads past its float window
    p, o = attention(q, k, v, scale, late)
    row = {"layer": i, "unit": float(mx.max(unit)), "unit_heads": [float(u) for u in unit],
           "unit_late": float(mx.max(output_error(p, o, v, decayed)[0])),
           **{f"window_{b}": e for b, e in on_window.items()}}
    for b in BITS:
        row[f"measured_{b}"] = float(mx.max(coded_error(p, o, v, decayed, b)[0]))
    return row


def correlation(a: list[float], b: list[float]) -> tuple[float, float]:
    """(Pearson, Spearman)."""
    rank = lambda x: np.argsort(np.argsort(x))  # noqa: E731
    return float(np.corrcoef(a, b)[0, 1]), float(np.corrcoef(rank(a), rank(b))[0, 1])


def run_model(key: str, context: int, targets: list[float]) -> dict:
    from tests.support import real_models

    label, loader, _ = MODELS[key]
    model, tok = getattr(real_models, loader)(mx.float32)
    captured, scale = quality.capture_qkv(model, quality.text_ids(tok, context))
    d = TurboQuantConfig()
    layers = []
    for i, (q, k, v) in enumerate(captured):
        r = layer_row(i, q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32), scale, d.sinks, d.first_window)
        layers.append(r)
        print(f"  layer {i:2d}: V2/V3/V4 on the window {r['window_2']:.4f} / {r['window_3']:.4f} / {r['window_4']:.4f},"
              f" later {r['measured_2']:.4f} / {r['measured_3']:.4f} / {r['measured_4']:.4f}; unit forecast "
              f"{r['unit']:.3f}", flush=True)
    D = captured[0][2].shape[-1]
    widths = {f"{t:g}": [value_width({b: r[f"window_{b}"] for b in BITS}, BITS[-1], t) for r in layers]
              for t in targets}
    measured = [r["measured_2"] for r in layers]
    return {"model": label, "context": context, "layers": layers, "widths": widths,
            "correlation": correlation([r["window_2"] for r in layers], measured),
            "correlation_forecast": correlation([r["unit"] for r in layers], measured),
            "forecast_over_measured_2": float(np.median([r["unit_late"] * math.sqrt(lloyd_max(D, 2).mse)
                                                         / r["measured_2"] for r in layers]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="qwen05,qwen15,smollm2", help=f"comma list of {','.join(MODELS)}")
    ap.add_argument("--context", type=int, default=2048, help="prefix tokens (at least sinks + 2 windows + 256)")
    ap.add_argument("--targets", default="0.05,0.1,0.15", help="value error targets, comma list")
    ap.add_argument("--out", default=str(RESULTS), help="results folder")
    args = ap.parse_args()
    d = TurboQuantConfig()
    least = d.sinks + 2 * d.first_window + QUERIES
    if args.context < least:
        raise SystemExit(f"--context must be at least {least} (later queries read tokens past their window), got "
                         f"{args.context}")
    targets = [float(t) for t in args.targets.split(",")]
    results = common.per_model(args.models, MODELS, lambda key: run_model(key, args.context, targets))
    headers = ["model", "V2 on the window against later (Pearson, Spearman)", "unit forecast against later",
               "forecast / measured, later", "V2 error later (median, max)"] + [
        f"layers at V2/V3/V4 for E = {t:g}" for t in targets]
    rows = []
    for m in results["models"].values():
        m2 = [r["measured_2"] for r in m["layers"]]
        rows.append([m["model"], "{:.2f}, {:.2f}".format(*m["correlation"]),
                     "{:.2f}, {:.2f}".format(*m["correlation_forecast"]), f"{m['forecast_over_measured_2']:.2f}",
                     f"{np.median(m2):.3f}, {max(m2):.3f}"]
                    + ["/".join(str(w.count(b)) for b in BITS) for w in m["widths"].values()])
    table = common.markdown_table(headers, rows)
    jp, _ = common.write_results("value_widths", results, table, args.out)
    print(f"\n{table}\n\nwrote {jp} ({results['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
