"""The stress driver: plays scheduler for a prefill and a decode node process and judges by content.

One loop advances every in-flight request through its phases (admit on both roles, wait for the
destination, fill source pages with oracle bytes, send in chunks, wait, read back and check every
page), injects the request-level faults of its plan, and polls both nodes' statuses in bulk. The
verdict per request is made from what the decode process actually holds (:mod:`kvxfer.tools.oracle`), and
at the end both pools must be whole again.

Invariants of the run: it stops by itself (request count and/or duration, then a bounded settle);
it only talks to processes it started, on loopback; those processes and its key directory (a
:class:`kvxfer.tools.procs.TempDir`) do not outlive it, even when it is killed (:mod:`kvxfer.tools.procs`).
"""

from __future__ import annotations

import enum
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import AdmissionRejected, KvxferError, PeerError, PoolExhausted
from .. import procs
from ..node import NodeClient, NodeSpec, spawn
from .workload import ALL_FAULTS, RequestPlan, StressConfig, Workload

log = logging.getLogger("kvxfer.stress")


class Phase(enum.Enum):
    """Where an in-flight request is in the driver's loop, in order."""

    ADMIT_PREFILL = 1
    ADMIT_DECODE = 2
    WAIT_READY = 3
    SENDING = 4
    WAIT_DONE = 5
    WAIT_DECODE_END = 6
    END = 7


@dataclass
class Live:
    """The driver's record of one in-flight request: its plan, phase, progress and, once ended, its outcome."""

    plan: RequestPlan
    phase: Phase = Phase.ADMIT_PREFILL
    instance: int = 0
    prefill_admitted: bool = False
    decode_admitted: bool = False
    pages: int = 0
    sent_chunks: int = 0
    retry_at: float = 0.0
    started: float = 0.0
    expect: str = ""
    outcome: str = ""
    detail: str = ""
    fired: str = ""  # the request-level fault of its plan, once it has been injected
    collateral: str = ""  # an injected fault aimed at another request that takes this one down too (kill_sender)


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
    decode_stats: dict[str, Any] = field(default_factory=dict)
    prefill_stats: dict[str, Any] = field(default_factory=dict)
    accounting_errors: list[str] = field(default_factory=list)
    accounting_checks: int = 0  # check_accounting() calls on a live node during the run
    settled: bool = True
    kills: int = 0
    leak_sources: set = field(default_factory=set)
    # (outcome, cause): cause is the injected fault the outcome was meant to come from, "" if none was
    causes: Counter = field(default_factory=Counter)
    unexpected_failures: Counter = field(default_factory=Counter)

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


