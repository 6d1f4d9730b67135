"""Decode and prefill speed of TurboQuant next to mlx-lm's caches, side by side in one run, as ratios to KVCache.

Caches: mlx-lm KVCache (the float baseline), QuantizedKVCache 8/4-bit (group 64), TurboQuant's named settings
(default, compact, quality: what --tq-preset builds), and mlx-vlm's TurboQuantKVCache (a peer from PyPI) where it runs. Models: a random llama-shaped model (hidden
512, 4 layers, 8 Q / 2 KV heads, head_dim 128, like shared/docs/mlx-lm-integration.md §9) and, unless --quick
or --no-smollm2, the real SmolLM2-135M (head_dim 64) at 1k/2k. Everything is float32 (on CPU fp16 matmuls skip BLAS).

  decode   tokens/s of `model(y, cache)` + mx.eval per token with the cache holding `ctx` tokens (filled with
           random keys/values, as decoding would leave them), best of --repeats runs of --steps tokens; the
           settings take turns within each repeat so that load from other processes hits them alike
  prefill  tokens/s of feeding `ctx` tokens into an empty cache in 2048-token chunks (mlx-lm's default
           prefill step), best of --prefill-repeats

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python benchmarks/speed.py [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

import caches  # noqa: E402  (settings, cache construction, the peer hook)
from caches import FLOAT, MLX4, MLX8, PEER4, Setting  # noqa: E402
from tq_mlx import TurboQuantConfig  # noqa: E402
from tq_mlx.config import NARROWEST_KEY_BITS, PRESETS, WIDEST_KEY_BITS, bits_label  # noqa: E402

CONTEXTS = (1024, 4096, 8192)
QUICK_CONTEXTS = (256, 1024)
SMOLLM2_CONTEXTS = (1024, 2048)
PREFILL_STEP = 2048


def preset(name: str) -> Setting:
    """A named setting as the commands' --tq-preset builds it: "TQ default (K4/V4, window 128, keys K3 to K6 by their
    output error)", "TQ compact (K4/V3 → K2/V2 after 4096)"."""
    cfg = TurboQuantConfig.preset(name)
    what = bits_label(cfg.key_bits, cfg.value_bits, cfg.qjl)
    if cfg.decay_after is not None:
        what += f" → {bits_label(*cfg.decayed_bits)} after {cfg.decay_after}"
    else:
        what += f", window {cfg.window}"
    if cfg.key_output_error is not None:
        what += f", keys K{NARROWEST_KEY_BITS} to K{WIDEST_KEY_BITS} by their output error"
    elif cfg.key_error is not None:
        what += f", keys up to K{WIDEST_KEY_BITS} by their error"
    return Setting(f"TQ {name} ({what})", "tq", config=cfg)


def settings(quick: bool) -> list[Setting]:
    """The caches a user picks from: mlx-lm's, TurboQuant's named settings (what tq-chat, tq-generate and
    tq-server run), the peer."""
    if quick:
        return [FLOAT, MLX4, preset("default"), PEER4]
    # what reading prefill as decode costs the default's prefill (one attention call per compress block of a chunk)
    before = Setting("TQ default, prefill not read as decode", "tq",
                     config=dataclasses.replace(TurboQuantConfig(), prefill_as_decode=False))
    return [FLOAT, MLX8, MLX4, *(preset(n) for n in PRESETS), before, PEER4]


def llama_model(seed: int = 0) -> nn.Module:
    """Random weights, llama layout of the §9 measurements: hidden 512, 4 layers, 8 Q / 2 KV heads, head_dim 128."""
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=512, num_hidden_layers=4, intermediate_size=1536,
                           num_attention_heads=8, num_key_value_heads=2, head_dim=128, rms_norm_eps=1e-5,
                           vocab_size=4096, rope_theta=10000.0, tie_word_embeddings=True)
    mx.random.seed(seed)
    model = llama.Model(args)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def _geometry(model) -> tuple[int, int]:
    a = model.layers[0].self_attn
    return a.n_kv_heads, a.head_dim if hasattr(a, "head_dim") else model.args.head_dim


def fill(cache: list, ctx: int, n_kv: int, head_dim: int, chunk: int = 2048, seed: int = 1) -> None:
    """Put ctx random (B=1) keys/values into every layer's cache, chunk tokens at a time."""
    key = mx.random.key(seed)
    k = mx.random.normal((1, n_kv, min(chunk, ctx), head_dim), key=key) * 0.5
    mx.eval(k)
    for c in cache:
        n = 0
        while n < ctx:
            m = min(chunk, ctx - n)
            keys, _ = c.update_and_fetch(k[:, :, :m], k[:, :, :m])
            if getattr(keys, "learn", None) is not None:  # as the hook does: queries for the keys' weights
                keys.learn(k[:, :, :m], keys, None)
            n += m
        caches.eval_cache([c])


def decode_step(model, cache, y) -> None:
    mx.eval(model(y, cache=cache))


