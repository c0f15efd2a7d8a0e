"""A dead, hung or cut-off peer costs the others nothing, and the engines forget the dead (issue 42).

On this host's loopback with real processes: a decode frozen with SIGSTOP mid-transfer (its sockets
open, nothing read or answered: a hung host, or one a silent partition cut off) while another decode
keeps transferring through the same prefill; the mirror, a prefill frozen half-way through a request
while another prefill keeps transferring to the same decode; the decode's backoff before offering a
writer its next data connection; and a decode that outlives 100 prefill restarts. Cuts between two
network namespaces are in tests/test_partitions.py and tests/test_two_hosts.py.
"""

from __future__ import annotations

import os
import signal
import statistics
import threading
import time

import numpy as np
import pytest

from kvxfer import DecodeEngine, EngineConfig, KVLayout, PrefillEngine, ReceiverState, SenderState
from kvxfer.tools.node import NodeSpec, spawn

from .conftest import close_checked, fill_random, wait_for

pytestmark = pytest.mark.slow

ITEM = 64 << 10  # bytes per page per buffer: a request of 128 pages is 16 MiB, more than the sockets buffer
PAGES = 256
PEER_TIMEOUT = 2.0


def _layout(pages: int = PAGES) -> KVLayout:
    return KVLayout.allocate(num_buffers=2, item_len=ITEM, num_pages=pages, page_size=16)


def _config(**kw) -> EngineConfig:
    return EngineConfig(max_context=PAGES * 16, heartbeat_interval=0.2, peer_timeout=PEER_TIMEOUT, **kw)


def _one_request(prefill: PrefillEngine, decode: DecodeEngine, rid: str, pages: int = 1) -> float:
    """A request of ``pages`` pages from ``prefill`` to ``decode``, admitted on both, sent, read back by
    content and released: its seconds from the prefill's admit to READABLE."""
    started = time.monotonic()
    prefill.admit(rid, pages * 16, peer=decode.engine_id)
    decode.admit(rid, pages * 16, peer=prefill.engine_id)
    prefill.wait_ready(rid, timeout=30)
    src = prefill.source_pages(rid)
    fill_random(prefill.layout, src, seed=len(rid))
    prefill.send(rid)
    req = decode.wait(rid, timeout=30)
    took = time.monotonic() - started
    assert req.state is ReceiverState.READABLE, (rid, req.state, req.error)
    with decode.read(rid) as kv:
        assert np.array_equal(kv.buffer(0), prefill.layout.views()[0][src])
    decode.release(rid)
    prefill.wait(rid, timeout=30)
    return took


def _spawn_node(role: str):
    """An engine of ``role`` in a process of its own (so it can be frozen with SIGSTOP), laid out as
    this module's in-process engines, with this module's heartbeat and peer_timeout."""
    return spawn(NodeSpec(role=role, num_buffers=2, item_len=ITEM, num_pages=PAGES, page_size=16,
                          config={"max_context": PAGES * 16, "heartbeat_interval": 0.2, "peer_timeout": PEER_TIMEOUT}))


