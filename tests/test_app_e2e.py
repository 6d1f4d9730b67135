"""tq-chat end to end: the real command on the demo model (SmolLM2-135M-Instruct), in a real terminal.

Types a question, reads a sensible answer and the memory panel off the screen, checks the panel against
tq_mlx.memory's estimate for the tokens it shows, saves an SVG screenshot (/screenshot) and quits.
The terminal is a pseudo-terminal read through pyte (pexpect + pyte, both from PyPI: nothing from apt), and
tmux as well where it is installed (CI). Set TQ_CHAT_SCREENSHOT=docs/tq-chat.svg to keep the screenshot.
"""

from __future__ import annotations

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
from tq_mlx.memory import estimate_kv_bytes, format_bytes, load_model_config

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


def panel(screen: str) -> str:
    """The memory panel's text: the right-hand 42 columns of the screen, borders dropped, one line."""
    lines = [line.ljust(WIDTH)[WIDTH - 42:] for line in screen.splitlines()]
    return " ".join(" ".join(lines).replace("│", " ").replace("╰", " ").replace("╭", " ").split())


def start(terminal: str, env: dict[str, str]):
    exe = shutil.which("tq-chat")
    cmd = [exe] if exe else [sys.executable, "-m", "tq_chat.main"]
    cmd += ["smollm2-135m", "--dtype", "float32", "--ctx", "4k", "--max-tokens", "40"]
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
    term = start(terminal, env)
    try:
        wait_for(term, r"Ready\. Type a message", timeout=180)
        term.type("What is the capital of France?")
        wait_for(term, r"Paris", timeout=180)
        # the answer is done when the panel shows a decode speed and the input box is back
        screen = wait_for(term, r"decode\s+[\d.]+ tok/s", timeout=180).string
        tokens = int(re.search(r"context\s+([\d,]+) / 4,096", screen).group(1).replace(",", ""))
        assert 30 < tokens < 120
        # the panel's KV figure is what memory's layout formula gives for that many tokens
        expected = estimate_kv_bytes(load_model_config(model), tokens, TurboQuantConfig(), dtype="float32")
        text = panel(screen)
        assert f"held {format_bytes(expected)}" in text, text
        # against mlx-lm's own float32 cache as it allocates: 256-token steps of 30 layers x 3 kv heads x 64 x (k, v)
        mlx_lm = 30 * 3 * 64 * 2 * 4 * 256 * -(-tokens // 256)
        assert f"mlx-lm float32 cache {format_bytes(mlx_lm)}" in text, text
        ratio = mlx_lm / expected
        assert f"saved {format_bytes(mlx_lm - expected)} ({ratio:.2f}x)" in text and ratio > 1, text
        assert (f"all {tokens} tokens in float32 (4 sinks + 768-token window): compression starts at token 773"
                in text), text
        for label in ("compressed 0 tokens", "weights", "MLX active", "MLX peak", "prefill", "decode"):
            assert label in text
        # the default: K4/V4, decaying to K3/V2 after 6144 tokens (the panel wraps the label)
        assert "K4→3/V4→2 after 6144 on all 30 attention layers" in text, text
        term.type(f"/screenshot {shot}")
        wait_for(term, r"Saved a screenshot", timeout=30)
        assert shot.exists() and "Paris" in shot.read_text()
        quit_cleanly(term, terminal)
    finally:
        term.kill()


def test_every_command_and_save_load_continue_in_a_terminal(tmp_path):
    """Every slash command as a user types them; /save, /clear, /load, then the conversation goes on (it failed
    with "There is no Stream(cpu, 0) in current thread" after /load); /save to a missing folder is one line."""
    term = start("pty", {"TERM": "xterm-256color"})
    saved = tmp_path / "conv.safetensors"
    try:
        wait_for(term, r"Ready\. Type a message", timeout=180)
        term.type("/help")
        wait_for(term, r"/load FILE", timeout=30)
        term.type("What is the capital of France?")
        wait_for(term, r"Paris", timeout=180)
        wait_for(term, r"decode\s+[\d.]+ tok/s", timeout=180)
        for _ in range(60):  # /stats is refused until the answer ends
            term.type("/stats")
            screen = wait_for(term, r"│ turns\s+│ 1 |has to wait until the answer ends", timeout=30).string
            if "│ turns" in screen:
                break
            time.sleep(2)
        assert re.search(r"│ saved\s+│ [\d.]+ [KM]B \([\d.]+x\)", screen), screen
        tokens = int(re.search(r"│ context\s+│ ([\d,]+) / 4,096 tokens", screen).group(1).replace(",", ""))
        term.type("/bits")
        wait_for(term, r"Bits per layer", timeout=30)
        term.type(f"/save {saved}")
        m = wait_for(term, r"Saved ([\d,]+) tokens \(([\d.]+ [KMG]?B) of KV cache\)", timeout=60)
        assert int(m.group(1).replace(",", "")) == tokens and saved.exists()
        term.type("/save /nonexistent_dir/x.safetensors")
        wait_for(term, r"Could not save: cannot save to /nonexistent_dir/x\.safetensors: the folder", timeout=30)
        term.type("/clear")
        wait_for(term, r"New conversation\.", timeout=30)
        assert re.search(r"context\s+0 / 4,096", term.screen())
        term.type(f"/load {saved}")
        wait_for(term, rf"Loaded {tokens} tokens from", timeout=60)
        screen = term.screen()
        assert re.search(rf"context\s+{tokens} / 4,096", screen) and "planned peak" in panel(screen), screen
        term.type("And what is the capital of Germany?")
        screen = wait_for(term, r"Berlin|generation failed", timeout=180).string
        assert "generation failed" not in screen, screen
        screen = wait_for(term, r"decode\s+[\d.]+ tok/s", timeout=180).string
        after = int(re.search(r"context\s+([\d,]+) / 4,096", screen).group(1).replace(",", ""))
        assert after > tokens + 10  # the second question and its answer joined the loaded conversation
        term.type("/load /nonexistent_dir/x.safetensors")
        wait_for(term, r"Could not load: no such file", timeout=30)
        term.type("/nonsense")
        wait_for(term, r"Unknown command /nonsense", timeout=30)
        term.type(f"/screenshot {tmp_path / 'shot.svg'}")
        wait_for(term, r"Saved a screenshot", timeout=30)
        assert "Berlin" in (tmp_path / "shot.svg").read_text()
        assert "Traceback" not in term.output()
        quit_cleanly(term, "pty")
    finally:
        term.kill()