def trim(cache: list, n: int) -> None:
    for c in cache:
        c.trim(n)


def measure_decode(model, sets: list[Setting], ctx: int, steps: int, repeats: int) -> dict[str, float]:
    n_kv, hd = _geometry(model)
    filled = {}
    for s in sets:
        try:
            c = caches.make_cache(model, s)
            fill(c, ctx, n_kv, hd)
            filled[s.name] = c
        except Exception as e:  # noqa: BLE001
            print(f"  {s.name}: cannot fill: {type(e).__name__}: {e}", flush=True)
    y = mx.array([[1]])
    for c in filled.values():  # warm-up (graph building, codebooks, kernels)
        decode_step(model, c, y)
        trim(c, 1)
    best = {name: float("inf") for name in filled}
    for _ in range(repeats):
        for name, c in filled.items():
            t = time.perf_counter()
            for _ in range(steps):
                decode_step(model, c, y)
            best[name] = min(best[name], (time.perf_counter() - t) / steps)
            trim(c, steps)  # back to ctx tokens
    return {name: 1.0 / t for name, t in best.items()}


def measure_prefill(model, sets: list[Setting], ctx: int, repeats: int) -> dict[str, float]:
    vocab = model.args.vocab_size
    tokens = mx.random.randint(0, vocab, (1, ctx), key=mx.random.key(2))
    best = {s.name: float("inf") for s in sets}
    for _ in range(repeats):
        for s in sets:
            try:
                c = caches.make_cache(model, s)
            except Exception:  # noqa: BLE001
                best.pop(s.name, None)
                continue
            t = time.perf_counter()
            for a in range(0, ctx, PREFILL_STEP):
                model(tokens[:, a : a + PREFILL_STEP], cache=c)
                caches.eval_cache(c)
            best[s.name] = min(best[s.name], time.perf_counter() - t)
            del c
    return {name: ctx / t for name, t in best.items()}


def run_model(label: str, model, sets: list[Setting], contexts, args, budget: common.Budget) -> dict:
    n_kv, hd = _geometry(model)
    print(f"\n{label}: {len(model.layers)} layers, {n_kv} kv heads, head_dim {hd}", flush=True)
    usable = [s for s in sets if s.kind != "peer" or caches.peer().module is not None]
    out = {"model": label, "layers": len(model.layers), "kv_heads": n_kv, "head_dim": hd, "contexts": {}}
    for ctx in contexts:
        if budget.over():
            print(f"  {ctx}: skipped (time budget)")
            continue
        t = time.perf_counter()
        dec = measure_decode(model, usable, ctx, args.steps, args.repeats)
        pre = measure_prefill(model, usable, ctx, args.prefill_repeats)
        base_d, base_p = dec.get(FLOAT.name), pre.get(FLOAT.name)
        rows = {}
        for s in sets:
            r = {"decode_tok_s": dec.get(s.name), "prefill_tok_s": pre.get(s.name)}
            r["decode_ratio"] = r["decode_tok_s"] / base_d if r["decode_tok_s"] and base_d else None
            r["prefill_ratio"] = r["prefill_tok_s"] / base_p if r["prefill_tok_s"] and base_p else None
            if s.kind == "peer" and caches.peer().module is None:
                r["error"] = caches.peer().reason
            rows[s.name] = r
        out["contexts"][str(ctx)] = rows
        print(f"  ctx {ctx} ({time.perf_counter() - t:.0f} s): " + ", ".join(
            f"{n} {common.fmt(r['decode_ratio'])}x/{common.fmt(r['prefill_ratio'])}x" for n, r in rows.items()), flush=True)
    return out


