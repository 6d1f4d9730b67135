"""KV cache memory of real model configurations at long context, and which Macs hold the model plus its cache.

For every model in benchmarks/configs/*.json (config.json numbers with their source): KV bytes at 8k, 32k, 128k
and 256k tokens for float16, mlx-lm's affine QuantizedKVCache at 8 and 4 bits (group 64), and TurboQuant at
4 / 3.5 / 3 / 2.5 bits. Hybrid models (Qwen3.5, Qwen3-Next) count only their full-attention layers; their
linear-attention state is fixed-size and not counted. Sliding-window layers (gpt-oss, Gemma 4) stay float at
min(ctx, window) tokens in every column. Multi-head latent attention models (DeepSeek-V3, Kimi-K2.5,
GLM-4.7-Flash) cache what mlx-lm caches: one "head" of the latent (kv_lora_rank wide, TurboQuant's key stream)
and the rope key (qk_rope_head_dim wide, its value stream) per token and layer.

The TurboQuant figures are read from real TurboQuantKVCache objects: one layer's cache per (kv heads,
key dim, value dim, bits) is filled with random keys and values to each context, block by block as decoding fills it,
and its `nbytes` times the number of attention layers is the model's figure. The script asserts that this
equals tq_mlx.planner.memory.estimate_kv_bytes exactly, for every cell. The float16 and affine figures come from that
formula and are checked against real mlx-lm KVCache / QuantizedKVCache objects at the smallest context.

"Smallest Mac" is the smallest of 16/24/32/48/64/128 GB whose GPU working set (--usable, default 75% of RAM)
holds the weights at 4 bits (params × 4.5 bits: mlx-lm affine 4-bit with group 64) plus the KV cache.

    python benchmarks/memory.py [--quick] [--boundary-layers N] [--no-chart]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import KVCache, QuantizedKVCache  # noqa: E402

from tq_mlx import TurboQuantConfig, TurboQuantKVCache  # noqa: E402
from tq_mlx.models.architectures import attention_layout  # noqa: E402
from tq_mlx.planner.memory import estimate_kv_bytes  # noqa: E402
from tq_mlx.plan import layer_plan  # noqa: E402

CONFIGS = common.BENCH_DIR / "configs"
CONTEXTS = (8192, 32768, 131072, 262144)
QUICK_CONTEXTS = (1024, 4096)
TQ_BITS = (4, 3.5, 3, 2.5)
MAC_GB = (16, 24, 32, 48, 64, 128)
WEIGHT_BITS = 4.5  # mlx-lm affine 4-bit, group 64: 4 bits + a float16 scale and bias per 64 weights
POOL = 4096  # tokens of random K/V reused for filling


def load_models(folder: Path = CONFIGS) -> list[dict]:
    models = []
    for p in sorted(folder.glob("*.json")):
        m = json.loads(p.read_text())
        m["file"] = p.name
        models.append(m)
    if not models:
        raise FileNotFoundError(f"no model configs in {folder}")
    return models


def ctx_label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 else str(n)


def tq_config(bits: float, boundary_layers: int) -> TurboQuantConfig:
    """The library's TurboQuantConfig defaults (window, sinks, centering, norms, step) at `bits` for keys and values,
    without temporal decay: every column prices the same layout (the default's decay is in the README headline)."""
    return TurboQuantConfig.from_bits(bits, boundary_layers=boundary_layers, decay_after=None)


def _capacity(cache: TurboQuantKVCache) -> int:
    return cache.key_stream.capacity if cache.key_stream else 0


def fill_layer(n_kv: int, head_dim: int, value_dim: int, config: TurboQuantConfig, contexts: tuple[int, ...],
               seed: int = 0, chunk: int = POOL, kind: str = "codes") -> dict[int, int]:
    """nbytes of one real TurboQuantKVCache filled with random K/V to each context.

    The buffers end up as a one-shot prefill or token-by-token decoding leaves them (what estimate_kv_bytes
    describes): large chunks go in only while the compressed storage is full to a whole number of `step`s, and
    block-sized chunks (what decoding compresses at a time) realign it otherwise. Large chunks from a misaligned
    buffer would leave it trimmed to the tokens held, i.e. smaller than the formula.
    """
    key = mx.random.key(seed)
    kk, kv = mx.random.split(key)
    # float16, as a Mac model's keys and values are (the cache's float parts keep the model's dtype)
    pool_k = mx.random.normal((1, n_kv, POOL, head_dim), key=kk).astype(mx.float16)
    pool_v = mx.random.normal((1, n_kv, POOL, value_dim), key=kv).astype(mx.float16)
    mx.eval(pool_k, pool_v)
    # kind: the layer's cache as the integration builds it: "latent" (MLA: the rope key at the key bits),
    # "k_eq_v" (one stream, keys derived from the values), else per-head keys and values
    cache = TurboQuantKVCache(config, layer_index=0, fetch="latent" if kind == "latent" else "codes",
                              derive_keys=(lambda v: v) if kind == "k_eq_v" else None)
    K, step = config.compress_block_size, config.step
    big = chunk if step % K == 0 else K
    out, n = {}, 0
    for T in sorted(contexts):
        while n < T:
            aligned = cache.n_coded % step == 0 and _capacity(cache) == cache.n_coded
            m = min(big if aligned else K, T - n)
            a = n % POOL if n % POOL + m <= POOL else 0
            keys, _ = cache.update_and_fetch(pool_k[:, :, a : a + m], pool_v[:, :, a : a + m])
            if getattr(keys, "learn", None) is not None:  # as the hook does: queries for the keys' weights
                keys.learn(pool_k[:, :, a : a + m], keys, None)
            n += m
            mx.eval(cache.held_arrays())
        assert cache.offset == T
        out[T] = cache.nbytes
        out.setdefault("shared", {})[T] = shared_held(cache)
    # the width the keys chose by their error (key_error; None: they kept their bits), which estimate_kv_bytes
    # takes to price this cache exactly (without it, it prices the most a layer may take)
    out["key_width"] = cache.key_bits if cache.key_stream is not None and cache.key_stream.widened else None
    return out


def shared_held(cache) -> dict[str, int]:
    """The codebooks and tables a layer holds that every quantizer of the process shares
    (quantizer.shared_constants: one set per group dim, width and kind), found among its arrays by identity: their
    bytes by "dim/bits/kind". Its nbytes counts them; a model's caches hold each once."""
    from tq_mlx.quant.quantizer import CODE_BITS, shared_constants
    from tq_mlx.quant.trellis import TRELLIS_BITS

    held = {id(a) for a in cache.held_arrays()}
    dims = {d for s in cache.streams for d in (s.dim, s.dim // 4, s.dim - s.dim // 4)}
    out = {}
    for d in sorted(dims):
        for b in CODE_BITS:
            for trellis in (False, True) if b in TRELLIS_BITS else (False,):
                arrays = [a for a in shared_constants(d, b, trellis) if a is not None]
                if all(id(a) in held for a in arrays):
                    out[f"{d}/{b}/{'trellis' if trellis else 'lloyd-max'}"] = sum(a.nbytes for a in arrays)
    return out


def model_bytes(layers: list[dict], ctx: int) -> int:
    """What a model's layers (fill_layer's figures, one per layer) hold together at ctx: each layer's nbytes, the
    constants they share (shared_held) counted once."""
    shared = {k: b for f in layers for k, b in f["shared"][ctx].items()}
    return sum(f[ctx] - sum(f["shared"][ctx].values()) for f in layers) + sum(shared.values())


def _timed_fill(n_kv: int, head_dim: int, value_dim: int, config: dict, contexts, kind: str = "codes"
                ) -> tuple[dict[int, int], float]:
    t = time.perf_counter()
    out = fill_layer(n_kv, head_dim, value_dim, TurboQuantConfig.from_dict(config), tuple(contexts), kind=kind)
    return out, time.perf_counter() - t


def check_mlx_caches(n_kv: int, head_dim: int, value_dim: int, ctx: int) -> dict:
    """Real mlx-lm float16 KVCache and QuantizedKVCache 8/4-bit bytes for one layer at ctx tokens vs the formula."""
    from tq_mlx.planner.memory import affine_kv_bytes, float16_kv_bytes

    k = mx.random.normal((1, n_kv, ctx, head_dim)).astype(mx.float16)
    v = mx.random.normal((1, n_kv, ctx, value_dim)).astype(mx.float16)
    out = {}
    c = KVCache()
    c.update_and_fetch(k, v)
    mx.eval(c.keys, c.values)
    out["float16"] = (c.nbytes, float16_kv_bytes(ctx, n_kv, head_dim, value_dim))
    for bits in (8, 4):
        q = QuantizedKVCache(group_size=64, bits=bits)
        q.update_and_fetch(k, v)
        mx.eval(q.keys, q.values)
        out[f"affine{bits}"] = (q.nbytes, affine_kv_bytes(ctx, n_kv, head_dim, value_dim, bits=bits))
    return out


def geometry(lay) -> tuple[int, int, int]:
    """(kv heads, key dim, value dim) of a model's compressed layers."""
    return lay.n_kv_heads, lay.head_dim, lay.v_head_dim


def layer_kind(lay) -> str:
    """How the model's compressed layers store their tokens: "latent", "k_eq_v" or "codes"."""
    return "latent" if lay.latent else "k_eq_v" if lay.k_eq_v else "codes"


def sliding_float16_bytes(lay, ctx: int) -> int:
    """What the float sliding-window layers hold at ctx (the same in every column)."""
    from tq_mlx.planner.memory import float16_kv_bytes

    H, dk, dv = lay.sliding_geometry
    return sum(float16_kv_bytes(min(ctx, w), H, dk, dv) for _, w in lay.sliding_layers)


def values_per_context(lay, ctx: int) -> int:
    """Key and value entries every cache of the model holds at ctx (the denominator of bits/val)."""
    H, dk, dv = lay.sliding_geometry
    sliding = sum(min(ctx, w) * H * (dk + dv) for _, w in lay.sliding_layers)
    return ctx * len(lay.full_layers) * lay.n_kv_heads * (lay.head_dim + lay.v_head_dim) + sliding


def smallest_mac(total_bytes: float, usable: float) -> int | None:
    for gb in MAC_GB:
        if total_bytes <= usable * gb * 2**30:
            return gb
    return None


def run(args) -> dict:
    contexts = QUICK_CONTEXTS if args.quick else CONTEXTS
    models = load_models()
    t0 = time.perf_counter()

    # Which (kv heads, head_dim, key bits, value bits) caches to fill, and the config of each TurboQuant column.
    configs = {b: tq_config(b, args.boundary_layers) for b in TQ_BITS}
    needed: dict[tuple, TurboQuantConfig] = {}
    for m in models:
        lay = attention_layout(m["config"])
        n_att = len(lay.full_layers)
        for b, cfg in configs.items():
            for a in range(n_att):
                kb, vb = layer_plan(cfg, a, n_att).bits
                needed[(*geometry(lay), kb, vb, layer_kind(lay))] = dataclasses.replace(
                    cfg, key_bits=kb, value_bits=vb, boundary_layers=0)

    fills, fill_rows = {}, []
    jobs = sorted(needed.items(), key=lambda x: (-x[0][0] * (x[0][1] + x[0][2]), -x[0][3]))  # biggest first
    shown = {"codes": "", "latent": ", latent", "k_eq_v": ", K=V"}
    if args.jobs > 1:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(args.jobs) as pool:
            done = pool.starmap(_timed_fill, [(H, dk, dv, cfg.to_dict(), contexts, kind)
                                              for (H, dk, dv, _, _, kind), cfg in jobs])
    else:
        done = [_timed_fill(H, dk, dv, cfg.to_dict(), contexts, kind) for (H, dk, dv, _, _, kind), cfg in jobs]
    for ((H, dk, dv, kb, vb, kind), _), (nbytes, secs) in zip(jobs, done):
        fills[(H, dk, dv, kb, vb, kind)] = nbytes
        fill_rows.append({"kv_heads": H, "head_dim": dk, "value_dim": dv, "key_bits": kb, "value_bits": vb,
                          "kind": kind, "nbytes": {str(c): v for c, v in nbytes.items() if isinstance(c, int)},
                          "key_width": nbytes["key_width"], "seconds": round(secs, 1)})
        print(f"filled one layer ({H} kv heads x {dk}/{dv}{shown[kind]}, K{kb}/V{vb}) to {ctx_label(max(contexts))}: "
              f"{nbytes[max(contexts)] / 1e6:.1f} MB ({secs:.1f} s)", flush=True)

    shapes = sorted({geometry(attention_layout(m["config"])) for m in models})
    mlx_checks = []
    for H, dk, dv in shapes:
        for name, (real, formula) in check_mlx_caches(H, dk, dv, min(contexts)).items():
            mlx_checks.append({"kv_heads": H, "head_dim": dk, "value_dim": dv, "ctx": min(contexts), "cache": name,
                               "nbytes": real, "formula": formula})
            assert real == formula, f"{name} ({H}x{dk}/{dv}) at {min(contexts)}: real {real} != formula {formula}"

    rows, checks = [], 0
    for m in models:
        cfg_json = m["config"]
        lay = attention_layout(cfg_json)
        n_att = len(lay.full_layers)
        weights = m["params"] * WEIGHT_BITS / 8
        caches = [("float16", {}), ("mlx-lm affine 8-bit", {"kv_bits": 8}), ("mlx-lm affine 4-bit", {"kv_bits": 4})]
        caches += [(f"TurboQuant {b}-bit", {"config": configs[b]}) for b in TQ_BITS]
        for label, spec in caches:
            kv, real, exact = {}, {}, {}
            for ctx in contexts:
                est = estimate_kv_bytes(cfg_json, ctx, spec.get("config"), kv_bits=spec.get("kv_bits"))
                kv[ctx] = est
                if "config" in spec:
                    cfg = spec["config"]
                    layers = [fills[(*geometry(lay), *layer_plan(cfg, a, n_att).bits, layer_kind(lay))] for a in range(n_att)]
                    total = model_bytes(layers, ctx) + sliding_float16_bytes(lay, ctx)
                    real[ctx] = total
                    exact[ctx] = estimate_kv_bytes(cfg_json, ctx, cfg, key_widths=[f["key_width"] for f in layers])
                    assert total == exact[ctx] <= est, (f"{m['name']} {label} at {ctx}: real caches hold {total} B, "
                                                        f"formula says {exact[ctx]} B with their key widths, {est} B at "
                                                        f"the most")
                    checks += 1
            fp16 = estimate_kv_bytes(cfg_json, max(contexts))
            rows.append({
                "model": m["name"], "cache": label, "attention_layers": n_att, "layers": lay.n_layers,
                "kv_heads": lay.n_kv_heads, "head_dim": lay.head_dim, "value_dim": lay.v_head_dim,
                "latent": lay.latent, "k_eq_v": lay.k_eq_v, "fetch": lay.fetch,
                "sliding_layers": len(lay.sliding_layers),
                "shared_layers": len(lay.shared_layers), "max_context": lay.max_context,
                "kv_bytes": {str(c): v for c, v in kv.items()},
                "kv_bytes_real": {str(c): v for c, v in real.items()} or None,
                # estimate_kv_bytes with the key widths the real caches chose (kv_bytes: at the most they take)
                "kv_bytes_exact": {str(c): v for c, v in exact.items()} or None,
                "bits_per_value": kv[max(contexts)] * 8 / values_per_context(lay, max(contexts)),
                "ratio_vs_fp16": fp16 / kv[max(contexts)],
                "weights_4bit_bytes": weights,
                "smallest_mac_gb": {str(c): smallest_mac(weights + kv[c], args.usable) for c in contexts},
                "fits_gb": {str(c): [gb for gb in MAC_GB if weights + kv[c] <= args.usable * gb * 2**30] for c in contexts},
            })
    print(f"real TurboQuantKVCache nbytes == estimate_kv_bytes for all {checks} (model, bits, context) cells; "
          f"mlx-lm KVCache/QuantizedKVCache == formula for {len(mlx_checks)} checks", flush=True)
    return {
        "meta": common.metadata(usable_fraction=args.usable, weight_bits=WEIGHT_BITS),
        "contexts": list(contexts), "mac_gb": list(MAC_GB),
        "turboquant_configs": {str(b): c.to_dict() for b, c in configs.items()},
        "models": [{k: m[k] for k in ("name", "hf_repo", "params", "source", "file")} for m in models],
        "rows": rows, "layer_fills": fill_rows, "mlx_checks": mlx_checks, "formula_checks": checks,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def model_label(r: dict) -> str:
    """"Llama-3.1-8B (32/32)", "DeepSeek-V3 (61/61, MLA)", "Gemma-4-31B (10/60, K=V, +50 sliding)"."""
    extra = ", MLA" if r.get("latent") else ", K=V" if r.get("k_eq_v") else ""
    extra += f", +{r['sliding_layers']} sliding" if r.get("sliding_layers") else ""
    extra += f", {r['shared_layers']} shared" if r.get("shared_layers") else ""
    return f"{r['model']} ({r['attention_layers']}/{r['layers']}{extra})"


def table(res: dict) -> tuple[list[str], list[list[str]]]:
    ctxs = res["contexts"]
    headers = ["model (attention layers)", "KV cache", "bits/val"] + [f"KV @{ctx_label(c)}" for c in ctxs]
    headers += ["vs fp16", "smallest Mac " + "/".join(ctx_label(c) for c in ctxs)]
    rows = []
    for r in res["rows"]:
        gb = [r["kv_bytes"][str(c)] / 1e9 for c in ctxs]
        macs = [r["smallest_mac_gb"][str(c)] for c in ctxs]
        rows.append([
            model_label(r) if r["cache"] == "float16" else "",
            r["cache"], f"{r['bits_per_value']:.2f}",
            *[f"{g:.3f} GB" if g < 1 else f"{g:.2f} GB" for g in gb],
            f"{r['ratio_vs_fp16']:.2f}x",
            " / ".join("–" if x is None else str(x) for x in macs),
        ])
    return headers, rows


def chart(res: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no chart: matplotlib is not installed (`pip install matplotlib`, it is not a tq-mlx dependency)")
        return None
    models = [m["name"] for m in res["models"]]
    ctxs = res["contexts"]
    cols = 3
    nrows = -(-len(models) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.8 * nrows), squeeze=False)
    styles = {"float16": ("black", "-"), "mlx-lm affine 8-bit": ("tab:gray", "--"), "mlx-lm affine 4-bit": ("tab:gray", ":")}
    tq_colors = ["tab:blue", "tab:green", "tab:orange", "tab:red"]
    for ax, name in zip(axes.flat, models):
        rs = [r for r in res["rows"] if r["model"] == name]
        for r in rs:
            if r["cache"] in styles:
                color, ls = styles[r["cache"]]
            else:
                color, ls = tq_colors[[f"TurboQuant {b}-bit" for b in TQ_BITS].index(r["cache"])], "-"
            ax.plot(ctxs, [r["kv_bytes"][str(c)] / 1e9 for c in ctxs], color=color, ls=ls, marker="o", ms=3, label=r["cache"])
        w = rs[0]["weights_4bit_bytes"]
        top = max(r["kv_bytes"][str(ctxs[-1])] for r in rs) / 1e9
        for gb in MAC_GB:
            room = (res["meta"]["usable_fraction"] * gb * 2**30 - w) / 1e9
            if 0 < room < top * 1.05:
                ax.axhline(room, color="tab:purple", lw=0.7, alpha=0.6)
                ax.text(ctxs[0], room, f" KV room, {gb} GB Mac", fontsize=7, va="bottom", color="tab:purple")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ctxs, [ctx_label(c) for c in ctxs])
        ax.set_title(f"{name} ({rs[0]['attention_layers']} attention layers)", fontsize=10)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("KV cache (GB)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(models):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"KV cache size vs context (weights 4-bit; {res['meta']['date']})", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="contexts 1k/4k instead of 8k..256k (CI)")
    ap.add_argument("--boundary-layers", type=int, default=TurboQuantConfig().boundary_layers,
                    help="TurboQuant boundary layers at boundary_bits (default: the library default)")
    ap.add_argument("--usable", type=float, default=0.75, help="fraction of a Mac's RAM the GPU may use (default 0.75)")
    ap.add_argument("--no-chart", action="store_true")
    ap.add_argument("--jobs", type=int, default=1, help="processes filling caches in parallel")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = ap.parse_args()

    res = run(args)
    name = "memory-quick" if args.quick else "memory"
    out_dir = Path(args.out) if args.out else common.RESULTS
    res["chart"] = None
    headers, rows, notes = report(res)
    common.write_results(name, res, common.render("Memory", res["meta"], headers, rows, notes, ALIGN), args.out)
    if not args.no_chart and not args.quick:
        try:
            png = chart(res, out_dir / f"{name}.png")
        except Exception as e:  # noqa: BLE001 (the tables are written already; a chart failure must not lose them)
            print(f"no chart: {type(e).__name__}: {e}")
            png = None
        res["chart"] = png.name if png else None
    md = common.render("Memory", res["meta"], headers, rows, notes, ALIGN, extra=chart_link(res))
    print()
    print(common.text_table(headers, rows, ALIGN))
    for n in notes:
        print(f"* {n}")
    jp, mp = common.write_results(name, res, md, args.out)
    print(f"wrote {jp}, {mp}" + (f", {out_dir / res['chart']}" if res["chart"] else "") + f" ({res['seconds']:.0f} s)")


ALIGN = "ll" + "r" * 20  # markdown_table/text_table use as many as there are columns


def chart_link(res: dict, prefix: str = "") -> str:
    return f"![KV cache size vs context]({prefix}{res['chart']})" if res.get("chart") else ""


def report(res: dict) -> tuple[list[str], list[list[str]], list[str]]:
    """The table and its notes, from a results dict alone (readme_tables.py renders saved JSON with it)."""
    headers, rows = table(res)
    cfg = res["turboquant_configs"][str(TQ_BITS[0])]
    notes = [
        "KV bytes for one sequence; hybrid models count only their full-attention layers (attention/total layers in "
        "the first column). bits/val and 'vs fp16' at the longest context.",
        "MLA: multi-head latent attention; every column holds mlx-lm's latent layout (the latent, kv_lora_rank wide, "
        "and the rope key, qk_rope_head_dim wide, per token and layer); TurboQuant compresses the latent as its key "
        "stream and the rope key as its value stream, at the key bits (it enters the scores). K=V (Gemma 4's "
        "attention_k_eq_v): mlx-lm caches keys and values; TurboQuant stores the values alone and derives the keys "
        "on each fetch. '+N sliding': sliding-window layers, float at min(ctx, window) "
        "tokens in every column (float16, by the formula, not a filled cache).",
        f"TurboQuant columns: TurboQuantConfig defaults (window {cfg['window']} float16 tokens, {cfg['sinks']} sinks, "
        f"centering {cfg['center_keys']}/{cfg['center_values']}, boundary layers {cfg['boundary_layers']}); "
        f"figures are tq_mlx.planner.memory.estimate_kv_bytes, which prices keys that take their widths by their error "
        f"(key_output_error {cfg.get('key_output_error')}, key_error {cfg.get('key_error')}) at the most they take (K6): "
        f"what a plan says. Real TurboQuantKVCache "
        f"objects (one layer per geometry and bit width, filled to each context with random keys and the queries "
        f"that weigh them, times the attention layers) hold exactly what it gives with the widths they chose, never "
        f"more than the figure, asserted in all {res['formula_checks']} cells. float16 and affine figures: the same "
        f"module's formulas, checked against real "
        f"mlx-lm KVCache / QuantizedKVCache at {ctx_label(min(res['contexts']))}.",
        f"Smallest Mac: weights at 4 bits (params x {res['meta']['weight_bits']} bits, an estimate) plus the KV cache "
        f"within {res['meta']['usable_fraction']:.0%} of RAM (about macOS's default GPU working set; `sysctl "
        "iogpu.wired_limit_mb` raises it); '–' = not even 128 GB. Contexts past a model's trained length are shown "
        "for scale.",
        "Model numbers and their sources: benchmarks/configs/*.json.",
    ]
    return headers, rows, notes


if __name__ == "__main__":
    main()
