"""The same-host transport: one-sided writes through a shared-memory ring, no socket in the data path.

What it owns: for every connection ``(writer engine, epoch)`` the decode offers, one
single-producer/single-consumer byte ring in a file under :attr:`ShmOptions.directory`
(``/dev/shm`` by default), created by the decode (mode 0600, an unguessable name, its memory
reserved up front with ``posix_fallocate`` so that no access can fault later), and the threads that
move bytes through it: the decode's *landing thread* per ring (:class:`ShmReceiver`) and, on the
prefill, the transport's sending lanes (:class:`~kvxfer.transport.lanes.SendLanes`) that serve every
link (:class:`ShmLink`) a step at a time; an idle link looks at its reader's state and process
every :data:`IDLE_CHECK` seconds, so a decode that is gone ends its link without a write.

Ring layout (all integers little-endian u64, each word on its own 64-byte line)::

    offset 0     magic "KVXSHMR1", version, data size, creator (decode) pid
    offset 64    producer position   written by the writer only (store-release)
    offset 128   consumer position   written by the reader only (store-release)
    offset 192   writer state        NEW 0 / OPEN 1 / CLOSED 2 (writer)
    offset 256   reader state        OPEN 1 / FENCED 2 (reader)
    offset 320   writer pid          (writer, once, for liveness checks)
    offset 384   reader want         the producer position a sleeping reader waits for, 0: none (reader;
                                     the writer clears it when it wakes the reader)
    offset 448   writer want         the consumer position a sleeping writer waits for, 0: none (writer;
                                     the reader clears it when it wakes the writer)
    offset 512   result producer     RESULT bytes the reader put into the result area (reader only)
    offset 576   result consumer     RESULT bytes the writer took out of it (writer only)
    offset 640   result want         the result producer position the writer's sleeping watcher waits
                                     for, 0: none (writer; the reader clears it when it wakes it)
    offset 704   result reader       1 once the writer reads RESULT frames from the result area (writer)
    offset 1024  result area of 3,072 bytes: RESULT frames, reader -> writer, a byte stream as the data area
    offset 4096  data area of ``size`` bytes

Positions count bytes since the ring was created and only grow; a position's place in the data
area is ``position % size``. The data area is a byte stream, exactly what a tcp connection carries:
the very same frames (:mod:`kvxfer.wire.frames`: CONNECT first, then WRITE and ORDERED frames), back
to back, a frame's bytes continuing at the start of the data area where they reach its end. Both
sides stream: the writer publishes its position every 256 KiB while it copies a frame in, the
reader lands those bytes and publishes its own position behind them, so a frame may be larger than
the ring and the ring's bytes stay in cache between the two copies (a small ring is faster).

The landing thread acts as the tcp receiver thread does (a NIC): it copies every frame's header and
body out of the ring before checking them (the writer can still change the ring; in C, ``ring_frame_head``,
the twin of tcp's ``recv_frame_head``, with the Python reader as reference and fallback), asks the
:class:`~kvxfer.core.writeguard.WriteGuard` about every WRITE and copies allowed payloads from the
ring into the destination pages in C with the GIL released (``ring_run_table``, straight from the
frame's run table, or ``ring_copy`` in ``native/kvxfer_native.c``), taking each item's checksum right
after it landed, at the destination (the semantics of tcp's ``recv_runs_summed``; Adler-32 items of
32 KiB or more in the same pass as the copy, from the very bytes stored, the pages written with
non-temporal stores so that landing a gigabyte does not evict the ring and the landing thread's state
from the caches); refused payloads are read past and never land. An ORDERED frame is handed to the engine only after every earlier frame of the ring was landed or
refused (a drain proof). The consumer position only ever covers bytes already copied out, so the
writer never overwrites bytes the reader has not finished with.

RESULT comes back the same way, through the small result area (a second byte ring, the other way
round): the landing side answers a verified request there (:meth:`ShmReceiver.answer`, the tcp
receiver's answer on its socket) when the writer reads it and the frame fits, never waiting; else
the RESULT goes on the control plane. The writer's *result watcher* thread (one per link, sleeping in a
futex on the result producer word) reads whole RESULT frames (:class:`~kvxfer.wire.frames.ResultReader`)
and delivers them as tcp's watcher does; anything else there, or an impossible position, ends the link.

Waiting never involves a socket or a pipe. A side waiting for the other's position polls it for a
few microseconds, then announces the position it needs in its *want* word and sleeps in a futex on
the position word itself (shared, not ``_PRIVATE``: two processes map the file), in C with the GIL
released (``ring_wait`` in ``native/kvxfer_native.c``). Publishing a position (store-release, a full
fence, then a look at the other side's want word) wakes the other side only when it sleeps for at
most that position: no system call while both run. A waiting writer asks to be woken once a
quarter of the ring is free, so that it refills in large pieces; a waiting landing thread once half
the ring more was published (or the frame's payload ends), so that it wakes about a quarter as often
(measured: 40,000 to 9,000 sleeps a second at 12 GB/s). Storing FENCED or CLOSED wakes both
position words; a sleep lasts at most 10 ms, so a state change nobody woke for (the writer's private
abort flag, a peer that died) is still seen. Without the C extension both sides poll with an
adaptive backoff (a few yields, then sleeps growing to 1 ms), and a native peer's sleeps end by
their 10 ms bound.

Invariants:

* a write lands only if the guard allowed it on this ring's connection; the ring's first frame must
  be CONNECT for the epoch offered, and binds the ring to what ``hooks.on_connect`` returned;
* :meth:`ShmReceiver.fence` marks the ring FENCED, stops and joins its landing thread, unlinks the
  file and (through the thread) unmaps it: when it returns nothing from that ring can land. The
  writer may still write into its own mapping; nobody reads it: that is the revocation. The writer
  sees FENCED (before every frame, while it waits for space, and every 50 ms when idle) and reports
  its link closed;
* a protocol error, the writer's CLOSED with the ring drained, or the writer's process gone ends
  the connection; every connection that ends is reported exactly once, to the fencer (``fence``
  returns True) or through ``hooks.on_closed`` (also a ring whose first frame was malformed, under
  the offered ``(peer, epoch)``);
* every ring file is removed when its connection starts (both sides have it mapped by then), when
  its offer is withdrawn, fenced or closed; a receiver also removes ring files left by processes that
  no longer exist; ``close()`` leaves nothing in the directory;
* the writer refuses an OFFER from another boot or host (``boot_id``), and opens only a regular
  file of the ring's name pattern, its own uid, mode 0600, the advertised size and a fresh ring
  header, so an OFFER cannot make it write into an arbitrary file.

Without the C extension (``KVXFER_PURE_PYTHON=1``) positions are read and written as aligned
64-bit numpy elements (single loads and stores; ordering relies on x86-64's total store order)
and payloads move by memoryview copies; item checksums are then left to verification.

GPU pools (not implemented: a non-CPU layout raises :class:`~kvxfer.errors.ConfigError`). CUDA
IPC slots in beside the ring, which keeps carrying the frames; only the payload stops travelling
through it. Pull, recommended: the writer exports its source pool once per buffer
(``cuIpcGetMemHandle``, or ``cuMemExportToShareableHandle`` for ``cuMemCreate`` pools, the file
descriptor passed over a unix socket) in its ACCEPT blob, which :meth:`ReceiverBackend.accept`
receives; the decode opens the handles (``cuIpcOpenMemHandle`` / ``cuMemImportFromShareableHandle``
+ ``cuMemMap``). A WRITE frame then carries its run table and the runs' source offsets instead of
payload; the landing thread asks the guard exactly as now, then issues the allowed runs as
device-to-device copies on its own stream and records an event; the write is recorded with the
guard (and item checksums taken by ``kvxfer.core.gpu.kernels.item_checksums`` on the landed pages)
when the event completed, and an ORDERED frame is handed over only after every earlier event
completed, which keeps it a drain proof. A fence stops issuing copies, synchronises the stream and
closes the handles (``cuIpcCloseMemHandle``): afterwards nothing can land, a real revocation as now.
Push (the writer opens the decode's exported pool and copies on its stream, an event per chunk as
completion proof, the frame put into the ring once its event completed) is the one-sided mirror, but
bytes then land before the guard sees them: it needs the verbs transport's write-log semantics
(``Capabilities(write_log=True)``, the log checked against the guard at DONE), and a fence can only
stop ordered delivery and ask the writer to close its handles, so fenced pages stay quarantined
until the writer confirms or its process exits, the limit one rkey per region has on verbs.
"""

from __future__ import annotations

import enum
import logging
import mmap
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from ..core import native
from ..core.layout import KVLayout
from ..core.runs import FrameCut, WriteBatch, cut_frames
from ..core.writeguard import WriteGuard
from ..errors import ConfigError, KvxferError, ProtocolError, TransportError, WriteRefused
from ..wire import frames as f
from ..wire import messages as m
from .base import (
    Capabilities,
    ConnId,
    LinkRequest,
    ReceiverBackend,
    ReceiverHooks,
    SenderTransport,
    TransportFactory,
)
from .faults import FaultInjector
from .framed import FrameLink, OrderedJob, RawJob, SmallWire, WriteJob
from .lanes import SendLanes
from .options import ShmOptions

log = logging.getLogger("kvxfer.shm")

CAPABILITIES = Capabilities(write_log=False, ordered_via_control=False, requires_final=False, raw_frames=True,
                            same_host=True)

