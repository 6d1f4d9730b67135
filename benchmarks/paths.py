"""What each fetch path costs per decode step: one attention layer's update_and_fetch + attention at a context,
for mlx-lm's float KVCache, TurboQuant on the codes, the latent path (MLA decode: one view as keys and values,
an additive rope mask), and decode-to-float (the layer's cache decoded to float each step, then
mx.fast.scaled_dot_product_attention). TurboQuant runs `TurboQuantConfig()` as a model gets it: keys centered
before a RoPE (a Llama-style one of 128 dims), weighed by the queries of the first prefill chunk, and (where it
decays) past `decay_after` tokens decayed. Times are this machine's (CPU, reference path; ratios matter, not the absolute
figures): the caches of one layer shape take turns step by step, so load from other processes hits them alike.
The transient is the float bytes a step materializes beyond the cache. tools/docs/readme_tables.py writes the
README's per-path table from results/paths.json.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python benchmarks/paths.py [--quick]
        [--contexts 4096 16384] [--steps 16] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx_lm.models.base import scaled_dot_product_attention as mlx_sdpa  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from tq_mlx import TurboQuantConfig, TurboQuantKVCache  # noqa: E402
from tq_mlx.models.rope import probe  # noqa: E402

from tq_mlx.hook import install_attention_hook  # noqa: E402  (mlx-lm's attention reaches the views, as in a model)

CONFIG = TurboQuantConfig()  # the defaults, as they are (results/paths.json records the config it measured)
CONTEXTS = (4096, 16384)
QUICK_CONTEXTS = (1024, 2048)
CHUNK = 2048  # prefill chunk (mlx-lm's default prefill step)
FLOAT, CODES, LATENT, TO_FLOAT = "mlx-lm float cache", "on the codes", "latent on the codes", "decode-to-float"
# GQA layer: 2 kv heads of 128 dims, 16 query heads. MLA layer: one latent of 512, 16 query heads attending to it
# with the rope scores as an additive mask.
GQA = dict(kv_heads=2, dim=128, q_heads=16)
MLA = dict(kv_heads=1, dim=512, q_heads=16)


class Case(NamedTuple):
    layer: str  # "GQA" or "MLA"
    path: str
    make: Callable[[], object]
    same: bool  # keys are values (MLA: one latent)


def cases() -> list[Case]:
    rope = probe(nn.RoPE(GQA["dim"], base=1e6), GQA["dim"])
    return [
        Case("GQA", FLOAT, KVCache, False),
        Case("GQA", CODES, lambda: TurboQuantKVCache(CONFIG, head_dim=GQA["dim"], rope=rope), False),
        Case("GQA", TO_FLOAT, lambda: TurboQuantKVCache(CONFIG, head_dim=GQA["dim"], fetch="float", rope=rope), False),
        Case("MLA", FLOAT, KVCache, True),
        Case("MLA", LATENT, lambda: TurboQuantKVCache(CONFIG, head_dim=MLA["dim"], fetch="latent"), True),
        Case("MLA", TO_FLOAT, lambda: TurboQuantKVCache(CONFIG, head_dim=MLA["dim"], fetch="float"), True),
    ]


def attend(q, k, v, cache, mask):
    return mlx_sdpa(q, k, v, cache, scale=q.shape[-1] ** -0.5, mask=mask)


def prefill(case: Case, ctx: int):
    """A cache of case's path holding ctx random tokens, fed in CHUNK-token chunks; the first chunk is attended
    by its queries, as a model's prefill does (query weights calibrate on them)."""
    shape = GQA if case.layer == "GQA" else MLA
    B, H, D, Hq = 1, shape["kv_heads"], shape["dim"], shape["q_heads"]
    k = mx.random.normal((B, H, ctx, D), key=mx.random.key(0))
    v = k if case.same else mx.random.normal((B, H, ctx, D), key=mx.random.key(1))
    cache = case.make()
    for a in range(0, ctx, CHUNK):
        kk, vv = cache.update_and_fetch(k[:, :, a : a + CHUNK], v[:, :, a : a + CHUNK])
        if a == 0:
            q = mx.random.normal((B, Hq, kk.shape[2] if isinstance(kk, mx.array) else min(CHUNK, ctx), D),
                                 key=mx.random.key(3))
            mx.eval(attend(q, kk, kk if case.same else vv, cache, "causal"))
        else:
            mx.eval(kk, vv)
    return cache


