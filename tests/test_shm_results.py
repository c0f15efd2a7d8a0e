"""RESULT back through the shm ring's result area (kvxfer/transport/shm.py; protocol/SPEC.md §3.0.1).

The common cases (a verified and a failed request answered there, the option off) run for both
transports in tests/test_results_on_data.py. The decode answers a leg's verification in the result area of the ring its DONE came on, never waiting;
where it cannot (the option off, a writer that does not read the area or left it full, the connection
ending) the same RESULT goes on the control plane, exactly one of the two. The prefill's result watcher
reads whole RESULT frames and delivers them as a RESULT from the control plane; anything else there, or
an impossible position, ends that link, and the engines connect again. Real engines on one host.
"""

from __future__ import annotations

import time

import pytest

from kvxfer.core.lifecycle import ReceiverState as R
from kvxfer.core.lifecycle import SenderState as S
from kvxfer.transport import shm
from kvxfer.wire import frames as f
from kvxfer.wire import messages as m

from .conftest import PAGE_TOKENS, wait_for
from .test_results_on_data import _results_on_data

pytestmark = pytest.mark.skipif(shm._native() is None, reason="the result watcher needs the native extension "
                                                              "(kvxfer._native: KVXFER_PURE_PYTHON=1 or not built)")


def _inbound(pair) -> shm._Inbound:
    conn = pair.decode.receiver.peers[pair.peer].conn
    return pair.decode.transport._conns[conn]


def _put(pair, data: bytes, *, producer: int | None = None) -> None:
    """What a hostile or broken decode writes into the result area (and the position it publishes)."""
    inbound = _inbound(pair)
    with inbound.answer_lock:
        ring = inbound.ring
        ring.write(inbound.results_produced, memoryview(data), shm.RESULT_AREA, shm.RESULT_AREA_BYTES)
        inbound.results_produced += len(data)
        ring.publish(shm.W_RESULT_PRODUCER, inbound.results_produced if producer is None else producer,
                     shm.W_RESULT_WANT)


@pytest.fixture
def shm_pair(engines):
    def make(**kwargs):
        return engines(fault_injection=kwargs.pop("fault_injection", False), transport="shm", **kwargs)
    return make


def test_a_writer_that_does_not_read_the_area_gets_results_on_the_control_plane(shm_pair):
    pair = shm_pair()
    _inbound(pair).ring.store(shm.W_RESULT_READER, 0)  # as a writer without the native watcher leaves it
    pair.transfer("a", 3 * PAGE_TOKENS)
    assert pair.decode.wait("a", timeout=10).state is R.READABLE
    assert pair.prefill.wait("a", timeout=10).state is S.SUCCEEDED
    assert _results_on_data(pair) == (0, 0, 0) and pair.decode.transport.stats()["answers_declined"] == 0


def test_a_writer_that_stops_reading_gets_its_results_on_the_control_plane_and_whole_frames(shm_pair):
    """While the prefill's watcher cannot read (its read lock held), the decode answers in the area until
    the next frame does not fit, then declines at once (nothing partial enters it); once the watcher reads
    again it gets every frame whole, and the next request's RESULT comes through the area again."""
    pair = shm_pair(prefill_pages=128)
    link = pair.link
    conn = pair.decode.receiver.peers[pair.peer].conn
    result = m.Result(rid="none", gen=1 << 40, ok=False, reason="x", detail="y" * 200)
    sent = 0
    with link._read_lock:
        t0 = time.monotonic()
        while pair.decode.transport.answer(conn, result):
            sent += 1
            assert sent < 100, "the decode never declined"
        for _ in range(50):
            assert not pair.decode.transport.answer(conn, result)
        assert time.monotonic() - t0 < 2  # declining never waits for the writer
        assert sent == shm.RESULT_AREA_BYTES // len(f.result_frame(result))
        assert pair.decode.transport.stats()["answers_declined"] == 51
    wait_for(lambda: link.results_received == sent, timeout=5, what="every RESULT frame read back")
    wait_for(lambda: pair.prefill.stats()["requests"].get("stale_result", 0) == sent, timeout=5,
             what="the RESULTs for no request counted as stale")
    assert link.alive
    pair.transfer("after", PAGE_TOKENS)
    assert pair.prefill.wait("after", timeout=10).state is S.SUCCEEDED
    wait_for(lambda: _results_on_data(pair)[0] == 1, timeout=5, what="the next RESULT through the area")


@pytest.mark.parametrize("garbage", ["bytes", "ordered-frame", "result-carrying-done", "generation-mismatch",
                                     "over-long", "position-too-far", "position-backwards"])
