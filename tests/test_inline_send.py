"""A small request's hand-offs: it leaves from the caller's thread (``inline_send``, tcp and shm), and
the decode's RESULT leaves after its lock is released.

A request whose writes fit one frame, posted with its DONE on an idle connection, is handed to the
kernel by the thread that calls ``send()``: no sending thread is woken, and none has to wait for the
interpreter while the caller goes on with Python work (``kvxfer bench --small-requests --busy-caller``
measures that). The caller never waits for the socket: what a full socket does not take at once is
copied and sent by a sending thread, first in the connection's queue. Real engines over real
sockets; the receiving side is the same either way, so every request here is verified there.
"""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from kvxfer import DecodeEngine, PrefillEngine
from kvxfer.core import native
from kvxfer.core.lifecycle import ReceiverState
from kvxfer.engine.config import EngineConfig
from kvxfer.errors import TransferFailed
from kvxfer.wire import messages as m
from kvxfer.wire.auth import Keyring

from .conftest import PAGE_TOKENS, close_checked, fill_random, make_layout, wait_for

pytestmark = pytest.mark.skipif(native.lib is None, reason="the tcp inline send needs the C data path (kvxfer._native)")


def landed(pair_prefill: PrefillEngine, decode: DecodeEngine, rid: str) -> bool:
    """The decode's pages of ``rid`` hold what the prefill's source pages held, buffer by buffer."""
    src = pair_prefill.sender.source_pages(rid)
    dst = decode.status(rid).pages
    return all(np.array_equal(s[src], d[dst]) for s, d in zip(pair_prefill.layout.views(), decode.layout.views()))


def send_without_waiting(p: PrefillEngine, rids: list[str], what: str) -> None:
    """Send each request from a thread of its own; each send() must return, without raising, within 5 s."""
    returned = []
    for rid in rids:
        sender = threading.Thread(target=lambda rid=rid: returned.append(p.send(rid)), daemon=True)
        sender.start()
        sender.join(5)
        assert not sender.is_alive(), f"send({rid!r}) waited for {what}"
    assert len(returned) == len(rids), f"a send() raised: {len(returned)} of {len(rids)} returned"


def all_readable(p: PrefillEngine, d: DecodeEngine, rids: list[str]) -> None:
    """Each request READABLE with the prefill's bytes, released, and settled on the prefill."""
    for rid in rids:
        req = d.wait(rid, timeout=20)
        assert req.state is ReceiverState.READABLE, (rid, req.state, req.error)
        assert landed(p, d, rid), rid
        d.release(rid)
        p.wait(rid, timeout=10)


def admitted_pair(made: list, rids: list[str], tokens: int, *, seed: int, item: int | None = None,
                  transport: str = "tcp"):
    """A keyed prefill and decode (appended to ``made`` for close_checked), peered over ``transport``, with
    ``rids`` admitted on both and their source pages filled (seeds ``seed``, ``seed + 1``, ...): (prefill,
    decode, data link)."""
    rings = Keyring.cluster(["prefill", "decode"])
    config = EngineConfig(max_context=64 * PAGE_TOKENS, heartbeat_interval=0.2, transport=transport)
    sized = {} if item is None else {"item": item}
    p = PrefillEngine(make_layout(64, **sized), EngineConfig(**{**vars(config), "keyring": rings["prefill"]}))
    made.append(p)
    d = DecodeEngine(make_layout(128, **sized), EngineConfig(**{**vars(config), "keyring": rings["decode"]}))
    made.append(d)
    peer = d.connect(p.address)
    for i, rid in enumerate(rids):
        d.admit(rid, tokens, peer=peer)
        p.admit(rid, tokens)
        fill_random(p.layout, p.sender.source_pages(rid), seed=seed + i)
        p.wait_ready(rid, timeout=10)
    return p, d, p.peers[d.engine_id].link


