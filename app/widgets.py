"""tq-chat's widgets: each owns one piece of the screen."""

from __future__ import annotations

from rich.console import Group
from rich.progress_bar import ProgressBar as RichBar
from rich.table import Table
from rich.text import Text
from textual.containers import Horizontal, VerticalScroll
from textual.reactive import reactive
from textual.widgets import Label, Markdown, ProgressBar, Static

from tq_mlx.planner.display import format_bytes, planned_text, saving_text, window_text


class ChatMessage(Markdown):
    """One message of the transcript; role is a CSS class (user, assistant, notice, error)."""

    TITLES = {"user": "you", "assistant": "assistant", "notice": "tq-chat", "error": "error"}

    LONG = 1200  # a user message longer than this (a pasted document) shows only its start and end

    def __init__(self, text: str, role: str):
        if role == "user" and len(text) > self.LONG:
            hidden = len(text) - 700
            text = f"{text[:500]} … *({hidden:,} more characters)* … {text[-200:]}"
        super().__init__(text, classes=role)
        self.role = role
        self.border_title = self.TITLES.get(role, role)


class Transcript(VerticalScroll):
    """The conversation, newest at the bottom; stays scrolled to the end while an answer streams."""

    def on_mount(self) -> None:
        self.anchor()

    async def add(self, text: str, role: str) -> ChatMessage:
        message = ChatMessage(text, role)
        await self.mount(message)
        self.anchor()
        return message


class StatusBar(Horizontal):
    """A label and a progress bar: model download and load, then prompt prefill."""

    def compose(self):
        yield Label("", id="status-label")
        yield ProgressBar(show_eta=False, id="status-bar")

    def show(self, label: str, done: float | None = None, total: float | None = None) -> None:
        self.display = True
        self.query_one("#status-label", Label).update(label)
        bar = self.query_one("#status-bar", ProgressBar)
        bar.update(total=total, progress=done or 0)

    def hide(self) -> None:
        self.display = False


def _tps(x: float) -> str:
    return f"{x:,.1f} tok/s" if x else "-"


class MemoryPanel(Static):
    """The live memory panel. `stats` is ChatSession.snapshot(): KV numbers from tq_mlx.planner.memory.cache_bytes,
    the same function tq-generate's summary uses, saved against mlx-lm's own cache for the same tokens
    (memory.SAVED_AGAINST); with the plan (stats["plan"], tq_chat.plan.Plan) also what the cache reaches at --ctx,
    as --plan says it."""

    stats: reactive[dict | None] = reactive(None, always_update=True)

    def __init__(self, **kwargs):
        super().__init__("", **kwargs)
        self.border_title = "memory"

    def watch_stats(self, stats: dict | None) -> None:
        self.update(self.render_stats(stats) if stats else Text("loading model…", style="dim"))

    def render_stats(self, s: dict) -> Group:
        width = max(self.content_size.width, 20) if self.content_size.width else 34
        used, ctx = s["context_tokens"], s["ctx"]
        good = s["mlx_lm_bytes"] > s["kv_bytes"]
        window = window_text(s)
        sections = [
            ("KV cache", [
                ("held", format_bytes(s["kv_bytes"]), "bold"),
                # what the user would hold without tq-mlx: mlx-lm's KVCache, in the model's dtype
                (f"mlx-lm {s['kv_dtype'] or 'float'} cache", format_bytes(s["mlx_lm_bytes"]), ""),
                ("saved", saving_text(s, basis=False), "bold green" if good else "dim"),
                *([("compressed", f"{s['compressed_tokens']:,} tokens", "")] if window else []),
                *([("other cache state", format_bytes(s["other_bytes"]), "")] if s.get("other_bytes") else []),
                ("context", f"{used:,} / {ctx:,}", "red" if used >= ctx else ""),
            ]),
            ("process", [
                ("weights", format_bytes(s["weights"]), ""),
                ("MLX active", format_bytes(s["active"]), ""),
                ("MLX peak", format_bytes(s["peak"]), ""),
                *([("planned peak", format_bytes(s["planned_peak"]), "dim")] if s.get("planned_peak") else []),
            ]),
            ("speed", [
                ("prefill", f"{s['prefill'][0]:,} / {s['prefill'][1]:,}" if s.get("prefill") else _tps(s["prompt_tps"]), ""),
                ("decode", _tps(s["decode_tps"]), ""),
            ]),
        ]
        parts = []
        for title, rows in sections:
            grid = Table.grid(padding=(0, 1), expand=True)
            grid.add_column(no_wrap=True, ratio=1)
            grid.add_column(no_wrap=True)
            grid.add_row(Text(title, style="bold underline"), "")
            for label, value, style in rows:
                # Text(justify=...) because a widget's own alignment would override the column's.
                grid.add_row(Text(label, style="bold"), Text(value, style=style, justify="right"))
            parts.append(grid)
            if title == "KV cache":
                parts.append(RichBar(total=max(ctx, 1), completed=min(used, ctx), width=width,
                                     complete_style="red" if used >= ctx else "cyan", finished_style="red"))
                plan = s.get("plan")
                notes = [window] if window else []
                if plan is not None and plan.config is not None:  # what the first screen cannot show yet
                    notes.append(planned_text(plan.saving, plan.ctx, plan.kv_dtype))
                if notes:
                    parts += [Text(""), *(Text(n, style="dim") for n in notes)]  # the bar leaves its line open
            parts.append(Text(""))
        parts += [Text("bits per layer", style="bold underline"), Text(s["bits"]), Text(s["config"], style="dim")]
        return Group(*parts)
