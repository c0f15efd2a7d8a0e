"""Sending lanes (kvxfer.transport.lanes) on real threads: a link with more to do stays on the lane
serving it, and a lane blocked in one link's step never holds another link back."""

from __future__ import annotations

import threading

from kvxfer.transport.lanes import LaneLink, SendLanes


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
