"""A hostile client of the decode's tcp data port, before and after CONNECT (issue 15, items 3 and 4).

Anyone who can reach the data port can open connections without knowing any secret. Each case
measures what such a client makes the decode hold (threads, traced memory, descriptors), checks it
stays within the documented EngineConfig bound (``max_data_connections``, ``connect_timeout``,
``max_ordered_body``), and then that the honest writer still transfers byte-exact (the ``engines``
fixture checks both pools' accounting after each test). The accept loop must also outlive running
out of file descriptors (EMFILE), which is exercised in a child process with a lowered RLIMIT_NOFILE.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

from kvxfer import EngineConfig, ReceiverState
from kvxfer.errors import ConfigError
from kvxfer.transport.tcp import parse_address
from kvxfer.wire import frames as f

from .conftest import PAGE_TOKENS, wait_for

R = ReceiverState
MIB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent


def settle(predicate: Callable[[], bool], timeout: float) -> bool:
    """Like wait_for, but answers instead of failing (the caller asserts on what it measured)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def open_idle(address: str, count: int) -> list[socket.socket]:
    host, port = parse_address(address)
    socks = []
    for _ in range(count):
        sock = socket.create_connection((host, port), timeout=5)
        sock.setblocking(False)
        socks.append(sock)
    return socks


def closed_by_decode(socks: list[socket.socket], wait: float, expect: int | None = None) -> set[socket.socket]:
    """The sockets the decode closed (EOF or reset seen) within ``wait`` seconds; once ``expect`` are,
    only a short grace more (to catch any beyond it)."""
    closed: set[socket.socket] = set()
    with selectors.DefaultSelector() as sel:
        for sock in socks:
            sel.register(sock, selectors.EVENT_READ)
        deadline = time.monotonic() + wait
        while len(closed) < len(socks):
            if expect is not None and len(closed) >= expect:
                deadline = min(deadline, time.monotonic() + 0.2)
                expect = None
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in sel.select(left):
                sock = key.fileobj
                try:
                    data = sock.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:  # reset: closed with our unread bytes in its buffer
                    data = b""
                if not data:
                    closed.add(sock)
                    sel.unregister(sock)
    return closed


def data_stats(pair) -> dict:
    return pair.decode.stats()["data_path"]


def wait_for_reconnect(pair, old: tuple[str, int]) -> None:
    """Both ends hold a newer connection than ``old``."""
    pair.wait_reconnected(old[1])


def reconnect_and_transfer(pair, rid: str, seed: int) -> None:
    """Fence the honest writer's connection, wait for its reconnect, then move a request byte-exact."""
    conn = pair.decode.receiver.peers[pair.peer].conn
    assert conn is not None
    assert pair.decode.fence(conn, "test fence")
    wait_for_reconnect(pair, conn)
    src = pair.transfer(rid, 3 * PAGE_TOKENS, seed=seed)
    assert pair.decode.wait(rid, timeout=10).state is R.READABLE
    pair.expect_content(rid, src)


# connections that never send CONNECT --------------------------------------------------------------


