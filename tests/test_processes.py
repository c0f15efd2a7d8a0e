"""Engines in separate OS processes: the demo, a SIGKILLed writer, startup refusal across processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from kvxfer.errors import AdmissionRejected, CapacityError
from kvxfer.tools.node import NodeSpec, spawn

pytestmark = pytest.mark.slow


def _spec(role: str, pages: int, **config):
    return NodeSpec(role=role, num_buffers=2, item_len=2048, num_pages=pages, page_size=16,
                    config={"max_context": 1024, "heartbeat_interval": 0.2, **config},
                    faults={} if role == "prefill" else None)


def test_demo_exits_zero_and_reports_every_expectation(tmp_path):
    out = tmp_path / "demo.json"
    proc = subprocess.run([sys.executable, "-m", "kvxfer", "demo", "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["ok"] is True
    steps = [o["step"] for o in report["outcomes"]]
    assert steps == ["startup", "normal", "unsafe band", "abort", "corruption", "late write", "authentication",
                     "accounting"]
    assert all(o["ok"] for o in report["outcomes"])
    assert "all expectations held" in proc.stdout


def test_startup_refusal_crosses_the_process_boundary():
    with pytest.raises(CapacityError, match="prefill pool 512 tokens < context 1,024 tokens"):
        spawn(_spec("prefill", 32))


def test_sigkilled_writer_fails_its_requests_and_frees_every_page():
    prefill = spawn(_spec("prefill", 64))
    decode = spawn(_spec("decode", 128))
    try:
        peer = decode.connect(address=prefill.control)
        prefill.admit(rid="r", tokens=800)
        decode.admit(rid="r", tokens=800, peer=peer)
        prefill.prepare(rid="r")
        prefill.fault(op="pause")
        prefill.send(rid="r", count=10)
        assert decode.stats()["pool_free"] == 128 - 50
        prefill.kill()
        final = decode.wait(rid="r", timeout=10)
        assert final["state"] == "FAILED" and "connection" in final["error"]
        decode.accounting()
        assert decode.stats()["pool_free"] == 128
        with pytest.raises(AdmissionRejected):
            decode.admit(rid="too-big", tokens=5000, peer=peer)
    finally:
        decode.close()
        prefill.close()


def test_killed_reader_fails_the_writer_without_leaking_source_pages():
    prefill = spawn(_spec("prefill", 64))
    decode = spawn(_spec("decode", 128))
    try:
        peer = decode.connect(address=prefill.control)
        prefill.admit(rid="w", tokens=400)
        decode.admit(rid="w", tokens=400, peer=peer)
        prefill.prepare(rid="w")
        decode.kill()
        time.sleep(0.2)
        try:
            prefill.send(rid="w")
        except Exception:  # the link may already be gone: either way the request must settle
            pass
        final = prefill.wait(rid="w", timeout=10)
        assert final["state"] == "FAILED"
        prefill.accounting()
        assert prefill.stats()["pool_free"] == 64
    finally:
        decode.close()
        prefill.close()


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity (Linux) and at least two CPUs")
def test_a_node_asked_for_cpus_runs_every_thread_on_them():
    """``spawn(..., cpus=...)`` (the bench's --pin): every thread of the node, its engine's included,
    runs on the CPUs asked for, read back from the kernel; a node asked for none runs on all."""
    from pathlib import Path

    cpus = sorted(os.sched_getaffinity(0))

    def allowed(pid: int) -> dict[int, str]:
        found = {}
        for task in Path(f"/proc/{pid}/task").iterdir():
            for line in (task / "status").read_text().splitlines():
                if line.startswith("Cpus_allowed_list:"):
                    found[int(task.name)] = line.split(":", 1)[1].strip()
        return found

    pinned = spawn(_spec("decode", 64), cpus=[cpus[-1]])
    free = spawn(_spec("decode", 64))
    try:
        threads = allowed(pinned.process.pid)
        assert len(threads) > 3  # the engine's threads, started after the pinning
        assert set(threads.values()) == {str(cpus[-1])}, threads
        assert str(cpus[-1]) not in set(allowed(free.process.pid).values())
    finally:
        pinned.close()
        free.close()
