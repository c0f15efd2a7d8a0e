"""`kvxfer bench` end to end at a tiny size: every case measured, JSON fields, ratios computed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zlib

import pytest

from kvxfer.core import native
from kvxfer.tools import procs
from kvxfer.tools.bench import BenchConfig, PeerSession, Unavailable, _run_rounds

from .conftest import wait_for

pytestmark = pytest.mark.slow
INSTALL = {"mooncake-tcp": ("mooncake", "pip install mooncake-transfer-engine-non-cuda"),
           "nixl-ucx-tcp": ("nixl_cu12", "pip install --no-deps nixl-cu12")}


def test_bench_reports_cases_and_ratios(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "kvxfer", "bench", "--total", "16M", "--request-bytes", "4M",
                           "--page-bytes", "64K", "--page-bytes", "4K", "--total-small", "4M", "--repeat", "2",
                           "--baselines", "raw-socket,native-stream,mooncake-tcp,nixl-ucx-tcp", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    cases = {(c["transport"], c["page_bytes"], c["checks"]): c for c in report["cases"]}
    for page in (65536, 4096):
        stream = [("native-stream", page, "on"), ("native-stream", page, "off")] if native.checksums_in_c else []
        for key in (("kvxfer-tcp", page, "on"), ("kvxfer-tcp", page, "off"), ("raw-socket", page, "off"), *stream):
            case = cases[key]
            assert not case["error"], case
            assert case["gbps"] > 0 and case["pages_per_s"] > 0 and case["seconds"] > 0 and case["bytes"] > 0
            assert set(case) >= {"transport", "page_bytes", "bytes", "seconds", "gbps", "pages_per_s", "checks"}
        assert cases[("kvxfer-tcp", page, "on")]["decode_rss_growth_of_moved"] < 0.5
        for checks in ("on", "off"):  # per-request latency, admission to READABLE, over the counted rounds
            case = cases[("kvxfer-tcp", page, checks)]
            assert case["latency_from"] == "admit-to-READABLE" and case["request_bytes"] == 4 << 20
            assert 0 < case["latency_p50_s"] <= case["latency_p99_s"] and case["latency_requests"] >= 2
            assert f"checks {checks}: per-request latency (admit to READABLE, 4 MiB requests) p50" in proc.stdout
    against = {(r["page_bytes"], r["against"]) for r in report["ratios"]}
    assert (65536, "raw-socket") in against and (4096, "kvxfer-tcp checks off") in against
    # the native stream runs with checks on and off like kvxfer: its own on/off is the machine's ceiling
    own = {(r["case"], r["page_bytes"], r["against"]) for r in report["ratios"]}
    skipped = {s["case"]: s["reason"] for s in report["skipped"]}
    if not native.checksums_in_c:  # the C extension or zlib-ng missing: skipped, saying which
        assert skipped["native-stream"].startswith("not available (")
    for page in (65536, 4096) if native.checksums_in_c else ():
        assert ("native-stream", page, "native-stream checks off") in own
        assert ("kvxfer-tcp", page, "native-stream checks on") in own
        assert ("kvxfer-tcp", page, "native-stream checks off") in own
    assert "native-stream (checks on) / native-stream checks off at 4,096 B" in proc.stdout or not native.checksums_in_c
    assert all(r["rounds"] == 2 for r in report["ratios"])
    # a peer that is not installed: one line naming what to install, no row, no ratio, "skipped" in the JSON
    for name, (module, install) in INSTALL.items():
        if importlib.util.find_spec(module) is not None:
            continue
        assert skipped[name] == f"not installed ({install})"
        assert f"{name}: skipped, not installed ({install})" in proc.stdout.splitlines()
        assert not any(c["transport"] == name for c in report["cases"])
        assert not any(r["against"] == name for r in report["ratios"])
    assert "0.000" not in proc.stdout and "Error" not in proc.stdout


@pytest.mark.skipif(not native.checksums_in_c, reason=f"native-stream needs it: {native.describe()}")
@pytest.mark.parametrize("honest", [True, False])
def test_native_stream_target_compares_the_senders_sums(honest):
    """The checks-on native stream is a real check, not a second copy of the bytes: its target lands
    the pages, sums them, reads the sender's sums and answers ``x`` when one differs."""
    import socket

    import numpy as np

    target = procs.popen([sys.executable, "-m", "kvxfer.tools.bench.peers", "native-stream", "target", "4", "4096",
                          "8", json.dumps({"checks": "on"})], stdout=subprocess.PIPE, text=True)
    try:
        ready = json.loads(target.stdout.readline())
        assert ready["ready"] and ready["checks"] == "on"
        pages = np.random.default_rng(5).integers(0, 256, (4, 4096), dtype=np.uint8)
        sums = b"".join(zlib.adler32(page.tobytes()).to_bytes(4, "little") for page in pages)
        if not honest:
            sums = sums[:4] + bytes([sums[4] ^ 1]) + sums[5:]  # the second page's sum, one bit off
        with socket.create_connection(("127.0.0.1", ready["port"]), timeout=30) as sock:
            sock.sendall(pages.tobytes() + sums)
            assert sock.recv(1) == (b"k" if honest else b"x")
    finally:
        procs.stop(target, grace=5.0)


