"""The small-request floor harnesses of tools/floor (docs/benchmarks.md's figures for a request with nothing
of kvxfer's around it) build and run: each moves its requests and checks every DONE against what
landed, exiting non-zero on a disagreement."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvxfer.tools.procs import popen_foreign

FLOOR = Path(__file__).resolve().parent.parent / "tools" / "floor"
LINE = re.compile(r"p50 (\d+\.\d) us p99 (\d+\.\d) us")


@pytest.fixture(scope="module")
def c_floor(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed: the C floor harness cannot be built")
    binary = tmp_path_factory.mktemp("floor") / "small_request_floor"
    build = subprocess.run(["gcc", "-O2", "-Wall", "-Werror", "-o", str(binary), str(FLOOR / "small_request_floor.c"),
                            "-lz", "-lpthread"], capture_output=True, text=True)
    if build.returncode and "zlib.h" in build.stderr:
        pytest.skip("zlib's headers (zlib1g-dev) are not installed: the C floor harness cannot be built")
    assert build.returncode == 0, build.stderr
    return binary


def _run(args: list[str]) -> tuple[int, str, str]:
    """Run a harness that dies with this process (the harness's own child dies with it)."""
    proc = popen_foreign(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out, err


def _latencies(args: list[str]) -> tuple[float, float]:
    code, out, err = _run(args)
    assert code == 0, err
    found = LINE.search(out)
    assert found, out
    p50, p99 = float(found.group(1)), float(found.group(2))
    assert 0 < p50 <= p99
    return p50, p99


@pytest.mark.parametrize("mode", ["0", "1"], ids=["wake", "poll"])
def test_c_floor_moves_and_checks_its_requests(c_floor: Path, mode: str) -> None:
    _latencies([str(c_floor), "200", mode, "0", "8", "4096"])


def test_c_floor_refuses_a_bad_command_line(c_floor: Path) -> None:
    code, _, err = _run([str(c_floor), "10", "0", "0", "65", "4096"])
    assert code == 2 and "PAGES 1-64" in err  # more pages than a request may carry: refused, nothing runs


def test_python_floor_moves_and_checks_its_requests() -> None:
    _latencies([sys.executable, str(FLOOR / "small_request_floor.py"), "200", "0", "8", "4096"])
