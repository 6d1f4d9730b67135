"""Command lines: tq-generate and tq-server (mlx-lm's generate and server with a TurboQuant KV cache), and the
TurboQuant cache flags they share with tq-chat.

Both commands keep every flag of the mlx-lm command they wrap and add the `--tq-*` flags. The model is patched
as it loads (`mlx_lm.utils.load_model`, which `mlx_lm.utils.load` looks up at call time; for the server,
`ModelProvider._load`), so every mlx-lm code path that builds a cache builds TurboQuant caches
(mlx-lm-integration.md §3). `--kv-bits` alone selects mlx-lm's own affine cache instead; mixing it with `--tq-*`
flags is refused.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Iterator, NoReturn

from .config import AUTO, NORM_BITS, PRESETS, TurboQuantConfig, bits_label
from .quantizer import MSE_BITS, check_bits, format_bits

_ALLOWED_BITS = ", ".join(map(format_bits, MSE_BITS))

# dest -> TurboQuantConfig field, for the flags that map one to one
_FIELDS = {
    "tq_key_bits": "key_bits",
    "tq_value_bits": "value_bits",
    "tq_window": "window",
    "tq_compress_block": "compress_block",
    "tq_sinks": "sinks",
    "tq_boundary_layers": "boundary_layers",
    "tq_boundary_bits": "boundary_bits",
    "tq_seed": "seed",
    "tq_protect_factor": "protect_factor",
    "tq_protect_bits": "protect_bits",
    "tq_norm_bits": "norm_bits",
    "tq_decay_after": "decay_after",
    "tq_decay_key_bits": "decay_key_bits",
    "tq_decay_value_bits": "decay_value_bits",
}
_DESTS = ("tq_preset", "tq_bits", "tq_qjl", "tq_weigh_keys", "tq_no_weigh_keys", "tq_center_keys", "tq_no_center_keys", "tq_center_values", "tq_no_center_values", "tq_no_protect",
          "tq_no_decay", *_FIELDS)


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


def _count_arg(low: int):
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
                   help="a named setting the other --tq-* flags then adjust (bits/value at 32k, head_dim 128): "
                        "quality (K8/V4, window 768, no decay: 6.34), default (K4/V4, window 768, tokens past 6144 "
                        "decaying to K3/V2: 3.17; other bits do not decay unless --tq-decay-* says so), compact "
                        "(K4/V3, tokens past 4096 decaying to K2/V2: 2.58); all with 8-bit norms; their "
                        "measurements are in benchmarks/DEFAULTS.md")
    g.add_argument(*names("--tq-bits", "--bits"), dest="tq_bits", type=bits_arg, metavar="B",
                   help=f"bits per value for keys and values (default: keys {format_bits(d.key_bits)}, values "
                        f"{format_bits(d.value_bits)}, i.e. {bits_label(d.key_bits, d.value_bits, d.qjl)})")
    g.add_argument(*names("--tq-key-bits", "--k-bits"), dest="tq_key_bits", type=bits_arg, metavar="B",
                   help="bits per key value (overrides --tq-bits for keys)")
    g.add_argument(*names("--tq-value-bits", "--v-bits"), dest="tq_value_bits", type=bits_arg, metavar="B",
                   help="bits per value-vector value (overrides --tq-bits for values)")
    g.add_argument("--tq-qjl", dest="tq_qjl", action="store_true",
                   help="keys as TurboQuant_prod: (bits-1) MSE bits + 1 QJL bit (integer key bits 1-4)")
    g.add_argument("--tq-window", dest="tq_window", type=_count_arg(0), metavar="N",
                   help=f"most recent tokens kept in the model's float dtype (default {d.window}; 0 compresses "
                        "every token)")
    g.add_argument("--tq-compress-block", "--tq-block", dest="tq_compress_block", type=_count_arg(1), metavar="N",
                   help="tokens compressed at a time when the window overflows (default: 128, or the window if smaller)")
    g.add_argument("--tq-sinks", dest="tq_sinks", type=_count_arg(0), metavar="N",
                   help=f"first tokens kept in the model's float dtype (default {d.sinks})")
    g.add_argument("--tq-boundary-layers", dest="tq_boundary_layers", type=_count_arg(0), metavar="N",
                   help=f"first and last N attention layers use --tq-boundary-bits (default {d.boundary_layers})")
    g.add_argument("--tq-boundary-bits", dest="tq_boundary_bits", type=bits_arg, metavar="B",
                   help=f"bits of the boundary layers (default {d.boundary_bits})")
    g.add_argument("--tq-protect-factor", dest="tq_protect_factor", type=_factor_arg, metavar="F",
                   help="a layer whose keys' score error along their mean direction is more than F times that of "
                        f"evenly spread keys stores its keys at --tq-protect-bits (default {d.protect_factor:g})")
    g.add_argument("--tq-protect-bits", dest="tq_protect_bits", type=bits_arg, metavar="B",
                   help=f"bits of self-protected keys (default {format_bits(d.protect_bits)})")
    g.add_argument("--tq-no-protect", dest="tq_no_protect", action="store_true",
                   help="never protect keys: every layer keeps the configured bits")
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
                   help=f"bits of each token's stored norm: 16 (float16) or 8 (a log code, within 2.2%%; "
                        f"0.125 bits/value less at head_dim 64) (default {d.norm_bits})")
    g.add_argument("--tq-decay-after", dest="tq_decay_after", type=_count_arg(1), metavar="N",
                   help="temporal decay: compressed tokens at least N tokens old are re-coded at the decay bits "
                        f"(default {d.decay_after} at the default bits, {bits_label(d.key_bits, d.value_bits)}, "
                        "or when decay bits are given; other bits do not decay)")
    g.add_argument("--tq-decay-key-bits", dest="tq_decay_key_bits", type=bits_arg, metavar="B",
                   help="bits keys decay to: an integer below the key bits (default "
                        f"{format_bits(d.decay_key_bits)} at key bits {format_bits(d.key_bits)}, else none)")
    g.add_argument("--tq-decay-value-bits", dest="tq_decay_value_bits", type=bits_arg, metavar="B",
                   help="bits values decay to: an integer below the value bits (default "
                        f"{format_bits(d.decay_value_bits)} at value bits {format_bits(d.value_bits)}, else none)")
    g.add_argument("--tq-no-decay", dest="tq_no_decay", action="store_true",
                   help="keep every compressed token at its bits (no temporal decay)")
    g.add_argument("--tq-seed", dest="tq_seed", type=_count_arg(0), metavar="N",
                   help=f"seed of the rotations (default {d.seed})")
    return parser


def cache_flags_given(args: argparse.Namespace) -> list[str]:
    """The --tq-* flags set on the command line, as option names."""
    return [
        "--" + dest.replace("_", "-")
        for dest in _DESTS
        if getattr(args, dest, None) not in (None, False)
    ]


def config_from_args(args: argparse.Namespace) -> TurboQuantConfig:
    """The TurboQuantConfig the --tq-* flags ask for (TurboQuantConfig's defaults for flags not given).

    Raises ValueError naming the conflict when the combination is invalid (e.g. --tq-qjl with 2.5 bits).
    """
    kw: dict[str, Any] = {}
    bits = getattr(args, "tq_bits", None)
    if bits is not None:
        kw["key_bits"] = kw["value_bits"] = bits
    for dest, name in _FIELDS.items():
        value = getattr(args, dest, None)
        if value is not None:
            kw[name] = value
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
    if getattr(args, "tq_no_protect", False):
        if getattr(args, "tq_protect_factor", None) is not None:
            raise ValueError("--tq-no-protect and --tq-protect-factor contradict each other: give one")
        kw["protect_factor"] = None
    if getattr(args, "tq_center_values", False):
        kw["center_values"] = True
    if getattr(args, "tq_no_center_values", False):
        kw["center_values"] = False
    decay = [d for d in ("tq_decay_after", "tq_decay_key_bits", "tq_decay_value_bits") if getattr(args, d, None)]
    if getattr(args, "tq_no_decay", False):
        if decay:
            raise ValueError(f"--tq-no-decay and --{decay[0].replace('_', '-')} contradict each other: give one")
        kw.update(decay_after=None, decay_key_bits=None, decay_value_bits=None)
    # A side given no more bits than the preset decays it to, or fractional bits, keeps them at every age (decay
    # only ever lowers integer bits).
    # The default preset names no decay of its own: TurboQuantConfig decays the default bits only (K4/V4).
    preset = PRESETS[getattr(args, "tq_preset", None) or "default"]
    for side in ("key", "value"):
        decay_bits = kw.get(f"decay_{side}_bits", preset.get(f"decay_{side}_bits"))
        bits = kw.get(f"{side}_bits")
        if (f"decay_{side}_bits" not in kw and bits is not None and decay_bits not in (None, AUTO)
                and (decay_bits >= bits or bits != int(bits))):  # fractional bits never decay (one rotation)
            kw[f"decay_{side}_bits"] = None
    if kw.get("decay_after", preset.get("decay_after")) is not None and all(
            kw.get(f"decay_{side}_bits", preset.get(f"decay_{side}_bits", AUTO)) is None for side in ("key", "value")):
        kw["decay_after"] = None  # nothing left to decay to
    return TurboQuantConfig.preset(getattr(args, "tq_preset", None) or "default", **kw)


def config_or_error(parser: argparse.ArgumentParser, args: argparse.Namespace) -> TurboQuantConfig | None:
    """config_from_args, with the --kv-bits conflict and invalid combinations reported through parser.error.
    None means "no TurboQuant" (--kv-bits alone: mlx-lm's affine cache)."""
    flags = cache_flags_given(args)
    if getattr(args, "kv_bits", None) is not None:
        if flags:
            parser.error(
                f"--kv-bits selects mlx-lm's own affine KV quantization and cannot be combined with TurboQuant "
                f"flags ({', '.join(flags)}); drop --kv-bits for TurboQuant, or the --tq-* flags for mlx-lm's cache"
            )
        return None
    try:
        return config_from_args(args)
    except ValueError as e:
        parser.error(f"invalid TurboQuant settings: {e}")


def describe_config(config: TurboQuantConfig | None) -> str:
    """One line: "TurboQuant K4/V3, window 768, sinks 4" (or mlx-lm's cache)."""
    if config is None:
        return "mlx-lm cache"
    parts = [f"TurboQuant {bits_label(config.key_bits, config.value_bits, config.qjl)}",
             f"window {config.window}", f"sinks {config.sinks}"]
    if config.boundary_layers:
        parts.append(f"boundary {config.boundary_layers} layers at {format_bits(config.boundary_bits)} bits")
    if config.protect_factor is None:
        parts.append("no key protection")
    if not config.weigh_keys:  # departures from the default's key coding are named, as protection's is
        parts.append("keys not weighed")
    if config.center_keys != "rope":
        parts.append("keys centered after RoPE" if config.center_keys else "keys not centered")
    if config.decay_after is not None:
        parts.append(f"decaying to {bits_label(*config.decayed_bits)} after {config.decay_after} tokens")
    return ", ".join(parts)


def summary_line(prompt_cache) -> str:
    """tq-generate's closing line: KV memory held against mlx-lm's own cache, and what is still in the float
    window (memory.cache_bytes, worded as tq-chat's panel words it)."""
    from .memory import bits_summary, cache_bytes, format_bytes, saving_text, window_text

    s = cache_bytes(prompt_cache)
    parts = [
        f"KV cache: {format_bytes(s['kv_bytes'])} for {s['tokens']:,} tokens",
        f"mlx-lm's {s['kv_dtype'] or 'float'} cache would hold {format_bytes(s['mlx_lm_bytes'])}",
        f"saved {saving_text(s)}",
    ]
    window = window_text(s)
    if window:
        parts.append(window)
    parts.append(bits_summary(prompt_cache))
    if s["other_bytes"]:
        parts.append(f"other cache state {format_bytes(s['other_bytes'])}")
    return "; ".join(parts)


@contextlib.contextmanager
def patched_loading(config: TurboQuantConfig | None) -> Iterator[None]:
    """While active, every model mlx_lm.utils.load / load_model loads is patched with TurboQuant caches."""
    import mlx_lm.utils as utils

    from .integration import patch_model

    original = utils.load_model
    if config is None:
        yield
        return

    def load_model(*args, **kwargs):
        model, model_config = original(*args, **kwargs)
        patch_model(model, config)
        return model, model_config

    utils.load_model = load_model
    try:
        yield
    finally:
        utils.load_model = original


class _Parsed:
    """Stands in for the parser mlx_lm.generate.main builds, returning arguments already parsed."""

    def __init__(self, args: argparse.Namespace):
        self.args = args

    def parse_args(self, *_, **__) -> argparse.Namespace:
        return self.args


def _generate_module():
    # `import mlx_lm.generate as gen` would give the function: mlx_lm/__init__.py re-exports it by that name.
    return importlib.import_module("mlx_lm.generate")


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0][:300] if text else type(error).__name__)


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