@pytest.mark.skipif(importlib.util.find_spec("mooncake") is not None, reason="mooncake is installed here")
def test_a_peer_found_missing_only_when_started_is_skipped_not_failed():
    """The peer process itself reports a missing library (say, a package that is found but does not
    import): the session is skipped with what to install, never counted as a failed case."""
    session = PeerSession("mooncake-tcp", BenchConfig(total_bytes=1 << 20), 65536)
    with pytest.raises(Unavailable, match=r"^not installed \(pip install mooncake-transfer-engine-non-cuda\)$"):
        session.start()
    session.close(measure=False)
    results, skipped = [], {}
    _run_rounds(BenchConfig(total_bytes=1 << 20, repeat=1), 65536,
                [PeerSession("mooncake-tcp", BenchConfig(total_bytes=1 << 20), 65536)], results, _Quiet(), skipped)
    assert results == [] and skipped == {"mooncake-tcp": "not installed (pip install mooncake-transfer-engine-non-cuda)"}


class _Quiet:
    def print(self, *args, **kwargs):
        pass


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def test_a_peer_is_stopped_between_its_rounds_and_leaves_nothing():
    """A contestant's processes are stopped (state T) outside its own rounds, so a library thread
    that spins while idle (NIXL's target progress thread) cannot slow the other contestants' rounds;
    each of its rounds still runs, and closing it ends both processes."""
    session = PeerSession("raw-socket", BenchConfig(total_bytes=4 << 20), 65536)
    session.start()
    try:
        pids = [proc.pid for proc in session.procs]
        assert len(pids) == 2
        wait_for(lambda: {_state(pid) for pid in pids} == {"T"}, timeout=5)  # SIGSTOP lands asynchronously
        for _ in range(2):
            assert session.run_once() > 0
            wait_for(lambda: {_state(pid) for pid in pids} == {"T"}, timeout=5)
    finally:
        session.close()
    assert all(proc.poll() is not None for proc in session.procs)


