"""Two engines over every registered transport (tcp and shm here, verbs inside the soft-RoCE VM):
the incident path, aborts, drains, fences, corruption."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import zmq

from kvxfer import AdmissionRejected, DecodeEngine, EngineConfig, PrefillEngine, ReceiverState, SenderState
from kvxfer.core.ledger import PageState
from kvxfer.errors import NotReadable, PeerError, TransferFailed, UnknownRequest
from kvxfer.wire import messages as m

from .conftest import PAGE_TOKENS, fill_random, make_layout, needs, wait_for

R, S = ReceiverState, SenderState
pytestmark = pytest.mark.usefixtures("transport", "send_mode")  # every transport, whole and layer-wise sends


def test_normal_transfer_is_readable_and_exact(engines):
    pair = engines()
    src = pair.transfer("r1", 40 * PAGE_TOKENS - 3, seed=7)
    assert pair.decode.wait("r1").state is R.READABLE
    pair.expect_content("r1", src)
    assert pair.prefill.wait("r1").state is S.SUCCEEDED
    pair.decode.release("r1")
    assert pair.decode.pool.ledger.free_count == pair.decode.layout.num_pages
    assert pair.prefill.pool.ledger.free_count == pair.prefill.layout.num_pages


def test_chunked_send_posts_done_only_after_last_chunk(engines):
    pair = engines()
    pair.prefill.admit("c", 20 * PAGE_TOKENS)
    pair.decode.admit("c", 20 * PAGE_TOKENS)
    pair.prefill.wait_ready("c")
    src = pair.prefill.source_pages("c")
    fill_random(pair.prefill.layout, src, 3)
    for _ in range(3):
        pair.prefill.send("c", count=6)
    time.sleep(0.1)
    assert pair.decode.status("c").state is R.RESERVED
    assert pair.prefill.status("c").state is S.TRANSFERRING
    pair.prefill.send("c", count=6)  # the last 2 pages
    assert pair.decode.wait("c").state is R.READABLE
    pair.expect_content("c", src)


def test_incident_path_rejected_at_admission_on_both_sides(engines):
    """Decode pool larger than prefill pool, prompt in the band between: refused before anything moves."""
    with pytest.warns(RuntimeWarning, match="UNSAFE CONFIGURATION"):
        pair = engines(prefill_pages=32, decode_pages=128, max_context=128 * PAGE_TOKENS, allow_undersized=True)
    band_prompt = 80 * PAGE_TOKENS  # > prefill pool (512 tokens), < advertised context (2048)
    with pytest.raises(AdmissionRejected) as dec_err:
        pair.decode.admit("big", band_prompt, peer=pair.peer)
    assert dec_err.value.reason == "exceeds_peer_pool"
    assert "1,280 tokens" in str(dec_err.value) and "512 tokens" in str(dec_err.value)
    with pytest.raises(AdmissionRejected) as pre_err:
        pair.prefill.admit("big", band_prompt)
    assert pre_err.value.reason == "exceeds_pool"
    assert pair.decode.status("big").state is R.REJECTED
    assert pair.prefill.status("big").state is S.REJECTED
    # no page reserved on either side, no byte moved
    assert pair.decode.pool.ledger.free_count == 128
    assert pair.prefill.pool.ledger.free_count == 32
    assert pair.decode.stats()["writes"]["landed_bytes"] == 0
    assert pair.prefill.stats()["bytes_sent"] == 0
    # and no way to read: the request never becomes readable
    with pytest.raises(NotReadable):
        pair.decode.read("big")


def test_writer_rejection_releases_reserved_pages_and_moves_nothing(engines):
    """A decode that does not know the prefill's pool reserves; the prefill's REJECT frees it."""
    with pytest.warns(RuntimeWarning):
        pair = engines(prefill_pages=32, decode_pages=128, max_context=128 * PAGE_TOKENS, allow_undersized=True)
    pair.decode.receiver.peers[pair.peer].pool_tokens = 0  # capacity unknown, as in SGLang
    req = pair.decode.admit("big", 80 * PAGE_TOKENS, peer=pair.peer)
    assert req.state is R.RESERVED and pair.decode.pool.ledger.free_count == 48
    with pytest.raises(AdmissionRejected):
        pair.prefill.admit("big", 80 * PAGE_TOKENS)
    assert pair.decode.wait("big").state is R.REJECTED
    assert "prefill rejected it" in str(pair.decode.status("big").error)
    assert pair.decode.pool.ledger.free_count == 128
    assert pair.decode.stats()["writes"]["landed_bytes"] == 0
    with pytest.raises(NotReadable):
        pair.decode.read("big")


def test_meta_before_prefill_admission_waits_then_binds(engines):
    pair = engines()
    pair.decode.admit("early", 5 * PAGE_TOKENS, peer=pair.peer)
    wait_for(lambda: "early" in pair.prefill.sender.pending_meta, what="pending META")
    pair.prefill.admit("early", 5 * PAGE_TOKENS)
    assert pair.prefill.status("early").state is S.READY
    pair.prefill.send("early")
    assert pair.decode.wait("early").state is R.READABLE


def test_corrupted_byte_fails_the_checksum(engines):
    pair = engines()
    pair.faults.flip_next_write()
    pair.transfer("bad", 10 * PAGE_TOKENS, seed=5)
    req = pair.decode.wait("bad")
    assert req.state is R.FAILED
    assert req.error.check == "checksum"
    assert "adler32 of the destination pages" in str(req.error)
    with pytest.raises(NotReadable):
        pair.decode.read("bad")
    assert pair.prefill.wait("bad").state is S.FAILED
    assert pair.decode.pool.ledger.free_count == pair.decode.layout.num_pages


def test_partial_transfer_never_becomes_readable(engines):
    """The incident's signal: one page written, 'complete' claimed for it."""
    pair = engines()
    pair.prefill.admit("part", 8 * PAGE_TOKENS)
    dreq = pair.decode.admit("part", 8 * PAGE_TOKENS, peer=pair.peer)
    pair.prefill.wait_ready("part")
    pair.prefill.send("part", count=1)
    link = pair.link
    src = pair.prefill.source_pages("part")[:1]
    from kvxfer.core.checksum import checksum_pages

    claim = m.Done(rid="part", gen=dreq.gen, bytes=pair.prefill.layout.bytes_for_pages(1), pages=1,
                   checksum=checksum_pages(pair.prefill.layout, src, "adler32"), algo="adler32")
    link.post_ordered(claim, slot=dreq.slot, gen=dreq.gen)
    req = pair.decode.wait("part")
    assert req.state is R.FAILED
    text = str(req.error)
    # (over verbs this hand-made DONE has no write log, so no page counts as written: 8 of 8)
    assert "DONE claims 1 pages, 8 reserved" in text and "of 8 reserved pages were not written" in text
    with pytest.raises(NotReadable):
        pair.decode.read("part")
    pair.prefill.abort("part")


