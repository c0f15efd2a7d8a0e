"""The software transport: one-sided, tagged writes over TCP, for machines without RDMA.

The receiving side behaves like a NIC: a thread per connection reads frames and lands WRITE
payloads straight into the destination pages with ``recv_into`` (no intermediate copy), consulting
only the :class:`~kvxfer.core.writeguard.WriteGuard` (the software rkey), never the decode engine's logic.
A refused write's payload is read into a small scratch buffer and dropped. ORDERED frames (DONE,
DRAIN_ACK, REJECT, ABORT) are handed to the engine only after every earlier frame on the connection
was processed, which is what makes them drain proofs.

Anyone who reaches the data port can connect, so until its CONNECT is accepted a connection costs
a few bytes and no thread: one accept thread takes connections and reads every pending CONNECT
through one selector, closes connections beyond ``max_connections`` (pending and live together) at
once and those without a complete CONNECT after ``connect_timeout``, and checks every announced
body length (CONNECT: :data:`CONNECT_BODY_MAX`; ORDERED: ``max_ordered_body``) before allocating it.
accept() failing for want of descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM) is retried with
exponential backoff and reported (``on_event("accept_error")``); only :meth:`TcpReceiver.close` ends
the accept thread.

The sending side (:class:`TcpLink`) turns write batches into frames (gather ``sendmsg`` from the
source pages) and reports completions; a batch whose request was aborted before its turn is dropped
unsent and reported complete-but-failed. Links have no thread of their own: the transport's
:class:`~kvxfer.transport.lanes.SendLanes` (``send_threads`` of them, 8 by default) serve every link a
step at a time, and its watcher ends a link whose receiver closed its end as soon as that happens.
A small request (one frame with the DONE behind it) posted on an idle link is the exception
(``inline_send``, :meth:`TcpLink.unhold`): the posting thread claims the link as a lane would and hands
the kernel what it takes without waiting (``send_runs_nowait``); a sending lane sends the rest, a copy,
before anything posted after it. A fault injector with nothing to do (:meth:`FaultInjector.idle`, the
test suites' engines) leaves that path open; one that would act on the frame sends from a lane.

Frames carry at most :func:`frame_limit` payload bytes (the size of a staging buffer: 32 MiB, or one
item when an item is larger; both ends compute it from their compatible layouts), whatever the
length of the runs: a longer run is split at item boundaries into several runs (frames). A staging
receiver refuses a frame announcing more than its staging buffer before reading any of it.

Fencing a connection (:meth:`TcpReceiver.fence`) shuts the socket down and joins its thread, so when
it returns nothing more from that connection can land anywhere.

Invariants: a connection's first frame is CONNECT and binds it to a peer and epoch; a protocol
error ends the connection (the byte stream is out of sync); every connection that ends is reported
exactly once, either to the fencer (return value) or through ``on_closed``.
"""

from __future__ import annotations

import ctypes
import enum
import errno
import fcntl
import logging
import selectors
import socket
import termios
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from ..core import native
from ..core.arguments import split_host_port
from ..core.layout import KVLayout
from ..core.runs import RUN_DTYPE, FrameCut, WriteBatch, cut_frames
from ..core.writeguard import WriteGuard
from ..errors import InvalidArgument, KvxferError, ProtocolError, TransportError, WriteRefused
from ..wire import frames as f
from ..wire import messages as m
from .base import (
    Capabilities,
    LinkRequest,
    ReceiverBackend,
    ReceiverHooks,
    SenderTransport,
    TransportFactory,
)
from .faults import FaultInjector
from .framed import FrameLink, OrderedJob, RawJob, SmallWire, WriteJob
from .lanes import DEFAULT_THREADS, SendLanes
from .options import TcpOptions
from .staging import Staging, copy_engine, packed_offsets

log = logging.getLogger("kvxfer.tcp")

FRAME_MAX_RUNS = 512  # whole-page runs: 2 MiB frames of 4 KiB pages (one kernel hand-off each)
# a head slice's runs are small pieces (one token's heads of a page): frames of this many runs, which
# carried 0.49-0.51x of equal TP's rate in the 2:1 bench against 0.33-0.43x with 512 (4 paired runs)
SLICE_FRAME_MAX_RUNS = f.MAX_RUNS
# the checked path lands and sends in the groups native recv_runs and send_runs use (RECV_GROUP and
# SEND_GROUP, chosen by measurement in native/kvxfer_native.c): it checksums each group right after
# it landed, or right after the kernel copied it, while it is still in cache
SUM_CHUNK = getattr(native.lib, "RECV_GROUP", 64 << 10)
SEND_SUM_CHUNK = getattr(native.lib, "SEND_GROUP", 1 << 20)
# a batch of several frames goes in C calls of this many frames (the GIL released through each; a
# cancelled batch stops between calls): 8 frames of 512 runs are 16 MiB of 4 KiB pages
FRAMES_PER_CALL = 8
FRAME_MAX_BYTES = 32 << 20  # payload of one frame (and size of each staging buffer), unless an item is larger
# a write batch at most this large, with an ordered message (its DONE) queued right behind it, leaves
# as one WRITE frame with that message's frame right behind it: its item checksums are taken after the
# WRITE frame went (while the receiver lands it) instead of during the send
WITH_ORDERED_MAX_BYTES = 256 << 10
WITH_ORDERED_MAX_RUNS = 256
_SCRATCH = 64 << 10  # a refused write's payload is read through this, made on a connection's first refusal
CONNECT_BODY_MAX = f.CONNECT_BODY_MAX
ACCEPT_BACKOFF_MIN = 0.01  # after accept() fails (no descriptors, no memory): retry after this, doubling
ACCEPT_BACKOFF_MAX = 1.0
# accept() errors that belong to the one connection being taken (accept(2), Linux): take the next
_ACCEPT_TRANSIENT = frozenset(getattr(errno, name) for name in (
    "ECONNABORTED", "EPROTO", "EINTR", "EPERM", "ENETDOWN", "ENOPROTOOPT", "EHOSTDOWN", "ENONET", "EHOSTUNREACH",
    "EOPNOTSUPP", "ENETUNREACH") if hasattr(errno, name))


def frame_limit(layout: KVLayout) -> int:
    """The most payload bytes one WRITE frame carries, and the size of each staging buffer:
    :data:`FRAME_MAX_BYTES`, or one item when an item of the layout is larger (a frame holds at least
    one whole item). Sender and receiver compute the same value from their compatible layouts."""
    largest = int(layout.item_lens.max()) if layout.num_buffers else 0
    return max(FRAME_MAX_BYTES, largest)


def parse_address(address: Any) -> tuple[str, int]:
    """A data address (``host:port``, an IPv6 host bare or in brackets) as ``(host, port)``, by the
    strict rules of :func:`~kvxfer.core.arguments.split_host_port` (ASCII digits only, port in 1..65535):
    it arrives from the peer in OFFER, so anything else is a TransportError naming it, never a
    ValueError or a connection to somewhere else."""
    try:
        return split_host_port(address, "tcp address")
    except InvalidArgument as exc:
        raise TransportError(exc.detail) from None


_TCP_CORK = getattr(socket, "TCP_CORK", None)  # Linux: hold partial segments until uncorked (at most 200 ms)


# A data connection whose peer went silent (a partition, a host gone) fails by itself instead of sitting
# in TCP's retransmission backoff, where a blocked send holds a sending lane for up to 15 minutes: data
# unacknowledged for UNACKED_MAX_S fails it (TCP_USER_TIMEOUT), and an idle one is probed (keepalive) from
# KEEPALIVE_IDLE_S of silence and dropped KEEPALIVE_PROBES x KEEPALIVE_INTERVAL_S later.
UNACKED_MAX_S = 10
CUT_AFTER_S = 0.5  # close(flush=False): a link not ended by then has its socket shut down
KEEPALIVE_IDLE_S = 5
KEEPALIVE_INTERVAL_S = 1
KEEPALIVE_PROBES = 5


