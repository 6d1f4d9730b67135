"""The settings long_context.py measures, by name (BY_KEY, or a spelled-out spec: parse_setting), the name of a
stored row under today's defaults (canonical_name), and their bits/value on one accounting (bits_at,
protection_bits)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (puts the repo on sys.path)
from caches import FLOAT, PEER4, TQ_FULL, TQFULL8V3, Setting, kv_geometry, tq_full, tq_full_bytes  # noqa: E402
from tq_mlx import TurboQuantConfig  # noqa: E402
from tq_mlx.config import bits_label  # noqa: E402
from tq_mlx.quant.quantizer import format_bits  # noqa: E402
from tq_mlx.layout import overflow  # noqa: E402
from tq_mlx.planner.memory import affine_kv_bytes, estimate_kv_bytes, float16_kv_bytes, turboquant_layer_bytes  # noqa: E402
from tq_mlx.plan import layer_plan  # noqa: E402
from tq_mlx.planner.display import boundary_sides_note  # noqa: E402

LONG = 32768
EVAL = 512  # tokens scored at the end of each context

# Settings are spelled out from BASE, the library defaults before decay (K4/V3, 16-bit norms, no decay), so a
# later change of the defaults never changes what a row measures; DEFAULTS spells today's default out
# (tests/test_benchmarks.py checks that DEFAULT is TurboQuantConfig()).
BASE = dict(key_bits=4, value_bits=3, window=768, compress_block=128, sinks=4, boundary_layers=0, boundary_bits=8,
            protect_factor=5.0, protect_bits=8, center_keys=True, center_values=False, qjl=False, norm_bits=16,
            decay_after=None, decay_key_bits=None, decay_value_bits=None, seed=0, weigh_keys=False, key_error=None,
            prefill_as_decode=False, calibration_tokens=None, boundary_sides="kv", key_half_steps=False,
            value_error=None, correct_norms=False, key_output_error=None, norm_steps=16, protect_before_rope=False,
            trellis=False)
# the default until DEFAULT_DATE: K4/V4, keys of tokens 6144 old one bit narrower, norms not corrected
DEFAULTS_1205 = dict(BASE, value_bits=4, norm_bits=8, decay_after=6144, decay_key_bits=3, decay_value_bits=None,
                     center_keys="rope", weigh_keys=True, key_error=0.1, prefill_as_decode=True, window=128,
                     calibration_tokens=768)
# the default until DEFAULT_1206_DATE: K4/V3 with norms corrected, no decay, keys K4-K6 by their logit error
DEFAULTS_1206 = dict(DEFAULTS_1205, value_bits=3, decay_after=None, decay_key_bits=None, correct_norms=True)
# the default until DEFAULT_1206B_DATE: V4 values, keys K3-K6 by their output error, 8-bit norms in the coarse code
DEFAULTS_1206B = dict(DEFAULTS_1206, value_bits=4, key_error=None, key_output_error=0.028)
# the default until DEFAULT_1206C_DATE: ... with the norms' fine code
DEFAULTS_1206C = dict(DEFAULTS_1206B, norm_steps=32)
DEFAULTS = dict(DEFAULTS_1206C, key_output_error=0.024)
UNTIL = "the default until 2026-11-26"  # K4/V3, window 768: the default before it decayed


def tq(key_bits: float, value_bits: float, note: str = "", **over) -> Setting:
    fields = {**BASE, "key_bits": key_bits, "value_bits": value_bits, **over}
    cfg = TurboQuantConfig(**fields)
    extra = []
    if cfg.window != BASE["window"] or cfg.compress_block != BASE["compress_block"]:
        extra.append(f"window {cfg.window}, block {cfg.compress_block_size}")
    if cfg.boundary_layers:
        extra.append(f"boundary_layers={cfg.boundary_layers} at {cfg.boundary_bits:g} bits" + boundary_sides_note(cfg))
    if cfg.protect_factor is None:
        extra.append("no key protection")
    elif cfg.protect_before_rope:
        extra.append("key protection tested before RoPE")
    if cfg.norm_bits != BASE["norm_bits"]:
        extra.append(f"{cfg.norm_bits}-bit norms" + (f" at {cfg.norm_steps} steps an octave"
                                                      if cfg.norm_steps != BASE["norm_steps"] else ""))
    if cfg.decay_after is not None:
        decayed = cfg.decayed_bits if cfg.value_error is None else (cfg.decayed_bits[0], cfg.value_bits)
        extra.append(f"decaying to {bits_label(*decayed)} after {cfg.decay_after}")
    if cfg.center_values != BASE["center_values"]:
        extra.append(centering_tag(cfg.center_values))
    if cfg.center_keys == "rope":
        extra.append("keys centered before RoPE")
    if cfg.weigh_keys:
        extra.append("keys weighed by the queries")
    if cfg.key_error is not None:
        extra.append(f"keys up to K6 above logit error {cfg.key_error:g}"
                     + (" in half steps" if cfg.key_half_steps else ""))
    if cfg.key_output_error is not None:
        extra.append(f"keys K3-K6 within output error {cfg.key_output_error:g}"
                     + (" in half steps" if cfg.key_half_steps else ""))
    if cfg.value_error is not None:
        extra.append(f"old values down to V{cfg.narrowest_value_bits} within output error {cfg.value_error:g}")
    if cfg.value_output_error is not None:
        extra.append(f"values V3-V{format_bits(cfg.value_bits)} within output error {cfg.value_output_error:g}"
                     " in half steps")
    if cfg.correct_norms:
        extra.append("norms corrected" if cfg.correct_norms is True else f"{cfg.correct_norms}' norms corrected")
    if cfg.prefill_as_decode:
        extra.append("prefill read as decode")
    if cfg.trellis:
        extra.append("trellis codes")
    if cfg.first_window > cfg.window:
        extra.append(f"calibrating on {cfg.first_window} tokens")
    if note:
        extra.append(note)
    label = f"TQ {bits_label(cfg.key_bits, cfg.value_bits, cfg.qjl)}" + (f" ({', '.join(extra)})" if extra else "")
    return Setting(label, "tq", config=cfg)


SPEC = re.compile(r"k(?P<kb>[\d.]+)v(?P<vb>[\d.]+)w(?P<window>\d+)b(?P<block>\d+)"
                  r"(?:d(?P<after>\d+)k(?P<dk>\d+)v(?P<dv>\d+))?(?P<n8>n8)?(?P<fine>f)?(?P<rope>r)?(?P<weigh>q)?"
                  r"(?:e(?P<error>[\d.]+))?(?P<half>h)?(?:o(?P<oerror>[\d.]+))?(?:ve(?P<verror>[\d.]+))?(?:vo(?P<voerror>[\d.]+))?(?P<nc>nc(?P<ncside>[kv])?)?(?P<pd>pd)?(?:c(?P<calib>\d+))?(?P<np>np)?(?P<pb>pb)?(?P<tc>tc)?"
                  r"(?:bv(?P<bv_layers>\d+)x(?P<bv_bits>[\d.]+))?$")


def parse_setting(key: str) -> Setting:
    """A --settings key: one of BY_KEY, a spelled-out TurboQuant setting
    k<key bits>v<value bits>w<window>b<compress block>[d<decay_after>k<decay key bits>v<decay value bits>][n8[f]][r][q][e<key error>]
    [h][o<key output error>][ve<value error>][vo<value output error>][nc[k|v]][pd][c<calibration tokens>][np|pb][tc][bv<layers>x<bits>], e.g. k4v3w768b128d2048k3v2n8 (8-bit norms; f: their fine code, 32 steps an octave; r: keys centered before RoPE; q: keys weighed by
    the queries; e0.2: key_error 0.2; h: keys widen in half steps too; o0.014: key_output_error 0.014, the keys' widths K3-K6 by
    their attention-output error; ve0.05: value_error 0.05, the values' decay bits chosen per layer; vo0.05:
    value_output_error 0.05, the values' widths V3-V4 in half steps by their attention-output error; nc: norms
    corrected (nck / ncv: the keys' / the values' alone); pd: prefill read as decode; c768: the first compression
    waits for 768 tokens and calibrates on them; np: no key protection (protect_factor None); pb: the protection tested before RoPE (protect_before_rope); tc: trellis codes (trellis); bv2x4: the values of the first and last 2 attention layers at 4 bits, not decaying), rotation + affine at other bits and windows (rot2w1700: the
    peer at matched bits/value), mlx-vlm's TurboQuant at other bits (peer3, peer2.5), or turboquant-mlx-full's
    TurboQuantKVCache tqfull<key bits>v<value bits>[m<float16 tokens>], bits 1 to 8 (tqfull8v3: its recommended
    K8/V3; tqfull4v4m128: K4/V4 with its first 128 tokens kept in float16, min_tokens_before_quant)."""
    if key in BY_KEY:
        return BY_KEY[key]
    if full := re.fullmatch(r"tqfull(\d+)v(\d+)(?:m(\d+))?", key):
        try:
            return tq_full(int(full[1]), int(full[2]), int(full[3] or 0))
        except ValueError as e:
            raise SystemExit(f"setting {key!r}: {e}") from None
    peer = re.fullmatch(r"(rot|peer)([\d.]+)(?:w(\d+))?", key)
    if peer and peer[1] == "rot" and peer[3] and peer[2] in ("2", "3", "4", "8"):
        return rot(int(peer[2]), int(peer[3]))  # rotation + affine at other bits, with a window of that size
    if peer and peer[1] == "peer" and not peer[3]:
        return Setting(f"peer: mlx-vlm TurboQuant {peer[2]}-bit", "peer", bits=float(peer[2]))
    m = SPEC.match(key)
    if not m:
        raise SystemExit(f"unknown setting {key!r}: expected one of {', '.join(BY_KEY)}, a spec like "
                         f"k4v3w768b128d2048k3v2n8, rot<2|3|4|8>w<window>, peer<bits> or tqfull<k>v<v>[m<tokens>]")
    num = lambda x: float(x) if "." in x else int(x)  # noqa: E731
    over = dict(window=int(m["window"]), compress_block=int(m["block"]))
    if m["after"]:
        dk, dv = int(m["dk"]), int(m["dv"])
        over.update(decay_after=int(m["after"]), decay_key_bits=dk if dk < num(m["kb"]) else None,
                    decay_value_bits=dv if dv < num(m["vb"]) else None)
    if m["n8"]:
        over["norm_bits"] = 8
    if m["fine"]:
        over["norm_steps"] = 32
    if m["rope"]:
        over["center_keys"] = "rope"
    if m["weigh"]:
        over["weigh_keys"] = True
    if m["error"]:
        over["key_error"] = float(m["error"])
    if m["half"]:
        over["key_half_steps"] = True
    if m["oerror"]:
        over["key_output_error"] = float(m["oerror"])
    if m["verror"]:
        over["value_error"] = float(m["verror"])
    if m["voerror"]:
        over["value_output_error"] = float(m["voerror"])
    if m["nc"]:
        over["correct_norms"] = {"k": "keys", "v": "values"}.get(m["ncside"], True)
    if m["pd"]:
        over["prefill_as_decode"] = True
    if m["calib"]:
        over["calibration_tokens"] = int(m["calib"])
    if m["np"]:
        over["protect_factor"] = None
    if m["pb"]:
        over["protect_before_rope"] = True
    if m["tc"]:
        over["trellis"] = True
    if m["bv_layers"]:
        over.update(boundary_layers=int(m["bv_layers"]), boundary_bits=num(m["bv_bits"]), boundary_sides="v")
    s = tq(num(m["kb"]), num(m["vb"]), **over)
    return next((p for p in (*PRESET_ROWS, *EARLIER_PRESETS) if p.config == s.config), s)


def centering_tag(center_values: bool) -> str:
    return "values centered" if center_values else "values not centered"


def canonical_name(row: dict) -> str:
    """A stored TurboQuant row's name under the current defaults. A row of an earlier default (K4/V3 with 16-bit
    norms and no decay; before that with centered values too) says which, and a spelled-out row of today's default
    is the default's row, so rows of either kind never merge into one."""
    cfg, name = row.get("config"), row["setting"]
    if row.get("kind") != "tq" or not cfg:
        return name
    for preset in (*PRESET_ROWS, *EARLIER_PRESETS):  # (a spelled-out row of a preset before: its row too)
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
    """A stored config (fields it predates at their meaning then: 16-bit norms, the coarse code, no decay) equals cfg."""
    full = {"norm_bits": 16, "norm_steps": 16, "decay_after": None, "decay_key_bits": None, "decay_value_bits": None,
            "weigh_keys": False, "key_error": None, "correct_norms": False, "key_half_steps": False,
            "prefill_as_decode": False, "boundary_sides": "kv", "protect_before_rope": False, "trellis": False, **stored}
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
            + (f" ({cfg.boundary_sides})" if cfg.boundary_layers and cfg.boundary_sides != "kv" else "")
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
def _without_bits(fields: dict) -> dict:
    """A defaults dict's other fields (tq takes the bits apart)."""
    return {k: v for k, v in fields.items() if k not in ("key_bits", "value_bits")}


