"""The receiving (decode) role: admission, reservation, verified completion, deferred release.

:class:`Receiver` is the decode engine's logic without any I/O: the engine feeds it calls and
messages, it answers through two callbacks (``send`` a control message to a peer, ``request_fence``
of a data connection). It owns the request table, the page pool, the write guard and the peers'
advertised capacities and geometries.

A request is written by one or more *legs*: each writer's share (with unequal tensor parallelism,
its heads of every page; otherwise the whole request, page for page). Each leg has its own
generation, slot, connection and write window over the request's pages, which the ledger holds under
the request's generation (the first leg's). One writer is the ordinary case, and everything below
reads the same for it.

Invariants (checked by :meth:`Receiver.check_accounting`):

* a page is held (not FREE) iff exactly one active request holds it, with the page's generation;
* a leg's window is open iff the request is ``RESERVED`` and the leg is ``OPEN``;
* pages leave ``QUARANTINED`` only when every leg is settled: a drain proof for *that leg's*
  generation (DONE, DRAIN_ACK, REJECT or ABORT arriving on the ordered data path behind the writer's
  writes) or the writer's connection fenced or gone; a timeout only ever leads to a fence;
* a request is ``READABLE`` only when every leg's DONE arrived and every leg verified (coverage of
  its pages or slice, bytes, write log, checksum) and, after all of them, no page holds poison;
* one leg failing (its connection gone, its writer giving up) stops the others: the request is
  quarantined until each of them proves its drain or is fenced;
* every leg whose DONE was claimed gets exactly one RESULT: ok or not once every leg verified, or
  ok=false as soon as the request fails before that (another leg's connection, abort or timeout), so
  no writer holds its sources waiting for an answer that will not come;
* a request is ``REJECTED`` before anything is reserved, or (its only writer rejected it) before any write;
* a leg's transport grant (``grant``: verbs memory windows, whose keys META carries) is revoked
  (``revoke``) when its DONE arrives and, in any case, before the request's pages are freed: a write
  that comes later fails in the NIC where the transport enforces grants.

All methods must be called with :attr:`lock` held or take it themselves; none blocks on I/O.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.arguments import check_peer, check_peers, check_rid, check_tokens, page_array
from ..core.checksum import ChecksumAlgo, checksum_addresses, checksum_pages
from ..core.geometry import plan_legs, serves, writers_of
from ..core.ledger import PageState
from ..core.lifecycle import Lifecycle, ReceiverState
from ..core.pool import PagePool
from ..core.slicing import LegAtoms, LegShape, SliceTable
from ..core.tags import MAX_SLOTS
from ..core.verify import Claim, poison_problem, verify_completion
from ..core.writeguard import Window, WriteGuard
from ..errors import (
    AdmissionRejected,
    ConfigError,
    DuplicateRequest,
    InvalidArgument,
    KvxferError,
    NotReadable,
    OwnershipError,
    PeerError,
    PoolExhausted,
    StaleGeneration,
    TransferAborted,
    TransferFailed,
    TransportError,
    UnknownRequest,
    VerificationFailed,
)
from ..wire import messages as m

log = logging.getLogger("kvxfer.receiver")
R = ReceiverState
HISTORY_LIMIT = 65536
# a request of at most this many reserved bytes (host memory) is verified on the thread that received
# its DONE rather than handed to the verifier: its checks cost less than the hand-off
INLINE_VERIFY_BYTES = 256 << 10


@dataclass
class PeerInfo:
    """What the receiver knows of one writer (from its HELLO_ACK) and its data connection."""

    engine: str
    control: str
    session: bytes
    pool_tokens: int = 0
    max_context: int = 0
    page_size: int = 0
    geometry: Any = None  # the writer's KVGeometry, when its layout says what its pages hold
    ready: bool = False
    conn: Any = None
    epoch: int = 0
    last_seen: float = 0.0
    fenced_epochs: set[int] = field(default_factory=set)
    offered: int = 0  # newest epoch offered (OFFER); the writer connects under it
    offer_nonce: bytes = b""  # that offer's nonce: the writer's connect proof must cover it
    accepted: int = 0  # newest epoch the writer ACCEPTed (it holds that link by then)
    offered_at: float = 0.0
    reoffer_at: float | None = None  # offer the next epoch at this time (after a connection ended)
    repeer_after: float = 0.0  # a HELLO again (the writer forgot us, or its control connection closed) not before
    connected_at: float = 0.0  # when the current data connection came up (0: none yet)
    short_lived: int = 0  # data connections in a row that ended within STABLE_CONNECTION_S: the offer backoff

    @property
    def attached(self) -> bool:
        """This side holds a live data connection (``conn``, alive: ``ready``); the writer may not yet."""
        return self.ready and self.conn is not None

    @property
    def connected(self) -> bool:
        """Both halves hold the data connection: this side has it (:attr:`attached`) and the writer
        ACCEPTed its epoch, which it does only once it has stored the link. The data path's CONNECT
        alone arrives before that; a request bound then would find no link at the writer."""
        return self.attached and self.accepted == self.epoch


class LegState(str, enum.Enum):
    """Where one writer's share of a request stands."""

    OPEN = "OPEN"  # its window is open: writes may land
    STOPPED = "STOPPED"  # window closed by an abort; writes may still be in flight until a drain proof or fence
    CLAIMED = "CLAIMED"  # DONE arrived behind its writes (drained); its claim waits for verification
    DRAINED = "DRAINED"  # proven drained without DONE (DRAIN_ACK, REJECT, ABORT, the connection ended)
    NULL = "NULL"  # nothing to write: its heads come from another writer


SETTLED = frozenset({LegState.CLAIMED, LegState.DRAINED, LegState.NULL})


@dataclass
class ReceiveLeg:
    """One writer's share of a request: its generation, slot, connection, heads and claim."""

    peer: str
    gen: int
    slot: int = -1
    conn: Any = None
    heads: tuple[int, ...] = ()  # () page for page; (first, count) a head slice; count 0 for NULL
    table: SliceTable | None = None  # a head slice or other page size: what its writes may cover
    state: LegState = LegState.OPEN
    claim: Claim | None = None
    log_problem: VerificationFailed | None = None
    aux: bytes = b""

    @property
    def settled(self) -> bool:
        return self.state in SETTLED

    def describe(self) -> str:
        heads = f" (heads {self.heads[0]}..{self.heads[0] + self.heads[1] - 1})" if len(self.heads) == 2 else ""
        return f"writer {self.peer}{heads} generation {self.gen}"


