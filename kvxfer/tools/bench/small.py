"""``kvxfer bench --small-requests``: per-request latency of small requests, beside NIXL's and Mooncake's.

Short prompts are many small requests: what a request of 1, 8 or 64 pages waits for matters more
than throughput. For each page size and request size, every contestant moves
``small_requests_count`` requests per round, one in flight at a time, destination pages at random
across the pool, in ``--repeat`` interleaved rounds (after one uncounted warm-up): kvxfer with its
checks on, and NIXL's and Mooncake's TCP paths where installed (a line says what to install
otherwise). Reported per request, nearest-rank p50 and p99 over every request of the counted rounds:

* kvxfer **send to READABLE**: from the prefill's ``send()`` call to the decode's READABLE (coverage,
  byte counts and checksum verified), both on the monotonic clock the two processes share: the data
  path, what NIXL's and Mooncake's figure measures;
* kvxfer **send to wait()**: from the same ``send()`` to the decode's ``wait()`` returning the request
  READABLE (``noticed``): when the decode's consumer learns it, a thread wake-up after READABLE was
  stamped; the counterpart of NIXL's *notified* below;
* kvxfer **admit to READABLE**: from the decode's admission, through its destination (META) reaching
  the prefill, to READABLE: the whole protocol, which a NIXL or Mooncake user builds around them
  (SGLang's bootstrap, vLLM's side channel) and which their figures leave out;
* NIXL (UCX over TCP): ``initialize_xfer`` to the initiator seeing DONE, and to the target's
  ``get_new_notifs`` returning the transfer's notification (*notified*: when a decode on NIXL, as
  SGLang's, learns that its KV landed; the counterpart of READABLE, without its checks); Mooncake: its
  ``transfer_sync_write`` call.

Beside the latencies, each kvxfer engine process's **CPU time per request** (user and system, every
thread, from ``/proc`` over the counted rounds): in a serving engine that time competes with the
scheduler for the GIL and the cores.

The ratios kvxfer / NIXL DONE and kvxfer / Mooncake (p50, send to READABLE) and kvxfer / NIXL notified
(p50, send to wait(): both sides' consumers informed) come from one run; below 1 kvxfer is faster.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from .cases import BenchConfig, CaseResult

DEFAULT_PAGES = (1, 8, 64)
PEERS = ("nixl-ucx-tcp", "mooncake-tcp")


def _config_for(config: BenchConfig, page_bytes: int, pages: int) -> BenchConfig:
    request = pages * page_bytes
    return replace(config, request_bytes=request, total_bytes=config.small_requests_count * request,
                   total_bytes_small_pages=None, concurrency=1, checks="on", page_sizes=[page_bytes],
                   baselines=[b for b in config.baselines if b in PEERS], tp=None, compare_windows=False,
                   compare_inline=config.transport in ("tcp", "shm"))


def _ms(value: float | None) -> str:
    return f"{1e3 * value:.3f}" if value is not None else "-"


def measure(config: BenchConfig) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Every page size and request size; rows of latencies by contestant, and contestants skipped."""
    from rich.console import Console

    from .rounds import _run_rounds, missing_baselines, sessions_for

    console = Console()
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    with tempfile.TemporaryFile("w+") as node_log:
        for page_bytes in config.page_sizes:
            for pages in config.small_requests or DEFAULT_PAGES:
                sub = _config_for(config, page_bytes, pages)
                missing = missing_baselines(sub)
                skipped.update(missing)
                results: list[CaseResult] = []
                sessions = sessions_for(sub, page_bytes, node_log, missing)
                try:
                    _run_rounds(sub, page_bytes, sessions, results, console, skipped)
                except BaseException:
                    for session in sessions:
                        session.close(measure=False)
                    raise
                row: dict[str, Any] = {"page_bytes": page_bytes, "request_pages": pages,
                                       "requests_per_round": config.small_requests_count}
                for r in results:
                    if r.error:
                        row[r.transport] = {"error": r.error}
                        continue
                    entry = {"p50_s": r.extra.get("latency_p50_s"), "p99_s": r.extra.get("latency_p99_s"),
                             "from": r.extra.get("latency_from"), "requests": r.extra.get("latency_requests")}
                    if "notified_p50_s" in r.extra:
                        entry["notified_p50_s"] = r.extra["notified_p50_s"]
                        entry["notified_p99_s"] = r.extra["notified_p99_s"]
                        entry["notified_requests"] = r.extra["notified_requests"]
                    if "send_latency_p50_s" in r.extra:
                        entry["send_p50_s"] = r.extra["send_latency_p50_s"]
                        entry["send_p99_s"] = r.extra["send_latency_p99_s"]
                    if "noticed_latency_p50_s" in r.extra:
                        entry["noticed_p50_s"] = r.extra["noticed_latency_p50_s"]
                        entry["noticed_p99_s"] = r.extra["noticed_latency_p99_s"]
                    if "succeeded_latency_p50_s" in r.extra:
                        entry["succeeded_p50_s"] = r.extra["succeeded_latency_p50_s"]
                        entry["succeeded_p99_s"] = r.extra["succeeded_latency_p99_s"]
                    for side in ("prefill", "decode"):
                        if f"{side}_cpu_us_per_request" in r.extra:
                            entry[f"{side}_cpu_us"] = r.extra[f"{side}_cpu_us_per_request"]
                    row[r.transport] = entry
                kvxfer = row.get(f"kvxfer-{config.transport}", {})
                lanes = row.get(f"kvxfer-{config.transport}-lanes", {})
                if kvxfer.get("send_p50_s") and lanes.get("send_p50_s"):
                    row["over_lanes_p50"] = round(kvxfer["send_p50_s"] / lanes["send_p50_s"], 3)
                for peer in PEERS:
                    theirs = row.get(peer, {})
                    if kvxfer.get("send_p50_s") and theirs.get("p50_s"):
                        row[f"over_{peer}_p50"] = round(kvxfer["send_p50_s"] / theirs["p50_s"], 3)
                    if kvxfer.get("noticed_p50_s") and theirs.get("notified_p50_s"):
                        row[f"over_{peer}_notified_p50"] = round(kvxfer["noticed_p50_s"] / theirs["notified_p50_s"], 3)
                rows.append(row)
    return rows, skipped


