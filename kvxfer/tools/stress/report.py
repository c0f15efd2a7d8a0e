"""Stress output: a live progress bar on a terminal, the summary table, JSON and the PNG report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .driver import StressResult


def summary_table(result: StressResult) -> Any:
    from rich.table import Table

    s = result.summary()
    table = Table(title=f"kvxfer stress ({s['transport']}{', UNSAFE LEGACY' if s['unsafe_legacy'] else ''})")
    table.add_column("measure")
    table.add_column("value", justify="right")

    def bad(value: int) -> str:
        return f"[red]{value}[/red]" if value else f"[green]{value}[/green]"

    rows = [
        ("requests", s["requests"]),
        ("completed (read back, checked)", s["completed"]),
        ("rejected at admission", s["rejected"]),
        ("aborted", s["aborted"]),
        ("failed", f"{s['failed']} {s['failure_reasons'] or ''}"),
        ("faults injected", ", ".join(f"{k}={v}" for k, v in s["faults"].items() if v) or "none"),
        ("pages checked by the oracle", s["pages_checked"]),
        ("leaked pages (other requests' bytes)", bad(s["leaked_pages"])),
        ("corrupted pages", bad(s["corrupted_pages"])),
        ("lost pages", bad(s["lost_pages"])),
        ("rejected requests that succeeded", bad(s["rejected_succeeded"])),
        ("stale writes refused", s["stale_writes_refused"]),
        ("quarantined at end", bad(s["quarantined_at_end"])),
        ("accounting checks while running / violations",
         f"{s['accounting_checks_during_run']} / {bad(len(s['accounting_errors']))}"),
        ("decode pool free at end", f"{s['pool_free_at_end']} / {s['pool_total']}"),
        ("bytes moved", f"{s['bytes_moved']:,}"),
        ("throughput", f"{s['throughput_gbps']:.3f} GB/s over {s['seconds']:.1f} s"),
        ("latency p50 / p99", f"{s['latency_ms']['p50']:.1f} / {s['latency_ms']['p99']:.1f} ms"),
    ]
    for name, value in rows:
        table.add_row(name, str(value))
    return table


def write_json(result: StressResult, path: str) -> None:
    data = result.summary()
    data["config"] = result.config.to_dict()
    Path(path).write_text(json.dumps(data, indent=2, default=str) + "\n")


def write_png(result: StressResult, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise SystemExit(f"--report needs matplotlib (pip install 'kvxfer[report]'): {exc}") from exc
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5))
    samples = result.samples
    if len(samples) >= 2:
        times = [(a[0] + b[0]) / 2 for a, b in zip(samples, samples[1:])]
        rates = [(b[1] - a[1]) / max(b[0] - a[0], 1e-9) / 1e9 for a, b in zip(samples, samples[1:])]
        top.plot(times, rates, drawstyle="steps-mid")
    top.set_xlabel("time (s)")
    top.set_ylabel("GB/s landed at decode")
    top.set_title("throughput over time")
    if result.latencies_ms:
        bottom.hist(result.latencies_ms, bins=50)
        for q, style in ((50, "--"), (99, ":")):
            bottom.axvline(result.latency(q), linestyle=style, color="k", label=f"p{q} {result.latency(q):.1f} ms")
        bottom.legend()
    bottom.set_xlabel("admission to readable (ms)")
    bottom.set_ylabel("requests")
    bottom.set_title("transfer latency distribution")
    s = result.summary()
    fig.suptitle(f"kvxfer stress: {s['requests']} requests, leaked {s['leaked_pages']}, "
                 f"corrupted {s['corrupted_pages']}, lost {s['lost_pages']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