@dataclass
class ReceiveRequest:
    """One request on the decode side: lifecycle, generation, reserved pages, its legs, read leases
    and outcome; its pages stay held while ``leases`` > 0. ``peer``, ``slot`` and ``conn`` are the
    first leg's (the only one's, with one writer)."""

    rid: Any
    tokens: int
    peer: str
    fsm: Lifecycle
    gen: int = 0
    slot: int = -1
    pages: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    conn: Any = None
    legs: list[ReceiveLeg] = field(default_factory=list)
    deadline: float = float("inf")
    failure: bool = False  # quarantined because of a failure, not a caller's abort
    abort_after_verify: str | None = None  # abort() arrived while the checksum was being verified
    leases: int = 0  # open read leases and live page views (kvxfer.engine.reads); pages held while > 0
    release_as: ReceiverState | None = None  # RELEASING: the terminal state once the leases end
    error: KvxferError | None = None
    aux: bytes = b""
    created: float = field(default_factory=time.monotonic)
    readable_at: float | None = None  # time.monotonic() when it became READABLE (verified)
    finished: float | None = None

    @property
    def state(self) -> ReceiverState:
        return self.fsm.state

    def leg(self, gen: int) -> ReceiveLeg | None:
        for leg in self.legs:
            if leg.gen == gen:
                return leg
        return None

    @property
    def writing(self) -> list[ReceiveLeg]:
        """The legs that write something."""
        return [leg for leg in self.legs if leg.state is not LegState.NULL]

    @property
    def settled(self) -> bool:
        return all(leg.settled for leg in self.legs)

    @property
    def sliced(self) -> bool:
        return any(leg.table is not None for leg in self.legs) or len(self.writing) > 1


