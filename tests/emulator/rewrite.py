"""Source rewrites and lints applied to MLX-generated Metal source before clang.

Macros cannot do these (docs/metal-on-linux.md §4):

1. ``template [[host_name("...")]] [[kernel]] decltype(...) f<...>;`` loses its
   attributes: C++ forbids attributes on an explicit instantiation.
2. ``threadgroup T name[N];`` declarations become a reference bound to storage
   from the runtime (``tqemu::tg_alloc``), shared by the whole threadgroup,
   poisoned with 0xFF at the start of each threadgroup and bounds-checked.
   Pointer/reference declarations (``threadgroup T* p``) are left alone: there
   ``threadgroup`` is just the address-space macro.
3. ``1.0h`` / ``2bf`` literals become casts.

Every rewrite keeps the line structure, so clang's diagnostics point at the
same lines as MLX's generated source.
"""

from __future__ import annotations

import re

_BRACKETS = {"(": ")", "[": "]", "{": "}", "<": ">"}


class RewriteError(ValueError):
    """The source uses a construct the emulator (or Metal) cannot accept."""


def mask_comments_and_strings(src: str) -> str:
    """Same-length copy of ``src`` with comments, string/char literals and
    preprocessor lines replaced by spaces (newlines kept)."""
    out = list(src)
    i, n = 0, len(src)
    line_start = True
    while i < n:
        c = src[i]
        if line_start and c == "#":
            j = i
            while j < n and src[j] != "\n":  # a directive, with continuations
                if src[j] == "\\" and j + 1 < n and src[j + 1] == "\n":
                    j += 2
                    continue
                j += 1
            for k in range(i, j):
                if out[k] != "\n":
                    out[k] = " "
            i = j
            continue
        if c == "/" and i + 1 < n and src[i + 1] == "/":
            j = src.find("\n", i)
            j = n if j < 0 else j
            for k in range(i, j):
                out[k] = " "
            i = j
            continue
        if c == "/" and i + 1 < n and src[i + 1] == "*":
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            for k in range(i, j):
                if out[k] != "\n":
                    out[k] = " "
            i = j
            continue
        if c in "\"'":
            j = i + 1
            while j < n and src[j] != c:
                j += 2 if src[j] == "\\" else 1
            j = min(j + 1, n)
            for k in range(i, j):
                out[k] = " "
            i = j
            continue
        if c == "\n":
            line_start = True
        elif not c.isspace():
            line_start = False
        i += 1
    return "".join(out)


_INSTANTIATION_ATTRS = re.compile(r"\btemplate(\s*\[\[(?:[^\]]|\](?!\]))*\]\])+")


def strip_instantiation_attributes(src: str) -> str:
    """``template [[host_name("x")]] [[kernel]] decltype(...)`` -> ``template decltype(...)``."""
    return _INSTANTIATION_ATTRS.sub("template", src)


def _split_top_level(text: str, sep: str = ",") -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def _outside_brackets(text: str) -> str:
    """``text`` with everything inside [...] removed (array bounds may hold calls)."""
    out, depth = [], 0
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def _split_declarator(decl: str) -> tuple[str, str, str] | None:
    """'metal::vec<T, 4> buf[N][2]' -> ('metal::vec<T, 4>', 'buf', '[N][2]')."""
    decl = decl.strip()
    b = decl.find("[")
    head, dims = (decl, "") if b < 0 else (decl[:b], decl[b:])
    m = re.match(r"^(.*?)([A-Za-z_]\w*)\s*$", head, re.S)
    if not m:
        return None
    return m.group(1).strip(), m.group(2), dims.strip()


_TG_KEYWORD = re.compile(r"\bthreadgroup\b")


