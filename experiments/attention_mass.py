"""Where attention falls on the coded tokens: would keeping a few "heavy hitter" tokens in float help?

A cache with a float window and sinks codes the tokens between them. Score errors on a coded token move the
output in proportion to the attention it draws, so if a few coded tokens drew most of it, keeping them in float
(as H2O-style caches do) would remove most of the error for a few bytes. This script measures, per attention
layer, for the last 512 queries of a --context-token text (float cache, fed in 512-token chunks as
long_context.py feeds it):

* coded: the share of their attention on the tokens the default cache holds as codes for them
  ([sinks, context - 512 - window): the window's tokens and the chunk itself are float);
* top32 / top128: the share of that coded attention on the 32 / 128 coded tokens that draw the most of it on
  average over the queries (per kv head: what one set of kept tokens could catch, chosen with hindsight);
* per-query top32: the same with the best 32 tokens chosen for each query apart (an upper bound no cache reaches).

    python experiments/attention_mass.py --models qwen05 --texts britannica --context 8192
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

import long_context  # noqa: E402
import long_context_settings as lc_settings  # noqa: E402


RESULTS = Path(__file__).resolve().parent / "results"  # experiments/results/, beside the probes
GEOMETRY = lc_settings.DEFAULT_1204.config  # the default's sinks and 768-token window, as its results were measured

CHUNK = 512
TOPS = (32, 128)


def coded_mass(q: mx.array, k: mx.array, scale: float, lo: int, hi: int) -> dict:
    """The attention shares above for queries q (1, Hq, L, D), the last L positions of keys k (1, H, T, D)."""
    _, Hq, L, _ = q.shape
    H, T = k.shape[1], k.shape[2]
    s = (q * scale) @ mx.repeat(k, Hq // H, axis=1).swapaxes(-1, -2)
    causal = mx.arange(T)[None] <= mx.arange(T - L, T)[:, None]
    p = mx.softmax(mx.where(causal, s, -mx.inf), axis=-1)[0]  # (Hq, L, T)
    coded = p[:, :, lo:hi]
    total = coded.sum(-1)  # (Hq, L)
    per_kv = coded.mean(1).reshape(H, Hq // H, -1).mean(1)  # (H, hi - lo): mean attention per coded token
    ranked = mx.sort(per_kv, axis=-1)[:, ::-1]
    row = {"coded": total.mean().item()}
    for n in TOPS:
        row[f"top{n}"] = (ranked[:, :n].sum(-1) / per_kv.sum(-1)).mean().item()
    best = mx.sort(coded, axis=-1)[:, :, ::-1][:, :, :TOPS[0]].sum(-1)
    row[f"per_query_top{TOPS[0]}"] = (best / mx.maximum(total, 1e-12)).mean().item()
    return row


def run(key: str, text: str, context: int) -> dict:
    from tests.support import real_models

    label, loader, _ = lc_settings.MODELS[key]
    model, tok = getattr(real_models, loader)(mx.float32)
    ids = long_context.text_ids(tok, text, context)
    d = GEOMETRY
    lo, hi = d.sinks, context - CHUNK - d.window
    layers: list[dict] = []
    measuring = [False]

    def spy(attend, queries, keys, values, cache, scale, mask, sinks):
        if measuring[0]:
            layers.append(coded_mass(queries.astype(mx.float32), keys.astype(mx.float32), scale, lo, hi))
        return attend(queries, keys, values, cache, scale, mask, sinks)

    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    with common.attention_spy(model, spy):
        for a in range(0, context, CHUNK):
            measuring[0] = a == context - CHUNK
            model(mx.array(ids[a:a + CHUNK])[None], cache=cache)
            mx.eval([c.state for c in cache])
    mean = {name: float(np.mean([r[name] for r in layers])) for name in layers[0]}
    return {"model": label, "text": text, "context": context, "coded_tokens": [lo, hi], "layers": layers,
            "mean": mean}


def main() -> None:
    from tests.support.texts import TEXTS

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="qwen05,smollm2", help=f"comma list of {','.join(lc_settings.MODELS)}")
    ap.add_argument("--texts", default="britannica", help=f"comma list of {','.join(TEXTS)}")
    ap.add_argument("--context", type=int, default=8192, help=f"tokens (a multiple of {CHUNK})")
    ap.add_argument("--out", default=str(RESULTS), help="results folder")
    args = ap.parse_args()
    texts = long_context.text_names(args.texts)
    d = GEOMETRY
    if args.context % CHUNK or args.context <= CHUNK + d.window + d.sinks:
        raise SystemExit(f"--context must be a multiple of {CHUNK} above {CHUNK + d.window + d.sinks}, "
                         f"got {args.context}")
    t0 = time.perf_counter()
    runs = []
    for key in args.models.split(","):
        for text in texts:
            r = run(key, text, args.context)
            runs.append(r)
            for i, row in enumerate(r["layers"]):
                print(f"  {r['model']} {text} layer {i:2d}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()),
                      flush=True)
    headers = ["model", "text", "coded", *(f"top{n} of coded" for n in TOPS), f"per-query top{TOPS[0]}"]
    rows = [[r["model"], r["text"], *(f"{r['mean'][k]:.3f}" for k in r["mean"])] for r in runs]
    results = {"meta": common.metadata(), "runs": runs, "seconds": round(time.perf_counter() - t0, 1)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_mass.json").write_text(json.dumps(results, indent=1))
    print(f"\nattention of the last {CHUNK} queries at {args.context} tokens, mean over layers\n\n"
          + common.markdown_table(headers, rows))
    print(f"\nwrote {out / 'attention_mass.json'} ({results['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
