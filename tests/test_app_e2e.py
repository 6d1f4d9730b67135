"""tq-chat end to end: the real command on the demo model (SmolLM2-135M-Instruct), in a real terminal.

Types a question, reads a sensible answer and the memory panel off the screen, checks the panel against
tq_mlx.planner.memory's estimate for the tokens it shows, saves an SVG screenshot (/screenshot) and quits.
The terminal is a pseudo-terminal read through pyte (pexpect + pyte, both from PyPI: nothing from apt), and
tmux as well where it is installed (CI). Set TQ_CHAT_SCREENSHOT=/some/file.svg to keep the screenshot
(docs/tq-chat.png is made by `python tools/docs/docs_assets.py`).

The tests wait on the app's state, not on text appearing: tq-chat appends its state changes (ready, a turn over,
a command done) to the file $TQ_CHAT_EVENT_LOG names, and a test types the next thing only once the app said it
is done with the last (on a loaded machine, decoding at 1.3 tok/s, the answer's speed showed up in the panel
while it was still streaming, and /load typed then was refused). Text on the screen is read only once the app
is idle, and waited for with the figures the event gives (the context's token count).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pexpect
import pyte
import pytest

from tq_mlx.cache import TurboQuantConfig
from tq_mlx.models.architectures import load_model_config
from tq_mlx.planner.display import format_bytes
from tq_mlx.planner.memory import estimate_kv_bytes

REPO = Path(__file__).resolve().parents[1]
WIDTH, HEIGHT = 140, 44

pytestmark = pytest.mark.slow


class PtyTerminal:
    """`command` in a pseudo-terminal (pexpect); its output drawn by a VT100 emulator (pyte)."""

    def __init__(self, command: list[str], env: dict[str, str], width: int = WIDTH, height: int = HEIGHT):
        self.screen_ = pyte.Screen(width, height)
        self.stream = pyte.Stream(self.screen_)
        self.transcript: list[str] = []  # everything the app wrote, to look for tracebacks
        # COLUMNS/LINES (set under pytest) would pin the app to that size instead of the terminal's.
        env = {**{k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}, **env}
        self.child = pexpect.spawn(command[0], command[1:], env=env, cwd=str(REPO), dimensions=(height, width),
                                   encoding="utf-8", codec_errors="replace")

    def pump(self, timeout: float = 0.2) -> None:
        """Feed what the app wrote to the screen (also keeps the pty from filling up and blocking the app)."""
        try:
            while True:
                data = self.child.read_nonblocking(1 << 16, timeout=timeout)
                self.transcript.append(data)
                self.stream.feed(data)
                timeout = 0.05
        except (pexpect.TIMEOUT, pexpect.EOF):
            pass

    def screen(self) -> str:
        self.pump()
        return "\n".join(line.rstrip() for line in self.screen_.display)

    def type(self, text: str) -> None:
        self.child.send(text)
        self.pump()
        self.child.send("\r")

    def dead(self) -> bool:
        self.pump(0.05)
        return not self.child.isalive()

    def output(self) -> str:
        return "".join(self.transcript)

    def kill(self) -> None:
        if self.child.isalive():
            self.child.terminate(force=True)


class Tmux:
    """One tmux server of our own (its own socket), one session running `command`."""

    def __init__(self, command: str, env: dict[str, str], width: int = 140, height: int = 44):
        self.socket = f"tq-chat-test-{os.getpid()}"
        self.run("new-session", "-d", "-s", "chat", "-x", str(width), "-y", str(height),
                 *[a for k, v in env.items() for a in ("-e", f"{k}={v}")], command)
        self.run("set-option", "-t", "chat", "remain-on-exit", "on")

    def run(self, *args: str, check: bool = True) -> str:
        # The tmux server passes its environment to the app; COLUMNS/LINES (set under pytest) would pin the
        # app to that size instead of the pane's.
        env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
        return subprocess.run(["tmux", "-L", self.socket, *args], check=check, capture_output=True, text=True,
                              timeout=30, env=env).stdout

    def screen(self) -> str:
        return self.run("capture-pane", "-p", "-t", "chat", check=False)

    def type(self, text: str) -> None:
        self.run("send-keys", "-t", "chat", "-l", text)
        self.run("send-keys", "-t", "chat", "Enter")

    def dead(self) -> bool:
        return self.run("display-message", "-p", "-t", "chat", "#{pane_dead}", check=False).strip() in ("1", "")

    def output(self) -> str:
        return self.screen()

    def kill(self) -> None:
        self.run("kill-server", check=False)


def wait_for(term: PtyTerminal | Tmux, pattern: str, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while True:
        screen = term.screen()
        m = re.search(pattern, screen)
        if m:
            return m
        if term.dead() or time.monotonic() > deadline:
            pytest.fail(f"waited {timeout:.0f} s for {pattern!r}; the screen:\n{screen}")
        time.sleep(0.5)


class Events:
    """The app's state changes, read from its $TQ_CHAT_EVENT_LOG file (tq_chat.chat.ChatApp.log_event)."""

    def __init__(self, path: Path):
        self.path, self.seen = path, 0

    def wait(self, term, event: str, timeout: float, **match) -> dict:
        """The next `event` after the last one waited for (with the given fields), once the app logged it."""
        deadline = time.monotonic() + timeout
        while True:
            lines = self.path.read_text().splitlines() if self.path.exists() else []
            for i in range(self.seen, len(lines)):
                e = json.loads(lines[i])
                if e["event"] == event and all(e.get(k) == v for k, v in match.items()):
                    self.seen = i + 1
                    return e
            if term.dead() or time.monotonic() > deadline:
                pytest.fail(f"waited {timeout:.0f} s for the event {event} {match or ''}; events: {lines[self.seen:]}; "
                            f"the screen:\n{term.screen()}")
            term.screen()  # keep reading the pty: a full pty blocks the app
            time.sleep(0.3)

    def last(self, event: str) -> dict:
        """The latest `event` the app logged."""
        lines = self.path.read_text().splitlines() if self.path.exists() else []
        return [e for e in map(json.loads, lines) if e["event"] == event][-1]

    def turn(self, term, timeout: float = 900) -> dict:
        """Wait until the answer is over (whatever the speed); its event says how many tokens the context holds."""
        e = self.wait(term, "turn", timeout)
        assert not e["error"], e
        return e

    def command(self, term, typed: str, timeout: float = 60) -> dict:
        """Type a slash command and wait until the app has done it."""
        term.type(typed)
        return self.wait(term, "command", timeout, command=typed.split()[0].lower())


