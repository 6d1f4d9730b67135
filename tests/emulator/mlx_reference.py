"""MLX itself as the oracle for the source generator.

Outside a Mac, ``mx.fast.metal_kernel`` only runs inside ``mx.export_function``
tracing; with ``verbose=True`` it then prints the full generated source to
C++ ``std::cout`` (file descriptor 1). This captures that text so tests (and
CI) can compare it byte for byte with :func:`tests.emulator.generate_source`.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from typing import Any, Iterator, Sequence


@contextlib.contextmanager
def capture_fd1() -> Iterator[list[str]]:
    """Capture what is written to file descriptor 1 (C/C++ stdout) inside the block."""
    sys.stdout.flush()
    saved = os.dup(1)
    result: list[str] = []
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 1)
        try:
            yield result
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
            tmp.seek(0)
            result.append(tmp.read().decode())


def mlx_generated_source(
    name: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    source: str,
    inputs: Sequence[Any],
    output_shapes: Sequence[Sequence[int]],
    output_dtypes: Sequence[Any],
    header: str = "",
    template: Sequence[tuple[str, Any]] | None = None,
    atomic_outputs: bool = False,
    grid: tuple[int, int, int] = (32, 1, 1),
    threadgroup: tuple[int, int, int] = (32, 1, 1),
) -> str:
    """The exact source MLX generates for this call (mx.arrays or Python
    scalars as inputs; MLX dtypes for outputs and templates)."""
    import mlx.core as mx

    kern = mx.fast.metal_kernel(
        name=name, input_names=list(input_names), output_names=list(output_names),
        source=source, header=header, atomic_outputs=atomic_outputs,
    )
    arrays = [x for x in inputs if isinstance(x, mx.array)]

    def f(*args: Any) -> Any:
        it = iter(args)
        ins = [next(it) if isinstance(x, mx.array) else x for x in inputs]
        return kern(
            inputs=ins, output_shapes=[tuple(s) for s in output_shapes],
            output_dtypes=list(output_dtypes), grid=grid, threadgroup=threadgroup,
            template=list(template) if template else None, verbose=True,
        )

    with tempfile.TemporaryDirectory() as td, capture_fd1() as out:
        mx.export_function(os.path.join(td, "kernel.mlxfn"), f, *arrays)
    text = out[0]
    m = re.search(
        r"Generated source code for `" + re.escape(name) + r"`:\n```\n(.*)\n```\n", text, re.S
    )
    if not m:
        raise RuntimeError(f"MLX printed no source for `{name}`; got:\n{text[:2000]}")
    return m.group(1)
