"""``kvxfer bench --first-request``: what the first request to a new decode pays, next to steady state.

One prefill engine (in the bench's own process, long-lived, as a serving prefill is) meets
``--decodes`` fresh decode engines, each its own process that has never peered with it, one at a
time, on every transport this machine runs (tcp, shm; verbs only where it is present, otherwise one
line naming it and why). Fresh decodes take turns between two ways of starting:

* **cold**: peering happens on demand. The clock starts when the caller decides to send request 1
  to this decode, and runs through ``connect()``, both admissions, the transfer and the decode's
  READABLE (verified): what a first request pays when nothing peered before it arrived.
* **peered ahead**: ``connect()`` ran when the decode started, as the engines should do; the decode
  then sits idle (``FIRST_REQUEST_IDLE_S``) and the same first request is timed from the moment
  the caller decides to send it through the decode's READABLE.

Each decode then takes ``--steady`` more requests on the same pair, back to back (**steady**), and
``connect()``'s own duration is reported apart (**handshake**: HELLO, HELLO_ACK, OFFER, the
prefill opening the data connection, ACCEPT; it returns once both halves hold the connection).

How it is timed: the driver notes ``time.monotonic()`` when it decides to send a request, the
decode process notes its own ``time.monotonic()`` when the request became READABLE
(:func:`kvxfer.tools.bench_loops.receive_loop`); every process of a host reads the same monotonic
clock, so a latency is the difference. Every request's latency includes the same driver hop (one
RPC to the decode node that admits it); the cold one has one more (the ``connect`` RPC), whose
round trip is reported (``rpc round trip``) so it can be told apart. A warm-up decode, not counted,
goes first on each transport, so the prefill's own first-use costs fall on no counted decode.

"First request pays no handshake" means: with peering ahead, the first request's latency is within
the noise of steady state (here: its p50 at or under the steady p90; on a loaded machine the p99
would excuse anything), and the handshake shows up only in the cold column. The ratios (peered
ahead / steady p50, cold / steady p50) come from one run and are judged by a reader, never by a
timed unit test. The phases of each column (decode admitted, prefill has the destination, send
posted, READABLE; medians from the caller's decision) show where a first request's extra time goes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..node import NodeSpec, spawn
from .cases import BenchConfig, percentile

FIRST_REQUEST_IDLE_S = 0.5  # peered ahead: the decode idles this long between connect() and request 1
WAIT_S = 600.0


def _summary(values: list[float]) -> dict[str, Any]:
    """p50 and p99 (nearest rank) of ``values`` in seconds, and their count; empty: count 0 only."""
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    return {"n": len(ordered), "p50_s": round(percentile(ordered, 50), 6), "p99_s": round(percentile(ordered, 99), 6),
            "min_s": round(ordered[0], 6), "max_s": round(ordered[-1], 6)}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


class FirstRequestPair:
    """The long-lived prefill of one transport and page size, and the fresh decodes it meets."""

    def __init__(self, config: BenchConfig, transport: str, page_bytes: int, checks: str, node_log: Any) -> None:
        from ...core.layout import KVLayout
        from ...engine import EngineConfig, PrefillEngine

        self.transport, self.page_bytes, self.checks = transport, page_bytes, checks
        self.pages = max(1, config.request_bytes // page_bytes)
        self.node_log = node_log
        engine = {
            "max_context": self.pages,
            "transport": transport,
            "checksum": "adler32" if checks == "on" else "none",
            "peer_timeout": 120.0,
            "transfer_timeout": WAIT_S,
            "transport_options": {key: dict(value) if isinstance(value, dict) else value
                                  for key, value in (config.transport_options or {}).items()},
            "alloc_policy": "random",
        }
        self.decode_config = {**engine, "seed": 1}
        layout = KVLayout.allocate(num_buffers=1, item_len=page_bytes, num_pages=2 * self.pages, page_size=1)
        self.prefill = PrefillEngine(layout, EngineConfig(**{**engine, "seed": 2}))
        self.serial = 0

    def close(self) -> None:
        self.prefill.close()

    def fresh_decode(self) -> Any:
        """A new decode engine process that has never peered with anything. Its node's own bench code
        (imported on first use, a thread started per run) is warmed with an empty run first: that is
        the harness's first-use cost, which a serving decode does not have, not the engine's."""
        spec = NodeSpec(role="decode", num_buffers=1, item_len=self.page_bytes, num_pages=2 * self.pages,
                        page_size=1, config=self.decode_config)
        decode = spawn(spec, stderr=self.node_log)
        try:
            decode.bench_start(requests=[], concurrency=1, peer="nobody")
            decode.bench_wait(timeout=WAIT_S)
        except BaseException:
            decode.close()
            raise
        return decode

    def connect(self, decode: Any) -> tuple[str, float]:
        """``decode.connect(prefill)``: the prefill's engine id and the seconds the call took (driver clock)."""
        began = time.monotonic()
        peer = decode.connect(address=self.prefill.address, timeout=60.0)
        return peer, time.monotonic() - began

    def request(self, decode: Any, peer: str, decided: float) -> dict[str, float]:
        """One request, both halves admitted now, timed from ``decided`` (the driver's monotonic clock):
        ``readable`` (the decode's READABLE, on its monotonic clock) and the phases on the way,
        ``admitted`` (the decode admitted it), ``destination`` (the prefill has its pages: META) and
        ``posted`` (the prefill's send returned). The prefill's half settles before this returns."""
        self.serial += 1
        rid = f"first-{self.serial}"
        decode.bench_start(requests=[[rid, self.pages]], concurrency=1, peer=peer)
        # a failure here leaves the decode's half waiting: the caller closes that decode, which ends it
        self.prefill.admit(rid, self.pages, peer=decode.engine_id)
        self.prefill.wait_ready(rid, timeout=WAIT_S)
        destination = time.monotonic()
        self.prefill.send(rid)
        posted = time.monotonic()
        received = decode.bench_wait(timeout=WAIT_S)
        self.prefill.wait(rid, timeout=WAIT_S)
        if not received or "error" in received or received.get("failed") or not received.get("readable_at"):
            raise RuntimeError(f"decode half of {rid}: {received}")
        readable = float(received["readable_at"][0])
        return {"readable": readable - decided, "admitted": readable - float(received["latencies"][0]) - decided,
                "destination": destination - decided, "posted": posted - decided}

    def rpc_round_trip(self, decode: Any, times: int = 3) -> float:
        """The driver's RPC round trip to ``decode`` (a ping), median of ``times``."""
        trips = []
        for _ in range(times):
            began = time.monotonic()
            decode.ping()
            trips.append(time.monotonic() - began)
        return statistics.median(trips)


