"""What the stored norm's code costs keys: per attention layer, the attention-output error (the error
key_output_error chooses widths by, tq_mlx.stream.calibration.output_errors) of the calibration keys coded at each
width the layer may take, K3 to K6, with the norms in float16, in the 8-bit fine code (norm_steps 32) and in the
8-bit coarse code (norm_steps 16, every 8-bit cache before 2026-12-06), and the width each layer takes at the
default's target; then the spread of the scaled norms the cache stores (log2, every compressed token of every
layer), which the fine code's range (2^-3.47 .. 2^4.44) must hold.

A norm's error scales a key's whole logit q·k: on the queries that read a key most it is the norm's relative error
itself, where a code's error spreads over the key's directions. Codes of 6 bits or more keep float16 norms
(layout.WIDE_BITS), so the coarse code shows as K5's error sitting far above K6's. The default cache (keys weighed
and centered before RoPE) is fed the first --context tokens of a text 512 at a time; the errors are those the cache
measured at its first compression.

    python experiments/norm_code.py --models qwen05,qwen15,smollm2 --context 1536
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "benchmarks")]

import common  # noqa: E402  (puts the repo on sys.path)
import long_context as lc  # noqa: E402
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from tests.support import real_models  # noqa: E402
from tq_mlx import TurboQuantConfig, make_prompt_cache  # noqa: E402
from tq_mlx.stream import compressed  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CODES = {"float16": dict(norm_bits=16), "fine": dict(norm_bits=8, norm_steps=32),
         "coarse": dict(norm_bits=8, norm_steps=16)}


def layer_errors(model, ids: list[int], config: TurboQuantConfig) -> tuple[list[dict], list]:
    """Per attention layer whose keys chose their width by their output error: {"layer", "widths", "errors",
    "took"} as the cache's first compression measured them (the worst kv head's, as it decides); and the caches."""
    errors, measured = {}, []
    real_errors, real_width = compressed.output_errors, compressed.CompressedStream._output_width

    def recording(*a, **k):
        e = real_errors(*a, **k)
        measured.append(np.asarray(mx.max(e, axis=(0, 1))).tolist())
        return e

    def width(stream, *a, **k):
        w = real_width(stream, *a, **k)
        errors[id(stream)] = measured[-1]
        return w

    compressed.output_errors, compressed.CompressedStream._output_width = recording, width
    try:
        cache = make_prompt_cache(model, config)
        x = mx.array(ids)[None]
        for i in range(0, len(ids), 512):
            model(x[:, i:i + 512], cache=cache)
            mx.eval([c.state for c in cache])
    finally:
        compressed.output_errors, compressed.CompressedStream._output_width = real_errors, real_width
    rows = [{"layer": i, "widths": list(c.key_stream.widen.widths(config.key_bits)),
             "errors": errors[id(c.key_stream)], "took": c.key_bits}
            for i, c in enumerate(cache) if id(getattr(c, "key_stream", None)) in errors]
    return rows, cache


def summary(rows: list[dict]) -> dict:
    """The widths the layers took (how many at each, their mean), and each step's error ratio (K3/K4 .. K5/K6, the
    median over the layers: a code's error roughly halves a bit, so a norm error that floors K5 shows there)."""
    took = [r["took"] for r in rows]
    out = {"layers": len(rows), "mean_key_bits": float(np.mean(took)),
           **{f"K{b}": int(sum(t == b for t in took)) for b in sorted({w for r in rows for w in r["widths"]})}}
    for lo in (3, 4, 5):
        ratios = [r["errors"][r["widths"].index(lo)] / r["errors"][r["widths"].index(lo + 1)]
                  for r in rows if lo in r["widths"] and lo + 1 in r["widths"]]
        out[f"K{lo}_over_K{lo + 1}"] = float(np.median(ratios))
    return out


def norm_spread(cache) -> dict:
    """log2 of the fine code's stored norms over every compressed token: percentiles, per side."""
    out = {}
    for side in ("key_stream", "value_stream"):
        logs = []
        for c in cache:
            s = getattr(c, side, None)
            if s is None or s.codes is None or s.codes.norms.dtype != mx.int8:
                continue
            n = np.asarray(s.codes.norms[:, :, : s.n_fresh]).astype(np.float64).ravel()
            logs.append(n / 32 + 0.5)
        v = np.concatenate(logs)
        out[side.split("_")[0]] = {f"p{p:g}": float(np.percentile(v, p)) for p in (0, 0.01, 0.1, 50, 99.9, 99.99, 100)}
    return out


def run(key: str, text: str, context: int) -> dict:
    _, loader, path_fn = lc.MODELS[key]
    model, tok = getattr(real_models, loader)(mx.float32)
    ids = lc.text_ids(tok, text, context)[:context]
    cell = {"model": key, "text": text, "context": context, "codes": {}, "summary": {}}
    for name, fields in CODES.items():
        rows, cache = layer_errors(model, ids, TurboQuantConfig(**fields))
        cell["codes"][name] = rows
        cell["summary"][name] = summary(rows)
        print(f"  {key} {name}: {cell['summary'][name]}", flush=True)
        if name == "fine":
            cell["spread"] = norm_spread(cache)
            print(f"  {key} scaled norms (log2): {cell['spread']}", flush=True)
    return cell


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen05,qwen15,smollm2", help="comma list of smollm2,qwen05,qwen15")
    ap.add_argument("--text", default="britannica", help="one of long_context.py's texts")
    ap.add_argument("--context", type=int, default=1536, help="tokens fed (past the first window's 768 + 128)")
    ap.add_argument("--out", type=Path, default=RESULTS / "norm_code.json")
    args = ap.parse_args(argv)
    (text,) = lc.text_names(args.text)
    results = {"meta": common.metadata(), "cells": []}
    for key in args.models.split(","):
        results["cells"].append(run(key, text, args.context))
        common.write_cells(args.out, results, lambda c: (c["model"], c["text"], c["context"]))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