def test_a_decode_that_puts_anything_but_result_frames_there_loses_that_connection(shm_pair, garbage):
    """A hostile or broken decode: the prefill ends that link, saying why, and transfers on the next
    connection the decode offers."""
    pair = shm_pair()
    link = pair.link
    old_epoch = link.epoch
    done = m.Done(rid="x", gen=3, bytes=1, pages=1, checksum=1, algo="adler32")
    result = m.Result(rid="x", gen=3, ok=True, reason="", detail="")
    if garbage == "position-too-far":
        _put(pair, b"", producer=shm.RESULT_AREA_BYTES + 1)
    elif garbage == "position-backwards":
        _put(pair, f.result_frame(result))
        wait_for(lambda: link.results_received == 1, timeout=5, what="the first RESULT read")
        _put(pair, b"", producer=3)
    else:
        _put(pair, {
            "bytes": b"not a frame at all, but long enough for a header",
            "ordered-frame": f.message_frame(f.FrameKind.ORDERED, m.encode(done), generation=3),
            "result-carrying-done": f.message_frame(f.FrameKind.RESULT, m.encode(done), generation=3),
            "generation-mismatch": f.message_frame(f.FrameKind.RESULT, m.encode(result), generation=4),
            "over-long": f.FrameHeader(f.FrameKind.RESULT, 0, 3, 0, f.RESULT_BODY_MAX + 1, 0).pack(),
        }[garbage])
    wait_for(lambda: not link.alive, timeout=5, what="the prefill ending the link")
    expected = "the receiver's result position" if garbage.startswith("position") else "the receiver sent a malformed frame"
    assert link._lost.startswith(expected), link._lost
    pair.wait_reconnected(old_epoch)
    pair.transfer("after", PAGE_TOKENS)
    assert pair.prefill.wait("after", timeout=10).state is S.SUCCEEDED


def test_a_writer_whose_result_position_is_impossible_gets_results_on_the_control_plane(shm_pair):
    """The result consumer word is the writer's: a hostile value makes the decode decline (the control
    plane carries the RESULT), never write outside the area or wait."""
    pair = shm_pair()
    ring = _inbound(pair).ring
    with pair.link._read_lock:  # the watcher would not touch the word meanwhile
        ring.store(shm.W_RESULT_CONSUMER, 1 << 62)
        pair.transfer("a", PAGE_TOKENS)
        assert pair.decode.wait("a", timeout=10).state is R.READABLE
        assert pair.prefill.wait("a", timeout=10).state is S.SUCCEEDED
    assert _results_on_data(pair)[:2] == (0, 0) and pair.decode.transport.stats()["answers_declined"] == 1


def test_a_result_for_no_request_in_the_area_changes_nothing(shm_pair):
    pair = shm_pair()
    _put(pair, f.result_frame(m.Result(rid="ghost", gen=999, ok=True, reason="", detail="")))
    wait_for(lambda: pair.prefill.stats()["requests"].get("stale_result", 0) == 1, timeout=5,
             what="a stale RESULT counted")
    assert pair.link.alive
    pair.transfer("real", PAGE_TOKENS)
    assert pair.prefill.wait("real", timeout=10).state is S.SUCCEEDED


def test_a_writer_that_sends_a_result_frame_into_the_ring_loses_its_connection(shm_pair):
    pair = shm_pair()
    link = pair.link
    before = pair.decode.stats()["protocol_errors"]
    link.post_raw([f.result_frame(m.Result(rid="x", gen=1, ok=True, reason="", detail=""))])
    wait_for(lambda: pair.decode.stats()["protocol_errors"] == before + 1, timeout=5, what="the decode's protocol error")
    pair.wait_reconnected(link.epoch)


@pytest.mark.parametrize("who", ["decode fences", "link ends"])
def test_a_result_that_came_ahead_of_the_connections_end_counts(shm_pair, who):
    """The decode answered in the area, then the connection ended before the prefill's watcher read it:
    the prefill reads what is left before it settles the link's requests, so the verified request
    succeeds instead of failing for a closed connection."""
    pair = shm_pair()
    p, d = pair.prefill, pair.decode
    link = pair.link
    with link._read_lock:  # the watcher is slow to come round
        pair.transfer("ahead", 2 * PAGE_TOKENS)
        assert d.wait("ahead", timeout=10).state is R.READABLE
        wait_for(lambda: d.stats()["data_path"]["answers_sent"] == 1, timeout=5, what="the RESULT answered")
        assert p.status("ahead").state is S.DONE_SENT
        if who == "decode fences":
            assert d.fence(d.receiver.peers[pair.peer].conn, "test: fenced right after answering")
        else:
            link.abort_connection()
    assert p.wait("ahead", timeout=10).state is S.SUCCEEDED
    pair.wait_reconnected(link.epoch)
