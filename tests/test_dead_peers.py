"""A dead, hung or cut-off peer costs the others nothing, and the engines forget the dead (issue 42).

On this host's loopback with real processes: a decode frozen with SIGSTOP mid-transfer (its sockets
open, nothing read or answered: a hung host, or one a silent partition cut off) while another decode
keeps transferring through the same prefill; and a decode that outlives 100 prefill restarts.
Cuts between two network namespaces are in tests/test_two_hosts.py.
"""

from __future__ import annotations

import os
import signal
import statistics
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
        spec = NodeSpec(role="decode", num_buffers=2, item_len=ITEM, num_pages=PAGES, page_size=16,
                        config={"max_context": PAGES * 16, "heartbeat_interval": 0.2, "peer_timeout": PEER_TIMEOUT})
        frozen = spawn(spec)
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
