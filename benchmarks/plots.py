"""The pictures in README.md and docs/, drawn from the benchmarks' JSON (matplotlib: `pip install ".[plot]"`).

    python benchmarks/plots.py                 # writes docs/kl_vs_bits.png and docs/memory_vs_context.png
    python benchmarks/plots.py --out /tmp/p    # somewhere else

kl_vs_bits.png: quality against size at 8k tokens, every cache setting and peer of
benchmarks/results/long_context.json on SmolLM2-135M: KL(float ‖ cache) against bits per value, the same
numbers as the long-context table (bits/val @8k, with the layers whose keys protected themselves).

memory_vs_context.png: KV bytes against context for USER_MODELS (from benchmarks/configs/*.json), in float16, in
mlx-lm's affine 8-bit and 4-bit QuantizedKVCache and with TurboQuant's defaults: tq_mlx.memory.estimate_kv_bytes,
which memory.py checks byte for byte against real caches.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

DOCS = common.REPO / "docs"
KL_CONTEXT = 8192
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
    if r["kind"] == "peer":
        return "peer"
    if r["kind"] == "mlx":
        return "mlx-lm affine"
    if r["kind"] == "rot":
        return "rotation + affine"
    import long_context

    return "default" if long_context.canonical_name(r) == long_context.DEFAULT.name else "TurboQuant"


STYLE = {  # family: colour, marker size, legend label
    "default": ("tab:red", 11, "TurboQuant default"),
    "TurboQuant": ("tab:blue", 7, "TurboQuant, other settings"),
    "rotation + affine": ("tab:green", 7, "rotation + affine 4-bit"),
    "mlx-lm affine": ("dimgray", 7, "mlx-lm QuantizedKVCache"),
    "peer": ("tab:orange", 7, "peer: mlx-vlm TurboQuant"),
}
TEXT_MARKER = {"britannica": "o", "hamlet": "^", "kjv": "s"}


def kl_points(lc: dict, model: str = "smollm2", ctx: int = KL_CONTEXT) -> list[dict]:
    """One entry per setting measured at ctx: name, family, bits/value at ctx, KL per text."""
    import long_context

    m = lc["models"][model]
    out = []
    for r in m["rows"]:
        if r["kind"] == "float":
            continue
        kl = {t: max(c[str(ctx)]["kl"], 1e-5) for t, c in r["texts"].items() if isinstance(c.get(str(ctx)), dict)}
        if not kl:
            continue
        bits = r["bits"].get(str(ctx))
        if bits is None:
            bits = (r.get("bits_measured_peer") or {}).get(str(ctx))
        if bits is None:
            continue
        if r["kind"] == "tq":
            bits += long_context.protection_bits(r, m["geometry"], ctx)
        out.append(dict(name=long_context.canonical_name(r), family=_family(r), bits=bits, kl=kl))
    return sorted(out, key=lambda p: (p["bits"], p["name"]))


def plot_kl(lc: dict, path: Path, model: str = "smollm2", ctx: int = KL_CONTEXT) -> Path:
    import long_context

    plt = _pyplot()
    pts = kl_points(lc, model, ctx)
    m = lc["models"][model]
    fig = plt.figure(figsize=(14.5, 7.2))
    ax = fig.add_axes([0.06, 0.09, 0.47, 0.82])
    for i, p in enumerate(pts, 1):
        color, size, _ = STYLE[p["family"]]
        ys = list(p["kl"].values())
        if len(ys) > 1:
            ax.plot([p["bits"]] * 2, [min(ys), max(ys)], color=color, lw=1, alpha=0.5, zorder=1)
        for t, y in p["kl"].items():
            ax.scatter(p["bits"], y, marker="*" if p["family"] == "default" else TEXT_MARKER.get(t, "o"),
                       s=(size * 2.2) ** 2 if p["family"] == "default" else size ** 2, color=color,
                       edgecolor="black" if p["family"] == "default" else "none", zorder=3)
        # settings of (nearly) the same size take turns right and left of their points
        near = [q for q in pts[:i - 1] if abs(q["bits"] - p["bits"]) < 0.05]
        ax.annotate(str(i), (p["bits"], max(ys)), textcoords="offset points", xytext=(-14 if len(near) % 2 else 5, 3),
                    fontsize=8.5, color=color, weight="bold" if p["family"] == "default" else "normal", zorder=4)
    ax.set_yscale("log")
    ax.set_xlabel(f"bits per value at {long_context.ctx_label(ctx)} tokens (16 = float16 cache)", fontsize=11)
    ax.set_ylabel("KL(float ‖ cache), nats (lower is better)", fontsize=11)
    ax.set_title(f"{m['model']}: quality against size at {long_context.ctx_label(ctx)} tokens", fontsize=12)
    ax.grid(alpha=0.3, which="both")
    handles = [plt.Line2D([], [], ls="", marker="*" if f == "default" else "o", ms=s * (1.4 if f == "default" else 1),
                          color=c, label=lab) for f, (c, s, lab) in STYLE.items()]
    handles += [plt.Line2D([], [], ls="", marker=mk, ms=7, color="black", mfc="none",
                           label=long_context.TEXT_LABEL.get(t, t) + " text") for t, mk in TEXT_MARKER.items()
                if any(t in p["kl"] for p in pts)]
    ax.legend(handles=handles, fontsize=8.5, loc="lower left", framealpha=0.9)
    # The numbered key, beside the plot: every setting's full name, so nothing overlaps on the axes.
    key = fig.add_axes([0.555, 0.09, 0.44, 0.82])
    key.axis("off")
    key.set_title("settings (bits/val @8k, number as on the plot)", fontsize=9.5, loc="left")
    step = 1 / max(len(pts), 1)
    for i, p in enumerate(pts, 1):
        key.text(0, 1 - (i - 0.5) * step, f"{i:>2}  {p['bits']:5.2f}  {p['name']}", fontsize=7.8, family="monospace",
                 color=STYLE[p["family"]][0], va="center", transform=key.transAxes,
                 weight="bold" if p["family"] == "default" else "normal")
    fig.text(0.06, 0.015, f"From benchmarks/results/long_context.json ({lc['meta']['date']}). Bar: the spread over "
             "the texts. KL below 1e-5 drawn at 1e-5.", fontsize=8, color="dimgray")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def user_models(folder: Path | None = None) -> list[dict]:
    """USER_MODELS' entries of benchmarks/configs (name, config.json numbers, sources), in that order."""
    import memory

    by_name = {m["name"]: m for m in (memory.load_models(folder) if folder else memory.load_models())}
    return [by_name[n] for n in USER_MODELS if n in by_name]


