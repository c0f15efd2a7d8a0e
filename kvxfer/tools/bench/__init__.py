"""``kvxfer bench``: throughput of kvxfer against a raw baseline and the peers, as ratios from one run.

Each case moves the same bytes (default 1 GiB on tcp) as pages of a given size between two engine
processes, destination pages allocated at random so they are scattered across the decode pool,
``--repeat`` times; the table reports the median and the spread. Baselines are cases of their own:
``ib_write_bw`` on the same device for verbs; the plain two-process socket stream and, when
installed, Mooncake's and NIXL's TCP paths for tcp, and ``native-stream`` (kvxfer's own C send and
receive calls with no protocol, checks on and off: what summing costs this machine without the rest of
kvxfer); a single-threaded scattered memcpy of the same
pages for shm (:mod:`.baselines`). A baseline that is not installed gets one line saying what to
install, no row and no ratio, and is listed under ``skipped`` in the JSON. ``--tp P:1`` adds, per page
size and checks setting, the same transfer with prefill TP ``P`` into decode TP 1 (:mod:`.tp`), reported
as a ratio against the equal-TP case (unequal / equal). ``--first-request`` measures instead what the
first request to a fresh decode pays, cold (peering on demand) and peered ahead, next to steady state
and the handshake itself (:mod:`.first`); ``--small-requests`` the per-request latency of requests of
1, 8 and 64 pages beside NIXL's and Mooncake's (:mod:`.small`); ``--ttft`` the time from a modelled
prefill's start to the decode's READABLE, layer-wise against whole-request (:mod:`.ttft`). Speed targets are judged on the printed ratios, never by
timed unit tests. ``--pin`` runs the prefill side's processes on one half of the CPUs and the decode
side's on the other, every contestant alike: two machines, modelled on one host.

Every process a bench starts (engine nodes, peers, ``ib_write_bw``) dies with it (:mod:`kvxfer.tools.procs`);
a stop signal closes every session that was started, without the closing measurements.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .cases import BenchConfig, CaseResult, KvxferSession, PeerSession, Session, Unavailable
from .rounds import _run_rounds, missing_baselines, sessions_for


def run_bench(config: BenchConfig, *, json_path: str | None = None, progress: bool | None = None) -> int:
    """Every case of a page size runs in interleaved rounds (a warm-up round first, not counted), so
    that drift on a noisy machine hits all of them alike; the median round is reported.
    ``config.first_request``: the first-request report instead (:mod:`.first`). ``progress``: a live
    bar (default: when stdout is a terminal, :func:`kvxfer.tools.progress.wanted`).

    Exit status 1 when a kvxfer case failed or measured nothing (no round completed): a run that
    measured nothing of kvxfer is never reported as a success."""
    import tempfile

    from ..progress import bar

    if config.pin:
        from .cases import side_cpus

        prefill, decode = side_cpus(config, "prefill"), side_cpus(config, "decode")
        print(f"pinned: prefill side on CPUs {prefill}, decode side on CPUs {decode}" if prefill else
              "--pin: fewer than two CPUs to split, nothing pinned", flush=True)
    if config.first_request:
        from .first import run_first_request

        return run_first_request(config, json_path=json_path, progress=progress)
    if config.small_requests:
        from .small import run_small_requests

        return run_small_requests(config, json_path=json_path, progress=progress)

    from rich.console import Console
    from rich.table import Table

    console = Console()
    results: list[CaseResult] = []
    skipped = missing_baselines(config)
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as node_log, bar("bench", console, progress):
        for page_bytes in config.page_sizes:
            sessions = sessions_for(config, page_bytes, node_log, skipped)
            try:
                _run_rounds(config, page_bytes, sessions, results, console, skipped)
            except BaseException:  # a stop signal: close whatever was started, fast
                for session in sessions:
                    session.close(measure=False)
                raise
        if any(r.error and r.transport.startswith("kvxfer") for r in results):
            node_log.seek(0)
            tail = node_log.read()[-3000:]
            if tail.strip():
                console.print(tail, markup=False, highlight=False)
    ratios = compute_ratios(results)
    unequal = {(r["case"], r["page_bytes"], r["checks"]): r for r in ratios if "unequal_tp" in r}
    table = Table(title=f"kvxfer bench ({config.transport}): median of {config.repeat} interleaved rounds")
    for column in ("case", "page", "checks", "GB/s", "spread", "pages/s", "note"):
        table.add_column(column, overflow="fold")
    for r in results:
        low, high = r.spread()
        if r.error or not r.seconds:  # no measurement: no number that could pass for one
            table.add_row(r.transport, f"{r.page_bytes:,}", r.checks, "-", "-", "-",
                          f"FAILED: {r.error or 'no round completed'}")
            continue
        note = "" if "decode_rss_growth_of_moved" not in r.extra else \
            f"rss +{100 * r.extra['decode_rss_growth_of_moved']:.1f}% of moved"
        tp = unequal.get((r.transport, r.page_bytes, r.checks))
        if tp is not None:
            note = f"TP {tp['unequal_tp']} / equal TP: {tp['gbps_ratio']:.2f}x" + (f"; {note}" if note else "")
        table.add_row(r.transport, f"{r.page_bytes:,}", r.checks, f"{r.gbps:.3f}", f"{low:.3f}-{high:.3f}",
                      f"{r.pages_per_s:,.0f}", note)
    console.print(table)
    for r in results:
        if "latency_p50_s" in r.extra:
            console.print(f"{r.transport} {r.page_bytes:,} B pages, checks {r.checks}: per-request latency "
                          f"({r.extra['latency_from'].replace('-to-', ' to ')}, {r.extra['request_bytes'] / (1 << 20):g} MiB requests) "
                          f"p50 {1e3 * r.extra['latency_p50_s']:.1f} ms, p99 {1e3 * r.extra['latency_p99_s']:.1f} ms "
                          f"({r.extra['latency_requests']} requests)", markup=False, highlight=False, soft_wrap=True)
    for name, reason in skipped.items():
        console.print(f"{name}: skipped, {reason}", markup=False, highlight=False, soft_wrap=True)
    for line in ratios:
        console.print(line["text"], soft_wrap=True)  # one line each, whatever the width
    console.print(f"bench took {time.monotonic() - started:.1f} s")
    if json_path:
        Path(json_path).write_text(json.dumps({
            "config": asdict(config),
            "cases": [r.to_dict() for r in results],
            "ratios": ratios,
            "skipped": [{"case": name, "reason": reason} for name, reason in skipped.items()],
        }, indent=2) + "\n")
    measured_nothing = [r for r in results if r.transport.startswith("kvxfer") and (r.error or not r.seconds)]
    if measured_nothing or not any(r.transport.startswith("kvxfer") for r in results):
        console.print(f"FAIL: {len(measured_nothing)} kvxfer case(s) measured nothing" if measured_nothing
                      else "FAIL: no kvxfer case ran", style="red", markup=False, highlight=False)
        return 1
    return 0


def compute_ratios(results: list[CaseResult]) -> list[dict[str, Any]]:
    """kvxfer (checks on) against every other case of the same page size, a baseline with checks
    (``native-stream``) against its own checks off; an unequal-TP case
    (``--tp``) only against the equal-TP case of its page size and checks (``unequal_tp`` set).

    The ratio is the median over rounds of the per-round speed ratio: both cases ran in the same
    round, back to back, so drift of a shared, noisy machine cancels out. The ratio of the medians
    is kept beside it."""
    out = []
    by = {(r.transport, r.page_bytes, r.checks): r for r in results if not r.error and r.seconds}
    unequal = {key: by.pop(key) for key in [k for k, r in by.items() if "tp" in r.extra]}
    for (_case, page, checks), r in unequal.items():
        equal = by.get((r.extra["equal_case"], page, checks))
        if equal is not None:
            out.append(_unequal_ratio(r, equal))
    with_checks = {t for (t, _p, c) in by if c == "on"}  # cases run with checks on and off: name the setting
    for (transport, page, checks), r in by.items():
        if checks != "on":
            continue
        for (other_t, other_p, other_c), o in by.items():
            if other_p != page or (other_t, other_c) == (transport, checks):
                continue
            # kvxfer against every case; a baseline that has checks (native-stream) against its own checks off
            if not transport.startswith("kvxfer") and other_t != transport:
                continue
            out.append(_paired_ratio(r, o, f"{other_t} checks {other_c}" if other_t in with_checks else other_t))
    return out


def _paired_ratio(r: CaseResult, o: CaseResult, label: str) -> dict[str, Any]:
    """``r`` (checks on) against ``o``, paired by round."""
    of_medians = r.gbps / o.gbps if o.gbps else 0.0
    paired = [(o_s / o.bytes) / (r_s / r.bytes) for r_s, o_s in zip(r.runs, o.runs) if r_s and o_s]
    # rounded once, before anything prints it, so the text and the JSON never disagree
    ratio = round(statistics.median(paired) if paired else of_medians, 3)
    pps = ratio * (o.page_bytes / r.page_bytes)
    return {"case": r.transport, "page_bytes": r.page_bytes, "against": label, "gbps_ratio": round(ratio, 3),
            "pages_per_s_ratio": round(pps, 3), "ratio_of_medians": round(of_medians, 3), "rounds": len(paired),
            "text": f"{r.transport} (checks on) / {label} at {r.page_bytes:,} B: {ratio:.2f}x "
                    f"(median of {len(paired)} paired rounds; ratio of medians {of_medians:.2f}x)"}


def _unequal_ratio(r: CaseResult, equal: CaseResult) -> dict[str, Any]:
    """The unequal-TP case against the equal-TP case of the same page size and checks: speed ratio,
    unequal / equal (below 1: the head slices cost that much), paired by round as in :func:`compute_ratios`."""
    of_medians = r.gbps / equal.gbps if equal.gbps else 0.0
    paired = [(e_s / equal.bytes) / (r_s / r.bytes) for r_s, e_s in zip(r.runs, equal.runs) if r_s and e_s]
    # rounded once, before anything prints it: the line and the table's note (which reads the JSON
    # value) showed 0.50x and 0.51x for a median of 0.5049
    ratio = round(statistics.median(paired) if paired else of_medians, 3)
    tp = r.extra["tp"]
    return {"case": r.transport, "page_bytes": r.page_bytes, "against": equal.transport, "checks": r.checks,
            "unequal_tp": tp, "gbps_ratio": round(ratio, 3), "pages_per_s_ratio": round(ratio, 3),
            "ratio_of_medians": round(of_medians, 3), "rounds": len(paired),
            "text": f"{r.transport} / {equal.transport} (checks {r.checks}) at {r.page_bytes:,} B: {ratio:.2f}x "
                    f"(prefill TP {tp} / equal TP, the same bytes and decode pages; median of {len(paired)} "
                    f"paired rounds; ratio of medians {of_medians:.2f}x)"}


__all__ = ["BenchConfig", "CaseResult", "KvxferSession", "PeerSession", "Session", "Unavailable", "run_bench"]
