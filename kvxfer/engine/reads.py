"""Read leases: checked access to a readable request's pages that the free path respects.

:meth:`DecodeEngine.read` opens a :class:`KVRead`, a lease on one request generation. While any
lease on a request is open, ``release()`` and ``abort()`` do not free its pages: the request moves
to ``RELEASING`` and its pages are freed (and scrubbed, per the free policy) when the last lease
ends. Neither call blocks: the free happens on whichever thread ends the last lease, or on the
engine's control thread.

A lease ends when :meth:`KVRead.close` is called (or its ``with`` block exits, or the object is
garbage-collected) **and** every page view it handed out is gone. That is the invariant: no API
hands out memory that can outlive the ownership check that admitted it.

* :meth:`KVRead.buffer` copies the request's pages of one buffer; the copy runs under a hold, so a
  concurrent ``close()`` or ``release()`` cannot free the pages mid-copy.
* :meth:`KVRead.page` returns a read-only numpy view of one page (no copy). The view, and every
  array derived from it without copying, keeps the lease's custody alive: the pages stay held
  until the last such array is garbage-collected.

Engines that read decode pages on the GPU (SGLang's model forward) cannot be fenced by a Python
object; there the adapter holds the request until the engine frees it (see docs/sglang.md).

Locking: custody counts change only under the receiver's lock. A view's finalizer may run on any
thread at any moment (even inside kvxfer code holding the lock), so it only appends to a queue the
receiver drains on its control thread; it never takes a lock or touches the ledger.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np

from ..errors import NotReadable

if TYPE_CHECKING:
    from ..core.layout import KVLayout
    from .receiver import Receiver, ReceiveRequest


class LeaseState(str, enum.Enum):
    """Whether a :class:`KVRead` is open or closed; a closed lease's page views may still hold custody."""

    OPEN = "open"
    CLOSED = "closed"  # close() was called; views handed out may still hold custody


class KVRead:
    """A read lease on one readable request generation (use as a context manager)."""

    def __init__(self, receiver: Receiver, layout: KVLayout, req: ReceiveRequest) -> None:
        # The receiver already counted this lease (Receiver.open_lease) under its lock.
        self._receiver = receiver
        self._layout = layout
        self._req = req
        self.rid = req.rid
        self.generation = req.gen
        self.pages = req.pages.copy()
        self.pages.flags.writeable = False
        self.aux = req.aux
        self.state = LeaseState.OPEN
        self._finalizer = weakref.finalize(self, receiver.end_lease_later, req)

    # the lease ---------------------------------------------------------------------------------------
    def close(self) -> None:
        """End this lease (idempotent). Views it handed out keep custody until they are gone."""
        with self._receiver.lock:
            if self.state is LeaseState.CLOSED:
                return
            self.state = LeaseState.CLOSED
            self._finalizer.detach()
            self._receiver.end_lease(self._req)

    def __enter__(self) -> KVRead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _held(self) -> Iterator[None]:
        """Hold the pages for the duration of one access (the lease itself may be closed meanwhile
        by another thread)."""
        with self._receiver.lock:
            self._check()
            self._receiver.hold_lease(self._req)
        try:
            yield
        finally:
            self._receiver.end_lease(self._req)

    def _check(self) -> None:
        if self.state is LeaseState.CLOSED:
            raise NotReadable("this read lease is closed", rid=self.rid, generation=self.generation)
        self._receiver.check_ownership(self._req)

    # access ----------------------------------------------------------------------------------------
    def buffer(self, index: int) -> np.ndarray:
        """A copy of buffer ``index`` for the request's pages, shape ``(pages, item_len)``."""
        view = self._layout.views()[index]
        with self._held():
            return view[self.pages]

    def page(self, index: int, position: int) -> np.ndarray:
        """A read-only view (no copy) of the request's ``position``-th page in buffer ``index``.

        The pages stay held while the view, or any array derived from it, is alive."""
        flat = self._layout.flat_view(index)
        item = int(self._layout.item_lens[index])
        with self._receiver.lock:
            self._check()
            page = int(self.pages[position])
            # np.frombuffer keeps its own memoryview as the base of every array derived without a
            # copy; when that memoryview dies, the last view is gone and the hold ends.
            view = np.frombuffer(memoryview(flat)[page * item : (page + 1) * item].toreadonly(), dtype=np.uint8)
            self._receiver.hold_lease(self._req)
            weakref.finalize(view.base, self._receiver.end_lease_later, self._req)
        return view

    def __repr__(self) -> str:
        return (f"KVRead(rid={self.rid!r}, generation={self.generation}, pages={len(self.pages)}, "
                f"state={self.state.value})")

