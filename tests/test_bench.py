"""`kvxfer bench` end to end at a tiny size: every case measured, JSON fields, ratios computed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_bench_reports_cases_and_ratios(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "kvxfer", "bench", "--total", "16M", "--request-bytes", "4M",
                           "--page-bytes", "64K", "--page-bytes", "4K", "--total-small", "4M", "--repeat", "2",
                           "--baselines", "raw-socket", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    cases = {(c["transport"], c["page_bytes"], c["checks"]): c for c in report["cases"]}
    for page in (65536, 4096):
        for key in (("kvxfer-tcp", page, "on"), ("kvxfer-tcp", page, "off"), ("raw-socket", page, "off")):
            case = cases[key]
            assert not case["error"], case
            assert case["gbps"] > 0 and case["pages_per_s"] > 0 and case["seconds"] > 0 and case["bytes"] > 0
            assert set(case) >= {"transport", "page_bytes", "bytes", "seconds", "gbps", "pages_per_s", "checks"}
        assert cases[("kvxfer-tcp", page, "on")]["decode_rss_growth_of_moved"] < 0.5
    against = {(r["page_bytes"], r["against"]) for r in report["ratios"]}
    assert (65536, "raw-socket") in against and (4096, "kvxfer-tcp checks off") in against
    assert all(r["rounds"] == 2 for r in report["ratios"])
