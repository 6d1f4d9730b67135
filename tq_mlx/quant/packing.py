"""Bit packing of b-bit codes into uint32 words along the last axis.

Widths that divide 32 (1, 2, 4, 8) pack 32/b codes per word, code i of a word at bits [b·i, b·i + b).
Other widths are stored as bit planes, lowest bits first: 3 bits as a 2-bit plane then a 1-bit plane, 5 bits
as a 4-bit plane then a 1-bit plane, 6 bits as a 4-bit plane then a 2-bit plane. That is exactly b bits per
code, every plane unpacks with one shift-and-mask, and no code straddles two words (this also keeps Metal
kernels branch-free). A last word that is not full is zero-padded.

`unpack_lookup` reads packed codes straight into a table's values, several codes per lookup: a byte for
1/2/4/8 bits (8/4/2/1 codes); for 3 bits a low-plane nibble with the two matching high-plane bits (2 codes,
a 64-row table); for 5 and 6 bits a low-plane byte with the matching high-plane bits, 2 or 4 of them (2
codes, a 1024- or 4096-row table). It skips the shift-and-mask pass over every code, which is what makes
dequantizing fast on MLX's CPU back end (where `take_along_axis` is ~10x faster than `take`, and a gather
costs about as much as writing its output; at 5 and 6 bits the pair table measured 1.1-1.3x faster than
unpack + a one-code table at 10^5-10^6 codes, 2x and more at 10^7). Tables are at most 32 KB (6 bits), 8 KB
at 1 and 5 bits, 512 B for 3 bits.
"""

from __future__ import annotations

import numpy as np

import mlx.core as mx

SUPPORTED_BITS = (1, 2, 3, 4, 5, 6, 8)
_PLANES = {1: (1,), 2: (2,), 3: (2, 1), 4: (4,), 5: (4, 1), 6: (4, 2), 8: (8,)}
# Constants are built from numpy, so they hold data rather than a lazy graph tied to the importing thread's
# stream (MLX streams are per thread; tq-chat and tq-server decode in worker threads).
_NIBBLES = mx.array(np.arange(0, 32, 4, dtype=np.uint32))
_PAIRS = mx.array(np.arange(0, 16, 2, dtype=np.uint32))
# 5 and 6 bits: the high-plane bits of a low-plane byte's 2 codes, 4 pairs (5) or 2 nibbles (6) per byte.
_HIGH_SHIFTS = {5: mx.array(np.arange(0, 8, 2, dtype=np.uint8)), 6: mx.array(np.arange(0, 8, 4, dtype=np.uint8))}


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


def _check_words(words: mx.array, bits: int, n: int) -> list[int]:
    """Raise unless words (..., w) hold exactly n codes of `bits` bits; returns the leading shape."""
    *lead, w = words.shape
    if w != packed_words(n, bits):
        raise ValueError(f"{w} words cannot hold {n} codes of {bits} bits (expected {packed_words(n, bits)})")
    return lead


def unpack(words: mx.array, bits: int, n: int) -> mx.array:
    """Inverse of pack: uint32 words (..., packed_words(n, bits)) -> uint32 codes (..., n)."""
    _check_bits(bits)
    lead = _check_words(words, bits, n)
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


def lookup_table(values, bits: int) -> mx.array:
    """The (entries, codes per entry) float32 table unpack_lookup reads: row k holds values[code] for each code
    packed in the byte k, lowest code first (3 bits: k = low-plane nibble | high-plane bit pair << 4; 5 and 6
    bits: k = low-plane byte | the two codes' high-plane fields (1 or 2 bits each) << 8).

    values: the 2^bits code values (array-like). Built in numpy: the table is data, usable from any thread."""
    _check_bits(bits)
    v = np.asarray(values, dtype=np.float32)
    if v.shape != (1 << bits,):
        raise ValueError(f"a {bits}-bit table needs {1 << bits} values, got shape {v.shape}")
    if bits == 3:
        k = np.arange(64, dtype=np.uint32)[:, None]
        i = np.arange(2, dtype=np.uint32)
        codes = ((k >> (2 * i)) & 3) | (((k >> (4 + i)) & 1) << 2)
    elif bits in (5, 6):
        h = bits - 4  # high-plane bits per code
        k = np.arange(1 << (8 + 2 * h), dtype=np.uint32)[:, None]
        i = np.arange(2, dtype=np.uint32)
        codes = ((k >> (4 * i)) & 15) | (((k >> (8 + h * i)) & ((1 << h) - 1)) << 4)
    else:
        k = np.arange(256, dtype=np.uint32)[:, None]
        codes = (k >> np.arange(0, 8, bits, dtype=np.uint32)) & ((1 << bits) - 1)
    return mx.array(v[codes])


def unpack_lookup(words: mx.array, bits: int, n: int, table: mx.array) -> mx.array:
    """values[unpack(words, bits, n)] for the table lookup_table(values, bits) made: (..., n), table's dtype."""
    _check_bits(bits)
    lead = _check_words(words, bits, n)
    if bits == 3:
        # Low-plane word j holds the low bits of codes 16j..16j+15 as 8 nibbles (2 codes each), and the j-th
        # 16-bit half of the high plane their high bits as 8 bit pairs: index = nibble | pair << 4.
        n_lo = -(-n // 16)
        lo = words[..., :n_lo, None]
        hi = mx.view(words[..., n_lo:], mx.uint16)[..., :n_lo, None].astype(mx.uint32)
        idx = ((lo >> _NIBBLES) & 15) | (((hi >> _PAIRS) & 3) << 4)
        idx = idx.reshape(*lead, n_lo * 8)
    elif bits in (5, 6):
        # Low-plane byte 4j+t holds the low nibbles of codes 8j+2t, 8j+2t+1; their high bits sit in high-plane
        # byte j as bit pair t (5 bits: a byte holds 8 codes' high bits), or in byte 2j+t//2 as nibble t%2 (6
        # bits: a byte holds 4 codes'): index = byte | high bits << 8. uint16 arithmetic on byte views measured
        # as fast as, or faster than, shifting whole words.
        n_lo = -(-n // 8)
        lo = mx.view(words[..., :n_lo], mx.uint8).astype(mx.uint16)
        hi = mx.view(words[..., n_lo:], mx.uint8)[..., : n_lo * (bits - 4), None]
        hi = (hi >> _HIGH_SHIFTS[bits]) & ((1 << (2 * bits - 8)) - 1)
        idx = lo | (hi.reshape(*lead, n_lo * 4).astype(mx.uint16) << 8)
    else:
        idx = mx.view(words, mx.uint8)
    per = table.shape[-1]
    flat = mx.broadcast_to(idx.reshape(-1, 1), (idx.size, per))
    out = mx.take_along_axis(table, flat, axis=0).reshape(*lead, idx.shape[-1] * per)
    return out if out.shape[-1] == n else out[..., :n]
