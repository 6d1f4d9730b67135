"""The tq-chat Textual app: transcript, input box, live memory panel.

Model download/loading and every generation run in thread workers, never in the event loop; they talk to the
app with messages (Textual's post_message is thread-safe). The memory panel is fed ChatSession.snapshot(),
whose KV numbers come from tq_mlx.planner.memory.cache_bytes.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widgets import Footer, Header, Input, Markdown

from tq_mlx.cache import TurboQuantConfig
from tq_mlx.planner.display import config_label, format_bytes, saving_text, window_text
from tq_mlx.planner.memory import FLOAT_BYTES

from .models import ModelSource, ModelUnavailable, download
from .plan import Plan, format_ctx
from .session import ChatSession, ContextFull, TurnResult
from .widgets import ChatMessage, MemoryPanel, StatusBar, Transcript

# Every slash command, with its /help line: /help's table and the unknown-command message are made from it.
COMMANDS = {
    "/clear": "start a new conversation (empty cache)",
    "/bits": "the cache's bit settings per layer",
    "/save FILE": "save the conversation and its compressed cache (`.safetensors`)",
    "/load FILE": "continue a saved conversation",
    "/stats": "memory and speed figures",
    "/screenshot [FILE]": "save the screen as SVG (no FILE: a new file in ~/.cache/tq-mlx/screenshots; "
                          "the app says where)",
    "/help": "this table",
    "/quit": "exit (or Ctrl+Q)",
}
HELP = ("**Commands**\n\n| command | what it does |\n|---|---|\n"
        + "".join(f"| `{c}` | {what} |\n" for c, what in COMMANDS.items())
        + "\n**Ctrl+C** (or Esc) stops an answer and keeps the conversation.\n")
KNOWN = tuple(c.split()[0] for c in COMMANDS)  # "/clear", "/bits", ...
# tq-chat appends one JSON line per state change to this file when it is set (tests wait on these events
# instead of on text appearing on the screen): {"event": "ready"}, {"event": "turn", "finish": ..., "context": N}, ...
EVENT_LOG_ENV = "TQ_CHAT_EVENT_LOG"


def screenshot_dir() -> Path:
    """Where a bare /screenshot goes: screenshots/ in tq-mlx's cache folder ($TQ_MLX_CACHE or ~/.cache/tq-mlx)."""
    from tq_mlx.models.demo import cache_dir

    return cache_dir() / "screenshots"


def store_text(store) -> str:
    """The prompt store's figures for /stats: files and bytes of this model and config, the cap, the folder."""
    st = store.stats()
    return (f"{st['files']} caches, {format_bytes(st['bytes'])} (folder: {format_bytes(st['all_bytes'])} of "
            f"{format_bytes(st['max_bytes'])}) in `{st['folder']}`")


STATS_INTERVAL = 0.25  # seconds between memory panel refreshes while generating


@dataclass
class ChatSettings:
    source: ModelSource
    ctx: int
    config: TurboQuantConfig | None = field(default_factory=TurboQuantConfig)
    max_tokens: int = 1024
    temp: float = 0.0
    top_p: float = 1.0
    system: str | None = None
    dtype: str | None = None  # cast the weights at load: float16, bfloat16 or float32
    kv_dtype: str | None = None  # the dtype the model will run in (--dtype, else its config's), for the plan note
    prefill_step_size: int = 512
    seed: int = 0
    plan: Plan | None = None
    store_folder: Path | None = None  # the prompt cache on disk (tq_mlx.prompt_cache.store); None: none
    store_bytes: int = 0  # its cap (--tq-prompt-cache-disk-bytes; 0: none)


def model_name(settings: ChatSettings, dtype: str | None) -> str:
    """The model's name, without a dtype tag when the dtype it runs in is known (a folder named "...-float16"
    run with --dtype float32 would say float16)."""
    name = settings.source.name
    if dtype:
        name = re.sub(r"[-_](float16|bfloat16|float32|fp16|bf16|fp32|f16|f32)$", "", name, flags=re.I)
    return name


def subtitle(settings: ChatSettings, dtype: str | None = None) -> str:
    """The header's "model · dtype · cache · ctx", with the dtype the model runs in (--dtype, else its weights')."""
    dtype = settings.dtype or dtype
    cache = f"TurboQuant {config_label(settings.config)}" if settings.config else "mlx-lm cache"  # "K4→3/V3→2 ..."
    return " · ".join(p for p in (model_name(settings, dtype), dtype, cache, f"ctx {format_ctx(settings.ctx)}") if p)


