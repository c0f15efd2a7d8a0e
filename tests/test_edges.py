"""Correctness at the edges of the public API (issue 12): read leases, validation before reservation,
per-generation retries, send() guards and accounting on a busy engine.

Each test drives real engines over loopback as a caller would: several threads against one engine,
bad input from the caller, a rejected prompt retried under the same id.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer import AdmissionRejected, ReceiverState, SenderState
from kvxfer.errors import InvalidArgument, KvxferError, NotReadable, TransferFailed

from .conftest import PAGE_TOKENS, fill_random, wait_for

R, S = ReceiverState, SenderState
BIG_ITEM = 2 << 20  # 2 MiB pages: a checked copy of many of them takes long enough to race


def _ledger_snapshot(engine):
    ledger = engine.pool.ledger
    return (ledger.state.copy(), ledger.generation.copy(), ledger.free_pages().copy())


def _assert_ledger_unchanged(engine, before):
    state, generation, free = _ledger_snapshot(engine)
    assert np.array_equal(state, before[0]), "page states changed"
    assert np.array_equal(generation, before[1]), "page generations changed"
    assert np.array_equal(np.sort(free), np.sort(before[2])), "free list changed"


# read leases ---------------------------------------------------------------------------------------


@pytest.fixture
def big_engines(engines, monkeypatch):
    """The ``engines`` factory with one buffer of 2 MiB items."""
    from . import conftest

    original = conftest.make_layout

    def big_layout(pages, *, buffers=1, item=BIG_ITEM, page_size=PAGE_TOKENS):
        return original(pages, buffers=buffers, item=item, page_size=page_size)

    monkeypatch.setattr(conftest, "make_layout", big_layout)
    return engines


def test_a_checked_read_racing_a_release_returns_the_owners_bytes_or_an_error(big_engines):
    """A reader copies a request's pages while another thread releases it (free policy: zero).

    The copy must hold the request's bytes exactly: the release waits for the read to end."""
    pair = big_engines(prefill_pages=48, decode_pages=96, decode_config={"free_policy": "zero"})
    for attempt in range(4):
        rid = f"race-{attempt}"
        src = pair.transfer(rid, 48 * PAGE_TOKENS, seed=attempt + 1)
        assert pair.decode.wait(rid).state is R.READABLE
        expected = pair.prefill.layout.views()[0][src].copy()
        assert (expected != 0).any()
        started = threading.Event()
        got: dict[str, object] = {}

        def reader(rid=rid, started=started, got=got):
            kv = pair.decode.read(rid)
            started.set()
            try:
                got["data"] = kv.buffer(0)
            except NotReadable as exc:  # refused is fine; wrong bytes are not
                got["error"] = exc
            finally:
                close = getattr(kv, "close", None)
                if close is not None:
                    close()

        thread = threading.Thread(target=reader)
        thread.start()
        started.wait(5)
        time.sleep(0.002)
        pair.decode.release(rid)
        thread.join(30)
        if "data" in got:
            data = got["data"]
            assert np.array_equal(data, expected), (
                f"attempt {attempt}: the read returned bytes that are not the request's "
                f"({int((data != expected).any(axis=1).sum())} of {len(src)} pages differ)")
        wait_for(lambda: pair.decode.pool.ledger.free_count == pair.decode.layout.num_pages,
                 what="pages freed after the read ended")
        assert pair.decode.wait(rid).state is R.RELEASED


def test_a_release_during_an_open_lease_is_deferred_without_blocking(engines):
    pair = engines(decode_config={"free_policy": "zero"})
    src = pair.transfer("lease", 8 * PAGE_TOKENS, seed=4)
    assert pair.decode.wait("lease").state is R.READABLE
    with pair.decode.read("lease") as kv:
        t0 = time.monotonic()
        pair.decode.release("lease")  # returns at once; the free waits for the lease
        assert time.monotonic() - t0 < 1.0
        assert pair.decode.status("lease").state is R.RELEASING
        assert pair.decode.pool.ledger.free_count == pair.decode.layout.num_pages - 8
        # the lease still reads the owner's bytes
        assert np.array_equal(kv.buffer(1), pair.prefill.layout.views()[1][src])
        pair.decode.check_accounting()
        with pytest.raises(NotReadable):
            pair.decode.read("lease")  # no new lease on a released request
    assert pair.decode.status("lease").state is R.RELEASED
    assert pair.decode.pool.ledger.free_count == pair.decode.layout.num_pages
    with pytest.raises(NotReadable, match="lease .* closed"):
        kv.buffer(0)


