"""The random Walsh-Hadamard rotation (orthogonal, seeded, every dtype and the sizes MLX's own transform gets
wrong) and bit packing (round trips at every width, 5- and 6-bit planes, exact sizes, lookups, bad widths)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mlx.core as mx

from tq_mlx.quant.packing import SUPPORTED_BITS, lookup_table, pack, packed_words, planes, unpack, unpack_lookup
from tq_mlx.quant.rotation import Rotation, hadamard_base

# Sizes MLX must not be trusted with (wrong result at 36, heap corruption at 60/100/144/200) go dense.
UNSAFE = [36, 60, 72, 100, 120, 136, 144, 200]
HADAMARD = [16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 256, 320, 512]


@pytest.mark.parametrize("dim", HADAMARD + UNSAFE)
def test_rotation_orthogonal_and_inverse(dim):
    r = Rotation(dim, seed=7)
    assert r.kind == ("dense" if dim in UNSAFE else "hadamard")
    p = np.array(r.as_matrix(), dtype=np.float64)
    np.testing.assert_allclose(p @ p.T, np.eye(dim), atol=5e-6)
    x = mx.random.normal((3, 5, dim), key=mx.random.key(dim))
    y = r.forward(x)
    np.testing.assert_allclose(np.array(y), np.array(x) @ p.T, atol=1e-5)
    np.testing.assert_allclose(np.array(r.inverse(y)), np.array(x), atol=5e-6)


def test_hadamard_base_rules():
    assert [hadamard_base(d) for d in (128, 96, 80, 112)] == [1, 12, 20, 28]
    assert all(hadamard_base(d) is None for d in UNSAFE)
    with pytest.raises(ValueError, match="allowed sizes"):
        Rotation(72, kind="hadamard")


def test_rotation_seeded():
    a, b, c = Rotation(128, seed=1), Rotation(128, seed=1), Rotation(128, seed=2)
    assert mx.array_equal(a.as_matrix(), b.as_matrix())
    assert not mx.array_equal(a.as_matrix(), c.as_matrix())
    assert mx.array_equal(Rotation(72, seed=3).as_matrix(), Rotation(72, seed=3).as_matrix())


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_rotation_dtypes(dtype):
    x = mx.random.normal((4, 64)).astype(dtype)
    y = Rotation(64).forward(x)
    assert y.dtype == mx.float32
    np.testing.assert_allclose(np.array(Rotation(64).inverse(y)), np.array(x.astype(mx.float32)), atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from(SUPPORTED_BITS),
    n=st.integers(1, 300),
    lead=st.lists(st.integers(1, 3), max_size=2),
    seed=st.integers(0, 2**31 - 1),
)
def test_pack_roundtrip(bits, n, lead, seed):
    codes = np.random.default_rng(seed).integers(0, 2**bits, size=(*lead, n), dtype=np.uint32)
    words = pack(mx.array(codes), bits)
    assert words.dtype == mx.uint32 and words.shape == (*lead, packed_words(n, bits))
    np.testing.assert_array_equal(np.array(unpack(words, bits, n)), codes)


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from(SUPPORTED_BITS),
    n=st.integers(1, 300),
    rows=st.integers(1, 5),
    seed=st.integers(0, 2**31 - 1),
)
def test_unpack_lookup_equals_codebook_of_unpack(bits, n, rows, seed):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 2**bits, size=(2, rows + 3, n), dtype=np.uint32)
    values = rng.standard_normal(2**bits).astype(np.float32)
    words = pack(mx.array(codes), bits)[:, 1 : rows + 1]  # a token slice, as attention reads it: not contiguous
    got = unpack_lookup(words, bits, n, lookup_table(values, bits))
    assert got.dtype == mx.float32 and got.shape == (2, rows, n)
    np.testing.assert_array_equal(np.array(got), values[codes[:, 1 : rows + 1]])


def test_lookup_table_sizes_and_errors():
    # Bytes per table: at most 8 KB (1 bit: 8 codes per byte); 3 bits use a 64-row table of code pairs, 5 and 6
    # bits 1024- and 4096-row tables of code pairs (a low-plane byte with 2 or 4 high-plane bits): at most 32 KB.
    sizes = {b: lookup_table(np.zeros(2**b), b).nbytes for b in SUPPORTED_BITS}
    assert sizes == {1: 8192, 2: 4096, 3: 512, 4: 2048, 5: 8192, 6: 32768, 8: 1024}
    assert [lookup_table(np.zeros(2**b), b).shape for b in (5, 6)] == [(1024, 2), (4096, 2)]
    with pytest.raises(ValueError, match="a 4-bit table needs 16 values"):
        lookup_table(np.zeros(8), 4)
    with pytest.raises(ValueError, match="cannot hold"):
        unpack_lookup(mx.zeros((3,), dtype=mx.uint32), 4, 128, lookup_table(np.zeros(16), 4))


@settings(max_examples=30, deadline=None)
@given(dim=st.sampled_from(HADAMARD + UNSAFE), seed=st.integers(0, 1000))
def test_rotation_roundtrip_property(dim, seed):
    x = mx.array(np.random.default_rng(seed).standard_normal((2, dim)).astype(np.float32))
    r = Rotation(dim, seed=seed)
    np.testing.assert_allclose(np.array(r.inverse(r.forward(x))), np.array(x), atol=1e-5)


def test_packed_sizes_are_exact():
    # 3 bits are exactly 3 bits per code (2-bit plane + 1-bit plane), not 32/10.
    assert packed_words(128, 3) == 12
    assert [packed_words(128, b) for b in (1, 2, 4, 8)] == [4, 8, 16, 32]
    assert packed_words(80, 3) == 8  # 160 + 80 bits -> 5 + 3 words
    # 5 bits: a 4-bit plane then a 1-bit plane; 6 bits: a 4-bit plane then a 2-bit plane. Exactly 5 and 6 bits
    # per code where n is a multiple of 32.
    assert planes(5) == (4, 1) and planes(6) == (4, 2)
    assert [packed_words(n, 5) for n in (64, 96, 128, 256)] == [10, 15, 20, 40]
    assert [packed_words(n, 6) for n in (64, 96, 128, 256)] == [12, 18, 24, 48]
    assert packed_words(80, 5) == 13 and packed_words(80, 6) == 15  # 320 + 80 bits -> 10 + 3; 320 + 160 -> 10 + 5
    assert packed_words(1, 5) == 2 and packed_words(33, 6) == 5 + 3


@pytest.mark.parametrize("bits", [5, 6])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 16, 31, 32, 33, 40, 64, 80, 96, 100, 128, 130, 256])
def test_pack_5_and_6_bits(bits, n):
    rng = np.random.default_rng(1000 * bits + n)
    codes = rng.integers(0, 2**bits, size=(3, 4, n), dtype=np.uint32)
    codes[0, 0] = 2**bits - 1  # every bit set: no field spills into its neighbour
    words = pack(mx.array(codes), bits)
    assert words.shape == (3, 4, packed_words(n, bits))
    np.testing.assert_array_equal(np.array(unpack(words, bits, n)), codes)
    # The planes as stored: the low 4 bits as a 4-bit plane (8 codes a word), the rest as a 1- or 2-bit plane.
    n_lo = -(-n // 8)
    np.testing.assert_array_equal(np.array(words[..., :n_lo]), np.array(pack(mx.array(codes & 15), 4)))
    np.testing.assert_array_equal(np.array(words[..., n_lo:]), np.array(pack(mx.array(codes >> 4), bits - 4)))
    # Read into a table's values, from a token slice (not contiguous) as attention reads it.
    values = rng.standard_normal(2**bits).astype(np.float32)
    got = unpack_lookup(words[:, 1:3], bits, n, lookup_table(values, bits))
    assert got.dtype == mx.float32 and got.shape == (3, 2, n)
    np.testing.assert_array_equal(np.array(got), values[codes[:, 1:3]])


@pytest.mark.parametrize("bits", [0, 7, 2.5, 16])
def test_pack_bad_bits(bits):
    with pytest.raises(ValueError, match="packing supports bits"):
        pack(mx.zeros((4,), dtype=mx.uint32), bits)


def test_unpack_wrong_width():
    with pytest.raises(ValueError, match="cannot hold"):
        unpack(mx.zeros((3,), dtype=mx.uint32), 2, 128)
