"""Experiments for issue 14's low-bit targets (SmolLM2-135M, KL of the last 512 tokens at 4k/8k).

Not a benchmark of the package: a quantize-dequantize ("fake quant") twin of TurboQuantKVCache that allows
per-layer bits, query-aware per-channel key scaling, weight-aware value scaling and temporal decay, without
touching tq_mlx. Compressed tokens are encoded with tq_mlx's own quantizer (TurboQuantMSE, same seeds as
TurboQuantKVCache: plan.layer_seed), centering (calibration_mean), power-of-two scale (calibration_scale) and
key protection (bias_outlier_factor), calibrated on the first `window` tokens after the sinks exactly as
stream.CompressedStream does; the float buffer then holds the decoded value, and attention is mlx's float SDPA
(the same scores as tq_mlx's attention up to float rounding). Validated against the real cache (the real_*
settings run TurboQuantKVCache itself).

Bits/value at 32k: tq_mlx.planner.memory.turboquant_layer_bytes per layer with that layer's bits (float parts in
float16), plus the per-channel scale vectors (float32 per layer and kv head), plus decay's savings.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python experiments/experiments_lowbit.py \
        --texts britannica --settings k3v3w512,... --out experiments/out/NAME
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field, asdict
from pathlib import Path

# the probes beside this one, then the benchmarks' modules they measure with
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "benchmarks")]

import common  # noqa: E402
import mlx.core as mx  # noqa: E402
import mlx_lm.models.llama as mlx_llama  # noqa: E402
from mlx_lm.models.cache import _BaseCache, create_attention_mask  # noqa: E402

import long_context as lc  # noqa: E402
import long_context_settings as lc_settings  # noqa: E402

import caches  # noqa: E402
from tq_mlx import TurboQuantConfig  # noqa: E402
from tq_mlx.plan import layer_seed  # noqa: E402
from tq_mlx.models.architectures import load_model_config  # noqa: E402
from tq_mlx.planner.memory import turboquant_layer_bytes  # noqa: E402
from tq_mlx.quant.quantizer import MSECodes, TurboQuantMSE  # noqa: E402
from tq_mlx.stream.calibration import bias_outlier_factor, calibration_mean, calibration_scale, outlier_order  # noqa: E402
from tq_mlx.layout import overflow  # noqa: E402

N_LAYERS = 30
LONG = 32768


@dataclass
class Spec:
    name: str
    kb: float | list = 4  # key bits, or one per layer
    vb: float | list = 3
    window: int = 768
    block: int = 128
    sinks: int = 4
    kscale: str = "none"  # none | qk (s = (E q²/E k²)^(1/4), queries seen before calibration) | k (E k²^(-1/4))
    vscale: str = "none"  # none | wo (s = (‖W_o col‖² / E v²)^(1/4))
    smax: float = 0.0  # clip s to [1/smax, smax] times its geometric mean (0: no clip)
    decay: list = field(default_factory=list)  # [(age_tokens, kb, vb)]: compressed tokens older than age re-encoded
    norm_bits: int = 16  # 8: norms stored as 8-bit log2 codes (1/16 octave steps, ±7.9 octaves around the
    # stream's power-of-two scale; code -128 = 0)
    real: bool = False  # use the real TurboQuantKVCache (validation)

    def bits(self, layer: int) -> tuple[float, float]:
        kb = self.kb[layer] if isinstance(self.kb, list) else self.kb
        vb = self.vb[layer] if isinstance(self.vb, list) else self.vb
        return kb, vb


def quantizer(dim: int, bits: float, layer: int, side: int) -> TurboQuantMSE:
    return TurboQuantMSE(dim, bits, seed=layer_seed(0, layer, side))


class FakeTQCache(_BaseCache):
    """A float buffer whose compressed tokens hold their TurboQuant-decoded values (see the module docstring).
    Compression happens in `prepare` (called by the attention wrapper with the chunk's queries)."""

    def __init__(self, spec: Spec, layer: int, wo_colnorm2: mx.array | None = None):
        self.spec, self.layer = spec, layer
        self.kb, self.vb = spec.bits(layer)
        self.keys = self.values = None
        self.offset = 0
        self.n_quant = 0
        self.q2 = None  # sum of q² per (kv head, channel) before calibration
        self.nq = 0
        self.mu = self.nu = self.ks = self.vs = self.kscl = self.vscl = None
        self.qk = self.qv = None
        self.wo = wo_colnorm2
        self.block_bits = []  # per compressed block: (start, end, kb, vb) for decay

    @property
    def nbytes(self):
        return 0

    def update_and_fetch(self, keys, values):
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = mx.concatenate([self.keys, keys], axis=2)
            self.values = mx.concatenate([self.values, values], axis=2)
        self.offset = self.keys.shape[2]
        return self.keys, self.values

    def make_mask(self, N, return_array=False, window_size=None):
        return create_attention_mask(N, offset=self.offset - N, return_array=return_array, window_size=window_size)

    def observe(self, queries):
        if self.n_quant:
            return
        B, Hq, L, D = queries.shape
        H = self.keys.shape[1]
        q = queries.astype(mx.float32).reshape(B, H, Hq // H, L, D)
        s = mx.sum(q * q, axis=(0, 2, 3))
        self.q2 = s if self.q2 is None else self.q2 + s
        self.nq += B * (Hq // H) * L

    def _channel_scale(self, x, mean, which):
        """(H, D) scale s with geometric mean 1, or None."""
        d = x - mean[:, :, None, :] if mean is not None else x
        e2 = mx.mean(d * d, axis=(0, 2)) + 1e-12  # (H, D)
        if which in ("qk", "qkp"):
            num = self.q2 / self.nq + 1e-12
        elif which == "k":
            num = mx.ones_like(e2)
        elif which == "wo":
            num = self.wo + 1e-12
        else:
            return None
        if which.endswith("p") or which == "k":
            # RoPE (non-traditional) rotates channel pairs (j, j + D/2) by position-dependent angles: a scale
            # equal on both channels of a pair commutes with it, so statistics pooled per pair hold at any position
            h = num.shape[-1] // 2
            num = mx.concatenate([num[:, :h] + num[:, h:]] * 2, axis=-1)
            e2 = mx.concatenate([e2[:, :h] + e2[:, h:]] * 2, axis=-1)
        s = (num / e2) ** 0.25
        s = s / mx.exp(mx.mean(mx.log(s), axis=-1, keepdims=True))
        if self.spec.smax:
            s = mx.clip(s, 1 / self.spec.smax, self.spec.smax)
        return s

    def _calibrate(self):
        S, W = self.spec.sinks, self.spec.window
        D = self.keys.shape[3]
        ck = self.keys[:, :, S : S + W].astype(mx.float32)
        cv = self.values[:, :, S : S + W].astype(mx.float32)
        self.mu, self.nu = calibration_mean(ck), calibration_mean(cv)
        kb = self.kb
        if kb < 8 and mx.max(bias_outlier_factor(ck, self.mu)).item() > 5.0:
            kb = self.kb = 8  # key protection, as the package does
        self.kscl = self._channel_scale(ck, self.mu, self.spec.kscale)
        if self.q2 is not None:
            # score-error proxy per kv head: E‖q‖²·E‖k-μ‖²/D (·ε of the bits), and the gain of the qk scaling
            Q = self.q2 / self.nq
            dk = ck - self.mu[:, :, None, :]
            K = mx.mean(dk * dk, axis=(0, 2))
            plain = mx.sum(Q, -1) * mx.sum(K, -1) / D / D
            gain = mx.sum(mx.sqrt(Q * K), -1) ** 2 / (mx.sum(Q, -1) * mx.sum(K, -1))
            dv = cv - self.nu[:, :, None, :]
            self.stats = {"score_err": plain.tolist(), "qk_gain": gain.tolist(),
                          "v_ms": mx.mean(dv * dv, axis=(0, 2, 3)).tolist()}
        self.vscl = self._channel_scale(cv, self.nu, self.spec.vscale)
        if self.kscl is not None:
            ck = (ck - self.mu[:, :, None, :]) * self.kscl[None, :, None, :] + self.mu[:, :, None, :]
        if self.vscl is not None:
            cv = (cv - self.nu[:, :, None, :]) * self.vscl[None, :, None, :] + self.nu[:, :, None, :]
        self.ks, self.vs = calibration_scale(ck, self.mu), calibration_scale(cv, self.nu)
        self.qk = quantizer(D, kb, self.layer, 0)
        self.qv = quantizer(D, self.vb, self.layer, 1)
        self.kperm = outlier_order(ck, self.mu, self.qk)
        self.vperm = outlier_order(cv, self.nu, self.qv)

    def _fq(self, x, q, mean, scale, chs, perm):
        x = x.astype(mx.float32) - mean[:, :, None, :]
        if chs is not None:
            x = x * chs[None, :, None, :]
        x = x / scale[:, :, None, None]
        if perm is not None:
            x = mx.take_along_axis(x, mx.broadcast_to(perm[None, :, None, :], x.shape), axis=-1)
        c = q.quantize(x)
        if self.spec.norm_bits == 8:
            n = c.norms.astype(mx.float32)
            lvl = mx.clip(mx.round(mx.log2(mx.maximum(n, 1e-30)) * 16), -127, 127)
            c = MSECodes(c.codes, mx.where(n > 0, mx.power(2.0, lvl / 16), 0.0).astype(mx.float16))
        y = q.dequantize(c)
        if perm is not None:
            inv = mx.argsort(perm, axis=-1)
            y = mx.take_along_axis(y, mx.broadcast_to(inv[None, :, None, :], y.shape), axis=-1)
        y = y * scale[:, :, None, None]
        if chs is not None:
            y = y / chs[None, :, None, :]
        return y + mean[:, :, None, :]

    def prepare(self):
        S = self.spec.sinks
        recent = max(0, self.offset - S) - self.n_quant
        n = overflow(recent, self.spec.window, self.spec.block)
        if n:
            if self.n_quant == 0:
                self._calibrate()
            a, b = S + self.n_quant, S + self.n_quant + n
            dt = self.keys.dtype
            k = self._fq(self.keys[:, :, a:b], self.qk, self.mu, self.ks, self.kscl, self.kperm)
            v = self._fq(self.values[:, :, a:b], self.qv, self.nu, self.vs, self.vscl, self.vperm)
            self.keys = mx.concatenate([self.keys[:, :, :a], k.astype(dt), self.keys[:, :, b:]], axis=2)
            self.values = mx.concatenate([self.values[:, :, :a], v.astype(dt), self.values[:, :, b:]], axis=2)
            self.n_quant += n
            self.block_bits.append([a, b, self.kb, self.vb])
        self._decay()

    def _decay(self):
        """Re-encode compressed tokens older than each age threshold at that level's bits, from their decoded
        values (what a real cache would hold), one block at a time."""
        if not self.spec.decay:
            return
        D = self.keys.shape[3]
        for blk in self.block_bits:
            a, b, kb, vb = blk
            age = self.offset - b
            for thr, kb2, vb2 in self.spec.decay:
                if age >= thr and (kb2 < kb or vb2 < vb):
                    dt = self.keys.dtype
                    if kb2 < kb:
                        k = self._fq(self.keys[:, :, a:b], quantizer(D, kb2, self.layer, 0), self.mu, self.ks,
                                     self.kscl, outlier_order(self.keys[:, :, a:b].astype(mx.float32), self.mu,
                                                              quantizer(D, kb2, self.layer, 0)))
                        self.keys = mx.concatenate([self.keys[:, :, :a], k.astype(dt), self.keys[:, :, b:]], axis=2)
                        kb = kb2
                    if vb2 < vb:
                        v = self._fq(self.values[:, :, a:b], quantizer(D, vb2, self.layer, 1), self.nu, self.vs,
                                     self.vscl, None)
                        self.values = mx.concatenate([self.values[:, :, :a], v.astype(dt), self.values[:, :, b:]],
                                                     axis=2)
                        vb = vb2
                    blk[2], blk[3] = kb, vb


def fake_cache_attention(attend, queries, keys, values, cache, scale, mask, sinks):
    """Attention of a llama layer (through common.wrap_attention): a FakeTQCache hands its decoded tokens over."""
    if isinstance(cache, FakeTQCache):
        cache.observe(queries)
        cache.prepare()
        keys, values = cache.keys, cache.values
    return attend(queries, keys, values, cache, scale, mask, sinks)


def install_wrapper():
    if getattr(mlx_llama.scaled_dot_product_attention, "around", None) is not fake_cache_attention:
        common.wrap_attention(mlx_llama, fake_cache_attention)  # for the rest of the process


def wo_colnorms(model, layer: int, H: int, D: int) -> mx.array:
    """‖W_o[:, j]‖² per (kv head, channel): o_proj input channels of the query heads sharing a kv head, summed."""
    w = model.layers[layer].self_attn.o_proj.weight.astype(mx.float32)  # (hidden, n_heads·D)
    c = mx.sum(w * w, axis=0)  # (n_heads·D)
    nq = c.shape[0] // D
    return mx.sum(c.reshape(H, nq // H, D), axis=1)


def make_caches(model, spec: Spec, H: int, D: int):
    if spec.real:
        cfg = TurboQuantConfig(key_bits=spec.kb, value_bits=spec.vb, window=spec.window,
                               compress_block=spec.block, sinks=spec.sinks, norm_bits=16, decay_after=None)
        return caches.make_cache(model, caches.Setting(spec.name, "tq", config=cfg))
    install_wrapper()
    return [FakeTQCache(spec, i, wo_colnorms(model, i, H, D) if spec.vscale == "wo" else None)
            for i in range(len(model.layers))]


def bits_at(spec: Spec, mcfg: dict, ctx: int = LONG) -> float:
    n_att, H, D = caches.kv_geometry(mcfg)
    cfg = TurboQuantConfig(key_bits=4, value_bits=4, window=spec.window, compress_block=spec.block, sinks=spec.sinks,
                           norm_bits=16, decay_after=None)
    total = 0
    for i in range(n_att):
        kb, vb = spec.bits(i)
        total += turboquant_layer_bytes(ctx, H, D, D, kb, vb, cfg, float_bytes=2)
        total += 4 * H * D * ((spec.kscale != "none") + (spec.vscale != "none"))
    if spec.norm_bits != 16:  # per compressed token (code capacity), head and stream: one norm per group
        n_c = overflow(ctx - min(ctx, spec.sinks), spec.window, spec.block)
        cap = -(-n_c // cfg.step) * cfg.step
        for i in range(n_att):
            groups = sum(1 if b == int(b) else 2 for b in spec.bits(i))
            total -= cap * H * groups * (16 - spec.norm_bits) // 8
    bits = common.bits_per_value(total, ctx, (n_att, H, D))
    if spec.decay:  # compressed tokens of age >= threshold (from the newest token) hold fewer code bits
        S = min(ctx, spec.sinks)
        n_c = overflow(ctx - S, spec.window, spec.block)
        saved = 0
        for i in range(n_att):
            kb0, vb0 = spec.bits(i)
            # per token: its bits are those of the oldest level it reached
            levels = sorted(spec.decay)
            counts = [max(0, min(S + n_c, ctx - thr) - S) for thr, _, _ in levels]  # tokens at age >= thr
            for j, (thr, kb2, vb2) in enumerate(levels):
                n_here = counts[j] - (counts[j + 1] if j + 1 < len(levels) else 0)
                saved += n_here * H * D * ((kb0 - min(kb0, kb2)) + (vb0 - min(vb0, vb2)))
        bits -= common.bits_per_value(saved / 8, ctx, (n_att, H, D))  # saved is in bits
    return bits


def run(args):
    from tests.support import real_models

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jpath = out / "results.json"
    results = json.loads(jpath.read_text()) if jpath.exists() else {"rows": {}}
    model, tok = real_models.load_smollm2(mx.float32)
    mcfg = load_model_config(real_models.smollm2_path())
    lc._MODEL_CONFIG[0] = mcfg
    n_att, H, D = caches.kv_geometry(mcfg)
    contexts = [int(c) for c in args.contexts.split(",")]
    specs = [SPECS[k] for k in args.settings.split(",")]
    for text in args.texts.split(","):
        ids = lc.text_ids(tok, text, max(contexts) + 1)
        t = time.perf_counter()
        rp = Path(f"/tmp/lowbit_ref_{text}_{args.contexts.replace(',', '_')}.npz")
        if rp.exists():
            z = mx.load(str(rp))
            ref = {c: z[f"lp{c}"] for c in contexts}
            ref_res = {c: {"ppl": z[f"ppl{c}"].item()} for c in contexts}
        else:
            ref_res, ref = lc.run_pass(model, lc.make_cache(model, lc_settings.FLOAT), ids, contexts, 512, 512, None)
            mx.savez(str(rp), **{f"lp{c}": ref[c] for c in contexts},
                     **{f"ppl{c}": mx.array(ref_res[c]["ppl"]) for c in contexts})
        print(f"{text} float: {[round(r['ppl'], 3) for r in ref_res.values()]} ({time.perf_counter() - t:.0f} s)",
              flush=True)
        for sp in specs:
            t = time.perf_counter()
            cache = make_caches(model, sp, H, D)
            res, _ = lc.run_pass(model, cache, ids, contexts, 512, 512, ref)
            row = results["rows"].setdefault(sp.name, {"spec": asdict(sp), "bits_32k": bits_at(sp, mcfg),
                                                       "texts": {}})
            row["bits_32k"] = bits_at(sp, mcfg)
            if not sp.real:
                row.setdefault("layer_stats", {})[text] = [getattr(c, "stats", None) for c in cache]
            cell = {}
            for c, r in res.items():
                r["ppl_delta_pct"] = 100 * (r["ppl"] / ref_res[c]["ppl"] - 1)
                r.pop("bits_real", None)
                cell[str(c)] = r
            cell["seconds"] = round(time.perf_counter() - t, 1)
            row["texts"][text] = cell
            on_disk = json.loads(jpath.read_text()) if jpath.exists() else {"rows": {}}
            on_disk["rows"].setdefault(sp.name, row)
            on_disk["rows"][sp.name]["texts"].update(row["texts"])
            on_disk["rows"][sp.name].setdefault("layer_stats", {}).update(row.get("layer_stats", {}))
            on_disk["rows"][sp.name]["bits_32k"] = row["bits_32k"]
            on_disk["rows"][sp.name].setdefault("code", {})[text] = common.code_version()  # of the run behind each text
            jpath.write_text(json.dumps(on_disk, indent=1))  # merged: other runs may have written meanwhile
            print(f"{text} {sp.name} bits32k {row['bits_32k']:.3f}: "
                  + ", ".join(f"@{c}: KL {r['kl']:.4f}±{r['kl_se']:.4f} dPPL {r['ppl_delta_pct']:+.1f}%"
                              for c, r in res.items()) + f" ({cell['seconds']} s)", flush=True)
            del cache


SPECS: dict[str, Spec] = {}


def add(name, **kw):
    SPECS[name] = Spec(name, **kw)


# validation: real cache vs the fake twin
add("real_k3v3w512", kb=3, vb=3, window=512, real=True)
add("k3v3w512", kb=3, vb=3, window=512)
add("k4v4w768", kb=4, vb=4, window=768)
add("k2v2w1024", kb=2, vb=2, window=1024)
# idea 1: windows, blocks, sinks
add("k3v3w512b64", kb=3, vb=3, window=512, block=64)
add("k3v3w512s16", kb=3, vb=3, window=512, sinks=16)
add("k3v2w768", kb=3, vb=2, window=768)
add("k4v4w1024", kb=4, vb=4, window=1024)
add("k4v4w1152", kb=4, vb=4, window=1152)
add("k4v4w1152b64", kb=4, vb=4, window=1152, block=64)
add("k2v2w1024b64", kb=2, vb=2, window=1024, block=64)
add("k2v2w1088b64", kb=2, vb=2, window=1088, block=64)
# idea 3: query-aware key scaling, weight-aware value scaling
add("k3v3w512_qk", kb=3, vb=3, window=512, kscale="qk")
add("k3v3w512_k", kb=3, vb=3, window=512, kscale="k")
add("k3v3w512_qk_wo", kb=3, vb=3, window=512, kscale="qk", vscale="wo")
add("k2v2w1024_qk", kb=2, vb=2, window=1024, kscale="qk")
add("k2v2w1024_qk_wo", kb=2, vb=2, window=1024, kscale="qk", vscale="wo")
add("k4v4w768_qk", kb=4, vb=4, window=768, kscale="qk")
add("k4v4w1024_qk", kb=4, vb=4, window=1024, kscale="qk")
# at the budgets: (a) <= 3.5, (b) <= 2.75, (c) <= 4.77 bits at 32k
add("k3v3w512_qkp", kb=3, vb=3, window=512, kscale="qkp")
add("k3v3w512_qkp_c2", kb=3, vb=3, window=512, kscale="qkp", smax=2.0)
add("k3v3w512_wo", kb=3, vb=3, window=512, vscale="wo")
# 8-bit log norms: the bits they save, spent on the window
add("k3v3w768b64n8", kb=3, vb=3, window=768, block=64, norm_bits=8)
add("k3v3w512n8", kb=3, vb=3, window=512, norm_bits=8)
add("k2v2w1392b64n8", kb=2, vb=2, window=1392, block=64, norm_bits=8)
add("k4v4w1504b64n8", kb=4, vb=4, window=1504, block=64, norm_bits=8)
add("k4v4w1248b64n8", kb=4, vb=4, window=1248, block=64, norm_bits=8)
# temporal decay: compressed tokens older than the threshold (tokens) re-encoded from their decoded values
add("k4v3w768b64_dec2k_k3v2", kb=4, vb=3, window=768, block=64, decay=[(2048, 3, 2)])
add("k3v3w768b64_dec2k_k2v2", kb=3, vb=3, window=768, block=64, decay=[(2048, 2, 2)])
add("k3v3w896b64n8", kb=3, vb=3, window=896, block=64, norm_bits=8)
add("k2v2w1424b64n8", kb=2, vb=2, window=1424, block=64, norm_bits=8)
add("k4v4w1632b64n8", kb=4, vb=4, window=1632, block=64, norm_bits=8)
add("k4v4w1696b64n8", kb=4, vb=4, window=1696, block=64, norm_bits=8)
add("k4v4w768b64_dec1k_k3v3", kb=4, vb=4, window=768, block=64, decay=[(1024, 3, 3)])
add("k4v3w1024b64_dec2k_k3v2n8", kb=4, vb=3, window=1024, block=64, decay=[(2048, 3, 2)], norm_bits=8)
add("k3v3w1024b64_dec2k_k2v2n8", kb=3, vb=3, window=1024, block=64, decay=[(2048, 2, 2)], norm_bits=8)
add("k4v3w2496b64n8", kb=4, vb=3, window=2496, block=64, norm_bits=8)
add("k4v3w2240b64", kb=4, vb=3, window=2240, block=64)
add("k3v3w3392b64n8", kb=3, vb=3, window=3392, block=64, norm_bits=8)
add("k3v3w896b64", kb=3, vb=3, window=896, block=64)
add("k3v3w600b32", kb=3, vb=3, window=600, block=32)
add("k3v3w600b64s16", kb=3, vb=3, window=600, block=64, sinks=16)
add("k3v2w1824b64", kb=3, vb=2, window=1824, block=64)
add("k3v2w2112b64n8", kb=3, vb=2, window=2112, block=64, norm_bits=8)
add("k4v3w2656b64", kb=4, vb=3, window=2656, block=64)
add("k2v1w2240b64", kb=2, vb=1, window=2240, block=64)
add("k4v3w1056b64_dec2k_k2v2", kb=4, vb=3, window=1056, block=64, decay=[(2048, 2, 2)])
add("k4v3w1344b64_dec2k_k2v2n8", kb=4, vb=3, window=1344, block=64, decay=[(2048, 2, 2)], norm_bits=8)
add("k4v3w1792b64_dec2k_k3v2", kb=4, vb=3, window=1792, block=64, decay=[(2048, 3, 2)])
add("k3v3w512_qkp_c2", kb=3, vb=3, window=512, kscale="qkp", smax=2.0)
# idea 2: per-layer bits at a fixed total, from the calibration proxy E‖q‖²·E‖k-μ‖²/D² (layer_stats): keys +1 bit
# in the 4 layers where it is largest (18, 27, 16, 25), values -1 bit in the 4 layers of smallest value energy (0-2, 6)
_kb = [4 if i in (18, 27, 16, 25) else 3 for i in range(N_LAYERS)]
_vb = [2 if i in (0, 1, 2, 6) else 3 for i in range(N_LAYERS)]
add("k3v3w600b64_perlayer", kb=_kb, vb=_vb, window=600, block=64)
add("real_k2v1w2240b64", kb=2, vb=1, window=2240, block=64, real=True)
add("real_k3v2w1824b64", kb=3, vb=2, window=1824, block=64, real=True)
add("k3v3w600b64", kb=3, vb=3, window=600, block=64)
add("k3v3w600b64_qk", kb=3, vb=3, window=600, block=64, kscale="qk")
add("k2v2w1136b64", kb=2, vb=2, window=1136, block=64)
add("k2v2w1136b64_qk", kb=2, vb=2, window=1136, block=64, kscale="qk")
add("k4v4w1248b64", kb=4, vb=4, window=1248, block=64)
add("k4v4w1248b64_qk", kb=4, vb=4, window=1248, block=64, kscale="qk")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--texts", default="britannica")
    ap.add_argument("--contexts", default="4096,8192")
    ap.add_argument("--settings", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--table", action="store_true", help="print the table of --out's results.json and exit")
    ap.add_argument("--bits", action="store_true", help="print bits at 32k of the settings and exit")
    args = ap.parse_args()
    if args.table:
        rows = json.loads((Path(args.out) / "results.json").read_text())["rows"]
        print("| setting | bits@32k | KL Brit 4k | KL Brit 8k | KL Hamlet 4k | KL Hamlet 8k | dPPL Brit 4k/8k | dPPL Hamlet 4k/8k |")
        print("|:--|--:|--:|--:|--:|--:|--:|--:|")
        for name, r in rows.items():
            cells, dp = [], []
            for t in ("britannica", "hamlet"):
                c = r["texts"].get(t, {})
                cells += [f"{c[k]['kl']:.4f}" if k in c else "–" for k in ("4096", "8192")]
                dp.append("/".join(f"{c[k]['ppl_delta_pct']:+.1f}%" for k in ("4096", "8192") if k in c) or "–")
            print(f"| {name} | {r['bits_32k']:.3f} | " + " | ".join(cells + dp) + " |")
        return
    if args.bits:
        from tests.support import real_models
        mcfg = load_model_config(real_models.smollm2_path())
        for k in args.settings.split(","):
            print(f"{k}: {bits_at(SPECS[k], mcfg):.3f}")
        return
    run(args)


if __name__ == "__main__":
    main()