def test_an_abort_during_an_open_lease_is_deferred_too(engines):
    pair = engines()
    pair.transfer("ab", 4 * PAGE_TOKENS, seed=2)
    assert pair.decode.wait("ab").state is R.READABLE
    kv = pair.decode.read("ab")
    pair.decode.abort("ab")
    assert pair.decode.status("ab").state is R.RELEASING
    assert pair.decode.pool.ledger.free_count == pair.decode.layout.num_pages - 4
    kv.close()
    kv.close()  # idempotent
    assert pair.decode.status("ab").state is R.ABORTED
    assert pair.decode.pool.ledger.free_count == pair.decode.layout.num_pages


def test_a_page_view_never_shows_the_next_owners_bytes(engines):
    """A view handed out by a read keeps the pages held for as long as it (or any view of it) lives."""
    pair = engines(decode_config={"free_policy": "zero"})
    src = pair.transfer("v", 4 * PAGE_TOKENS, seed=9)
    assert pair.decode.wait("v").state is R.READABLE
    kv = pair.decode.read("v")
    view = kv.page(0, 1)
    part = view[10:20]
    expected = pair.prefill.layout.views()[0][src[1]].copy()
    assert np.array_equal(view, expected)
    close = getattr(kv, "close", None)
    if close is not None:
        close()
    del kv
    pair.decode.release("v")
    # the pool is not free while views exist: a new owner cannot get these pages
    assert np.array_equal(view, expected), "the view shows bytes that are not the request's"
    assert np.array_equal(part, expected[10:20])
    assert pair.decode.pool.ledger.free_count == pair.decode.layout.num_pages - 4
    del view
    time.sleep(0.1)  # the control loop has had its turn
    assert pair.decode.pool.ledger.free_count == pair.decode.layout.num_pages - 4  # ``part`` still lives
    del part
    wait_for(lambda: pair.decode.pool.ledger.free_count == pair.decode.layout.num_pages,
             what="pages freed once the last view is gone")
    assert pair.decode.status("v").state is R.RELEASED


def test_views_are_read_only_and_only_inside_an_open_lease(engines):
    pair = engines()
    pair.transfer("ro", 2 * PAGE_TOKENS, seed=3)
    pair.decode.wait("ro")
    with pair.decode.read("ro") as kv:
        view = kv.page(2, 0)
        with pytest.raises(ValueError):
            view[0] = 1
    with pytest.raises(NotReadable):
        kv.page(2, 0)
    del view
    pair.decode.release("ro")
    wait_for(lambda: pair.decode.status("ro").state is R.RELEASED, what="released")


# validation before reservation ------------------------------------------------------------------------

BAD_RIDS = ["x" * 600, "", -1, 2**65, np.int64(3), 1.5, b"bytes", None, True, ("a",)]


@pytest.mark.parametrize("rid", BAD_RIDS, ids=repr)
def test_an_unencodable_request_id_changes_nothing_on_decode(engines, rid):
    pair = engines()
    before = _ledger_snapshot(pair.decode)
    with pytest.raises(InvalidArgument, match="request id"):
        pair.decode.admit(rid, 4 * PAGE_TOKENS, peer=pair.peer)
    _assert_ledger_unchanged(pair.decode, before)
    assert not pair.decode.receiver.active and not pair.decode.receiver.guard.open_windows()
    time.sleep(0.3)  # a tick or two: nothing may fence the connection afterwards
    src = pair.transfer("after", 4 * PAGE_TOKENS, seed=1)
    assert pair.decode.wait("after").state is R.READABLE
    pair.expect_content("after", src)
    assert pair.decode.counters["fences"] == 0


