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
suppressed.
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
    """The event emitter of one engine."""

    def __init__(self, engine: str, role: str, *, burst: int = 50) -> None:
        self.engine = engine
        self.role = role
        self.burst = burst
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str], list[float]] = {}  # key -> [count, suppressed, last emitted]

    def emit(self, event: str, *, rid: Any = None, gen: int | None = None, level: int = logging.WARNING,
             limit_key: str | None = None, **fields: Any) -> None:
        """Log one event line; with ``limit_key`` the line is rate limited under (event, limit_key)."""
        if not logger.isEnabledFor(level):
            return
        suppressed = 0
        if limit_key is not None:
            now = time.monotonic()
            with self._lock:
                entry = self._seen.setdefault((event, limit_key), [0, 0, 0.0])
                entry[0] += 1
                if entry[0] > self.burst and now - entry[2] < 1.0:
                    entry[1] += 1
                    return
                suppressed, entry[1], entry[2] = entry[1], 0, now
        record: dict[str, Any] = {"event": event, "engine": self.engine, "role": self.role}
        if rid is not None:
            record["rid"] = rid
        if gen:
            record["gen"] = gen
        record.update(fields)
        if suppressed:
            record["suppressed"] = suppressed
        logger.log(level, "%s", json.dumps(record, default=str, ensure_ascii=True))

    def transition(self, fsm: Lifecycle, old: Any, reason: str) -> None:
        """Lifecycle observer: an event for every transition that leaves the happy path."""
        if fsm.happy:
            return
        self.emit(
            "transition", rid=fsm.rid, gen=fsm.generation, level=logging.WARNING,
            side=fsm.role, to=fsm.state.value, reason=reason, **{"from": getattr(old, "value", str(old))},
        )