def panel(screen: str) -> str:
    """The memory panel's text: the right-hand 42 columns of the screen, borders dropped, one line."""
    lines = [line.ljust(WIDTH)[WIDTH - 42:] for line in screen.splitlines()]
    return " ".join(" ".join(lines).replace("│", " ").replace("╰", " ").replace("╭", " ").split())


def start(terminal: str, env: dict[str, str], events: Path, *flags: str):
    env = {**env, "TQ_CHAT_EVENT_LOG": str(events)}
    exe = shutil.which("tq-chat")
    cmd = [exe] if exe else [sys.executable, "-m", "tq_chat.main"]
    cmd += ["smollm2-135m", "--dtype", "float32", "--ctx", "4k", "--max-tokens", "40", *flags]
    # No LD_PRELOAD here: tq-chat brings in OpenBLAS itself where it is installed (tq_mlx.blas).
    if terminal == "pty":
        return PtyTerminal(cmd, env)
    return Tmux(f"cd {shlex.quote(str(REPO))} && exec {shlex.join(cmd)}", env)


def quit_cleanly(term, terminal: str) -> None:
    term.type("/quit")
    deadline = time.monotonic() + 30
    while not term.dead():
        assert time.monotonic() < deadline, f"tq-chat did not exit:\n{term.screen()}"
        time.sleep(0.3)
    assert "Traceback" not in term.output()
    if terminal == "pty":
        term.child.close()
        assert term.child.exitstatus == 0, (f"exit status {term.child.exitstatus}, signal "
                                            f"{term.child.signalstatus}:\n{term.output()[-2000:]}")


# tmux only where it is installed (CI): the pseudo-terminal needs nothing but PyPI, so it always runs.
TERMINALS = ["pty"] + (["tmux"] if shutil.which("tmux") else [])