# ring format
MAGIC = int.from_bytes(b"KVXSHMR1", "little")
RING_VERSION = 3  # 2: the want words and the futex wake protocol; 3: the result area
HEADER_BYTES = 4096
W_MAGIC, W_VERSION, W_SIZE, W_CREATOR = 0, 8, 16, 24
W_PRODUCER = 64
W_CONSUMER = 128
W_WRITER_STATE = 192
W_READER_STATE = 256
W_WRITER_PID = 320
W_READER_WANT = 384  # the producer position a sleeping reader waits for; 0: it does not sleep
W_WRITER_WANT = 448  # the consumer position a sleeping writer waits for; 0: it does not sleep
W_RESULT_PRODUCER = 512  # RESULT bytes the reader put into the result area
W_RESULT_CONSUMER = 576  # RESULT bytes the writer took out of it
W_RESULT_WANT = 640  # the result producer position the writer's sleeping watcher waits for; 0: it does not sleep
W_RESULT_READER = 704  # 1: the writer reads RESULT frames from the result area
RESULT_AREA = 1024
RESULT_AREA_BYTES = HEADER_BYTES - RESULT_AREA
WRITER_NEW, WRITER_OPEN, WRITER_CLOSED = 0, 1, 2
READER_OPEN, READER_FENCED = 1, 2
MIN_RING_BYTES = 64 << 10
RING_NAME = re.compile(r"kvxfer-ring-(\d+)-[0-9a-f]{32}")

# data path tuning
# a frame carries up to a 64 MiB request's runs (wire limit 8192): the landing thread's Python work
# (parse, guard check and record, about 0.5 ms with cold caches) is per frame, and small pages would
# otherwise need many (512 runs of 4 KiB are 2 MiB)
FRAME_MAX_RUNS = f.MAX_RUNS
FRAME_BYTES = 64 << 20  # payload of one frame, unless an item is larger; frames stream through the ring
INLINE_MAX_BYTES = 256 << 10  # a request this small, alone on an idle link, goes into the ring from the posting thread
SUM_CHUNK = 256 << 10  # copy this much, checksum it while it is still in cache, publish the position
PY_CHUNK = 1 << 20  # the pure-Python path moves at most this much between two position updates
WAIT_SLICE = 0.05  # a native wait returns to Python at least this often (to look at what C does not see)
SPINS = 32  # pure Python: polls with a yield in between before the first sleep
SLEEP_MIN = 20e-6
SLEEP_MAX = 1e-3  # pure Python: the longest a waiting side sleeps between two polls
IDLE_CHECK = 0.05  # an idle writer looks at the reader's state this often
LIVENESS_AFTER = 1.0  # a side waiting this long starts checking that the other process exists
_STALE_AGE = 60.0  # ring files of dead processes older than this are removed by a new receiver


_NATIVE = (native.lib if native.provides("copy_runs", "ring_copy", "ring_load", "ring_store", "ring_wait", "ring_publish",
                                         "ring_wake") else None)


def _native() -> Any:
    """The C extension when it has the ring functions (an extension built from an older native/ does
    not: then the pure-Python path runs, as under KVXFER_PURE_PYTHON=1); looked up once, at import."""
    return _NATIVE


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:  # pragma: no cover - not Linux
        return ""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - exists, another user
        return True
    return True


class _Backoff:
    """One side waiting until the other's position (the word at ``offset``) reaches ``target``.

    Native: each :meth:`pause` is one ``ring_wait`` in C with the GIL released: a few microseconds of
    polling, then futex sleeps announced in the ring's ``want`` word, which the other side's publish
    ends (see native/kvxfer_native.c), returning when the position got there, the ``stop`` or
    ``closed`` word took its value or ``WAIT_SLICE`` passed; the caller looks at everything again.
    Pure Python: ``SPINS`` yields, then sleeps doubling from ``SLEEP_MIN`` to ``SLEEP_MAX``."""

    __slots__ = ("spins", "delay", "started", "wait", "args", "poll")

    def __init__(self, ring: _Ring, offset: int, target: int, want: int, stop: int, stop_value: int, closed: int,
                 closed_value: int, poll: tuple[int, int] | None = None) -> None:
        # ``poll``: (nanoseconds, counts address) of busy polling before the first native wait
        self.poll = poll
        self.spins = 0
        self.delay = SLEEP_MIN
        self.started = 0.0
        # `stop` and `closed` are addresses: `closed` may be a private word (the writer's abort flag)
        self.wait = ring._lib.ring_wait if ring._lib is not None else None
        self.args = (ring.base + offset, target, ring.base + want, stop, stop_value, closed, closed_value, 0, WAIT_SLICE)

    def pause(self) -> None:
        if self.spins == 0:
            self.started = time.monotonic()
        if self.wait is not None:
            self.spins += 1
            if self.poll is not None and self.spins == 1:
                self.wait(*self.args, *self.poll)
            else:
                self.wait(*self.args)
            return
        if self.spins < SPINS:
            self.spins += 1
            os.sched_yield()  # lets the other side (and, in one process, its thread) run
            return
        time.sleep(self.delay)
        self.delay = min(self.delay * 2, SLEEP_MAX)

    def waited(self) -> float:
        return time.monotonic() - self.started if self.spins else 0.0


