"""The pictures in README.md and docs/, drawn from the benchmarks' JSON (matplotlib: `pip install ".[plot]"`).

    python tools/docs/plots.py                 # writes docs/kl_vs_bits.png, peers_vs_bits[_16k].png, memory_vs_context.png
    python tools/docs/plots.py --out /tmp/p    # somewhere else
    python tools/docs/plots.py --check         # exit 1 if docs/'s pictures are stale (needs no matplotlib)

(`python tools/docs/docs_assets.py` runs this with every other generated picture and example.) Next to each
PNG, a JSON sidecar holds what it draws (every point, curve and label) and the PNG's sha256: --check compares
that data with what the code and results give now, never pixels. Every label lies inside the picture: the KL
picture is as wide as its key, and a picture with a label cut at its edge is not written.

kl_vs_bits.png: quality against size at 8k tokens, every cache setting and peer of
benchmarks/results/long_context.json on SmolLM2-135M: KL(float ‖ cache) against bits per value, the same
numbers as the long-context table (bits/val @8k, with the layers whose keys protected themselves).

peers_vs_bits.png: the same on Qwen2.5-Coder-1.5B, Britannica, at the context where every peer is measured:
long_context.json's rows (ours, mlx-lm's, mlx-vlm's) and TurboQuant+'s cells of benchmarks/results/tqplus.json,
the same scored tokens (the fork's KL against its own f16 cache). peers_vs_bits_16k.png: the same at 16k, with the
peers measured there; its footnote names those of the 8k picture that are not.

memory_vs_context.png: KV bytes against context for USER_MODELS (from benchmarks/configs/*.json), in float16, in
mlx-lm's affine 8-bit and 4-bit QuantizedKVCache and with TurboQuant's defaults: tq_mlx.planner.memory.estimate_kv_bytes,
which memory.py checks byte for byte against real caches.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import textwrap
from pathlib import Path

# the docs scripts beside this one, then the benchmarks' modules they render
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2] / "benchmarks")]

import common  # noqa: E402

DOCS = common.REPO / "docs"
KL_CONTEXT = 8192
# tqplus.py's cells: one model, one text; the context where every peer has a cell (the fork's turbo cells take
# hours at 16k on this CPU), and each peers picture's context
PEERS_MODEL, PEERS_TEXT, PEERS_CONTEXT = "qwen15", "britannica", 8192
PEERS_FIGURES = {"peers_vs_bits": PEERS_CONTEXT, "peers_vs_bits_16k": 16384}
# the families that are peers rather than this project's settings
PEER_FAMILIES = ("mlx-lm affine", "peer", "turboquant-mlx-full", "TurboQuant+")
# The models people asked about (benchmarks/configs has more): the memory picture and the README's headline table.
USER_MODELS = ["Llama-3.1-70B", "Llama-3.1-8B", "Qwen2.5-14B", "Qwen3-Coder-Next", "Qwen3.5-27B", "Qwen3.5-35B-A3B"]
MEMORY_CONTEXTS = [1024 * k for k in range(1, 257)]  # 1k .. 256k, every 1k


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit('plots.py needs matplotlib: pip install ".[plot]"') from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _family(r: dict) -> str:
    if r["kind"] == "peer":  # which peer: mlx-vlm's rows carry no "peer" field
        return "peer" if r.get("peer", "mlx-vlm") == "mlx-vlm" else r["peer"]
    if r["kind"] == "mlx":
        return "mlx-lm affine"
    if r["kind"] == "rot":
        return "rotation + affine"
    import long_context_settings as lc_settings

    return "default" if lc_settings.canonical_name(r) == lc_settings.DEFAULT.name else "TurboQuant"


STYLE = {  # family: colour, marker size, legend label
    "default": ("tab:red", 11, "TurboQuant default"),
    "TurboQuant": ("tab:blue", 7, "TurboQuant, other settings"),
    "rotation + affine": ("tab:green", 7, "rotation + affine 4-bit"),
    "mlx-lm affine": ("dimgray", 7, "mlx-lm QuantizedKVCache"),
    "peer": ("tab:orange", 7, "peer: mlx-vlm TurboQuant"),
    "turboquant-mlx-full": ("tab:brown", 7, "peer: turboquant-mlx-full"),
    "TurboQuant+": ("tab:purple", 7, "peer: TurboQuant+ (llama.cpp fork)"),
}
TEXT_MARKER = {"britannica": "o", "hamlet": "^", "kjv": "s", "code": "D"}


def kl_points(lc: dict, model: str = "smollm2", ctx: int = KL_CONTEXT, texts: tuple | None = None) -> list[dict]:
    """One entry per setting measured at ctx (on texts, if given): name, family, bits/value at ctx, KL per text."""
    import long_context_settings as lc_settings

    m = lc["models"][model]
    out = []
    for r in m["rows"]:
        if r["kind"] == "float":
            continue
        cells = {t: c for t, c in r["texts"].items() if texts is None or t in texts}
        kl = {t: max(c[str(ctx)]["kl"], 1e-5) for t, c in cells.items() if isinstance(c.get(str(ctx)), dict)}
        if not kl:
            continue
        bits = r["bits"].get(str(ctx))
        if bits is None:
            bits = (r.get("bits_measured_peer") or {}).get(str(ctx))
        if bits is None:
            continue
        if r["kind"] == "tq":
            bits += lc_settings.protection_bits(dict(r, texts=cells), m["geometry"], ctx)
        out.append(dict(name=lc_settings.canonical_name(r), family=_family(r), bits=bits, kl=kl))
    return sorted(out, key=lambda p: (p["bits"], p["name"]))


def tqplus_points(tq: dict, ctx: int = PEERS_CONTEXT) -> list[dict]:
    """TurboQuant+'s cells of tqplus.json at ctx, as kl_points gives ours (its f16 base is no point)."""
    import tqplus

    return [dict(name=tqplus.label(s), family="TurboQuant+", bits=c["bits"], kl={PEERS_TEXT: max(c["kl"], 1e-5)})
            for s, c in tq.get("cells", {}).get(str(ctx), {}).items() if "kl" in c]


