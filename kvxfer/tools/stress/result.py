"""What a stress run counted, and its verdict (:class:`StressResult`).

The verdict is made from content and accounting only: no leaked or corrupted page (by the oracle),
no lost page in any pool (every rank's pool whole again after the settle), no rejected request that
succeeded, clean accounting, everything settled.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .workload import ALL_FAULTS, StressConfig


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
    }


@dataclass
class StressResult:
    """Everything a stress run counted and measured; :attr:`ok` is the verdict (no leak, no corruption, no lost
    page, no rejected request that succeeded, accounting clean, settled)."""

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
        return lost

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
            and not self.accounting_errors
            and self.settled
        )

    def topology(self) -> dict[str, Any]:
        cfg = self.config
        return {"prefill_tp": cfg.prefill_tp, "decode_tp": cfg.decode_tp, "prefill_page_size": cfg.prefill_page,
                "decode_page_size": cfg.decode_page,
                **({"kv_heads": cfg.kv_heads, "head_bytes": cfg.head_bytes} if cfg.topology else {}),
                "text": cfg.describe_topology()}

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
            "ok": self.ok,
        }
