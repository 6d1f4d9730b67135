"""Whether key protection still tests what the codes see: per attention layer, `bias_outlier_factor` (how much a
query along the keys' mean reads their coding error, against keys that vary evenly; the cache protects a layer
whose calibration keys exceed protect_factor) on the calibration keys four ways:

* raw: as the cache tests them today, the keys as the model makes them (after RoPE), less their plain mean;
* before RoPE: the keys turned back by their RoPE, less μ0: the frame the default takes the mean in, where the
  k_proj bias is one direction for every position, so the test reads the keys' spread along the bias itself;
* centered: as the default codes them, less R(p) μ0 (the mean before RoPE, turned to each position);
* weighed: centered, times the query weights (what the quantizer is handed).

The question it answers: the factor that makes Qwen2.5-Coder-0.5B's layer 0 and Qwen2.5-Coder-1.5B's layer 1
protect themselves at 8 bits is their k_proj bias, which centering before RoPE takes out before coding; on the keys
as coded, is any layer still an outlier? Found: no layer of the three models reaches 5 once centered (both
protected layers fall near 1) or before RoPE (along the bias itself), so the protection spends 8-bit keys on an
offset the codes never hold; without it those layers take the widths their output error asks (benchmarks/DEFAULTS.md, protect_factor: about a standard
error more KL for 0.06-0.09 fewer bits/value at 8k).

The default cache is run over the first --context tokens of Britannica (fed 512 at a time) so each key stream has
its centering and weights; the calibration keys are the first window after the 4 sinks. The largest factor over
kv heads per layer. Not a quality figure (long_context.py is: the `np` settings).

    python experiments/protection_factor.py --models qwen05,qwen15,smollm2 --context 1536
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# the probes beside this one, then the benchmarks' modules they measure with
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "benchmarks")]

import common  # noqa: E402  (puts the repo on sys.path)
import mlx.core as mx  # noqa: E402

import quality  # noqa: E402
import tq_mlx  # noqa: E402
from key_error import MODELS  # noqa: E402
from tq_mlx import TurboQuantConfig  # noqa: E402
from tq_mlx.models.rope import rotate  # noqa: E402
from tq_mlx.stream.calibration import bias_outlier_factor, calibration_mean  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
WAYS = ("raw", "before_rope", "centered", "weighed")


def factor(x: mx.array) -> float:
    return float(mx.max(bias_outlier_factor(x, calibration_mean(x))))


def run_model(key: str, context: int) -> dict:
    from tests.support import real_models

    label, loader, _ = MODELS[key]
    model, tok = getattr(real_models, loader)(mx.float32)
    ids = quality.text_ids(tok, context)
    captured, _ = quality.capture_qkv(model, ids)
    config = TurboQuantConfig()
    cache = tq_mlx.make_prompt_cache(model, config)
    for start in range(0, len(ids), 512):
        model(mx.array(ids[start:start + 512])[None], cache=cache)
        mx.eval([c.state for c in cache])
    layers = []
    first, n = config.sinks, config.first_window
    for i, ((_, k, _), c) in enumerate(zip(captured, cache)):
        s = c.key_stream
        calib = k.astype(mx.float32)[:, :, first:first + n]
        centered, _ = s._quantizer_input(calib, first, s.mean, None)
        weighed, _ = s._quantizer_input(calib, first, s.mean, s.weights)
        before = calib if s.rope is None else rotate(calib, s.rope, first, inverse=True)
        row = {"layer": i, "raw": factor(calib), "before_rope": factor(before), "centered": factor(centered),
               "weighed": factor(weighed),
               "key_bits": c.key_bits, "protected": bool(c.protected)}
        layers.append(row)
        print(f"  layer {i:2d}: " + " / ".join(f"{row[w]:5.2f}" for w in WAYS)
              + f"  K{c.key_bits:g}{' protected' if c.protected else ''}", flush=True)
    limit = config.protect_factor
    found = {"model": label, "context": context, "protect_factor": limit, "layers": layers,
             **{f"over_{w}": [r["layer"] for r in layers if r[w] > limit] for w in WAYS},
             **{f"max_{w}": max(r[w] for r in layers) for w in WAYS}}
    print(f"  over protect_factor {limit:g}: "
          + "; ".join(f"{w} {found[f'over_{w}'] or 'none'} (largest {found[f'max_{w}']:.2f})" for w in WAYS))
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="qwen05,qwen15,smollm2", help=f"comma list of {','.join(MODELS)}")
    ap.add_argument("--context", type=int, default=1536, help="prefix tokens (at least the first window and a block)")
    ap.add_argument("--out", default=str(RESULTS), help="results folder")
    args = ap.parse_args()
    print("bias_outlier_factor raw / before RoPE / centered / weighed, per layer")
    results = common.per_model(args.models, MODELS, lambda key: run_model(key, args.context))
    common.write_probe(results, args.out, "protection_factor")


if __name__ == "__main__":
    main()