@pytest.mark.parametrize("rid", BAD_RIDS, ids=repr)
def test_an_unencodable_request_id_changes_nothing_on_prefill(engines, rid):
    pair = engines()
    before = _ledger_snapshot(pair.prefill)
    with pytest.raises(InvalidArgument, match="request id"):
        pair.prefill.admit(rid, 4 * PAGE_TOKENS)
    _assert_ledger_unchanged(pair.prefill, before)
    assert not pair.prefill.sender.active


_bad_rid = st.sampled_from(BAD_RIDS) | st.text(min_size=513, max_size=700) | st.integers(max_value=-1) \
    | st.integers(min_value=2**64) | st.floats(allow_nan=True)
_good_rid = st.text(min_size=1, max_size=20) | st.integers(min_value=0, max_value=2**64 - 1)
_bad_tokens = st.sampled_from([None, "16", 1.5, True, np.float32(3), [16]]) | st.integers(max_value=0) \
    | st.integers(min_value=2**64)
_good_tokens = st.integers(min_value=1, max_value=3 * PAGE_TOKENS)
_bad_pages = st.sampled_from(["0,1", 1.5, [[0], [1]], [0.5, 1.5], object()]) \
    | st.lists(st.integers(min_value=-(2**40), max_value=2**40), min_size=1, max_size=6).filter(
        lambda p: any(x < 0 or x >= 64 for x in p)) | st.just([]) \
    | st.lists(st.integers(min_value=0, max_value=3), min_size=2, max_size=5).filter(lambda p: len(set(p)) < len(p))


@st.composite
def _bad_admission(draw):
    """(rid, tokens, pages) where at least one is invalid."""
    which = draw(st.sampled_from(["rid", "tokens", "pages"]))
    rid = draw(_bad_rid if which == "rid" else _good_rid | _bad_rid)
    tokens = draw(_bad_tokens if which == "tokens" else _good_tokens)
    pages = draw(_bad_pages if which == "pages" else st.none() | _bad_pages)
    return rid, tokens, pages


def test_random_bad_admissions_leave_the_ledger_unchanged(engines):
    """Property: any invalid (request id, token count, page list) is refused with a kvxfer error
    before anything is reserved, a window opened or a message sent: the ledger is unchanged."""
    pair = engines(decode_pages=64)
    decode, prefill = pair.decode, pair.prefill
    # one page is held by a live request, so "pages not free" is among the inputs too
    pair.prefill.admit("live", PAGE_TOKENS)
    decode.admit("live", PAGE_TOKENS, peer=pair.peer)
    prefill.wait_ready("live")

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(_bad_admission())
    def check(args):
        rid, tokens, pages = args
        before = (_ledger_snapshot(decode), _ledger_snapshot(prefill))
        windows = len(decode.receiver.guard.open_windows())
        active = (set(decode.receiver.active), set(prefill.sender.active))
        sent_meta = decode.receiver.stats["admitted"]
        with pytest.raises(KvxferError):
            decode.admit(rid, tokens, peer=pair.peer, pages=pages)
        if pages is None:
            with pytest.raises(KvxferError):
                prefill.admit(rid, tokens)
        _assert_ledger_unchanged(decode, before[0])
        _assert_ledger_unchanged(prefill, before[1])
        assert len(decode.receiver.guard.open_windows()) == windows
        assert (set(decode.receiver.active), set(prefill.sender.active)) == active
        assert decode.receiver.stats["admitted"] == sent_meta

    check()
    prefill.send("live")
    assert decode.wait("live").state is R.READABLE
    assert decode.counters["fences"] == 0


