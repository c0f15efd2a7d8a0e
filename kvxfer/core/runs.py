"""Turning (source pages, destination pages) into the byte runs a transport posts.

Page i of a chunk goes from ``src_pages[i]`` to ``dst_pages[i]`` in every buffer. Positions where
both sides continue contiguously merge into one run (Mooncake's ``group_concurrent_contiguous``), so
a request laid out contiguously on both sides costs one run per buffer. Everything is vectorised:
no Python work per page.

A transport with a frame size limit (tcp: its staging buffers) cuts a batch with
:func:`cut_frames`: runs longer than the limit are split at item boundaries, whatever their length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .layout import KVLayout
from .pagesets import total

# One run as WRITE frames and DONE's write log carry it (``protocol/SPEC.md`` §3): buffer, flags (0),
# destination offset, length, little-endian. It is the runs' own record, so it lives with them;
# :mod:`kvxfer.wire.frames` frames and checks tables of it.
RUN_DTYPE = np.dtype([("buffer", "<u4"), ("flags", "<u4"), ("offset", "<u8"), ("length", "<u8")])


def pack_runs(buffers: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> bytes:
    """Runs as :data:`RUN_DTYPE` records back to back (a WRITE frame's body, DONE's write log)."""
    runs = np.zeros(len(buffers), dtype=RUN_DTYPE)
    runs["buffer"] = buffers
    runs["offset"] = offsets
    runs["length"] = lengths
    return runs.tobytes()


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
    # Set by the caller when the source pages are still being written by a device stream (SGLang's
    # early send under overlap scheduling): an object with ``synchronize()`` (a CUDA event) or
    # ``wait()``. Whoever reads the source pages first waits on it (:meth:`wait_sources`).
    ready: Any = None
    # what the ready event raised while it was waited on: the source pages never became valid, so the
    # batch was cancelled unsent (the sender fails its request with this reason)
    ready_error: BaseException | None = None
    # the transport's access blob from the request's META (verbs: its memory windows' keys); b"": none
    access: bytes = b""
    # a head slice's runs (kvxfer.core.slicing): each run is whole pieces of ``units[i]`` bytes, not whole
    # pages; checksums are taken per piece and frames cut at piece boundaries. None: whole pages.
    units: np.ndarray | None = None
    # the receiver's bytes per page of each buffer, when they differ from the writer's (head slices,
    # other page sizes): destination offsets are in the receiver's pages. None: the writer's own.
    dst_item_lens: np.ndarray | None = None
    # what the transport prepared for sending the batch before it was posted (tcp: its one frame's
    # prefix and iovec arrays), made when the destination arrived (SenderLink.prepare); None: nothing
    wire: Any = None
    # unit_lengths and item_counts for one item_lens array, computed once (a batch's runs never change):
    # the frame cut, the kept sums and DONE's checksum each asked again, 16,384 runs at a time
    _units: Any = field(default=None, init=False, repr=False, compare=False)

    def unit_lengths(self, item_lens: np.ndarray) -> np.ndarray:
        """Each run's checksum unit: a piece of a head slice, else a page of its buffer (read-only)."""
        cached = self._units
        if cached is not None and cached[0] is item_lens:
            return cached[1]
        if self.units is not None:
            units = np.array(self.units, dtype=np.int64)
        else:
            units = np.asarray(item_lens, dtype=np.int64)[self.buffers]
        units.setflags(write=False)
        self._units = (item_lens, units, None)
        return units

    def item_counts(self, item_lens: np.ndarray) -> np.ndarray:
        """How many checksum units each run holds (``lengths // unit_lengths``; read-only)."""
        units = self.unit_lengths(item_lens)
        cached = self._units
        if cached[2] is None:
            counts = np.asarray(self.lengths, dtype=np.int64) // units
            counts.setflags(write=False)
            cached = self._units = (item_lens, units, counts)
        return cached[2]

    def wait_sources(self) -> bool:
        """Block until the source pages hold what the caller wrote (at once without ``ready``). False
        when they never will and nothing of the batch may be sent: it was cancelled, or its ready event
        raised (a device error in the kernel that writes them). The batch is then cancelled with the
        exception in :attr:`ready_error`, and whoever holds it reports all its writes failed: an event
        that fails never escapes into the transport's thread or ends its connection."""
        ready = self.ready
        if ready is None or self.cancelled:
            return not self.cancelled
        wait = getattr(ready, "synchronize", None) or ready.wait
        try:
            wait()
        except Exception as exc:
            self.ready_error = exc
            self.cancelled = True
            return False
        finally:
            self.ready = None
        return True

    def log_bytes(self) -> bytes:
        """The batch as write-log records (buffer, flags, dst offset, length), as DONE carries them."""
        return pack_runs(self.buffers, self.dst_offsets, self.lengths)

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def nbytes(self) -> int:
        return total(np.asarray(self.lengths))


def is_ready_event(ready: Any) -> bool:
    """Whether ``ready`` can be waited on as :meth:`WriteBatch.wait_sources` does: None (nothing to
    wait for), or an object with a callable ``synchronize()`` (a CUDA event) or ``wait()``."""
    return ready is None or callable(getattr(ready, "synchronize", None)) or callable(getattr(ready, "wait", None))


