"""tq-generate: mlx_lm.generate with a TurboQuant KV cache, then the KV memory summary.

It keeps every flag of mlx_lm.generate and adds the `--tq-*` flags (flags.py); `--model smollm2-135m` is tq-chat's
demo model, and `--max-kv-size` below the float window fits the window to it (config.fit_max_kv_size). The model
is patched as it loads (`mlx_lm.utils.load_model`, which `mlx_lm.utils.load` looks up at call time, replaced by
tq_mlx.hook while the command runs, as are the names of mlx_lm.generate it calls), so every mlx-lm code path that
builds a cache builds TurboQuant caches (mlx-lm-integration.md §3). `--kv-bits` alone selects mlx-lm's own affine
cache instead; mixing it with `--tq-*` flags is refused. A float prompt-cache file is converted as it loads
(convert.py).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from typing import Iterator

from .. import hook
from ..config import TurboQuantConfig
from ..convert import compress_float_cache, converted_config
from ..planner.display import describe_config, summary_line
from .flags import add_cache_args, config_or_error, exit_without_teardown, first_line, model_arg


@contextlib.contextmanager
def patched_loading(config: TurboQuantConfig | None) -> Iterator[None]:
    """While active, every model mlx_lm.utils.load / load_model loads is patched with TurboQuant caches (tq_mlx.hook's
    "load_model" part)."""
    import mlx_lm.utils as utils

    from ..integration import patch_model

    if config is None:
        yield
        return
    original = hook.original(utils, "load_model")

    def load_model(*args, **kwargs):
        model, model_config = original(*args, **kwargs)
        patch_model(model, config)
        return model, model_config

    with hook.installed("load_model", {"mlx_lm.utils.load_model": load_model}):
        yield


class _Parsed:
    """Stands in for the parser mlx_lm.generate.main builds, returning arguments already parsed."""

    def __init__(self, args: argparse.Namespace):
        self.args = args

    def parse_args(self, *_, **__) -> argparse.Namespace:
        return self.args


def _generate_module():
    # `import mlx_lm.generate as gen` would give the function: mlx_lm/__init__.py re-exports it by that name.
    return importlib.import_module("mlx_lm.generate")


def _loading_errors_in_one_line(load, default_model: str):
    """mlx_lm's load, its failures (offline Hub, missing repo, damaged weights) raised as one-line ValueErrors."""

    def wrapped(path, *args, **kwargs):
        try:
            return load(path, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 (any failure to load is the user's model argument or network)
            default = " (mlx-lm's default when --model is not given)" if path == default_model else ""
            raise ValueError(f"cannot load model {path}{default}: {first_line(e)}") from None

    return wrapped


def _prompt_cache_loader(args: argparse.Namespace, loaded: dict):
    """gen.main's load_prompt_cache: tq_mlx's loader (it registers TurboQuantKVCache, which mlx-lm's loader looks up
    by name), metadata that tq-chat's /save and hand-made files leave out filled in, the file noted in `loaded`."""
    from ..integration import load_prompt_cache

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


def max_tokens_arg(text: str) -> int:
    """--max-tokens: a count of 1 or more, or -1 (no limit, mlx-lm's meaning of any negative number)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, or -1 for no limit, got {text!r}") from None
    if n == 0 or n < -1:
        raise argparse.ArgumentTypeError(f"must be >= 1, or -1 for no limit, got {n}")
    return n


def generate_parser() -> argparse.ArgumentParser:
    """mlx_lm.generate's parser plus the TurboQuant flags."""
    gen = _generate_module()
    parser = gen.setup_arg_parser()
    parser.prog = "tq-generate"
    parser.description = "mlx_lm.generate with a TurboQuant-compressed KV cache."
    for action in parser._actions:
        if action.dest == "max_tokens":  # mlx-lm takes any negative value as no limit and refuses 0 mid-run
            action.type = max_tokens_arg
            action.help = "Maximum number of tokens to generate: 1 or more, or -1 for no limit"
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
        from ..blas import use_openblas

        use_openblas("tq-generate")
    import mlx.core as mx

    from ..integration import tune_malloc

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
        args.model = model_arg(args.model, "tq-generate")
    except ValueError as e:
        print(f"tq-generate: error: {e}", file=sys.stderr)
        return 2
    used: list = []
    loaded: dict = {}  # the --prompt-cache-file, once gen.main has loaded it

    original_generate, original_load = gen.generate, gen.load

    def generate(model, tokenizer, prompt, verbose=False, **kwargs):
        if loaded and config is not None and kwargs.get("prompt_cache") is loaded["cache"]:
            cache, n = compress_float_cache(model, loaded["cache"], config, loaded["file"], args.prefill_step_size)
            if n:
                from ..planner.memory import cache_bytes

                tokens = cache_bytes(cache)["tokens"]
                print(f"tq-generate: {loaded['file']} holds mlx-lm's float cache ({tokens:,} tokens): converted it "
                      f"to {describe_config(converted_config(config))} for this run (the file is unchanged; it holds "
                      f"no queries to weigh the keys by)", file=sys.stderr, flush=True)
            kwargs["prompt_cache"] = cache
        # Build the cache here, exactly as generate_step / speculative_generate_step would (their make_prompt_cache
        # is tq_mlx.hook's once the model is patched: it passes --max-kv-size on), to read it after.
        if kwargs.get("prompt_cache") is None:
            cache = hook.make_prompt_cache(model, max_kv_size=kwargs.get("max_kv_size"))
            if kwargs.get("draft_model") is not None:
                cache = cache + hook.make_prompt_cache(kwargs["draft_model"])
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

    names = {  # what gen.main calls, while it runs (tq_mlx.hook's "tq-generate" part)
        "mlx_lm.generate.setup_arg_parser": lambda: _Parsed(args),
        "mlx_lm.generate.generate": generate,
        "mlx_lm.generate.load_prompt_cache": _prompt_cache_loader(args, loaded),
        "mlx_lm.generate.load": _loading_errors_in_one_line(load if distributed else original_load, gen.DEFAULT_MODEL),
    }
    try:
        with hook.installed("tq-generate", names):
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
    if used and group.rank() == 0:
        cache, n_layers = used[-1]
        line = summary_line(cache[:n_layers])
        if distributed:
            line += f" (rank 0's shard of {group.size()})"
        print(line, file=sys.stdout if args.verbose else sys.stderr, flush=True)
    return 0


def generate_command() -> None:
    """The tq-generate command (generate_main, then exit_without_teardown)."""
    exit_without_teardown(generate_main())
