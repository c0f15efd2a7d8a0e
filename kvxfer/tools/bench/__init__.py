"""``kvxfer bench``: throughput of kvxfer against a raw baseline and the peers, as ratios from one run.

Each case moves the same bytes (default 1 GiB on tcp) as pages of a given size between two engine
processes, destination pages allocated at random so they are scattered across the decode pool,
``--repeat`` times; the table reports the median and the spread. Baselines are cases of their own:
``ib_write_bw`` on the same device for verbs; the plain two-process socket stream and, when
installed, Mooncake's and NIXL's TCP paths for tcp (:mod:`.baselines`). Speed targets are judged on
the printed ratios, never by timed unit tests.

Every process a bench starts (engine nodes, peers, ``ib_write_bw``) dies with it (:mod:`kvxfer.tools.procs`);
a stop signal closes every session that was started, without the closing measurements.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .. import procs
from ..node import NodeSpec, spawn


@dataclass
class BenchConfig:
    transport: str = "tcp"
    total_bytes: int = 1 << 30
    page_sizes: list[int] = field(default_factory=lambda: [65536, 4096])
    request_bytes: int = 32 << 20
    concurrency: int = 4
    repeat: int = 5
    checks: str = "both"  # on, off, both
    baselines: list[str] = field(default_factory=lambda: ["raw-socket", "mooncake-tcp", "nixl-ucx-tcp", "ib_write_bw"])
    ib_device: str | None = None
    gid_index: int | None = None
    total_bytes_small_pages: int | None = None


@dataclass
class CaseResult:
    transport: str
    page_bytes: int
    bytes: int
    seconds: float
    checks: str
    runs: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    error: str = ""

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0

    @property
    def pages_per_s(self) -> float:
        return self.bytes / self.page_bytes / self.seconds if self.seconds else 0.0

    def spread(self) -> tuple[float, float]:
        if not self.runs:
            return 0.0, 0.0
        rates = [self.bytes / s / 1e9 for s in self.runs if s > 0]
        return min(rates), max(rates)

    def to_dict(self) -> dict[str, Any]:
        low, high = self.spread()
        return {
            "transport": self.transport,
            "page_bytes": self.page_bytes,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 6),
            "gbps": round(self.gbps, 4),
            "pages_per_s": round(self.pages_per_s, 1),
            "checks": self.checks,
            "repeats": len(self.runs),
            "gbps_min": round(low, 4),
            "gbps_max": round(high, 4),
            "error": self.error,
            **self.extra,
        }


class Session:
    """One contestant kept running across rounds; ``run_once`` moves ``bytes`` once, returns seconds."""

    def __init__(self, result: CaseResult) -> None:
        self.result = result

    def start(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def run_once(self) -> float:  # pragma: no cover - overridden
        raise NotImplementedError

    def close(self, *, measure: bool = True) -> None:  # pragma: no cover - overridden
        """Stop the contestant's processes; ``measure=False`` (a stop signal): skip closing measurements."""


