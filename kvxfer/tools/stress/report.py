"""Stress output: a live progress bar on a terminal, the summary table, JSON and the PNG report; a fleet
adds its topology line and a table of every process it started."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from .result import StressResult, faults_fired


def rate_text(bytes_per_s: float) -> str:
    """A rate in the unit that shows it: 1.234 GB/s, 56.7 MB/s, 38.5 kB/s (never a bare 0.000 GB/s)."""
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.{3 if unit == 'GB/s' else 1}f} {unit}"
    return f"{bytes_per_s:.0f} B/s"


def _by_fault(counts: dict[str, int]) -> str:
    return ", ".join(f"{name}: {n}" for name, n in counts.items())


def outcome_text(s: dict[str, Any]) -> str:
    """What became of the requests, in words: which endings the injected faults were meant to cause
    and which nothing injected explains, e.g. "152 completed; 41 failed as injected faults intended
    (flip_byte: 12, kill_sender: 29); 0 failed unexpectedly; ..."."""

    def part(count: int, what: str, causes: dict[str, int]) -> str:
        return f"{count} {what}" + (f" ({_by_fault(causes)})" if causes else "")

    parts = [f"{s['completed']} completed",
             part(sum(s["failed_as_injected"].values()), "failed as injected faults intended", s["failed_as_injected"]),
             f"{s['failed_unexpectedly']} failed unexpectedly"
             + (f" ({_by_fault(s['unexpected_failure_reasons'])})" if s["failed_unexpectedly"] else "")]
    aborted = sum(s["aborted_as_injected"].values())
    if aborted or s["aborted_unexpectedly"]:
        parts.append(part(aborted, "aborted as injected", s["aborted_as_injected"]))
    if s["aborted_unexpectedly"]:
        parts.append(f"{s['aborted_unexpectedly']} aborted unexpectedly")
    rejected = sum(s["rejected_as_injected"].values())
    if rejected or s["rejected_unexpectedly"]:
        parts.append(part(rejected, "rejected at admission as injected", s["rejected_as_injected"]))
    if s["rejected_unexpectedly"]:
        parts.append(f"{s['rejected_unexpectedly']} rejected unexpectedly")
    return f"{s['requests']} requests: " + "; ".join(parts) + "."


def verdict_text(s: dict[str, Any]) -> str:
    """PASS, or FAIL naming each check that failed and by how much (words, not colour); under
    ``--unsafe-legacy`` a clean run where no fault fired is INCONCLUSIVE: the negative control tested nothing."""
    problems = [f"{s[key]:,} {what}" for key, what in (
        ("leaked_pages", "leaked pages (other requests' bytes)"),
        ("corrupted_pages", "corrupted pages"),
        ("lost_pages", "lost pages"),
        ("rejected_succeeded", "rejected requests that succeeded"),
    ) if s[key]]
    if s["accounting_errors"]:
        problems.append(f"{len(s['accounting_errors'])} accounting violations")
    if not s["settled"]:
        problems.append("requests still active at the end")
    if "completed" in s and not s["completed"]:
        problems.append("no request ran" if not s.get("requests") else
                        f"none of the {s['requests']:,} requests completed, so the oracle checked no page")
    if s.get("requests_unaccounted"):
        problems.append(f"{s['requests_unaccounted']:,} requests unaccounted for")
    net_errors = s.get("net_faults", {}).get("errors") or []
    if net_errors:
        problems.append(f"{len(net_errors)} net faults not applied or undone ({net_errors[0]})")
    if not problems and s.get("unsafe_legacy") and not faults_fired(s):
        return ("INCONCLUSIVE: --unsafe-legacy injected nothing, so the incident's leak could not happen (no fault "
                f"fired in {s.get('requests', 0):,} requests: give more --requests or a higher --fault rate)")
    if not problems:
        return "PASS: no leaked, corrupted or lost pages; no rejected request succeeded; accounting clean"
    return "FAIL: " + "; ".join(problems)