# The KL figure's geometry, in inches: the plot keeps its size, the key beside it is as wide as its longest line.
KL_PLOT = (6.9, 6.2)  # width, height of the plot's axes
KL_MARGINS = dict(left=0.9, right=0.25, bottom=0.85, top=0.45, gap=0.45)
KEY_LINE = 0.165  # inches per line of the numbered key (7.8-point monospace)
KEY_WIDTH = 84  # characters per line of the key; a longer setting name goes on under its start
FOOT_CHARS = 13  # characters of the 8-point footnote per inch of the picture's width, with room to spare


def key_lines(entry: str) -> list[str]:
    """One key entry ("23   5.03  TQ K4/V4 (...)") as the lines drawn: wrapped at KEY_WIDTH, indented under the name."""
    indent = " " * (len(entry) - len(entry.split("  ", 2)[-1].lstrip()))
    return textwrap.wrap(entry, KEY_WIDTH, subsequent_indent=indent, drop_whitespace=False) or [entry]


def kl_figure(lc: dict, model: str = "smollm2", ctx: int = KL_CONTEXT, texts: tuple | None = None,
              tq: dict | None = None) -> dict:
    """Everything the KL picture draws, as data: the points (number, name, family, bits, KL per text) and every
    label; with tq (tqplus.json), TurboQuant+'s cells among them. docs/<name>.json keeps this next to the PNG;
    `docs_assets.py --check` compares it with now."""
    import long_context_table as lc_table

    pts = kl_points(lc, model, ctx, texts)
    missing = []
    if tq is not None:
        pts = sorted(pts + tqplus_points(tq, ctx), key=lambda p: (p["bits"], p["name"]))
        missing = unmeasured_peers(lc, tq, model, texts, ctx, pts)
    m = lc["models"][model]
    at = lc_table.ctx_label(ctx)
    shown = [t for t in TEXT_MARKER if any(t in p["kl"] for p in pts)]
    foot = f"From benchmarks/results/long_context.json ({measured(lc, model)})"
    if tq is not None:
        foot += (f" and tqplus.json ({tq['meta']['date'][:10]}), {PEERS_TEXT.capitalize()} only, the same scored "
                 "tokens: TurboQuant+'s KL against its own f16 cache, the others' against the float cache")
    if missing:
        foot += f". Not measured at {at} (each is in the {lc_table.ctx_label(PEERS_CONTEXT)} picture): " + "; ".join(missing)
    peers = "" if tq is None else ", every peer" if not missing else ", peers measured"
    return {
        "title": f"{m['model']}: quality against size at {at} tokens" + peers,
        "xlabel": f"bits per value at {at} tokens, float parts in float16 (16 = float16 cache)",
        "ylabel": "KL(float ‖ cache), nats (lower is better)",
        "legend": [STYLE[f][2] for f in families(pts)] + [lc_table.TEXT_LABEL.get(t, t) + " text" for t in shown],
        "key_title": f"settings (bits/val @{at}, number as on the plot)",
        "key": [f"{i:>2}  {p['bits']:5.2f}  {p['name']}" for i, p in enumerate(pts, 1)],
        "footnote": foot + (". KL below 1e-5 drawn at 1e-5." if tq is not None else
                            ". Bar: the spread over the texts. KL below 1e-5 drawn at 1e-5."),
        "points": [dict(n=i, **p) for i, p in enumerate(pts, 1)],
    }