def until_idle(link) -> None:
    """Until no sending thread holds or is due to serve ``link`` and nothing is queued: the state in which a
    small request leaves from the caller's thread. A new shm link schedules one step of its own (its first
    look at the reader), which a loaded machine may not have run when the first request is posted; that
    request then goes from the sending thread, as on any busy link (a clean-clone CI run saw it once)."""
    def idle() -> bool:
        with link._cond:
            return not link._scheduled and not link._queue

    wait_for(idle, timeout=5, what="an idle link (no sending thread's step due, nothing queued)")


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "lanes"])
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_small_request_has_left_when_send_returns(engines, transport, inline):
    """With ``inline_send`` each one-page request's frame and DONE left (the socket, or the ring) before
    send() returned when posted on an idle link: no sending thread was involved; with it off a sending
    thread sends them later. Every request is READABLE with the prefill's bytes either way."""
    pair = engines(fault_injection=False, transport=transport,
                   transport_options={transport: {"inline_send": inline}})
    p, d = pair.prefill, pair.decode
    link = pair.link
    for i in range(20):
        rid = f"small-{i}"
        d.admit(rid, PAGE_TOKENS, peer=pair.peer)
        p.admit(rid, PAGE_TOKENS)
        fill_random(p.layout, p.sender.source_pages(rid), seed=i)
        p.wait_ready(rid, timeout=10)
        until_idle(link)
        before = link.frames_sent
        p.send(rid)
        if inline:
            assert link.frames_sent == before + 2, "send() returned before its request and DONE had left"
        req = d.wait(rid, timeout=10)
        assert req.state is ReceiverState.READABLE, req.describe() if hasattr(req, "describe") else req.state
        assert landed(p, d, rid)
        d.release(rid)
        p.wait(rid, timeout=10)
    assert link.sent_inline == (20 if inline else 0)
    assert getattr(link, "inline_rest", 0) == 0 and getattr(link, "inline_deferred", 0) == 0
    if not inline:  # a sending thread sent each request's frame and its DONE in one step, DONE summed in C
        assert (getattr(link, "sent_with_ordered", 0), link.done_filled) == (20, 20), (
            getattr(link, "sent_with_ordered", 0), link.done_filled)


def test_what_a_full_socket_does_not_take_goes_from_a_sending_thread():
    """The decode stops reading (its data thread waits for the engine's lock, which the test holds) and
    the connection's send buffer is small: send() of a 240 KiB request still returns at once, the part
    the socket did not take is sent by a sending thread, and once the decode reads again the request
    is READABLE with the prefill's bytes. A request posted meanwhile goes behind it, in order."""
    made: list = []
    try:
        rids = ["big-0", "big-1"]
        # 3 buffers of 16 KiB: 48 KiB a page; 5 pages fit one frame with DONE (256 KiB)
        p, d, link = admitted_pair(made, rids, 5 * PAGE_TOKENS, seed=100, item=16 << 10)
        link._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        with d.lock:  # the decode's data thread stops at its first frame's check: nothing more is read
            send_without_waiting(p, rids, "a socket the receiver does not read")
            # the WRITE frame left as it was posted and was cut; its rest and the DONE went from a lane
            assert (link.sent_early, link.inline_rest, link.sent_inline) == (1, 1, 0), (
                link.sent_early, link.inline_rest, link.sent_inline)
            assert link.ordered_rest == 0, "the WRITE frame itself was to be cut (its rest and DONE sent later)"
        all_readable(p, d, rids)
    finally:
        close_checked(made)


def test_an_ordered_frame_the_socket_takes_in_part_is_finished_by_a_sending_thread():
    """The posting thread sends the WRITE frame first, then the DONE frame: here the socket takes the whole
    one-page WRITE but only part of a DONE carrying 900 KiB of aux (the decode reads nothing meanwhile, and
    the send buffer is small), so the DONE's tail goes from a sending thread. send() returns at once, and
    once the decode reads again the request is READABLE with the prefill's bytes and the whole aux; a
    request posted meanwhile goes behind it."""
    made: list = []
    try:
        rids = ["long-aux", "behind"]
        p, d, link = admitted_pair(made, rids, PAGE_TOKENS, seed=200)
        until_idle(link)
        link._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        aux = bytes(range(256)) * (900 * 4)
        with d.lock:  # the decode's data thread stops at its first frame's check: nothing more is read
            returned = []
            sender = threading.Thread(target=lambda: returned.append(p.send("long-aux", aux=aux)), daemon=True)
            sender.start()
            sender.join(5)
            assert not sender.is_alive() and returned, "send() waited for a socket the receiver does not read"
            assert link.sent_inline == 1 and link.inline_rest == 1, (link.sent_inline, link.inline_rest)
            assert link.ordered_rest == 1, "the socket was to take the whole WRITE frame and part of the DONE"
            send_without_waiting(p, ["behind"], "a socket the receiver does not read")
        req = d.wait("long-aux", timeout=20)
        assert req.state is ReceiverState.READABLE and req.aux == aux, (req.state, req.error)
        all_readable(p, d, rids)
    finally:
        close_checked(made)


