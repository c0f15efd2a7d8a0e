"""What only the verbs transport has, on a real verbs device (soft-RoCE in the VM): the final
immediate, the write log, a late write on a fenced queue pair, the post rate. The lifecycle and
hostile-peer suites run over verbs too (they are parametrized over every registered transport).

These run inside ``tools/softroce/run`` (``.ci/run`` does that); elsewhere they skip with the reason.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvxfer import ReceiverState, SenderState
from kvxfer.core.ledger import PageState
from kvxfer.errors import NotReadable
from kvxfer.transport import verbs
from kvxfer.wire import messages as m

from .conftest import PAGE_TOKENS, verbs_skip_reason, wait_for

R, S = ReceiverState, SenderState
_why = verbs_skip_reason()
pytestmark = [pytest.mark.verbs, pytest.mark.skipif(_why is not None, reason=_why or "")]

VERBS = {"transport": "verbs", "peer_timeout": 60.0}


def test_transfer_over_verbs_is_exact_and_counts_the_final_immediate(engines):
    pair = engines(**VERBS)
    src = pair.transfer("v1", 20 * PAGE_TOKENS, seed=1)
    req = pair.decode.wait("v1", timeout=60)
    assert req.state is R.READABLE, req.error
    pair.expect_content("v1", src)
    assert pair.prefill.wait("v1", timeout=60).state is S.SUCCEEDED
    pair.decode.release("v1")
    assert pair.decode.pool.ledger.free_count == pair.decode.layout.num_pages


def test_partial_transfer_never_readable_over_verbs(engines):
    pair = engines(**VERBS)
    pair.prefill.admit("p", 8 * PAGE_TOKENS)
    dreq = pair.decode.admit("p", 8 * PAGE_TOKENS, peer=pair.peer)
    pair.prefill.wait_ready("p", timeout=60)
    pair.prefill.send("p", count=1)
    req = pair.prefill.status("p")
    wait_for(lambda: req.quiescent, timeout=30, what="first chunk completed")
    log = b"".join(b.log_bytes() for b in req.batches)
    claim = m.Done(rid="p", gen=dreq.gen, bytes=pair.prefill.layout.bytes_for_pages(1), pages=1,
                   checksum=0, algo="adler32", runs=log)
    pair.prefill._send_to_peer(pair.decode.engine_id, claim)
    failed = pair.decode.wait("p", timeout=60)
    assert failed.state is R.FAILED
    text = str(failed.error)
    assert "7 of 8 reserved pages were not written" in text and "final write" in text
    pair.prefill.abort("p")


def test_stale_generation_ack_cannot_release_a_newer_owner_over_verbs(engines):
    pair = engines(**VERBS)
    pair.transfer("room", 3 * PAGE_TOKENS)
    pair.decode.wait("room", timeout=60)
    pair.decode.release("room")
    old_gen = pair.decode.status("room").gen
    pair.prefill.wait("room", timeout=60)
    pair.prefill.admit("room", 3 * PAGE_TOKENS)
    new = pair.decode.admit("room", 3 * PAGE_TOKENS, peer=pair.peer)
    wait_for(lambda: pair.prefill.status("room").state is S.READY, timeout=30, what="READY")
    pair.prefill.sender.on_abort = lambda peer, msg: None  # the writer never answers the abort
    pair.decode.abort("room")
    pair.prefill._send_to_peer(pair.decode.engine_id, m.DrainAck(rid="room", gen=old_gen, posted=0, completed=0))
    time.sleep(1.0)
    assert pair.decode.status("room").state is R.QUARANTINED
    assert (pair.decode.pool.ledger.state[new.pages] == PageState.QUARANTINED).all()
    pair.prefill._send_to_peer(pair.decode.engine_id, m.DrainAck(rid="room", gen=new.gen, posted=0, completed=0))
    assert pair.decode.wait("room", timeout=60).state is R.ABORTED


def test_late_write_after_fence_fails_on_the_wire_and_never_lands_in_reused_pages(engines):
    """Abort with a writer that never answers; the decode fences (QP to ERR) after the drain timeout and
    reuses the pages for a new request over a new queue pair. A write the old writer then posts on its
    old queue pair toward those pages fails on the wire, and the new owner's bytes are intact."""
    pair = engines(decode_config={"drain_timeout": 1.0}, **VERBS)
    pair.prefill.admit("a", 6 * PAGE_TOKENS)
    areq = pair.decode.admit("a", 6 * PAGE_TOKENS, peer=pair.peer)
    pair.prefill.wait_ready("a", timeout=60)
    old_link = pair.link
    really_close = old_link.close
    old_link.close = lambda flush=True: None  # the old writer keeps its queue pair alive ...
    pair.prefill.sender.on_abort = lambda peer, msg: None  # ... and never answers the abort
    try:
        pair.decode.abort("a")
        assert pair.decode.wait("a", timeout=30).state is R.ABORTED  # fenced after the drain timeout
        assert pair.decode.counters["fences"] == 1
        wait_for(lambda: pair.link is not None and pair.link is not old_link
                 and pair.decode.receiver.peers[pair.peer].conn is not None, timeout=30, what="a new queue pair")
        src = pair.transfer("b", 6 * PAGE_TOKENS, seed=8)
        breq = pair.decode.wait("b", timeout=60)
        assert breq.state is R.READABLE
        assert set(breq.pages.tolist()) == set(areq.pages.tolist()), "LIFO reuses the fenced pages"
        item = int(pair.prefill.layout.item_lens[0])
        before = pair.decode.layout.views()[0][breq.pages].copy()
        spare = int(np.flatnonzero(pair.prefill.pool.ledger.state == 0)[-1])  # a source page no request uses
        pair.prefill.layout.views()[0][spare] = 0xEE
        dst = pair.decode.layout.buffers[0].address + int(breq.pages[0]) * item
        endpoint = old_link.endpoint
        src_addr = pair.prefill.layout.buffers[0].address + spare * item
        endpoint.post_writes(10_000_000, np.array([src_addr], dtype=np.uint64),
                             np.array([item], dtype=np.uint64), old_link.device.buffer_lkey[:1],
                             np.array([dst], dtype=np.uint64), old_link._remote_rkey[:1], -1)
        statuses = _poll_statuses(endpoint, 5.0)  # real HCAs retry and fail; rxe stays silent
        assert verbs.WC_SUCCESS not in statuses, f"the late write completed: {statuses}"
        assert np.array_equal(pair.decode.layout.views()[0][breq.pages], before)
        endpoint.to_error()  # the writer acts on the fence at last: its queue pair flushes
        statuses += _poll_statuses(endpoint, 20.0)
        assert statuses and verbs.WC_SUCCESS not in statuses, f"no failure reported on the wire: {statuses}"
        assert np.array_equal(pair.decode.layout.views()[0][breq.pages], before)
        pair.expect_content("b", src)
    finally:
        del old_link.close
        really_close(flush=False)