def test_legacy_placeholder_writer_is_caught_by_a_safe_decode(engines):
    """A prefill running the incident's placeholder path cannot make a safe decode read stale pages."""
    with pytest.warns(RuntimeWarning):
        pair = engines(prefill_pages=16, decode_pages=128, max_context=128 * PAGE_TOKENS,
                       allow_undersized=True, prefill_config={"unsafe_legacy": True})
    pair.decode.receiver.peers[pair.peer].pool_tokens = 0
    pair.prefill.admit("ph", 60 * PAGE_TOKENS)  # placeholder: one page
    pair.decode.admit("ph", 60 * PAGE_TOKENS, peer=pair.peer)
    pair.prefill.wait_ready("ph")
    pair.prefill.send("ph")
    req = pair.decode.wait("ph")
    assert req.state is R.FAILED and req.error.check == "pages"
    assert "59 of 60 reserved pages were not written" in str(req.error)


def test_abort_mid_transfer_quarantines_until_drained(engines):
    pair = engines()
    pair.prefill.admit("a", 30 * PAGE_TOKENS)
    dreq = pair.decode.admit("a", 30 * PAGE_TOKENS, peer=pair.peer)
    pair.prefill.wait_ready("a")
    pair.faults.pause()  # the link stalls: posted writes are in flight
    pair.prefill.send("a", count=10)  # a third of the request posted, DONE not yet
    pages = dreq.pages.copy()
    pair.decode.abort("a")
    assert pair.decode.status("a").state is R.QUARANTINED
    wait_for(lambda: pair.prefill.status("a").state is S.DRAINING, what="prefill draining")
    time.sleep(0.2)
    # nothing leaves quarantine while the writer has not proven its drain
    assert (pair.decode.pool.ledger.state[pages] == PageState.QUARANTINED).all()
    assert pair.decode.status("a").state is R.QUARANTINED
    pair.faults.resume()
    assert pair.decode.wait("a").state is R.ABORTED
    assert pair.decode.pool.ledger.free_count == pair.decode.layout.num_pages
    assert pair.prefill.wait("a").state is S.ABORTED
    assert pair.decode.receiver.stats["drained"] == 1


