"""Baselines and peers measured beside kvxfer in the same ``kvxfer bench`` run.

Each runner moves the same bytes the same way as far as its tool allows and returns a
:class:`~kvxfer.tools.bench.cases.CaseResult` named by its ``transport`` field (``ib_write_bw``,
``raw-socket``, ``native-stream``, ``mooncake-tcp``, ``nixl-ucx-tcp``, ``scattered-memcpy``, ``two-copy-memcpy``). A runner whose tool is not
installed is skipped before anything starts: :meth:`Runner.missing` names what to install, and the
bench prints that in one line and records it under ``skipped`` in its JSON, with no row or ratio.
``ib_write_bw`` runs under :func:`kvxfer.tools.procs.popen_foreign`: it dies with the bench.
``scattered-memcpy`` (the shm transport's yardstick) and ``two-copy-memcpy`` (its ceiling: what two
concurrent copies of the round each get, the most a transport that copies every byte twice at once,
writer into a ring and reader out of it, can reach) run in the bench process itself.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any

from .. import procs
from .cases import BenchConfig, CaseResult, PeerSession, Session, Unavailable, _geometry


@dataclass
class Runner:
    """A baseline or peer the bench can run: its name, the transports it is measured on, and its session class."""

    name: str
    transports: tuple[str, ...]
    session_cls: Any
    module: str = ""   # a Python package it needs (found without importing it)
    binary: str = ""   # or a program it needs on PATH
    install: str = ""  # how to get it
    checks: bool = False  # runs once per checks setting of the bench, as kvxfer does (native-stream)

    def session(self, config: BenchConfig, page_bytes: int, checks: str = "off") -> Any:
        if self.checks:
            return self.session_cls(self.name, config, page_bytes, checks)
        return self.session_cls(self.name, config, page_bytes)

    def missing(self) -> str | None:
        """Why this runner cannot run here, as "not installed (<how to install>)", or None."""
        if self.module and importlib.util.find_spec(self.module) is None:
            return f"not installed ({self.install})"
        if self.binary and shutil.which(self.binary) is None:
            return f"not installed ({self.install})"
        return None


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
            raise Unavailable("not installed (apt-get install perftest)")
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


class ScatteredMemcpySession(Session):
    """The shm transport's yardstick: one thread copying the round's pages from random pages of one
    pool to random pages of another (pools as large as kvxfer's decode pool), with the native
    ``copy_runs`` (numpy fancy indexing without the extension): a same-host transfer with no
    protocol, no checks and a single copy.

    With ``copies=2`` (``two-copy-memcpy``) two threads each copy the whole round at the same time,
    between pools of their own, and the round's time is until both finished: the rate each copy gets
    while another runs, which bounds any transport whose bytes are copied twice concurrently (the
    shm ring: the writer into it, the landing thread out of it) on the same memory system."""

    copies = 1

    def __init__(self, name: str, config: BenchConfig, page_bytes: int) -> None:
        pages, _per, _req, pool_pages = _geometry(config, page_bytes)
        super().__init__(CaseResult(transport=name, page_bytes=page_bytes, bytes=pages * page_bytes,
                                    seconds=0.0, checks="off"))
        self.pages = pages
        self.pool_pages = pool_pages

    def start(self) -> None:
        import numpy as np

        from ...core import native

        page = self.result.page_bytes
        # written: every page is resident
        self.pools = [(np.ones((self.pool_pages, page), dtype=np.uint8), np.ones((self.pool_pages, page), dtype=np.uint8))
                      for _ in range(self.copies)]
        self.rng = np.random.default_rng(7)
        self.lib = native.lib if native.provides("copy_runs") else None
        threads = f"{self.copies} thread" + ("s at once" if self.copies > 1 else "")
        self.result.extra["tool"] = f"native copy_runs, {threads}" if self.lib is not None else f"numpy, {threads}"

    def _picks(self) -> Any:
        import numpy as np

        reps = -(-self.pages // self.pool_pages)
        return np.concatenate([self.rng.permutation(self.pool_pages) for _ in range(reps)])[: self.pages]

    def run_once(self) -> float:
        import numpy as np

        page = self.result.page_bytes
        moves: list[Any] = []
        for src_pool, dst_pool in self.pools:
            src, dst = self._picks(), self._picks()
            if self.lib is None:
                moves.append(lambda s=src_pool, d=dst_pool, si=src, di=dst: d.__setitem__(di, s[si]))
                continue
            dst_addr = (np.uint64(dst_pool.ctypes.data) + dst.astype(np.uint64) * np.uint64(page)).tobytes()
            src_addr = (np.uint64(src_pool.ctypes.data) + src.astype(np.uint64) * np.uint64(page)).tobytes()
            lengths = np.full(len(src), page, dtype=np.uint64).tobytes()
            moves.append(lambda d=dst_addr, s=src_addr, n=lengths: self.lib.copy_runs(d, s, n))
        if len(moves) == 1:
            start = time.perf_counter()
            moves[0]()
            return time.perf_counter() - start
        threads = [threading.Thread(target=move) for move in moves[1:]]  # copy_runs releases the GIL
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        moves[0]()
        for thread in threads:
            thread.join()
        return time.perf_counter() - start

    def close(self, *, measure: bool = True) -> None:
        self.pools = []


class TwoCopyMemcpySession(ScatteredMemcpySession):
    """``two-copy-memcpy``: :class:`ScatteredMemcpySession` with two copies at once (its docstring)."""

    copies = 2


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
    "native-stream": Runner("native-stream", ("tcp",), PeerSession, checks=True),
    "mooncake-tcp": Runner("mooncake-tcp", ("tcp",), PeerSession, module="mooncake",
                           install="pip install mooncake-transfer-engine-non-cuda"),
    "nixl-ucx-tcp": Runner("nixl-ucx-tcp", ("tcp",), PeerSession, module="nixl_cu12",
                           install="pip install --no-deps nixl-cu12"),
    "ib_write_bw": Runner("ib_write_bw", ("verbs",), IbWriteBwSession, binary="ib_write_bw",
                          install="apt-get install perftest"),
    "scattered-memcpy": Runner("scattered-memcpy", ("shm",), ScatteredMemcpySession),
    "two-copy-memcpy": Runner("two-copy-memcpy", ("shm",), TwoCopyMemcpySession),
}
