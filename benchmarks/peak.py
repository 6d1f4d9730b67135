"""Peak MLX memory of a real prefill + decode, against what the planner predicts (tq_mlx.planner.memory.estimate_peak_bytes).

Each cell runs in its own process (MLX's peak counter and allocator cache start fresh): load the model in float32,
prefill `ctx` random tokens in `--step`-token chunks through mlx-lm's generate_step, decode 4 tokens, and read
mx.get_peak_memory(); beside it the planner's prediction from config.json alone. Float cache and TurboQuant's
default cache, side by side. `--quick` runs SmolLM2 at 512 tokens only (CI).

    python benchmarks/peak.py                       # SmolLM2-135M at 2k, 4k, 8k
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import common  # noqa: E402  (puts the repo on sys.path)

from tq_mlx import TurboQuantConfig
from tq_mlx.models.architectures import load_model_config
from tq_mlx.planner.display import format_bytes
from tq_mlx.planner.memory import estimate_peak_bytes

_CELL = r"""
import json, sys, time
import mlx.core as mx, numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as mlx_cache
import tq_mlx
from tq_mlx.integration import tune_malloc
from tests.support.real_models import load_converted
from pathlib import Path
tune_malloc()
path, kind, ctx, step = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
model, _ = load_converted(Path(path), mx.float32)
mx.eval(model.parameters())
weights = mx.get_active_memory()
ids = mx.array(np.random.default_rng(0).integers(100, 40000, ctx).tolist())
cache = tq_mlx.make_prompt_cache(model, tq_mlx.TurboQuantConfig()) if kind == "tq" else mlx_cache.make_prompt_cache(model)
mx.reset_peak_memory()
t = time.time()
for _ in generate_step(ids, model, prompt_cache=cache, max_tokens=4, prefill_step_size=step):
    pass
print(json.dumps(dict(weights=weights, kv=tq_mlx.cache.held_bytes(cache), peak=mx.get_peak_memory(),
                      seconds=time.time() - t)))
"""


def measure(path: Path, kind: str, ctx: int, step: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _CELL, str(path), kind, str(ctx), str(step)], capture_output=True,
                         text=True, cwd=common.REPO)
    if out.returncode:
        raise RuntimeError(f"{kind} at {ctx}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CI size: SmolLM2 at 512 tokens")
    ap.add_argument("--contexts", default=None, help="comma list (default 2048,4096,8192)")
    ap.add_argument("--step", type=int, default=None, help="prefill chunk (default 2048; quick 256)")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = ap.parse_args()
    contexts = [int(c) for c in (args.contexts or ("512" if args.quick else "2048,4096,8192")).split(",")]
    step = args.step or (256 if args.quick else 2048)
    from tests.support.real_models import smollm2_path

    path = smollm2_path()
    model_config = load_model_config(path)
    rows, table = [], []
    for ctx in contexts:
        for kind, config in (("float", None), ("tq", TurboQuantConfig())):
            m = measure(path, kind, ctx, step)
            predicted = estimate_peak_bytes(model_config, ctx, config, weights=m["weights"], prefill_step=step,
                                            dtype="float32")
            err = predicted / m["peak"] - 1
            rows.append(dict(model="SmolLM2-135M", cache=kind, ctx=ctx, step=step, **m, predicted=predicted,
                             error=err))
            table.append(["SmolLM2-135M", "float (mlx-lm KVCache)" if kind == "float" else "TurboQuant K4/V3",
                          f"{ctx:,}", format_bytes(m["kv"]), format_bytes(m["peak"]), format_bytes(predicted),
                          f"{100 * err:+.1f}%", format_bytes(m["peak"] - m["weights"] - m["kv"])])
            print(common.text_table(HEADERS, table[-1:]), flush=True)
    meta = common.metadata(step=step)
    notes = [
        "float32 weights (538 MB) on MLX's CPU back end; peak = mx.get_peak_memory() over the prefill and 4 "
        "decoded tokens, in a fresh process per cell.",
        "predicted = tq_mlx.planner.memory.estimate_peak_bytes from config.json and the weights' bytes: what `tq-chat "
        "--plan` shows. Its two constants (FLOAT_SCORE_COPIES, TQ_SCORE_TILES) were measured on this model; "
        "Qwen2.5-Coder-0.5B at 2k checked them (see docs/benchmarks.md).",
        "transient = peak - weights - KV: flat in the context for TurboQuant (tiles of scores), growing with it "
        "for the float cache (mx.fast.scaled_dot_product_attention materializes the scores on the CPU back end).",
    ]
    md = common.render("Peak memory: planned vs measured", meta, HEADERS, table, notes)
    print("\n" + common.text_table(HEADERS, table))
    jp, _ = common.write_results("peak-quick" if args.quick else "peak", {"meta": meta, "rows": rows}, md, args.out)
    print(f"wrote {jp}")


HEADERS = ["model", "cache", "context", "KV held", "peak measured", "peak planned", "planned error", "transient"]

if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"{time.time() - t0:.0f} s")
