"""The page ledger: the state, owner generation and free-list position of every page in a pool.

This is the bookkeeping that stands between tenants when pages are reused without zeroing, so it is
deliberately small, vectorised and strict:

* every page is in exactly one :class:`PageState`;
* a page is on the free list if and only if its state is ``FREE``, and at most once;
* every allocation stamps the page with the allocating request's generation, which is unique and
  increasing per engine, so a page's generation changes on every allocation;
* every state change names the generation that must own the pages and the states they may be in,
  and refuses (raising, changing nothing) when any page differs.

The ledger does not touch page memory (scrubbing is :mod:`kvxfer.core.pool`'s job) and does not know
request ids (the engine maps generations to requests). :mod:`kvxfer.tools.simulate` drives this same class.
"""

from __future__ import annotations

import enum
import functools
import random
from collections.abc import Iterable

import numpy as np

from ..errors import ConfigError, LedgerInvariantError, PageStateError, PoolExhausted
from . import native as _native
from .pagesets import all_set


class PageState(enum.IntEnum):
    """The state of one page in the ledger; every page is in exactly one (see the module's invariants)."""

    FREE = 0
    """On the free list; may hold a previous owner's bytes (unless the free policy scrubbed it)."""
    RESERVED = 1
    """Allocated to a request; writes tagged with its generation may land."""
    WRITTEN = 2
    """Every buffer of the page was covered by writes of its owner's generation."""
    READABLE = 3
    """The owner's transfer was verified; reads pass the ownership check."""
    QUARANTINED = 4
    """The owner was aborted while writes may be in flight: never allocated, never readable."""


WRITABLE_STATES = (PageState.RESERVED, PageState.WRITTEN)
HELD_STATES = (PageState.RESERVED, PageState.WRITTEN, PageState.READABLE, PageState.QUARANTINED)
# the states as numpy scalars: comparing or assigning an IntEnum member costs numpy 4x an integer's
_FREE, _RESERVED, _WRITTEN = (np.uint8(s) for s in (PageState.FREE, PageState.RESERVED, PageState.WRITTEN))


class AllocPolicy(str, enum.Enum):
    """Which free page is handed out next. It decides whose stale bytes a bug would expose."""

    LIFO = "lifo"
    FIFO = "fifo"
    RANDOM = "random"

    @classmethod
    def parse(cls, value: str | AllocPolicy) -> AllocPolicy:
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(p.value for p in cls)
            raise ConfigError(f"unknown allocation policy {value!r} (choose {choices})") from None


class _FreeList:
    """Free pages in hand-out order. Subclasses decide the order; all are numpy-backed."""

    def __init__(self, num_pages: int) -> None:
        self.capacity = num_pages

    def __len__(self) -> int:  # pragma: no cover - overridden
        raise NotImplementedError

    def push(self, pages: np.ndarray) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def pop(self, count: int) -> np.ndarray:  # pragma: no cover - overridden
        raise NotImplementedError

    def contents(self) -> np.ndarray:  # pragma: no cover - overridden
        raise NotImplementedError

    def remove(self, pages: np.ndarray) -> None:
        """Take specific pages out (caller has checked they are free)."""
        keep = self.contents()
        keep = keep[~np.isin(keep, pages)]
        self._reset(keep)

    def _reset(self, items: np.ndarray) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


class _LifoFreeList(_FreeList):
    """A stack: the most recently freed page is handed out first (SGLang's behaviour)."""

    def __init__(self, num_pages: int) -> None:
        super().__init__(num_pages)
        self._items = np.arange(num_pages, dtype=np.int64)[::-1].copy()
        self._n = num_pages

    def __len__(self) -> int:
        return self._n

    def push(self, pages: np.ndarray) -> None:
        k = len(pages)
        self._items[self._n : self._n + k] = pages
        self._n += k

    def pop(self, count: int) -> np.ndarray:
        out = self._items[self._n - count : self._n][::-1].copy()
        self._n -= count
        return out

    def contents(self) -> np.ndarray:
        return self._items[: self._n][::-1].copy()

    def _reset(self, items: np.ndarray) -> None:
        self._n = len(items)
        self._items[: self._n] = items[::-1]


