"""The transport contract: what a fabric implements so that the engine can move KV pages over it.

The engine and the roles (:mod:`kvxfer.engine`) never name a fabric. They hold a
:class:`ReceiverBackend` (decode side) or a :class:`SenderTransport` (prefill side), look up
behaviour in its declared :class:`Capabilities`, and pass the fabric's handshake along as opaque
bytes in the generic OFFER and ACCEPT control messages (protocol/SPEC.md, "Peering"). A new fabric is
one module plus one line in :mod:`kvxfer.transport.registry`.

Peering, for every transport (decode drives the epochs):

1. decode, after HELLO/HELLO_ACK: ``blob = backend.offer(peer, session, epoch)`` and sends
   OFFER{epoch, blob}. The blob holds whatever the writer needs to reach the decode's pool
   (a data address, a queue pair and rkeys, a shared ring's name).
2. prefill: ``link = transport.connect(LinkRequest(...))``. The link is the writer's half of
   connection ``(prefill engine id, epoch)``. It sends ACCEPT{engine, epoch, proof, link.accept_blob};
   the proof (:func:`kvxfer.wire.messages.connect_proof`) shows the session secret for this one offer
   without revealing it, and CONNECT frames carry the same proof.
3. decode: ``backend.accept(peer, session, epoch, blob)`` finishes the connection (verbs moves its
   queue pair to RTS) and returns its connection id, or None when the data path itself announces
   the connection (tcp and shm send CONNECT first on it; the backend then calls
   ``hooks.on_connect``).

After a fence, or when either side sees the connection end, decode offers ``epoch + 1``; a writer
only ever writes on the newest epoch it accepted, and the receiver only lands writes from
connections it has not fenced.

Invariants every backend keeps (the lifecycle and hostile-peer suites run against each one):

* a write lands only if :meth:`WriteGuard.check` allowed it for that connection, slot and
  generation, or, for a fabric where the hardware lands writes (``Capabilities.write_log``), the
  writer's write log is checked against the guard before completion is believed;
* an ordered message (DONE, DRAIN_ACK, REJECT, ABORT) is acted on only after every write posted
  before it on the same connection landed or was refused (a drain proof);
* :meth:`ReceiverBackend.fence` returns only when nothing more from that connection can land;
* a request's access to its pages is granted (:meth:`ReceiverBackend.grant`, whose bytes META
  carries) before its META is sent, and revoked (:meth:`ReceiverBackend.revoke`) before its pages are
  freed or reused: after verified completion, a drain proof or a fence. Where the fabric enforces
  the grant itself (verbs memory windows) a late or stale write then fails in the NIC; elsewhere the
  write guard is the enforcement and both calls are no-ops;
* every connection that ends is reported exactly once: to the fencer (``fence`` returns True) or
  through ``hooks.on_closed``;
* ``close()`` is idempotent.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from ..core.layout import KVLayout
from ..core.runs import WriteBatch
from ..core.writeguard import WriteGuard

ConnId = tuple[str, int]  # (writer engine id, epoch)
OnComplete = Callable[[WriteBatch, int, int], None]  # (batch, bytes completed, errors)


@dataclass(frozen=True)
class Capabilities:
    """What the engine needs to know about a fabric, declared instead of probed.

    ``write_log``: the receiver does not see individual writes land (the NIC places them); the
    writer attaches its write log to DONE and the receiver checks it against the guard.
    ``ordered_via_control``: ordered messages travel on the control plane, not the data path;
    the receiver calls :meth:`ReceiverBackend.sync` before acting on one.
    ``requires_final``: a generation's completion is proven only by a final tagged write
    (RDMA WRITE_WITH_IMM) seen on the same connection.
    ``raw_frames``: links accept :meth:`SenderLink.post_raw` (hostile-peer and fault tests).
    ``same_host``: both engines must run on one host (shared memory).
    ``sees_disconnect``: the receiver notices at once when the writer's end of a connection goes
    away (a socket closes, a ring is marked closed); where it cannot (an RC queue pair whose peer was
    destroyed looks idle), a dead writer is found by the peer timeout or the transfer timeout.
    """

    write_log: bool = False
    ordered_via_control: bool = False
    requires_final: bool = False
    raw_frames: bool = False
    same_host: bool = False
    sees_disconnect: bool = True


@dataclass
class ReceiverHooks:
    """What a receiver backend calls back into the decode engine (from its own threads).

    ``on_connect(connect_msg)`` -> connection id or None (refused) for fabrics whose data path
    opens with CONNECT; ``on_ordered(conn, msg)`` for ordered messages that arrive on the data
    path; ``on_closed(conn, reason)`` once for each connection that ended without being fenced."""

    on_connect: Callable[[Any], ConnId | None]
    on_ordered: Callable[[ConnId, Any], None]
    on_closed: Callable[[ConnId, str], None]
    # an off-the-happy-path event for the engine's counters and rate-limited event lines:
    # on_event(kind, **fields), e.g. on_event("accept_error", error="EMFILE")
    on_event: Callable[..., None] = lambda kind, **fields: None


class ReceiverBackend(abc.ABC):
    """The decode side of a fabric: lets writers place bytes in the pool, through the guard."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    address: str  # where this backend listens, for logs and stats (not a secret)
    # what confines a writer to a request's pages before its bytes land: "write_guard" (the receiver
    # checks every write, tcp and shm), "memory_windows" (the NIC, per request; verbs) or "region_rkey"
    # (nothing before landing: the write log is checked and the fence stops a liar; verbs without windows)
    write_window: str = "write_guard"

    @abc.abstractmethod
    def offer(self, peer: str, session: bytes, epoch: int) -> bytes:
        """Prepare connection ``(peer, epoch)`` and return the opaque blob the writer needs."""

    def accept(self, peer: str, session: bytes, epoch: int, blob: bytes) -> ConnId | None:
        """The writer's ACCEPT for an offer: finish the connection and return its id, or None
        when the data path announces the connection itself (CONNECT first)."""
        return None

    def withdraw(self, peer: str, epoch: int) -> None:  # noqa: B027 - optional
        """Forget an offer that was never accepted (the peer went away or a newer one replaced it)."""

    def grant(self, conn: ConnId, gen: int, pages: Any) -> bytes:
        """Let ``conn`` write generation ``gen``'s reserved ``pages`` and, where the fabric can enforce
        it, nothing else; returns the access blob META carries (b"": the offer's keys apply). Raises
        TransportError when the connection cannot take the request (nothing stays granted)."""
        return b""

    def revoke(self, conn: ConnId, gen: int) -> None:  # noqa: B027 - optional
        """Withdraw ``gen``'s grant: once this returns, no new write for it can land through the
        fabric's own checks. Called before the request's pages are freed or reused; idempotent; never
        raises (a fabric that cannot revoke cleanly stops the whole connection instead)."""

    def answer(self, conn: ConnId, msg: Any) -> bool:
        """Send ``msg`` (a RESULT) to the writer on data connection ``conn`` itself, without waiting:
        True when it was handed to the connection whole, False when the caller must send it on the
        control plane instead (the fabric cannot, the connection is ending, or its writer is not
        reading fast enough). Called from the engine's threads, maybe under the engine lock: it never
        waits and never calls back into the engine."""
        return False

    def flush(self) -> None:  # noqa: B027 - optional
        """Called on the engine's control thread every few milliseconds: send what :meth:`answer` left
        part-sent (a writer reading slowly); never waits."""

    def sync(self, conn: ConnId, gen: int | None = None) -> None:  # noqa: B027 - optional
        """Before an ordered message from the control plane is acted on: make sure everything the
        fabric already completed for ``conn`` reached the guard (``ordered_via_control`` only)."""

    @abc.abstractmethod
    def fence(self, conn: ConnId) -> bool:
        """Revoke ``conn``: when this returns nothing from it can land. True if it was live."""

    @abc.abstractmethod
    def connections(self) -> list[ConnId]:
        """Live connections."""

    def stats(self) -> dict[str, Any]:
        """Counters for :meth:`DecodeEngine.stats` (protocol errors, frames, ...)."""
        return {}

    @abc.abstractmethod
    def close(self) -> None:
        """Fence every connection (reporting each through ``on_closed``) and release the fabric."""

    def __enter__(self) -> ReceiverBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class LinkRequest:
    """Everything a :class:`SenderTransport` needs to open one link (one connection, one epoch)."""

    engine: str  # this (prefill) engine's id
    peer: str  # the decode engine's id
    epoch: int
    proof: bytes  # connect_proof(session, OFFER nonce, engine, epoch): what CONNECT carries
    blob: bytes  # the decode's OFFER blob
    on_closed: Callable[[SenderLink, str], None]
    send_control: Callable[[Any], None]  # send a control message to the peer (ordered_via_control)
    faults: Any = None  # a FaultInjector (tests and ``kvxfer stress`` only)
    # a message the receiver sent back on the data connection (RESULT, where the fabric carries it:
    # ReceiverBackend.answer), delivered from the transport's own thread
    on_message: Callable[[Any], None] | None = None