def test_stale_generation_ack_cannot_release_a_newer_owner(engines):
    """The room id is reused; only stale acks arrive at first, and the new owner's pages stay put."""
    pair = engines()
    pair.transfer("room", 4 * PAGE_TOKENS)
    pair.decode.wait("room")
    pair.decode.release("room")
    old_gen = pair.decode.status("room").gen
    pair.prefill.wait("room")
    pair.prefill.admit("room", 4 * PAGE_TOKENS)
    new = pair.decode.admit("room", 4 * PAGE_TOKENS, peer=pair.peer)
    wait_for(lambda: pair.prefill.status("room").state is S.READY, what="READY")
    # Let the decode's ABORT reach a writer that will not answer it: drop it on the prefill side.
    pair.prefill.sender.on_abort = lambda peer, msg: None
    pair.decode.abort("room")
    from kvxfer.wire.frames import FrameKind, message_frame

    needs(pair, "raw_frames")
    for gen in (old_gen, new.gen + 7):
        ack = m.DrainAck(rid="room", gen=gen, posted=0, completed=0)
        pair.link.post_raw([message_frame(FrameKind.ORDERED, m.encode(ack), generation=gen)])
    time.sleep(0.3)
    assert pair.decode.status("room").state is R.QUARANTINED
    assert (pair.decode.pool.ledger.state[new.pages] == PageState.QUARANTINED).all()
    # the genuine ack (right generation) releases
    pair.link.post_ordered(m.DrainAck(rid="room", gen=new.gen, posted=0, completed=0), slot=new.slot, gen=new.gen)
    assert pair.decode.wait("room").state is R.ABORTED


def test_late_write_after_abort_never_lands_in_a_reused_page(engines):
    pair = engines()
    needs(pair, "raw_frames")  # verbs: test_verbs.py replays a late write on a fenced queue pair
    pair.faults.capture_next_write()
    pair.transfer("victim", 6 * PAGE_TOKENS, seed=1)
    vreq = pair.decode.wait("victim")
    assert vreq.state is R.READABLE
    pair.decode.abort("victim")  # a client disconnect after completion
    late = pair.faults.take_captured()
    assert late, "a write frame was captured"
    pair.prefill.wait("victim")
    # the pages are reused by the next request (LIFO hands them out again)
    src = pair.transfer("next", 6 * PAGE_TOKENS, seed=2)
    nreq = pair.decode.wait("next")
    assert nreq.state is R.READABLE
    assert set(nreq.pages.tolist()) & set(vreq.pages.tolist()), "LIFO should reuse the victim's pages"
    refused_before = pair.decode.stats()["writes"]["refused_by_reason"].get("stale_tag", 0)
    for frame in late:
        pair.link.post_raw(frame)
    wait_for(lambda: pair.decode.stats()["writes"]["refused_by_reason"].get("stale_tag", 0) > refused_before,
             what="stale write refused")
    pair.expect_content("next", src)  # untouched


