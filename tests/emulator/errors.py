"""Exceptions raised by the MSL emulator."""

from __future__ import annotations

from typing import Any


class EmulatorUnavailable(RuntimeError):
    """No usable C++ compiler (clang >= 17 or the ziglang package)."""


class EmulatorCompileError(RuntimeError):
    """clang or a lint rejected the kernel (locations are `<kernel>.metal:line:col`)."""


class EmulatorError(RuntimeError):
    """The emulator caught a kernel bug at run time (barrier misuse, out-of-bounds
    access, threadgroup memory over the limit, ...). ``stats`` holds the partial
    launch statistics."""

    def __init__(self, message: str, stats: Any = None) -> None:
        super().__init__(message)
        self.stats = stats


class AsanReport(EmulatorError):
    """AddressSanitizer stopped the kernel (ASan build); the message is its report."""
