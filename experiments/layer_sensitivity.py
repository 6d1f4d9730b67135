"""What each layer's keys cost the model's output, and whether the cache could tell from its first window.

`key_error` widens a layer's keys by the attention-logit error its first window predicts; a layer's error is not
the model's, since later layers amplify or damp it. This probe measures the model's side: for each attention layer
alone, that layer's keys coded at --bits (values at 8 bits, every other layer float, the real cache and hook) and
the KL(float ‖ that cache) of the last 512 tokens of a --context-token text, fed 512 at a time as long_context.py
feeds it. Beside it, two figures a cache has at its first compression: the RMS logit error of the layer's keys at 4
bits over its calibration queries (what `key_error` compares), and the relative error of the layer's attention
output, ‖o(K4) − o‖² / ‖o‖², for the queries of the first window's last third, each reading as K4 codes (centered
before RoPE and weighed, as the cache codes them) the tokens between the sinks and its 128 most recent, as
`value_error` measures values; and the width the default takes.

Then three allocations of whole widths K3-K6 held to the summed KL of the default's widths (a layer's KL at b bits
taken as its K4 KL times D_mse(b) / D_mse(4), the model's as the layers' sum), widening first the layer whose next
bit takes off the most: by the measured KL (an oracle: it needs the float model), by the predicted logit error
squared, and by the output error, each scaled to the measured sum so that only the order differs.

With --check-contexts, the default cache runs to those contexts (float log-probs from long_context.py's disk cache)
with each layer's key width by its output error, a rule a cache could apply alone: the fewest bits K3-K6 whose
output error (K4's times D_mse(b) / D_mse(4)) is at most --output-target. KL, ΔPPL and the bits/value held (float
parts in float16, the widths taken) are read as long_context.py reads them.

    python experiments/layer_sensitivity.py --models qwen05,smollm2 --context 4096
    python experiments/layer_sensitivity.py --models qwen05,smollm2,qwen15 --check-contexts 8192 --output-target 2e-4
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
from mlx_lm.models.cache import KVCache, make_prompt_cache  # noqa: E402

import caches  # noqa: E402
import quality  # noqa: E402
from key_error import centered_means  # noqa: E402
import long_context  # noqa: E402
import long_context_settings as lc_settings  # noqa: E402
import tq_mlx  # noqa: E402
from tq_mlx import TurboQuantConfig  # noqa: E402
from tq_mlx.models.architectures import load_model_config  # noqa: E402
from tq_mlx.models.rope import probe  # noqa: E402
from tq_mlx.planner.memory import estimate_kv_bytes  # noqa: E402
from tq_mlx.quant.codebook import lloyd_max  # noqa: E402
from tq_mlx.quant.quantizer import TurboQuantMSE  # noqa: E402
from tq_mlx.stream.calibration import query_weights  # noqa: E402
from tq_mlx.stream import compressed  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"  # experiments/results/, beside the probes
CHUNK = 512
WIDTHS = (3, 4, 5, 6)


# The default this probe measured (until 2026-12-06): K4/V3 with keys widened by their logit error (key_error), whose
# key_width it records and forces; today's default takes its widths by the output error the probe led to.
PROBED = TurboQuantConfig(value_bits=3, key_output_error=None)


def mse_ratios(D: int, base: int = 4) -> dict[int, float]:
    """D_mse(b) / D_mse(base) for each of WIDTHS: what a layer's error at `base` bits is scaled by at b bits."""
    return {b: lloyd_max(D, b).mse / lloyd_max(D, base).mse for b in WIDTHS}


def predicted(model, ids: list[int]) -> tuple[list[float], list[float]]:
    """The default cache's predicted K4 logit error (the worst kv head's) and chosen width per attention layer, from
    the calibration queries of the first tokens of ids: key_width's own inputs, recorded as it is called."""
    seen: list[float] = []
    real = compressed.key_width

    def spy(unit_error, widths, target, dim, split=None):
        seen.append(float(np.max(unit_error)) * float(np.sqrt(lloyd_max(dim, 4).mse)))
        return real(unit_error, widths, target, dim, split)

    compressed.key_width = spy
    try:
        cache = tq_mlx.make_prompt_cache(model, PROBED)
        d = PROBED
        n = d.sinks + d.first_window + CHUNK
        for a in range(0, n, CHUNK):
            model(mx.array(ids[a : min(a + CHUNK, n)])[None], cache=cache)
            caches.eval_cache(cache)
    finally:
        compressed.key_width = real
    att = [c for c in cache if hasattr(c, "key_stream")]
    widths = [float(c.key_bits) for c in att]
    protected = [bool(getattr(c, "protected", False)) for c in att]
    # a protected layer calls no key_width: its prediction is missing; put a None in its place
    out, it = [], iter(seen)
    for p in protected:
        out.append(None if p else next(it))
    return out, widths