def summary_table(result: StressResult) -> Any:
    from rich.table import Table

    s = result.summary()
    topology = s["topology"]["text"]
    table = Table(title=f"kvxfer stress ({s['transport']}{', ' + topology if topology else ''}"
                        f"{', layer-wise sends' if s['layerwise'] else ''}"
                        f"{', UNSAFE LEGACY' if s['unsafe_legacy'] else ''})")
    table.add_column("measure")
    table.add_column("value", justify="right")

    def bad(value: int) -> str:  # the word carries the verdict; colour only repeats it
        return f"[red]{value} FAIL[/red]" if value else f"[green]{value}[/green]"

    def by_fault(count: int, causes: dict[str, int]) -> str:
        return f"{count} ({_by_fault(causes)})" if causes else str(count)

    rows = [
        ("requests", s["requests"]),
        ("completed (read back, checked)", s["completed"]),
        ("failed, as injected faults intended", by_fault(sum(s["failed_as_injected"].values()),
                                                         s["failed_as_injected"])),
        ("failed unexpectedly (no injected fault explains it)",
         by_fault(s["failed_unexpectedly"], s["unexpected_failure_reasons"])),
        ("aborted, as injected", by_fault(sum(s["aborted_as_injected"].values()), s["aborted_as_injected"])),
        ("rejected at admission, as injected", by_fault(sum(s["rejected_as_injected"].values()),
                                                        s["rejected_as_injected"])),
    ]
    if s["secondary_failure_reasons"]:
        rows.append(("other decode ranks' own reasons in failed requests", _by_fault(s["secondary_failure_reasons"])))
    if s["aborted_unexpectedly"]:
        rows.append(("aborted unexpectedly", s["aborted_unexpectedly"]))
    if s["rejected_unexpectedly"]:
        rows.append(("rejected unexpectedly", s["rejected_unexpectedly"]))
    rows += [
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
        *_pool_rows(s),
        *_fleet_rows(s, bad),
        ("bytes landed at decode", f"{s['bytes_moved']:,}"),
        ("throughput", f"{rate_text(result.throughput)} over {s['seconds']:.1f} s"),
        ("latency p50 / p99", f"{s['latency_ms']['p50']:.1f} / {s['latency_ms']['p99']:.1f} ms"),
    ]
    for name, value in rows:
        table.add_row(name, str(value))
    return table


def _pool_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """The decode pool's free pages at the end; with a topology, each role's pools summed over its ranks;
    a fleet's over the processes still running."""
    if not s["topology"]["text"]:
        return [("decode pool free at end", f"{s['pool_free_at_end']} / {s['pool_total']}")]
    if "fleet" in s:
        running = s["fleet"]["processes_at_end"]

        def procs(role: str) -> str:
            return f"{running[role]} process{'es' if running[role] != 1 else ''} running"

        return [(f"decode pools free at end ({procs('decode')})", f"{s['pool_free_at_end']} / {s['pool_total']}"),
                (f"prefill pools free at end ({procs('prefill')})",
                 f"{s['prefill_pool_free_at_end']} / {s['prefill_pool_total']}")]
    ranks = Counter(pool["pool"].split()[0] for pool in s["pools"])

    def of(role: str) -> str:
        return f"{ranks[role]} rank{'s' if ranks[role] != 1 else ''}"

    return [(f"decode pools free at end ({of('decode')})", f"{s['pool_free_at_end']} / {s['pool_total']}"),
            (f"prefill pools free at end ({of('prefill')})",
             f"{s['prefill_pool_free_at_end']} / {s['prefill_pool_total']}")]


def _fleet_rows(s: dict[str, Any], bad: Any) -> list[tuple[str, Any]]:
    """A fleet's churn, pairs, the pools of the processes that left, and requests unaccounted for."""
    if "fleet" not in s:
        return []
    f = s["fleet"]
    c = f["counterpart_halves"]
    within = f" within {f['prefill_halves_settled_within_s']:.1f} s" if f["prefill_halves_settled_within_s"] else ""
    left = [p for p in f["processes"] if p["end"] == "left"]
    whole = sum(1 for p in left if p["pool"] is not None and p["pool"]["free"] == p["pool"]["total"])
    seat_pairs = len({(p["seat"], d["seat"]) for p in f["processes"] if p["role"] == "prefill"
                      for d in f["processes"] if d["role"] == "decode"})
    return [
        ("processes started (killed / left / running at end)",
         f"{f['processes_started']} ({f['processes_by_end'].get('killed', 0)} / {f['processes_by_end'].get('left', 0)}"
         f" / {f['processes_by_end'].get('running', 0)})"),
        ("processes killed (prefill / decode), restarted, joined, left (prefill / decode)",
         f"{f['kills']['prefill']} / {f['kills']['decode']}, {f['restarts']}, {f['joins']}, "
         f"{f['leaves']['prefill']} / {f['leaves']['decode']}"),
        ("pairs that completed requests", f"{f['distinct_pairs_completed']} of {seat_pairs}"),
        ("requests' halves whose other process was killed",
         f"decode: {c['decode halves left to the decode engine']} left to their engine; prefill: "
         f"{c['prefill halves settled by the prefill engine']} of {c['prefill halves left to the prefill engine']} "
         f"settled by their engine{within} ({c['prefill halves whose prefill died too']} died too), "
         f"{c['prefill halves stopped by the driver']} stopped by the driver"),
        ("pools whole when their process left", f"{whole} of {len(left)}"
         + (f" [red]({len(left) - whole} FAIL)[/red]" if whole != len(left) else "")),
        ("requests unaccounted for", bad(s["requests_unaccounted"])),
    ]


