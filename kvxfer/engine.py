"""Engines: the decode (receiving) and prefill (writing) roles wired to the control plane and a
transport, with the threads that drive them.

:class:`DecodeEngine` and :class:`PrefillEngine` are what an application uses (the README shows
them). Each owns a page pool over a :class:`~kvxfer.layout.KVLayout`, a control plane, a transport
and a control thread that receives messages, applies timeouts and sends heartbeats. The role logic
lives in :mod:`kvxfer.receiver` / :mod:`kvxfer.sender`; this module is plumbing.

Lifecycle: construct (the capacity invariant is checked first, before any socket opens), peer
(``DecodeEngine.connect(prefill.address)``), use, ``close()`` (idempotent; also a context manager).

Locking: one re-entrant lock per engine guards the role logic, its ledger and its write guard. The
transport's threads take it briefly to check and record writes and to deliver ordered messages; no
thread holds it while blocking on I/O, and fencing (which joins a data thread) happens outside it.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .checksum import ChecksumAlgo
from .control import ControlPlane
from .errors import (
    ConfigError,
    EngineClosed,
    KvxferError,
    PeerError,
    ProtocolError,
    TransferFailed,
    TransportError,
)
from .events import EventLog
from .layout import KVLayout
from .lifecycle import ReceiverState, SenderState
from .metrics import EngineMetrics
from .pool import PagePool, check_capacity
from .reads import KVRead
from .receiver import PeerInfo, Receiver, ReceiveRequest
from .sender import Sender, SendRequest
from .transport.faults import FaultInjector
from .transport.tcp import TcpLink, TcpReceiver
from .wire import messages as m

log = logging.getLogger("kvxfer.engine")

TRANSPORTS = ("tcp", "verbs")
ORDERED_MESSAGES = (m.Done, m.DrainAck, m.Reject, m.Abort)


@dataclass
class EngineConfig:
    """Settings shared by both roles. Times are seconds."""

    max_context: int
    alloc_policy: str = "lifo"
    free_policy: str = "keep"
    checksum: str = "adler32"
    transport: str = "tcp"
    host: str = "127.0.0.1"
    control_port: int = 0
    data_port: int = 0
    allow_undersized_pool: bool = False
    max_inflight: int = 4096
    transfer_timeout: float = 60.0
    drain_timeout: float = 10.0
    meta_timeout: float = 60.0
    heartbeat_interval: float = 1.0
    peer_timeout: float = 15.0
    seed: int | None = None
    engine_id: str | None = None
    unsafe_legacy: bool = False
    ib_device: str | None = None
    ib_port: int = 1
    gid_index: int | None = None
    keyring: Any = None  # a kvxfer.auth.Keyring or a keyring directory: authenticated control plane
    metrics_port: int | None = None  # serve Prometheus metrics here (0: any free port); None: off
    metrics_host: str | None = None  # default: ``host``
    max_pending_meta: int = 4096  # prefill: destinations held for requests not admitted yet, per peer
    # extra["tcp_staging"] = "host": send and land host pages through the staging buffers GPU pages
    # use (tests and diagnostics of that pipeline on machines without a GPU)
    extra: dict[str, Any] = field(default_factory=dict)

    def load_keyring(self) -> Any:
        """The :class:`~kvxfer.auth.Keyring` to use, or None for an unauthenticated control plane."""
        if self.keyring is None or self.keyring == "":
            return None
        from .auth import Keyring

        return self.keyring if isinstance(self.keyring, Keyring) else Keyring.load(self.keyring)

    def verbs_options(self) -> Any:
        from .transport.verbs import VerbsOptions

        return VerbsOptions.from_config({"ib_device": self.ib_device, "ib_port": self.ib_port,
                                         "gid_index": self.gid_index})

    def validate(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"unknown transport {self.transport!r} (available: {', '.join(TRANSPORTS)})")
        ChecksumAlgo.parse(self.checksum)
        for name in ("transfer_timeout", "drain_timeout", "meta_timeout", "heartbeat_interval", "peer_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port {self.metrics_port} is not a TCP port")
        if self.max_pending_meta <= 0:
            raise ConfigError("max_pending_meta must be positive")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _engine_id(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class _Engine:
    role = "engine"

    def __init__(self, layout: KVLayout, config: EngineConfig, *, faults: FaultInjector | None = None) -> None:
        config.validate()
        check_capacity(
            role=self.role,
            pool_tokens=layout.pool_tokens,
            max_context=config.max_context,
            allow_undersized=config.allow_undersized_pool,
        )
        self.layout = layout
        self.config = config
        self.faults = faults
        self.engine_id = config.engine_id or _engine_id(self.role)
        self.lock = threading.RLock()
        self.pool = PagePool(layout, alloc_policy=config.alloc_policy, free_policy=config.free_policy,
                             seed=config.seed)
        self.events = EventLog(self.engine_id, self.role)
        self.control = ControlPlane(self.engine_id, host=config.host, port=config.control_port,
                                    keyring=config.load_keyring())
        self.address = self.control.address
        self.counters: Counter[str] = Counter()
        self.metrics: EngineMetrics | None = None
        self._stop = threading.Event()
        self._closed = False
        self._hb_seq = 0
        self._next_heartbeat = 0.0
        self._thread = threading.Thread(target=self._loop, name=f"kvxfer-{self.role}-control", daemon=True)

    def _start(self) -> None:
        if self.config.metrics_port is not None:
            try:
                self.metrics = EngineMetrics(self)
                self.metrics_address = self.metrics.serve(self.config.metrics_host or self.config.host,
                                                          self.config.metrics_port)
            except OSError as exc:
                self.close()
                raise ConfigError(f"cannot serve metrics on port {self.config.metrics_port}: {exc}") from exc
        self._thread.start()

    def _observe(self, fsm: Any, old: Any, reason: str) -> None:
        """Lifecycle observer (called under the engine lock): event lines and metrics."""
        self.events.transition(fsm, old, reason)
        if self.metrics is not None:
            self.metrics.observe(fsm, old, reason)

    def _event(self, kind: str, *, counter: str | None = None, limit_key: str | None = None, **fields: Any) -> None:
        """Count an off-the-happy-path control event and log it as one structured line."""
        self.counters[counter or kind] += 1
        self.events.emit(kind, limit_key=limit_key if limit_key is not None else kind, **fields)

    def _control_events(self) -> None:
        for kind, fields in self.control.drain_events():
            self._event(kind, **fields)

    # the control thread -----------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                for identity, data in self.control.receive(20):
                    self._handle(identity, data)
                if self.control.events:
                    self._control_events()
                self._tick()
                now = time.monotonic()
                if now >= self._next_heartbeat:
                    self._next_heartbeat = now + self.config.heartbeat_interval
                    self._heartbeat()
            except Exception:  # the control thread must survive anything a peer sends
                log.exception("%s control loop error", self.engine_id)
                self.counters["control_loop_errors"] += 1

    def _handle(self, identity: str, data: bytes) -> None:
        try:
            msg = m.decode(data)
        except ProtocolError as exc:
            log.warning("%s: malformed control message from %r: %s", self.engine_id, identity, exc)
            self._event("malformed_message", counter="malformed_messages", limit_key=identity, peer=identity,
                        error=str(exc)[:500])
            self._reply_error(identity, "?", exc)
            return
        self._note_alive(identity)
        try:
            self._dispatch(identity, msg)
        except KvxferError as exc:
            log.warning("%s: %s from %r refused: %s", self.engine_id, msg.TYPE, identity, exc)
            self._event("refused_message", counter="refused_messages", limit_key=f"{identity}/{exc.code}",
                        peer=identity, message=msg.TYPE, rid=getattr(msg, "rid", None), gen=getattr(msg, "gen", None),
                        code=exc.code, error=str(exc)[:500])
            self._reply_error(identity, msg.TYPE, exc, rid=getattr(msg, "rid", "?"), gen=getattr(msg, "gen", 0))

    def _reply_error(self, identity: str, about: str, exc: KvxferError, *, rid: Any = "?", gen: int = 0) -> None:
        address = self._peer_address(identity)
        if address is None:
            return
        try:
            self.control.send(address, m.Error(about=about, code=exc.code, detail=str(exc)[:4000],
                                               rid=rid if rid not in (None, "") else "?", gen=gen or 0))
        except (PeerError, ProtocolError):
            pass

    def _send_to_peer(self, peer: str, msg: m.Message) -> None:
        address = self._peer_address(peer)
        if address is None:
            log.warning("%s: cannot send %s to unknown peer %r", self.engine_id, msg.TYPE, peer)
            return
        try:
            self.control.send(address, msg)
        except PeerError as exc:
            log.warning("%s: %s to %r not sent: %s", self.engine_id, msg.TYPE, peer, exc)

    # hooks for the roles ------------------------------------------------------------------------------
    def _dispatch(self, identity: str, msg: m.Message) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def _tick(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def _heartbeat(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def _note_alive(self, identity: str) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def _peer_address(self, identity: str) -> str | None:  # pragma: no cover - overridden
        raise NotImplementedError

    # lifecycle --------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosed(f"{self.role} engine {self.engine_id} is closed")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._close_transport()
        self.control.close()
        if self.metrics is not None:
            self.metrics.close()

    def _close_transport(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def __enter__(self) -> _Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# decode -----------------------------------------------------------------------------------------------


class _Worker:
    """A thread running checksum passes (verification on decode, source checksums on prefill), so
    the threads that move data never stop for them."""

    def __init__(self, name: str) -> None:
        import queue

        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Any) -> None:
        self._queue.put(job)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                job()
            except Exception:
                log.exception("verification job failed")

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=30)


class DecodeEngine(_Engine):
    """The receiving role: reserves pages, lands verified writes, gates reads."""

    role = "decode"

    def __init__(self, layout: KVLayout, config: EngineConfig, *, faults: FaultInjector | None = None) -> None:
        super().__init__(layout, config, faults=faults)
        self._verifier = _Worker(f"kvxfer-{self.role}-verify")
        self.receiver = Receiver(
            self.pool,
            max_context=config.max_context,
            checksum=config.checksum,
            max_inflight=config.max_inflight,
            transfer_timeout=config.transfer_timeout,
            drain_timeout=config.drain_timeout,
            send=self._send_to_peer,
            lock=self.lock,
            unsafe_legacy=config.unsafe_legacy,
            defer=self._verifier.submit,
            observer=self._observe,
        )
        self.receiver.guard.on_refused = self._write_refused
        self._pending_hello: dict[bytes, dict[str, Any]] = {}
        self.transport: Any
        try:
            if config.transport == "verbs":
                from .transport.verbs import VerbsReceiver

                self.transport = VerbsReceiver(layout, self.receiver.guard, config.verbs_options(),
                                               on_closed=self._on_data_closed)
            else:
                self.transport = TcpReceiver(
                    layout,
                    self.receiver.guard,
                    host=config.host,
                    port=config.data_port,
                    on_connect=self._on_data_connect,
                    on_ordered=self.receiver.on_ordered,
                    on_closed=self._on_data_closed,
                    checksum=config.checksum,
                    staging=config.extra.get("tcp_staging"),
                )
        except OSError as exc:
            self.control.close()
            self._verifier.close()
            raise TransportError(f"cannot listen for data on {config.host}:{config.data_port}: {exc}") from exc
        except Exception:
            self.control.close()
            self._verifier.close()
            raise
        self.data_address = self.transport.address
        self._start()

    # peering ---------------------------------------------------------------------------------------
    def connect(self, prefill_address: str, *, timeout: float = 10.0) -> str:
        """Peer with the prefill engine at ``prefill_address``; returns its engine id."""
        self._check_open()
        session = secrets.token_bytes(16)
        hello = m.Hello(
            engine=self.engine_id, role="decode", session=session, reply_to=self.address,
            transport=self.config.transport, data_addr=self.data_address,
            page_size=self.layout.page_size, num_pages=self.layout.num_pages,
            item_lens=[int(x) for x in self.layout.item_lens], pool_tokens=self.layout.pool_tokens,
            max_context=self.config.max_context, checksum=self.config.checksum,
        )
        with self.lock:
            self._pending_hello[session] = {"address": prefill_address, "error": None, "peer": None}
        self.control.send(prefill_address, hello)
        deadline = time.monotonic() + timeout
        with self.lock:
            while True:
                entry = self._pending_hello[session]
                if entry["error"] is not None:
                    del self._pending_hello[session]
                    raise PeerError(f"peering with {prefill_address} refused: {entry['error']}")
                peer = entry["peer"]
                if peer is not None and self.receiver.peers[peer].ready:
                    del self._pending_hello[session]
                    return peer
                left = deadline - time.monotonic()
                if left <= 0:
                    del self._pending_hello[session]
                    raise PeerError(f"no answer from prefill at {prefill_address} within {timeout:g} s")
                self.receiver.changed.wait(min(left, 0.1))

    def _dispatch(self, identity: str, msg: m.Message) -> None:
        if isinstance(msg, m.HelloAck):
            self._on_hello_ack(identity, msg)
            return
        if identity not in self.receiver.peers:
            raise PeerError(f"{msg.TYPE} from {identity!r}, which is not a peer")
        if isinstance(msg, m.Heartbeat):
            return
        if self.config.transport == "verbs":
            if isinstance(msg, m.VerbsConnect):
                self._on_verbs_connect(identity, msg)
                return
            if isinstance(msg, ORDERED_MESSAGES):
                # The writer sent it only after every work request before it completed (drain proof).
                conn = self.receiver.peers[identity].conn
                if conn is None:
                    raise PeerError(f"{msg.TYPE} from {identity!r}, which has no queue pair connected")
                self.transport.sync(conn, msg.gen if isinstance(msg, m.Done) else None)
                self.receiver.on_ordered(conn, msg)
                return
        if isinstance(msg, m.Error):
            self.counters["peer_errors"] += 1
            log.warning("%s: peer %s reports about %s: %s", self.engine_id, identity, msg.about, msg.detail)
            return
        if isinstance(msg, m.Reject):
            # Rejections normally travel on the ordered data path; one here means the writer has no
            # data connection, so treat it as an abort request (quarantine until proven drained).
            with self.lock:
                req = self.receiver.active.get(msg.rid)
                if req is not None and req.gen == msg.gen and req.peer == identity:
                    self.receiver.abort(msg.rid, f"prefill rejected it: {msg.detail}", failure=True,
                                        generation=msg.gen)
            return
        raise ProtocolError(f"{msg.TYPE} is not a message a decode engine accepts")

    def _on_hello_ack(self, identity: str, msg: m.HelloAck) -> None:
        refused_conn = None
        with self.lock:
            entry = self._pending_hello.get(msg.session)
            if entry is None:
                raise PeerError("HELLO_ACK for a session this engine did not open")
            problem = "" if msg.ok else (msg.error or "refused")
            if not problem:
                try:
                    self.layout.check_compatible(
                        {"page_size": msg.page_size, "item_lens": msg.item_lens}, peer_name=identity
                    )
                except ConfigError as exc:
                    problem = str(exc)
            early = entry.get("early_conn")
            if problem or (early is not None and early[0] != identity):
                entry["error"] = problem or f"data connection came from {early[0]!r}, not {identity!r}"
                refused_conn = early
            else:
                info = PeerInfo(
                    engine=identity, control=entry["address"], session=msg.session,
                    pool_tokens=msg.pool_tokens, max_context=msg.max_context, page_size=msg.page_size,
                    last_seen=time.monotonic(),
                )
                if early is not None:
                    info.conn, info.epoch, info.ready = early, early[1], True
                self.receiver.add_peer(info)
                entry["peer"] = identity
            self.receiver.changed.notify_all()
        if refused_conn is not None:
            self.transport.fence(refused_conn)
        if self.config.transport == "verbs" and entry.get("peer") == identity:
            self._offer_verbs(identity, msg.session, 1)

    def _offer_verbs(self, identity: str, session: bytes, epoch: int) -> None:
        """Create a queue pair for the writer under ``epoch`` and tell it (VERBS_INFO)."""
        try:
            offer = self.transport.open_peer(identity, session, epoch)
        except Exception as exc:
            log.error("%s: cannot create a queue pair for %s: %s", self.engine_id, identity, exc)
            with self.lock:
                entry = next((e for e in self._pending_hello.values() if e.get("peer") == identity), None)
                if entry is not None:
                    entry["error"] = f"cannot create a queue pair: {exc}"
                self.receiver.changed.notify_all()
            return
        self._send_to_peer(identity, offer)

    def _on_verbs_connect(self, identity: str, msg: m.VerbsConnect) -> None:
        with self.lock:
            info = self.receiver.peers[identity]
            if msg.engine != identity or not secrets.compare_digest(info.session, msg.session):
                raise PeerError(f"VERBS_CONNECT from {identity!r} with a wrong session")
            if msg.epoch <= info.epoch:
                raise PeerError(f"VERBS_CONNECT epoch {msg.epoch} is not after {info.epoch}")
        conn = self.transport.connect_peer(msg)
        with self.lock:
            info.epoch = msg.epoch
            info.conn = conn
            info.ready = True
            self.receiver.changed.notify_all()

    def _on_data_connect(self, msg: m.Connect) -> Any:
        with self.lock:
            info = self.receiver.peers.get(msg.engine)
            if info is None:
                # The writer may open its data path before its HELLO_ACK reached us (two sockets).
                entry = next((e for s, e in self._pending_hello.items()
                              if secrets.compare_digest(s, msg.session)), None)
                if entry is None or entry.get("early_conn") is not None:
                    self._event("refused_connection", counter="refused_connections", peer=msg.engine,
                                why="unknown session")
                    log.warning("%s: data connection from %r refused: unknown session", self.engine_id, msg.engine)
                    return None
                entry["early_conn"] = (msg.engine, msg.epoch)
                return entry["early_conn"]
            if not secrets.compare_digest(info.session, msg.session):
                self._event("refused_connection", counter="refused_connections", peer=msg.engine,
                            why="wrong session")
                log.warning("%s: data connection from %r refused: wrong session", self.engine_id, msg.engine)
                return None
            if msg.epoch <= info.epoch:
                self._event("refused_connection", counter="refused_connections", peer=msg.engine,
                            why=f"epoch {msg.epoch} not after {info.epoch}")
                log.warning("%s: data connection from %r refused: epoch %d not after %d",
                            self.engine_id, msg.engine, msg.epoch, info.epoch)
                return None
            info.epoch = msg.epoch
            info.conn = (msg.engine, msg.epoch)
            info.ready = True
            self.receiver.changed.notify_all()
            return info.conn

    def _write_refused(self, reason: str, conn: Any, refusal: Any) -> None:
        """WriteGuard hook (under the lock): one rate-limited event line per refused write."""
        fields: dict[str, Any] = {"reason": reason, "conn": conn}
        if refusal is not None:
            fields.update(rid=refusal.rid, gen=refusal.generation, pages=(refusal.pages or [])[:16],
                          error=refusal.detail[:300])
        self.events.emit("write_refused", limit_key=reason, **fields)

    def _on_data_closed(self, conn: Any, reason: str) -> None:
        self.counters["connections_lost"] += 1
        log.info("%s: data connection %s closed: %s", self.engine_id, conn, reason)
        self.receiver.on_connection_closed(conn, reason)

    def fence(self, conn: Any, reason: str) -> bool:
        """Fence a data connection: after this returns nothing from it can land. Never under lock."""
        closed = self.transport.fence(conn)
        if closed:
            self._event("fence", counter="fences", limit_key="", peer=conn[0], epoch=conn[1], reason=reason[:500])
            log.warning("%s: fenced data connection %s: %s", self.engine_id, conn, reason)
            self.receiver.on_connection_closed(conn, f"fenced: {reason}")
            peer, epoch = conn
            self._send_to_peer(peer, m.Fenced(epoch=epoch, reason=reason[:4000]))
            info = self.receiver.peers.get(peer)
            if self.config.transport == "verbs" and info is not None and not self._closed:
                self._offer_verbs(peer, info.session, epoch + 1)
        return closed

    def _tick(self) -> None:
        for conn, reason in self.receiver.tick():
            self.fence(conn, reason)
        now = time.monotonic()
        dead = []
        with self.lock:
            for info in self.receiver.peers.values():
                if info.ready and now - info.last_seen > self.config.peer_timeout:
                    info.ready = False
                    dead.append(info)
        for info in dead:
            self._event("dead_peer", counter="dead_peers", peer=info.engine, silent_s=round(now - info.last_seen, 3))
            log.warning("%s: peer %s silent for %.1f s: dead", self.engine_id, info.engine, now - info.last_seen)
            if info.conn is not None:
                self.fence(info.conn, f"peer {info.engine} dead (silent for {now - info.last_seen:.1f} s)")

    def _heartbeat(self) -> None:
        self._hb_seq += 1
        for peer in list(self.receiver.peers):
            self._send_to_peer(peer, m.Heartbeat(engine=self.engine_id, seq=self._hb_seq))

    def _note_alive(self, identity: str) -> None:
        info = self.receiver.peers.get(identity)
        if info is not None:
            info.last_seen = time.monotonic()
            if info.conn is not None:
                info.ready = True

    def _peer_address(self, identity: str) -> str | None:
        info = self.receiver.peers.get(identity)
        return info.control if info is not None else None

    def _close_transport(self) -> None:
        self.transport.close()
        self._verifier.close()

    # the API ---------------------------------------------------------------------------------------
    def admit(self, rid: Any, tokens: int, *, peer: str | None = None, pages: Any = None) -> ReceiveRequest:
        """Admit a request and reserve its pages (or refuse: see :meth:`Receiver.admit`)."""
        self._check_open()
        return self.receiver.admit(rid, tokens, peer=peer, pages=pages)

    def abort(self, rid: Any, reason: str = "aborted by caller", *, generation: int | None = None) -> ReceiveRequest:
        """Abort a request (``generation``: only that generation of the id; StaleGeneration otherwise).
        Pages with writes possibly in flight are quarantined until a drain proof or a fence."""
        self._check_open()
        return self.receiver.abort(rid, reason, generation=generation)

    def status(self, rid: Any) -> ReceiveRequest:
        return self.receiver.status(rid)

    def wait(self, rid: Any, *, timeout: float = 30.0,
             until: tuple[ReceiverState, ...] | None = None) -> ReceiveRequest:
        """Block until the request is READABLE or terminal (or in one of ``until``)."""
        targets = until or (ReceiverState.READABLE, ReceiverState.REJECTED, ReceiverState.FAILED,
                            ReceiverState.ABORTED, ReceiverState.RELEASED)
        deadline = time.monotonic() + timeout
        with self.lock:
            while True:
                req = self.receiver.status(rid)
                if req.state in targets:
                    return req
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferFailed(f"still {req.state.value} after {timeout:g} s", reason="wait_timeout",
                                         rid=rid, generation=req.gen)
                self.receiver.changed.wait(min(left, 0.1))

    def read(self, rid: Any, *, generation: int | None = None) -> KVRead:
        """A read lease on a readable request (:class:`~kvxfer.reads.KVRead`; a context manager):
        raises if not readable or not owned; until it ends, release and abort defer the free."""
        req = self.receiver.open_lease(rid, generation=generation)
        return KVRead(self.receiver, self.layout, req)

    def release(self, rid: Any, *, generation: int | None = None) -> None:
        self.receiver.release(rid, generation=generation)

    def check_accounting(self) -> dict[str, int]:
        return self.receiver.check_accounting()

    def stats(self) -> dict[str, Any]:
        with self.lock:
            self.receiver.drain_ended_leases()  # a read dropped just before this call has ended
            return {
                "engine": self.engine_id,
                "role": self.role,
                "pages": self.pool.ledger.counts(),
                "pool_total": self.layout.num_pages,
                "pool_free": self.pool.ledger.free_count,
                "requests": dict(self.receiver.stats),
                "writes": self.receiver.guard.counters(),
                "engine_counters": dict(self.counters),
                "protocol_errors": self.transport.protocol_errors,
                "data_path": {k: getattr(self.transport, k) for k in ("frames", "payload_seconds", "busy_seconds")
                              if hasattr(self.transport, k)},
                "active": len(self.receiver.active),
            }


# prefill -----------------------------------------------------------------------------------------------


@dataclass
class _Peer:
    engine: str
    control: str
    session: bytes
    data_addr: str
    link: TcpLink | None = None
    epoch: int = 0
    last_seen: float = 0.0
    alive: bool = True
    reconnect_at: float | None = None


class PrefillEngine(_Engine):
    """The writing role: admits prompts, holds source pages, writes them into decode's pages."""

    role = "prefill"

    def __init__(self, layout: KVLayout, config: EngineConfig, *, faults: FaultInjector | None = None) -> None:
        super().__init__(layout, config, faults=faults)
        self._checksummer = _Worker(f"kvxfer-{self.role}-checksum")
        self.sender = Sender(
            self.pool,
            max_context=config.max_context,
            checksum=config.checksum,
            meta_timeout=config.meta_timeout,
            send=self._send_to_peer,
            link_for=self._link_for,
            lock=self.lock,
            unsafe_legacy=config.unsafe_legacy,
            defer=self._checksummer.submit,
            observer=self._observe,
            max_pending_meta=config.max_pending_meta,
        )
        self.peers: dict[str, _Peer] = {}
        self.verbs_device: Any = None
        if config.transport == "verbs":
            from .transport.verbs import VerbsDevice

            try:
                self.verbs_device = VerbsDevice(config.verbs_options(), layout, remote_write=False)
            except Exception:
                self.control.close()
                self._checksummer.close()
                raise
        self._start()

    # peering ---------------------------------------------------------------------------------------
    def _dispatch(self, identity: str, msg: m.Message) -> None:
        if isinstance(msg, m.Hello):
            self._on_hello(identity, msg)
            return
        peer = self.peers.get(identity)
        if peer is None:
            raise PeerError(f"{msg.TYPE} from {identity!r}, which is not a peer")
        if isinstance(msg, m.VerbsInfo):
            self._open_verbs_link(peer, msg)
        elif isinstance(msg, m.Meta):
            self.sender.on_meta(identity, msg)
        elif isinstance(msg, m.Abort):
            if self.faults is not None and self.faults.config.ignore_aborts:
                self.faults.counts["ignored_abort"] += 1
                return
            self.sender.on_abort(identity, msg)
        elif isinstance(msg, m.Result):
            self.sender.on_result(identity, msg)
        elif isinstance(msg, m.Reject):
            self.sender.on_reject(identity, msg)
        elif isinstance(msg, m.Fenced):
            self._on_fenced(peer, msg)
        elif isinstance(msg, m.Heartbeat):
            return
        elif isinstance(msg, m.Error):
            self.counters["peer_errors"] += 1
            log.warning("%s: peer %s reports about %s: %s", self.engine_id, identity, msg.about, msg.detail)
        else:
            raise ProtocolError(f"{msg.TYPE} is not a message a prefill engine accepts")

    def _on_hello(self, identity: str, msg: m.Hello) -> None:
        problem = ""
        if msg.engine != identity:
            problem = f"HELLO names engine {msg.engine!r} but came from {identity!r}"
        elif msg.role != "decode":
            problem = f"HELLO from a {msg.role!r} engine; only decode engines peer with prefill"
        elif msg.transport != self.config.transport:
            problem = f"transport {msg.transport!r} != this engine's {self.config.transport!r}"
        elif msg.checksum != self.config.checksum:
            problem = f"checksum {msg.checksum!r} != this engine's {self.config.checksum!r}"
        else:
            try:
                self.layout.check_compatible({"page_size": msg.page_size, "item_lens": msg.item_lens},
                                             peer_name=identity)
            except ConfigError as exc:
                problem = str(exc)
        ack = m.HelloAck(
            engine=self.engine_id, role="prefill", session=msg.session, ok=not problem, error=problem,
            page_size=self.layout.page_size, num_pages=self.layout.num_pages,
            item_lens=[int(x) for x in self.layout.item_lens], pool_tokens=self.layout.pool_tokens,
            max_context=self.config.max_context,
        )
        self.control.send(msg.reply_to, ack)
        if problem:
            log.warning("%s: refused peering with %s: %s", self.engine_id, identity, problem)
            return
        with self.lock:
            old = self.peers.get(identity)
            peer = _Peer(engine=identity, control=msg.reply_to, session=msg.session, data_addr=msg.data_addr,
                         epoch=old.epoch if old else 0, last_seen=time.monotonic())
            self.peers[identity] = peer
        if old is not None and old.link is not None:
            old.link.close(flush=False)
        if self.config.transport == "tcp":
            self._open_link(peer)

    def _open_verbs_link(self, peer: _Peer, info: m.VerbsInfo) -> None:
        """The decode offered a queue pair: connect ours to it and answer VERBS_CONNECT."""
        from .transport.verbs import VerbsLink

        if self.config.transport != "verbs":
            raise PeerError("VERBS_INFO to an engine that does not run the verbs transport")
        with self.lock:
            old = peer.link
            if old is not None and old.epoch >= info.epoch:
                raise PeerError(f"VERBS_INFO epoch {info.epoch} is not after {old.epoch}")
            peer.link = None
        if old is not None:
            self.sender.on_connection_closed(old, "replaced by a new queue pair")
            if self.faults is not None and self.faults.config.keep_fenced_links:
                self.faults.stale_links.append(old)
            else:
                old.close(flush=False)
        link = VerbsLink(self.layout, self.verbs_device, info, engine=self.engine_id, session=peer.session,
                         send_control=lambda msg, name=peer.engine: self._send_to_peer(name, msg),
                         on_closed=self._on_link_closed, faults=self.faults)
        with self.lock:
            peer.link = link
            peer.epoch = info.epoch
            peer.alive = True
            self.sender.changed.notify_all()
        self._send_to_peer(peer.engine, link.connect_message)

    def _open_link(self, peer: _Peer) -> None:
        peer.epoch += 1
        connect = m.Connect(engine=self.engine_id, session=peer.session, epoch=peer.epoch)
        try:
            link = TcpLink(self.layout, peer.data_addr, connect=connect, on_closed=self._on_link_closed,
                           faults=self.faults, checksum=self.config.checksum,
                           staging=self.config.extra.get("tcp_staging"))
        except TransportError as exc:
            log.warning("%s: %s", self.engine_id, exc)
            return
        with self.lock:
            peer.link = link
            peer.alive = True
            self.sender.changed.notify_all()

    def _on_link_closed(self, link: TcpLink, reason: str) -> None:
        self.counters["connections_lost"] += 1
        log.info("%s: data connection %s closed: %s", self.engine_id, link.conn_id, reason)
        with self.lock:
            for peer in self.peers.values():
                if peer.link is link:
                    peer.link = None
                    if not self._closed and self.config.transport == "tcp":
                        peer.reconnect_at = time.monotonic() + 0.05
            self.sender.on_connection_closed(link, reason)

    def _on_fenced(self, peer: _Peer, msg: m.Fenced) -> None:
        """The decode fenced our connection of epoch ``msg.epoch``: settle, then reconnect."""
        self._event("fenced_by_peer", peer=peer.engine, epoch=msg.epoch, reason=msg.reason[:500])
        with self.lock:
            link = peer.link
            if link is not None and link.epoch == msg.epoch:
                peer.link = None
                self.sender.on_connection_closed(link, f"fenced by decode: {msg.reason}")
                if self.faults is not None and self.faults.config.keep_fenced_links:
                    self.faults.stale_links.append(link)
                    link = None
            else:
                link = None
            if peer.link is None and self.config.transport == "tcp":
                peer.reconnect_at = time.monotonic()
        if link is not None:
            link.close(flush=False)

    def _link_for(self, peer: str) -> Any:
        info = self.peers.get(peer)
        return info.link if info is not None and info.link is not None and info.link.alive else None

    def _tick(self) -> None:
        self.sender.tick()
        now = time.monotonic()
        for peer in list(self.peers.values()):
            if peer.reconnect_at is not None and now >= peer.reconnect_at and peer.alive and peer.link is None:
                peer.reconnect_at = None
                self._open_link(peer)
                if peer.link is None:
                    peer.reconnect_at = now + 1.0
        dead = []
        with self.lock:
            for peer in self.peers.values():
                if peer.alive and now - peer.last_seen > self.config.peer_timeout:
                    peer.alive = False
                    dead.append(peer)
        for peer in dead:
            self._event("dead_peer", counter="dead_peers", peer=peer.engine, silent_s=round(now - peer.last_seen, 3))
            log.warning("%s: peer %s silent: dead", self.engine_id, peer.engine)
            if peer.link is not None:
                peer.link.close(flush=False)

    def _heartbeat(self) -> None:
        self._hb_seq += 1
        for name in list(self.peers):
            self._send_to_peer(name, m.Heartbeat(engine=self.engine_id, seq=self._hb_seq))

    def _note_alive(self, identity: str) -> None:
        peer = self.peers.get(identity)
        if peer is not None:
            peer.last_seen = time.monotonic()

    def _peer_address(self, identity: str) -> str | None:
        peer = self.peers.get(identity)
        return peer.control if peer is not None else None

    def _close_transport(self) -> None:
        for peer in list(self.peers.values()):
            if peer.link is not None:
                peer.link.close(flush=True)
        if self.faults is not None:
            for link in self.faults.stale_links:
                link.close(flush=False)
            self.faults.stale_links.clear()
        if self.verbs_device is not None:
            self.verbs_device.close()
        self._checksummer.close()

    # the API ---------------------------------------------------------------------------------------
    def admit(self, rid: Any, tokens: int, *, external_pages: bool = False, peer: str | None = None) -> SendRequest:
        """Admit a prompt or raise :class:`AdmissionRejected` (nothing held, no byte moves).

        ``peer`` (a decode engine id), when the caller knows it, binds the request to that decode:
        no other peer can give it a destination or reject it."""
        self._check_open()
        return self.sender.admit(rid, tokens, external_pages=external_pages, peer=peer)

    def wait_ready(self, rid: Any, *, timeout: float = 30.0) -> SendRequest:
        """Block until decode's destination pages are known (or the request ended)."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while True:
                req = self.sender._lookup(rid)
                if req.state is not SenderState.ADMITTED:
                    if req.fsm.terminal and req.error is not None:
                        raise req.error
                    return req
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferFailed(f"no destination after {timeout:g} s", reason="wait_timeout", rid=rid)
                self.sender.changed.wait(min(left, 0.1))

    def source_pages(self, rid: Any) -> np.ndarray:
        return self.sender.source_pages(rid)

    def send(self, rid: Any, src_pages: Any = None, *, count: int | None = None, aux: bytes = b"",
             ready: Any = None) -> SendRequest:
        """Post the next chunk (default: everything left); the final chunk posts DONE behind it.
        ``ready`` (e.g. a CUDA event recorded after the kernel that writes the source pages) is
        waited on before the transport reads them."""
        self._check_open()
        return self.sender.send(rid, src_pages, count=count, aux=aux, ready=ready)

    def refuse(self, rid: Any, reason: str = "aborted", detail: str = "the prefill gave up on the request") -> None:
        """Give up on a request not admitted here: a decode's destination for it gets REJECT at once."""
        self._check_open()
        self.sender.refuse(rid, reason, detail)

    def abort(self, rid: Any, reason: str = "aborted by caller") -> SendRequest:
        self._check_open()
        return self.sender.abort(rid, reason)

    def status(self, rid: Any) -> SendRequest:
        with self.lock:
            return self.sender._lookup(rid)

    def wait(self, rid: Any, *, timeout: float = 30.0) -> SendRequest:
        """Block until the request is terminal and quiescent (its source memory reusable)."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while True:
                req = self.sender._lookup(rid)
                if self.sender.settled(req):
                    return req
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferFailed(f"still {req.state.value} after {timeout:g} s", reason="wait_timeout",
                                         rid=rid, generation=req.gen or None)
                self.sender.changed.wait(min(left, 0.1))

    def check_accounting(self) -> dict[str, int]:
        return self.sender.check_accounting()

    def stats(self) -> dict[str, Any]:
        with self.lock:
            links = [p.link for p in self.peers.values() if p.link is not None]
            return {
                "engine": self.engine_id,
                "role": self.role,
                "pages": self.pool.ledger.counts(),
                "pool_total": self.layout.num_pages,
                "pool_free": self.pool.ledger.free_count,
                "requests": dict(self.sender.stats),
                "bytes_sent": sum(link.bytes_sent for link in links),
                "engine_counters": dict(self.counters),
                "active": len(self.sender.active),
                "faults": dict(self.faults.counts) if self.faults is not None else {},
            }