def output_errors(model, mcfg: dict, ids: list[int]) -> list[float]:
    """Per attention layer: ‖o(K4 codes) − o‖² / ‖o‖² summed over the first window's last third of queries (all
    heads), each query reading as codes the tokens between the sinks and its 128 most recent, the rest float."""
    d = TurboQuantConfig()
    n = d.sinks + d.first_window
    captured, scale = quality.capture_qkv(model, ids[:n])
    calib = slice(d.sinks, n)
    first = d.sinks + d.first_window - d.first_window // 3
    out = []
    for i, (q, k, v) in enumerate(captured):
        q, k, v = (a.astype(mx.float32) for a in (q, k, v))
        B, Hq, N, D = q.shape
        H = k.shape[1]
        G = Hq // H
        rope = probe(model.model.layers[i].self_attn.rope, D)
        mean = centered_means(k, "rope", calib, float(mcfg.get("rope_theta", 10000.0)))
        qc = q.reshape(B, H, G, N, D)[:, :, :, calib].reshape(B, H, -1, D)
        w = query_weights(mx.sum(qc * qc, axis=2), (k - mean)[:, :, calib], rope)[:, :, None]
        quant = TurboQuantMSE(D, 4, seed=1)
        k_hat = quant.dequantize(quant.quantize((k - mean) * w)) / w + mean
        ql = q[:, :, first:].reshape(B, H, G * (N - first), D) * scale
        pos = mx.array(np.tile(np.arange(first, N), G))[:, None]
        j = mx.arange(N)[None]
        coded = (j >= d.sinks) & (j < pos - d.window)
        seen = j <= pos
        exact = ql @ k.swapaxes(-1, -2)
        o = mx.softmax(mx.where(seen, exact, -mx.inf), axis=-1, precise=True) @ v
        coded_scores = mx.where(coded, ql @ k_hat.swapaxes(-1, -2), exact)
        o_hat = mx.softmax(mx.where(seen, coded_scores, -mx.inf), axis=-1, precise=True) @ v
        out.append(float(mx.sum(mx.square(o_hat - o)) / mx.sum(mx.square(o))))
    return out


def output_widths(errors: list[float | None], target: float, D: int) -> list[float | None]:
    """Each layer's fewest bits (WIDTHS) whose output error is at most target (None: a protected layer)."""
    mse = mse_ratios(D)
    return [None if e is None else float(next((b for b in WIDTHS if e * mse[b] <= target), WIDTHS[-1]))
            for e in errors]


def check(model, key: str, mcfg: dict, text: str, ids: list[int], contexts: list[int],
          widths: list[float | None]) -> dict:
    """The default cache to `contexts` with the key widths forced (key_width returns them in layer order)."""
    forced = [w for w in widths if w is not None]
    calls = [0]
    real = compressed.key_width

    def force(unit_error, widths_, target, dim, split=None):
        w = forced[calls[0] % len(forced)]
        calls[0] += 1
        return w

    ref = long_context.FloatReference(key, text, ids, CHUNK, CHUNK)
    if not ref.has(contexts):
        raise SystemExit(f"no float log-probs for {key} {text} at {contexts}: run long_context.py's float pass first")
    compressed.key_width = force
    try:
        cfg = PROBED
        cache = tq_mlx.make_prompt_cache(model, cfg)
        res, _ = long_context.run_pass(model, cache, ids, contexts, CHUNK, CHUNK, ref)
    finally:
        compressed.key_width = real
    float_rows = ref.row(contexts)
    att = [c for c in cache if hasattr(c, "key_stream")]
    taken = [float(c.key_bits) for c in att]
    geometry = caches.kv_geometry(mcfg)
    out = {}
    for c, r in res.items():
        # bits/value as the tables price them: the float parts in float16, the widths the layers took
        row = {"kl": r["kl"], "kl_se": r["kl_se"], "ppl_delta_pct": 100 * (r["ppl"] / float_rows[c]["ppl"] - 1),
               "ppl_delta_pct_se": r["ppl_delta_pct_se"], "bits_as_run": r["bits_real"],
               "bits_float16": common.bits_per_value(
                   estimate_kv_bytes(mcfg, c, cfg, dtype="float16", key_widths=taken), c, geometry)}
        out[str(c)] = row
        print(f"  forced widths @{c}: KL {row['kl']:.4f} ± {row['kl_se']:.4f}, ΔPPL {row['ppl_delta_pct']:+.2f}%, "
              f"{row['bits_float16']:.2f} bits/value (float parts in float16), {row['bits_as_run']:.2f} as run",
              flush=True)
    return {"widths": taken, "contexts": out}