def test_fence_on_drain_timeout_releases_and_reconnects(engines):
    pair = engines(decode_config={"drain_timeout": 0.3})
    old_conn = pair.decode.receiver.peers[pair.peer].conn
    pair.prefill.admit("slow", 10 * PAGE_TOKENS)
    dreq = pair.decode.admit("slow", 10 * PAGE_TOKENS, peer=pair.peer)
    pair.prefill.wait_ready("slow")
    pair.faults.pause()
    pair.prefill.send("slow")
    pair.decode.abort("slow")
    assert pair.decode.status("slow").state is R.QUARANTINED
    req = pair.decode.wait("slow", timeout=5)
    assert req.state is R.ABORTED
    assert pair.decode.counters["fences"] == 1
    assert pair.decode.pool.ledger.free_count == pair.decode.layout.num_pages
    # the fenced writer learns it, fails the request, and reconnects under a new epoch
    pair.faults.resume()
    assert pair.prefill.wait("slow", timeout=5).state in (S.ABORTED, S.FAILED)
    pair.wait_reconnected(old_conn[1])
    src = pair.transfer("after", 5 * PAGE_TOKENS, seed=9)
    assert pair.decode.wait("after").state is R.READABLE
    pair.expect_content("after", src)
    del dreq


def test_a_request_admitted_while_the_writer_is_still_reconnecting_waits_for_it_or_is_refused(engines):
    """After a fence the decode sees the new connection (tcp/shm: its CONNECT) a moment before the
    prefill holds the link (its ACCEPT is on the way). A request admitted in that moment waits for the
    ACCEPT (briefly) and binds; if the writer takes longer, admit refuses it ("not connected"). It is
    never bound and then failed by the prefill with "no data connection"."""
    pair = engines()
    connect = pair.prefill.transport.connect
    release = threading.Event()

    def slow_connect(request):  # the prefill's connector thread is slow to store the new link
        link = connect(request)
        release.wait(10)
        return link

    def fence_with_a_slow_writer(rid: str) -> tuple[str, int]:
        old = pair.decode.receiver.peers[pair.peer].conn
        release.clear()
        pair.prefill.transport.connect = slow_connect
        assert pair.decode.fence(old, "test fence")
        wait_for(lambda: pair.decode.receiver.peers[pair.peer].offered > old[1], what="the next offer")
        time.sleep(0.3)  # the writer has connected; the data path's CONNECT (tcp, shm) has arrived by now
        pair.prefill.admit(rid, 2 * PAGE_TOKENS, peer=pair.decode.engine_id)
        return old

    def completes(rid: str, seed: int) -> None:
        pair.prefill.wait_ready(rid)
        src = pair.prefill.source_pages(rid)
        fill_random(pair.prefill.layout, src, seed)
        pair.prefill.send(rid)
        assert pair.decode.wait(rid).state is R.READABLE
        pair.expect_content(rid, src)

    # the writer takes longer than admit waits: refused, nothing bound on either side
    old = fence_with_a_slow_writer("late")
    try:
        with pytest.raises(PeerError, match="not connected"):
            pair.decode.admit("late", 2 * PAGE_TOKENS, peer=pair.peer)
        assert pair.prefill.status("late").state is S.ADMITTED
    finally:
        release.set()
        pair.prefill.transport.connect = connect
    pair.wait_reconnected(old[1])
    pair.decode.admit("late", 2 * PAGE_TOKENS, peer=pair.peer)
    completes("late", 4)
    if pair.decode.config.transport == "verbs":
        return  # the connection exists only once the ACCEPT is processed (SPEC 3.0): no moment to wait out
    # the ACCEPT comes within the wait: admit waits for it and binds
    old = fence_with_a_slow_writer("soon")
    timer = threading.Timer(0.5, release.set)
    timer.start()
    try:
        pair.decode.admit("soon", 2 * PAGE_TOKENS, peer=pair.peer)
    finally:
        timer.cancel()
        release.set()
        pair.prefill.transport.connect = connect
    completes("soon", 5)


