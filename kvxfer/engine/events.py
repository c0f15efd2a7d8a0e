"""Structured event lines: one JSON object per line on the ``kvxfer.events`` logger.

Every lifecycle transition off the happy path (a rejection, an abort, a quarantine, a failure, a
drain), every fence, refused connection, refused or stale message, refused write, authentication
denial and dead peer becomes one line that names the engine, its role, and where it applies the
request id and generation, so a log pipeline can follow one request across both engines without
parsing prose. The human-readable warnings on ``kvxfer.engine`` etc. stay as they are.

Invariant: an event line is a single line of JSON (``json.dumps`` never emits a newline), its keys
always include ``event``, ``engine`` and ``role``; events that a peer can cause in bulk (refused
writes, refused messages, denials) are rate limited per (event, reason) so a hostile peer cannot
flood the log: after ``burst`` lines a key emits at most one line per second, carrying the count it
suppressed. A peer that varies the key (a new engine id per message) meets a second limit per
event: a bucket of ``2 * burst`` lines refilled at ``burst / 5`` lines a second across all its keys,
and at most ``max_keys`` keys tracked per event (further ones share one). Human-readable lines a
peer can provoke go through the same limiter (:meth:`EventLog.log`), with a suppressed count.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from ..core.lifecycle import Lifecycle

logger = logging.getLogger("kvxfer.events")


class EventLog:
    """The event emitter of one engine, and the rate limiter of every line a peer can provoke."""

    OVERFLOW = "\x00other"  # the key an event's keys beyond ``max_keys`` share
    IDLE_S = 60.0  # a key silent this long may be forgotten to make room for another

    def __init__(self, engine: str, role: str, *, burst: int = 50, max_keys: int = 64) -> None:
        self.engine = engine
        self.role = role
        self.burst = burst
        self.max_keys = max_keys
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str], list[float]] = {}  # key -> [count, suppressed, last emitted]
        # event -> [tokens, last refill, keys tracked, lines the bucket suppressed since the event's last line,
        # last look for idle keys]
        self._events: dict[str, list[float]] = {}

    def allow(self, event: str, key: str) -> tuple[int, int] | None:
        """Whether one more line of ``event`` under ``key`` may be logged: None (suppressed, counted),
        else (lines of this key its own limit suppressed since its last line, lines of any key the
        event's limit suppressed since the event's last line)."""
        now = time.monotonic()
        with self._lock:
            bucket = self._events.get(event)
            if bucket is None:
                bucket = self._events[event] = [2.0 * self.burst, now, 0, 0, now]
            bucket[0] = min(2.0 * self.burst, bucket[0] + (now - bucket[1]) * self.burst / 5.0)
            bucket[1] = now
            entry = self._seen.get((event, key))
            if entry is None:
                if bucket[2] >= self.max_keys and now - bucket[4] >= 1.0:
                    self._forget_idle(event, now, bucket)
                if bucket[2] >= self.max_keys:
                    key = self.OVERFLOW
                entry = self._seen.get((event, key))
                if entry is None:
                    entry = self._seen[(event, key)] = [0, 0, 0.0]
                    bucket[2] += 1
            entry[0] += 1
            if entry[0] > self.burst and now - entry[2] < 1.0:
                entry[1] += 1  # this key's own limit
                return None
            if bucket[0] < 1.0:
                bucket[3] += 1  # the event's limit, across its keys
                return None
            bucket[0] -= 1.0
            verdict = int(entry[1]), int(bucket[3])
            entry[1], entry[2] = 0, now
            bucket[3] = 0
            return verdict

    def _forget_idle(self, event: str, now: float, bucket: list[float]) -> None:
        """Drop ``event``'s keys silent for :attr:`IDLE_S` (their suppressed counts are lost)."""
        idle = [k for k, v in self._seen.items() if k[0] == event and k[1] != self.OVERFLOW and now - v[2] > self.IDLE_S]
        for k in idle:
            del self._seen[k]
        bucket[2] -= len(idle)
        bucket[4] = now

    def emit(self, event: str, *, rid: Any = None, gen: int | None = None, level: int = logging.WARNING,
             limit_key: str | None = None, **fields: Any) -> None:
        """Log one event line; with ``limit_key`` the line is rate limited under (event, limit_key)."""
        if not logger.isEnabledFor(level):
            return
        suppressed = others = 0
        if limit_key is not None:
            verdict = self.allow(event, limit_key)
            if verdict is None:
                return
            suppressed, others = verdict
        record: dict[str, Any] = {"event": event, "engine": self.engine, "role": self.role}
        if rid is not None:
            record["rid"] = rid
        if gen:
            record["gen"] = gen
        record.update(fields)
        if suppressed:
            record["suppressed"] = suppressed
        if others:
            record["suppressed_all_keys"] = others
        logger.log(level, "%s", json.dumps(record, default=str, ensure_ascii=True))

    def log(self, target: logging.Logger, level: int, limit_key: str, msg: str, *args: Any, **kwargs: Any) -> None:
        """A human-readable line a peer can provoke: ``target.log(level, msg, *args)``, rate limited
        like the event lines under (``msg``, ``limit_key``), with a count of what it suppressed."""
        if not target.isEnabledFor(level):
            return
        verdict = self.allow(f"log:{target.name}:{msg}", limit_key)
        if verdict is None:
            return
        suppressed = sum(verdict)
        if suppressed:
            msg, args = msg + " [%d similar lines suppressed]", (*args, suppressed)
        target.log(level, msg, *args, **kwargs)

    def transition(self, fsm: Lifecycle, old: Any, reason: str) -> None:
        """Lifecycle observer: an event for every transition that leaves the happy path."""
        if fsm.happy:
            return
        self.emit(
            "transition", rid=fsm.rid, gen=fsm.generation, level=logging.WARNING,
            side=fsm.role, to=fsm.state.value, reason=reason, **{"from": getattr(old, "value", str(old))},
        )