def test_idle_connections_cost_no_thread_and_no_buffer_and_are_capped(engines):
    """Finding 3: 300 connections that never send CONNECT used to cost a thread and a 1 MiB scratch
    buffer each (+300 threads, +300 MiB). Now they wait in one handshake thread with a few bytes each,
    the ones beyond ``max_data_connections`` (default 256, the honest writer's included) are closed at
    once, and the honest writer keeps transferring meanwhile."""
    pair = engines(decode_config={"connect_timeout": 60.0})  # the flood waits its turn in the backlog for seconds
    cap = pair.decode.config.max_data_connections
    assert cap == 256  # the default
    flood = 300
    assert flood > cap
    threads_before = threading.active_count()
    rss_before = rss_bytes()
    tracemalloc.start()
    try:
        traced_before = tracemalloc.get_traced_memory()[0]
        socks = open_idle(pair.decode.data_address, flood)
        try:
            settle(lambda: data_stats(pair).get("connections_refused", 0) + data_stats(pair).get(
                "pending_connections", 0) >= flood, timeout=10)
            time.sleep(0.3)  # threads the old receiver starts per connection have started by now
            threads_grown = threading.active_count() - threads_before
            traced_grown = tracemalloc.get_traced_memory()[0] - traced_before
            rss_grown = rss_bytes() - rss_before
            closed = closed_by_decode(socks, wait=2.0, expect=flood - cap + 1)
            measured = (f"{flood} idle connections: +{threads_grown} threads, +{traced_grown / MIB:.1f} MiB traced, "
                        f"+{rss_grown / MIB:.1f} MiB RSS, {len(closed)} closed by the decode")
            assert threads_grown <= 2, measured
            assert traced_grown < 8 * MIB, measured
            live = len(pair.decode.transport.connections())
            assert len(closed) == flood - (cap - live), measured
            stats = data_stats(pair)
            assert stats["connections_refused"] == flood - (cap - live)
            assert stats["pending_connections"] == cap - live
            wait_for(lambda: pair.decode.counters["data_connections_refused"] == flood - (cap - live), timeout=2,
                     what="the engine's counter")
            # the honest writer's live connection is untouched by the flood
            src = pair.transfer("during", 2 * PAGE_TOKENS, seed=1)
            assert pair.decode.wait("during", timeout=10).state is R.READABLE
            pair.expect_content("during", src)
        finally:
            for sock in socks:
                sock.close()
    finally:
        tracemalloc.stop()
    wait_for(lambda: data_stats(pair)["pending_connections"] == 0, timeout=5, what="the flood's slots freed")
    reconnect_and_transfer(pair, "after", seed=2)  # a slot is free again for the writer's reconnect


def test_the_cap_counts_live_connections_too(engines):
    pair = engines(decode_config={"max_data_connections": 3})
    assert len(pair.decode.transport.connections()) == 1
    socks = open_idle(pair.decode.data_address, 4)
    try:
        closed = closed_by_decode(socks, wait=1.0, expect=2)
        assert len(closed) == 2, f"{len(closed)} of 4 idle connections closed with 1 live and a cap of 3"
        assert data_stats(pair)["connections_refused"] == 2
    finally:
        for sock in socks:
            sock.close()
    wait_for(lambda: data_stats(pair)["pending_connections"] == 0, timeout=5, what="the idle slots freed")
    reconnect_and_transfer(pair, "after", seed=3)


def test_a_connection_that_does_not_finish_connect_in_time_is_closed(engines):
    """Finding 3: no deadline for CONNECT. Silent, a partial header, a body that stops half way:
    each is closed after ``connect_timeout`` and counted."""
    pair = engines(decode_config={"connect_timeout": 0.5})
    socks = open_idle(pair.decode.data_address, 3)
    try:
        socks[1].send(f.message_frame(f.FrameKind.CONNECT, b"\x80" * 100)[:10])  # a partial header
        socks[2].send(f.message_frame(f.FrameKind.CONNECT, b"\x80" * 100)[:f.HEADER_SIZE + 50])  # half a body
        started = time.monotonic()
        closed = closed_by_decode(socks, wait=3.0)
        took = time.monotonic() - started
        assert len(closed) == 3, f"{len(closed)} of 3 connections without CONNECT closed within 3 s"
        assert 0.3 < took < 2.5, took
        assert data_stats(pair)["connect_timeouts"] == 3
        wait_for(lambda: pair.decode.counters["connect_timeouts"] == 3, timeout=2, what="the engine's counter")
    finally:
        for sock in socks:
            sock.close()
    reconnect_and_transfer(pair, "after", seed=4)


# frame bodies checked before anything is allocated ------------------------------------------------------


