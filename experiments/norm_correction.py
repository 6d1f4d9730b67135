"""Whether values should keep their norms corrected: per attention layer, the relative error of the attention
outputs that values coded at 3 and 4 bits give, with each token's norm stored three ways:

* plain: ‖x‖, the decoded vector ‖x‖·c (c the unit vector's code, ‖c‖² ≈ 1 - D_mse: shorter than the token);
* corrected: ‖x‖ / ‖c‖ (config.correct_norms), the decoded vector as long as the token;
* least squares: ⟨x, c⟩ / ‖c‖², the scale that makes each decoded vector closest to its token (the least MSE).

The question it answers: each centroid is the mean of the coordinates it codes, so plain codes look unbiased and
correcting the norms might lengthen every value an attention output averages (by about 1 + D_mse / 2), an error
that does not average away. Measured: it does not; the outputs' error is lowest with the norms corrected, and the
least squares' lower MSE per vector does not carry to the outputs.

Queries are the last 256 of a --context-token Britannica prefix, reading the tokens past the first 4 and before
their 128-token window (the cache's sinks and window); the largest error over kv heads per layer. Not a quality
figure (long_context.py is: `nc`, `nck`, `ncv` settings).

    python experiments/norm_correction.py --models qwen05,qwen15,smollm2 --context 2048
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# the probes beside this one, then the benchmarks' modules they measure with
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "benchmarks")]

import common  # noqa: E402  (puts the repo on sys.path)
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import quality  # noqa: E402
from key_error import MODELS  # noqa: E402
from tq_mlx.quant.quantizer import TurboQuantMSE  # noqa: E402
from value_widths import attention  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BITS = (3, 4)
NORMS = ("plain", "corrected", "least_squares")
QUERIES, SINKS, WINDOW = 256, 4, 128


def decode(x: mx.array, bits: int, norms: str) -> mx.array:
    """x coded at `bits` (float16 norms) and decoded with its norm stored as `norms` says."""
    q = TurboQuantMSE(x.shape[-1], bits, seed=1)
    plain = q.dequantize(q.quantize(x))  # ‖x‖ c
    length = mx.linalg.norm(plain, axis=-1, keepdims=True)
    if norms == "corrected":
        return plain * mx.linalg.norm(x, axis=-1, keepdims=True) / length
    if norms == "least_squares":
        return plain * mx.sum(x * plain, axis=-1, keepdims=True) / (length * length)
    return plain


def layer_errors(q: mx.array, k: mx.array, v: mx.array, scale: float) -> dict:
    """{bits: {norms: (the largest relative output error over kv heads, the mean relative MSE per vector)}}."""
    N = q.shape[2]
    p, o = attention(q, k, v, scale, slice(N - QUERIES, N))
    old = slice(SINKS, N - QUERIES - WINDOW)
    x = v[:, :, old]
    out = {}
    for bits in BITS:
        out[bits] = {}
        for norms in NORMS:
            e = decode(x, bits, norms) - x
            d = p[..., old] @ e
            rel = mx.sqrt(mx.sum(d * d, axis=(2, 3)) / mx.maximum(mx.sum(o * o, axis=(2, 3)), 1e-30))
            out[bits][norms] = (float(mx.max(rel)), float(mx.mean(mx.sum(e * e, -1) / mx.sum(x * x, -1))))
    return out


def run_model(key: str, context: int) -> dict:
    from tests.support import real_models

    label, loader, _ = MODELS[key]
    model, tok = getattr(real_models, loader)(mx.float32)
    captured, scale = quality.capture_qkv(model, quality.text_ids(tok, context))
    layers = []
    for i, (q, k, v) in enumerate(captured):
        e = layer_errors(*(a.astype(mx.float32) for a in (q, k, v)), scale)
        layers.append(e)
        print(f"  layer {i:2d}: " + "; ".join(f"V{b} " + " / ".join(f"{e[b][n][0]:.4f}" for n in NORMS) for b in BITS),
              flush=True)
    summary = {}
    for b in BITS:
        summary[str(b)] = {n: {"median": float(np.median([e[b][n][0] for e in layers])),
                               "mean": float(np.mean([e[b][n][0] for e in layers])),
                               "mse": float(np.mean([e[b][n][1] for e in layers]))} for n in NORMS}
        summary[str(b)]["layers_corrected_lowest"] = sum(
            e[b]["corrected"][0] <= min(e[b][n][0] for n in NORMS) for e in layers)
    for b in BITS:
        m = summary[str(b)]
        print(f"  V{b}: median " + " / ".join(f"{m[n]['median']:.4f}" for n in NORMS) + ", MSE per vector "
              + " / ".join(f"{m[n]['mse']:.5f}" for n in NORMS)
              + f"; corrected lowest in {m['layers_corrected_lowest']} of {len(layers)} layers")
    return {"model": label, "context": context, "layers": len(layers), "bits": summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="qwen05,qwen15,smollm2", help=f"comma list of {','.join(MODELS)}")
    ap.add_argument("--context", type=int, default=2048, help="prefix tokens")
    ap.add_argument("--out", default=str(RESULTS), help="results folder")
    args = ap.parse_args()
    print("V3 / V4 output error with plain / corrected / least-squares norms, per layer")
    results = common.per_model(args.models, MODELS, lambda key: run_model(key, args.context))
    common.write_probe(results, args.out, "norm_correction")


if __name__ == "__main__":
    main()
