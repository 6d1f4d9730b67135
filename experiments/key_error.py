"""Why a model's keys are hard to code: the score error of TurboQuant keys under three ways to center them.

The cache subtracts one key mean μ per (batch, kv head), taken after RoPE from its first compressed tokens. A
model whose keys carry a large constant part before RoPE (Qwen2.5's k_proj bias) sees that part rotate with the
position after RoPE, so one μ leaves most of it in the vectors and the codes spend their bits on it. This script
measures, per attention layer, the RMS error of the attention scores q·k with keys coded at --bits, relative to
the spread of the exact scores over the keys (the same measure for every model), for:

* global: one μ after RoPE over the calibration tokens (what the cache does);
* block: one μ per block of 128 tokens (what per-block means would store: D float16 per block and head);
* rope: one μ0 before RoPE, subtracted as RoPE_p(μ0) at each position p (no storage; attention would add
  q·RoPE_p(μ0) back per token);
* weighted: rope, and the keys coded times the cache's query weights (tq_mlx.stream.calibration.query_weights, from the
  queries at the calibration positions), the query divided by them;
* matrix: rope, and the keys coded times a full matrix A per kv head instead of per-channel weights, the query
  times A⁻ᵀ (scores exact): A = M^(1/4) with M = Σk^(-1/2) (Σk^(1/2) Σq Σk^(1/2))^(1/2) Σk^(-1/2) from the
  calibration queries' and keys' second moments. M minimizes E(score error²) (the matrix form of w² ∝ rms(q)/rms(k))
  and M^(1/4) takes half its exponent, as the weights do. Not in the cache: it says what a full matrix would add.
* allocated: weighted, and the bits allocated by energy instead of spread evenly by one rotation: the RoPE pairs
  ranked by their weighted keys' energy in the calibration tokens, the top quarter coded at bits + 1, the middle
  half at bits, the rest at bits - 1 (the same code bits per vector), each group with its own rotation and
  norm (two more norms per token). Not in the cache: it says what transform coding's bit allocation would add.

Queries are the last 256 of a --context-token Britannica prefix, keys all of it; calibration tokens are the
cache's (the window after 4 sinks). Not a quality figure: it says which centering a model's keys call for.

    python experiments/key_error.py --models qwen05,smollm2 --context 4096 --bits 3,4
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

import quality  # noqa: E402
from tq_mlx import TurboQuantConfig  # noqa: E402
from tq_mlx.models.architectures import load_model_config  # noqa: E402
from tq_mlx.quant.codebook import lloyd_max  # noqa: E402
from tq_mlx.quant.quantizer import TurboQuantMSE  # noqa: E402
from tq_mlx.quant.rotation import Rotation  # noqa: E402
from tq_mlx.models.rope import probe  # noqa: E402
from tq_mlx.stream.calibration import query_weights  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"  # experiments/results/, beside the probes

MODELS = {
    "smollm2": ("SmolLM2-135M-Instruct", "load_smollm2", "smollm2_path"),
    "qwen05": ("Qwen2.5-Coder-0.5B-Instruct", "load_qwen25_coder_05b", "qwen25_coder_05b_path"),
    "qwen15": ("Qwen2.5-Coder-1.5B-Instruct", "load_qwen25_coder_15b", "qwen25_coder_15b_path"),
}
QUERIES = 256
BLOCK = 128
CENTERINGS = ("global", "block", "rope", "weighted", "matrix", "allocated")


def rope_rotate(x: mx.array, base: float, inverse: bool = False) -> mx.array:
    """mlx's non-traditional RoPE (pairs i and i + D/2) at positions 0..n-1 of x (B, H, n, D), or its inverse."""
    D = x.shape[-1]
    half = D // 2
    freqs = base ** (-np.arange(half) * 2.0 / D)
    angle = np.arange(x.shape[2])[:, None] * freqs[None]
    cos, sin = mx.array(np.cos(angle), mx.float32), mx.array(np.sin(angle) * (-1 if inverse else 1), mx.float32)
    a, b = x[..., :half], x[..., half:]
    return mx.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def relative_error(q: mx.array, k: mx.array, k_hat: mx.array) -> float:
    s, s_hat = q @ k.swapaxes(-1, -2), q @ k_hat.swapaxes(-1, -2)
    spread = mx.sqrt(mx.mean((s - mx.mean(s, axis=-1, keepdims=True)) ** 2))
    return float(mx.sqrt(mx.mean((s - s_hat) ** 2)) / spread)