@pytest.mark.parametrize("terminal", TERMINALS)
def test_tq_chat_answers_in_a_terminal(tmp_path, terminal):
    from tests.support.real_models import smollm2_path

    model = smollm2_path()  # the folder `tq-chat smollm2-135m` prepares (and here finds ready)
    env = {"TERM": "xterm-256color"}
    shot = Path(os.environ.get("TQ_CHAT_SCREENSHOT") or tmp_path / "tq-chat.svg").resolve()
    events = Events(tmp_path / "events.jsonl")
    term = start(terminal, env, events.path)
    try:
        events.wait(term, "ready", timeout=300)
        wait_for(term, r"Ready\. Type a message", timeout=30)
        term.type("What is the capital of France?")
        tokens = events.turn(term)["context"]  # the answer is over
        assert 30 < tokens < 120
        # the panel's final figures: its context line shows the tokens the app reported
        screen = wait_for(term, rf"context\s+{tokens:,} / 4,096", timeout=30).string
        assert "Paris" in screen, screen
        # the panel's KV figure is what memory's layout formula gives for that many tokens
        # (nothing is compressed yet, so no layer has chosen its keys' width: every layer as configured)
        expected = estimate_kv_bytes(load_model_config(model), tokens, TurboQuantConfig(), dtype="float32",
                                     key_widths=[None] * 30)
        text = panel(screen)
        assert f"held {format_bytes(expected)}" in text, text
        # against mlx-lm's own float32 cache as it allocates: 256-token steps of 30 layers x 3 kv heads x 64 x (k, v)
        mlx_lm = 30 * 3 * 64 * 2 * 4 * 256 * -(-tokens // 256)
        assert f"mlx-lm float32 cache {format_bytes(mlx_lm)}" in text, text
        ratio = mlx_lm / expected
        assert f"saved {format_bytes(mlx_lm - expected)} ({ratio:.2f}x)" in text and ratio > 1, text
        assert (f"all {tokens} tokens in float32 (4 sinks + 128-token window, 768 tokens until the first compression "
                "calibrates on them): compression starts at token 773" in text), text
        for label in ("compressed 0 tokens", "weights", "MLX active", "MLX peak", "prefill", "decode"):
            assert label in text
        assert re.search(r"decode\s+[\d.]+ tok/s", text), text
        # the default: K4/V4 at every age (the panel wraps the label); nothing is compressed yet, so no layer has
        # chosen its keys' width
        assert "K4/V4 on all 30 attention layers" in text, text
        events.command(term, f"/screenshot {shot}")
        wait_for(term, r"Saved a screenshot", timeout=30)
        assert shot.exists() and "Paris" in shot.read_text()
        quit_cleanly(term, terminal)
    finally:
        term.kill()


def test_every_command_and_save_load_continue_in_a_terminal(tmp_path):
    """Every slash command as a user types them; /save, /clear, /load, then the conversation goes on (it failed
    with "There is no Stream(cpu, 0) in current thread" after /load); /save to a missing folder is one line.
    A 16-token window, so that the saved cache holds compressed tokens (the default window holds the whole
    conversation in float) and /load brings them back. Each step waits for the app to finish the last one.
    Prefill not read as decode: at so small a window SmolLM2's first answer token is a near tie that reading as
    decode tips from "The capital of France is Paris" to "L'Étoile…" (tests/test_integration.py checks the
    distributions); this test checks the commands and what /load brings back, by the answers it names."""
    from tq_chat.chat import screenshot_dir

    events = Events(tmp_path / "events.jsonl")
    term = start("pty", {"TERM": "xterm-256color"}, events.path, "--tq-window", "16", "--tq-calibration-tokens", "16", "--tq-no-prefill-as-decode")
    saved = tmp_path / "conv.safetensors"

    def compressed(screen: str) -> int:
        return int(re.search(r"compressed ([\d,]+) tokens", panel(screen)).group(1).replace(",", ""))

    try:
        events.wait(term, "ready", timeout=300)
        events.command(term, "/help")
        wait_for(term, r"/load FILE", timeout=30)
        term.type("What is the capital of France?")
        tokens = events.turn(term)["context"]
        screen = wait_for(term, rf"context\s+{tokens:,} / 4,096", timeout=30).string
        assert "Paris" in screen, screen
        n_compressed = compressed(screen)
        assert n_compressed > 0
        events.command(term, "/stats")
        screen = wait_for(term, r"│ turns\s+│ 1 ", timeout=30).string
        assert re.search(r"│ saved\s+│ [\d.]+ [KM]B \([\d.]+x\)", screen), screen
        assert re.search(rf"│ context\s+│ {tokens:,} / 4,096 tokens", screen), screen
        events.command(term, "/bits")
        wait_for(term, r"Bits per layer", timeout=30)
        events.command(term, f"/save {saved}")
        m = wait_for(term, r"Saved ([\d,]+) tokens \(([\d.]+ [KMG]?B) of KV cache\)", timeout=30)
        assert int(m.group(1).replace(",", "")) == tokens and saved.exists()
        events.command(term, "/save /nonexistent_dir/x.safetensors")
        wait_for(term, r"Could not save: cannot save to /nonexistent_dir/x\.safetensors: the folder", timeout=30)
        events.command(term, "/clear")
        wait_for(term, r"New conversation\.", timeout=30)
        wait_for(term, r"context\s+0 / 4,096", timeout=30)
        events.command(term, f"/load {saved}")
        wait_for(term, rf"Loaded {tokens} tokens from", timeout=30)
        screen = wait_for(term, rf"context\s+{tokens:,} / 4,096", timeout=30).string
        assert "planned peak" in panel(screen), screen
        assert compressed(screen) == n_compressed > 0, panel(screen)  # the compressed tokens came back
        term.type("And what is the capital of Germany?")
        after = events.turn(term)["context"]
        assert after > tokens + 10  # the second question and its answer joined the loaded conversation
        screen = wait_for(term, rf"context\s+{after:,} / 4,096", timeout=30).string
        assert "Berlin" in screen and "generation failed" not in screen, screen
        events.command(term, "/load /nonexistent_dir/x.safetensors")
        wait_for(term, r"Could not load: no such file", timeout=30)
        events.command(term, "/nonsense")
        wait_for(term, r"Unknown command /nonsense", timeout=30)
        # a bare /screenshot goes into tq-mlx's cache folder, at the path the app prints and logs
        events.command(term, "/screenshot")
        shot = Path(events.last("screenshot")["path"])
        try:
            wait_for(term, r"Saved a screenshot to", timeout=30)
            assert shot.parent == screenshot_dir() and "Berlin" in shot.read_text()
        finally:
            shot.unlink(missing_ok=True)
        assert "Traceback" not in term.output()
        quit_cleanly(term, "pty")
    finally:
        term.kill()