class _FifoFreeList(_FreeList):
    """A ring: the page freed longest ago is handed out first."""

    def __init__(self, num_pages: int) -> None:
        super().__init__(num_pages)
        self._items = np.arange(num_pages, dtype=np.int64)
        self._head = 0
        self._n = num_pages

    def __len__(self) -> int:
        return self._n

    def push(self, pages: np.ndarray) -> None:
        idx = (self._head + self._n + np.arange(len(pages))) % self.capacity
        self._items[idx] = pages
        self._n += len(pages)

    def pop(self, count: int) -> np.ndarray:
        idx = (self._head + np.arange(count)) % self.capacity
        out = self._items[idx].copy()
        self._head = (self._head + count) % self.capacity
        self._n -= count
        return out

    def contents(self) -> np.ndarray:
        return self._items[(self._head + np.arange(self._n)) % self.capacity].copy()

    def _reset(self, items: np.ndarray) -> None:
        self._head = 0
        self._n = len(items)
        self._items[: self._n] = items


_FEW_RANDOM = 16  # random pops of up to this many pages pick one by one
# larger random pops in C where the extension is built (a 16,384-page pop from 131,072 free pages: numpy's
# choice and the masks closing the holes 0.26 ms, half a millisecond beside a landing thread)
_RANDOM_TAKE = _native.lib.random_take if _native.provides("random_take") else None


class _RandomFreeList(_FreeList):
    """Uniformly random choice among free pages (seeded, so runs are reproducible)."""

    def __init__(self, num_pages: int, seed: int | None) -> None:
        super().__init__(num_pages)
        self._items = np.arange(num_pages, dtype=np.int64)
        self._n = num_pages
        self._rng = np.random.default_rng(seed)
        self._few_rng = random.Random(seed)  # a few pages at a time: Python's generator, without numpy's per-call cost

    def __len__(self) -> int:
        return self._n

    def push(self, pages: np.ndarray) -> None:
        self._items[self._n : self._n + len(pages)] = pages
        self._n += len(pages)

    def pop(self, count: int) -> np.ndarray:
        """``count`` distinct free pages, uniformly at random; the list closes the holes they leave with
        the survivors from its tail, so a pop costs O(count), not O(free pages) (1 ms per page at a
        million pages when it compacted the whole list)."""
        n, items = self._n, self._items
        if count <= _FEW_RANDOM:  # swap each pick with the list's last page
            out = np.empty(count, dtype=np.int64)
            for i in range(count):
                j = self._few_rng.randrange(n)
                n -= 1
                out[i] = items[j]
                items[j] = items[n]
            self._n = n
            return out
        if _RANDOM_TAKE is not None:  # the same draw in C: a partial Fisher-Yates shuffle, O(count)
            out = np.empty(count, dtype=np.int64)
            _RANDOM_TAKE(items, n, out, int(self._rng.integers(0, 1 << 63)))
            self._n = n - count
            return out
        chosen = self._rng.choice(n, size=count, replace=False)
        out = items[chosen].copy()
        kept = n - count
        tail_survives = np.ones(count, dtype=bool)
        tail_survives[chosen[chosen >= kept] - kept] = False
        items[chosen[chosen < kept]] = items[kept:n][tail_survives]
        self._n = kept
        return out

    def contents(self) -> np.ndarray:
        return self._items[: self._n].copy()

    def _reset(self, items: np.ndarray) -> None:
        self._n = len(items)
        self._items[: self._n] = items


@functools.lru_cache(maxsize=64)
def _state_table_of(states: tuple[int, ...]) -> np.ndarray:
    table = np.zeros(256, dtype=bool)  # a lookup table: cheaper than np.isin per call
    table[list(states)] = True
    table.setflags(write=False)
    return table


_STATE_TABLES: dict[tuple[PageState, ...], np.ndarray] = {}