def unmeasured_peers(lc: dict, tq: dict, model: str, texts: tuple | None, ctx: int, pts: list[dict]) -> list[str]:
    """The peers with a point at PEERS_CONTEXT (where every peer is measured) that pts, drawn at ctx, lack."""
    if ctx == PEERS_CONTEXT:
        return []
    drawn = {p["name"] for p in pts}
    every = kl_points(lc, model, PEERS_CONTEXT, texts) + tqplus_points(tq, PEERS_CONTEXT)
    return [p["name"] for p in every if p["family"] in PEER_FAMILIES and p["name"] not in drawn]


def families(pts: list[dict]) -> list[str]:
    """The families among pts, in STYLE's order: the legend's entries."""
    return [f for f in STYLE if any(p["family"] == f for p in pts)]


def measured(lc: dict, model: str) -> str:
    """When the model's rows were measured: "33 runs, 2026-11-25 to 2026-11-28" (a merged file's own date is its
    first run's only)."""
    import long_context_table as lc_table

    runs = lc_table.runs_of(lc["meta"], model) or [lc["meta"]]
    days = sorted({r["date"][:10] for r in runs})
    return (f"{len(runs)} run{'s' if len(runs) > 1 else ''}, " if len(runs) > 1 else "") + (
        days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}")


def plot_kl(data: dict, path: Path) -> Path:
    """Draw data (kl_figure's) to path; every label inside the picture (texts_outside is checked)."""
    plt = _pyplot()
    pts = data["points"]
    mg = KL_MARGINS
    lines = [(p, line) for p, entry in zip(pts, data["key"]) for line in key_lines(entry)]
    key_h = max(KL_PLOT[1], KEY_LINE * (len(lines) + 1))
    height = mg["bottom"] + key_h + mg["top"]
    fig = plt.figure(figsize=(16, height))
    ax = fig.add_axes([0, 0, 0.1, 0.1])
    for p in pts:
        color, size, _ = STYLE[p["family"]]
        ys = list(p["kl"].values())
        if len(ys) > 1:
            ax.plot([p["bits"]] * 2, [min(ys), max(ys)], color=color, lw=1, alpha=0.5, zorder=1)
        for t, y in p["kl"].items():
            ax.scatter(p["bits"], y, marker="*" if p["family"] == "default" else TEXT_MARKER.get(t, "o"),
                       s=(size * 2.2) ** 2 if p["family"] == "default" else size ** 2, color=color,
                       edgecolor="black" if p["family"] == "default" else "none", zorder=3)
        # settings of (nearly) the same size take turns right and left of their points
        near = [q for q in pts[:p["n"] - 1] if abs(q["bits"] - p["bits"]) < 0.05]
        ax.annotate(str(p["n"]), (p["bits"], max(ys)), textcoords="offset points",
                    xytext=(-14 if len(near) % 2 else 5, 3), fontsize=8.5, color=color,
                    weight="bold" if p["family"] == "default" else "normal", zorder=4, annotation_clip=True)
    ax.set_yscale("log")
    ax.set_xlabel(data["xlabel"], fontsize=11)
    ax.set_ylabel(data["ylabel"], fontsize=11)
    ax.set_title(data["title"], fontsize=12)
    ax.grid(alpha=0.3, which="both")
    shown = families(pts)
    n_styles = len(shown)
    handles = [plt.Line2D([], [], ls="", marker="*" if f == "default" else "o",
                          ms=STYLE[f][1] * (1.4 if f == "default" else 1), color=STYLE[f][0], label=lab)
               for f, lab in zip(shown, data["legend"])]
    handles += [plt.Line2D([], [], ls="", marker=TEXT_MARKER[t], ms=7, color="black", mfc="none", label=lab)
                for t, lab in zip([t for t in TEXT_MARKER if any(t in p["kl"] for p in pts)],
                                  data["legend"][n_styles:])]
    ax.legend(handles=handles, fontsize=8.5, loc="best", framealpha=0.9)  # where it covers the fewest points
    # The numbered key, beside the plot: every setting's full name, so nothing overlaps on the axes.
    key = fig.add_axes([0.5, 0, 0.1, 0.1])
    key.axis("off")
    drawn = [key.set_title(data["key_title"], fontsize=9.5, loc="left")]
    for i, (p, line) in enumerate(lines):
        drawn.append(key.text(0, 1 - (i + 0.5) / len(lines), line.rstrip(), fontsize=7.8, family="monospace",
                              color=STYLE[p["family"]][0], va="center", transform=key.transAxes,
                              weight="bold" if p["family"] == "default" else "normal"))
    foot = fig.text(0, 0, data["footnote"], fontsize=8, color="dimgray")
    # Size the figure to its content: the key as wide as its longest line.
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    key_w = max(t.get_window_extent(renderer).width for t in drawn) / fig.dpi + 0.1
    width = mg["left"] + KL_PLOT[0] + mg["gap"] + key_w + mg["right"]
    fig.set_size_inches(width, height)
    foot.set_text("\n".join(textwrap.wrap(data["footnote"], int(width * FOOT_CHARS))))
    plot_bottom = mg["bottom"] + (key_h - KL_PLOT[1])
    ax.set_position([mg["left"] / width, plot_bottom / height, KL_PLOT[0] / width, KL_PLOT[1] / height])
    key.set_position([(mg["left"] + KL_PLOT[0] + mg["gap"]) / width, mg["bottom"] / height, key_w / width,
                      key_h / height])
    foot.set_position((mg["left"] / width, 0.1 / height))
    return save(fig, path)