# per-generation state -------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["decode-first", "prefill-first", "retry-decode-first"])
def test_a_rejected_prompt_retried_under_the_same_id_succeeds_promptly(engines, order):
    """The incident prompt is rejected on both roles; a fitting retry under the same id then works
    on both roles at once (no leftover rejection applied to it, no wait for a timeout)."""
    with pytest.warns(RuntimeWarning):
        pair = engines(prefill_pages=32, decode_pages=128, max_context=128 * PAGE_TOKENS, allow_undersized=True,
                       meta_timeout=30.0, transfer_timeout=30.0)
    big, small = 80 * PAGE_TOKENS, 8 * PAGE_TOKENS
    sides = [lambda: pair.decode.admit("room", big, peer=pair.peer), lambda: pair.prefill.admit("room", big)]
    for admit in (sides if order != "prefill-first" else sides[::-1]):
        with pytest.raises(AdmissionRejected):
            admit()
    time.sleep(0.2)  # the decode's REJECT reaches the prefill
    t0 = time.monotonic()
    if order == "retry-decode-first":
        pair.decode.admit("room", small, peer=pair.peer)
        time.sleep(0.2)  # its META reaches the prefill before the prefill admits the retry
        pair.prefill.admit("room", small)
    else:
        pair.prefill.admit("room", small)
        pair.decode.admit("room", small, peer=pair.peer)
    pair.prefill.wait_ready("room", timeout=5)
    src = pair.prefill.source_pages("room")
    fill_random(pair.prefill.layout, src, 11)
    pair.prefill.send("room")
    assert pair.decode.wait("room", timeout=5).state is R.READABLE
    assert pair.prefill.wait("room", timeout=5).state is S.SUCCEEDED
    assert time.monotonic() - t0 < 5
    pair.expect_content("room", src)
    pair.decode.release("room")


# send() guards ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [-1, 0, 9, 1.5, True, "2"])
def test_send_count_outside_one_to_the_pages_left_is_refused(engines, count):
    pair = engines()
    pair.prefill.admit("c", 8 * PAGE_TOKENS)
    pair.decode.admit("c", 8 * PAGE_TOKENS, peer=pair.peer)
    pair.prefill.wait_ready("c")
    with pytest.raises(InvalidArgument, match="count"):
        pair.prefill.send("c", count=count)
    assert pair.prefill.status("c").state is S.READY
    assert pair.prefill.status("c").sent == 0
    pair.prefill.send("c", count=8)
    assert pair.decode.wait("c").state is R.READABLE


def test_send_refuses_source_pages_another_request_holds(engines):
    pair = engines()
    for rid in ("a", "b"):
        pair.prefill.admit(rid, 4 * PAGE_TOKENS)
        pair.decode.admit(rid, 4 * PAGE_TOKENS, peer=pair.peer)
        pair.prefill.wait_ready(rid)
    other = pair.prefill.source_pages("b")
    with pytest.raises(InvalidArgument, match="not held by this request"):
        pair.prefill.send("a", other)
    mixed = np.concatenate([pair.prefill.source_pages("a")[:2], other[:2]])
    with pytest.raises(InvalidArgument, match="not held by this request"):
        pair.prefill.send("a", mixed)
    own = pair.prefill.source_pages("a")
    with pytest.raises(InvalidArgument, match="twice"):
        pair.prefill.send("a", np.concatenate([own[:2], own[:2]]))
    assert pair.prefill.status("a").sent == 0
    fill_random(pair.prefill.layout, own, 5)
    pair.prefill.send("a", own[:2])
    with pytest.raises(InvalidArgument, match="already sent"):
        pair.prefill.send("a", own[:2])
    pair.prefill.send("a", own[2:])
    assert pair.decode.wait("a").state is R.READABLE
    pair.expect_content("a", own)
    pair.prefill.abort("b")
    pair.decode.release("a")


def test_external_source_pages_are_the_callers_and_only_range_checked(engines):
    pair = engines()
    pair.prefill.admit("ext", 3 * PAGE_TOKENS, external_pages=True)
    pair.decode.admit("ext", 3 * PAGE_TOKENS, peer=pair.peer)
    pair.prefill.wait_ready("ext")
    with pytest.raises(KvxferError, match="out of range"):
        pair.prefill.send("ext", [0, 1, 10**6])
    src = np.array([7, 3, 40])
    fill_random(pair.prefill.layout, src, 8)
    pair.prefill.send("ext", src)
    assert pair.decode.wait("ext").state is R.READABLE
    pair.expect_content("ext", src)


