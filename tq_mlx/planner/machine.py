"""The weights and the machine: what a model's weights take in memory (weight_bytes, from its safetensors headers)
and what this machine can give MLX (available_memory)."""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path

import mlx.core as mx

# safetensors dtype names -> bytes per element
_ST_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8,
}
_ST_FLOATS = {"F16", "BF16", "F32", "F64"}


def safetensors_header(path: str | os.PathLike) -> dict:
    """The JSON header of a .safetensors file (tensor name -> dtype, shape, data_offsets)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100_000_000:
            raise ValueError(f"{path}: not a safetensors file (header length {n})")
        return json.loads(f.read(n))


def weight_bytes(model_path: str | os.PathLike, dtype: str | None = None) -> int:
    """Bytes the model's weights take in memory, from the safetensors headers of a local model folder.

    dtype ("float16", "bfloat16", "float32") counts floating tensors as cast to it, as `--dtype` does at load
    time; quantized weights (uint32) keep their size. A file whose header cannot be read counts its size.
    """
    target = {None: None, "float16": 2, "bfloat16": 2, "float32": 4}
    if dtype not in target:
        raise ValueError(f"dtype must be one of float16, bfloat16, float32, got {dtype!r}")
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model_path}")
    total = 0
    for f in files:
        try:
            header = safetensors_header(f)
        except (OSError, ValueError, struct.error):
            total += f.stat().st_size
            continue
        for name, t in header.items():
            if name == "__metadata__":
                continue
            begin, end = t["data_offsets"]
            n = end - begin
            if target[dtype] and t["dtype"] in _ST_FLOATS:
                n = n // _ST_DTYPE_BYTES[t["dtype"]] * target[dtype]
            total += n
    return total


def available_memory() -> int:
    """Bytes this machine can give MLX: on Apple silicon MLX's recommended working set (what mlx-lm wires),
    elsewhere the physical memory."""
    try:
        if mx.metal.is_available():
            info = mx.device_info()
            if "max_recommended_working_set_size" in info:
                return int(info["max_recommended_working_set_size"])
    except (AttributeError, RuntimeError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    raise RuntimeError(f"cannot tell how much memory this machine has ({sys.platform})")