def test_writes_after_fence_land_nowhere(engines):
    """A write posted on a fenced connection fails on the wire; nothing lands."""
    pair = engines()
    pair.prefill.admit("f", 4 * PAGE_TOKENS)
    dreq = pair.decode.admit("f", 4 * PAGE_TOKENS, peer=pair.peer)
    pair.prefill.wait_ready("f")
    conn = pair.decode.receiver.peers[pair.peer].conn
    old_link = pair.link
    landed_before = pair.decode.stats()["writes"]["landed_bytes"]
    pair.prefill.sender.on_connection_closed = lambda link, reason: None  # keep the stale link's request alive
    pair.prefill._on_fenced = lambda peer, msg: None  # the writer ignores the FENCED notice
    assert pair.decode.fence(conn, "test fence")
    assert pair.decode.status("f").state is R.FAILED
    try:
        pair.prefill.send("f")
    except TransferFailed as exc:
        # layer-wise: a later layer finds the request failed by an earlier one's writes, or (a link
        # that already saw its connection close: under load, shm's idle check can come first) the
        # first layer's post is refused by the closed link
        assert "failed on the wire" in str(exc) or ("could not post writes" in str(exc) and "closed" in str(exc)), exc
    wait_for(lambda: not old_link.alive, what="link to notice the fence")
    assert pair.decode.stats()["writes"]["landed_bytes"] == landed_before
    assert pair.decode.pool.ledger.free_count == pair.decode.layout.num_pages
    del dreq


def test_dead_writer_fails_requests_and_frees_pages(engines):
    pair = engines()
    needs(pair, "sees_disconnect")  # verbs: a dead writer is found by its silence (test_verbs.py)
    pair.prefill.admit("d", 10 * PAGE_TOKENS)
    pair.decode.admit("d", 10 * PAGE_TOKENS, peer=pair.peer)
    pair.prefill.wait_ready("d")
    pair.link.abort_connection()  # the writer's process died: its socket is gone
    req = pair.decode.wait("d")
    assert req.state is R.FAILED
    assert "connection" in str(req.error)
    assert pair.decode.pool.ledger.free_count == pair.decode.layout.num_pages


def test_abort_after_done_before_read_frees_immediately(engines):
    pair = engines()
    pair.transfer("x", 3 * PAGE_TOKENS)
    assert pair.decode.wait("x").state is R.READABLE
    pair.decode.abort("x")
    assert pair.decode.status("x").state is R.ABORTED
    assert pair.decode.pool.ledger.free_count == pair.decode.layout.num_pages
    with pytest.raises(NotReadable):
        pair.decode.read("x")


def test_prefill_abort_tells_decode_on_the_ordered_path(engines):
    pair = engines()
    pair.prefill.admit("p", 6 * PAGE_TOKENS)
    pair.decode.admit("p", 6 * PAGE_TOKENS, peer=pair.peer)
    pair.prefill.wait_ready("p")
    pair.prefill.send("p", count=2)
    pair.prefill.abort("p")
    assert pair.decode.wait("p").state is R.ABORTED
    assert pair.prefill.wait("p").state is S.ABORTED
    assert pair.decode.pool.ledger.free_count == pair.decode.layout.num_pages


def test_transfer_timeout_quarantines_then_fences(engines):
    pair = engines(decode_config={"transfer_timeout": 0.3, "drain_timeout": 0.3})
    pair.prefill.sender.on_abort = lambda peer, msg: None  # a writer that never answers
    pair.decode.admit("t", 4 * PAGE_TOKENS, peer=pair.peer)
    req = pair.decode.wait("t", timeout=5)
    assert req.state is R.FAILED
    assert pair.decode.counters["fences"] == 1
    assert pair.decode.pool.ledger.free_count == pair.decode.layout.num_pages