def test_aux_must_be_small_bytes(engines):
    pair = engines()
    pair.prefill.admit("x", PAGE_TOKENS)
    pair.decode.admit("x", PAGE_TOKENS, peer=pair.peer)
    pair.prefill.wait_ready("x")
    with pytest.raises(InvalidArgument, match="aux"):
        pair.prefill.send("x", aux="text")
    with pytest.raises(InvalidArgument, match="aux"):
        pair.prefill.send("x", aux=b"x" * (2 << 20))
    pair.prefill.send("x", aux=b"meta")
    assert pair.decode.wait("x").state is R.READABLE
    assert pair.decode.status("x").aux == b"meta"
    assert pair.decode.counters["fences"] == 0


# live accounting ---------------------------------------------------------------------------------------------


def test_accounting_on_a_busy_engine_finds_no_false_violations(engines):
    """16 threads stream transfers through one pair while the accounting runs over and over."""
    pair = engines(prefill_pages=256, decode_pages=512, max_context=16 * PAGE_TOKENS)
    stop = threading.Event()
    errors: list[str] = []
    done = [0]

    def stream(worker: int) -> None:
        n = 0
        while not stop.is_set():
            rid = f"w{worker}-{n}"
            n += 1
            tokens = (1 + (worker + n) % 12) * PAGE_TOKENS
            try:
                seed = worker * 1000 + n
                src = pair.transfer(rid, tokens, seed=seed)
                assert pair.decode.wait(rid).state is R.READABLE
                kv = pair.decode.read(rid)
                # what fill_random wrote into buffer 0 (the source pages may be reused by now)
                expected = np.random.default_rng(seed).integers(0, 256, size=(len(src), kv.buffer(0).shape[1]),
                                                                dtype=np.uint8)
                assert np.array_equal(kv.buffer(0), expected)
                del kv  # the read's lease ends with it
                pair.decode.release(rid)
                pair.prefill.wait(rid)
                done[0] += 1
            except Exception as exc:  # reported below
                errors.append(f"{rid}: {type(exc).__name__}: {exc}")
                return

    threads = [threading.Thread(target=stream, args=(w,)) for w in range(16)]
    for t in threads:
        t.start()
    checks = 0
    seen_states: set[str] = set()
    deadline = time.monotonic() + 6
    try:
        while time.monotonic() < deadline and not errors:
            with pair.decode.lock:
                seen_states |= {r.state.value for r in pair.decode.receiver.active.values()}
            pair.decode.check_accounting()
            pair.prefill.check_accounting()
            checks += 1
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not errors, errors[:3]
    assert checks > 20 and done[0] > 50, (checks, done[0])
    assert {"RESERVED", "READABLE"} <= seen_states, seen_states


def test_invalid_send_state_is_a_transfer_error_not_an_assertion(engines):
    pair = engines()
    pair.prefill.admit("w", PAGE_TOKENS)
    with pytest.raises(TransferFailed, match="ADMITTED"):
        pair.prefill.send("w")
    pair.prefill.abort("w")



