"""The cases of ``kvxfer bench``: its configuration, a case's result, and the sessions that run one case.

:class:`KvxferSession` drives two engine nodes (:mod:`kvxfer.tools.node`); :class:`PeerSession` a
baseline or peer process pair (:mod:`.peers`). They live here, not in the package's ``__init__``, so
that :mod:`.baselines` builds on them while the bench (:func:`kvxfer.tools.bench.run_bench`) imports
:mod:`.baselines`: the dependency runs one way, with no import cycle.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass, field
from typing import Any

from .. import procs
from ..node import NodeSpec, spawn


def side_cpus(config: BenchConfig, side: str) -> list[int] | None:
    """With ``config.pin``, the CPUs of ``side`` ("prefill": the first half of the CPUs this process
    may use, "decode": the rest); None without it, or with fewer than two CPUs to split."""
    if not config.pin:
        return None
    import os

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    half = len(cpus) // 2
    return cpus[:half] if side == "prefill" else cpus[half:]


class Unavailable(RuntimeError):
    """A contestant cannot run on this machine (its tool is not installed); the message says what
    to install. The bench skips it with that one line instead of reporting a failed case."""


@dataclass
class BenchConfig:
    """What one ``kvxfer bench`` run measures: transport, bytes per case, page sizes, requests, rounds, baselines."""

    transport: str = "tcp"
    total_bytes: int = 1 << 30
    page_sizes: list[int] = field(default_factory=lambda: [65536, 4096])
    request_bytes: int = 32 << 20
    concurrency: int = 4
    repeat: int = 5
    checks: str = "both"  # on, off, both
    baselines: list[str] = field(default_factory=lambda: ["raw-socket", "native-stream", "mooncake-tcp",
                                                          "nixl-ucx-tcp", "ib_write_bw", "scattered-memcpy",
                                                          "two-copy-memcpy"])
    transport_options: dict[str, Any] = field(default_factory=dict)  # EngineConfig.transport_options
    total_bytes_small_pages: int | None = None
    compare_windows: bool = False  # verbs: kvxfer with memory windows on and off, as two cases
    compare_inline: bool = False  # tcp, shm: also kvxfer with inline_send off (every send from a sending thread)
    tp: str | None = None  # "P:1": also prefill TP P into decode TP 1, its own case (kvxfer.tools.bench.tp)
    # --first-request (kvxfer.tools.bench.first): first request to fresh decodes against steady state
    first_request: bool = False
    first_request_decodes: int = 16  # fresh decode processes, cold and peered ahead in turn
    first_request_steady: int = 8  # steady requests on each pair after its first
    first_request_transports: list[str] | None = None  # None: every registered transport this machine runs
    # --small-requests (kvxfer.tools.bench.small): per-request latency of requests of these many pages
    small_requests: list[int] | None = None
    small_requests_count: int = 200  # requests per round and size
    caller_busy_ms: float = 0.0  # the prefill's caller holds the interpreter this long after each send()
    # --pin: the prefill side's processes (kvxfer's prefill, a peer's initiator) on one half of this
    # machine's CPUs, the decode side's (kvxfer's decode, a peer's target) on the other: two machines
    pin: bool = False


@dataclass
class CaseResult:
    """One case's measurement: bytes moved per round, the median round's seconds (``seconds``), every counted
    round (``runs``), extras, and the error that stopped it, if any."""

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


def record_latency(result: CaseResult, latencies: list[float], request_pages: int,
                   measured_from: str = "initialize_xfer-to-DONE") -> None:
    """Per-request latency p50 and p99 (nearest rank) over every request of the counted rounds, into
    ``result.extra``."""
    if not latencies:
        return
    result.extra.update({
        "latency_from": measured_from,
        "request_bytes": request_pages * result.page_bytes,
        "latency_requests": len(latencies),
        **p50_p99("latency", latencies),
    })


def p50_p99(prefix: str, seconds: list[float]) -> dict[str, float]:
    """``{prefix}_p50_s`` and ``{prefix}_p99_s``: nearest-rank percentiles of ``seconds`` (not empty)."""
    ordered = sorted(seconds)
    return {f"{prefix}_p50_s": round(percentile(ordered, 50), 6), f"{prefix}_p99_s": round(percentile(ordered, 99), 6)}


class KvxferSession(Session):
    """A prefill and a decode node; each round is ``requests`` requests with up to ``concurrency``
    in flight, destination and source pages at random across the pools."""

    def __init__(self, config: BenchConfig, page_bytes: int, checks: str, node_log: Any,
                 windows: str | None = None, inline: bool = True) -> None:
        pages, self.per_request, self.requests, pool_pages = _geometry(config, page_bytes)
        # ``windows`` (verbs): force memory windows "on" or "off" for this case; "off" is its own case name;
        # ``inline`` False (tcp, shm): every send from a sending thread, the case "kvxfer-<transport>-lanes"
        name = f"kvxfer-{config.transport}" + ("-windows-off" if windows == "off" else "") + ("" if inline else "-lanes")
        super().__init__(CaseResult(transport=name, page_bytes=page_bytes,
                                    bytes=pages * page_bytes, seconds=0.0, checks=checks))
        self.config = config
        options = {key: dict(value) if isinstance(value, dict) else value
                   for key, value in (config.transport_options or {}).items()}
        if windows is not None:
            verbs = options.get("verbs") or {}
            options["verbs"] = {**(verbs if isinstance(verbs, dict) else vars(verbs)), "windows": windows}
            self.result.extra["windows"] = windows
        if not inline:
            own = options.get(config.transport) or {}
            options[config.transport] = {**(own if isinstance(own, dict) else vars(own)), "inline_send": False}
        engine = {
            "max_context": self.per_request,
            "transport": config.transport,
            "checksum": "adler32" if checks == "on" else "none",
            "peer_timeout": 120.0,
            "transfer_timeout": 600.0,
            "transport_options": options,
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
        self.latencies: list[float] = []  # admit-to-READABLE seconds of every request of the counted rounds
        self.data_latencies: list[float] = []  # send()-to-READABLE seconds (one request in flight at a time)
        self.noticed_latencies: list[float] = []  # send() to the decode's wait() returning it READABLE
        self.result_latencies: list[float] = []  # send() to the prefill's wait() returning it SUCCEEDED (its RESULT)
        self.cpu_seconds = {"prefill": 0.0, "decode": 0.0}  # each node process's CPU time over the counted rounds
        self.cpu_requests = 0

    def start(self) -> None:
        self.decode = spawn(self.decode_spec, stderr=self.node_log, cpus=side_cpus(self.config, "decode"))
        self.prefill = spawn(self.prefill_spec, stderr=self.node_log, cpus=side_cpus(self.config, "prefill"))
        self.peer = self.decode.connect(address=self.prefill.control)
        self.rss_start = self.decode.rss()

    def run_once(self) -> float:
        self.round += 1
        plan = [[f"r{self.round}-{i}", self.per_request] for i in range(self.requests)]
        cpu_before = {"prefill": process_cpu_seconds(self.prefill.pid), "decode": process_cpu_seconds(self.decode.pid)}
        self.decode.bench_start(requests=plan, concurrency=self.config.concurrency, peer=self.peer)
        self.prefill.bench_start(requests=plan, concurrency=self.config.concurrency,
                                 busy_ms=self.config.caller_busy_ms)
        received = self.decode.bench_wait(timeout=3600)
        sent = self.prefill.bench_wait(timeout=3600)
        if self.round > 1:  # CPU time per request, each side (every thread of its process, GIL holder or not)
            for side, node in (("prefill", self.prefill), ("decode", self.decode)):
                self.cpu_seconds[side] += process_cpu_seconds(node.pid) - cpu_before[side]
            self.cpu_requests += self.requests
            for side, seconds in self.cpu_seconds.items():
                self.result.extra[f"{side}_cpu_us_per_request"] = round(1e6 * seconds / self.cpu_requests, 1)
        if not received or "error" in received or received.get("failed"):
            raise RuntimeError(f"decode half: {received}")
        if not sent or "error" in sent or sent.get("failed"):
            raise RuntimeError(f"prefill half: {sent}")
        if sent.get("post_rate"):
            self.post_rates.append(sent["post_rate"])
        readable, posted = received.get("readable_at") or [], sent.get("posted_at") or []
        noticed = received.get("noticed_at") or []
        finished = sent.get("finished_at") or []
        if self.round > 1:  # the first round is the bench's uncounted warm-up
            self.latencies.extend(received.get("latencies", ()))
            if self.config.concurrency == 1 and len(readable) == len(posted):  # request i is request i on both
                self.data_latencies.extend(r - p for r, p in zip(readable, posted))
                if len(noticed) == len(posted):
                    self.noticed_latencies.extend(n - p for n, p in zip(noticed, posted))
                if len(finished) == len(posted) and not self.config.caller_busy_ms:  # the prefill's RESULT
                    self.result_latencies.extend(s - p for s, p in zip(finished, posted))
        # per-request latency, admission to READABLE (verified) on the decode side
        record_latency(self.result, self.latencies, self.per_request, "admit-to-READABLE")
        if self.data_latencies:  # and from the prefill's send() to READABLE: the data path's share
            self.result.extra.update(p50_p99("send_latency", self.data_latencies))
        if self.noticed_latencies:  # and to the decode's wait() returning: when its consumer learns it
            self.result.extra.update(p50_p99("noticed_latency", self.noticed_latencies))
        if self.result_latencies:  # and to the prefill's wait() returning: RESULT taken, its sources free
            self.result.extra.update(p50_p99("succeeded_latency", self.result_latencies))
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
                if path.get("write_window"):
                    self.result.extra["write_window"] = path["write_window"]
                windows = path.get("windows") or {}
                if windows.get("granted"):
                    self.result.extra.update({
                        "window_bind_us_per_request": windows["bind_us_per_request"],
                        "window_invalidate_us_per_request": windows["invalidate_us_per_request"],
                        "windows_per_request": round(windows["windows_bound"] / windows["granted"], 2),
                        "wide_window_requests": windows["wide"],
                    })
            except Exception:  # the numbers are extras; never fail the bench on them
                pass
        if self.post_rates:
            self.result.extra["wr_post_rate_per_s"] = round(statistics.median(self.post_rates), 1)
        for node in (self.prefill, self.decode):
            if node is not None:
                node.close()


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` so far, all its threads (``/proc/PID/stat``; 0.0
    where there is no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime (fields 14 and 15 of stat)


def percentile(ordered: list[float], pct: float) -> float:
    """Nearest-rank percentile of an ascending list (not empty)."""
    import math

    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


class PeerSession(Session):
    """A baseline or peer (kvxfer.tools.bench.peers): a target and an initiator process.

    Between its own rounds a peer's processes are stopped (SIGSTOP, SIGCONT before its next round
    and before closing): a library thread that polls while idle (NIXL's target progress thread
    spins on a core) would otherwise run through every other contestant's rounds. Measured before:
    with NIXL installed, kvxfer's 64 KiB rounds in the same run fell from ~3.8 to ~2.1 GB/s. A
    stopped process still dies with the bench (a fatal signal ends a stopped process)."""

    def __init__(self, name: str, config: BenchConfig, page_bytes: int, checks: str = "off") -> None:
        pages, _per, _req, pool_pages = _geometry(config, page_bytes)
        super().__init__(CaseResult(transport=name, page_bytes=page_bytes, bytes=pages * page_bytes,
                                    seconds=0.0, checks=checks))
        self.args = [name, str(pages), str(page_bytes), str(pool_pages)]
        self.config = config
        self.procs: list[Any] = []
        self.request_pages, self.concurrency = _per, config.concurrency
        self.rounds = 0
        self.latencies: list[float] = []  # per-request seconds of the counted rounds, where the peer reports them
        self.notified: list[float] = []  # NIXL: initialize_xfer to the target's notification, same rounds

    def _spawn(self, role: str, *extra: str) -> tuple[Any, dict[str, Any]]:
        import os
        import subprocess
        import sys

        env = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES="lo", PYTHONUNBUFFERED="1")
        side = "decode" if role == "target" else "prefill"
        proc = procs.popen([sys.executable, "-m", "kvxfer.tools.bench.peers", self.args[0], role, *self.args[1:], *extra],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                           cpus=side_cpus(self.config, side))
        self.procs.append(proc)
        info = self._read(proc) or {"error": f"{role} exited with {proc.wait()}"}
        if "unavailable" in info:
            raise Unavailable(info["unavailable"])
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

    def target_options(self) -> list[str]:
        """Extra arguments of the target process (``native-stream``: its checks setting as JSON)."""
        return [json.dumps({"checks": self.result.checks})] if self.result.checks == "on" else []

    def start(self) -> None:
        self.target, info = self._spawn("target", *self.target_options())
        info.update(request_pages=self.request_pages, concurrency=self.concurrency)
        self.initiator, _ = self._spawn("initiator", json.dumps(info))
        self._park(True)

    def _park(self, stopped: bool) -> None:
        """Stop (``True``) or continue every process of this peer that is still running."""
        import signal

        for proc in self.procs:
            if proc.poll() is None:
                try:
                    proc.send_signal(signal.SIGSTOP if stopped else signal.SIGCONT)
                except ProcessLookupError:
                    pass

    def run_once(self) -> float:
        self._park(False)
        try:
            self.initiator.stdin.write("go\n")
            self.initiator.stdin.flush()
            info = self._read(self.initiator) or {"error": "initiator died"}
            arrivals = self._arrivals(info.get("began")) if "error" not in info else {}
        finally:
            self._park(True)
        if "error" in info:
            raise RuntimeError(info["error"])
        self.rounds += 1
        if self.rounds > 1 and info.get("latencies"):  # the first round is the bench's uncounted warm-up
            self.latencies.extend(info["latencies"])
            record_latency(self.result, self.latencies, self.request_pages,
                           "initialize_xfer-to-DONE" if self.args[0].startswith("nixl") else "batch_transfer_sync_write")
            began = info.get("began") or {}
            self.notified.extend(arrivals[tag] - began[tag] for tag in began if tag in arrivals)
            if self.notified:
                self.result.extra.update({"notified_from": "initialize_xfer-to-target-notification",
                                          "notified_requests": len(self.notified), **p50_p99("notified", self.notified)})
        return float(info["seconds"])

    def _arrivals(self, began: dict[str, float] | None) -> dict[str, float]:
        """NIXL: when each of the round's notifications reached the target (its own clock, which the
        initiator shares); empty for peers that send none."""
        if not began:
            return {}
        self.target.stdin.write(f"arrivals {len(began)}\n")
        self.target.stdin.flush()
        reply = self._read(self.target) or {}
        arrivals = reply.get("arrivals") or {}
        if self.rounds >= 1 and len(arrivals) < len(began):  # counted rounds only: say what did not arrive
            raise RuntimeError(f"{len(began) - len(arrivals)} of {len(began)} NIXL notifications never reached "
                               "the target within 10 s")
        return arrivals

    def close(self, *, measure: bool = True) -> None:
        self._park(False)
        for proc in reversed(self.procs):
            try:
                proc.stdin.write("quit\n")
                proc.stdin.close()
            except (OSError, ValueError):
                pass
        for proc in self.procs:
            procs.stop(proc, grace=20.0 if measure else 2.0)
