"""Does the cache's quality depend on what its first window holds? Every layer decides its keys' widths, weights and
centre from the first window it compresses (calibration_tokens), and a real prompt can open with something unlike what
follows it (a system prompt, a code file before prose). This runs long_context.py's cell (the last 512 tokens of a
context, fed 512 at a time) on a body text whose opening tokens are replaced by another text's (the lead), each
setting against the float pass of those same tokens, and writes each one's KL, ΔPPL and the widths its layers took;
the lead "none" is the body alone. A run keeps the cells of the file it writes that it does not run again.

    python experiments/calibration_shift.py --models qwen05 --body britannica --leads none,code --context 8192

A setting whose calibration reads its first window (the default) set beside one that reads it less (fixed key
widths) tells the calibration's part from the lead's own: both see the same tokens.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "benchmarks")]

import common  # noqa: E402  (puts the repo on sys.path)
import long_context as lc  # noqa: E402
import mlx.core as mx  # noqa: E402
from long_context_settings import parse_setting  # noqa: E402

from tests.support import real_models  # noqa: E402

NONE = "none"


def context_ids(tok, body: str, lead: str, lead_tokens: int, context: int) -> list[int]:
    """The body's first context + 1 tokens, the first lead_tokens of them the lead text's (none: the body alone)."""
    ids = lc.text_ids(tok, body, context + 1)
    if lead == NONE:
        return ids
    return lc.text_ids(tok, lead, lead_tokens) + ids[lead_tokens:]


def run(key: str, body: str, lead: str, lead_tokens: int, context: int, settings: list[str]) -> dict:
    """One cell: the float pass over the led context, then each setting's, each scored against it."""
    _, loader, path_fn = lc.MODELS[key]
    model, tok = getattr(real_models, loader)(mx.float32)
    lc._MODEL_CONFIG[0] = lc.load_model_config(getattr(real_models, path_fn)())
    ids = context_ids(tok, body, lead, lead_tokens, context)
    out, base = {}, None
    for name in ("float", *settings):
        t = time.perf_counter()
        setting = lc.FLOAT if name == "float" else parse_setting(name)
        cache = lc.make_cache(model, setting)
        # the float pass returns its log-probs; each setting's pass scores itself against them (KL, its SEs)
        r, lps = lc.run_pass(model, cache, ids, [context], 512, 512, None if base is None else {context: base})
        cell = r[context]
        base = lps[context] if base is None else base
        cell["ppl_delta_pct"] = 100 * (cell["ppl"] / out["float"]["ppl"] - 1) if out else 0.0
        if name != "float":
            cell["widened"] = lc.widened_layers(cache)
        cell["seconds"] = round(time.perf_counter() - t, 1)
        out[name] = cell
        print(f"  {key} {body} led by {lead} ({lead_tokens if lead != NONE else 0} tokens) {context} {name}: "
              f"KL {cell['kl']:.5f} ± {cell['kl_se']:.5f}, ΔPPL {cell['ppl_delta_pct']:+.2f}% ({cell['seconds']} s)",
              flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen05", help="comma list of smollm2,qwen05,qwen15")
    ap.add_argument("--body", default="britannica", help="the text scored (one of long_context.py's texts)")
    ap.add_argument("--leads", default="none,code", help='comma list of long_context.py\'s texts, or "none"')
    ap.add_argument("--lead-tokens", type=int, default=1024,
                    help="tokens of the lead opening the context (more than calibration_tokens: it fills the first window)")
    ap.add_argument("--context", type=int, default=8192, help="tokens of context; the last 512 are scored")
    ap.add_argument("--settings", default="default", help="comma list of long_context.py settings")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "calibration_shift.json")
    args = ap.parse_args(argv)
    (body,) = lc.text_names(args.body)
    leads = args.leads.split(",")
    lc.text_names(",".join(x for x in leads if x != NONE) or body)  # an unknown lead is refused before any pass
    if not 0 < args.lead_tokens <= args.context - 512:
        raise SystemExit(f"--lead-tokens must be between 1 and the context less the 512 scored tokens "
                         f"({args.context - 512}), got {args.lead_tokens}")
    settings = args.settings.split(",")
    for s in settings:
        parse_setting(s)  # an unknown setting is refused before any pass
    results = {"meta": common.metadata(), "cells": []}
    cell_key = lambda c: (c["model"], c["body"], c["lead"], c["lead_tokens"], c["context"])  # noqa: E731
    for key in args.models.split(","):
        for lead in leads:
            rows = run(key, body, lead, args.lead_tokens, args.context, settings)
            results["cells"].append({"model": key, "body": body, "lead": lead,
                                     "lead_tokens": args.lead_tokens if lead != NONE else 0, "context": args.context,
                                     "command": results["meta"]["command"], "rows": rows})
            common.write_cells(args.out, results, cell_key)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