DEFAULT = tq(DEFAULTS["key_bits"], DEFAULTS["value_bits"], "the default", **_without_bits(DEFAULTS))
# the default before its keys' output error target fell to 0.024
DEFAULT_1206C_DATE = "2026-12-06, third"
DEFAULT_1206C = tq(DEFAULTS_1206C["key_bits"], DEFAULTS_1206C["value_bits"], f"the default until {DEFAULT_1206C_DATE}",
                   **_without_bits(DEFAULTS_1206C))
# the default before its 8-bit norms took the fine code (32 steps an octave)
DEFAULT_1206B_DATE = "2026-12-06, later"
DEFAULT_1206B = tq(DEFAULTS_1206B["key_bits"], DEFAULTS_1206B["value_bits"], f"the default until {DEFAULT_1206B_DATE}",
                   **_without_bits(DEFAULTS_1206B))
# the default before its values rose to V4 and its keys took K3-K6 by their output error
DEFAULT_1206_DATE = "2026-12-06"
DEFAULT_1206 = tq(DEFAULTS_1206["key_bits"], DEFAULTS_1206["value_bits"], f"the default until {DEFAULT_1206_DATE}",
                  **_without_bits(DEFAULTS_1206))
# the default before its values fell to V3 (norms corrected) and its keys stopped decaying
DEFAULT_DATE = "2026-12-05"
_1205 = _without_bits(DEFAULTS_1205)
DEFAULT_1205 = tq(DEFAULTS_1205["key_bits"], DEFAULTS_1205["value_bits"], f"the default until {DEFAULT_DATE}", **_1205)
# the default before its window fell to 128 tokens (calibrating on 768 as that window did)
WINDOW_DATE = "2026-12-04"
_WIDE = dict(_1205, window=768, calibration_tokens=None)
DEFAULT_1204 = tq(4, 4, f"the default until {WINDOW_DATE}", **_WIDE)
K4V3 = tq(4, 3, UNTIL)
# the defaults before a prefill chunk's queries read the cache as decode steps would
PREFILL_DATE = "2026-12-03"
_BEFORE = dict(_WIDE, prefill_as_decode=False)
DEFAULT_1203 = tq(4, 4, f"the default until {PREFILL_DATE}", **_BEFORE)
# an earlier default: keys not widened by their error, values decayed to V2 with the keys
DECAY_V2_DATE = "2026-11-27"
DECAY_V2 = tq(4, 4, f"the default until {DECAY_V2_DATE}", **dict(_BEFORE, decay_value_bits=2, key_error=None))
# the default's bits with keys centered before RoPE, not weighed: the default until its keys were weighed
DEFAULT_ROPE = tq(4, 4, **dict(_BEFORE, weigh_keys=False, decay_value_bits=2, key_error=None))
# ... with the key mean taken after RoPE: briefly the default before that
DEFAULT_MEAN = tq(4, 4, **dict(_BEFORE, center_keys=True, weigh_keys=False, decay_value_bits=2, key_error=None))
# the compact preset: K4/V3, 8-bit norms, tokens past 4096 at K2/V2; and its rows from before keys were weighed
_COMPACT = dict(_WIDE, decay_after=4096, decay_key_bits=2, decay_value_bits=2, key_error=None)
COMPACT = tq(4, 3, "compact", **_COMPACT)
COMPACT_1203 = tq(4, 3, f"compact until {PREFILL_DATE}", **dict(_COMPACT, prefill_as_decode=False))
COMPACT_ROPE = tq(4, 3, **dict(_COMPACT, weigh_keys=False, prefill_as_decode=False))
# the quality preset: 8-bit keys, no decay (before, K4/V4 with a larger window: K4V4_N8 below)
_QUALITY = dict(_WIDE, decay_after=None, decay_key_bits=None, decay_value_bits=None, key_error=None)
QUALITY = tq(8, 4, "quality", **_QUALITY)
QUALITY_1203 = tq(8, 4, f"quality until {PREFILL_DATE}", **dict(_QUALITY, prefill_as_decode=False))
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
# 8-bit (log-coded) norms pay for a bigger window at the same bits/value at 32k.
K3V3_N8 = tq(3, 3, window=896, compress_block=64, norm_bits=8)
K4V4_N8 = tq(4, 4, window=1696, compress_block=64, norm_bits=8)  # at rotation + affine 4-bit's bits
# Fewer code bits for a large window, compressed 64 at a time, at issue 14's bits/value budgets at 32k (the window
# buffer counts in full either way; so large a window flatters short contexts).
K3V2_W1824 = tq(3, 2, window=1824, compress_block=64)
K2V1_W2240 = tq(2, 1, window=2240, compress_block=64)
# 8-bit norms pay for the window at the lower budget: 2-bit values and a larger window, or 1-bit values and larger
K2V2_W1408_N8 = tq(2, 2, window=1408, compress_block=64, norm_bits=8)
K2V1_W2496_N8 = tq(2, 1, window=2496, compress_block=64, norm_bits=8)
PRESET_ROWS = (DEFAULT, COMPACT, QUALITY)  # a spelled-out setting equal to one of these is that row
EARLIER_PRESETS = (DEFAULT_1206C, DEFAULT_1206B, DEFAULT_1206, DEFAULT_1205, DEFAULT_1204, DEFAULT_1203, DECAY_V2, COMPACT_1203, QUALITY_1203)  # ... or one of these, named by its date
# each preset's row before prefill was read as decode, by module attribute: the same bits, not yet measured on
# every cell since (the README's prose takes such a cell from it and says so)
BEFORE_PREFILL = {"DEFAULT_1204": "DEFAULT_1203", "COMPACT": "COMPACT_1203", "QUALITY": "QUALITY_1203"}
PRESET_NAMES = {p.name for p in PRESET_ROWS}
PRESET_TAGS = ("the default", "compact", "quality")
# the README's headline: the default, the defaults before it (but those of 2026-12-04 and 2026-12-06, later:
# docs/benchmarks.md), compact, quality
HEADLINE_PRESETS = [DEFAULT.name, DEFAULT_1206C.name, DEFAULT_1206.name, DEFAULT_1205.name, DEFAULT_1203.name, DECAY_V2.name,
                    COMPACT.name, COMPACT_1203.name, QUALITY.name, QUALITY_1203.name]
