"""``kvxfer bench``: throughput of kvxfer against a raw baseline and the peers, as ratios from one run.

Each case moves the same bytes (default 1 GiB on tcp) as pages of a given size between two engine
processes, destination pages allocated at random so they are scattered across the decode pool,
``--repeat`` times; the table reports the median and the spread. Baselines are cases of their own:
``ib_write_bw`` on the same device for verbs; the plain two-process socket stream and, when
installed, Mooncake's and NIXL's TCP paths for tcp (:mod:`.baselines`). Speed targets are judged on
the printed ratios, never by timed unit tests.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..node import NodeSpec, spawn


@dataclass
class BenchConfig:
    transport: str = "tcp"
    total_bytes: int = 1 << 30
    page_sizes: list[int] = field(default_factory=lambda: [65536, 4096])
    request_bytes: int = 64 << 20
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


def run_kvxfer_case(config: BenchConfig, page_bytes: int, checks: str, *, node_log: Any = None) -> CaseResult:
    """Move ``total_bytes`` as ``page_bytes`` pages between a prefill and a decode node."""
    total = config.total_bytes
    if page_bytes < 16384 and config.total_bytes_small_pages:
        total = config.total_bytes_small_pages
    pages_total = max(1, total // page_bytes)
    per_request = max(1, min(pages_total, config.request_bytes // page_bytes))
    requests = -(-pages_total // per_request)
    in_flight = per_request * config.concurrency
    engine = {
        "max_context": per_request,
        "transport": config.transport,
        "checksum": "adler32" if checks == "on" else "none",
        "peer_timeout": 120.0,
        "transfer_timeout": 600.0,
        "ib_device": config.ib_device,
        "gid_index": config.gid_index,
    }
    decode_spec = NodeSpec(role="decode", num_buffers=1, item_len=page_bytes, num_pages=2 * in_flight, page_size=1,
                           config={**engine, "alloc_policy": "random", "seed": 1})
    prefill_spec = NodeSpec(role="prefill", num_buffers=1, item_len=page_bytes, num_pages=in_flight + per_request,
                            page_size=1, config={**engine, "alloc_policy": "random", "seed": 2})
    result = CaseResult(transport=f"kvxfer-{config.transport}", page_bytes=page_bytes, bytes=0, seconds=0.0,
                        checks=checks)
    decode = spawn(decode_spec, stderr=node_log)
    prefill = spawn(prefill_spec, stderr=node_log)
    try:
        peer = decode.connect(address=prefill.control)
        rss_before = decode.rss()
        post_rates = []
        for rep in range(-1, config.repeat):  # repetition -1 warms up (page faults, caches); not counted
            plan = [[f"r{rep}-{i}", per_request] for i in range(requests)]
            decode.bench_start(requests=plan, concurrency=config.concurrency, peer=peer)
            prefill.bench_start(requests=plan, concurrency=config.concurrency)
            received = decode.bench_wait(timeout=3600)
            sent = prefill.bench_wait(timeout=3600)
            if not received or "error" in received or received.get("failed"):
                raise RuntimeError(f"decode half: {received}")
            if not sent or "error" in sent or sent.get("failed"):
                raise RuntimeError(f"prefill half: {sent}")
            if rep < 0:
                continue
            result.runs.append(received["seconds"])
            result.bytes = received["bytes"]
            if sent.get("post_rate"):
                post_rates.append(sent["post_rate"])
        rss_after = decode.rss()
        result.seconds = statistics.median(result.runs)
        result.extra["decode_rss_growth_bytes"] = rss_after["peak_rss"] - rss_before["rss"]
        result.extra["decode_rss_growth_of_moved"] = round(
            (rss_after["peak_rss"] - rss_before["rss"]) / max(1, result.bytes * len(result.runs)), 5)
        if post_rates:
            result.extra["wr_post_rate_per_s"] = round(statistics.median(post_rates), 1)
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        decode.close()
        prefill.close()
    return result


def run_bench(config: BenchConfig, *, json_path: str | None = None) -> int:
    import tempfile

    from rich.console import Console
    from rich.table import Table

    from . import baselines

    console = Console()
    results: list[CaseResult] = []
    checks = ["on", "off"] if config.checks == "both" else [config.checks]
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as node_log:
        for page_bytes in config.page_sizes:
            for check in checks:
                console.print(f"kvxfer {config.transport}, {page_bytes:,} B pages, checks {check} ...")
                results.append(run_kvxfer_case(config, page_bytes, check, node_log=node_log))
            for name in config.baselines:
                runner = baselines.RUNNERS.get(name)
                if runner is None or config.transport not in runner.transports:
                    continue
                console.print(f"{name}, {page_bytes:,} B ...")
                results.append(runner.run(config, page_bytes))
        if any(r.error for r in results):
            node_log.seek(0)
            tail = node_log.read()[-3000:]
            if tail.strip():
                console.print(tail, markup=False, highlight=False)
    table = Table(title=f"kvxfer bench ({config.transport}), median of {config.repeat}")
    for column in ("case", "page", "checks", "GB/s", "spread", "pages/s", "note"):
        table.add_column(column)
    for r in results:
        low, high = r.spread()
        note = r.error or ", ".join(f"{k}={v}" for k, v in r.extra.items() if k != "decode_rss_growth_bytes")
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


def compute_ratios(results: list[CaseResult]) -> list[dict[str, Any]]:
    """kvxfer (checks on) against every other case of the same page size, plus checks on vs off."""
    out = []
    by = {(r.transport, r.page_bytes, r.checks): r for r in results if not r.error and r.seconds}
    for (transport, page, checks), r in by.items():
        if not transport.startswith("kvxfer") or checks != "on":
            continue
        for (other_t, other_p, other_c), o in by.items():
            if other_p != page or (other_t, other_c) == (transport, checks):
                continue
            label = other_t if other_t != transport else f"{other_t} checks {other_c}"
            gbps = r.gbps / o.gbps if o.gbps else 0.0
            pps = r.pages_per_s / o.pages_per_s if o.pages_per_s else 0.0
            out.append({"case": transport, "page_bytes": page, "against": label, "gbps_ratio": round(gbps, 3),
                        "pages_per_s_ratio": round(pps, 3),
                        "text": f"{transport} (checks on) / {label} at {page:,} B: {gbps:.2f}x"})
    return out


__all__ = ["BenchConfig", "CaseResult", "run_bench", "run_kvxfer_case"]