def _loading_errors_in_one_line(load, default_model: str):
    """mlx_lm's load, its failures (offline Hub, missing repo, damaged weights) raised as one-line ValueErrors."""

    def wrapped(path, *args, **kwargs):
        try:
            return load(path, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 (any failure to load is the user's model argument or network)
            default = f" (mlx-lm's default when --model is not given)" if path == default_model else ""
            raise ValueError(f"cannot load model {path}{default}: {_first_line(e)}") from None

    return wrapped


def _prompt_cache_loader(args: argparse.Namespace, loaded: dict):
    """gen.main's load_prompt_cache: tq_mlx's loader (it registers TurboQuantKVCache, which mlx-lm's loader looks up
    by name), metadata that tq-chat's /save and hand-made files leave out filled in, the file noted in `loaded`."""
    from .integration import load_prompt_cache

    def load(file_name, return_metadata=False):
        cache, metadata = load_prompt_cache(file_name, return_metadata=True)
        metadata = dict(metadata)
        metadata.setdefault("tokenizer_config", "{}")
        if "model" not in metadata:
            if args.model is None:
                raise ValueError(f"{file_name} does not say which model made it: pass --model")
            metadata["model"] = args.model
        loaded.update(file=file_name, cache=cache)
        return (cache, metadata) if return_metadata else cache

    return load


def compress_float_cache(model, cache: list, config: TurboQuantConfig, file_name: str,
                         chunk: int = 2048) -> tuple[list, int]:
    """A prompt cache of mlx-lm's float KVCaches (mlx_lm cache_prompt's file) as TurboQuant caches: each float
    layer's keys and values are fed, chunk by chunk as a prefill feeds them, into the TurboQuantKVCache the patched
    model builds for that layer; the other layers are kept. Returns (cache, layers compressed). Raises ValueError
    for a layer tq-generate cannot compress (mlx-lm's affine QuantizedKVCache, or a layout the model does not have)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from .cache import TurboQuantKVCache

    fresh = make_prompt_cache(model)
    if len(fresh) != len(cache):
        raise ValueError(f"{file_name}: holds {len(cache)} layer caches, the model has {len(fresh)}")
    out, n = [], 0
    for i, (new, old) in enumerate(zip(fresh, cache)):
        if isinstance(new, TurboQuantKVCache) and type(old) is KVCache:
            if old.offset:
                keys, values = old.keys[..., : old.offset, :], old.values[..., : old.offset, :]
                for at in range(0, old.offset, chunk):
                    new.update_and_fetch(keys[..., at : at + chunk, :], values[..., at : at + chunk, :])
                    mx.eval(new.held_arrays())
            out.append(new)
            n += 1
        elif type(new) is type(old) or isinstance(old, TurboQuantKVCache):
            out.append(old)
        else:
            raise ValueError(
                f"{file_name}: layer {i} holds {type(old).__name__}, which tq-generate cannot turn into "
                f"{type(new).__name__} (a --kv-bits cache cannot be recompressed): run it with mlx_lm.generate, or "
                f"make the file again without --kv-bits"
            )
    return out, n


def generate_parser() -> argparse.ArgumentParser:
    """mlx_lm.generate's parser plus the TurboQuant flags."""
    gen = _generate_module()
    parser = gen.setup_arg_parser()
    parser.prog = "tq-generate"
    parser.description = "mlx_lm.generate with a TurboQuant-compressed KV cache."
    for action in parser._actions:
        if action.dest == "prompt_cache_file":
            action.help = (
                "A prompt cache file to continue from: a TurboQuant file (tq_mlx / tq-chat's /save) keeps its "
                "compressed cache; a float file from `mlx_lm cache_prompt` is converted to TurboQuant as it loads "
                "(the file is unchanged; --kv-bits keeps mlx-lm's cache instead); one from `cache_prompt --kv-bits` "
                "is refused (use mlx_lm.generate)"
            )
    # mlx_lm.generate 0.32.2 has no distributed mode; tq-generate has that of mlx_lm.chat and mlx_lm.server:
    # under mlx.launch the model is sharded across the processes, tensor parallel unless --pipeline.
    try:
        parser.add_argument("--pipeline", action="store_true",
                            help="Use pipelining instead of tensor parallelism (distributed runs under mlx.launch)")
    except argparse.ArgumentError:  # a later mlx_lm.generate has its own
        pass
    return add_cache_args(parser)


def generate_main(argv: list[str] | None = None) -> int:
    """tq-generate: mlx_lm.generate's main with the model patched, then the KV memory summary."""
    if argv is None:  # the real command line: OpenBLAS on Linux CPU (may restart the process)
        from .blas import use_openblas

        use_openblas("tq-generate")
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from .integration import tune_malloc

    tune_malloc()
    gen = _generate_module()
    parser = generate_parser()
    args = parser.parse_args(argv)
    config = config_or_error(parser, args)
    group = mx.distributed.init()
    distributed = group.size() > 1
    if distributed and (args.adapter_path or args.draft_model or getattr(args, "quantize_activations", False)):
        parser.error("--adapter-path, --draft-model and --quantize-activations are not supported in distributed mode")
    try:
        check_model_arg(args.model)
    except ValueError as e:
        print(f"tq-generate: error: {e}", file=sys.stderr)
        return 2
    used: list = []
    loaded: dict = {}  # the --prompt-cache-file, once gen.main has loaded it

    original_generate, original_load, original_load_cache = gen.generate, gen.load, gen.load_prompt_cache

    def generate(model, tokenizer, prompt, verbose=False, **kwargs):
        if loaded and config is not None and kwargs.get("prompt_cache") is loaded["cache"]:
            cache, n = compress_float_cache(model, loaded["cache"], config, loaded["file"], args.prefill_step_size)
            if n:
                from .memory import cache_bytes

                tokens = cache_bytes(cache)["tokens"]
                print(f"tq-generate: {loaded['file']} holds mlx-lm's float cache ({tokens:,} tokens): converted it "
                      f"to {describe_config(config)} for this run (the file is unchanged)", file=sys.stderr, flush=True)
            kwargs["prompt_cache"] = cache
        # Build the cache here, exactly as generate_step / speculative_generate_step would, to read it after.
        if kwargs.get("prompt_cache") is None:
            cache = make_prompt_cache(model, max_kv_size=kwargs.get("max_kv_size"))
            if kwargs.get("draft_model") is not None:
                cache = cache + make_prompt_cache(kwargs["draft_model"])
            kwargs["prompt_cache"] = cache
        used.append((kwargs["prompt_cache"], len(model.layers)))
        return original_generate(model, tokenizer, prompt, verbose=verbose, **kwargs)

    def load(path, tokenizer_config=None, return_config=False, trust_remote_code=False, **_):
        # Distributed: each process loads its shard, as mlx_lm.chat does (sharded_load calls the patched
        # load_model, so the shards build TurboQuant caches of their own heads or layers).
        from mlx_lm.utils import sharded_load

        return sharded_load(path, pipeline_group=group if args.pipeline else None,
                            tensor_group=None if args.pipeline else group, return_config=return_config,
                            tokenizer_config=tokenizer_config, trust_remote_code=trust_remote_code)

    setup = gen.setup_arg_parser
    gen.setup_arg_parser, gen.generate = (lambda: _Parsed(args)), generate
    gen.load_prompt_cache = _prompt_cache_loader(args, loaded)
    gen.load = _loading_errors_in_one_line(load if distributed else original_load, gen.DEFAULT_MODEL)
    try:
        # Every rank computes the same answer; rank 0 prints it.
        with patched_loading(config), open(os.devnull, "w") as null:
            with contextlib.redirect_stdout(null if group.rank() else sys.stdout):
                gen.main()
        if distributed:
            # Generation leaves a step in flight: finish it on every rank before any exits and closes its
            # connections under a peer still receiving.
            mx.synchronize()
            mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu))
    except ValueError as e:
        print(f"tq-generate: error: {e}", file=sys.stderr)
        return 2
    finally:
        gen.setup_arg_parser, gen.generate, gen.load = setup, original_generate, original_load
        gen.load_prompt_cache = original_load_cache
    if used and group.rank() == 0:
        cache, n_layers = used[-1]
        line = summary_line(cache[:n_layers])
        if distributed:
            line += f" (rank 0's shard of {group.size()})"
        print(line, file=sys.stdout if args.verbose else sys.stderr, flush=True)
    return 0