def table(res: dict) -> tuple[list[str], list[list[str]]]:
    headers = ["model", "cache"]
    ctxs = sorted({int(c) for m in res["models"] for c in m["contexts"]}) or res["contexts"]
    lab = lambda c: f"{c // 1024}k" if c >= 1024 else str(c)  # noqa: E731
    headers += [f"decode @{lab(c)}" for c in ctxs] + [f"prefill @{lab(c)}" for c in ctxs]
    rows = []
    for m in res["models"]:
        names = list(next(iter(m["contexts"].values())).keys()) if m["contexts"] else []
        for i, name in enumerate(names):
            line = [m["model"] if i == 0 else "", name]
            for kind in ("decode", "prefill"):
                for c in ctxs:
                    r = m["contexts"].get(str(c), {}).get(name, {})
                    v, ratio = r.get(f"{kind}_tok_s"), r.get(f"{kind}_ratio")
                    line.append("–" if v is None else f"{v:.1f} ({ratio:.2f}x)")
            rows.append(line)
    return headers, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI size: contexts 256/1k, random llama only, few settings")
    ap.add_argument("--contexts", default=None, help="comma list (default 1024,4096,8192)")
    ap.add_argument("--steps", type=int, default=None, help="decode tokens per timed run (default 16; quick 4)")
    ap.add_argument("--repeats", type=int, default=None, help="decode runs, best kept (default 4; quick 2)")
    ap.add_argument("--prefill-repeats", type=int, default=None, help="default 2; quick 1")
    ap.add_argument("--no-smollm2", action="store_true")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--budget", type=float, default=None, help="seconds; later contexts/models are skipped")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = ap.parse_args()
    q = args.quick
    contexts = tuple(int(x) for x in args.contexts.split(",")) if args.contexts else (QUICK_CONTEXTS if q else CONTEXTS)
    args.steps = args.steps or (4 if q else 16)
    args.repeats = args.repeats or (2 if q else 4)
    args.prefill_repeats = args.prefill_repeats or (1 if q else 2)

    from tests.support.real_models import blas_hint

    if hint := blas_hint():
        print(f"hint: {hint}", file=sys.stderr)
    t0 = time.perf_counter()
    budget = common.Budget(args.budget)
    peer = caches.load_peer(not args.no_peers)
    print(f"back end: {common.backend()}; peer mlx-vlm: {'version ' + peer.version if peer.module else peer.reason}", flush=True)
    sets = settings(q)
    res = {"meta": common.metadata(), "contexts": list(contexts), "steps": args.steps, "repeats": args.repeats,
           "settings": [s.to_dict() for s in sets],
           "peers": {"mlx-vlm": {"version": peer.version, "runs": peer.module is not None, "reason": peer.reason}},
           "models": []}
    res["models"].append(run_model("random llama (4 layers, 8/2 heads, head_dim 128)", llama_model(), sets, contexts, args, budget))
    if not q and not args.no_smollm2 and not budget.over():
        from tests.support.real_models import load_smollm2

        # A real model's prefill is slow on a CPU: fewer settings and contexts, one prefill each.
        model, _ = load_smollm2(mx.float32)
        args.prefill_repeats = 1
        res["models"].append(run_model("SmolLM2-135M (30 layers, 9/3 heads, head_dim 64)", model, sets,
                                       SMOLLM2_CONTEXTS, args, budget))
    res["seconds"] = round(time.perf_counter() - t0, 1)

    headers, rows, notes = report(res)
    md = common.render("Speed", res["meta"], headers, rows, notes, ALIGN)
    print()
    print(common.text_table(headers, rows, ALIGN))
    for n in notes:
        print(f"* {n}")
    jp, mp = common.write_results("speed-quick" if q else "speed", res, md, args.out)
    print(f"wrote {jp} and {mp} ({res['seconds']:.0f} s)")


ALIGN = "ll" + "r" * 20  # as many as there are columns


def report(res: dict) -> tuple[list[str], list[list[str]], list[str]]:
    """The table and its notes, from a results dict alone (readme_tables.py renders saved JSON with it)."""
    headers, rows = table(res)
    peer = res["peers"]["mlx-vlm"]
    notes = [
        "tokens/s (ratio to mlx-lm KVCache in the same run); float32 weights and activations, so the float cache is "
        f"float32. Decode: best of {res['repeats']} x {res['steps']} tokens at a constant context; prefill: the context "
        f"fed in {PREFILL_STEP}-token chunks into an empty cache.",
        f"Back end: {res['meta']['backend']} ({res['meta']['device']}). Without Metal, TurboQuant runs its pure-MLX "
        "reference attention (byte-at-a-time codebook lookups, values dequantized on a second stream); mlx-lm's "
        "QuantizedKVCache runs mx.quantized_matmul."
        + (" Every cache ran with tq_mlx.integration.tune_malloc() (glibc keeps transient buffers in the heap)."
           if res["meta"].get("malloc_tuned") else ""),
        f"Peer: mlx-vlm {peer['version']} TurboQuantKVCache (no Metal here: its CPU fallback, dequantize-then-SDPA for "
        "prefill)." if peer["runs"] else f"Peer mlx-vlm: {peer['reason']}.",
        "TurboQuant rows: the named settings as --tq-preset builds them, filled with random keys and values (the "
        "keys also standing in for the queries that weigh them).",
        f"The machine was shared with other jobs (load average {', '.join(f'{x:.1f}' for x in res['meta']['load_average'] or [])} "
        "at the start): trust ratios within a column, not absolute speeds.",
    ]
    for m in res["models"]:
        ctxs = sorted(int(c) for c in m["contexts"])
        for c1, c2 in zip(ctxs, ctxs[1:]):
            d1 = m["contexts"][str(c1)].get(FLOAT.name, {}).get("decode_tok_s")
            d2 = m["contexts"][str(c2)].get(FLOAT.name, {}).get("decode_tok_s")
            if d1 and d2 and d2 < 0.5 * d1 * c1 / c2:  # slower than attention growing linearly with context explains
                notes.append(f"{m['model'].split(' (')[0]}: the float cache decoded {d2:.1f} tok/s at {c2} tokens after "
                             f"{d1:.1f} at {c1}, slower than the longer context explains: a disturbed measurement, so "
                             f"the decode ratios at {c2} are not meaningful.")
    return headers, rows, notes


if __name__ == "__main__":
    main()
