"""Fault injection for transports: test-only, off unless explicitly switched on.

The stress tool and the demo need a transport that misbehaves the way real links and buggy peers
do: flipped bytes, duplicated writes, writes that arrive late (after their request was aborted and
its pages may have been reused), slow links, a paused sender. The hooks live in the transport's
send path, because that is where a NIC would do these things, and they are reachable only through
a :class:`FaultInjector`, which refuses to exist unless :func:`enable` was called or
``KVXFER_TEST_FAULTS=1`` is set. Engines built without one pay nothing.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, fields
from typing import Any

from ..errors import ConfigError

_ENABLED = False


def enable() -> None:
    """Allow fault injectors in this process (tests, ``kvxfer stress``, ``kvxfer demo``)."""
    global _ENABLED
    _ENABLED = True


def enabled() -> bool:
    return _ENABLED or os.environ.get("KVXFER_TEST_FAULTS") == "1"


@dataclass
class FaultConfig:
    """Per-frame probabilities (0..1) and parameters of each fault."""

    flip_rate: float = 0.0
    duplicate_rate: float = 0.0
    late_rate: float = 0.0
    late_delay_s: float = 0.3
    slow_rate: float = 0.0
    slow_delay_s: float = 0.02
    ignore_aborts: bool = False  # a hung writer: receivers' ABORTs go unanswered (forces a fence)
    keep_fenced_links: bool = False  # verbs: keep a fenced queue pair to post a late write on it

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FaultConfig:
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ConfigError(f"unknown fault settings: {sorted(unknown)}")
        config = cls(**data)
        for f in fields(cls):
            value = getattr(config, f.name)
            if f.name.endswith("_rate") and not 0.0 <= float(value) <= 1.0:
                raise ConfigError(f"fault {f.name}={value} outside [0, 1]")
        return config


class FaultInjector:
    """Decides, per frame, which faults fire; holds late frames until they are due."""

    def __init__(self, config: FaultConfig | None = None, *, seed: int | None = None) -> None:
        if not enabled():
            raise ConfigError(
                "fault injection is test-only: call kvxfer.transport.faults.enable() "
                "or set KVXFER_TEST_FAULTS=1"
            )
        self.config = config or FaultConfig()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._resume = threading.Event()
        self._resume.set()
        self._late: list[tuple[float, Any]] = []
        self._captured: list[Any] = []
        self._capture_next = 0
        self._flip_next = 0
        self.counts: Counter[str] = Counter()
        self.stale_links: list[Any] = []

    # engine hooks (see kvxfer.engine.base.EngineHooks) ---------------------------------------------
    def drop_message(self, msg: Any) -> bool:
        """A hung writer: with ``ignore_aborts``, the receiver's ABORTs go unanswered (forces a fence)."""
        if self.config.ignore_aborts and getattr(msg, "TYPE", "") == "ABORT":
            self.counts["ignored_abort"] += 1
            return True
        return False

    def retire_link(self, link: Any) -> bool:
        """With ``keep_fenced_links``, keep a fenced link open to post a late write on it later."""
        if self.config.keep_fenced_links:
            self.stale_links.append(link)
            return True
        return False

    def close(self) -> None:
        """Close the links kept by :meth:`retire_link`."""
        links, self.stale_links = self.stale_links, []
        for link in links:
            link.close(flush=False)

    # scripted, one-shot faults (demo, tests) ----------------------------------------------------------
    def pause(self) -> None:
        """Stall the send path before its next frame (a link that stopped moving)."""
        self._resume.clear()

    def resume(self) -> None:
        self._resume.set()

    def wait_if_paused(self) -> None:
        self._resume.wait()

    @property
    def paused(self) -> bool:
        return not self._resume.is_set()

    def flip_next_write(self, count: int = 1) -> None:
        with self._lock:
            self._flip_next += count

    def capture_next_write(self) -> None:
        """Keep a copy of the next WRITE frame (it is still sent) for :meth:`take_captured`."""
        with self._lock:
            self._capture_next += 1

    def take_captured(self) -> list[Any]:
        with self._lock:
            out, self._captured = self._captured, []
            return out

    def idle(self) -> bool:
        """Nothing would act on the next frame: no fault rate set, no scripted fault pending, not paused
        and no late frame held (a link may then send as if it had no injector: the caller's thread)."""
        c = self.config
        with self._lock:
            return (self._resume.is_set() and not self._late and not self._capture_next and not self._flip_next
                    and not (c.flip_rate or c.duplicate_rate or c.late_rate or c.slow_rate))

    # per-frame decisions -------------------------------------------------------------------------------
    def _roll(self, rate: float) -> bool:
        return rate > 0 and self._rng.random() < rate

    def on_write(self, frame: Any) -> dict[str, bool]:
        """Which faults fire for this WRITE frame; records a copy when capturing or late."""
        with self._lock:
            flip = self._flip_next > 0 or self._roll(self.config.flip_rate)
            if self._flip_next > 0:
                self._flip_next -= 1
            decision = {
                "flip": flip,
                "duplicate": self._roll(self.config.duplicate_rate),
                "late": self._roll(self.config.late_rate),
                "slow": self._roll(self.config.slow_rate),
                "capture": self._capture_next > 0,
            }
            if self._capture_next > 0:
                self._capture_next -= 1
            for name, fired in decision.items():
                if fired:
                    self.counts[name] += 1
            return decision

    def hold_late(self, frame: Any) -> None:
        with self._lock:
            self._late.append((time.monotonic() + self.config.late_delay_s, frame))

    def keep_captured(self, frame: Any) -> None:
        with self._lock:
            self._captured.append(frame)

    def due_late(self, *, flush: bool = False) -> list[Any]:
        now = time.monotonic()
        with self._lock:
            due = [f for t, f in self._late if flush or t <= now]
            self._late = [(t, f) for t, f in self._late if not (flush or t <= now)]
            return due

    def next_due(self) -> float | None:
        with self._lock:
            return min((t for t, _ in self._late), default=None)

    def pick(self, n: int) -> int:
        """A random index below ``n`` (from the injector's seeded generator)."""
        with self._lock:
            return self._rng.randrange(n)

    def flip(self, data: bytearray) -> None:
        """Flip one bit of one byte, chosen at random, in place."""
        if not data:
            return
        with self._lock:
            index = self._rng.randrange(len(data))
            bit = 1 << self._rng.randrange(8)
        data[index] ^= bit
