"""RESULT back on the tcp data connection (protocol/SPEC.md §3.0.1, RESULT frames).

The decode answers a leg's verification on the connection its DONE came on, without waiting; where it
cannot (the option off, the writer not reading, the connection ending) the same RESULT goes on the
control plane, exactly one of the two. The prefill reads RESULT frames on its lanes' watcher and treats
them as a RESULT from the control plane; anything else a decode sends there ends that connection.
"""

from __future__ import annotations

import re
import socket
import time

import numpy as np
import pytest

from kvxfer.core.lifecycle import ReceiverState as R
from kvxfer.core.lifecycle import SenderState as S
from kvxfer.errors import ProtocolError
from kvxfer.transport import shm, tcp
from kvxfer.wire import frames as f
from kvxfer.wire import messages as m

from .conftest import PAGE_TOKENS, wait_for


def _results_on_data(pair) -> tuple[int, int, int]:
    """(decode RESULTs sent on the data connection, the transport's count of them, prefill RESULTs read there)."""
    decode = pair.decode.stats()
    prefill = pair.prefill.stats()
    return (decode["requests"].get("results_on_data", 0), decode["data_path"]["answers_sent"],
            prefill["requests"].get("results_on_data", 0))


# tcp answers on its socket, shm in its ring's result area (tests/test_shm_results.py has shm's own cases)
BOTH = ["tcp", pytest.param("shm", marks=pytest.mark.skipif(
    shm._native() is None, reason="shm's result watcher needs the native extension (kvxfer._native)"))]


@pytest.mark.parametrize("transport_name", BOTH)
@pytest.mark.parametrize("tokens", [PAGE_TOKENS, 120 * PAGE_TOKENS], ids=["one-page", "verifier-thread"])
def test_a_verified_request_is_answered_on_its_data_connection(engines, tokens, transport_name):
    """A one-page request (verified on the data thread) and a larger one (verified on the verifier
    thread): each RESULT travels back on the data connection, the prefill succeeds on it, and the
    control plane carries none."""
    pair = engines(fault_injection=False, prefill_pages=128, decode_pages=256, transport=transport_name)
    control_results = []
    deliver = pair.decode.receiver._deliver
    pair.decode.receiver._deliver = lambda peer, msg: (
        control_results.append(msg) if isinstance(msg, m.Result) else None, deliver(peer, msg))
    for i in range(3):
        src = pair.transfer(f"r{i}", tokens, seed=i)
        assert pair.decode.wait(f"r{i}", timeout=10).state is R.READABLE
        assert pair.prefill.wait(f"r{i}", timeout=10).state is S.SUCCEEDED
        pair.expect_content(f"r{i}", src)
        pair.decode.release(f"r{i}")
    wait_for(lambda: _results_on_data(pair) == (3, 3, 3), timeout=5, what="three RESULTs on the data connection")
    assert control_results == []
    assert pair.link.results_received == 3 and pair.link.alive


@pytest.mark.parametrize("transport_name", BOTH)
def test_a_failed_verification_is_answered_on_the_data_connection(engines, transport_name):
    pair = engines(transport=transport_name)
    pair.faults.flip_next_write()
    pair.transfer("bad", 10 * PAGE_TOKENS, seed=5)
    assert pair.decode.wait("bad", timeout=10).state is R.FAILED
    done = pair.prefill.wait("bad", timeout=10)
    assert done.state is S.FAILED and "checksum" in str(done.error)
    wait_for(lambda: _results_on_data(pair) == (1, 1, 1), timeout=5, what="the failure on the data connection")


@pytest.mark.parametrize("transport_name", BOTH)
def test_with_the_option_off_results_go_on_the_control_plane(engines, transport_name):
    off = {"transport_options": {transport_name: {"answer_on_data": False}}}
    pair = engines(fault_injection=False, decode_config=off, transport=transport_name)
    pair.transfer("a", 3 * PAGE_TOKENS)
    assert pair.decode.wait("a", timeout=10).state is R.READABLE
    assert pair.prefill.wait("a", timeout=10).state is S.SUCCEEDED
    assert _results_on_data(pair) == (0, 0, 0)


