"""The stress driver: plays scheduler for the ranks of a prefill and a decode server and judges by content.

One loop advances every in-flight request through its phases (admit on every rank of both roles,
wait until every prefill rank has its destinations, fill source pages with oracle bytes, send in
chunks on every prefill rank, wait, read back and check every decode rank's pages), injects the
request-level faults of its plan, and polls every rank's statuses in bulk. The verdict per request
is made from what the decode processes actually hold (:mod:`kvxfer.tools.oracle`, or cell by cell
with a topology: :mod:`kvxfer.tools.head_oracle`), and at the end every pool must be whole again.

A request is one request across the ranks (:mod:`.ranks`): the plain pair is one rank of each. A
request-level fault acts on the request as a whole: an abort mid-transfer starts on one decode rank
and the engines carry it to the ranks that share its writers (the driver starts it once in each
group of ranks that share none), a client disconnect aborts every rank, ``kill_sender`` kills one
prefill rank process and the driver stops the request's other ranks. A request completes only when
every decode rank read back exactly its bytes; a rank that ends otherwise ends the request.

A fleet (:mod:`.fleet`: ``prefills`` x ``decodes`` processes of one rank each) routes each request to
one (prefill, decode) pair drawn from those up: the request's :class:`~.ranks.Route` names them, and
everything above acts on them alone. With churn, a request's start may SIGKILL and restart a process,
add one or retire one cleanly. A request routed to a process that dies fails (put down to the fault
that killed it); its half in the surviving process is stopped by the driver when that half has no
destination yet (what a router does when the other half of a request is gone), else left to the
engine, which must settle it when the data connection closes. A retired process's pool must be whole
when it leaves; a killed process's pool dies with it, and the pools it shared requests with must not
keep a page of them.

On two hosts (``--two-hosts``), the fleet's prefills run in one network namespace and its decodes in
another (:class:`kvxfer.tools.netns.TwoHosts`, owned by the driver), and the network faults of the
run's timeline (:mod:`.netfaults`) cut, drop or blackhole the wire between them, or kill or stop a
process, while requests start. A kill goes through the same path as a churn kill (restart included);
a request that does not complete while or after a fault was in force during its life is put down to
that fault. Every fault is undone before the settle, so the pools must end whole as ever.

Invariants of the run: it stops by itself (request count and/or duration, then a bounded settle);
it only talks to processes it started, on loopback or (two hosts) over unix sockets; those
processes, its key directory (a :class:`kvxfer.tools.procs.TempDir`) and its namespaces do not
outlive it, even when it is killed (:mod:`kvxfer.tools.procs`; namespaces: :func:`kvxfer.tools.netns.sweep_stale`).
"""

from __future__ import annotations

import enum
import logging
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...errors import AdmissionRejected, KvxferError, PeerError, PoolExhausted
from .. import procs
from ..guests import TwoGuests
from ..netns import TwoHosts
from .fleet import Fleet, Process
from .netfaults import NetChaos, Window
from .ranks import Ranks, Route
from .result import StressResult, pool_totals
from .workload import RequestPlan, StressConfig, Workload

log = logging.getLogger("kvxfer.stress")

__all__ = ["Live", "Phase", "StressDriver", "StressResult"]

_ENDED = ("FAILED", "ABORTED", "REJECTED", "RELEASED")


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
    """The driver's record of one in-flight request across the ranks: its plan, phase, which ranks hold
    it, each prefill rank's sending progress, each decode rank's ending and, once ended, its outcome."""

    plan: RequestPlan
    route: Route
    phase: Phase = Phase.ADMIT_PREFILL
    prefills: set[int] = field(default_factory=set)  # prefill ranks that admitted it
    decodes: set[int] = field(default_factory=set)  # decode ranks that admitted it
    bound: dict[int, int] = field(default_factory=dict)  # prefill rank -> incarnation the request depends on
    dbound: dict[int, int] = field(default_factory=dict)  # a fleet: decode seat -> incarnation it depends on
    src_pages: dict[int, int] = field(default_factory=dict)  # prefill rank -> source pages it sends (0: none)
    sent: dict[int, int] = field(default_factory=dict)  # prefill rank -> source pages sent so far
    done_sending: set[int] = field(default_factory=set)
    sent_chunks: int = 0
    # --layerwise: prefill rank -> the (layer, pages) sends still to make, one per step
    layer_plan: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    ended: dict[int, tuple[str, str]] = field(default_factory=dict)  # decode rank -> (state, detail); READ: checked
    retry_at: float = 0.0
    started: float = 0.0
    expect: str = ""
    outcome: str = ""
    detail: str = ""
    fired: str = ""  # the request-level fault of its plan, once it has been injected
    collateral: str = ""  # an injected fault aimed at another request that takes this one down too (kill_sender, churn)

    @property
    def prefill_admitted(self) -> bool:
        return bool(self.prefills)

    @property
    def decode_admitted(self) -> bool:
        return bool(self.decodes)


