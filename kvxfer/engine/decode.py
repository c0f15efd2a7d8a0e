"""DecodeEngine: the receiving role wired to the control plane and a receiver transport."""

from __future__ import annotations

import logging
import random
import secrets
import time
from typing import Any

from ..core.arguments import check_rid, split_tcp_endpoint
from ..core.layout import KVLayout
from ..core.lifecycle import ReceiverState
from ..errors import ConfigError, InvalidArgument, PeerError, ProtocolError, TransferFailed
from ..transport.base import ReceiverBackend, ReceiverHooks
from ..transport.faults import FaultInjector
from ..wire import messages as m
from ..wire.auth import is_loopback, split_address
from ..wire.trust import PeerAllowlist, key_problem
from .base import ORDERED_MESSAGES, EngineBase
from .config import EngineConfig
from .reads import KVRead
from .receiver import PeerInfo, Receiver, ReceiveRequest

log = logging.getLogger("kvxfer.engine")
# refuse()'s HELLOs that wait for no caller (each lives until its answer or peer_timeout): beyond this many
# the oldest is dropped (its answer then finds no session and is refused), so refusals aimed at addresses
# nobody answers from cannot grow the table without bound
MAX_DETACHED_HELLOS = 1024
RETAIN_INTERVAL_S = 1.0  # how often _tick closes control sockets no peer or pending HELLO uses
# Offering the next data connection after one ended: at once (REOFFER_MIN_S) after a connection that had
# lived STABLE_CONNECTION_S; after each that did not, twice as long, up to REOFFER_MAX_S, each delay drawn
# within +-50% (jitter: many decodes cut off together do not all dial back at once). A peer silent past
# peer_timeout gets no offer until it is heard from again.
REOFFER_MIN_S = 0.05
REOFFER_MAX_S = 5.0
STABLE_CONNECTION_S = 5.0

