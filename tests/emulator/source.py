"""Python re-implementation of MLX's Metal source generation for custom kernels.

Mirrors ``mlx/backend/common/metal_kernel.cpp`` (``metal_kernel``,
``write_signature``, ``write_template``) of the pinned MLX version, including its
quirks, so the emulator compiles exactly the text MLX would hand to Apple's
compiler. tests/test_emulator.py compares this output byte for byte with the
source MLX prints while tracing ``mx.export_function`` (no Metal needed).

Rules reproduced (docs/metal-on-linux.md §1.2):
* inputs with fewer than 8 elements are ``const constant T*``; 0-d inputs are
  ``const constant T&``; everything else ``const device T*``;
* ``<name>_shape`` / ``_strides`` / ``_ndim`` buffers are added when that
  substring occurs in ``source`` (the header is not searched), never for 0-d;
* the 20 thread attributes are added by substring match, alphabetically;
* the kernel name is ``custom_kernel_<name>[_<template>]`` plus ``_<type>`` per
  input (suffix ``s`` for 0-d, ``c`` for constant) and per output;
* the ``) {`` placement bug after outputs (compares a buffer index that counts
  shape/stride buffers with ``len(inputs) + len(outputs) - 1``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence, Union

from .dtypes import dtype_name, metal_type

MAX_CONSTANT_ARRAY_SIZE = 8

# (attribute, Metal type) in the order MLX lists them (alphabetical).
METAL_ATTRIBUTES: tuple[tuple[str, str], ...] = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)


@dataclass(frozen=True)
class ArgSpec:
    """What the generator needs to know about one input array."""

    dtype: str  # MLX dtype name, e.g. "float32"
    shape: tuple[int, ...]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n


@dataclass(frozen=True)
class Param:
    """One kernel parameter in buffer order.

    kind is "input", "shape", "strides", "ndim", "output" or "attr"; ``index``
    is the input/output position it belongs to (-1 for attributes).
    """

    kind: str
    name: str
    index: int
    ctype: str  # element type (inputs/outputs) or attribute type
    space: str = ""  # "device" / "constant" for buffers
    is_ref: bool = False  # 0-d input or ndim: bound by reference


@dataclass(frozen=True)
class GeneratedKernel:
    kernel_name: str  # host name, e.g. "custom_kernel_k_float_float"
    source: str  # full Metal source, exactly as MLX builds it (no preamble)
    template_def: str  # "<float, 3, 1>" or "" without templates
    params: tuple[Param, ...]
    attributes: tuple[str, ...]  # thread attributes used, in signature order


TemplateValue = Union[bool, int, Any]  # Any: an mx.Dtype / numpy dtype


def _as_spec(x: Any) -> ArgSpec:
    if isinstance(x, ArgSpec):
        return x
    # Python scalars become 0-d arrays as in MLX's to_array (bool before int).
    if isinstance(x, bool):
        return ArgSpec("bool", ())
    if isinstance(x, int):
        return ArgSpec("int32", ())
    if isinstance(x, float):
        return ArgSpec("float32", ())
    if isinstance(x, tuple) and len(x) == 2 and not hasattr(x, "dtype"):
        return ArgSpec(dtype_name(x[0]), tuple(int(d) for d in x[1]))
    return ArgSpec(dtype_name(x.dtype), tuple(int(d) for d in x.shape))


def _template_kind(value: Any) -> str:
    # Same order as MLX's Python binding: bool, then int, then Dtype.
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    try:
        dtype_name(value)
    except Exception:
        raise ValueError(
            "[metal_kernel] Invalid template argument. Must be `mlx.core.Dtype`, `int` or `bool`."
        ) from None
    return "typename"


def _template_value(value: Any) -> str:
    kind = _template_kind(value)
    if kind == "bool":
        return "1" if value else "0"  # std::ostream prints bools as 1/0
    if kind == "int":
        return str(int(value))
    return metal_type(value)


def write_template(template: Sequence[tuple[str, Any]]) -> str:
    return "<" + ", ".join(_template_value(v) for _, v in template) + ">"


def used_attributes(source: str) -> tuple[str, ...]:
    return tuple(a for a, _ in METAL_ATTRIBUTES if a in source)


def build_kernel(
    name: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    source: str,
    header: str,
    inputs: Sequence[Any],
    output_dtypes: Sequence[Any],
    template: Sequence[tuple[str, Any]] | None = None,
    atomic_outputs: bool = False,
) -> GeneratedKernel:
    """Build the Metal source and the parameter list exactly as MLX does."""
    if not output_names:
        raise ValueError("[metal_kernel] Must specify at least one output.")
    specs = [_as_spec(x) for x in inputs]
    if len(specs) != len(input_names):
        raise ValueError(
            f"[metal_kernel] Expected `inputs` to have size {len(input_names)} "
            f"but got size {len(specs)}."
        )
    if len(output_dtypes) != len(output_names):
        raise ValueError(
            f"[metal_kernel] Expected `output_dtypes` to have size {len(output_names)} "
            f"but got size {len(output_dtypes)}."
        )
    out_types = [metal_type(d) for d in output_dtypes]
    template = list(template or [])

    kernel_name = "custom_kernel_" + name
    template_def = ""
    if template:
        template_def = write_template(template)
        # MLX replaces "<", ">", ", " and (as the pinned wheel shows for
        # negative ints) "-" by "_", then pop_back()s the trailing "_".
        kernel_name += "_" + re.sub(r"<|>|, |-", "_", template_def)[:-1]
    for s in specs:
        kernel_name += "_" + metal_type(s.dtype)
        if s.ndim == 0:
            kernel_name += "s"
        elif s.size < MAX_CONSTANT_ARRAY_SIZE:
            kernel_name += "c"
    for t in out_types:
        kernel_name += "_" + t

    attrs = [(a, t) for a, t in METAL_ATTRIBUTES if a in source]
    params: list[Param] = []
    src = header
    if template:
        decl = []
        for tname, value in template:
            decl.append(f"{_template_kind(value)} {tname}")
        src += "template <" + ", ".join(decl) + ">\n"
    src += "[[kernel]] void " + kernel_name + "(\n"

    index = 0
    for i, (iname, spec) in enumerate(zip(input_names, specs)):
        space = "constant" if spec.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if spec.ndim == 0 else "*"
        ctype = metal_type(spec.dtype)
        src += f"  const {space} {ctype}{ref} {iname} [[buffer({index})]],\n"
        params.append(Param("input", iname, i, ctype, space, spec.ndim == 0))
        index += 1
        if spec.ndim > 0:
            if iname + "_shape" in source:
                src += f"  const constant int* {iname}_shape [[buffer({index})]],\n"
                params.append(Param("shape", iname + "_shape", i, "int", "constant"))
                index += 1
            if iname + "_strides" in source:
                src += f"  const constant int64_t* {iname}_strides [[buffer({index})]],\n"
                params.append(Param("strides", iname + "_strides", i, "int64_t", "constant"))
                index += 1
            if iname + "_ndim" in source:
                src += f"  const constant int& {iname}_ndim [[buffer({index})]],\n"
                params.append(Param("ndim", iname + "_ndim", i, "int", "constant", True))
                index += 1

    n_in, n_out = len(specs), len(output_names)
    for i, (oname, otype) in enumerate(zip(output_names, out_types)):
        full = f"atomic<{otype}>" if atomic_outputs else otype
        src += f"  device {full}* {oname} [[buffer({index})]]"
        # The MLX bug, kept on purpose: `index` also counts shape/strides/ndim
        # buffers, so with such buffers and no attributes ") {" comes too early.
        if index < n_in + n_out - 1 or attrs:
            src += ",\n"
        else:
            src += ") {\n"
        params.append(Param("output", oname, i, otype, "device"))
        index += 1

    for j, (attr, atype) in enumerate(attrs):
        src += f"  {atype} {attr} [[{attr}]]"
        src += ",\n" if j < len(attrs) - 1 else ") {\n"
        params.append(Param("attr", attr, -1, atype))
    src += source + "\n}\n"

    if template:
        full_def = kernel_name + template_def
        src += (
            f'\ntemplate [[host_name("{kernel_name}")]] [[kernel]] '
            f"decltype({full_def}) {full_def};\n"
        )
    return GeneratedKernel(
        kernel_name=kernel_name,
        source=src,
        template_def=template_def,
        params=tuple(params),
        attributes=tuple(a for a, _ in attrs),
    )


def generate_source(
    name: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    source: str,
    header: str,
    inputs: Sequence[Any],
    output_dtypes: Sequence[Any],
    template: Sequence[tuple[str, Any]] | None = None,
    atomic_outputs: bool = False,
) -> tuple[str, str]:
    """Return ``(kernel_host_name, full_source)`` as MLX would generate them.

    ``inputs`` items may be numpy arrays, mx.arrays, :class:`ArgSpec`,
    ``(dtype, shape)`` tuples or Python scalars; only dtype and shape matter.
    """
    g = build_kernel(
        name, input_names, output_names, source, header, inputs, output_dtypes,
        template, atomic_outputs,
    )
    return g.kernel_name, g.source


def mlx_verbose_block(name: str, full_source: str) -> str:
    """The text MLX's ``verbose=True`` writes to std::cout for one kernel call."""
    return f"Generated source code for `{name}`:\n```\n{full_source}\n```\n"


