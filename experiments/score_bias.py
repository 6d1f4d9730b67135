"""Whether coded keys' scores want a variance shift: attention over keys coded at --bits, each coded token's score
moved by a·σ_i² before the softmax, against float attention.

A Lloyd-Max code's reconstruction is the conditional mean of the coordinate in its cell, so a coded score ŝ_i is
an estimate of the true s_i with error variance σ_i² ≈ scale²·‖q‖²·‖k_i‖²·D_mse(b)/D (the rotation spreads q
over the coordinates). Were the error independent of ŝ, E exp(s_i) = exp(ŝ_i + σ_i²/2) (a = +0.5) would put back
the mass coded tokens lose against the float sinks and window; were it part of ŝ (noise the code adds), the
convexity of exp would give them too much mass and a < 0 would take it away. This measures which, per attention
layer: the relative output error ‖ô - o‖/‖o‖ (values float: the keys alone), the mean KL(p ‖ p̂) of the rows,
and the attention mass on the coded tokens, for a in --shifts.

The cache's geometry: 4 float sinks, the last 768 tokens float (the window), the tokens between coded; keys
centered as the cache does (one mean before RoPE); queries the last 256 of a --context-token Britannica prefix.
Not a quality figure (long_context.py is): it says whether a score shift is worth building.

    python experiments/score_bias.py --models qwen05,qwen15 --context 4096 --bits 3,4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# the probes beside this one, then the benchmarks' modules they measure with
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "benchmarks")]

import common  # noqa: E402  (puts the repo on sys.path)
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import long_context_settings as lc_settings  # noqa: E402
import quality  # noqa: E402
from key_error import MODELS, QUERIES, centered_means  # noqa: E402
from tq_mlx.models.architectures import load_model_config  # noqa: E402
from tq_mlx.quant.codebook import lloyd_max  # noqa: E402
from tq_mlx.quant.quantizer import TurboQuantMSE  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"  # experiments/results/, beside the probes
GEOMETRY = lc_settings.DEFAULT_1204.config  # the default's sinks and 768-token window, as its results were measured


def layer_row(q: mx.array, k: mx.array, v: mx.array, scale: float, base: float, bits: list[int],
              shifts: list[float]) -> dict:
    d = GEOMETRY
    B, Hq, N, D = q.shape
    H = k.shape[1]
    G = Hq // H
    coded = slice(d.sinks, N - d.window)
    k = k - centered_means(k, "rope", slice(d.sinks, d.sinks + d.window), base)
    qs = q[:, :, N - QUERIES:].reshape(B, H, G * QUERIES, D) * scale
    pos = mx.array(np.tile(np.arange(N - QUERIES, N), G))[None, None, :, None]
    causal = mx.arange(N)[None, None, None, :] <= pos
    p = mx.softmax(mx.where(causal, qs @ k.swapaxes(-1, -2), -1e30), axis=-1)
    o = p @ v
    row = {"mass_float": float(mx.mean(mx.sum(p[..., coded], axis=-1)))}
    float_parts = (d.sinks, d.window)  # the sinks and the window, before and after the coded tokens
    for b in bits:
        quant = TurboQuantMSE(D, b, seed=1)
        mid = k[:, :, coded]
        k_hat = mx.concatenate([k[:, :, : d.sinks], quant.dequantize(quant.quantize(mid)), k[:, :, N - d.window:]], 2)
        s_hat = mx.where(causal, qs @ k_hat.swapaxes(-1, -2), -1e30)
        var = (mx.sum(qs * qs, axis=-1, keepdims=True) * mx.sum(mid * mid, axis=-1)[:, :, None, :]
               * lloyd_max(D, b).mse / D)
        var = mx.pad(var, [(0, 0), (0, 0), (0, 0), float_parts])  # the float sinks and window: no shift
        row[f"sigma_{b}"] = float(mx.mean(mx.sqrt(var[..., coded])))
        for a in shifts:
            ph = mx.softmax(s_hat + a * var, axis=-1)
            row[f"err_{b}_{a:g}"] = float(mx.sqrt(mx.sum((ph @ v - o) ** 2) / mx.sum(o * o)))
            row[f"kl_{b}_{a:g}"] = float(mx.mean(mx.sum(p * (mx.log(p + 1e-30) - mx.log(ph + 1e-30)), axis=-1)))
            row[f"mass_{b}_{a:g}"] = float(mx.mean(mx.sum(ph[..., coded], axis=-1)))
    return row


def run_model(key: str, context: int, bits: list[int], shifts: list[float]) -> dict:
    from tests.support import real_models

    label, loader, path_fn = MODELS[key]
    base = float(load_model_config(getattr(real_models, path_fn)()).get("rope_theta", 10000.0))
    model, tok = getattr(real_models, loader)(mx.float32)
    captured, scale = quality.capture_qkv(model, quality.text_ids(tok, context))
    layers = []
    for i, (q, k, v) in enumerate(captured):
        r = layer_row(*(x.astype(mx.float32) for x in (q, k, v)), scale, base, bits, shifts)
        layers.append(r)
        print(f"  layer {i:2d}: " + ", ".join(f"a={a:g} err {r[f'err_{bits[0]}_{a:g}']:.4f}" for a in shifts), flush=True)
    summary = {f"{m}_{b}_{a:g}": float(np.mean([r[f"{m}_{b}_{a:g}"] for r in layers]))
               for m in ("err", "kl") for b in bits for a in shifts}
    return {"model": label, "context": context, "layers": layers, "mean": summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="qwen05,qwen15", help=f"comma list of {','.join(MODELS)}")
    ap.add_argument("--context", type=int, default=4096, help="prefix tokens (more than the window, sinks and queries)")
    ap.add_argument("--bits", default="3,4", help="key bits, comma list of whole numbers 2 to 8")
    ap.add_argument("--shifts", default="0.5,0,-0.25,-0.5", help="a in a·σ², comma list")
    ap.add_argument("--out", default=str(RESULTS), help="results folder")
    args = ap.parse_args()
    d = GEOMETRY
    if args.context <= d.sinks + d.window + QUERIES:
        raise SystemExit(f"--context must exceed {d.sinks + d.window + QUERIES} tokens, got {args.context}")
    bits = [int(b) for b in args.bits.split(",")]
    if any(not 2 <= b <= 8 for b in bits):
        raise SystemExit(f"--bits must be whole numbers from 2 to 8, got {args.bits}")
    shifts = [float(a) for a in args.shifts.split(",")]
    t0 = time.perf_counter()
    results = {"meta": common.metadata(), "models": {}}
    for key in args.models.split(","):
        print(f"{MODELS[key][0]}:", flush=True)
        results["models"][key] = run_model(key, args.context, bits, shifts)
    results["seconds"] = round(time.perf_counter() - t0, 1)
    headers = ["model", "key bits"] + [f"a = {a:g}: error, KL" for a in shifts]
    rows = [[m["model"], f"K{b}"] + [f"{m['mean'][f'err_{b}_{a:g}']:.4f}, {m['mean'][f'kl_{b}_{a:g}']:.4f}"
                                     for a in shifts]
            for m in results["models"].values() for b in bits]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "score_bias.json").write_text(json.dumps(results, indent=1))
    print(common.markdown_table(headers, rows))


if __name__ == "__main__":
    main()