def test_a_connect_header_announcing_64_mib_is_refused_before_allocating_it(engines):
    """Finding 3: a 32-byte header announcing a 64 MiB CONNECT body made the decode allocate 64 MiB
    and wait for it. A CONNECT body is a few KiB at most: the header alone is refused."""
    pair = engines()
    headers = 4
    errors_before = data_stats(pair)["protocol_errors"]
    tracemalloc.start()
    try:
        traced_before = tracemalloc.get_traced_memory()[0]
        socks = open_idle(pair.decode.data_address, headers)
        try:
            announce = f.FrameHeader(f.FrameKind.CONNECT, 0, 0, 0, 64 * MIB, 0).pack()
            for sock in socks:
                sock.send(announce)
            closed = closed_by_decode(socks, wait=2.0, expect=headers)
            settle(lambda: data_stats(pair)["protocol_errors"] >= errors_before + headers, timeout=1)
            traced_grown = tracemalloc.get_traced_memory()[0] - traced_before
            measured = (f"{headers} CONNECT headers announcing 64 MiB: +{traced_grown / MIB:.1f} MiB traced, "
                        f"{len(closed)} closed")
            assert traced_grown < 8 * MIB, measured
            assert len(closed) == headers, measured
            assert data_stats(pair)["protocol_errors"] == errors_before + headers
        finally:
            for sock in socks:
                sock.close()
    finally:
        tracemalloc.stop()
    src = pair.transfer("after", 2 * PAGE_TOKENS, seed=5)
    assert pair.decode.wait("after", timeout=10).state is R.READABLE
    pair.expect_content("after", src)


def test_an_ordered_header_announcing_64_mib_is_refused_before_allocating_it(engines):
    """Finding 3, after CONNECT: an ORDERED body is bounded by ``max_ordered_body`` (default 2 MiB: a
    DONE's aux may be 1 MiB). A larger announcement ends the connection before any allocation; the
    writer reconnects and the next transfer is byte-exact."""
    pair = engines()
    conn = pair.decode.receiver.peers[pair.peer].conn
    errors_before = data_stats(pair)["protocol_errors"]
    tracemalloc.start()
    try:
        traced_before = tracemalloc.get_traced_memory()[0]
        pair.link.post_raw([f.FrameHeader(f.FrameKind.ORDERED, 0, 1, 0, 64 * MIB, 0).pack()])
        refused = settle(lambda: data_stats(pair)["protocol_errors"] > errors_before, timeout=3)
        traced_grown = tracemalloc.get_traced_memory()[0] - traced_before
    finally:
        tracemalloc.stop()
    measured = f"ORDERED header announcing 64 MiB: +{traced_grown / MIB:.1f} MiB traced, refused: {refused}"
    assert refused, measured
    assert traced_grown < 8 * MIB, measured
    wait_for_reconnect(pair, conn)
    src = pair.transfer("after", 3 * PAGE_TOKENS, seed=6)
    assert pair.decode.wait("after", timeout=10).state is R.READABLE
    pair.expect_content("after", src)


