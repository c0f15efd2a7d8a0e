"""Baseline and peer processes for ``kvxfer bench``: a raw socket pair, a native stream, Mooncake TCP, NIXL UCX tcp.

Each runs as two processes, a *target* that owns the destination pool and an *initiator* that
owns the source pool and moves ``pages`` pages of ``page_bytes`` from random source pages to random
destination pages once per round. Both pools are the same size as kvxfer's decode pool in the same
run (``pool_pages``), so every contestant has the same working set. The driver talks to them over
stdin/stdout, one JSON object per line:

* the target prints ``{"ready": ..., <how to reach it>}`` and then waits for ``quit``;
* the initiator is started with the target's line, prints ``{"ready": true}``, then for every
  ``go`` line moves the pages and prints ``{"seconds": S}``.

``native-stream`` is the ceiling of kvxfer's own tcp data path: the same C calls kvxfer's tcp transport
makes (gather ``sendmsg`` of 1 MiB groups, ``readv`` of 64 KiB into scattered pages) with no protocol,
and with checks on the same Adler-32 of every page on both sides (the sender right after each group
went to the kernel, the receiver right after each group landed) and a comparison of the two; it runs
once per checks setting, so its own checks on/off ratio is what summing costs this machine without
anything else of kvxfer's.

Run: ``python -m kvxfer.tools.bench.peers PEER ROLE PAGES PAGE_BYTES POOL_PAGES [OPTIONS_JSON]``
(a target's options: ``{"checks": "on"}`` for native-stream; an initiator's: the target's ready line).
Mooncake (``mooncake-transfer-engine-non-cuda``) and NIXL (``nixl-cu12 --no-deps``, with
``UCX_TLS=tcp UCX_NET_DEVICES=lo`` and its initiator progress thread off, the best setting
measured here) are optional; a missing one exits with a one-line reason (``unavailable``: what to
install), which the bench reports as a skipped contestant. A peer process never
outlives the bench that started it (:func:`kvxfer.tools.procs.adopt`).
"""

from __future__ import annotations

import base64
import json
import socket
import struct
import sys
import time
from typing import Any

import numpy as np

from .. import procs

HEADER = struct.Struct("<IQ")
# NIXL's target polls its notifications this often: with no pause the poller competed with NIXL's own
# progress thread for two cores, and notifications arrived later (one-page p50 0.27-0.36 ms against
# 0.24-0.29 ms with this pause, two runs each)
POLL_PAUSE = 50e-6
MOONCAKE_BATCH = 1024


def _pool(pool_pages: int, page_bytes: int) -> np.ndarray:
    pool = np.zeros((pool_pages, page_bytes), dtype=np.uint8)
    pool.reshape(-1)[::4096] = 1  # pre-fault
    return pool


