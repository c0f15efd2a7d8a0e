"""The write guard's C rules (native/kvxfer_guard.c) held to their Python twins (kvxfer/core/writeguard.py).

Each C rule runs on the guard's and the ledger's own arrays; the Python rules are the reference. Random
run tables (hostile ones included: another buffer, misaligned, past the pool, huge offsets, zero length,
another owner's, quarantined, readable or free pages) against random ledgers: the C check must accept
exactly what the Python rules accept, with the same page counts, and the records and the completion's
coverage and landed checksum must leave and read the same state. A guard built with ``native=False``
runs the Python rules alone, so the two guards are driven side by side through the public methods.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer.core import native
from kvxfer.core.checksum import ChecksumAlgo, native_id
from kvxfer.core.ledger import PageLedger, PageState
from kvxfer.core.writeguard import Window, WriteGuard
from kvxfer.errors import WriteRefused
from kvxfer.wire.frames import RUN_DTYPE

pytestmark = pytest.mark.skipif(
    not native.provides("guard_accept", "guard_record", "guard_landed"),
    reason=f"needs the C extension kvxfer._native with the guard rules ({native.describe()})",
)

PAGES = 64


def _layout(items: list[int]):
    """Buffers of different item lengths (K, V and an index buffer), one token per page."""
    from kvxfer.core.layout import BufferSpec, KVLayout
    from kvxfer.core.memory import allocate_host

    region = allocate_host(sum(items) * PAGES, name="kv", prefault=False)
    offsets = np.concatenate(([0], np.cumsum(items)[:-1])) * PAGES
    return KVLayout([BufferSpec(region, int(o), i) for o, i in zip(offsets, items)], num_pages=PAGES, page_size=1)


def _runs(table: list[tuple[int, int, int]]) -> np.ndarray:
    runs = np.zeros(len(table), dtype=RUN_DTYPE)
    for i, (buffer, offset, length) in enumerate(table):
        runs[i] = (buffer, 0, offset, length)
    return runs


def _guard_pair(items: list[int]) -> tuple[list[tuple[WriteGuard, Window]], np.ndarray, np.ndarray]:
    """Two guards over identical ledgers (C rules, Python rules): a window of generation 7 over most of
    its pages, some of them QUARANTINED, WRITTEN or READABLE, and another request's pages beside them."""
    pairs = []
    for use_c in (True, False):
        ledger = PageLedger(PAGES)
        guard = WriteGuard(_layout(items), ledger, native=use_c)
        assert (guard._c is not None) is use_c
        mine = ledger.allocate(40, 7)
        theirs = ledger.allocate(10, 8)
        ledger.move(mine[:4], 7, PageState.QUARANTINED, allowed=(PageState.RESERVED,))
        ledger.move(mine[4:8], 7, PageState.WRITTEN, allowed=(PageState.RESERVED,))
        ledger.move(theirs[:3], 8, PageState.READABLE, allowed=(PageState.RESERVED,))
        window = Window(rid="a", gen=7, slot=1, conn="c", pages=mine[4:])
        guard.open(window)
        ledger.move(mine[8:10], 7, PageState.READABLE, allowed=(PageState.RESERVED,))  # raced to READABLE
        pairs.append((guard, window))
    return pairs, mine, theirs


def _random_table(rng: np.random.Generator, items: list[int], mine: np.ndarray, theirs: np.ndarray,
                  max_pages: int) -> list[tuple[int, int, int]]:
    table = []
    for _ in range(int(rng.integers(1, 6))):
        buffer = int(rng.integers(0, len(items) + 1)) if rng.random() < 0.08 else int(rng.integers(0, len(items)))
        item = items[min(buffer, len(items) - 1)]
        pool = np.concatenate((theirs, [0, PAGES - 1, PAGES, PAGES + 6]))
        page = int(rng.choice(mine)) if rng.random() < 0.85 else int(rng.choice(pool))
        count = int(rng.integers(0, max_pages + 1))
        offset, length = page * item, count * item
        roll = rng.random()
        if roll < 0.04:
            offset += int(rng.integers(1, item))
        elif roll < 0.08:
            length += int(rng.integers(1, item))
        elif roll < 0.10:
            offset = int(rng.integers(1 << 62, 1 << 64, dtype=np.uint64))
        elif roll < 0.12:
            length = int(rng.integers(1 << 62, 1 << 64, dtype=np.uint64))
        table.append((buffer, offset, length))
    return table