class StressDriver:
    """Runs one stress workload against a prefill and a decode node process it starts, and owns them and their keys.

    It only talks to the processes it started; they and its key directory do not outlive it."""

    def __init__(self, config: StressConfig, *, on_progress: Callable[[StressResult, int], None] | None = None,
                 node_log: Any = None) -> None:
        self.config = config
        self.result = StressResult(config)
        self.workload = Workload(config)
        self._on_progress = on_progress
        self._node_log = node_log
        self.live: dict[str, Live] = {}
        self.started = 0
        self.instance = 0
        self.prefill: NodeClient | None = None
        self.decode: NodeClient | None = None
        self.peer = ""
        self._t0 = 0.0
        # one key pair per role (a respawned writer keeps its role's key): authenticated control plane
        from ...wire.auth import write_cluster

        self._keys = procs.TempDir(prefix="kvxfer-stress-keys-")
        self.keyrings = {p.name: str(p) for p in write_cluster(self._keys.name, ["prefill", "decode"])}
        self._next_sample = 0.0
        self._next_audit = 0.0
        self._fault_counts_closed: Counter = Counter()

    # nodes ---------------------------------------------------------------------------------------
    def _spec(self, role: str) -> NodeSpec:
        cfg = self.config
        config = {
            "max_context": cfg.max_context,
            "transport": cfg.transport,
            "alloc_policy": cfg.alloc_policy,
            "free_policy": cfg.free_policy,
            "checksum": cfg.checksum,
            "seed": cfg.seed,
            "drain_timeout": cfg.drain_timeout,
            "transfer_timeout": cfg.transfer_timeout,
            "meta_timeout": cfg.transfer_timeout,
            "unsafe_legacy": cfg.unsafe_legacy,
            "heartbeat_interval": 0.5,
            "transport_options": cfg.transport_options,
            "keyring": self.keyrings[role],
        }
        if cfg.transport == "verbs":
            config["peer_timeout"] = 10.0  # verbs has no EOF: a killed writer is found by its silence
        pages = cfg.prefill_pages
        if role == "prefill":
            config["allow_undersized_pool"] = cfg.prefill_tokens < cfg.max_context
        else:
            pages = cfg.decode_pages
        return NodeSpec(role=role, num_buffers=cfg.buffers, item_len=cfg.item_len, num_pages=pages,
                        page_size=cfg.page_size, config=config,
                        faults=cfg.link_faults() if role == "prefill" else None,
                        seed=cfg.seed + self.instance, log_level="ERROR")

    def _start_prefill(self) -> None:
        self.prefill = spawn(self._spec("prefill"), stderr=self._node_log)
        assert self.decode is not None
        self.peer = self.decode.connect(address=self.prefill.control)

    def _kill_prefill(self) -> None:
        """SIGKILL the writer mid-transfer, settle what it owned, start a fresh one."""
        assert self.prefill is not None
        try:
            self._fault_counts_closed.update(self.prefill.fault(op="counts"))
        except KvxferError:
            pass
        self.prefill.kill()
        self.prefill.close()
        self.result.kills += 1
        dead = self.instance
        self.instance += 1
        for live in self.live.values():
            if live.instance != dead or live.phase in (Phase.END, Phase.ADMIT_PREFILL):
                continue
            live.collateral = "kill_sender"
            if live.decode_admitted:
                live.phase = Phase.WAIT_DECODE_END
                live.expect = "failed"
            else:
                self._finish(live, "failed", "sender killed")
        self._start_prefill()

    # the loop --------------------------------------------------------------------------------------
    def run(self) -> StressResult:
        cfg = self.config
        self.decode = spawn(self._spec("decode"), stderr=self._node_log)
        try:
            self._start_prefill()
            self._t0 = time.monotonic()
            while True:
                now = time.monotonic()
                self._start_new(now)
                if not self.live:
                    break
                for live in list(self.live.values()):
                    if live.phase is not Phase.END and now >= live.retry_at:
                        self._act(live, now)
                self._poll()
                self._sample(now)
                self._audit(now)
                self.live = {rid: lv for rid, lv in self.live.items() if lv.phase is not Phase.END}
                if self._on_progress is not None:
                    self._on_progress(self.result, len(self.live))
            self._settle()
        finally:
            self.result.elapsed = time.monotonic() - self._t0 if self._t0 else 0.0
            try:
                for node in (self.prefill, self.decode):
                    if node is not None:
                        node.close()
            finally:
                self._keys.cleanup()
        del cfg
        return self.result

    def _more(self, now: float) -> bool:
        cfg = self.config
        if cfg.requests is not None and self.started >= cfg.requests:
            return False
        return not (cfg.duration is not None and now - self._t0 >= cfg.duration)

    def _start_new(self, now: float) -> None:
        while len(self.live) < self.config.concurrency and self._more(now):
            plan = self.workload.next()
            self.started += 1
            live = Live(plan=plan, instance=self.instance, started=now)
            for fault in plan.faults:
                self.result.planned[fault] += 1
            if "oversized" in plan.faults:
                self._fired(live, "oversized")
            if plan.faults & {"abort_before_bootstrap"} and plan.decode_first:
                live.phase = Phase.ADMIT_DECODE
            self.live[plan.rid] = live

    def _fired(self, live: Live, fault: str) -> None:
        self.result.faults[fault] += 1
        live.fired = fault

    def _finish(self, live: Live, outcome: str, detail: str = "") -> None:
        live.phase = Phase.END
        live.outcome = outcome
        live.detail = detail
        self.result.outcomes[outcome] += 1
        reason = detail.split(":")[0][:60] or "failed"
        if outcome == "failed":
            self.result.failures[reason] += 1
        if outcome != "completed":
            cause = self._cause(live, outcome, reason)
            self.result.causes[(outcome, cause)] += 1
            if outcome == "failed" and not cause:
                self.result.unexpected_failures[reason] += 1

    # What each injected fault is meant to do to the request it hits (link faults hit frames, not
    # requests: a flipped byte shows up as the decode's checksum check failing).
    _INTENDED = {
        "abort_before_bootstrap": ("aborted", "failed"),
        "abort_mid_transfer": ("aborted", "failed"),
        "abort_after_done": ("aborted", "failed"),
        "client_disconnect": ("aborted", "failed"),
        "oversized": ("rejected",),
        "kill_sender": ("failed", "aborted"),
    }

    def _cause(self, live: Live, outcome: str, reason: str) -> str:
        """The injected fault that ``outcome`` was meant to come from, or "" when none explains it."""
        if live.collateral:
            return live.collateral
        if live.fired and outcome in self._INTENDED[live.fired]:
            return live.fired
        if outcome == "failed" and reason == "checksum" and self.config.faults.get("flip_byte"):
            return "flip_byte"
        return ""

    # one step of one request ---------------------------------------------------------------------------
    def _act(self, live: Live, now: float) -> None:
        assert self.prefill is not None and self.decode is not None
        plan = live.plan
        rid = plan.rid
        try:
            if live.phase is Phase.ADMIT_PREFILL:
                self.prefill.admit(rid=rid, tokens=plan.tokens)
                live.prefill_admitted = True
                live.instance = self.instance
                if "abort_before_bootstrap" in plan.faults:
                    self._fired(live, "abort_before_bootstrap")
                    self.prefill.abort(rid=rid, reason="aborted before bootstrap")
                    self._finish(live, "aborted")
                    return
                if "client_disconnect" in plan.faults and plan.disconnect_at == 0:
                    self._fired(live, "client_disconnect")
                    self.prefill.abort(rid=rid, reason="client disconnected")
                    self._finish(live, "aborted")
                    return
                live.phase = Phase.ADMIT_DECODE
            elif live.phase is Phase.ADMIT_DECODE:
                info = self.decode.admit(rid=rid, tokens=plan.tokens, peer=self.peer)
                live.decode_admitted = True
                live.pages = info["pages"]
                if "abort_before_bootstrap" in plan.faults:  # decode-first variant
                    self._fired(live, "abort_before_bootstrap")
                    self.decode.abort(rid=rid, reason="aborted before bootstrap")
                    live.phase = Phase.WAIT_DECODE_END
                    live.expect = "aborted"
                    return
                if "client_disconnect" in plan.faults and plan.disconnect_at == 1:
                    self._fired(live, "client_disconnect")
                    self.decode.abort(rid=rid, reason="client disconnected")
                    self.prefill.abort(rid=rid, reason="client disconnected")
                    live.phase = Phase.WAIT_DECODE_END
                    live.expect = "aborted"
                    return
                live.phase = Phase.WAIT_READY
            elif live.phase is Phase.SENDING:
                self._send_chunk(live)
        except AdmissionRejected as exc:
            self._on_rejected(live, exc)
        except PoolExhausted:
            live.retry_at = now + 0.02
        except PeerError as exc:
            self._finish(live, "failed", f"peer: {exc}")
        except KvxferError as exc:
            if live.decode_admitted:
                live.phase = Phase.WAIT_DECODE_END
                live.expect = "failed"
            else:
                self._finish(live, "failed", f"{exc.code}: {exc}")

    def _on_rejected(self, live: Live, exc: AdmissionRejected) -> None:
        assert self.prefill is not None and self.decode is not None
        rid = live.plan.rid
        if live.prefill_admitted:
            # The decode refused what the prefill accepted: drop the prefill half.
            try:
                self.prefill.abort(rid=rid, reason=f"decode rejected: {exc.reason}")
            except KvxferError:
                pass
        elif not live.decode_admitted:
            # The prefill refused: the decode must refuse it as well (before reserving anything).
            try:
                self.decode.admit(rid=rid, tokens=live.plan.tokens, peer=self.peer)
            except AdmissionRejected:
                pass
            except KvxferError:
                pass
            else:
                self.result.rejected_succeeded += 1
                self.decode.abort(rid=rid, reason="admitted after the prefill rejected it")
        if "oversized" not in live.plan.faults:
            self._finish(live, "failed", f"unexpected rejection: {exc.reason}")
            return
        self._finish(live, "rejected", exc.reason)

    def _send_chunk(self, live: Live) -> None:
        assert self.prefill is not None and self.decode is not None
        plan = live.plan
        rid = plan.rid
        chunks = max(plan.chunks, 2 if plan.faults & {"abort_mid_transfer", "kill_sender", "client_disconnect"} else 1)
        per = max(1, -(-live.pages // chunks))
        info = self.prefill.send(rid=rid, count=per)
        live.sent_chunks += 1
        # The writer decides when it is done (a legacy placeholder writer stops after one page).
        last = live.sent_chunks * per >= live.pages or info["state"] in ("DONE_SENT", "SUCCEEDED")
        if live.sent_chunks == 1 and not last:
            if "abort_mid_transfer" in plan.faults:
                self._fired(live, "abort_mid_transfer")
                self.decode.abort(rid=rid, reason="aborted mid-transfer")
                live.phase = Phase.WAIT_DECODE_END
                live.expect = "aborted"
                return
            if "client_disconnect" in plan.faults:
                self._fired(live, "client_disconnect")
                self.decode.abort(rid=rid, reason="client disconnected")
                self.prefill.abort(rid=rid, reason="client disconnected")
                live.phase = Phase.WAIT_DECODE_END
                live.expect = "aborted"
                return
            if "kill_sender" in plan.faults:
                self._fired(live, "kill_sender")
                self._kill_prefill()
                return
        if last:
            live.phase = Phase.WAIT_DONE

    # polling -----------------------------------------------------------------------------------------
    def _poll(self) -> None:
        assert self.prefill is not None and self.decode is not None
        ready = [lv for lv in self.live.values() if lv.phase is Phase.WAIT_READY and lv.instance == self.instance]
        if ready:
            try:
                states = self.prefill.statuses(rids=[lv.plan.rid for lv in ready])
            except PeerError:
                states = {}
            for live in ready:
                status = states.get(repr(live.plan.rid))
                if status is None:
                    continue
                if status["state"] == "READY":
                    try:
                        self.prefill.prepare(rid=live.plan.rid, seed=self.config.seed)
                        live.phase = Phase.SENDING
                    except KvxferError:
                        live.phase = Phase.WAIT_DECODE_END
                        live.expect = "failed"
                elif status["state"] in ("FAILED", "ABORTED", "REJECTED"):
                    live.phase = Phase.WAIT_DECODE_END
                    live.expect = "failed"
        waiting = [lv for lv in self.live.values() if lv.phase in (Phase.WAIT_DONE, Phase.WAIT_DECODE_END)]
        if not waiting:
            return
        states = self.decode.statuses(rids=[lv.plan.rid for lv in waiting])
        for live in waiting:
            status = states.get(repr(live.plan.rid))
            if status is None:
                continue
            state = status["state"]
            if state == "READABLE":
                if live.phase is Phase.WAIT_DECODE_END or "abort_after_done" in live.plan.faults:
                    if live.phase is Phase.WAIT_DONE:
                        self._fired(live, "abort_after_done")
                    self.decode.abort(rid=live.plan.rid, reason="aborted after DONE, before read")
                    if live.phase is Phase.WAIT_DONE:
                        live.expect = "aborted"
                    live.phase = Phase.WAIT_DECODE_END
                    continue
                self._read(live)
            elif state in ("FAILED", "ABORTED", "REJECTED", "RELEASED"):
                if state == "ABORTED" or (state == "FAILED" and live.expect == "aborted"):
                    self._finish(live, "aborted", status.get("error") or "")
                elif state == "REJECTED":
                    self._finish(live, "rejected", status.get("reason") or "")
                else:
                    self._finish(live, "failed", f"{status.get('check') or status.get('reason') or 'failed'}")

    def _read(self, live: Live) -> None:
        assert self.decode is not None
        latency = (time.monotonic() - live.started) * 1000
        try:
            report = self.decode.read_check(rid=live.plan.rid, seed=self.config.seed)
        except KvxferError as exc:
            self._finish(live, "failed", f"read: {exc.code}")
            return
        self.result.pages_checked += report["pages"]
        self.result.leaked_pages += report["leaked_pages"]
        self.result.corrupted_pages += report["corrupted_pages"]
        for source in report["leaked_from"]:
            self.result.leak_sources.add(tuple(source))
        if "oversized" in live.plan.faults:
            self.result.rejected_succeeded += 1
        self.result.latencies_ms.append(latency)
        self._finish(live, "completed")

    def _sample(self, now: float) -> None:
        if now < self._next_sample:
            return
        self._next_sample = now + 0.5
        assert self.decode is not None
        landed = self.decode.stats()["writes"]["landed_bytes"]
        self.result.samples.append((now - self._t0, int(landed)))

    def _audit(self, now: float) -> None:
        """The accounting invariant on both live nodes, while requests are in flight (once a second)."""
        if now < self._next_audit:
            return
        self._next_audit = now + 1.0
        for node in (self.decode, self.prefill):
            if node is None or not node.alive():
                continue  # a killed writer is being replaced (kill_sender)
            try:
                node.accounting()
                self.result.accounting_checks += 1
            except PeerError:
                continue  # died between the check and the call: the restart handles it
            except KvxferError as exc:
                self.result.accounting_errors.append(f"{node.spec.role} during the run: {exc}")

    # the end -----------------------------------------------------------------------------------------
    def _settle(self) -> None:
        """Wait (bounded) until no request is active on either node, then take the accounting."""
        assert self.prefill is not None and self.decode is not None
        deadline = time.monotonic() + self.config.settle_timeout
        while True:
            dstats, pstats = self.decode.stats(), self.prefill.stats()
            if dstats["active"] == 0 and pstats["active"] == 0:
                break
            if time.monotonic() > deadline:
                self.result.settled = False
                log.error("requests still active after %.0f s: decode %d, prefill %d",
                          self.config.settle_timeout, dstats["active"], pstats["active"])
                break
            time.sleep(0.1)
        self._next_sample = 0.0
        self._sample(time.monotonic())
        for node in (self.decode, self.prefill):
            try:
                node.accounting()
            except KvxferError as exc:
                self.result.accounting_errors.append(f"{node.spec.role}: {exc}")
        self.result.decode_stats = self.decode.stats()
        self.result.prefill_stats = self.prefill.stats()
        counts = Counter(self._fault_counts_closed)
        counts.update(self.prefill.fault(op="counts"))
        for name, key in (("late_write", "late"), ("duplicate_write", "duplicate"), ("flip_byte", "flip"),
                          ("slow_link", "slow")):
            self.result.faults[name] += int(counts.get(key, 0))