ROT4 = rot(4, 768)  # the window the default had when rot4 was first measured: its rows say so
ROT4_128 = rot(4, 128)
K8V8 = tq(8, 8)
BOUND = tq(4, 4, boundary_layers=2, boundary_bits=8, window=128, compress_block=None)
# named as their rows are stored (caches.py names its own for quality.py's rows)
MLX4 = Setting("mlx-lm affine 4-bit g64 (QuantizedKVCache)", "mlx", bits=4)
MLX8 = Setting("mlx-lm affine 8-bit g64 (QuantizedKVCache)", "mlx", bits=8)

# Most important first.
ALL = [FLOAT, DEFAULT, DEFAULT_1206C, DEFAULT_1206B, DEFAULT_1206, DEFAULT_1205, DEFAULT_1204, DEFAULT_1203, DECAY_V2, DEFAULT_ROPE, K4V3, DEFAULT_MEAN, COMPACT, QUALITY, PREVIOUS, ROT4, K4V4, K4V2, K3V3, K25V2, NO_PROTECT, ROT4_128, K2V2, K4V1, K3V1, K2V2_1024,
       K3V3_N8, K4V4_N8, K3V2_W1824, K2V1_W2240, K2V2_W1408_N8, K2V1_W2496_N8, K8V8, BOUND, MLX4, MLX8, PEER4, TQFULL8V3]