def labels(fig) -> list:
    """Every label fig draws: titles, axis labels, visible tick labels, texts and annotations, legends."""
    out = [t for t in (*fig.texts, getattr(fig, "_suptitle", None)) if t is not None]
    out += [t for legend in fig.legends for t in legend.get_texts()]
    for ax in fig.axes:
        out += [ax.title, ax._left_title, ax._right_title, *ax.texts]
        if ax.axison:
            out += [ax.xaxis.label, ax.yaxis.label]
            for axis, i in ((ax.xaxis, 0), (ax.yaxis, 1)):  # tick labels in view (the others are not drawn)
                lo, hi = sorted(axis.get_view_interval())
                out += [t for t in axis.get_ticklabels(which="both")
                        if lo - 1e-9 * abs(hi - lo) <= t.get_position()[i] <= hi + 1e-9 * abs(hi - lo)]
        legend = ax.get_legend()
        if legend is not None:
            out += [*legend.get_texts(), legend.get_title()]
    return [t for t in out if t.get_visible() and t.get_text().strip()]


def texts_outside(fig) -> list[str]:
    """Every label of fig that does not lie wholly inside the picture (empty: nothing is cut)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    out = []
    for t in labels(fig):
        e = t.get_window_extent(renderer)
        if e.x0 < box.x0 - 0.5 or e.y0 < box.y0 - 0.5 or e.x1 > box.x1 + 0.5 or e.y1 > box.y1 + 0.5:
            out.append(t.get_text())
    return out


def save(fig, path: Path) -> Path:
    """Write fig as PNG; refuses (SystemExit) a picture whose labels are cut at its edges."""
    import matplotlib.pyplot as plt

    cut = texts_outside(fig)
    if cut:
        plt.close(fig)
        raise SystemExit(f"{path.name}: labels cut at the picture's edge: {cut}")
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return path


def user_models(folder: Path | None = None) -> list[dict]:
    """USER_MODELS' entries of benchmarks/configs (name, config.json numbers, sources), in that order."""
    import memory

    by_name = {m["name"]: m for m in (memory.load_models(folder) if folder else memory.load_models())}
    return [by_name[n] for n in USER_MODELS if n in by_name]


