"""One leg's bytes, piece by piece: head slices and unequal page sizes between a writer and a receiver.

A *leg* is one writer's share of a receiver's request: heads ``leg`` of every buffer, tokens
``0 .. covered - 1``. Its *atoms* are the largest pieces that are contiguous on both sides and lie
within one source page and one destination page; they depend only on the two geometries, the token
count and the page sizes (:class:`LegShape`), never on which pages were picked, so both roles
enumerate the same atoms in the same order (:class:`LegAtoms`):

* ``NHD`` (``[token][head][byte]``): a token's heads of the leg are contiguous; consecutive tokens
  are too when the leg is every head both sides hold, up to the nearer page boundary;
* ``HND`` (``[head][token][byte]``): a head's tokens are contiguous up to the nearer page boundary;
  consecutive heads are too when both pages are whole and the same size.

Every atom of a leg has the same length per buffer (``unit``). Canonical order, the order of a leg's
checksum: buffer by buffer, atoms by (first token, first head). A leg whose pages map one to one
with identical contents (:attr:`LegShape.whole`) keeps the page-for-page path of
:mod:`kvxfer.core.runs`; this module serves the others.

``covered`` is the tokens both page sizes hold whole: ``min(ceil(n/P)*P, ceil(n/Q)*Q)``; with equal
page sizes it is whole pages, as the page-for-page path writes them.

Writer: :func:`chunk_runs` turns a chunk of source pages into runs, adjacent atoms merged where both
sides continue. Receiver: :class:`SliceTable` accepts a write only if it is a run of whole, adjacent
atoms of the leg inside the reserved pages, records coverage per atom and buffer, and lists the
destination pieces in canonical order for the receiver's own checksum. Everything is vectorised: no
Python work per atom.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..errors import ConfigError
from .pagesets import total


def expand_runs(first: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenate ``range(first[i], first[i] + counts[i])`` for every i, vectorised."""
    if len(counts) == 1:  # one run (a one-page write, a contiguous one): no reduction needed
        n = int(counts[0])
        return np.arange(int(first[0]), int(first[0]) + n, dtype=np.int64) if n > 0 else np.empty(0, dtype=np.int64)
    size = total(counts)
    if size == 0:
        return np.empty(0, dtype=np.int64)
    starts = np.repeat(first, counts)
    run_base = np.repeat(np.cumsum(counts) - counts, counts)
    return starts + (np.arange(size, dtype=np.int64) - run_base)


