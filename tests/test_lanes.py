"""Sending lanes (kvxfer.transport.lanes) on real threads: a link with more to do stays on the lane
serving it, a lane blocked in one link's step never holds another link back, and an idle link is woken
once per interval however many steps it served (also on a real shm link)."""

from __future__ import annotations

import threading
import time

from kvxfer.core.lifecycle import ReceiverState
from kvxfer.transport import shm
from kvxfer.transport.lanes import LaneLink, SendLanes

from .conftest import PAGE_TOKENS


class StepLink(LaneLink):
    """A link whose steps are counted: ``steps`` to run, each noting the lane that ran it; a step may
    block on ``gate`` (a receiver that stopped reading)."""

    def __init__(self, lanes: SendLanes, steps: int, gate: threading.Event | None = None) -> None:
        self._cond = threading.Condition()
        self._init_lane(lanes)
        self.left = steps
        self.gate = gate
        self.served_by: list[threading.Thread] = []
        self.done = threading.Event()

    def start(self) -> None:
        with self._cond:
            self._kick()

    def serve_step(self) -> None:
        self.served_by.append(threading.current_thread())
        if self.gate is not None:
            self.gate.wait(30)
        with self._cond:
            self._scheduled = False
            self.left -= 1
            if self.left > 0:
                self._kick(continuing=True)
                return
        self.done.set()


def test_a_link_with_more_to_do_stays_on_its_lane():
    """Every step of a busy link runs on the lane that took it: the step's own re-queue wakes no idle
    lane (it would find the queue empty and sleep again, a wasted wake-up per step)."""
    lanes = SendLanes("t", threads=8, watch=False)
    try:
        link = StepLink(lanes, 2000)
        link.start()
        assert link.done.wait(30)
        assert len(link.served_by) == 2000
        assert len(set(link.served_by)) == 1, {t.name for t in link.served_by}
    finally:
        lanes.close()


def test_a_lane_blocked_in_one_link_never_holds_back_another():
    """Two lanes: one blocks in link A's step; link B, queued while both lanes were busy and again
    after each of its steps, still runs every step on the other lane."""
    lanes = SendLanes("t", threads=2, watch=False)
    gate = threading.Event()
    try:
        stuck = StepLink(lanes, 2, gate=gate)
        stuck.start()
        busy = StepLink(lanes, 500)
        busy.start()
        assert busy.done.wait(30), f"{busy.left} steps of the free link never ran"
        assert stuck.left == 2 and len(stuck.served_by) == 1
        assert stuck.served_by[0] not in busy.served_by
    finally:
        gate.set()
        lanes.close()



class IdleLookingLink(LaneLink):
    """A link that, as an shm link does, asks for a wake-up ``interval`` after each step that leaves its
    queue empty; a step run with nothing posted (a wake-up's) is counted as a look."""

    def __init__(self, lanes: SendLanes, interval: float) -> None:
        self._cond = threading.Condition()
        self._init_lane(lanes)
        self.interval = interval
        self.posted = 0
        self.looks = 0

    def post(self) -> None:
        with self._cond:
            self.posted += 1
            self._kick()

    def serve_step(self) -> None:
        with self._cond:
            self._scheduled = False
            if self.posted:
                self.posted -= 1
            else:
                self.looks += 1
            self._cond.notify_all()
        self._wake_later(time.monotonic() + self.interval)


def test_an_idle_link_is_woken_once_per_interval_however_many_steps_it_served():
    """500 posts, each served by a step that asks for a wake-up: the idle link is then woken about once
    per interval, not once per step it served (each wake-up's step asked for the next, so every step
    left a chain of wake-ups behind it, and an idle shm link burned a core after a burst)."""
    lanes = SendLanes("t", threads=2, watch=False)
    try:
        link = IdleLookingLink(lanes, interval=0.05)
        for _ in range(500):
            link.post()
            with link._cond:
                assert link._cond.wait_for(lambda: not link.posted, timeout=5)
        time.sleep(0.1)
        before = link.looks
        time.sleep(0.5)
        looks = link.looks - before
        assert 5 <= looks <= 14, f"{looks} wake-ups of an idle link in 0.5 s (about one per 0.05 s expected)"
        assert len(lanes._timers) <= 2, f"{len(lanes._timers)} wake-ups pending for one link"
    finally:
        lanes.close()


def test_an_idle_shm_link_looks_at_its_reader_once_per_interval_after_a_burst(engines):
    """Real engines over shm, every request sent by a sending thread (inline sends off): after 200
    requests the idle link looks at its reader about once per IDLE_CHECK, as before the burst (it
    looked once per request it had sent, each look asking for the next: a fifth of a core, idle)."""
    pair = engines(fault_injection=False, transport="shm", transport_options={"shm": {"inline_send": False}})
    p, d, link = pair.prefill, pair.decode, pair.link
    for i in range(200):
        rid = f"burst-{i}"
        pair.transfer(rid, PAGE_TOKENS, seed=i)
        assert d.wait(rid, timeout=10).state is ReceiverState.READABLE
        d.release(rid)
        p.wait(rid, timeout=10)
    time.sleep(2 * shm.IDLE_CHECK)
    before = link.idle_looks
    time.sleep(0.5)
    looks = link.idle_looks - before
    assert looks <= 0.5 / shm.IDLE_CHECK + 4, f"{looks} looks at the reader in 0.5 s of an idle link"