def _state_table(states: Iterable[PageState]) -> np.ndarray:
    """Which page states (uint8 values) are among ``states``: a read-only lookup table (looked up by
    the caller's tuple first: the callers pass a few constant tuples, on every frame)."""
    table = _STATE_TABLES.get(states) if type(states) is tuple else None
    if table is None:
        table = _state_table_of(tuple(int(s) for s in states))
        if type(states) is tuple and len(_STATE_TABLES) < 64:
            _STATE_TABLES[states] = table
    return table


_STATE_MASKS: dict[tuple[PageState, ...], int] = {}
# PageLedger.move's ownership check and state change in C (native/kvxfer_guard.c), where it is built
_C_MOVE = _native.lib.ledger_move if _native.provides("ledger_move") else None


def _state_mask(states: tuple[PageState, ...]) -> int:
    """Which page states are among ``states``, as a bit per state value (the C rules' form)."""
    mask = _STATE_MASKS.get(states)
    if mask is None:
        mask = sum(1 << int(s) for s in set(states))
        if len(_STATE_MASKS) < 64:
            _STATE_MASKS[states] = mask
    return mask


def _as_pages(pages: Iterable[int] | np.ndarray) -> np.ndarray:
    if type(pages) is np.ndarray and pages.dtype == np.int64 and pages.ndim == 1:
        return pages  # the common case, as the data path passes them
    return np.asarray(pages, dtype=np.int64).reshape(-1)