class ContextTooLong(ValueError):
    """A request whose prompt tokens + max_tokens exceed tq-server's context bound (answered with HTTP 400)."""

    def __init__(self, limit: int, prompt_tokens: int, max_tokens: int, param: str = "messages"):
        self.limit, self.prompt_tokens, self.max_tokens, self.param = limit, prompt_tokens, max_tokens, param
        super().__init__(
            f"This server's maximum context length is {limit:,} tokens (--tq-max-context). However, you requested "
            f"{prompt_tokens + max_tokens:,} tokens ({prompt_tokens:,} in the prompt, {max_tokens:,} in the "
            f"completion). Please reduce the length of the messages or completion."
        )

    def body(self) -> dict:
        """OpenAI's error JSON for an over-long context."""
        return openai_error(str(self), param=self.param, code="context_length_exceeded")


def openai_error(message: str, status: int = 400, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object, the one shape of every tq-server error."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def request_error(path: str, body: dict) -> tuple[str, str] | None:
    """(message, param) for a completion request tq-server refuses before mlx-lm reads it, None if it passes:
    `messages` must be a non-empty list of objects with a `role`, `prompt` a non-empty string."""
    if path in ("/v1/chat/completions", "/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return (f"'messages' must be a non-empty list of messages like {{\"role\": \"user\", \"content\": "
                    f"\"hello\"}}, got {json.dumps(messages)[:100]}", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                return (f"'messages[{i}]' must be an object with a 'role' string, got {json.dumps(m)[:100]}",
                        f"messages[{i}]")
    elif path == "/v1/completions":
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            return f"'prompt' must be a non-empty string, got {json.dumps(prompt)[:100]}", "prompt"
    return None


def _openai_error_bytes(data: bytes, handler) -> bytes:
    """An error body mlx_lm.server writes ({"error": "text"}, or b"Not Found") as OpenAI's error object; anything
    else (headers, bodies already in that shape) unchanged."""
    if data.strip() == b"Not Found":
        message = (f"no such endpoint: {handler.command} {handler.path} (tq-server serves POST /v1/chat/completions "
                   f"and /v1/completions, GET /v1/models and /health)")
        return json.dumps(openai_error(message, 404, code="not_found")).encode()
    try:
        body = json.loads(data)
    except ValueError:
        return data
    if not (isinstance(body, dict) and isinstance(body.get("error"), str)):
        return data
    status = handler.status
    return json.dumps(openai_error(body["error"], status, getattr(handler, "error_param", None))).encode()


class _OpenAIErrors:
    """A request handler's output stream that turns mlx_lm.server's error bodies into OpenAI's error object."""

    def __init__(self, raw, handler):
        self.raw, self.handler = raw, handler

    def write(self, data: bytes) -> int:
        if getattr(self.handler, "status", 200) >= 400:
            data = _openai_error_bytes(bytes(data), self.handler)
        return self.raw.write(data)

    def __getattr__(self, name: str):
        return getattr(self.raw, name)


def _scan_cache_or_empty(scan):
    """huggingface_hub.scan_cache_dir for mlx_lm.server's /v1/models, an empty cache when its folder does not
    exist yet (it raised after the 200 header, leaving an empty body)."""
    from types import SimpleNamespace

    def scan_cache_dir(*args, **kwargs):
        try:
            return scan(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 (CacheNotFound, or an unreadable cache: no models to list)
            logging.info(f"/v1/models: no Hugging Face cache to list ({_first_line(e)})")
            return SimpleNamespace(repos=frozenset())

    return scan_cache_dir


class _Refusal(BaseException):
    # mlx_lm.server's handler answers every Exception raised by generate() with 404 and its own body; a
    # BaseException passes that `except Exception`, so tq-server's handler answers with OpenAI's body and status.
    def __init__(self, body: dict, status: int = 400):
        super().__init__(body["error"]["message"])
        self.body, self.status = body, status


def context_bound(model_config: dict, weights: int, config: TurboQuantConfig | None,
                  prefill_step: int = 2048) -> tuple[int | None, str]:
    """tq-server's default --tq-max-context: the model's trained context, or less if one sequence's planned
    peak at it does not fit this machine's memory (memory.available_memory); and a phrase saying which."""
    from .memory import attention_layout, available_memory, format_bytes, max_context

    try:
        trained = attention_layout(model_config).max_context
        fits = max_context(model_config, available_memory(), config, weights=weights, prefill_step=prefill_step)
    except Exception as e:  # noqa: BLE001 (a config the planner cannot read: no bound, said in the log)
        return None, f"the memory plan cannot read this model's config: {type(e).__name__}: {e}"
    if trained and trained <= fits:
        return trained, "the model's trained context"
    if not fits:  # the plan has no room even for the weights: refusing everything would not help
        return None, f"the planned peak exceeds {format_bytes(available_memory())} at any context"
    return fits, f"what one sequence's planned peak fits in {format_bytes(available_memory())}"


def _model_config(model_path: str) -> dict:
    """config.json of the model mlx_lm.server just loaded (a local folder or a Hugging Face cache entry)."""
    from pathlib import Path

    from mlx_lm.utils import hf_repo_to_path

    from .memory import load_model_config

    path = Path(model_path)
    return load_model_config(path if path.exists() else hf_repo_to_path(model_path))


def server_main(argv: list[str] | None = None) -> int:
    """tq-server: mlx_lm.server with every loaded model patched (ModelProvider subclass) and the --tq-* flags,
    and requests longer than --tq-max-context refused with HTTP 400 (ResponseGenerator and APIHandler
    subclasses)."""
    if argv is None:  # the real command line: OpenBLAS on Linux CPU (may restart the process)
        from .blas import use_openblas

        use_openblas("tq-server")
    import mlx_lm.server as server
    from mlx_lm.models.cache import make_prompt_cache

    from .integration import patch_model, tune_malloc

    tune_malloc()
    argv = list(sys.argv[1:] if argv is None else argv)
    tq_parser = add_cache_args(argparse.ArgumentParser(prog="tq-server", add_help=False))
    bound = tq_parser.add_argument_group("tq-server context bound")
    bound.add_argument("--tq-max-context", dest="tq_max_context", type=_count_arg(0), metavar="N",
                       help="refuse (HTTP 400, before any forward) a request whose prompt tokens + max_tokens "
                            "exceed N (default: the model's trained context, or less if one sequence's planned "
                            "peak memory there does not fit this machine; 0: no bound)")
    tq_args, rest = tq_parser.parse_known_args(argv)
    wants_help = "-h" in rest or "--help" in rest
    if wants_help:
        pass  # mlx_lm.server prints the usage and its options; the TurboQuant sections follow (below)
    elif any(a == "--kv-bits" or a.startswith("--kv-bits=") for a in rest):
        tq_args.kv_bits = True  # only its presence matters here
    config = config_or_error(tq_parser, tq_args)

    class ModelProvider(server.ModelProvider):
        def _load(self, model_path, adapter_path=None, draft_model_path=None):
            super()._load(model_path, adapter_path, draft_model_path)
            if config is not None:
                patch_model(self.model, config)
                # Batching needs every cache to merge (TurboQuantKVCache merges into tq_mlx.batch's cache);
                # recompute for the TurboQuant caches. A pipeline stage ties its send to `cache[-1].keys`, which
                # the batch cache lacks: pipelined servers answer one request at a time.
                self.is_batchable = self.draft_model is None and self.pipeline_group is None and all(
                    hasattr(c, "merge") for c in make_prompt_cache(self.model)
                )
                batching = "on" if self.is_batchable else "off (a draft model, --pipeline or a cache without merge)"
                logging.info(f"KV cache: {describe_config(config)}; batching {batching}")
            self.max_context = self._context_bound(model_path)

        def _context_bound(self, model_path) -> int | None:
            from mlx.utils import tree_flatten

            if tq_args.tq_max_context is not None:
                limit, source = tq_args.tq_max_context or None, "--tq-max-context"
            else:
                try:
                    model_config = _model_config(model_path)
                except Exception as e:  # noqa: BLE001 (no config.json to plan with: serve without a bound)
                    model_config = {}
                    logging.warning(f"Cannot read the model's config.json for the context bound: {e}")
                weights = sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))
                limit, source = context_bound(model_config, weights, config, self.cli_args.prefill_step_size)
            logging.info(f"Context bound: {f'{limit:,} tokens' if limit else 'none'} per request ({source})")
            return limit

    class ResponseGenerator(server.ResponseGenerator):
        def _tokenize(self, tokenizer, request, args):
            # Every request is tokenized here, in the generation thread, before it joins a batch or is served
            # alone: refusing here runs no forward and leaves the other requests as they are.
            out = super()._tokenize(tokenizer, request, args)
            limit = getattr(self.model_provider, "max_context", None)
            if limit and len(out[0]) + args.max_tokens > limit:
                param = "prompt" if request.request_type == "text" else "messages"
                raise ContextTooLong(limit, len(out[0]), args.max_tokens, param)
            return out

        def generate(self, *args, **kwargs):
            try:
                return super().generate(*args, **kwargs)
            except ContextTooLong as e:
                raise _Refusal(e.body()) from None
            except Exception as e:  # noqa: BLE001 (mlx-lm answers these 404; they come from the request)
                raise _Refusal(openai_error(f"{type(e).__name__}: {e}")) from None

    class APIHandler(server.APIHandler):
        # Every error goes out as OpenAI's error object (_OpenAIErrors rewrites mlx-lm's string bodies).
        status, error_param = 200, None

        def setup(self):
            super().setup()
            self.wfile = _OpenAIErrors(self.wfile, self)

        def send_response(self, code, message=None):
            self.status = code
            super().send_response(code, message)

        def _refuse_bad_body(self):
            error = request_error(self.path, self.body)
            if error is not None:
                self.error_param = error[1]
                raise ValueError(error[0])  # mlx_lm.server's do_POST answers it with 400

        def handle_chat_completions(self):
            self._refuse_bad_body()
            return super().handle_chat_completions()

        def handle_text_completions(self):
            self._refuse_bad_body()
            return super().handle_text_completions()

        def handle_completion(self, request, stop_words):
            try:
                super().handle_completion(request, stop_words)
            except _Refusal as r:  # raised before any header was sent
                logging.info(f"Refused a request: {r}")
                self._set_completion_headers(r.status)
                self.end_headers()
                self.wfile.write(json.dumps(r.body).encode())

    def run_http_server(host, port, response_generator, **kwargs):
        # mlx_lm.server.run passes no handler class (its default is bound at definition): give ours.
        return saved[2](host, port, response_generator, **{**kwargs, "handler_class": APIHandler})

    saved = server.ModelProvider, server.ResponseGenerator, server._run_http_server, server.scan_cache_dir, sys.argv
    server.ModelProvider, server.ResponseGenerator, server._run_http_server = (ModelProvider, ResponseGenerator,
                                                                               run_http_server)
    server.scan_cache_dir = _scan_cache_or_empty(saved[3])
    sys.argv = ["tq-server", *rest]
    try:
        server.main()
    except SystemExit:
        if not wants_help:
            raise
        # One usage block (mlx_lm.server's), then the TurboQuant flags without a second one.
        print("\n" + tq_parser.format_help().split("\n\n", 1)[1].rstrip())
        return 0
    except ValueError as e:
        print(f"tq-server: error: {e}", file=sys.stderr)
        return 2
    finally:
        (server.ModelProvider, server.ResponseGenerator, server._run_http_server, server.scan_cache_dir,
         sys.argv) = saved
    return 0


def exit_without_teardown(code: int) -> NoReturn:
    """End the process now, skipping interpreter and C++ teardown. MLX 0.32 can abort in its exit-time destructors
    ("terminate called without an active exception", SIGABRT) once a worker thread has used it: 2 of 10 runs of a
    five-line script with one worker thread; tq-chat and tq-server generate in worker threads. Called by the
    console commands once their main function has returned, when nothing is left but flushing the output."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def generate_command() -> None:
    """The tq-generate command (generate_main, then exit_without_teardown)."""
    exit_without_teardown(generate_main())


def server_command() -> None:
    """The tq-server command (server_main, then exit_without_teardown)."""
    exit_without_teardown(server_main())