def coalesce(src_pages: np.ndarray, dst_pages: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(src_start, dst_start, count)`` of maximal runs contiguous on both sides."""
    src = np.asarray(src_pages, dtype=np.int64)
    dst = np.asarray(dst_pages, dtype=np.int64)
    if src.shape != dst.shape:
        raise ValueError(f"{src.size} source pages for {dst.size} destination pages")
    if src.size <= 1:
        return src, dst, np.ones(src.size, dtype=np.int64)
    breaks = np.flatnonzero(((src[1:] - src[:-1]) != 1) | ((dst[1:] - dst[:-1]) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [src.size]))
    return src[starts], dst[starts], ends - starts


def build_batch(
    layout: KVLayout, src_pages: np.ndarray, dst_pages: np.ndarray, *, slot: int, gen: int,
    buffers: np.ndarray | None = None,
) -> WriteBatch:
    """The runs of a chunk in every buffer (or in ``buffers``, sorted: a layer-wise send), offsets
    relative to each buffer's base."""
    src_start, dst_start, count = coalesce(src_pages, dst_pages)
    group = np.arange(layout.num_buffers, dtype=np.int64) if buffers is None else np.asarray(buffers, np.int64)
    nb = group.size
    item_lens = np.asarray(layout.item_lens, dtype=np.int64)[group]
    if nb == 1:  # one buffer: the runs as they are (np.tile and np.repeat cost more than the arithmetic)
        return WriteBatch(slot=slot, gen=gen, buffers=np.repeat(group, len(count)), src_offsets=src_start * item_lens,
                          dst_offsets=dst_start * item_lens, lengths=count * item_lens)
    items = np.repeat(item_lens, len(count))
    return WriteBatch(
        slot=slot,
        gen=gen,
        buffers=np.repeat(group, len(count)),
        src_offsets=np.tile(src_start, nb) * items,
        dst_offsets=np.tile(dst_start, nb) * items,
        lengths=np.tile(count, nb) * items,
    )


@dataclass
class FrameCut:
    """One frame's share of a batch: whole runs, or item-aligned pieces of runs, in batch order."""

    buffers: np.ndarray
    src_offsets: np.ndarray
    dst_offsets: np.ndarray
    lengths: np.ndarray
    nbytes: int
    runs_before: int  # runs of the batch wholly sent before this frame
    runs_done: int  # runs of the batch whose last byte travels in this frame
    units: np.ndarray  # each entry's checksum unit (a page of its buffer, or a head slice's piece)


def cut_frames(batch: WriteBatch, item_lens: np.ndarray, max_bytes: int, max_runs: int) -> list[FrameCut]:
    """Cut ``batch`` into frames of at most ``max_bytes`` payload and ``max_runs`` runs.

    Runs that fit go whole, as many per frame as fit (greedy, in order). A run whose rest is longer
    than ``max_bytes`` is split at item boundaries (``item_lens[buffer]``, or a head slice's piece,
    :meth:`WriteBatch.unit_lengths`) into pieces of as many whole items as fit, so every piece is
    itself a valid write (offset and length whole items) and the concatenated pieces are the batch's
    item sequence in order (the order of item checksums).
    Per frame: a binary search on the runs' cumulative lengths and slices; nothing per page."""
    lengths = np.asarray(batch.lengths, dtype=np.int64)
    total = len(lengths)
    if total == 0:
        return []
    items = batch.unit_lengths(item_lens)
    largest = int(np.maximum.reduce(items))
    if largest > max_bytes:
        raise ValueError(f"an item of {largest} bytes does not fit a frame of {max_bytes} bytes")
    if max_runs < 1:
        raise ValueError("a frame holds at least one run")
    if total <= max_runs:  # one frame (a small request) when it fits: what the loop cuts
        nbytes = int(lengths.sum())
        if nbytes <= max_bytes:
            return [FrameCut(buffers=batch.buffers, src_offsets=batch.src_offsets, dst_offsets=batch.dst_offsets,
                             lengths=lengths, nbytes=nbytes, runs_before=0, runs_done=total, units=items)]
    if int(lengths.max()) * max_runs <= max_bytes:  # any max_runs runs fit: what the loop cuts, by run count
        starts = range(0, total, max_runs)
        sizes = np.add.reduceat(lengths, np.arange(0, total, max_runs)).tolist()
        return [FrameCut(buffers=batch.buffers[a : a + max_runs], src_offsets=batch.src_offsets[a : a + max_runs],
                         dst_offsets=batch.dst_offsets[a : a + max_runs], lengths=lengths[a : a + max_runs],
                         nbytes=size, runs_before=a, runs_done=min(max_runs, total - a), units=items[a : a + max_runs])
                for a, size in zip(starts, sizes)]
    ends = np.cumsum(lengths)  # where each run ends in the batch's byte stream
    cuts: list[FrameCut] = []
    run, off = 0, 0  # the next byte to cut: ``off`` bytes into run ``run``
    while run < total:
        rest = int(lengths[run]) - off
        if rest > max_bytes:  # a piece of this run alone: as many whole items as fit
            item = int(items[run])
            take = max_bytes // item * item
            end, done = run + 1, 0
        else:  # the rest of this run, then whole runs while they fit
            start_at = int(ends[run]) - rest
            end = int(np.searchsorted(ends, start_at + max_bytes, side="right"))
            end = min(end, run + max_runs, total)
            take, done = rest, end - run
        src = batch.src_offsets[run:end]
        dst = batch.dst_offsets[run:end]
        lens = lengths[run:end]
        if off or take != rest:  # the first entry is a piece: adjust copies, never the batch
            src, dst, lens = src.copy(), dst.copy(), lens.copy()
            src[0] += off
            dst[0] += off
            lens[0] = take
        cuts.append(FrameCut(buffers=batch.buffers[run:end], src_offsets=src, dst_offsets=dst, lengths=lens,
                             nbytes=int(lens.sum()), runs_before=run, runs_done=done, units=items[run:end]))
        if done:
            run, off = end, 0
        else:
            off += take
    return cuts
