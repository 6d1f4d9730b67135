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


# tmux only where it is installed (CI): the pseudo-terminal needs nothing but PyPI, so it always runs.
TERMINALS = ["pty"] + (["tmux"] if shutil.which("tmux") else [])


@pytest.mark.parametrize("terminal", TERMINALS)
def test_tq_chat_answers_in_a_terminal(tmp_path, terminal):
    from tests.support.real_models import smollm2_path

    model = smollm2_path()  # the folder `tq-chat smollm2-135m` prepares (and here finds ready)
    exe = shutil.which("tq-chat")
    cmd = [exe] if exe else [sys.executable, "-m", "tq_chat.main"]
    cmd += ["smollm2-135m", "--dtype", "float32", "--ctx", "4k", "--max-tokens", "40"]
    # No LD_PRELOAD here: tq-chat brings in OpenBLAS itself where it is installed (tq_mlx.blas).
    env = {"TERM": "xterm-256color"}
    shot = Path(os.environ.get("TQ_CHAT_SCREENSHOT") or tmp_path / "tq-chat.svg").resolve()

    if terminal == "pty":
        term = PtyTerminal(cmd, env)
    else:
        term = Tmux(f"cd {shlex.quote(str(REPO))} && exec {shlex.join(cmd)}", env)
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
        assert re.search(rf"held\s+{re.escape(format_bytes(expected))}", screen), screen
        fp16 = 30 * 3 * 64 * 2 * 2 * tokens  # layers x kv heads x head_dim x (k, v) x float16
        assert re.search(rf"float16 would hold\s+{re.escape(format_bytes(fp16))}", screen), screen
        for label in ("saved", "ratio", "weights", "MLX active", "MLX peak", "prefill", "decode"):
            assert label in screen
        assert "K4/V3 on all 30 attention layers" in screen
        term.type(f"/screenshot {shot}")
        wait_for(term, r"Saved a screenshot", timeout=30)
        assert shot.exists() and "Paris" in shot.read_text()
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
    finally:
        term.kill()