class Receiver:
    """The decode role's logic without I/O: the request table, page pool, write guard and peers' capacities; called with ``lock`` held (see the module's invariants)."""

    def __init__(
        self,
        pool: PagePool,
        *,
        max_context: int,
        checksum: ChecksumAlgo | str = ChecksumAlgo.ADLER32,
        max_inflight: int = 4096,
        transfer_timeout: float = 60.0,
        drain_timeout: float = 10.0,
        send: Callable[[str, m.Message], None] | None = None,
        request_fence: Callable[[Any, str], None] | None = None,
        lock: threading.RLock | None = None,
        clock: Callable[[], float] = time.monotonic,
        unsafe_legacy: bool = False,
        defer: Callable[[Callable[[], None]], None] | None = None,
        observer: Callable[[Lifecycle, Any, str], None] | None = None,
        warn: Callable[..., None] | None = None,
        grant: Callable[[Any, int, np.ndarray], bytes] | None = None,
        revoke: Callable[[Any, int], None] | None = None,
        answer: Callable[[Any, m.Message], bool] | None = None,
    ) -> None:
        if not 0 < max_inflight <= MAX_SLOTS:
            raise ValueError(f"max_inflight must be in 1..{MAX_SLOTS}")
        self.pool = pool
        self.layout = pool.layout
        self.ledger = pool.ledger
        self.max_context = int(max_context)
        self.checksum = ChecksumAlgo.parse(checksum)
        self.transfer_timeout = transfer_timeout
        self.drain_timeout = drain_timeout
        self.lock = lock or threading.RLock()
        self.guard = WriteGuard(self.layout, self.ledger, self.lock)
        self._deliver = send or (lambda peer, msg: None)
        # a RESULT sent back on the data connection its DONE came on (ReceiverBackend.answer): True when
        # the connection took it, False when it goes on the control plane
        self._answer = answer or (lambda conn, msg: False)
        # messages to peers held while a verification holds the lock (RESULT): sent once it is released,
        # so the consumer woken by READABLE does not wait for their encoding and queueing
        self._outbox: list[tuple[str, m.Message, Any]] | None = None
        self._woke_waiters = False  # a verdict notified threads waiting on ``changed`` (under the lock)
        self._request_fence = request_fence or (lambda conn, reason: None)
        self._clock = clock
        self.unsafe_legacy = unsafe_legacy
        self._defer = defer or (lambda fn: fn())
        # the transport's per-request access (ReceiverBackend.grant / revoke); no-ops by default
        self._grant = grant or (lambda conn, gen, pages: b"")
        self._revoke = revoke or (lambda conn, gen: None)
        self.peers: dict[str, PeerInfo] = {}
        self.active: dict[Any, ReceiveRequest] = {}
        self.by_gen: OrderedDict[int, ReceiveRequest] = OrderedDict()
        self.recent: OrderedDict[Any, ReceiveRequest] = OrderedDict()
        self._ended_leases: deque[ReceiveRequest] = deque()  # appended by finalizers, any thread
        self._free_slots = list(range(max_inflight - 1, -1, -1))
        self._next_gen = 1
        self.stats: Counter[str] = Counter()
        self.observer = observer
        self.changed = threading.Condition(self.lock)
        # warn(logger, limit_key, msg, *args): a WARNING a peer can provoke (the engine rate limits it)
        self._warn = warn or (lambda target, _key, msg, *args: target.warning(msg, *args))

    # peers --------------------------------------------------------------------------------------
    def add_peer(self, info: PeerInfo) -> None:
        with self.lock:
            self.peers[info.engine] = info

    def default_peer(self) -> str:
        ready = [p.engine for p in self.peers.values() if p.connected]
        if len(ready) != 1:
            raise PeerError(
                f"no peer named and {len(ready)} ready peers ({', '.join(ready) or 'none'}); name one"
            )
        return ready[0]

    # admission ----------------------------------------------------------------------------------
    def admit(self, rid: Any, tokens: int, *, peer: str | None = None, pages: Any = None,
              peers: Sequence[str] | None = None) -> ReceiveRequest:
        """Admit a request: check it can ever fit, reserve pages, open each writer's window, send META.

        ``peer`` names the one writer; ``peers`` the writers of a request whose heads several prefill
        ranks hold (every rank this one takes KV from, in rank order; each head is written by the first
        that holds it, the others are told they write nothing). Raises :class:`InvalidArgument` (a
        request id, token count, peer list or page list the API cannot take),
        :class:`AdmissionRejected` (nothing reserved, writers told), :class:`PoolExhausted` (retry
        later), :class:`DuplicateRequest` or :class:`PeerError`. On any error the ledger, the windows
        and the request table are as they were."""
        rid = check_rid(rid)
        tokens = check_tokens(tokens, rid)
        peer = check_peer(peer, rid)
        named = check_peers(peers, rid)
        if peer is not None and named is not None:
            raise InvalidArgument("give peer or peers, not both", rid=rid)
        if peer is not None:
            named = [peer]
        chosen = None if pages is None else page_array(pages, num_pages=self.layout.num_pages, rid=rid)
        with self.lock:
            if rid in self.active:
                live = self.active[rid]
                raise DuplicateRequest(
                    f"already active in state {live.state.value}", rid=rid, generation=live.gen
                )
            req = ReceiveRequest(rid=rid, tokens=tokens, peer=named[0] if named else "",
                                 fsm=Lifecycle("receiver", rid, observer=self.observer))
            rejection = self._admission_problem(req, None)
            if rejection is not None:
                raise self._reject(req, *rejection, tell=named or ())
            names = named if named is not None else [self.default_peer()]
            req.peer = names[0]
            infos = []
            for name in names:
                info = self.peers.get(name)
                if info is None or not info.connected:
                    raise PeerError(f"peer {name!r} is not connected", rid=rid)
                infos.append(info)
            for info in infos:
                rejection = self._admission_problem(req, info)
                if rejection is not None:
                    raise self._reject(req, *rejection, tell=names)
            try:
                plan = self._plan(req.tokens, infos)
            except ConfigError as exc:
                raise self._reject(req, "layout_mismatch", exc.detail, tell=names) from None
            needed = self.layout.pages_for_tokens(req.tokens)
            if chosen is None and needed > self.ledger.free_count:
                raise PoolExhausted(
                    f"needs {needed} pages, {self.ledger.free_count} of {self.layout.num_pages} free",
                    rid=rid,
                )
            if chosen is not None and chosen.size != needed:
                raise InvalidArgument(f"{chosen.size} pages given for {req.tokens} tokens; {needed} needed",
                                      rid=rid)
            writing = sum(1 for heads, _ in plan if heads[1:] != (0,))
            if len(self._free_slots) < writing:
                raise PoolExhausted("no free request slot", rid=rid)
            gen = self._next_gen
            held = self.ledger.allocate(needed, gen) if chosen is None else self.ledger.adopt(chosen, gen)
            req.gen = gen
            req.fsm.generation = gen
            req.pages = held
            req.deadline = self._clock() + self.transfer_timeout
            try:
                metas = [self._open_leg(req, info, heads, shape) for info, (heads, shape) in zip(infos, plan)]
                req.slot, req.conn = req.legs[0].slot, req.legs[0].conn
                writers = f" from {writing} writers" if writing > 1 else ""
                req.fsm.to(R.RESERVED, f"{len(held)} pages reserved{writers}")
                self.active[rid] = req
                self._remember(req)
                for name, meta in metas:
                    self._send(name, meta)
            except BaseException:
                self._undo_admission(req)
                raise
            self.stats["admitted"] += 1
            return req

    def _plan(self, tokens: int, infos: list[PeerInfo]) -> list[tuple[tuple[int, ...], LegShape | None]]:
        """Each writer's heads (``()``: page for page) and, for a head slice, its shape. Raises
        :class:`ConfigError` when these writers cannot give this engine every head it holds."""
        local = self.layout.geometry
        if local is None or any(info.geometry is None for info in infos):
            if len(infos) > 1:
                raise ConfigError("a request from several writers needs layouts that say which heads each engine "
                                  "holds (a KVGeometry) on every engine")
            return [((), None)]
        sizes = {info.geometry.tp_size for info in infos}
        ranks = [info.geometry.tp_rank for info in infos]
        wanted = writers_of(local, next(iter(sizes)))
        if len(sizes) != 1 or ranks != wanted or not all(serves(info.geometry, local) for info in infos):
            raise ConfigError(
                f"TP rank {local.tp_rank} of {local.tp_size} takes KV from writer ranks {wanted} of "
                f"{'/'.join(map(str, sorted(sizes)))}, in that order; given ranks {ranks}")
        plan: list[tuple[tuple[int, ...], LegShape | None]] = []
        for info, (first, count) in zip(infos, plan_legs(local, [info.geometry for info in infos])):
            if not count:
                plan.append(((first, 0), None))
                continue
            plan.append(((first, count), LegShape(
                tokens=tokens, src_page=info.page_size, dst_page=self.layout.page_size,
                src_heads=info.geometry.heads[:2], dst_heads=local.heads[:2], leg=(first, count), order=local.order)))
        return plan

    def _open_leg(self, req: ReceiveRequest, info: PeerInfo, heads: tuple[int, ...],
                  shape: LegShape | None) -> tuple[str, m.Meta]:
        """One writer's leg of an admission in progress: generation, slot, window, grant; its META."""
        if not req.legs:
            gen = req.gen
        else:
            gen = self._next_gen
        self._next_gen = max(self._next_gen, gen + 1)
        if heads[1:] == (0,):
            req.legs.append(ReceiveLeg(peer=info.engine, gen=gen, heads=heads, state=LegState.NULL))
            return info.engine, m.Meta(rid=req.rid, gen=gen, slot=0, tokens=req.tokens,
                                       pages=np.empty(0, dtype=np.int64), heads=heads)
        leg = ReceiveLeg(peer=info.engine, gen=gen, slot=self._free_slots.pop(), conn=info.conn, heads=heads)
        req.legs.append(leg)
        if shape is not None and not shape.whole:
            geometry = self.layout.geometry
            leg.table = SliceTable(LegAtoms(shape), req.pages, self.layout.item_lens,
                                   np.array([b.head_bytes for b in geometry.buffers], dtype=np.int64))
        self.guard.open(Window(rid=req.rid, gen=gen, slot=leg.slot, conn=info.conn, pages=req.pages,
                               owner_gen=req.gen, table=leg.table))
        try:
            access = self._grant(info.conn, gen, req.pages)
        except TransportError as exc:  # its connection broke: as if the peer were not connected
            raise PeerError(f"data connection {info.conn} cannot take the request: {exc}", rid=req.rid,
                            generation=gen) from exc
        return info.engine, m.Meta(rid=req.rid, gen=gen, slot=leg.slot, tokens=req.tokens, pages=req.pages,
                                   access=access, heads=heads)

    def _undo_admission(self, req: ReceiveRequest) -> None:
        """Admission failed after the reservation (nothing was sent): put everything back."""
        for leg in req.legs:
            if leg.conn is not None:
                self._revoke(leg.conn, leg.gen)
            self.guard.forget(leg.gen)
            if leg.slot >= 0:
                self._free_slots.append(leg.slot)
                leg.slot = -1
            self.by_gen.pop(leg.gen, None)
        self.ledger.release(req.pages, req.gen, allowed=(PageState.RESERVED,))
        req.slot = -1
        if self.active.get(req.rid) is req:
            del self.active[req.rid]
        self.by_gen.pop(req.gen, None)
        if self.recent.get(req.rid) is req:
            del self.recent[req.rid]
        log.error("request %r generation %d: admission undone after an unexpected error", req.rid, req.gen)

    def _admission_problem(self, req: ReceiveRequest, info: PeerInfo | None) -> tuple[str, str] | None:
        """Why the request can never be served (local limits, or with ``info`` the writer's), or None."""
        tokens = req.tokens
        if info is None:
            if tokens <= 0:
                return "empty", f"prompt of {tokens} tokens"
            if self.unsafe_legacy:
                return None
            if tokens > self.max_context:
                return "exceeds_context", f"prompt of {tokens:,} tokens exceeds the context of {self.max_context:,}"
            pool_tokens = self.layout.pool_tokens
            if tokens > pool_tokens:
                return (
                    "exceeds_pool",
                    f"prompt of {tokens:,} tokens can never fit this decode pool of {pool_tokens:,} tokens",
                )
            return None
        if self.unsafe_legacy:
            return None
        if info.max_context and tokens > info.max_context:
            return (
                "exceeds_peer_context",
                f"prompt of {tokens:,} tokens exceeds prefill {info.engine}'s context of {info.max_context:,}",
            )
        if info.pool_tokens and tokens > info.pool_tokens:
            return (
                "exceeds_peer_pool",
                f"prompt of {tokens:,} tokens can never fit prefill {info.engine}'s pool of "
                f"{info.pool_tokens:,} tokens",
            )
        return None

    def new_generation(self) -> int:
        """A fresh generation that names no reservation (a refusal's); call under the lock."""
        gen = self._next_gen
        self._next_gen += 1
        return gen

    def _reject(self, req: ReceiveRequest, reason: str, text: str, *, tell: Sequence[str]) -> AdmissionRejected:
        if not req.gen:
            # A generation names this attempt (nothing is reserved under it), so the writer can tell
            # this REJECT from one of an earlier attempt under the same request id.
            req.gen = self._next_gen
            req.fsm.generation = req.gen
            self._next_gen += 1
        req.fsm.to(R.REJECTED, reason)
        req.error = AdmissionRejected(text, reason=reason, rid=req.rid, generation=req.gen or None)
        req.finished = self._clock()
        self.stats["rejected"] += 1
        self.stats[f"rejected_{reason}"] += 1
        self._remember(req)
        log.info("rejected at admission: %s", req.error)
        for name in tell:
            if name in self.peers:
                self._send(name, m.Reject(rid=req.rid, gen=req.gen, reason=reason, detail=text))
        self.changed.notify_all()
        return req.error

    # messages from the ordered data path ------------------------------------------------------------
    def _send(self, peer: str, msg: m.Message, conn: Any = None) -> None:
        """A message to ``peer``: at once, or (inside :meth:`_sends_after_lock`) when the lock is released.
        With ``conn`` (a RESULT), on that data connection where it takes it, else on the control plane."""
        if self._outbox is not None:
            self._outbox.append((peer, msg, conn))
        else:
            self._send_now(peer, msg, conn)

    def _send_now(self, peer: str, msg: m.Message, conn: Any) -> None:
        if conn is not None and self._answer(conn, msg):
            with self.lock:
                self.stats["results_on_data"] += 1
            return
        self._deliver(peer, msg)

    @contextmanager
    def _sends_after_lock(self) -> Iterator[None]:
        """Hold the lock; the messages sent meanwhile go out, in order, once it is released (the
        waiters :attr:`changed` woke get the lock first). Nested uses share the outermost's outbox."""
        held: list[tuple[str, m.Message, Any]] | None = None
        woke = False
        try:
            with self.lock:
                outer = self._outbox is None
                if outer:
                    self._outbox = []
                try:
                    yield
                finally:
                    if outer:
                        held, self._outbox = self._outbox, None
                        woke, self._woke_waiters = self._woke_waiters, False
        finally:
            if woke:
                # the consumer woken by the verdict first: where it shares this thread's CPU it would
                # otherwise wait for the RESULT's send (on loopback the send runs the peer's receive path
                # too); docs/benchmarks.md, "RESULT on the data connection, and the consumer first"
                os.sched_yield()
            for peer, msg, conn in held or ():
                self._send_now(peer, msg, conn)

    def on_ordered(self, conn: Any, msg: m.Message) -> None:
        """A DONE / DRAIN_ACK / REJECT / ABORT that arrived behind the writer's writes on ``conn``."""
        with self._sends_after_lock():
            req = self.by_gen.get(getattr(msg, "gen", 0))
            if req is None or req.rid != msg.rid:
                self._complain(conn, msg, UnknownRequest(
                    f"{msg.TYPE} names no request this engine admitted", rid=msg.rid, generation=msg.gen
                ))
                return
            leg = req.leg(msg.gen)
            if leg is None or leg.conn != conn:
                self._complain(conn, msg, StaleGeneration(
                    f"{msg.TYPE} arrived on connection {conn}, the request lives on "
                    f"{leg.conn if leg is not None else req.conn}",
                    rid=req.rid, generation=msg.gen,
                ))
                return
            if isinstance(msg, m.Done):
                self._on_done(req, leg, msg)
            elif isinstance(msg, m.DrainAck):
                self._on_drained(req, leg, "drain acknowledged")
            elif isinstance(msg, m.Reject):
                self._on_writer_gave_up(req, leg, msg.reason, msg.detail, rejected=True)
            elif isinstance(msg, m.Abort):
                self._on_writer_gave_up(req, leg, msg.reason, msg.detail, rejected=False)
            else:
                self._complain(conn, msg, UnknownRequest(f"{msg.TYPE} is not an ordered message"))

    def _complain(self, conn: Any, msg: m.Message, error: KvxferError) -> None:
        self.stats[f"refused_{error.code}"] += 1
        self.stats["stale_messages"] += 1
        peer = conn[0] if isinstance(conn, tuple) else None
        self._warn(log, f"{peer}/{msg.TYPE}/{error.code}", "ignored %s: %s", msg.TYPE, error)
        if peer in self.peers:
            self._send(
                peer,
                m.Error(about=msg.TYPE, code=error.code, detail=str(error),
                        rid=getattr(msg, "rid", "?"), gen=getattr(msg, "gen", 0)),
            )

    def _on_done(self, req: ReceiveRequest, leg: ReceiveLeg, msg: m.Done) -> None:
        if leg.state is LegState.STOPPED:
            # The writer finished before it saw our ABORT; DONE is ordered behind its writes.
            self._settle_leg(req, leg, "writer completed before the abort reached it")
            return
        if leg.state is not LegState.OPEN or req.state is not R.RESERVED:
            self._complain(leg.conn, msg, StaleGeneration(
                f"DONE for a request in state {req.state.value}", rid=req.rid, generation=leg.gen
            ))
            return
        # DONE came behind every write of the leg's generation: from here on no write for it may land
        # (the NIC refuses it where the transport enforces grants), so what it wrote stays as verified
        self._revoke(leg.conn, leg.gen)
        leg.log_problem = self._record_write_log(req, leg, msg)
        self.guard.close(leg.gen)
        leg.state = LegState.CLAIMED
        leg.claim = Claim(bytes=msg.bytes, pages=msg.pages, checksum=msg.checksum, algo=msg.algo)
        leg.aux = msg.aux
        if not req.settled:
            return  # other writers still write: verified together once all of them are done
        req.aux = next((w.aux for w in req.writing if w.aux), b"")
        req.fsm.to(R.VERIFYING, "DONE received" if len(req.writing) == 1 else "every writer's DONE received")
        # Every window is closed and each DONE came behind its writes, so the pages cannot change: the
        # checksum pass runs outside the lock, on the verifier (not the thread that lands data). A
        # small request in host memory is verified here at once: handing it over costs more than its
        # checks (a thread wake-up, about 0.1 ms on a busy 2-core host, against tens of microseconds).
        if self.layout.device == "cpu" and self.layout.bytes_for_pages(len(req.pages)) <= INLINE_VERIFY_BYTES:
            if not self._verified_at_once(req, leg):
                self._verify(req)
        else:
            self._defer(lambda: self._verify(req))

    def _verified_at_once(self, req: ReceiveRequest, leg: ReceiveLeg) -> bool:
        """Under the lock, a small request in host memory: the common case (one writer of whole pages, no
        write log, no final write owed, no poison to look for, DONE's counts equal to the reservation)
        verified and made READABLE in one pass over the guard and the ledger in C
        (:meth:`~kvxfer.core.writeguard.WriteGuard.verified_move`): the same checks as
        :func:`~kvxfer.core.verify.verify_completion`. False, nothing changed, for anything else or any
        check that fails: the full verification then decides, and names what differs."""
        claim = leg.claim
        assert claim is not None
        if (len(req.writing) != 1 or leg.table is not None or leg.log_problem is not None or self.unsafe_legacy
                or claim.algo != self.checksum.value or claim.pages != len(req.pages) or self.pool.poisons
                or claim.bytes != self.layout.bytes_for_pages(len(req.pages))):
            return False
        if not self.guard.verified_move(req.pages, req.gen, claim.checksum, self.checksum, PageState.WRITTEN,
                                        PageState.READABLE):
            return False
        self.stats["verified_at_once"] += 1
        self._readable(req, req.writing)
        return True

    def _verify(self, req: ReceiveRequest) -> None:
        if self.layout.device == "cpu" and len(req.writing) == 1:
            # the common case as a small request's: coverage, checksum and the move to READABLE in one
            # pass over the guard and one over the ledger (a 16,384-page request: two guard passes, the
            # Python checks and the ledger's pass otherwise); anything else, or a check that fails, below
            with self._sends_after_lock():
                if self._verified_at_once(req, req.writing[0]):
                    return
        actuals: list[int | None] = []
        for leg in req.writing:
            actual = None
            assert leg.claim is not None
            if leg.log_problem is None and not self.unsafe_legacy and leg.claim.algo == self.checksum.value:
                if leg.table is not None:
                    addresses, lengths = leg.table.pieces(
                        np.array([spec.address for spec in self.layout.buffers], dtype=np.int64))
                    actual = checksum_addresses(self.layout.device, addresses, lengths, self.checksum)
                else:
                    actual = self.guard.landed_checksum(req.pages, self.checksum)
                    if actual is None:
                        actual = checksum_pages(self.layout, req.pages, self.checksum)
            actuals.append(actual)
        with self._sends_after_lock():
            self._conclude(req, actuals)

    def _conclude(self, req: ReceiveRequest, actuals: list[int | None]) -> None:
        writing = req.writing
        several = req.sliced
        try:
            for leg, actual in zip(writing, actuals):
                assert leg.claim is not None
                try:
                    if leg.log_problem is not None:
                        raise leg.log_problem
                    if not self.unsafe_legacy:
                        verify_completion(
                            self.pool, self.guard, rid=req.rid, gen=leg.gen, pages=req.pages,
                            claim=leg.claim, algo=self.checksum, actual_checksum=actual, table=leg.table,
                            check_poison=not several,
                        )
                except VerificationFailed as exc:
                    if not several:
                        raise
                    raise VerificationFailed(f"{leg.describe()}: {exc.detail}", check=exc.check, rid=req.rid,
                                             generation=req.gen, pages=exc.pages) from None
            if several and not self.unsafe_legacy:
                full = next((w.table.full_pages() for w in writing if w.table is not None), req.pages)
                poisoned = poison_problem(self.pool, full)
                if poisoned is not None:
                    raise VerificationFailed(f"transfer not verified: {poisoned[0][1]}", check="poison", rid=req.rid,
                                             generation=req.gen, pages=poisoned[1][:64])
        except VerificationFailed as exc:
            self.stats["verification_failed"] += 1
            self.stats[f"verification_failed_{exc.check}"] += 1
            log.warning("%s", exc)
            req.error = exc
            req.fsm.to(R.FAILED, exc.check)
            self._finish(req, release_from=(PageState.RESERVED, PageState.WRITTEN))
            for leg in writing:
                self._send(leg.peer, m.Result(rid=req.rid, gen=leg.gen, ok=False, reason=exc.check, detail=str(exc)),
                           leg.conn)
            return
        if self.unsafe_legacy:
            # Legacy behaviour: readable whatever landed (the incident's decode side).
            self.ledger.state[req.pages] = PageState.WRITTEN
        # a head slice's pages stay RESERVED while they land (no one writer covers a page); verified here
        allowed = (PageState.RESERVED, PageState.WRITTEN) if several else (PageState.WRITTEN,)
        self.ledger.move(req.pages, req.gen, PageState.READABLE, allowed=allowed)
        self._readable(req, writing)

    def _readable(self, req: ReceiveRequest, writing: list[ReceiveLeg]) -> None:
        """Under the lock, ``req`` verified and its pages moved to READABLE: its state, RESULT to each
        writer, an abort that waited for the verdict, and its waiters woken."""
        req.fsm.to(R.READABLE, "verified")
        req.readable_at = time.monotonic()
        self.stats["completed"] += 1
        for leg in writing:
            self._send(leg.peer, m.Result(rid=req.rid, gen=leg.gen, ok=True, reason="", detail=""), leg.conn)
        if req.abort_after_verify is not None:
            reason = req.abort_after_verify
            req.error = TransferAborted(reason, reason="aborted", rid=req.rid, generation=req.gen)
            req.fsm.to(R.ABORTED, reason)
            self.stats["aborted"] += 1
            self._finish(req, release_from=(PageState.READABLE,))
        self._woke_waiters = self._woke_waiters or bool(getattr(self.changed, "_waiters", True))
        self.changed.notify_all()

    def _record_write_log(self, req: ReceiveRequest, leg: ReceiveLeg, msg: m.Done) -> VerificationFailed | None:
        """Verbs: check DONE's write log against the leg's window and record it, exactly as tcp records writes."""
        if not msg.runs:
            return None
        from ..errors import ProtocolError, WriteRefused
        from ..wire.frames import parse_write_log

        try:
            runs = parse_write_log(msg.runs)
            window, counts = self.guard.check(leg.conn, leg.slot, leg.gen, runs)
        except (ProtocolError, WriteRefused) as exc:
            return VerificationFailed(f"transfer not verified: write log: {exc.detail}", check="write_log",
                                      rid=req.rid, generation=leg.gen, pages=getattr(exc, "pages", None))
        self.guard.record(window, runs, counts)
        return None

    def _on_drained(self, req: ReceiveRequest, leg: ReceiveLeg, why: str) -> None:
        if leg.state is not LegState.STOPPED:
            self.stats["unexpected_drain_ack"] += 1
            self._warn(log, f"{leg.peer}/{req.state.value}", "request %r generation %d: drain proof (%s) in state %s ignored",
                       req.rid, leg.gen, why, req.state.value)
            return
        self._settle_leg(req, leg, why)

    def _settle_leg(self, req: ReceiveRequest, leg: ReceiveLeg, why: str) -> None:
        """A stopped leg proved its drain: nothing more of it can land. The request ends (its pages
        freed) once every leg has."""
        leg.state = LegState.DRAINED
        if req.state is not R.QUARANTINED or not req.settled:
            return
        end = R.FAILED if req.failure else R.ABORTED
        req.fsm.to(end, why)
        self._finish(req, release_from=(PageState.QUARANTINED,))
        self.stats["drained"] += 1

    def _on_writer_gave_up(self, req: ReceiveRequest, leg: ReceiveLeg, reason: str, detail: str, *,
                           rejected: bool) -> None:
        if leg.state is LegState.STOPPED:
            self._settle_leg(req, leg, f"writer {'rejected' if rejected else 'aborted'}: {reason}")
            return
        if leg.state is not LegState.OPEN or req.state is not R.RESERVED:
            self._complain(leg.conn, m.Abort(rid=req.rid, gen=leg.gen, reason=reason, detail=detail),
                           StaleGeneration(f"writer gave up on a request in state {req.state.value}",
                                           rid=req.rid, generation=leg.gen))
            return
        self.guard.close(leg.gen)
        leg.state = LegState.DRAINED
        if rejected:
            error: KvxferError = AdmissionRejected(f"prefill rejected it: {detail}", reason=reason,
                                                   rid=req.rid, generation=req.gen)
            self.stats["rejected"] += 1
            self.stats[f"rejected_{reason}"] += 1
        else:
            error = TransferAborted(f"prefill aborted it: {detail}", reason=reason, rid=req.rid, generation=req.gen)
            self.stats["aborted"] += 1
        req.error = error
        if not req.settled:  # other writers may still write: stop them, free the pages when they proved it
            self._quarantine(req, f"{leg.describe()} gave up: {detail}", failure=False)
            return
        self._answer_claimed(req, reason, f"{leg.describe()} gave up: {detail}")
        req.fsm.to(R.REJECTED if rejected else R.ABORTED, reason)
        self._finish(req, release_from=(PageState.RESERVED, PageState.WRITTEN))

    def _answer_claimed(self, req: ReceiveRequest, reason: str, detail: str) -> None:
        """The request failed before every leg's DONE arrived: a leg whose DONE was already claimed
        has nothing more to prove (DONE came behind its writes), so it gets its own RESULT now
        (ok=false) and its writer frees its sources at once, instead of waiting out its
        ``result_timeout``. Only ever once per leg: a CLAIMED leg is otherwise answered by
        :meth:`_conclude`, which runs only when every leg's DONE arrived while the request was RESERVED."""
        for leg in req.legs:
            if leg.state is LegState.CLAIMED:
                self._send(leg.peer, m.Result(rid=req.rid, gen=leg.gen, ok=False, reason=reason,
                                              detail=f"request failed before every writer's DONE arrived: "
                                                     f"{detail}"[:4000]), leg.conn)

    def _quarantine(self, req: ReceiveRequest, reason: str, *, failure: bool) -> None:
        """RESERVED -> QUARANTINED: every leg still open is stopped (its window closed, its writer asked
        to drain) and the pages frozen until each proves it or is fenced (:meth:`tick`)."""
        req.failure = failure
        self.ledger.move(req.pages, req.gen, PageState.QUARANTINED,
                         allowed=(PageState.RESERVED, PageState.WRITTEN))
        req.fsm.to(R.QUARANTINED, reason)
        req.deadline = self._clock() + self.drain_timeout
        self.stats["quarantined"] += 1
        self._answer_claimed(req, "timeout" if failure else "aborted", reason)
        for leg in req.legs:
            if leg.state is LegState.OPEN:
                self.guard.close(leg.gen)
                leg.state = LegState.STOPPED
                self._send(leg.peer, m.Abort(rid=req.rid, gen=leg.gen, reason="timeout" if failure else "aborted",
                                             detail=reason))
        self.changed.notify_all()

    # local calls -------------------------------------------------------------------------------
    def abort(self, rid: Any, reason: str = "aborted by caller", *, failure: bool = False,
              generation: int | None = None) -> ReceiveRequest:
        """Abort a request. Pages with writes possibly in flight are quarantined (never freed here)."""
        with self.lock:
            self.drain_ended_leases()
            req = self._lookup(rid, generation)
            if req.fsm.terminal or req.state in (R.QUARANTINED, R.RELEASING):
                return req
            if req.state is R.VERIFYING:
                # DONE already proved the drain; the verifier frees the pages when it concludes.
                req.abort_after_verify = reason
                return req
            if req.state is R.READABLE:
                # DONE was ordered behind every write: nothing can still land. Open read leases
                # keep the pages until they end.
                req.error = TransferAborted(reason, reason="aborted", rid=rid, generation=req.gen)
                self.stats["aborted"] += 1
                self._end_reading(req, R.ABORTED, reason)
                return req
            cls = TransferFailed if failure else TransferAborted
            req.error = cls(reason, reason="timeout" if failure else "aborted", rid=rid, generation=req.gen)
            req.failure = failure
            if self.unsafe_legacy:
                # Legacy behaviour: free at once, in-flight writes or not (the use-after-free).
                for leg in req.legs:
                    self.guard.close(leg.gen)
                req.fsm.to(R.FAILED if failure else R.ABORTED, reason)
                self._finish(req, release_from=(PageState.RESERVED, PageState.WRITTEN))
                for leg in req.writing:
                    self._send(leg.peer, m.Abort(rid=rid, gen=leg.gen, reason="aborted", detail=reason))
                return req
            self.stats["aborted" if not failure else "timed_out"] += 1
            self._quarantine(req, reason, failure=failure)
            return req

    def release(self, rid: Any, *, generation: int | None = None) -> None:
        """The consumer is done with a readable request: scrub (per policy) and free its pages, now
        or, while read leases are open, when the last one ends (never blocks)."""
        with self.lock:
            self.drain_ended_leases()  # a read dropped just before this call has ended
            req = self._lookup(rid, generation)
            if req.state is not R.READABLE:
                raise NotReadable(f"cannot release in state {req.state.value}", rid=rid, generation=req.gen)
            self.stats["released"] += 1
            self._end_reading(req, R.RELEASED, "consumer released")

    def _end_reading(self, req: ReceiveRequest, end: ReceiverState, reason: str) -> None:
        """READABLE -> ``end`` (pages freed), or -> RELEASING while read leases are open."""
        if req.leases:
            req.release_as = end
            req.fsm.to(R.RELEASING, f"{reason}; {req.leases} read lease(s) open")
            self.stats["release_deferred"] += 1
            self.changed.notify_all()
            return
        req.fsm.to(end, reason)
        self._finish(req, release_from=(PageState.READABLE,))

    # read leases (kvxfer.engine.reads) -------------------------------------------------------------------
    def open_lease(self, rid: Any, *, generation: int | None = None) -> ReceiveRequest:
        """The page-tag check, then one more lease: every page must be READABLE and stamped with the
        request's generation; the pages are held until :meth:`end_lease`."""
        with self.lock:
            req = self._lookup(rid, generation)
            if req.state is not R.READABLE:
                why = f": {req.error}" if req.error is not None else ""
                raise NotReadable(f"not readable in state {req.state.value}{why}", rid=rid, generation=req.gen)
            self.check_ownership(req)
            req.leases += 1
            return req

    def hold_lease(self, req: ReceiveRequest) -> None:
        """One more hold on a request whose lease is open (a page view, an access in progress)."""
        with self.lock:
            if req.state not in (R.READABLE, R.RELEASING) or req.leases <= 0:
                raise NotReadable(f"no open lease in state {req.state.value}", rid=req.rid, generation=req.gen)
            req.leases += 1

    def end_lease(self, req: ReceiveRequest) -> None:
        """A hold ended; the last one completes a deferred release or abort."""
        with self.lock:
            if req.leases <= 0:
                log.error("request %r generation %d: lease ended twice", req.rid, req.gen)
                return
            req.leases -= 1
            if req.leases == 0 and req.state is R.RELEASING:
                end = req.release_as or R.RELEASED
                req.fsm.to(end, "last read lease ended")
                self._finish(req, release_from=(PageState.READABLE,))

    def end_lease_later(self, req: ReceiveRequest) -> None:
        """:meth:`end_lease` from a finalizer: queued (no lock taken here), done by :meth:`tick`."""
        self._ended_leases.append(req)

    def drain_ended_leases(self) -> None:
        """End the holds whose views or leases were garbage-collected since the last call."""
        with self.lock:
            while self._ended_leases:
                self.end_lease(self._ended_leases.popleft())

    def check_ownership(self, req: ReceiveRequest) -> None:
        ok = self.ledger.owned_by(req.pages, req.gen, (PageState.READABLE,))
        if not ok.all():
            bad = req.pages[~ok]
            first = int(bad[0])
            raise OwnershipError(
                f"page {first} is {PageState(int(self.ledger.state[first])).name} of generation "
                f"{int(self.ledger.generation[first])}, not READABLE of this request",
                rid=req.rid, generation=req.gen, pages=bad,
            )

    def status(self, rid: Any) -> ReceiveRequest:
        rid = check_rid(rid)
        with self.lock:
            req = self.active.get(rid) or self.recent.get(rid)
            if req is None:
                raise UnknownRequest("never admitted here (or forgotten)", rid=rid)
            return req

    # connection events -------------------------------------------------------------------------
    def on_connection_closed(self, conn: Any, reason: str) -> list[ReceiveRequest]:
        """``conn`` is fenced or gone: nothing more can land from it. Settle its requests' legs; a
        request whose other writers may still write is quarantined until they proved their drain."""
        with self.lock:
            settled = []
            for req in list(self.active.values()):
                legs = [leg for leg in req.legs if leg.conn == conn and leg.state in (LegState.OPEN, LegState.STOPPED)]
                if not legs:
                    continue
                for leg in legs:
                    self.guard.close(leg.gen)
                    leg.state = LegState.DRAINED
                if req.state is R.RESERVED:
                    req.error = TransferFailed(f"connection closed: {reason}", reason="connection",
                                               rid=req.rid, generation=req.gen)
                    self.stats["failed_connection"] += 1
                    if not req.settled:
                        self._quarantine(req, f"connection closed: {reason}", failure=True)
                        continue
                    self._answer_claimed(req, "connection", f"connection closed: {reason}")
                    req.fsm.to(R.FAILED, f"connection closed: {reason}")
                    self._finish(req, release_from=(PageState.RESERVED, PageState.WRITTEN))
                    settled.append(req)
                elif req.state is R.QUARANTINED and req.settled:
                    end = R.FAILED if req.failure else R.ABORTED
                    req.fsm.to(end, f"fenced: {reason}")
                    self._finish(req, release_from=(PageState.QUARANTINED,))
                    self.stats["released_by_fence"] += 1
                    settled.append(req)
            for info in self.peers.values():
                if info.conn == conn:
                    info.conn = None
            return settled

    def tick(self) -> list[tuple[Any, str]]:
        """Apply timeouts and end the leases whose views were collected. Returns connections to
        fence (the caller fences outside the lock)."""
        with self.lock:
            self.drain_ended_leases()
            now = self._clock()
            to_fence: dict[Any, str] = {}
            for req in list(self.active.values()):
                if now < req.deadline:
                    continue
                if req.state is R.RESERVED:
                    self.abort(req.rid, f"transfer timed out after {self.transfer_timeout:g} s",
                               failure=True, generation=req.gen)
                elif req.state is R.QUARANTINED:
                    for leg in req.legs:
                        if leg.state is LegState.STOPPED and leg.conn is not None:
                            to_fence.setdefault(
                                leg.conn,
                                f"no drain proof for request {req.rid!r} generation {leg.gen} within "
                                f"{self.drain_timeout:g} s",
                            )
            return list(to_fence.items())

    # bookkeeping ---------------------------------------------------------------------------------
    def _lookup(self, rid: Any, generation: int | None) -> ReceiveRequest:
        rid = check_rid(rid)
        req = self.active.get(rid) or self.recent.get(rid)
        if req is None:
            raise UnknownRequest("never admitted here (or forgotten)", rid=rid)
        if generation is not None and generation != req.gen:
            raise StaleGeneration(f"current generation is {req.gen}", rid=rid, generation=generation)
        return req

    def _finish(self, req: ReceiveRequest, *, release_from: tuple[PageState, ...]) -> None:
        """A request reached a terminal state: free its pages (proof in hand), slots and entry."""
        for leg in req.legs:
            if leg.conn is not None:
                self._revoke(leg.conn, leg.gen)  # before the pages can be reused (idempotent)
            self.guard.forget(leg.gen)
            if leg.slot >= 0:
                self._free_slots.append(leg.slot)
                leg.slot = -1
        if req.pages.size:
            self.pool.release(req.pages, req.gen, allowed=release_from)
        if not req.legs:
            self.guard.forget(req.gen)
        req.slot = -1
        req.finished = self._clock()
        if self.active.get(req.rid) is req:
            del self.active[req.rid]
        self._remember(req)
        self.changed.notify_all()

    def _remember(self, req: ReceiveRequest) -> None:
        if req.gen:
            for gen in {req.gen, *(leg.gen for leg in req.legs)}:
                self.by_gen[gen] = req
                self.by_gen.move_to_end(gen)
            while len(self.by_gen) > HISTORY_LIMIT:
                self.by_gen.popitem(last=False)
        if req.fsm.terminal:
            self.recent[req.rid] = req
            self.recent.move_to_end(req.rid)
            while len(self.recent) > HISTORY_LIMIT:
                self.recent.popitem(last=False)

    def check_accounting(self) -> dict[str, int]:
        """The pool accounting invariant, including every active request's custody.

        A consistent snapshot on a busy engine: every ledger, window and request change happens
        under :attr:`lock`, which this holds throughout (data keeps moving into pages that were
        checked before the snapshot; page states only change under the lock)."""
        from ..errors import LedgerInvariantError

        with self.lock:
            self.drain_ended_leases()
            counts = self.ledger.check_invariants()
            expected_states = {
                R.RESERVED: (PageState.RESERVED, PageState.WRITTEN),
                R.VERIFYING: (PageState.RESERVED, PageState.WRITTEN),  # window closed, verdict pending
                R.READABLE: (PageState.READABLE,),
                R.RELEASING: (PageState.READABLE,),  # held for open read leases
                R.QUARANTINED: (PageState.QUARANTINED,),
            }
            holdings = []
            for req in self.active.values():
                allowed = expected_states.get(req.state)
                if allowed is None:
                    raise LedgerInvariantError(
                        f"active request in state {req.state.value}", rid=req.rid, generation=req.gen
                    )
                if (req.leases > 0) != (req.state is R.RELEASING) and req.state is not R.READABLE:
                    raise LedgerInvariantError(f"{req.leases} read holds in state {req.state.value}",
                                               rid=req.rid, generation=req.gen)
                for leg in req.legs:
                    if leg.state is LegState.NULL:
                        continue
                    window = self.guard.window(leg.gen)
                    should = req.state is R.RESERVED and leg.state is LegState.OPEN
                    if should != bool(window is not None and window.open):
                        raise LedgerInvariantError(
                            f"{leg.describe()}: write window {'closed' if should else 'open'} with the leg "
                            f"{leg.state.value} in state {req.state.value}", rid=req.rid, generation=req.gen,
                        )
                holdings.append((req.rid, req.gen, req.pages, allowed))
            self.ledger.check_custody(holdings)
            held = [leg.slot for req in self.active.values() for leg in req.legs if leg.slot >= 0]
            if len(set(held) | set(self._free_slots)) != len(held) + len(self._free_slots):
                raise LedgerInvariantError("request slot handed out twice")
            return counts