def plan_note(settings: ChatSettings) -> str:
    """The first message on the screen: the plan's weights, KV cache at --ctx against mlx-lm's and predicted peak
    (the screenshot's check makes it again: benchmarks/docs_assets.py)."""
    plan = settings.plan
    dtype = settings.dtype or settings.kv_dtype
    if dtype in FLOAT_BYTES:  # mlx-lm's cache holds the model's dtype; the plan prices it in float16
        label = f"**{model_name(settings, dtype)}** ({dtype})"
        reference = f"mlx-lm's {dtype} cache would be {format_bytes(plan.kv_mlx_lm)}"
    else:
        label = f"**{settings.source.name}**"
        reference = f"float16 would be {format_bytes(plan.kv_fp16)}"
    return (f"{label}: weights {format_bytes(plan.weights)}, KV cache at {plan.ctx:,} tokens {format_bytes(plan.kv)} "
            f"({reference}); predicted peak {format_bytes(plan.needed)} of {format_bytes(plan.usable)} usable.")


class Loaded(Message):
    def __init__(self, session: ChatSession | None, error: str | None = None, note: str | None = None):
        super().__init__()
        self.session, self.error, self.note = session, error, note


class StoreWarning(Message):
    """A line the prompt store logged (a file it cannot read or write), for the transcript."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text


class _StoreLog(logging.Handler):
    """The prompt store's warnings, posted to the app (post_message is thread-safe)."""

    def __init__(self, app: App):
        super().__init__(logging.WARNING)
        self.app = app

    def emit(self, record: logging.LogRecord) -> None:
        self.app.post_message(StoreWarning(record.getMessage()))


class Progress(Message):
    """Download or prefill progress."""

    def __init__(self, label: str, done: float, total: float | None):
        super().__init__()
        self.label, self.done, self.total = label, done, total


class Streamed(Message):
    def __init__(self, text: str):
        super().__init__()
        self.text = text


class Stats(Message):
    def __init__(self, stats: dict):
        super().__init__()
        self.stats = stats


class TurnDone(Message):
    def __init__(self, result: TurnResult | None = None, error: str | None = None):
        super().__init__()
        self.result, self.error = result, error