def test_read_checks_page_ownership(engines):
    pair = engines()
    pair.transfer("o", 4 * PAGE_TOKENS)
    pair.decode.wait("o")
    kv = pair.decode.read("o")
    kv.buffer(0)
    # a bookkeeping bug hands one page to someone else behind the request's back
    page = int(kv.pages[1])
    pair.decode.pool.ledger.generation[page] += 1000
    from kvxfer.errors import OwnershipError

    with pytest.raises(OwnershipError, match=f"page {page}"):
        kv.buffer(0)
    with pytest.raises(OwnershipError):
        pair.decode.read("o")
    pair.decode.pool.ledger.generation[page] -= 1000
    pair.decode.release("o")


def test_unknown_and_stale_inputs_get_clear_errors(engines):
    pair = engines()
    with pytest.raises(UnknownRequest, match="'nope'"):
        pair.prefill.send("nope")
    with pytest.raises(UnknownRequest):
        pair.decode.abort("nope")
    with pytest.raises(UnknownRequest):
        pair.decode.release("nope")
    pair.transfer("k", PAGE_TOKENS)
    gen = pair.decode.wait("k").gen
    from kvxfer.errors import DuplicateRequest, StaleGeneration

    with pytest.raises(StaleGeneration, match="current generation"):
        pair.decode.read("k", generation=gen - 1)
    with pytest.raises(DuplicateRequest):
        pair.decode.admit("k", PAGE_TOKENS, peer=pair.peer)
    # a DONE for a generation nobody admitted is ignored and counted, never completes anything
    before = pair.decode.receiver.stats["stale_messages"]
    bogus = m.Done(rid="ghost", gen=999_999, bytes=1, pages=1, checksum=1, algo="adler32")
    pair.link.post_ordered(bogus, slot=0, gen=999_999)
    wait_for(lambda: pair.decode.receiver.stats["stale_messages"] > before, what="stale DONE counted")
    pair.decode.release("k")


def test_malformed_control_messages_keep_the_engine_running(engines):
    pair = engines(keyed=False)  # an open control plane; tests/test_hostile_peers.py sends garbage under a key
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"intruder")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(pair.decode.address)
    for junk in (b"", b"\xc1", b"\x93\x07\xa4META\x80", m.encode(m.Heartbeat(engine="x", seq=1)) + b"!",
                 b"\x93\x01\xa3FOO\x80", b"\x93\x01\xa4META\x81\xa3bad\x01"):
        sock.send(junk)
    wait_for(lambda: pair.decode.counters["malformed_messages"] >= 6, what="malformed messages counted")
    sock.close()
    ctx.term()
    src = pair.transfer("still", 4 * PAGE_TOKENS)
    assert pair.decode.wait("still").state is R.READABLE
    pair.expect_content("still", src)


def test_hostile_writes_are_refused_with_reasons(engines):
    pair = engines()
    needs(pair, "raw_frames")
    pair.prefill.admit("h", 4 * PAGE_TOKENS)
    dreq = pair.decode.admit("h", 4 * PAGE_TOKENS, peer=pair.peer)
    pair.prefill.wait_ready("h")
    from kvxfer.wire import frames as f

    item = pair.decode.layout.item_lens[0]
    free_page = int(np.setdiff1d(np.arange(pair.decode.layout.num_pages), dreq.pages)[0])
    cases = {
        "not_reserved": (dreq.slot, dreq.gen, 0, free_page * item, item),
        "out_of_range": (dreq.slot, dreq.gen, 0, pair.decode.layout.num_pages * item, item),
        "misaligned": (dreq.slot, dreq.gen, 0, int(dreq.pages[0]) * item + 1, item),
        "bad_buffer": (dreq.slot, dreq.gen, 9, int(dreq.pages[0]) * item, item),
        "tag_mismatch": (dreq.slot + 1, dreq.gen, 0, int(dreq.pages[0]) * item, item),
        "unknown_tag": (dreq.slot, dreq.gen + 100, 0, int(dreq.pages[0]) * item, item),
    }
    for slot, gen, buf, off, length in cases.values():
        header = f.write_header(slot, gen, 1, length)
        runs = f.pack_runs(np.array([buf]), np.array([off]), np.array([length]))
        pair.link.post_raw([header, runs, b"\xee" * length])
    wait_for(lambda: sum(pair.decode.stats()["writes"]["refused_by_reason"].values()) >= len(cases),
             what="refusals")
    assert set(pair.decode.stats()["writes"]["refused_by_reason"]) == set(cases)
    assert pair.decode.stats()["writes"]["landed_bytes"] == 0
    # the genuine transfer still completes and verifies
    fill_random(pair.prefill.layout, pair.prefill.source_pages("h"), 4)
    pair.prefill.send("h")
    assert pair.decode.wait("h").state is R.READABLE