def run_small_requests(config: BenchConfig, *, json_path: str | None = None, progress: bool | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    from ..progress import bar

    console = Console()
    started = time.monotonic()
    with bar("bench --small-requests", console, progress):
        rows, skipped = measure(config)
    name = f"kvxfer-{config.transport}"
    busy = f", the prefill's caller busy {config.caller_busy_ms:g} ms after each send()" if config.caller_busy_ms else ""
    table = Table(title=f"kvxfer bench --small-requests ({config.transport}): per-request latency p50 / p99, ms, "
                        f"one request in flight{busy}")
    for column in ("page", "request", "kvxfer send->READABLE", "kvxfer send->wait()", "kvxfer send->SUCCEEDED",
                   "kvxfer admit->READABLE",
                   "kvxfer CPU us/request (prefill / decode)", "lanes send->READABLE / CPU", "NIXL DONE", "NIXL notified", "Mooncake", "/ NIXL DONE",
                   "/ NIXL notified", "/ Mooncake"):
        table.add_column(column, overflow="fold", justify="right")
    failed = False
    for row in rows:
        k = row.get(name, {})
        failed = failed or "error" in k or not k

        def cell(entry: dict[str, Any], p50: str = "p50_s", p99: str = "p99_s") -> str:
            if "error" in entry:
                return f"FAILED: {entry['error']}"
            return f"{_ms(entry.get(p50))} / {_ms(entry.get(p99))}" if entry.get(p50) is not None else "-"

        ratios = [f"{row[key]:.2f}x" if key in row else "-"
                  for key in ("over_nixl-ucx-tcp_p50", "over_nixl-ucx-tcp_notified_p50", "over_mooncake-tcp_p50")]
        nixl = row.get("nixl-ucx-tcp", {})
        cpu = (f"{k['prefill_cpu_us']:.0f} / {k['decode_cpu_us']:.0f}" if "prefill_cpu_us" in k and "decode_cpu_us" in k
               else "-")
        lanes = row.get(f"{name}-lanes")
        lanes_cell = "-" if lanes is None else cell(lanes, "send_p50_s", "send_p99_s") + (
            f" / {lanes['prefill_cpu_us']:.0f} / {lanes['decode_cpu_us']:.0f}" if "prefill_cpu_us" in lanes else "")
        table.add_row(f"{row['page_bytes']:,} B", f"{row['request_pages']} pages", cell(k, "send_p50_s", "send_p99_s"),
                      cell(k, "noticed_p50_s", "noticed_p99_s"), cell(k, "succeeded_p50_s", "succeeded_p99_s"), cell(k), cpu, lanes_cell, cell(nixl), cell(nixl, "notified_p50_s", "notified_p99_s") if "error" not in nixl else "-",
                      cell(row.get("mooncake-tcp", {})), *ratios)
    console.print(table)
    for peer, reason in skipped.items():
        console.print(f"{peer}: skipped, {reason}", markup=False, highlight=False, soft_wrap=True)
    console.print("kvxfer send->READABLE: the prefill's send() to the decode's READABLE, verified (the data path, "
                  "as NIXL's initialize_xfer->DONE and Mooncake's transfer_sync_write); send->wait(): to the decode's "
                  "wait() returning it (its consumer informed, as NIXL notified); send->SUCCEEDED: to the prefill's wait() "
                  "returning it (the decode's RESULT taken, its sources free); admit->READABLE adds the "
                  "destination's round trip (META), which the peers leave to their users. NIXL notified: initialize_xfer "
                  "to the target's get_new_notifs returning the transfer's notification (the moment an SGLang decode "
                  "on NIXL learns its KV landed, as wait() is kvxfer's). / NIXL DONE, / Mooncake: kvxfer send->READABLE "
                  "p50 over theirs; / NIXL notified: kvxfer send->wait() p50 over it (below 1: kvxfer is faster). CPU: "
                  "each engine process's user and system time over the counted rounds, every thread, per request "
                  "(/proc, 10 ms ticks: read it over many requests). lanes (tcp, shm): kvxfer with inline_send off, every "
                  "send from a sending thread instead of the caller's (send->READABLE p50 / p99, then CPU us per "
                  "request, prefill / decode), in the same rounds.", markup=False, highlight=False,
                  soft_wrap=True)
    console.print(f"bench took {time.monotonic() - started:.1f} s on {os.cpu_count()} cores", markup=False,
                  highlight=False)
    if json_path:
        Path(json_path).write_text(json.dumps({"config": asdict(config), "small_requests": rows,
                                               "skipped": [{"case": k, "reason": v} for k, v in skipped.items()]},
                                              indent=2) + "\n")
    return 1 if failed or not rows else 0