def test_a_ring_without_room_leaves_the_request_to_a_sending_thread(engines):
    """shm: the decode stops reading (its reader waits for the engine's lock, which the test holds) with
    a ring of 64 KiB: the first request fills most of it from the caller's thread, the second does not
    fit and send() still returns at once, leaving it to a sending thread; once the decode reads again
    both are READABLE with the prefill's bytes."""
    pair = engines(fault_injection=False, transport="shm", transport_options={"shm": {"ring_bytes": 64 << 10}})
    p, d = pair.prefill, pair.decode
    link = pair.link
    rids = ["ring-0", "ring-1"]
    for i, rid in enumerate(rids):  # 16 pages of 3 KiB: 48 KiB and a run table, one frame each
        d.admit(rid, 16 * PAGE_TOKENS, peer=pair.peer)
        p.admit(rid, 16 * PAGE_TOKENS)
        fill_random(p.layout, p.sender.source_pages(rid), seed=200 + i)
        p.wait_ready(rid, timeout=10)
    with d.lock:
        send_without_waiting(p, rids, "room in a ring the receiver does not read")
        assert (link.sent_inline, link.inline_deferred) == (1, 1)
    all_readable(p, d, rids)


@pytest.mark.parametrize("size", ["small", "large"])
def test_result_leaves_after_the_decode_lets_go_of_its_lock(engines, size):
    """The decode's RESULT for a verified request is encoded and queued only once the engine's lock is
    released, so the consumer woken by READABLE takes the lock first; the request and its RESULT still
    complete on both sides (a one-page request is verified on the data thread, a larger one on the
    verifier)."""
    pair = engines(fault_injection=False, prefill_pages=128, decode_pages=256)
    p, d = pair.prefill, pair.decode
    deliver, answer, under_lock = d.receiver._deliver, d.receiver._answer, []

    def watched(peer, msg):
        if isinstance(msg, m.Result):
            under_lock.append(d.lock._is_owned())
        deliver(peer, msg)

    def watched_answer(conn, msg):  # RESULT back on the data connection, where it takes it
        under_lock.append(d.lock._is_owned())
        return answer(conn, msg)

    d.receiver._deliver, d.receiver._answer = watched, watched_answer
    tokens = PAGE_TOKENS if size == "small" else 120 * PAGE_TOKENS  # 360 KiB: past INLINE_VERIFY_BYTES
    for i in range(5):
        rid = f"{size}-{i}"
        d.admit(rid, tokens, peer=pair.peer)
        p.admit(rid, tokens)
        p.wait_ready(rid, timeout=10)
        p.send(rid)
        assert d.wait(rid, timeout=10).state is ReceiverState.READABLE
        assert p.wait(rid, timeout=10).state.value == "SUCCEEDED"  # its RESULT arrived
        d.release(rid)
    assert under_lock == [False] * 5


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_request_posted_on_a_fenced_connection_fails_and_frees_its_sources(engines, transport):
    """The decode fences the connection just before the prefill, not told (it ignores FENCED), sends a
    small request on it from its own thread: nothing lands, the request fails, and its writes are
    reported failed so the prefill's source pages come back (a step from the caller's thread that fails
    ends the link as a sending thread's would)."""
    pair = engines(fault_injection=False, transport=transport)
    p, d = pair.prefill, pair.decode
    p.admit("f", PAGE_TOKENS)
    d.admit("f", PAGE_TOKENS, peer=pair.peer)
    p.wait_ready("f", timeout=10)
    link = pair.link
    conn = d.receiver.peers[pair.peer].conn
    landed_before = d.stats()["writes"]["landed_bytes"]
    p._on_fenced = lambda peer, msg: None  # the writer ignores the FENCED notice
    assert d.fence(conn, "test fence")
    try:
        p.send("f")
    except TransferFailed:
        pass  # the link already saw its connection end
    assert p.wait("f", timeout=15).state.value == "FAILED"  # settled: terminal and drained
    wait_for(lambda: not link.alive, what="the link to end")
    wait_for(lambda: p.pool.ledger.free_count == p.layout.num_pages, what="the prefill's source pages back")
    assert d.stats()["writes"]["landed_bytes"] == landed_before
    assert d.pool.ledger.free_count == d.layout.num_pages


