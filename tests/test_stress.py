"""`kvxfer stress` at CI size: clean under every fault, and the negative control catches leaks."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from kvxfer.core import native
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
    # every request that did not complete is put down to the fault meant to end it, or called unexpected
    assert report["failed"] == sum(report["failed_as_injected"].values()) + report["failed_unexpectedly"]
    assert report["aborted"] == sum(report["aborted_as_injected"].values()) + report["aborted_unexpectedly"]
    assert report["rejected"] == report["rejected_as_injected"]["oversized"] and report["rejected_unexpectedly"] == 0
    assert report["failed_unexpectedly"] == 0, report["unexpected_failure_reasons"]
    assert report["failed_as_injected"].get("kill_sender", 0) > 0
    assert report["throughput_gbps"] > 0 and report["throughput_bytes_per_s"] > 0
    text = " ".join(proc.stdout.split())  # the console wraps at 80 columns
    assert f"{report['completed']} completed; {report['failed'] - report['failed_unexpectedly']} failed as injected " \
           "faults intended (" in text
    assert "; 0 failed unexpectedly;" in text and "PASS: no leaked, corrupted or lost pages" in text
    assert "0.000 GB/s" not in text and "red rows" not in text


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_stress_without_link_faults_drives_the_production_sending_paths_and_stays_clean(tmp_path, transport):
    """Request faults only (aborts at every stage, client disconnects, oversized prompts), short prompts:
    the prefill's links run with no fault injector, as in production, so its small requests take the
    caller's-thread path, and a busy link's the one-step path with DONE's checksum filled in C; the run
    is clean and the report shows those paths ran (with the C data path: KVXFER_PURE_PYTHON=1 has none)."""
    proc, report, _ = _run(tmp_path, "--fault", "abort_before_bootstrap=0.06", "--fault", "abort_mid_transfer=0.06",
                           "--fault", "abort_after_done=0.06", "--fault", "client_disconnect=0.06",
                           "--fault", "oversized=0.06", "--median-tokens", "48", "--seed", "5",
                           "--transport", transport)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["leaked_pages"] == 0 and report["corrupted_pages"] == 0 and report["lost_pages"] == 0
    assert report["failed_unexpectedly"] == 0 and report["aborted_unexpectedly"] == 0, report
    assert report["quarantined_at_end"] == 0 and report["pool_free_at_end"] == report["pool_total"]
    assert not any(report["faults"][name] for name in ("late_write", "duplicate_write", "flip_byte", "slow_link"))
    paths = report["prefill_link_paths"]
    if native.lib is not None:  # those paths are the C data path's (KVXFER_PURE_PYTHON=1: the Python one)
        assert paths.get("sent_inline", 0) > 0 and paths.get("done_filled", 0) > 0, paths
    assert report["completed"] > 0 and "PASS: no leaked, corrupted or lost pages" in " ".join(proc.stdout.split())


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_unsafe_legacy_negative_control_reports_leaks_and_fails(tmp_path, transport):
    proc, report, _ = _run(tmp_path, "--unsafe-legacy", "--fault", "oversized=0.25", "--seed", "3",
                           "--transport", transport)
    assert proc.returncode != 0
    assert report["leaked_pages"] > 0
    assert report["rejected_succeeded"] > 0
    assert report["ok"] is False
    text = " ".join(proc.stdout.split())
    assert f"FAIL: {report['leaked_pages']:,} leaked pages (other requests' bytes)" in text
    assert f"{report['rejected_succeeded']:,} rejected requests that succeeded" in text


def test_summary_words_rate_outcomes_and_verdict():
    """The stress summary says what it means in words: a rate in a unit that shows it, which failures
    the injected faults were meant to cause, and the verdict with what failed (no colour needed)."""
    from kvxfer.tools.stress.report import outcome_text, rate_text, verdict_text

    assert rate_text(38_465.0) == "38.5 kB/s" and rate_text(5.3e6) == "5.3 MB/s" and rate_text(1.2345e9) == "1.234 GB/s"
    assert rate_text(0.0) == "0 B/s"
    s = {"requests": 200, "completed": 152, "failed_as_injected": {"flip_byte": 12, "kill_sender": 29},
         "failed_unexpectedly": 0, "unexpected_failure_reasons": {}, "aborted_as_injected": {"abort_mid_transfer": 3},
         "aborted_unexpectedly": 0, "rejected_as_injected": {"oversized": 4}, "rejected_unexpectedly": 0}
    assert outcome_text(s) == ("200 requests: 152 completed; 41 failed as injected faults intended (flip_byte: 12, "
                               "kill_sender: 29); 0 failed unexpectedly; 3 aborted as injected "
                               "(abort_mid_transfer: 3); 4 rejected at admission as injected (oversized: 4).")
    s.update(failed_unexpectedly=2, unexpected_failure_reasons={"wait_timeout": 2})
    assert "; 2 failed unexpectedly (wait_timeout: 2);" in outcome_text(s)
    clean = {"leaked_pages": 0, "corrupted_pages": 0, "lost_pages": 0, "rejected_succeeded": 0,
             "accounting_errors": [], "settled": True}
    assert verdict_text(clean).startswith("PASS: ")
    assert verdict_text({**clean, "lost_pages": 3, "settled": False}) == \
        "FAIL: 3 lost pages; requests still active at the end"


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


# topologies: prefill and decode servers of several tensor-parallel ranks, one process per rank ------------

TOPOLOGIES = [("tcp", 2, 1), ("tcp", 1, 2), ("shm", 2, 1)]


@pytest.mark.parametrize(("transport", "tp_prefill", "tp_decode"), TOPOLOGIES,
                         ids=[f"{t}-p{p}d{d}" for t, p, d in TOPOLOGIES])
def test_stress_with_unequal_tp_and_every_fault_leaks_nothing_in_any_pool(tmp_path, transport, tp_prefill, tp_decode):
    """Each rank its own process, every decode page assembled from head slices and checked cell by
    cell; kill_sender kills one prefill rank, an abort mid-transfer starts on one decode rank."""
    proc, report, _ = _run(tmp_path, "--all-faults", "0.05", "--seed", "3", "--transport", transport,
                           "--prefill-tp", str(tp_prefill), "--decode-tp", str(tp_decode), "--head-bytes", "32")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    topology = report["topology"]
    assert (topology["prefill_tp"], topology["decode_tp"], topology["kv_heads"]) == (tp_prefill, tp_decode, 4)
    assert report["leaked_pages"] == 0 and report["corrupted_pages"] == 0 and report["lost_pages"] == 0
    assert report["rejected_succeeded"] == 0 and report["quarantined_at_end"] == 0 and report["settled"]
    pools = {pool["pool"]: pool for pool in report["pools"]}
    assert set(pools) == {f"prefill rank {p}" for p in range(tp_prefill)} | {f"decode rank {d}" for d in range(tp_decode)}
    assert all(pool["free"] == pool["total"] and pool["quarantined"] == 0 for pool in pools.values()), pools
    assert report["pool_total"] == 2048 * tp_decode and report["prefill_pool_total"] == 512 * tp_prefill
    assert report["requests"] == 160 and report["completed"] > 0 and report["pages_checked"] > 0
    assert report["rejected"] == report["faults"]["oversized"] > 0
    fired = {name for name, count in report["faults"].items() if count}
    assert len(fired) >= 8 and {"kill_sender", "flip_byte", "oversized"} <= fired, report["faults"]
    assert report["failed_unexpectedly"] == 0, report["unexpected_failure_reasons"]
    assert report["aborted_unexpectedly"] == 0 and report["rejected_unexpectedly"] == 0
    assert report["sender_kills"] > 0 and report["accounting_checks_during_run"] >= 2
    assert report["decode_ranks_timed_out"] == 0  # every end reached every rank (none waited out its timeout)
    text = " ".join(proc.stdout.split())
    assert f"prefill TP {tp_prefill} -> decode TP {tp_decode}, 4 KV heads x 32 B" in text
    assert "PASS: no leaked, corrupted or lost pages" in text


@pytest.mark.parametrize(("tp_prefill", "tp_decode"), [(2, 1), (1, 2)], ids=["p2d1", "p1d2"])
def test_unsafe_legacy_negative_control_with_unequal_tp_reports_leaks(tmp_path, tp_prefill, tp_decode):
    """The legacy placeholder writer with head slices: decode ranks read pages nobody wrote this time,
    and the cell oracle finds other requests' bytes in them."""
    proc, report, _ = _run(tmp_path, "--unsafe-legacy", "--fault", "oversized=0.25", "--seed", "3", "--requests", "60",
                           "--prefill-tp", str(tp_prefill), "--decode-tp", str(tp_decode), "--head-bytes", "32")
    assert proc.returncode != 0
    assert report["leaked_pages"] > 0 and report["rejected_succeeded"] > 0 and report["ok"] is False
    assert report["checksum"] == "adler32" and report["topology"]["decode_tp"] == tp_decode
    assert f"FAIL: {report['leaked_pages']:,} leaked pages" in " ".join(proc.stdout.split())


