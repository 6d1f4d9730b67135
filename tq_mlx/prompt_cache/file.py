"""A prompt-cache file as tq_mlx.prompt_cache.store writes and checks it: mlx-lm's save_prompt_cache layout, written
atomically with a CRC-32 of its data, and its safetensors header read and checked against the file's size.

`flatten_cache` gives the arrays and metadata mlx-lm's save_prompt_cache would write (its loader, and
tq_mlx.load_prompt_cache, read the file), each array a snapshot: a new array object on the same data, evaluated in
the calling thread, so the file can be written on another thread while the cache goes on. `write_file` writes them
to a temporary name in the same folder, syncs it and renames it over the final name (os.replace): the file is
whole or absent. `read_header` reads the header alone, no array, and checks that the file is as long as it
says (a truncated file fails there); `data_crc` is the checksum to compare with the one the header holds.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

MAX_HEADER = 64 << 20

_DTYPES = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.float64: "F64", mx.uint8: "U8",
           mx.uint16: "U16", mx.uint32: "U32", mx.uint64: "U64", mx.int8: "I8", mx.int16: "I16", mx.int32: "I32",
           mx.int64: "I64", mx.bool_: "BOOL"}
_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "U8": 1, "U16": 2, "U32": 4, "U64": 8, "I8": 1, "I16": 2,
             "I32": 4, "I64": 8, "BOOL": 1}


def read_header(path: Path) -> tuple[dict, dict, int]:
    """(tensors, metadata, data start) of a safetensors file, checked against its size; ValueError saying why
    not (truncated, not safetensors)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"truncated: {size} bytes")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER or 8 + n > size:
            raise ValueError(f"truncated or not a safetensors file: a {n:,}-byte header in {size:,} bytes")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise ValueError("not a safetensors file: its header is not JSON") from None
    if not isinstance(header, dict):
        raise ValueError("not a safetensors file: its header is not an object")
    meta = header.pop("__metadata__", {}) or {}
    end = 0
    for name, t in header.items():
        try:
            begin, stop = t["data_offsets"]
            want = math.prod(t["shape"]) * _ITEMSIZE[t["dtype"]]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"not a safetensors file: tensor {name!r} is not described") from None
        if not 0 <= begin <= stop or stop - begin != want:
            raise ValueError(f"damaged header: tensor {name!r} has {stop - begin} bytes for {want}")
        end = max(end, stop)
    if 8 + n + end != size:
        raise ValueError(f"truncated: {size:,} bytes, the header describes {8 + n + end:,}")
    return header, meta, 8 + n


def data_crc(path: Path, start: int) -> int:
    crc = 0
    with open(path, "rb") as f:
        f.seek(start)
        while chunk := f.read(16 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def flatten_cache(prompt_cache: list, metadata: dict) -> tuple[dict, dict]:
    """The arrays and string metadata mlx-lm's save_prompt_cache writes for `prompt_cache` (its layout, so its
    loader reads the file), each array a snapshot: a new array object on the same data, evaluated here."""
    scalars: list = [""]

    def leaf(item):
        i, data = item
        if isinstance(data, mx.array):
            return i, mx.array(data)
        if isinstance(data, (bool, int, float)):
            scalars.append((i, "scalar"))
            return i, mx.array(data)
        if isinstance(data, str):
            scalars.append((i, "string"))
            return i, mx.array([ord(c) for c in data])
        if data is None:
            scalars.append((i, "none"))
            return i, mx.array([])
        raise ValueError(f"prompt cache state is not serializable: {type(data).__name__}")

    arrays = dict(map(leaf, tree_flatten([c.state for c in prompt_cache])))
    mx.eval(list(arrays.values()))
    for k, a in arrays.items():
        if a.size and not memoryview(a).contiguous:
            arrays[k] = mx.contiguous(a)
    mx.eval(list(arrays.values()))
    meta = dict(tree_flatten([metadata, [type(c).__name__ for c in prompt_cache], scalars]))
    return arrays, {k: str(v) for k, v in meta.items()}


def write_file(path: Path, arrays: dict, metadata: dict) -> int:
    """Write a safetensors file atomically: to a temporary name beside `path`, synced, then renamed. The CRC-32
    of the data goes into the metadata ("0.crc32"). Returns the bytes written; OSError as the system said it."""
    names = sorted(arrays)
    views = [memoryview(arrays[k]) for k in names]
    crc, offset, tensors = 0, 0, {}
    for k, v in zip(names, views):
        a = arrays[k]
        tensors[k] = {"dtype": _DTYPES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + v.nbytes]}
        offset += v.nbytes
        crc = zlib.crc32(v, crc)
    header = json.dumps({**tensors, "__metadata__": {**metadata, "0.crc32": f"{crc:08x}"}}).encode()
    header += b" " * (-len(header) % 8)
    temp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:
        with open(temp, "xb") as f:
            f.write(len(header).to_bytes(8, "little") + header)
            for v in views:
                f.write(v)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        try:
            temp.unlink()
        except OSError:
            pass
        raise
    try:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
    return 8 + len(header) + offset