def centered_means(k: mx.array, how: str, calib: slice, base: float) -> mx.array:
    """The mean subtracted from every key (B, H, n, D) under `how`."""
    if how == "global":
        return mx.broadcast_to(mx.mean(k[:, :, calib], axis=2, keepdims=True), k.shape)
    if how == "block":
        B, H, n, D = k.shape
        blocks = k.reshape(B, H, n // BLOCK, BLOCK, D)
        return mx.broadcast_to(mx.mean(blocks, axis=3, keepdims=True), blocks.shape).reshape(k.shape)
    if how in ("weighted", "matrix", "allocated"):
        how = "rope"
    mu0 = mx.mean(rope_rotate(k, base, inverse=True)[:, :, calib], axis=2, keepdims=True)
    return rope_rotate(mx.broadcast_to(mu0, k.shape), base)


def _psd_power(s: np.ndarray, p: float) -> np.ndarray:
    e, v = np.linalg.eigh(s)
    return (v * np.maximum(e, 1e-9 * e.max()) ** p) @ v.T


def matrix_weights(s_q: np.ndarray, s_k: np.ndarray) -> np.ndarray:
    """A (D, D), symmetric with determinant 1, for keys coded as A·k and queries as A⁻ᵀ·q: M^(1/4) with M the
    minimizer of E(score error²) for queries and keys of second moments s_q and s_k (the docstring's formula)."""
    root, inv_root = _psd_power(s_k, 0.5), _psd_power(s_k, -0.5)
    a = _psd_power(inv_root @ _psd_power(root @ s_q @ root, 0.5) @ inv_root, 0.25)
    return a / np.exp(np.mean(np.log(np.linalg.eigvalsh(a))))


def group_code(x: mx.array, bits: int, seed: int) -> mx.array:
    """x (..., n) through TurboQuant_mse at any codebook width: norm (float16), rotation, Lloyd-Max, back."""
    cb = lloyd_max(x.shape[-1], bits)
    rot = Rotation(x.shape[-1], seed=seed)
    norm = mx.linalg.norm(x, axis=-1, keepdims=True)
    y = rot.forward(x / mx.maximum(norm, 1e-30))
    idx = mx.sum(y[..., None] > mx.array(cb.boundaries.astype(np.float32)), axis=-1)
    return rot.inverse(mx.take(mx.array(cb.centroids.astype(np.float32)), idx)) * norm.astype(mx.float16)


def allocated(x: mx.array, calib: slice, bits: int) -> mx.array:
    """x (B, H, n, D) coded in three groups of RoPE pairs (i, i + D/2) ranked by their energy in the calibration
    tokens: the top quarter at bits + 1, the middle half at bits, the rest at bits - 1."""
    B, H, _, D = x.shape
    half = D // 2
    e = np.array(mx.mean(x[:, :, calib] ** 2, axis=2))
    out = mx.zeros(x.shape)
    for b_ in range(B):
        for h in range(H):
            order = np.argsort(-(e[b_, h, :half] + e[b_, h, half:]))
            start = 0
            for g, (n, gb) in enumerate(((half // 4, bits + 1), (half // 2, bits), (half // 4, bits - 1))):
                pairs = order[start : start + n]
                start += n
                ch = mx.array(np.concatenate([pairs, pairs + half]).astype(np.int32))
                out[b_, h, :, ch] = group_code(mx.take(x[b_, h], ch, axis=-1), gb, seed=g)
    return out


def run_model(key: str, context: int, bits: list[float]) -> dict:
    from tests.support import real_models

    label, loader, path_fn = MODELS[key]
    mcfg = load_model_config(getattr(real_models, path_fn)())
    if mcfg.get("rope_scaling") or mcfg.get("partial_rotary_factor", 1) != 1:
        raise SystemExit(f"{label}: only plain RoPE over the whole head is modelled here")
    base = float(mcfg.get("rope_theta", 10000.0))
    model, tok = getattr(real_models, loader)(mx.float32)
    ids = quality.text_ids(tok, context)
    captured, scale = quality.capture_qkv(model, ids)
    d = TurboQuantConfig()
    calib = slice(d.sinks, d.sinks + d.first_window)
    layers = []
    # the calibration queries per kv head (B, H, R, n, D), and each layer's RoPE as the cache reads it
    q_all = [q.astype(mx.float32).reshape(q.shape[0], k.shape[1], -1, *q.shape[2:]) for q, k, _ in captured]
    ropes = [probe(model.model.layers[i].self_attn.rope, captured[i][1].shape[-1]) for i in range(len(captured))]
    for i, (q, k, _) in enumerate(captured):
        q = q.astype(mx.float32)[:, :, -QUERIES:] * scale
        k = k.astype(mx.float32)
        B, Hq, _, D = q.shape
        H = k.shape[1]
        q_calib = q_all[i][:, :, :, calib].reshape(B, H, -1, D)
        q = q.reshape(B, H, Hq // H * QUERIES, D)
        row = {"layer": i}
        for how in CENTERINGS:
            mean = centered_means(k, how, calib, base)
            w = mx.ones((1, 1, 1, D))
            if how in ("weighted", "allocated"):
                w = query_weights(mx.sum(q_calib * q_calib, axis=2), (k - mean)[:, :, calib], ropes[i])[:, :, None]
            a = a_inv = None
            if how == "matrix":
                qc, kc = np.array(q_calib), np.array((k - mean)[:, :, calib])
                am = np.stack([np.stack([matrix_weights(qc[b_, h].T @ qc[b_, h] / qc.shape[2],
                                                        kc[b_, h].T @ kc[b_, h] / kc.shape[2])
                                         for h in range(H)]) for b_ in range(B)])
                a, a_inv = mx.array(am.astype(np.float32)), mx.array(np.linalg.inv(am).astype(np.float32))
            row[f"norm_{how}"] = float(mx.mean(mx.linalg.norm(k - mean, axis=-1)))
            for b in bits:
                quant = TurboQuantMSE(D, b, seed=1)
                if how == "allocated":
                    k_hat = allocated((k - mean) * w, calib, int(b)) / w + mean
                elif a is None:
                    k_hat = quant.dequantize(quant.quantize((k - mean) * w)) / w + mean
                else:  # rows: A·k is (k)·Aᵀ = k·A (A symmetric), and back with A⁻¹
                    k_hat = quant.dequantize(quant.quantize((k - mean) @ a)) @ a_inv + mean
                row[f"{how}_{b:g}"] = relative_error(q, k, k_hat)
        layers.append(row)
        print(f"  layer {i:2d}: " + ", ".join(f"{how} {row[f'{how}_{bits[-1]:g}']:.3f}" for how in CENTERINGS),
              flush=True)
    mean_of = lambda name: float(np.mean([r[name] for r in layers]))  # noqa: E731
    summary = {f"{how}_{b:g}": mean_of(f"{how}_{b:g}") for how in CENTERINGS for b in bits}
    return {"model": label, "context": context, "rope_theta": base, "layers": layers, "mean": summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="qwen05,smollm2", help=f"comma list of {','.join(MODELS)}")
    ap.add_argument("--context", type=int, default=4096, help="prefix tokens (a multiple of 128)")
    ap.add_argument("--bits", default="3,4", help="key bits, comma list")
    ap.add_argument("--out", default=str(RESULTS), help="results folder")
    args = ap.parse_args()
    if args.context % BLOCK or args.context <= QUERIES:
        raise SystemExit(f"--context must be a multiple of {BLOCK} above {QUERIES}, got {args.context}")
    bits = [float(b) for b in args.bits.split(",")]
    if any(b != int(b) or not 2 <= b <= 7 for b in bits):
        raise SystemExit(f"--bits must be whole numbers from 2 to 7 (allocated codes use bits ± 1), got {args.bits}")
    t0 = time.perf_counter()
    results = {"meta": common.metadata(), "models": {}}
    for key in args.models.split(","):
        print(f"{MODELS[key][0]}:", flush=True)
        results["models"][key] = run_model(key, args.context, bits)
    results["seconds"] = round(time.perf_counter() - t0, 1)
    headers = ["model"] + [f"{how} K{b:g}" for b in bits for how in CENTERINGS]
    rows = [[m["model"]] + [f"{m['mean'][f'{how}_{b:g}']:.3f}" for b in bits for how in CENTERINGS]
            for m in results["models"].values()]
    table = common.markdown_table(headers, rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "key_error.json").write_text(json.dumps(results, indent=1))
    print("\nrelative score error, mean over layers (lower is better)\n\n" + table)
    print(f"\nwrote {out / 'key_error.json'} ({results['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