LAYERWISE = [("tcp", 1, 1), ("shm", 1, 1), ("tcp", 2, 1)]


@pytest.mark.parametrize(("transport", "tp_prefill", "tp_decode"), LAYERWISE,
                         ids=[f"{t}-p{p}d{d}" for t, p, d in LAYERWISE])
def test_layerwise_sends_with_every_fault_leak_nothing_and_the_negative_control_still_leaks(
        tmp_path, transport, tp_prefill, tp_decode):
    """Issue 26: every chunk sent layer by layer, one layer per step, the layers of a request interleaved,
    so aborts, kills, disconnects and link faults land between the layers of one request."""
    topology = ["--prefill-tp", str(tp_prefill), "--decode-tp", str(tp_decode), "--head-bytes", "32"] \
        if tp_prefill > 1 else []
    proc, report, _ = _run(tmp_path, "--layerwise", "--all-faults", "0.06", "--seed", "4", "--transport", transport,
                           *topology)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["layerwise"] is True and report["config"]["layerwise"] is True
    assert report["leaked_pages"] == 0 and report["corrupted_pages"] == 0 and report["lost_pages"] == 0
    assert report["rejected_succeeded"] == 0 and report["quarantined_at_end"] == 0
    assert report["failed_unexpectedly"] == 0, report["unexpected_failure_reasons"]
    assert report["completed"] > 0 and report["pages_checked"] > 0
    fired = {name for name, count in report["faults"].items() if count}
    assert {"abort_mid_transfer", "kill_sender", "flip_byte", "late_write"} <= fired, report["faults"]
    text = " ".join(proc.stdout.split())
    assert "layer-wise sends" in text and "PASS: no leaked, corrupted or lost pages" in text
    if tp_prefill == 1:
        control, creport, _ = _run(tmp_path, "--layerwise", "--unsafe-legacy", "--fault", "oversized=0.25",
                                   "--seed", "4", "--transport", transport, "--requests", "80")
        assert control.returncode != 0 and creport["leaked_pages"] > 0 and creport["ok"] is False