def _geometry(config: BenchConfig, page_bytes: int) -> tuple[int, int, int, int]:
    """(pages per round, pages per request, requests per round, pool pages)."""
    total = config.total_bytes
    if page_bytes < 16384 and config.total_bytes_small_pages:
        total = config.total_bytes_small_pages
    pages_total = max(1, total // page_bytes)
    per_request = max(1, min(pages_total, config.request_bytes // page_bytes))
    requests = -(-pages_total // per_request)
    return requests * per_request, per_request, requests, 2 * per_request * config.concurrency


class KvxferSession(Session):
    """A prefill and a decode node; each round is ``requests`` requests with up to ``concurrency``
    in flight, destination and source pages at random across the pools."""

    def __init__(self, config: BenchConfig, page_bytes: int, checks: str, node_log: Any) -> None:
        pages, self.per_request, self.requests, pool_pages = _geometry(config, page_bytes)
        super().__init__(CaseResult(transport=f"kvxfer-{config.transport}", page_bytes=page_bytes,
                                    bytes=pages * page_bytes, seconds=0.0, checks=checks))
        self.config = config
        engine = {
            "max_context": self.per_request,
            "transport": config.transport,
            "checksum": "adler32" if checks == "on" else "none",
            "peer_timeout": 120.0,
            "transfer_timeout": 600.0,
            "ib_device": config.ib_device,
            "gid_index": config.gid_index,
            "alloc_policy": "random",
        }
        self.decode_spec = NodeSpec(role="decode", num_buffers=1, item_len=page_bytes, num_pages=pool_pages,
                                    page_size=1, config={**engine, "seed": 1})
        self.prefill_spec = NodeSpec(role="prefill", num_buffers=1, item_len=page_bytes,
                                     num_pages=pool_pages // 2 + self.per_request, page_size=1,
                                     config={**engine, "seed": 2})
        self.node_log = node_log
        self.decode: Any = None
        self.prefill: Any = None
        self.round = 0
        self.post_rates: list[float] = []

    def start(self) -> None:
        self.decode = spawn(self.decode_spec, stderr=self.node_log)
        self.prefill = spawn(self.prefill_spec, stderr=self.node_log)
        self.peer = self.decode.connect(address=self.prefill.control)
        self.rss_start = self.decode.rss()

    def run_once(self) -> float:
        self.round += 1
        plan = [[f"r{self.round}-{i}", self.per_request] for i in range(self.requests)]
        self.decode.bench_start(requests=plan, concurrency=self.config.concurrency, peer=self.peer)
        self.prefill.bench_start(requests=plan, concurrency=self.config.concurrency)
        received = self.decode.bench_wait(timeout=3600)
        sent = self.prefill.bench_wait(timeout=3600)
        if not received or "error" in received or received.get("failed"):
            raise RuntimeError(f"decode half: {received}")
        if not sent or "error" in sent or sent.get("failed"):
            raise RuntimeError(f"prefill half: {sent}")
        if sent.get("post_rate"):
            self.post_rates.append(sent["post_rate"])
        return float(received["seconds"])

    def close(self, *, measure: bool = True) -> None:
        if self.decode is not None and measure:
            try:
                end = self.decode.rss()
                growth = end["peak_rss"] - self.rss_start["rss"]
                self.result.extra["decode_rss_growth_of_moved"] = round(
                    growth / max(1, self.result.bytes * max(1, self.round)), 5)
                path = self.decode.stats().get("data_path", {})
                if path.get("busy_seconds"):
                    self.result.extra["recv_payload_share"] = round(path["payload_seconds"] / path["busy_seconds"], 3)
            except Exception:  # the numbers are extras; never fail the bench on them
                pass
        if self.post_rates:
            self.result.extra["wr_post_rate_per_s"] = round(statistics.median(self.post_rates), 1)
        for node in (self.prefill, self.decode):
            if node is not None:
                node.close()


class PeerSession(Session):
    """A baseline or peer (kvxfer.tools.bench.peers): a target and an initiator process."""

    def __init__(self, name: str, config: BenchConfig, page_bytes: int) -> None:
        pages, _per, _req, pool_pages = _geometry(config, page_bytes)
        super().__init__(CaseResult(transport=name, page_bytes=page_bytes, bytes=pages * page_bytes,
                                    seconds=0.0, checks="off"))
        self.args = [name, str(pages), str(page_bytes), str(pool_pages)]
        self.procs: list[Any] = []

    def _spawn(self, role: str, *extra: str) -> tuple[Any, dict[str, Any]]:
        import os
        import subprocess
        import sys

        env = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES="lo", PYTHONUNBUFFERED="1")
        proc = procs.popen([sys.executable, "-m", "kvxfer.tools.bench.peers", self.args[0], role, *self.args[1:], *extra],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        self.procs.append(proc)
        info = self._read(proc) or {"error": f"{role} exited with {proc.wait()}"}
        if "error" in info:
            raise RuntimeError(info["error"])
        return proc, info

    @staticmethod
    def _read(proc: Any) -> dict[str, Any] | None:
        """The next JSON object line; libraries (NIXL, UCX) may print their own lines to stdout."""
        while True:
            line = proc.stdout.readline()
            if not line:
                return None
            line = line.strip()
            if line.startswith("{"):
                try:
                    return json.loads(line)
                except ValueError:
                    continue

    def start(self) -> None:
        _target, info = self._spawn("target")
        self.initiator, _ = self._spawn("initiator", json.dumps(info))

    def run_once(self) -> float:
        self.initiator.stdin.write("go\n")
        self.initiator.stdin.flush()
        info = self._read(self.initiator) or {"error": "initiator died"}
        if "error" in info:
            raise RuntimeError(info["error"])
        return float(info["seconds"])

    def close(self, *, measure: bool = True) -> None:
        for proc in reversed(self.procs):
            try:
                proc.stdin.write("quit\n")
                proc.stdin.close()
            except (OSError, ValueError):
                pass
        for proc in self.procs:
            procs.stop(proc, grace=20.0 if measure else 2.0)


def sessions_for(config: BenchConfig, page_bytes: int, node_log: Any) -> list[Session]:
    from . import baselines

    checks = ["on", "off"] if config.checks == "both" else [config.checks]
    out: list[Session] = [KvxferSession(config, page_bytes, c, node_log) for c in checks]
    for name in config.baselines:
        runner = baselines.RUNNERS.get(name)
        if runner is not None and config.transport in runner.transports:
            out.append(runner.session(config, page_bytes))
    return out


def run_bench(config: BenchConfig, *, json_path: str | None = None) -> int:
    """Every case of a page size runs in interleaved rounds (a warm-up round first, not counted), so
    that drift on a noisy machine hits all of them alike; the median round is reported."""
    import tempfile

    from rich.console import Console
    from rich.table import Table

    console = Console()
    results: list[CaseResult] = []
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as node_log:
        for page_bytes in config.page_sizes:
            sessions = sessions_for(config, page_bytes, node_log)
            try:
                _run_rounds(config, page_bytes, sessions, results, console)
            except BaseException:  # a stop signal: close whatever was started, fast
                for session in sessions:
                    session.close(measure=False)
                raise
        if any(r.error and r.transport.startswith("kvxfer") for r in results):
            node_log.seek(0)
            tail = node_log.read()[-3000:]
            if tail.strip():
                console.print(tail, markup=False, highlight=False)
    table = Table(title=f"kvxfer bench ({config.transport}): median of {config.repeat} interleaved rounds")
    for column in ("case", "page", "checks", "GB/s", "spread", "pages/s", "note"):
        table.add_column(column, overflow="fold")
    for r in results:
        low, high = r.spread()
        note = r.error or ("" if "decode_rss_growth_of_moved" not in r.extra else
                           f"rss +{100 * r.extra['decode_rss_growth_of_moved']:.1f}% of moved")
        table.add_row(r.transport, f"{r.page_bytes:,}", r.checks, f"{r.gbps:.3f}", f"{low:.3f}-{high:.3f}",
                      f"{r.pages_per_s:,.0f}", note)
    console.print(table)
    ratios = compute_ratios(results)
    for line in ratios:
        console.print(line["text"])
    console.print(f"bench took {time.monotonic() - started:.1f} s")
    if json_path:
        Path(json_path).write_text(json.dumps({
            "config": asdict(config),
            "cases": [r.to_dict() for r in results],
            "ratios": ratios,
        }, indent=2) + "\n")
    return 1 if any(r.error and r.transport.startswith("kvxfer") for r in results) else 0


def _run_rounds(config: BenchConfig, page_bytes: int, sessions: list[Session], results: list[CaseResult],
                console: Any) -> None:
    """Start the sessions of one page size, run the interleaved rounds, close them."""
    live: list[Session] = []
    for session in sessions:
        results.append(session.result)
        try:
            session.start()
            live.append(session)
        except Exception as exc:
            session.result.error = f"{type(exc).__name__}: {exc}"
            session.close()
    console.print(f"{page_bytes:,} B pages: {', '.join(s.result.transport + ('' if s.result.checks == 'off' or not s.result.transport.startswith('kvxfer') else ' (checks on)') for s in live)}; {config.repeat} rounds")
    for round_no in range(config.repeat + 1):
        shift = round_no % max(1, len(live))
        for session in live[shift:] + live[:shift]:
            if session.result.error:
                continue
            try:
                seconds = session.run_once()
            except Exception as exc:
                session.result.error = f"{type(exc).__name__}: {exc}"
                continue
            if round_no:
                session.result.runs.append(seconds)
    for session in live:
        session.close()
        if session.result.runs:
            session.result.seconds = statistics.median(session.result.runs)


def compute_ratios(results: list[CaseResult]) -> list[dict[str, Any]]:
    """kvxfer (checks on) against every other case of the same page size.

    The ratio is the median over rounds of the per-round speed ratio: both cases ran in the same
    round, back to back, so drift of a shared, noisy machine cancels out. The ratio of the medians
    is kept beside it."""
    out = []
    by = {(r.transport, r.page_bytes, r.checks): r for r in results if not r.error and r.seconds}
    for (transport, page, checks), r in by.items():
        if not transport.startswith("kvxfer") or checks != "on":
            continue
        for (other_t, other_p, other_c), o in by.items():
            if other_p != page or (other_t, other_c) == (transport, checks):
                continue
            label = other_t if other_t != transport else f"{other_t} checks {other_c}"
            of_medians = r.gbps / o.gbps if o.gbps else 0.0
            paired = [(o_s / o.bytes) / (r_s / r.bytes) for r_s, o_s in zip(r.runs, o.runs) if r_s and o_s]
            ratio = statistics.median(paired) if paired else of_medians
            pps = ratio * (o.page_bytes / r.page_bytes)
            out.append({"case": transport, "page_bytes": page, "against": label, "gbps_ratio": round(ratio, 3),
                        "pages_per_s_ratio": round(pps, 3), "ratio_of_medians": round(of_medians, 3),
                        "rounds": len(paired),
                        "text": f"{transport} (checks on) / {label} at {page:,} B: {ratio:.2f}x "
                                f"(median of {len(paired)} paired rounds; ratio of medians {of_medians:.2f}x)"})
    return out


__all__ = ["BenchConfig", "CaseResult", "KvxferSession", "PeerSession", "Session", "run_bench"]
