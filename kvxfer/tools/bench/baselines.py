"""Baselines and peers measured beside kvxfer in the same ``kvxfer bench`` run.

Each runner moves the same bytes the same way as far as its tool allows and returns a
:class:`~kvxfer.tools.bench.cases.CaseResult` named by its ``transport`` field (``ib_write_bw``,
``raw-socket``, ``mooncake-tcp``, ``nixl-ucx-tcp``). A runner whose tool is not installed returns a
result carrying the reason, so the table says what was skipped and why. ``ib_write_bw`` runs under
:func:`kvxfer.tools.procs.popen_foreign`: it dies with the bench.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from typing import Any

from .. import procs
from .cases import BenchConfig, CaseResult, PeerSession, Session


@dataclass
class Runner:
    """A baseline or peer the bench can run: its name, the transports it is measured on, and its session class."""

    name: str
    transports: tuple[str, ...]
    session_cls: Any

    def session(self, config: BenchConfig, page_bytes: int) -> Any:
        return self.session_cls(self.name, config, page_bytes)


class IbWriteBwSession(Session):
    """perftest's ib_write_bw, server and client on the same device (loopback), -D seconds a round."""

    DURATION = 3

    def __init__(self, name: str, config: BenchConfig, page_bytes: int) -> None:
        super().__init__(CaseResult(transport="ib_write_bw", page_bytes=page_bytes, bytes=config.total_bytes,
                                    seconds=0.0, checks="off"))
        self.config = config
        self.port = 18515

    def start(self) -> None:
        self.binary = shutil.which("ib_write_bw")
        if self.binary is None:
            raise RuntimeError("ib_write_bw not installed (apt-get install perftest)")
        self.result.extra["tool"] = "perftest ib_write_bw"

    def run_once(self) -> float:
        config = self.config
        verbs = config.transport_options.get("verbs") or {}
        if not isinstance(verbs, dict):  # a VerbsOptions
            verbs = vars(verbs)
        device = verbs.get("device") or "rxe0"  # the soft-RoCE VM's device and GID index by default
        gid = str(verbs["gid_index"] if verbs.get("gid_index") is not None else 1)
        address = os.environ.get("KVXFER_VM_IP", "127.0.0.1")
        self.port += 1
        args = ["-d", device, "-x", gid, "-F", "-s", str(self.result.page_bytes), "-D", str(self.DURATION),
                "-p", str(self.port)]
        server = procs.popen_foreign([self.binary, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        client = None
        try:
            time.sleep(1.0)
            client = procs.popen_foreign([self.binary, *args, address], stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True)
            client_out, client_err = client.communicate(timeout=120)
            server_out, _ = server.communicate(timeout=120)
        finally:  # a timeout or a stop signal: neither outlives the round
            for proc in (client, server):
                if proc is not None and proc.poll() is None:
                    proc.kill()
                    proc.wait()
        rate = _parse_perftest(client_out) or _parse_perftest(server_out)
        if rate is None:
            raise RuntimeError(f"could not parse ib_write_bw output: {client_out[-300:]} {client_err[-300:]}")
        return self.result.bytes / (rate * 2**20)  # perftest's MB/sec is MiB/s


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
    "raw-socket": Runner("raw-socket", ("tcp",), PeerSession),
    "mooncake-tcp": Runner("mooncake-tcp", ("tcp",), PeerSession),
    "nixl-ucx-tcp": Runner("nixl-ucx-tcp", ("tcp",), PeerSession),
    "ib_write_bw": Runner("ib_write_bw", ("verbs",), IbWriteBwSession),
}
