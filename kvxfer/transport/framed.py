"""What the frame-stream links share (tcp and shm): job kinds, the posting queue, fault injection on
a frame, and keeping the item checksums taken while sending.

A :class:`FrameLink` sends its jobs in posting order from one thread at a time (its own, shm; or a
lane of the transport's :class:`~kvxfer.transport.lanes.SendLanes`, tcp): a write batch, an ordered
message (DONE and the drain proofs) or raw frame bytes. Subclasses own the byte pipe (a socket, a
shared ring) and how they are served (``_kick``); this class owns the rules both keep:

* posting after the link ended or started closing raises :class:`TransportError`;
* every write job is reported exactly once through its ``on_complete``, as sent or as failed,
  including the unsent rest of a batch when the pipe fails mid-batch and every job still queued
  when the link ends;
* the link reports its own end once (``on_closed``).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.runs import FrameCut, WriteBatch
from ..errors import TransportError
from ..wire import frames as f
from .base import ConnId, OnComplete, SenderLink
from .lanes import LaneLink


@dataclass
class WriteJob:
    """A batch of page writes and who to tell when it completed."""

    batch: WriteBatch
    on_complete: OnComplete


@dataclass
class OrderedJob:
    """An ordered message (or a callable building one when its turn comes: DONE) with its tag."""

    msg: Any
    slot: int
    gen: int


@dataclass
class RawJob:
    """Prepared frame bytes, sent as they are (fault replay, hostile-peer tests)."""

    frame: list[Any]


@dataclass
class SmallWire:
    """A small batch's one WRITE frame, ready for the C send (tcp: one sendmsg; shm: one ring copy): its
    header and run table (``prefix``), the payload's source addresses and lengths (uint64 bytes), and
    (addresses, lengths, item lengths) as bytes for the call that sums the items. Made when the request's
    destination arrived (``prepare``), so that the send itself builds nothing."""

    nbytes: int
    prefix: bytes
    addresses: bytes
    lengths: bytes
    payload: tuple[bytes, bytes, bytes]

    @classmethod
    def of(cls, batch: WriteBatch, cut: FrameCut, src_base: np.ndarray) -> SmallWire:
        """``batch``'s WRITE frame ``cut`` (its only one), its sources in buffers at ``src_base``."""
        addresses = (src_base[cut.buffers] + cut.src_offsets.astype(np.uint64)).tobytes()
        lengths = np.asarray(cut.lengths, dtype=np.uint64).tobytes()
        prefix = f.write_header(batch.slot, batch.gen, len(cut.lengths), cut.nbytes) + f.pack_runs(
            cut.buffers, cut.dst_offsets, cut.lengths)
        return cls(nbytes=cut.nbytes, prefix=prefix, addresses=addresses, lengths=lengths,
                   payload=(addresses, lengths, cut.units.astype(np.uint64).tobytes()))


