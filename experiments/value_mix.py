"""What a value width per layer would do, measured before the cache chose one itself (value_error): the
default's keys (K4 widened by their error up to K6, one bit narrower past 6144), and values that past 6144 tokens
decay to V2, to V3 or not at all (V4), layer by layer, as given or as experiments/value_widths.py's first window
chose them for a value error target. The cache of each layer is the one its spelled-out setting builds
(long_context_settings), so this measures the widths whatever the cache would choose; KL and ΔPPL are against the
float log-probs long_context.py stored.

    python experiments/value_mix.py --model qwen05 --text britannica --context 16384 --v4 0,3,9,11,16,22
    python experiments/value_mix.py --model qwen05 --text britannica --context 16384 --from-window 0.05
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

import caches  # noqa: E402
import long_context as lc  # noqa: E402
import long_context_settings as lcs  # noqa: E402
from long_context_settings import LONG, MODELS, parse_setting  # noqa: E402
from tq_mlx.models.architectures import load_model_config  # noqa: E402
from tq_mlx.planner.memory import chosen_key_widths  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"  # experiments/results/, beside the probes

# the setting whose cache a layer takes, by the bits its values decay to past 6144 (4: they keep theirs)
BY_WIDTH = {4: "k4v4w768b128d6144k3v4n8rqe0.1", 3: "k4v4w768b128d6144k3v3n8rqe0.1", 2: "k4v4w768b128d6144k3v2n8rqe0.1"}


def layer_widths(n_layers: int, v4: list[int], v3: list[int]) -> list[int]:
    """Each attention layer's value decay width: 4 (none) for v4, 3 for v3, 2 for the rest."""
    if bad := [i for i in (*v4, *v3) if not 0 <= i < n_layers] or sorted(set(v4) & set(v3)):
        raise SystemExit(f"layers {bad}: each layer once, among 0..{n_layers - 1}")
    return [4 if i in v4 else 3 if i in v3 else 2 for i in range(n_layers)]


def mixed_cache(model, widths: list[int]) -> list:
    """The prompt cache whose layer i is the one BY_WIDTH[widths[i]]'s setting builds for it."""
    built = {w: caches.make_cache(model, parse_setting(BY_WIDTH[w])) for w in set(widths)}
    return [built[w][i] for i, w in enumerate(widths)]


def bits_at(model_config: dict, ctx: int, widths: list[int], cache: list) -> float:
    """Bits/value at ctx as long_context.py's table counts them (float parts in float16; † the layers whose keys
    protected themselves or widened in this pass): each layer's share of its own setting's figure (the keys' part
    is the same in every setting, the values' part uniform over layers)."""
    n_att, H, D = caches.kv_geometry(model_config)
    g = {"attention_layers": n_att, "kv_heads": H, "head_dim": D}
    chosen = {"protected_layers": lc.protected_layers(cache), "key_widths": lc.widened_layers(cache)}
    whole = {}  # each width's setting, as if every layer took it
    for w in set(widths):
        s = parse_setting(BY_WIDTH[w])
        whole[w] = lcs.bits_at(s, model_config, ctx) + lcs.protection_bits(
            {"texts": {"run": chosen}, "config": s.config.to_dict()}, g, ctx)
    return sum(whole[w] for w in widths) / n_att


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen05", choices=list(MODELS))
    ap.add_argument("--text", default="britannica")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--v4", default="", help="layers whose values keep 4 bits at every age, comma list")
    ap.add_argument("--v3", default="", help="layers whose values decay to 3 bits, comma list (the rest: 2)")
    ap.add_argument("--from-window", type=float, default=None,
                    help="widths value_widths.py's first window chose for this value error target (its json)")
    ap.add_argument("--out", default=str(RESULTS), help="results folder")
    args = ap.parse_args()
    from tests.support import real_models

    label, loader, path_fn = MODELS[args.model]
    mcfg = load_model_config(getattr(real_models, path_fn)())
    n_att = caches.kv_geometry(mcfg)[0]
    if args.from_window is not None:
        chosen = json.loads((RESULTS / "value_widths.json").read_text())["models"][args.model]["widths"]
        if f"{args.from_window:g}" not in chosen:
            raise SystemExit(f"value_widths.json has targets {', '.join(chosen)} for {args.model}, not {args.from_window:g}")
        widths = chosen[f"{args.from_window:g}"]
    else:
        nums = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
        widths = layer_widths(n_att, nums(args.v4), nums(args.v3))
    model, tok = getattr(real_models, loader)(mx.float32)
    lc._MODEL_CONFIG[0] = mcfg
    ids = lc.text_ids(tok, args.text, args.context + 1)
    ref = lc.FloatReference(args.model, args.text, ids, 512, 512)
    if not ref.has([args.context]):
        raise SystemExit(f"no float log-probs for {args.model} {args.text} at {args.context}: run long_context.py "
                         f"--models {args.model} --texts {args.text} --settings float at that context first")
    t0 = time.perf_counter()
    cache = mixed_cache(model, widths)
    # checkpointed as long_context.py's passes are (a pass to 32k outlasts a session here): the same command resumes
    mark = caches.Setting(f"value widths {widths} beside {BY_WIDTH[4]}", "mix")
    checkpoint = caches.Checkpoint(ref.partial(args.context, mark), caches.pass_code(mark))
    res, _ = lc.run_pass(model, cache, ids, [args.context], 512, 512, ref, checkpoint=checkpoint)
    r, fl = res[args.context], ref.row([args.context])[args.context]
    keys = chosen_key_widths(cache)
    row = {"model": label, "text": args.text, "context": args.context, "value_widths": widths,
           "from_window": args.from_window, "kl": r["kl"], "kl_se": r["kl_se"],
           "ppl_delta_pct": 100 * (r["ppl"] / fl["ppl"] - 1), "bits_real": r["bits_real"], "key_widths": keys,
           "bits_32k": bits_at(mcfg, LONG, widths, cache), "seconds": round(time.perf_counter() - t0, 1),
           **common.code_version()}  # rows of several runs share one file (and its first run's meta)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "value_mix.json"
    stored = json.loads(path.read_text()) if path.exists() else {"meta": common.metadata(), "rows": []}
    stored["rows"] = [x for x in stored["rows"] if (x["model"], x["text"], x["context"], x["value_widths"])
                      != (label, args.text, args.context, widths)] + [row]
    path.write_text(json.dumps(stored, indent=1))
    print(f"{label} {args.text} @{args.context}: values V2/V3/V4 on {widths.count(2)}/{widths.count(3)}/"
          f"{widths.count(4)} layers: KL {row['kl']:.4f} ± {row['kl_se']:.4f}, ΔPPL {row['ppl_delta_pct']:+.2f}%, "
          f"{row['bits_32k']:.2f} bits/value at 32k ({row['seconds']:.0f} s); wrote {path}")


if __name__ == "__main__":
    main()
