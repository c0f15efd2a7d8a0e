"""Request lifecycles on both roles, as explicit state machines with validated transitions.

The tables below are the whole truth; ``protocol/SPEC.md`` draws them. A transition not in a table
raises :class:`~kvxfer.errors.IllegalTransition` naming request, generation and both states, and
changes nothing. ``REJECTED`` is terminal on both roles and its only predecessors are ``NEW`` (and,
on the receiver, ``RESERVED`` when the writer rejects before writing), so a rejected request can
never reach bootstrap, allocation or transfer.

Receiver (decode) page custody per state: ``RESERVED``/``VERIFYING``/``READABLE`` hold pages,
``RELEASING`` holds them (still readable by the leases already open, by no new one) until the last
read lease ends, ``QUARANTINED`` holds them frozen until a drain proof or a fence, terminal states
hold none.
Sender (prefill) custody: source pages are held until every posted write has completed.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import IllegalTransition


class ReceiverState(str, enum.Enum):
    """A request's state on the receiving (decode) role; legal moves are :data:`RECEIVER_TRANSITIONS`."""

    NEW = "NEW"
    REJECTED = "REJECTED"  # admission refused (here or by the writer before writing); terminal
    RESERVED = "RESERVED"  # pages reserved, writes of this generation may land
    VERIFYING = "VERIFYING"  # DONE arrived behind the writes; checking coverage, bytes, checksum
    READABLE = "READABLE"  # verified; reads pass the ownership check
    RELEASING = "RELEASING"  # released or aborted while read leases are open; pages held until they end
    QUARANTINED = "QUARANTINED"  # aborted with writes possibly in flight; pages frozen
    FAILED = "FAILED"  # terminal; pages released after a drain proof or fence
    ABORTED = "ABORTED"  # terminal; pages released after a drain proof or fence
    RELEASED = "RELEASED"  # terminal; the consumer finished reading, pages freed


class SenderState(str, enum.Enum):
    """A request's state on the sending (prefill) role; legal moves are :data:`SENDER_TRANSITIONS`."""

    NEW = "NEW"
    REJECTED = "REJECTED"  # admission refused; terminal; never bootstraps, allocates or writes
    ADMITTED = "ADMITTED"  # source pages held; waiting for the receiver's destination pages
    READY = "READY"  # destination known; nothing posted yet
    TRANSFERRING = "TRANSFERRING"  # writes posted
    DONE_SENT = "DONE_SENT"  # every write posted, DONE posted behind them
    SUCCEEDED = "SUCCEEDED"  # the receiver verified the transfer; terminal
    DRAINING = "DRAINING"  # aborted; waiting for posted writes to complete
    ABORTED = "ABORTED"  # drained and acknowledged; terminal
    FAILED = "FAILED"  # terminal


R, S = ReceiverState, SenderState

RECEIVER_TRANSITIONS: dict[ReceiverState, frozenset[ReceiverState]] = {
    R.NEW: frozenset({R.REJECTED, R.RESERVED}),
    R.RESERVED: frozenset({R.VERIFYING, R.QUARANTINED, R.REJECTED, R.ABORTED, R.FAILED}),
    R.VERIFYING: frozenset({R.READABLE, R.FAILED}),
    R.READABLE: frozenset({R.RELEASED, R.ABORTED, R.RELEASING}),
    R.RELEASING: frozenset({R.RELEASED, R.ABORTED}),
    R.QUARANTINED: frozenset({R.ABORTED, R.FAILED}),
    R.REJECTED: frozenset(),
    R.FAILED: frozenset(),
    R.ABORTED: frozenset(),
    R.RELEASED: frozenset(),
}

SENDER_TRANSITIONS: dict[SenderState, frozenset[SenderState]] = {
    S.NEW: frozenset({S.REJECTED, S.ADMITTED}),
    S.ADMITTED: frozenset({S.READY, S.ABORTED, S.FAILED}),
    S.READY: frozenset({S.TRANSFERRING, S.ABORTED, S.FAILED}),
    S.TRANSFERRING: frozenset({S.TRANSFERRING, S.DONE_SENT, S.DRAINING, S.FAILED}),
    S.DONE_SENT: frozenset({S.SUCCEEDED, S.FAILED, S.ABORTED}),
    S.DRAINING: frozenset({S.ABORTED, S.FAILED}),
    S.REJECTED: frozenset(),
    S.SUCCEEDED: frozenset(),
    S.ABORTED: frozenset(),
    S.FAILED: frozenset(),
}

RECEIVER_TERMINAL = frozenset(s for s, nxt in RECEIVER_TRANSITIONS.items() if not nxt)
SENDER_TERMINAL = frozenset(s for s, nxt in SENDER_TRANSITIONS.items() if not nxt)

# The happy path on each role; every other state is an event operators are told about.
RECEIVER_HAPPY = frozenset({R.NEW, R.RESERVED, R.VERIFYING, R.READABLE, R.RELEASING, R.RELEASED})
SENDER_HAPPY = frozenset({S.NEW, S.ADMITTED, S.READY, S.TRANSFERRING, S.DONE_SENT, S.SUCCEEDED})


@dataclass
class Transition:
    """One entry of a :class:`Lifecycle`'s history: states by value, the reason, ``time.monotonic()``."""

    old: str
    new: str
    reason: str
    at: float


@dataclass
class Lifecycle:
    """One request's state on one role, with its history."""

    role: str  # "receiver" or "sender"
    rid: Any
    generation: int | None = None
    state: Any = None
    history: list[Transition] = field(default_factory=list)
    # called after every transition with (lifecycle, old state, reason); metrics and event logs
    observer: Callable[[Lifecycle, Any, str], None] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.role == "receiver":
            self._table: dict[Any, frozenset[Any]] = RECEIVER_TRANSITIONS
            self.state = R.NEW
        elif self.role == "sender":
            self._table = SENDER_TRANSITIONS
            self.state = S.NEW
        else:
            raise ValueError(f"unknown role {self.role!r}")

    @property
    def terminal(self) -> bool:
        return not self._table[self.state]

    def can(self, new: Any) -> bool:
        return new in self._table[self.state]

    def to(self, new: Any, reason: str = "") -> None:
        """Move to ``new`` or raise :class:`IllegalTransition` (state unchanged)."""
        if new not in self._table[self.state]:
            raise IllegalTransition(
                rid=self.rid,
                generation=self.generation,
                role=self.role,
                old=self.state.value,
                new=getattr(new, "value", str(new)),
            )
        old = self.state
        self.history.append(Transition(old.value, new.value, reason, time.monotonic()))
        self.state = new
        if self.observer is not None:
            self.observer(self, old, reason)

    @property
    def happy(self) -> bool:
        """Whether the current state is on the role's happy path."""
        return self.state in (RECEIVER_HAPPY if self.role == "receiver" else SENDER_HAPPY)

    @property
    def age(self) -> float:
        """Seconds since the first transition (admission), 0 before it."""
        return self.history[-1].at - self.history[0].at if self.history else 0.0

    @property
    def reason(self) -> str:
        """The reason given for the latest transition."""
        return self.history[-1].reason if self.history else ""