def _say(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def _commands() -> Any:
    for line in sys.stdin:
        line = line.strip()
        if line == "quit":
            return
        if line:
            yield line


def _picks(rng: np.random.Generator, pool_pages: int, pages: int) -> np.ndarray:
    """``pages`` random pool pages (with wrap-around when the pool is smaller than the round)."""
    reps = -(-pages // pool_pages)
    return np.concatenate([rng.permutation(pool_pages) for _ in range(reps)])[:pages]


# raw sockets -------------------------------------------------------------------------------------


def raw_target(pages: int, page_bytes: int, pool_pages: int) -> None:
    pool = _pool(pool_pages, page_bytes)
    server = socket.create_server(("127.0.0.1", 0))
    _say({"ready": True, "port": server.getsockname()[1]})
    conn, _ = server.accept()
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    header = memoryview(bytearray(HEADER.size))
    rng = np.random.default_rng(1)

    def fill(view: memoryview) -> None:
        got = 0
        while got < len(view):
            n = conn.recv_into(view[got:])
            if not n:
                raise ConnectionError("initiator closed")
            got += n

    try:
        while True:
            for index in _picks(rng, pool_pages, pages).tolist():
                fill(header)
                fill(memoryview(pool[index]))
            conn.sendall(b"k")
    except ConnectionError:
        return


def raw_initiator(pages: int, page_bytes: int, pool_pages: int, target: dict[str, Any]) -> None:
    pool = _pool(pool_pages, page_bytes)
    sock = socket.create_connection(("127.0.0.1", target["port"]))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    rng = np.random.default_rng(2)
    _say({"ready": True})
    for _ in _commands():
        start = time.perf_counter()
        for i, index in enumerate(_picks(rng, pool_pages, pages).tolist()):
            sock.sendmsg([HEADER.pack(i, index), memoryview(pool[index])])
        sock.recv(1)  # the target has every byte
        _say({"seconds": time.perf_counter() - start})
    sock.close()


# native stream -----------------------------------------------------------------------------------

ADLER32 = 0  # the native module's algorithm number for Adler-32, its initial value 1


def _native_lib() -> Any:
    """kvxfer's C extension with zlib-ng's checksums loaded, or exit saying what is missing."""
    from ...core import native

    if not native.provides("send_runs", "send_runs_summed", "recv_runs", "recv_runs_summed") \
            or not native.checksums_in_c:
        _say({"error": f"native-stream needs kvxfer's C extension with zlib-ng: {native.describe()}",
              "unavailable": f"not available ({native.describe()})"})
        sys.exit(3)
    return native.lib


def _page_runs(pool: np.ndarray, picks: np.ndarray) -> tuple[bytes, bytes]:
    """Addresses and lengths (uint64 bytes) of the picked pages of ``pool``, in pick order."""
    page_bytes = pool.shape[1]
    addresses = np.uint64(pool.ctypes.data) + picks.astype(np.uint64) * np.uint64(page_bytes)
    return addresses.tobytes(), np.full(len(picks), page_bytes, dtype=np.uint64).tobytes()


def native_target(pages: int, page_bytes: int, pool_pages: int, options: dict[str, Any] | None = None) -> None:
    """Lands each round's pages at random pool pages with ``recv_runs`` (checks off) or
    ``recv_runs_summed`` (on; then reads the initiator's sums and compares), answers ``k`` (or ``x``:
    a page's sums differ) when the round is in."""
    from ...transport.tcp import recv_exact

    lib = _native_lib()
    checks = (options or {}).get("checks", "off")
    checked = checks == "on"
    pool = _pool(pool_pages, page_bytes)
    server = socket.create_server(("127.0.0.1", 0))
    _say({"ready": True, "port": server.getsockname()[1], "checks": checks})
    conn, _ = server.accept()
    rng = np.random.default_rng(1)
    sent_sums = bytearray(4 * pages)
    try:
        while True:
            addresses, lengths = _page_runs(pool, _picks(rng, pool_pages, pages))
            if not checked:
                lib.recv_runs(conn.fileno(), addresses, lengths)
                conn.sendall(b"k")
                continue
            sums = lib.recv_runs_summed(conn.fileno(), addresses, lengths, lengths, ADLER32, 1,
                                        lib.RECV_GROUP)
            recv_exact(conn, memoryview(sent_sums))
            conn.sendall(b"k" if sums == bytes(sent_sums) else b"x")
    except ConnectionError:
        return


def native_initiator(pages: int, page_bytes: int, pool_pages: int, target: dict[str, Any]) -> None:
    """Sends each round's pages from random pool pages with ``send_runs`` (checks off) or
    ``send_runs_summed`` followed by the sums (on), then waits for the target's answer."""
    lib = _native_lib()
    checked = target.get("checks") == "on"
    pool = _pool(pool_pages, page_bytes)
    pool[:] = (np.arange(page_bytes) % 251).astype(np.uint8)  # not zeros, and every page its own index:
    pool[:, :8] = np.arange(pool_pages, dtype=np.uint64).view(np.uint8).reshape(pool_pages, 8)  # sums differ
    sock = socket.create_connection(("127.0.0.1", target["port"]))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rng = np.random.default_rng(2)
    _say({"ready": True})
    for _ in _commands():
        addresses, lengths = _page_runs(pool, _picks(rng, pool_pages, pages))
        start = time.perf_counter()
        if checked:
            sums = lib.send_runs_summed(sock.fileno(), b"", addresses, lengths, lengths, ADLER32, 1, lib.SEND_GROUP)
            sock.sendall(sums)
        else:
            lib.send_runs(sock.fileno(), b"", addresses, lengths)
        answer = sock.recv(1)
        seconds = time.perf_counter() - start
        if answer != b"k":
            _say({"error": "native-stream: the target's page checksums differ from the sender's"
                  if answer == b"x" else "native-stream: the target closed the connection"})
            sys.exit(4)
        _say({"seconds": seconds})
    sock.close()


# Mooncake ------------------------------------------------------------------------------------------


def _mooncake() -> Any:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        _say({"error": f"mooncake not installed: {exc}",
              "unavailable": "not installed (pip install mooncake-transfer-engine-non-cuda)"})
        sys.exit(3)
    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        _say({"error": "mooncake TransferEngine.initialize failed"})
        sys.exit(3)
    return engine


def mooncake_target(pages: int, page_bytes: int, pool_pages: int) -> None:
    engine = _mooncake()
    pool = _pool(pool_pages, page_bytes)
    engine.register_memory(pool.ctypes.data, pool.nbytes)
    _say({"ready": True, "session": f"127.0.0.1:{engine.get_rpc_port()}", "base": pool.ctypes.data})
    for _ in _commands():
        pass


def mooncake_initiator(pages: int, page_bytes: int, pool_pages: int, target: dict[str, Any]) -> None:
    """Each round moves the pages as requests of ``request_pages``, each one or more
    ``batch_transfer_sync_write`` calls of at most MOONCAKE_BATCH pages (synchronous: one request at a
    time), and reports every request's latency beside the round's seconds."""
    engine = _mooncake()
    pool = _pool(pool_pages, page_bytes)
    engine.register_memory(pool.ctypes.data, pool.nbytes)
    rng = np.random.default_rng(2)
    per_request = max(1, int(target.get("request_pages", pages)))
    _say({"ready": True})
    for _ in _commands():
        src = pool.ctypes.data + _picks(rng, pool_pages, pages).astype(np.int64) * page_bytes
        dst = target["base"] + _picks(rng, pool_pages, pages).astype(np.int64) * page_bytes
        lengths = [page_bytes] * MOONCAKE_BATCH
        latencies: list[float] = []
        start = time.perf_counter()
        for first in range(0, pages, per_request):
            began = time.perf_counter()
            for lo in range(first, min(pages, first + per_request), MOONCAKE_BATCH):
                hi = min(lo + MOONCAKE_BATCH, first + per_request, pages)
                s, d = src[lo:hi].tolist(), dst[lo:hi].tolist()
                rc = engine.batch_transfer_sync_write(target["session"], s, d, lengths[: len(s)])
                if rc != 0:
                    _say({"error": f"batch_transfer_sync_write returned {rc}"})
                    sys.exit(4)
            latencies.append(time.perf_counter() - began)
        _say({"seconds": time.perf_counter() - start, "latencies": latencies})


# NIXL -------------------------------------------------------------------------------------------


def _nixl(name: str, *, progress_thread: bool) -> Any:
    try:
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        _say({"error": f"NIXL not installed: {exc}", "unavailable": "not installed (pip install --no-deps nixl-cu12)"})
        sys.exit(3)
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"]))


def nixl_target(pages: int, page_bytes: int, pool_pages: int) -> None:
    """The destination pool, and the decode's side of a NIXL completion: a thread polls
    ``get_new_notifs`` every :data:`POLL_PAUSE` (SGLang's NIXL decode polls them from its event loop)
    and stamps each notification's arrival on the monotonic clock the initiator shares. ``arrivals N``
    waits (up to 10 s) until N have arrived since the last report and prints them,
    ``{"arrivals": {notif: seconds}}``."""
    import threading

    agent = _nixl("kvxfer-bench-target", progress_thread=True)
    pool = _pool(pool_pages, page_bytes)
    agent.register_memory([(pool.ctypes.data, pool.nbytes, 0, "")], "DRAM")
    meta = base64.b64encode(agent.get_agent_metadata()).decode()
    arrivals: dict[str, float] = {}
    cond = threading.Condition()
    quitting = threading.Event()

    def poll() -> None:
        while not quitting.is_set():
            notifs = agent.get_new_notifs()
            if not notifs:
                time.sleep(POLL_PAUSE)
                continue
            now = time.perf_counter()
            with cond:
                for messages in notifs.values():
                    for message in messages:
                        arrivals[message.decode(errors="replace")] = now
                cond.notify_all()

    poller = threading.Thread(target=poll, name="nixl-notifs", daemon=True)
    poller.start()
    _say({"ready": True, "metadata": meta, "base": pool.ctypes.data})
    for line in _commands():
        if line.startswith("arrivals"):
            wanted = int(line.split()[1])
            with cond:
                cond.wait_for(lambda n=wanted: len(arrivals) >= n, timeout=10.0)
                report = dict(arrivals)
                arrivals.clear()
            _say({"arrivals": report})
    quitting.set()
    poller.join(timeout=5.0)


def nixl_initiator(pages: int, page_bytes: int, pool_pages: int, target: dict[str, Any]) -> None:
    """Each round moves the pages as requests of ``request_pages`` (kvxfer's ``--request-bytes``), up
    to ``concurrency`` in flight, as kvxfer's bench loops do, and reports every request's latency
    (from its ``initialize_xfer`` to DONE) beside the round's seconds, and when each began, by the
    notification it carries (``began``), which the target stamps as it arrives."""
    agent = _nixl("kvxfer-bench-initiator", progress_thread=False)
    pool = _pool(pool_pages, page_bytes)
    agent.register_memory([(pool.ctypes.data, pool.nbytes, 0, "")], "DRAM")
    remote = agent.add_remote_agent(base64.b64decode(target["metadata"]))
    rng = np.random.default_rng(2)
    per_request = max(1, int(target.get("request_pages", pages)))
    concurrency = max(1, int(target.get("concurrency", 1)))
    _say({"ready": True})
    for round_no, _ in enumerate(_commands()):
        src = np.zeros((pages, 3), dtype=np.uint64)
        dst = np.zeros((pages, 3), dtype=np.uint64)
        src[:, 0] = pool.ctypes.data + _picks(rng, pool_pages, pages).astype(np.uint64) * page_bytes
        dst[:, 0] = target["base"] + _picks(rng, pool_pages, pages).astype(np.uint64) * page_bytes
        src[:, 1] = dst[:, 1] = page_bytes
        todo = list(range(0, pages, per_request))
        in_flight: list[tuple[Any, float]] = []
        latencies: list[float] = []
        began_at: dict[str, float] = {}
        start = time.perf_counter()
        while todo or in_flight:
            while todo and len(in_flight) < concurrency:
                lo = todo.pop(0)
                notif = f"r{round_no}-{lo}"
                began = began_at[notif] = time.perf_counter()
                handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs(src[lo : lo + per_request], "DRAM"),
                                               agent.get_xfer_descs(dst[lo : lo + per_request], "DRAM"),
                                               remote, notif.encode())
                state = agent.transfer(handle)
                if state not in ("PROC", "DONE"):
                    _say({"error": f"NIXL transfer ended in state {state}"})
                    sys.exit(4)
                in_flight.append((handle, began))
            handle, began = in_flight[0]  # requests complete in order on one connection
            state = agent.check_xfer_state(handle)
            if state == "PROC":
                continue
            if state != "DONE":
                _say({"error": f"NIXL transfer ended in state {state}"})
                sys.exit(4)
            latencies.append(time.perf_counter() - began)
            agent.release_xfer_handle(handle)
            in_flight.pop(0)
        _say({"seconds": time.perf_counter() - start, "latencies": latencies, "began": began_at})


ROLES = {
    ("raw-socket", "target"): raw_target,
    ("raw-socket", "initiator"): raw_initiator,
    ("native-stream", "target"): native_target,
    ("native-stream", "initiator"): native_initiator,
    ("mooncake-tcp", "target"): mooncake_target,
    ("mooncake-tcp", "initiator"): mooncake_initiator,
    ("nixl-ucx-tcp", "target"): nixl_target,
    ("nixl-ucx-tcp", "initiator"): nixl_initiator,
}

if __name__ == "__main__":
    procs.adopt()  # the bench gone, SIGTERM (default action: exit) and, failing that, _exit
    peer, role = sys.argv[1], sys.argv[2]
    pages, page_bytes, pool_pages = map(int, sys.argv[3:6])
    fn = ROLES[(peer, role)]
    fn(pages, page_bytes, pool_pages, *(json.loads(arg) for arg in sys.argv[6:7]))