@pytest.mark.parametrize("seed", range(6))
def test_the_c_check_accepts_exactly_what_the_python_rules_accept(seed):
    rng = np.random.default_rng(seed)
    items = [int(x) for x in rng.choice([64, 128, 192, 4096], size=int(rng.integers(1, 4)))]
    ((c_guard, c_window), (_, _)), mine, theirs = _guard_pair(items)
    accepted = refused = 0
    for _ in range(3000):
        table = _random_table(rng, items, mine, theirs, max_pages=int(rng.choice([2, 8, 40])))
        runs = _runs(table)
        c_counts = c_guard._accept_c(c_window, runs)
        try:
            counts = c_guard._check_runs(c_window, runs)
        except WriteRefused:
            counts = None
        if counts is None:
            refused += 1
            assert c_counts is None, f"accepted in C, refused by the rules: {table}"
        else:
            accepted += 1
            assert c_counts is not None, f"accepted by the rules, refused in C: {table}"
            assert c_counts.tolist() == counts.tolist(), table
    assert accepted > 200 and refused > 200, (accepted, refused)


@pytest.mark.parametrize("seed", range(4))
def test_the_c_record_and_completion_leave_what_the_python_rules_leave(seed):
    """Both guards take the same writes through check() and record() (repeats, overlaps, several
    buffers, item checksums present, absent or of the wrong count) and a refused write in between;
    coverage, checksums, ledger states, counters, uncovered pages and the landed checksum agree after
    every step that changes them."""
    rng = np.random.default_rng(100 + seed)
    items = [int(x) for x in rng.choice([64, 128, 4096], size=int(rng.integers(1, 4)))]
    pairs, mine, theirs = _guard_pair(items)
    algos = [a for a in (ChecksumAlgo.ADLER32, ChecksumAlgo.CRC32) if native_id(a) is not None]
    for step in range(600):
        table = _random_table(rng, items, mine, theirs, max_pages=int(rng.choice([1, 3, 12])))
        runs = _runs(table)
        outcome = []
        sums_roll = rng.random()
        for guard, _window in pairs:
            try:
                window, counts = guard.check("c", 1, 7, runs)
            except WriteRefused as exc:
                outcome.append(("refused", exc.reason, None))
                continue
            n = int(np.asarray(counts).sum())
            local = np.random.default_rng(step)  # the same sums for both guards
            if sums_roll < 0.6:
                sums = local.integers(0, 1 << 32, n, dtype=np.uint32)
            elif sums_roll < 0.7:
                sums = local.integers(0, 1 << 32, n + 1, dtype=np.uint32)  # not one per item: unsummed
            else:
                sums = None
            guard.record(window, runs, counts, sums)
            outcome.append(("landed", np.asarray(counts).tolist(), None))
        assert outcome[0] == outcome[1], (table, outcome)
        (c, c_window), (py, py_window) = pairs
        for name in ("covered", "summed", "item_sum"):
            assert np.array_equal(getattr(c, name), getattr(py, name)), (name, table)
        assert np.array_equal(c.ledger.state, py.ledger.state), table
        assert (c_window.duplicate_items, c_window.bytes_landed, c_window.writes_landed) == (
            py_window.duplicate_items, py_window.bytes_landed, py_window.writes_landed)
        assert c.counters() == py.counters()
        if step % 20 == 0:
            for pages in (c_window.pages, mine[10:14], mine[12:13], np.array([], dtype=np.int64)):
                assert c.uncovered(pages).tolist() == py.uncovered(pages).tolist()
                for algo in algos:
                    assert c.landed_checksum(pages, algo) == py.landed_checksum(pages, algo), (algo, pages)
    c, _ = pairs[0]
    assert c.landed_writes > 50 and np.count_nonzero(c.ledger.state == PageState.WRITTEN) > 4


