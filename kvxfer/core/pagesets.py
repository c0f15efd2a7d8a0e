"""Set questions about page-index arrays (membership, duplicates), cheap for the small ones.

A one-page request asks the same questions as a 10,000-page one (are these pages the request's? is a
page named twice?), and numpy's general answers (``np.isin``, ``np.unique``) cost 10-30 us each
even for one element: on a small request's path that is a large share of its latency. These
helpers answer exactly as numpy does for every input, by brute force (one broadcast comparison) or
with Python sets while the arrays are small, and with numpy's sort-based algorithms beyond.

The same holds for the simplest questions: ``mask.any()``, ``mask.all()`` and ``array.sum()`` go
through numpy's Python-level wrappers (2-5 us each on this host for a one-element array, several per
frame on the write path), where :func:`any_set`, :func:`all_set` and :func:`total` call the C
reductions directly (about 1 us) and answer the same at any size.

Invariant: each function's result equals its numpy counterpart's for any one-dimensional integer
arrays (``tests/test_pagesets.py`` checks that over random inputs on both sides of the thresholds).
"""

from __future__ import annotations

import numpy as np

# a broadcast comparison of values x pool costs about one numpy call per this many cells
BROADCAST_CELLS = 4096
SMALL_SET = 64  # up to this many elements a Python set beats a sort


def any_set(mask: np.ndarray) -> bool:
    """``bool(mask.any())``: some element is nonzero (False for an empty array)."""
    return bool(np.count_nonzero(mask))


def all_set(mask: np.ndarray) -> bool:
    """``bool(mask.all())``: every element is nonzero (True for an empty array)."""
    return bool(np.count_nonzero(mask) == mask.size)


def total(values: np.ndarray) -> int:
    """``int(values.sum())`` of an integer array, as a Python int (0 for an empty array); summed in
    64 bits as ``sum`` does (a bare ``np.add.reduce`` would keep a narrower dtype and wrap)."""
    return int(np.add.reduce(values, axis=None, dtype=np.uint64 if values.dtype.kind == "u" else np.int64))


def isin(values: np.ndarray, pool: np.ndarray) -> np.ndarray:
    """Boolean mask over ``values``: which are in ``pool`` (``np.isin(values, pool)``)."""
    if values.size == 0 or pool.size == 0:
        return np.zeros(values.shape, dtype=bool)
    if values.size * pool.size <= BROADCAST_CELLS:
        return (values.reshape(-1, 1) == pool.reshape(1, -1)).any(axis=1).reshape(values.shape)
    return np.isin(values, pool)


def has_duplicates(values: np.ndarray) -> bool:
    """Whether some value occurs twice (``np.unique(values).size != values.size``)."""
    n = values.size
    if n < 2:
        return False
    if n <= SMALL_SET:
        return len(set(values.tolist())) != n
    ordered = np.sort(values, axis=None)
    return bool((ordered[1:] == ordered[:-1]).any())
