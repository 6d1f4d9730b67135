"""Bitshift-trellis codes for the coordinates of a rotated unit vector (the construction of QTIP, Tseng et al.,
arXiv 2406.11235): TurboQuant_mse's codes with a memory.

A Lloyd-Max code decodes coordinate i from its own b-bit symbol s_i. A bitshift trellis keeps the same b-bit
symbol per coordinate (the same packing, the same bytes) but decodes coordinate i from a window of the last L/b
symbols, x̂_i = C[s_{i-L/b+1} … s_i] with the newest symbol in the low bits and the symbols before the first 0, C a
codebook of 2^L entries. The encoder chooses the symbols of a whole vector together: the windows pass through 2^(L-b)
states (the older L - b bits), and Viterbi finds the path of least squared error, every vector starting at state 0
(nothing more is stored). Decoding stays one table lookup a coordinate, with a wider index; encoding costs 2^L
additions a coordinate. L is 12 (WINDOW_BITS; 10 at 5 bits, whose symbols do not divide 12).

The codebooks are data: trained once on seeded Gaussian vectors (train_book, never on a model's vectors) and shipped
as BOOK_FILE, so every machine and back end decodes the same symbols to the same values (a cache file written on one
loads on another). Their scale is a standard Gaussian coordinate; a quantizer's group of d channels scales them by
1/√d (the coordinates of a rotated unit vector). `python -m tq_mlx.quant.trellis` writes the file again.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

import mlx.core as mx

WINDOW_BITS = {2: 12, 3: 12, 4: 12, 5: 10, 6: 12}  # b -> L: the codebook's index width, a multiple of b
TRELLIS_BITS = tuple(WINDOW_BITS)  # the widths trellis codes take (1 and 8 bits keep Lloyd-Max codes)
BOOK_FILE = Path(__file__).with_name("trellis_books.npz")
# How the shipped codebooks were trained (train_book's arguments; tests train them again and compare).
TRAINING = dict(rounds=8, vectors=2048, dim=128, seed=0)
BLOCK_VECTORS = 256  # vectors viterbi searches at once: its backpointers and step candidates are a block's


def window_bits(bits: int) -> int:
    """L for b-bit symbols; ValueError naming TRELLIS_BITS for any other width."""
    if isinstance(bits, bool) or bits not in WINDOW_BITS:
        raise ValueError(f"trellis codes take bits in {TRELLIS_BITS}, got {bits!r}")
    return WINDOW_BITS[bits]


def _check_book(book, bits: int) -> int:
    """The window bits L of a 2^L-entry codebook for b-bit symbols (ValueError if it is not one)."""
    L = window_bits(bits)
    if book.ndim != 1 or book.shape[0] != 1 << L:
        raise ValueError(f"a {bits}-bit trellis takes a codebook of {1 << L} entries, got shape {tuple(book.shape)}")
    return L


def window_index(symbols: mx.array, bits: int) -> mx.array:
    """Each coordinate's codebook index (..., d) uint32 from its b-bit symbols (..., d): the last L/b symbols
    s_{i-L/b+1} … s_i, the newest in the low bits, those before the first coordinate 0."""
    k = window_bits(bits) // bits
    s = symbols.astype(mx.uint32)
    d = s.shape[-1]
    idx = s
    for j in range(1, min(k, d)):  # s_{i-j} lands j symbols up the index
        pad = [(0, 0)] * (s.ndim - 1) + [(j, 0)]
        idx = idx | (mx.pad(s[..., : d - j], pad) << (bits * j))
    return idx


def decode(symbols: mx.array, book: mx.array, bits: int) -> mx.array:
    """x̂ (..., d) float32: each coordinate's codebook entry by its window of symbols."""
    _check_book(book, bits)
    return mx.take(book, window_index(symbols, bits))