def test_the_c_landed_checksum_is_the_pages_own_checksum():
    """What the C rules combine from the item checksums is the checksum of the pages' bytes, read back."""
    from kvxfer.core.checksum import checksum_pages

    items = [128, 4096, 64]
    ledger = PageLedger(PAGES)
    guard = WriteGuard(_layout(items), ledger)
    pages = ledger.allocate(6, 3)
    window = Window(rid="r", gen=3, slot=0, conn="c", pages=pages)
    guard.open(window)
    rng = np.random.default_rng(5)
    for view in guard.layout.views():
        view[pages] = rng.integers(0, 256, view[pages].shape, dtype=np.uint8)
    for algo in (ChecksumAlgo.ADLER32, ChecksumAlgo.CRC32):
        for b, item in enumerate(items):
            for page in pages.tolist():
                runs = _runs([(b, page * item, item)])
                w, counts = guard.check("c", 0, 3, runs)
                own = algo.update(guard.layout.views()[b][page].tobytes(), algo.initial)
                guard.record(w, runs, counts, np.array([own], dtype=np.uint32))
        assert guard.landed_checksum(pages, algo) == checksum_pages(guard.layout, pages, algo)
        assert guard.uncovered(pages).size == 0
    assert (ledger.state[pages] == PageState.WRITTEN).all()


def test_the_c_rules_refuse_tables_they_were_not_given_checked():
    """Called directly with what no caller should pass, the C rules raise and write nothing: a run past
    the pool, arrays of the wrong size, a page outside the pool."""
    lib = native.lib
    items = np.array([64, 128], dtype=np.int64).tobytes()
    state = np.full(PAGES, int(PageState.RESERVED), dtype=np.uint8)
    stamps = np.full(PAGES, 3, dtype=np.uint64)
    covered = np.zeros(2 * PAGES, dtype=bool)
    summed = np.zeros(2 * PAGES, dtype=bool)
    item_sum = np.zeros(2 * PAGES, dtype=np.uint32)
    past = _runs([(0, 0, 64), (1, (PAGES - 1) * 128, 2 * 128)])
    with pytest.raises(ValueError, match="run 1 is not whole pages"):
        lib.guard_record(past, items, PAGES, covered, summed, item_sum, None, state, stamps, 3, 1, 2)
    assert not covered.any() and (state == PageState.RESERVED).all()
    assert lib.guard_accept(past, items, PAGES, state, stamps, 3, 0b110) is None
    with pytest.raises(ValueError, match="one entry per page"):
        lib.guard_accept(_runs([(0, 0, 64)]), items, PAGES, state[:-1], stamps, 3, 0b110)
    with pytest.raises(ValueError, match="24-byte run records"):
        lib.guard_accept(b"\0" * 23, items, PAGES, state, stamps, 3, 0b110)
    with pytest.raises(ValueError, match=r"must be \(buffers, pages\)"):
        lib.guard_record(_runs([(0, 0, 64)]), items, PAGES, covered[:-1], summed, item_sum, None, state, stamps,
                         3, 1, 2)
    with pytest.raises(ValueError, match="outside the pool"):
        lib.guard_landed(np.array([PAGES], dtype=np.int64), items, PAGES, covered, summed, item_sum, 0, 1)
    with pytest.raises(TypeError):
        lib.guard_record(_runs([(0, 0, 64)]), items, PAGES, bytes(2 * PAGES), summed, item_sum, None, state,
                         stamps, 3, 1, 2)  # read-only arrays are refused, not written through


@pytest.mark.parametrize("seed", range(3))
def test_the_c_ledger_move_is_the_python_rule(seed):
    """PageLedger.move and holds() through C against the same ledger on the Python rules (owned_by):
    random pages (out of range, repeated, another generation's, every state) and allowed states; a
    refused move raises naming the pages and changes nothing on either."""
    from kvxfer.core import ledger as ledger_module
    from kvxfer.errors import PageStateError

    rng = np.random.default_rng(seed)
    ledgers = [PageLedger(PAGES), PageLedger(PAGES)]
    for ledger in ledgers:
        for gen in (3, 4, 5):
            ledger.allocate(15, gen)
    states = list(PageState)
    moved = refused = 0
    for _ in range(1500):
        gen = int(rng.choice([3, 4, 5, 6]))
        pages = rng.integers(-2, PAGES + 2, int(rng.integers(0, 6))) if rng.random() < 0.1 else \
            rng.choice(np.flatnonzero(ledgers[0].generation == gen) if gen < 6 else np.arange(4), int(rng.integers(1, 6)))
        pages = np.asarray(pages, dtype=np.int64)
        allowed = tuple(rng.choice(states[1:], int(rng.integers(1, 4)), replace=False).tolist())
        allowed = tuple(PageState(s) for s in allowed)
        new_state = PageState(int(rng.choice([1, 2, 3, 4])))
        results = []
        for use_c, ledger in zip((True, False), ledgers):
            saved = ledger_module._C_MOVE
            if not use_c:
                ledger_module._C_MOVE = None
            try:
                holds = ledger.holds(pages, gen, allowed)
                try:
                    ledger.move(pages, gen, new_state, allowed=allowed)
                    results.append((holds, "moved", None))
                except PageStateError as exc:
                    results.append((holds, "refused", sorted(set(np.asarray(exc.pages).tolist())) if exc.pages is not None else None))
            finally:
                ledger_module._C_MOVE = saved
        assert results[0] == results[1], (pages, gen, allowed, new_state, results)
        assert np.array_equal(ledgers[0].state, ledgers[1].state)
        moved += results[0][1] == "moved"
        refused += results[0][1] == "refused"
    assert moved > 100 and refused > 100, (moved, refused)


