"""PrefillEngine: the writing role wired to the control plane and a sender transport."""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.arguments import split_tcp_endpoint
from ..core.layout import KVLayout
from ..core.lifecycle import SenderState
from ..errors import ConfigError, InvalidArgument, NotPeered, PeerError, ProtocolError, TransferFailed, TransportError
from ..transport.base import LinkRequest, SenderLink, SenderTransport
from ..transport.faults import FaultInjector
from ..wire import messages as m
from ..wire.auth import is_loopback, split_address
from .base import EngineBase
from .config import EngineConfig
from .sender import Sender, SendRequest

log = logging.getLogger("kvxfer.engine")

# per-link counters of the sending paths taken, summed into stats()["link_paths"]
LINK_PATHS = ("sent_inline", "sent_early", "sent_with_ordered", "done_filled")
# what a refused HELLO says to a peer the keyring did not authenticate (the reason is in this engine's log)
HELLO_REFUSED = "peering refused by the prefill engine (its log says why)"
CONNECT_THREADS = 4  # threads opening data connections for every peer
CLOSE_THREADS = 4  # threads closing links the control thread retired (a close may wait for a stalled send)
# a decode that asks to peer again this long after its HELLO was answered, never having offered a
# connection, did not hear the answer (one that did offers at once)
UNHEARD_S = 1.0
RECEIVER_CLOSED = "the receiver"  # how a link's end reads when the decode closed its end (lanes' watcher)

@dataclass
class _Peer:
    """A decode this prefill peered with: its control address, session and current link."""

    engine: str
    control: str
    session: bytes
    page_size: int = 0  # the decode's tokens per page (its HELLO)
    geometry: Any = None  # the decode's KVGeometry, when its layout says what its pages hold
    link: SenderLink | None = None
    epoch: int = 0  # newest epoch offered by the decode (its link, once open, has this epoch)
    pending_offer: m.Offer | None = None  # the newest offer not yet taken by the connector
    connector: bool | None = None  # True while a connecting job (on the engine's pool) runs for this peer
    last_seen: float = 0.0
    answered_at: float = 0.0  # when this peering's HELLO was answered
    alive: bool = True
    link_lost_at: float = 0.0  # when the decode closed its end of our link (forgotten unless heard from soon)