FIRST = 15  # ALL[:FIRST] on every text before the rest on any
QUICK = [FLOAT, DEFAULT, PREVIOUS, ROT4, MLX4]
BY_KEY = {"float": FLOAT, "default": DEFAULT, "default-1206c": DEFAULT_1206C, "default-1206b": DEFAULT_1206B, "default-1206": DEFAULT_1206, "default-1205": DEFAULT_1205, "default-1204": DEFAULT_1204, "default-1203": DEFAULT_1203, "default-1127": DECAY_V2, "k4v3": K4V3, "default-rope": DEFAULT_ROPE, "default-mean": DEFAULT_MEAN, "compact": COMPACT, "compact-1203": COMPACT_1203, "quality": QUALITY, "quality-1203": QUALITY_1203, "previous": PREVIOUS, "noprotect": NO_PROTECT, "k4v4": K4V4,
          "k4v2": K4V2, "k3v3": K3V3, "k2.5v2": K25V2, "k2v2": K2V2, "k4v1": K4V1, "k3v1": K3V1, "k3v3n8": K3V3_N8, "k4v4n8": K4V4_N8, "k3v2w1824": K3V2_W1824,
          "k2v1w2240": K2V1_W2240, "k2v2w1408n8": K2V2_W1408_N8, "k2v1w2496n8": K2V1_W2496_N8,
          "k2v2w1024": K2V2_1024, "rot4": ROT4, "rot4w128": ROT4_128, "k8v8": K8V8,
          "boundary": BOUND, "mlx4": MLX4, "mlx8": MLX8, "peer4": PEER4,
          "tqfull8v3": TQFULL8V3}

