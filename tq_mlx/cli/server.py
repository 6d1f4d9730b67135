"""tq-server: mlx_lm.server with a TurboQuant KV cache, a context bound, and OpenAI's error shapes.

It keeps every flag of mlx_lm.server and adds the `--tq-*` flags (flags.py) to mlx-lm's own parser (server_parser),
so `--help` and the usage line show them all; `--model smollm2-135m` is tq-chat's demo model. Every model the
server loads is patched (`ModelProvider._load`: tq_mlx.hook installs the subclasses while the server runs), so every
mlx-lm code path that builds a cache builds TurboQuant caches (mlx-lm-integration.md §3); `--kv-bits` alone selects
mlx-lm's own affine cache instead, and mixing it with `--tq-*` flags is refused. The model given by --model is
loaded before the server listens: one that cannot load (or be compressed) is a one-line error and exit code 2. A
request longer than --tq-max-context is refused with HTTP 400 before any forward, and every error goes out as
OpenAI's error object. The prompt cache is tq_mlx.prompt_cache.lru's (mlx-lm's LRU and byte cap over the compressed
caches, hits resumed where they equal a fresh prefill) with a disk tier in --tq-prompt-cache-dir
(tq_mlx.prompt_cache.store) that outlives restarts; GET /v1/prompt_cache gives its figures.
"""

from __future__ import annotations

import argparse
import json
import contextlib
import logging
import signal
import sys
import threading
import types

from .. import hook
from ..config import TurboQuantConfig
from ..planner.display import describe_config
from .flags import (add_cache_args, add_prompt_store_args, config_or_error, count_arg, exit_without_teardown,
                    first_line, model_arg, prompt_store_folder)

DESCRIPTION = ("tq-server: an OpenAI-compatible HTTP server (POST /v1/chat/completions and /v1/completions) whose "
               "KV cache is compressed with TurboQuant (the --tq-* flags), with a context bound per request "
               "(--tq-max-context). It is mlx_lm.server, whose every flag works as there.")


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
                   f"and /v1/completions, GET /v1/models, /v1/prompt_cache and /health)")
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
            logging.info(f"/v1/models: no Hugging Face cache to list ({first_line(e)})")
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
    peak at it does not fit this machine's memory (machine.available_memory); and a phrase saying which."""
    from ..models.architectures import attention_layout
    from ..planner.display import format_bytes
    from ..planner.machine import available_memory
    from ..planner.memory import max_context

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

    from ..models.architectures import load_model_config

    path = Path(model_path)
    return load_model_config(path if path.exists() else hf_repo_to_path(model_path))


class _Built(Exception):
    """Raised by mlx_lm.server's parse_args to hand its parser over (server_parser)."""

    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__("parser built")
        self.parser = parser


def _argparse_with(cls: type) -> types.ModuleType:
    """argparse with `cls` as its ArgumentParser: mlx_lm.server's main calls argparse.ArgumentParser inline, so with
    this as mlx_lm.server's `argparse` (tq_mlx.hook's "tq-server" part) it builds its parser as `cls`."""
    proxy = types.ModuleType("argparse")
    proxy.__dict__.update(vars(argparse))
    proxy.ArgumentParser = cls
    return proxy


def server_parser(server) -> argparse.ArgumentParser:
    """mlx_lm.server's own parser (its main runs up to parse_args, which hands the parser over) as tq-server's: its
    name and description, the --tq-* cache flags and the context bound, so that --help and the usage line show
    every flag."""

    class Capture(argparse.ArgumentParser):
        capturing = True

        def parse_args(self, args=None, namespace=None):
            if self.capturing:
                raise _Built(self)
            return super().parse_args(args, namespace)

    with hook.installed("tq-server", {"mlx_lm.server.argparse": _argparse_with(Capture)}):
        try:
            server.main()
        except _Built as built:
            parser = built.parser
        else:  # pragma: no cover - an mlx-lm whose main no longer parses its flags first
            raise RuntimeError("mlx_lm.server.main did not build its argument parser")
    parser.capturing = False
    parser.prog, parser.description = "tq-server", DESCRIPTION
    add_cache_args(parser)
    bound = parser.add_argument_group("tq-server context bound")
    bound.add_argument("--tq-max-context", dest="tq_max_context", type=count_arg(0), metavar="N",
                       help="refuse (HTTP 400, before any forward) a request whose prompt tokens + max_tokens "
                            "exceed N (default: the model's trained context, or less if one sequence's planned "
                            "peak memory there does not fit this machine; 0: no bound)")
    add_prompt_store_args(parser)
    return parser