def test_a_writer_that_stops_reading_gets_its_results_on_the_control_plane_and_whole_frames(engines):
    """While the prefill reads nothing from its data connection, the decode answers there until the
    writer leaves 64 KiB unread, then declines (its caller sends on the control plane; nothing partial
    enters the stream); once the prefill reads again it gets every frame whole and the link lives."""
    pair = engines(fault_injection=False, prefill_pages=128)
    link = pair.link
    p, d = pair.prefill, pair.decode
    p.transport.lanes.unwatch(link._sock)  # the prefill's watcher stops reading this connection
    conn = d.receiver.peers[pair.peer].conn
    detail = "x" * 2000  # a long failure text: the backlog fills after ~32 frames
    sent = 0
    while d.transport.answer(conn, m.Result(rid=f"none-{sent}", gen=1 << 40, ok=False, reason="x", detail=detail)):
        sent += 1
        assert sent < 100_000, "the decode never declined"
    assert d.transport.stats()["answers_declined"] >= 1
    p.transport.lanes.watch(link._sock, link)
    wait_for(lambda: link.results_received == sent, timeout=10, what="every RESULT frame read back")
    assert link.alive
    wait_for(lambda: p.stats()["requests"].get("stale_result", 0) == sent, timeout=5,
             what="the RESULTs for no request counted as stale")
    pair.transfer("after", PAGE_TOKENS)
    assert p.wait("after", timeout=10).state is S.SUCCEEDED
    wait_for(lambda: d.stats()["requests"].get("results_on_data", 0) == 1, timeout=5, what="the decode's count")


def test_an_answer_looks_at_the_send_queue_only_when_the_backlog_could_be_reached(engines):
    """Each answer used to ask the kernel how many bytes the writer left unacknowledged (SIOCOUTQ, a
    syscall per RESULT on the landing thread); what was sent since the last look bounds that number, so
    the kernel is asked only when the bound could pass ANSWER_BACKLOG. Thirty RESULT frames of ~80 bytes
    are sent without one look; a writer that stops reading is still found out (declined, as above)."""
    pair = engines(fault_injection=False)
    for i in range(30):
        pair.transfer(f"r{i}", PAGE_TOKENS, seed=i)
        assert pair.decode.wait(f"r{i}", timeout=10).state is R.READABLE
        assert pair.prefill.wait(f"r{i}", timeout=10).state is S.SUCCEEDED
        pair.decode.release(f"r{i}")
    stats = pair.decode.transport.stats()
    assert stats["answers_sent"] == 30 and stats["answers_declined"] == 0, stats
    assert stats["send_queue_looks"] == 0, stats
    pair.prefill.transport.lanes.unwatch(pair.link._sock)
    conn = pair.decode.receiver.peers[pair.peer].conn
    result = m.Result(rid="none", gen=1 << 40, ok=False, reason="x", detail="y" * 2000)
    sent = 0
    while pair.decode.transport.answer(conn, result):
        sent += 1
        assert sent < 1000, "the decode never declined"
    stats = pair.decode.transport.stats()
    assert stats["answers_declined"] == 1 and stats["send_queue_looks"] >= 1, stats
    assert sent * len(f.result_frame(result)) > tcp.ANSWER_BACKLOG // 2, sent
    pair.prefill.transport.lanes.watch(pair.link._sock, pair.link)
    wait_for(lambda: pair.link.results_received == 30 + sent, timeout=10, what="every RESULT frame read back")


def _decode_socket(pair) -> socket.socket:
    conn = pair.decode.receiver.peers[pair.peer].conn
    return pair.decode.transport._conns[conn].sock


@pytest.mark.parametrize("garbage", ["bytes", "ordered-frame", "result-carrying-done", "generation-mismatch",
                                     "over-long"])
