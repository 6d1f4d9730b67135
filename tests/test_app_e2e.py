"""tq-chat end to end: the real command on the converted SmolLM2-135M-Instruct, in a real terminal (tmux).

Types a question, reads a sensible answer and the memory panel off the screen, checks the panel against
tq_mlx.memory's estimate for the tokens it shows, saves an SVG screenshot (/screenshot) and quits.
Set TQ_CHAT_SCREENSHOT=docs/tq-chat.svg to keep the screenshot.
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

import pytest

from tq_mlx.cache import TurboQuantConfig
from tq_mlx.memory import estimate_kv_bytes, format_bytes, load_model_config

REPO = Path(__file__).resolve().parents[1]
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"

pytestmark = pytest.mark.slow


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

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            m = re.search(pattern, screen)
            if m:
                return m
            if self.dead() or time.monotonic() > deadline:
                pytest.fail(f"waited {timeout:.0f} s for {pattern!r}; the screen:\n{screen}")
            time.sleep(0.5)

    def kill(self) -> None:
        self.run("kill-server", check=False)


def test_tq_chat_answers_in_a_terminal(tmp_path):
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (apt-get install tmux)")
    from tests.support.real_models import smollm2_path

    model = smollm2_path()
    exe = shutil.which("tq-chat")
    cmd = [exe] if exe else [sys.executable, "-m", "app.main"]
    cmd += [str(model), "--dtype", "float32", "--ctx", "4k", "--max-tokens", "40"]
    env = {"TERM": "xterm-256color", "PYTHONPATH": str(REPO)}
    if sys.platform.startswith("linux") and Path(OPENBLAS).exists():
        env["LD_PRELOAD"] = OPENBLAS  # MLX's CPU wheel links a reference BLAS (real-models.md §3)
    shot = Path(os.environ.get("TQ_CHAT_SCREENSHOT") or tmp_path / "tq-chat.svg").resolve()

    tmux = Tmux(f"cd {shlex.quote(str(REPO))} && exec {shlex.join(cmd)}", env)
    try:
        tmux.wait_for(r"Ready\. Type a message", timeout=180)
        tmux.type("What is the capital of France?")
        tmux.wait_for(r"Paris", timeout=180)
        # the answer is done when the panel shows a decode speed and the input box is back
        screen = tmux.wait_for(r"decode\s+[\d.]+ tok/s", timeout=180).string
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
        tmux.type(f"/screenshot {shot}")
        tmux.wait_for(r"Saved a screenshot", timeout=30)
        assert shot.exists() and "Paris" in shot.read_text()
        tmux.type("/quit")
        deadline = time.monotonic() + 30
        while not tmux.dead():
            assert time.monotonic() < deadline, f"tq-chat did not exit:\n{tmux.screen()}"
            time.sleep(0.3)
        assert "Traceback" not in tmux.screen()
    finally:
        tmux.kill()
