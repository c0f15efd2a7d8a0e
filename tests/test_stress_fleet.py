"""`kvxfer stress` as a fleet: N prefill x M decode processes, each request to a random pair, with
every fault on and processes killed, restarted, joining and leaving while requests run.

The runs are the real command line (``python -m kvxfer stress ...`` over tcp), as a user runs it;
the verdict is the tool's own (content oracle, every pool whole), checked here from its JSON."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from kvxfer.errors import ConfigError
from kvxfer.tools.stress import ALL_FAULTS, StressConfig
from kvxfer.tools.stress.result import StressResult
from kvxfer.tools.stress.workload import Workload

from .test_process_hygiene import assert_left_nothing, listening_of, start  # noqa: F401 (start: a fixture)

SMALL = ["--concurrency", "8", "--prefill-pages", "512", "--decode-pages", "2048", "--median-tokens", "600",
         "--no-progress", "--transport", "tcp"]


def _run(tmp_path, *extra, timeout=600):
    out = tmp_path / "stress.json"
    proc = subprocess.run([sys.executable, "-m", "kvxfer", "stress", *SMALL, "--json", str(out), *extra],
                          capture_output=True, text=True, timeout=timeout)
    assert out.exists(), proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())


@pytest.mark.slow
def test_fleet_3x4_with_every_fault_and_churn_leaks_corrupts_and_loses_nothing(tmp_path):
    """3 prefill x 4 decode processes; every fault at 5%; per request a 10% chance that a process is
    SIGKILLed (and restarted), joins or leaves. Seed 4 draws kills of both roles, joins and leaves."""
    proc, report = _run(tmp_path, "--prefills", "3", "--decodes", "4", "--all-faults", "0.05", "--churn", "0.1",
                        "--requests", "120", "--seed", "4")
    text = " ".join(proc.stdout.split())  # the console wraps at 80 columns
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "PASS: no leaked, corrupted or lost pages" in text
    assert report["leaked_pages"] == 0 and report["corrupted_pages"] == 0 and report["lost_pages"] == 0
    assert report["rejected_succeeded"] == 0 and report["quarantined_at_end"] == 0 and report["settled"]
    assert report["accounting_errors"] == [] and report["accounting_checks_during_run"] >= 2
    # no request unaccounted for: every one started has an outcome
    assert report["requests_started"] == report["requests"] == 120 and report["requests_unaccounted"] == 0
    assert report["requests"] == report["completed"] + report["failed"] + report["aborted"] + report["rejected"]
    assert report["failed_unexpectedly"] == 0, report["unexpected_failure_reasons"]
    # an oversized prompt is rejected at admission, unless a process of its pair died before that
    assert report["rejected"] == report["rejected_as_injected"].get("oversized", 0) > 0
    assert report["rejected"] <= report["faults"]["oversized"] and report["rejected_unexpectedly"] == 0
    assert report["completed"] > 0 and report["pages_checked"] > 0
    fleet = report["fleet"]
    # requests went through many pairs
    assert fleet["distinct_pairs_completed"] >= 4, fleet["pairs_completed"]
    # the churn happened: kills of both roles, their restarts, joins and leaves
    assert fleet["kills"]["prefill"] > 0 and fleet["kills"]["decode"] > 0, fleet
    assert fleet["kills_by_churn"] > 0 and fleet["restarts"] > 0 and fleet["joins"] > 0, fleet
    assert fleet["leaves"]["prefill"] + fleet["leaves"]["decode"] > 0, fleet
    assert fleet["start_failures"] == 0 and fleet["peering_failures"] == 0, fleet
    assert report["failed_as_injected"].get("churn", 0) > 0  # requests routed to a killed process failed
    # the halves of those requests in the surviving processes were ended by their engines, by themselves
    halves = fleet["counterpart_halves"]
    assert halves["decode halves left to the decode engine"] > 0 and report["decode_ranks_timed_out"] == 0
    assert halves["prefill halves settled by the prefill engine"] + halves["prefill halves whose prefill died too"] \
        == halves["prefill halves left to the prefill engine"], halves
    # every pool of a process alive at the end is whole, and so was every pool of a process that left
    processes = fleet["processes"]
    assert {p["end"] for p in processes} >= {"killed", "left", "running"}, processes
    for p in processes:
        if p["end"] == "killed":
            assert p["pool"] is None  # its pool died with it: not counted
        else:
            assert p["pool"]["free"] == p["pool"]["total"] and p["pool"]["quarantined"] == 0, p
    running = [p for p in processes if p["end"] == "running"]
    assert {pool["pool"] for pool in report["pools"]} == {p["process"] for p in running}
    assert report["pool_total"] == 2048 * sum(p["role"] == "decode" for p in running)
    assert report["prefill_pool_total"] == 512 * sum(p["role"] == "prefill" for p in running)
    assert sum(p["completed"] for p in processes if p["role"] == "decode") == report["completed"]
    assert sum(p["pages_checked"] for p in processes if p["role"] == "decode") == report["pages_checked"]
    assert text.startswith("topology: 3 prefill x 4 decode processes of one rank each, every decode peered with "
                           "every prefill; each request to a random (prefill, decode) pair; churn 0.1 per request")
    assert "kvxfer stress (tcp, 3 prefill x 4 decode processes, churn 0.1)" in text
    assert "processes" in text and "died" in text


@pytest.mark.slow
def test_fleet_negative_control_unsafe_legacy_reports_leaks_and_fails(tmp_path):
    """The incident's behaviour in a fleet (no admission rejection, no verification, immediate free):
    the oracle finds other requests' bytes in decode pages, and the run fails."""
    proc, report = _run(tmp_path, "--prefills", "2", "--decodes", "3", "--unsafe-legacy", "--fault", "oversized=0.25",
                        "--churn", "0.05", "--requests", "60", "--seed", "3")
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert report["leaked_pages"] > 0 and report["rejected_succeeded"] > 0 and report["ok"] is False
    assert report["fleet"]["distinct_pairs_completed"] >= 2
    leaking = [p for p in report["fleet"]["processes"] if p["role"] == "decode" and p["leaked_pages"]]
    assert leaking and sum(p["leaked_pages"] for p in report["fleet"]["processes"] if p["role"] == "decode") \
        == report["leaked_pages"]
    assert f"FAIL: {report['leaked_pages']:,} leaked pages" in " ".join(proc.stdout.split())