class DecodeEngine(EngineBase):
    """The receiving role: reserves pages, lands verified writes, gates reads.

    What it holds for others: a :class:`PeerInfo` and a data connection per prefill it peered with, a
    control socket per address a peer or a pending HELLO uses (``_pending_hello``: a :meth:`connect`
    in progress, or a HELLO of :meth:`refuse` or of peering again, waiting for its answer). A failed
    :meth:`connect` leaves neither entry nor socket behind; any other socket is closed by the control
    thread once unused for a second or more (:meth:`_retain_control`)."""

    role = "decode"
    worker_name = "verify"

    def __init__(self, layout: KVLayout, config: EngineConfig, *, faults: FaultInjector | None = None) -> None:
        super().__init__(layout, config, faults=faults)
        self.receiver = Receiver(
            self.pool,
            max_inflight=config.max_inflight,
            transfer_timeout=config.transfer_timeout,
            drain_timeout=config.drain_timeout,
            grant=lambda conn, gen, pages: self.transport.grant(conn, gen, pages),
            revoke=lambda conn, gen: self.transport.revoke(conn, gen),
            answer=lambda conn, msg: self.transport.answer(conn, msg),
            **self._role_settings(),
        )
        self.receiver.guard.on_refused = self._write_refused
        self.receiver.guard.requires_final = self.capabilities.requires_final
        self._pending_hello: dict[bytes, dict[str, Any]] = {}
        self._trusted = PeerAllowlist.parse(config.trusted_prefills)
        self._next_retain = 0.0  # when _tick next closes control sockets nothing uses
        self._unused_control: set[str] = set()  # addresses whose socket was unused at that pass
        hooks = ReceiverHooks(on_connect=self._on_data_connect, on_ordered=self.receiver.on_ordered,
                              on_closed=self._on_data_closed, on_event=self._event)
        self.transport: ReceiverBackend = self._open_transport(
            lambda: self.transport_factory.receiver(layout, self.receiver.guard, config, hooks))
        self.data_address = self.transport.address
        self._start()

    # peering ---------------------------------------------------------------------------------------
    def connect(self, prefill_address: str, *, timeout: float = 10.0) -> str:
        """Peer with the prefill engine at ``prefill_address``; returns its engine id.

        However it ends, its pending-HELLO entry is gone when this returns or raises; one that fails
        (refused by the prefill, no answer within ``timeout``, or an address this engine refuses to
        talk to before sending anything: :class:`PeerError` naming the address) also closes the control
        socket to ``prefill_address`` unless a peer or another pending HELLO uses it."""
        self._check_open()
        self._check_trusted(prefill_address)
        session = secrets.token_bytes(16)
        hello = self._hello(session)
        with self.lock:
            self._pending_hello[session] = {"address": prefill_address, "error": None, "peer": None}
        peered = False
        try:
            self.control.send(prefill_address, hello)
            deadline = time.monotonic() + timeout
            with self.lock:
                while True:
                    entry = self._pending_hello[session]
                    if entry["error"] is not None:
                        raise PeerError(f"peering with {prefill_address} refused: {entry['error']}")
                    peer = entry["peer"]
                    info = self.receiver.peers.get(peer) if peer is not None else None
                    if info is not None and info.connected:  # both halves hold it
                        peered = True
                        return peer
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise PeerError(f"no answer from prefill at {prefill_address} within {timeout:g} s"
                                        f"{self._reply_hint(prefill_address)}")
                    self.receiver.changed.wait(min(left, 0.1))
        finally:
            with self.lock:
                self._pending_hello.pop(session, None)
                if not peered:
                    self._release_control(prefill_address)

    def peer_connected(self, peer: str, *, wait: float = 2.0) -> bool:
        """Whether both halves hold ``peer``'s data connection (:attr:`PeerInfo.connected`), so a request
        admitted now binds. While only its CONNECT has arrived (the writer's ACCEPT is on the way, after a
        fence or a reconnect) this waits up to ``wait`` seconds for it; a peer not connecting at all is
        answered at once."""
        deadline = time.monotonic() + wait
        with self.lock:
            while True:
                info = self.receiver.peers.get(peer)
                if info is None or not info.attached:
                    return False
                if info.connected:
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.receiver.changed.wait(min(left, 0.1))

    def _hello(self, session: bytes) -> m.Hello:
        return m.Hello(
            engine=self.engine_id, role="decode", session=session, reply_to=self.address,
            transport=self.config.transport,
            page_size=self.layout.page_size, num_pages=self.layout.num_pages,
            item_lens=[int(x) for x in self.layout.item_lens], pool_tokens=self.layout.pool_tokens,
            max_context=self.config.max_context, checksum=self.config.checksum, geometry=self.layout.geometry,
        )

    def refuse(self, rid: Any, prefill_address: str, *, reason: str = "refused",
               detail: str = "the decode will not take this request") -> int:
        """Tell the prefill at ``prefill_address`` that this decode will not take request ``rid``
        (nothing is reserved here): the prefill's half fails at once with ``detail``, or its admission
        does when it has not admitted ``rid`` yet. For what a decode refuses before its own admission
        runs (a layout it cannot serve, a setting it does not support).

        Works whether or not the two are peered: without a peering this sends a HELLO first, on the
        same ordered control socket, and a prefill that refuses that HELLO for this decode's layout or
        a full peer table still takes its REJECTs (for its ``meta_timeout``). A HELLO it accepts starts
        a peering, as :meth:`connect` would. Nothing waits for an answer. Returns the generation that
        names this refusal. An address this engine will not talk to (with a keyring: one without a
        trusted key) raises :class:`PeerError` naming it, and leaves no pending HELLO and no socket."""
        self._check_open()
        rid = check_rid(rid)
        if not isinstance(reason, str) or not isinstance(detail, str) or not isinstance(prefill_address, str):
            raise InvalidArgument("reason, detail and prefill_address must be strings", rid=rid)
        self._check_trusted(prefill_address)
        with self.lock:
            gen = self.receiver.new_generation()
            peered = any(p.control == prefill_address for p in self.receiver.peers.values())
            hello = None
            session = b""
            if not peered:
                session = secrets.token_bytes(16)
                self._add_detached_hello(session, prefill_address, time.monotonic() + self.config.peer_timeout)
                hello = self._hello(session)
            self.counters["refused_requests"] += 1
        try:
            if hello is not None:
                self.control.send(prefill_address, hello)
            self.control.send(prefill_address, m.Reject(rid=rid, gen=gen, reason=reason[:200],
                                                         detail=detail[:4000]))
        except PeerError:  # an address this engine will not talk to, or a full queue: nothing waits for it
            with self.lock:
                self._pending_hello.pop(session, None)
                self._release_control(prefill_address)
            raise
        return gen

    def _reply_hint(self, prefill_address: str) -> str:
        """Why a prefill on another host may not have answered: this engine asks for answers at its own
        loopback address (``host`` left at its default)."""
        try:
            host, _port = split_tcp_endpoint(split_address(prefill_address)[0])
        except (InvalidArgument, PeerError):
            return ""
        if is_loopback(self.advertised_host) and not is_loopback(host):
            return (f" (this decode asks for answers at {self.address}, its own loopback, which a prefill on "
                    "another host cannot reach: set host or advertise_host, KVXFER_HOST / KVXFER_ADVERTISE_HOST)")
        return ""

    def _check_trusted(self, address: Any) -> None:
        """Refuse (:class:`PeerError` naming it, nothing opened) an address this decode does not trust
        (:mod:`kvxfer.wire.trust`): callers name addresses clients gave them."""
        if not isinstance(address, str):
            raise PeerError(f"a prefill address is a string tcp://host:port, got {type(address).__name__}")
        try:
            why = key_problem(address, self.control.keyring)
            if why is not None:
                raise PeerError(f"refusing to connect to prefill at {address[:200]}: {why}")
            self._trusted.check(address, keyed=self.control.keyring is not None)
        except PeerError:
            self.counters["untrusted_addresses"] += 1
            raise

    def _add_detached_hello(self, session: bytes, address: str, until: float) -> None:
        """Record a HELLO to ``address`` nobody waits for (under the lock): kept until its answer comes
        or ``until``; at most :data:`MAX_DETACHED_HELLOS` at once (the oldest goes first)."""
        detached = [k for k, e in self._pending_hello.items() if "detached_until" in e]
        for old in detached[:max(0, len(detached) - MAX_DETACHED_HELLOS + 1)]:
            del self._pending_hello[old]
        self._pending_hello[session] = {"address": address, "error": None, "peer": None, "detached_until": until}

    def _control_in_use(self) -> set[str]:
        """Addresses whose control socket is needed (under the lock): every peer's, and every pending
        HELLO's (its answer may still come, and a REJECT may queue behind it)."""
        used = {p.control for p in self.receiver.peers.values()}
        used.update(e["address"] for e in self._pending_hello.values())
        return used

    def _release_control(self, address: str) -> None:
        """Close the control socket to ``address`` unless a peer or a pending HELLO uses it. Under the
        lock, so no use of it can start between the check and the close."""
        with self.lock:
            if address not in self._control_in_use():
                self.control.forget(address)

    def _retain_control(self) -> None:
        """Close the control sockets no peer or pending HELLO used at this pass nor at the previous one
        (at least :data:`RETAIN_INTERVAL_S` apart), so what was queued just before a HELLO's answer
        (refuse()'s REJECT) still goes out. Bounds the sockets to what peers and pending HELLOs use."""
        with self.lock:
            unused = self.control.addresses() - self._control_in_use()
            for address in unused & self._unused_control:
                self.control.forget(address)
            self._unused_control = unused - self._unused_control

    def _dispatch(self, identity: str, msg: m.Message) -> None:
        if isinstance(msg, m.HelloAck):
            self._on_hello_ack(identity, msg)
            return
        if identity not in self.receiver.peers:
            raise PeerError(f"{msg.TYPE} from {identity!r}, which is not a peer")
        if isinstance(msg, m.Heartbeat):
            return
        if isinstance(msg, m.Accept):
            self._on_accept(identity, msg)
            return
        if self.capabilities.ordered_via_control and isinstance(msg, ORDERED_MESSAGES):
            # The writer sent it only after every write before it completed (drain proof).
            conn = self.receiver.peers[identity].conn
            if conn is None:
                raise PeerError(f"{msg.TYPE} from {identity!r}, which has no data connection")
            self.transport.sync(conn, msg.gen if isinstance(msg, m.Done) else None)
            self.receiver.on_ordered(conn, msg)
            return
        if isinstance(msg, m.Reject):
            # Rejections normally travel on the ordered data path; one here means the writer has no
            # data connection, so treat it as an abort request (quarantine until proven drained).
            with self.lock:
                req = self.receiver.active.get(msg.rid)
                leg = req.leg(msg.gen) if req is not None else None
                if leg is not None and leg.peer == identity:
                    self.receiver.abort(msg.rid, f"prefill {identity} rejected it: {msg.detail}", failure=True,
                                        generation=req.gen)
            return
        if isinstance(msg, m.Fenced):
            # the writer's end of a connection ended: fence ours now (nothing more lands) and offer anew
            conn = self.receiver.peers[identity].conn
            if conn is not None and conn[1] == msg.epoch:
                self.fence(conn, f"the writer closed it: {msg.reason}"[:4000])
            return
        raise ProtocolError(f"{msg.TYPE} is not a message a decode engine accepts")

    def _on_hello_ack(self, identity: str, msg: m.HelloAck) -> None:
        with self.lock:
            entry = self._pending_hello.get(msg.session)
            if entry is None:
                raise PeerError("HELLO_ACK for a session this engine did not open")
            problem = "" if msg.ok else (msg.error or "refused")
            if not problem:
                try:
                    self.layout.check_compatible(
                        {"page_size": msg.page_size, "item_lens": msg.item_lens, "geometry": msg.geometry},
                        peer_name=identity,
                    )
                except ConfigError as exc:
                    problem = str(exc)
            if "detached_until" in entry:  # a HELLO of refuse(): nobody waits for this answer
                del self._pending_hello[msg.session]
            old = self.receiver.peers.get(identity)
            if problem:
                entry["error"] = problem
            else:
                info = PeerInfo(
                    engine=identity, control=entry["address"], session=msg.session,
                    pool_tokens=msg.pool_tokens, max_context=msg.max_context, page_size=msg.page_size,
                    geometry=msg.geometry, last_seen=time.monotonic(),
                )
                if old is not None:  # peering again: epochs keep increasing, the old connection goes
                    info.epoch = max(old.epoch, old.offered)
                self.receiver.add_peer(info)
                entry["peer"] = identity
            self.receiver.changed.notify_all()
        if problem:
            return
        if old is not None and old.conn is not None:
            self.fence(old.conn, "peering replaced by a new HELLO", offer=False)
        if old is not None and old.offered > old.epoch:
            self.transport.withdraw(identity, old.offered)
        self._offer(identity)

    def _offer(self, identity: str) -> None:
        """Prepare a data connection for ``identity`` under the next epoch and send OFFER."""
        with self.lock:
            info = self.receiver.peers.get(identity)
            if info is None or self._closed:
                return
            stale = info.offered if info.offered > info.epoch else None
            epoch = max(info.epoch, info.offered) + 1
            info.offered = epoch
            info.offer_nonce = nonce = secrets.token_bytes(16)
            info.offered_at = time.monotonic()
            info.reoffer_at = None
            session = info.session
        if stale is not None:
            self.transport.withdraw(identity, stale)
        try:
            blob = self.transport.offer(identity, session, epoch)
        except Exception as exc:
            self._warn(log, identity, "%s: cannot prepare a data connection for %s: %s", self.engine_id, identity, exc)
            with self.lock:
                entry = next((e for e in self._pending_hello.values() if e.get("peer") == identity), None)
                if entry is not None:
                    entry["error"] = f"cannot prepare a data connection: {exc}"
                info.reoffer_at = time.monotonic() + 1.0
                self.receiver.changed.notify_all()
            return
        self._send_to_peer(identity, m.Offer(epoch=epoch, nonce=nonce, blob=blob))

    def _on_accept(self, identity: str, msg: m.Accept) -> None:
        with self.lock:
            info = self.receiver.peers[identity]
            if msg.epoch != info.offered:
                raise PeerError(f"ACCEPT for epoch {msg.epoch}, which is not the offered one ({info.offered})")
            if msg.engine != identity or not m.proof_matches(msg.proof, info.session, info.offer_nonce,
                                                             identity, msg.epoch):
                raise PeerError(f"ACCEPT from {identity!r} with a wrong proof for epoch {msg.epoch}")
            info.accepted = msg.epoch
            self.receiver.changed.notify_all()
            if info.epoch == msg.epoch:
                return  # already connected under this epoch (its data path announced it first)
        conn = self.transport.accept(identity, info.session, msg.epoch, msg.blob)
        if conn is None:
            return  # the data path announces the connection itself (CONNECT first)
        with self.lock:
            info.epoch = msg.epoch
            info.conn = conn
            info.ready = True
            info.connected_at = time.monotonic()
            self.receiver.changed.notify_all()

    def _on_data_connect(self, msg: m.Connect) -> Any:
        with self.lock:
            info = self.receiver.peers.get(msg.engine)
            why = ""
            if info is None:
                why = "unknown peer"
            elif msg.epoch != info.offered or msg.epoch <= info.epoch:
                why = f"epoch {msg.epoch} is not the offered one ({info.offered})"
            elif not m.proof_matches(msg.proof, info.session, info.offer_nonce, msg.engine, msg.epoch):
                why = "wrong proof"
            if why:
                self._event("refused_connection", counter="refused_connections", peer=msg.engine, why=why)
                self._warn(log, msg.engine[:64], "%s: data connection from %r refused: %s", self.engine_id, msg.engine, why)
                return None
            info.epoch = msg.epoch
            info.conn = (msg.engine, msg.epoch)
            info.ready = True
            info.connected_at = time.monotonic()
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
        self._reoffer_soon(conn)

    def _reoffer_soon(self, conn: Any) -> None:
        """After connection ``conn`` ended: offer the next epoch from the control thread, after a
        backoff that grows while connections end young (see :data:`REOFFER_MIN_S`)."""
        with self.lock:
            info = self.receiver.peers.get(conn[0])
            if info is None or self._closed:
                return
            now = time.monotonic()
            if info.epoch == conn[1] and info.offered <= info.epoch:  # the live connection ended
                lived = now - info.connected_at if info.connected_at else 0.0
                info.short_lived = 0 if lived >= STABLE_CONNECTION_S else info.short_lived + 1
                info.conn = None
                info.connected_at = 0.0
                info.reoffer_at = now + self._offer_delay(info)
            elif info.offered == conn[1] and info.epoch < conn[1]:  # the pending offer died before CONNECT
                info.short_lived += 1
                info.reoffer_at = now + self._offer_delay(info)

    @staticmethod
    def _offer_delay(info: PeerInfo) -> float:
        """The wait before the next offer to ``info``'s writer: exponential in its short-lived connections
        in a row, with jitter."""
        if info.short_lived <= 0:
            return REOFFER_MIN_S
        base = min(REOFFER_MIN_S * (2 ** min(info.short_lived, 16)), REOFFER_MAX_S)
        return base * random.uniform(0.5, 1.5)

    def forget(self, peer: str, reason: str = "forgotten by the caller") -> bool:
        """Drop prefill ``peer``: its data connection is fenced (its requests settle), an offer not yet
        taken is withdrawn, and its entry and control socket go. A prefill that comes back is peered
        with by :meth:`connect` again. Returns whether it was known. Also done by the control thread to
        a prefill silent for ``peer_expiry`` (at least ``peer_timeout``)."""
        self._check_open()
        return self._forget(peer, reason)

    def _forget(self, peer: str, reason: str) -> bool:
        with self.lock:
            info = self.receiver.peers.pop(peer, None)
            if info is None:
                return False
            conn, pending = info.conn, (info.offered if info.offered > info.epoch else None)
            info.conn, info.ready, info.reoffer_at = None, False, None
            for session in [k for k, e in self._pending_hello.items() if e.get("peer") == peer]:
                del self._pending_hello[session]
            self.receiver.changed.notify_all()
        if conn is not None:
            if not self.fence(conn, f"peer {peer} forgotten: {reason}", offer=False):
                self.receiver.on_connection_closed(conn, f"peer {peer} forgotten: {reason}")
        if pending is not None:
            self.transport.withdraw(peer, pending)
        self._release_control(info.control)
        self._event("peer_forgotten", counter="peers_forgotten", peer=peer[:200], why=reason[:500])
        return True

    def fence(self, conn: Any, reason: str, *, offer: bool = True) -> bool:
        """Fence a data connection: after this returns nothing from it can land. Never under lock.
        Then (``offer``) the peer is offered the next epoch."""
        closed = self.transport.fence(conn)
        if closed:
            self._event("fence", counter="fences", limit_key="", peer=conn[0], epoch=conn[1], reason=reason[:500])
            self._warn(log, conn[0][:64], "%s: fenced data connection %s: %s", self.engine_id, conn, reason)
            self.receiver.on_connection_closed(conn, f"fenced: {reason}")
            peer, epoch = conn
            self._send_to_peer(peer, m.Fenced(epoch=epoch, reason=reason[:4000]))
            if offer:
                self._reoffer_soon(conn)
        return closed

    def _tick(self) -> None:
        self.transport.flush()  # RESULT frames a slow writer left part-sent
        for conn, reason in self.receiver.tick():
            self.fence(conn, reason)
        now = time.monotonic()
        with self.lock:  # refuse()'s HELLOs that no answer came for
            for session in [k for k, e in self._pending_hello.items() if e.get("detached_until", now + 1) <= now]:
                del self._pending_hello[session]
        if now >= self._next_retain:
            self._next_retain = now + RETAIN_INTERVAL_S
            self._retain_control()
        dead = []
        offers = []
        expired = []
        expiry = max(self.config.peer_expiry, self.config.peer_timeout)
        with self.lock:
            for info in self.receiver.peers.values():
                silent = now - info.last_seen
                if silent > expiry:
                    expired.append((info.engine, silent))
                    continue
                if silent > self.config.peer_timeout:
                    pass  # no offer to a writer cut off: _note_alive offers when it is heard from again
                elif info.reoffer_at is not None and now >= info.reoffer_at:
                    offers.append(info.engine)
                elif (info.conn is None and info.offered > info.epoch
                      and now - info.offered_at > self.config.peer_timeout):
                    offers.append(info.engine)  # the OFFER went unanswered: a fresh one
                if info.ready and silent > self.config.peer_timeout:
                    info.ready = False
                    dead.append(info)
        for name, silent in expired:
            self._forget(name, f"silent for {silent:.1f} s (peer_expiry {expiry:g} s)")
        for name in offers:
            self._offer(name)
        for info in dead:
            self._event("dead_peer", counter="dead_peers", peer=info.engine, silent_s=round(now - info.last_seen, 3))
            self._warn(log, info.engine, "%s: peer %s silent for %.1f s: dead", self.engine_id, info.engine,
                       now - info.last_seen)
            if info.conn is not None:
                self.fence(info.conn, f"peer {info.engine} dead (silent for {now - info.last_seen:.1f} s)")

    def _on_not_peered(self, identity: str, msg: m.Error) -> None:
        """The prefill says it holds no peering with this engine (it forgot it): peer again."""
        self._repeer(identity, f"it holds no peering with this engine: {msg.detail[:200]}")

    def _repeer(self, identity: str, why: str) -> None:
        """Prefill ``identity`` forgot this engine: its data connection is fenced at once (nothing more
        lands; its requests settle), and a HELLO goes to its address again with nobody waiting for the
        answer, so the peering comes back by itself. At most once a second per peer."""
        now = time.monotonic()
        with self.lock:
            info = self.receiver.peers.get(identity)
            if info is None or self._closed or now < info.repeer_after:
                return
            info.repeer_after = now + 1.0
            info.ready = False
            conn = info.conn
            session = secrets.token_bytes(16)
            self._add_detached_hello(session, info.control, now + max(self.config.peer_timeout, 60.0))
            hello = self._hello(session)
            self.receiver.changed.notify_all()
        self._event("repeer", counter="repeers", peer=identity[:200], why=why[:500])
        if conn is not None:
            self.fence(conn, f"prefill {identity}: {why}", offer=False)
        try:
            self.control.send(info.control, hello)
        except PeerError as exc:
            with self.lock:  # nothing will answer it: the next repeer sends another
                self._pending_hello.pop(session, None)
            self._warn(log, identity, "%s: cannot HELLO %s again: %s", self.engine_id, identity, exc)

    def _heartbeat(self) -> None:
        self._hb_seq += 1
        for peer in list(self.receiver.peers):
            self._send_to_peer(peer, m.Heartbeat(engine=self.engine_id, seq=self._hb_seq))

    def _note_alive(self, identity: str) -> None:
        info = self.receiver.peers.get(identity)
        if info is not None:
            now = time.monotonic()
            if now - info.last_seen > self.config.peer_timeout and info.conn is None:
                # heard from again after a silence (a partition healed): offer a data connection soon
                info.reoffer_at = now + self._offer_delay(info)
            info.last_seen = now
            if info.conn is not None:
                info.ready = True

    def _peer_address(self, identity: str) -> str | None:
        info = self.receiver.peers.get(identity)
        return info.control if info is not None else None

    def _close_transport(self) -> None:
        self.transport.close()
        self._worker.close()

    # the API ---------------------------------------------------------------------------------------
    def admit(self, rid: Any, tokens: int, *, peer: str | None = None, pages: Any = None,
              peers: list[str] | None = None) -> ReceiveRequest:
        """Admit a request and reserve its pages (or refuse: see :meth:`Receiver.admit`). ``peers``:
        every prefill rank this rank takes KV from, in rank order, when their tensor parallelism
        differs from this engine's (each writes its heads' slice of every page).

        A peer whose new data connection is up on this side while its ACCEPT is still on the way (just
        after a fence or a reconnect) is waited for, briefly (:meth:`peer_connected`); one that is not
        connected then is refused ("not connected"), never bound to a link its writer does not hold."""
        self._check_open()
        if peers:
            names = list(peers)
        elif peer is not None:
            names = [peer]
        else:
            with self.lock:
                names = [p.engine for p in self.receiver.peers.values() if p.attached]
        for name in names:
            if isinstance(name, str):  # anything else is refused by the receiver, naming it
                self.peer_connected(name)
        return self.receiver.admit(rid, tokens, peer=peer, pages=pages, peers=peers)

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
        """A read lease on a readable request (:class:`~kvxfer.engine.reads.KVRead`; a context manager):
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
            data_path = self.transport.stats()
            return {
                "engine": self.engine_id,
                "role": self.role,
                "pages": self.pool.ledger.counts(),
                "pool_total": self.layout.num_pages,
                "pool_free": self.pool.ledger.free_count,
                "requests": dict(self.receiver.stats),
                "writes": self.receiver.guard.counters(),
                "engine_counters": dict(self.counters),
                "transport": self.transport.name,
                "write_window": self.transport.write_window,
                "protocol_errors": data_path.get("protocol_errors", 0),
                "data_path": data_path,
                "active": len(self.receiver.active),
                # per prefill: the newest data-connection epoch offered, and whether both halves hold one
                "peers": {name: {"offered": info.offered, "epoch": info.epoch, "connected": info.connected}
                          for name, info in self.receiver.peers.items()},
            }


# prefill -----------------------------------------------------------------------------------------------