@pytest.mark.parametrize("seed", range(3))
def test_the_one_pass_verification_makes_readable_only_what_the_full_verification_passes(seed):
    """``verified_move`` (a small request's coverage, landed checksum and move to READABLE in one pass in
    C) against ``verify_completion`` and the ledger's own move on the Python-rules guard: over random
    writes, page sets (covered, partly covered, another owner's, raced to READABLE) and claims (the
    landed checksum, another one), it moves the pages exactly when the full verification passes and the
    pages are WRITTEN for the generation, and changes nothing otherwise."""
    from kvxfer.core.pool import PagePool
    from kvxfer.core.verify import Claim, verify_completion
    from kvxfer.errors import PageStateError, VerificationFailed

    rng = np.random.default_rng(300 + seed)
    items = [int(x) for x in rng.choice([64, 128, 4096], size=int(rng.integers(1, 4)))]
    pairs, mine, theirs = _guard_pair(items)
    (c, _), (py, _) = pairs
    pool = PagePool(py.layout)  # verify_completion reads the layout and the (keep) free policy of it
    algos = [ChecksumAlgo.NONE] + [a for a in (ChecksumAlgo.ADLER32, ChecksumAlgo.CRC32) if native_id(a) is not None]
    outcomes = {True: 0, False: 0}
    for step in range(600):
        runs = _runs(_random_table(rng, items, mine, theirs, max_pages=int(rng.choice([1, 3, 12]))))
        for guard in (c, py):
            try:
                window, counts = guard.check("c", 1, 7, runs)
            except WriteRefused:
                continue
            guard.record(window, runs, counts, np.random.default_rng(step).integers(
                0, 1 << 32, int(np.asarray(counts).sum()), dtype=np.uint32))
        first = int(rng.integers(0, len(mine) - 1))
        pages = [mine[first : first + int(rng.integers(1, 9))], theirs[:2], mine[8:12]][int(rng.choice(3, p=[.8, .1, .1]))]
        algo = algos[int(rng.integers(0, len(algos)))]
        landed = py.landed_checksum(pages, algo) if algo is not ChecksumAlgo.NONE else 0
        claimed = landed if landed is not None and rng.random() < 0.8 else int(rng.integers(0, 1 << 32))
        claim = Claim(bytes=py.layout.bytes_for_pages(len(pages)), pages=len(pages), checksum=claimed, algo=algo.value)
        try:
            verify_completion(pool, py, rid="a", gen=7, pages=pages, claim=claim, algo=algo,
                              actual_checksum=None if algo is ChecksumAlgo.NONE else landed)
            py.ledger.move(pages, 7, PageState.READABLE, allowed=(PageState.WRITTEN,))
            expected = True
        except (VerificationFailed, PageStateError, TypeError):  # TypeError: no landed checksum to compare
            expected = False
        before = c.ledger.state.copy()
        moved = c.verified_move(pages, 7, claimed, algo, PageState.WRITTEN, PageState.READABLE)
        assert moved is expected, (pages, algo, claimed, landed)
        if moved:
            assert (c.ledger.state[pages] == PageState.READABLE).all()
            c.ledger.state[pages] = py.ledger.state[pages] = PageState.WRITTEN  # as before, for the next steps
        else:
            assert np.array_equal(c.ledger.state, before)
        outcomes[moved] += 1
    assert min(outcomes.values()) > 15, outcomes
