"""Turning (source pages, destination pages) into the byte runs a transport posts.

Page i of a chunk goes from ``src_pages[i]`` to ``dst_pages[i]`` in every buffer. Positions where
both sides continue contiguously merge into one run (Mooncake's ``group_concurrent_contiguous``), so
a request laid out contiguously on both sides costs one run per buffer. Everything is vectorised:
no Python work per page.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .layout import KVLayout


@dataclass
class WriteBatch:
    """Byte runs of one chunk of one request, in buffer-major order (one run = one RDMA WRITE)."""

    slot: int
    gen: int
    buffers: np.ndarray
    src_offsets: np.ndarray
    dst_offsets: np.ndarray
    lengths: np.ndarray
    cancelled: bool = False
    final: bool = False  # the request's last chunk: its last write carries the tag as immediate (verbs)
    owner: Any = None
    # Per-item source checksums (buffer-major, chunk page order): taken by the tcp sender while it
    # sends (``sums_done``), or computed off the sending thread (``sums_ready``, an Event; verbs).
    item_sums: np.ndarray | None = None
    sums_filled: int = 0
    sums_done: bool = False
    sums_ready: Any = None

    def log_bytes(self) -> bytes:
        """The batch as write-log records (buffer, flags, dst offset, length), as DONE carries them."""
        from .wire.frames import pack_runs

        return pack_runs(self.buffers, self.dst_offsets, self.lengths)

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())


def coalesce(src_pages: np.ndarray, dst_pages: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(src_start, dst_start, count)`` of maximal runs contiguous on both sides."""
    src = np.asarray(src_pages, dtype=np.int64)
    dst = np.asarray(dst_pages, dtype=np.int64)
    if src.shape != dst.shape:
        raise ValueError(f"{src.size} source pages for {dst.size} destination pages")
    if src.size == 0:
        return src, dst, src
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [src.size]))
    return src[starts], dst[starts], ends - starts


def build_batch(
    layout: KVLayout, src_pages: np.ndarray, dst_pages: np.ndarray, *, slot: int, gen: int
) -> WriteBatch:
    """All buffers' runs for a chunk, offsets relative to each buffer's base."""
    src_start, dst_start, count = coalesce(src_pages, dst_pages)
    nb = layout.num_buffers
    items = np.repeat(layout.item_lens, len(count))
    buffers = np.repeat(np.arange(nb, dtype=np.int64), len(count))
    return WriteBatch(
        slot=slot,
        gen=gen,
        buffers=buffers,
        src_offsets=np.tile(src_start, nb) * items,
        dst_offsets=np.tile(dst_start, nb) * items,
        lengths=np.tile(count, nb) * items,
    )
