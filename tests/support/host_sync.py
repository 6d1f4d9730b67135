"""A guard that fails on any host synchronization: evaluation, and every way an mx.array's data reaches the
host (its methods, numpy's conversions through __array__ or the buffer protocol, memoryview)."""

from __future__ import annotations

import builtins
import contextlib
from typing import Iterator

import mlx.core as mx
import numpy as np

_ARRAY_METHODS = ("item", "tolist", "__array__", "__float__", "__int__", "__bool__", "__index__")
_NUMPY_READERS = ("asarray", "array", "asanyarray", "ascontiguousarray", "frombuffer", "copy")


class HostSync(AssertionError):
    pass


@contextlib.contextmanager
def forbid_host_sync(monkeypatch) -> Iterator[None]:
    def boom(*a, **k):
        raise HostSync("host synchronization")

    def guarded(fn):
        def reader(obj, *a, **k):
            if isinstance(obj, mx.array):
                raise HostSync(f"host synchronization (numpy.{fn.__name__} of an mx.array)")
            return fn(obj, *a, **k)

        return reader

    with monkeypatch.context() as m:
        for n in _ARRAY_METHODS:
            m.setattr(mx.array, n, boom)
        m.setattr(mx, "eval", boom)
        m.setattr(mx, "async_eval", boom)
        for n in _NUMPY_READERS:
            m.setattr(np, n, guarded(getattr(np, n)))
        m.setattr(builtins, "memoryview", guarded(memoryview))
        yield