def _poll_statuses(endpoint, seconds: float) -> list[int]:
    statuses: list[int] = []
    deadline = time.monotonic() + seconds
    while not statuses and time.monotonic() < deadline:
        statuses = [int(r["status"]) for r in endpoint.poll()]
        time.sleep(0.01)
    return statuses


def test_post_rate_is_measured(engines):
    pair = engines(**VERBS)
    pair.transfer("r", 30 * PAGE_TOKENS)
    pair.decode.wait("r", timeout=60)
    link = pair.link
    assert link.wrs_posted > 0 and link.post_rate() > 0


# hostile peers over verbs (the control plane is the same CURVE-authenticated one as tcp's) ----------


@pytest.mark.parametrize("step", ["after_meta", "mid_write", "in_quarantine"])
def test_writer_vanishing_over_verbs_loses_and_exposes_nothing(engines, step):
    pair = engines(transport="verbs", peer_timeout=2.0)
    pair.prefill.admit("r", 8 * PAGE_TOKENS)
    pair.decode.admit("r", 8 * PAGE_TOKENS, peer=pair.peer)
    pair.prefill.wait_ready("r", timeout=60)
    if step in ("mid_write", "in_quarantine"):
        pair.faults.pause()
        pair.prefill.send("r", count=4)
    if step == "in_quarantine":
        pair.decode.abort("r")
        assert pair.decode.status("r").state is R.QUARANTINED
    pair.prefill.close()  # its queue pair is destroyed and its heartbeats stop
    final = pair.decode.wait("r", timeout=60)
    assert final.state in (R.FAILED, R.ABORTED)
    with pytest.raises(NotReadable):
        pair.decode.read("r")
    wait_for(lambda: pair.decode.pool.ledger.free_count == pair.decode.layout.num_pages, timeout=30,
             what="pages freed")
