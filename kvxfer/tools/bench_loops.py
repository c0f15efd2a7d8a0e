"""The benchmark's two halves, run inside the engine node processes (see :mod:`kvxfer.tools.node`).

Kept beside :mod:`kvxfer.tools.node`, outside :mod:`kvxfer.tools.bench`: the bench drives nodes, a
node runs these loops, and neither the loops nor the node import the bench (no import cycle).

The decode half admits requests (with random allocation, so destination pages are scattered across
its pool), waits until each is readable, and releases it; the prefill half admits the same requests,
waits for their destinations and posts them. Each keeps up to ``concurrency`` requests in flight.
The decode half's clock, from its first admission to its last readable request, is the measurement:
every check (coverage, byte counts, checksum) has run by then. Each request's latency is measured
on the decode side from its admission to the moment it became READABLE (verified), not to when
the loop noticed it; the decode half also returns each moment itself (``readable_at``, its
``time.monotonic()``, the clock every process of the host shares), so a driver can time a request
from a moment of its own (``kvxfer bench --first-request``: from before the peering), and the moment
its ``wait()`` returned (``noticed_at``: when the consumer learns it, which is what a user's engine
acts on, a little after READABLE was stamped).
"""

from __future__ import annotations

import collections
import time
from typing import Any

from ..core.lifecycle import ReceiverState
from ..errors import KvxferError, PoolExhausted


def _hold_interpreter(ms: float) -> None:
    """Pure-Python work for ``ms`` milliseconds (the interpreter is released only at its switch interval)."""
    end = time.perf_counter() + ms / 1e3
    spins = 0
    while time.perf_counter() < end:
        spins += 1


def _admit(fn: Any, *args: Any, **kwargs: Any) -> Any:
    while True:
        try:
            return fn(*args, **kwargs)
        except PoolExhausted:
            time.sleep(0.0005)


def receive_loop(engine: Any, peer: str | None, requests: list[tuple[str, int]], concurrency: int,
                 peers: list[str] | None = None) -> dict[str, Any]:
    """``peers``: every writer of a request whose heads several prefill ranks hold (instead of ``peer``)."""
    writers = {"peers": list(peers)} if peers else {"peer": peer}
    pending: collections.deque[str] = collections.deque()
    failed = 0
    nbytes = 0
    start = None
    latencies: list[float] = []
    readable_at: list[float] = []
    noticed_at: list[float] = []

    def finish_one() -> None:
        nonlocal failed, nbytes
        rid = pending.popleft()
        req = engine.wait(rid, timeout=600)
        noticed = time.monotonic()
        if req.state is ReceiverState.READABLE:
            nbytes += engine.layout.bytes_for_pages(len(req.pages))
            if req.readable_at is not None:
                latencies.append(req.readable_at - req.created)
                readable_at.append(req.readable_at)
                noticed_at.append(noticed)
            engine.release(rid)
        else:
            failed += 1

    for rid, tokens in requests:
        while len(pending) >= concurrency:
            finish_one()
        _admit(engine.admit, rid, tokens, **writers)
        if start is None:
            start = time.perf_counter()
        pending.append(rid)
    while pending:
        finish_one()
    seconds = time.perf_counter() - (start or time.perf_counter())
    return {"seconds": seconds, "bytes": nbytes, "failed": failed, "requests": len(requests),
            "latencies": latencies, "readable_at": readable_at, "noticed_at": noticed_at}


def send_loop(engine: Any, requests: list[tuple[str, int]], concurrency: int, *, busy_ms: float = 0.0) -> dict[str, Any]:
    """The prefill half; ``posted_at``: each request's ``time.monotonic()`` as its send() was called (the
    moment the data path takes over: a driver pairs it with the decode's ``readable_at``);
    ``finished_at``: as each wait() returned, in the order waited (with one request in flight and no
    ``busy_ms``, request i's RESULT taken: its sources free). ``busy_ms``:
    after each send() the loop computes in Python for that long, holding the interpreter as a serving
    engine's scheduler does while it prepares the next batch (a sending thread waits for it meanwhile)."""
    pending: collections.deque[str] = collections.deque()
    failed = 0
    posted_at: list[float] = []
    finished_at: list[float] = []
    start = time.perf_counter()
    for rid, tokens in requests:
        while len(pending) >= concurrency:
            try:
                engine.wait(pending.popleft(), timeout=600)
                finished_at.append(time.monotonic())
            except KvxferError:
                failed += 1
        _admit(engine.admit, rid, tokens)
        engine.wait_ready(rid, timeout=600)
        posted_at.append(time.monotonic())
        engine.send(rid)
        if busy_ms:
            _hold_interpreter(busy_ms)
        pending.append(rid)
    while pending:
        try:
            engine.wait(pending.popleft(), timeout=600)
            finished_at.append(time.monotonic())
        except KvxferError:
            failed += 1
    links = [p.link for p in engine.peers.values() if p.link is not None]
    post_rate = max((link.post_rate() for link in links if hasattr(link, "post_rate")), default=0.0)
    return {"seconds": time.perf_counter() - start, "failed": failed, "post_rate": post_rate, "posted_at": posted_at,
            "finished_at": finished_at}
