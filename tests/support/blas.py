"""Tests that compare a batch with its rows alone, bit for bit, on MLX's reference BLAS."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tq_mlx.blas import openblas_preloaded

REPO = Path(__file__).resolve().parents[2]


def reference_blas_env() -> dict:
    """This process's environment without OpenBLAS preloaded: MLX's reference BLAS, whose matmuls give a row of a
    batch exactly what they give it alone. OpenBLAS picks other kernels for other batch sizes (float32 keys
    differ by ~1e-6 from the sequence alone, with mlx-lm's own BatchKVCache too), and quantization can turn such a
    difference into another code, so a batch equals its rows alone only on the reference BLAS."""
    env = dict(os.environ, TQ_MLX_OPENBLAS="0")
    env["LD_PRELOAD"] = ":".join(p for p in env.get("LD_PRELOAD", "").replace(" ", ":").split(":")
                                 if p and "blas" not in p)
    return env


def ran_on_reference_blas(request) -> bool:
    """Under OpenBLAS, runs this test again in a pytest subprocess on the reference BLAS (asserting that it passes
    there) and returns True; returns False when this process already uses the reference BLAS."""
    if not openblas_preloaded():
        return False
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid],
                         cwd=REPO, env=reference_blas_env(), capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1].startswith("1 passed"), run.stdout[-2000:]
    return True