def test_a_decode_that_sends_anything_but_result_frames_loses_that_connection(engines, garbage):
    """A hostile or broken decode writes something else back on the data connection: the prefill ends
    that link, saying why, and transfers on the next connection the decode offers."""
    pair = engines(fault_injection=False)
    p = pair.prefill
    link = pair.link
    old_epoch = link.epoch
    done = m.Done(rid="x", gen=3, bytes=1, pages=1, checksum=1, algo="adler32")
    result = m.Result(rid="x", gen=3, ok=True, reason="", detail="")
    data = {
        "bytes": b"not a frame at all, but long enough for a header",
        "ordered-frame": f.message_frame(f.FrameKind.ORDERED, m.encode(done), generation=3),
        "result-carrying-done": f.message_frame(f.FrameKind.RESULT, m.encode(done), generation=3),
        "generation-mismatch": f.message_frame(f.FrameKind.RESULT, m.encode(result), generation=4),
        "over-long": f.FrameHeader(f.FrameKind.RESULT, 0, 3, 0, f.RESULT_BODY_MAX + 1, 0).pack(),
    }[garbage]
    _decode_socket(pair).sendall(data)
    wait_for(lambda: not link.alive, timeout=5, what="the prefill ending the link")
    assert link._lost.startswith("the receiver sent a malformed frame"), link._lost  # why the link ended
    pair.wait_reconnected(old_epoch)
    pair.transfer("after", PAGE_TOKENS)
    assert p.wait("after", timeout=10).state is S.SUCCEEDED


def test_a_result_for_no_request_on_the_data_connection_changes_nothing(engines):
    pair = engines(fault_injection=False)
    p = pair.prefill
    _decode_socket(pair).sendall(f.result_frame(m.Result(rid="ghost", gen=999, ok=True, reason="", detail="")))
    wait_for(lambda: p.stats()["requests"].get("stale_result", 0) == 1, timeout=5, what="a stale RESULT counted")
    assert pair.link.alive
    pair.transfer("real", PAGE_TOKENS)
    assert p.wait("real", timeout=10).state is S.SUCCEEDED


def test_a_writer_that_sends_a_result_frame_loses_its_connection(engines):
    """RESULT travels receiver -> writer only: a writer's RESULT frame is a protocol error at the decode."""
    pair = engines(fault_injection=False)
    d = pair.decode
    link = pair.link
    before = d.stats()["protocol_errors"]
    link.post_raw([f.result_frame(m.Result(rid="x", gen=1, ok=True, reason="", detail=""))])
    wait_for(lambda: d.stats()["protocol_errors"] == before + 1, timeout=5, what="the decode's protocol error")
    pair.wait_reconnected(link.epoch)


# the reader itself ------------------------------------------------------------------------------------


def _results(n: int) -> list[m.Result]:
    return [m.Result(rid=i if i % 2 else f"r{i}", gen=i + 1, ok=bool(i % 3), reason="" if i % 3 else "coverage",
                     detail="d" * (i * 7)) for i in range(n)]


@pytest.mark.parametrize("seed", range(3))
def test_the_result_reader_reads_frames_cut_anywhere(seed):
    rng = np.random.default_rng(seed)
    expected = _results(20)
    stream = b"".join(f.result_frame(r) for r in expected)
    reader, got, pos = f.ResultReader(), [], 0
    while pos < len(stream):
        size = int(rng.integers(1, 90))
        got += reader.feed(stream[pos : pos + size])
        pos += size
    assert got == expected and reader.pending == 0


def test_the_result_reader_keeps_a_partial_frame():
    frame = f.result_frame(_results(1)[0])
    reader = f.ResultReader()
    assert reader.feed(frame[:-1]) == [] and reader.pending == len(frame) - 1
    assert reader.feed(frame[-1:]) == _results(1)


@pytest.mark.parametrize(("frame", "error"), [
    (f.message_frame(f.FrameKind.CONNECT, m.encode(m.Connect(engine="e", epoch=1, proof=b"p" * 32))),
     "only RESULT travels that way"),
    (f.FrameHeader(f.FrameKind.RESULT, 5, 1, 0, 10, 0).pack() + b"x" * 10, "slot 5"),
    (f.FrameHeader(f.FrameKind.RESULT, 0, 1, 0, f.RESULT_BODY_MAX + 1, 0).pack(), "at most"),
    (b"KX\x02\x04" + bytes(28), "unsupported frame version"),
])
def test_the_result_reader_refuses_other_frames(frame, error):
    good = f.result_frame(_results(2)[1])
    reader = f.ResultReader()
    assert reader.feed(good + frame) == [_results(2)[1]]  # what came whole before it still counts
    assert reader.error is not None and re.search(error, str(reader.error))
    with pytest.raises(ProtocolError, match=error):
        reader.feed(good)  # out of sync for good


