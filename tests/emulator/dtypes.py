"""Dtype names shared by the source generator and the launcher.

Everything is normalised to MLX's dtype names ("float32", "bfloat16", ...), so
the generator does not need MLX to be importable.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# MLX dtype name -> Metal type string, as mlx/backend/common/compiled.cpp
# get_type_string() prints it.
METAL_TYPE: dict[str, str] = {
    "float32": "float",
    "float16": "float16_t",
    "bfloat16": "bfloat16_t",
    "complex64": "complex64_t",
    "bool": "bool",
    "int8": "int8_t",
    "int16": "int16_t",
    "int32": "int32_t",
    "int64": "int64_t",
    "uint8": "uint8_t",
    "uint16": "uint16_t",
    "uint32": "uint32_t",
    "uint64": "uint64_t",
}

# numpy storage dtype for each MLX dtype. bfloat16 is carried as its raw
# uint16 bit pattern unless ml_dtypes is installed (see numpy_dtype()).
_NUMPY_STORAGE: dict[str, Any] = {
    "float32": np.float32, "float16": np.float16, "bfloat16": np.uint16,
    "complex64": np.complex64, "bool": np.bool_,
    "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
    "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64,
}

try:  # optional: real bfloat16 numpy arrays
    import ml_dtypes as _ml_dtypes  # type: ignore

    BFLOAT16_NP: Any = np.dtype(_ml_dtypes.bfloat16)
except Exception:  # pragma: no cover - depends on the environment
    BFLOAT16_NP = None


def dtype_name(d: Any) -> str:
    """Normalise an mx.Dtype, numpy dtype/type or name string to an MLX dtype name."""
    if isinstance(d, str):
        name = d.removeprefix("mlx.core.")
        if name == "bool_":
            name = "bool"
        if name in METAL_TYPE:
            return name
        return dtype_name(np.dtype(d))
    # mx.Dtype prints as "mlx.core.float32"; avoid importing mlx here.
    if type(d).__name__ == "Dtype" and type(d).__module__.startswith("mlx"):
        return dtype_name(str(d))
    nd = np.dtype(d)
    if BFLOAT16_NP is not None and nd == BFLOAT16_NP:
        return "bfloat16"
    if nd == np.float64:
        raise TypeError("float64 is not a Metal type (Apple GPUs have no double)")
    name = "bool" if nd == np.bool_ else nd.name
    if name not in METAL_TYPE:
        raise TypeError(f"unsupported dtype for a Metal kernel: {nd}")
    return name


def metal_type(d: Any) -> str:
    """Metal type string for a dtype, e.g. float16 -> 'float16_t'."""
    return METAL_TYPE[dtype_name(d)]


def numpy_dtype(name: str) -> np.dtype:
    """numpy dtype used to hold an MLX dtype's bytes (bfloat16 -> ml_dtypes or uint16)."""
    if name == "bfloat16" and BFLOAT16_NP is not None:
        return BFLOAT16_NP
    return np.dtype(_NUMPY_STORAGE[name])


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """Widen raw bfloat16 bit patterns (uint16) to float32 exactly."""
    b = np.asarray(bits)
    if BFLOAT16_NP is not None and b.dtype == BFLOAT16_NP:
        return b.astype(np.float32)
    return (b.astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest-even) and return the uint16 bit patterns."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    out = np.where(nan, (u >> 16) | 0x40, rounded)
    return out.astype(np.uint16)