def test_protocol_error_on_data_stream_fences_only_that_connection(engines):
    pair = engines()
    needs(pair, "raw_frames")
    pair.prefill.admit("z", 2 * PAGE_TOKENS)
    pair.decode.admit("z", 2 * PAGE_TOKENS, peer=pair.peer)
    pair.prefill.wait_ready("z")
    pair.link.post_raw([b"XX" + b"\x00" * 30])  # bad magic: the stream is out of sync
    assert pair.decode.wait("z").state is R.FAILED
    assert pair.decode.stats()["protocol_errors"] == 1


def test_capacity_invariant_refuses_undersized_pool():
    from kvxfer.errors import CapacityError

    layout = make_layout(32)
    with pytest.raises(CapacityError, match=r"prefill pool 512 tokens < context 1,024 tokens"):
        PrefillEngine(layout, EngineConfig(max_context=1024))
    with pytest.raises(CapacityError, match=r"decode pool 512 tokens < context"):
        DecodeEngine(layout, EngineConfig(max_context=1024))


def test_duplicate_writes_are_harmless(engines):
    pair = engines()
    pair.faults.config.duplicate_rate = 1.0
    src = pair.transfer("dup", 8 * PAGE_TOKENS, seed=11)
    assert pair.decode.wait("dup").state is R.READABLE
    pair.expect_content("dup", src)
    pair.faults.config.duplicate_rate = 0.0


def test_many_requests_in_flight_on_one_connection(engines):
    pair = engines(prefill_pages=64, decode_pages=128)
    rids = [f"m{i}" for i in range(6)]
    sources = {}
    for rid in rids:
        pair.prefill.admit(rid, 10 * PAGE_TOKENS)
        pair.decode.admit(rid, 10 * PAGE_TOKENS, peer=pair.peer)
    for i, rid in enumerate(rids):
        pair.prefill.wait_ready(rid)
        sources[rid] = pair.prefill.source_pages(rid)
        fill_random(pair.prefill.layout, sources[rid], 100 + i)
    for _ in range(5):  # interleave chunks of every request on the one connection
        for rid in rids:
            pair.prefill.send(rid, count=2)
    for rid in rids:
        assert pair.decode.wait(rid).state is R.READABLE
        pair.expect_content(rid, sources[rid])
        pair.decode.release(rid)


def test_poison_policy_names_unwritten_pages_at_completion(engines):
    pair = engines(decode_config={"free_policy": "poison"})
    pair.prefill.admit("pz", 4 * PAGE_TOKENS)
    dreq = pair.decode.admit("pz", 4 * PAGE_TOKENS, peer=pair.peer)
    pair.prefill.wait_ready("pz")
    pair.prefill.send("pz", count=1)
    done = m.Done(rid="pz", gen=dreq.gen, bytes=pair.decode.layout.bytes_for_pages(4), pages=4,
                  checksum=0, algo="adler32")
    pair.link.post_ordered(done, slot=dreq.slot, gen=dreq.gen)
    req = pair.decode.wait("pz")
    assert req.state is R.FAILED
    assert "poison: 3 pages still hold the poison pattern" in str(req.error)
    pair.prefill.abort("pz")


