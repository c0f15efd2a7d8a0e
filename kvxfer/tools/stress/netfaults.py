"""The network faults of a two-hosts stress run (``--net-fault``), played on a timeline of their own.

:class:`NetChaos` owns one thread, the fault in force and the record of every fault window. The
timeline is the configured faults in turn, ``rounds`` times (0: round and round): ``gap`` seconds of
healthy network, then one fault for its seconds, then its undo, then the next. It runs from
:meth:`NetChaos.start` until it has played its rounds or :meth:`NetChaos.stop` is called (the driver
stops it once every request has started, before it waits for the requests to settle), independently
of the driver's loop, which may be waiting on a node that a fault froze. A bounded number of rounds
keeps a run bounded: a wire cut again and again faster than TCP's retransmission backoff lets it
recover stalls the requests, and a timeline that lasts as long as requests are still to start would
then never end.

Invariants:

* **At most one fault in force**, and every fault applied is undone: :meth:`NetChaos.stop` (idempotent)
  ends the window in force, heals the wire (:meth:`kvxfer.tools.netns.TwoHosts.heal`) and resumes a
  process it suspended before it returns; the thread does not outlive it.
* **Processes are the driver's.** A kill (``kill_prefill``, ``kill_decode``) is not done on this thread:
  it is handed to the driver (:meth:`NetChaos.take_kills`), which owns the processes, the requests
  that depended on them and the restart. A stop (``stop_prefill``, ``stop_decode``) only sends SIGSTOP
  and, when its window ends, SIGCONT, through the driver's ``suspend`` callback.
* **Every window is recorded** (:class:`Window`): what was cut, when, and what the requests did meanwhile
  and afterwards (completions in force, the first completion after the heal), so a report can say how
  long a cut took to be noticed and to heal. A fault that could not be applied is an error of the
  run (:attr:`NetChaos.errors`), not a silent no-op.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..netns import Direction, TwoHosts

log = logging.getLogger("kvxfer.stress")

__all__ = ["NetChaos", "Window"]

Suspend = Callable[[str], "tuple[str, Callable[[], Any]] | None"]  # role -> (label, resume) of the process stopped


class ChaosState(enum.Enum):
    """A timeline's life: not started, playing (its thread runs), stopped (every fault undone)."""

    IDLE = "idle"
    PLAYING = "playing"
    STOPPED = "stopped"


@dataclass
class Window:
    """One fault of the timeline, from when it was applied to when it was undone (seconds from the
    run's start), and what the requests did."""

    name: str
    start: float
    end: float | None = None
    target: str = ""  # kill/stop: the process it hit ("" for the wire; "none up": nothing to hit)
    completed: int = 0  # requests that completed while it was in force
    ended_otherwise: int = 0  # requests that failed or were aborted while it was in force
    last_completion_in: float | None = None  # seconds from its start to the last completion while in force
    recovered_in: float | None = None  # seconds from its end to the first completion after it
    first_new_in: float | None = None  # from its end to the completion of the first request started after it
    error: str = ""

    def record(self) -> dict[str, Any]:
        def r(x: float | None) -> float | None:
            return None if x is None else round(x, 3)

        return {"fault": self.name, "start_s": r(self.start), "end_s": r(self.end),
                "seconds": r(None if self.end is None else self.end - self.start),
                **({"target": self.target} if self.target else {}), "completed_in_force": self.completed,
                "ended_otherwise_in_force": self.ended_otherwise,
                "last_completion_in_force_s": r(self.last_completion_in), "recovered_in_s": r(self.recovered_in),
                "first_new_request_done_in_s": r(self.first_new_in), **({"error": self.error} if self.error else {})}