def test_bench_unequal_tp_case_moves_the_same_bytes_and_reports_its_ratio(tmp_path):
    """``--tp 2:1``: two prefill rank processes write half the heads of every decode page each, next to
    the equal-TP case of the same page size; the JSON and the table carry unequal / equal."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "kvxfer", "bench", "--total", "8M", "--request-bytes", "2M",
                           "--page-bytes", "64K", "--repeat", "2", "--checks", "on", "--baselines", "none",
                           "--tp", "2:1", "--json", str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "200"})  # table rows on one line each
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    cases = {c["transport"]: c for c in report["cases"]}
    equal, unequal = cases["kvxfer-tcp"], cases["kvxfer-tcp-tp2:1"]
    assert not equal["error"] and not unequal["error"], (equal, unequal)
    assert unequal["bytes"] == equal["bytes"] == 8 << 20 and unequal["page_bytes"] == equal["page_bytes"] == 65536
    assert (unequal["tp"], unequal["kv_heads"], unequal["head_bytes"], unequal["tokens_per_page"]) == ("2:1", 8, 256, 32)
    assert unequal["gbps"] > 0 and unequal["latency_requests"] >= 4
    [ratio] = [r for r in report["ratios"] if r.get("unequal_tp")]
    assert (ratio["case"], ratio["against"], ratio["checks"], ratio["rounds"]) == ("kvxfer-tcp-tp2:1", "kvxfer-tcp", "on", 2)
    assert ratio["gbps_ratio"] > 0
    assert not any(r["against"] == "kvxfer-tcp-tp2:1" for r in report["ratios"])
    text = " ".join(proc.stdout.split())
    assert f"kvxfer-tcp-tp2:1 / kvxfer-tcp (checks on) at 65,536 B: {ratio['gbps_ratio']:.2f}x" in text
    assert f"TP 2:1 / equal TP: {ratio['gbps_ratio']:.2f}x" in proc.stdout  # the case's row in the table
    bad = subprocess.run([sys.executable, "-m", "kvxfer", "bench", "--tp", "1:2"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "prefill TP 2, 4 or 8 into decode TP 1" in bad.stderr


def test_bench_first_request_reports_cold_peered_ahead_and_steady_apart_from_the_handshake(tmp_path):
    """``--first-request``: fresh decodes meet one prefill on every transport here; the report puts the
    first request cold (peering on demand) and after peering ahead beside steady state, p50 and p99,
    the handshake in a column of its own, the ratios of one run, and verbs skipped by name where absent.
    Nothing here judges a time: the numbers only have to be there and be positive."""
    from kvxfer.transport import registry

    out = tmp_path / "first.json"
    proc = subprocess.run([sys.executable, "-m", "kvxfer", "bench", "--first-request", "--decodes", "2",
                           "--steady", "2", "--request-bytes", "256K", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "250"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    expected = [name for name in registry.names() if registry.available(name)[0]]
    assert {"tcp", "shm"} <= set(expected)
    rows = {r["transport"]: r for r in report["first_request"]}
    assert sorted(rows) == sorted(expected) and report["failed"] == []
    for name, r in rows.items():
        assert (r["page_bytes"], r["request_pages"], r["request_bytes"], r["checks"]) == (65536, 4, 256 << 10, "on")
        assert r["latency_from"] == "caller-decides-to-decode-READABLE"
        assert (r["handshake"]["n"], r["cold"]["n"], r["ahead"]["n"], r["steady"]["n"]) == (2, 1, 1, 4)
        for column in ("handshake", "cold", "ahead", "steady"):
            assert 0 < r[column]["p50_s"] <= r[column]["p99_s"], (name, column, r[column])
        for column in ("cold", "ahead", "steady"):  # phases in order, from the caller's decision
            phases = r[column]["phases_p50_s"]
            assert 0 < phases["admitted"] <= phases["destination"] <= phases["posted"], (name, column, phases)
        assert r["cold"]["phases_p50_s"]["admitted"] > 0 and r["rpc_round_trip"]["p50_s"] > 0
        assert all(r["ratios"][key] > 0 for key in ("ahead_over_steady_p50", "cold_over_steady_p50",
                                                     "ahead_paired_median", "cold_paired_median"))
        assert isinstance(r["first_request_pays_no_handshake"], bool)
        text = " ".join(proc.stdout.split())
        assert (f"{name} 65,536 B pages (checks on): handshake (connect(), reported apart) "
                f"p50 {1e3 * r['handshake']['p50_s']:.2f} ms") in text
        assert f"first after peering / steady p50 {r['ratios']['ahead_over_steady_p50']:.2f}x" in text
        assert f"cold / steady p50 {r['ratios']['cold_over_steady_p50']:.2f}x" in text
        assert f"{name} 65,536 B pages: first request after peering p50" in text
    header = next(line for line in proc.stdout.splitlines() if "handshake (connect)" in line)
    for column in ("handshake (connect)", "cold (connect + request)", "first after peering", "steady",
                   "ahead / steady p50", "cold / steady p50"):
        assert column in header
    assert "\"First request pays no handshake\": with the decode peered ahead" in " ".join(proc.stdout.split())
    skipped = {s["case"]: s["reason"] for s in report["skipped"]}
    for name in set(registry.names()) - set(expected):  # verbs without pyverbs or a device: one line naming it
        assert name in skipped and f"{name}: skipped, {skipped[name]}" in " ".join(proc.stdout.split())
    assert "FAILED" not in proc.stdout and "Error" not in proc.stdout


def test_bench_ttft_reports_layerwise_whole_and_the_floor_for_every_prompt(tmp_path):
    """Issue 26: the time-to-first-token report, a small model at CI size; figures are the reader's to
    judge, the test checks what is reported and that every request became READABLE both ways."""
    out = tmp_path / "ttft.json"
    proc = subprocess.run([sys.executable, "-m", "kvxfer", "bench", "--ttft", "--ttft-tokens", "64,512",
                           "--model-params", "1e8", "--model-layers", "4", "--repeat", "1",
                           "--layerwise-min-tokens", "256", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    rows = {r["tokens"]: r for r in report["ttft"]}
    assert set(rows) == {64, 512}
    for tokens, r in rows.items():
        assert r["floor_s"] > 0 and r["whole_s"] > 0 and r["layerwise_s"] > 0
        assert r["kv_bytes"] == tokens * 2 * 4 * 8 * 128 * 2
        assert len(r["runs"]["whole"]) == len(r["runs"]["layerwise"]) == 1
        # nothing is READABLE before its last layer was computed: the floor bounds both ways
        assert r["whole_s"] >= r["floor_s"] and r["layerwise_s"] >= r["floor_s"]
    assert rows[64]["auto_s"] == rows[64]["whole_s"] and rows[512]["auto_s"] == rows[512]["layerwise_s"]
    assert report["config"]["layerwise_min_tokens"] == 256
    text = " ".join(proc.stdout.split())
    assert "prefill start to READABLE" in text and "auto: whole-request below 256 tokens" in text
    bad = subprocess.run([sys.executable, "-m", "kvxfer", "bench", "--ttft", "--ttft-tokens", "x"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--ttft-tokens takes integers" in bad.stderr


def test_bench_small_requests_reports_send_and_admit_latency_per_size(tmp_path):
    out = tmp_path / "small.json"
    proc = subprocess.run([sys.executable, "-m", "kvxfer", "bench", "--small-requests", "1,8", "--page-bytes", "4K",
                           "--requests", "200", "--repeat", "1", "--baselines", "none", "--pin", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["config"]["pin"] is True
    if len(os.sched_getaffinity(0)) >= 2:  # each side on its own half of the CPUs (the nodes: test_processes)
        cpus = sorted(os.sched_getaffinity(0))
        half = len(cpus) // 2
        assert f"pinned: prefill side on CPUs {cpus[:half]}, decode side on CPUs {cpus[half:]}" in proc.stdout
    rows = report["small_requests"]
    assert [(r["page_bytes"], r["request_pages"]) for r in rows] == [(4096, 1), (4096, 8)]
    for r in rows:
        k = r["kvxfer-tcp"]
        assert k["requests"] == 200 and 0 < k["send_p50_s"] <= k["send_p99_s"] and 0 < k["p50_s"] <= k["p99_s"]
        # CPU per request on each side: a request costs each process tens of microseconds at the least, so 200
        # of them cross /proc's 10 ms ticks; and no side spends a whole second of CPU on one small request
        assert 0 < k["prefill_cpu_us"] < 1e6 and 0 < k["decode_cpu_us"] < 1e6, k
        assert k["from"] == "admit-to-READABLE"
        # the consumer's wait() returns after READABLE was stamped, never before
        assert k["send_p50_s"] <= k["noticed_p50_s"] <= k["noticed_p99_s"]
        # the prefill's wait() returns once the decode's RESULT arrived, after the decode verified
        assert k["send_p50_s"] <= k["succeeded_p50_s"] <= k["succeeded_p99_s"]
        # the same requests with every send from a sending thread (inline_send off), in the same rounds
        lanes = r["kvxfer-tcp-lanes"]
        assert lanes["requests"] == 200 and 0 < lanes["send_p50_s"] <= lanes["send_p99_s"], lanes
        assert r["over_lanes_p50"] == round(k["send_p50_s"] / lanes["send_p50_s"], 3)
    assert "kvxfer send->wait()" in proc.stdout and "CPU: each engine process" in proc.stdout
    assert "lanes (tcp, shm): kvxfer with inline_send off" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "kvxfer", "bench", "--small-requests", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "page counts above 0" in bad.stderr


def test_bench_busy_caller_holds_the_prefills_interpreter_after_each_send(tmp_path):
    """--busy-caller 3: the prefill's loop computes in Python for 3 ms after each send(), which its
    process's CPU per request shows (the work runs; the latencies beside it are the benchmark's)."""
    out = tmp_path / "busy.json"
    proc = subprocess.run([sys.executable, "-m", "kvxfer", "bench", "--small-requests", "1", "--page-bytes", "4K",
                           "--requests", "50", "--repeat", "1", "--baselines", "none", "--busy-caller", "3",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["config"]["caller_busy_ms"] == 3
    (row,) = report["small_requests"]
    for case in ("kvxfer-tcp", "kvxfer-tcp-lanes"):
        assert row[case]["prefill_cpu_us"] >= 2500, (case, row[case])  # 3 ms of Python per request, less ticks
    assert "the prefill's caller busy 3 ms after each send()" in proc.stdout


@pytest.mark.skipif(importlib.util.find_spec("nixl_cu12") is None,
                    reason="NIXL not installed (pip install --no-deps nixl-cu12)")
def test_bench_small_requests_reports_when_nixl_target_is_notified(tmp_path):
    """Beside NIXL's initiator DONE, the moment its target learns the transfer landed (the notification
    a decode on NIXL waits for, READABLE's counterpart): stamped by the target, for every request of the
    counted rounds."""
    out = tmp_path / "small.json"
    proc = subprocess.run([sys.executable, "-m", "kvxfer", "bench", "--small-requests", "1", "--page-bytes", "4K",
                           "--requests", "20", "--repeat", "2", "--baselines", "nixl-ucx-tcp", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = json.loads(out.read_text())["small_requests"]
    nixl = row["nixl-ucx-tcp"]
    assert "error" not in nixl, nixl
    assert nixl["requests"] == 40 and nixl["from"] == "initialize_xfer-to-DONE"
    assert nixl["notified_requests"] == 40 and 0 < nixl["notified_p50_s"] <= nixl["notified_p99_s"]
    # both consumers informed: kvxfer's wait() returning against NIXL's target notified
    assert row["over_nixl-ucx-tcp_notified_p50"] == round(row["kvxfer-tcp"]["noticed_p50_s"] / nixl["notified_p50_s"], 3)
    assert "NIXL notified" in proc.stdout