def ceil_div(a: int, b: int) -> int:
    return -(-int(a) // int(b))


@dataclass(frozen=True)
class LegShape:
    """What fixes a leg's atoms: tokens, both page sizes, the heads each side holds (``(first, count)``),
    the heads the leg writes, and the in-page order (the same on both sides)."""

    tokens: int
    src_page: int
    dst_page: int
    src_heads: tuple[int, int]
    dst_heads: tuple[int, int]
    leg: tuple[int, int]
    order: str = "NHD"

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.src_page < 1 or self.dst_page < 1:
            raise ConfigError("a leg needs at least one token and positive page sizes")
        if max(self.src_page, self.dst_page) % min(self.src_page, self.dst_page):
            raise ConfigError(f"page sizes {self.src_page} and {self.dst_page}: neither is a multiple of the other")
        a, n = self.leg
        for name, (first, count) in (("writer", self.src_heads), ("receiver", self.dst_heads)):
            if n < 1 or a < first or a + n > first + count:
                raise ConfigError(f"leg heads {a}..{a + n - 1} are not all held by the {name} "
                                  f"({first}..{first + count - 1})")
        if self.order not in ("NHD", "HND"):
            raise ConfigError(f"unknown in-page order {self.order!r}")

    @property
    def covered(self) -> int:
        """Tokens the leg writes: what both page sizes hold whole."""
        return min(ceil_div(self.tokens, self.src_page) * self.src_page,
                   ceil_div(self.tokens, self.dst_page) * self.dst_page)

    @property
    def src_pages(self) -> int:
        return ceil_div(self.tokens, self.src_page)

    @property
    def dst_pages(self) -> int:
        return ceil_div(self.tokens, self.dst_page)

    @property
    def full_heads(self) -> bool:
        return self.leg == self.src_heads == self.dst_heads

    @property
    def whole(self) -> bool:
        """Page i of the writer's is page i of the receiver's, byte for byte (the page-for-page path)."""
        return self.src_page == self.dst_page and self.full_heads


class LegAtoms:
    """A leg's atoms in canonical order: per atom its first token, first head, source page (index in
    the request) and the offset in that page, destination page and offset, offsets in units of
    ``head_bytes`` (multiply by a buffer's head size for bytes); ``tokens_per`` x ``heads_per`` each."""

    def __init__(self, shape: LegShape) -> None:
        self.shape = shape
        P, Q = shape.src_page, shape.dst_page
        m = min(P, Q)
        covered = shape.covered
        a, n = shape.leg
        if shape.order == "NHD":
            self.heads_per = n
            if shape.full_heads:
                self.tokens_per = m
                t0 = np.arange(0, covered, m, dtype=np.int64)
            else:
                self.tokens_per = 1
                t0 = np.arange(covered, dtype=np.int64)
            h0 = np.full(t0.size, a, dtype=np.int64)
        elif P == Q:  # HND, whole pages: the leg's heads are one block of each page
            self.heads_per, self.tokens_per = n, P
            t0 = np.arange(0, covered, P, dtype=np.int64)
            h0 = np.full(t0.size, a, dtype=np.int64)
        else:  # HND, pages of different sizes: one head's run of tokens at a time
            self.heads_per, self.tokens_per = 1, m
            segments = np.arange(0, covered, m, dtype=np.int64)
            t0 = np.repeat(segments, n)
            h0 = np.tile(np.arange(a, a + n, dtype=np.int64), segments.size)
        self.t0, self.h0 = t0, h0
        self.src_page_index, s_tok = np.divmod(t0, P)
        self.dst_page_index, d_tok = np.divmod(t0, Q)
        s0, sc = shape.src_heads
        d0, dc = shape.dst_heads
        if shape.order == "NHD":
            self.src_rel = s_tok * sc + (h0 - s0)
            self.dst_rel = d_tok * dc + (h0 - d0)
        else:
            self.src_rel = (h0 - s0) * P + s_tok
            self.dst_rel = (h0 - d0) * Q + d_tok

    @property
    def count(self) -> int:
        return int(self.t0.size)

    @property
    def unit_heads(self) -> int:
        """An atom's size in head-token units (bytes: times a buffer's head size)."""
        return self.tokens_per * self.heads_per

    def chunk(self, first_page: int, end_page: int) -> slice:
        """The atoms whose source page index is in ``[first_page, end_page)`` (they are consecutive)."""
        lo = int(np.searchsorted(self.src_page_index, first_page, side="left"))
        hi = int(np.searchsorted(self.src_page_index, end_page, side="left"))
        return slice(lo, hi)


@dataclass
class LegRuns:
    """A chunk's runs for a transport: buffer-major, canonical order within, adjacent atoms merged
    where both sides continue; ``units`` is each run's atom length (runs are whole atoms)."""

    buffers: np.ndarray
    src_offsets: np.ndarray
    dst_offsets: np.ndarray
    lengths: np.ndarray
    units: np.ndarray

    def only(self, buffers: np.ndarray) -> LegRuns:
        """The runs of ``buffers`` only (a layer-wise send), in the same order."""
        keep = np.isin(self.buffers, buffers)
        return LegRuns(self.buffers[keep], self.src_offsets[keep], self.dst_offsets[keep], self.lengths[keep],
                       self.units[keep])


def chunk_runs(atoms: LegAtoms, first_page: int, src_ids: np.ndarray, dst_ids: np.ndarray,
               src_items: np.ndarray, dst_items: np.ndarray, head_bytes: np.ndarray) -> LegRuns:
    """Runs for source pages ``src_ids`` (request pages ``first_page ..``) into the destination pages
    ``dst_ids`` (all of the request's), offsets relative to each buffer's base."""
    src_ids = np.asarray(src_ids, dtype=np.int64)
    dst_ids = np.asarray(dst_ids, dtype=np.int64)
    part = atoms.chunk(first_page, first_page + src_ids.size)
    hb = np.asarray(head_bytes, dtype=np.int64)[:, None]
    src = src_ids[atoms.src_page_index[part] - first_page][None, :] * np.asarray(src_items, np.int64)[:, None] \
        + atoms.src_rel[part][None, :] * hb
    dst = dst_ids[atoms.dst_page_index[part]][None, :] * np.asarray(dst_items, np.int64)[:, None] \
        + atoms.dst_rel[part][None, :] * hb
    nb, k = src.shape
    unit = (atoms.unit_heads * hb).reshape(-1)
    src, dst = src.reshape(-1), dst.reshape(-1)
    buffers = np.repeat(np.arange(nb, dtype=np.int64), k)
    lengths = np.repeat(unit, k)
    if src.size == 0:
        empty = np.empty(0, dtype=np.int64)
        return LegRuns(empty, empty, empty, empty, empty)
    ends_s, ends_d = src + lengths, dst + lengths
    joins = (ends_s[:-1] == src[1:]) & (ends_d[:-1] == dst[1:]) & (buffers[:-1] == buffers[1:])
    starts = np.concatenate(([0], np.flatnonzero(~joins) + 1))
    return LegRuns(buffers=buffers[starts], src_offsets=src[starts], dst_offsets=dst[starts],
                   lengths=np.add.reduceat(lengths, starts), units=lengths[starts])


def canonical_pieces(atoms: LegAtoms, page_ids: np.ndarray, *, source: bool, bases: np.ndarray,
                     items: np.ndarray, head_bytes: np.ndarray,
                     src_pages: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Addresses and lengths of the leg's bytes on one side, in canonical order (adjacent pieces
    merged): what that side's checksum of the leg reads. ``page_ids``: the side's pages of the request;
    ``src_pages``: only the atoms of the first that many source pages (a writer that sent fewer, the
    legacy placeholder)."""
    page_ids = np.asarray(page_ids, dtype=np.int64)
    part = atoms.chunk(0, atoms.shape.src_pages if src_pages is None else src_pages)
    index = (atoms.src_page_index if source else atoms.dst_page_index)[part]
    rel = (atoms.src_rel if source else atoms.dst_rel)[part]
    hb = np.asarray(head_bytes, dtype=np.int64)[:, None]
    addr = (np.asarray(bases, dtype=np.int64)[:, None] + page_ids[index][None, :] * np.asarray(items, np.int64)[:, None]
            + rel[None, :] * hb).reshape(-1)
    lengths = np.repeat((atoms.unit_heads * hb).reshape(-1), index.size)
    if addr.size == 0:
        return addr, lengths
    joins = addr[:-1] + lengths[:-1] == addr[1:]
    starts = np.concatenate(([0], np.flatnonzero(~joins) + 1))
    return addr[starts], np.add.reduceat(lengths, starts)


class SliceTable:
    """The receiver's view of one leg over its reserved pages: which byte ranges of which buffer a
    write may cover (whole, adjacent atoms), and which atoms have landed, per buffer."""

    def __init__(self, atoms: LegAtoms, dst_pages: np.ndarray, items: np.ndarray, head_bytes: np.ndarray) -> None:
        self.atoms = atoms
        self.dst_pages = np.asarray(dst_pages, dtype=np.int64)
        if self.dst_pages.size != atoms.shape.dst_pages:
            raise ConfigError(f"{self.dst_pages.size} destination pages for a leg of {atoms.shape.tokens} tokens "
                              f"({atoms.shape.dst_pages} pages of {atoms.shape.dst_page})")
        self.items = np.asarray(items, dtype=np.int64)
        self.head_bytes = np.asarray(head_bytes, dtype=np.int64)
        self.units = atoms.unit_heads * self.head_bytes
        nb = self.items.size
        self.covered = np.zeros((nb, atoms.count), dtype=bool)
        self.duplicates = 0
        # buffers that share (item, head size) share every offset: one lookup table per class
        classes: dict[tuple[int, int], int] = {}
        self.class_of = np.array([classes.setdefault((int(i), int(h)), len(classes))
                                  for i, h in zip(self.items, self.head_bytes)], dtype=np.int64)
        self._tables = []
        for (item, hb) in classes:
            offsets = self.dst_pages[atoms.dst_page_index] * item + atoms.dst_rel * hb
            order = np.argsort(offsets, kind="stable")
            starts = offsets[order]
            ends = starts + atoms.unit_heads * hb
            gaps = np.concatenate(([0], np.cumsum(ends[:-1] != starts[1:])))
            self._tables.append((starts, ends, order, gaps))

    @cached_property
    def nbytes(self) -> int:
        return int(self.units.sum()) * self.atoms.count

    def locate(self, buffers: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """For runs (buffer, destination offset, length): the first and last atom (sorted positions) each
        covers, or None if some run is not whole, adjacent atoms of this leg."""
        first = np.empty(buffers.size, dtype=np.int64)
        last = np.empty(buffers.size, dtype=np.int64)
        classes = self.class_of[buffers]
        for c, (starts, ends, _order, gaps) in enumerate(self._tables):
            mine = np.flatnonzero(classes == c)
            if not mine.size:
                continue
            off = offsets[mine]
            end = off + lengths[mine]
            i = np.searchsorted(starts, off, side="left")
            j = np.searchsorted(ends, end, side="left")
            n = starts.size
            ok = (i < n) & (j < n)
            if not ok.all():
                return None
            ok = (starts[i] == off) & (ends[j] == end) & (j >= i) & (gaps[j] == gaps[i])
            if not ok.all():
                return None
            first[mine], last[mine] = i, j
        return first, last

    def record(self, buffers: np.ndarray, first: np.ndarray, last: np.ndarray) -> None:
        """Mark the atoms of located runs as landed in their buffers."""
        counts = last - first + 1
        sorted_pos = expand_runs(first, counts)
        run_buffers = np.repeat(buffers, counts)
        canonical = np.empty(sorted_pos.size, dtype=np.int64)
        classes = self.class_of[run_buffers]
        for c, (_s, _e, order, _g) in enumerate(self._tables):
            mine = classes == c
            canonical[mine] = order[sorted_pos[mine]]
        self.duplicates += int(np.count_nonzero(self.covered[run_buffers, canonical]))
        self.covered[run_buffers, canonical] = True

    def uncovered_pages(self) -> np.ndarray:
        """Destination pages some atom of which has not landed in some buffer."""
        missing = ~self.covered.all(axis=0)
        return np.unique(self.dst_pages[self.atoms.dst_page_index[missing]])

    def covered_atoms(self) -> int:
        return int(self.covered.sum())

    def pieces(self, bases: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Destination addresses and lengths of the leg in canonical order (the receiver's checksum)."""
        return canonical_pieces(self.atoms, self.dst_pages, source=False, bases=bases, items=self.items,
                                head_bytes=self.head_bytes)

    def full_pages(self) -> np.ndarray:
        """Destination pages every token of which the leg covers (a last page may be partly beyond)."""
        shape = self.atoms.shape
        whole = shape.covered // shape.dst_page
        return self.dst_pages[:whole]