def test_data_path_settings_validate_and_read_from_the_environment():
    config = EngineConfig(max_context=64)
    assert (config.max_data_connections, config.connect_timeout, config.max_ordered_body) == (256, 5.0, 2 * MIB)
    for bad in ({"max_data_connections": 0}, {"connect_timeout": 0}, {"max_ordered_body": 1000},
                {"max_ordered_body": 65 * MIB}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            EngineConfig(max_context=64, **bad).validate()
    env = {"KVXFER_MAX_CONTEXT": "64", "KVXFER_MAX_DATA_CONNECTIONS": "32", "KVXFER_CONNECT_TIMEOUT": "1.5",
           "KVXFER_MAX_ORDERED_BODY": str(4 * MIB)}
    config = EngineConfig.from_env(env)
    assert (config.max_data_connections, config.connect_timeout, config.max_ordered_body) == (32, 1.5, 4 * MIB)


# running out of file descriptors -------------------------------------------------------------------------

EMFILE_CHILD = r"""
import json, logging, os, resource, socket, sys, time
from kvxfer import DecodeEngine, EngineConfig, KVLayout, PrefillEngine
from kvxfer.transport.tcp import parse_address
from kvxfer.wire.auth import Keyring

lines = []
class Collect(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
events = logging.getLogger("kvxfer.events")
events.addHandler(Collect())
events.setLevel(logging.INFO)
logging.getLogger("kvxfer").propagate = False

def layout(pages):
    return KVLayout.allocate(num_buffers=2, item_len=1024, num_pages=pages, page_size=16)

rings = Keyring.cluster(["prefill", "decode"])
prefill = PrefillEngine(layout(32), EngineConfig(max_context=512, heartbeat_interval=0.2, keyring=rings["prefill"]))
decode = DecodeEngine(layout(64), EngineConfig(max_context=512, heartbeat_interval=0.2, keyring=rings["decode"]))
peer = decode.connect(prefill.address)
out = {}

def transfer(rid):
    try:
        prefill.admit(rid, 32)
        decode.admit(rid, 32, peer=peer)
        prefill.wait_ready(rid, timeout=5)
        prefill.send(rid)
        return decode.wait(rid, timeout=5).state.value
    except Exception as exc:
        return f"failed: {exc}"

def conn():
    return decode.receiver.peers[peer].conn

out["first"] = transfer("a")
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
highest = max(int(n) for n in os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 1, hard))
fillers = []
try:
    while True:
        fillers.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
os.close(fillers.pop())  # one descriptor left: the client's socket takes it, so accept() gets EMFILE
client = socket.create_connection(parse_address(decode.data_address), timeout=5)
deadline = time.monotonic() + 3
while time.monotonic() < deadline and not decode.counters.get("accept_errors"):
    time.sleep(0.02)
time.sleep(0.3)  # a few retries, backing off
out["accept_errors"] = decode.counters.get("accept_errors", 0)
out["data_path_accept_errors"] = decode.stats()["data_path"].get("accept_errors", 0)
client.close()
for fd in fillers:
    os.close(fd)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
out["events"] = [line for line in lines if '"accept_error"' in line]
old = conn()
decode.fence(old, "test fence after EMFILE")
def reconnected():
    link = prefill.peers[decode.engine_id].link  # the decode sees CONNECT a moment before the prefill stores it
    info = decode.receiver.peers[peer]
    return info.connected and info.epoch > old[1] and link is not None and link.alive and link.epoch == info.epoch
deadline = time.monotonic() + 10
while time.monotonic() < deadline and not reconnected():
    time.sleep(0.02)
out["reconnected"] = reconnected()
out["second"] = transfer("b")
for rid in ("a", "b"):
    try:
        decode.release(rid)
    except Exception:
        pass
time.sleep(0.2)
try:
    decode.check_accounting()
    prefill.check_accounting()
    out["accounting"] = "ok"
except Exception as exc:
    out["accounting"] = str(exc)
print(json.dumps(out), flush=True)
prefill.close()
decode.close()
"""


def test_the_accept_loop_survives_running_out_of_file_descriptors():
    """Finding 4: EMFILE from accept() ended the accept thread silently and for good, so after the
    next fence the writer could never reconnect. Now the loop backs off (10 ms doubling to 1 s),
    writes an ``accept_error`` event line, counts ``accept_errors`` and goes on."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", EMFILE_CHILD], capture_output=True, text=True, timeout=90,
                          cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["first"] == "READABLE", out
    assert out["accept_errors"] >= 1, out
    assert out["data_path_accept_errors"] >= 1, out
    assert out["events"] and "EMFILE" in out["events"][0], out
    assert out["reconnected"], out
    assert out["second"] == "READABLE", out
    assert out["accounting"] == "ok", out
    from kvxfer.engine.metrics import CONTROL_EVENTS

    assert "accept_errors" in CONTROL_EVENTS  # kvxfer_control_events_total{kind="accept_errors"}
