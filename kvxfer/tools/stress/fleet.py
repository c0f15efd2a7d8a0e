"""The node processes of a fleet run: N prefill and M decode engines, every decode peered with every prefill.

Each process is an engine node of its own (:mod:`kvxfer.tools.node`, one rank each, no geometry). A
request goes to one (prefill, decode) pair drawn at random from the processes that are up
(:meth:`Fleet.route`): the prefill admits it bound to that decode by name
(``admit(rid, tokens, peer=<decode engine id>)``), the decode admits it from that prefill.

Processes come and go while requests run (churn, and ``kill_sender`` in a fleet):

* **kill**: SIGKILL, mid-whatever; its pool dies with it. A fresh process starts in its seat (a new
  engine id, the seat's next incarnation) in the background and, once up, peers with the others.
* **join**: a process more, in a free seat; once up it peers with the others (a decode connects to
  every prefill that is up; a new prefill is connected to by every decode that is up).
* **leave**: the process gets no new requests; once no request it holds is in flight, its pool is
  taken (it must be whole) and it closes cleanly.

Peering always happens on the driver's thread, when a process turns up, so no pair is missed: a
process coming up peers with every process already up. A pairing that fails (the wire between two
hosts was cut as the process came up) is tried again (:meth:`Fleet.repeer`), once a second.

On two hosts (:meth:`Fleet.place`), every prefill process runs in host a's network namespace and every
decode process in host b's, each engine bound to its host's address (:func:`kvxfer.tools.node.spawn`
with ``netns``; the driver reaches them over unix sockets). Every process started here dies with the
driver (:func:`kvxfer.tools.node.spawn`: started from a background thread it still follows the
driver's lifeline, :mod:`kvxfer.tools.procs`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ...errors import KvxferError
from ..netns import Host, TwoHosts
from ..node import NodeClient, NodeSpec, spawn
from .ranks import Route, node_config
from .workload import ROLES, StressConfig

log = logging.getLogger("kvxfer.stress")

@dataclass
class Process:
    """One engine process of a fleet run, from its start to its end, and what went through it."""

    role: str
    seat: int
    incarnation: int  # the seat's how-manieth process (0: the first)
    why: str  # "start", "restart" (after a kill) or "join"
    node: NodeClient | None = None
    state: str = "starting"  # starting -> up (-> leaving) -> left | killed; "failed": it never started
    started: float = 0.0
    up_at: float | None = None
    ended: float | None = None
    engine: str = ""
    pid: int = 0
    routed: int = 0  # requests sent its way
    completed: int = 0  # of those, read back and checked
    pages_checked: int = 0  # a decode: pages the oracle checked in its pool
    leaked_pages: int = 0
    corrupted_pages: int = 0
    landed_bytes: int = 0  # a decode: its write guard's landed bytes, last sampled
    pool: dict[str, int] | None = None  # at its end (left) or the run's (still up); none for a killed one
    error: str = ""
    leave_since: float | None = None
    _thread: threading.Thread | None = field(default=None, repr=False)
    _outcome: list[Any] = field(default_factory=list, repr=False)  # the start thread's NodeClient or error

    @property
    def label(self) -> str:
        """``"decode 2"``; a seat's later processes ``"decode 2 #1"``, ``"decode 2 #2"``, ..."""
        return f"{self.role} {self.seat}" + (f" #{self.incarnation}" if self.incarnation else "")

    @property
    def live(self) -> bool:
        return self.state in ("up", "leaving") and self.node is not None

    def record(self, t0: float) -> dict[str, Any]:
        """Its figures for the report and the JSON."""
        return {
            "process": self.label, "role": self.role, "seat": self.seat, "incarnation": self.incarnation,
            "started_as": self.why, "end": "running" if self.state in ("up", "leaving") else self.state,
            "engine": self.engine, "pid": self.pid,
            "up_s": round(max(0.0, self.up_at - t0), 3) if self.up_at is not None else None,
            "ended_s": round(self.ended - t0, 3) if self.ended is not None else None,
            "routed": self.routed, "completed": self.completed,
            **({"pages_checked": self.pages_checked, "leaked_pages": self.leaked_pages,
                "corrupted_pages": self.corrupted_pages, "landed_bytes": self.landed_bytes}
               if self.role == "decode" else {}),
            "pool": self.pool, **({"error": self.error} if self.error else {}),
        }


