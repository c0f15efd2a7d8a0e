"""`kvxfer stress` at CI size: clean under every fault, and the negative control catches leaks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvxfer.errors import ConfigError
from kvxfer.tools.stress import ALL_FAULTS, StressConfig
from kvxfer.tools.stress.workload import Workload

pytestmark = pytest.mark.slow

SMALL = ["--requests", "160", "--concurrency", "8", "--prefill-pages", "512", "--decode-pages", "2048",
         "--median-tokens", "600", "--no-progress"]


def _run(tmp_path, *extra):
    out = tmp_path / "stress.json"
    png = tmp_path / "stress.png"
    proc = subprocess.run([sys.executable, "-m", "kvxfer", "stress", *SMALL, "--json", str(out),
                           "--report", str(png), *extra], capture_output=True, text=True, timeout=300)
    return proc, json.loads(out.read_text()), png


@pytest.mark.parametrize("transport", ["tcp", "shm"])  # verbs: tools/softroce/ci-verbs runs it in the VM
def test_stress_with_every_fault_leaks_nothing_and_loses_nothing(tmp_path, transport):
    proc, report, png = _run(tmp_path, "--all-faults", "0.06", "--seed", "3", "--transport", transport)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["transport"] == transport
    assert report["leaked_pages"] == 0 and report["corrupted_pages"] == 0 and report["lost_pages"] == 0
    assert report["rejected_succeeded"] == 0 and report["quarantined_at_end"] == 0
    assert report["pool_free_at_end"] == report["pool_total"] == 2048
    assert report["prefill_pool_free_at_end"] == report["prefill_pool_total"]
    assert report["requests"] == 160 and report["completed"] > 0 and report["pages_checked"] > 0
    assert report["rejected"] == report["faults"]["oversized"] > 0
    # the accounting invariant was checked on the live nodes while requests were in flight
    assert report["accounting_checks_during_run"] >= 2 and report["accounting_errors"] == []
    fired = {name for name, count in report["faults"].items() if count}
    assert len(fired) >= 8, report["faults"]
    for key in ("transport", "aborted", "failed", "stale_writes_refused", "bytes_moved", "throughput_gbps"):
        assert key in report
    assert set(report["latency_ms"]) == {"p50", "p99"}
    assert png.stat().st_size > 10_000


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_unsafe_legacy_negative_control_reports_leaks_and_fails(tmp_path, transport):
    proc, report, _ = _run(tmp_path, "--unsafe-legacy", "--fault", "oversized=0.25", "--seed", "3",
                           "--transport", transport)
    assert proc.returncode != 0
    assert report["leaked_pages"] > 0
    assert report["rejected_succeeded"] > 0
    assert report["ok"] is False


def test_workload_rates_and_validation():
    config = StressConfig(requests=10, faults={name: 0.05 for name in ALL_FAULTS})
    workload = Workload(config)
    plans = [workload.next() for _ in range(4000)]
    for fault in ("oversized", "kill_sender", "abort_after_done"):
        share = sum(fault in p.faults for p in plans) / len(plans)
        assert 0.035 < share < 0.065, (fault, share)
    band = config.unsafe_band
    assert all(band[0] <= p.tokens <= band[1] for p in plans if "oversized" in p.faults)
    assert all(p.tokens <= config.prefill_tokens for p in plans if "oversized" not in p.faults)
    with pytest.raises(ConfigError, match="unknown fault"):
        StressConfig(requests=1, faults={"meteor": 0.1})
    with pytest.raises(ConfigError, match="stop by itself"):
        StressConfig(requests=None, duration=None)