PHASES = ("admitted", "destination", "posted", "readable")


def measure(config: BenchConfig, transport: str, page_bytes: int, node_log: Any) -> dict[str, Any]:
    """Every column of one transport and page size (see the module's docstring)."""
    checks = "off" if config.checks == "off" else "on"
    pair = FirstRequestPair(config, transport, page_bytes, checks, node_log)
    handshakes: list[float] = []
    trips: list[float] = []
    columns: dict[str, list[dict[str, float]]] = {"cold": [], "ahead": [], "steady": []}
    paired: dict[str, list[float]] = {"cold": [], "ahead": []}  # first / the same decode's steady median
    from ..progress import current

    bar = current()
    try:
        bar.status(f"{transport}, {page_bytes:,} B pages: warm-up decode")
        warm = pair.fresh_decode()  # not counted: the prefill's own first-use costs land here
        try:
            peer, _ = pair.connect(warm)
            for _ in range(3):
                pair.request(warm, peer, time.monotonic())
        finally:
            warm.close()
        bar.advance()
        for index in range(config.first_request_decodes):
            mode = "cold" if index % 2 == 0 else "ahead"  # in turn, so drift hits both alike
            bar.status(f"{transport}, {page_bytes:,} B pages: fresh decode {index + 1}/{config.first_request_decodes} "
                       f"({mode})")
            decode = pair.fresh_decode()
            try:
                trips.append(pair.rpc_round_trip(decode))
                if mode == "cold":
                    decided = time.monotonic()  # the caller decides: peer now, then the request
                    peer, handshake = pair.connect(decode)
                else:
                    peer, handshake = pair.connect(decode)  # at engine start
                    time.sleep(FIRST_REQUEST_IDLE_S)
                    decided = time.monotonic()
                first = pair.request(decode, peer, decided)
                steady = [pair.request(decode, peer, time.monotonic()) for _ in range(config.first_request_steady)]
            finally:
                decode.close()
            handshakes.append(handshake)
            columns[mode].append(first)
            columns["steady"] += steady
            paired[mode].append(first["readable"] / statistics.median(r["readable"] for r in steady))
            bar.advance()
    finally:
        pair.close()
    out: dict[str, Any] = {
        "transport": transport, "page_bytes": page_bytes, "request_pages": pair.pages,
        "request_bytes": pair.pages * page_bytes, "checks": checks, "decodes": config.first_request_decodes,
        "steady_per_decode": config.first_request_steady, "idle_after_peering_s": FIRST_REQUEST_IDLE_S,
        "latency_from": "caller-decides-to-decode-READABLE",
        "handshake": _summary(handshakes),
        "rpc_round_trip": _summary(trips),
    }
    for name, requests in columns.items():
        out[name] = _summary([r["readable"] for r in requests])
        # the median moment of each phase, from the caller's decision: where the time goes
        out[name]["phases_p50_s"] = {phase: round(statistics.median(r[phase] for r in requests), 6)
                                     for phase in PHASES} if requests else {}
    steady = sorted(r["readable"] for r in columns["steady"])
    out["steady"]["p90_s"] = round(percentile(steady, 90), 6)
    steady_p50 = out["steady"]["p50_s"]
    ahead_p50, cold_p50 = out["ahead"].get("p50_s"), out["cold"].get("p50_s")
    out["ratios"] = {
        "ahead_over_steady_p50": _ratio(ahead_p50, steady_p50),
        "cold_over_steady_p50": _ratio(cold_p50, steady_p50),
        "ahead_paired_median": round(statistics.median(paired["ahead"]), 3) if paired["ahead"] else None,
        "cold_paired_median": round(statistics.median(paired["cold"]), 3) if paired["cold"] else None,
    }
    out["ahead_excess_over_steady_p50_s"] = round(ahead_p50 - steady_p50, 6) if ahead_p50 is not None else None
    # the noise band of steady state: its p90 (a loaded machine's p99 would excuse anything)
    out["first_request_pays_no_handshake"] = ahead_p50 is not None and ahead_p50 <= out["steady"]["p90_s"]
    return out