@pytest.mark.slow
def test_a_fleet_without_churn_routes_reproducibly(tmp_path):
    """Without churn the processes up never change, so the same seed sends each request to the same
    pair: two runs complete the same requests on the same pairs (no faults: every request completes)."""
    pairs = []
    for run in range(2):
        (tmp_path / str(run)).mkdir()
        proc, report = _run(tmp_path / str(run), "--prefills", "2", "--decodes", "2", "--requests", "24",
                            "--seed", "11", timeout=300)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
        assert report["completed"] == 24 and report["fleet"]["kills"] == {"prefill": 0, "decode": 0}
        pairs.append(report["fleet"]["pairs_completed"])
    assert pairs[0] == pairs[1] and len(pairs[0]) >= 3, pairs


def test_fleet_options_are_checked():
    for bad, match in (({"prefills": 0}, "prefills must be 1..16"), ({"decodes": 17}, "decodes must be 1..16"),
                       ({"churn": 1.5}, r"churn rate 1.5 outside \[0, 1\]"),
                       ({"prefills": 2, "decode_tp": 2}, "do not combine with --prefill-tp/--decode-tp"),
                       ({"churn": 0.1, "decode_page_size": 32}, "do not combine")):
        with pytest.raises(ConfigError, match=match):
            StressConfig(requests=1, **bad)
    assert not StressConfig(requests=1).fleet and StressConfig(requests=1, churn=0.1).fleet
    out = subprocess.run([sys.executable, "-m", "kvxfer", "stress", "--prefills", "2", "--prefill-tp", "2",
                          "--requests", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "kvxfer stress: --prefills/--decodes/--churn" in out.stderr, out.stderr


def test_fleet_draws_leave_the_plain_pairs_workload_as_it_was():
    """Routes and churn come from streams of their own: the same seed draws the same prompts and faults
    for the plain pair and a fleet; churn events come at about their rate, all three kinds."""
    faults = {name: 0.05 for name in ALL_FAULTS}
    plain = Workload(StressConfig(requests=1, faults=faults, seed=5))
    fleet = Workload(StressConfig(requests=1, faults=faults, seed=5, prefills=3, decodes=4, churn=0.1))
    a = [plain.next() for _ in range(2000)]
    b = [fleet.next() for _ in range(2000)]
    assert [(p.tokens, p.faults, p.chunks) for p in a] == [(p.tokens, p.faults, p.chunks) for p in b]
    assert all(p.route == (0.0, 0.0) and p.churn is None for p in a)
    assert len({p.route for p in b}) == 2000
    events = [p.churn for p in b if p.churn]
    assert 0.08 < len(events) / 2000 < 0.12
    assert {kind for kind, _, _ in events} == {"kill", "join", "leave"}
    assert {role for _, role, _ in events} == {"prefill", "decode"}


def test_the_plain_pairs_summary_has_no_fleet_fields():
    """1 prefill x 1 decode without churn is the plain pair: its summary and table are as they were."""
    summary = StressResult(StressConfig(requests=1)).summary()
    assert "fleet" not in summary and "requests_started" not in summary
    assert summary["topology"] == {"prefill_tp": 1, "decode_tp": 1, "prefill_page_size": 16, "decode_page_size": 16,
                                   "text": ""}
    assert "prefills" not in StressConfig(requests=1).to_dict() and "churn" not in StressConfig(requests=1).to_dict()
    assert StressResult(StressConfig(requests=1, decodes=2)).summary()["topology"]["text"] == \
        "1 prefill x 2 decode processes"
    assert StressConfig(requests=1, decodes=2).to_dict()["decodes"] == 2


@pytest.mark.slow
def test_sigkilled_fleet_with_churn_leaves_no_process_port_or_temp_dir(start):  # noqa: F811
    """A fleet starts its processes from background threads (no parent-death signal there): SIGKILLed
    mid-churn, every one of them, restarted and joined ones included, still goes with it (lifeline)."""
    run = start("stress", "--prefills", "2", "--decodes", "2", "--requests", "20000", "--concurrency", "4",
                "--prefill-pages", "512", "--decode-pages", "2048", "--median-tokens", "300", "--churn", "0.05",
                "--seed", "4", "--no-progress")
    run.wait_until("a process started by the churn", lambda: run.nodes_seen() >= 5, timeout=120)
    assert list(run.tmp.glob("kvxfer-*")), "stress keeps no temp dir: the check is void"
    sockets = listening_of(list(run.processes()))
    run.proc.kill()
    assert run.exit_status() == -signal.SIGKILL
    assert_left_nothing(run, sockets)
