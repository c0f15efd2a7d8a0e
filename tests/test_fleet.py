"""Issue 25: a fleet, not a pair. One prefill against many decodes: bounded cost per peer, refusals past
``max_peers`` that come at once and break nobody, storms of peering and restarts, peers forgotten as
soon as they are gone, and a decode the prefill forgot peering again by itself.

The fleet runs are the real tool (``kvxfer fleet``, one prefill process and decode worker processes)
started the way a user starts it; the rest use real engines and real node processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kvxfer import DecodeEngine, EngineConfig, PrefillEngine
from kvxfer.core.lifecycle import ReceiverState as R
from kvxfer.tools import oracle
from kvxfer.tools.fleet import process_load
from kvxfer.tools.node import NodeSpec, spawn

from .conftest import BUFFERS, ITEM, PAGE_TOKENS, close_checked, fill_random, make_layout, wait_for


def _fleet(tmp_path, *args: str, timeout: float = 300) -> tuple[int, dict, str]:
    out = tmp_path / "fleet.json"
    proc = subprocess.run([sys.executable, "-m", "kvxfer", "fleet", *args, "--json", str(out)],
                          capture_output=True, text=True, timeout=timeout)
    report = json.loads(out.read_text()) if out.exists() else {}
    return proc.returncode, report, proc.stdout + proc.stderr


def test_past_max_peers_the_extra_decodes_are_refused_at_once_and_the_admitted_ones_all_transfer(tmp_path):
    """Reproduced first: 40 decodes against max_peers 30 left 8 refused decodes waiting 10 s for "no
    answer" (one-off answers capped at 32 in flight), and after every decode restarted at once none
    peered (the dead ones held the table until peer_timeout)."""
    rc, report, text = _fleet(tmp_path, "--decodes", "40", "--per-process", "20", "--max-peers", "30", "--restart")
    print(text)
    assert rc == 0, text
    for phase in ("storm", "storm_after_restart"):
        r = report[phase]
        assert (r["peered"], r["refused"], r["refusals_unanswered"]) == (30, 10, 0), r
        assert r["slowest_refusal_s"] < 5.0, r  # an answer, not a connect() timeout (10 s before)
        assert r["transfers_correct"] == r["transfers"] == 30, r
        assert "refused" in r["refusal_sample"], r
    # no thread per peer: 30 peers add the few connecting threads at most, not 30
    assert report["storm"]["prefill_with_peers"]["threads"] - report["prefill_idle"]["threads"] <= 6, report
    # the decodes gone, their descriptors are released without waiting for peer_expiry (300 s)
    assert report["prefill_after"]["fds"] <= report["prefill_idle"]["fds"] + 4, report
    assert report["forgotten_after_s"] < 8.0, report
    assert report["prefill_pool_free"][0] == report["prefill_pool_free"][1]


def test_a_storm_of_512_decodes_and_their_restart_all_peer_and_transfer_correct_bytes(tmp_path):
    rc, report, text = _fleet(tmp_path, "--decodes", "512", "--per-process", "64", "--max-peers", "600",
                              "--restart", timeout=600)
    print(text)
    assert rc == 0, text
    # Every connect is answered well inside connect_timeout (30 s): the bound catches connects that wait out
    # a timeout or queue behind each other, not the speed of two shared cores. CI's two cores took 6.5-12.2 s
    # for either storm (two runs: 6.5 then 11.3 s, 12.2 then 7.3 s; both failed a 10 s bound).
    for phase in ("storm", "storm_after_restart"):
        r = report[phase]
        assert r["peered"] == 512 and r["refused"] == 0, r
        assert r["transfers_correct"] == 512, r
        assert r["all_answered_s"] < 20.0, r
    assert report["storm"]["prefill_with_peers"]["threads"] - report["prefill_idle"]["threads"] <= 6, report


def _decode_node(prefill: PrefillEngine, **config) -> object:
    spec = NodeSpec(role="decode", num_buffers=BUFFERS, item_len=ITEM, num_pages=64, page_size=PAGE_TOKENS,
                    config={"max_context": 16 * PAGE_TOKENS, "heartbeat_interval": 0.2, **config})
    node = spawn(spec)
    node.connect(address=prefill.address)
    return node


def _transfer_to_node(prefill: PrefillEngine, node, rid: str) -> None:
    prefill.admit(rid, 3 * PAGE_TOKENS, peer=node.engine_id)
    node.admit(rid=rid, tokens=3 * PAGE_TOKENS)
    req = prefill.wait_ready(rid)
    oracle.fill(prefill.layout, req.pages, rid=rid, gen=req.gen)
    prefill.send(rid)
    node.wait(rid=rid)
    report = node.read_check(rid=rid)
    assert report["ok"] == report["pages"] == 3, report
    prefill.wait(rid)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_decode_process_that_dies_is_forgotten_at_once_not_after_peer_timeout(transport):
    """tcp: the link's socket ends; shm: an idle link looks at its reader's process."""
    prefill = PrefillEngine(make_layout(64), EngineConfig(max_context=16 * PAGE_TOKENS, heartbeat_interval=0.2,
                                                          peer_timeout=60.0, peer_expiry=600.0,
                                                          transport=transport))
    node = None
    try:
        node = _decode_node(prefill, transport=transport)
        wait_for(lambda: prefill.peers.get(node.engine_id) is not None
                 and prefill.peers[node.engine_id].link is not None, what="the data link")
        _transfer_to_node(prefill, node, "before")
        killed = time.monotonic()
        node.kill()
        wait_for(lambda: node.engine_id not in prefill.peers, timeout=10, what="the dead decode forgotten")
        gone_after = time.monotonic() - killed
        assert gone_after < 5.0  # its link's end closing says so; peer_timeout is 60 s here
        assert prefill.counters["peers_forgotten"] == 1
        assert not prefill.control.open_sockets()
    finally:
        if node is not None:
            node.close()
        close_checked([prefill])


def test_a_decode_the_prefill_forgot_while_it_was_stopped_peers_again_by_itself():
    """A decode process paused longer than the prefill's peer_expiry (SIGSTOP: a GC pause, a VM
    migration) is forgotten; when it resumes, the prefill tells it so and it HELLOs again on its own."""
    prefill = PrefillEngine(make_layout(64), EngineConfig(max_context=16 * PAGE_TOKENS, heartbeat_interval=0.2,
                                                          peer_timeout=0.5, peer_expiry=1.0))
    node = None
    try:
        node = _decode_node(prefill)
        wait_for(lambda: prefill.peers.get(node.engine_id) is not None
                 and prefill.peers[node.engine_id].link is not None, what="the data link")
        os.kill(node.pid, signal.SIGSTOP)
        try:
            wait_for(lambda: node.engine_id not in prefill.peers, timeout=10, what="the stopped decode forgotten")
        finally:
            os.kill(node.pid, signal.SIGCONT)
        wait_for(lambda: prefill.peers.get(node.engine_id) is not None
                 and prefill.peers[node.engine_id].link is not None, timeout=10, what="the decode peered again")
        assert prefill.counters["told_not_peered"] >= 1
        assert node.stats()["engine_counters"]["repeers"] >= 1
        _transfer_to_node(prefill, node, "after")
    finally:
        if node is not None:
            node.close()
        close_checked([prefill])


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_sending_threads_do_not_grow_with_peers_and_every_peer_gets_its_bytes(transport):
    config = EngineConfig(max_context=4 * PAGE_TOKENS, heartbeat_interval=0.2, transport=transport)
    prefill = PrefillEngine(make_layout(256), config)
    decodes = [DecodeEngine(make_layout(16), config) for _ in range(24)]
    made = [prefill, *decodes]
    try:
        connected = []
        threads = [threading.Thread(target=lambda d=d: connected.append(d.connect(prefill.address)))
                   for d in decodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(connected) == 24
        senders = [t for t in threading.enumerate() if t.name.startswith(f"kvxfer-{transport}-send")]
        assert len(senders) == prefill.config.options(transport).send_threads == 8
        sources = {}
        for i, d in enumerate(decodes):  # every request posted before any is waited for: lanes interleave
            rid = f"r{i}"
            prefill.admit(rid, 4 * PAGE_TOKENS, peer=d.engine_id)
            d.admit(rid, 4 * PAGE_TOKENS, peer=prefill.engine_id)
        for i, _d in enumerate(decodes):
            rid = f"r{i}"
            prefill.wait_ready(rid)
            sources[rid] = prefill.source_pages(rid)
            fill_random(prefill.layout, sources[rid], i)
            prefill.send(rid)
        for i, d in enumerate(decodes):
            rid = f"r{i}"
            assert d.wait(rid).state is R.READABLE
            with d.read(rid) as kv:
                for b in range(d.layout.num_buffers):
                    assert np.array_equal(kv.buffer(b), prefill.layout.views()[b][sources[rid]])
            d.release(rid)
            prefill.wait(rid)
        assert len([t for t in threading.enumerate() if t.name.startswith(f"kvxfer-{transport}-send")]) == 8
    finally:
        close_checked(made)


@pytest.mark.parametrize("threads", ["0", "x"])
def test_a_bad_send_threads_setting_is_refused_naming_it(threads):
    from kvxfer.errors import ConfigError

    with pytest.raises((ConfigError, ValueError), match="(?i)send_threads"):
        config = EngineConfig.from_env({"KVXFER_MAX_CONTEXT": "64", "KVXFER_TCP_SEND_THREADS": threads})
        PrefillEngine(make_layout(16), config).close()


def test_process_load_reads_this_process():
    load = process_load(os.getpid())
    assert load["threads"] >= 1 and load["fds"] >= 3 and load["rss"] > 0


@pytest.mark.parametrize("forgotten", [True, False], ids=["after-forgotten", "new-hello"])
def test_a_decode_restarted_under_the_same_engine_id_transfers_at_once(forgotten):
    """Deployments pin engine ids (a pod name). A decode closed and started again under the same id
    counts its generations from 1 again; the prefill's replay check ("newest META generation from this
    peer") belongs to one peering, so the new incarnation's first META is taken, whether the prefill
    forgot the old one first or only hears the new HELLO. Before, it was refused as a replay
    (stale_meta) until its counter passed the old incarnation's."""
    config = EngineConfig(max_context=16 * PAGE_TOKENS, heartbeat_interval=0.2, engine_id="decode-pod-0")
    prefill = PrefillEngine(make_layout(64), EngineConfig(max_context=16 * PAGE_TOKENS, heartbeat_interval=0.2))
    made = [prefill]
    try:
        old = DecodeEngine(make_layout(64), config)
        made.append(old)
        assert old.connect(prefill.address) == prefill.engine_id
        for i in range(4):
            _transfer_to_engine(prefill, old, f"old-{i}")
        assert prefill.sender.meta_gen_seen["decode-pod-0"] >= 4
        old.close()
        if forgotten:
            wait_for(lambda: "decode-pod-0" not in prefill.peers, timeout=10, what="the closed decode forgotten")
            assert "decode-pod-0" not in prefill.sender.meta_gen_seen  # bounded by live peers
        new = DecodeEngine(make_layout(64), config)
        made.append(new)
        assert new.connect(prefill.address) == prefill.engine_id
        gens = [_transfer_to_engine(prefill, new, f"new-{i}") for i in range(3)]
        assert gens == [1, 2, 3]  # the old incarnation's generations again
        assert prefill.sender.stats["stale_meta"] == 0
        assert prefill.sender.meta_gen_seen["decode-pod-0"] == 3
        # (peer, generation) names the new incarnation's requests, never the old one's
        assert [prefill.sender.by_gen[("decode-pod-0", g)].rid for g in gens] == ["new-0", "new-1", "new-2"]
    finally:
        close_checked(made)


def _transfer_to_engine(prefill: PrefillEngine, decode: DecodeEngine, rid: str) -> int:
    """One transfer that must become READABLE at once (no waiting out a timeout) with the bytes written;
    returns its generation."""
    prefill.admit(rid, 3 * PAGE_TOKENS, peer=decode.engine_id)
    gen = decode.admit(rid, 3 * PAGE_TOKENS, peer=prefill.engine_id).gen
    req = prefill.wait_ready(rid, timeout=5)
    fill_random(prefill.layout, req.pages, 7)
    prefill.send(rid)
    assert decode.wait(rid, timeout=5).state is R.READABLE
    with decode.read(rid) as kv:
        for b in range(decode.layout.num_buffers):
            assert np.array_equal(kv.buffer(b), prefill.layout.views()[b][req.pages])
    decode.release(rid)
    prefill.wait(rid, timeout=5)
    return gen