class _Ring:
    """One mapped ring: the header words, the data area's address and a memoryview of the mapping."""

    def __init__(self, mm: mmap.mmap, size: int, path: str) -> None:
        self.mm = mm
        self.size = size
        self.path = path
        self._bytes = np.frombuffer(mm, dtype=np.uint8)  # the mapping's address (a buffer export)
        self._words = np.frombuffer(mm, dtype=np.uint64, count=HEADER_BYTES // 8)
        self.base = int(self._bytes.ctypes.data)
        self.data = self.base + HEADER_BYTES
        self.view = memoryview(mm)
        self._lib = _native()

    def load(self, offset: int) -> int:
        if self._lib is not None:
            return self._lib.ring_load(self.base + offset)
        return int(self._words[offset // 8])

    def store(self, offset: int, value: int) -> None:
        if self._lib is not None:
            self._lib.ring_store(self.base + offset, value)
        else:
            self._words[offset // 8] = value

    def publish(self, offset: int, value: int, want: int) -> None:
        """Store this side's position and wake the other side if it sleeps for (at most) it."""
        if self._lib is not None:
            self._lib.ring_publish(self.base + offset, value, self.base + want)
        else:  # the pure-Python side never sleeps in a futex; a native peer's sleeps end within 10 ms
            self._words[offset // 8] = value

    def set_state(self, offset: int, value: int) -> None:
        """Store a state word (FENCED, CLOSED) and wake both sides' sleeps to look at it."""
        self.store(offset, value)
        if self._lib is not None:
            self._lib.ring_wake(self.base + W_PRODUCER)
            self._lib.ring_wake(self.base + W_CONSUMER)

    def read_into(self, position: int, out: memoryview, area: int = HEADER_BYTES, size: int = 0) -> None:
        """Copy ``len(out)`` bytes of the stream at ``position`` out of the ring (wrapping at its end); ``area``
        and ``size``: another byte ring in the mapping (the result area), else the data area."""
        size = size or self.size
        length = len(out)
        offset = position % size
        first = min(length, size - offset)
        out[:first] = self.view[area + offset : area + offset + first]
        if length > first:
            out[first:] = self.view[area : area + length - first]

    def read(self, position: int, length: int, area: int = HEADER_BYTES, size: int = 0) -> bytes:
        out = bytearray(length)
        self.read_into(position, memoryview(out), area, size)
        return bytes(out)

    def write(self, position: int, data: memoryview, area: int = HEADER_BYTES, size: int = 0) -> None:
        """Copy ``data`` into the stream at ``position`` (wrapping at the ring's end); ``area`` and
        ``size`` as :meth:`read_into`."""
        size = size or self.size
        length = len(data)
        offset = position % size
        first = min(length, size - offset)
        self.view[area + offset : area + offset + first] = data[:first]
        if length > first:
            self.view[area : area + length - first] = data[first:]

    def close(self) -> None:
        self._bytes = None  # type: ignore[assignment]
        self._words = None  # type: ignore[assignment]
        self.view.release()
        try:
            self.mm.close()
        except BufferError:  # pragma: no cover - a view is still alive somewhere; unmapped when collected
            log.debug("ring %s: mapping still exported, left to the garbage collector", self.path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:  # pragma: no cover
        log.warning("cannot remove ring file %s: %s", path, exc)


def reap_stale_rings(directory: str) -> int:
    """Remove ring files of this user whose creating process no longer exists (a SIGKILLed decode
    between its OFFER and the writer's CONNECT). Returns how many were removed."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    now = time.time()
    for name in names:
        match = RING_NAME.fullmatch(name)
        if match is None or _pid_alive(int(match.group(1))):
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode) or now - st.st_mtime < _STALE_AGE:
            continue
        _unlink(path)
        removed += 1
    return removed


def _check_cpu(layout: KVLayout) -> None:
    if layout.device != "cpu":
        raise ConfigError(f"the shm transport moves host pages only; this layout's pages are on {layout.device} "
                          "(CUDA IPC for GPU pools is not implemented: use tcp or verbs)")


def _options(config: Any) -> ShmOptions:
    if config is not None and hasattr(config, "options"):
        try:
            options = config.options("shm")
        except (KeyError, ConfigError, TypeError):
            options = None
        if isinstance(options, ShmOptions):
            return options
    return ShmOptions()


def encode_offer(path: str, size: int) -> bytes:
    """The OFFER blob: where the ring is and which boot and process made it."""
    return msgpack.packb({"v": 1, "path": path, "size": size, "boot_id": _boot_id(), "pid": os.getpid()},
                         use_bin_type=True)


def decode_offer(blob: bytes) -> dict[str, Any]:
    """The fields of an shm OFFER blob; ProtocolError for anything malformed, TransportError for a
    ring on another host or boot."""
    try:
        data = msgpack.unpackb(blob, raw=False)
    except Exception as exc:
        raise ProtocolError(f"shm OFFER blob is not msgpack: {exc}") from None
    if (not isinstance(data, dict) or data.get("v") != 1 or not isinstance(data.get("path"), str)
            or not isinstance(data.get("size"), int) or not isinstance(data.get("boot_id"), str)
            or not isinstance(data.get("pid"), int)):
        raise ProtocolError("shm OFFER blob must be {v: 1, path: str, size: int, boot_id: str, pid: int}")
    ours = _boot_id()
    if data["boot_id"] != ours or not ours:
        raise TransportError(f"shm OFFER comes from another host or boot (boot_id {data['boot_id']!r}, this host "
                             f"{ours!r}): the shm transport needs both engines on one host; use tcp or verbs")
    if not MIN_RING_BYTES <= data["size"] <= 1 << 40:
        raise ProtocolError(f"shm OFFER names a ring of {data['size']} bytes")
    if RING_NAME.fullmatch(os.path.basename(data["path"])) is None:
        raise ProtocolError(f"shm OFFER path {data['path']!r} is not a kvxfer ring")
    return data


# receiving side -------------------------------------------------------------------------------------


class _State(enum.Enum):
    OPEN = "open"
    FENCING = "fencing"  # fenced, withdrawn or closed by the receiver: the thread stops, nothing is reported
    CLOSED = "closed"


class _Stopped(Exception):
    """The receiver stopped this ring (fence, withdraw, close)."""


class _Ended(Exception):
    """The writer closed and the ring is drained (at a frame boundary)."""


@dataclass(eq=False)
class _Inbound:
    peer: str
    epoch: int
    ring: _Ring
    conn_id: Any = None
    thread: threading.Thread | None = None
    state: _State = _State.OPEN
    consumer: int = 0
    unlinked: bool = False
    writer_pid: int | None = None
    frames: int = 0
    # RESULT frames put into the result area (answer): their end, and the lock that keeps answers
    # whole and off an unmapped ring (mapped goes False, under it, before the ring is unmapped)
    results_produced: int = 0
    answer_lock: threading.Lock = field(default_factory=threading.Lock)
    mapped: bool = True


class ShmReceiver(ReceiverBackend):
    """The decode side: creates a ring per offered connection and lands its writes through the guard.

    One landing thread per ring polls it, checks every WRITE with the guard, copies allowed payloads
    into the pool and hands ORDERED messages to ``hooks.on_ordered`` behind every earlier frame."""

    name = "shm"
    capabilities = CAPABILITIES

    def __init__(self, layout: KVLayout, guard: WriteGuard, *, hooks: ReceiverHooks, checksum: Any = None,
                 options: ShmOptions | None = None, max_ordered_body: int = 2 << 20) -> None:
        from ..core.checksum import ChecksumAlgo, native_id

        _check_cpu(layout)
        self.layout = layout
        self.guard = guard
        self.options = options or ShmOptions()
        if self.options.ring_bytes < MIN_RING_BYTES:
            raise ConfigError(f"shm ring_bytes {self.options.ring_bytes} is below the minimum {MIN_RING_BYTES}")
        self.directory = os.path.realpath(self.options.directory)
        if not os.path.isdir(self.directory) or not os.access(self.directory, os.W_OK | os.X_OK):
            raise ConfigError(f"shm directory {self.options.directory!r} is not a writable directory")
        self.ring_bytes = self.options.ring_bytes
        self.hooks = hooks
        self.max_ordered_body = max_ordered_body
        algo = ChecksumAlgo.parse(checksum) if checksum is not None else ChecksumAlgo.NONE
        self._sum_fn = native_id(algo)
        self._sum_initial = algo.initial if self._sum_fn is not None else 0
        self._dst = [memoryview(layout.flat_view(b)) for b in range(layout.num_buffers)]
        self._dst_base = np.array([spec.address for spec in layout.buffers], dtype=np.uint64)
        self._items = layout.item_lens.astype(np.uint64)
        self._dst_bases = self._dst_base.tobytes()  # ring_run_table's per-buffer base addresses and item lengths
        self._item_lens = np.ascontiguousarray(layout.item_lens, dtype=np.int64).tobytes()
        self._c_run_table = _native().ring_run_table if _native() is not None and native.provides("ring_run_table") else None
        self.address = f"shm:{self.directory}"
        self._lock = threading.Lock()
        self._offers: dict[tuple[str, int], _Inbound] = {}
        self._conns: dict[Any, _Inbound] = {}
        self._closed = False
        self.protocol_errors = 0
        self.frames = 0
        self.done_frames = 0  # DONEs that came in the binary DONE frame (the rest came as ORDERED msgpack)
        self.answers_sent = 0  # RESULT frames put into a result area (answer)
        self.answers_declined = 0  # ... that did not fit in what a writer left unread: on the control plane
        # the landing threads poll their ring this long before sleeping for the next frame (C only); what
        # came of it: [data found while polling, polling ran out, another thread was polling]
        self._poll_counts = np.zeros(3, dtype=np.uint64)
        self._busy_poll = ((self.options.busy_poll_us * 1000, int(self._poll_counts.ctypes.data))
                           if self.options.busy_poll_us and getattr(_native(), "BUSY_POLLERS", 0) else None)
        # frame heads read and checked in C (the Python reader where the extension lacks it)
        self._c_head = f.native_reader("ring_frame_head") if _native() is not None else None
        self.payload_seconds = 0.0  # time inside payload copies (ring -> pages)
        self.busy_seconds = 0.0  # time handling frames, from a published frame to done
        reaped = reap_stale_rings(self.directory)
        if reaped:
            log.info("removed %d ring file(s) of processes that no longer exist from %s", reaped, self.directory)

    # offers ----------------------------------------------------------------------------------------
    def offer(self, peer: str, session: bytes, epoch: int) -> bytes:
        """Create the ring for connection ``(peer, epoch)``, start its landing thread, return the blob."""
        with self._lock:
            if self._closed:
                raise TransportError("shm receiver is closed")
            old = self._offers.get((peer, epoch))
        if old is not None:
            self.withdraw(peer, epoch)
        size = self.ring_bytes
        path = os.path.join(self.directory, f"kvxfer-ring-{os.getpid()}-{secrets.token_hex(16)}")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as exc:
            raise TransportError(f"cannot create a ring in {self.directory}: {exc}") from exc
        try:
            try:
                os.posix_fallocate(fd, 0, HEADER_BYTES + size)  # no SIGBUS later on a full tmpfs
            except OSError as exc:
                raise TransportError(f"cannot reserve {HEADER_BYTES + size:,} bytes for a ring in "
                                     f"{self.directory}: {exc} (lower ring_bytes or free space)") from exc
            mm = mmap.mmap(fd, HEADER_BYTES + size)
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        os.close(fd)
        ring = _Ring(mm, size, path)
        for offset, value in ((W_VERSION, RING_VERSION), (W_SIZE, size), (W_CREATOR, os.getpid()),
                              (W_PRODUCER, 0), (W_CONSUMER, 0), (W_WRITER_STATE, WRITER_NEW),
                              (W_READER_STATE, READER_OPEN), (W_READER_WANT, 0), (W_WRITER_WANT, 0),
                              (W_RESULT_PRODUCER, 0), (W_RESULT_CONSUMER, 0), (W_RESULT_WANT, 0), (W_RESULT_READER, 0)):
            ring.store(offset, value)
        ring.store(W_MAGIC, MAGIC)  # last: a writer sees a complete header or none
        inbound = _Inbound(peer, epoch, ring)
        thread = threading.Thread(target=self._serve, args=(inbound,), name="kvxfer-shm-land", daemon=True)
        inbound.thread = thread
        with self._lock:
            if self._closed:
                ring.close()
                _unlink(path)
                raise TransportError("shm receiver is closed")
            self._offers[(peer, epoch)] = inbound
            thread.start()
        return encode_offer(path, size)

    def withdraw(self, peer: str, epoch: int) -> None:
        """Forget an offer whose ring never carried a connection: stop its thread, remove its file."""
        with self._lock:
            inbound = self._offers.get((peer, epoch))
            if inbound is None or inbound.conn_id is not None or inbound.state is not _State.OPEN:
                return
            self._revoke_locked(inbound)
        self._stop(inbound)
        if inbound.conn_id is not None:  # CONNECT was being handled meanwhile: the engine knows the id
            self.hooks.on_closed(inbound.conn_id, "offer withdrawn")

    # the landing thread --------------------------------------------------------------------------
    def _serve(self, inbound: _Inbound) -> None:
        reason = "closed"
        # the id on_closed reports, unless the receiver stopped the ring: the offered (peer, epoch) until
        # CONNECT names the connection (a malformed first frame ends the offered connection)
        report: Any = (inbound.peer, inbound.epoch)
        try:
            header, body = self._next_frame(inbound)
            if header.kind is not f.FrameKind.CONNECT:
                raise ProtocolError(f"first frame must be CONNECT, got {header.kind.name}")
            hello = m.decode(body)
            if not isinstance(hello, m.Connect):
                raise ProtocolError(f"CONNECT frame carries {hello.TYPE}")
            if hello.epoch != inbound.epoch:
                raise ProtocolError(f"CONNECT for epoch {hello.epoch} on the ring offered for epoch {inbound.epoch}")
            pid = inbound.ring.load(W_WRITER_PID)
            inbound.writer_pid = pid if 0 < pid < 1 << 31 and _pid_alive(pid) else None
            conn_id = self.hooks.on_connect(hello)
            if conn_id is None:
                report = None
                reason = f"connection from {hello.engine!r} refused (unknown peer, wrong epoch or proof)"
                log.warning("shm ring %s: %s", inbound.ring.path, reason)
                return
            with self._lock:
                inbound.conn_id = conn_id  # whoever stopped the ring meanwhile reports it
                report = conn_id
                if inbound.state is _State.OPEN:
                    self._conns[conn_id] = inbound
            # both sides have the ring mapped: its name is no longer needed
            _unlink(inbound.ring.path)
            inbound.unlinked = True
            while True:
                header, body = self._next_frame(inbound)
                t0 = time.perf_counter()
                if header.kind is f.FrameKind.WRITE:
                    self._land_write(inbound, header, body)
                elif header.kind is f.FrameKind.ORDERED or header.kind is f.FrameKind.DONE:
                    if header.kind is f.FrameKind.DONE:
                        with self._lock:
                            self.done_frames += 1
                    self.hooks.on_ordered(conn_id, body)
                else:
                    raise ProtocolError("second CONNECT on one ring")
                self.frames += 1
                inbound.frames += 1
                self.busy_seconds += time.perf_counter() - t0
        except ProtocolError as exc:
            self.protocol_errors += 1
            reason = f"protocol error: {exc}"
            log.warning("shm connection %s: %s", inbound.conn_id or (inbound.peer, inbound.epoch), reason)
        except _Ended:
            reason = "writer closed the connection"
        except ConnectionError as exc:
            reason = f"connection lost: {exc}"
        except _Stopped:
            pass
        except Exception as exc:  # a bug must not leave the ring half alive: end it, loudly
            log.exception("shm connection %s: landing thread failed", inbound.conn_id)
            reason = f"landing failed: {exc}"
        finally:
            self._finish(inbound, reason, report)

    def _next_frame(self, inbound: _Inbound) -> tuple[f.FrameHeader, Any]:
        """The next frame's header and what its body says, consumed: a WRITE frame's run table (an array;
        its payload is left in the stream for :meth:`_land_write`), an ORDERED or DONE frame's message, a
        CONNECT frame's body (bytes). Read and checked in C where the extension has ``ring_frame_head``
        (the twin of the Python rules below), else in Python; ProtocolError names a broken rule."""
        body: Any = None
        if self._c_head is not None:
            if inbound.state is not _State.OPEN:
                raise _Stopped
            ring = inbound.ring
            base = ring.base
            rc, inbound.consumer, head = self._c_head(
                ring.data, ring.size, inbound.consumer, base + W_PRODUCER, base + W_CONSUMER, base + W_READER_STATE,
                READER_FENCED, base + W_WRITER_STATE, WRITER_CLOSED, inbound.writer_pid or 0, base + W_READER_WANT,
                base + W_WRITER_WANT, *f.NATIVE_LIMITS, self.max_ordered_body, *(self._busy_poll or ()))
            if rc:
                raise self._wait_ended(inbound, rc)
            if head[0] in (3, -3) and head[5] > self.max_ordered_body:  # a DONE frame C read: the limit first
                raise ProtocolError(f"DONE frame body of {head[5]} bytes exceeds {self.max_ordered_body}")
            header, body = f.native_head(head)
        else:
            self._wait(inbound, f.HEADER_SIZE, boundary=True)
            header = f.parse_header(inbound.ring.read(inbound.consumer, f.HEADER_SIZE))
            self._consume(inbound, f.HEADER_SIZE)
        if body is None:
            limit = {f.FrameKind.CONNECT: f.CONNECT_BODY_MAX, f.FrameKind.ORDERED: self.max_ordered_body,
                     f.FrameKind.DONE: self.max_ordered_body}.get(header.kind)
            if limit is not None and header.body_len > limit:  # refused before allocating or reading it
                raise ProtocolError(f"{header.kind.name} frame body of {header.body_len} bytes exceeds {limit}")
            raw = bytearray(header.body_len)
            self._stream(inbound, header.body_len,
                         lambda at, n: inbound.ring.read_into(inbound.consumer, memoryview(raw)[at : at + n]))
            body = f.parse_runs(header, raw) if header.kind is f.FrameKind.WRITE else bytes(raw)
        if header.kind is f.FrameKind.ORDERED or (header.kind is f.FrameKind.DONE and not isinstance(body, m.Done)):
            body = f.ordered_message(header, body)
        return header, body

    @staticmethod
    def _wait_ended(inbound: _Inbound, rc: int) -> Exception:
        """What ended a native wait on the ring (the rc of ``ring_frame_head``, ``ring_copy`` or
        ``ring_run_table``), as the Python reader raises it."""
        if rc == 1:
            return _Stopped()
        if rc == 2:
            return ConnectionError("the writer closed inside a frame")
        if rc == 3:
            return ConnectionError(f"the writer's process {inbound.writer_pid} exited")
        if rc == 5:
            return _Ended()
        if rc == 6:
            return ProtocolError(f"producer position {inbound.ring.load(W_PRODUCER)} is impossible (consumer at "
                                 f"{inbound.consumer}, ring of {inbound.ring.size} bytes)")
        return RuntimeError(f"ring_frame_head returned {rc}")

    def _stream(self, inbound: _Inbound, nbytes: int, sink: Callable[[int, int], None] | None) -> None:
        """Take ``nbytes`` of the stream as the writer publishes them, in pieces: ``sink(done, n)``
        copies the next ``n`` (None: read past them), then the consumer position moves behind them."""
        done = 0
        piece_max = max(1, min(PY_CHUNK, inbound.ring.size // 2))
        while done < nbytes:
            piece = min(nbytes - done, piece_max)
            self._wait(inbound, piece)
            if sink is not None:
                sink(done, piece)
            self._consume(inbound, piece)
            done += piece

    def _wait(self, inbound: _Inbound, nbytes: int, *, boundary: bool = False) -> None:
        """Until ``nbytes`` (at most the ring's size) beyond the consumer position are published.
        When the writer closed first: _Ended at a frame ``boundary`` with nothing left, else
        ConnectionError; _Stopped when the receiver stopped the ring."""
        ring = inbound.ring
        consumer = inbound.consumer
        backoff: _Backoff | None = None
        next_check = 0.0
        while True:
            if inbound.state is not _State.OPEN:
                raise _Stopped
            producer = ring.load(W_PRODUCER)
            if producer < consumer or producer - consumer > ring.size:
                raise ProtocolError(f"producer position {producer} is impossible (consumer at {consumer}, "
                                    f"ring of {ring.size} bytes)")
            if producer - consumer >= nbytes:
                return
            if ring.load(W_WRITER_STATE) == WRITER_CLOSED and ring.load(W_PRODUCER) - consumer < nbytes:
                if not boundary or ring.load(W_PRODUCER) != consumer:
                    raise ConnectionError("the writer closed inside a frame")
                raise _Ended
            if backoff is None:  # waiting for the next frame: busy polling first (busy_poll_us)
                backoff = _Backoff(ring, W_PRODUCER, consumer + nbytes, W_READER_WANT, ring.base + W_READER_STATE,
                                   READER_FENCED, ring.base + W_WRITER_STATE, WRITER_CLOSED,
                                   self._busy_poll if boundary else None)
            backoff.pause()
            waited = backoff.waited()
            if waited > LIVENESS_AFTER and waited > next_check:
                next_check = waited + LIVENESS_AFTER
                if inbound.writer_pid is not None and not _pid_alive(inbound.writer_pid):
                    raise ConnectionError(f"the writer's process {inbound.writer_pid} exited")

    def _consume(self, inbound: _Inbound, nbytes: int) -> None:
        inbound.consumer += nbytes
        inbound.ring.publish(W_CONSUMER, inbound.consumer, W_WRITER_WANT)

    def _land_write(self, inbound: _Inbound, header: f.FrameHeader, runs: np.ndarray) -> None:
        """Land (or refuse) a WRITE frame's payload (its checked run table ``runs``), streamed out of the
        ring as it is published."""
        try:
            window, counts = self.guard.check(inbound.conn_id, header.slot, header.generation, runs)
        except WriteRefused:
            self._stream(inbound, header.payload_len, None)  # read past, never landed
            return
        ring = inbound.ring
        t0 = time.perf_counter()
        sums = None
        lib = _native()
        if lib is not None:
            summed = self._sum_fn is not None and window.table is None  # a head slice is summed at verification
            base = ring.base
            words = (base + W_PRODUCER, base + W_CONSUMER, base + W_READER_STATE, READER_FENCED, base + W_WRITER_STATE,
                     WRITER_CLOSED, inbound.writer_pid or 0, base + W_READER_WANT, base + W_WRITER_WANT)
            if self._c_run_table is not None and runs.dtype == f.RUN_DTYPE and runs.flags.c_contiguous:
                rc, raw = self._c_run_table(runs, self._dst_bases, self._item_lens, self.layout.num_pages,
                                            self._sum_fn if summed else -1, self._sum_initial, SUM_CHUNK, ring.data,
                                            ring.size, inbound.consumer, *words)
            else:
                lengths = runs["length"].astype(np.uint64)
                dst = self._dst_base[runs["buffer"]] + runs["offset"]
                items = self._items[runs["buffer"]] if summed else lengths
                rc, raw = lib.ring_copy(dst.tobytes(), lengths.tobytes(), items.tobytes(), self._sum_fn if summed else -1,
                                        self._sum_initial, SUM_CHUNK, ring.data, ring.size, inbound.consumer, 1, *words)
            if rc:
                raise self._wait_ended(inbound, rc)
            inbound.consumer += header.payload_len  # ring_copy published it
            if raw is not None:
                sums = np.frombuffer(raw, dtype=np.uint32)
        else:
            for buffer, offset, length in zip(runs["buffer"].tolist(), runs["offset"].tolist(), runs["length"].tolist()):
                target = self._dst[buffer][offset : offset + length]
                self._stream(inbound, length, lambda at, n, target=target: ring.read_into(inbound.consumer, target[at : at + n]))
        self.payload_seconds += time.perf_counter() - t0
        self.guard.record(window, runs, counts, sums)

    def _finish(self, inbound: _Inbound, reason: str, report: Any) -> None:
        with self._lock:
            stopped = inbound.state is _State.FENCING
            inbound.state = _State.CLOSED
            if inbound.conn_id is not None and self._conns.get(inbound.conn_id) is inbound:
                del self._conns[inbound.conn_id]
            if self._offers.get((inbound.peer, inbound.epoch)) is inbound:
                del self._offers[(inbound.peer, inbound.epoch)]
        ring = inbound.ring
        try:
            ring.set_state(W_READER_STATE, READER_FENCED)  # the writer stops: nobody reads this ring any more
        finally:
            if not inbound.unlinked:
                _unlink(ring.path)
                inbound.unlinked = True
            with inbound.answer_lock:  # no answer is being written into it
                inbound.mapped = False
                ring.close()
        if not stopped and report is not None:
            self.hooks.on_closed(report, reason)

    @staticmethod
    def _revoke_locked(inbound: _Inbound) -> None:
        """With the receiver's lock held and the ring OPEN (so its thread has not unmapped it): mark
        it FENCING for the thread and FENCED for the writer."""
        inbound.state = _State.FENCING
        inbound.ring.set_state(W_READER_STATE, READER_FENCED)  # wakes the landing thread and the writer

    def _stop(self, inbound: _Inbound) -> None:
        """Remove the ring's file and wait for its thread to end (the caller revoked it)."""
        if not inbound.unlinked:
            _unlink(inbound.ring.path)
            inbound.unlinked = True
        if inbound.thread is not None and inbound.thread is not threading.current_thread():
            inbound.thread.join()

    # the contract -------------------------------------------------------------------------------------
    def fence(self, conn: ConnId) -> bool:
        """Mark the ring FENCED, stop and join its landing thread, remove its file: afterwards nothing
        from it lands. True if this call ended a live connection, False if it was already gone."""
        with self._lock:
            inbound = self._conns.get(conn)
            if inbound is None or inbound.state is not _State.OPEN:
                return False
            self._revoke_locked(inbound)
        self._stop(inbound)
        return True

    def connections(self) -> list[ConnId]:
        with self._lock:
            return list(self._conns)

    def answer(self, conn: ConnId, msg: m.Message) -> bool:
        """Put RESULT ``msg`` into connection ``conn``'s result area without waiting (the writer's
        watcher delivers it): False, writing nothing, when ``answer_on_data`` is off, the connection
        is not open, its writer does not read the area, or the frame does not fit in what the writer
        left unread (the caller then uses the control plane)."""
        if not self.options.answer_on_data:
            return False
        with self._lock:
            inbound = self._conns.get(conn)
            if inbound is None or inbound.state is not _State.OPEN:
                return False
        try:
            frame = f.result_frame(msg)
        except ProtocolError:
            return False
        with inbound.answer_lock:
            ring = inbound.ring
            if not inbound.mapped or ring.load(W_RESULT_READER) != 1:
                return False
            produced = inbound.results_produced
            taken = ring.load(W_RESULT_CONSUMER)  # the writer's word: any value, a hostile writer's too
            if taken > produced or produced - taken + len(frame) > RESULT_AREA_BYTES:
                with self._lock:
                    self.answers_declined += 1
                return False
            ring.write(produced, memoryview(frame), RESULT_AREA, RESULT_AREA_BYTES)
            inbound.results_produced = produced + len(frame)
            ring.publish(W_RESULT_PRODUCER, inbound.results_produced, W_RESULT_WANT)
        with self._lock:
            self.answers_sent += 1
        return True

    def stats(self) -> dict[str, Any]:
        with self._lock:
            offers = sum(1 for i in self._offers.values() if i.conn_id is None)
        return {"protocol_errors": self.protocol_errors, "frames": self.frames, "payload_seconds": self.payload_seconds,
                "busy_seconds": self.busy_seconds, "rings_offered": offers, "ring_bytes": self.ring_bytes,
                "done_frames": self.done_frames, "answers_sent": self.answers_sent,
                "answers_declined": self.answers_declined, "busy_poll_found": int(self._poll_counts[0]),
                "busy_poll_expired": int(self._poll_counts[1]), "busy_poll_skipped": int(self._poll_counts[2])}

    def close(self) -> None:
        """Fence every connection (reporting each through ``on_closed``), withdraw every offer and
        remove every ring file this receiver created. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with self._lock:
            rings = list(self._offers.values())  # every ring until its thread finished, connected or not
        for inbound in rings:
            with self._lock:
                mine = inbound.state is _State.OPEN
                if mine:
                    self._revoke_locked(inbound)
            if mine:
                self._stop(inbound)
                if inbound.conn_id is not None:  # read after the thread ended: final
                    self.hooks.on_closed(inbound.conn_id, "receiver closed")
            elif inbound.thread is not None and inbound.thread is not threading.current_thread():
                inbound.thread.join(timeout=10)  # ending on its own (and reporting itself)


# sending side ----------------------------------------------------------------------------------------


class _Fenced(Exception):
    """The reader fenced the ring (or its process is gone): the link is over."""


class ShmLink(FrameLink):
    """The writer's half of one connection: puts frames into the decode's ring, from the transport's lanes.

    Mirrors :class:`~kvxfer.transport.tcp.TcpLink`: jobs for writes, ordered messages and raw frames
    are handled in order; fault injection hooks act on the same frames."""

    def __init__(self, layout: KVLayout, ring: _Ring, *, connect: m.Connect,
                 on_closed: Callable[[ShmLink, str], None], lanes: SendLanes, faults: FaultInjector | None = None,
                 checksum: Any = None, reader_pid: int | None = None, inline_send: bool = True,
                 on_message: Callable[[m.Message], None] | None = None) -> None:
        self._init_link((connect.engine, connect.epoch), on_closed, faults, checksum)
        # RESULT frames the receiver puts into the result area, read by this link's watcher thread (native
        # only: it sleeps in a futex on the result producer word) and delivered to on_message
        self._on_message = on_message if ring._lib is not None else None
        self._results = f.ResultReader()
        self._results_taken = 0  # result-area bytes read (published as the result consumer position)
        self.results_received = 0
        self._read_lock = threading.Lock()  # one reader of the result area at a time; held while it is unmapped
        self._watch_stop = np.zeros(1, dtype=np.uint64)  # 1: the watcher returns
        self._watcher: threading.Thread | None = None
        self._init_lane(lanes)
        # a small request posted on an idle link goes into the ring from the posting thread: its WRITE frame
        # as its batch is posted (_send_early), its DONE at the last unhold (_send_inline)
        self.inline_send = inline_send
        self.sent_inline = 0  # small requests whose DONE the posting thread put into the ring (unhold)
        self.inline_deferred = 0  # small requests claimed for it that a sending thread took (no room in the ring)
        self.sent_early = 0  # WRITE frames put into the ring by the posting thread as their batch was posted
        self._early: tuple[WriteBatch, SmallWire | FrameCut] | None = None  # that batch and its frame, its DONE
        # not yet sent (the link claimed)
        self.done_filled = 0  # DONE frames whose checksum was combined in C from the sums the WRITE's copy took
        self._early_small: SmallWire | FrameCut | None = None  # its one frame, as _small made it when claimed
        self.sent_prepared = 0  # ... of which made when the destination arrived (prepare)
        self.sent_with_ordered = 0  # small batches a lane sent with their DONE right behind, in one step
        self._next_pid_check = 0.0
        self.idle_looks = 0  # steps with nothing queued: a look at the reader (about one per IDLE_CHECK when idle)
        self.layout = layout
        self.ring = ring
        self.address = f"shm:{ring.path}"
        self.accept_blob = b""
        self._reader_pid = reader_pid
        self._src = [memoryview(layout.flat_view(b)) for b in range(layout.num_buffers)]
        self._src_base = np.array([spec.address for spec in layout.buffers], dtype=np.uint64)
        self._items = layout.item_lens.astype(np.uint64)
        self.frame_limit = max(FRAME_BYTES, int(layout.item_lens.max()))  # frames stream: any size fits the ring
        if self.frame_limit > f.MAX_PAYLOAD:
            raise TransportError(f"an item of {self.frame_limit} bytes is larger than a frame may carry "
                                 f"({f.MAX_PAYLOAD} bytes)")
        self._abort_word = np.zeros(1, dtype=np.uint64)  # ring_copy gives up when this is 1 (abort)
        self._lost: str | None = None  # a step from the posting thread failed: the next lane step ends the link
        self._producer = 0
        self._abort = False
        self._unmapped = False
        ring.store(W_WRITER_PID, os.getpid())
        ring.store(W_WRITER_STATE, WRITER_OPEN)
        if self._on_message is not None:
            ring.store(W_RESULT_READER, 1)
            self._watcher = threading.Thread(target=self._watch_results, name="kvxfer-shm-results", daemon=True)
            self._watcher.start()
        try:
            self._write_pieces([f.message_frame(f.FrameKind.CONNECT, m.encode(connect))])
        except _Fenced as exc:
            self._release_ring()
            raise TransportError(f"shm ring {ring.path} was fenced before the writer connected") from exc
        with self._cond:
            self._kick()  # the first idle look at the reader

    # the ring ---------------------------------------------------------------------------------------------
    def _check_reader(self) -> None:
        if self.ring.load(W_READER_STATE) != READER_OPEN:
            raise _Fenced("the receiver fenced or closed the connection")

    def _wait_free(self, nbytes: int) -> None:
        """Until ``nbytes`` after the producer position are free; _Fenced if the reader is gone."""
        ring = self.ring
        limit = self._producer + nbytes - ring.size
        backoff: _Backoff | None = None
        next_check = 0.0
        while True:
            if ring.load(W_CONSUMER) >= limit:
                return
            self._check_reader()
            if self._abort:
                raise _Fenced("link aborted")
            if backoff is None:
                backoff = _Backoff(ring, W_CONSUMER, limit, W_WRITER_WANT, ring.base + W_READER_STATE, READER_FENCED,
                                   int(self._abort_word.ctypes.data), 1)
            backoff.pause()
            waited = backoff.waited()
            if waited > LIVENESS_AFTER and waited > next_check:
                next_check = waited + LIVENESS_AFTER
                if self._reader_pid is not None and not _pid_alive(self._reader_pid):
                    raise _Fenced(f"the receiver's process {self._reader_pid} exited")

    def _publish(self, nbytes: int) -> None:
        self._producer += nbytes
        self.ring.publish(W_PRODUCER, self._producer, W_READER_WANT)

    def _write_pieces(self, pieces: list[Any]) -> None:
        """Stream ``pieces`` (buffers) into the ring back to back, publishing as room allows: every
        ``PY_CHUNK``, before waiting for room and at the end (a frame's header and run table are
        published together: the reader wakes once for them)."""
        if self._abort:
            raise _Fenced("link aborted")
        self._check_reader()
        ring = self.ring
        piece_max = max(1, min(PY_CHUNK, ring.size // 2))
        at = self._producer  # written up to here, published up to self._producer
        for piece in pieces:
            data = memoryview(piece).cast("B")
            done = 0
            while done < len(data):
                step = min(len(data) - done, piece_max)
                if ring.load(W_CONSUMER) < at + step - ring.size:  # no room: publish what the reader may wait for
                    if at > self._producer:
                        self._publish(at - self._producer)
                    self._wait_free(step)
                ring.write(at, data[done : done + step])
                at += step
                done += step
                if at - self._producer >= piece_max:
                    self._publish(at - self._producer)
        if at > self._producer:
            self._publish(at - self._producer)

    # RESULT frames from the receiver ------------------------------------------------------------------------
    def _watch_results(self) -> None:
        """The watcher: sleep until the receiver publishes RESULT bytes, read and deliver them; ends when
        the link releases the ring or the receiver fences it (what is left is read at the end), or when
        the area holds anything but RESULT frames (the link then ends on a lane, saying why)."""
        ring = self.ring
        wait = ring._lib.ring_wait
        stop = int(self._watch_stop.ctypes.data)
        while not self._watch_stop[0]:
            rc = wait(ring.base + W_RESULT_PRODUCER, self._results_taken + 1, ring.base + W_RESULT_WANT,
                      ring.base + W_READER_STATE, READER_FENCED, stop, 1, 0, WAIT_SLICE)
            why = self._read_results()
            if why is not None:
                with self._cond:
                    self._lost = self._lost or why
                    self._kick()
                return
            if rc == 1:  # fenced: the lanes end the link (which reads what is left)
                return

    def _read_results(self) -> str | None:
        """Read and deliver the RESULT frames in the area now; why the link must end, or None."""
        with self._read_lock:
            if self._unmapped:
                return None
            ring = self.ring
            produced = ring.load(W_RESULT_PRODUCER)
            taken = self._results_taken
            if produced == taken:
                return None
            if produced < taken or produced - taken > RESULT_AREA_BYTES:
                return (f"the receiver's result position {produced} is impossible (read up to {taken}, an area "
                        f"of {RESULT_AREA_BYTES} bytes)")
            data = ring.read(taken, produced - taken, RESULT_AREA, RESULT_AREA_BYTES)
            self._results_taken = produced
            ring.store(W_RESULT_CONSUMER, produced)
            results = self._results.feed(data)
            self.results_received += len(results)
            why = f"the receiver sent a malformed frame: {self._results.error}" if self._results.error else None
        for msg in results:  # outside the read lock: delivering takes the engine's
            try:
                self._on_message(msg)  # type: ignore[misc]
            except Exception:  # the engine reports its own failures; the connection is fine
                log.exception("shm connection %s: handling %s", self.conn_id, msg.TYPE)
        return why

    def drain_messages(self) -> None:
        """Deliver the RESULT frames already in the result area (before the link's requests settle)."""
        if self._on_message is not None and self._results.error is None:
            self._read_results()

    def _stop_watcher(self) -> None:
        """The watcher told to return and joined (unless it is this thread); what it left is read here."""
        if self._watcher is None:
            return
        self._watch_stop[0] = 1
        if not self._unmapped and self.ring._lib is not None:
            self.ring._lib.ring_wake(self.ring.base + W_RESULT_PRODUCER)
        if self._watcher is not threading.current_thread():
            self._watcher.join(5)
        self.drain_messages()

    # from the posting thread -------------------------------------------------------------------------------
    def _may_claim(self) -> bool:
        """Under ``_cond``: the posting thread may take this link's next send itself (inline sends on, the C
        path, the link idle and open, no fault injection waiting)."""
        return (self.inline_send and not self._scheduled and not self._closing and not self._abort
                and self._lost is None and not self._ended.is_set() and _native() is not None
                and (self.faults is None or self.faults.idle()))

    def _small(self, job: Any) -> SmallWire | FrameCut | None:
        """What the posting thread puts into the ring for ``job`` when it is a small write batch of one
        frame whose sources need no wait: its WRITE frame made when its destination arrived (:meth:`prepare`)
        or now, for one C copy; with fault injection on the link, the frame's cut (the faults act on it as
        a lane's step sends it). None: a lane sends it."""
        if (not isinstance(job, WriteJob) or job.batch.cancelled or job.batch.ready is not None
                or job.batch.nbytes > INLINE_MAX_BYTES):
            return None
        batch = job.batch
        if self.faults is None and isinstance(batch.wire, SmallWire):
            self.sent_prepared += 1
            return batch.wire
        cuts = cut_frames(batch, self.layout.item_lens, self.frame_limit, FRAME_MAX_RUNS)
        if len(cuts) != 1:
            return None
        return SmallWire.of(batch, cuts[0], self._src_base) if self.faults is None else cuts[0]

    @staticmethod
    def _small_bytes(small: SmallWire | FrameCut) -> int:
        """The ring bytes of a small batch's WRITE frame."""
        if isinstance(small, SmallWire):
            return len(small.prefix) + small.nbytes
        return f.HEADER_SIZE + f.RUN_SIZE * len(small.lengths) + small.nbytes

    def _put_small(self, batch: WriteBatch, small: SmallWire | FrameCut) -> None:
        """A small batch's one WRITE frame into the ring (the caller made sure it has room)."""
        if isinstance(small, SmallWire):
            self._send_wire(batch, small)
        else:
            self._send_frame(batch, small, last=True)

    def prepare(self, batch: WriteBatch) -> None:
        """A small batch's WRITE frame and descriptors, made when its destination arrived (before its
        send): the posting thread then only copies it into the ring."""
        if (self.faults is None and _native() is not None and batch.ready is None
                and batch.nbytes <= INLINE_MAX_BYTES):
            cuts = cut_frames(batch, self.layout.item_lens, self.frame_limit, FRAME_MAX_RUNS)
            if len(cuts) == 1:
                batch.wire = SmallWire.of(batch, cuts[0], self._src_base)

    def _claim_early(self, job: WriteJob) -> bool:
        """Under ``_cond``, ``job`` posted while the link is held (a send posting a small request's writes,
        then its DONE): whether the posting thread puts its WRITE frame into the ring now
        (:meth:`_send_early`), before the rest of the post is done, the link claimed until the last unhold
        puts the DONE behind it. So the landing thread lands the pages meanwhile. Only a small batch
        posted first on an idle link."""
        if self._queue or self._early is not None or not self._may_claim():
            return False
        small = self._small(job)
        if small is None:
            return False
        self._scheduled = True
        self._serving = threading.current_thread()
        self._early_small = small
        return True

    def _send_early(self, job: WriteJob) -> None:
        """The posting thread, the link claimed (:meth:`_claim_early`): ``job``'s WRITE frame goes into the
        ring now if the ring has room for it (never waiting), and the batch is reported sent; the claim is
        kept for the DONE the post queues behind it (:meth:`_claim_inline`). Without room, cancelled
        meanwhile, or when the frame cannot go (the reader fenced), the batch goes back to the head of the queue unreported and
        the claim is given back: a lane sends or fails it after the post, never in its middle."""
        batch, small = job.batch, self._early_small
        try:
            self._check_reader()
            if not batch.wait_sources() or self._free() < self._small_bytes(small):
                with self._cond:  # (the last unhold claims it again with its DONE, and counts it deferred)
                    self._queue.appendleft(job)
                    self._give_back()
                return
            self._put_small(batch, small)
        except Exception as exc:
            reason = str(exc) if isinstance(exc, _Fenced) else f"send failed: {type(exc).__name__}: {exc}"
            if not isinstance(exc, _Fenced):
                log.warning("shm connection %s: %s", self.conn_id, reason)
            with self._cond:
                self._lost = self._lost or reason
                self._queue.appendleft(job)
                self._give_back()
            return
        self.frames_sent += 1
        self.sent_early += 1
        job.on_complete(batch, len(batch), 0)
        with self._cond:
            if self._holding:  # the post goes on: its last unhold takes the claim back
                self._early = (batch, small)
                return
            self._give_back()

    def _give_back(self, requeue: list[Any] | None = None) -> None:
        """Under ``_cond``: the posting thread's claim ends; ``requeue`` goes first, and a step is scheduled
        if anything is left to do, unless a post still holds the link (its last unhold schedules it: a
        lane must not end the link in the middle of a post)."""
        self._serving = None
        self._scheduled = False
        self._queue.extendleft(reversed(requeue or []))
        if (not self._holding and not self._ended.is_set()
                and (self._queue or self._closing or self._abort or self._lost is not None)):
            self._kick()

    def _claim_inline(self) -> tuple[WriteJob | None, OrderedJob, SmallWire | FrameCut, WriteBatch] | None:
        """Under ``_cond``, at the last unhold: what the posting thread puts into the ring itself now, for
        :meth:`_send_inline`: the queue's two jobs, taken as a lane would take them (the link claimed),
        when they are a batch of one small frame and the ordered message behind it on an idle link; when a
        batch's WRITE frame went at post time (:meth:`_send_early`), the ordered message queued alone
        behind it (anything else queued, or nothing: the claim is given back). None: nothing to send
        here (a step is scheduled if the link has anything to do). Also the batch and its frame, for
        the DONE behind it."""
        early, self._early = self._early, None
        if early is not None:
            self._serving = threading.current_thread()  # the last unhold may be another holder's thread
            if (len(self._queue) == 1 and isinstance(self._queue[0], OrderedJob) and not self._closing
                    and not self._abort and self._lost is None and (self.faults is None or self.faults.idle())):
                return None, self._queue.popleft(), early[1], early[0]
            self._give_back()
            return None
        if len(self._queue) == 2 and isinstance(self._queue[1], OrderedJob) and self._may_claim():
            small = self._small(self._queue[0])
            if small is not None:
                self._scheduled = True
                self._serving = threading.current_thread()
                job, behind = self._queue.popleft(), self._queue.popleft()
                return job, behind, small, job.batch
        if not self._ended.is_set() and (self._queue or self._closing or self._abort or self._lost is not None):
            self._kick()
        return None

    def _filled_done(self, batch: WriteBatch, small: SmallWire | FrameCut, ordered: OrderedJob) -> bytes | None:
        """The DONE frame behind ``batch``'s one WRITE frame, its checksum combined in C from the item sums
        that frame's copy took (tcp's ``send_summed_done`` sums again; here the copy summed already), where
        DONE's builder offers it for this very batch (:meth:`~kvxfer.engine.sender.DoneBuilder.unsummed`),
        the algorithm is this link's and every run of the frame is one item. None: the builder builds it."""
        unsummed = getattr(ordered.msg, "unsummed", None)
        if (unsummed is None or not isinstance(small, SmallWire) or self._sum_fn is None or not batch.sums_done
                or batch.item_sums is None):
            return None
        msg = unsummed(batch)
        if msg is None or msg.algo != self._sum_algo:
            return None
        frame = f.done_frame(msg, slot=ordered.slot)
        if frame is None:
            return None
        item_lens = np.frombuffer(small.payload[2], dtype=np.uint64)  # a run per item (scattered pages)
        if small.lengths != small.payload[2]:  # runs of several items each
            runs = np.frombuffer(small.lengths, dtype=np.uint64)
            item_lens = np.repeat(item_lens, (runs // item_lens).astype(np.int64))
        if item_lens.size != batch.item_sums.size:
            return None
        checksum = _native().combine_items(self._sum_fn, self._sum_initial, batch.item_sums, item_lens)
        filled = bytearray(frame)
        filled[f.DONE_CHECKSUM_AT : f.DONE_CHECKSUM_AT + 4] = checksum.to_bytes(4, "little")
        ordered.msg.built()
        self.done_filled += 1
        return bytes(filled)

    def _free(self) -> int:
        """Bytes of the ring the writer may fill now without waiting."""
        return self.ring.size - (self._producer - self.ring.load(W_CONSUMER))

    def _send_inline(self, job: WriteJob | None, ordered: OrderedJob, small: SmallWire | FrameCut,
                     batch: WriteBatch) -> None:
        """Put a claimed small request into the ring from the posting thread, a whole frame at a time and
        only where the ring has room for it, so it never waits: what does not fit (the batch, or the
        ordered frame built after it) goes back first in the queue for a lane. ``job`` None: its WRITE
        frame went at post time, the ordered message alone follows. A fenced reader or any failure ends
        the link on a lane, as a lane's own failure would."""
        requeue: list[Any] = []
        reported = False

        def on_complete(batch: WriteBatch, ok: int, failed: int) -> None:
            nonlocal reported
            reported = True
            job.on_complete(batch, ok, failed)  # type: ignore[union-attr]

        try:
            self._check_reader()
            if job is not None:
                if self._free() < self._small_bytes(small):
                    requeue = [job, ordered]
                    self.inline_deferred += 1
                    return
                self._put_small(job.batch, small)  # raising: its writes are reported failed below
                on_complete(job.batch, len(job.batch), 0)
                self.frames_sent += 1
            self.sent_inline += 1
            trailer = self._filled_done(batch, small, ordered)
            if trailer is None:  # built as a lane's step builds it
                trailer = self._ordered_frame(ordered)
            if self._free() < len(trailer):
                requeue = [RawJob([trailer])]
                return
            self.ring.write(self._producer, memoryview(trailer))  # it fits: one copy, one publish
            self._publish(len(trailer))
            self.frames_sent += 1
        except Exception as exc:  # the link ends on a lane with this reason
            if job is not None and not reported:  # it failed before the batch went into the ring: its writes failed
                job.on_complete(job.batch, 0, len(job.batch))
            reason = str(exc) if isinstance(exc, _Fenced) else f"send failed: {type(exc).__name__}: {exc}"
            if not isinstance(exc, _Fenced):
                log.warning("shm connection %s: %s", self.conn_id, reason)
            self._lost = self._lost or reason
        finally:
            with self._cond:
                self._give_back(requeue)

    # on the transport's sending lanes ---------------------------------------------------------------------
    def serve_step(self) -> None:
        """One step on a lane: the next job; with none, a look at the reader (fenced? its process gone?);
        the end of a closing link with nothing queued. Then back on the ready queue if there is more,
        else a wake-up after :data:`IDLE_CHECK` (or when a held late frame falls due)."""
        self._serving = threading.current_thread()
        try:
            self._step()
        except _Fenced as exc:
            self._end(str(exc))
        except KvxferError as exc:
            reason = f"send failed: {exc}"
            log.warning("shm connection %s: %s", self.conn_id, reason)
            self._end(reason)
        except BaseException as exc:
            self._end(f"sending failed: {type(exc).__name__}: {exc}")
            raise
        finally:
            self._serving = None
        with self._cond:
            self._scheduled = False
            if self._ended.is_set():
                return
            if self._queue or self._closing or self._abort:
                self._kick(continuing=True)
                return
            due = self.faults.next_due() if self.faults is not None else None
        when = time.monotonic() + IDLE_CHECK
        self._wake_later(min(when, due) if due is not None else when)

    def _step(self) -> None:
        if self._abort:
            raise _Fenced("link aborted")
        if self._lost is not None:
            raise _Fenced(self._lost)
        if self.faults is not None:
            self.faults.wait_if_paused()
            for frame in self.faults.due_late():
                self._write_pieces(frame)
        with self._cond:
            job = self._queue.popleft() if self._queue else None
            finish = job is None and self._closing
            small = self._leaves_with_next(job)
            behind = self._queue.popleft() if small is not None else None
        if finish:
            self._end("closed")
            return
        if behind is not None:
            self._send_small_with_ordered(job, behind, small)
            return
        if job is None:  # the idle look
            self.idle_looks += 1
            self._check_reader()
            now = time.monotonic()
            if self._reader_pid is not None and now >= self._next_pid_check:
                self._next_pid_check = now + LIVENESS_AFTER
                if not _pid_alive(self._reader_pid):
                    raise _Fenced(f"the receiver's process {self._reader_pid} exited")
            return
        if isinstance(job, WriteJob):
            self._send_batch(job)
        elif isinstance(job, OrderedJob):
            self._write_pieces([self._ordered_frame(job)])
        else:
            self._write_pieces(job.frame)
        self.frames_sent += 1

    def _leaves_with_next(self, job: Any) -> SmallWire | None:
        """Under ``_cond``: the prepared WRITE frame of ``job`` when it is a small batch of one frame with
        the ordered job (its DONE) queued behind it, so that a lane sends both in one step as the posting
        thread does (:meth:`_send_small_with_ordered`); None: each job is its own step."""
        if (self.faults is not None or _native() is None or not self._queue
                or not isinstance(self._queue[0], OrderedJob) or not isinstance(job, WriteJob)):
            return None
        small = self._small(job)
        if not isinstance(small, SmallWire) or self._small_bytes(small) > self.ring.size // 2:
            return None
        return small

    def _send_small_with_ordered(self, job: WriteJob, ordered: OrderedJob, small: SmallWire) -> None:
        """A lane's step for a small request: its one WRITE frame copied into the ring in C (waiting for
        room), then the DONE behind it with its checksum combined in C from the sums that copy took
        (:meth:`_filled_done`), where the posting thread would have sent them itself had the link been idle
        (or inline sends off). A batch dropped meanwhile: the ordered message goes alone."""
        batch = job.batch
        if not batch.wait_sources():
            job.on_complete(batch, 0, len(batch))
            self._write_pieces([self._ordered_frame(ordered)])
            self.frames_sent += 1
            return
        try:
            self._check_reader()
            self._wait_free(len(small.prefix))  # the payload's copy waits for room itself
            self._put_small(batch, small)
        except BaseException:
            job.on_complete(batch, 0, len(batch))
            raise
        job.on_complete(batch, len(batch), 0)
        self.frames_sent += 1
        trailer = self._filled_done(batch, small, ordered)
        self._write_pieces([trailer if trailer is not None else self._ordered_frame(ordered)])
        self.frames_sent += 1
        self.sent_with_ordered += 1

    def _send_batch(self, job: WriteJob) -> None:
        if not job.batch.wait_sources():  # cancelled, or its ready event failed: nothing of it is sent
            job.on_complete(job.batch, 0, len(job.batch))
            return
        cuts = cut_frames(job.batch, self.layout.item_lens, self.frame_limit, FRAME_MAX_RUNS)
        self._send_batch_frames(job, cuts, lambda batch, cut, last: self._send_frame(batch, cut, last=last))

    def _send_wire(self, batch: WriteBatch, wire: SmallWire) -> None:
        """A small batch's prepared WRITE frame: its header and run table copied in, its payload copied
        (and its items summed) in C, the whole frame published at once."""
        ring = self.ring
        at = self._producer
        ring.write(at, memoryview(wire.prefix))
        summed = self._sum_fn is not None and batch.sums_ready is None
        addresses, lengths, units = wire.payload
        self._copy_in(batch, addresses, lengths, units if summed else lengths, summed, at + len(wire.prefix),
                      wire.nbytes, True)

    def _copy_in(self, batch: WriteBatch, addresses: bytes, lengths: bytes, items: bytes, summed: bool, position: int,
                 nbytes: int, last: bool) -> None:
        """``ring_copy`` of a frame's payload from the sources into the ring at ``position``, published as
        it goes (with everything before it); the item checksums it took kept for the batch's DONE."""
        ring = self.ring
        base = ring.base
        rc, raw = _native().ring_copy(addresses, lengths, items, self._sum_fn if summed else -1, self._sum_initial,
                                      SUM_CHUNK, ring.data, ring.size, position, 0, base + W_CONSUMER, base + W_PRODUCER,
                                      base + W_READER_STATE, READER_FENCED, int(self._abort_word.ctypes.data), 1,
                                      self._reader_pid or 0, base + W_WRITER_WANT, base + W_READER_WANT)
        if rc == 1:
            raise _Fenced("the receiver fenced or closed the connection")
        if rc == 2:
            raise _Fenced("link aborted")
        if rc == 3:
            raise _Fenced(f"the receiver's process {self._reader_pid} exited")
        self._producer = position + nbytes  # ring_copy published it
        if raw is not None:
            self._keep_sums(batch, np.frombuffer(raw, dtype=np.uint32), last)
        self.bytes_sent += nbytes

    def _send_frame(self, batch: WriteBatch, cut: FrameCut, *, last: bool) -> None:
        buffers, size = cut.buffers, cut.nbytes
        header = f.write_header(batch.slot, batch.gen, len(cut.lengths), size)
        runs = f.pack_runs(buffers, cut.dst_offsets, cut.lengths)
        if self.faults is None and _native() is not None:  # streamed: published piece by piece as it is copied
            self._write_pieces([header, runs])
            lengths = cut.lengths.astype(np.uint64)
            src = self._src_base[buffers] + cut.src_offsets.astype(np.uint64)
            summed = self._sum_fn is not None and batch.sums_ready is None
            items = cut.units.astype(np.uint64) if summed else lengths
            self._copy_in(batch, src.tobytes(), lengths.tobytes(), items.tobytes(), summed, self._producer, size, last)
            return
        payload: list[Any] = [self._src[b][o : o + n]
                              for b, o, n in zip(buffers.tolist(), cut.src_offsets.tolist(), cut.lengths.tolist())]
        if self.faults is not None:
            self._send_with_faults(batch, header, runs, payload, self._write_pieces)
        else:
            self._write_pieces([header, runs, *payload])
        self.bytes_sent += size

    def _release_ring(self) -> None:
        if self._unmapped:
            return
        self._stop_watcher()  # a RESULT that came ahead of the end still counts
        with self._read_lock:
            self._unmapped = True
            try:
                self.ring.set_state(W_WRITER_STATE, WRITER_CLOSED)
            finally:
                self.ring.close()

    def _end(self, reason: str) -> None:
        """The link ends (on the lane serving it), once: queued writes fail, the ring is released."""
        if self._ended.is_set():
            return
        self._fail_queued()
        self._release_ring()  # the producer position is final before CLOSED is stored
        with self._cond:
            self._ended.set()
        self._report_closed(reason)

    def close(self, *, flush: bool = True) -> None:
        """Stop the link. With ``flush`` queued frames are put into the ring first (for up to 10 s);
        without, a link not ended within half a second is aborted (a writer waiting for room the reader
        never makes); idempotent."""
        self._begin_close(flush)
        if self._serving is threading.current_thread():
            return  # called back from this link's own step (on_closed): it ends when the step returns
        if not self._ended.wait(10 if flush else 0.5):  # waiting for room the reader never makes: give up
            self._abort = True
            self._abort_word[0] = 1
            self._ended.wait(5)

    def abort_connection(self) -> None:
        """Drop the connection at once (a crashed writer): nothing more is put into the ring."""
        self._abort = True
        self._abort_word[0] = 1
        with self._cond:
            self._kick()


class ShmTransport(SenderTransport):
    """The prefill side: maps the ring an OFFER names and opens one :class:`ShmLink` on it."""

    name = "shm"
    capabilities = CAPABILITIES

    def __init__(self, layout: KVLayout, *, checksum: Any = None, options: ShmOptions | None = None) -> None:
        _check_cpu(layout)
        self.layout = layout
        self.checksum = checksum
        self.options = options or ShmOptions()
        self.lanes = SendLanes("shm", threads=self.options.send_threads, watch=False)

    def connect(self, request: LinkRequest) -> ShmLink:
        offer = decode_offer(request.blob)
        ring = _open_ring(offer["path"], offer["size"])
        pid = offer["pid"]
        try:
            connect = m.Connect(engine=request.engine, epoch=request.epoch, proof=request.proof)
            return ShmLink(self.layout, ring, connect=connect, on_closed=request.on_closed, faults=request.faults,
                           checksum=self.checksum, reader_pid=pid if 0 < pid < 1 << 31 and _pid_alive(pid) else None,
                           lanes=self.lanes, inline_send=self.options.inline_send, on_message=request.on_message)
        except BaseException:
            if not ring.mm.closed:
                ring.close()
            raise

    def close(self) -> None:
        self.lanes.close()


def _open_ring(path: str, size: int) -> _Ring:
    """Map the ring an OFFER names, after checking it is one: a fresh kvxfer ring of this user."""
    flags = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise TransportError(f"cannot open the shm ring {path}: {exc} (both engines need the same host and "
                             "shm directory)") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise TransportError(f"{path} is not a private ring file of this user")
        if st.st_size != HEADER_BYTES + size:
            raise TransportError(f"ring {path} holds {st.st_size} bytes, the OFFER says {HEADER_BYTES + size}")
        mm = mmap.mmap(fd, HEADER_BYTES + size)
    finally:
        os.close(fd)
    ring = _Ring(mm, size, path)
    try:
        if (ring.load(W_MAGIC) != MAGIC or ring.load(W_VERSION) != RING_VERSION or ring.load(W_SIZE) != size):
            raise TransportError(f"{path} does not hold a version {RING_VERSION} kvxfer ring of {size} bytes")
        if ring.load(W_WRITER_STATE) != WRITER_NEW or ring.load(W_PRODUCER) != 0:
            raise TransportError(f"ring {path} already has a writer")
        if ring.load(W_READER_STATE) != READER_OPEN:
            raise TransportError(f"ring {path} was fenced before the writer connected")
    except BaseException:
        ring.close()
        raise
    return ring


def _receiver(layout: KVLayout, guard: WriteGuard, config: Any, hooks: ReceiverHooks) -> ShmReceiver:
    return ShmReceiver(layout, guard, hooks=hooks, checksum=getattr(config, "checksum", None),
                       options=_options(config), max_ordered_body=getattr(config, "max_ordered_body", 2 << 20))


def _sender(layout: KVLayout, config: Any) -> ShmTransport:
    return ShmTransport(layout, checksum=getattr(config, "checksum", None), options=_options(config))


def _available() -> tuple[bool, str]:
    directory = os.environ.get("KVXFER_SHM_DIR") or ShmOptions().directory
    if not _boot_id():
        return False, "no /proc/sys/kernel/random/boot_id (shm needs Linux)"
    if not os.path.isdir(directory) or not os.access(directory, os.W_OK | os.X_OK):
        return False, f"{directory} is not a writable directory (set KVXFER_SHM_DIR)"
    return True, ""


TRANSPORT = TransportFactory(
    name="shm",
    summary="one-sided writes through a shared-memory ring (prefill and decode on one host; no socket in the data path)",
    capabilities=CAPABILITIES,
    receiver=_receiver,
    sender=_sender,
    options=ShmOptions,
    available=_available,
)

__all__ = ["ShmLink", "ShmReceiver", "ShmTransport", "TRANSPORT", "decode_offer", "encode_offer", "reap_stale_rings"]
