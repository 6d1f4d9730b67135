"""Attention as the hook runs it: the caches learn from the queries first (tq_mlx.batch.learned), then the
attention function reads the views that step returns. Attention itself only reads: given views whose cache still
wants the queries it raises, so tests that attend views straight from update_and_fetch wrap the attention function
they test with `learning`."""

from __future__ import annotations

import functools
import inspect
from typing import Callable

from tq_mlx.batch import learned


def learning(attend: Callable) -> Callable:
    """`attend` (turboquant_attention, dispatch_attention, ...; queries, keys, values, scale first) after the
    caches of its views learned from its queries, as tq_mlx.hook.fetched_attention runs it."""
    signature = inspect.signature(attend)

    @functools.wraps(attend)
    def wrapped(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        a = bound.arguments
        a["keys"], a["values"] = learned(a["queries"], a["keys"], a["values"], a.get("scale"))
        return attend(*bound.args, **bound.kwargs)

    return wrapped
