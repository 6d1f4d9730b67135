"""Whether trellis codes would buy the bits issue 53's goals need: per attention layer, the relative error of the
attention outputs that values (and keys) coded at 3 and 4 bits give, Lloyd-Max codes (the cache's) against
bitshift-trellis codes of the same bits.

The cache codes each coordinate of a rotated unit vector on its own (Lloyd-Max), which at 3 bits leaves its mean
squared error 3.4 dB above the rate-distortion bound of a Gaussian source (0.0345 against 2^-6): about half a bit
a value that scalar codes cannot reach. Trellis codes (tq_mlx.quant.trellis, the construction of QTIP, Tseng et al.,
arXiv 2406.11235) keep the same b-bit symbol per coordinate and the same packing, but decode coordinate i from a
window of the last L/b symbols through a 2^L-entry codebook trained on Gaussian vectors, never on the model's; both
codes here come from the cache's quantizer (TurboQuantMSE, trellis or not), norms corrected as the cache's are.

Measured per layer on the first --context tokens of Britannica: queries are the last 256, reading the tokens past
the first 4 and before their 128-token window (the cache's sinks and window), each side coded alone (the other
float): for values the largest relative error of the queries' outputs over kv heads; for keys, what the
default's key streams code (centered before RoPE and weighed by the queries), the largest relative MSE over kv
heads. Not a quality figure: benchmarks/long_context.py measures caches of trellis codes (setting letter tc).

    python experiments/trellis_codes.py --models qwen05,qwen15,smollm2 --context 1536 --layer-step 3
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# the probes beside this one, then the benchmarks' modules they measure with
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "benchmarks")]

import common  # noqa: E402  (puts the repo on sys.path)
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import quality  # noqa: E402
import tq_mlx  # noqa: E402
from key_error import MODELS  # noqa: E402
from tq_mlx import TurboQuantConfig  # noqa: E402
from tq_mlx.quant.codebook import lloyd_max  # noqa: E402
from tq_mlx.quant.quantizer import TurboQuantMSE  # noqa: E402
from tq_mlx.quant.trellis import TRAINING, WINDOW_BITS  # noqa: E402
from value_widths import attention  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BITS = (3, 4)
CODES = ("lloyd_max", "lloyd_max_half", "trellis")  # the cache's codes at b, at b + 0.5 (its channel split), trellis
QUERIES, SINKS, WINDOW = 256, 4, 128


def sphere_mse(vectors: int = 512, dim: int = 128, seed: int = 1) -> dict:
    """Per bits: the MSE a coordinate of held-out random unit vectors (scaled by √dim) takes, the cache's Lloyd-Max
    codes against trellis codes (norms not corrected: the codes alone), and the rate-distortion bound of a Gaussian
    source, 2^-2b."""
    g = np.random.default_rng(seed).standard_normal((vectors, dim))
    x = mx.array((g / np.linalg.norm(g, axis=1, keepdims=True)).astype(np.float32))
    out = {}
    for b in BITS:
        q = TurboQuantMSE(dim, b, seed=1, norm_dtype=mx.float32, trellis=True)
        out[str(b)] = {"lloyd_max": float(lloyd_max(dim, b).mse),
                       "trellis": float(mx.mean(mx.square(q.dequantize(q.quantize(x)) - x))) * dim,
                       "bound": 2.0 ** (-2 * b)}
    return out


def coded(x: mx.array, code: str, bits: int) -> mx.array:
    """x (…, d) coded and decoded, its norm corrected, by a quantizer of the cache: Lloyd-Max codes at b or b + 0.5
    (its channel split), or trellis codes (tq_mlx.quant.trellis)."""
    q = TurboQuantMSE(x.shape[-1], bits + (0.5 if code == "lloyd_max_half" else 0), seed=1, norm_dtype=mx.float32,
                      correct_norms=True, trellis=code == "trellis")
    return q.dequantize(q.quantize(x))


def layer_errors(q: mx.array, k: mx.array, v: mx.array, scale: float, stream) -> dict:
    """{side: {bits: {code: (error, the mean relative MSE per vector)}}}, coding the tokens past the sinks and
    before the queries' window: values, the largest relative attention-output error over kv heads (keys float);
    keys, what the cache's key stream codes (centered before RoPE and weighed by the queries, from `stream`),
    the error its relative MSE (the largest over kv heads)."""
    N = q.shape[2]
    queries = slice(N - QUERIES, N)
    p, o = attention(q, k, v, scale, queries)
    old = slice(SINKS, N - QUERIES - WINDOW)
    keys, mean = stream._quantizer_input(k[:, :, old], old.start, stream.mean, stream.weights)
    keys = keys if mean is None else keys - mean  # a stream without RoPE subtracts its mean as it encodes
    out = {"values": {}, "keys": {}}
    for side, x in (("values", v[:, :, old]), ("keys", keys)):
        for b in BITS:
            out[side][b] = {}
            for code in CODES:
                e = coded(x, code, b) - x
                mse = mx.sum(e * e, -1) / mx.maximum(mx.sum(x * x, -1), 1e-30)
                if side == "values":
                    d = p[..., old] @ e
                    err = mx.max(mx.sqrt(mx.sum(d * d, axis=(2, 3)) / mx.maximum(mx.sum(o * o, axis=(2, 3)), 1e-30)))
                else:
                    err = mx.max(mx.mean(mse, axis=-1))
                out[side][b][code] = (float(err), float(mx.mean(mse)))
    return out


def run_model(key: str, context: int, step: int) -> dict:
    from tests.support import real_models

    label, loader, _ = MODELS[key]
    model, tok = getattr(real_models, loader)(mx.float32)
    ids = quality.text_ids(tok, context)
    captured, scale = quality.capture_qkv(model, ids)
    cache = tq_mlx.make_prompt_cache(model, TurboQuantConfig())  # the default's key streams: their mean and weights
    for start in range(0, len(ids), 512):
        model(mx.array(ids[start:start + 512])[None], cache=cache)
        mx.eval([c.state for c in cache])
    layers = []
    for i, ((q, k, v), c) in enumerate(zip(captured, cache)):
        if i % step:
            continue
        if c.key_stream.mean is None and c.key_stream.weights is None:
            raise SystemExit(f"layer {i}: its key stream has not calibrated (is --context past the first "
                             f"compression?)")
        e = layer_errors(*(a.astype(mx.float32) for a in (q, k, v)), scale, c.key_stream)
        layers.append(e)
        print(f"  layer {i:2d}: " + "; ".join(
            f"{side[0].upper()}{b} " + " / ".join(f"{e[side][b][c][0]:.4f}" for c in CODES)
            for side in ("values", "keys") for b in BITS), flush=True)
    summary = {}
    for side in ("values", "keys"):
        summary[side] = {}
        for b in BITS:
            m = {c: {"median": float(np.median([e[side][b][c][0] for e in layers])),
                     "mse": float(np.mean([e[side][b][c][1] for e in layers]))} for c in CODES}
            m["layers_trellis_below_half"] = sum(e[side][b]["trellis"][0] < e[side][b]["lloyd_max_half"][0]
                                                 for e in layers)
            summary[side][str(b)] = m
            print(f"  {side} {b} bits: median error " + " / ".join(f"{m[c]['median']:.4f}" for c in CODES)
                  + ", MSE " + " / ".join(f"{m[c]['mse']:.5f}" for c in CODES)
                  + f"; trellis under {b + 0.5:g}-bit Lloyd-Max in {m['layers_trellis_below_half']} of "
                    f"{len(layers)} layers", flush=True)
    return {"model": label, "context": context, "layers": len(layers), "layer_step": step, "summary": summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="qwen05,qwen15,smollm2", help=f"comma list of {','.join(MODELS)}")
    ap.add_argument("--context", type=int, default=1536,
                    help="prefix tokens (past the default's first compression, with tokens older than the window)")
    ap.add_argument("--layer-step", type=int, default=1, help="measure every n-th layer from layer 0")
    ap.add_argument("--out", default=str(RESULTS), help="results folder")
    args = ap.parse_args()
    d = TurboQuantConfig()
    least = max(SINKS + WINDOW + QUERIES, d.sinks + d.calibration_tokens) + 1
    if args.context < least:
        raise SystemExit(f"--context must be at least {least} (the default's key streams calibrate on their first "
                         f"{d.calibration_tokens} tokens, and some tokens must be older than the window), got "
                         f"{args.context}")
    if args.layer_step < 1:
        raise SystemExit(f"--layer-step must be at least 1, got {args.layer_step}")
    t0 = time.perf_counter()
    gauss = sphere_mse()
    print(f"MSE on random unit vectors ({time.perf_counter() - t0:.0f} s), Lloyd-Max / trellis / bound: "
          + "; ".join(f"{b} bits {g['lloyd_max']:.5f} / {g['trellis']:.5f} / {g['bound']:.5f}"
                      for b, g in gauss.items()))
    print("values' output error, keys' MSE: Lloyd-Max b / Lloyd-Max b+0.5 / trellis b, per layer")
    results = common.per_model(args.models, MODELS, lambda key: run_model(key, args.context, args.layer_step))
    results.update(window_bits={str(b): WINDOW_BITS[b] for b in BITS}, training=TRAINING, sphere=gauss)
    common.write_probe(results, args.out, "trellis_codes")


if __name__ == "__main__":
    main()