def test_caller_chosen_pages_are_checked(engines):
    pair = engines()
    from kvxfer.errors import InvalidArgument, PageStateError

    with pytest.raises(InvalidArgument, match="out of range"):
        pair.decode.admit("ext", 2 * PAGE_TOKENS, peer=pair.peer, pages=[3, 500])
    with pytest.raises(InvalidArgument, match="3 pages given"):
        pair.decode.admit("ext", 2 * PAGE_TOKENS, peer=pair.peer, pages=[3, 4, 5])
    req = pair.decode.admit("ext", 2 * PAGE_TOKENS, peer=pair.peer, pages=[7, 3])
    assert req.pages.tolist() == [7, 3]
    with pytest.raises(PageStateError, match="not free"):
        pair.decode.admit("ext2", PAGE_TOKENS, peer=pair.peer, pages=[7])
    pair.decode.abort("ext")
    assert pair.decode.wait("ext").state is R.ABORTED
    # the prefill never admitted "ext"; the aborted generation's META must not bind later
    pair.prefill.admit("ext", 2 * PAGE_TOKENS)
    time.sleep(0.1)
    assert pair.prefill.status("ext").state is S.ADMITTED
    pair.prefill.abort("ext")


def test_checksums_taken_as_bytes_land_match_a_reading_pass(engines):
    """The fast path (item checksums at landing, combined) agrees with reading the pages back."""
    from kvxfer.core import native
    from kvxfer.core.checksum import checksum_pages

    pair = engines()
    if pair.decode.capabilities.write_log:
        pytest.skip("the NIC lands these writes: the receiver takes no checksums as bytes land")
    pair.transfer("fast", 17 * PAGE_TOKENS, seed=21)
    req = pair.decode.wait("fast")
    assert req.state is R.READABLE
    guard = pair.decode.receiver.guard
    landed = guard.landed_checksum(req.pages, pair.decode.receiver.checksum)
    if native.checksums_in_c:
        assert landed == checksum_pages(pair.decode.layout, req.pages, "adler32")
    else:
        assert landed is None


def test_a_refused_request_frees_the_decodes_pages_at_once(engines):
    """The prefill's caller gave up on a request it never admitted (SGLang: the client left while the
    request waited for its bootstrap): a destination for it is answered with REJECT at once."""
    pair = engines(meta_timeout=30.0)
    pair.decode.admit("early", 4 * PAGE_TOKENS, peer=pair.peer)  # the META arrives first
    wait_for(lambda: "early" in pair.prefill.sender.pending_meta, what="pending META")
    pair.prefill.refuse("early")
    assert pair.decode.wait("early", timeout=5).state is R.REJECTED
    pair.prefill.refuse("late")  # the refusal arrives first
    pair.decode.admit("late", 4 * PAGE_TOKENS, peer=pair.peer)
    assert pair.decode.wait("late", timeout=5).state is R.REJECTED
    assert pair.decode.pool.ledger.free_count == pair.decode.layout.num_pages
    # a new attempt under a refused id is admitted normally
    src = pair.transfer("late", 4 * PAGE_TOKENS, seed=2)
    assert pair.decode.wait("late").state is R.READABLE
    pair.expect_content("late", src)


def test_send_waits_for_the_sources_ready_event_before_reading_them(engines):
    """SGLang's early send under overlap scheduling: the forward pass may still be writing the pages
    when send() is called; the transport reads them only after the event."""
    import threading

    pair = engines()
    pair.prefill.admit("ev", 4 * PAGE_TOKENS)
    pair.decode.admit("ev", 4 * PAGE_TOKENS, peer=pair.peer)
    pair.prefill.wait_ready("ev")
    src = pair.prefill.source_pages("ev")
    ready = threading.Event()
    pair.prefill.send("ev", ready=ready)
    time.sleep(0.2)
    assert pair.decode.status("ev").state is R.RESERVED  # nothing read, nothing landed
    assert pair.decode.stats()["writes"]["landed_bytes"] == 0
    fill_random(pair.prefill.layout, src, 77)  # the "forward pass" finishes writing
    ready.set()
    assert pair.decode.wait("ev").state is R.READABLE
    pair.expect_content("ev", src)
