"""Baselines and peers measured beside kvxfer in the same ``kvxfer bench`` run.

Each runner moves the same bytes the same way as far as its tool allows and returns a
:class:`~kvxfer.bench.CaseResult` named by its ``transport`` field (``ib_write_bw``,
``raw-socket``, ``mooncake-tcp``, ``nixl-ucx-tcp``). A runner whose tool is not installed returns a
result carrying the reason, so the table says what was skipped and why.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass
from typing import Any

from . import BenchConfig, CaseResult


@dataclass
class Runner:
    name: str
    transports: tuple[str, ...]
    fn: Any

    def run(self, config: BenchConfig, page_bytes: int) -> CaseResult:
        return self.fn(config, page_bytes)


def _ib_write_bw(config: BenchConfig, page_bytes: int) -> CaseResult:
    """perftest's ib_write_bw, server and client on the same device (loopback), -D seconds each."""
    result = CaseResult(transport="ib_write_bw", page_bytes=page_bytes, bytes=0, seconds=0.0, checks="off")
    binary = shutil.which("ib_write_bw")
    if binary is None:
        result.error = "ib_write_bw not installed (apt-get install perftest)"
        return result
    device = config.ib_device or os.environ.get("KVXFER_RDMA_DEVICE", "rxe0")
    gid = str(config.gid_index if config.gid_index is not None else os.environ.get("KVXFER_GID_INDEX", "1"))
    address = os.environ.get("KVXFER_VM_IP", "127.0.0.1")
    duration = 3
    rates = []
    port = 18515
    for _ in range(config.repeat):
        port += 1
        args = ["-d", device, "-x", gid, "-F", "-s", str(page_bytes), "-D", str(duration), "-p", str(port)]
        server = subprocess.Popen([binary, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(1.0)
        client = subprocess.run([binary, *args, address], capture_output=True, text=True, timeout=120)
        server_out, _ = server.communicate(timeout=120)
        rate = _parse_perftest(client.stdout) or _parse_perftest(server_out)
        if rate is None:
            result.error = f"could not parse ib_write_bw output: {client.stdout[-300:]} {client.stderr[-300:]}"
            return result
        rates.append(rate)
    # perftest reports MB/s with MB = 2**20 bytes
    median = statistics.median(rates) * 2**20
    result.bytes = int(median * duration)
    result.seconds = float(duration)
    result.runs = [result.bytes / (r * 2**20) for r in rates]
    result.extra["tool"] = "perftest ib_write_bw"
    return result


def _parse_perftest(text: str) -> float | None:
    """BW average (MB/sec) from perftest's result line: '#bytes #iterations BW peak BW average MsgRate'."""
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 4 and re.fullmatch(r"\d+", fields[0]) and re.fullmatch(r"\d+", fields[1]):
            try:
                return float(fields[3])
            except ValueError:
                continue
    return None


RUNNERS: dict[str, Runner] = {
    "ib_write_bw": Runner("ib_write_bw", ("verbs",), _ib_write_bw),
}