MODELS = {
    "smollm2": ("SmolLM2-135M-Instruct", "load_smollm2", "smollm2_path"),
    "qwen05": ("Qwen2.5-Coder-0.5B-Instruct", "load_qwen25_coder_05b", "qwen25_coder_05b_path"),
    "qwen15": ("Qwen2.5-Coder-1.5B-Instruct", "load_qwen25_coder_15b", "qwen25_coder_15b_path"),
}
# max_position_embeddings of each model's config: contexts past it are measured, but are no quality target
TRAINED_CONTEXT = {"smollm2": 8192, "qwen05": 32768, "qwen15": 32768}

# --- bits/value on one accounting ---------------------------------------------------------------------------------


def bits_at(s: Setting, model_config: dict, ctx: int) -> float | None:
    """bits/value at ctx tokens, float parts in float16 (None for mlx-vlm's peer: see the measured figure;
    turboquant-mlx-full's from caches.tq_full_bytes, which the arrays it holds match); TurboQuant's with every
    layer's keys at the configured bits (protection_bits adds what the layers chose: the † figures)."""
    n_att, H, D = kv_geometry(model_config)
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
    elif s.kind == "peer" and s.peer == TQ_FULL:
        b = tq_full_bytes(s, ctx, (n_att, H, D))
    else:
        return None
    return common.bits_per_value(b, ctx, (n_att, H, D))


