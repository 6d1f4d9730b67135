"""Waiting for a server subprocess (tq-server, mlx_lm.server) to answer on localhost."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path


def stop(proc: subprocess.Popen, grace: float = 15) -> None:
    """Stop a server started in its own process group: SIGTERM to the group, SIGKILL after `grace` seconds."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)


def wait_until_healthy(proc: subprocess.Popen, port: int, log: Path, timeout: float, name: str = "tq-server") -> None:
    """Return once http://127.0.0.1:port/health answers; fail with the server's log if it exits or times out."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"{name} exited early:\n{log.read_text()}"
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
            return
        except OSError:  # URLError and connection errors are OSErrors
            assert time.monotonic() < deadline, f"{name} did not start:\n{log.read_text()}"
            time.sleep(0.3)