def step(case: Case, cache, ctx: int, i: int) -> float:
    """Seconds of decode step i (update + attention) on a cache that held ctx tokens."""
    shape = GQA if case.layer == "GQA" else MLA
    B, H, D, Hq = 1, shape["kv_heads"], shape["dim"], shape["q_heads"]
    q = mx.random.normal((B, Hq, 1, D), key=mx.random.key(2))
    nk = mx.random.normal((B, H, 1, D), key=mx.random.key(10 + i))
    mask = mx.zeros((B, Hq, 1, ctx + i + 1)) if case.layer == "MLA" else None
    mx.eval(q, nk, *([] if mask is None else [mask]))
    t0 = time.perf_counter()
    kk, vv = cache.update_and_fetch(nk, nk)
    out = attend(q, kk, kk if case.same else vv, cache, mask)
    mx.eval(out)
    t = time.perf_counter() - t0
    if case.path == CODES:  # what the README claims is measured: the default as a model runs it
        assert kk.weights is not None and kk.rope is not None, "the keys are not weighed or centered before RoPE"
        after = CONFIG.decay_after
        if after is None:  # nothing decays
            assert kk.n_decayed == 0, (ctx, kk.n_decayed)
        elif ctx >= 2 * after or ctx <= after:  # tokens past decay_after decayed
            assert (kk.n_decayed > 0) == (ctx > after), (ctx, kk.n_decayed)
    return t


def measure(contexts, steps: int) -> list[dict]:
    install_attention_hook()
    rows = []
    for ctx in contexts:
        for layer in ("GQA", "MLA"):
            picked = [c for c in cases() if c.layer == layer]
            caches = [prefill(c, ctx) for c in picked]
            times = {c.path: [] for c in picked}
            for i in range(steps + 2):  # the caches take turns, step by step; the first two steps warm up
                for c, cache in zip(picked, caches):
                    t = step(c, cache, ctx, i)
                    if i >= 2:
                        times[c.path].append(t)
            base = sorted(times[FLOAT])[steps // 2]
            for c in picked:
                t = sorted(times[c.path])[steps // 2]
                shape = GQA if layer == "GQA" else MLA
                # decode-to-float: the layer's K and V in float32 (MLA: the latent twice, as the model gets it)
                transient = 2 * ctx * shape["kv_heads"] * shape["dim"] * 4 if c.path == TO_FLOAT else 0
                rows.append(dict(layer=layer, path=c.path, context=ctx, ms=t * 1e3, vs_float=t / base,
                                 transient_bytes=transient))
                print(f"{layer:4s} {ctx:6d} {c.path:22s} {t * 1e3:8.2f} ms  {t / base:5.2f}x float"
                      f"  transient {transient / 2**20:6.1f} MB", flush=True)
            del caches
    return rows


def report(res: dict) -> tuple[list[str], list[list[str]]]:
    headers = ["layer", "path", "context", "ms per step", "vs float", "transient"]
    rows = [[r["layer"], r["path"], str(r["context"]), f"{r['ms']:.2f}", f"{r['vs_float']:.2f}x",
             f"{r['transient_bytes'] / 2**20:.0f} MB"] for r in res["rows"]]
    return headers, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"CI size: contexts {QUICK_CONTEXTS}, 3 steps")
    ap.add_argument("--contexts", type=int, nargs="+", default=None, help=f"default {CONTEXTS}")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps per cache (default 16)")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = ap.parse_args()
    contexts = args.contexts or (QUICK_CONTEXTS if args.quick else CONTEXTS)
    steps = args.steps or (3 if args.quick else 16)
    meta = common.metadata(contexts=list(contexts), steps=steps, gqa=GQA, mla=MLA, dtype="float32")
    res = {"meta": meta, "config": CONFIG.to_dict(), "rows": measure(contexts, steps)}
    headers, rows = report(res)
    md = common.render("Decode step per fetch path", meta, headers, rows, [])
    jp, _ = common.write_results("paths-quick" if args.quick else "paths", res, md, args.out)
    print(f"wrote {jp}")


if __name__ == "__main__":
    main()