def test_topology_options_are_checked_and_documented():
    from kvxfer.tools.cli import build_parser

    for bad, match in (({"prefill_tp": 3}, "prefill tp must be 1, 2 or 4"),
                       ({"prefill_tp": 4, "kv_heads": 6}, "6 KV heads cannot be split over 4"),
                       ({"decode_tp": 2, "head_bytes": 24}, "head bytes must be a multiple of 8, at least 32"),
                       ({"prefill_page_size": 16, "decode_page_size": 24}, "one must be a multiple of the other")):
        with pytest.raises(ConfigError, match=match):
            StressConfig(requests=1, **bad)
    config = StressConfig(requests=1, prefill_tp=2, decode_page_size=32)
    assert config.topology and config.sliced and config.max_context == 8192 * 32
    assert not StressConfig(requests=1).topology
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    stress = sub.choices["stress"]
    options = {action.option_strings[0]: action for action in stress._actions if action.option_strings}
    formatter = stress._get_formatter()
    for option, default in (("--prefill-tp", "1"), ("--decode-tp", "1"), ("--kv-heads", "4"), ("--head-bytes", "64"),
                            ("--prefill-page-size", "--page-size"), ("--decode-page-size", "--page-size")):
        assert f"(default: {default})" in formatter._expand_help(options[option]), option
    with pytest.raises(SystemExit):
        build_parser().parse_args(["stress", "--decode-tp", "3"])


def test_head_oracle_tells_leaks_from_corruption_cell_by_cell():
    """Decode rank 1 of 2 (heads 2..3 of 4), in both in-page orders: its own cells check clean (the
    last page's padding is not read), a cell naming another request is a leak, a flipped bit or a
    cell of the right request at the wrong head is corruption."""
    import numpy as np

    from kvxfer import KVLayout
    from kvxfer.core.geometry import KVGeometry
    from kvxfer.tools import head_oracle

    for order in ("NHD", "HND"):
        geometry = KVGeometry.attention(layers=2, total_heads=4, head_dim=24, itemsize=2, dtype="bfloat16",
                                        tp_rank=1, tp_size=2, order=order)
        layout = KVLayout.allocate(num_pages=8, page_size=4, geometry=geometry)
        pages = np.array([5, 1, 6])
        head_oracle.fill(layout, pages, rid="a", tokens=10, seed=1)
        assert head_oracle.check(layout, pages, rid="a", tokens=10, seed=1).clean
        head_oracle.fill(layout, np.array([2]), rid="b", tokens=4, seed=1)
        views = [view[pages].copy() for view in layout.views()]
        views[3][2][-1] ^= 0xFF  # page 6 (tokens 8..11): padding past token 9, never read
        assert head_oracle.check(layout, pages, rid="a", tokens=10, seed=1, views=views).clean
        views[1][1] = layout.views()[1][2]  # page 1 holds request b's cells
        views[2][0][100] ^= 4  # a flipped bit in page 5
        cell = 48
        a_page = layout.views()[0][5]
        views[0][2][:2 * cell] = np.concatenate([a_page[cell:2 * cell], a_page[:cell]])  # a's cells, misplaced
        report = head_oracle.check(layout, pages, rid="a", tokens=10, seed=1, views=views)
        assert report.leaked == [1] and report.corrupted == [5, 6] and report.ok == 0
        assert report.leaked_from == {(head_oracle.rid_key("b"), 0)}
