"""Does the cache's KL depend on the model's dtype? Every quality table here runs the weights in float32 (float16
matmuls bypass BLAS on this CPU), while a Mac runs the model in float16 or bfloat16: the float cache it is compared
with, the sinks and the window then hold float16 and the queries arrive in float16. This runs the same cell
(long_context.py's pass: the last 512 tokens of a context, fed 512 at a time) with the weights in each dtype, each
setting against the float cache in that dtype (and, when float32 is among the dtypes, against float32's float cache
too: the float cache in float16 or bfloat16 rounds on its own), and writes each one's KL and ΔPPL. A run keeps the
cells of the file it writes that it does not run again (each cell names the command that ran it).

    python experiments/model_dtype.py --models qwen05 --texts britannica --context 2048 --dtypes float32,float16

float16 arithmetic is emulated on this CPU: a 2k cell of Qwen2.5-Coder-0.5B takes about 10 minutes a pass here.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "benchmarks")]

import common  # noqa: E402  (puts the repo on sys.path)
import long_context as lc  # noqa: E402
import mlx.core as mx  # noqa: E402
from long_context_settings import parse_setting  # noqa: E402

from tests.support import real_models  # noqa: E402

DTYPES = ("float32", "float16", "bfloat16")


def kl(ref: mx.array, lp: mx.array) -> tuple[float, float]:
    """Mean KL(ref ‖ lp) over the scored tokens, and its standard error."""
    per_token = lc.token_kl(ref, lp)
    return per_token.mean().item(), mx.std(per_token).item() / math.sqrt(per_token.size)


FLOAT_ATTENTION32 = "float, its attention in float32"


@contextlib.contextmanager
def attention_in_float32():
    """mlx-lm's float attention computed in float32 and its output cast back: what a Mac's SDPA kernels do inside
    (float accumulators), where this CPU's float16/bfloat16 SDPA rounds the scores to the model's dtype."""
    sdpa = mx.fast.scaled_dot_product_attention

    def upcast(q, k, v, *, scale, mask=None, **kw):
        mask = mask.astype(mx.float32) if isinstance(mask, mx.array) and mx.issubdtype(mask.dtype, mx.floating) else mask
        return sdpa(q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32), scale=scale, mask=mask,
                    **kw).astype(q.dtype)

    mx.fast.scaled_dot_product_attention = upcast
    try:
        yield
    finally:
        mx.fast.scaled_dot_product_attention = sdpa


def run(key: str, text: str, context: int, dtype: str, settings: list[str], f32: mx.array | None) -> tuple[dict, mx.array]:
    """One cell in one dtype: the float pass and each setting's, each scored against the float pass in this dtype
    (kl), against float32's float pass (kl_f32, when f32 holds its log-probs: the cache's error told from the
    rounding of the float cache it is compared with) and, in float16 and bfloat16, against the float pass whose
    attention runs in float32 (kl_attention32: the float cache as a Mac's kernels compute it). Returns the rows and
    this float pass's log-probs."""
    _, loader, path_fn = lc.MODELS[key]
    model, tok = getattr(real_models, loader)(getattr(mx, dtype))
    lc._MODEL_CONFIG[0] = lc.load_model_config(getattr(real_models, path_fn)())
    ids = lc.text_ids(tok, text, context + 1)
    out, base, attn32 = {}, None, None
    names = ("float", *((FLOAT_ATTENTION32,) if dtype != "float32" else ()), *settings)
    for name in names:
        t = time.perf_counter()
        setting = lc.FLOAT if name in ("float", FLOAT_ATTENTION32) else parse_setting(name)
        with attention_in_float32() if name == FLOAT_ATTENTION32 else contextlib.nullcontext():
            r, lps = lc.run_pass(model, lc.make_cache(model, setting), ids, [context], 512, 512, None)
        cell, lp = r[context], lps[context]
        base = lp if base is None else base
        attn32 = lp if name == FLOAT_ATTENTION32 else attn32
        cell["kl"], cell["kl_se"] = kl(base, lp)
        cell["ppl_delta_pct"] = 100 * (cell["ppl"] / out["float"]["ppl"] - 1) if out else 0.0
        if f32 is not None:
            cell["kl_f32"], cell["kl_f32_se"] = kl(f32, lp)
        if attn32 is not None and name != FLOAT_ATTENTION32:
            cell["kl_attention32"], cell["kl_attention32_se"] = kl(attn32, lp)
        cell["seconds"] = round(time.perf_counter() - t, 1)
        out[name] = cell
        print(f"  {key} {text} {context} {dtype} {name}: KL {cell['kl']:.5f} ± {cell['kl_se']:.5f}"
              + (f", against float32's float {cell['kl_f32']:.5f}" if f32 is not None else "")
              + (f", against the float pass with float32 attention {cell['kl_attention32']:.5f}"
                 if "kl_attention32" in cell else "")
              + f", ΔPPL {cell['ppl_delta_pct']:+.2f}% ({cell['seconds']} s)", flush=True)
    return out, base


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen05", help="comma list of smollm2,qwen05,qwen15")
    ap.add_argument("--texts", type=lc.text_names, default="britannica", help="comma list of long_context.py's texts")
    ap.add_argument("--context", type=int, default=2048, help="tokens of context; the last 512 are scored")
    ap.add_argument("--dtypes", default="float32,float16", help=f"comma list of {','.join(DTYPES)}")
    ap.add_argument("--settings", default="default", help="comma list of long_context.py settings")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "model_dtype.json")
    args = ap.parse_args(argv)
    dtypes = args.dtypes.split(",")
    if bad := [d for d in dtypes if d not in DTYPES]:
        raise SystemExit(f"--dtypes takes {', '.join(DTYPES)}; got {', '.join(bad)}")
    dtypes.sort(key=DTYPES.index)  # float32 first: the others are scored against its float pass too
    settings = args.settings.split(",")
    results = {"meta": common.metadata(), "cells": []}
    cell_key = lambda c: (c["model"], c["text"], c["context"], c["dtype"])  # noqa: E731
    for key in args.models.split(","):
        for text in args.texts:
            f32 = None
            for dtype in dtypes:
                rows, base = run(key, text, args.context, dtype, settings, f32)
                f32 = base if dtype == "float32" else f32
                results["cells"].append({"model": key, "text": text, "context": args.context, "dtype": dtype,
                                         "command": results["meta"]["command"], "rows": rows})
                common.write_cells(args.out, results, cell_key)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