class Fleet:
    """The prefill and decode processes of a fleet run, by seat; who is up, who peers with whom.

    Offers what the driver asks of :class:`~kvxfer.tools.stress.ranks.Ranks` (seats stand for ranks,
    each request's :class:`Route` names one of each), plus the churn: :meth:`kill`, :meth:`join`,
    :meth:`leave`, :meth:`retire` and :meth:`poll_started`."""

    def __init__(self, config: StressConfig, keyrings: dict[str, str], node_log: Any = None) -> None:
        self.config = config
        self.keyrings = keyrings
        self.node_log = node_log
        self.seats: dict[str, list[Process | None]] = {role: [None] * config.seats(role) for role in ROLES}
        self.next_incarnation: dict[str, list[int]] = {role: [0] * config.seats(role) for role in ROLES}
        self.processes: list[Process] = []  # every process started, in order
        self.peered: set[tuple[str, str]] = set()  # (prefill label, decode label)
        self.counts: Counter = Counter()  # kills by role, restarts, joins, leaves, peerings, failures
        self.closed_fault_counts: Counter = Counter()  # link faults counted by prefill processes gone
        self.restarts = 0
        self.t0 = time.monotonic()  # the run's start once the first processes are up (times are from it)
        self.startup_s = 0.0  # until every first process was up and peered
        self.placement: dict[str, Host] = {}  # two hosts: role -> the host its processes run on
        self._next_repeer = 0.0

    def place(self, hosts: TwoHosts) -> None:
        """Run every prefill process on host a and every decode process on host b (before :meth:`start`)."""
        self.placement = {"prefill": hosts.a, "decode": hosts.b}

    # what the driver asks of the ranks -------------------------------------------------------------
    @property
    def incarnations(self) -> list[int]:
        """Each prefill seat's current process's incarnation (a request bound to another is not its)."""
        return self._incarnations("prefill")

    @property
    def decode_incarnations(self) -> list[int]:
        return self._incarnations("decode")

    def _incarnations(self, role: str) -> list[int]:
        return [p.incarnation if p is not None and p.live else -1 for p in self.seats[role]]

    @property
    def prefills(self) -> list[NodeClient | None]:
        return [p.node if p is not None and p.live else None for p in self.seats["prefill"]]

    @property
    def decodes(self) -> list[NodeClient | None]:
        return [p.node if p is not None and p.live else None for p in self.seats["decode"]]

    def prefill(self, p: int) -> NodeClient:
        return self._node("prefill", p)

    def decode(self, d: int) -> NodeClient:
        return self._node("decode", d)

    def _node(self, role: str, seat: int) -> NodeClient:
        process = self.seats[role][seat]
        assert process is not None and process.live and process.node is not None, (role, seat)
        return process.node

    def find(self, role: str, seat: int, incarnation: int | None) -> Process | None:
        """The process that was (or is) the ``incarnation`` of ``seat``."""
        return next((p for p in self.processes if (p.role, p.seat, p.incarnation) == (role, seat, incarnation)), None)

    def process(self, role: str, seat: int) -> Process:
        process = self.seats[role][seat]
        assert process is not None
        return process

    def decode_seats(self) -> list[int]:
        return [s for s, p in enumerate(self.seats["decode"]) if p is not None and p.live]

    def prefill_seats(self) -> list[int]:
        return [s for s, p in enumerate(self.seats["prefill"]) if p is not None and p.live]

    def labelled(self) -> list[tuple[str, NodeClient]]:
        """Every live process with its label, decodes first, by seat."""
        out = []
        for role in ("decode", "prefill"):
            for process in self.seats[role]:
                if process is not None and process.live and process.node is not None:
                    out.append((process.label, process.node))
        return out

    def prefill_admit_args(self, p: int, route: Route) -> dict[str, Any]:
        """A prefill admits a request bound to its pair's decode, by engine id."""
        return {"peer": self.decode(route.decodes[0]).engine_id}

    def decode_admit_args(self, d: int, route: Route) -> dict[str, Any]:
        return {"peer": self.prefill(route.prefills[0]).engine_id}

    def landed_bytes(self) -> int:
        """Bytes landed in every decode's pages, the gone ones' as last sampled."""
        for process in self.processes:
            if process.role == "decode" and process.live and process.node is not None:
                try:
                    process.landed_bytes = int(process.node.stats()["writes"]["landed_bytes"])
                except KvxferError:
                    pass
        return sum(p.landed_bytes for p in self.processes if p.role == "decode")

    # routing ---------------------------------------------------------------------------------------
    def up(self, role: str) -> list[Process]:
        return [p for p in self.seats[role] if p is not None and p.state == "up"]

    def can_route(self) -> bool:
        return any(self._partners(p) for p in self.up("prefill"))

    def _partners(self, prefill: Process) -> list[Process]:
        return [d for d in self.up("decode") if (prefill.label, d.label) in self.peered]

    def route(self, draw: tuple[float, float]) -> tuple[Route, dict[str, int]] | None:
        """A (prefill, decode) pair among those up and peered, chosen by ``draw`` (two numbers in [0, 1));
        with the incarnations the request is bound to. None when no pair is up."""
        prefills = [p for p in self.up("prefill") if self._partners(p)]
        if not prefills:
            return None
        prefill = prefills[min(int(draw[0] * len(prefills)), len(prefills) - 1)]
        decodes = self._partners(prefill)
        decode = decodes[min(int(draw[1] * len(decodes)), len(decodes) - 1)]
        prefill.routed += 1
        decode.routed += 1
        route = Route(prefills=[prefill.seat], decodes=[decode.seat], writers={decode.seat: [prefill.seat]},
                      components=[[decode.seat]])
        return route, {"prefill": prefill.incarnation, "decode": decode.incarnation}

    def pair(self, route: Route) -> tuple[Process, Process]:
        return self.process("prefill", route.prefills[0]), self.process("decode", route.decodes[0])

    # processes -------------------------------------------------------------------------------------
    def spec(self, role: str, seat: int, incarnation: int) -> NodeSpec:
        cfg = self.config
        config = node_config(cfg, self.keyrings[f"{role}{seat}"])
        if role == "prefill":
            pages = cfg.prefill_pages
            config["allow_undersized_pool"] = cfg.prefill_tokens < cfg.max_context
        else:
            pages = cfg.decode_pages
        return NodeSpec(role=role, num_buffers=cfg.buffers, item_len=cfg.item_len, num_pages=pages,
                        page_size=cfg.page_size, config=config,
                        faults=cfg.link_faults() if role == "prefill" else None,
                        seed=cfg.seed + 1000 * seat + 100_000 * incarnation + (1 if role == "prefill" else 0),
                        log_level="ERROR")

    def start(self) -> None:
        """The processes the run starts with, started together; returns once every one is up and peered."""
        for role in ROLES:
            for seat in range(self.config.prefills if role == "prefill" else self.config.decodes):
                self._begin(role, seat, "start")
        deadline = time.monotonic() + 120.0
        while any(p.state == "starting" for p in self.processes):
            self.poll_started(wait=0.05)
            if time.monotonic() > deadline:
                raise KvxferError("fleet processes did not start within 120 s")
        failed = [p for p in self.processes if p.state == "failed"]
        if failed:
            raise KvxferError(f"{failed[0].label} did not start: {failed[0].error}")
        now = time.monotonic()
        self.startup_s = now - self.t0
        self.t0 = now

    def _begin(self, role: str, seat: int, why: str) -> Process:
        """Start a process in ``seat`` in the background (:meth:`poll_started` brings it up)."""
        incarnation = self.next_incarnation[role][seat]
        self.next_incarnation[role][seat] += 1
        process = Process(role=role, seat=seat, incarnation=incarnation, why=why, started=time.monotonic())
        self.seats[role][seat] = process
        self.processes.append(process)
        spec = self.spec(role, seat, incarnation)

        host = self.placement.get(role)

        def run() -> None:
            try:
                process._outcome.append(spawn(spec, stderr=self.node_log, netns=host))
            except BaseException as exc:  # reported by poll_started
                process._outcome.append(exc)

        process._thread = threading.Thread(target=run, name=f"kvxfer-stress-start-{process.label}", daemon=True)
        process._thread.start()
        return process

    def starting(self) -> bool:
        return any(p.state == "starting" for p in self.processes)

    def poll_started(self, wait: float = 0.0) -> list[Process]:
        """Processes whose start finished: peer each with the processes up (on this thread) and mark it up.
        Returns those that came up."""
        came = []
        for process in [p for p in self.processes if p.state == "starting"]:
            assert process._thread is not None
            process._thread.join(wait)
            if process._thread.is_alive():
                continue
            outcome = process._outcome[0]
            if isinstance(outcome, BaseException):
                process.state = "failed"
                process.error = f"{type(outcome).__name__}: {outcome}"
                process.ended = time.monotonic()
                self.counts["start_failures"] += 1
                self.seats[process.role][process.seat] = None
                log.error("%s did not start: %s", process.label, process.error)
                continue
            node: NodeClient = outcome
            process.node = node
            process.engine = node.engine_id
            process.pid = node.pid
            self._peer(process)
            process.state = "up"
            process.up_at = time.monotonic()
            if process.why == "restart":
                self.counts["restarts"] += 1
            elif process.why == "join":
                self.counts["joins"] += 1
            came.append(process)
        return came

    def _peer(self, process: Process) -> None:
        """A decode connects to every prefill up; a prefill is connected to by every decode up."""
        assert process.node is not None
        if process.role == "decode":
            pairs = [(p, process) for p in self.up("prefill")]
        else:
            pairs = [(process, d) for d in self.up("decode")]
        for prefill, decode in pairs:
            self._connect(prefill, decode)

    def _connect(self, prefill: Process, decode: Process, timeout: float = 10.0) -> bool:
        assert prefill.node is not None and decode.node is not None
        try:
            decode.node.connect(address=prefill.node.control, timeout=timeout)
        except KvxferError as exc:
            self.counts["peering_failures"] += 1
            log.error("%s could not peer with %s: %s", decode.label, prefill.label, exc)
            return False
        self.peered.add((prefill.label, decode.label))
        self.counts["peerings"] += 1
        return True

    def unpeered(self) -> list[tuple[Process, Process]]:
        """Pairs of processes up that are not peered (their pairing failed)."""
        return [(p, d) for p in self.up("prefill") for d in self.up("decode") if (p.label, d.label) not in self.peered]

    def repeer(self, now: float, timeout: float = 2.0) -> None:
        """Try the failed pairings again (at most once a second)."""
        if now < self._next_repeer:
            return
        self._next_repeer = now + 1.0
        for prefill, decode in self.unpeered():
            if self._connect(prefill, decode, timeout=timeout):
                self.counts["repeerings"] += 1

    # churn -----------------------------------------------------------------------------------------
    def kill(self, role: str, seat: int, *, restart: bool = True) -> int:
        """SIGKILL the process in ``seat`` (its pool dies with it) and start a fresh one there in the
        background (unless it was leaving); returns the incarnation that died."""
        process = self.process(role, seat)
        assert process.node is not None
        if role == "prefill":
            try:
                self.closed_fault_counts.update(process.node.fault(op="counts"))
            except KvxferError:
                pass
        process.node.kill()
        process.node.close()
        leaving = process.state == "leaving"
        process.state = "killed"
        process.ended = time.monotonic()
        self.counts[f"{role}_kills"] += 1
        self.seats[role][seat] = None
        if restart and not leaving:  # one that was leaving anyway is not replaced
            self.restarts += 1
            self._begin(role, seat, "restart")
        return process.incarnation

    def replace_prefill(self, p: int) -> int:
        """``kill_sender`` in a fleet: the prefill in seat ``p`` is killed and restarted."""
        return self.kill("prefill", p)

    def free_seat(self, role: str) -> int | None:
        return next((s for s, p in enumerate(self.seats[role]) if p is None), None)

    def join(self, role: str) -> Process | None:
        seat = self.free_seat(role)
        return None if seat is None else self._begin(role, seat, "join")

    def leave(self, process: Process) -> None:
        """Stop routing to ``process``; :meth:`retire` closes it once nothing of it is in flight."""
        process.state = "leaving"
        process.leave_since = time.monotonic()

    def leaving(self) -> list[Process]:
        return [p for p in self.processes if p.state == "leaving"]

    def retire(self, process: Process, errors: list[str]) -> None:
        """Take a leaving process's pool (and accounting), then close it cleanly."""
        assert process.node is not None
        self._final(process, errors)
        process.node.close()
        process.state = "left"
        process.ended = time.monotonic()
        self.counts[f"{process.role}_leaves"] += 1
        self.seats[process.role][process.seat] = None

    def _final(self, process: Process, errors: list[str]) -> dict[str, Any]:
        """A live process's pool, accounting and (a prefill's) link fault counts, recorded on it."""
        assert process.node is not None
        try:
            process.node.accounting()
        except KvxferError as exc:
            errors.append(f"{process.label}: {exc}")
        stats = process.node.stats()
        process.pool = {"total": int(stats["pool_total"]), "free": int(stats["pool_free"]),
                        "quarantined": int(stats.get("pages", {}).get("quarantined", 0))}
        if process.role == "decode":
            process.landed_bytes = int(stats["writes"]["landed_bytes"])
        elif process.state == "leaving":
            try:
                self.closed_fault_counts.update(process.node.fault(op="counts"))
            except KvxferError:
                pass
        return stats

    def finish_starts(self, timeout: float = 120.0) -> None:
        """Wait (bounded) for the processes still starting and bring them up."""
        deadline = time.monotonic() + timeout
        while self.starting() and time.monotonic() < deadline:
            self.poll_started(wait=0.05)

    def close(self) -> None:
        for process in self.processes:
            if process._thread is not None and process.state == "starting":
                process._thread.join(30.0)
                if process._outcome and isinstance(process._outcome[0], NodeClient):
                    process._outcome[0].close()
            elif process.node is not None and process.state in ("up", "leaving"):
                process.node.close()