def allocate(costs: list[float], budget: float, D: int) -> list[int]:
    """Whole widths (WIDTHS) per layer, fewest bits first: start every layer at the narrowest, then widen the layer
    whose next bit removes the most cost per bit until the summed cost is within budget (cost at b bits: cost ×
    D_mse(b) / D_mse(4))."""
    mse = mse_ratios(D)
    b = [WIDTHS[0]] * len(costs)
    total = lambda: sum(c * mse[w] for c, w in zip(costs, b))  # noqa: E731
    while total() > budget:
        gains = [(c * (mse[w] - mse[w + 1]) if w < WIDTHS[-1] else -1.0) for c, w in zip(costs, b)]
        i = int(np.argmax(gains))
        if gains[i] <= 0:
            break
        b[i] += 1
    return b


def layer_cells(model, key: str, mcfg: dict, text: str, ids: list[int], context: int, bits: int,
                layers: list[int] | None) -> dict:
    """Each attention layer's keys alone at `bits` (values at 8, the rest float): the KL, beside the predicted
    logit error, the output error and the default's width; then the allocations (the module's docstring)."""
    _, H, D = caches.kv_geometry(mcfg)
    ref = long_context.FloatReference(key, text, ids, CHUNK, CHUNK)
    if not ref.has([context]):
        print(f"  float pass to {context} ...", flush=True)
        long_context.run_pass(model, make_prompt_cache(model), ids, [context], CHUNK, CHUNK, None, store=ref)
    pred, widths = predicted(model, ids)
    outerr = output_errors(model, mcfg, ids)
    cfg = TurboQuantConfig(key_bits=bits, value_bits=8, key_error=None)
    att = [i for i, c in enumerate(make_prompt_cache(model)) if type(c) is KVCache]
    rows = []
    for li, pos in enumerate(att):
        if layers is not None and li not in layers:
            continue
        t = time.perf_counter()
        cache = make_prompt_cache(model)
        tq_cache = tq_mlx.make_prompt_cache(model, cfg)[pos]
        cache[pos] = tq_cache
        r = long_context.run_pass(model, cache, ids, [context], CHUNK, CHUNK, ref)[0][context]
        rows.append({"layer": li, "kl": r["kl"], "kl_se": r["kl_se"], "predicted_4": pred[li],
                     "output_error_4": outerr[li], "width": widths[li],
                     "protected": bool(getattr(tq_cache, "protected", False))})
        print(f"  layer {li:2d}: KL {r['kl']:.5f} (predicted K4 logit error "
              f"{'protected' if pred[li] is None else f'{pred[li]:.3f}'}, output error² {outerr[li]:.2e}, "
              f"default K{widths[li]:g}) {time.perf_counter() - t:.0f} s", flush=True)
    return {"layers": rows, **allocations(rows, D, bits)}


def allocations(rows: list[dict], D: int, bits: int = 4) -> dict:
    """The default's mean key bits and summed KL over the unprotected layers, and each allocation's widths, mean
    key bits, summed KL and how well its cost's log follows the measured KL's (Pearson)."""
    mse = mse_ratios(D, bits)
    free = [r for r in rows if not r["protected"] and r["predicted_4"] is not None]
    kl = [r["kl"] for r in free]
    budget = sum(r["kl"] * mse[int(r["width"])] for r in free)
    cell = {"default_key_bits": float(np.mean([r["width"] for r in free])), "default_kl_sum": budget}
    floor = 1e-9  # a layer whose KL reads 0 at this precision
    for name, cost in (("oracle", kl), ("predicted", [r["predicted_4"] ** 2 for r in free]),
                       ("output", [r["output_error_4"] for r in free])):
        scaled = [c * sum(kl) / sum(cost) for c in cost]  # each held to the measured K4 sum: the order is what differs
        w = allocate(scaled, budget, D)
        cell[f"{name}_widths"] = w
        cell[f"{name}_key_bits"] = float(np.mean(w))
        cell[f"{name}_kl_sum"] = sum(c * mse[b] for c, b in zip(kl, w))
        cell[f"{name}_log_correlation"] = float(np.corrcoef(np.log(np.maximum(kl, floor)),
                                                            np.log(np.maximum(cost, floor)))[0, 1])
    return cell