class StressDriver:
    """Runs one stress workload against the prefill and decode rank processes it starts (one of each
    without a topology), and owns them and their keys.

    It only talks to the processes it started; they and its key directory do not outlive it."""

    def __init__(self, config: StressConfig, *, on_progress: Callable[[StressResult, int], None] | None = None,
                 node_log: Any = None) -> None:
        self.config = config
        self.result = StressResult(config)
        self.workload = Workload(config)
        self._on_progress = on_progress
        self.live: dict[str, Live] = {}
        self.started = 0
        self._t0 = 0.0
        # two hosts: the namespaces first (nothing else exists yet if they cannot be made)
        self.hosts: TwoHosts | TwoGuests | None = None
        if config.two_hosts:
            self.hosts = TwoGuests(config.peer_agent) if config.peer_agent else TwoHosts()
        # one key pair per rank (a respawned writer keeps its rank's key): authenticated control plane
        from ...wire.auth import write_cluster

        self._keys = procs.TempDir(prefix="kvxfer-stress-keys-")
        self.keyrings = {p.name: str(p) for p in write_cluster(self._keys.name, config.key_names())}
        self.fleet: Fleet | None = Fleet(config, self.keyrings, node_log) if config.fleet else None
        self.chaos: NetChaos | None = None
        if self.hosts is not None:
            assert self.fleet is not None  # two hosts run a fleet
            self.fleet.place(self.hosts)
            if config.net_faults:
                self.chaos = NetChaos(self.hosts, config.net_faults, config.net_fault_gap, suspend=self._suspend,
                                      rounds=config.net_fault_rounds)
        self.ranks: Any = self.fleet if self.fleet is not None else Ranks(config, self.keyrings, node_log)
        self._held: RequestPlan | None = None  # a fleet: the next request, waiting for a pair to be up
        # a fleet: requests whose decode died while their prefill half had its destination, by prefill
        # (seat, incarnation): the prefill engine must settle them itself
        self._orphans: dict[tuple[int, int], list[tuple[str, float]]] = {}  # -> [(rid, when its decode died)]
        self._next_orphan_check = 0.0
        self._stopped = False
        self._next_sample = 0.0
        self._next_audit = 0.0
        self._unpeered_since: float | None = None  # a fleet waiting for a failed pairing to be retried

    # the loop --------------------------------------------------------------------------------------
    def run(self) -> StressResult:
        try:
            self.ranks.start()
            self._t0 = time.monotonic()
            if self.chaos is not None:
                self.chaos.start()
            while True:
                now = time.monotonic()
                if self.chaos is not None:
                    self._net_tick(now)
                if self.fleet is not None:
                    self._churn_tick(now)
                self._start_new(now)
                if not self.live:
                    if not self._waiting_for_a_pair(now):
                        break
                    time.sleep(0.02)
                for live in list(self.live.values()):
                    if live.phase is not Phase.END and now >= live.retry_at:
                        self._act(live, now)
                self._poll()
                if self._orphans and now >= self._next_orphan_check:
                    self._next_orphan_check = now + 0.1
                    self._check_orphans()
                self._sample(now)
                self._audit(now)
                self.live = {rid: lv for rid, lv in self.live.items() if lv.phase is not Phase.END}
                if self._on_progress is not None:
                    self._on_progress(self.result, len(self.live))
            self._stop_chaos()
            if self.fleet is not None:
                self._fleet_end()
            self._settle()
        finally:
            self.result.elapsed = time.monotonic() - self._t0 if self._t0 else 0.0
            try:
                self._stop_chaos()
                if self.chaos is not None:  # its record, with the recoveries seen until the end
                    self.result.net = self.chaos.summary()
                    self.result.net_errors = list(self.chaos.errors)
            finally:
                if self.fleet is not None:
                    self.result.record_fleet(self.fleet, self.started)
                try:
                    self.ranks.close()
                finally:
                    try:
                        if self.hosts is not None:
                            self.hosts.close()
                    finally:
                        self._keys.cleanup()
        return self.result

    def _more(self, now: float) -> bool:
        cfg = self.config
        if self._stopped:
            return False
        if cfg.requests is not None and self.started >= cfg.requests:
            return False
        return not (cfg.duration is not None and now - self._t0 >= cfg.duration)

    def _start_new(self, now: float) -> None:
        while len(self.live) < self.config.concurrency and (self._held is not None or self._more(now)):
            if self._held is not None:
                plan = self._held
            else:
                plan = self.workload.next()
                self.started += 1
                if plan.churn is not None:
                    self._churn(plan.churn, now)
            routed = self.ranks.route(plan.route)
            if routed is None:  # a fleet with no pair up: it starts once one is
                self._held = plan
                return
            self._held = None
            route, incarnations = routed
            live = Live(plan=plan, route=route, started=now)
            if incarnations:  # a fleet: the request depends on these two processes from now on
                live.bound[route.prefills[0]] = incarnations["prefill"]
                live.dbound[route.decodes[0]] = incarnations["decode"]
            for fault in plan.faults:
                self.result.planned[fault] += 1
            if "oversized" in plan.faults:
                self._fired(live, "oversized")
            if plan.faults & {"abort_before_bootstrap"} and plan.decode_first:
                live.phase = Phase.ADMIT_DECODE
            self.live[plan.rid] = live

    def _waiting_for_a_pair(self, now: float) -> bool:
        """A fleet with requests still to start and no pair up yet, while processes are starting."""
        fleet = self.fleet
        if fleet is None or (self._held is None and not self._more(now)):
            return False
        if fleet.starting() or fleet.leaving():
            return True
        if fleet.unpeered():  # a pairing failed (a cut wire): it is tried again, for a while
            if self._unpeered_since is None:
                self._unpeered_since = now
            if now - self._unpeered_since < self.config.settle_timeout:
                return True
        else:
            self._unpeered_since = None
        self.result.accounting_errors.append("no prefill and decode pair left up to route requests to")
        self._held = None
        self._stopped = True  # nothing more starts
        return False

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
        if self.fleet is not None:
            self._count_for_fleet(live, outcome)
        if self.chaos is not None:
            self.chaos.note(outcome, live.started)
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
    CHURN = "churn"  # a fleet's kill of a process: every request routed to it ends

    def _cause(self, live: Live, outcome: str, reason: str) -> str:
        """The injected fault that ``outcome`` was meant to come from, or "" when none explains it."""
        if live.collateral:
            return live.collateral
        if live.fired and outcome in self._INTENDED[live.fired]:
            return live.fired
        if outcome == "failed" and reason == "checksum" and self.config.faults.get("flip_byte"):
            return "flip_byte"
        if self.chaos is not None and outcome in ("failed", "aborted"):
            return self.chaos.cause(live.started)  # a net fault was in force during its life
        return ""

    # acting on every rank of a request -------------------------------------------------------------
    def _abort_prefills(self, live: Live, reason: str, *, skip: int | None = None) -> None:
        """Abort the request on every prefill rank that admitted it and still runs the process it was
        admitted on (a terminal request is left as it is)."""
        for p in sorted(live.prefills):
            if p == skip or live.bound.get(p) != self.ranks.incarnations[p]:
                continue
            try:
                self.ranks.prefill(p).abort(rid=live.plan.rid, reason=reason)
            except KvxferError:
                pass

    def _abort_decodes(self, live: Live, reason: str, ranks: list[int] | None = None) -> None:
        for d in sorted(live.decodes) if ranks is None else ranks:
            if d in live.decodes and d not in live.ended:
                self.ranks.decode(d).abort(rid=live.plan.rid, reason=reason)

    def _give_up(self, live: Live, detail: str) -> None:
        """The request failed on one rank: stop it on the others, then wait for its decode ranks (if
        any took it) to end, or end it now."""
        self._abort_prefills(live, "request failed on another rank")
        orphans = [d for d in live.decodes if not set(live.route.writers[d]) <= live.prefills]
        for d in orphans:  # no writer of theirs admitted it: nobody else tells them
            try:
                self._abort_decodes(live, "request failed on another rank", [d])
            except KvxferError:
                pass
        if live.decode_admitted:
            live.phase = Phase.WAIT_DECODE_END
            live.expect = live.expect or "failed"
        else:
            self._finish(live, "failed", detail)

    # one step of one request ---------------------------------------------------------------------------
    def _act(self, live: Live, now: float) -> None:
        plan = live.plan
        rid = plan.rid
        try:
            if live.phase is Phase.ADMIT_PREFILL:
                for p in live.route.prefills:
                    if p not in live.prefills:
                        self.ranks.prefill(p).admit(rid=rid, tokens=plan.tokens,
                                                    **self.ranks.prefill_admit_args(p, live.route))
                        live.prefills.add(p)
                        live.bound.setdefault(p, self.ranks.incarnations[p])
                for fault, at in (("abort_before_bootstrap", None), ("client_disconnect", 0)):
                    if fault in plan.faults and (at is None or plan.disconnect_at == at):
                        self._fired(live, fault)
                        self._abort_prefills(live, "aborted before bootstrap" if at is None else "client disconnected")
                        self._finish(live, "aborted")
                        return
                live.phase = Phase.ADMIT_DECODE
            elif live.phase is Phase.ADMIT_DECODE:
                for d in live.route.decodes:
                    if d not in live.decodes:
                        self.ranks.decode(d).admit(rid=rid, tokens=plan.tokens,
                                                   **self.ranks.decode_admit_args(d, live.route))
                        live.decodes.add(d)
                        for p in live.route.writers[d]:
                            live.bound.setdefault(p, self.ranks.incarnations[p])
                if "abort_before_bootstrap" in plan.faults:  # decode-first variant
                    self._fired(live, "abort_before_bootstrap")
                    self._abort_decodes(live, "aborted before bootstrap")
                    live.phase = Phase.WAIT_DECODE_END
                    live.expect = "aborted"
                    return
                if "client_disconnect" in plan.faults and plan.disconnect_at == 1:
                    self._disconnect(live)
                    return
                live.phase = Phase.WAIT_READY
            elif live.phase is Phase.SENDING:
                self._send_chunk(live)
        except AdmissionRejected as exc:
            self._on_rejected(live, exc)
        except PoolExhausted:
            live.retry_at = now + 0.02
        except PeerError as exc:
            self._abort_prefills(live, "request failed on another rank")
            self._finish(live, "failed", f"peer: {exc}")
        except KvxferError as exc:
            self._give_up(live, f"{exc.code}: {exc}")

    def _disconnect(self, live: Live) -> None:
        """The client went away: every rank of both roles is told."""
        self._fired(live, "client_disconnect")
        self._abort_decodes(live, "client disconnected")
        self._abort_prefills(live, "client disconnected")
        live.phase = Phase.WAIT_DECODE_END
        live.expect = "aborted"

    def _on_rejected(self, live: Live, exc: AdmissionRejected) -> None:
        rid = live.plan.rid
        if live.prefill_admitted:
            # A decode rank refused what the prefill ranks accepted: drop their halves (and any decode
            # rank's that took it).
            self._abort_prefills(live, f"decode rejected: {exc.reason}")
            try:
                self._abort_decodes(live, f"another decode rank rejected: {exc.reason}")
            except KvxferError:
                pass
        elif not live.decode_admitted:
            # A prefill rank refused: every other rank must refuse it as well (before reserving anything).
            route = live.route
            others = [(self.ranks.prefill(p), self.ranks.prefill_admit_args(p, route)) for p in route.prefills[1:]]
            others += [(self.ranks.decode(d), self.ranks.decode_admit_args(d, route)) for d in route.decodes]
            admitted = []
            for node, args in others:
                try:
                    node.admit(rid=rid, tokens=live.plan.tokens, **args)
                except KvxferError:
                    continue
                admitted.append(node)
            if admitted:
                self.result.rejected_succeeded += 1
                for node in admitted:
                    node.abort(rid=rid, reason="admitted after another rank rejected it")
        if "oversized" not in live.plan.faults:
            self._finish(live, "failed", f"unexpected rejection: {exc.reason}")
            return
        self._finish(live, "rejected", exc.reason)

    def _send_chunk(self, live: Live) -> None:
        """One step of sending: the next chunk on every prefill rank (with ``layerwise``: the next
        layer of a chunk, so that faults fire between the layers of one request)."""
        plan = live.plan
        rid = plan.rid
        chunks = max(plan.chunks, 2 if plan.faults & {"abort_mid_transfer", "kill_sender", "client_disconnect"} else 1)
        for p in sorted(live.src_pages):
            if p in live.done_sending:
                continue
            total = live.src_pages[p]
            per = max(1, -(-total // chunks))
            if self.config.layerwise:
                steps = live.layer_plan.setdefault(p, self._layer_steps(rid, p, -(-total // per), per))
                layer, count = steps.pop(0)
                info = self.ranks.prefill(p).send(rid=rid, count=count, layer=layer)
                finished = not steps
            else:
                info = self.ranks.prefill(p).send(rid=rid, count=per)
                live.sent[p] = live.sent.get(p, 0) + per
                finished = live.sent[p] >= total
            # The writer decides when it is done (a legacy placeholder writer stops after one page).
            if finished or info["state"] in ("DONE_SENT", "SUCCEEDED"):
                live.done_sending.add(p)
        live.sent_chunks += 1
        last = len(live.done_sending) == len(live.src_pages)
        if live.sent_chunks == 1 and not last:
            if "abort_mid_transfer" in plan.faults:
                # on one decode rank; the engines carry it to the ranks that share its writers
                self._fired(live, "abort_mid_transfer")
                first = live.route.decodes[plan.decode_rank % len(live.route.decodes)]
                starts = [first] + [group[0] for group in live.route.components if first not in group]
                self._abort_decodes(live, "aborted mid-transfer", starts)
                live.phase = Phase.WAIT_DECODE_END
                live.expect = "aborted"
                return
            if "client_disconnect" in plan.faults:
                self._disconnect(live)
                return
            if "kill_sender" in plan.faults:
                self._fired(live, "kill_sender")
                self._kill_prefill(live.route.prefills[plan.prefill_rank % len(live.route.prefills)])
                return
        if last:
            live.phase = Phase.WAIT_DONE

    def _layer_steps(self, rid: str, p: int, chunks: int, per: int) -> list[tuple[int, int]]:
        """Every layer's chunks, the layers interleaved at random (seeded by the run's seed and the
        request), each layer's chunks in order: ``(layer, pages)`` per send."""
        rng = random.Random(f"{self.config.seed}:{rid}:{p}:layers")
        left = {layer: chunks for layer in range(self.config.layers)}
        steps = []
        while left:
            layer = rng.choice(sorted(left))
            steps.append((layer, per))
            left[layer] -= 1
            if not left[layer]:
                del left[layer]
        return steps

    def _kill_prefill(self, p: int, cause: str = "kill_sender") -> None:
        """SIGKILL prefill rank ``p`` mid-transfer, start a fresh one; every request that depended on the
        dead process fails, and its other ranks are stopped."""
        if self._orphans:
            self._check_orphans()  # what the prefill settled before it dies is counted
        dead = self.ranks.replace_prefill(p)
        if cause == "kill_sender":
            self.result.kills += 1
        for live in self.live.values():
            if live.phase is Phase.END or live.bound.get(p) != dead:
                continue
            live.collateral = cause
            self._abort_prefills(live, "a prefill rank of the request died", skip=p)
            if live.decode_admitted:
                live.phase = Phase.WAIT_DECODE_END
                live.expect = "failed"
                if self.fleet is not None:  # the decode engine must end its half by itself
                    self.result.counterparts["decode halves left to the decode engine"] += 1
            else:
                self._finish(live, "failed", "sender killed" if cause == "kill_sender" else "prefill killed")

    # a fleet: processes coming and going ------------------------------------------------------------
    def _churn(self, event: tuple[str, str, float], now: float) -> None:
        """Fire one churn event (kind, role, which): SIGKILL and restart a process, start one more, or
        retire one. A kind the fleet cannot take now becomes another (a join with no free seat a leave,
        a leave of a role's last process a join); with neither possible, a kill."""
        fleet = self.fleet
        assert fleet is not None
        kind, role, which = event
        up = fleet.up(role)
        if kind == "join" and fleet.free_seat(role) is None:
            kind = "leave"
        if kind == "leave" and len(up) < 2:
            kind = "join" if fleet.free_seat(role) is not None else "kill"
        if kind == "join":
            fleet.join(role)
            return
        if not up:  # every process of the role is starting or leaving: nothing to act on
            self.result.churn_skipped += 1
            return
        victim = up[min(int(which * len(up)), len(up) - 1)]
        if kind == "leave":
            fleet.leave(victim)
        elif role == "prefill":
            self._kill_prefill(victim.seat, self.CHURN)
        else:
            self._kill_decode(victim.seat)

    # two hosts: the net faults' timeline -----------------------------------------------------------
    def _net_tick(self, now: float) -> None:
        """Carry out the kills the timeline has due; stop the timeline once every request has started."""
        chaos = self.chaos
        assert chaos is not None
        for role, window in chaos.take_kills():
            self._net_kill(role, window)
        if self._held is None and not self._more(now):
            self._stop_chaos()

    def _stop_chaos(self) -> None:
        """End the timeline (idempotent): the wire healed, no process left stopped."""
        if self.chaos is not None:
            self.chaos.stop()

    def _net_kill(self, role: str, window: Window) -> None:
        """``kill_prefill`` / ``kill_decode``: SIGKILL the first process of the role that is up (restarted
        in its seat, as a churn kill is)."""
        fleet = self.fleet
        assert fleet is not None
        up = fleet.up(role)
        if not up:
            window.target = "none up"
            return
        victim = up[0]
        window.target = victim.label
        self.result.net_kills += 1
        if role == "prefill":
            self._kill_prefill(victim.seat, window.name)
        else:
            self._kill_decode(victim.seat, window.name)

    def _suspend(self, role: str) -> tuple[str, Callable[[], Any]] | None:
        """``stop_prefill`` / ``stop_decode`` (called on the timeline's thread): SIGSTOP the first process of
        the role that is up; returns its label and how to resume it."""
        fleet = self.fleet
        assert fleet is not None
        for process in fleet.up(role):
            node = process.node
            if node is not None and node.suspend():
                return process.label, node.resume
        return None

    def _kill_decode(self, d: int, cause: str = CHURN) -> None:
        """SIGKILL the decode in seat ``d``, start a fresh one. Every request routed to it fails; a
        request's prefill half with no destination yet is stopped (as a router would), one that has
        its destination is left to the prefill engine, which must settle it when the connection closes."""
        fleet = self.fleet
        assert fleet is not None
        dead = fleet.kill("decode", d)
        for live in self.live.values():
            if live.phase is Phase.END or live.dbound.get(d) != dead:
                continue
            live.collateral = cause
            p = live.route.prefills[0]
            if live.phase in (Phase.ADMIT_PREFILL, Phase.ADMIT_DECODE, Phase.WAIT_READY):
                if live.prefill_admitted:
                    self.result.counterparts["prefill halves stopped by the driver"] += 1
                self._abort_prefills(live, "the request's decode died")
            elif live.prefill_admitted and live.bound.get(p) == self.ranks.incarnations[p]:
                self.result.counterparts["prefill halves left to the prefill engine"] += 1
                self._orphans.setdefault((p, live.bound[p]), []).append((live.plan.rid, time.monotonic()))
            self._finish(live, "failed", "decode killed")

    def _check_orphans(self, *, final: bool = False) -> None:
        """Prefill halves left to their engine after their decode died: settled yet (terminal, every write
        completed, sources freed)? At the end, one that is not is a failure."""
        fleet = self.fleet
        assert fleet is not None
        now = time.monotonic()
        for (p, incarnation), rids in list(self._orphans.items()):
            process = fleet.seats["prefill"][p]
            if process is None or process.incarnation != incarnation or not process.live:
                # that prefill died too (a prefill leaves only once its requests are settled)
                self.result.counterparts["prefill halves whose prefill died too"] += len(rids)
                del self._orphans[(p, incarnation)]
                continue
            try:
                states = self.ranks.prefill(p).statuses(rids=[rid for rid, _ in rids])
            except KvxferError:
                continue
            left = [(rid, t) for rid, t in rids if not (states.get(repr(rid)) or {}).get("settled", True)]
            self.result.counterparts["prefill halves settled by the prefill engine"] += len(rids) - len(left)
            for rid, t in rids:
                if (rid, t) not in left:
                    self.result.orphan_settle_s.append(now - t)
            if left:
                self._orphans[(p, incarnation)] = left
            else:
                del self._orphans[(p, incarnation)]
        if final:
            unsettled = sum(len(rids) for rids in self._orphans.values())
            if unsettled:
                self.result.accounting_errors.append(
                    f"{unsettled} prefill halves of requests whose decode died never settled")

    def _churn_tick(self, now: float) -> None:
        """Processes that finished starting come up (peered with the others); leaving ones whose requests
        have all ended are retired."""
        fleet = self.fleet
        assert fleet is not None
        fleet.poll_started()
        if fleet.unpeered():
            fleet.repeer(now)
        for process in fleet.leaving():
            if self._holds(process) and now - (process.leave_since or now) < self.config.settle_timeout:
                continue
            assert process.node is not None
            try:
                active = int(process.node.stats()["active"])
            except KvxferError:
                active = 0
            if active and now - (process.leave_since or now) < self.config.settle_timeout:
                continue  # the engine still settles a request the driver is done with
            fleet.retire(process, self.result.accounting_errors)

    def _holds(self, process: Process) -> bool:
        """A request still in flight was routed to ``process``."""
        for live in self.live.values():
            if live.phase is Phase.END:
                continue
            if process.role == "prefill" and live.bound.get(process.seat) == process.incarnation:
                return True
            if process.role == "decode" and live.dbound.get(process.seat) == process.incarnation:
                return True
        return False

    def _count_for_fleet(self, live: Live, outcome: str) -> None:
        """A request ended: its pair's tally (a pair by seats; the processes by incarnation)."""
        fleet = self.fleet
        assert fleet is not None
        if outcome != "completed":
            return
        p, d = live.route.prefills[0], live.route.decodes[0]
        self.result.pairs[(f"prefill {p}", f"decode {d}")] += 1
        for role, seat, bound in (("prefill", p, live.bound), ("decode", d, live.dbound)):
            process = fleet.find(role, seat, bound.get(seat))
            if process is not None:
                process.completed += 1

    def _fleet_end(self) -> None:
        """Every request has ended: processes still starting come up before the pools are taken."""
        fleet = self.fleet
        assert fleet is not None
        fleet.finish_starts()
        fleet.poll_started()

    # polling -----------------------------------------------------------------------------------------
    def _poll(self) -> None:
        self._poll_prefills()
        waiting = [lv for lv in self.live.values() if lv.phase in (Phase.WAIT_DONE, Phase.WAIT_DECODE_END)]
        for d in self.ranks.decode_seats():
            ask = [lv for lv in waiting if d in lv.decodes and d not in lv.ended and lv.phase is not Phase.END]
            if not ask:
                continue
            states = self.ranks.decode(d).statuses(rids=[lv.plan.rid for lv in ask])
            for live in ask:
                status = states.get(repr(live.plan.rid))
                if status is not None and live.phase is not Phase.END:
                    self._on_decode_status(live, d, status)

    def _poll_prefills(self) -> None:
        """Requests waiting for their destinations: ready when every prefill rank is (a rank that writes
        nothing for it has already succeeded); then each fills its source pages."""
        ready = [lv for lv in self.live.values() if lv.phase is Phase.WAIT_READY]
        if not ready:
            return
        states: dict[int, dict[str, Any]] = {}
        for p in sorted({p for lv in ready for p in lv.route.prefills}):
            mine = [lv for lv in ready if p in lv.route.prefills]
            try:
                states[p] = self.ranks.prefill(p).statuses(rids=[lv.plan.rid for lv in mine])
            except PeerError:
                states[p] = {}
        for live in ready:
            got = [states[p].get(repr(live.plan.rid)) for p in live.route.prefills]
            if any(s is None for s in got):
                continue
            names = [s["state"] for s in got]
            if any(n in ("FAILED", "ABORTED", "REJECTED") for n in names):
                self._give_up(live, "prefill rank ended")
                continue
            if not all(n in ("READY", "SUCCEEDED") for n in names):
                continue
            try:
                for p, name in zip(live.route.prefills, names):
                    if name == "READY":
                        live.src_pages[p] = int(self.ranks.prefill(p).prepare(rid=live.plan.rid,
                                                                               seed=self.config.seed)["pages"])
                    else:  # this rank holds no head the decode ranks need: it writes nothing
                        live.src_pages[p] = 0
                        live.done_sending.add(p)
                live.phase = Phase.SENDING
            except KvxferError as exc:
                self._give_up(live, f"{exc.code}: {exc}")

    def _on_decode_status(self, live: Live, d: int, status: dict[str, Any]) -> None:
        state = status["state"]
        rid = live.plan.rid
        if state == "READABLE":
            if live.phase is Phase.WAIT_DECODE_END or "abort_after_done" in live.plan.faults:
                if live.phase is Phase.WAIT_DONE:
                    self._fired(live, "abort_after_done")
                    live.expect = "aborted"
                self.ranks.decode(d).abort(rid=rid, reason="aborted after DONE, before read")
                live.phase = Phase.WAIT_DECODE_END
                return
            self._read(live, d)
        elif state in _ENDED:
            if state == "ABORTED":
                detail = status.get("error") or ""
            elif state == "REJECTED":
                detail = status.get("reason") or ""
            else:
                detail = f"{status.get('check') or status.get('reason') or 'failed'}"
            live.ended[d] = (state, detail)
            if state == "FAILED" and detail == "timeout":
                self.result.rank_timeouts += 1  # nobody told this rank the request ended (transfer_timeout)
            if live.phase is Phase.WAIT_DONE:
                live.phase = Phase.WAIT_DECODE_END  # the request failed: its other ranks are not read
        else:
            return
        if len(live.ended) == len(live.decodes):
            self._conclude(live)

    def _read(self, live: Live, d: int) -> None:
        try:
            report = self.ranks.decode(d).read_check(rid=live.plan.rid, seed=self.config.seed)
        except KvxferError as exc:
            live.ended[d] = ("FAILED", f"read: {exc.code}")
            live.phase = Phase.WAIT_DECODE_END
            return
        self.result.pages_checked += report["pages"]
        self.result.leaked_pages += report["leaked_pages"]
        self.result.corrupted_pages += report["corrupted_pages"]
        if self.fleet is not None:
            process = self.fleet.find("decode", d, live.dbound.get(d))
            assert process is not None
            process.pages_checked += report["pages"]
            process.leaked_pages += report["leaked_pages"]
            process.corrupted_pages += report["corrupted_pages"]
        for source in report["leaked_from"]:
            self.result.leak_sources.add(tuple(source))
        live.ended[d] = ("READ", "")

    def _conclude(self, live: Live) -> None:
        """Every decode rank that took the request has ended it: the request's outcome."""
        ends = [live.ended[d] for d in sorted(live.ended)]
        states = {state for state, _ in ends}

        def detail(*names: str) -> str:
            return next(text for state, text in ends if state in names)

        if states == {"READ"}:
            if "oversized" in live.plan.faults:
                self.result.rejected_succeeded += 1
            self.result.latencies_ms.append((time.monotonic() - live.started) * 1000)
            self._finish(live, "completed")
        elif "REJECTED" in states:
            self._finish(live, "rejected", detail("REJECTED"))
        elif "FAILED" in states and live.expect != "aborted":
            # With several ranks failed, the request failed for the reason an injected fault explains,
            # if one does (a flipped byte fails one rank's checksum; the writer then stops the other
            # ranks' legs mid-way, which fail their coverage check): the others are counted apart.
            reasons = [text for state, text in ends if state == "FAILED"]
            explained = [r for r in reasons if self._cause(live, "failed", r.split(":")[0][:60] or "failed")]
            primary = (explained or reasons)[0]
            reasons.remove(primary)
            for text in reasons:
                if text != primary:
                    self.result.secondary_failures[text.split(":")[0][:60] or "failed"] += 1
            self._finish(live, "failed", primary)
        elif states & {"ABORTED", "FAILED"}:
            self._finish(live, "aborted", detail("ABORTED", "FAILED"))
        else:
            self._finish(live, "failed", detail(*_ENDED))

    def _sample(self, now: float) -> None:
        if now < self._next_sample:
            return
        self._next_sample = now + 0.5
        self.result.samples.append((now - self._t0, self.ranks.landed_bytes()))

    def _audit(self, now: float) -> None:
        """The accounting invariant on every live rank, while requests are in flight (once a second)."""
        if now < self._next_audit:
            return
        self._next_audit = now + 1.0
        for label, node in self.ranks.labelled():
            if not node.alive():
                continue  # a killed writer is being replaced (kill_sender)
            try:
                node.accounting()
                self.result.accounting_checks += 1
            except PeerError:
                continue  # died between the check and the call: the restart handles it (a fleet: the churn)
            except KvxferError as exc:
                self.result.accounting_errors.append(f"{label} during the run: {exc}")

    # the end -----------------------------------------------------------------------------------------
    def _settle(self) -> None:
        """Wait (bounded) until no request is active on any rank, then take every pool's accounting."""
        deadline = time.monotonic() + self.config.settle_timeout
        while True:
            active = {label: int(node.stats()["active"]) for label, node in self.ranks.labelled()}
            if not any(active.values()):
                break
            if time.monotonic() > deadline:
                self.result.settled = False
                log.error("requests still active after %.0f s: %s", self.config.settle_timeout,
                          ", ".join(f"{label} {n}" for label, n in active.items()))
                break
            time.sleep(0.1)
        if self.fleet is not None:
            self._check_orphans(final=True)
            for process in self.fleet.leaving():  # their requests have ended: they leave now
                self.fleet.retire(process, self.result.accounting_errors)
        self._next_sample = 0.0
        self._sample(time.monotonic())
        for label, node in self.ranks.labelled():
            try:
                node.accounting()
            except KvxferError as exc:
                self.result.accounting_errors.append(f"{label}: {exc}")
        stats = {label: node.stats() for label, node in self.ranks.labelled()}
        self.result.decode_stats = pool_totals([s for label, s in stats.items() if label.startswith("decode")])
        self.result.prefill_stats = pool_totals([s for label, s in stats.items() if label.startswith("prefill")])
        self.result.pools = [{"pool": label, "total": int(s["pool_total"]), "free": int(s["pool_free"]),
                              "quarantined": int(s.get("pages", {}).get("quarantined", 0))}
                             for label, s in stats.items()]
        if self.fleet is not None:
            for process in self.fleet.processes:
                pool = next((p for p in self.result.pools if p["pool"] == process.label), None)
                if pool is not None and process.live:
                    process.pool = {k: pool[k] for k in ("total", "free", "quarantined")}
        counts = Counter(self.ranks.closed_fault_counts)
        for node in self.ranks.prefills:
            if node is not None:
                counts.update(node.fault(op="counts"))
        for name, key in (("late_write", "late"), ("duplicate_write", "duplicate"), ("flip_byte", "flip"),
                          ("slow_link", "slow")):
            self.result.faults[name] += int(counts.get(key, 0))