def test_a_fault_injector_with_nothing_to_do_leaves_the_callers_thread_path_open(engines):
    """The suites' engines carry a fault injector; while it has nothing to do a small request still leaves
    from the caller's thread, and one scripted fault (a captured write) sends that request from a
    sending thread, through the injector, which captures it; both requests verify."""
    pair = engines()  # a FaultInjector with no rate set
    p, d = pair.prefill, pair.decode
    link = pair.link
    for i, capture in enumerate((False, True)):
        rid = f"fi-{i}"
        d.admit(rid, PAGE_TOKENS, peer=pair.peer)
        p.admit(rid, PAGE_TOKENS)
        p.wait_ready(rid, timeout=10)
        if capture:
            pair.faults.capture_next_write()
        p.send(rid)
        assert d.wait(rid, timeout=10).state is ReceiverState.READABLE
        d.release(rid)
        p.wait(rid, timeout=10)
        assert link.sent_inline == 1, (rid, link.sent_inline)
    assert len(pair.faults.take_captured()) == 1


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_small_request_s_write_frame_leaves_as_it_is_posted_and_its_done_at_the_end_of_send(transport):
    """Production links: a small request's WRITE frame leaves from the caller's thread as send() posts
    it (before its DONE is built and posted) and its DONE when send() lets go of the link, both counted;
    the decode lands byte-exact. A request sent chunk by chunk (no DONE behind the first chunks) has its
    first chunk's WRITE frame go early too, the link given back at the end of that send() and the next
    chunks posted and served behind it in order."""
    made: list = []
    try:
        rids = [f"small-{i}" for i in range(5)]
        p, d, link = admitted_pair(made, rids + ["chunked"], 4 * PAGE_TOKENS, seed=300, transport=transport)
        until_idle(link)
        early, inline, filled = link.sent_early, link.sent_inline, link.done_filled
        for rid in rids:
            p.send(rid)
            assert d.wait(rid, timeout=10).state is ReceiverState.READABLE
        assert (link.sent_early - early, link.sent_inline - inline, link.done_filled - filled) == (5, 5, 5)
        all_readable(p, d, rids)
        until_idle(link)
        early = link.sent_early
        for _chunk in range(4):  # one page at a time; the last send posts DONE
            p.send("chunked", count=1)
        assert link.sent_early - early >= 1
        all_readable(p, d, ["chunked"])
    finally:
        close_checked(made)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_many_threads_sending_small_requests_through_one_engine_land_every_byte(transport):
    """Eight threads each send their own small requests through one prefill engine and one data link at
    once (posted from their threads: WRITE frames at post time, DONEs at the end of send(), or queued to a
    lane behind another thread's claim): every request is READABLE with its own bytes, in whatever order."""
    made: list = []
    try:
        rids = [f"t{t}-{i}" for t in range(8) for i in range(6)]  # 48 of the prefill's 64 pages
        p, d, link = admitted_pair(made, rids, PAGE_TOKENS, seed=400, transport=transport)
        errors: list = []

        def sender(t: int) -> None:
            try:
                for i in range(6):
                    p.send(f"t{t}-{i}")
            except Exception as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=sender, args=(t,), daemon=True) for t in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert not errors and not any(t.is_alive() for t in threads), errors
        all_readable(p, d, rids)
        assert link.sent_early > 0
    finally:
        close_checked(made)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_write_frame_that_fails_as_it_is_posted_is_reported_and_ends_only_its_link(monkeypatch, transport):
    """Something raising in the caller's thread as it sends a WRITE frame at post time (here the batch's
    source check): the batch is reported failed, the link ends with that reason, the request fails and
    its sources are freed (nothing left unreported), and a new link carries the next request."""
    from kvxfer.core.runs import WriteBatch

    made: list = []
    try:
        p, d, link = admitted_pair(made, ["broken"], PAGE_TOKENS, seed=500, transport=transport)
        until_idle(link)
        original = WriteBatch.wait_sources

        def escaping(self):
            raise RuntimeError("device error in the caller's thread")
        monkeypatch.setattr(WriteBatch, "wait_sources", escaping)
        p.send("broken")
        monkeypatch.setattr(WriteBatch, "wait_sources", original)
        wait_for(lambda: link.ended, what="the link ended")
        assert p.wait("broken", timeout=10).state.value == "FAILED"
        assert link.sent_early == 0
        wait_for(lambda: p.check_accounting()["sources_in_flight"] == 0, what="the sources freed")
        d.abort("broken")
        def reconnected() -> bool:  # both halves on the new connection (either may see it first)
            info = d.receiver.peers.get(p.engine_id)
            new = p.peers[d.engine_id].link
            return new is not None and new is not link and new.alive and info is not None and info.connected

        wait_for(reconnected, timeout=10, what="a new data link")
        d.admit("after", PAGE_TOKENS, peer=p.engine_id)
        p.admit("after", PAGE_TOKENS)
        fill_random(p.layout, p.sender.source_pages("after"), seed=501)
        p.wait_ready("after", timeout=10)
        p.send("after")
        all_readable(p, d, ["after"])
    finally:
        close_checked(made)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("inline", [True, False], ids=["inline", "lanes"])