def memory_curves(models: list[dict], contexts: list[int] = MEMORY_CONTEXTS) -> dict[str, dict[str, list[int]]]:
    """{model name: {cache: KV bytes at each context}} from tq_mlx.memory's formulas."""
    from tq_mlx import TurboQuantConfig
    from tq_mlx.memory import estimate_kv_bytes

    default = TurboQuantConfig()
    caches = {"float16": {}, "mlx-lm affine 8-bit": {"kv_bits": 8}, "mlx-lm affine 4-bit": {"kv_bits": 4},
              f"TurboQuant default (K{default.key_bits:g}/V{default.value_bits:g})": {"config": default}}
    return {m["name"]: {name: [estimate_kv_bytes(m["config"], c, **kw) for c in contexts] for name, kw in caches.items()}
            for m in models}


def plot_memory(models: list[dict], path: Path, contexts: list[int] = MEMORY_CONTEXTS) -> Path:
    import memory

    plt = _pyplot()
    curves = memory_curves(models, contexts)
    cols = 3
    rows = -(-len(curves) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(14, 4.3 * rows), squeeze=False)
    style = [("black", "-", 2.0), ("dimgray", "--", 1.6), ("dimgray", ":", 1.8), ("tab:red", "-", 2.4)]
    by_name = {m["name"]: m for m in models}
    for ax, (name, cs) in zip(axes.flat, curves.items()):
        for (cache, ys), (color, ls, lw) in zip(cs.items(), style):
            ax.plot(contexts, [y / 1e9 for y in ys], color=color, ls=ls, lw=lw, label=cache)
            ax.annotate(f"{ys[-1] / 1e9:.1f} GB" if ys[-1] >= 1e9 else f"{ys[-1] / 1e6:.0f} MB",
                        (contexts[-1], ys[-1] / 1e9), textcoords="offset points", xytext=(4, 0), fontsize=8.5,
                        color=color, va="center")
        from tq_mlx.memory import attention_layout

        cfg = by_name[name]["config"]
        lay = attention_layout(cfg)
        ticks = [0, 32768, 65536, 131072, 196608, 262144]
        ax.set_xticks(ticks, [memory.ctx_label(c) if c else "0" for c in ticks])
        ax.set_xlim(0, contexts[-1] * 1.2)
        ax.set_ylim(0, None)
        ax.set_title(f"{name}: {len(lay.full_layers)} attention layers, {lay.n_kv_heads} KV heads x {lay.head_dim}",
                     fontsize=10)
        ax.set_xlabel("context (tokens)", fontsize=9)
        ax.set_ylabel("KV cache, GB", fontsize=9)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(curves):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8.5, loc="upper left")
    fig.suptitle("KV cache of one sequence against context (tq_mlx.memory.estimate_kv_bytes; "
                 "benchmarks/configs)", fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=str(common.RESULTS), help="folder with long_context.json")
    ap.add_argument("--configs", default=str(common.BENCH_DIR / "configs"), help="folder of model configs")
    ap.add_argument("--out", default=str(DOCS), help="where the PNGs go (default docs/)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lc = json.loads((Path(args.results) / "long_context.json").read_text())
    for p in (plot_kl(lc, out / "kl_vs_bits.png"), plot_memory(user_models(Path(args.configs)),
                                                                 out / "memory_vs_context.png")):
        print(f"wrote {p}")


if __name__ == "__main__":
    main()