class PrefillEngine(EngineBase):
    """The writing role: admits prompts, holds source pages, writes them into decode's pages."""

    role = "prefill"
    worker_name = "checksum"

    def __init__(self, layout: KVLayout, config: EngineConfig, *, faults: FaultInjector | None = None) -> None:
        super().__init__(layout, config, faults=faults)
        self.sender = Sender(
            self.pool,
            meta_timeout=config.meta_timeout,
            link_for=self._link_for,
            max_pending_meta=config.max_pending_meta,
            max_pending_meta_bytes=config.max_pending_meta_bytes,
            result_timeout=config.result_timeout,
            write_log=self.capabilities.write_log,
            peer_layout=self._peer_layout,
            **self._role_settings(),
        )
        self.peers: dict[str, _Peer] = {}  # at most config.max_peers; silent ones expire (_tick)
        # decodes whose HELLO was refused for what they are -> until when their REJECTs are taken (oldest first)
        self.refused_peers: dict[str, float] = {}
        self._next_retain = 0.0  # when _tick next closes control sockets no peer uses
        # a peer whose link the decode closed is forgotten when nothing came from it for this long (a live
        # decode that fenced offers anew at once, and heartbeats every heartbeat_interval)
        self._lost_grace = 2 * config.heartbeat_interval + 0.5
        # peers forgotten lately -> (their control address, when they may next be told so): a message from
        # one is answered NOT_PEERED there (at most once a second), so a decode that missed it peers again
        self._forgotten: collections.OrderedDict[str, list[Any]] = collections.OrderedDict()
        # opens links off the control thread (a connect may take seconds, and a peer can point it anywhere):
        # a few threads for every peer, not one per peer
        self._connectors = concurrent.futures.ThreadPoolExecutor(max_workers=CONNECT_THREADS,
                                                                 thread_name_prefix="kvxfer-prefill-connect")
        # closes links off the control thread: closing a link to a peer that stopped reading (a partition, a
        # hung process) waits for its sending lane to give up, and no other peer may wait for that
        self._closers = concurrent.futures.ThreadPoolExecutor(max_workers=CLOSE_THREADS,
                                                              thread_name_prefix="kvxfer-prefill-close")
        self.transport: SenderTransport = self._open_transport(lambda: self.transport_factory.sender(layout, config))
        self._start()

    # peering ---------------------------------------------------------------------------------------
    def _dispatch(self, identity: str, msg: m.Message) -> None:
        if isinstance(msg, m.Hello):
            self._on_hello(identity, msg)
            return
        peer = self.peers.get(identity)
        if peer is None:
            if isinstance(msg, m.Reject) and self._may_still_reject(identity):
                # a decode refused at peering (its layout, a full table) still refuses its requests here,
                # so their prefill half fails at once instead of waiting for a destination
                self.sender.on_reject(identity, msg)
                return
            self._tell_forgotten(identity, msg)
            raise NotPeered(f"{msg.TYPE} from {identity!r}, which is not a peer")
        if self.hooks.drop_message(msg):
            return
        if isinstance(msg, m.Offer):
            self._on_offer(peer, msg)
        elif isinstance(msg, m.Meta):
            self.sender.on_meta(identity, msg)
        elif isinstance(msg, m.Abort):
            self.sender.on_abort(identity, msg)
        elif isinstance(msg, m.Result):
            self.sender.on_result(identity, msg)
        elif isinstance(msg, m.Reject):
            self.sender.on_reject(identity, msg)
        elif isinstance(msg, m.Fenced):
            self._on_fenced(peer, msg)
        elif isinstance(msg, m.Heartbeat):
            return
        else:
            raise ProtocolError(f"{msg.TYPE} is not a message a prefill engine accepts")

    def _on_data_message(self, identity: str, msg: m.Message) -> None:
        """A RESULT the decode sent back on its data connection (the transport's thread): the same
        rules as one from the control plane; the connection was authenticated by its CONNECT proof."""
        if not isinstance(msg, m.Result):  # the transport lets nothing else through; kept as the rule
            raise ProtocolError(f"{msg.TYPE} may not travel back on a data connection")
        with self.sender.lock:
            self.sender.stats["results_on_data"] += 1
        self.sender.on_result(identity, msg)

    def _on_hello(self, identity: str, msg: m.Hello) -> None:
        self._check_reply_address(identity, msg.reply_to)
        problem = ""
        if msg.engine != identity:
            problem = f"HELLO names engine {msg.engine!r} but came from {identity!r}"
        elif msg.role != "decode":
            problem = f"HELLO from a {msg.role!r} engine; only decode engines peer with prefill"
        if problem:  # not a decode speaking for itself: nothing more is taken from it
            self._refuse_hello(identity, msg, problem)
            return
        if msg.transport != self.config.transport:
            problem = f"transport {msg.transport!r} != this engine's {self.config.transport!r}"
        elif msg.checksum != self.config.checksum:
            problem = f"checksum {msg.checksum!r} != this engine's {self.config.checksum!r}"
        else:
            try:
                self.layout.check_compatible({"page_size": msg.page_size, "item_lens": msg.item_lens,
                                              "geometry": msg.geometry}, peer_name=identity)
            except ConfigError as exc:
                problem = str(exc)
        if not problem:
            problem = self._make_room(identity)
        if problem:
            self._refuse_hello(identity, msg, problem, may_reject=True)
            return
        ack = m.HelloAck(
            engine=self.engine_id, role="prefill", session=msg.session, ok=True, error="",
            page_size=self.layout.page_size, num_pages=self.layout.num_pages,
            item_lens=[int(x) for x in self.layout.item_lens], pool_tokens=self.layout.pool_tokens,
            max_context=self.config.max_context, geometry=self.layout.geometry,
        )
        self.control.send(msg.reply_to, ack)
        now = time.monotonic()
        with self.lock:
            old = self.peers.get(identity)
            # A new peering starts afresh: epochs (the decode offers 1 again after a restart; the same
            # decode peering again continues past its old ones), and the sender's per-peering state
            # (META replay check, destinations held): a decode restarted under the same engine id counts
            # its generations from 1 again. Nothing of the old peering arrives after this HELLO: its
            # messages came on the same ordered socket before it, or on one that ended.
            peer = _Peer(engine=identity, control=msg.reply_to, session=msg.session, page_size=msg.page_size,
                         geometry=msg.geometry, last_seen=now, answered_at=now)
            self.peers[identity] = peer
            self._forgotten.pop(identity, None)
            self.sender.forget_peer(identity, "its decode started another peering (a new HELLO)")
        if old is not None and old.epoch == 0 and old.link is None and now - old.answered_at >= UNHEARD_S:
            self._reply_unheard(old, f"asked to peer again {now - old.answered_at:.1f} s later")
        if old is not None and old.control != peer.control:
            self._release_control(old.control)  # peering again from another address: the old socket goes
        if old is not None and old.link is not None:
            self._retire(old.link, "peering replaced by a new HELLO")

    def _check_reply_address(self, identity: str, reply_to: str) -> None:
        """A HELLO that came from another host but asks for its answers at a loopback address (a decode
        left on the default host) will never hear back: say so here, since the decode only sees
        silence. The answer still goes where it asked."""
        source = self.control.source_of(identity)
        try:
            host, _port = split_tcp_endpoint(split_address(reply_to)[0])
        except (InvalidArgument, PeerError):
            return
        if source and is_loopback(host) and not is_loopback(source):
            self._event("unreachable_reply_to", peer=identity[:200], reply_to=reply_to[:200], source=source)
            self._warn(log, f"reply/{identity[:64]}", "%s: HELLO from %r came from %s but asks for answers at %s, "
                       "which is that host's own loopback: it will not hear back (set its host or advertise_host "
                       "to an address this host reaches)", self.engine_id, identity[:200], source, reply_to[:200])

    def _reply_unheard(self, peer: _Peer, what: str) -> None:
        """A decode whose HELLO was answered but that never offered a connection after it (it asked again,
        or went silent) most likely never got the answer: its advertised address does not reach it from
        here. Said here because the control plane's dial there gives up without telling anyone."""
        key = f"reply/{peer.engine[:64]}"
        self._event("reply_unheard", counter="unheard_replies", limit_key=key, peer=peer.engine[:200],
                    reply_to=peer.control[:200], what=what)
        self._warn(log, key, "%s: decode %r %s without offering a connection after its HELLO was answered at "
                   "%s: that address does not reach it from this host, if it is running (set its host or "
                   "advertise_host to an address this host reaches)", self.engine_id, peer.engine[:200], what,
                   peer.control[:200])

    def _refuse_hello(self, identity: str, msg: m.Hello, problem: str, *, may_reject: bool = False) -> None:
        """Refuse a peering. The details go to this engine's log only: the answer names neither this
        engine nor its layout or capacity (a stranger must not learn what HELLO would be accepted),
        except to a peer the keyring authenticated, which is told why. It travels on a socket of its
        own under a random routing identity, closed again (:meth:`ControlPlane.send_once`).

        ``may_reject``: a decode refused for what it is (layout, transport, checksum, a full peer table)
        rather than for lying about who it is; for ``meta_timeout`` its REJECTs are still taken, so a
        request it cannot serve fails on this side at once (:meth:`DecodeEngine.refuse`)."""
        if may_reject:
            with self.lock:
                self.refused_peers.pop(identity, None)
                while len(self.refused_peers) >= max(64, self.config.max_peers):
                    self.refused_peers.pop(next(iter(self.refused_peers)))  # the oldest goes
                self.refused_peers[identity] = time.monotonic() + self.config.meta_timeout
        self._event("hello_refused", counter="refused_hellos", peer=identity[:200], reply_to=msg.reply_to[:200],
                    why=problem[:500])
        self._warn(log, "hello", "%s: refused peering with %r: %s", self.engine_id, identity[:200], problem)
        authenticated = self.control.keyring is not None
        ack = m.HelloAck(engine="", role="prefill", session=msg.session, ok=False,
                         error=problem if authenticated else HELLO_REFUSED,
                         page_size=0, num_pages=0, item_lens=[], pool_tokens=0, max_context=0)
        if not self.control.send_once(msg.reply_to, ack):
            self.counters["refusals_unanswered"] += 1

    # the peer table ------------------------------------------------------------------------------------
    def _make_room(self, identity: str) -> str:
        """Room in the peer table for ``identity``: "" when there is (if the table is full, the peer silent
        longest is forgotten, provided it is gone: silent past ``peer_timeout``, or its decode closed our
        link and has said nothing since), else why not."""
        now = time.monotonic()
        with self.lock:
            if identity in self.peers or len(self.peers) < self.config.max_peers:
                return ""
            # gone: its link closed by the decode and nothing heard since, or silent past peer_timeout
            gone = [p for p in self.peers.values()
                    if (p.link is None and p.link_lost_at and p.last_seen < p.link_lost_at)
                    or now - p.last_seen > self.config.peer_timeout]
            victim = min(gone, key=lambda p: p.last_seen) if gone else None
        if victim is None:
            return f"peer table full: {len(self.peers)} live peers (max_peers {self.config.max_peers})"
        self._forget_peer(victim, "its place in the full peer table was needed (max_peers)")
        return ""

    def _forget_peer(self, peer: _Peer, why: str) -> None:
        """Drop ``peer`` from the table: its link is retired, its control socket closed, and the sender's
        state of its peering dropped (:meth:`Sender.forget_peer`: its META replay entry, destinations
        held for it). A decode that comes back must HELLO again."""
        with self.lock:
            if self.peers.get(peer.engine) is not peer:
                return
            del self.peers[peer.engine]
            link, peer.link = peer.link, None
            peer.pending_offer = None
            self._forgotten.pop(peer.engine, None)
            self._forgotten[peer.engine] = [peer.control, 0.0]
            while len(self._forgotten) > max(1024, self.config.max_peers):
                self._forgotten.popitem(last=False)
            self.sender.forget_peer(peer.engine, f"the prefill forgot the peering: {why}")
        if link is not None:
            self._retire(link, f"peer forgotten: {why}")
        self._release_control(peer.control)
        self._event("peer_forgotten", counter="peers_forgotten", peer=peer.engine[:200], why=why)

    def _tell_forgotten(self, identity: str, msg: m.Message) -> None:
        """A message from a peer this engine forgot: tell it at its old control address, so it peers
        again (at most once a second per peer; strangers are not answered)."""
        now = time.monotonic()
        with self.lock:
            entry = self._forgotten.get(identity)
            if entry is None or now < entry[1]:
                return
            entry[1] = now + 1.0
            address = entry[0]
        self._event("told_not_peered", counter="told_not_peered", peer=identity[:200], message=msg.TYPE)
        try:
            self.control.send(address, m.Error(about=msg.TYPE, code=NotPeered.code, rid="?", gen=0,
                                               detail=f"prefill {self.engine_id} holds no peering with "
                                                      f"{identity}: send HELLO again"))
        except PeerError:
            pass

    def _on_not_peered(self, identity: str, msg: m.Error) -> None:
        """A decode says it holds no peering with this engine (it restarted or forgot us): forget it."""
        peer = self.peers.get(identity)
        if peer is not None:
            self._forget_peer(peer, f"it holds no peering with this engine: {msg.detail[:200]}")

    def _release_control(self, address: str) -> None:
        """Close the control socket to ``address`` unless a peer still uses it."""
        with self.lock:
            used = any(p.control == address for p in self.peers.values())
        if not used:
            self.control.forget(address)

    def _retire(self, link: SenderLink, reason: str) -> None:
        """Settle the requests on ``link`` and close it (or hand it to the test hooks)."""
        link.drain_messages()  # a RESULT that came on it ahead of the fence counts
        self.sender.on_connection_closed(link, reason)
        if not self.hooks.retire_link(link):
            self._close_later(link)

    def _close_later(self, link: SenderLink) -> None:
        """Close ``link`` without flushing, on a closing thread: the caller (often the control thread)
        never waits for it. Its writes are reported failed as it ends (its requests settle then)."""
        try:
            self._closers.submit(link.close, flush=False)
        except RuntimeError:  # the engine is closing: the pool takes no more, close it here
            link.close(flush=False)

    def _on_offer(self, peer: _Peer, msg: m.Offer) -> None:
        """The decode offered a data connection under a new epoch: open our half (off the control
        thread: a connect may take seconds, and a peer can point it anywhere), then answer ACCEPT.
        One connecting job per peer at most; a newer offer supersedes one not started yet."""
        with self.lock:
            if msg.epoch <= peer.epoch:
                raise PeerError(f"OFFER epoch {msg.epoch} is not after {peer.epoch}")
            old, peer.link = peer.link, None
            peer.epoch = msg.epoch
            peer.pending_offer = msg
            start = peer.connector is None and not self._closed
            if start:
                peer.connector = True  # the job below, until it has taken every offer
        if old is not None:
            self._retire(old, "replaced by a newer data connection")
        if start:
            try:
                self._connectors.submit(self._connect_loop, peer)  # it clears peer.connector when done
            except RuntimeError:  # the engine is closing: the pool takes no more
                with self.lock:
                    peer.connector = None

    def _connect_loop(self, peer: _Peer) -> None:
        while True:
            with self.lock:
                msg, peer.pending_offer = peer.pending_offer, None
                if msg is None or self._closed:
                    peer.connector = None
                    return
            try:
                self._connect(peer, msg)
            except Exception:  # a connector must not die silently with offers left
                log.exception("%s: opening the data connection %s offered failed", self.engine_id, peer.engine)

    def _connect(self, peer: _Peer, msg: m.Offer) -> None:
        proof = m.connect_proof(peer.session, msg.nonce, self.engine_id, msg.epoch)
        request = LinkRequest(engine=self.engine_id, peer=peer.engine, epoch=msg.epoch, proof=proof,
                              blob=msg.blob, on_closed=self._on_link_closed,
                              send_control=lambda out, name=peer.engine: self._send_to_peer(name, out),
                              faults=self.faults,
                              on_message=lambda msg, name=peer.engine: self._on_data_message(name, msg))
        try:
            link = self.transport.connect(request)
        except (TransportError, ProtocolError) as exc:
            self._warn(log, peer.engine, "%s: cannot open the data connection %s offered (epoch %d): %s",
                        self.engine_id, peer.engine, msg.epoch, exc)
            self._event("connect_failed", peer=peer.engine, epoch=msg.epoch, error=str(exc)[:500])
            return
        with self.lock:
            if peer.epoch != msg.epoch or self.peers.get(peer.engine) is not peer or self._closed:
                stale = True  # a newer offer or peering arrived meanwhile, or the engine is closing
            else:
                stale = False
                peer.link = link
                peer.alive = True
                peer.link_lost_at = 0.0
                self.sender.changed.notify_all()
        if stale:
            link.close(flush=False)
            return
        self._send_to_peer(peer.engine, m.Accept(engine=self.engine_id, epoch=msg.epoch, proof=proof,
                                                 blob=link.accept_blob))

    def _on_link_closed(self, link: SenderLink, reason: str) -> None:
        self.counters["connections_lost"] += 1
        log.info("%s: data connection %s closed: %s", self.engine_id, link.conn_id, reason)
        tell = None
        with self.lock:
            for peer in self.peers.values():
                if peer.link is link:
                    peer.link = None  # the decode offers the next epoch once it knows
                    tell = None if self._closed else peer.engine
                    if reason.startswith(RECEIVER_CLOSED):
                        peer.link_lost_at = time.monotonic()  # a decode that is gone says nothing more
            self.sender.on_connection_closed(link, reason)
        if tell is not None:  # our end of the live connection failed: say so (verbs cannot see it)
            self._send_to_peer(tell, m.Fenced(epoch=link.epoch, reason=reason[:4000]))

    def _on_fenced(self, peer: _Peer, msg: m.Fenced) -> None:
        """The decode fenced our connection of epoch ``msg.epoch``: settle; it offers the next one."""
        self._event("fenced_by_peer", peer=peer.engine, epoch=msg.epoch, reason=msg.reason[:500])
        with self.lock:
            link = peer.link
            if link is None or link.epoch != msg.epoch:
                return
            peer.link = None
        self._retire(link, f"fenced by decode: {msg.reason}")

    def _peer_layout(self, peer: str) -> tuple[int, Any]:
        """A decode peer's tokens per page and geometry (from its HELLO); this engine's page size and
        no geometry for one it does not know."""
        info = self.peers.get(peer)
        if info is None:
            return self.layout.page_size, None
        return info.page_size or self.layout.page_size, info.geometry

    def _link_for(self, peer: str) -> Any:
        info = self.peers.get(peer)
        return info.link if info is not None and info.link is not None and info.link.alive else None

    def _may_still_reject(self, identity: str) -> bool:
        with self.lock:
            until = self.refused_peers.get(identity)
            return until is not None and time.monotonic() < until

    def _tick(self) -> None:
        for link, why in self.sender.tick():
            self._close_stuck(link, why)
        now = time.monotonic()
        with self.lock:
            for identity in [i for i, until in self.refused_peers.items() if until <= now]:
                del self.refused_peers[identity]
        dead = []
        expired = []
        expiry = max(self.config.peer_expiry, self.config.peer_timeout)
        with self.lock:
            for peer in self.peers.values():
                silent = now - peer.last_seen
                if peer.alive and silent > self.config.peer_timeout:
                    peer.alive = False
                    dead.append(peer)
                lost = (peer.link is None and peer.link_lost_at and peer.last_seen < peer.link_lost_at
                        and now - peer.link_lost_at > self._lost_grace)
                if silent > expiry or lost or (not peer.alive and peer.epoch == 0 and peer.link is None
                                               and peer.connector is None):
                    # silent past peer_expiry; its link closed by the decode and nothing heard since (its
                    # engine or process is gone); or dead without ever offering a connection
                    expired.append(peer)
        for peer in dead:
            self._event("dead_peer", counter="dead_peers", peer=peer.engine, silent_s=round(now - peer.last_seen, 3))
            self._warn(log, "dead", "%s: peer %s silent: dead", self.engine_id, peer.engine)
            if peer.epoch == 0 and peer.link is None:
                self._reply_unheard(peer, f"went silent for {now - peer.last_seen:.1f} s")
            if peer.link is not None:
                self._close_later(peer.link)
        for peer in expired:
            why = (f"it closed its data connection {now - peer.link_lost_at:.1f} s ago and has said nothing since"
                   if peer.link_lost_at and peer.last_seen < peer.link_lost_at else
                   f"silent for {now - peer.last_seen:.1f} s")
            self._forget_peer(peer, why)
        if now >= self._next_retain:  # sockets to addresses no peer uses: a peer forgotten meanwhile
            self._next_retain = now + 1.0
            with self.lock:
                addresses = {p.control for p in self.peers.values()}
                addresses |= {e[0] for e in self._forgotten.values() if e[1] > now - 1.0}  # told just now
            self.control.retain(addresses)

    def _close_stuck(self, link: SenderLink, why: str) -> None:
        """A request failed for want of RESULT while its writes were still not taken: close the link
        (its writes complete as failed, its sources are freed); the decode offers the next one."""
        tell = None
        with self.lock:
            for peer in self.peers.values():
                if peer.link is link:
                    peer.link = None
                    tell = peer.engine
        self._event("link_closed", counter="stuck_links_closed", conn=str(link.conn_id), why=why[:500])
        self._retire(link, why)
        if tell is not None:  # the decode fences its half and offers anew (verbs cannot see the close)
            self._send_to_peer(tell, m.Fenced(epoch=link.epoch, reason=why[:4000]))

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
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        self._connectors.shutdown(wait=True, cancel_futures=True)  # a link still opening is closed below
        self._closers.shutdown(wait=True)  # the retired links' closes finish before the transport goes
        for peer in list(self.peers.values()):
            if peer.link is not None:
                peer.link.close(flush=False)
        self.hooks.close()  # links kept by the test hooks go before the transport
        self.transport.close()  # no link of it is left running: a device closes under none
        self._worker.close()

    # the API ---------------------------------------------------------------------------------------
    def admit(self, rid: Any, tokens: int, *, external_pages: bool = False, peer: str | None = None,
              any_peer: bool = False, peers: list[str] | None = None) -> SendRequest:
        """Admit a prompt or raise :class:`AdmissionRejected` (nothing held, no byte moves).

        A request is bound to one decode: only that decode can give it a destination (META) or
        reject it, so no other peer can take its KV. ``peer`` names the decode engine; without it
        the request binds to this prefill's only decode, and with several peers the call is refused
        (:class:`InvalidArgument`). ``any_peer=True`` is the explicit opt-in for callers that cannot
        know the decode in advance (SGLang, whose router pairs the servers per request and whose
        request id, the bootstrap room, is a random 63-bit number): the first peer whose META names
        the request binds it (with a decode of more TP ranks than this prefill: the first of each of the
        ranks this prefill serves, all of one group). ``peers`` names those decode ranks explicitly."""
        self._check_open()
        if peers is not None:
            return self.sender.admit(rid, tokens, external_pages=external_pages, peers=peers)
        if peer is None and not any_peer:
            with self.lock:
                peered = sorted(name for name, p in self.peers.items() if p.alive)
            if len(peered) != 1:
                raise InvalidArgument(
                    f"no decode engine named and this prefill has {len(peered)} live peers"
                    f"{' (' + ', '.join(peered[:8]) + ')' if peered else ''}: pass peer=<decode engine id>, "
                    f"or any_peer=True to let the first decode that sends its destination bind it", rid=rid)
            peer = peered[0]
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
             ready: Any = None, buffers: Any = None, finish: bool = True, at: int | None = None) -> SendRequest:
        """Post the next chunk (default: everything left); the chunk that completes the request posts
        DONE behind it (unless ``finish=False``: then :meth:`finish` does). ``ready`` (e.g. a CUDA event
        recorded after the kernel that writes the source pages) is waited on before the transport
        reads them. ``buffers``: only these buffers (a layer-wise send, :meth:`send_layer`); each
        buffer advances through the pages on its own. ``at``: refuse unless the buffers are at that
        position (see :meth:`kvxfer.engine.sender.Sender.send`)."""
        self._check_open()
        return self.sender.send(rid, src_pages, count=count, aux=aux, ready=ready, buffers=buffers, finish=finish,
                                at=at)

    def finish(self, rid: Any, aux: bytes = b"") -> SendRequest:
        """Post DONE, with ``aux``, for a request whose pages were all sent with ``finish=False``."""
        self._check_open()
        return self.sender.finish(rid, aux)

    def send_layer(self, rid: Any, layer: int, src_pages: Any = None, *, count: int | None = None,
                   aux: bytes = b"", ready: Any = None, finish: bool = True, at: int | None = None) -> SendRequest:
        """Send one layer's buffers (its K and V, or its MLA latent) of the next chunk, as soon as that
        layer is computed; ``ready`` is that layer's own event. Layers go in any order and any number
        of chunks; the call after which every layer sent every page posts DONE. Needs a layout with a
        :class:`~kvxfer.core.geometry.KVGeometry` (without one, name the buffers: ``send(buffers=...)``)."""
        self._check_open()
        geometry = self.layout.geometry
        if geometry is None:
            raise InvalidArgument("a layout without a geometry has no layers: send(rid, buffers=[...]) names "
                                  "the buffers of a layer", rid=rid)
        try:
            buffers = geometry.layer_buffers(layer)
        except ConfigError as exc:
            raise InvalidArgument(exc.detail, rid=rid) from None
        return self.sender.send(rid, src_pages, count=count, aux=aux, ready=ready, buffers=buffers, finish=finish,
                                at=at)

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
        """Block until the request is terminal and drained (its source memory reusable)."""
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
                # which sending paths the current links took (tcp, shm): small requests from the caller's
                # thread, WRITE frames as they were posted, a request's frame and DONE in one step, DONE
                # checksums filled in C
                "link_paths": {name: sum(int(getattr(link, name, 0)) for link in links) for name in LINK_PATHS},
            }