def _tune(sock: socket.socket) -> None:
    """No delayed small frames; socket buffers left to the kernel's autotuning, which grows them past
    what SO_SNDBUF/SO_RCVBUF may set (net.core.*mem_max) and is disabled once they are set; liveness
    bounds (:data:`UNACKED_MAX_S`, keepalive) where the platform has them."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_USER_TIMEOUT", UNACKED_MAX_S * 1000), ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
                        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S), ("TCP_KEEPCNT", KEEPALIVE_PROBES)):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


ANSWER_BACKLOG = 64 << 10  # RESULT bytes a writer may leave unread before answers go on the control plane


def _send_queue_bytes(sock: socket.socket) -> int:
    """Bytes in ``sock``'s send queue not yet taken by the peer (Linux SIOCOUTQ; 0 where unknown)."""
    try:
        raw = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except OSError:
        return 0
    return int.from_bytes(raw, "little", signed=True)


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock`` or raise ConnectionError on EOF."""
    got = 0
    total = len(view)
    while got < total:
        n = sock.recv_into(view[got:], total - got)
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n


# the C reader of frame heads, where the built extension knows this protocol's DONE frame
_C_FRAME_HEAD = f.native_reader("recv_frame_head")
# lands a WRITE frame's payload from its run table in C (no address arrays built per frame)
_C_RUN_TABLE_RECV = native.lib.recv_run_table if native.provides("recv_run_table") else None
_C_SEND_SUMMED_DONE = native.lib.send_summed_done if native.provides("send_summed_done") else None
_C_SEND_FRAMES = native.lib.send_frames if native.provides("send_frames") else None


def recv_frame_head(sock: socket.socket, max_ordered: int = 0, busy_poll_ns: int = 0,
                    poll_counts: int = 0) -> tuple[f.FrameHeader, Any]:
    """One frame's header from ``sock`` and, for a WRITE frame, its run table (an array), for a DONE frame
    its DONE (a :class:`~kvxfer.wire.messages.Done`), for an ORDERED frame of at most ``max_ordered`` body
    bytes its body (bytes), read and checked in C
    (``recv_frame_head`` in native/kvxfer_native.c, the twin of :func:`~kvxfer.wire.frames.parse_header`,
    :func:`~kvxfer.wire.frames.parse_runs` and :func:`~kvxfer.wire.frames.parse_done`); other bodies stay in the socket (None). A frame C refuses
    is parsed by the Python rules, which raise the ProtocolError naming the rule. ``busy_poll_ns``: poll
    the socket that long before sleeping in the read (``busy_poll``; ``poll_counts``: the address of its
    three uint64 counters, or 0)."""
    # (an extension built before busy polling takes no such arguments, and is never asked to poll)
    polling = (busy_poll_ns, poll_counts) if busy_poll_ns else ()
    return f.native_head(_C_FRAME_HEAD(sock.fileno(), *f.NATIVE_LIMITS, max_ordered, *polling))


def send_all(sock: socket.socket, pieces: list[Any]) -> None:
    """Gather-send every piece (bytes / memoryviews), handling partial sends."""
    views = [memoryview(p).cast("B") for p in pieces]
    index = 0
    while index < len(views):
        batch = views[index : index + 1000]
        sent = sock.sendmsg(batch)
        while sent > 0 and index < len(views):
            size = len(views[index])
            if sent >= size:
                sent -= size
                index += 1
            else:
                views[index] = views[index][sent:]
                sent = 0


# receiving side -------------------------------------------------------------------------------------


class _ConnState(enum.Enum):
    HANDSHAKE = "handshake"  # accepted, CONNECT not complete yet: held by the accept thread, no thread of its own
    OPEN = "open"
    FENCING = "fencing"
    CLOSED = "closed"


@dataclass(eq=False)
class _Inbound:
    sock: socket.socket
    conn_id: Any = None
    thread: threading.Thread | None = None
    state: _ConnState = _ConnState.HANDSHAKE
    deadline: float = 0.0  # HANDSHAKE: CONNECT must be complete by then (monotonic)
    header: f.FrameHeader | None = None  # HANDSHAKE: the CONNECT header, once all of it arrived
    got: bytearray = field(default_factory=bytearray)  # HANDSHAKE: bytes of the header or body so far
    scratch: memoryview | None = None  # OPEN: refused payloads are read through it (made on first refusal)
    send_lock: threading.Lock = field(default_factory=threading.Lock)  # RESULT frames sent back (answer)
    tail: bytes = b""  # the rest of a RESULT frame the kernel took only part of (sent first, by flush)
    # RESULT bytes that may still be unacknowledged: the send queue as last looked at (SIOCOUTQ) plus what
    # was sent since. It only overstates (the queue shrinks by itself), so the kernel is asked only when
    # it could pass ANSWER_BACKLOG (under send_lock)
    unacked_at_most: int = 0


_LISTENER = object()  # selector keys of the accept thread that are not connections
_WAKE = object()


CAPABILITIES = Capabilities(raw_frames=True)


def encode_offer(address: str) -> bytes:
    """OFFER blob of the tcp transport: the receiver's data address."""
    return msgpack.packb({"v": 1, "addr": address}, use_bin_type=True)


def decode_offer(blob: bytes) -> str:
    """The data address in a tcp OFFER blob; ProtocolError for anything else."""
    try:
        data = msgpack.unpackb(blob, raw=False)
    except Exception as exc:
        raise ProtocolError(f"tcp OFFER blob is not msgpack: {exc}") from None
    if not isinstance(data, dict) or data.get("v") != 1 or not isinstance(data.get("addr"), str):
        raise ProtocolError("tcp OFFER blob must be {v: 1, addr: 'host:port'}")
    parse_address(data["addr"])
    return data["addr"]