class PageLedger:
    """State, generation and free list of ``num_pages`` pages."""

    def __init__(
        self, num_pages: int, *, policy: AllocPolicy | str = AllocPolicy.LIFO, seed: int | None = None
    ) -> None:
        if num_pages <= 0:
            raise ConfigError(f"a ledger needs at least one page (got {num_pages})")
        self.num_pages = int(num_pages)
        self.policy = AllocPolicy.parse(policy)
        self.state = np.zeros(self.num_pages, dtype=np.uint8)
        self.generation = np.zeros(self.num_pages, dtype=np.uint64)
        if self.policy is AllocPolicy.LIFO:
            self._free: _FreeList = _LifoFreeList(self.num_pages)
        elif self.policy is AllocPolicy.FIFO:
            self._free = _FifoFreeList(self.num_pages)
        else:
            self._free = _RandomFreeList(self.num_pages, seed)
        self.allocations = 0
        self.releases = 0

    # queries --------------------------------------------------------------------------------
    @property
    def free_count(self) -> int:
        return len(self._free)

    def counts(self) -> dict[str, int]:
        """Pages per state, by lower-case state name; the values always sum to ``num_pages``."""
        binc = np.bincount(self.state, minlength=len(PageState))
        return {s.name.lower(): int(binc[s]) for s in PageState}

    def owned_by(self, pages: np.ndarray, generation: int, states: Iterable[PageState]) -> np.ndarray:
        """Boolean mask: which of ``pages`` are in one of ``states`` and stamped ``generation``."""
        pages = _as_pages(pages)
        in_range = (pages >= 0) & (pages < self.num_pages)
        # out-of-range indices read a clipped neighbour, then fail on in_range
        ok = _state_table(states)[self.state.take(pages, mode="clip")]
        ok &= self.generation.take(pages, mode="clip") == np.uint64(generation)
        return ok & in_range

    def check_custody(self, holdings: Iterable[tuple[object, int, np.ndarray, tuple[PageState, ...]]], *,
                      noun: str = "pages") -> None:
        """The custody invariant both roles keep: each holding ``(rid, generation, pages, states)`` has
        its pages in one of ``states`` under its stamp, no page is held twice, and every page that is
        not FREE has a holder. Raises :class:`LedgerInvariantError` naming the request and pages."""
        held = np.zeros(self.num_pages, dtype=np.int32)
        for rid, generation, pages, states in holdings:
            ok = self.owned_by(pages, generation, states)
            if not ok.all():
                raise LedgerInvariantError(
                    f"{noun} not in {'/'.join(s.name for s in states)} under the request's stamp",
                    rid=rid, generation=generation, pages=np.asarray(pages)[~ok],
                )
            np.add.at(held, _as_pages(pages), 1)
        if (held > 1).any():
            raise LedgerInvariantError(f"{noun} held by two requests", pages=np.flatnonzero(held > 1))
        orphan = np.flatnonzero((held == 0) & (self.state != _FREE))
        if orphan.size:
            raise LedgerInvariantError(f"{noun} held by no request", pages=orphan)

    def free_pages(self) -> np.ndarray:
        """Free pages in the order they would be handed out (LIFO/FIFO; arbitrary for random)."""
        return self._free.contents()

    # changes --------------------------------------------------------------------------------
    def allocate(self, count: int, generation: int) -> np.ndarray:
        """Take ``count`` free pages, stamp them ``generation`` and mark them RESERVED."""
        count = int(count)
        if count <= 0:
            raise PageStateError(f"cannot allocate {count} pages", generation=generation)
        self._check_generation(generation)
        if count > len(self._free):
            raise PoolExhausted(
                f"{count} pages requested, {len(self._free)} of {self.num_pages} free",
                generation=generation,
            )
        pages = self._free.pop(count)
        if self.policy is not AllocPolicy.RANDOM:
            # Which pages is the policy's choice; their order within the request is ours, and
            # ascending order lets runs coalesce.
            pages.sort()
        self.state[pages] = _RESERVED
        self.generation[pages] = np.uint64(generation)
        self.allocations += 1
        return pages

    def adopt(self, pages: Iterable[int] | np.ndarray, generation: int) -> np.ndarray:
        """Reserve pages someone else chose (an engine with its own allocator, like SGLang's)."""
        pages = _as_pages(pages)
        self._check_generation(generation)
        if pages.size == 0:
            raise PageStateError("cannot adopt an empty page list", generation=generation)
        out_of_range = pages[(pages < 0) | (pages >= self.num_pages)]
        if out_of_range.size:
            raise PageStateError(
                f"page index out of range [0, {self.num_pages})", generation=generation, pages=out_of_range
            )
        if np.unique(pages).size != pages.size:
            raise PageStateError("page list names a page twice", generation=generation, pages=pages)
        busy = pages[self.state[pages] != _FREE]
        if busy.size:
            raise PageStateError(
                "pages are not free (held by generations "
                f"{sorted(set(int(g) for g in self.generation[busy][:8]))})",
                generation=generation,
                pages=busy,
            )
        self._free.remove(pages)
        self.state[pages] = _RESERVED
        self.generation[pages] = np.uint64(generation)
        self.allocations += 1
        return pages

    def move(
        self,
        pages: np.ndarray,
        generation: int,
        new_state: PageState,
        *,
        allowed: Iterable[PageState],
    ) -> None:
        """Move pages owned by ``generation`` from one of ``allowed`` states to ``new_state``."""
        pages = _as_pages(pages)
        if new_state is PageState.FREE:
            raise PageStateError("use release() to free pages", generation=generation)
        allowed = tuple(allowed)
        if self._moved_in_c(pages, generation, allowed, int(new_state)):
            return
        ok = self.owned_by(pages, generation, allowed)
        if not all_set(ok):
            self._raise_not_owned(pages[~ok], generation, allowed, f"move to {new_state.name}")
        self.state[pages] = np.uint8(new_state)

    def holds(self, pages: np.ndarray, generation: int, states: Iterable[PageState]) -> bool:
        """Whether every one of ``pages`` is in one of ``states`` and stamped ``generation``
        (:meth:`owned_by`, all of them)."""
        pages = _as_pages(pages)
        states = tuple(states)
        return self._moved_in_c(pages, generation, states, -1) or all_set(self.owned_by(pages, generation, states))

    def _moved_in_c(self, pages: np.ndarray, generation: int, allowed: tuple[PageState, ...], new_state: int) -> bool:
        """True when C found every page owned and moved them to ``new_state`` (-1: checked only); False
        when C is not built or a page is not owned, changing nothing (the Python rules then decide)."""
        if _C_MOVE is None or not pages.flags.c_contiguous or not 0 < generation < 1 << 64:
            return False
        return _C_MOVE(pages, self.state, self.generation, generation, _state_mask(allowed), new_state)

    def mark_written(self, pages: np.ndarray, generation: int) -> int:
        """RESERVED pages of ``generation`` among ``pages`` become WRITTEN; others stay as they are.

        Called by the data path once a page is covered in every buffer. Pages that meanwhile went
        QUARANTINED (or to another owner) are left alone. Returns how many pages moved. A short list of
        Python integers (a small write's pages) is moved one by one, without numpy's per-call cost."""
        if type(pages) is list and len(pages) <= 64:
            moved = 0
            for page in pages:
                if (0 <= page < self.num_pages and self.state.item(page) == PageState.RESERVED
                        and self.generation.item(page) == generation):
                    self.state[page] = _WRITTEN
                    moved += 1
            return moved
        pages = _as_pages(pages)
        mine = (self.state[pages] == _RESERVED) & (
            self.generation[pages] == np.uint64(generation)
        )
        self.state[pages[mine]] = _WRITTEN
        return int(np.count_nonzero(mine))

    def release(self, pages: np.ndarray, generation: int, *, allowed: Iterable[PageState]) -> None:
        """Return pages owned by ``generation`` to the free list.

        The caller has already scrubbed them per the free policy and has proof that no write for
        ``generation`` can still land (completion, drain acknowledgement or fence)."""
        pages = _as_pages(pages)
        allowed = tuple(allowed)
        if not self._moved_in_c(pages, generation, allowed, int(_FREE)):  # checked and freed in one pass
            ok = self.owned_by(pages, generation, allowed)
            if not all_set(ok):
                self._raise_not_owned(pages[~ok], generation, allowed, "release")
            self.state[pages] = _FREE
        self._free.push(pages)
        self.releases += 1

    # invariant ------------------------------------------------------------------------------
    def check_invariants(self) -> dict[str, int]:
        """Raise :class:`LedgerInvariantError` unless the accounting holds; return the counts."""
        free = self._free.contents()
        uniq = np.unique(free)
        if uniq.size != free.size:
            raise LedgerInvariantError(f"free list holds {free.size - uniq.size} duplicate pages")
        by_state = np.flatnonzero(self.state == _FREE)
        if not np.array_equal(uniq, by_state):
            missing = np.setdiff1d(by_state, uniq)
            extra = np.setdiff1d(uniq, by_state)
            raise LedgerInvariantError(
                f"free list and page states disagree: {missing.size} FREE pages not on the list "
                f"{missing[:8].tolist()}, {extra.size} listed pages not FREE {extra[:8].tolist()}"
            )
        if self.state.max(initial=0) > max(PageState):
            raise LedgerInvariantError("a page holds an unknown state value")
        held = self.state != _FREE
        if (self.generation[held] == 0).any():
            raise LedgerInvariantError("a held page has no generation stamp")
        counts = self.counts()
        if sum(counts.values()) != self.num_pages:
            raise LedgerInvariantError(f"state counts {counts} do not sum to {self.num_pages}")
        return counts

    # helpers --------------------------------------------------------------------------------
    def _check_generation(self, generation: int) -> None:
        if int(generation) <= 0:
            raise PageStateError(f"generation must be positive (got {generation})")

    def _raise_not_owned(
        self, bad: np.ndarray, generation: int, allowed: tuple[PageState, ...], what: str
    ) -> None:
        in_range = bad[(bad >= 0) & (bad < self.num_pages)]
        if in_range.size != bad.size:
            raise PageStateError(
                f"cannot {what}: page index out of range [0, {self.num_pages})",
                generation=generation,
                pages=bad,
            )
        first = int(in_range[0])
        raise PageStateError(
            f"cannot {what}: page {first} is {PageState(int(self.state[first])).name} of generation "
            f"{int(self.generation[first])}, expected {'/'.join(s.name for s in allowed)} of "
            f"generation {generation}",
            generation=generation,
            pages=in_range,
        )