def transports_for(config: BenchConfig) -> tuple[list[str], dict[str, str]]:
    """The transports to measure, and those skipped with why (not available on this machine)."""
    from ...transport import registry

    wanted = list(config.first_request_transports or registry.names())
    run, skipped = [], {}
    for name in wanted:
        ok, why = registry.available(name)
        if ok:
            run.append(name)
        else:
            skipped[name] = why or "not available on this machine"
    return run, skipped


@contextlib.contextmanager
def _engine_log_to(stream: Any) -> Iterator[None]:
    """The in-process prefill's log lines go where the decode nodes' do (shown only on a failure)."""
    logger = logging.getLogger("kvxfer")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    propagate = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def _ms(summary: dict[str, Any], key: str) -> str:
    return f"{1e3 * summary[key]:.2f}" if summary.get(key) is not None else "-"


def _cell(summary: dict[str, Any]) -> str:
    return f"{_ms(summary, 'p50_s')} / {_ms(summary, 'p99_s')}" if summary.get("n") else "-"


def _x(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "-"


def run_first_request(config: BenchConfig, *, json_path: str | None = None, progress: bool | None = None) -> int:
    """Measure and print every transport and page size; 1 when a measurement failed or none ran."""
    import tempfile

    from rich.console import Console
    from rich.table import Table

    from ..progress import bar

    console = Console()
    started = time.monotonic()
    transports, skipped = transports_for(config)
    rows: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    with tempfile.TemporaryFile("w+") as node_log, _engine_log_to(node_log), \
            bar("bench --first-request", console, progress) as live:
        live.grow(len(transports) * len(config.page_sizes) * (config.first_request_decodes + 1))
        for transport in transports:
            for page_bytes in config.page_sizes:
                console.print(f"{transport}, {page_bytes:,} B pages: a warm-up decode, then "
                              f"{config.first_request_decodes} fresh decodes (cold and peered ahead in turn), "
                              f"{config.first_request_steady} steady requests each", markup=False, highlight=False)
                done = live.done + config.first_request_decodes + 1
                try:
                    rows.append(measure(config, transport, page_bytes, node_log))
                except Exception as exc:
                    failures.append({"transport": transport, "page_bytes": page_bytes,
                                     "error": f"{type(exc).__name__}: {exc}"})
                live.advance(done - live.done)  # the steps a failed measurement left undone
        if failures:
            node_log.seek(0)
            tail = node_log.read()[-3000:]
            if tail.strip():
                console.print(tail, markup=False, highlight=False)
    table = Table(title="kvxfer bench --first-request: latency from the caller's decision to the decode's READABLE, "
                        "p50 / p99 in ms")
    for column in ("transport", "page", "request", "handshake (connect)", "cold (connect + request)",
                   "first after peering", "steady", "ahead / steady p50", "cold / steady p50"):
        table.add_column(column, overflow="fold")
    for r in rows:
        table.add_row(r["transport"], f"{r['page_bytes']:,} B",
                      f"{r['request_pages']} pages, {r['request_bytes'] / (1 << 20):g} MiB",
                      _cell(r["handshake"]), _cell(r["cold"]), _cell(r["ahead"]), _cell(r["steady"]),
                      _x(r["ratios"]["ahead_over_steady_p50"]), _x(r["ratios"]["cold_over_steady_p50"]))
    for f in failures:
        table.add_row(f["transport"], f"{f['page_bytes']:,} B", "-", "-", "-", "-", "-", "-", f"FAILED: {f['error']}")
    console.print(table)
    for r in rows:
        ratios = r["ratios"]
        console.print(f"{r['transport']} {r['page_bytes']:,} B pages (checks {r['checks']}): handshake (connect(), "
                      f"reported apart) p50 {_ms(r['handshake'], 'p50_s')} ms, p99 {_ms(r['handshake'], 'p99_s')} ms "
                      f"over {r['handshake']['n']} decodes; {r['cold']['n']} cold and {r['ahead']['n']} peered-ahead "
                      f"first requests, {r['steady']['n']} steady; first after peering / steady p50 "
                      f"{_x(ratios['ahead_over_steady_p50'])} (median per decode of first / its own steady median "
                      f"{_x(ratios['ahead_paired_median'])}), cold / steady p50 {_x(ratios['cold_over_steady_p50'])} "
                      f"(per decode {_x(ratios['cold_paired_median'])}); driver rpc round trip p50 "
                      f"{_ms(r['rpc_round_trip'], 'p50_s')} ms", markup=False, highlight=False, soft_wrap=True)
        for name, label in (("cold", "cold"), ("ahead", "first after peering"), ("steady", "steady")):
            phases = r[name].get("phases_p50_s") or {}
            if phases:
                console.print(f"  {label}, median ms from the caller's decision: decode admitted "
                              f"{_ms(phases, 'admitted')}, prefill has the destination {_ms(phases, 'destination')}, "
                              f"send posted {_ms(phases, 'posted')}, READABLE {_ms(phases, 'readable')}",
                              markup=False, highlight=False, soft_wrap=True)
        if r["ahead"].get("n"):
            verdict = ("within steady-state noise: the first request pays no handshake"
                       if r["first_request_pays_no_handshake"] else
                       f"above the steady p90: the first request after peering still pays "
                       f"{1e3 * r['ahead_excess_over_steady_p50_s']:.2f} ms over steady p50")
            console.print(f"{r['transport']} {r['page_bytes']:,} B pages: first request after peering p50 "
                          f"{_ms(r['ahead'], 'p50_s')} ms against steady p50 {_ms(r['steady'], 'p50_s')} ms / p90 "
                          f"{_ms(r['steady'], 'p90_s')} ms: {verdict}", markup=False, highlight=False, soft_wrap=True)
    console.print("\"First request pays no handshake\": with the decode peered ahead (connect() at engine start), "
                  "the first request's latency is within the noise of steady state (its p50 at or under the "
                  "steady p90); the handshake then shows only in the cold column, where peering happens on demand.",
                  markup=False, highlight=False, soft_wrap=True)
    for name, reason in skipped.items():
        console.print(f"{name}: skipped, {reason}", markup=False, highlight=False, soft_wrap=True)
    console.print(f"bench took {time.monotonic() - started:.1f} s on {os.cpu_count()} cores")
    if json_path:
        Path(json_path).write_text(json.dumps({
            "config": asdict(config),
            "first_request": rows,
            "failed": failures,
            "skipped": [{"case": name, "reason": reason} for name, reason in skipped.items()],
        }, indent=2) + "\n")
    return 1 if failures or not rows else 0