def test_a_done_queued_behind_another_requests_write_claims_its_own_pages(inline, transport):
    """Y is sent without its DONE, then X (also without), then Y's DONE is posted: on the link Y's DONE sits
    right behind X's WRITE frame, and the link sends them together. The DONE must claim Y's checksum, not
    one summed from X's pages (a review found the one-call summed DONE taking the batch it followed):
    both requests are READABLE with their own bytes."""
    made: list = []
    try:
        rids = ["Y", "X"]
        p, d, link = admitted_pair(made, rids, PAGE_TOKENS, seed=600, transport=transport)
        link.inline_send = inline
        p.send("Y", finish=False)
        until_idle(link)
        link.hold()  # X's writes and Y's DONE queued together, as a busy link would hold them
        try:
            p.send("X", finish=False)
            p.finish("Y")
        finally:
            link.unhold()
        p.finish("X")
        all_readable(p, d, rids)
    finally:
        close_checked(made)


def _mla_request_on_two_idle_links(made: list) -> tuple:
    """MLA from prefill TP 1 into decode TP 2 (engines added to ``made``): request "m" admitted on both
    decodes and its sources filled, both links idle. (cluster, the prefill, its links)."""
    from .tp_env import build

    cluster = build(tp_prefill=1, tp_decode=2, mla=True, head_bytes=64, made=made)
    p = cluster.prefills[0]
    cluster.admit("m", 40)
    cluster.fill("m", 5)
    links = [peer.link for peer in p.peers.values()]
    for link in links:
        until_idle(link)
    return cluster, p, links