def topology_text(s: dict[str, Any]) -> str:
    """A fleet's topology line: who runs, who peers with whom, how requests are routed."""
    f = s["fleet"]
    cfg = s["topology"]
    kills = f["kills"]["prefill"] + f["kills"]["decode"]
    by_net = int(f.get("kills_by_net_fault", 0))
    net_kills = f", {by_net} by net faults" if by_net else ""
    return (f"topology: {cfg['prefills']} prefill x {cfg['decodes']} decode processes of one rank each, every decode "
            f"peered with every prefill; each request to a random (prefill, decode) pair; churn {cfg['churn']:g} per "
            f"request; processes killed {kills} ({kills - f['kills_by_churn'] - by_net} by kill_sender{net_kills}), "
            f"restarted {f['restarts']}, joined {f['joins']}, left {f['leaves']['prefill'] + f['leaves']['decode']}; "
            f"{f['processes_started']} processes in all (the first {cfg['prefills'] + cfg['decodes']} up and peered in "
            f"{f['startup_s']:.1f} s)" + (f"; {net_text(s)}" if s.get("two_hosts") else ""))


def net_text(s: dict[str, Any]) -> str:
    """Two hosts: where the processes ran and what the net faults did, e.g. "two hosts (prefills on a, decodes
    on b, tcp over a veth); net faults fired: link_down 2, drop 1; first completion after a fault healed
    within 0.8 s at most"."""
    net = s.get("net_faults") or {}
    cfg = s.get("config") or {}
    if cfg.get("peer_agent"):
        text = (f"two machines (prefills on a: this one; decodes on b, through its agent at {cfg['peer_agent']}; "
                f"{s.get('transport', 'tcp')} across the wire between them)")
    else:
        text = f"two hosts (prefills on a, decodes on b, {s.get('transport', 'tcp')} over a veth)"
    fired = net.get("fired") or {}
    if net.get("timeline"):
        text += "; net faults fired: " + (", ".join(f"{name} {n}" for name, n in fired.items()) or "none")
        if net.get("never_fired"):
            text += (f"; never fired (every request had started before): {', '.join(net['never_fired'])}: give "
                     "--duration to cover the timeline")
        if net.get("max_recovered_in_s") is not None:
            text += f"; first completion after a fault ended within {net['max_recovered_in_s']:.1f} s at most"
    return text


def process_table(s: dict[str, Any]) -> Any:
    """Every process a fleet run started: how it started and ended, its requests, its pool (at the end, or
    as it left; a killed process's pool died with it)."""
    from rich import box
    from rich.table import Table

    table = Table(title="processes (pages: checked by the oracle; bad: leaked / corrupted)", box=box.SIMPLE_HEAD,
                  pad_edge=False)
    for name in ("process", "started", "end", "routed", "done", "pages", "bad", "pool free"):
        table.add_column(name, justify="left" if name in ("process", "started", "end") else "right",
                         no_wrap=name in ("process", "pool free"))
    for p in s["fleet"]["processes"]:
        pool = p["pool"]
        if p["end"] == "killed":
            pool_text = "died"
        elif pool is None:
            pool_text = "-"
        else:
            pool_text = f"{pool['free']}/{pool['total']}" + (" [red]FAIL[/red]" if pool["free"] != pool["total"] else "")
        decode = p["role"] == "decode"
        table.add_row(p["process"], p["started_as"], p["end"], str(p["routed"]), str(p["completed"]),
                      str(p["pages_checked"]) if decode else "-",
                      f"{p['leaked_pages']}/{p['corrupted_pages']}" if decode else "-", pool_text)
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
    topology = f"\n{s['topology']['text']}" if s["topology"]["text"] else ""
    fig.suptitle(f"kvxfer stress: {s['requests']} requests, leaked {s['leaked_pages']}, "
                 f"corrupted {s['corrupted_pages']}, lost {s['lost_pages']}{topology}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
