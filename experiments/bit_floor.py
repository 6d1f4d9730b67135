"""What issue 53's bit targets ask of the codes: the planner's bits/value (tq_mlx.planner.memory.estimate_kv_bytes,
float parts in float16, as a Mac holds them) of settings whose widths a plan knows, on the Qwen2.5-Coder models'
geometry: every layer's keys at K4 or K5, values at V4 or V3, the default's 768-token window or 128 tokens
(calibrating on 768), the default's decay otherwise. No model runs: the model folders' config.json only.

    python experiments/bit_floor.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "benchmarks")]

import common  # noqa: E402,F401  (puts the repo on sys.path)

from tests.support.real_models import qwen25_coder_05b_path, qwen25_coder_15b_path  # noqa: E402
from tq_mlx import TurboQuantConfig  # noqa: E402
from tq_mlx.models.architectures import attention_layout, load_model_config  # noqa: E402
from tq_mlx.planner.memory import estimate_kv_bytes  # noqa: E402

SMALL = dict(window=128, calibration_tokens=768)
ROWS = (  # label, config, every layer's key width (None: the config's key bits)
    ("K4, V4 (the default's codes, none widened), window 768", TurboQuantConfig(key_error=None), None),
    ("K4, V4, window 128", TurboQuantConfig(key_error=None, **SMALL), None),
    ("K5, V4, window 128", TurboQuantConfig(**SMALL), 5),
    ("K4, V3, window 128", TurboQuantConfig(key_error=None, value_bits=3, **SMALL), None),
)
MODELS = (("Qwen2.5-Coder-1.5B", qwen25_coder_15b_path, (8192, 32768)), ("Qwen2.5-Coder-0.5B", qwen25_coder_05b_path, (32768,)))


def bits(model_config: dict, ctx: int, config: TurboQuantConfig, key_width: int | None) -> float:
    lay = attention_layout(model_config)
    n = len(lay.full_layers)
    widths = None if key_width is None else [key_width] * n
    held = estimate_kv_bytes(model_config, ctx, config, dtype="float16", key_widths=widths)
    return held * 8 / (ctx * n * lay.n_kv_heads * (lay.head_dim + lay.v_head_dim))


def main() -> None:
    configs = [(name, load_model_config(path()), contexts) for name, path, contexts in MODELS]
    head = " | ".join(f"{name} {ctx // 1024}k" for name, _, contexts in configs for ctx in contexts)
    print(f"| every layer's keys at | {head} |")
    print("|:--|" + "--:|" * sum(len(c) for *_, c in configs))
    for label, config, width in ROWS:
        cells = " | ".join(f"{bits(mc, ctx, config, width):.2f}" for _, mc, contexts in configs for ctx in contexts)
        print(f"| {label} | {cells} |")


if __name__ == "__main__":
    main()