def test_a_writer_side_header_parse_refuses_result_frames():
    with pytest.raises(ProtocolError, match="receiver -> writer only"):
        f.parse_header(f.result_frame(_results(1)[0])[: f.HEADER_SIZE])


def test_an_over_long_result_is_not_framed():
    with pytest.raises(ProtocolError, match="exceeds"):
        f.result_frame(m.Result(rid="r", gen=1, ok=False, reason="x", detail="y" * (f.RESULT_BODY_MAX + 10)))
    with pytest.raises(ProtocolError, match="only RESULT"):
        f.result_frame(m.Abort(rid="r", gen=1, reason="x", detail=""))


def test_answering_is_quick_and_never_waits(engines):
    """answer() on a connection whose writer does not read returns (declines) at once."""
    pair = engines(fault_injection=False)
    pair.prefill.transport.lanes.unwatch(pair.link._sock)
    conn = pair.decode.receiver.peers[pair.peer].conn
    result = m.Result(rid="r", gen=1 << 40, ok=False, reason="x", detail="y" * 4000)
    t0 = time.monotonic()
    sent = 0
    while pair.decode.transport.answer(conn, result):
        sent += 1
    declined = pair.decode.transport.stats()["answers_declined"]
    for _ in range(100):
        assert not pair.decode.transport.answer(conn, result)
    assert time.monotonic() - t0 < 5
    assert pair.decode.transport.stats()["answers_declined"] == declined + 100
    pair.prefill.transport.lanes.watch(pair.link._sock, pair.link)
    wait_for(lambda: pair.link.results_received == sent, timeout=10, what="every RESULT frame read back")
    assert pair.link.alive and conn in pair.decode.transport.connections()


@pytest.mark.parametrize("who", ["decode fences", "link ends"])
def test_a_result_that_came_ahead_of_the_connections_end_counts(engines, who):
    """The decode answered on the connection, then the connection ended before the prefill's watcher
    read the frame (the decode fenced it, telling the prefill on the control plane; or the link ended on
    the prefill's side): the prefill reads what is left in the socket before it settles the link's
    requests, so the verified request succeeds instead of failing for a closed connection."""
    pair = engines(fault_injection=False)
    p, d = pair.prefill, pair.decode
    link = pair.link
    p.transport.lanes.unwatch(link._sock)  # the watcher is slow to come round
    pair.transfer("ahead", 2 * PAGE_TOKENS)
    assert d.wait("ahead", timeout=10).state is R.READABLE
    wait_for(lambda: d.stats()["data_path"]["answers_sent"] == 1, timeout=5, what="the RESULT frame sent")
    assert p.status("ahead").state is S.DONE_SENT
    if who == "decode fences":
        assert d.fence(d.receiver.peers[pair.peer].conn, "test: fenced right after answering")
    else:
        link.abort_connection()  # the link's end, as a failed send would find it
        link.peer_closed("test: the connection ended")
    assert p.wait("ahead", timeout=10).state is S.SUCCEEDED
    pair.wait_reconnected(link.epoch)


def test_a_frame_the_kernel_takes_in_part_is_completed_before_any_other(engines):
    """The decode's send buffer at its minimum and a writer that does not read: a RESULT frame the kernel
    takes only in part is finished first (by the control thread's flush once the writer reads again),
    no other frame is sent meanwhile, and the writer reads every frame whole."""
    pair = engines(fault_injection=False)
    link = pair.link
    pair.prefill.transport.lanes.unwatch(link._sock)
    _decode_socket(pair).setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    link._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    conn = pair.decode.receiver.peers[pair.peer].conn
    sent = 0
    while sent < 10_000 and pair.decode.transport.answer(
            conn, m.Result(rid=f"r{sent}", gen=1 << 40, ok=False, reason="x", detail="y" * 4000)):
        sent += 1
    stats = pair.decode.transport.stats()
    assert stats["answers_split"] >= 1 and stats["answers_declined"] >= 1, stats
    pair.prefill.transport.lanes.watch(link._sock, link)
    wait_for(lambda: link.results_received == sent, timeout=10, what="every RESULT frame read back whole")
    assert link.alive
    pair.transfer("after", PAGE_TOKENS)
    assert pair.prefill.wait("after", timeout=10).state is S.SUCCEEDED