def memory_curves(models: list[dict], contexts: list[int] = MEMORY_CONTEXTS) -> dict[str, dict[str, list[int]]]:
    """{model name: {cache: KV bytes at each context}} from tq_mlx.planner.memory's formulas."""
    from tq_mlx import TurboQuantConfig
    from tq_mlx.planner.display import config_label
    from tq_mlx.planner.memory import estimate_kv_bytes

    default = TurboQuantConfig()
    caches = {"float16": {}, "mlx-lm affine 8-bit": {"kv_bits": 8}, "mlx-lm affine 4-bit": {"kv_bits": 4},
              f"TurboQuant default ({config_label(default)})": {"config": default}}
    return {m["name"]: {name: [estimate_kv_bytes(m["config"], c, **kw) for c in contexts] for name, kw in caches.items()}
            for m in models}


MEMORY_TICKS = [0, 32768, 65536, 131072, 196608, 262144]


def _gb_label(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def memory_figure(models: list[dict], contexts: list[int] = MEMORY_CONTEXTS) -> dict:
    """Everything the memory picture draws, as data: per model its title and each cache's curve (KV bytes at
    every context) with its end label, and the picture's labels. docs/memory_vs_context.json keeps this."""
    import memory

    from tq_mlx.models.architectures import attention_layout

    curves = memory_curves(models, contexts)
    panels = []
    for m in models:
        lay = attention_layout(m["config"])
        panels.append({
            "title": f"{m['name']}: {len(lay.full_layers)} attention layers, "
                     f"{lay.n_kv_heads} KV heads x {lay.head_dim}",
            "curves": {cache: {"bytes": ys, "label": _gb_label(ys[-1])} for cache, ys in curves[m["name"]].items()},
        })
    return {
        "suptitle": "KV cache of one sequence against context (tq_mlx.planner.memory.estimate_kv_bytes; benchmarks/configs)",
        "xlabel": "context (tokens)",
        "ylabel": "KV cache, GB",
        "xticks": [[c, memory.ctx_label(c) if c else "0"] for c in MEMORY_TICKS],
        "contexts": contexts,
        "panels": panels,
    }


def plot_memory(models: list[dict], path: Path, contexts: list[int] = MEMORY_CONTEXTS) -> Path:
    """Draw memory_figure(models) to path; every label inside the picture."""
    plt = _pyplot()
    data = memory_figure(models, contexts)
    cols = 3
    rows = -(-len(data["panels"]) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(14.5, 4.3 * rows), squeeze=False)
    style = [("black", "-", 2.0), ("dimgray", "--", 1.6), ("dimgray", ":", 1.8), ("tab:red", "-", 2.4)]
    for ax, panel in zip(axes.flat, data["panels"]):
        for (cache, curve), (color, ls, lw) in zip(panel["curves"].items(), style):
            ys = curve["bytes"]
            ax.plot(contexts, [y / 1e9 for y in ys], color=color, ls=ls, lw=lw, label=cache)
            ax.annotate(curve["label"], (contexts[-1], ys[-1] / 1e9), textcoords="offset points", xytext=(4, 0),
                        fontsize=8.5, color=color, va="center")
        ticks = [c for c, _ in data["xticks"]]
        ax.set_xticks(ticks, [lab for _, lab in data["xticks"]])
        ax.set_xlim(0, contexts[-1] * 1.25)
        ax.set_ylim(0, None)
        ax.set_title(panel["title"], fontsize=10)
        ax.set_xlabel(data["xlabel"], fontsize=9)
        ax.set_ylabel(data["ylabel"], fontsize=9)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(data["panels"]):]:
        ax.axis("off")
    # one legend for all, under the title, where it covers no curve
    fig.suptitle(data["suptitle"], fontsize=12, y=0.995)
    fig.legend(*axes.flat[0].get_legend_handles_labels(), loc="upper center", ncol=4, fontsize=9.5,
               bbox_to_anchor=(0.5, 0.965), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.945))
    return save(fig, path)


