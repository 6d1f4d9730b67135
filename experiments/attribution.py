"""Where a cache's error comes from: keys or values, decayed or fresh tokens, which layers and kv heads.

Feeds a --context-token text through the real cache of a setting (the default unless told) in 512-token chunks,
as long_context.py does, keeping beside it the float keys and values each layer's cache was given. At the last
chunk, every attention layer's queries attend the float tokens (the reference) and the same tokens with parts
replaced by what the cache decodes from its codes:

* all: keys and values as decoded (what the cache attends, to rounding: `actual` is the cache's own output);
* keys / values: one side decoded, the other float;
* keys decayed / keys fresh (values decayed / fresh): only that side's decayed (re-coded at fewer bits) or
  fresh compressed tokens decoded.

Each figure is the relative error of the layer's attention output, ‖o − o_float‖ / ‖o_float‖ over the chunk's
queries, per kv head (its query heads together) and for the layer. A layer's error is not the model's: later
layers may amplify or damp it (long_context.py measures the end, KL).

    python experiments/attribution.py --models qwen05 --texts britannica --context 8192
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

import long_context  # noqa: E402
import long_context_settings as lc_settings  # noqa: E402

from tq_mlx.stream.view import StreamView, decode  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"  # experiments/results/, beside the probes

CHUNK = 512
PARTS = ("all", "keys", "values", "keys decayed", "keys fresh", "values decayed", "values fresh")


def _decoded(view: StreamView, part: str, float_tokens: mx.array) -> mx.array:
    """float_tokens (1, H, T, D) with the compressed tokens of `part` ("all", "decayed", "fresh") replaced by the
    view's decoded codes (positions n_sinks .. n_sinks + n_coded: the cache holds every token, none dropped)."""
    n_s, n_d, n_c = view.n_sinks, view.n_decayed, view.n_coded
    lo, hi = {"all": (0, n_c), "decayed": (0, n_d), "fresh": (n_d, n_c)}[part]
    if hi <= lo:
        return float_tokens
    codes = decode(view, mx.float32)[:, :, lo:hi]
    return mx.concatenate([float_tokens[:, :, : n_s + lo], codes, float_tokens[:, :, n_s + hi:]], axis=2)