def row_config(cfg: dict) -> TurboQuantConfig:
    """The TurboQuantConfig a results row records (its "config", less the benchmark's own "block")."""
    return TurboQuantConfig.from_dict({k: v for k, v in cfg.items() if k != "block"})


def replan(m: dict, model_config: dict) -> int:
    """A results file's model m with its TurboQuant rows' planned bits/value (bits at each context and bits_32k) by
    bits_at again, with the planner as it is now (a row keeps what its run measured: bits_real, widths). The other
    kinds' figures do not come from the planner of TurboQuant caches and stand. Returns how many figures changed."""
    changed = 0
    for r in m["rows"]:
        if r.get("kind") != "tq" or not r.get("config"):
            continue
        s = Setting(r["setting"], "tq", config=row_config(r["config"]))
        bits = {c: bits_at(s, model_config, int(c)) for c in r["bits"]}
        bits_32k = bits_at(s, model_config, LONG)
        changed += sum(b != r["bits"][c] for c, b in bits.items()) + (bits_32k != r.get("bits_32k"))
        r["bits"], r["bits_32k"] = bits, bits_32k
    return changed


def chosen_widths(r: dict, part: str) -> dict[int, int]:
    """The bits each layer chose in a row's texts (part "key_widths" or "value_widths": [layer, bits] pairs), the
    most over the texts."""
    widths: dict[int, int] = {}
    for c in r["texts"].values():
        for layer, b in c.get(part, ()):
            widths[layer] = max(b, widths.get(layer, 0))
    return widths


