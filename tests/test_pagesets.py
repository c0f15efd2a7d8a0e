"""The small-request shortcuts answer exactly as the general code does, on both sides of each threshold.

``kvxfer.core.pagesets`` (membership, duplicates), the Python loop of ``combine_adler32`` for a few
pieces, and the one-run shortcuts of ``expand_runs`` and ``coalesce`` replace numpy calls on a small
request's path; a difference here would let a foreign page through or fail a good transfer.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from kvxfer.core import native, pagesets
from kvxfer.core.checksum import SMALL_COMBINE, ChecksumAlgo, combine, combine_adler32, combine_crc32
from kvxfer.core.runs import coalesce
from kvxfer.core.slicing import expand_runs

SIZES = [0, 1, 2, 3, 17, pagesets.SMALL_SET, pagesets.SMALL_SET + 1, 200, 5000]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("m", [0, 1, 5, 64, 65, 4096, 9000])
def test_isin_matches_numpy(n: int, m: int) -> None:
    rng = np.random.default_rng(n * 10007 + m)
    values = rng.integers(0, max(2 * m, 4), n, dtype=np.int64)
    pool = rng.integers(0, max(2 * m, 4), m, dtype=np.int64)
    assert np.array_equal(pagesets.isin(values, pool), np.isin(values, pool))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [np.bool_, np.uint8, np.uint32, np.int64, np.uint64])
def test_any_all_total_match_numpy(n: int, dtype: type) -> None:
    rng = np.random.default_rng(n + 3)
    for values in (np.zeros(n, dtype=dtype), np.ones(n, dtype=dtype),
                   rng.integers(0, 2, n).astype(dtype), (rng.integers(0, 2, (2, n)) > 0).astype(dtype)):
        assert pagesets.any_set(values) is bool(values.any())
        assert pagesets.all_set(values) is bool(values.all())
        if dtype is not np.bool_:
            assert pagesets.total(values) == int(values.sum())
    big = np.full(n, np.iinfo(np.uint32).max, dtype=np.uint32)  # would wrap in 32 bits
    assert pagesets.total(big) == int(big.sum()) == n * int(np.iinfo(np.uint32).max)


@pytest.mark.parametrize("n", SIZES)
def test_has_duplicates_matches_numpy(n: int) -> None:
    rng = np.random.default_rng(n)
    distinct = rng.permutation(10 * n + 1)[:n].astype(np.int64)
    assert pagesets.has_duplicates(distinct) is False
    if n >= 2:
        twice = distinct.copy()
        twice[-1] = twice[0]
        assert pagesets.has_duplicates(twice) is True
        assert (np.unique(twice).size != twice.size) is True


@pytest.mark.parametrize("pieces", [1, 2, SMALL_COMBINE, SMALL_COMBINE + 1, 300])
def test_combine_adler32_is_adler32_of_the_concatenation(pieces: int) -> None:
    rng = np.random.default_rng(pieces)
    chunks = [rng.integers(0, 256, int(rng.integers(1, 6000)), dtype=np.uint8).tobytes() for _ in range(pieces)]
    values = np.array([zlib.adler32(c) for c in chunks], dtype=np.uint32)
    lengths = np.array([len(c) for c in chunks], dtype=np.int64)
    start = zlib.adler32(b"some earlier bytes")
    assert combine_adler32(values, lengths) == zlib.adler32(b"".join(chunks))
    assert combine_adler32(values, lengths, start) == zlib.adler32(b"".join(chunks), start)


@pytest.mark.parametrize("algo", [ChecksumAlgo.ADLER32, ChecksumAlgo.CRC32])
@pytest.mark.parametrize("size", [0, 1, 4096, 65522])
def test_combining_one_piece_gives_its_own_checksum(algo: ChecksumAlgo, size: int) -> None:
    """A one-page request's checksum is its page's (``combine`` returns it without combining)."""
    chunk = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    fn = zlib.adler32 if algo is ChecksumAlgo.ADLER32 else zlib.crc32
    value = combine(algo, np.array([fn(chunk)], dtype=np.uint32), np.array([size], dtype=np.int64))
    assert value == fn(chunk) and type(value) is int


@pytest.mark.parametrize("algo", [ChecksumAlgo.ADLER32, ChecksumAlgo.CRC32])
@pytest.mark.parametrize("pieces", [0, 1, 2, 300])
def test_combine_is_the_checksum_of_the_concatenation(algo: ChecksumAlgo, pieces: int) -> None:
    """``combine`` (zlib-ng's combinations in C where the native path loaded them, else Python) and
    the Python functions agree with the checksum of the bytes themselves, for empty pieces, pieces
    longer than Adler's modulus, runs of equal lengths (CRC32's operator is reused across them) and
    a nonzero start."""
    rng = np.random.default_rng(pieces)
    sizes = [] if not pieces else [0, 65521, 65522, 200_000, *[4096] * 5, *rng.integers(1, 6000, pieces).tolist()]
    chunks = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    fn = zlib.adler32 if algo is ChecksumAlgo.ADLER32 else zlib.crc32
    values = np.array([fn(c) for c in chunks], dtype=np.uint32)
    lengths = np.array([len(c) for c in chunks], dtype=np.int64)
    assert combine(algo, values, lengths) == fn(b"".join(chunks))
    python = combine_adler32 if algo is ChecksumAlgo.ADLER32 else combine_crc32
    start = fn(b"some earlier bytes")
    assert python(values, lengths, start) == fn(b"".join(chunks), start)
    if native.checksums_in_c:
        lib = native.lib
        algo_id = 0 if algo is ChecksumAlgo.ADLER32 else 1
        got = lib.combine_items(algo_id, start, values.tobytes(), lengths.astype(np.uint64).tobytes())
        assert got == fn(b"".join(chunks), start)
        with pytest.raises(ValueError, match="one per piece"):
            lib.combine_items(algo_id, start, values.tobytes() + b"\0\0\0\0", lengths.astype(np.uint64).tobytes())


def test_one_run_shortcuts_match_the_general_path() -> None:
    assert expand_runs(np.array([7]), np.array([3])).tolist() == [7, 8, 9]
    assert expand_runs(np.array([7, 20]), np.array([2, 1])).tolist() == [7, 8, 20]
    assert expand_runs(np.array([7]), np.array([0])).size == 0
    src, dst, count = coalesce(np.array([5]), np.array([9]))
    assert (src.tolist(), dst.tolist(), count.tolist()) == ([5], [9], [1])
    src, dst, count = coalesce(np.array([5, 6, 8]), np.array([9, 10, 11]))
    assert (src.tolist(), dst.tolist(), count.tolist()) == ([5, 8], [9, 11], [2, 1])
