"""What each fetch path costs per decode step: one attention layer's update_and_fetch + attention at a context,
for mlx-lm's float KVCache, TurboQuant on the codes, the latent path (MLA decode: one view as keys and values,
an additive rope mask), and decode-to-float (the layer's cache decoded to float each step, then
mx.fast.scaled_dot_product_attention). Times are this machine's (CPU, reference path; ratios matter, not the
absolute figures) and the transient is the float bytes a step materializes beyond the cache.

    python benchmarks/paths.py [--contexts 4096 16384] [--steps 16] [--json benchmarks/results/paths.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention as mlx_sdpa
from mlx_lm.models.cache import KVCache

from tq_mlx import TurboQuantConfig, TurboQuantKVCache
from tq_mlx.cache import _sdpa
from tq_mlx.integration import tune_malloc

CONFIG = TurboQuantConfig()  # the defaults (results/paths.json records the config it measured)


def _fill(cache, k, v, chunk: int = 2048):
    for a in range(0, k.shape[2], chunk):
        out = cache.update_and_fetch(k[:, :, a : a + chunk], v[:, :, a : a + chunk])
        mx.eval(out)


def step_time(make, shape_kv, shape_q, ctx: int, steps: int, mask_fn=None, keys_are_values=False) -> float:
    """Median seconds of one decode step (update + attention) after a prefill of ctx tokens."""
    B, H, _, Dk = shape_kv
    k = mx.random.normal((B, H, ctx, Dk), key=mx.random.key(0))
    v = k if keys_are_values else mx.random.normal((B, H, ctx, shape_kv[3]), key=mx.random.key(1))
    cache = make()
    _fill(cache, k, v)
    q = mx.random.normal(shape_q, key=mx.random.key(2))
    times = []
    for i in range(steps + 2):
        nk = mx.random.normal((B, H, 1, Dk), key=mx.random.key(10 + i))
        t0 = time.perf_counter()
        kk, vv = cache.update_and_fetch(nk, nk)
        if keys_are_values:
            vv = kk
        mask = mask_fn(ctx + i + 1) if mask_fn else None
        out = (_sdpa if isinstance(cache, TurboQuantKVCache) else mlx_sdpa)(q, kk, vv, cache, scale=Dk**-0.5,
                                                                            mask=mask)
        mx.eval(out)
        times.append(time.perf_counter() - t0)
    return sorted(times[2:])[len(times[2:]) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "paths.json")
    args = ap.parse_args()
    tune_malloc()
    rows = []
    # GQA layer: 2 kv heads of 128 dims, 16 query heads. MLA layer: one latent of 512 plus a 64-wide rope key,
    # 16 query heads attending to the latent.
    gqa_kv, gqa_q = (1, 2, None, 128), (1, 16, 1, 128)
    mla_kv, mla_q = (1, 1, None, 512), (1, 16, 1, 512)
    for ctx in args.contexts:
        cases = [
            ("GQA", "mlx-lm float cache", lambda: KVCache(), gqa_kv, gqa_q, None, False),
            ("GQA", "on the codes", lambda: TurboQuantKVCache(CONFIG, head_dim=128), gqa_kv, gqa_q, None, False),
            ("GQA", "decode-to-float", lambda: TurboQuantKVCache(CONFIG, head_dim=128, fetch="float"), gqa_kv,
             gqa_q, None, False),
            ("MLA", "mlx-lm float cache", lambda: KVCache(), mla_kv, mla_q,
             lambda t: mx.zeros((1, 16, 1, t)), True),
            ("MLA", "latent on the codes", lambda: TurboQuantKVCache(CONFIG, head_dim=512, fetch="latent"), mla_kv,
             mla_q, lambda t: mx.zeros((1, 16, 1, t)), True),
            ("MLA", "decode-to-float", lambda: TurboQuantKVCache(CONFIG, head_dim=512, fetch="float"), mla_kv,
             mla_q, lambda t: mx.zeros((1, 16, 1, t)), True),
        ]
        base = {}
        for layer, path, make, kv, q, mask_fn, same in cases:
            t = step_time(make, kv, q, ctx, args.steps, mask_fn, same)
            base.setdefault(layer, t)
            transient = 0 if path != "decode-to-float" else 2 * ctx * kv[1] * kv[3] * 4  # float32 K and V
            rows.append(dict(layer=layer, path=path, context=ctx, ms=t * 1e3, vs_float=t / base[layer],
                             transient_bytes=transient))
            print(f"{layer:4s} {ctx:6d} {path:22s} {t * 1e3:8.2f} ms  {t / base[layer]:5.2f}x float"
                  f"  transient {transient / 2**20:6.1f} MB", flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"config": CONFIG.to_dict(), "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