def layer_errors(q: mx.array, keys: StreamView, values: StreamView, kf: mx.array, vf: mx.array, scale: float,
                 actual: mx.array) -> dict:
    """Relative output errors {part: (layer, [per kv head])} for queries q (1, Hq, L, D), the last L of T tokens."""
    H, T = kf.shape[1], kf.shape[2]
    Hq, L = q.shape[1], q.shape[2]
    if keys.n_sinks + keys.n_coded + (0 if keys.window is None else keys.window.shape[2]) != T:
        raise RuntimeError("the cache dropped tokens (a bounded cache): attribution needs every token it was fed")
    mask = mx.arange(T)[None] <= mx.arange(T - L, T)[:, None]
    ref = mx.fast.scaled_dot_product_attention(q, kf, vf, scale=scale, mask=mask)

    def err(o: mx.array) -> tuple[float, list[float]]:
        d = ((o - ref) ** 2).reshape(H, Hq // H, L, -1).sum(axis=(1, 2, 3))
        r = (ref ** 2).reshape(H, Hq // H, L, -1).sum(axis=(1, 2, 3))
        return float(mx.sqrt(d.sum() / r.sum())), [float(x) for x in mx.sqrt(d / r)]

    out = {"actual": err(actual.astype(mx.float32))}
    for part in PARTS:
        side, _, which = part.partition(" ")
        which = which or "all"
        k = _decoded(keys, which, kf) if side in ("all", "keys") else kf
        v = _decoded(values, which, vf) if side in ("all", "values") else vf
        out[part] = err(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask))
    return out


def run(key: str, text: str, context: int, setting: str) -> dict:
    from tests.support import real_models

    label, loader, _ = lc_settings.MODELS[key]
    model, tok = getattr(real_models, loader)(mx.float32)
    ids = long_context.text_ids(tok, text, context)
    s = lc_settings.parse_setting(setting)
    cache = long_context.make_cache(model, s)  # installs the attention hook into the model's module
    fed: list[list[tuple[mx.array, mx.array]]] = [[] for _ in cache]
    for i, c in enumerate(cache):
        def shadowed(k, v, _update=c.update_and_fetch, _fed=fed[i]):
            _fed.append((k.astype(mx.float32), v.astype(mx.float32)))
            return _update(k, v)
        c.update_and_fetch = shadowed
    layers: list[dict] = []
    measuring = [False]

    def spy(attend, queries, keys, values, cache, scale, mask, sinks):
        out = attend(queries, keys, values, cache, scale, mask, sinks)
        if measuring[0] and isinstance(keys, StreamView):
            i = len(layers)
            kf = mx.concatenate([k for k, _ in fed[i]], axis=2)
            vf = mx.concatenate([v for _, v in fed[i]], axis=2)
            e = layer_errors(queries.astype(mx.float32), keys, values, kf, vf, scale, out)
            layers.append({"layer": i, "decayed": [keys.n_decayed, values.n_decayed], "coded": keys.n_coded,
                           **{p: {"layer": v[0], "kv_heads": v[1]} for p, v in e.items()}})
        return out

    t0 = time.perf_counter()
    with common.attention_spy(model, spy):
        for a in range(0, context, CHUNK):
            measuring[0] = a == context - CHUNK
            model(mx.array(ids[a:a + CHUNK])[None], cache=cache)
            mx.eval([c.state for c in cache])
            if time.perf_counter() - t0 > 60 and a % (8 * CHUNK) == 0:
                print(f"    ... {a + CHUNK}/{context} tokens, {time.perf_counter() - t0:.0f} s", flush=True)
    mean = {p: float(np.mean([r[p]["layer"] for r in layers])) for p in ("actual", *PARTS)}
    return {"model": label, "text": text, "context": context, "setting": s.name, "layers": layers, "mean": mean,
            "seconds": round(time.perf_counter() - t0, 1)}


def worst_head(r: dict) -> str:
    h = r["all"]["kv_heads"]
    i = int(np.argmax(h))
    return f"{i} ({h[i]:.3f})"


def main() -> None:
    from tests.support.texts import TEXTS

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="qwen05", help=f"comma list of {','.join(lc_settings.MODELS)}")
    ap.add_argument("--texts", default="britannica", help=f"comma list of {','.join(TEXTS)}")
    ap.add_argument("--context", type=int, default=8192, help=f"tokens (a multiple of {CHUNK})")
    ap.add_argument("--setting", default="default", help="a long_context.py --settings key (default: default)")
    ap.add_argument("--out", default=str(RESULTS), help="results folder")
    args = ap.parse_args()
    texts = long_context.text_names(args.texts)
    if args.context % CHUNK or args.context < 4 * CHUNK:
        raise SystemExit(f"--context must be a multiple of {CHUNK}, at least {4 * CHUNK}; got {args.context}")
    t0 = time.perf_counter()
    runs = []
    headers = ["layer", "coded (decayed K/V)", *PARTS, "worst kv head"]
    for key in args.models.split(","):
        for text in texts:
            r = run(key, text, args.context, args.setting)
            runs.append(r)
            rows = [[x["layer"], f"{x['coded']} ({x['decayed'][0]}/{x['decayed'][1]})",
                     *(f"{x[p]['layer']:.3f}" for p in PARTS), worst_head(x)] for x in r["layers"]]
            rows.append(["mean", "", *(f"{r['mean'][p]:.3f}" for p in PARTS), ""])
            print(f"\n{r['model']}, {text}, {args.context} tokens, {r['setting']}: relative error of each layer's "
                  f"attention output on the last {CHUNK} queries (the cache's own: {r['mean']['actual']:.3f} "
                  f"mean)\n\n" + common.markdown_table(headers, rows), flush=True)
    results = {"meta": common.metadata(), "runs": runs, "seconds": round(time.perf_counter() - t0, 1)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attribution.json").write_text(json.dumps(results, indent=1))
    print(f"\nwrote {out / 'attribution.json'} ({results['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