def protection_bits(r: dict, g: dict, ctx: int) -> float:
    """What the layers that protected their keys or widened them add to a TurboQuant row's bits/value at ctx
    tokens: their key streams at protect_bits, not decaying, or at the bits they chose, decaying a step; and what
    the layers whose old values chose fewer bits (value_error) take off the value bits bits_at prices them at
    (tq_mlx.planner.memory.turboquant_layer_bytes; every such layer at the most bits over the row's texts)."""
    n = max((len(c.get("protected_layers", ())) for c in r["texts"].values()), default=0)
    widths, values = chosen_widths(r, "key_widths"), chosen_widths(r, "value_widths")
    cfg = r.get("config")
    if not (n or widths or values) or not cfg:
        return 0.0
    D, H, n_att = g["head_dim"], g["kv_heads"], g["attention_layers"]
    config = row_config(cfg)
    args = (ctx, H, D, D, config.key_bits, config.value_bits, config)
    decay = dict(decay_bits=layer_plan(config, n_att // 2, n_att).decay_bits)
    # layers' own bytes here; the codebooks and tables the layers share (bits_at priced the base's) once, after
    base_held: dict = {}
    base = turboquant_layer_bytes(*args, **decay, shared=base_held)
    held = dict(base_held)
    extra = n * (turboquant_layer_bytes(*args, protected=True, **decay, shared=held) - base) if n else 0
    extra += sum(turboquant_layer_bytes(*args, key_width=b, **decay, shared=held) - base for b in widths.values())
    kept = turboquant_layer_bytes(*args, value_width=config.value_bits, **decay, shared=dict(held)) if values else 0
    extra += sum(turboquant_layer_bytes(*args, value_width=b, **decay, shared=held) - kept for b in values.values())
    extra += sum(held.values()) - sum(base_held.values())
    return common.bits_per_value(extra, ctx, (n_att, H, D))
