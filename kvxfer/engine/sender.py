"""The writing (prefill) role: admission, source pages, tagged writes, DONE, drain acknowledgements.

:class:`Sender` is the prefill engine's logic without I/O. The engine feeds it calls, control
messages from receivers and write completions from the transport; it answers through ``send``
(control messages) and the peer's transport link (writes and ordered messages).

Invariants:

* a request is ``REJECTED`` before it holds a page, learns a destination or posts a write;
* every posted write is counted (``posted``) and every completion, successful or not, is counted
  (``completed``); a request is *quiescent* when the two are equal;
* DRAIN_ACK (and a writer-side ABORT) is posted only when the request is quiescent, on the ordered
  path behind its writes, so it proves that nothing more will land;
* source pages return to the pool only when the request is terminal *and* drained (quiescent and,
  once DONE was posted, DONE built by the transport or the link gone), and :meth:`Sender.settled`
  callers see a settled request only then, since a transport may still be reading source memory for
  a posted write or for DONE's checksum;
* a request in ``DONE_SENT`` fails after ``result_timeout`` without a RESULT (a decode that took the
  KV and never answers); its sources then follow the same rule, and a link that has not taken its
  writes by then is handed back to the engine to close.

A request has one *leg* per destination: with a decode of more tensor-parallel ranks than this
prefill (``fanout``, :func:`kvxfer.core.geometry.fanout`), each of those ranks reserves its own pages
and sends its own META, naming the heads it takes from this prefill (``META.heads``). The request is
``READY`` when every leg has its destination; each chunk goes to every leg (page for page, or as the
head slice's runs, :mod:`kvxfer.core.slicing`); each leg gets its own DONE and RESULT, and the request
succeeds when every leg did. A request fails as one: when one leg fails, every other leg still
writing is stopped and gets a writer ABORT on its ordered path once its posted writes completed, so
each decode rank frees its pages at once. A leg that writes nothing (its heads come from another
prefill rank) completes when it binds. With one destination this is the request as it always was.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..core.arguments import (
    check_aux,
    check_count,
    check_peer,
    check_peers,
    check_rid,
    check_tokens,
    describe_buffers,
    page_array,
)
from ..core.checksum import ChecksumAlgo, checksum_addresses, checksum_pages, combine, native_id
from ..core.geometry import KVGeometry, fanout, serves
from ..core.ledger import PageState
from ..core.lifecycle import Lifecycle, SenderState
from ..core.pagesets import all_set, any_set, has_duplicates, isin
from ..core.pool import PagePool
from ..core.runs import WriteBatch, build_batch, is_ready_event
from ..core.slicing import LegAtoms, LegShape, canonical_pieces, chunk_runs
from ..errors import (
    AdmissionRejected,
    ConfigError,
    DuplicateRequest,
    InvalidArgument,
    KvxferError,
    PeerError,
    PoolExhausted,
    StaleGeneration,
    TransferAborted,
    TransferFailed,
    TransportError,
    UnknownRequest,
)
from ..wire import messages as m

log = logging.getLogger("kvxfer.sender")
S = SenderState
HISTORY_LIMIT = 65536


@dataclass
class DoneBuilder:
    """DONE for one leg, built by the transport when it has sent everything before it."""

    layout: Any
    algo: ChecksumAlgo
    rid: Any
    gen: int
    aux: bytes
    src: np.ndarray
    batches: list[WriteBatch]
    write_log: bool
    on_built: Callable[[], None] | None = None  # DONE is built: the transport reads no source page for it
    atoms: LegAtoms | None = None  # a head slice: what the leg writes (None: whole pages)
    dst_pages: int = 0  # the destination's page count (a head slice's claim)

    def checksum(self) -> int:
        if self.algo is ChecksumAlgo.NONE:
            return 0
        def ready(batch: WriteBatch) -> bool:
            if batch.sums_done:
                return True
            return batch.sums_ready is not None and batch.sums_ready.wait(60) and batch.item_sums is not None

        if self.batches and all(ready(b) for b in self.batches):
            # each batch's sums run buffer-major over its chunk, one per unit (a page, or a slice's
            # piece); a stable sort by buffer puts them in canonical order: buffer by buffer, chunks in order
            units = [b.unit_lengths(self.layout.item_lens) for b in self.batches]
            counts = [b.item_counts(self.layout.item_lens) for b in self.batches]
            if len(self.batches) == 1:  # one chunk: its sums are in canonical order already
                single = int(counts[0].max()) == 1  # a run per page (scattered pages): a sum per run
                return combine(self.algo, self.batches[0].item_sums, units[0] if single else np.repeat(units[0], counts[0]))
            buffers = np.concatenate([np.repeat(b.buffers, c) for b, c in zip(self.batches, counts)])
            lengths = np.concatenate([np.repeat(u, c) for u, c in zip(units, counts)])
            values = np.concatenate([b.item_sums for b in self.batches])
            order = np.argsort(buffers, kind="stable")
            return combine(self.algo, values[order], lengths[order])
        if self.atoms is not None:
            geometry = self.layout.geometry
            addresses, lengths = canonical_pieces(
                self.atoms, self.src, source=True, bases=np.array([b.address for b in self.layout.buffers]),
                items=self.layout.item_lens, head_bytes=np.array([b.head_bytes for b in geometry.buffers]),
                src_pages=self.src.size)
            return checksum_addresses(self.layout.device, addresses, lengths, self.algo)
        return checksum_pages(self.layout, self.src, self.algo)

    def unsummed(self, batch: WriteBatch) -> m.Done | None:
        """The DONE this builder builds, with checksum 0, when its checksum is the combination, in order,
        of the item checksums of ``batch``, its one batch, of whole pages (no write log, nothing cancelled,
        the sums taken by the transport): a transport that sums that batch as it sends it fills the
        checksum in (the number :meth:`checksum` would compute from those sums) and calls :meth:`built`
        once it sent it. None otherwise (another batch than this DONE's: the transport calls the builder)."""
        if self.atoms is not None or self.write_log or len(self.batches) != 1 or self.batches[0] is not batch:
            return None
        if batch.cancelled or batch.units is not None or batch.sums_ready is not None:
            return None
        return m.Done(rid=self.rid, gen=self.gen, bytes=self.layout.bytes_for_pages(self.src.size),
                      pages=int(self.src.size), checksum=0, algo=self.algo.value, aux=self.aux)

    def built(self) -> None:
        """DONE was built (or sent filled in, :meth:`unsummed`): the transport reads no source page for it."""
        if self.on_built is not None:
            self.on_built()

    def __call__(self) -> m.Message:
        """DONE, or a writer ABORT when some of the leg's writes were cancelled before they left (the
        request failed meanwhile): DONE must never claim writes that were not sent. Built on the
        transport's thread, behind every write of the leg."""
        try:
            if any(batch.cancelled for batch in self.batches):
                failed = next((b.ready_error for b in self.batches if b.ready_error is not None), None)
                detail = ("the request failed on another of its legs; its writes stopped" if failed is None else
                          f"a chunk's ready event raised before its source pages were read: {failed}"[:2000])
                return m.Abort(rid=self.rid, gen=self.gen, reason="aborted", detail=detail)
            log_bytes = b"".join(batch.log_bytes() for batch in self.batches) if self.write_log else b""
            if self.atoms is None:
                nbytes, pages = self.layout.bytes_for_pages(self.src.size), int(self.src.size)
            else:
                head_bytes = sum(b.head_bytes for b in self.layout.geometry.buffers)
                sent = self.atoms.chunk(0, self.src.size)
                nbytes, pages = (sent.stop - sent.start) * self.atoms.unit_heads * head_bytes, self.dst_pages
            return m.Done(rid=self.rid, gen=self.gen, bytes=nbytes, pages=pages, checksum=self.checksum(),
                          algo=self.algo.value, aux=self.aux, runs=log_bytes)
        except Exception as exc:  # never end the transport's thread: the receiver gets a reason instead
            log.exception("request %r generation %d: building DONE failed", self.rid, self.gen)
            return m.Abort(rid=self.rid, gen=self.gen, reason="internal", detail=f"building DONE failed: {exc}")
        finally:
            self.built()



def _unhold_all(links: list[Any]) -> None:
    """Unhold every link of a post, even when one's unhold raises (its inline send failing where nothing
    caught it): a link left held never sends again. The first error is raised once all are unheld."""
    error: BaseException | None = None
    for link in links:
        try:
            link.unhold()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the other links
            error = error or exc
    if error is not None:
        raise error

class SenderLink(Protocol):
    """What the sender needs of a transport connection to one receiver. Optional, used when present
    (:class:`kvxfer.transport.base.SenderLink` has them): ``prepare(batch)`` before a send,
    ``hold()``/``unhold()`` around posting a chunk's writes and DONE."""

    conn_id: Any

    def post_writes(self, batch: WriteBatch, on_complete: Callable[[WriteBatch, int, int], None]) -> None: ...

    def post_ordered(self, msg: m.Message, *, slot: int, gen: int) -> None: ...


@dataclass
class SendLeg:
    """One destination of a request: a decode rank's pages and tag, the link to it, what was posted
    there (quiescent when every posted write completed) and how it ended."""

    peer: str
    gen: int
    slot: int
    link: Any
    dst_pages: np.ndarray
    access: bytes = b""  # META.access: the transport's keys for the destination (verbs memory windows)
    heads: tuple[int, ...] = ()  # META.heads: () page for page; (first, count) a head slice
    atoms: LegAtoms | None = None  # a head slice or another page size: the leg's pieces (None: page for page)
    dst_item_lens: np.ndarray | None = None  # the destination's bytes per page (with atoms)
    null: bool = False  # nothing to write: its heads come from another writer
    group: str = ""  # the destination's tensor-parallel group (every leg of a request: the same)
    rank: int = 0  # its tensor-parallel rank
    req: Any = None  # the SendRequest
    posted: int = 0
    completed: int = 0
    failed_writes: int = 0
    bytes_posted: int = 0
    batches: list[WriteBatch] = field(default_factory=list)
    done_posted: bool = False  # DONE was posted behind the last write ...
    done_built: bool = False  # ... and the transport has built it (it reads no source page any more)
    succeeded: bool = False  # RESULT ok (a null leg: at once)
    owes: type | None = None  # a drain proof to post once quiescent (DRAIN_ACK or writer ABORT)
    prepared: WriteBatch | None = None  # the whole request's writes, built when the destination arrived
    proof_posted: bool = False

    @property
    def quiescent(self) -> bool:
        return self.completed == self.posted

    @property
    def alive(self) -> bool:
        return self.link is not None and getattr(self.link, "alive", False)

    @property
    def drained(self) -> bool:
        """Nothing of the leg is left on its link: every write completed and, once DONE was posted,
        DONE built (or the link ended, which takes its queue with it)."""
        if self.completed != self.posted:
            return False
        if not self.done_posted or self.done_built:
            return True
        return not self.alive


@dataclass
class SendRequest:
    """One request on the prefill side: lifecycle, source pages and its legs (destinations), each with
    posted/completed write counts (quiescent when equal). ``gen``, ``peer`` and the destination fields
    are the first leg's (the only one's, with one destination)."""

    rid: Any
    tokens: int
    fsm: Lifecycle
    pages: np.ndarray
    local_gen: int
    external: bool = False
    gen: int = 0
    peer: str | None = None
    expected_peers: list[str] | None = None  # admit(peer=... / peers=...): only these decodes may bind it
    legs: list[SendLeg] = field(default_factory=list)
    fanout: int = 1  # destinations the request waits for (known when its first leg binds)
    src_count: int = 0  # source pages the request sends (its tokens in this engine's pages)
    sent: int = 0  # positions (request pages) every buffer has sent
    # per buffer: positions sent (a send names a group of buffers, a layer, or all of them); and the
    # source page at each position, fixed by the first group that sent it (-1: not yet). None before
    # the first send.
    buffer_sent: np.ndarray | None = None
    order: np.ndarray | None = None
    deadline: float = float("inf")
    error: KvxferError | None = None
    placeholder: bool = False
    sources_released: bool = False
    created: float = field(default_factory=time.monotonic)
    finished: float | None = None

    @property
    def state(self) -> SenderState:
        return self.fsm.state

    @property
    def expected_peer(self) -> str | None:
        return self.expected_peers[0] if self.expected_peers and len(self.expected_peers) == 1 else None

    @property
    def writing(self) -> list[SendLeg]:
        return [leg for leg in self.legs if not leg.null]

    def _first(self) -> SendLeg | None:
        return self.legs[0] if self.legs else None

    @property
    def slot(self) -> int:
        leg = self._first()
        return leg.slot if leg is not None else -1

    @property
    def link(self) -> Any:
        leg = self._first()
        return leg.link if leg is not None else None

    @property
    def dst_pages(self) -> np.ndarray | None:
        leg = self._first()
        return leg.dst_pages if leg is not None else None

    @property
    def access(self) -> bytes:
        leg = self._first()
        return leg.access if leg is not None else b""

    @property
    def batches(self) -> list[WriteBatch]:
        return [b for leg in self.legs for b in leg.batches]

    @property
    def posted(self) -> int:
        return sum(leg.posted for leg in self.legs)

    @property
    def completed(self) -> int:
        return sum(leg.completed for leg in self.legs)

    @property
    def failed_writes(self) -> int:
        return sum(leg.failed_writes for leg in self.legs)

    @property
    def bytes_posted(self) -> int:
        return sum(leg.bytes_posted for leg in self.legs)

    @property
    def quiescent(self) -> bool:
        return all(leg.quiescent for leg in self.legs)

    @property
    def drained(self) -> bool:
        """Nothing of the request is left on any of its links (see :attr:`SendLeg.drained`)."""
        return all(leg.drained for leg in self.legs)

    @property
    def total_pages(self) -> int:
        """Source pages the request sends."""
        if self.placeholder:
            return len(self.pages)
        leg = next((leg for leg in self.legs if not leg.null), None)
        if leg is not None and leg.atoms is None:
            return len(leg.dst_pages)
        return self.src_count

    def leg(self, peer: str, gen: int) -> SendLeg | None:
        for leg in self.legs:
            if leg.peer == peer and leg.gen == gen:
                return leg
        return None


class Sender:
    """The prefill role's logic without I/O: admission, source pages, tagged writes, DONE and drain acknowledgements (see the module's invariants)."""

    def __init__(
        self,
        pool: PagePool,
        *,
        max_context: int,
        checksum: ChecksumAlgo | str = ChecksumAlgo.ADLER32,
        meta_timeout: float = 60.0,
        send: Callable[[str, m.Message], None] | None = None,
        link_for: Callable[[str], Any] | None = None,
        lock: threading.RLock | None = None,
        clock: Callable[[], float] = time.monotonic,
        unsafe_legacy: bool = False,
        defer: Callable[[Callable[[], None]], None] | None = None,
        observer: Callable[[Lifecycle, Any, str], None] | None = None,
        max_pending_meta: int = 4096,
        write_log: bool = False,
        result_timeout: float = 120.0,
        max_pending_meta_bytes: int = 64 << 20,
        warn: Callable[..., None] | None = None,
        peer_layout: Callable[[str], tuple[int, KVGeometry | None]] | None = None,
    ) -> None:
        self.pool = pool
        self.write_log = write_log  # the transport's receiver cannot see writes land: DONE carries the log
        self._defer = defer
        self.layout = pool.layout
        self._every_buffer = np.arange(self.layout.num_buffers, dtype=np.int64)
        self._every_buffer.flags.writeable = False  # shared by every send of all buffers: nobody changes it
        self.max_context = int(max_context)
        self.checksum = ChecksumAlgo.parse(checksum)
        self.meta_timeout = meta_timeout
        self._send = send or (lambda peer, msg: None)
        self._link_for = link_for or (lambda peer: None)
        # a receiver's page size and geometry, from its HELLO
        self._peer_layout = peer_layout or (lambda peer: (self.layout.page_size, None))
        self.lock = lock or threading.RLock()
        self._clock = clock
        self.unsafe_legacy = unsafe_legacy
        self.active: dict[Any, SendRequest] = {}
        self.by_gen: OrderedDict[tuple[str, int], SendRequest] = OrderedDict()
        self.recent: OrderedDict[Any, SendRequest] = OrderedDict()
        # destinations for requests not admitted yet: rid -> [(peer, META, deadline)], one per decode rank
        self.pending_meta: dict[Any, list[tuple[str, m.Meta, float]]] = {}
        self.max_pending_meta = max_pending_meta
        self.max_pending_meta_bytes = max_pending_meta_bytes  # page-list bytes held per peer in pending_meta
        self._pending_bytes: Counter[str] = Counter()  # per peer; may run high (removals do not count), never low
        self.result_timeout = result_timeout
        # terminal requests whose sources wait for their links to drain (DONE built, or the link gone)
        self.undrained: dict[int, SendRequest] = {}
        # warn(logger, limit_key, msg, *args): a WARNING a peer can provoke (the engine rate limits it)
        self._warn = warn or (lambda target, _key, msg, *args: target.warning(msg, *args))
        self.meta_gen_seen: dict[str, int] = {}  # per receiver: newest META generation (they only grow)
        # Decode rejections (REJECT, generation G) for requests not admitted here yet: applied to the
        # next admission of that id, unless a META of a newer generation shows the decode moved on.
        self.peer_rejections: dict[Any, tuple[m.Reject, float, str]] = {}
        # Requests the caller gave up on before admitting them (refuse()): a destination offered for
        # one is answered with REJECT at once instead of waiting for meta_timeout.
        self.refused: dict[Any, tuple[str, str, float]] = {}
        self._next_local_gen = 1
        self.stats: Counter[str] = Counter()
        self.observer = observer
        self.changed = threading.Condition(self.lock)

    # admission ----------------------------------------------------------------------------------
    def admit(self, rid: Any, tokens: int, *, external_pages: bool = False, peer: str | None = None,
              peers: list[str] | None = None) -> SendRequest:
        """Admit a prompt: reject what can never fit, else hold source pages for it.

        With ``external_pages`` the engine's own allocator owns the source pages and passes them to
        :meth:`send` (SGLang); kvxfer then holds none. With ``peer`` only that decode engine may give
        the request its destination or reject it; any other peer's META/REJECT for it is refused.
        ``peers``: the same for a request that goes to several decode ranks (each sends its own META).

        Raises :class:`InvalidArgument` before anything is held for an id, token count or peer the
        API cannot take."""
        rid = check_rid(rid)
        tokens = check_tokens(tokens, rid)
        peer = check_peer(peer, rid)
        expected = check_peers(peers, rid)
        if peer is not None:
            if expected is not None:
                raise InvalidArgument("give peer or peers, not both", rid=rid)
            expected = [peer]
        with self.lock:
            if rid in self.active:
                live = self.active[rid]
                raise DuplicateRequest(f"already active in state {live.state.value}", rid=rid,
                                       generation=live.gen or None)
            self.refused.pop(rid, None)  # a new attempt under that id
            fsm = Lifecycle("sender", rid, observer=self.observer)
            req = SendRequest(rid=rid, tokens=tokens, fsm=fsm, pages=np.empty(0, dtype=np.int64),
                              local_gen=0, external=external_pages, expected_peers=expected,
                              src_count=self.layout.pages_for_tokens(tokens))
            problem = self._admission_problem(tokens)
            if problem is not None and self.unsafe_legacy and problem[0] == "exceeds_pool":
                # The incident's path: swap the prompt for a one-page placeholder and carry on.
                req.placeholder = True
                problem = None
            if problem is not None:
                reason, text = problem
                req.fsm.to(S.REJECTED, reason)
                req.error = AdmissionRejected(text, reason=reason, rid=rid)
                req.finished = self._clock()
                self.stats["rejected"] += 1
                self.stats[f"rejected_{reason}"] += 1
                log.info("rejected at admission: %s", req.error)
                for pending_peer, msg, _deadline in self.pending_meta.pop(rid, []):
                    req.gen = req.gen or msg.gen  # the decode's attempt this rejection answers
                    self._reject_meta(pending_peer, msg, reason, text)
                remembered = self.peer_rejections.pop(rid, None)
                if remembered is not None and not req.gen:
                    req.gen = remembered[0].gen  # both roles refused that attempt: settled
                self._remember(req)
                self.changed.notify_all()
                raise req.error
            if not external_pages:
                needed = 1 if req.placeholder else self.layout.pages_for_tokens(tokens)
                if needed > self.pool.ledger.free_count:
                    raise PoolExhausted(
                        f"needs {needed} source pages, {self.pool.ledger.free_count} free", rid=rid
                    )
                req.local_gen = self._next_local_gen
                self._next_local_gen += 1
                req.pages = self.pool.ledger.allocate(needed, req.local_gen)
            req.fsm.to(S.ADMITTED, "source pages held" if not external_pages else "admitted")
            req.deadline = self._clock() + self.meta_timeout
            self.active[rid] = req
            self.stats["admitted"] += 1
            rejection = self.peer_rejections.pop(rid, None)
            if rejection is not None and expected is not None and rejection[2] not in expected:
                rejection = None  # another decode's word about a request it does not serve
            if rejection is not None:
                req.gen = rejection[0].gen
                self._fail(req, AdmissionRejected(f"decode rejected it: {rejection[0].detail}",
                                                  reason=rejection[0].reason, rid=rid, generation=req.gen or None))
                return req
            for pending_peer, msg, _deadline in self.pending_meta.pop(rid, []):
                if req.fsm.terminal:
                    self._reject_meta(pending_peer, msg, "failed", f"request {rid!r} failed: {req.error}")
                elif expected is not None and pending_peer not in expected:
                    self._error(pending_peer, msg, PeerError(
                        f"META from {pending_peer!r}, but the request was admitted for decode "
                        f"{', '.join(map(repr, expected))}", rid=rid, generation=msg.gen))
                elif req.state is S.ADMITTED:
                    self._bind_meta(req, pending_peer, msg)
            return req

    def _admission_problem(self, tokens: int) -> tuple[str, str] | None:
        if tokens <= 0:
            return "empty", f"prompt of {tokens} tokens"
        if tokens > self.max_context:
            return "exceeds_context", f"prompt of {tokens:,} tokens exceeds the context of {self.max_context:,}"
        if tokens > self.layout.pool_tokens:
            return (
                "exceeds_pool",
                f"prompt of {tokens:,} tokens can never fit this prefill pool of "
                f"{self.layout.pool_tokens:,} tokens",
            )
        return None

    # control messages from receivers ---------------------------------------------------------------
    def on_meta(self, peer: str, msg: m.Meta) -> None:
        """A receiver's destination for request ``msg.rid``. Replay protection is per peering: a META
        whose generation is not after the newest one ``peer`` sent in its current peering
        (``meta_gen_seen``) is refused (``stale_meta``); a new peering starts afresh
        (:meth:`forget_peer`), since a decode restarted under the same engine id counts from 1 again."""
        with self.lock:
            newest = self.meta_gen_seen.get(peer, 0)
            if msg.gen <= newest:
                # A receiver's generations only grow and its META messages arrive in order: this one
                # is a replay (or a buggy peer); binding it would aim writes at an old generation.
                self.stats["stale_meta"] += 1
                self._error(peer, msg, StaleGeneration(
                    f"META generation {msg.gen} is not after {newest}, the newest from peer {peer!r} in this "
                    "peering: replayed", rid=msg.rid, generation=msg.gen))
                return
            self.meta_gen_seen[peer] = msg.gen
            # Every key of this peering's generations is at most ``newest``: one at msg.gen is a request
            # of a peering that ended (a decode restarted under the same engine id): it goes, so that
            # this peering's ABORT or RESULT for msg.gen never finds it.
            self.by_gen.pop((peer, msg.gen), None)
            remembered = self.peer_rejections.get(msg.rid)
            if remembered is not None and remembered[2] == peer and remembered[0].gen < msg.gen:
                # The decode rejected an older attempt and now reserved pages for a new one.
                del self.peer_rejections[msg.rid]
                self.stats["rejections_superseded"] += 1
            req = self.active.get(msg.rid)
            refusal = self.refused.pop(msg.rid, None) if req is None else None
            if refusal is not None:
                self.stats["refused_meta"] += 1
                self._reject_meta(peer, msg, refusal[0], refusal[1])
                if fanout(self.layout.geometry, self._geometry_of(peer)) > 1:
                    self.refused[msg.rid] = refusal  # every decode rank of the request hears it
                return
            if req is None:
                self._hold_meta(peer, msg)
                return
            if req.expected_peers is not None and peer not in req.expected_peers:
                self._error(peer, msg, PeerError(
                    f"META from {peer!r}, but the request was admitted for decode "
                    f"{', '.join(map(repr, req.expected_peers))}", rid=msg.rid, generation=msg.gen))
                return
            if req.legs and req.fanout == 1 and peer != req.peer:  # any_peer: the first META bound it
                self._error(peer, msg, PeerError(
                    f"META from {peer!r}, but the request is bound to decode {req.peer!r}",
                    rid=msg.rid, generation=msg.gen))
                return
            if req.state is not S.ADMITTED or any(leg.peer == peer for leg in req.legs):
                self._error(peer, msg, StaleGeneration(
                    f"META for a request already in state {req.state.value}", rid=msg.rid, generation=msg.gen))
                return
            self._bind_meta(req, peer, msg)

    def forget_peer(self, peer: str, why: str) -> dict[str, int]:
        """End what this sender keeps of ``peer``'s peering: the engine forgot the peer, or a new HELLO
        from it starts another peering (a decode restarted under the same engine id counts its
        generations from 1 again, and may name the same request ids). Afterwards:

        * ``meta_gen_seen`` has no entry for ``peer``: replay protection belongs to one peering, and the
          table holds at most the peers the engine holds;
        * ``by_gen`` entries of ``peer`` are left where they are (the table holds up to HISTORY_LIMIT
          entries of every peer: scanning it per forgotten peer would hold the lock for milliseconds
          each, in a restart storm for seconds); :meth:`on_meta` drops the one a new peering's META
          reuses, before that META is held or bound, so no message of the new peering finds a request
          of an old one;
        * no destination (META) from ``peer`` is held for a request not admitted here: it names pages of
          a peering that ended. Each becomes a remembered rejection of generation 0 for that id, so its
          admission fails at once naming ``peer`` (any META of the next peering supersedes it).

        Returns how many entries of each table went."""
        with self.lock:
            if self.meta_gen_seen.pop(peer, None) is None:
                return {"meta_gen_seen": 0, "pending_meta": 0}  # no META this peering: nothing of it is held
            held = 0
            for rid, entries in list(self.pending_meta.items()):
                kept = [e for e in entries if e[0] != peer]
                if len(kept) == len(entries):
                    continue
                held += len(entries) - len(kept)
                if kept:
                    self.pending_meta[rid] = kept
                else:
                    del self.pending_meta[rid]
                if rid not in self.peer_rejections and len(self.peer_rejections) < self.max_pending_meta:
                    gone = m.Reject(rid=rid, gen=0, reason="connection",
                                    detail=f"decode {peer}'s destination for it is gone: {why}"[:4000])
                    self.peer_rejections[rid] = (gone, self._clock() + self.meta_timeout, peer)
            self._pending_bytes.pop(peer, None)
            return {"meta_gen_seen": 1, "pending_meta": held}

    def _hold_meta(self, peer: str, msg: m.Meta) -> None:
        """A destination for a request not admitted here (yet): answered at once if this prefill already
        refused it or it can never be admitted, else held (capped per peer) until admission or meta_timeout."""
        ranks = fanout(self.layout.geometry, self._geometry_of(peer))
        old = self.recent.get(msg.rid)
        if old is not None and old.state is S.REJECTED and old.tokens == msg.tokens and (old.gen == 0 or ranks > 1):
            # This prefill already refused this prompt (before its META arrived): answer it (every
            # decode rank of it). A META for another size is a retry under the same id and waits.
            old.gen = old.gen or msg.gen
            self._reject_meta(peer, msg, old.error.reason, old.error.detail)  # type: ignore[union-attr]
            return
        held = [e for e in self.pending_meta.get(msg.rid, []) if e[0] != peer]  # a newer one from a peer replaces its own
        if len(held) >= ranks:
            self._error(peer, msg, PeerError(
                f"META while a destination from {held[0][0]!r} is already pending for it",
                rid=msg.rid, generation=msg.gen))
            return
        most = -(-self.max_context // max(1, self._page_size_of(peer)))  # in the receiver's pages
        if len(msg.pages) > most and not self.unsafe_legacy:
            # no prompt this prefill admits needs that many pages: never held, answered at once
            self.stats["oversized_meta"] += 1
            text = (f"{len(msg.pages):,} destination pages, more than the {most:,} of the longest prompt "
                    f"this prefill admits ({self.max_context:,} tokens)")
            self._warn(log, f"{peer}/oversized", "refused META %r from %s: %s", msg.rid, peer, text)
            self._reject_meta(peer, msg, "exceeds_context", text)
            return
        mine = sum(1 for entries in self.pending_meta.values() for p, _m, _d in entries if p == peer)
        if not held and len(self.pending_meta) >= self.max_pending_meta and mine >= self.max_pending_meta:
            self.stats["flood_refused"] += 1
            self._error(peer, msg, PeerError(
                f"{self.max_pending_meta} destinations from this peer already wait for requests not "
                "admitted here; refusing more", rid=msg.rid, generation=msg.gen))
            return
        size = int(msg.pages.nbytes) + len(msg.access)  # page list and transport keys (verbs windows)
        if self._pending_bytes[peer] + size > self.max_pending_meta_bytes:
            held_bytes = sum(int(e[1].pages.nbytes) + len(e[1].access) for entries in self.pending_meta.values()
                             for e in entries if e[0] == peer)
            self._pending_bytes[peer] = held_bytes  # the running count only ever overestimates
            if held_bytes + size > self.max_pending_meta_bytes:
                self.stats["meta_bytes_refused"] += 1
                self._error(peer, msg, PeerError(
                    f"destinations from this peer already hold {held_bytes:,} bytes of page lists for "
                    f"requests not admitted here (max_pending_meta_bytes {self.max_pending_meta_bytes:,}); "
                    "refusing more", rid=msg.rid, generation=msg.gen))
                return
        self._pending_bytes[peer] += size
        self.pending_meta[msg.rid] = held + [(peer, msg, self._clock() + self.meta_timeout)]

    def _page_size_of(self, peer: str) -> int:
        return self._peer_layout(peer)[0]

    def _geometry_of(self, peer: str) -> KVGeometry | None:
        return self._peer_layout(peer)[1]

    def _leg_plan(self, req: SendRequest, peer: str, msg: m.Meta) -> tuple[SendLeg | None, str]:
        """The leg a META describes, or why it cannot be served (a size or layout mismatch)."""
        writer = self.layout.geometry
        receiver = self._geometry_of(peer)
        heads = tuple(msg.heads)
        leg = SendLeg(peer=peer, gen=msg.gen, slot=msg.slot, link=None, dst_pages=msg.pages, access=msg.access,
                      heads=heads, req=req)
        if receiver is not None:
            leg.group, leg.rank = receiver.group, receiver.tp_rank
        if not heads:  # page for page: the layouts must pair one to one
            if writer is not None and receiver is not None and not (
                    self._page_size_of(peer) == self.layout.page_size and writer.heads == receiver.heads):
                return None, "META names no heads, but the two layouts differ (heads or page size)"
            expected = len(msg.pages) if self.unsafe_legacy else self.layout.pages_for_tokens(req.tokens)
            if msg.tokens != req.tokens or len(msg.pages) != expected:
                return None, (f"decode reserved {len(msg.pages)} pages for {msg.tokens} tokens, prefill admitted "
                              f"{req.tokens} tokens ({expected} pages)")
            return leg, ""
        if writer is None or receiver is None:
            return None, "META names heads, but a layout without a geometry cannot be sliced"
        first, count = heads
        if msg.tokens != req.tokens:
            return None, f"decode reserved for {msg.tokens} tokens, prefill admitted {req.tokens} tokens"
        if not serves(writer, receiver):
            return None, (f"decode TP rank {receiver.tp_rank} of {receiver.tp_size} does not take KV from this "
                          f"prefill (TP rank {writer.tp_rank} of {writer.tp_size})")
        if not count:
            if len(msg.pages):
                return None, "META writes nothing (heads count 0) but names destination pages"
            leg.null = True
            return leg, ""
        try:
            shape = LegShape(tokens=req.tokens, src_page=self.layout.page_size, dst_page=self._page_size_of(peer),
                             src_heads=writer.heads[:2], dst_heads=receiver.heads[:2], leg=(first, count),
                             order=writer.order)
        except ConfigError as exc:
            return None, exc.detail
        if len(msg.pages) != shape.dst_pages:
            return None, (f"decode reserved {len(msg.pages)} pages for {msg.tokens} tokens, "
                          f"{shape.dst_pages} of {shape.dst_page} tokens needed")
        if not shape.whole:
            leg.atoms = LegAtoms(shape)
            leg.dst_item_lens = np.array([b.item_len(shape.dst_page) for b in receiver.buffers], dtype=np.int64)
        return leg, ""

    def _bind_meta(self, req: SendRequest, peer: str, msg: m.Meta) -> None:
        link = self._link_for(peer)
        if link is None:
            self._fail(req, TransferFailed(f"no data connection to {peer}", reason="connection",
                                           rid=req.rid, generation=msg.gen))
            return
        leg, problem = self._leg_plan(req, peer, msg)
        if leg is not None and req.legs:
            first = req.legs[0]
            if leg.group != first.group or leg.rank in {other.rank for other in req.legs}:
                problem = (f"decode {peer!r} (group {leg.group!r}, TP rank {leg.rank}) is not another rank of "
                           f"the group that bound the request ({first.group!r}, ranks "
                           f"{sorted(other.rank for other in req.legs)})")
                self._error(peer, msg, PeerError(problem, rid=req.rid, generation=msg.gen))
                return
        if leg is None:
            if not req.legs:
                req.gen = msg.gen
                req.peer = peer
            link.post_ordered(m.Reject(rid=req.rid, gen=msg.gen, reason="size_mismatch", detail=problem),
                              slot=msg.slot, gen=msg.gen)
            self._fail(req, TransferFailed(problem, reason="size_mismatch", rid=req.rid, generation=msg.gen))
            return
        leg.link = link
        if not req.legs:
            req.gen = msg.gen
            req.fsm.generation = msg.gen
            req.peer = peer
            req.fanout = fanout(self.layout.geometry, self._geometry_of(peer))
        req.legs.append(leg)
        self.by_gen[(peer, msg.gen)] = req
        if leg.null:
            leg.succeeded = True
        if len(req.legs) < req.fanout:
            self.changed.notify_all()
            return
        req.deadline = float("inf")
        for ready_leg in req.writing:
            self._prepare(req, ready_leg)
        req.fsm.to(S.READY, "destination received" if req.fanout == 1 else f"all {req.fanout} destinations received")
        if not req.writing:  # every decode rank takes its heads from another prefill rank
            req.fsm.to(S.TRANSFERRING, "nothing to write: other writers hold the heads the decodes take")
            req.fsm.to(S.DONE_SENT, "nothing to write")
            req.fsm.to(S.SUCCEEDED, "nothing to write")
            self.stats["succeeded"] += 1
            self._finish(req)
        self.changed.notify_all()

    def _prepare(self, req: SendRequest, leg: SendLeg) -> None:
        """The writes of a send of the whole request at once (the usual one, and every small request's)
        to a page-for-page leg, built now, while the prefill computes, and handed to the transport to
        prepare: :meth:`send` takes them when it sends exactly that."""
        if req.external or leg.atoms is not None or req.pages is None or len(req.pages) != len(leg.dst_pages):
            return
        prepare = getattr(leg.link, "prepare", None)  # optional (SenderLink)
        if prepare is None:
            return
        batch = build_batch(self.layout, req.pages, leg.dst_pages, slot=leg.slot, gen=leg.gen)
        try:
            prepare(batch)
        except TransportError:
            return  # the send builds its own and meets the link's state there
        leg.prepared = batch

    def _reject_meta(self, peer: str, msg: m.Meta, reason: str, text: str) -> None:
        link = self._link_for(peer)
        if link is not None:
            link.post_ordered(m.Reject(rid=msg.rid, gen=msg.gen, reason=reason, detail=text),
                              slot=msg.slot, gen=msg.gen)
        else:
            self._send(peer, m.Reject(rid=msg.rid, gen=msg.gen, reason=reason, detail=text))

    def on_abort(self, peer: str, msg: m.Abort) -> None:
        """The receiver aborted ``msg.gen``: stop writing the request and acknowledge once drained."""
        with self.lock:
            req = self.by_gen.get((peer, msg.gen))
            leg = req.leg(peer, msg.gen) if req is not None and req.rid == msg.rid else None
            if leg is None:
                self.stats["stale_abort"] += 1
                entries = self.pending_meta.get(msg.rid, [])
                kept = [e for e in entries if not (e[0] == peer and e[1].gen == msg.gen)]
                if len(kept) != len(entries):
                    # Never bound, so never written; and now it never will be.
                    if kept:
                        self.pending_meta[msg.rid] = kept
                    else:
                        del self.pending_meta[msg.rid]
                # Nothing of ours is in flight for that generation, which is exactly what an ack says.
                link = self._link_for(peer)
                if link is not None and msg.gen:
                    link.post_ordered(m.DrainAck(rid=msg.rid, gen=msg.gen, posted=0, completed=0),
                                      slot=0, gen=msg.gen)
                return
            self.stats["aborted_by_peer"] += 1
            error = TransferAborted(f"decode aborted: {msg.detail}", reason=msg.reason,
                                    rid=req.rid, generation=req.gen)
            self._stop(req, error, ack_with=m.DrainAck, asking=leg)

    def on_reject(self, peer: str, msg: m.Reject) -> None:
        """The receiver rejected the request at its admission (it never reserved pages)."""
        with self.lock:
            req = self.active.get(msg.rid)
            if req is None:
                old = self.recent.get(msg.rid)
                if old is not None and old.state is S.REJECTED and old.gen == 0:
                    # This prefill refused the same attempt itself: both roles agree, nothing to keep.
                    old.gen = msg.gen
                    self.stats["rejections_paired"] += 1
                    return
                # Not admitted here (yet): remember, so its admission fails at once instead of
                # waiting for a destination that will never come.
                if msg.rid not in self.peer_rejections and len(self.peer_rejections) >= self.max_pending_meta:
                    self.stats["flood_refused"] += 1
                    self._error(peer, msg, PeerError("too many rejections remembered for requests not admitted here",
                                                     rid=msg.rid))
                    return
                self.peer_rejections[msg.rid] = (msg, self._clock() + self.meta_timeout, peer)
                self.stats["peer_rejections_remembered"] += 1
                return
            owners = req.expected_peers or ([req.peer] if req.peer and req.fanout == 1 else None)
            if owners is not None and peer not in owners:
                self._error(peer, msg, PeerError(f"REJECT from {peer!r} for a request that decode "
                                                 f"{', '.join(map(repr, owners))} serves",
                                                 rid=msg.rid, generation=msg.gen))
                return
            if req.state is not S.ADMITTED or any(leg.peer == peer for leg in req.legs):
                self.stats["stale_reject"] += 1
                return
            if not req.legs:
                req.peer = peer
                req.gen = msg.gen
            self._fail(req, AdmissionRejected(f"decode rejected it: {msg.detail}", reason=msg.reason,
                                              rid=req.rid, generation=msg.gen or None))

    def on_result(self, peer: str, msg: m.Result) -> None:
        with self.lock:
            req = self.by_gen.get((peer, msg.gen))
            leg = req.leg(peer, msg.gen) if req is not None and req.rid == msg.rid else None
            if leg is not None and leg.done_posted and not leg.done_built:
                leg.done_built = True  # the decode answers DONE: it was built and sent
                self._maybe_release(req)
            if leg is None or req.state is not S.DONE_SENT or leg.succeeded or leg.null:
                self.stats["stale_result"] += 1
                return
            if not msg.ok:
                self._fail(req, TransferFailed(f"decode ended it unverified: {msg.detail}", reason=msg.reason,
                                               rid=req.rid, generation=req.gen), culprit=leg)
                return
            leg.succeeded = True
            if all(other.succeeded for other in req.legs):
                req.fsm.to(S.SUCCEEDED, "receiver verified" if len(req.writing) == 1 else "every receiver verified")
                self.stats["succeeded"] += 1
                self._finish(req)

    def _error(self, peer: str, msg: m.Message, error: KvxferError) -> None:
        self.stats[f"refused_{error.code}"] += 1
        self._warn(log, f"{peer}/{msg.TYPE}/{error.code}", "ignored %s from %s: %s", msg.TYPE, peer, error)
        self._send(peer, m.Error(about=msg.TYPE, code=error.code, detail=str(error),
                                 rid=getattr(msg, "rid", "?"), gen=getattr(msg, "gen", 0)))

    # local calls ---------------------------------------------------------------------------------
    def source_pages(self, rid: Any) -> np.ndarray:
        with self.lock:
            return self._lookup(rid).pages

    def send(self, rid: Any, src_pages: Any = None, *, count: int | None = None,
             aux: bytes = b"", ready: Any = None, buffers: Any = None, finish: bool = True,
             at: int | None = None) -> SendRequest:
        """Post writes for the next chunk of the request; the chunk that completes it posts DONE.

        ``buffers`` names the buffers the chunk covers (a layer's K and V, as soon as that layer is
        computed); default: every buffer. Each buffer advances on its own through the request's pages
        (positions), in any order of groups and any number of calls; the buffers of one call must be
        at the same position. The source page of a position is fixed by the first group that sends
        it: another group sending that position must name the same page. DONE follows the call after
        which every buffer has sent every position; its checksum is the whole request's (buffer by
        buffer, positions in order) however the request was split.

        ``src_pages`` are the chunk's source pages: the caller's own with ``external_pages``,
        otherwise pages this request holds and has not sent before (for those buffers). Without them
        the chunk is the next ``count`` held pages (``count`` in [1, pages left]; default: all left).
        ``ready`` (a CUDA event or anything with ``wait()``) is waited on before the source pages are
        read. Every destination gets the chunk (its pages, or its heads' slice of them).
        ``finish=False``: this call never posts DONE, even when it completes the request; DONE then
        waits for :meth:`finish` (an engine whose DONE carries data computed after the last layer).
        ``at``: the position the caller means the chunk to start at; refused (nothing posted) if the
        buffers are elsewhere, checked under the same lock as the send (a caller that read the
        positions before may have been overtaken).
        Raises :class:`InvalidArgument` (nothing posted) for anything else."""
        with self.lock:
            req = self._sending(rid, "send")
            if not is_ready_event(ready):
                raise InvalidArgument(f"ready must be an event (an object with synchronize() or wait(), such as a "
                                      f"CUDA event), got a {type(ready).__name__}", rid=rid, generation=req.gen)
            total = req.total_pages
            group = self._buffer_group(req, buffers)
            if req.buffer_sent is None:  # the first send: every buffer at position 0
                req.buffer_sent = np.zeros(self.layout.num_buffers, dtype=np.int64)
                req.order = np.full(total, -1, dtype=np.int64)
                start = 0
            else:
                positions = req.buffer_sent[group]
                if any_set(positions != positions[0]):
                    raise InvalidArgument(
                        f"buffers {describe_buffers(group)} are at different positions "
                        f"({', '.join(f'buffer {b}: {int(p)}' for b, p in zip(group[:8], positions[:8]))}): send "
                        "them in separate calls", rid=rid, generation=req.gen)
                start = int(positions[0])
            if at is not None and start != at:
                raise InvalidArgument(f"buffers {describe_buffers(group)} are at position {start}, not {at}",
                                      rid=rid, generation=req.gen)
            remaining = total - start
            aux = check_aux(aux, req.rid, req.gen)
            if src_pages is not None:
                if count is not None:
                    raise InvalidArgument("give src_pages or count, not both", rid=rid, generation=req.gen)
                chunk = self._check_chunk(req, src_pages, start)
            else:
                # the placeholder's caller counts in the destination's pages (the incident's path)
                limit = len(req.dst_pages) if req.placeholder and req.dst_pages is not None else total
                if count is not None:
                    count = check_count(count, limit, rid, req.gen)
                if remaining <= 0:
                    raise InvalidArgument(f"buffers {describe_buffers(group)} have sent all {total} pages",
                                          rid=rid, generation=req.gen)
                take = remaining if count is None else min(count, remaining)
                chunk = req.pages[start : start + take]
            if chunk.size > remaining:
                raise InvalidArgument(f"chunk of {chunk.size} pages, only {remaining} left to send"
                                      f"{'' if group.size == self.layout.num_buffers else ' in these buffers'}",
                                      rid=rid, generation=req.gen)
            links = [leg.link for leg in req.writing if hasattr(leg.link, "hold")]
            for link in links:  # the chunk's writes and the DONE behind them start together
                link.hold()
            try:
                return self._post_chunk(req, chunk, start, group, ready=ready, aux=aux, finish=finish,
                                        whole=src_pages is None and start == 0 and chunk.size == len(req.pages))
            finally:
                _unhold_all(links)

    def _post_chunk(self, req: SendRequest, chunk: np.ndarray, start: int, group: np.ndarray, *, ready: Any,
                    aux: bytes, finish: bool, whole: bool) -> SendRequest:
        """Under the lock, the chunk checked: post its writes to every leg, then DONE if it completes
        the request (and ``finish``). ``whole``: the chunk is the request's pages, all of them, in their
        own order (a send without source pages of everything at once)."""
        rid, total = req.rid, req.total_pages
        if chunk.size:
            if whole and group.size == self.layout.num_buffers and start + chunk.size == total:  # all of it, now
                after, final = np.full(self.layout.num_buffers, total, dtype=np.int64), True
            else:
                after = req.buffer_sent.copy()
                after[group] = start + chunk.size
                final = all_set(after == total)
            for leg in req.writing:
                batch = self._batch(req, leg, chunk, start, group, final, whole=whole)
                batch.ready = ready
                self._sum_later(batch)
                nbytes = batch.nbytes
                leg.posted += len(batch)
                leg.bytes_posted += nbytes
                leg.batches.append(batch)
                self.stats["writes_posted"] += len(batch)
                self.stats["bytes_posted"] += nbytes
                if req.state is S.READY:
                    req.fsm.to(S.TRANSFERRING, "first chunk posted")
                try:
                    leg.link.post_writes(batch, self._on_complete)
                    if req.fsm.terminal:  # it failed meanwhile (its other legs were told): nothing more is posted
                        return req
                except TransportError as exc:
                    leg.completed += len(batch)
                    leg.failed_writes += len(batch)
                    self._fail(req, TransferFailed(f"could not post writes to {leg.peer}: {exc}", reason="transport",
                                                   rid=rid, generation=req.gen), culprit=leg)
                    return req
            req.order[start : start + chunk.size] = chunk
            req.buffer_sent = after
            if group.size != self.layout.num_buffers:
                self.stats["layer_sends"] += 1
            req.sent = total if final else int(after.min())
        if finish and req.sent == total and req.state in (S.TRANSFERRING, S.READY):
            self._post_done(req, aux)
        return req

    def _sending(self, rid: Any, verb: str) -> SendRequest:
        """The request, if it may still send (READY or TRANSFERRING); else TransferFailed naming its state."""
        req = self._lookup(rid)
        if req.state not in (S.READY, S.TRANSFERRING):
            why = f": {req.error}" if req.error is not None else ""
            raise TransferFailed(f"cannot {verb} in state {req.state.value}{why}", reason="state",
                                 rid=rid, generation=req.gen or None)
        return req

    def finish(self, rid: Any, aux: bytes = b"") -> SendRequest:
        """Post DONE (with ``aux``) for a request whose every buffer has sent every page with
        ``finish=False``. Raises :class:`InvalidArgument` while pages are left to send."""
        with self.lock:
            req = self._sending(rid, "finish")
            aux = check_aux(aux, req.rid, req.gen)
            total = req.total_pages
            if req.sent != total:
                raise InvalidArgument(f"cannot finish: {req.sent} of {total} pages sent in every buffer",
                                      rid=rid, generation=req.gen)
            self._post_done(req, aux)
            return req

    def _buffer_group(self, req: SendRequest, buffers: Any) -> np.ndarray:
        """The buffers a send covers, sorted: every buffer, or the distinct indices the caller names."""
        nb = self.layout.num_buffers
        if buffers is None:
            return self._every_buffer
        try:
            group = np.asarray(buffers)
        except Exception as exc:
            raise InvalidArgument(f"buffers is not a list of buffer indices: {exc}", rid=req.rid,
                                  generation=req.gen) from None
        if group.ndim == 0:
            group = group.reshape(1)
        if group.ndim != 1 or group.size == 0 or group.dtype.kind not in "iu":
            raise InvalidArgument(f"buffers must be a non-empty list of buffer indices, not {buffers!r}"[:200],
                                  rid=req.rid, generation=req.gen)
        group = group.astype(np.int64)
        bad = group[(group < 0) | (group >= nb)]
        if bad.size:
            raise InvalidArgument(f"buffer index {int(bad[0])} out of range [0, {nb})", rid=req.rid,
                                  generation=req.gen)
        if has_duplicates(group):
            raise InvalidArgument("buffers names a buffer twice", rid=req.rid, generation=req.gen)
        return np.sort(group)

    def _batch(self, req: SendRequest, leg: SendLeg, chunk: np.ndarray, start: int, group: np.ndarray,
               final: bool, *, whole: bool = False) -> WriteBatch:
        """The chunk's writes to one leg for the buffers of ``group``: page for page, or the head
        slice's runs. ``start``: the chunk's first position; ``whole``: as :meth:`_post_chunk`'s."""
        every = group.size == self.layout.num_buffers
        prepared, leg.prepared = leg.prepared, None  # made for one send: the first one
        if prepared is not None and every and whole:  # what _prepare built: the whole request
            batch = prepared
        elif leg.atoms is None:
            dst = leg.dst_pages[start : start + chunk.size]
            batch = build_batch(self.layout, chunk, dst, slot=leg.slot, gen=leg.gen,
                                buffers=None if every else group)
        else:
            runs = chunk_runs(leg.atoms, start, chunk, leg.dst_pages, self.layout.item_lens, leg.dst_item_lens,
                              np.array([b.head_bytes for b in self.layout.geometry.buffers], dtype=np.int64))
            if not every:
                runs = runs.only(group)
            batch = WriteBatch(slot=leg.slot, gen=leg.gen, buffers=runs.buffers, src_offsets=runs.src_offsets,
                               dst_offsets=runs.dst_offsets, lengths=runs.lengths, units=runs.units,
                               dst_item_lens=leg.dst_item_lens)
        batch.owner = leg
        batch.access = leg.access
        batch.final = final
        return batch

    def _check_chunk(self, req: SendRequest, src_pages: Any, start: int) -> np.ndarray:
        """Explicit source pages for positions ``start ..``: distinct, in range and, unless external,
        held by this request; the pages other buffers already sent at those positions, and pages
        not sent at any other position (another request's KV must never travel under this tag, and a
        position holds one token range in every buffer)."""
        chunk = page_array(src_pages, num_pages=self.layout.num_pages, rid=req.rid, what="source pages")
        if chunk.size == 0:
            raise InvalidArgument("source page list is empty", rid=req.rid, generation=req.gen)
        if not req.external:
            foreign = chunk[~isin(chunk, req.pages)]
            if foreign.size:
                raise InvalidArgument("source pages not held by this request (admit with external_pages=True to "
                                      "send pages of your own allocator)", rid=req.rid, generation=req.gen,
                                      pages=foreign[:8])
        assert req.order is not None
        known = req.order[start : start + chunk.size]
        fixed = known >= 0
        differ = fixed & (known != chunk[: known.size])
        if any_set(differ):
            at = int(np.flatnonzero(differ)[0])
            raise InvalidArgument(
                f"source page {int(chunk[at])} at position {start + at}, where other buffers sent page "
                f"{int(known[at])}: every buffer of a position must come from the same page",
                rid=req.rid, generation=req.gen, pages=chunk[differ][:8])
        if not req.external:
            fresh = chunk[: known.size][~fixed]
            elsewhere = req.order >= 0  # positions sent before, other than these
            elsewhere[start : start + known.size] = False
            again = fresh[isin(fresh, req.order[elsewhere])] if any_set(elsewhere) else fresh[:0]
            if again.size:
                raise InvalidArgument("source pages already sent", rid=req.rid, generation=req.gen, pages=again[:8])
        return chunk

    def _sum_later(self, batch: WriteBatch) -> None:
        """Source item checksums of the batch, computed on the checksum thread while the transport
        sends (the caller finished writing these pages before sending them)."""
        if self._defer is None or not self.write_log or self.layout.device != "cpu":
            return  # tcp takes the sums while sending (hot in cache); verbs posts without reading
        algo_id = native_id(self.checksum)
        if algo_id is None:
            return
        from ..core import native

        event = threading.Event()
        batch.sums_ready = event
        items = batch.unit_lengths(self.layout.item_lens).astype(np.uint64)
        bases = np.array([spec.address for spec in self.layout.buffers], dtype=np.uint64)
        addresses = bases[batch.buffers] + batch.src_offsets.astype(np.uint64)
        lengths = batch.lengths.astype(np.uint64)
        initial = self.checksum.initial

        def compute() -> None:
            try:
                if not batch.wait_sources():  # never valid (its ready event failed) or cancelled: no sums
                    return
                raw = native.lib.checksum_items(algo_id, initial, addresses.tobytes(), lengths.tobytes(),
                                                items.tobytes())
                batch.item_sums = np.frombuffer(raw, dtype=np.uint32)
            finally:
                event.set()

        self._defer(compute)

    def _post_done(self, req: SendRequest, aux: bytes) -> None:
        src = req.order if req.order is not None else np.empty(0, dtype=np.int64)
        if req.state is S.READY:
            req.fsm.to(S.TRANSFERRING, "empty transfer")
        for leg in req.writing:
            # The transport builds DONE when it reaches it, behind every write of the leg; the source
            # checksums were computed meanwhile (or it reads the pages once).
            done = DoneBuilder(layout=self.layout, algo=self.checksum, rid=req.rid, gen=leg.gen, aux=aux,
                               src=src, batches=list(leg.batches), write_log=self.write_log,
                               on_built=lambda leg=leg: self._done_built(leg), atoms=leg.atoms,
                               dst_pages=len(leg.dst_pages))
            try:
                leg.link.post_ordered(done, slot=leg.slot, gen=leg.gen)
            except TransportError as exc:  # the link ended after the writes were posted (a lane ended it)
                self._fail(req, TransferFailed(f"could not post DONE to {leg.peer}: {exc}", reason="transport",
                                               rid=req.rid, generation=req.gen), culprit=leg)
                return
            leg.done_posted = True
        req.fsm.to(S.DONE_SENT, "DONE posted behind the last write")
        req.deadline = self._clock() + self.result_timeout  # a decode that never answers cannot pin the sources
        self.stats["done_sent"] += 1
        self.changed.notify_all()

    def _done_built(self, leg: SendLeg) -> None:
        """Transport thread: DONE of ``leg`` is built; the request's sources may go once it ended."""
        with self.lock:
            leg.done_built = True
            self._maybe_release(leg.req)
            if leg.req.fsm.terminal:  # wait() waits for terminal and drained; nothing waits for DONE alone
                self.changed.notify_all()

    def refuse(self, rid: Any, reason: str, detail: str) -> None:
        """The caller gave up on ``rid`` before admitting it (its client left, its bootstrap timed
        out): a destination a receiver reserved for it is answered with REJECT now, or as soon as it
        arrives (until ``meta_timeout``), so the receiver frees its pages at once. An admitted
        request is aborted instead."""
        rid = check_rid(rid)
        with self.lock:
            if rid in self.active:
                self.abort(rid, detail)
                return
            pending = self.pending_meta.pop(rid, [])
            for peer, msg, _deadline in pending:
                self.stats["refused_meta"] += 1
                self._reject_meta(peer, msg, reason, detail)
            if pending and fanout(self.layout.geometry, self._geometry_of(pending[0][0])) <= len(pending):
                return
            if len(self.refused) >= self.max_pending_meta:
                self.refused.pop(next(iter(self.refused)))
            self.refused[rid] = (reason, detail, self._clock() + self.meta_timeout)

    def abort(self, rid: Any, reason: str = "aborted by caller") -> SendRequest:
        """Stop a request. Its receivers learn it on the ordered path once posted writes completed."""
        with self.lock:
            req = self._lookup(rid)
            if req.fsm.terminal or req.state is S.DRAINING:
                return req
            error = TransferAborted(reason, reason="aborted", rid=rid, generation=req.gen or None)
            self.stats["aborted"] += 1
            if req.state in (S.ADMITTED, S.DONE_SENT):
                req.error = error
                req.fsm.to(S.ABORTED, reason)
                if req.state is S.ABORTED and req.legs and not all(leg.done_posted for leg in req.writing):
                    for leg in req.writing:  # bound, nothing posted: tell them now
                        leg.owes = m.Abort
                    self._post_owed(req)
                self._finish(req)
                return req
            self._stop(req, error, ack_with=m.Abort)
            return req

    def _stop(self, req: SendRequest, error: KvxferError, *, ack_with: type, asking: SendLeg | None = None) -> None:
        """Cancel unposted work and send each leg its drain proof (``ack_with`` to the leg that asked,
        every leg when the caller did; a writer ABORT to the others) once quiescent."""
        if req.fsm.terminal or req.state is S.DRAINING:
            return
        req.error = error
        for leg in req.writing:
            leg.owes = ack_with if asking is None or leg is asking else m.Abort
        if req.state is S.DONE_SENT:
            # DONE was ordered behind every write; it already proves the drain.
            for leg in req.writing:
                leg.owes = None
            req.fsm.to(S.ABORTED, "aborted after DONE")
        elif req.state in (S.ADMITTED, S.READY):
            # Nothing was posted: the proof can go at once.
            req.fsm.to(S.ABORTED, error.detail)
            self._post_owed(req)
        else:
            for leg in req.legs:
                for batch in leg.batches:
                    batch.cancelled = True
            req.fsm.to(S.DRAINING, error.detail)
            self._maybe_drained(req)
            return
        self._finish(req)

    def _post_owed(self, req: SendRequest) -> None:
        """Post every drain proof a leg owes, once its posted writes all completed."""
        for leg in req.legs:
            if leg.owes is None or leg.proof_posted or not leg.quiescent:
                continue
            leg.proof_posted = True
            if leg.link is None:
                continue
            if leg.owes is m.DrainAck:
                msg: m.Message = m.DrainAck(rid=req.rid, gen=leg.gen, posted=leg.posted, completed=leg.completed)
            else:
                msg = m.Abort(rid=req.rid, gen=leg.gen, reason="aborted", detail=str(req.error))
            try:
                leg.link.post_ordered(msg, slot=leg.slot, gen=leg.gen)
                self.stats["drain_acks" if leg.owes is m.DrainAck else "aborts_sent"] += 1
            except TransportError as exc:
                log.warning("could not post drain proof for %r generation %d: %s", req.rid, leg.gen, exc)

    def _maybe_drained(self, req: SendRequest) -> None:
        self._post_owed(req)
        if req.state is S.DRAINING and req.quiescent:
            req.fsm.to(S.ABORTED, f"drained: {req.posted} writes completed")
            self._finish(req)

    # transport events -------------------------------------------------------------------------------
    def _on_complete(self, batch: WriteBatch, ok: int, failed: int) -> None:
        """Transport callback: ``ok + failed`` writes of ``batch`` completed (any thread).

        Waiters (``wait_ready``: a state change; ``wait``: terminal and drained) are woken only when what
        they wait for may have changed: the request's state, or the last posted write of a terminal
        request completed. A wake per frame (2 MiB of 4 KiB pages) cost the send thread a third of its
        time in GIL hand-offs to waiters that went back to sleep (py-spy, tcp bench, 4 KiB pages); a
        wake when a small request's writes completed, before its RESULT, put the caller's ``wait()``
        between the sending lane and its ``sendmsg``."""
        with self.lock:
            leg = batch.owner
            if leg is None:
                return
            req = leg.req
            state = req.state
            leg.completed += ok + failed
            leg.failed_writes += failed
            self.stats["writes_completed"] += ok + failed
            if failed and not batch.cancelled and req.state in (S.TRANSFERRING, S.DONE_SENT):
                self._fail(req, TransferFailed(f"{failed} writes failed on the wire", reason="write_error",
                                               rid=req.rid, generation=req.gen), culprit=leg)
            elif batch.ready_error is not None and req.state in (S.TRANSFERRING, S.DONE_SENT):
                # the caller's ready event raised: these source pages never held valid KV. The request fails
                # alone (no culprit: every leg's link is fine, each gets a writer ABORT behind its writes)
                exc = batch.ready_error
                self._fail(req, TransferFailed(
                    f"the ready event of a chunk raised before its source pages were read: "
                    f"{type(exc).__name__}: {exc}"[:2000], reason="source_not_ready", rid=req.rid,
                    generation=req.gen))
            self._maybe_drained(req)
            self._maybe_release(req)
            if req.state is not state or (leg.quiescent and req.fsm.terminal):
                self.changed.notify_all()

    def on_connection_closed(self, link: Any, reason: str) -> None:
        """The data connection is gone (dead peer or fence): settle every request bound to it."""
        with self.lock:
            for req in list(self.undrained.values()):
                if any(leg.link is link for leg in req.legs):
                    self._maybe_release(req)
            for req in list(self.active.values()):
                legs = [leg for leg in req.legs if leg.link is link]
                if not legs:
                    continue
                for leg in legs:
                    leg.proof_posted = leg.owes is not None  # no proof can travel on it any more
                if req.state is S.DRAINING:
                    if all(leg.quiescent or leg.link is link for leg in req.legs):
                        req.fsm.to(S.ABORTED, f"connection closed: {reason}")
                        self._finish(req)
                elif not req.fsm.terminal and (req.state is not S.ADMITTED or len(req.legs)):
                    self._fail(req, TransferFailed(f"connection closed: {reason}", reason="connection",
                                                   rid=req.rid, generation=req.gen), culprit=legs[0])

    def tick(self) -> list[tuple[Any, str]]:
        """Timeouts and expiries; returns the links (with why) whose writes a failed request still
        waits on, for the engine to close: a link that took no write for ``result_timeout``."""
        stuck: list[tuple[Any, str]] = []
        with self.lock:
            now = self._clock()
            for req in list(self.active.values()):
                if req.state is S.ADMITTED and now >= req.deadline:
                    bound = f" ({len(req.legs)} of {req.fanout} bound)" if req.legs else ""
                    self._fail(req, TransferFailed(
                        f"no destination from decode within {self.meta_timeout:g} s{bound}", reason="timeout",
                        rid=req.rid))
                elif req.state is S.DONE_SENT and now >= req.deadline:
                    # The decode took DONE (or never read the writes before it) and never answered:
                    # fail, and free the sources by the drain rule of an abort after DONE.
                    self.stats["result_timeouts"] += 1
                    silent = [leg for leg in req.writing if not leg.succeeded]
                    names = ", ".join(repr(leg.peer) for leg in silent)
                    self._fail(req, TransferFailed(
                        f"no RESULT from decode {names} within {self.result_timeout:g} s of DONE",
                        reason="result_timeout", rid=req.rid, generation=req.gen), culprit=silent[0] if silent else None)
                    for leg in silent:
                        if not leg.quiescent and leg.link is not None:
                            stuck.append((leg.link, f"request {req.rid!r} generation {leg.gen}: "
                                                    f"{leg.posted - leg.completed} writes not taken within "
                                                    f"{self.result_timeout:g} s"))
            for req in list(self.undrained.values()):
                self._maybe_release(req)  # its link may have ended without telling
            for rid, (_msg, deadline, _peer) in list(self.peer_rejections.items()):
                if now >= deadline:
                    del self.peer_rejections[rid]
            for rid, (_reason, _detail, deadline) in list(self.refused.items()):
                if now >= deadline:
                    del self.refused[rid]
            for rid, entries in list(self.pending_meta.items()):
                kept = []
                for peer, msg, deadline in entries:
                    if now < deadline:
                        kept.append((peer, msg, deadline))
                        continue
                    self.stats["meta_expired"] += 1
                    self._reject_meta(peer, msg, "not_admitted",
                                      f"prefill never admitted request {rid!r} within {self.meta_timeout:g} s")
                if kept:
                    self.pending_meta[rid] = kept
                else:
                    del self.pending_meta[rid]
            if not self.pending_meta and self._pending_bytes:
                self._pending_bytes.clear()
        return stuck

    # bookkeeping -----------------------------------------------------------------------------------
    def _lookup(self, rid: Any) -> SendRequest:
        rid = check_rid(rid)
        req = self.active.get(rid) or self.recent.get(rid)
        if req is None:
            raise UnknownRequest("never admitted here (or forgotten)", rid=rid)
        return req

    def _fail(self, req: SendRequest, error: KvxferError, *, culprit: SendLeg | None = None) -> None:
        """The request failed as one. Every other leg still writing is stopped and told (a writer
        ABORT once quiescent), so its decode frees its pages at once; with one destination there is
        no other leg, and nothing more is sent."""
        if req.fsm.terminal:
            return
        for leg in req.legs:
            if not leg.quiescent:  # writes not sent yet are dropped (a queued DONE then becomes an ABORT)
                for batch in leg.batches:
                    batch.cancelled = True
            if leg is not culprit and not leg.null and not leg.done_posted and leg.alive:
                leg.owes = m.Abort
        req.error = error
        req.fsm.to(S.FAILED, error.code)
        self.stats["failed"] += 1
        log.info("%s", error)
        self._post_owed(req)
        self._finish(req)

    def _finish(self, req: SendRequest) -> None:
        req.finished = self._clock()
        if self.active.get(req.rid) is req:
            del self.active[req.rid]
        self._remember(req)
        self._maybe_release(req)
        if not req.sources_released:
            self.undrained[id(req)] = req
        self.changed.notify_all()

    def _maybe_release(self, req: SendRequest) -> None:
        if req.sources_released or not req.fsm.terminal or not req.drained:
            return
        req.sources_released = True
        self.undrained.pop(id(req), None)
        for leg in req.legs:
            leg.batches = []
        if req.pages.size and not req.external:
            self.pool.release(req.pages, req.local_gen, allowed=(PageState.RESERVED,))

    def _remember(self, req: SendRequest) -> None:
        self.recent[req.rid] = req
        self.recent.move_to_end(req.rid)
        while len(self.recent) > HISTORY_LIMIT:
            self.recent.popitem(last=False)
        while len(self.by_gen) > HISTORY_LIMIT:
            self.by_gen.popitem(last=False)

    def settled(self, req: SendRequest) -> bool:
        """Terminal and drained (every write completed, DONE built if posted): the caller may reuse
        the request's source memory."""
        return req.fsm.terminal and req.drained

    def check_accounting(self) -> dict[str, int]:
        """The source pool's accounting invariant and every request's custody of its source pages.

        Besides the ledger's own counts: ``sources_in_flight``, source pages that ended requests still
        hold because the transport has not yet taken every write (or DONE) posted for them, and
        ``writes_in_flight``, writes posted and not yet reported. Raises
        :class:`~kvxfer.errors.LedgerInvariantError` when a request is settled (ended and drained) but
        still holds its sources, or when an ended request waits on writes that a data connection which
        has ended never reported (they never will be: its sources would be held for ever)."""
        from ..errors import LedgerInvariantError

        with self.lock:
            for req in list(self.undrained.values()):
                self._maybe_release(req)  # as tick() does: a link that ended just now has not told us yet
            counts = self.pool.ledger.check_invariants()
            # every ended request still holding sources: those in the history, and those the history
            # let go (its size bound, a request id used again) but which wait on their writes
            ended_by_id = {id(r): r for r in (*self.recent.values(), *self.undrained.values())
                           if not r.sources_released and r.pages.size and not r.external}
            ended = list(ended_by_id.values())
            holders = list(self.active.values()) + ended
            for req in holders:
                if id(req) in ended_by_id and self.settled(req):
                    raise LedgerInvariantError(f"settled ({req.state.value}, drained) but still holds its "
                                               f"{req.pages.size} source pages", rid=req.rid, generation=req.gen or None)
                # a link sets ``ended`` only after every write it took was reported, each report under this
                # lock: a write it still owes now is one nobody will report
                for leg in req.legs:
                    link = leg.link
                    if not leg.quiescent and link is not None and link.ended:
                        raise LedgerInvariantError(
                            f"{leg.posted - leg.completed} writes to {leg.peer!r} (generation {leg.gen}) on data "
                            f"connection {link.conn_id}, which has ended, were never reported: its "
                            f"{req.pages.size} source pages would be held for ever", rid=req.rid,
                            generation=req.gen or None)
            self.pool.ledger.check_custody(
                ((req.rid, req.local_gen, req.pages, (PageState.RESERVED,)) for req in holders if not req.external),
                noun="source pages")
            counts["sources_in_flight"] = sum(int(req.pages.size) for req in ended)
            counts["writes_in_flight"] = sum(leg.posted - leg.completed for req in holders for leg in req.legs)
            return counts
