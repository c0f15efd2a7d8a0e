"""What both roles share: the control thread, peer bookkeeping hooks, close(), and the checksum worker.

:class:`EngineBase` owns a page pool over a :class:`~kvxfer.core.layout.KVLayout`, a control plane and a
control thread that receives messages, applies timeouts and sends heartbeats. Locking: one
re-entrant lock per engine guards the role logic, its ledger and its write guard; no thread holds it
while blocking on I/O, and fencing (which joins a data thread) happens outside it.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections import Counter
from typing import Any

from ..core.layout import KVLayout
from ..core.pool import PagePool, check_capacity
from ..errors import ConfigError, EngineClosed, KvxferError, NotPeered, PeerError, ProtocolError, TransportError
from ..transport import registry
from ..transport.faults import FaultInjector
from ..wire import messages as m
from ..wire.addresses import advertised_host
from ..wire.control import ControlPlane
from .config import EngineConfig
from .events import EventLog
from .metrics import EngineMetrics

log = logging.getLogger("kvxfer.engine")

ORDERED_MESSAGES = (m.Done, m.DrainAck, m.Reject, m.Abort)


class EngineHooks:
    """Test seams an engine calls at a few points; the default does nothing. A
    :class:`~kvxfer.transport.faults.FaultInjector` implements them for ``kvxfer stress`` and tests,
    so no fault logic lives in the roles."""

    def drop_message(self, msg: m.Message) -> bool:
        """True: the prefill acts as if control message ``msg`` never arrived."""
        return False

    def retire_link(self, link: Any) -> bool:
        """True: the hook keeps a replaced or fenced link (and closes it in :meth:`close`)."""
        return False

    def close(self) -> None:
        """Release whatever the hooks kept."""


def _engine_id(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class EngineBase:
    """What both roles share: the page pool, control plane and control thread, events, metrics and
    close(); ``lock`` guards the role logic, its ledger and its write guard."""

    role = "engine"
    worker_name = "worker"  # the checksum worker thread's name

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
        self.hooks: Any = faults if faults is not None else EngineHooks()
        self.transport_factory = registry.get(config.transport)
        self.capabilities = self.transport_factory.capabilities
        self.engine_id = config.engine_id or _engine_id(self.role)
        self.lock = threading.RLock()
        self.pool = PagePool(layout, alloc_policy=config.alloc_policy, free_policy=config.free_policy,
                             seed=config.seed)
        self.events = EventLog(self.engine_id, self.role)
        self.advertised_host = advertised_host(config.host, config.advertise_host)
        self.control = ControlPlane(self.engine_id, host=config.host, port=config.control_port,
                                    keyring=config.load_keyring(), advertise=self.advertised_host)
        self.address = self.control.address
        self.counters: Counter[str] = Counter()
        self.metrics: EngineMetrics | None = None
        self._stop = threading.Event()
        self._closed = False
        self._hb_seq = 0
        self._next_heartbeat = 0.0
        self._thread = threading.Thread(target=self._loop, name=f"kvxfer-{self.role}-control", daemon=True)
        # checksum passes off the data threads: verification on decode, source sums on prefill
        self._worker = _Worker(f"kvxfer-{self.role}-{self.worker_name}")

    def _role_settings(self) -> dict[str, Any]:
        """The keyword arguments both role logics (Receiver, Sender) take from the engine."""
        config = self.config
        return {"max_context": config.max_context, "checksum": config.checksum, "send": self._send_to_peer,
                "lock": self.lock, "unsafe_legacy": config.unsafe_legacy, "defer": self._worker.submit,
                "observer": self._observe, "warn": self._warn}

    def _open_transport(self, build: Any) -> Any:
        """``build()`` the role's half of the transport; on failure release what the engine holds."""
        try:
            return build()
        except OSError as exc:
            self._abandon()
            raise TransportError(f"cannot open the {self.config.transport} transport "
                                 f"({self.config.host}:{self.config.data_port}): {exc}") from exc
        except Exception:
            self._abandon()
            raise

    def _abandon(self) -> None:
        """Undo a constructor that failed after the control plane and the worker started."""
        self.control.close()
        self._worker.close()

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

    def _warn(self, target: logging.Logger, limit_key: str, msg: str, *args: Any, **kwargs: Any) -> None:
        """A WARNING line a peer can provoke: rate limited per (``msg``, ``limit_key``) by the event log's
        limiter, so a flood of messages cannot flood the log (the counters still count every one)."""
        self.events.log(target, logging.WARNING, limit_key, msg, *args, **kwargs)

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
            except Exception as exc:  # the control thread must survive anything a peer sends
                self.events.log(log, logging.ERROR, type(exc).__name__, "%s control loop error", self.engine_id,
                                exc_info=True)
                self.counters["control_loop_errors"] += 1

    def _handle(self, identity: str, data: bytes) -> None:
        try:
            msg = m.decode(data)
        except ProtocolError as exc:
            self._warn(log, identity, "%s: malformed control message from %r: %s", self.engine_id, identity, exc)
            self._event("malformed_message", counter="malformed_messages", limit_key=identity, peer=identity,
                        error=str(exc)[:500])
            self._reply_error(identity, "?", exc, address=getattr(exc, "reply_to", None))
            return
        self._note_alive(identity)
        if isinstance(msg, m.Error) and self._peer_address(identity) is not None:
            # a peer's word about something we sent (both roles): counted, and logged rate limited,
            # since a peer can answer every message it gets, and provoke them
            self.counters["peer_errors"] += 1
            if msg.code == NotPeered.code:
                self._on_not_peered(identity, msg)
                return
            self._warn(log, f"{identity}/{msg.about}/{msg.code}", "%s: peer %s reports about %s: %s",
                       self.engine_id, identity, msg.about, msg.detail)
            return
        try:
            self._dispatch(identity, msg)
        except KvxferError as exc:
            self._warn(log, f"{identity}/{exc.code}", "%s: %s from %r refused: %s", self.engine_id, msg.TYPE,
                       identity, exc)
            self._event("refused_message", counter="refused_messages", limit_key=f"{identity}/{exc.code}",
                        peer=identity, message=msg.TYPE, rid=getattr(msg, "rid", None), gen=getattr(msg, "gen", None),
                        code=exc.code, error=str(exc)[:500])
            self._reply_error(identity, msg.TYPE, exc, rid=getattr(msg, "rid", "?"), gen=getattr(msg, "gen", 0))

    def _reply_error(self, identity: str, about: str, exc: KvxferError, *, rid: Any = "?", gen: int = 0,
                     address: str | None = None) -> None:
        """ERROR back to a peer; ``address`` for one not peered yet (a HELLO of another protocol version),
        answered once over a socket of its own that is not kept (:meth:`ControlPlane.send_once`)."""
        error = m.Error(about=about, code=exc.code, detail=str(exc)[:4000],
                        rid=rid if rid not in (None, "") else "?", gen=gen or 0)
        peer_address = self._peer_address(identity)
        try:
            if peer_address is not None:
                self.control.send(peer_address, error)
            elif address is not None:
                self.control.send_once(address, error)
        except (PeerError, ProtocolError):
            pass

    def _send_to_peer(self, peer: str, msg: m.Message) -> None:
        address = self._peer_address(peer)
        if address is None:
            self._warn(log, peer, "%s: cannot send %s to unknown peer %r", self.engine_id, msg.TYPE, peer)
            return
        try:
            self.control.send(address, msg)
        except PeerError as exc:
            self._warn(log, peer, "%s: %s to %r not sent: %s", self.engine_id, msg.TYPE, peer, exc)

    # hooks for the roles ------------------------------------------------------------------------------
    def _dispatch(self, identity: str, msg: m.Message) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def _tick(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def _heartbeat(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def _note_alive(self, identity: str) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def _on_not_peered(self, identity: str, msg: m.Error) -> None:  # pragma: no cover - overridden
        """Peer ``identity`` says it holds no peering with this engine (it forgot this one)."""
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
        self.hooks.close()
        self.control.close()
        if self.metrics is not None:
            self.metrics.close()

    def _close_transport(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def __enter__(self) -> EngineBase:
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