def test_a_frozen_decode_costs_another_decode_on_the_same_prefill_nothing():
    """Decode A freezes (SIGSTOP) with 16 MiB in flight, so the prefill's link to it blocks mid-send; the
    prefill gives up on A at peer_timeout and closes that link. Meanwhile decode B's requests through
    the same prefill take at most 1 s longer than on a quiet link (the close used to hold the prefill's
    control thread for 10 s: no META, RESULT or heartbeat for anyone)."""
    engines: list = []
    frozen = None
    try:
        prefill = PrefillEngine(_layout(), _config())
        engines.append(prefill)
        healthy = DecodeEngine(_layout(), _config())
        engines.append(healthy)
        healthy.connect(prefill.address)
        frozen = _spawn_node("decode")
        frozen.call("connect", address=prefill.address)
        quiet = [_one_request(prefill, healthy, f"quiet-{i}") for i in range(8)]
        frozen_id = frozen.engine_id
        prefill.admit("big", 128 * 16, peer=frozen_id)
        frozen.call("admit", rid="big", tokens=128 * 16, peer=prefill.engine_id)
        prefill.wait_ready("big", timeout=30)
        os.kill(frozen.pid, signal.SIGSTOP)
        cut = time.monotonic()
        prefill.send("big")  # fills the socket buffers, then the link's lane blocks in sendmsg
        during = []
        i = 0
        while time.monotonic() - cut < PEER_TIMEOUT + 4.0:
            during.append(_one_request(prefill, healthy, f"during-{i}"))
            i += 1
        big = prefill.wait("big", timeout=10)
        assert big.state is SenderState.FAILED, big.state
        gave_up = big.finished - cut
        assert PEER_TIMEOUT - 0.5 <= gave_up <= PEER_TIMEOUT + 2.0, gave_up  # peer_timeout, and not 10 s more
        assert prefill.counters["dead_peers"] >= 1
        slowest = max(during)
        assert slowest <= max(quiet) + 1.0, (f"a healthy decode's request took {slowest:.2f} s while another "
                                             f"decode was cut off (quiet: {max(quiet):.3f} s)")
        print(f"quiet median {statistics.median(quiet) * 1e3:.1f} ms max {max(quiet) * 1e3:.1f} ms; during the "
              f"cut median {statistics.median(during) * 1e3:.1f} ms max {slowest * 1e3:.1f} ms over {len(during)} "
              f"requests; the prefill gave up on the frozen decode after {gave_up:.2f} s")
    finally:
        if frozen is not None:
            try:
                os.kill(frozen.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            frozen.close()
        close_checked(engines)


class _ControlThreadWatch:
    """Samples a decode's heartbeat sequence (advanced only by its control thread, every
    ``heartbeat_interval``) every 10 ms: :attr:`longest` is the longest time it stood still, how long
    the control thread was kept from its loop."""

    def __init__(self, decode: DecodeEngine) -> None:
        self.decode = decode
        self.longest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="control-thread-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        seq, since = self.decode._hb_seq, time.monotonic()
        while not self._stop.wait(0.01):
            now = time.monotonic()
            if self.decode._hb_seq != seq:
                seq, since = self.decode._hb_seq, now
            self.longest = max(self.longest, now - since)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.longest


def test_a_frozen_prefill_costs_another_prefill_on_the_same_decode_nothing():
    """The mirror of the test above: prefill F freezes (SIGSTOP) half-way through a request of 128 pages
    to decode D, so D's landing thread for F waits in recv and D's control thread fences F's link at
    peer_timeout (TcpReceiver.fence: a shutdown, then a join of that thread). Meanwhile prefill P's
    requests to the same decode take at most 1 s longer than on a quiet link, D's control thread never
    stands still for more than a second, P never finds D silent, and once F runs again a new request
    from it lands."""
    engines: list = []
    frozen = None
    watch = None
    try:
        decode = DecodeEngine(_layout(), _config())
        engines.append(decode)
        prefill = PrefillEngine(_layout(), _config())
        engines.append(prefill)
        decode.connect(prefill.address)
        frozen = _spawn_node("prefill")
        frozen_id = decode.connect(frozen.control)
        quiet = [_one_request(prefill, decode, f"quiet-{i}") for i in range(8)]
        watch = _ControlThreadWatch(decode)
        frozen.admit(rid="big", tokens=128 * 16, peer=decode.engine_id)
        decode.admit("big", 128 * 16, peer=frozen_id)
        frozen.prepare(rid="big", timeout=30)
        landed = decode.receiver.guard.counters()["landed_bytes"]
        frozen.send(rid="big", count=64)  # half of it: D then waits in recv for the rest
        wait_for(lambda: decode.receiver.guard.counters()["landed_bytes"] - landed >= 64 * 2 * ITEM, timeout=10,
                 what="the first half landed")
        assert decode.status("big").state is ReceiverState.RESERVED, decode.status("big").state
        assert frozen.suspend()
        cut = time.monotonic()
        during = []
        i = 0
        while time.monotonic() - cut < PEER_TIMEOUT + 4.0:
            during.append(_one_request(prefill, decode, f"during-{i}"))
            i += 1
        big = decode.wait("big", timeout=10)
        gave_up = big.finished - cut if big.finished else float("nan")
        stood_still = watch.stop()
        slowest = max(during)
        print(f"quiet median {statistics.median(quiet) * 1e3:.1f} ms max {max(quiet) * 1e3:.1f} ms; with another "
              f"prefill frozen median {statistics.median(during) * 1e3:.1f} ms max {slowest * 1e3:.1f} ms over "
              f"{len(during)} requests; the decode failed the frozen prefill's request after {gave_up:.2f} s; its "
              f"control thread stood still at most {stood_still * 1e3:.0f} ms")
        assert big.state is ReceiverState.FAILED, (big.state, big.error)
        assert decode.counters["dead_peers"] >= 1 and decode.counters["fences"] >= 1, dict(decode.counters)
        assert PEER_TIMEOUT - 0.5 <= gave_up <= PEER_TIMEOUT + 2.0, gave_up
        assert prefill.counters["dead_peers"] == 0, dict(prefill.counters)
        assert slowest <= max(quiet) + 1.0, (f"a healthy prefill's request took {slowest:.2f} s while another "
                                             f"prefill was cut off (quiet: {max(quiet):.3f} s)")
        assert stood_still <= 1.0, f"the decode's control thread stood still for {stood_still:.2f} s"

        assert frozen.resume()
        resumed = time.monotonic()
        wait_for(lambda: decode.peer_connected(frozen_id, wait=0.0), timeout=10,
                 what="a new data connection from the resumed prefill")
        frozen.admit(rid="again", tokens=4 * 16, peer=decode.engine_id)
        decode.admit("again", 4 * 16, peer=frozen_id)
        frozen.prepare(rid="again", timeout=10)
        frozen.send(rid="again")
        assert decode.wait("again", timeout=10).state is ReceiverState.READABLE
        print(f"the resumed prefill's next request was READABLE {time.monotonic() - resumed:.2f} s after SIGCONT")
        frozen.accounting()
        decode.release("again")
    finally:
        if watch is not None:
            watch.stop()
        if frozen is not None:
            frozen.close()
        close_checked(engines)


def test_the_decode_offer_backoff_grows_stays_within_bounds_and_is_jittered():
    """DecodeEngine._offer_delay, the wait before offering a writer its next data connection: at once
    (REOFFER_MIN_S) after a stable one; after k short-lived ones in a row, REOFFER_MIN_S * 2**k capped
    at REOFFER_MAX_S, drawn within +-50%, so many decodes (or one decode's many prefills) cut off
    together do not dial back in step. Then on a real peering: each fence of a young connection
    counts one more short-lived connection and schedules the next offer within those bounds."""
    from kvxfer.engine import decode as decode_mod
    from kvxfer.engine.receiver import PeerInfo

    lo, hi = decode_mod.REOFFER_MIN_S, decode_mod.REOFFER_MAX_S
    decode = DecodeEngine(KVLayout.allocate(num_buffers=2, item_len=1024, num_pages=32, page_size=16),
                          EngineConfig(max_context=16 * 16, heartbeat_interval=0.2, peer_timeout=PEER_TIMEOUT))
    prefill = None
    try:
        assert decode._offer_delay(PeerInfo(engine="p", control="tcp://x", session=b"")) == lo
        medians = []
        for k in range(1, 21):
            base = min(lo * 2 ** k, hi)
            peers = [PeerInfo(engine=f"p{j}", control="tcp://x", session=b"", short_lived=k) for j in range(200)]
            delays = [decode._offer_delay(info) for info in peers]  # 200 peers at the same point
            again = [decode._offer_delay(peers[0]) for _ in range(200)]  # one peer, 200 attempts
            for drawn in (delays, again):
                assert all(0.5 * base <= d <= 1.5 * base for d in drawn), (k, base, min(drawn), max(drawn))
                assert len(set(drawn)) > 100, (k, "not jittered")
                assert min(drawn) < 0.75 * base and max(drawn) > 1.25 * base, (k, base, min(drawn), max(drawn))
            medians.append(statistics.median(delays))
        assert all(b > 1.5 * a for a, b in zip(medians[:5], medians[1:6])), medians[:6]  # doubling until the cap
        assert all(b >= 0.8 * a for a, b in zip(medians, medians[1:])), medians  # never shrinking after it
        assert max(medians) <= hi * 1.1 and medians[-1] >= hi * 0.9, medians  # capped at REOFFER_MAX_S

        # on a real peering: fence young connections in a row
        prefill = PrefillEngine(KVLayout.allocate(num_buffers=2, item_len=1024, num_pages=32, page_size=16),
                                EngineConfig(max_context=16 * 16, heartbeat_interval=0.2, peer_timeout=PEER_TIMEOUT))
        peer = decode.connect(prefill.address)
        scheduled = []
        for k in range(1, 5):
            wait_for(lambda: decode.peer_connected(peer, wait=0.0), timeout=10, what=f"connection {k} up")
            with decode.lock:
                conn = decode.receiver.peers[peer].conn
                offered = decode.receiver.peers[peer].offered
            before = time.monotonic()
            assert decode.fence(conn, f"test: young connection {k}")
            after = time.monotonic()
            with decode.lock:
                info = decode.receiver.peers[peer]
                assert info.short_lived == k, (k, info.short_lived)
                at, offered_at, offered_now = info.reoffer_at, info.offered_at, info.offered
            # the fence drew delay d at some moment t within [before, after]: the offer is due at t + d
            base = min(lo * 2 ** k, hi)
            if at is None:  # this thread was held up past it and the control thread has offered already
                assert offered_now == offered + 1 and offered_at - before >= 0.5 * base, (k, base, offered_at - before)
                at = offered_at
            else:
                assert at - before >= 0.5 * base and at - after <= 1.5 * base, (k, base, at - before, at - after)
            scheduled.append(round(at - before, 3))
        print(f"offers after 1..4 young connections scheduled {scheduled} s after their fence")
        wait_for(lambda: decode.peer_connected(peer, wait=0.0), timeout=10, what="the last connection up")
        _one_request(prefill, decode, "after-backoff")
    finally:
        if prefill is not None:
            prefill.close()
        decode.close()


def _descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("how", ["expiry", "forget"])
def test_a_decode_forgets_dead_prefills_and_its_descriptors_stay_flat_over_100_restarts(how):
    """Each prefill restart is a new engine at a new address: the decode forgets the old one (by
    peer_expiry, or by DecodeEngine.forget), closing its control socket, so 100 restarts leave the
    decode's peers, sockets and descriptors where one left them."""
    small = dict(max_context=16 * 16, heartbeat_interval=0.1, peer_timeout=0.5, peer_expiry=0.5)
    decode = DecodeEngine(KVLayout.allocate(num_buffers=2, item_len=1024, num_pages=32, page_size=16),
                          EngineConfig(**small))
    try:
        baseline = None
        for i in range(100):
            prefill = PrefillEngine(KVLayout.allocate(num_buffers=2, item_len=1024, num_pages=16, page_size=16),
                                    EngineConfig(**small))
            try:
                peer = decode.connect(prefill.address, timeout=10)
                if i % 10 == 0:
                    _one_request(prefill, decode, f"r{i}")
            finally:
                prefill.close()
            if how == "forget":
                assert decode.forget(peer, "restarted") is True
                assert decode.forget(peer) is False
            else:
                wait_for(lambda peer=peer: peer not in decode.receiver.peers, timeout=10,
                         what="the dead prefill forgotten by peer_expiry")
            wait_for(lambda: decode.control.open_sockets() == 0, timeout=10, what="its control socket closed")
            if i == 4:
                baseline = _descriptors()
        assert not decode.receiver.peers and not decode._pending_hello
        assert decode.counters["peers_forgotten"] == 100
        assert _descriptors() <= baseline + 4, (baseline, _descriptors())
        decode.check_accounting()
    finally:
        decode.close()
