"""Where the key error comes from, layer by layer, and what key_error chooses: per attention layer, the RMS error of
the attention logits that keys coded at 4, 5 and 6 bits give, as the cache predicts it at its first compression
(tq_mlx.stream.calibration.logit_error on the calibration tokens and their queries) and as real codes give it to later
queries, with the attention-weighted error those queries' softmax sees (½·Var_p(δ), the KL of one head's
attention to first order); then the widths TurboQuantConfig(key_error=E) takes per layer for each --targets E,
and beside them the widths each kv head alone would take (a forecast: the cache chooses one width per layer).

Keys are centered before RoPE and weighed by the calibration queries, as the default cache codes them; queries
are the last 256 of a --context-token Britannica prefix, keys all of it. Not a quality figure: long_context.py
measures what a setting does to the model's output.

    python experiments/key_widths.py --models qwen05,qwen15,smollm2 --context 2048 --targets 0.1,0.15,0.2
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
from key_error import MODELS, QUERIES, centered_means  # noqa: E402
from tq_mlx import TurboQuantConfig  # noqa: E402
from tq_mlx.models.architectures import load_model_config  # noqa: E402
from tq_mlx.stream.calibration import key_width, logit_error, query_weights  # noqa: E402
from tq_mlx.quant.codebook import lloyd_max  # noqa: E402
from tq_mlx.quant.quantizer import TurboQuantMSE  # noqa: E402
from tq_mlx.models.rope import probe  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"  # experiments/results/, beside the probes

BITS = (4, 5, 6)


def layer_row(i: int, q: mx.array, k: mx.array, scale: float, rope, base: float, calib: slice) -> dict:
    B, Hq, N, D = q.shape
    H = k.shape[1]
    G = Hq // H
    qc = q.reshape(B, H, G, N, D)[:, :, :, calib].reshape(B, H, -1, D)
    q_sq = mx.sum(qc * qc, axis=2)
    mean = centered_means(k, "rope", calib, base)
    w = query_weights(q_sq, (k - mean)[:, :, calib], rope)
    unit = logit_error((k - mean)[:, :, calib] * w[:, :, None], w, q_sq, qc.shape[2], scale)
    row = {"layer": i, "unit": float(mx.max(unit)), "unit_heads": [float(u) for u in unit[0]]}
    ql = q[:, :, -QUERIES:].reshape(B, H, G * QUERIES, D) * scale
    pos = mx.array(np.tile(np.arange(N - QUERIES, N), G))[None, None, :, None]
    seen = mx.arange(N)[None, None, None, :] <= pos
    p = mx.softmax(mx.where(seen, ql @ k.swapaxes(-1, -2), -1e30), axis=-1)
    for b in BITS:
        quant = TurboQuantMSE(D, b, seed=1)
        k_hat = quant.dequantize(quant.quantize((k - mean) * w[:, :, None])) / w[:, :, None] + mean
        delta = ql @ (k_hat - k).swapaxes(-1, -2)
        m1, m2 = mx.sum(p * delta, -1), mx.sum(p * delta * delta, -1)
        row[f"predicted_{b}"] = row["unit"] * math.sqrt(lloyd_max(D, b).mse)
        row[f"measured_{b}"] = float(mx.sqrt(mx.sum(mx.where(seen, delta * delta, 0)) / mx.sum(seen)))
        row[f"attention_{b}"] = float(mx.mean(0.5 * (m2 - m1 * m1)))
    return row


def run_model(key: str, context: int, targets: list[float]) -> dict:
    from tests.support import real_models

    label, loader, path_fn = MODELS[key]
    mcfg = load_model_config(getattr(real_models, path_fn)())
    base = float(mcfg.get("rope_theta", 10000.0))
    model, tok = getattr(real_models, loader)(mx.float32)
    captured, scale = quality.capture_qkv(model, quality.text_ids(tok, context))
    d = TurboQuantConfig()
    calib = slice(d.sinks, d.sinks + d.first_window)
    layers = []
    for i, (q, k, _) in enumerate(captured):
        rope = probe(model.model.layers[i].self_attn.rope, k.shape[-1])
        layers.append(layer_row(i, q.astype(mx.float32), k.astype(mx.float32), scale, rope, base, calib))
        r = layers[-1]
        print(f"  layer {i:2d}: logit error K4 predicted {r['predicted_4']:.3f} measured {r['measured_4']:.3f}, "
              f"attention {r['attention_4']:.2e} / {r['attention_5']:.2e} / {r['attention_6']:.2e} at K4/5/6", flush=True)
    D = captured[0][1].shape[-1]
    widths = {f"{t:g}": [key_width(r["unit"], BITS, t, D) for r in layers] for t in targets}
    # what a width per kv head (each head its own fewest bits) would take instead of the layer's widest head's
    head_widths = {f"{t:g}": [[key_width(u, BITS, t, D) for u in r["unit_heads"]] for r in layers] for t in targets}
    return {"model": label, "context": context, "layers": layers, "widths": widths, "head_widths": head_widths}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="qwen05,qwen15,smollm2", help=f"comma list of {','.join(MODELS)}")
    ap.add_argument("--context", type=int, default=2048, help="prefix tokens (above the window + sinks + 256)")
    ap.add_argument("--targets", default="0.1,0.15,0.2", help="key_error targets, comma list")
    ap.add_argument("--out", default=str(RESULTS), help="results folder")
    args = ap.parse_args()
    d = TurboQuantConfig()
    if args.context < d.sinks + d.first_window + QUERIES:
        raise SystemExit(f"--context must be at least {d.sinks + d.first_window + QUERIES}, got {args.context}")
    targets = [float(t) for t in args.targets.split(",")]
    results = common.per_model(args.models, MODELS, lambda key: run_model(key, args.context, targets))
    headers = ["model", "logit error K4 (median, max)", "predicted / measured", "Σ attention error K4 / K5 / K6"] + [
        f"widths at key_error {t:g} (K4/K5/K6)" for t in targets] + [
        f"mean key bits at key_error {t:g}: per layer / per kv head" for t in targets]
    rows = []
    for m in results["models"].values():
        L = m["layers"]
        p4 = [r["predicted_4"] for r in L]
        ratio = np.median([r["predicted_4"] / r["measured_4"] for r in L])
        att = " / ".join(f"{sum(r[f'attention_{b}'] for r in L):.3f}" for b in BITS)
        rows.append([m["model"], f"{np.median(p4):.3f}, {max(p4):.3f}", f"{ratio:.2f}", att]
                    + ["/".join(str(w.count(b)) for b in BITS) for w in m["widths"].values()]
                    + [f"{np.mean(m['widths'][t]):.2f} / {np.mean(m['head_widths'][t]):.2f}" for t in m["widths"]])
    table = common.markdown_table(headers, rows)
    jp, _ = common.write_results("key_widths", results, table, args.out)
    print(f"\n{table}\n\nwrote {jp} ({results['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