FIGURES = ("kl_vs_bits", *PEERS_FIGURES, "memory_vs_context")


def load_inputs(results: Path = common.RESULTS, configs: Path | None = None) -> dict:
    """What the pictures are drawn from: long_context.json, tqplus.json and USER_MODELS' entries of
    benchmarks/configs."""
    read = lambda name: json.loads((Path(results) / name).read_text())  # noqa: E731
    return {"long_context": read("long_context.json"), "tqplus": read("tqplus.json"), "models": user_models(configs)}


def figure_data(name: str, inputs: dict) -> dict:
    """The data the picture `name` draws (kl_figure or memory_figure): what its sidecar JSON holds."""
    lc = inputs["long_context"]
    if name == "kl_vs_bits":
        return kl_figure(lc)
    if name in PEERS_FIGURES:
        return kl_figure(lc, PEERS_MODEL, PEERS_FIGURES[name], (PEERS_TEXT,), inputs["tqplus"])
    return memory_figure(inputs["models"])


def draw(name: str, inputs: dict, out: Path) -> Path:
    """Write out/<name>.png and its sidecar out/<name>.json (the data drawn and the PNG's sha256)."""
    data = figure_data(name, inputs)
    path = out / f"{name}.png"
    png = plot_memory(inputs["models"], path) if name == "memory_vs_context" else plot_kl(data, path)
    side = {"png_sha256": hashlib.sha256(png.read_bytes()).hexdigest(), **data}
    sidecar(out / f"{name}.json").write_text(dump_json(side))
    return png


def sidecar(path: Path) -> Path:
    return path.with_suffix(".json")


def dump_json(data: dict) -> str:
    """JSON with one list of numbers per line (the curves), so that a changed figure reads as a short diff."""
    text = json.dumps(data, indent=1, ensure_ascii=False)
    return re.sub(r"\[\n\s*(-?[\d.e+-]+(?:,\n\s*-?[\d.e+-]+)*)\n\s*\]",
                  lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text) + "\n"


def check(name: str, inputs: dict, docs: Path = DOCS) -> list[str]:
    """What is stale about docs/<name>.png: its sidecar against the data drawn now, the PNG against the sidecar's
    sha256 (pixels are never compared: a matplotlib upgrade does not fail this)."""
    png, side = docs / f"{name}.png", docs / f"{name}.json"
    if not png.exists() or not side.exists():
        return [f"docs/{name}.png or its .json is missing"]
    stored = json.loads(side.read_text())
    problems = []
    if stored.pop("png_sha256", None) != hashlib.sha256(png.read_bytes()).hexdigest():
        problems.append(f"docs/{name}.png is not the picture docs/{name}.json describes")
    now = json.loads(json.dumps(figure_data(name, inputs)))
    for key in sorted(set(now) | set(stored)):
        if now.get(key) != stored.get(key):
            problems.append(f"docs/{name}.json: {key!r} differs from what the code and results give now")
    return problems


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=str(common.RESULTS), help="folder with long_context.json and tqplus.json")
    ap.add_argument("--configs", default=str(common.BENCH_DIR / "configs"), help="folder of model configs")
    ap.add_argument("--out", default=str(DOCS), help="where the PNGs and their JSON go (default docs/)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if docs/'s pictures are stale")
    args = ap.parse_args(argv)
    inputs = load_inputs(Path(args.results), Path(args.configs))
    if args.check:
        problems = [p for name in FIGURES for p in check(name, inputs, Path(args.out))]
        for p in problems:
            print(p)
        if problems:
            raise SystemExit("stale pictures: python tools/docs/plots.py (or tools/docs/docs_assets.py) redraws them")
        print("pictures up to date")
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in FIGURES:
        print(f"wrote {draw(name, inputs, out)} and its .json")


if __name__ == "__main__":
    main()