class TcpReceiver(ReceiverBackend):
    """Accepts writers' data connections and lands their writes through the write guard.

    One accept thread takes connections and reads their CONNECT frames (non-blocking, all of them
    through one selector); only a connection the engine accepted gets a landing thread."""

    name = "tcp"
    capabilities = CAPABILITIES

    def __init__(
        self,
        layout: KVLayout,
        guard: WriteGuard,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise: str | None = None,
        on_connect: Callable[[m.Connect], Any],
        on_ordered: Callable[[Any, m.Message], None],
        on_closed: Callable[[Any, str], None],
        on_event: Callable[..., None] | None = None,
        checksum: Any = None,
        staging: str | None = None,
        max_connections: int = 256,
        connect_timeout: float = 5.0,
        max_ordered_body: int = 2 << 20,
        answer_on_data: bool = True,
        busy_poll_us: int = 0,
    ) -> None:
        from ..core.checksum import ChecksumAlgo, native_id

        # the landing threads poll their socket this long before sleeping for the next frame (C only);
        # what came of it: [data found while polling, polling ran out, another thread was polling]
        self._busy_poll_ns = busy_poll_us * 1000 if getattr(native.lib, "BUSY_POLLERS", 0) and _C_FRAME_HEAD else 0
        self._poll_counts = np.zeros(3, dtype=np.uint64)
        self._poll_counts_at = int(self._poll_counts.ctypes.data)

        # RESULT goes back on the connection its DONE came on (answer), not through the control plane
        self.answer_on_data = answer_on_data
        self.answers_sent = 0  # RESULT frames handed to a data connection
        self.answers_declined = 0  # ... left to the control plane: the writer was not reading them
        self.answers_split = 0  # ... of which the kernel took only part at once (the rest went on by flush)
        self.send_queue_looks = 0  # times an answer asked the kernel for a connection's unacknowledged bytes
        self._tails: set[_Inbound] = set()  # connections with part of a RESULT frame still to send

        self.layout = layout
        self.guard = guard
        self._staging_mode = staging
        self._stages = copy_engine(layout, staging) is not None  # GPU pages: land via pinned buffers
        self.frame_limit = frame_limit(layout)
        self.max_connections = max_connections
        self.connect_timeout = connect_timeout
        self.max_ordered_body = max_ordered_body
        algo = ChecksumAlgo.parse(checksum) if checksum is not None else ChecksumAlgo.NONE
        self._sum_fn = native_id(algo)
        self._sum_initial = algo.initial if self._sum_fn is not None else 0
        self._on_connect = on_connect
        self._on_ordered = on_ordered
        self._on_closed = on_closed
        self._on_event = on_event
        self._dst = ([memoryview(layout.flat_view(b)) for b in range(layout.num_buffers)]
                     if layout.device == "cpu" else [])
        self._dst_base = np.array([spec.address for spec in layout.buffers], dtype=np.uint64)
        # what recv_run_table needs to land a frame from its run table: each buffer's base and item length
        self._dst_bases = self._dst_base.tobytes()
        self._item_lens = np.ascontiguousarray(layout.item_lens, dtype=np.int64).tobytes()
        bind = host.strip("[]") if host not in ("", "*") else "0.0.0.0"
        family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        # "::" binds every interface: IPv4 writers too, as the control plane's dual-stack socket takes them
        self._listener = socket.create_server((bind, port), backlog=64, family=family,
                                              dualstack_ipv6=bind == "::" and socket.has_dualstack_ipv6())
        self._listener.setblocking(False)
        shown = advertise or host  # what writers connect to (kvxfer.wire.addresses): never a wildcard
        port = self._listener.getsockname()[1]
        self.address = f"[{shown}]:{port}" if ":" in shown and not shown.startswith("[") else f"{shown}:{port}"
        self._lock = threading.Lock()
        self._conns: dict[Any, _Inbound] = {}
        self._pending: set[_Inbound] = set()  # HANDSHAKE connections (the accept thread's)
        self._deadlines: deque[_Inbound] = deque()  # the same, by deadline (they all wait connect_timeout)
        self._closed = False
        self.protocol_errors = 0
        self.frames = 0
        self.done_frames = 0  # DONEs that came in the binary DONE frame (the rest came as ORDERED msgpack)
        self.payload_seconds = 0.0  # time inside the payload copy (recv into destination pages)
        self.busy_seconds = 0.0  # time handling frames, from header arrival to done
        self.connections_refused = 0  # closed at accept: max_connections held already
        self.connect_timeouts = 0  # closed without a complete CONNECT within connect_timeout
        self.accept_errors = 0  # accept() failures (out of descriptors or memory), retried with backoff
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        self._selector.register(self._listener, selectors.EVENT_READ, _LISTENER)
        self._accept_thread = threading.Thread(target=self._accept_loop, name="kvxfer-tcp-accept", daemon=True)
        self._accept_thread.start()

    # the accept thread: accepting, and every connection until its CONNECT is handled -------------------
    def _accept_loop(self) -> None:
        backoff = 0.0
        resume_at: float | None = None  # backing off after an accept error: the listener is not watched
        try:
            while not self._closed:
                try:
                    now = time.monotonic()
                    if resume_at is not None and now >= resume_at:
                        self._selector.register(self._listener, selectors.EVENT_READ, _LISTENER)
                        resume_at = None
                    wake = self._deadlines[0].deadline if self._deadlines else None
                    if resume_at is not None:
                        wake = resume_at if wake is None else min(wake, resume_at)
                    events = self._selector.select(None if wake is None else max(0.0, wake - now))
                    for key, _ in events:
                        if key.data is _WAKE:
                            self._drain_wake()
                        elif key.data is _LISTENER:
                            error = self._accept_ready()
                            if error is None:
                                backoff = 0.0
                                continue
                            backoff = min(max(2 * backoff, ACCEPT_BACKOFF_MIN), ACCEPT_BACKOFF_MAX)
                            self._selector.unregister(self._listener)
                            resume_at = time.monotonic() + backoff
                            self._accept_failed(error, backoff)
                        elif key.data.state is _ConnState.HANDSHAKE:
                            try:
                                self._handshake_step(key.data)
                            except Exception as exc:  # a bug: that connection ends, the others go on
                                log.exception("tcp receiver %s: handling a CONNECT", self.address)
                                self._drop(key.data, error=f"{type(exc).__name__}: {exc}")
                    self._expire(time.monotonic())
                except Exception:  # a bug here must not end the accepting for good: log it, go on
                    if self._closed:
                        break
                    log.exception("tcp receiver %s: accept loop", self.address)
                    time.sleep(ACCEPT_BACKOFF_MAX)
        finally:
            with self._lock:
                pending = list(self._pending)
                self._pending.clear()
            for inbound in pending:
                inbound.state = _ConnState.CLOSED
                _close_quietly(inbound.sock)
            self._deadlines.clear()
            self._selector.close()
            for sock in (self._listener, self._wake_r, self._wake_w):
                _close_quietly(sock)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(64):
                pass
        except OSError:
            pass

    def _accept_ready(self) -> OSError | None:
        """Take the connections waiting in the backlog; the error that stopped it, if one did."""
        for _ in range(64):
            try:
                sock, _addr = self._listener.accept()
            except BlockingIOError:
                return None
            except OSError as exc:
                if self._closed:
                    return None
                if exc.errno in _ACCEPT_TRANSIENT:
                    continue  # that one connection failed before it was taken; the next may not
                return exc
            self._admit(sock)
        return None

    def _accept_failed(self, exc: OSError, backoff: float) -> None:
        self.accept_errors += 1
        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        if self.accept_errors == 1 or backoff >= ACCEPT_BACKOFF_MAX:
            log.warning("tcp receiver %s: accept failed (%s: %s); retrying in %g s", self.address, name,
                        exc.strerror, backoff)
        self._event("accept_error", counter="accept_errors", error=name, detail=str(exc)[:200],
                    retry_s=round(backoff, 3))

    def _admit(self, sock: socket.socket) -> None:
        """A new connection: held until its CONNECT arrives, or closed at once beyond the cap."""
        with self._lock:
            held = len(self._pending) + len(self._conns)
            refuse = self._closed or held >= self.max_connections
            if not refuse:
                inbound = _Inbound(sock, deadline=time.monotonic() + self.connect_timeout)
                self._pending.add(inbound)
        if refuse:
            closing = self._closed
            if not closing:
                self.connections_refused += 1
            _close_quietly(sock)
            if not closing:
                self._event("data_connection_refused", counter="data_connections_refused", held=held,
                            max_data_connections=self.max_connections)
            return
        try:
            sock.setblocking(False)
            _tune(sock)
            self._selector.register(sock, selectors.EVENT_READ, inbound)
        except (OSError, ValueError):
            self._drop(inbound)
            return
        self._deadlines.append(inbound)

    def _drop(self, inbound: _Inbound, *, error: str | None = None, event: bool = True) -> None:
        """End a connection that never became one (no CONNECT handled): nothing to report to the engine.
        ``error``: a protocol error (counted; with ``event``, a rate-limited event line)."""
        with self._lock:
            if inbound.state is not _ConnState.HANDSHAKE:
                return  # handed to a landing thread (or already dropped)
            self._pending.discard(inbound)
            inbound.state = _ConnState.CLOSED
            if error is not None:
                self.protocol_errors += 1
        try:
            self._selector.unregister(inbound.sock)
        except (KeyError, ValueError):
            pass
        _close_quietly(inbound.sock)
        if error is not None and event:
            self._event("data_handshake_error", counter="data_handshake_errors", error=error[:300])

    def _expire(self, now: float) -> None:
        while self._deadlines:
            inbound = self._deadlines[0]
            if inbound.state is _ConnState.HANDSHAKE and inbound.deadline > now:
                return
            self._deadlines.popleft()
            if inbound.state is _ConnState.HANDSHAKE:
                self.connect_timeouts += 1
                got = len(inbound.got) + (f.HEADER_SIZE if inbound.header is not None else 0)
                self._drop(inbound)
                self._event("connect_timeout", counter="connect_timeouts", got_bytes=got,
                            connect_timeout=self.connect_timeout)

    def _handshake_step(self, inbound: _Inbound) -> None:
        """Read what arrived of a connection's CONNECT frame; handle it once complete."""
        header = inbound.header
        need = (f.HEADER_SIZE if header is None else header.body_len) - len(inbound.got)
        try:
            data = inbound.sock.recv(min(need, 65536))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(inbound)
            return
        if not data:
            self._drop(inbound)  # closed before CONNECT (a port probe, a writer that gave up)
            return
        inbound.got += data
        if len(data) < need:
            return
        try:
            if header is None:
                header = f.parse_header(inbound.got)
                if header.kind is not f.FrameKind.CONNECT:
                    raise ProtocolError(f"first frame must be CONNECT, got {header.kind.name}")
                if header.body_len > CONNECT_BODY_MAX:
                    raise ProtocolError(f"CONNECT frame body of {header.body_len} bytes "
                                        f"(a CONNECT is at most {CONNECT_BODY_MAX})")
                inbound.header = header
                inbound.got = bytearray()
                return
            hello = m.decode(bytes(inbound.got))
            if not isinstance(hello, m.Connect):
                raise ProtocolError(f"CONNECT frame carries {hello.TYPE}")
        except ProtocolError as exc:
            self._drop(inbound, error=str(exc))
            return
        self._connect(inbound, hello)

    def _connect(self, inbound: _Inbound, hello: m.Connect) -> None:
        """A complete CONNECT: ask the engine; an accepted connection gets its landing thread."""
        try:
            self._selector.unregister(inbound.sock)
        except (KeyError, ValueError):
            pass
        inbound.got = bytearray()
        try:
            conn_id = self._on_connect(hello)
        except Exception:  # the engine failed to decide: refuse
            log.exception("tcp receiver %s: CONNECT from %r", self.address, hello.engine)
            conn_id = None
        if conn_id is None:  # the engine counted and reported the refusal (unknown peer, wrong epoch or proof)
            self._drop(inbound, error=f"connection from {hello.engine!r} refused", event=False)
            return
        thread = threading.Thread(target=self._serve, args=(inbound,), name="kvxfer-tcp-recv", daemon=True)
        started = False
        with self._lock:  # close() either sees this connection with its thread started, or not at all
            self._pending.discard(inbound)
            if not self._closed:
                inbound.conn_id = conn_id
                inbound.thread = thread
                inbound.state = _ConnState.OPEN
                self._conns[conn_id] = inbound
                try:
                    inbound.sock.setblocking(True)
                    thread.start()
                    started = True
                except (OSError, RuntimeError) as exc:  # no thread to be had: the connection ends here
                    log.error("tcp receiver %s: cannot serve connection %s: %s", self.address, conn_id, exc)
                    del self._conns[conn_id]
            if not started:
                inbound.state = _ConnState.CLOSED
        if not started:
            _close_quietly(inbound.sock)
            self._on_closed(conn_id, "receiver closed" if self._closed else "no landing thread")

    def _event(self, kind: str, **fields: Any) -> None:
        if self._on_event is None:
            return
        try:
            self._on_event(kind, **fields)
        except Exception:  # pragma: no cover - reporting must never break the data path
            log.exception("tcp receiver %s: reporting %s", self.address, kind)

    # a landing thread per accepted connection ---------------------------------------------------------
    def _serve(self, inbound: _Inbound) -> None:
        sock = inbound.sock
        header_buf = bytearray(f.HEADER_SIZE)
        header_view = memoryview(header_buf)
        reason = "closed"
        staging = None
        try:
            if self._stages:
                staging = Staging(copy_engine(self.layout, self._staging_mode), self.frame_limit)
            in_c = _C_FRAME_HEAD is not None and staging is None
            while True:
                body = None
                if in_c:  # the header and a WRITE frame's run table or an ORDERED body, in one C call
                    header, body = recv_frame_head(sock, self.max_ordered_body, self._busy_poll_ns,
                                                   self._poll_counts_at)
                else:
                    recv_exact(sock, header_view)
                    header = f.parse_header(header_buf)
                t0 = time.perf_counter()
                if header.kind is f.FrameKind.WRITE:
                    self._land_write(sock, inbound, header, staging, body)
                    self.frames += 1
                    self.busy_seconds += time.perf_counter() - t0
                elif header.kind is f.FrameKind.ORDERED or header.kind is f.FrameKind.DONE:
                    # refused before allocating or reading it (a DONE frame's body, at most DONE_BODY_MAX
                    # bytes, was read with its header: the limit still holds)
                    if header.body_len > self.max_ordered_body:
                        raise ProtocolError(f"{header.kind.name} frame body of {header.body_len} bytes exceeds "
                                            f"max_ordered_body ({self.max_ordered_body})")
                    if body is None:
                        body = bytearray(header.body_len)
                        recv_exact(sock, memoryview(body))
                    msg = body if isinstance(body, m.Done) else f.ordered_message(header, body)
                    if header.kind is f.FrameKind.DONE:
                        self._count("done_frames")
                    if staging is not None:
                        staging.drain()  # every earlier write is in the pages before this is acted on
                    self._on_ordered(inbound.conn_id, msg)
                else:
                    raise ProtocolError(f"{header.kind.name} frame on an open connection (CONNECT comes once, "
                                        f"RESULT travels receiver -> writer only)")
        except ProtocolError as exc:
            self.protocol_errors += 1
            reason = f"protocol error: {exc}"
            log.warning("data connection %s: %s", inbound.conn_id, reason)
        except (ConnectionError, OSError) as exc:
            reason = f"connection lost: {exc}"
        finally:
            if staging is not None:
                try:
                    staging.close()  # nothing lands after the connection is reported closed
                except Exception as exc:  # a failing GPU copy: the connection is over either way
                    log.error("data connection %s: staging copies failed: %s", inbound.conn_id, exc)
            self._finish(inbound, reason)

    def _land_write(self, sock: socket.socket, inbound: _Inbound, header: f.FrameHeader,
                    staging: Staging | None = None, runs: np.ndarray | None = None) -> None:
        """Land a WRITE frame whose header was read (and its run table, when ``runs`` is given)."""
        conn_id = inbound.conn_id
        if staging is not None and header.payload_len > staging.capacity:
            # refused before reading anything more: landing it would overrun the staging buffer
            raise ProtocolError(f"WRITE frame of {header.payload_len} bytes exceeds the staging buffer "
                                f"({staging.capacity} bytes): a writer cuts frames to that size")
        if runs is None:
            body = bytearray(header.body_len)  # at most MAX_RUNS runs: parse_header checked it
            recv_exact(sock, memoryview(body))
            runs = f.parse_runs(header, body)
        try:
            window, counts = self.guard.check(conn_id, header.slot, header.generation, runs)
        except WriteRefused:
            if inbound.scratch is None:
                inbound.scratch = memoryview(bytearray(_SCRATCH))
            scratch = inbound.scratch
            remaining = header.payload_len
            while remaining:
                chunk = min(remaining, len(scratch))
                recv_exact(sock, scratch[:chunk])
                remaining -= chunk
            return
        t0 = time.perf_counter()
        summed = window.table is None  # a head slice's pieces are not whole items: summed at verification
        if staging is not None:
            sums = self._land_staged(sock, runs, header.payload_len, staging, summed)
            self.payload_seconds += time.perf_counter() - t0
            self.guard.record(window, runs, counts, sums)
            return
        sums = None
        if _C_RUN_TABLE_RECV is not None and runs.dtype == f.RUN_DTYPE and runs.flags.c_contiguous:
            algo = self._sum_fn if self._sum_fn is not None and summed else -1
            raw = _C_RUN_TABLE_RECV(sock.fileno(), runs, self._dst_bases, self._item_lens, self.layout.num_pages,
                                    algo, self._sum_initial, SUM_CHUNK)
            sums = None if raw is None else np.frombuffer(raw, dtype=np.uint32)
        elif native.lib is not None:
            sums = self._recv_runs_native(sock, runs, self._dst_base[runs["buffer"]] + runs["offset"], summed)
        else:
            for buffer, offset, length in zip(
                runs["buffer"].tolist(), runs["offset"].tolist(), runs["length"].tolist()
            ):
                recv_exact(sock, self._dst[buffer][offset : offset + length])
        self.payload_seconds += time.perf_counter() - t0
        self.guard.record(window, runs, counts, sums)

    def _land_staged(self, sock: socket.socket, runs: np.ndarray, payload_len: int, staging: Staging,
                     summed: bool = True) -> Any:
        """Receive a WRITE payload into a staging buffer, then copy its runs to the pages (async)."""
        buffer, base = staging.take()
        lengths = runs["length"].astype(np.uint64)
        sums = None
        if native.lib is not None:
            sums = self._recv_runs_native(sock, runs, np.uint64(base) + packed_offsets(lengths), summed)
        else:
            recv_exact(sock, memoryview(buffer)[:payload_len])
        destinations = self._dst_base[runs["buffer"]] + runs["offset"]
        staging.engine.scatter(destinations, base, lengths)
        staging.mark_pending()
        return sums

    def _recv_runs_native(self, sock: socket.socket, runs: np.ndarray, addresses: np.ndarray,
                          summed: bool = True) -> Any:
        """Receive the payload's runs at ``addresses`` in C; the item checksums when checksums are on
        (and ``summed``: the runs are whole items)."""
        lengths = runs["length"].astype(np.uint64)
        if self._sum_fn is None or not summed:
            native.lib.recv_runs(sock.fileno(), addresses.tobytes(), lengths.tobytes())
            return None
        items = self.layout.item_lens.astype(np.uint64)[runs["buffer"]]
        raw = native.lib.recv_runs_summed(sock.fileno(), addresses.tobytes(), lengths.tobytes(),
                                          items.tobytes(), self._sum_fn, self._sum_initial, SUM_CHUNK)
        return np.frombuffer(raw, dtype=np.uint32)

    def _finish(self, inbound: _Inbound, reason: str) -> None:
        with self._lock:
            self._pending.discard(inbound)
            self._tails.discard(inbound)
            fenced = inbound.state is _ConnState.FENCING
            inbound.state = _ConnState.CLOSED
            if inbound.conn_id is not None and self._conns.get(inbound.conn_id) is inbound:
                del self._conns[inbound.conn_id]
        with inbound.send_lock:  # no RESULT is being sent on it (its descriptor number may be reused)
            try:
                inbound.sock.close()
            except OSError:  # pragma: no cover
                pass
        if not fenced and inbound.conn_id is not None:
            self._on_closed(inbound.conn_id, reason)

    def offer(self, peer: str, session: bytes, epoch: int) -> bytes:
        """The writer connects to this receiver's one listening address; CONNECT names the epoch."""
        return encode_offer(self.address)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            live, pending = len(self._conns), len(self._pending)
        return {"protocol_errors": self.protocol_errors, "frames": self.frames,
                "payload_seconds": self.payload_seconds, "busy_seconds": self.busy_seconds,
                "live_connections": live, "pending_connections": pending,
                "connections_refused": self.connections_refused, "connect_timeouts": self.connect_timeouts,
                "answers_sent": self.answers_sent, "answers_declined": self.answers_declined,
                "answers_split": self.answers_split, "done_frames": self.done_frames,
                "send_queue_looks": self.send_queue_looks,
                "accept_errors": self.accept_errors, "busy_poll_found": int(self._poll_counts[0]),
                "busy_poll_expired": int(self._poll_counts[1]), "busy_poll_skipped": int(self._poll_counts[2])}

    def fence(self, conn_id: Any) -> bool:
        """Close ``conn_id`` and wait until its thread stopped: afterwards nothing from it lands.

        Returns True if this call closed a live connection (the caller settles its requests),
        False if it was already gone (``on_closed`` settled them)."""
        with self._lock:
            inbound = self._conns.get(conn_id)
            if inbound is None or inbound.state is not _ConnState.OPEN:
                return False
            inbound.state = _ConnState.FENCING
        try:
            inbound.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if inbound.thread is not None and inbound.thread is not threading.current_thread():
            inbound.thread.join()
        return True

    def connections(self) -> list[Any]:
        with self._lock:
            return list(self._conns)

    def answer(self, conn_id: Any, msg: m.Message) -> bool:
        """Send RESULT ``msg`` back on data connection ``conn_id`` without waiting (SPEC §3.0.1, RESULT
        frames): False, sending nothing, when the connection is not open, the frame would be too long,
        the rest of an earlier frame is still waiting, or more than :data:`ANSWER_BACKLOG` bytes sent
        on it are not yet acknowledged (the writer is not reading them); the caller then uses the control
        plane. A frame the kernel takes only in part is completed first, by :meth:`flush` (the control
        thread's tick) or the next answer, so frames never interleave."""
        if not self.answer_on_data:
            return False
        with self._lock:
            inbound = self._conns.get(conn_id)
            if inbound is None or inbound.state is not _ConnState.OPEN:
                return False
        try:
            frame = f.result_frame(msg)
        except ProtocolError:
            return False
        with inbound.send_lock:
            try:
                if inbound.tail and not self._send_tail(inbound):
                    self._count("answers_declined")
                    return False
                if inbound.unacked_at_most + len(frame) > ANSWER_BACKLOG:
                    inbound.unacked_at_most = _send_queue_bytes(inbound.sock)
                    self._count("send_queue_looks")
                    if inbound.unacked_at_most + len(frame) > ANSWER_BACKLOG:
                        self._count("answers_declined")
                        return False
                sent = inbound.sock.send(frame, socket.MSG_DONTWAIT)
                inbound.unacked_at_most += sent
            except (BlockingIOError, InterruptedError):
                self._count("answers_declined")
                return False
            except OSError:  # the connection is ending: its end is reported as usual
                return False
            if sent < len(frame):  # the rest goes before anything else on this connection
                inbound.tail = frame[sent:]
                with self._lock:
                    self._tails.add(inbound)
                    self.answers_split += 1
        self._count("answers_sent")
        return True

    def _send_tail(self, inbound: _Inbound) -> bool:
        """Under ``inbound.send_lock``: send what is left of a part-sent frame without waiting; True once
        none is left (a connection that failed has none: it ends, and its writer with it)."""
        try:
            sent = inbound.sock.send(inbound.tail, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            sent = len(inbound.tail)
        inbound.unacked_at_most += sent
        inbound.tail = inbound.tail[sent:]
        if not inbound.tail:
            with self._lock:
                self._tails.discard(inbound)
        return not inbound.tail

    def flush(self) -> None:
        with self._lock:
            waiting = list(self._tails)
        for inbound in waiting:
            if inbound.send_lock.acquire(blocking=False):  # an answer() under way sends it itself
                try:
                    if inbound.tail:
                        self._send_tail(inbound)
                finally:
                    inbound.send_lock.release()

    def _count(self, name: str) -> None:
        with self._lock:  # several threads answer at once (the data threads, the verifier)
            setattr(self, name, getattr(self, name) + 1)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._wake_w.send(b"x")  # the accept thread closes the listener and every connection without CONNECT
        except OSError:
            pass
        if self._accept_thread is not threading.current_thread():
            self._accept_thread.join(timeout=10)
        for conn_id in self.connections():  # no connection is added any more
            if self.fence(conn_id):
                self._on_closed(conn_id, "receiver closed")


class _Reported:
    """A write job's completion callback that remembers it was called (once is the rule)."""

    def __init__(self, job: WriteJob) -> None:
        self.job = job
        self.reported = False

    def __call__(self, batch: WriteBatch, ok: int, failed: int) -> None:
        self.reported = True
        self.job.on_complete(batch, ok, failed)


def _unsent(wire: SmallWire, sent: int) -> bytes:
    """The bytes of ``wire``'s WRITE frame (its prefix, then each run's pages) after the first ``sent``,
    copied out of the sources."""
    pieces, skip = [], sent
    if skip < len(wire.prefix):
        pieces.append(wire.prefix[skip:])
        skip = 0
    else:
        skip -= len(wire.prefix)
    for address, length in zip(np.frombuffer(wire.addresses, dtype=np.uint64).tolist(),
                               np.frombuffer(wire.lengths, dtype=np.uint64).tolist()):
        if skip >= length:
            skip -= length
            continue
        pieces.append(ctypes.string_at(address + skip, length - skip))
        skip = 0
    return b"".join(pieces)


def _close_quietly(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:  # pragma: no cover
        pass


# sending side ----------------------------------------------------------------------------------------


class TcpLink(FrameLink):
    """One data connection to one receiver, served by the transport's sending lanes (no thread of its own)."""

    def __init__(
        self,
        layout: KVLayout,
        address: str,
        *,
        connect: m.Connect,
        on_closed: Callable[[TcpLink, str], None],
        lanes: SendLanes,
        faults: FaultInjector | None = None,
        timeout: float = 10.0,
        checksum: Any = None,
        staging: str | None = None,
        inline_send: bool = True,
        on_message: Callable[[m.Message], None] | None = None,
    ) -> None:
        self._init_link((connect.engine, connect.epoch), on_closed, faults, checksum)
        # RESULT frames the receiver sends back on this connection (read by the lanes' watcher)
        self._on_message = on_message
        self._results = f.ResultReader()
        self.results_received = 0
        self._read_lock = threading.Lock()  # one reader of the socket at a time; held while it is closed
        # a small request (one batch that leaves with its DONE) posted on an idle link leaves from the
        # posting thread (unhold): no lane's wake-up, and no wait for the interpreter while the caller
        # goes on with Python work (a serving engine's scheduler)
        self.inline_send = inline_send
        self.layout = layout
        self.address = address
        self._init_lane(lanes)
        self._lost: str | None = None  # the receiver closed its end (the watcher saw it)
        self._corked = False  # TCP_CORK is set: the last job's partial segment waits for the next job's bytes
        self.sent_with_ordered = 0  # write batches that left with the ordered message right behind them
        self.ordered_rest = 0  # the caller's thread sent a WRITE frame whole and its ordered frame only in part
        self.done_filled = 0  # DONE frames whose checksum the C send filled in from the sums it took (send_summed_done)
        self.sent_prepared = 0  # ... of which prepared when the destination arrived (prepare)
        self.sent_inline = 0  # ... of which left from the posting thread (unhold), no lane involved
        self.inline_rest = 0  # ... of which the socket took only part at once: a lane sent the rest
        self.sent_early = 0  # WRITE frames sent by the posting thread as their batch was posted (_send_early)
        self.frames_in_c = 0  # WRITE frames of batches sent several to a C call (send_frames)
        self._early: tuple[WriteBatch, SmallWire] | None = None  # that batch, its DONE not yet sent (the link claimed)
        self._src = ([memoryview(layout.flat_view(b)) for b in range(layout.num_buffers)]
                     if layout.device == "cpu" else [])
        self._src_base = np.array([spec.address for spec in layout.buffers], dtype=np.uint64)
        self.frame_limit = frame_limit(layout)
        if self.frame_limit > f.MAX_PAYLOAD:
            raise TransportError(f"an item of {self.frame_limit} bytes is larger than a tcp frame may carry "
                                 f"({f.MAX_PAYLOAD} bytes)")
        engine = copy_engine(layout, staging)  # GPU pages: leave via pinned buffers
        self._staging = Staging(engine, self.frame_limit) if engine is not None else None
        host, port = parse_address(address)
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise TransportError(f"cannot open data connection to {address}: {exc}") from exc
        self._sock.settimeout(None)
        _tune(self._sock)
        send_all(self._sock, [f.message_frame(f.FrameKind.CONNECT, m.encode(connect))])
        lanes.watch(self._sock, self)

    # scheduling on the lanes ---------------------------------------------------------------------------------
    def wake(self) -> None:
        with self._cond:
            if self._queue or self._closing or (self.faults is not None and self.faults.next_due() is not None):
                self._kick()

    def peer_closed(self, reason: str) -> None:
        with self._cond:
            self._lost = reason
            self._kick()

    def readable(self) -> str | None:
        """On the lanes' watcher: read what the receiver sent without blocking and deliver each whole
        RESULT frame; why the link must end (the receiver closed its end, or sent anything but RESULT
        frames), or None."""
        with self._read_lock:
            why, results = self._read_once()
        self._deliver(results)  # outside the read lock: delivering takes the engine's
        return why

    def drain_messages(self) -> None:
        """Deliver every whole RESULT frame already in the socket (before the link's requests settle)."""
        while True:
            with self._read_lock:
                why, results = self._read_once()
            self._deliver(results)
            if why is not None or not results:
                return

    def _read_once(self) -> tuple[str | None, list[m.Message]]:
        """One non-blocking read (under ``_read_lock``): why the link must end, or None, and the whole
        RESULT frames read (the ones before a malformed frame included)."""
        if self._sock.fileno() < 0:
            return "the link is closed", []
        try:
            data = self._sock.recv(1 << 16, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return None, []
        except OSError as exc:
            return f"the receiver's end failed: {exc}", []
        if not data:
            return "the receiver closed the connection", []
        if self._on_message is None:
            return "the receiver sent bytes on a data connection that takes no RESULT frames", []
        results = self._results.feed(data)
        self.results_received += len(results)
        if self._results.error is not None:
            return f"the receiver sent a malformed frame: {self._results.error}", results
        return None, results

    def _deliver(self, results: list[m.Message]) -> None:
        for msg in results:
            try:
                self._on_message(msg)  # type: ignore[misc]
            except Exception:  # the engine reports its own failures; the connection is fine
                log.exception("data connection to %s: handling %s", self.address, msg.TYPE)

    def _may_claim(self) -> bool:
        """Under ``_cond``: the posting thread may take this link's next send itself (inline sends on, the
        link idle and open, no partial segment held back, no fault injection waiting)."""
        return (self.inline_send and not self._scheduled and not self._closing and self._lost is None
                and not self._corked and not self._ended.is_set()
                and (self.faults is None or self.faults.idle()))

    def _claimable(self, batch: WriteBatch) -> bool:
        """A batch the posting thread may send: not cancelled, no ready event to wait for, one small frame."""
        return not batch.cancelled and batch.ready is None and self._fits_one_send(batch)

    def _claim(self) -> None:
        """Under ``_cond``: the link marked scheduled and served by this thread (no lane serves it meanwhile)."""
        self._scheduled = True
        self._serving = threading.current_thread()

    def _claim_early(self, job: WriteJob) -> bool:
        """Under ``_cond``, ``job`` posted while the link is held (a send posting a chunk and then its DONE):
        whether the posting thread sends its WRITE frame now (:meth:`_send_early`), before the rest of the
        post (its DONE built and posted) is done, the link claimed until :meth:`unhold` sends the DONE. So
        the receiver wakes and lands the pages meanwhile. Only a small batch posted first on an idle link."""
        if self._queue or self._early is not None or not self._may_claim() or not self._claimable(job.batch):
            return False
        self._claim()
        return True

    def _claim_inline(self) -> tuple[Any, ...] | None:
        """Under ``_cond``, at the last unhold: what the posting thread sends itself now, for
        :meth:`_send_inline`: the queue's two jobs, taken as a lane would take them (the link claimed),
        when they are one whole small batch and the ordered message behind it on an idle link whose
        sources need no wait; when a batch's WRITE frame left at post time (:meth:`_send_early`), that
        batch with the ordered message queued alone behind it, or with None (anything else queued, or
        nothing: its item checksums are taken and the claim given back). None: nothing to send here (a
        step is scheduled if the link has anything to do)."""
        early, self._early = self._early, None
        if early is not None:
            self._serving = threading.current_thread()  # the last unhold may be another holder's thread
            if (len(self._queue) == 1 and isinstance(self._queue[0], OrderedJob) and not self._closing
                    and self._lost is None and (self.faults is None or self.faults.idle())):
                return None, self._queue.popleft(), early
            return None, None, early
        if len(self._queue) == 2 and self._may_claim():
            job, behind = self._queue
            if isinstance(job, WriteJob) and isinstance(behind, OrderedJob) and self._claimable(job.batch):
                self._claim()
                return self._queue.popleft(), self._queue.popleft()
        if not self._ended.is_set() and (self._queue or self._closing or self._lost is not None):
            self._kick()
        return None

    def _give_back(self, rest: bytes | None = None) -> None:
        """Under ``_cond``: the posting thread's claim ends; ``rest`` (bytes the socket did not take) goes
        first, and a step is scheduled if anything is left to do, unless a post still holds the link (its
        last unhold schedules it: a lane must not end the link in the middle of a post)."""
        self._serving = None
        self._scheduled = False
        if rest:
            self._queue.appendleft(RawJob([rest]))
        if not self._holding and not self._ended.is_set() and (self._queue or self._closing or self._lost is not None):
            self._kick()

    def _sending_failed(self, exc: Exception) -> None:
        """Under ``_cond``: a send from the posting thread failed; the link ends on a lane with this reason,
        as a lane's own failure would end it."""
        reason = (f"connection lost: {exc}" if isinstance(exc, OSError)
                  else f"sending failed: {type(exc).__name__}: {exc}")
        if not isinstance(exc, OSError):
            log.error("data connection to %s: %s", self.address, reason)
        self._lost = self._lost or reason

    def _send_early(self, job: WriteJob) -> None:
        """The posting thread, the link claimed (:meth:`_claim_early`): ``job``'s WRITE frame leaves now,
        without waiting for the socket, and the batch is reported sent; the claim is kept for the ordered
        message the post queues behind it (:meth:`_claim_inline`). What the socket did not take is copied
        and left to a lane, first in the queue (the claim given back; the DONE then goes from a lane and is
        built as its own step builds it). A batch that cannot go (cancelled meanwhile, or the send failed)
        goes back to the head of the queue unreported: a lane reports it when it serves or ends the link,
        after the post, never in its middle (the request's other legs are being posted)."""
        batch = job.batch
        try:
            if not batch.wait_sources():
                with self._cond:
                    self._queue.appendleft(job)
                    self._give_back()
                return
            wire = self._prepared_wire(batch)
            rest = self._send_write(wire, wait=False)
        except Exception as exc:
            with self._cond:
                self._sending_failed(exc)
                self._queue.appendleft(job)
                self._give_back()
            return
        self.frames_sent += 1
        self.bytes_sent += wire.nbytes
        self.sent_early += 1
        if rest:
            self.inline_rest += 1
        job.on_complete(batch, len(batch), 0)
        with self._cond:
            if not rest and self._holding:  # the post goes on: its last unhold takes the claim back
                self._early = (batch, wire)
                return
        if not rest:
            self._keep_item_sums(batch, wire)  # posted without a hold of its own (nothing more is coming)
        with self._cond:
            self._give_back(rest)

    def _keep_item_sums(self, batch: WriteBatch, wire: SmallWire) -> None:
        """The item checksums of a small batch whose WRITE frame left, kept for its DONE (built now behind
        it, or later: a chunk of a request sent in several), as a lane keeps them while sending."""
        if self._sum_fn is not None and batch.sums_ready is None and not batch.sums_done:
            raw = native.lib.checksum_items(self._sum_fn, self._sum_initial, *wire.payload)
            self._keep_sums(batch, np.frombuffer(raw, dtype=np.uint32), True)

    def _send_inline(self, job: WriteJob | None, ordered: OrderedJob | None,
                     early: tuple[WriteBatch, SmallWire] | None = None) -> None:
        """Send what :meth:`_claim_inline` claimed from the posting thread, never waiting for the socket: a
        small batch's WRITE frame and the ordered message behind it, or (``early``: its WRITE frame left at
        post time) the ordered message alone, or nothing (``ordered`` None: the early batch's checksums are
        kept). What the socket does not take at once (its buffer is full) is copied and left to a lane,
        first in the queue. A failing socket ends the link on a lane, as a lane's own failure would."""
        rest: bytes | None = None
        watched = _Reported(job) if job is not None else None
        try:
            if early is not None:
                batch, wire = early
                if ordered is None:
                    self._keep_item_sums(batch, wire)
                else:
                    rest = self._send_behind(batch, wire, ordered, b"", wait=False)
                    self.frames_sent += 1
                    self.sent_with_ordered += 1
                    self.sent_inline += 1
            elif job is not None and ordered is not None:
                rest = self._send_batch_with_ordered(WriteJob(job.batch, watched), ordered, wait=False)
                self.frames_sent += 2  # the WRITE frame and the ordered one, as a lane counts them
                self.sent_inline += 1
            if rest:
                self.inline_rest += 1
        except Exception as exc:
            if watched is not None and job is not None and not watched.reported:  # its writes failed
                job.on_complete(job.batch, 0, len(job.batch))
            with self._cond:
                self._sending_failed(exc)
        finally:
            with self._cond:
                self._give_back(rest)

    def serve_step(self) -> None:
        """One step on a lane: the next job, the end of a closing link with nothing queued, or (fault
        injection) the late frames that fell due; then back on the ready queue if there is more."""
        self._serving = threading.current_thread()
        try:
            self._step()
        except OSError as exc:
            self._end(f"connection lost: {exc}")
        except KvxferError as exc:  # a failing staging copy (GPU): the connection cannot go on
            reason = f"staging failed: {exc}"
            log.error("data connection to %s: %s", self.address, reason)
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
            if self._queue or self._closing or self._lost:
                self._kick(continuing=True)
                return
            due = self.faults.next_due() if self.faults is not None else None
        if due is not None:
            self._wake_later(due)

    def _step(self) -> None:
        if self._lost is not None:
            self._end(self._lost)
            return
        if self.faults is not None:
            self.faults.wait_if_paused()
            for frame in self.faults.due_late():
                send_all(self._sock, frame)
        with self._cond:
            job = self._queue.popleft() if self._queue else None
            finish = job is None and self._closing
            behind = self._queue.popleft() if self._queue and self._leaves_with_next(job) else None
            more = bool(self._queue)
        if finish:
            self._end("closed")
            return
        if job is None:
            return
        # With more queued behind this job (a request's DONE behind its writes), hold its last partial
        # segment until the next job's bytes join it: one transmission and one wake-up of the
        # receiver instead of two. Released as soon as a job leaves with nothing behind it.
        cork = more and self.faults is None and _TCP_CORK is not None
        if cork and not self._corked:
            self._sock.setsockopt(socket.IPPROTO_TCP, _TCP_CORK, 1)
            self._corked = True
        if behind is not None:
            self._send_batch_with_ordered(job, behind)
            self.frames_sent += 1
        elif isinstance(job, WriteJob):
            self._send_batch(job)
        elif isinstance(job, OrderedJob):
            send_all(self._sock, [self._ordered_frame(job)])
        else:
            send_all(self._sock, job.frame)
        if self._corked and not cork:  # nothing was queued behind this job: everything held leaves now
            self._sock.setsockopt(socket.IPPROTO_TCP, _TCP_CORK, 0)
            self._corked = False
        self.frames_sent += 1

    def _leaves_with_next(self, job: Any) -> bool:
        """Under ``_cond``, the queue not empty: whether ``job`` and the ordered job queued behind it
        leave in one step, the WRITE frame first (a small request's writes and its DONE)."""
        if not isinstance(job, WriteJob) or not isinstance(self._queue[0], OrderedJob):
            return False
        return not job.batch.cancelled and self._sends_whole(job.batch)

    def _sends_whole(self, batch: WriteBatch) -> bool:
        """A small batch on the production path (no fault injection): :meth:`_fits_one_send`."""
        return self.faults is None and self._fits_one_send(batch)

    def _fits_one_send(self, batch: WriteBatch) -> bool:
        """A small batch the C path sends with the ordered message behind it (native, no staging): one
        frame, few runs, whole pages."""
        return (native.lib is not None and self._staging is None and batch.units is None
                and len(batch) <= WITH_ORDERED_MAX_RUNS and batch.nbytes <= min(WITH_ORDERED_MAX_BYTES, self.frame_limit))

    def prepare(self, batch: WriteBatch) -> None:
        """A small batch's frame and descriptors, made before its send (the request's destination just
        arrived): the send then only adds the ordered message's frame."""
        if self._sends_whole(batch):
            batch.wire = self._wire(batch)

    def _wire(self, batch: WriteBatch) -> SmallWire:
        (cut,) = self._frames(batch)  # one frame (_sends_whole)
        return SmallWire.of(batch, cut, self._src_base)

    def _send_batch_with_ordered(self, job: WriteJob, ordered: OrderedJob, *, wait: bool = True) -> bytes:
        """One WRITE frame (the whole batch), then the ordered message behind it. The WRITE frame leaves
        first and the batch's item checksums are taken and the message built after it (a DONE combines
        them, and is built exactly as its own step would build it), so the receiver wakes and lands the
        pages meanwhile: measured against one sendmsg of both frames, about 15% less send->wait() for
        one and eight 4 KiB pages, on the caller's thread and on a lane alike (docs/benchmarks.md). The
        batch is reported sent after the call, or failed (and the connection ends) if it raises.
        Without ``wait`` (the posting thread, :meth:`_send_inline`) the socket is never waited for:
        returns the bytes it did not take, copied (the rest of the WRITE frame and the whole ordered
        frame, or the ordered frame's tail), which the caller must send next; else b""."""
        batch = job.batch
        if not batch.wait_sources():  # dropped unsent meanwhile (a close without flush, a failed ready event):
            # the message goes alone (a DONE behind cancelled writes is built as a writer ABORT)
            job.on_complete(batch, 0, len(batch))
            frame = self._ordered_frame(ordered)
            if not wait:
                return frame
            send_all(self._sock, [frame])
            return b""
        wire = self._prepared_wire(batch)
        try:
            unsent = self._send_write(wire, wait=wait)
            rest = self._send_behind(batch, wire, ordered, unsent, wait=wait)
        except BaseException:
            job.on_complete(batch, 0, len(batch))
            raise
        self.bytes_sent += wire.nbytes
        self.sent_with_ordered += 1
        job.on_complete(batch, len(batch), 0)
        return rest

    def _prepared_wire(self, batch: WriteBatch) -> SmallWire:
        """The batch's WRITE frame and descriptors: made when its destination arrived (:meth:`prepare`), or now."""
        if batch.wire is None:
            return self._wire(batch)
        self.sent_prepared += 1
        return batch.wire

    def _send_write(self, wire: SmallWire, *, wait: bool) -> bytes:
        """A small batch's WRITE frame; without ``wait`` the bytes the socket did not take, copied."""
        fd = self._sock.fileno()
        if wait:
            native.lib.send_runs(fd, wire.prefix, wire.addresses, wire.lengths)
            return b""
        sent = native.lib.send_runs_nowait(fd, wire.prefix, wire.addresses, wire.lengths)
        return _unsent(wire, sent) if sent < len(wire.prefix) + wire.nbytes else b""

    def _send_behind(self, batch: WriteBatch, wire: SmallWire, ordered: OrderedJob, unsent: bytes, *, wait: bool) -> bytes:
        """The ordered message behind a batch whose WRITE frame went (``unsent``: the part of it the socket
        has not taken yet, which goes first): a DONE is summed, filled in and sent in one C call where it
        can be (:meth:`_unsummed_done`), else the batch's item checksums are taken and the message built
        as its own step builds it. Returns what is left to send, as :meth:`_send_batch_with_ordered`."""
        fd = self._sock.fileno()
        filled = None if unsent else self._unsummed_done(batch, ordered)
        if filled is not None:  # the sums, DONE's checksum and its send in one C call
            frame, builder = filled
            try:
                done_sent, _checksum = _C_SEND_SUMMED_DONE(fd, *wire.payload, self._sum_fn, self._sum_initial,
                                                           frame, f.DONE_CHECKSUM_AT)
            finally:
                builder.built()
            self.done_filled += 1
            rest = bytes(frame[done_sent:])
        else:
            self._keep_item_sums(batch, wire)
            frame = self._ordered_frame(ordered)
            rest = unsent + frame if unsent or wait else frame[native.lib.send_runs_nowait(fd, frame, b"", b""):]
        if rest and not unsent and not wait:
            self.ordered_rest += 1  # the WRITE frame left whole, the ordered frame in part
        if wait and rest:
            send_all(self._sock, [rest])
            return b""
        return rest

    def _unsummed_done(self, batch: WriteBatch, ordered: OrderedJob) -> tuple[bytearray, Any] | None:
        """The DONE frame behind ``batch``, its checksum 0, and its builder, when one C call can sum the
        batch's items, fill the checksum in and send it (``send_summed_done``): DONE's builder offers it
        for this very batch (:meth:`~kvxfer.engine.sender.DoneBuilder.unsummed`: the DONE queued behind a
        batch may be another request's), its algorithm is this link's, and it fits the binary layout.
        None: the message is built as its own step builds it."""
        unsummed = getattr(ordered.msg, "unsummed", None)
        if unsummed is None or _C_SEND_SUMMED_DONE is None or self._sum_fn is None or batch.sums_ready is not None:
            return None
        msg = unsummed(batch)
        if msg is None or msg.algo != self._sum_algo:
            return None
        frame = f.done_frame(msg, slot=ordered.slot)
        return None if frame is None else (bytearray(frame), ordered.msg)

    def _send_batch(self, job: WriteJob) -> None:
        if not job.batch.wait_sources():  # cancelled, or its ready event failed: nothing of it is sent
            job.on_complete(job.batch, 0, len(job.batch))
            return
        if self._staging is not None:
            self._send_batch_staged(job)
            return
        cuts = self._frames(job.batch)
        if self.faults is None and _C_SEND_FRAMES is not None and len(cuts) > 1:
            self._send_frames_in_c(job, cuts)
            return
        self._send_batch_frames(job, cuts, lambda batch, cut, last: self._send_frame(batch, cut, last=last))

    def _send_frames_in_c(self, job: WriteJob, cuts: list[FrameCut]) -> None:
        """A batch of several frames in calls of up to :data:`FRAMES_PER_CALL` frames, each call one C
        loop with the GIL released (``send_frames``: every frame's header and run table, its runs in
        groups and their item checksums taken as each group went), instead of a Python step per frame:
        at 4 KiB pages that step was a tenth of the sending lane's time (perf, tcp bench). The frames'
        headers, run tables and source addresses are built for the whole call at once. A cancelled
        batch stops between calls; a call that fails reports its runs failed, as a failed frame did."""
        summed = self._sum_fn is not None and job.batch.sums_ready is None
        steps = (cuts[at : at + FRAMES_PER_CALL] for at in range(0, len(cuts), FRAMES_PER_CALL))
        self._send_batch_steps(job, steps, lambda batch, group, last: self._send_frame_group(batch, group, summed, last))

    def _send_frame_group(self, batch: WriteBatch, cuts: list[FrameCut], summed: bool, last: bool) -> None:
        """One ``send_frames`` call for ``cuts`` (consecutive frames of ``batch``): every frame's header
        and run table written into one buffer, the runs' arrays handed over as they are (no copies)."""
        buffers = np.concatenate([cut.buffers for cut in cuts])
        lengths = np.concatenate([cut.lengths for cut in cuts]).astype(np.uint64)
        runs = np.zeros(len(buffers), dtype=RUN_DTYPE)  # the frames' run tables, back to back
        runs["buffer"] = buffers
        runs["offset"] = np.concatenate([cut.dst_offsets for cut in cuts])
        runs["length"] = lengths
        table = runs.view(np.uint8)
        addresses = self._src_base[buffers] + np.concatenate([cut.src_offsets for cut in cuts]).astype(np.uint64)
        counts = [len(cut.lengths) for cut in cuts]
        run_ends = np.cumsum(counts, dtype=np.uint64)
        prefix_ends = run_ends * np.uint64(f.RUN_SIZE) + np.arange(1, len(cuts) + 1, dtype=np.uint64) * np.uint64(f.HEADER_SIZE)
        prefixes = np.empty(int(prefix_ends[-1]), dtype=np.uint8)
        at = first = 0
        for cut, count in zip(cuts, counts):
            prefixes[at : at + f.HEADER_SIZE] = np.frombuffer(f.write_header(batch.slot, batch.gen, count, cut.nbytes),
                                                               dtype=np.uint8)
            at += f.HEADER_SIZE
            prefixes[at : at + count * f.RUN_SIZE] = table[first * f.RUN_SIZE : (first + count) * f.RUN_SIZE]
            at += count * f.RUN_SIZE
            first += count
        items = np.concatenate([cut.units for cut in cuts]).astype(np.uint64) if summed else b""
        raw = _C_SEND_FRAMES(self._sock.fileno(), prefixes, prefix_ends, run_ends, addresses, lengths, items,
                             self._sum_fn if summed else -1, self._sum_initial, SEND_SUM_CHUNK)
        if raw is not None:
            self._keep_sums(batch, np.frombuffer(raw, dtype=np.uint32), last)
        self.bytes_sent += sum(cut.nbytes for cut in cuts)
        self.frames_in_c += len(cuts)

    def _frames(self, batch: WriteBatch) -> list[FrameCut]:
        """The frames the batch is cut into: at most :attr:`frame_limit` bytes and
        :data:`FRAME_MAX_RUNS` runs each (:data:`SLICE_FRAME_MAX_RUNS` for a head slice's pieces), longer
        runs split at item boundaries."""
        runs = FRAME_MAX_RUNS if batch.units is None else SLICE_FRAME_MAX_RUNS
        return cut_frames(batch, self.layout.item_lens, self.frame_limit, runs)

    def _send_batch_staged(self, job: WriteJob) -> None:
        """Frame k leaves from one staging buffer while frame k+1 is copied into the other."""
        assert self._staging is not None
        frames = self._frames(job.batch)
        staging = self._staging

        def stage(cut: FrameCut) -> tuple[np.ndarray, int]:
            buffer, base = staging.take()
            sources = self._src_base[cut.buffers] + cut.src_offsets.astype(np.uint64)
            staging.engine.gather(base, sources, cut.lengths.astype(np.uint64))
            staging.mark_pending()
            return buffer, base

        index = {id(cut): i for i, cut in enumerate(frames)}
        staged = {0: stage(frames[0])} if frames else {}

        def send(batch: WriteBatch, cut: FrameCut, last: bool) -> None:
            i = index[id(cut)]
            staging.drain()  # frame i is in its buffer
            current = staged.pop(i)
            if i + 1 < len(frames):
                staged[i + 1] = stage(frames[i + 1])  # overlaps the send below
            self._send_frame(batch, cut, current, last=last)

        try:
            self._send_batch_frames(job, frames, send)
        finally:
            staging.drain()

    def _send_frame(self, batch: WriteBatch, cut: FrameCut, staged: tuple[np.ndarray, int] | None = None,
                    *, last: bool) -> None:
        buffers, size = cut.buffers, cut.nbytes
        header = f.write_header(batch.slot, batch.gen, len(cut.lengths), size)
        runs = f.pack_runs(buffers, cut.dst_offsets, cut.lengths)
        if self.faults is None and native.lib is not None:
            lengths = cut.lengths.astype(np.uint64)
            if staged is not None:  # the runs lie back to back in the staging buffer
                addresses = np.uint64(staged[1]) + packed_offsets(lengths)
            else:
                addresses = self._src_base[buffers] + cut.src_offsets.astype(np.uint64)
            if self._sum_fn is None or batch.sums_ready is not None:
                native.lib.send_runs(self._sock.fileno(), header + runs, addresses.tobytes(), lengths.tobytes())
            else:
                items = cut.units.astype(np.uint64)
                raw = native.lib.send_runs_summed(self._sock.fileno(), header + runs, addresses.tobytes(),
                                                  lengths.tobytes(), items.tobytes(), self._sum_fn,
                                                  self._sum_initial, SEND_SUM_CHUNK)
                self._keep_sums(batch, np.frombuffer(raw, dtype=np.uint32), last)
            self.bytes_sent += size
            return
        if staged is not None:
            payload: list[Any] = [memoryview(staged[0])[:size]]
        else:
            payload = [
                self._src[b][o : o + n]
                for b, o, n in zip(buffers.tolist(), cut.src_offsets.tolist(), cut.lengths.tolist())
            ]
        if self.faults is not None:
            self._send_with_faults(batch, header, runs, payload, lambda frame: send_all(self._sock, frame))
        else:
            send_all(self._sock, [header, runs, *payload])
        self.bytes_sent += size

    def _end(self, reason: str) -> None:
        """The link ends (on the lane serving it): queued writes fail, the socket closes, once."""
        if self._ended.is_set():
            return
        self._lanes.unwatch(self._sock)
        self._fail_queued()
        self.drain_messages()  # a RESULT that came ahead of the end still counts
        with self._read_lock:
            try:
                self._sock.close()
            except OSError:  # pragma: no cover
                pass
        if self._staging is not None:
            try:
                self._staging.close()
            except KvxferError as exc:
                log.error("data connection to %s: releasing staging buffers: %s", self.address, exc)
        with self._cond:
            self._ended.set()
        self._report_closed(reason)

    def close(self, *, flush: bool = True) -> None:
        """Stop the link. With ``flush`` queued frames are sent first (for up to 10 s); without, the
        socket is cut if the link has not ended within :data:`CUT_AFTER_S` (a lane blocked sending
        to a peer that stopped reading, or cut off); idempotent."""
        self._begin_close(flush)
        if self._serving is threading.current_thread():
            return  # called back from this link's own step (on_closed): it ends when the step returns
        if not self._ended.wait(10 if flush else CUT_AFTER_S):
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # a lane blocked sending to a peer that stopped reading
            except OSError:
                pass
            self._ended.wait(5)

    def abort_connection(self) -> None:
        """Drop the connection at once (a crashed writer), without flushing."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class TcpTransport(SenderTransport):
    """The prefill side: opens one :class:`TcpLink` per OFFER."""

    name = "tcp"
    capabilities = CAPABILITIES

    def __init__(self, layout: KVLayout, *, checksum: Any = None, staging: str | None = None,
                 send_threads: int = DEFAULT_THREADS, inline_send: bool = True) -> None:
        self.layout = layout
        self.checksum = checksum
        self.staging = staging
        self.inline_send = inline_send
        self.lanes = SendLanes("tcp", threads=send_threads)

    def connect(self, request: LinkRequest) -> TcpLink:
        address = decode_offer(request.blob)
        connect = m.Connect(engine=request.engine, epoch=request.epoch, proof=request.proof)
        return TcpLink(self.layout, address, connect=connect, on_closed=request.on_closed, faults=request.faults,
                       checksum=self.checksum, staging=self.staging, lanes=self.lanes, inline_send=self.inline_send,
                       on_message=request.on_message)

    def close(self) -> None:
        self.lanes.close()


def _options(config: Any) -> TcpOptions:
    return config.options("tcp") if hasattr(config, "options") else TcpOptions()


def _receiver(layout: KVLayout, guard: WriteGuard, config: Any, hooks: ReceiverHooks) -> TcpReceiver:
    from ..wire.addresses import advertised_host

    return TcpReceiver(layout, guard, host=config.host, port=config.data_port,
                       advertise=advertised_host(config.host, getattr(config, "advertise_host", None)),
                       on_connect=hooks.on_connect,
                       on_ordered=hooks.on_ordered, on_closed=hooks.on_closed, on_event=hooks.on_event,
                       checksum=config.checksum, staging=_options(config).staging,
                       max_connections=config.max_data_connections, connect_timeout=config.connect_timeout,
                       max_ordered_body=config.max_ordered_body, answer_on_data=_options(config).answer_on_data,
                       busy_poll_us=_options(config).busy_poll_us)


def _sender(layout: KVLayout, config: Any) -> TcpTransport:
    options = _options(config)
    return TcpTransport(layout, checksum=config.checksum, staging=options.staging, send_threads=options.send_threads,
                        inline_send=options.inline_send)


TRANSPORT = TransportFactory(
    name="tcp",
    summary="software one-sided writes over TCP sockets (any two hosts; the receiver lands each write)",
    capabilities=CAPABILITIES,
    receiver=_receiver,
    sender=_sender,
    options=TcpOptions,
)