@pytest.mark.skipif(not hasattr(__import__("socket"), "TCP_CORK"), reason="TCP_CORK: Linux only")
def test_corked_tcp_sends_deliver_every_request_and_leave_the_socket_uncorked(engines):
    """Without fault injection (production), the tcp lane corks the socket while a request's DONE is
    queued behind its writes: many threads sending at once must each get their bytes, and once the
    lane is idle nothing may stay held in the kernel (a socket left corked delays the next frame)."""
    import socket

    pair = engines(fault_injection=False, prefill_pages=64, decode_pages=128)
    assert pair.link.faults is None
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for i in range(6):
                rid = f"cork-{t}-{i}"
                pages = 1 + (t + i) % 5
                pair.prefill.admit(rid, pages * PAGE_TOKENS, peer=pair.decode.engine_id)
                pair.decode.admit(rid, pages * PAGE_TOKENS, peer=pair.peer)
                pair.prefill.wait_ready(rid)
                src = pair.prefill.source_pages(rid)
                fill_random(pair.prefill.layout, src, 100 * t + i)
                sent = [view[src].copy() for view in pair.prefill.layout.views()]  # pages are reused once sent
                pair.prefill.send(rid)
                assert pair.decode.wait(rid).state is R.READABLE
                with pair.decode.read(rid) as kv:
                    for b, expected in enumerate(sent):
                        assert np.array_equal(kv.buffer(b), expected), f"{rid} buffer {b}"
                pair.decode.release(rid)
        except BaseException as exc:  # noqa: BLE001 - reported below, with the thread's request
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors[0]
    assert not any(th.is_alive() for th in threads)
    link = pair.link
    wait_for(lambda: not link._queue, what="the tcp lane idle")
    assert link._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CORK) == 0
    assert not link._corked


def test_small_batches_leave_with_their_done_in_one_send_and_verify(engines):
    """Without fault injection, a small batch with DONE queued right behind it leaves with it in one
    sendmsg, its item checksums taken before sending (and, for a send of the whole request, its
    frame prepared when META arrived): whole sends, chunked sends (only the last chunk has DONE
    behind it), layer by layer and with aux, over several buffers, must each verify and read back
    the bytes sent; a batch too large for that path goes as before."""
    from kvxfer.core import native

    pair = engines(fault_injection=False, prefill_pages=96, decode_pages=192)
    link = pair.link
    layout = pair.prefill.layout
    one_send = native.lib is not None  # the one-sendmsg path needs the native data path (pure Python: never)
    plans = {"whole": [None], "chunks": [2, None], "layers": "layers", "aux": [None], "large": [None],
             "reordered": "reordered"}
    for n, (rid, plan) in enumerate(plans.items()):
        pages = 90 if rid == "large" else 5  # 90 pages x 3 buffers x 1 KiB: beyond WITH_ORDERED_MAX_BYTES
        pair.prefill.admit(rid, pages * PAGE_TOKENS, peer=pair.decode.engine_id)
        pair.decode.admit(rid, pages * PAGE_TOKENS, peer=pair.peer)
        pair.prefill.wait_ready(rid)
        src = pair.prefill.source_pages(rid)
        fill_random(layout, src, 700 + n)
        if plan == "reordered":  # its own pages in another order: not what was prepared
            src = src[::-1].copy()
        sent = [view[src].copy() for view in layout.views()]
        before, prepared_before = link.sent_with_ordered, link.sent_prepared
        if plan == "layers":
            for b in reversed(range(layout.num_buffers)):
                pair.prefill.send(rid, buffers=[b])
        elif plan == "reordered":
            pair.prefill.send(rid, src)
        else:
            for count in plan:
                pair.prefill.send(rid, count=count, aux=b"tail" if rid == "aux" else b"")
        req = pair.decode.wait(rid)
        assert req.state is R.READABLE, (rid, req.error)
        # the lane counts a batch after its sendmsg returned, before it reports the writes complete:
        # the decode may verify first (CI: the count read 0), the prefill's wait() comes after
        pair.prefill.wait(rid)
        assert link.sent_with_ordered == before + (0 if rid == "large" or not one_send else 1), rid
        # a send of the whole request takes the batch and frame prepared when META arrived
        assert link.sent_prepared == prepared_before + (1 if rid in ("whole", "aux") and one_send else 0), rid
        if rid == "aux":
            assert req.aux == b"tail"
        with pair.decode.read(rid) as kv:
            for b, expected in enumerate(sent):
                assert np.array_equal(kv.buffer(b), expected), f"{rid} buffer {b}"
        pair.decode.release(rid)
        pair.prefill.wait(rid)