class NetChaos:
    """Plays ``timeline`` (``(name, seconds)`` pairs from :data:`~.workload.NET_FAULTS`) against ``hosts``
    (host a: the prefills, host b: the decodes) on a thread of its own; see the module docstring."""

    def __init__(self, hosts: TwoHosts, timeline: list[tuple[str, float]], gap: float, *,
                 suspend: Suspend, rounds: int = 1) -> None:
        self.hosts = hosts
        self.timeline = list(timeline)
        self.gap = gap
        self.rounds = rounds
        self._suspend = suspend
        self.windows: list[Window] = []
        self.errors: list[str] = []
        self.t0 = time.monotonic()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._kills: queue.Queue[tuple[str, Window]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._undo: Callable[[], Any] | None = None
        self.state = ChaosState.IDLE

    # the timeline --------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the timeline now (the first fault comes after ``gap`` seconds)."""
        if self.state is not ChaosState.IDLE or not self.timeline:
            return
        self.state = ChaosState.PLAYING
        self.t0 = time.monotonic()
        self._thread = threading.Thread(target=self._play, name="kvxfer-stress-net-faults", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the fault in force and the timeline; the wire is healed and no process is left stopped
        (idempotent). The windows keep counting the requests that end afterwards (their recovery)."""
        if self.state is ChaosState.STOPPED:
            return
        self.state = ChaosState.STOPPED
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
        self._end_window()  # the thread never ran, or ended on an error: whatever is left is undone here
        try:
            if not self.hosts.closed:
                self.hosts.heal()
        except Exception as exc:  # reported: a wire left cut would fail the settle
            self.errors.append(f"healing the wire: {exc}")

    def _now(self) -> float:
        return time.monotonic() - self.t0

    def _play(self) -> None:
        turn = 0
        while not self._stopping.wait(self.gap):
            if self.rounds and turn >= self.rounds * len(self.timeline):
                return
            name, seconds = self.timeline[turn % len(self.timeline)]
            turn += 1
            window = Window(name=name, start=self._now())
            with self._lock:
                self.windows.append(window)
            try:
                self._undo = self._apply(name, window)
            except Exception as exc:
                window.error = str(exc)
                self.errors.append(f"{name}: {exc}")
                log.error("net fault %s could not be applied: %s", name, exc)
            self._stopping.wait(seconds)
            self._end_window()

    def _end_window(self) -> None:
        """Undo the fault in force (if any) and close its window."""
        undo, self._undo = self._undo, None
        try:
            if undo is not None:
                undo()
        except Exception as exc:
            self.errors.append(f"undoing {self.windows[-1].name if self.windows else 'a fault'}: {exc}")
        with self._lock:
            if self.windows and self.windows[-1].end is None:
                self.windows[-1].end = self._now()

    def _apply(self, name: str, window: Window) -> Callable[[], Any] | None:
        """Apply fault ``name``; returns its undo (None: nothing to undo on this thread)."""
        hosts = self.hosts
        if name == "link_down":
            hosts.link_down()
            return hosts.link_up
        kind, _, rest = name.partition("_")
        if kind in ("drop", "blackhole"):
            direction = Direction.parse(rest or "both")
            if kind == "drop":
                hosts.drop(direction)
                return hosts.undrop
            hosts.blackhole(direction)
            return hosts.unblackhole
        if kind == "kill":
            self._kills.put((rest, window))  # the driver kills and restarts it
            return None
        if kind == "stop":
            stopped = self._suspend(rest)
            if stopped is None:
                window.target = "none up"
                return None
            window.target, resume = stopped
            return resume
        raise ValueError(f"unknown net fault {name!r}")

    # what the driver asks ------------------------------------------------------------------------------
    def take_kills(self) -> list[tuple[str, Window]]:
        """Kills due (role, window), for the driver to carry out on its thread."""
        out = []
        while True:
            try:
                out.append(self._kills.get_nowait())
            except queue.Empty:
                return out

    def cause(self, started: float) -> str:
        """The fault of the latest window in force at any moment since ``started`` (monotonic), or "":
        what a request that did not complete is put down to."""
        since = started - self.t0
        with self._lock:
            for window in reversed(self.windows):
                if window.end is None or window.end >= since:
                    return window.name
        return ""

    def note(self, outcome: str, started: float) -> None:
        """A request that started at ``started`` (monotonic) ended now with ``outcome``: the windows' tallies."""
        now = self._now()
        began = started - self.t0
        with self._lock:
            for window in self.windows:
                if window.end is None or window.end >= now:  # in force
                    if outcome == "completed":
                        window.completed += 1
                        window.last_completion_in = now - window.start
                    else:
                        window.ended_otherwise += 1
                elif outcome == "completed":
                    if window.recovered_in is None:
                        window.recovered_in = now - window.end
                    if window.first_new_in is None and began >= window.end:
                        window.first_new_in = now - window.end

    def summary(self) -> dict[str, Any]:
        with self._lock:
            windows = [w.record() for w in self.windows]
        fired: dict[str, int] = {}
        for window in windows:
            fired[window["fault"]] = fired.get(window["fault"], 0) + 1
        recovered = [w["recovered_in_s"] for w in windows if w["recovered_in_s"] is not None]
        # the requests were all started before these came up: the run did not test them
        never = [name for name, _ in self.timeline if name not in fired]
        return {"timeline": [list(item) for item in self.timeline], "gap_s": self.gap, "rounds": self.rounds,
                "fired": fired, "never_fired": list(dict.fromkeys(never)),
                "windows": windows, "max_recovered_in_s": max(recovered) if recovered else None,
                "errors": list(self.errors)}
