"""Sending lanes: a fixed set of threads that serve every link of one sender transport.

A link used to own a sending thread, so a prefill peered with 512 decodes held 512 threads. Now a
link owns only its queue: when it has work it is put on the lanes' ready queue, a lane runs one
step of it (:meth:`Served.serve_step`: one job, or its end), and the link puts itself back behind
the others if it has more. Threads do not grow with peers, and no peer waits for another's whole
queue. A link with a timed wake-up (a late frame held by fault injection) is woken then.

With ``watch`` (links over sockets), one watcher thread polls the sockets of every watched link for the receiver closing its end (EOF or
a reset: the decode's engine or process is gone, or it fenced the connection) and tells the link at
once (:meth:`Served.peer_closed`), so a dead peer's link ends without waiting for a write to fail.
The same thread reads what a receiver sends back on the connection (RESULT frames): a watched link's
``readable()`` reads without blocking and says why the link must end, if it must.

A lane blocked on one link's socket (a receiver that stopped reading) holds that lane until the link
is closed (the peer declared dead, the link closed: a closer shuts the socket down, which unblocks
the send); the other lanes keep serving. ``threads`` bounds how many such links can stall at once.

Invariants: a link is in the ready queue at most once and served by at most one lane at a time, so
its jobs stay in posting order (the link keeps that flag under its own lock, and never holds the
lanes' lock while calling them back); :meth:`SendLanes.close` ends every thread it started and is
idempotent; an exception in a step ends only that link (the link reports it), never a lane.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import selectors
import socket
import threading
import time
from typing import Protocol

log = logging.getLogger("kvxfer.lanes")

DEFAULT_THREADS = 8


class Served(Protocol):
    """What a link served by lanes provides."""

    def serve_step(self) -> None:
        """Run one step (one job, or the link's end); reschedule itself if it has more."""

    def wake(self) -> None:
        """A timed wake-up fell due: schedule a step if there is something to do."""

    def peer_closed(self, reason: str) -> None:
        """The watcher saw the receiver close its end of the socket."""

    def readable(self) -> str | None:
        """A watched link's socket is readable: read it without blocking (what the receiver sent back),
        and say why the link must end (the receiver closed its end, sent what it may not), or None."""


class LaneLink:
    """The scheduling half of a link served by :class:`SendLanes`: a flag that keeps it on the ready
    queue at most once, the lane serving it now, and the event set when it ended. The link supplies
    ``_cond`` (its queue's condition) and :meth:`Served.serve_step`."""

    _cond: threading.Condition

    def _init_lane(self, lanes: SendLanes) -> None:
        self._lanes = lanes
        self._scheduled = False  # on the lanes' ready queue or being served (under _cond)
        self._serving: threading.Thread | None = None  # the lane serving a step now
        self._ended = threading.Event()
        self._wake_due = 0.0  # the earliest timed wake-up asked for (under _cond); past: none pending

    def _wake_later(self, when: float) -> None:
        """A wake-up at monotonic time ``when``, unless one still to come is at or before it: a link waits
        for at most one (a step of an idle shm link asked for one each, every wake-up's step for the next,
        so after a burst of steps an idle link was woken once per step it had served)."""
        with self._cond:
            if time.monotonic() < self._wake_due <= when:
                return
            self._wake_due = when
        self._lanes.wake_at(self, when)  # type: ignore[arg-type]

    def _kick(self, *, continuing: bool = False) -> None:
        """Under ``_cond``: schedule a step unless one is scheduled or the link ended. ``continuing``:
        called by the link's own step as its last act on the lane serving it (it has more to do)."""
        if not self._scheduled and not self._ended.is_set():
            self._scheduled = True
            self._lanes.ready(self, continuing=continuing)  # type: ignore[arg-type]

    def wake(self) -> None:
        with self._cond:
            self._kick()

    def peer_closed(self, reason: str) -> None:  # pragma: no cover - only links over sockets are watched
        pass


class SendLanes:
    """``threads`` sending threads and one watcher thread, shared by the links of one transport."""

    def __init__(self, name: str, *, threads: int = DEFAULT_THREADS, watch: bool = True) -> None:
        if threads <= 0:
            raise ValueError("a transport needs at least one sending thread")
        self.name = name
        self._cond = threading.Condition()
        self._ready: collections.deque[Served] = collections.deque()
        self._timers: list[tuple[float, int, Served]] = []
        self._seq = itertools.count()
        self._closed = False
        self._selector = selectors.DefaultSelector()
        self._watch_lock = threading.Lock()
        # always watched, so the watcher blocks in select() from the start: a socket registered meanwhile
        # is watched at once (a RESULT on a fresh connection waits for no polling interval)
        self._wake_r, self._wake_w = socket.socketpair() if watch else (None, None)
        if self._wake_r is not None:
            self._wake_r.setblocking(False)
            self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._threads = [threading.Thread(target=self._lane, name=f"kvxfer-{name}-send-{i}", daemon=True)
                         for i in range(threads)]
        self._watcher = (threading.Thread(target=self._watch_loop, name=f"kvxfer-{name}-watch", daemon=True)
                         if watch else None)
        self._lane_threads = frozenset(self._threads)
        for thread in self._threads:
            thread.start()
        if self._watcher is not None:
            self._watcher.start()

    # scheduling ------------------------------------------------------------------------------------
    def ready(self, link: Served, *, continuing: bool = False) -> None:
        """Put ``link`` on the ready queue (its caller guarantees it is not there already).

        ``continuing``: the link's own step calls this as its last act, on a lane, and returns to
        the lane's loop at once. When nothing else is queued, that lane takes the link next, so no
        idle lane is woken for it: a woken lane would find the queue empty and sleep again, one
        wasted thread wake-up per step (per 2 MiB frame, and per job of a small request) fighting
        the serving lane for two cores and the interpreter. With others queued, a lane is woken as
        always, so a link never waits behind a lane that blocks on another link's socket."""
        with self._cond:
            alone = not self._ready
            self._ready.append(link)
            if not (continuing and alone and threading.current_thread() in self._lane_threads):
                self._cond.notify()

    def wake_at(self, link: Served, when: float) -> None:
        """Call ``link.wake()`` at monotonic time ``when``."""
        with self._cond:
            heapq.heappush(self._timers, (when, next(self._seq), link))
            self._cond.notify()

    def _next(self) -> Served | None:
        with self._cond:
            while True:
                if self._closed:
                    return None
                now = time.monotonic()
                while self._timers and self._timers[0][0] <= now:
                    due = heapq.heappop(self._timers)[2]
                    self._cond.release()
                    try:
                        due.wake()  # takes the link's lock, may call ready(): not under ours
                    finally:
                        self._cond.acquire()
                if self._ready:
                    return self._ready.popleft()
                wait = self._timers[0][0] - now if self._timers else None
                self._cond.wait(wait)

    def _lane(self) -> None:
        while True:
            link = self._next()
            if link is None:
                return
            try:
                link.serve_step()
            except Exception:  # a link reports its own failures; a lane never dies of one
                log.exception("%s: a sending step failed", self.name)

    # watching sockets ---------------------------------------------------------------------------
    def watch(self, sock: socket.socket, link: Served) -> None:
        with self._watch_lock:
            if not self._closed:
                self._selector.register(sock, selectors.EVENT_READ, link)

    def unwatch(self, sock: socket.socket) -> None:
        """Stop watching ``sock`` (before it is closed)."""
        with self._watch_lock:
            try:
                self._selector.unregister(sock)
            except (KeyError, ValueError, OSError):
                pass

    def _watch_loop(self) -> None:
        while not self._closed:
            try:
                events = self._selector.select(0.5)
            except (OSError, ValueError):
                time.sleep(0.01)
                continue
            for key, _ in events:
                if key.data is None:  # close() woke the watcher
                    continue
                try:
                    reason = key.data.readable()
                except Exception as exc:  # a link's reader failing ends that link only
                    log.exception("%s: reading a data connection failed", self.name)
                    reason = f"reading the connection failed: {exc}"
                if reason is None:
                    continue
                self.unwatch(key.fileobj)
                try:
                    key.data.peer_closed(reason)
                except Exception:  # pragma: no cover - a link reports its own failures
                    log.exception("%s: reporting a closed connection failed", self.name)

    # lifecycle ------------------------------------------------------------------------------------
    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        if self._wake_w is not None:
            try:
                self._wake_w.send(b"x")
            except OSError:
                pass
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=10)
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=5)
        with self._watch_lock:
            self._selector.close()
        for end in (self._wake_r, self._wake_w):
            if end is not None:
                end.close()

    @property
    def threads(self) -> int:
        return len(self._threads)