def check_cell(model, key: str, mcfg: dict, text: str, ids: list[int], contexts: list[int], target: float) -> dict:
    """The default cache with each layer's key width by its output error (output_widths at `target`)."""
    _, _, D = caches.kv_geometry(mcfg)
    outerr = output_errors(model, mcfg, ids)
    pred, _ = predicted(model, ids)  # the layers that protect themselves take no width
    widths = output_widths([None if p is None else e for p, e in zip(pred, outerr)], target, D)
    print(f"  widths by output error ≤ {target:g}: {widths}", flush=True)
    return {"output_target": target, "output_errors": outerr, **check(model, key, mcfg, text, ids, contexts, widths)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen05", help=f"comma list of {','.join(lc_settings.MODELS)}")
    ap.add_argument("--text", default="britannica", help="one of long_context.py's texts")
    ap.add_argument("--context", type=int, default=4096, help="tokens of context; the last 512 are scored")
    ap.add_argument("--bits", type=int, default=4, help="the one layer's key bits")
    ap.add_argument("--layers", default="", help="comma list of attention layers to measure (default: all)")
    ap.add_argument("--check-contexts", default="", help="run the default cache with widths by output error to these")
    ap.add_argument("--output-target", type=float, default=2e-4, help="the output error² a width must hold")
    ap.add_argument("--out", type=Path, default=RESULTS / "layer_sensitivity.json")
    args = ap.parse_args(argv)
    (text,) = long_context.text_names(args.text)
    d = TurboQuantConfig()
    least = d.sinks + d.first_window + CHUNK + d.window
    if args.context < least:
        raise SystemExit(f"--context must be at least {least} (sinks, the first window, the window and the "
                         f"{CHUNK} scored tokens), got {args.context}")
    if not args.output_target > 0:
        raise SystemExit(f"--output-target must be above 0, got {args.output_target}")
    layers = [int(x) for x in args.layers.split(",")] if args.layers else None
    checks = [int(c) for c in args.check_contexts.split(",") if c]
    results = {"meta": common.metadata(), "cells": []}
    cell_key = lambda c: (c["model"], c["text"], c["kind"], c["context"], c.get("output_target"))  # noqa: E731
    from tests.support import real_models

    for key in args.models.split(","):
        label, loader, path_fn = lc_settings.MODELS[key]
        print(f"{label}:", flush=True)
        model, tok = getattr(real_models, loader)(mx.float32)
        mcfg = load_model_config(getattr(real_models, path_fn)())
        long_context._MODEL_CONFIG[0] = mcfg
        ids = long_context.text_ids(tok, text, max([args.context, *checks]) + 1)
        t = time.perf_counter()
        if checks:
            cell = {"kind": "check", "context": max(checks),
                    **check_cell(model, key, mcfg, text, ids, checks, args.output_target)}
        else:
            cell = {"kind": "layers", "context": args.context, "bits": args.bits,
                    **layer_cells(model, key, mcfg, text, ids, args.context, args.bits, layers)}
        results["cells"].append({"model": key, "text": text, "command": results["meta"]["command"], **cell,
                                 "seconds": round(time.perf_counter() - t, 1)})
        common.write_cells(args.out, results, cell_key)
    print(table(json.loads(args.out.read_text())["cells"]))
    print(f"wrote {args.out}")


def table(cells: list[dict]) -> str:
    """The layers cells, one row per model and text, then the check cells, one row per context."""
    rows = []
    for c in cells:
        if c["kind"] != "layers":
            continue
        free = [r for r in c["layers"] if not r["protected"] and r["predicted_4"] is not None]
        worst = max(free, key=lambda r: r["kl"])
        rows.append([c["model"], c["text"], c["context"],
                     f"{np.median([r['kl'] for r in free]):.5f} / {worst['kl']:.5f} ({worst['layer']})",
                     f"{c['predicted_log_correlation']:.2f} / {c['output_log_correlation']:.2f}",
                     " / ".join(f"{c[k]:.2f}" for k in ("default_key_bits", "oracle_key_bits", "predicted_key_bits",
                                                         "output_key_bits")),
                     " / ".join(f"{c[k]:.5f}" for k in ("default_kl_sum", "predicted_kl_sum", "output_kl_sum"))])
    headers = ["model", "text", "context", "one layer's K4 keys, KL: median / max (layer)",
               "log correlation with the predicted logit error² / the output error²",
               "mean key bits: the default / by KL (oracle) / by predicted error / by output error",
               "summed KL: the default / by predicted error / by output error"]
    checks = [[c["model"], c["text"], ctx, f"{c['output_target']:g}",
               f"{np.mean([w for w in c['widths'] if w <= WIDTHS[-1]]):.2f}",
               f"{r['kl']:.4f} ± {r['kl_se']:.4f}", f"{r['ppl_delta_pct']:+.2f}%", f"{r['bits_float16']:.2f}"]
              for c in cells if c["kind"] == "check" for ctx, r in c["contexts"].items()]
    check_headers = ["model", "text", "context", "output target", "mean key bits (unprotected layers)", "KL",
                     "ΔPPL", "bits/value (float parts in float16)"]
    return "\n\n".join(common.markdown_table(h, r) for h, r in ((headers, rows), (check_headers, checks)) if r)


if __name__ == "__main__":
    main()