def rewrite_threadgroup_decls(src: str) -> str:
    """Turn threadgroup variable declarations into runtime-backed references."""
    masked = mask_comments_and_strings(src)
    edits: list[tuple[int, int, str]] = []
    for m in _TG_KEYWORD.finditer(masked):
        start = m.start()
        k = start - 1
        while k >= 0 and masked[k].isspace():
            k -= 1
        if k >= 0 and masked[k] not in ";{}":
            continue  # not at the start of a statement: a cast, parameter, ...
        end = masked.find(";", m.end())
        if end < 0:
            continue
        body = masked[m.end():end]
        flat = _outside_brackets(body)
        if "(" in flat or ")" in flat:
            continue  # a function declaration or an expression
        decls = _split_top_level(body)
        first = _split_declarator(decls[0])
        if first is None:
            continue
        type_text, _, _ = first
        if not type_text or "*" in type_text or "&" in type_text:
            continue  # pointer or reference into threadgroup memory
        line = src.count("\n", 0, start) + 1
        if "=" in flat:
            raise RewriteError(
                f"line {line}: threadgroup variables cannot have an initializer in Metal"
            )
        pieces = []
        for i, d in enumerate(decls):
            parts = _split_declarator(d if i == 0 else f"{type_text} {d.strip()}")
            # A "*" inside the array bounds (threadgroup float buf[2 * N]) is arithmetic, not a pointer.
            if parts is None or "*" in _outside_brackets(d) or "&" in _outside_brackets(d):
                raise RewriteError(f"line {line}: unsupported threadgroup declaration: {d.strip()}")
            _, name, dims = parts
            t = f"tqemu_tg_t_{name}"
            key = f"tqemu_tg_k_{name}"
            pieces.append(
                f"using {t} = threadgroup {type_text} {dims}; static const char {key} = 0; "
                f"{t}& {name} = *({t}*)::tqemu::tg_alloc(&{key}, sizeof({t}), alignof({t}), "
                f'"{name}", __FILE__, __LINE__);'
            )
        original = src[start : end + 1]
        replacement = " ".join(pieces) + "\n" * original.count("\n")
        edits.append((start, end + 1, replacement))
    for s, e, r in reversed(edits):
        src = src[:s] + r + src[e:]
    return src


_LITERAL = re.compile(
    r"(?<![\w.])((?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)(bf|BF|h|H)\b"
)


def rewrite_literals(src: str) -> str:
    """``1.0h`` -> ``((half)1.0f)``, ``0.5bf`` -> ``((bfloat)0.5f)``."""
    masked = mask_comments_and_strings(src)
    edits = []
    for m in _LITERAL.finditer(masked):
        num = m.group(1)
        if not re.search(r"[.eE]", num):
            num += ".0"
        elif num.endswith("."):
            num += "0"
        typ = "half" if m.group(2) in ("h", "H") else "bfloat"
        edits.append((m.start(), m.end(), f"(({typ}){num}f)"))
    for s, e, r in reversed(edits):
        src = src[:s] + r + src[e:]
    return src


def rewrite_source(src: str) -> str:
    """All rewrites, in the order they must happen."""
    src = strip_instantiation_attributes(src)
    src = rewrite_threadgroup_decls(src)
    return rewrite_literals(src)


def lint(source: str, header: str = "") -> tuple[list[str], list[str]]:
    """Checks clang cannot do for us. Returns (errors, warnings)."""
    errors: list[str] = []
    warnings: list[str] = []
    body = mask_comments_and_strings(source)
    both = mask_comments_and_strings(header) + "\n" + body
    # MLX adds the attribute parameters by substring match on the raw source,
    # so the check uses the raw text too.
    if "thread_execution_width" in source and "threads_per_simdgroup" in source:
        errors.append(
            "the kernel uses both thread_execution_width and threads_per_simdgroup: "
            "Apple's compiler rejects that combination"
        )
    if re.search(r"\bdouble\b", both):
        errors.append("`double` is not supported by Metal on Apple GPUs")
    if re.search(r"\b(goto|throw|try|virtual|new|delete)\b", both):
        errors.append("goto/exceptions/virtual/new/delete are not allowed in Metal kernels")
    if re.search(
        r"static_cast\s*<\s*(?:u?int|float|half|bfloat|u?short|u?char|u?long|bool)[234]\s*>",
        both,
    ):
        warnings.append(
            "static_cast<vectorN>(...) between vector types is a bitcast in the emulator "
            "(clang) but a value conversion in Metal: prefer the float4(x) constructor form"
        )
    return errors, warnings