def viterbi(y: mx.array, book: mx.array, bits: int) -> mx.array:
    """The b-bit symbols (..., d) uint32 whose decoding is closest to y (..., d) in squared error (y at the book's
    scale), every vector starting at state 0. Ties go to the smaller symbol. Searched BLOCK_VECTORS vectors at a
    time, so what it holds is a block's, not grown with the vectors (a prefill chunk's keys held 0.6 GB at once)."""
    L = _check_book(book, bits)
    lead, d = y.shape[:-1], y.shape[-1]
    y = y.astype(mx.float32).reshape(-1, d)
    starts = range(0, max(1, y.shape[0]), BLOCK_VECTORS)
    blocks = [_search(y[a : a + BLOCK_VECTORS], book, bits, L) for a in starts]
    return (blocks[0] if len(blocks) == 1 else mx.concatenate(blocks)).reshape(*lead, d)


def _search(y: mx.array, book: mx.array, bits: int, L: int) -> mx.array:
    """viterbi on a block of vectors (n, d)."""
    n, d = y.shape
    T = 1 << bits  # a step's symbols: the window's newest b bits
    S = 1 << (L - bits)  # states: the window's older L - b bits
    U = S // T  # the part of a state that stays in the next one
    # Window w = (oldest b bits, middle, newest b bits); the state it comes from is (oldest, middle), the state it
    # leads to (middle, newest).
    book = book.astype(mx.float32).reshape(1, T, U, T)
    cost = mx.broadcast_to(mx.where(mx.arange(S) == 0, 0.0, float("inf")), (n, S))
    back = []  # per step, for each state reached: the oldest b bits of the best state it was reached from
    for i in range(d):
        tot = cost.reshape(n, T, U, 1) + mx.square(y[:, i, None, None, None] - book)
        # the next cost reads the step's choice, so evaluation takes each step whole and frees `tot` at once
        # (with mx.min beside it, a lazy graph kept every step's `tot` alive until the traceback: d·n·2^L floats)
        best = mx.argmin(tot, axis=1).astype(mx.uint8)
        back.append(best.reshape(n, S))
        cost = mx.take_along_axis(tot, best[:, None], axis=1).reshape(n, S)
    state = mx.argmin(cost, axis=1).astype(mx.uint32)
    symbols = [None] * d
    for i in range(d - 1, -1, -1):
        symbols[i] = state & (T - 1)
        oldest = mx.take_along_axis(back[i], state[:, None].astype(mx.int32), axis=1)[:, 0].astype(mx.uint32)
        state = oldest * U + (state >> bits)
    return mx.stack(symbols, axis=-1)


def train_book(bits: int, rounds: int, vectors: int, dim: int, seed: int = 0) -> np.ndarray:
    """A codebook for standard Gaussian coordinates, (2^L,) float32: seeded Gaussian entries, then `rounds` of
    coding fresh seeded Gaussian vectors (vectors x dim) by Viterbi and moving each entry to the mean of what it
    coded (entries nothing chose keep theirs)."""
    L = window_bits(bits)
    rng = np.random.default_rng([int(seed), bits, 0x7E11])
    book = rng.standard_normal(1 << L).astype(np.float32)
    for _ in range(rounds):
        y = rng.standard_normal((vectors, dim)).astype(np.float32)
        idx = np.array(window_index(viterbi(mx.array(y), mx.array(book), bits), bits)).ravel()
        n = np.bincount(idx, minlength=book.size)
        s = np.bincount(idx, weights=y.ravel().astype(np.float64), minlength=book.size)
        book = np.where(n > 0, s / np.maximum(n, 1), book).astype(np.float32)
    return book


@functools.cache
def standard_book(bits: int) -> np.ndarray:
    """The shipped codebook for b-bit symbols at a standard Gaussian coordinate's scale, (2^L,) float32."""
    L = window_bits(bits)
    with np.load(BOOK_FILE) as books:
        book = books[str(bits)]
    if book.shape != (1 << L,) or book.dtype != np.float32:
        raise ValueError(f"{BOOK_FILE} holds a {bits}-bit codebook of shape {book.shape} {book.dtype}; expected "
                         f"({1 << L},) float32: write it again with python -m tq_mlx.quant.trellis")
    book.flags.writeable = False
    return book


def write_books(path: Path = BOOK_FILE) -> None:
    """Train every width's codebook (TRAINING) and write them to `path`."""
    np.savez(path, **{str(b): train_book(b, **TRAINING) for b in TRELLIS_BITS})


if __name__ == "__main__":
    write_books()
    print(f"wrote {BOOK_FILE}")
