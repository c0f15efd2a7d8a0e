"""The receiver's write guard: whether a one-sided write may land, and what landed for whom.

This is the software twin of an RDMA rkey, and every transport uses it (the tcp transport before
each payload lands, the verbs transport when attributing completions), so there is one copy of the
rules:

* a write carries a tag ``(slot, generation)`` and arrives on a connection;
* it is accepted only if a *window* is open for that generation, the slot matches, it arrived on
  the connection the window was opened for, and every byte falls inside whole pages that the
  ledger holds ``RESERVED``/``WRITTEN`` for that generation;
* anything else is refused with a reason, counted and logged, and lands nowhere;
* what landed is recorded per (buffer, page) in a coverage bitmap, which completion verification
  reads; a page covered in every buffer becomes ``WRITTEN``;
* a window of one writer's head slice (a request with several writers, or pages of another size:
  ``Window.table``) accepts only runs of whole, adjacent atoms of that slice
  (:class:`~kvxfer.core.slicing.SliceTable`, reason ``outside_slice``) and records coverage per atom
  in the table; its pages move on at verification, when every writer's slice is known to have landed.
  A request's writers have windows of their own generations over pages the ledger holds for the
  request's generation (``Window.owner_gen``).

Where the C extension is built, the checks and records of writes of whole pages, and the completion's
coverage and landed checksum, run its twins of these rules (``native/kvxfer_guard.c``) on the same
arrays, under the same lock; the C check only ever accepts, and anything it does not accept is decided
(and named) by the Python rules here, which stay the reference (``tests/test_guard_native.py`` holds
the two equal). ``native=False`` keeps a guard on the Python rules alone.

Invariants: windows open only over pages the ledger holds for their generation; coverage of a page
is reset when a window opens over it; all state here and all ledger changes of the receiver happen
under the engine's lock (``lock``), so a page cannot change owner between check and record.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import WriteRefused
from . import native as _native
from .checksum import ChecksumAlgo, combine, native_id
from .layout import KVLayout
from .ledger import WRITABLE_STATES, PageLedger, PageState
from .pagesets import all_set, any_set, total
from .runs import RUN_DTYPE
from .slicing import SliceTable, expand_runs

log = logging.getLogger("kvxfer.writeguard")
_LOG_FIRST = 20
# Writes of at most this many pages are checked with Python integers first (:meth:`WriteGuard._accept_few`):
# a one-page write is one run, and numpy's per-call cost was most of its check.
FEW_PAGES = 16
_WRITABLE_VALUES = frozenset(int(s) for s in WRITABLE_STATES)


@dataclass
class Window:
    """Write permission for one request generation over its reserved pages."""

    rid: Any
    gen: int
    slot: int
    conn: Any
    pages: np.ndarray
    open: bool = True
    bytes_landed: int = 0
    writes_landed: int = 0
    duplicate_items: int = 0
    refused: int = 0
    final_writes: int = 0
    final_bytes: int = 0
    first_landed: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    owner_gen: int = 0  # the generation the ledger holds the pages under (0: ``gen``)
    table: SliceTable | None = None  # one writer's head slice; None: whole pages

    def __post_init__(self) -> None:
        if not self.owner_gen:
            self.owner_gen = self.gen


__all__ = ["Window", "WriteGuard", "expand_runs"]


class WriteGuard:
    """The receiver's write permissions (windows by generation and slot) and coverage of what landed.

    Every check and record runs under ``lock``, the engine's lock (see the module's invariants)."""

    def __init__(self, layout: KVLayout, ledger: PageLedger, lock: threading.RLock | None = None, *,
                 native: bool = True) -> None:
        self.layout = layout
        self.ledger = ledger
        self.lock = lock or threading.RLock()
        self.covered = np.zeros((layout.num_buffers, layout.num_pages), dtype=bool)
        self._item_lens = [int(n) for n in layout.item_lens]
        # Per (buffer, page) checksum of the item as it landed, when the transport computed one while
        # the bytes were still in cache; ``summed`` says which items have a current one.
        self.item_sum = np.zeros((layout.num_buffers, layout.num_pages), dtype=np.uint32)
        self.summed = np.zeros((layout.num_buffers, layout.num_pages), dtype=bool)
        # 1-D views of the three (buffer, page) arrays, indexed by buffer * num_pages + page
        self._covered_flat, self._summed_flat, self._item_sum_flat = (
            self._flat(a) for a in (self.covered, self.summed, self.item_sum))
        self._windows: dict[int, Window] = {}
        self._by_slot: dict[int, Window] = {}
        self.newest_generation = 0
        self.requires_final = False  # verbs: a request's final write (with immediate) must be seen
        self.refused: Counter[str] = Counter()
        self.refused_bytes = 0
        self.landed_bytes = 0
        self.landed_writes = 0
        # called (under the lock) with (reason, conn, refusal or None) for every refused write
        self.on_refused: Any = None
        # the C twins of the whole-page rules (native/kvxfer_guard.c), where the extension has them
        self._c = _native.lib if native and _native.provides("guard_accept", "guard_record", "guard_landed") else None
        self._item_lens_c = np.ascontiguousarray(layout.item_lens, dtype=np.int64).tobytes()
        self._writable_mask = sum(1 << int(s) for s in WRITABLE_STATES)

    # windows ----------------------------------------------------------------------------------
    def open(self, window: Window) -> None:
        with self.lock:
            if not self.ledger.holds(window.pages, window.owner_gen, WRITABLE_STATES):
                ok = self.ledger.owned_by(window.pages, window.owner_gen, WRITABLE_STATES)
                raise WriteRefused(
                    "cannot open a write window over pages the request does not hold",
                    reason="not_reserved",
                    rid=window.rid,
                    generation=window.gen,
                    pages=window.pages[~ok],
                )
            if window.table is None:
                self.covered[:, window.pages] = False
                self.summed[:, window.pages] = False
            self._windows[window.gen] = window
            self._by_slot[window.slot] = window
            self.newest_generation = max(self.newest_generation, window.gen)

    def close(self, gen: int) -> Window | None:
        """Revoke write permission for ``gen``: every later write for it is refused."""
        with self.lock:
            window = self._windows.get(gen)
            if window is not None:
                window.open = False
            return window

    def forget(self, gen: int) -> None:
        with self.lock:
            window = self._windows.pop(gen, None)
            if window is not None and self._by_slot.get(window.slot) is window:
                del self._by_slot[window.slot]

    def final(self, conn: Any, imm: int, nbytes: int) -> Window | None:
        """A final write's immediate arrived (verbs). Attribute it, or count it as stale/unknown."""
        from .tags import GEN_MASK, split_imm32

        with self.lock:
            slot, gen_low = split_imm32(imm)
            window = self._by_slot.get(slot)
            if window is None or not window.open or (window.gen & GEN_MASK) != gen_low or window.conn != conn:
                reason = "stale_tag" if window is not None or gen_low else "unknown_tag"
                self.refused[reason] += 1
                count = self.refused[reason]
                level = logging.WARNING if count <= _LOG_FIRST else logging.DEBUG
                log.log(level, "final write refused (%s): immediate %#010x (slot %d, generation mod 2^16 %d) "
                        "matches no open window on %s", reason, imm, slot, gen_low, conn)
                if self.on_refused is not None:
                    self.on_refused(reason, conn, None)
                return None
            window.final_writes += 1
            window.final_bytes += nbytes
            return window

    def window(self, gen: int) -> Window | None:
        return self._windows.get(gen)

    def open_windows(self) -> list[Window]:
        with self.lock:
            return [w for w in self._windows.values() if w.open]

    # the check ---------------------------------------------------------------------------------
    def check(self, conn: Any, slot: int, gen: int, runs: np.ndarray) -> tuple[Window, np.ndarray]:
        """Accept a write (returns its window and per-run page counts) or raise WriteRefused.

        ``runs`` is a structured array with ``buffer``, ``offset`` and ``length`` fields."""
        with self.lock:
            try:
                return self._check(conn, slot, gen, runs)
            except WriteRefused as refusal:
                self.refused[refusal.reason] += 1
                self.refused_bytes += int(runs["length"].sum())
                window = self._windows.get(gen)
                if window is not None:
                    window.refused += 1
                count = self.refused[refusal.reason]
                level = logging.WARNING if count <= _LOG_FIRST else logging.DEBUG
                log.log(level, "write refused (%s, #%d of this kind): %s", refusal.reason, count, refusal)
                if self.on_refused is not None:
                    self.on_refused(refusal.reason, conn, refusal)
                raise

    def _check(self, conn: Any, slot: int, gen: int, runs: np.ndarray) -> tuple[Window, np.ndarray]:
        window = self._windows.get(gen)
        if window is None or not window.open:
            if window is not None or 0 < gen <= self.newest_generation:
                rid = window.rid if window is not None else None
                raise WriteRefused(
                    f"stale tag (slot {slot}): the generation's write window is closed",
                    reason="stale_tag",
                    rid=rid,
                    generation=gen,
                )
            raise WriteRefused(
                f"unknown tag (slot {slot}): no write window was ever opened for this generation",
                reason="unknown_tag",
                generation=gen,
            )
        if window.slot != slot:
            raise WriteRefused(
                f"tag slot {slot} does not match the window's slot {window.slot}",
                reason="tag_mismatch",
                rid=window.rid,
                generation=gen,
            )
        if window.conn != conn:
            raise WriteRefused(
                f"write arrived on connection {conn}, the window belongs to {window.conn}",
                reason="wrong_connection",
                rid=window.rid,
                generation=gen,
            )
        if window.table is None:
            counts = self._accept_c(window, runs) if self._c is not None else self._accept_few(window, runs)
            if counts is not None:
                return window, counts
        return window, self._check_runs(window, runs)

    def _accept_c(self, window: Window, runs: np.ndarray) -> np.ndarray | None:
        """:meth:`_accept_few`'s C twin for writes of any size (``guard_accept``): the per-run page counts
        of a write of whole pages in range over pages the window's owner holds writable, or None (the
        vectorised rules then decide and name the reason)."""
        if runs.dtype != RUN_DTYPE or not runs.flags.c_contiguous or not len(runs):
            return None
        ledger = self.ledger
        raw = self._c.guard_accept(runs, self._item_lens_c, self.layout.num_pages, ledger.state, ledger.generation,
                                   window.owner_gen, self._writable_mask)
        return None if raw is None else np.frombuffer(raw, dtype=np.int64)

    def _few_spans(self, runs: np.ndarray) -> list[tuple[int, int, int]] | None:
        """A short run table as ``(buffer, first page, page count)`` per run, in Python integers, when
        every run is whole pages of a buffer of the layout inside the pool and all of them together are
        at most :data:`FEW_PAGES` pages; None otherwise (the vectorised code then takes the write)."""
        if len(runs) > FEW_PAGES or runs.dtype != RUN_DTYPE:
            return None
        items, num_pages = self._item_lens, self.layout.num_pages
        left = FEW_PAGES
        spans = []
        for buffer, _flags, offset, length in runs.tolist():
            if buffer >= len(items) or length <= 0:
                return None
            item = items[buffer]
            if offset % item or length % item:
                return None
            first, count = offset // item, length // item
            left -= count
            if left < 0 or first + count > num_pages:
                return None
            spans.append((buffer, first, count))
        return spans

    def _accept_few(self, window: Window, runs: np.ndarray) -> np.ndarray | None:
        """The per-run page counts of a write of whole pages that passes every rule of :meth:`_check_runs`
        (in range, aligned, in pages the window's owner holds writable), checked page by page with
        Python integers; None when a rule fails or the write is not a few pages (:meth:`_few_spans`),
        and :meth:`_check_runs` decides (and names the reason). It only ever accepts less."""
        spans = self._few_spans(runs)
        if spans is None:
            return None
        state, stamps, owner = self.ledger.state, self.ledger.generation, window.owner_gen
        for _buffer, first, count in spans:
            for page in range(first, first + count):
                if state.item(page) not in _WRITABLE_VALUES or stamps.item(page) != owner:
                    return None
        return np.array([count for _buffer, _first, count in spans], dtype=np.int64)

    def _check_runs(self, window: Window, runs: np.ndarray) -> np.ndarray:
        """Per-run page counts of a write inside ``window`` (slot and connection already checked), or
        WriteRefused: the rules, vectorised over the run table."""
        gen = window.gen
        buffers = runs["buffer"].astype(np.int64)
        offsets = runs["offset"].astype(np.int64)
        lengths = runs["length"].astype(np.int64)
        if any_set(offsets < 0) or any_set(lengths <= 0):  # parsers refuse these; never trust one caller
            raise WriteRefused("write with a negative offset or a non-positive length", reason="out_of_range",
                               rid=window.rid, generation=gen)
        if any_set(buffers >= self.layout.num_buffers):
            raise WriteRefused(
                f"write names buffer {int(buffers.max())}; the layout has {self.layout.num_buffers}",
                reason="bad_buffer",
                rid=window.rid,
                generation=gen,
            )
        if window.table is not None:
            return self._check_slice(window, buffers, offsets, lengths)
        items = self.layout.item_lens[buffers]
        if any_set((offsets % items) | (lengths % items)):  # both >= 0: nonzero if either is
            raise WriteRefused(
                "write is not aligned to whole pages", reason="misaligned", rid=window.rid, generation=gen
            )
        first = offsets // items
        counts = lengths // items
        beyond = (first + counts) > self.layout.num_pages
        if any_set(beyond):
            bad = first[beyond]
            raise WriteRefused(
                f"write beyond the pool's {self.layout.num_pages} pages",
                reason="out_of_range",
                rid=window.rid,
                generation=gen,
                pages=bad,
            )
        pages = expand_runs(first, counts)
        ok = self.ledger.owned_by(pages, window.owner_gen, WRITABLE_STATES)
        if not all_set(ok):
            raise WriteRefused(
                "write touches pages not reserved for this generation",
                reason="not_reserved",
                rid=window.rid,
                generation=gen,
                pages=pages[~ok],
            )
        return counts

    def _check_slice(self, window: Window, buffers: np.ndarray, offsets: np.ndarray,
                     lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A write for one writer's slice: whole, adjacent atoms of it, in pages the request still holds."""
        assert window.table is not None
        located = window.table.locate(buffers, offsets, lengths)
        if located is None:
            raise WriteRefused("write is not whole pieces of this writer's slice of the request's pages",
                               reason="outside_slice", rid=window.rid, generation=window.gen)
        items = self.layout.item_lens[buffers]
        pages = np.unique(np.concatenate([offsets // items, (offsets + lengths - 1) // items]))
        ok = self.ledger.owned_by(pages, window.owner_gen, WRITABLE_STATES)
        if not ok.all():
            raise WriteRefused("write touches pages not reserved for this generation", reason="not_reserved",
                               rid=window.rid, generation=window.gen, pages=pages[~ok])
        return located

    def record(self, window: Window, runs: np.ndarray, counts: Any = None,
               sums: np.ndarray | None = None) -> None:
        """Record that an accepted write's bytes have landed (with their item checksums, if known).
        ``counts`` is what :meth:`check` returned beside the window."""
        with self.lock:
            if window.table is not None:
                self._record_slice(window, runs, counts)
            elif self._c is not None and runs.dtype == RUN_DTYPE and runs.flags.c_contiguous and len(runs):
                self._record_c(window, runs, sums)
            elif not self._record_few(window, runs, sums):
                self._record_runs(window, runs, counts, sums)

    def _record_c(self, window: Window, runs: np.ndarray, sums: np.ndarray | None) -> None:
        """:meth:`_record_runs` in C (``guard_record``): coverage, the landed item checksums, and the pages
        covered in every buffer moved to WRITTEN, on the same arrays."""
        if sums is not None:
            sums = np.ascontiguousarray(sums, dtype=np.uint32)
        ledger = self.ledger
        duplicates, nbytes = self._c.guard_record(
            runs, self._item_lens_c, self.layout.num_pages, self._covered_flat, self._summed_flat,
            self._item_sum_flat, sums, ledger.state, ledger.generation, window.gen, int(PageState.RESERVED),
            int(PageState.WRITTEN))
        window.duplicate_items += duplicates
        window.bytes_landed += nbytes
        window.writes_landed += len(runs)
        self.landed_bytes += nbytes
        self.landed_writes += len(runs)

    def _record_few(self, window: Window, runs: np.ndarray, sums: np.ndarray | None) -> bool:
        """:meth:`_record_runs` for a write of a few whole pages (:meth:`_few_spans`), page by page with
        Python integers; False, recording nothing, for any other."""
        spans = self._few_spans(runs)
        if spans is None:
            return False
        num_pages, buffers = self.layout.num_pages, len(self._item_lens)
        touched = [page for _buffer, first, count in spans for page in range(first, first + count)]
        at = [buffer * num_pages + page for buffer, first, count in spans for page in range(first, first + count)]
        sums_of = sums.tolist() if sums is not None and len(sums) == len(at) else None
        covered, summed, item_sum = self._covered_flat, self._summed_flat, self._item_sum_flat
        duplicates = sum(covered.item(i) for i in at)  # covered before this write, as _record_runs counts
        for k, i in enumerate(at):
            covered[i] = True
            if sums_of is None:
                summed[i] = False
            else:
                item_sum[i] = sums_of[k]
                summed[i] = True
        if buffers > 1:  # WRITTEN once covered in every buffer
            touched = [p for p in dict.fromkeys(touched) if all(covered.item(b * num_pages + p) for b in range(buffers))]
        self.ledger.mark_written(touched, window.gen)
        nbytes = sum(count * self._item_lens[buffer] for buffer, _first, count in spans)
        window.duplicate_items += duplicates
        window.bytes_landed += nbytes
        window.writes_landed += len(spans)
        self.landed_bytes += nbytes
        self.landed_writes += len(spans)
        return True

    def _record_runs(self, window: Window, runs: np.ndarray, counts: Any, sums: np.ndarray | None) -> None:
        """Record a write of whole pages (under the lock), vectorised over its run table."""
        buffers = runs["buffer"].astype(np.int64)
        lengths = runs["length"].astype(np.int64)
        items = self.layout.item_lens[buffers]
        if counts is None:
            counts = lengths // items
        first = runs["offset"].astype(np.int64) // items
        pages = expand_runs(first, counts)
        # (buffer, page) as one index into the flattened (C-contiguous) arrays: cheaper than 2-D
        # fancy indexing on this per-frame path
        one_buffer = self.layout.num_buffers == 1
        flat = pages if one_buffer else np.repeat(buffers, counts) * self.layout.num_pages + pages
        covered = self._covered_flat
        window.duplicate_items += int(np.count_nonzero(covered[flat]))
        covered[flat] = True
        summed = self._summed_flat
        if sums is not None and len(sums) == len(pages):
            self._item_sum_flat[flat] = sums
            summed[flat] = True
        else:
            summed[flat] = False
        # a page is WRITTEN once covered in every buffer; with one buffer every page just recorded
        # is (mark_written moves only this generation's RESERVED pages and ignores repeats)
        full = pages if one_buffer else pages[self.covered[:, pages].all(axis=0)]
        self.ledger.mark_written(full, window.gen)
        nbytes = total(lengths)
        window.bytes_landed += nbytes
        window.writes_landed += len(runs)
        self.landed_bytes += nbytes
        self.landed_writes += len(runs)

    def _record_slice(self, window: Window, runs: np.ndarray, located: Any) -> None:
        assert window.table is not None
        buffers = runs["buffer"].astype(np.int64)
        if located is None:  # recorded without its check (a caller's own): locate it now
            located = window.table.locate(buffers, runs["offset"].astype(np.int64), runs["length"].astype(np.int64))
            if located is None:
                raise WriteRefused("write is not whole pieces of this writer's slice", reason="outside_slice",
                                   rid=window.rid, generation=window.gen)
        before = window.table.duplicates
        window.table.record(buffers, *located)
        window.duplicate_items += window.table.duplicates - before
        nbytes = int(runs["length"].astype(np.int64).sum())
        window.bytes_landed += nbytes
        window.writes_landed += len(runs)
        self.landed_bytes += nbytes
        self.landed_writes += len(runs)

    @staticmethod
    def _flat(array: np.ndarray) -> np.ndarray:
        """A 1-D view of a (buffers, pages) array; writes through it land in ``array``."""
        if not array.flags.c_contiguous:  # pragma: no cover - made C-contiguous; reshape would copy
            raise AssertionError("write guard arrays must be C-contiguous")
        return array.reshape(-1)

    # queries ------------------------------------------------------------------------------------
    def landed_checksum(self, pages: np.ndarray, algo: Any) -> int | None:
        """The request checksum combined from item checksums taken as the bytes landed, or None if
        some item has none (the caller then reads the pages)."""
        with self.lock:
            algo_id = native_id(algo) if self._c is not None else None
            if algo_id is not None:
                pages = np.ascontiguousarray(pages, dtype=np.int64)
                return self._c.guard_landed(pages, self._item_lens_c, self.layout.num_pages, self._covered_flat,
                                            self._summed_flat, self._item_sum_flat, algo_id, algo.initial)[1]
            if not all_set(self.summed[:, pages]):
                return None
            values = self.item_sum[:, pages].reshape(-1)
        lengths = np.repeat(self.layout.item_lens, len(pages))
        return combine(algo, values, lengths)

    def verified_move(self, pages: np.ndarray, gen: int, claimed: int, algo: Any, written: int, readable: int) -> bool:
        """A whole-page request's coverage and checksum checks, and its pages moved from ``written`` to
        ``readable``, in one pass in C (``guard_landed``, then ``ledger_move``): True when every page is
        covered in every buffer, the checksum combined from the landed item checksums equals ``claimed``
        (``algo`` none: not compared) and every page is ``written`` and stamped ``gen``, and they moved.
        False, nothing changed, otherwise, or without the C twins or with a final write owed (verbs):
        :func:`~kvxfer.core.verify.verify_completion` then decides and names what differs."""
        if self._c is None or not hasattr(self._c, "ledger_move") or self.requires_final or not len(pages):
            return False
        algo_id = native_id(algo)
        if algo_id is None and algo is not ChecksumAlgo.NONE:
            return False
        with self.lock:
            pages = np.ascontiguousarray(pages, dtype=np.int64)
            uncovered, actual = self._c.guard_landed(
                pages, self._item_lens_c, self.layout.num_pages, self._covered_flat, self._summed_flat,
                self._item_sum_flat, -1 if algo_id is None else algo_id, algo.initial)
            if uncovered or (algo_id is not None and actual != claimed):
                return False
            ledger = self.ledger
            return bool(self._c.ledger_move(pages, ledger.state, ledger.generation, gen, 1 << int(written),
                                            int(readable)))

    def uncovered(self, pages: np.ndarray) -> np.ndarray:
        """Pages (of ``pages``) not covered in every buffer."""
        with self.lock:
            if self._c is not None:  # counted in C first: a verified request has none
                flat = np.ascontiguousarray(pages, dtype=np.int64)
                if not self._c.guard_landed(flat, self._item_lens_c, self.layout.num_pages, self._covered_flat,
                                            self._summed_flat, self._item_sum_flat, -1, 0)[0]:
                    return pages[:0]
            return pages[~self.covered[:, pages].all(axis=0)]

    def counters(self) -> dict[str, Any]:
        with self.lock:
            return {
                "landed_bytes": self.landed_bytes,
                "landed_writes": self.landed_writes,
                "refused_writes": sum(self.refused.values()),
                "refused_bytes": self.refused_bytes,
                "refused_by_reason": dict(self.refused),
            }
