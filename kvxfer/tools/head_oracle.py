"""The content oracle for head-sliced pages: every (token, head) cell names its owner.

With tensor parallelism a decode page holds pieces from several writers (each prefill rank writes
the heads it holds), and with unequal page sizes one writer page feeds several decode pages or the
other way round, so the page-level oracle (:mod:`kvxfer.tools.oracle`, one owner per page item)
cannot say who wrote what. Here the unit is the cell: the ``head_bytes`` of one head of one token
of one buffer. Each cell starts with a 32-byte header (magic, request key, token, head and buffer)
followed by a splitmix64 stream keyed by the same, so any rank with the request id, its token count
and its layout's :class:`~kvxfer.core.geometry.KVGeometry` can recompute what every cell of its pages
must hold, whichever writer put it there:

* a page whose cells all equal their expectation is **ok**;
* a page with a cell whose header names a *different* request is a **leak**;
* anything else wrong (a cell of the right request at the wrong place, a flipped byte, zeros) is
  **corruption**.

Cells are keyed by request id, not generation: a request written in legs has one generation per
writer, and the stress tool's request ids are unique per request (never reused in a run). Cells past
the prompt's last token (the padding of a last page) are not checked: nobody reads them. Head bytes
must be a multiple of 8, at least 32; at most 256 heads and 65536 buffers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..core.layout import KVLayout
from ..errors import ConfigError
from .oracle import OracleReport, _mix, rid_key

MAGIC = np.uint64(0x4C4C4543_4F564B58)  # "XKVOCELL" little-endian: not the page oracle's magic
HEADER_WORDS = 4
MAX_HEADS = 256


def check_head_bytes(head_bytes: int) -> None:
    """Raise :class:`ConfigError` unless cells of ``head_bytes`` can carry the header."""
    if head_bytes % 8 or head_bytes < 8 * HEADER_WORDS:
        raise ConfigError(f"the head oracle needs head bytes of a multiple of 8, at least 32 (got {head_bytes})")


def expected_cells(head_bytes: int, *, key: int, tokens: np.ndarray, heads: np.ndarray, buffer: int,
                   seed: int) -> np.ndarray:
    """``(len(tokens), len(heads), head_bytes // 8)`` uint64 words those cells must hold."""
    check_head_bytes(head_bytes)
    words = head_bytes // 8
    t = tokens.astype(np.uint64)[:, None]
    h = heads.astype(np.uint64)[None, :]
    base = _mix(np.array([key ^ (seed << 33)], dtype=np.uint64))
    with np.errstate(over="ignore"):
        cell = (t << np.uint64(24)) | (h << np.uint64(16)) | np.uint64(buffer)
        keys = _mix(base ^ _mix(cell))
        body = _mix(keys[:, :, None] + np.arange(words, dtype=np.uint64)[None, None, :])
    body[:, :, 0] = MAGIC
    body[:, :, 1] = np.uint64(key)
    body[:, :, 2] = t
    body[:, :, 3] = (h << np.uint64(32)) | np.uint64(buffer)
    return body


def _geometry(layout: KVLayout) -> Any:
    geometry = layout.geometry
    if geometry is None:
        raise ConfigError("the head oracle needs a layout with a KVGeometry")
    first, count, total = geometry.heads
    if total > MAX_HEADS or layout.num_buffers > 65536:
        raise ConfigError(f"the head oracle takes at most {MAX_HEADS} heads and 65536 buffers")
    return geometry


def _page_cells(layout: KVLayout, b: int, npages: int, tokens: int, key: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """What ``npages`` request pages of buffer ``b`` hold, as ``(pages, page_size, heads, words)``, and
    which ``(pages, page_size)`` token slots are the prompt's."""
    spec = layout.geometry.buffers[b]
    size = layout.page_size
    slots = np.arange(npages * size, dtype=np.int64)
    heads = np.arange(spec.head_start, spec.head_start + spec.head_count, dtype=np.int64)
    cells = expected_cells(spec.head_bytes, key=key, tokens=slots, heads=heads, buffer=b, seed=seed)
    valid = (slots < tokens).reshape(npages, size)
    return cells.reshape(npages, size, len(heads), -1), valid


def _to_page(cells: np.ndarray, order: str) -> np.ndarray:
    """``(pages, page_size, heads, words)`` in the rank's in-page order, one row of bytes per page."""
    if order == "HND":
        cells = cells.transpose(0, 2, 1, 3)
    return np.ascontiguousarray(cells).reshape(cells.shape[0], -1).view(np.uint8)


def _from_page(rows: np.ndarray, order: str, size: int, heads: int) -> np.ndarray:
    """Rows of page bytes back to ``(pages, page_size, heads, words)``."""
    words = np.ascontiguousarray(rows).view(np.uint64)
    if order == "HND":
        return words.reshape(len(rows), heads, size, -1).transpose(0, 2, 1, 3)
    return words.reshape(len(rows), size, heads, -1)


def fill(layout: KVLayout, pages: np.ndarray, *, rid: Any, tokens: int, seed: int = 0) -> None:
    """Write request ``rid``'s cells (``tokens`` tokens, page i holding tokens ``i*P .. i*P+P-1`` of
    this rank's heads) into ``pages``; the padding slots of the last page get zeros."""
    geometry = _geometry(layout)
    pages = np.asarray(pages, dtype=np.int64)
    key = rid_key(rid)
    for b, view in enumerate(layout.views()):
        cells, valid = _page_cells(layout, b, len(pages), tokens, key, seed)
        cells[~valid] = 0
        view[pages] = _to_page(cells, geometry.buffers[b].order)


def check(layout: KVLayout, pages: np.ndarray, *, rid: Any, tokens: int, seed: int = 0,
          views: list[np.ndarray] | None = None) -> OracleReport:
    """Compare what ``pages`` hold (``views``: already-read copies per buffer, rows in request order)
    with request ``rid``'s cells; ``leaked_from`` holds ``(request key, 0)`` of each foreign owner."""
    geometry = _geometry(layout)
    pages = np.asarray(pages, dtype=np.int64)
    key = rid_key(rid)
    report = OracleReport(pages=len(pages))
    status = np.zeros(len(pages), dtype=np.int8)  # 0 ok, 1 corrupt, 2 leak (a leak dominates)
    for b, full in enumerate(layout.views()):
        spec = geometry.buffers[b]
        rows = views[b] if views is not None else full[pages]
        expect, valid = _page_cells(layout, b, len(pages), tokens, key, seed)
        actual = _from_page(rows, spec.order, layout.page_size, spec.head_count)
        bad = ~(actual == expect).all(axis=3) & valid[:, :, None]
        if not bad.any():
            continue
        foreign = bad & (actual[..., 0] == MAGIC) & (actual[..., 1] != np.uint64(key))
        page_bad, page_foreign = bad.any(axis=(1, 2)), foreign.any(axis=(1, 2))
        status = np.maximum(status, np.where(page_foreign, 2, np.where(page_bad, 1, 0)).astype(np.int8))
        for owner in np.unique(actual[..., 1][foreign]):
            report.leaked_from.add((int(owner), 0))
    report.leaked = [int(p) for p in pages[status == 2]]
    report.corrupted = [int(p) for p in pages[status == 1]]
    report.ok = int((status == 0).sum())
    return report