class SenderLink(abc.ABC):
    """The writer's half of one connection: posts writes and ordered messages, in order."""

    conn_id: ConnId
    epoch: int
    accept_blob: bytes = b""  # sent to the decode in ACCEPT
    bytes_sent: int = 0

    @property
    @abc.abstractmethod
    def alive(self) -> bool:
        """False once the connection ended (the link reported ``on_closed`` or was closed)."""

    @property
    def ended(self) -> bool:
        """True once the link has ended *and* reported every write it took (sent or failed): a write
        of an ended link that was not reported never will be (the prefill's accounting checks it)."""
        return False

    @abc.abstractmethod
    def post_writes(self, batch: WriteBatch, on_complete: OnComplete) -> None:
        """Queue a batch of writes; ``on_complete`` reports it once (possibly as failed)."""

    @abc.abstractmethod
    def post_ordered(self, msg: Any, *, slot: int, gen: int) -> None:
        """Send ``msg`` (or what ``msg()`` builds, for DONE) after everything posted before it."""

    def post_raw(self, pieces: list[Any]) -> None:
        """Send prepared frame bytes as they are (``Capabilities.raw_frames`` only)."""
        raise NotImplementedError(f"{type(self).__name__} does not send raw frames")

    def drain_messages(self) -> None:
        """Deliver (``LinkRequest.on_message``) what the receiver already sent back on the connection and
        this side has not read yet: called before the link's requests are settled, so a RESULT that
        came in order ahead of the connection's end is not lost. Never waits; by default nothing."""
        return None

    def prepare(self, batch: WriteBatch) -> None:
        """Called when a request's destination arrived, before its send: do for ``batch`` what can be
        done ahead (a small request's frame and descriptors), off the send's path. Optional; the
        batch is sent the same either way."""
        return None

    def hold(self) -> None:
        """Jobs posted from now until :meth:`unhold` start sending together then (a request's last
        writes and its DONE behind them, which a transport may send as one). Every ``hold`` is
        paired with an ``unhold`` (``try``/``finally``); by default nothing is held."""
        return None

    def unhold(self) -> None:
        """End a :meth:`hold`: what was posted meanwhile is scheduled now."""
        return None

    @abc.abstractmethod
    def close(self, *, flush: bool = True) -> None:
        """End the link: with ``flush``, after everything posted was sent. Idempotent."""

    def abort_connection(self) -> None:
        """Drop the connection abruptly, as a dying process would: nothing more is sent (tests)."""
        self.close(flush=False)


class SenderTransport(abc.ABC):
    """The prefill side of a fabric: opens links to the decodes that offer them."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]

    @abc.abstractmethod
    def connect(self, request: LinkRequest) -> SenderLink:
        """Open a link from an OFFER blob, or raise TransportError / ProtocolError (bad blob)."""

    def close(self) -> None:  # noqa: B027 - optional
        """Release what the transport holds beyond its links (a device context). Idempotent."""


@dataclass(frozen=True)
class TransportFactory:
    """One registered transport: its builders and its per-transport options class."""

    name: str
    summary: str
    capabilities: Capabilities
    receiver: Callable[..., ReceiverBackend]  # (layout, guard, config, hooks) -> backend
    sender: Callable[..., SenderTransport]  # (layout, config) -> transport
    options: type | None = None  # a dataclass of this transport's settings (EngineConfig.transport_options)
    available: Callable[[], tuple[bool, str]] = lambda: (True, "")


__all__ = ["Capabilities", "ConnId", "LinkRequest", "OnComplete", "ReceiverBackend", "ReceiverHooks",
           "SenderLink", "SenderTransport", "TransportFactory", "KVLayout", "WriteGuard"]
