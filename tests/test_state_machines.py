"""Every transition of both request state machines, legal and illegal; tags; the write guard."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvxfer.core.ledger import PageLedger, PageState
from kvxfer.core.lifecycle import (
    RECEIVER_TERMINAL,
    RECEIVER_TRANSITIONS,
    SENDER_TERMINAL,
    SENDER_TRANSITIONS,
    Lifecycle,
    ReceiverState,
    SenderState,
)
from kvxfer.core.tags import GEN_MASK, MAX_SLOTS, Tag, split_imm32
from kvxfer.core.writeguard import Window, WriteGuard
from kvxfer.errors import IllegalTransition, WriteRefused
from kvxfer.wire.frames import RUN_DTYPE

from .conftest import make_layout

R, S = ReceiverState, SenderState


def _at(role: str, table: dict, target) -> Lifecycle:
    """A lifecycle driven along legal transitions to ``target`` (breadth-first path)."""
    fsm = Lifecycle(role, "rid", generation=5)
    start = fsm.state
    paths = {start: []}
    frontier = [start]
    while frontier:
        nxt = []
        for state in frontier:
            for succ in table[state]:
                if succ not in paths:
                    paths[succ] = paths[state] + [succ]
                    nxt.append(succ)
        frontier = nxt
    for step in paths[target]:
        fsm.to(step)
    return fsm


RECEIVER_PAIRS = list(itertools.product(list(R), list(R)))
SENDER_PAIRS = list(itertools.product(list(S), list(S)))


@pytest.mark.parametrize("old,new", RECEIVER_PAIRS, ids=[f"{a.value}->{b.value}" for a, b in RECEIVER_PAIRS])
def test_receiver_transition(old, new):
    fsm = _at("receiver", RECEIVER_TRANSITIONS, old)
    if new in RECEIVER_TRANSITIONS[old]:
        fsm.to(new, "because")
        assert fsm.state is new and fsm.reason == "because"
    else:
        with pytest.raises(IllegalTransition) as err:
            fsm.to(new)
        assert fsm.state is old
        text = str(err.value)
        assert "'rid'" in text and "generation 5" in text and f"{old.value} -> {new.value}" in text


@pytest.mark.parametrize("old,new", SENDER_PAIRS, ids=[f"{a.value}->{b.value}" for a, b in SENDER_PAIRS])
def test_sender_transition(old, new):
    fsm = _at("sender", SENDER_TRANSITIONS, old)
    if new in SENDER_TRANSITIONS[old]:
        fsm.to(new)
        assert fsm.state is new
    else:
        with pytest.raises(IllegalTransition, match=f"{old.value} -> {new.value}"):
            fsm.to(new)
        assert fsm.state is old


def test_rejected_is_terminal_and_only_reachable_before_anything_moves():
    assert R.REJECTED in RECEIVER_TERMINAL and S.REJECTED in SENDER_TERMINAL
    assert {s for s, nxt in RECEIVER_TRANSITIONS.items() if R.REJECTED in nxt} == {R.NEW, R.RESERVED}
    assert {s for s, nxt in SENDER_TRANSITIONS.items() if S.REJECTED in nxt} == {S.NEW}


def test_quarantine_only_exits_to_terminal_states():
    assert RECEIVER_TRANSITIONS[R.QUARANTINED] <= RECEIVER_TERMINAL


def test_readable_is_only_reached_through_verification():
    assert {s for s, nxt in RECEIVER_TRANSITIONS.items() if R.READABLE in nxt} == {R.VERIFYING}


def test_every_state_reachable():
    for role, table in (("receiver", RECEIVER_TRANSITIONS), ("sender", SENDER_TRANSITIONS)):
        for state in table:
            assert _at(role, table, state).state is state


# tags ---------------------------------------------------------------------------------------------


def test_tag_immediate_encoding_and_wrap():
    tag = Tag(slot=3, generation=7)
    assert tag.imm32() == (7 << 16) | 3
    assert split_imm32(tag.imm32()) == (3, 7)
    wrapped = Tag(slot=3, generation=7 + (GEN_MASK + 1))
    assert wrapped.imm32() == tag.imm32()  # documented: the immediate carries gen mod 2**16
    assert Tag(slot=MAX_SLOTS - 1, generation=2**64 - 1).imm32() < 2**32
    with pytest.raises(ValueError):
        Tag(slot=MAX_SLOTS, generation=1)
    with pytest.raises(ValueError):
        Tag(slot=0, generation=0)
    with pytest.raises(ValueError):
        split_imm32(2**32)


# write guard --------------------------------------------------------------------------------------


def _runs(*items: tuple[int, int, int]) -> np.ndarray:
    runs = np.zeros(len(items), dtype=RUN_DTYPE)
    for i, (b, off, n) in enumerate(items):
        runs[i] = (b, 0, off, n)
    return runs


def _mixed_layout(pages: int, items: list[int]):
    """Buffers of different item lengths (a layout of K, V and an index buffer)."""
    from kvxfer.core.layout import BufferSpec, KVLayout
    from kvxfer.core.memory import allocate_host

    region = allocate_host(sum(items) * pages, name="kv", prefault=False)
    offsets = np.concatenate(([0], np.cumsum(items)[:-1])) * pages
    return KVLayout([BufferSpec(region, int(o), i) for o, i in zip(offsets, items)], num_pages=pages, page_size=1)


@pytest.mark.parametrize("seed", range(6))
def test_the_guards_integer_check_of_small_writes_accepts_only_what_its_vectorised_check_accepts(seed):
    """Writes of up to FEW_PAGES pages are accepted by ``_accept_few`` (Python integers) before the
    vectorised rules run; anything it accepts the vectorised check must accept, with the same page
    counts, or a write the rules refuse would land. Random run tables, hostile ones included (wrong
    buffer, misaligned, past the pool, huge offsets, another owner's or a quarantined page, zero
    length), against random ledgers; most small well-formed writes take the fast path."""
    from kvxfer.core.writeguard import FEW_PAGES

    rng = np.random.default_rng(seed)
    items = [int(x) for x in rng.choice([64, 128, 192, 4096], size=int(rng.integers(1, 4)))]
    layout = _mixed_layout(64, items)
    ledger = PageLedger(64)
    guard = WriteGuard(layout, ledger)
    mine = ledger.allocate(40, 7)
    theirs = ledger.allocate(10, 8)
    ledger.move(mine[:4], 7, PageState.QUARANTINED, allowed=(PageState.RESERVED,))
    ledger.move(mine[4:8], 7, PageState.WRITTEN, allowed=(PageState.RESERVED,))
    window = Window(rid="a", gen=7, slot=1, conn="c", pages=mine[4:])
    guard.open(window)
    accepted = fast = 0
    for _ in range(3000):
        table = []
        for _ in range(int(rng.integers(1, 5))):
            buffer = int(rng.integers(0, len(items) + 1)) if rng.random() < 0.1 else int(rng.integers(0, len(items)))
            item = items[min(buffer, len(items) - 1)]
            page = int(rng.choice(mine)) if rng.random() < 0.8 else int(rng.choice(np.concatenate((theirs, [63, 64, 70]))))
            count = int(rng.integers(0, 6))
            offset, length = page * item, count * item
            roll = rng.random()
            if roll < 0.05:
                offset += int(rng.integers(1, item))
            elif roll < 0.1:
                length += int(rng.integers(1, item))
            elif roll < 0.13:
                offset = int(rng.integers(1 << 62, 1 << 64, dtype=np.uint64))
            table.append((buffer, 0, offset, length))
        runs = _runs(*[(b, o, n) for b, _f, o, n in table])
        quick = guard._accept_few(window, runs)
        try:
            counts = guard._check_runs(window, runs)
        except WriteRefused:
            counts = None
        if counts is not None:
            accepted += 1
        if quick is not None:
            fast += 1
            assert counts is not None, f"accepted by the integer check, refused by the rules: {table}"
            assert np.array_equal(quick, counts), table
        elif counts is not None and int(counts.sum()) <= FEW_PAGES:
            raise AssertionError(f"a small write the rules accept missed the fast path: {table}")
    assert fast > 300 and accepted < 3000, (fast, accepted)


@pytest.mark.parametrize("seed", range(4))
def test_the_guards_integer_record_of_small_writes_matches_its_vectorised_record(seed):
    """Small writes are recorded page by page with Python integers (``_record_few``); the coverage,
    checksums, duplicates, byte counts and WRITTEN pages must be exactly what the vectorised record
    leaves, for repeated, overlapping and multi-buffer writes, with and without item checksums."""
    rng = np.random.default_rng(seed)
    items = [int(x) for x in rng.choice([64, 128, 4096], size=int(rng.integers(1, 4)))]
    guards = []
    for _ in range(2):
        ledger = PageLedger(64)
        guard = WriteGuard(_mixed_layout(64, items), ledger)
        pages = ledger.allocate(48, 3)
        ledger.move(pages[:4], 3, PageState.QUARANTINED, allowed=(PageState.RESERVED,))
        window = Window(rid="a", gen=3, slot=0, conn="c", pages=pages[4:])
        guard.open(window)
        guards.append((guard, window, pages[4:]))
    (fast, fast_window, mine), (slow, slow_window, _) = guards
    for _ in range(400):
        table = []
        for _ in range(int(rng.integers(1, 4))):
            buffer = int(rng.integers(0, len(items)))
            page = int(rng.choice(mine[:-4]))
            table.append((buffer, page * items[buffer], int(rng.integers(1, 4)) * items[buffer]))
        runs = _runs(*table)
        window, counts = fast.check("c", 0, 3, runs)
        sums = rng.integers(0, 1 << 32, int(counts.sum()), dtype=np.uint32) if rng.random() < 0.7 else None
        fast.record(window, runs, counts, sums)
        with slow.lock:
            slow._record_runs(slow_window, runs, counts, sums)
    for name in ("covered", "summed", "item_sum"):
        assert np.array_equal(getattr(fast, name), getattr(slow, name)), name
    assert np.array_equal(fast.ledger.state, slow.ledger.state)
    assert (fast_window.duplicate_items, fast_window.bytes_landed, fast_window.writes_landed) == (
        slow_window.duplicate_items, slow_window.bytes_landed, slow_window.writes_landed)
    assert (fast.landed_bytes, fast.landed_writes) == (slow.landed_bytes, slow.landed_writes)
    assert fast_window.duplicate_items > 0 and np.count_nonzero(fast.ledger.state == PageState.WRITTEN) > 0


def test_write_guard_accepts_only_the_window_and_records_coverage():
    layout = make_layout(16, buffers=2, item=64)
    ledger = PageLedger(16)
    guard = WriteGuard(layout, ledger)
    pages = ledger.allocate(3, 1)  # pages 0,1,2
    guard.open(Window(rid="a", gen=1, slot=4, conn="c1", pages=pages))
    window, counts = guard.check("c1", 4, 1, _runs((0, 0, 128), (1, 0, 64)))
    guard.record(window, _runs((0, 0, 128), (1, 0, 64)), counts)
    assert ledger.state[0] == PageState.WRITTEN and ledger.state[1] == PageState.RESERVED
    assert guard.uncovered(pages).tolist() == [1, 2]
    refusals = {
        "wrong_connection": ("c2", 4, 1, _runs((0, 0, 64))),
        "tag_mismatch": ("c1", 5, 1, _runs((0, 0, 64))),
        "unknown_tag": ("c1", 4, 9, _runs((0, 0, 64))),
        "not_reserved": ("c1", 4, 1, _runs((0, 3 * 64, 64))),
        "out_of_range": ("c1", 4, 1, _runs((0, 16 * 64, 64))),
        "misaligned": ("c1", 4, 1, _runs((0, 8, 64))),
        "bad_buffer": ("c1", 4, 1, _runs((2, 0, 64))),
    }
    for reason, args in refusals.items():
        with pytest.raises(WriteRefused) as err:
            guard.check(*args)
        assert err.value.reason == reason
    guard.close(1)
    with pytest.raises(WriteRefused) as err:
        guard.check("c1", 4, 1, _runs((0, 0, 64)))
    assert err.value.reason == "stale_tag"
    assert guard.counters()["refused_writes"] == len(refusals) + 1
    assert guard.counters()["landed_bytes"] == 192


def test_write_guard_refuses_writes_into_quarantined_pages():
    layout = make_layout(8, buffers=1, item=64)
    ledger = PageLedger(8)
    guard = WriteGuard(layout, ledger)
    pages = ledger.allocate(2, 1)
    guard.open(Window(rid="a", gen=1, slot=0, conn="c", pages=pages))
    ledger.move(pages, 1, PageState.QUARANTINED, allowed=(PageState.RESERVED,))
    with pytest.raises(WriteRefused) as err:
        guard.check("c", 0, 1, _runs((0, 0, 64)))
    assert err.value.reason == "not_reserved"


def test_duplicate_items_are_counted():
    layout = make_layout(8, buffers=1, item=64)
    ledger = PageLedger(8)
    guard = WriteGuard(layout, ledger)
    pages = ledger.allocate(2, 1)
    window = Window(rid="a", gen=1, slot=0, conn="c", pages=pages)
    guard.open(window)
    for _ in range(2):
        w, counts = guard.check("c", 0, 1, _runs((0, 0, 128)))
        guard.record(w, _runs((0, 0, 128)), counts)
    assert window.duplicate_items == 2 and window.bytes_landed == 256
    assert guard.uncovered(pages).size == 0