class FrameLink(SenderLink, LaneLink):
    """The posting side and the bookkeeping of a link that sends frames, served by the transport's
    sending lanes (:class:`~kvxfer.transport.lanes.LaneLink`: a job posted schedules a step)."""

    address: str

    def _init_link(self, conn_id: ConnId, on_closed: Callable[[Any, str], None], faults: Any,
                   checksum: Any) -> None:
        from ..core.checksum import ChecksumAlgo, native_id

        algo = ChecksumAlgo.parse(checksum) if checksum is not None else ChecksumAlgo.NONE
        self._sum_fn = native_id(algo)  # item checksums taken while sending, in the same C loop
        self._sum_initial = algo.initial if self._sum_fn is not None else 0
        self._sum_algo = algo.value  # DONE names it: a DONE of another algorithm is not summed in the send
        self.conn_id = conn_id
        self.epoch = conn_id[1]
        self._on_closed = on_closed
        self.faults = faults
        self._queue: collections.deque[Any] = collections.deque()
        self._cond = threading.Condition()
        self._holding = 0  # hold() nesting: posted jobs wait for the last unhold() before a step is scheduled
        self._alive = True
        self._closing = False
        self._reported = False
        self.frames_sent = 0
        self.bytes_sent = 0

    @property
    def alive(self) -> bool:
        return self._alive

    @property
    def ended(self) -> bool:
        """The link ended: ``_end`` reported every queued write failed before it set ``_ended``."""
        return self._ended.is_set()

    # posting (any thread) -----------------------------------------------------------------------------
    def post_writes(self, batch: WriteBatch, on_complete: OnComplete) -> None:
        self._post(WriteJob(batch, on_complete))

    def post_ordered(self, msg: Any, *, slot: int, gen: int) -> None:
        """Send ``msg`` (or what ``msg()`` builds, for DONE) after every frame posted before it."""
        self._post(OrderedJob(msg, slot, gen))

    def post_raw(self, pieces: list[Any]) -> None:
        """Send prepared frame bytes as they are (fault replay, hostile-peer tests)."""
        self._post(RawJob(pieces))

    def _post(self, job: Any) -> None:
        with self._cond:
            if not self._alive or self._closing:
                raise TransportError(f"data connection {self.conn_id} to {self.address} is closed")
            if not (self._holding and isinstance(job, WriteJob) and self._claim_early(job)):
                self._queue.append(job)
                if not self._holding:
                    self._kick()
                return
        self._send_early(job)

    def hold(self) -> None:
        """Jobs posted until :meth:`unhold` are scheduled together then (a step already under way,
        or scheduled, may still take the first of them: holding never delays a busy link)."""
        with self._cond:
            self._holding += 1

    def unhold(self) -> None:
        """The last unhold of a post schedules a step, unless the transport claims the posted jobs for
        the posting thread (:meth:`_claim_inline`: a small request on an idle link), which then sends
        them itself (:meth:`_send_inline`)."""
        with self._cond:
            self._holding -= 1
            if self._holding:
                return
            claimed = self._claim_inline()
            if claimed is None:
                if self._queue:
                    self._kick()
                return
        self._send_inline(*claimed)

    def _claim_inline(self) -> tuple[Any, ...] | None:
        """Under ``_cond``, at the last unhold: the jobs the posting thread sends itself (the link marked
        scheduled), or None (a claim taken at post time, :meth:`_claim_early`, is given back)."""
        return None

    def _send_inline(self, *claimed: Any) -> None:  # pragma: no cover - only with a claim
        raise NotImplementedError

    def _claim_early(self, job: WriteJob) -> bool:
        """Under ``_cond``, a write job posted while held: whether the posting thread sends it at once
        (:meth:`_send_early`), the link claimed until the last unhold. Never, unless a link says so."""
        return False

    def _send_early(self, job: WriteJob) -> None:  # pragma: no cover - only with a claim
        raise NotImplementedError

    def _begin_close(self, flush: bool) -> None:
        """Stop taking jobs; without ``flush`` the queued write batches are dropped unsent."""
        with self._cond:
            if not self._closing:
                self._closing = True
                if not flush:
                    for job in self._queue:
                        if isinstance(job, WriteJob):
                            job.batch.cancelled = True
                self._kick()
        if self.faults is not None:
            self.faults.resume()

    # the sending thread -------------------------------------------------------------------------------
    @staticmethod
    def _ordered_frame(job: OrderedJob) -> bytes:
        """The frame of ``job``'s message (a DONE frame, or ORDERED: :func:`~kvxfer.wire.frames.ordered_frame`),
        the message built now (DONE: behind every write before it)."""
        msg = job.msg() if callable(job.msg) else job.msg
        return f.ordered_frame(msg, slot=job.slot, generation=job.gen)

    def _send_batch_frames(self, job: WriteJob, cuts: Iterable[FrameCut],
                           send_frame: Callable[[WriteBatch, FrameCut, bool], None]) -> None:
        """Send ``job``'s batch frame by frame, reporting each frame's runs as it goes."""
        self._send_batch_steps(job, ([cut] for cut in cuts), lambda batch, group, last: send_frame(batch, group[0], last))

    def _send_batch_steps(self, job: WriteJob, steps: Iterable[list[FrameCut]],
                          send_step: Callable[[WriteBatch, list[FrameCut], bool], None]) -> None:
        """Send ``job``'s batch a step of consecutive frames at a time (``send_step(batch, frames, last)``),
        reporting each step's runs as it goes: a cancelled batch stops between steps, and when a step
        raises every run not yet reported is reported failed."""
        batch = job.batch
        reported = 0
        try:
            for group in steps:
                if batch.cancelled:
                    job.on_complete(batch, 0, len(batch) - group[0].runs_before)
                    return
                end = group[-1]
                send_step(batch, group, end.runs_before + end.runs_done == len(batch))
                done = sum(cut.runs_done for cut in group)
                if done:
                    job.on_complete(batch, done, 0)
                    reported += done
        except BaseException:
            if reported < len(batch):  # the pipe failed mid-batch: the rest is reported failed
                job.on_complete(batch, 0, len(batch) - reported)
            raise

    def _send_with_faults(self, batch: WriteBatch, header: bytes, runs: bytes, payload: list[Any],
                          put: Callable[[list[Any]], None]) -> None:
        """Send one WRITE frame through the fault injector: slow, flipped, captured, late, duplicated."""
        decision = self.faults.on_write(batch)
        if decision["slow"]:
            time.sleep(self.faults.config.slow_delay_s)
        if decision["flip"]:
            victim = self.faults.pick(len(payload))
            copy = bytearray(payload[victim])
            self.faults.flip(copy)
            payload[victim] = copy
        frame = [header, runs, *payload]
        if decision["capture"] or decision["late"]:
            snapshot = [header, runs, b"".join(bytes(p) for p in payload)]
            if decision["capture"]:
                self.faults.keep_captured(snapshot)
            if decision["late"]:
                self.faults.hold_late(snapshot)
        put(frame)
        if decision["duplicate"]:
            put(frame)

    def _keep_sums(self, batch: WriteBatch, sums: np.ndarray, last: bool) -> None:
        """Append one frame's item checksums to the batch's (frames go out in batch order)."""
        if batch.item_sums is None and last:  # the batch's one frame: its sums are the batch's
            batch.item_sums = sums
            batch.sums_filled = len(sums)
            batch.sums_done = True
            return
        if batch.item_sums is None:
            items = batch.item_counts(self.layout.item_lens)
            batch.item_sums = np.empty(int(items.sum()), dtype=np.uint32)
            batch.sums_filled = 0
        batch.item_sums[batch.sums_filled : batch.sums_filled + len(sums)] = sums
        batch.sums_filled += len(sums)
        if last and batch.sums_filled == len(batch.item_sums):
            batch.sums_done = True

    def _fail_queued(self) -> None:
        """The link ended: nothing more is taken, and every queued write is reported failed."""
        with self._cond:
            self._alive = False
            pending = list(self._queue)
            self._queue.clear()
        for job in pending:
            if isinstance(job, WriteJob):
                job.on_complete(job.batch, 0, len(job.batch))

    def _report_closed(self, reason: str) -> None:
        if not self._reported:
            self._reported = True
            self._on_closed(self, reason)
