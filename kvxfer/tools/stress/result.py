"""What a stress run counted, and its verdict (:class:`StressResult`).

The verdict is made from content and accounting only: no leaked or corrupted page (by the oracle),
no lost page in any pool (every rank's pool whole again after the settle), no rejected request that
succeeded, clean accounting, everything settled. A fleet adds: every pool of a process that left
cleanly was whole when it left (a killed process's pool dies with it and is not counted), and every
request started was accounted for. Two hosts add: every net fault of the timeline was applied and
undone (a fault that could not be is an error of the run, not a silent no-op).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .workload import ALL_FAULTS, StressConfig

if TYPE_CHECKING:
    from .fleet import Fleet


def pool_totals(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """The pool fields of several ranks' ``stats()`` summed (one rank's stats as they are)."""
    if len(stats) == 1:
        return stats[0]
    refused: Counter = Counter()
    for s in stats:
        refused.update(s.get("writes", {}).get("refused_by_reason", {}))
    return {
        "pool_total": sum(int(s.get("pool_total", 0)) for s in stats),
        "pool_free": sum(int(s.get("pool_free", 0)) for s in stats),
        "pages": {"quarantined": sum(int(s.get("pages", {}).get("quarantined", 0)) for s in stats)},
        "writes": {"refused_by_reason": dict(refused),
                   "landed_bytes": sum(int(s.get("writes", {}).get("landed_bytes", 0)) for s in stats)},
        "link_paths": dict(sum((Counter(s.get("link_paths", {})) for s in stats), Counter())),
    }


def faults_fired(s: dict[str, Any]) -> int:
    """Faults that fired in a run (a summary's ``faults`` and ``net_faults``): the request and link faults,
    and two hosts' net faults."""
    net = (s.get("net_faults") or {}).get("fired") or {}
    return sum((s.get("faults") or {}).values()) + sum(net.values())


@dataclass
class StressResult:
    """Everything a stress run counted and measured; :attr:`ok` is the verdict (no leak, no corruption, no lost
    page, no rejected request that succeeded, accounting clean, settled; under ``--unsafe-legacy``, a fault fired)."""

    config: StressConfig
    outcomes: Counter = field(default_factory=Counter)
    faults: Counter = field(default_factory=Counter)
    planned: Counter = field(default_factory=Counter)
    failures: Counter = field(default_factory=Counter)
    leaked_pages: int = 0
    corrupted_pages: int = 0
    pages_checked: int = 0
    rejected_succeeded: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    samples: list[tuple[float, int]] = field(default_factory=list)
    elapsed: float = 0.0
    decode_stats: dict[str, Any] = field(default_factory=dict)  # every decode rank's pools, summed
    prefill_stats: dict[str, Any] = field(default_factory=dict)  # every prefill rank's pools, summed
    pools: list[dict[str, Any]] = field(default_factory=list)  # each rank's pool at the end
    accounting_errors: list[str] = field(default_factory=list)
    accounting_checks: int = 0  # check_accounting() calls on a live node during the run
    settled: bool = True
    kills: int = 0
    leak_sources: set = field(default_factory=set)
    # (outcome, cause): cause is the injected fault the outcome was meant to come from, "" if none was
    causes: Counter = field(default_factory=Counter)
    unexpected_failures: Counter = field(default_factory=Counter)
    # a decode rank's own failure reason when another rank's failure is the request's (several ranks)
    secondary_failures: Counter = field(default_factory=Counter)
    rank_timeouts: int = 0  # decode ranks that waited out transfer_timeout: an end nobody carried to them
    # a fleet ---------------------------------------------------------------------------------------
    pairs: Counter = field(default_factory=Counter)  # (prefill seat, decode seat) -> requests completed
    churn_skipped: int = 0  # churn events with nothing to act on (every process of the role starting)
    # halves of requests whose other process was killed: who ended them (the engines must, by themselves)
    counterparts: Counter = field(default_factory=Counter)
    orphan_settle_s: list[float] = field(default_factory=list)  # decode killed -> its prefill half settled
    requests_started: int = 0
    fleet_counts: dict[str, int] = field(default_factory=dict)  # kills by role, restarts, joins, leaves, ...
    fleet_startup_s: float = 0.0
    processes: list[dict[str, Any]] = field(default_factory=list)  # every process started, with its figures
    # two hosts ---------------------------------------------------------------------------------------
    net: dict[str, Any] = field(default_factory=dict)  # the net faults' timeline and windows (NetChaos.summary)
    net_errors: list[str] = field(default_factory=list)  # net faults that could not be applied or undone
    net_kills: int = 0  # processes SIGKILLed by kill_prefill / kill_decode

    # the verdict -----------------------------------------------------------------------------
    @property
    def pool_total(self) -> int:
        return int(self.decode_stats.get("pool_total", 0))

    @property
    def pool_free_at_end(self) -> int:
        return int(self.decode_stats.get("pool_free", 0))

    @property
    def quarantined_at_end(self) -> int:
        return int(self.decode_stats.get("pages", {}).get("quarantined", 0))

    @property
    def lost_pages(self) -> int:
        lost = self.pool_total - self.pool_free_at_end
        lost += int(self.prefill_stats.get("pool_total", 0)) - int(self.prefill_stats.get("pool_free", 0))
        for process in self.processes:  # a fleet: the pools of processes that left, as they left
            if process["end"] == "left" and process["pool"] is not None:
                lost += process["pool"]["total"] - process["pool"]["free"]
        return lost

    @property
    def requests_unaccounted(self) -> int:
        """A fleet: requests started that no outcome was counted for."""
        return self.requests_started - sum(self.outcomes.values()) if self.config.fleet else 0

    @property
    def bytes_moved(self) -> int:
        """Bytes landed in the decode's pages: its write guard's ``landed_bytes``, which counts every
        accepted write on tcp and shm and, on verbs (where the receiver cannot see writes land), the
        writes that DONE's write log declared and the guard accepted."""
        return int(self.samples[-1][1]) if self.samples else 0

    @property
    def ok(self) -> bool:
        return (
            self.leaked_pages == 0
            and self.corrupted_pages == 0
            and self.lost_pages == 0
            and self.rejected_succeeded == 0
            and self.requests_unaccounted == 0
            and not self.accounting_errors
            and not self.net_errors
            and self.settled
            and self.outcomes["completed"] > 0  # an empty or wholly failed run checked nothing: never a pass
            and not self.injected_nothing  # a negative control with no fault fired tested nothing either
        )

    @property
    def injected_nothing(self) -> bool:
        """``--unsafe-legacy`` and no fault fired (request, link or net): the incident's leak could not happen."""
        return self.config.unsafe_legacy and not faults_fired({"faults": self.faults, "net_faults": self.net})

    def topology(self) -> dict[str, Any]:
        cfg = self.config
        return {"prefill_tp": cfg.prefill_tp, "decode_tp": cfg.decode_tp, "prefill_page_size": cfg.prefill_page,
                "decode_page_size": cfg.decode_page,
                **({"kv_heads": cfg.kv_heads, "head_bytes": cfg.head_bytes} if cfg.topology else {}),
                **({"prefills": cfg.prefills, "decodes": cfg.decodes, "churn": cfg.churn} if cfg.fleet else {}),
                "text": cfg.describe_topology() or cfg.describe_fleet()}

    def record_fleet(self, fleet: Fleet, started: int) -> None:
        """A fleet run's processes and churn, as they stand at its end."""
        self.requests_started = started
        self.fleet_counts = dict(fleet.counts)
        self.fleet_startup_s = fleet.startup_s
        self.processes = [process.record(fleet.t0) for process in fleet.processes]

    def fleet_summary(self) -> dict[str, Any]:
        """What a fleet run adds to the summary: churn, pairs, every process's figures."""
        counts = Counter(self.fleet_counts)
        by_end = Counter(p["end"] for p in self.processes)
        return {
            "processes_started": len(self.processes),
            "startup_s": round(self.fleet_startup_s, 3),  # until the first processes were all up and peered
            "processes_at_end": {role: sum(1 for p in self.processes if p["role"] == role and p["end"] == "running")
                                 for role in ("prefill", "decode")},
            "kills": {role: int(counts[f"{role}_kills"]) for role in ("prefill", "decode")},
            "kills_by_churn": int(counts["prefill_kills"] + counts["decode_kills"]) - self.kills - self.net_kills,
            **({"kills_by_net_fault": self.net_kills} if self.config.two_hosts else {}),
            "restarts": int(counts["restarts"]),
            "joins": int(counts["joins"]),
            "leaves": {role: int(counts[f"{role}_leaves"]) for role in ("prefill", "decode")},
            "processes_by_end": dict(by_end),
            "start_failures": int(counts["start_failures"]),
            "peerings": int(counts["peerings"]),
            "peering_failures": int(counts["peering_failures"]),
            "churn_events_skipped": self.churn_skipped,
            "counterpart_halves": {key: int(self.counterparts[key]) for key in (
                "decode halves left to the decode engine", "prefill halves left to the prefill engine",
                "prefill halves settled by the prefill engine", "prefill halves whose prefill died too",
                "prefill halves stopped by the driver")},
            # seconds from a decode's death until the prefill engine had settled a half it held for it
            "prefill_halves_settled_within_s": round(max(self.orphan_settle_s), 3) if self.orphan_settle_s else None,
            "pairs_completed": {f"{p} -> {d}": n for (p, d), n in sorted(self.pairs.items())},
            "distinct_pairs_completed": len(self.pairs),
            "left_pools_not_whole": sum(1 for p in self.processes if p["end"] == "left" and p["pool"] is not None
                                        and p["pool"]["free"] != p["pool"]["total"]),
            "processes": self.processes,
        }

    def latency(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else 0.0

    def as_injected(self, outcome: str) -> dict[str, int]:
        """Requests that ended in ``outcome`` because an injected fault was meant to end them so, by fault."""
        return {cause: n for (out, cause), n in sorted(self.causes.items()) if out == outcome and cause and n}

    def unexpectedly(self, outcome: str) -> int:
        """Requests that ended in ``outcome`` with no injected fault to explain it."""
        return int(self.causes.get((outcome, ""), 0))

    @property
    def throughput(self) -> float:
        """Bytes landed at the decode per second of the run (see :attr:`bytes_moved`)."""
        return self.bytes_moved / self.elapsed if self.elapsed > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        writes = self.decode_stats.get("writes", {}).get("refused_by_reason", {})
        requests = sum(self.outcomes.values())
        return {
            "transport": self.config.transport,
            "topology": self.topology(),
            "checksum": self.config.checksum,
            "unsafe_legacy": self.config.unsafe_legacy,
            "layerwise": self.config.layerwise,
            "requests": requests,
            "completed": self.outcomes["completed"],
            "rejected": self.outcomes["rejected"],
            "aborted": self.outcomes["aborted"],
            "failed": self.outcomes["failed"],
            "failure_reasons": dict(self.failures),
            # why requests did not complete, split into what the injected faults were meant to do
            # (by fault) and what nothing injected explains
            "failed_as_injected": self.as_injected("failed"),
            "failed_unexpectedly": self.unexpectedly("failed"),
            "unexpected_failure_reasons": dict(self.unexpected_failures),
            "secondary_failure_reasons": dict(self.secondary_failures),
            "decode_ranks_timed_out": self.rank_timeouts,
            "aborted_as_injected": self.as_injected("aborted"),
            "aborted_unexpectedly": self.unexpectedly("aborted"),
            "rejected_as_injected": self.as_injected("rejected"),
            "rejected_unexpectedly": self.unexpectedly("rejected"),
            "faults": {name: int(self.faults.get(name, 0)) for name in ALL_FAULTS},
            "faults_planned": {name: int(self.planned.get(name, 0)) for name in ALL_FAULTS},
            "sender_kills": self.kills,
            "leaked_pages": self.leaked_pages,
            "leaked_from_requests": len(self.leak_sources),
            "corrupted_pages": self.corrupted_pages,
            "lost_pages": self.lost_pages,
            "rejected_succeeded": self.rejected_succeeded,
            "pages_checked": self.pages_checked,
            "stale_writes_refused": int(writes.get("stale_tag", 0)) + int(writes.get("unknown_tag", 0)),
            "writes_refused": dict(writes),
            "quarantined_at_end": self.quarantined_at_end,
            "pool_total": self.pool_total,
            "pool_free_at_end": self.pool_free_at_end,
            "prefill_pool_total": int(self.prefill_stats.get("pool_total", 0)),
            "prefill_pool_free_at_end": int(self.prefill_stats.get("pool_free", 0)),
            # the prefills' sending paths (their live links at the end): without link faults the links run
            # with no injector, as in production, and these show the caller's-thread and one-step paths ran
            "prefill_link_paths": {k: int(v) for k, v in self.prefill_stats.get("link_paths", {}).items()},
            "pools": self.pools,
            "accounting_errors": self.accounting_errors,
            "accounting_checks_during_run": self.accounting_checks,
            "settled": self.settled,
            "bytes_moved": self.bytes_moved,
            "seconds": round(self.elapsed, 3),
            # six significant digits: a slow run (soft-RoCE under emulation) moves kB/s, not 0
            "throughput_gbps": float(f"{self.throughput / 1e9:.6g}"),
            "throughput_bytes_per_s": round(self.throughput, 1),
            "latency_ms": {"p50": round(self.latency(50), 3), "p99": round(self.latency(99), 3)},
            **({"requests_started": self.requests_started, "requests_unaccounted": self.requests_unaccounted,
                "fleet": self.fleet_summary()} if self.config.fleet else {}),
            **({"two_hosts": True, "net_faults": {**self.net, "errors": list(self.net_errors)}}
               if self.config.two_hosts else {}),
            "ok": self.ok,
        }