def server_main(argv: list[str] | None = None) -> int:
    """tq-server: mlx_lm.server with every loaded model patched (ModelProvider subclass) and the --tq-* flags,
    the --model loaded before the server listens, and requests longer than --tq-max-context refused with HTTP
    400 (ResponseGenerator and APIHandler subclasses)."""
    if argv is None:  # the real command line: OpenBLAS on Linux CPU (may restart the process)
        from ..blas import use_openblas

        use_openblas("tq-server")
    import mlx_lm.server as server
    from mlx_lm.models.cache import make_prompt_cache

    from ..integration import patch_model, tune_malloc

    tune_malloc()
    parser = server_parser(server)
    args = parser.parse_args(argv)  # --help prints every flag and exits
    config = config_or_error(parser, args)
    try:
        args.model = model_arg(args.model, "tq-server")
    except ValueError as e:
        print(f"tq-server: error: {e}", file=sys.stderr)
        return 2

    class ModelProvider(server.ModelProvider):
        def __init__(self, cli_args):
            super().__init__(cli_args)
            self.loaded = threading.Event()  # set once the first load ended, loaded or not
            self.load_error: str | None = None  # the last load's failure, in one line
            self.stores: dict = {}  # model key -> (its PromptStore, the model): the prompt cache's disk tier
            providers.append(self)

        def _load(self, model_path, adapter_path=None, draft_model_path=None):
            try:
                self._load_patched(model_path, adapter_path, draft_model_path)
                self.load_error = None
            except Exception as e:  # noqa: BLE001 (any failure is the model argument's: said in one line)
                self.load_error = f"cannot load model {model_path}: {first_line(e)}"
                raise
            finally:
                self.loaded.set()

        def _load_patched(self, model_path, adapter_path, draft_model_path):
            self.stores.clear()  # the last model's store holds that model: let it go with it
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
                self._open_store(model_path)
            self.max_context = self._context_bound(model_path)

        def _open_store(self, model_path) -> None:
            from ..prompt_cache.store import PromptStore, model_id
            from ..prompt_cache.lru import MIN_STORED_TOKENS

            why = store_off_reason(args, self.draft_model, self.pipeline_group or self.tensor_group)
            if why is None:
                store = PromptStore(prompt_store_folder(args), args.tq_prompt_cache_disk_bytes,
                                    model_id=model_id(self.model), config=config, model_name=str(model_path),
                                    min_tokens=MIN_STORED_TOKENS)
                if store.enabled:
                    self.stores[self.model_key] = (store, self.model)
                why = store.describe()
            logging.info(f"Prompt cache on disk: {why}")

        def _context_bound(self, model_path) -> int | None:
            from mlx.utils import tree_flatten

            if args.tq_max_context is not None:
                limit, source = args.tq_max_context or None, "--tq-max-context"
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
        def _log_cache_stats(self):
            if not hasattr(self.prompt_cache, "describe"):  # mlx-lm's own (--kv-bits alone)
                return super()._log_cache_stats()
            logging.info(self.prompt_cache.describe(self.model_provider.model_key))

        def _run_generate(self):
            # mlx_lm.server's, without the traceback when the --model failed to load: server_main says that in
            # one line and exits (run_http_server below waits for the load).
            try:
                self._generate()
            except Exception as e:  # noqa: BLE001
                self._generation_failed = True
                if self.model_provider.load_error is None:
                    logging.exception(f"mlx_lm.server generation thread died: {e}")

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

        def do_GET(self):
            if self.path.rstrip("/") != "/v1/prompt_cache":
                return super().do_GET()
            cache = self.response_generator.prompt_cache
            stats = cache.stats(self.response_generator.model_provider.model_key) if hasattr(cache, "stats") else {
                "object": "prompt_cache", "memory": {"sequences": len(cache), "bytes": cache.nbytes},
                "disk": {"enabled": False}}
            self._set_completion_headers(200)
            self.end_headers()
            self.wfile.write(json.dumps(stats).encode())

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
        # The generation thread loads --model first: listen only once it has loaded, and fail in one line if it
        # cannot. mlx_lm.server.run passes no handler class (its default is bound at definition): give ours.
        provider = response_generator.model_provider
        if provider.cli_args.model is not None:
            while not provider.loaded.wait(0.2) and response_generator.generation_available():
                pass
            if provider.load_error is not None:
                raise ValueError(provider.load_error)
        return serve(host, port, response_generator, **{**kwargs, "handler_class": APIHandler})

    class Parsed(argparse.ArgumentParser):
        def parse_args(self, *_, **__) -> argparse.Namespace:
            return args  # parsed above, with the cache flags

    def prompt_cache(max_size):
        # mlx_lm.server.run builds its LRUPromptCache with --prompt-cache-size alone: ours takes
        # --prompt-cache-bytes too, and the disk tier of the model the provider loaded
        from ..prompt_cache.lru import PromptCache

        return PromptCache(max_size, args.prompt_cache_bytes,
                           stores=lambda key: providers[0].stores.get(key) if providers else None)

    providers: list = []
    serve = server._run_http_server
    names = {  # what server.main reaches, while it runs (tq_mlx.hook's "tq-server" part)
        "mlx_lm.server.ModelProvider": ModelProvider,
        "mlx_lm.server.ResponseGenerator": ResponseGenerator,
        "mlx_lm.server._run_http_server": run_http_server,
        "mlx_lm.server.scan_cache_dir": _scan_cache_or_empty(server.scan_cache_dir),
        "mlx_lm.server.argparse": _argparse_with(Parsed),
    }
    if config is not None:
        names["mlx_lm.server.LRUPromptCache"] = prompt_cache
    try:
        with hook.installed("tq-server", names), _terminate_as_interrupt():
            server.main()
    except ValueError as e:
        print(f"tq-server: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # stopped while --model loaded (once listening, mlx_lm.server takes it and returns)
        return 130
    finally:
        _flush_stores(providers)
    return 0


def store_off_reason(args: argparse.Namespace, draft_model, distributed) -> str | None:
    """Why tq-server keeps no prompt caches on disk (None: it does)."""
    if args.tq_prompt_cache_disk_bytes == 0:
        return "off (--tq-prompt-cache-disk-bytes 0)"
    if args.prompt_cache_size == 0:
        return "off (--prompt-cache-size 0: no prompt cache)"
    if draft_model is not None:
        return "off (a draft model's caches are not stored)"
    if distributed is not None:
        return "off (a distributed model's caches are not stored)"
    return None


@contextlib.contextmanager
def _terminate_as_interrupt():
    """SIGTERM (kill, systemd, `docker stop`) stops the server as Ctrl+C does: mlx_lm.server shuts down, the
    generation thread saves the request it was on, and the disk tier's writes finish. A second SIGTERM ends the
    process at once (its files stay whole or absent)."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers belong to the main thread
        yield
        return

    def interrupt(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _flush_stores(providers: list, timeout: float = 30) -> None:
    """Let the disk tier finish the writes it started (a server stopped with Ctrl+C or SIGTERM), at most `timeout`
    seconds."""
    for provider in providers:
        for store, _ in provider.stores.values():
            if not store.flush(timeout):
                logging.warning(f"Prompt cache on disk: stopped with writes unfinished in {store.folder} (the "
                                f"files are whole or absent)")


def server_command() -> None:
    """The tq-server command (server_main, then exit_without_teardown)."""
    exit_without_teardown(server_main())
