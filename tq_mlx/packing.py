"""Bit packing of b-bit codes into uint32 words along the last axis.

Widths that divide 32 (1, 2, 4, 8) pack 32/b codes per word, code i of a word at bits [b·i, b·i + b).
A 3-bit code is stored as two bit planes, its low 2 bits in a 2-bit plane followed by its high bit in a
1-bit plane: exactly 3 bits per code, and every plane unpacks with one shift-and-mask, with no code
straddling two words (this also keeps Metal kernels branch-free). A last word that is not full is
zero-padded.
"""

from __future__ import annotations

import mlx.core as mx

SUPPORTED_BITS = (1, 2, 3, 4, 8)
_PLANES = {1: (1,), 2: (2,), 3: (2, 1), 4: (4,), 8: (8,)}


def _check_bits(bits: int) -> None:
    if bits not in _PLANES or isinstance(bits, bool):
        raise ValueError(f"packing supports bits in {SUPPORTED_BITS}, got {bits!r}")


def planes(bits: int) -> tuple[int, ...]:
    """The bit-plane widths a code of `bits` bits is stored as, lowest bits first."""
    _check_bits(bits)
    return _PLANES[bits]


def packed_words(n: int, bits: int) -> int:
    """How many uint32 words hold n codes of `bits` bits."""
    return sum(-(-n * p // 32) for p in planes(bits))


def pack(codes: mx.array, bits: int) -> mx.array:
    """Pack integer codes in [0, 2^bits) along the last axis into uint32 words."""
    _check_bits(bits)
    codes = codes.astype(mx.uint32)
    *lead, n = codes.shape
    out, offset = [], 0
    for p in _PLANES[bits]:
        per = 32 // p
        nw = -(-n // per)
        v = (codes >> offset) & ((1 << p) - 1)
        if nw * per != n:
            v = mx.pad(v, [(0, 0)] * len(lead) + [(0, nw * per - n)])
        shifts = mx.arange(0, 32, p, dtype=mx.uint32)
        # Fields do not overlap, so the sum is a bitwise OR.
        out.append(mx.sum(v.reshape(*lead, nw, per) << shifts, axis=-1).astype(mx.uint32))
        offset += p
    return out[0] if len(out) == 1 else mx.concatenate(out, axis=-1)


def unpack(words: mx.array, bits: int, n: int) -> mx.array:
    """Inverse of pack: uint32 words (..., packed_words(n, bits)) -> uint32 codes (..., n)."""
    _check_bits(bits)
    *lead, w = words.shape
    if w != packed_words(n, bits):
        raise ValueError(f"{w} words cannot hold {n} codes of {bits} bits (expected {packed_words(n, bits)})")
    codes, start, offset = None, 0, 0
    for p in _PLANES[bits]:
        per = 32 // p
        nw = -(-n // per)
        shifts = mx.arange(0, 32, p, dtype=mx.uint32)
        v = (words[..., start : start + nw, None] >> shifts) & ((1 << p) - 1)
        v = v.reshape(*lead, nw * per)[..., :n]
        codes = v if codes is None else codes | (v << offset)
        start += nw
        offset += p
    return codes
