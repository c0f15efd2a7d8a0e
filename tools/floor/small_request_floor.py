"""The floor of a small request in Python: ``small_request_floor.c``'s shape with Python threads.

Two processes over loopback tcp, exactly the C harness's messages: the "prefill" sends a header, the
run table, the pages (their Adler-32 taken before the send) and a DONE with the sum in one
``sendmsg``, waits for RESULT, sleeps 200 us; the "decode"'s receiving thread reads each piece into
place (``recv_into``), sums what landed with zlib, compares it with DONE, wakes a consumer thread
through a ``threading.Condition`` and sends RESULT. Latency: the prefill's ``time.monotonic()``
before its send to the consumer's after its wake. What this leaves out against kvxfer is kvxfer's
own per-request work (admission, control plane, write guard, ledger, verification, state machines)
and its thread hand-offs; the C harness shows what the interpreter itself costs.

    python3 tools/floor/small_request_floor.py REQUESTS PINNED PAGES PAGE_BYTES
"""

from __future__ import annotations

import ctypes
import mmap
import os
import random
import signal
import socket
import struct
import sys
import threading
import time
import zlib

import numpy as np

PR_SET_PDEATHSIG = 1

REGION = 16 << 20
HEADER = struct.Struct("<IIII")
DONE = struct.Struct("<IIQ")


def read_exact(sock: socket.socket, view: memoryview) -> None:
    while len(view):
        got = sock.recv_into(view)
        if not got:
            raise EOFError("the other side closed")
        view = view[got:]


def decode(listener: socket.socket, region: memoryview, stamps: np.ndarray, requests: int, page_bytes: int) -> None:
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    changed = threading.Condition()
    landed = [0]

    def consumer() -> None:
        for i in range(requests):
            with changed:
                while landed[0] <= i:
                    changed.wait()
            stamps[2 * i + 1] = time.monotonic()

    thread = threading.Thread(target=consumer)
    thread.start()
    header, done = bytearray(HEADER.size), bytearray(DONE.size)
    for i in range(requests):
        read_exact(conn, memoryview(header))
        _, _, gen, pages = HEADER.unpack(header)
        table = bytearray(8 * pages)
        read_exact(conn, memoryview(table))
        total = zlib.adler32(b"")
        for offset in np.frombuffer(table, dtype=np.uint64).tolist():
            page = region[offset : offset + page_bytes]
            read_exact(conn, page)
            total = zlib.adler32(page, total)
        read_exact(conn, memoryview(done))
        done_gen, done_sum, _ = DONE.unpack(done)
        if done_gen != gen or done_sum != total:
            raise SystemExit(f"request {i}: DONE disagrees with what landed")
        with changed:
            landed[0] += 1
            changed.notify()
        conn.sendall(struct.pack("<I", gen))
    thread.join()


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    requests, pinned, pages, page_bytes = (int(a) for a in argv)
    stamps = np.frombuffer(mmap.mmap(-1, 16 * requests), dtype=np.float64)  # shared with the child
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    region = memoryview(bytearray(b"\x07" * REGION))
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        code = 0
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))  # dies with the prefill
            if os.getppid() != parent:
                raise SystemExit("the prefill is gone")
            if pinned:
                os.sched_setaffinity(0, {1})
            decode(listener, region, stamps, requests, page_bytes)
        except BaseException as exc:  # report, and never return into the parent's code
            print(exc, file=sys.stderr)
            code = 1
        os._exit(code)
    if pinned:
        os.sched_setaffinity(0, {0})
    sock = socket.create_connection(listener.getsockname())
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rng = random.Random(1)
    result = bytearray(4)
    for i in range(requests):
        stamps[2 * i] = time.monotonic()
        offsets = [rng.randrange(REGION // page_bytes) * page_bytes for _ in range(pages)]
        total = zlib.adler32(b"")
        for offset in offsets:
            total = zlib.adler32(region[offset : offset + page_bytes], total)
        sock.sendmsg([HEADER.pack(1, 3, i, pages), np.array(offsets, dtype=np.uint64).tobytes(),
                      *(region[o : o + page_bytes] for o in offsets), DONE.pack(i, total, page_bytes * pages)])
        read_exact(sock, memoryview(result))
        time.sleep(0.0002)
    sock.close()
    _, status = os.waitpid(child, 0)
    if status:
        return 1
    latency = np.sort(stamps[1::2] - stamps[0::2]) * 1e6
    print(f"python wake pinned {pinned}, {pages} page(s) of {page_bytes} B: p50 {latency[requests // 2]:.1f} us "
          f"p99 {latency[requests * 99 // 100]:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