class ChatApp(App):
    CSS_PATH = Path(__file__).with_name("chat.tcss")  # absolute: subclasses live elsewhere
    TITLE = "tq-chat"
    BINDINGS = [
        Binding("ctrl+c", "stop", "Stop answer", priority=True),
        Binding("escape", "stop", "Stop", show=False),
        Binding("ctrl+l", "clear", "Clear"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(self, settings: ChatSettings):
        super().__init__()
        self.settings = settings
        self.session: ChatSession | None = None
        self.generating = False
        self._answer: ChatMessage | None = None
        self._stream = None
        self.sub_title = self._subtitle()

    def _subtitle(self, dtype: str | None = None) -> str:
        return subtitle(self.settings, dtype)

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="body"):
            with Vertical(id="chat"):
                yield Transcript(id="transcript")
                yield StatusBar(id="status")
                yield Input(placeholder="Loading model…", id="prompt", disabled=True)
            yield MemoryPanel(id="memory")
        yield Footer()

    async def on_mount(self) -> None:
        plan = self.settings.plan
        if plan is not None:
            await self.transcript.add(plan_note(self.settings), "notice")
            for w in plan.warnings:
                await self.transcript.add(f"Warning: {w}", "error")
        self.status.show("Loading model…")
        self.load_model()

    @property
    def transcript(self) -> Transcript:
        return self.query_one(Transcript)

    @property
    def status(self) -> StatusBar:
        return self.query_one(StatusBar)

    @property
    def panel(self) -> MemoryPanel:
        return self.query_one(MemoryPanel)

    # --- loading -----------------------------------------------------------------------------------------

    @work(thread=True, exclusive=True, group="load")
    def load_model(self) -> None:
        s = self.settings
        try:
            if s.source.needs_download:
                def progress(done: float, total: float | None) -> None:
                    size = f"{format_bytes(done)} / {format_bytes(total)}" if total else format_bytes(done)
                    self.post_message(Progress(f"Downloading {s.source.repo_id}  {size}", done, total))

                download(s.source, progress)
            self.post_message(Progress(f"Loading {s.source.name}…", 0, None))
            session = self._load_session(s.source.path)
        except ModelUnavailable as e:
            self.post_message(Loaded(None, str(e)))
        except Exception as e:  # the app must stay up and say what went wrong
            self.post_message(Loaded(None, f"could not load {s.source.spec}: {type(e).__name__}: {e}"))
        else:
            try:
                note = session.warm_start(lambda done, total: self.post_message(
                    Progress(f"Prefill of the system prompt {done:,} / {total:,} tokens", done, total)))
            except Exception as e:  # noqa: BLE001 (the conversation starts without it)
                session.clear()
                note = f"The system prompt's cache could not be prepared ({type(e).__name__}: {e}); it is " \
                       f"prefilled with the first message."
            self.post_message(Loaded(session, note=note))

    def _load_session(self, path: Path) -> ChatSession:
        import mlx.core as mx
        from mlx_lm import load
        from mlx_lm.sample_utils import make_sampler

        s = self.settings
        mx.random.seed(s.seed)
        model, tokenizer = load(str(path))
        if s.dtype:
            model.set_dtype(getattr(mx, s.dtype))
            mx.eval(model.parameters())
        return ChatSession(
            model, tokenizer, s.config, s.ctx, model_id=s.source.repo_id or str(path), system=s.system,
            max_tokens=s.max_tokens, sampler=make_sampler(s.temp, s.top_p), prefill_step_size=s.prefill_step_size,
            store=self._open_store(model, s.source.repo_id or str(path)),
        )

    def _open_store(self, model, name: str):
        """The prompt cache on disk for this model and config (the disk tier tq-server uses), None if off."""
        s = self.settings
        if s.config is None or not s.store_bytes or s.store_folder is None:
            return None
        from tq_mlx.prompt_cache.store import PromptStore, log, model_id

        for h in [h for h in log.handlers if isinstance(h, _StoreLog)]:  # an earlier app's, in this process
            log.removeHandler(h)
        log.addHandler(_StoreLog(self))
        store = PromptStore(s.store_folder, s.store_bytes, model_id=model_id(model), config=s.config, model_name=name)
        return store if store.enabled else None

    async def on_loaded(self, message: Loaded) -> None:
        self.status.hide()
        prompt = self.query_one("#prompt", Input)
        if message.session is None:
            prompt.placeholder = "The model did not load: /quit to exit"
            prompt.disabled = False
            prompt.focus()
            await self.transcript.add(message.error or "could not load the model", "error")
            self.log_event("load-failed", error=message.error)
            return
        self.session = message.session
        self.sub_title = self._subtitle(self.session.dtype)
        self.panel.stats = self._with_plan(self.session.snapshot())
        if message.note:
            await self.transcript.add(message.note, "notice")
        await self.transcript.add("Ready. Type a message, or /help for commands.", "notice")
        prompt.placeholder = "Message (/help for commands)"
        prompt.disabled = False
        prompt.focus()
        self.log_event("ready", context=self.session.cache_offset(), note=message.note)

    async def on_store_warning(self, message: StoreWarning) -> None:
        await self.transcript.add(message.text, "error")

    # --- one turn ----------------------------------------------------------------------------------------

    @on(Input.Submitted, "#prompt")
    async def submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        event.input.clear()
        if not text:
            return
        if text.startswith("/"):
            await self.run_command(text)
            self.log_event("command", command=text.split()[0].lower())
            return
        if self.session is None:
            self.notify("The model is not loaded.", severity="warning")
            return
        if self.generating:
            self.notify("Still answering: wait, or press Ctrl+C to stop.", severity="warning")
            return
        await self.transcript.add(text, "user")
        self.generating = True
        self._answer, self._stream = None, None
        self.generate(text)

    @work(thread=True, exclusive=True, group="generate")
    def generate(self, text: str) -> None:
        session = self.session
        last = [0.0]

        def stats(force: bool = False) -> None:
            now = time.monotonic()
            if force or now - last[0] >= STATS_INTERVAL:
                last[0] = now
                self.post_message(Stats(session.snapshot()))

        def on_text(t: str) -> None:
            self.post_message(Streamed(t))
            stats()

        def on_progress(done: int, total: int) -> None:
            self.post_message(Progress("Prefill", done, total))
            stats(force=True)

        # The final figures go to the panel before TurnDone, so that the panel is final when the turn is over.
        try:
            result = session.generate(text, on_text, on_progress)
        except ContextFull as e:
            done = TurnDone(error=str(e))
        except Exception as e:
            done = TurnDone(error=f"generation failed: {type(e).__name__}: {e}")
        else:
            done = TurnDone(result)
        self.post_message(Stats(session.snapshot()))
        self.post_message(done)

    async def on_progress(self, message: Progress) -> None:
        if message.label == "Prefill":
            if message.done >= (message.total or 0):
                self.status.hide()
                return
            label = f"Prefill {int(message.done):,} / {int(message.total):,} tokens"
        else:
            label = message.label
        self.status.show(label, message.done, message.total)

    async def on_streamed(self, message: Streamed) -> None:
        if self._answer is None:
            self._answer = await self.transcript.add("", "assistant")
            self._stream = Markdown.get_stream(self._answer)
        await self._stream.write(message.text)

    def on_stats(self, message: Stats) -> None:
        self.panel.stats = self._with_plan(message.stats)

    def _with_plan(self, stats: dict) -> dict:
        """The panel shows the predicted peak next to the measured one."""
        plan = self.settings.plan
        return {**stats, "planned_peak": plan.needed, "plan": plan} if plan is not None else stats

    async def on_turn_done(self, message: TurnDone) -> None:
        await self._end_turn(message)
        r = message.result
        self.log_event("turn", finish=r.finish if r else "error", error=message.error,
                       generated=r.generated if r else 0, context=self.session.cache_offset())

    async def _end_turn(self, message: TurnDone) -> None:
        if self._stream is not None:
            await self._stream.stop()
        self._stream = None
        self.generating = False
        self.status.hide()
        if message.error:
            await self.transcript.add(message.error, "error")
            return
        r = message.result
        if r.generated == 0 and self._answer is None and r.finish != "stopped":
            await self.transcript.add("(empty answer)", "notice")
        if r.stored_tokens:
            await self.transcript.add(f"{r.stored_tokens:,} tokens of this conversation came from the prompt cache on "
                                      f"disk (no prefill for them).", "notice")
        notes = {
            "stopped": "Stopped. The partial answer stays in the conversation.",
            "context": f"Context limit reached ({self.settings.ctx:,} tokens): /clear to start a new conversation.",
            "length": f"Answer cut at --max-tokens {self.settings.max_tokens:,}.",
        }
        if r.finish in notes:
            await self.transcript.add(notes[r.finish], "notice")

    def log_event(self, event: str, **data) -> None:
        """Append {"event": event, ...} as one JSON line to the file $TQ_CHAT_EVENT_LOG names (nothing if unset):
        "ready", "load-failed", "turn" (finish, context tokens), "command", "screenshot" (path). The e2e tests
        wait on these, so that a slow machine cannot make them type into an answer still streaming."""
        path = os.environ.get(EVENT_LOG_ENV)
        if path:
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"event": event, **data}) + "\n")

    # --- actions and commands ----------------------------------------------------------------------------

    def exit(self, *args, **kwargs) -> None:
        # A thread worker cannot be cancelled: end the answer so that quitting does not wait for it.
        if self.session is not None:
            self.session.stop_event.set()
        super().exit(*args, **kwargs)

    def action_stop(self) -> None:
        if self.generating and self.session is not None:
            self.session.stop_event.set()
            self.notify("Stopping…")
        else:
            self.notify("Nothing to stop. /quit or Ctrl+Q exits.")

    async def action_clear(self) -> None:
        await self.run_command("/clear")

    async def run_command(self, line: str) -> None:
        cmd, _, arg = line.partition(" ")
        cmd, arg = cmd.lower(), arg.strip()
        if cmd in ("/quit", "/exit", "/q"):
            self.exit()
            return
        if cmd == "/help":
            await self.transcript.add(HELP, "notice")
            return
        if cmd == "/screenshot":
            await self.cmd_screenshot(arg)  # works at any time, even while answering or before the model loads
            return
        if cmd not in KNOWN:
            await self.transcript.add(f"Unknown command {cmd}. Commands: {', '.join(KNOWN)}.", "error")
            return
        if self.session is None:
            await self.transcript.add("The model is not loaded.", "error")
            return
        if self.generating:
            await self.transcript.add(f"{cmd} has to wait until the answer ends (Ctrl+C stops it).", "error")
            return
        await getattr(self, "cmd_" + cmd[1:])(arg)

    async def cmd_screenshot(self, arg: str) -> None:
        """Save the screen as SVG: to FILE, or without one to a new timestamped file in screenshot_dir()."""
        if arg:
            path = Path(arg).expanduser().resolve()
        else:
            folder = screenshot_dir()
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / time.strftime("tq-chat-%Y%m%d-%H%M%S.svg")
            for n in range(2, 1000):  # two in the same second: a new name, never an overwrite
                if not path.exists():
                    break
                path = folder / time.strftime(f"tq-chat-%Y%m%d-%H%M%S-{n}.svg")
        try:
            self.save_screenshot(path.name, str(path.parent))
        except OSError as e:
            await self.transcript.add(f"Could not save a screenshot to `{path}`: {e.strerror or e}", "error")
            return
        await self.transcript.add(f"Saved a screenshot to `{path}`.", "notice")
        self.log_event("screenshot", path=str(path))

    async def cmd_clear(self, arg: str) -> None:
        self.session.clear()
        await self.transcript.remove_children()
        await self.transcript.add("New conversation.", "notice")
        self.panel.stats = self._with_plan(self.session.snapshot())

    async def cmd_bits(self, arg: str) -> None:
        s = self.session.snapshot()
        await self.transcript.add(f"**Cache**: {s['config']}\n\n**Bits per layer**: {s['bits']}", "notice")

    async def cmd_stats(self, arg: str) -> None:
        s = self.session.snapshot()
        rows = [
            ("context", f"{s['context_tokens']:,} / {s['ctx']:,} tokens"),
            ("KV cache held", format_bytes(s["kv_bytes"])),
            (f"mlx-lm {s['kv_dtype'] or 'float'} cache", format_bytes(s["mlx_lm_bytes"])),
            ("saved", saving_text(s)),
            *([("float window", window_text(s))] if window_text(s) else []),
            ("other cache state", format_bytes(s["other_bytes"])),
            ("weights", format_bytes(s["weights"])),
            ("MLX active / peak", f"{format_bytes(s['active'])} / {format_bytes(s['peak'])}"),
            ("prefill / decode", f"{s['prompt_tps']:.1f} / {s['decode_tps']:.1f} tok/s"),
            ("turns", str(sum(m["role"] == "user" for m in self.session.messages))),
            *([("prompt cache on disk", store_text(self.session.store))] if self.session.store else []),
        ]
        table = "| figure | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)
        await self.transcript.add(table, "notice")

    async def cmd_save(self, arg: str) -> None:
        if not arg:
            await self.transcript.add("Usage: /save FILE", "error")
            return
        try:
            path = self.session.save(arg)
        except Exception as e:  # noqa: BLE001 (a failed save must never end the conversation)
            await self.transcript.add(f"Could not save: {e}", "error")
            return
        s = self.session.snapshot()
        await self.transcript.add(
            f"Saved {len(self.session.tokens):,} tokens ({format_bytes(s['kv_bytes'])} of KV cache) to "
            f"`{path}`: `/load {path}` continues this conversation.",
            "notice",
        )

    async def cmd_load(self, arg: str) -> None:
        if not arg:
            await self.transcript.add("Usage: /load FILE", "error")
            return
        try:
            warnings = self.session.load(arg)
        except Exception as e:  # noqa: BLE001 (a failed load leaves the conversation as it was)
            await self.transcript.add(f"Could not load: {e}", "error")
            return
        await self.transcript.remove_children()
        for m in self.session.messages:
            if m["role"] in ("user", "assistant"):
                await self.transcript.add(m["content"], m["role"])
        await self.transcript.add(
            f"Loaded {len(self.session.tokens):,} tokens from `{arg}`; the conversation continues from here.",
            "notice",
        )
        for w in warnings:
            await self.transcript.add(f"Warning: {w}", "error")
        self.panel.stats = self._with_plan(self.session.snapshot())