def test_a_leg_whose_write_frame_fails_as_it_is_posted_leaves_the_other_legs_untouched():
    """MLA from prefill TP 1 into decode TP 2: one request, two whole-page legs on two links. The first
    leg's WRITE frame fails as send() posts it (a broken socket): the request fails, and no link gets a
    write of it posted after the writer ABORT it got (the failure is reported once send() posted every
    leg, never in the middle, when the sources may already be free)."""
    import errno

    from kvxfer.transport import framed, tcp

    made: list = []
    try:
        cluster, p, _links = _mla_request_on_two_idle_links(made)
        send_write, post = tcp.TcpLink._send_write, framed.FrameLink._post
        calls, posted = [], []

        def failing_first(self, wire, *, wait):
            calls.append(self)
            if len(calls) == 1:
                raise BrokenPipeError(errno.EPIPE, "simulated broken socket")
            return send_write(self, wire, wait=wait)

        def logged(self, job):
            posted.append((self, type(job).__name__))
            return post(self, job)

        tcp.TcpLink._send_write, framed.FrameLink._post = failing_first, logged
        try:
            p.send("m")
        finally:
            tcp.TcpLink._send_write, framed.FrameLink._post = send_write, post
        assert calls, "no WRITE frame was sent from the caller's thread"
        for link in {link for link, _ in posted}:
            kinds = [kind for each, kind in posted if each is link]
            assert "WriteJob" not in kinds[kinds.index("OrderedJob"):] if "OrderedJob" in kinds else True, kinds
        assert p.wait("m", timeout=10).state.value == "FAILED"
        wait_for(lambda: p.check_accounting()["sources_in_flight"] == 0, what="the sources freed")
        states = {}
        for decode in cluster.decodes:
            wait_for(lambda decode=decode: decode.status("m").fsm.terminal
                     or decode.status("m").state is ReceiverState.READABLE, timeout=10, what="each decode's verdict")
            states[decode.engine_id] = decode.status("m").state.value
        # the broken link's decode fails the request; the other got the WRITE frame and DONE posted before
        # the failure was reported, and verifies them (or hears the abort first)
        verdicts = sorted(states.values(), key=lambda state: state != "FAILED")
        assert verdicts[0] == "FAILED" and verdicts[1] in ("ABORTED", "READABLE", "FAILED"), states
        for decode in cluster.decodes:
            if decode.status("m").state is ReceiverState.READABLE:
                decode.release("m")
    finally:
        close_checked(made)


def test_a_done_that_cannot_be_posted_fails_the_request_without_raising_out_of_send(monkeypatch):
    """The link ends between a send()'s writes and its DONE (a lane ended it: the peer closed its end), so
    posting the DONE is refused: send() does not raise a transport error at its caller after it posted the
    writes; the request fails naming the link, and its sources are freed."""
    from kvxfer.errors import TransportError
    from kvxfer.transport import tcp

    made: list = []
    try:
        p, d, link = admitted_pair(made, ["cut"], PAGE_TOKENS, seed=700)
        original = tcp.TcpLink.post_ordered

        def refused(self, msg, *, slot, gen):
            raise TransportError(f"data connection {self.conn_id} to {self.address} is closed")
        monkeypatch.setattr(tcp.TcpLink, "post_ordered", refused)
        p.send("cut")
        monkeypatch.setattr(tcp.TcpLink, "post_ordered", original)
        req = p.wait("cut", timeout=10)
        assert req.state.value == "FAILED" and "DONE" in str(req.error), (req.state, req.error)
        wait_for(lambda: p.check_accounting()["sources_in_flight"] == 0, what="the sources freed")
        d.abort("cut")
    finally:
        close_checked(made)


def test_an_error_in_one_links_unhold_still_unholds_every_other_link():
    """MLA from prefill TP 1 into decode TP 2: one request's chunk is held on two links while send()
    posts it. If the first link's last unhold raises after it sent what it claimed (a callback's bug
    that nothing caught), the error still reaches the caller, and the other link is unheld all the
    same: its WRITE frame and DONE go out and both decodes verify the request, instead of that link
    staying held, never sending again, for this request and every later one."""
    from kvxfer.transport import framed

    made: list = []
    try:
        cluster, p, links = _mla_request_on_two_idle_links(made)
        unhold = framed.FrameLink.unhold
        calls: list = []

        def failing_first(self):
            calls.append(self)
            unhold(self)
            if len(calls) == 1:
                raise RuntimeError("simulated bug after an unhold")

        framed.FrameLink.unhold = failing_first
        try:
            with pytest.raises(RuntimeError, match="simulated bug"):
                p.send("m")
        finally:
            framed.FrameLink.unhold = unhold
        assert len(calls) == 2, "the second link was never unheld"
        assert all(link._holding == 0 for link in links)
        assert p.wait("m", timeout=10).state.value == "SUCCEEDED"
        for decode in cluster.decodes:
            assert decode.wait("m", timeout=10).state is ReceiverState.READABLE
            decode.release("m")
    finally:
        close_checked(made)
