"""Per-request memory windows of the verbs transport: the NIC itself refuses a write outside the
pages a request holds, once the request's windows are invalidated (issue 17).

What this module owns:

* :func:`plan_windows`: which windows a request needs. One per buffer and per maximal run of
  consecutive page indices among its reserved pages; above ``max_runs`` runs (or more windows than
  one chain of binds may hold) one per buffer over the whole buffer, a *wide* grant: the region's
  reach, but still only through the request's own connection and only until the request ends.
* the verbs ``META.access`` blob: :func:`encode_access` (receiver) and :class:`WindowTable`
  (writer: the rkey each write run must use; a run outside every window is refused before it is
  posted, never sent with a guessed key).
* :class:`ReceiverWindows`: the receiver's pool of type-2 memory windows and the grants bound from
  it, one per request generation.

State machines::

    a window (one ibv_mw)   FREE --BIND_MW on the connection's QP, completed--> BOUND
                            BOUND --LOCAL_INV on that QP, completed--> FREE (back at the pool's tail)
                            BOUND --its QP fenced, or a window operation failed--> DEALLOCATED
    a grant (one request)   BOUND --revoke()--> REVOKED (invalidated) | DISPOSED (QP in error, windows deallocated)

Invariants:

* a grant's keys reach the writer (in META) only after its binds completed;
* :meth:`ReceiverWindows.revoke` returns only when no new write through the grant's windows can land
  (its invalidations completed, or its QP is in the error state and the windows are deallocated); the
  receiver calls it before it frees or reuses the request's pages;
* a window is rebound only after its invalidation completed, and the pool hands out the window freed
  longest ago and keeps ``reserve`` free windows behind it (allocating more while the device allows),
  so a freed window is rebound only after at least ``reserve`` others were, and its 8-bit key comes
  round again only after 256 such turns;
* a type-2 window holds its QP and MR: windows are deallocated before their QP is destroyed and
  before the memory regions are deregistered;
* every window operation runs under one lock, one chain at a time, and waits for its own signalled
  completion on the QP's send completion queue (which carries nothing else).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from ..core.checksum import page_runs as consecutive_runs
from ..errors import ProtocolError, TransportError

log = logging.getLogger("kvxfer.verbs")

# one window as META.access carries it: buffer, first page, pages, rkey (little-endian u32 each)
WINDOW_DTYPE = np.dtype([("buffer", "<u4"), ("first", "<u4"), ("pages", "<u4"), ("rkey", "<u4")])
MAX_WINDOWS = 1 << 15  # per request, on the wire (META.access holds at most 1 MiB)
ACCESS_REMOTE_WRITE = 1 << 1  # IBV_ACCESS_REMOTE_WRITE
WAIT_S = 5.0  # a bind or invalidate chain that does not complete within this is a broken QP


def page_runs(pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(first, count)`` of the maximal runs of consecutive indices among ``pages`` (any order)."""
    return consecutive_runs(np.unique(np.asarray(pages, dtype=np.int64)))


def plan_windows(pages: np.ndarray, *, num_buffers: int, num_pages: int, max_runs: int,
                 max_windows: int) -> tuple[np.ndarray, bool]:
    """The windows (rkey 0) a request over ``pages`` needs, buffer-major, and whether the grant is wide."""
    first, count = page_runs(pages)
    wide = len(first) > max_runs or len(first) * num_buffers > max_windows
    if wide:
        first = np.zeros(1, dtype=np.int64)
        count = np.full(1, num_pages, dtype=np.int64)
    records = np.zeros(num_buffers * len(first), dtype=WINDOW_DTYPE)
    records["buffer"] = np.repeat(np.arange(num_buffers), len(first))
    records["first"] = np.tile(first, num_buffers)
    records["pages"] = np.tile(count, num_buffers)
    return records, wide


def encode_access(epoch: int, records: np.ndarray) -> bytes:
    """The verbs ``META.access`` blob: the connection epoch the windows are bound on, and the windows."""
    return msgpack.packb({"v": 1, "epoch": int(epoch), "windows": records.astype(WINDOW_DTYPE).tobytes()},
                         use_bin_type=True)


def inc_rkey(rkey: int) -> int:
    """The next key of a memory window: same index (high 24 bits), key byte + 1 (libibverbs' ibv_inc_rkey)."""
    return (rkey & 0xFFFFFF00) | ((rkey + 1) & 0xFF)


class WindowTable:
    """The writer's view of one request's windows: which rkey each write run must carry."""

    def __init__(self, epoch: int, records: np.ndarray) -> None:
        self.epoch = epoch
        order = np.lexsort((records["first"], records["buffer"]))
        self.records = records[order]
        self._keys = (self.records["buffer"].astype(np.uint64) << np.uint64(32)) | self.records["first"].astype(np.uint64)

    @classmethod
    def decode(cls, blob: bytes, *, num_buffers: int, num_pages: int) -> WindowTable:
        """A ``META.access`` blob, checked field by field; ProtocolError naming the problem."""
        try:
            data = msgpack.unpackb(blob, raw=False)
        except Exception as exc:
            raise ProtocolError(f"verbs META access blob is not msgpack: {exc}") from None
        if not isinstance(data, dict) or data.get("v") != 1 or set(data) != {"v", "epoch", "windows"}:
            raise ProtocolError("verbs META access blob must be a map {v: 1, epoch, windows}")
        epoch, raw = data["epoch"], data["windows"]
        if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 < epoch < (1 << 64):
            raise ProtocolError("verbs META access blob: epoch missing or out of range")
        if not isinstance(raw, bytes) or not raw or len(raw) % WINDOW_DTYPE.itemsize:
            raise ProtocolError(f"verbs META access blob: windows must be {WINDOW_DTYPE.itemsize}-byte records")
        records = np.frombuffer(raw, dtype=WINDOW_DTYPE)
        if len(records) > MAX_WINDOWS:
            raise ProtocolError(f"verbs META access blob: {len(records)} windows exceed {MAX_WINDOWS}")
        end = records["first"].astype(np.int64) + records["pages"].astype(np.int64)
        if (records["buffer"] >= num_buffers).any() or (records["pages"] == 0).any() or (end > num_pages).any():
            raise ProtocolError(f"verbs META access blob: a window lies outside the layout's {num_buffers} "
                                f"buffers of {num_pages} pages")
        return cls(epoch, records.copy())

    def rkeys(self, buffers: np.ndarray, dst_offsets: np.ndarray, lengths: np.ndarray,
              item_lens: np.ndarray) -> np.ndarray:
        """The rkey of the window holding each run; ProtocolError if a run leaves every window."""
        buffers = np.asarray(buffers, dtype=np.int64)
        items = np.asarray(item_lens, dtype=np.int64)[buffers]
        first = np.asarray(dst_offsets, dtype=np.int64) // items
        last = (np.asarray(dst_offsets, dtype=np.int64) + np.asarray(lengths, dtype=np.int64) - 1) // items
        keys = (buffers.astype(np.uint64) << np.uint64(32)) | first.astype(np.uint64)
        at = np.searchsorted(self._keys, keys, side="right") - 1
        ok = at >= 0
        hit = self.records[np.maximum(at, 0)]
        ok &= (hit["buffer"] == buffers) & (hit["first"] <= first)
        ok &= last < hit["first"].astype(np.int64) + hit["pages"].astype(np.int64)
        if not ok.all():
            bad = int(np.flatnonzero(~ok)[0])
            raise ProtocolError(f"write to buffer {int(buffers[bad])} pages {int(first[bad])}..{int(last[bad])} "
                                f"lies outside every memory window the receiver granted")
        return hit["rkey"].astype(np.uint32)


@dataclass
class _Window:
    mw: Any  # the pyverbs MW
    ptr: int  # its ibv_mw pointer
    rkey: int  # its current key
    state: str = "free"  # free, bound, deallocated


@dataclass
class _Grant:
    gen: int
    endpoint: Any
    windows: list[_Window]
    wide: bool
    state: str = "bound"  # bound, revoked, disposed
    rkeys: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.uint32))


class ReceiverWindows:
    """The decode side's memory windows: a pool of type-2 windows, and one grant per request generation
    bound on the queue pair of the connection the request lives on (see the module's invariants).

    ``on_broken(endpoint, reason)`` is called (under no lock of the caller's) when a window operation
    failed: the QP is already in the error state and its windows deallocated; the receiver then fences
    the connection and reports it closed."""

    def __init__(self, device: Any, *, max_runs: int, max_windows: int, max_mw: int,
                 on_broken: Callable[[Any, str], None], reserve: int = 64) -> None:
        if max_runs < 1:
            raise ValueError("window_max_runs must be at least 1")
        self.device = device
        self.max_runs = max_runs
        self.max_windows = max_windows  # per grant: one chain of binds must fit the send queue
        self.max_mw = max_mw
        self.reserve = reserve
        self._on_broken = on_broken
        self._lock = threading.Lock()
        self._free: collections.deque[_Window] = collections.deque()
        self._grants: dict[int, _Grant] = {}
        self._mr_ptrs: np.ndarray | None = None
        self._bind_infos: list[Any] = []
        self._next_wr = 1
        self._closed = False
        self.allocated = 0
        self.counters: collections.Counter[str] = collections.Counter()
        self.bind_seconds = 0.0
        self.invalidate_seconds = 0.0

    # grants -----------------------------------------------------------------------------------------
    def grant(self, endpoint: Any, epoch: int, gen: int, pages: np.ndarray) -> bytes:
        """Bind windows over ``pages`` on ``endpoint`` for generation ``gen``; returns META's access blob
        once the binds completed. TransportError (nothing stays bound) if the QP cannot bind them."""
        layout = self.device.layout
        records, wide = plan_windows(pages, num_buffers=layout.num_buffers, num_pages=layout.num_pages,
                                     max_runs=self.max_runs, max_windows=self.max_windows)
        broken = ""
        with self._lock:
            if self._closed:
                raise TransportError(f"request generation {gen}: the receiver is closed")
            if gen in self._grants:
                raise TransportError(f"request generation {gen} already holds memory windows")
            if endpoint.state != "rts":
                raise TransportError(f"request generation {gen}: connection epoch {epoch} is {endpoint.state}")
            windows = self._take(len(records), endpoint)
            if windows is None and not wide:  # the pool is at the device's limit: one window per buffer
                records, wide = plan_windows(pages, num_buffers=layout.num_buffers, num_pages=layout.num_pages,
                                             max_runs=0, max_windows=0)
                windows = self._take(len(records), endpoint)
                self.counters["wide_for_pool"] += 1
            if windows is None:
                raise TransportError(f"request generation {gen}: no memory window free ({self.allocated} "
                                     f"allocated, the device allows {self.max_mw})")
            rkeys = np.array([inc_rkey(w.rkey) for w in windows], dtype=np.uint32)
            items = layout.item_lens[records["buffer"].astype(np.int64)].astype(np.uint64)
            addrs = self.device.buffer_addr[records["buffer"].astype(np.int64)] + records["first"].astype(np.uint64) * items
            lens = records["pages"].astype(np.uint64) * items
            mrs = self._mr_pointers(endpoint)[records["buffer"].astype(np.int64)]
            first = self._next_wr
            self._next_wr += len(windows)
            t0 = time.perf_counter()
            try:
                endpoint.post_binds(first, np.array([w.ptr for w in windows], dtype=np.uint64), rkeys, mrs,
                                    addrs, lens, ACCESS_REMOTE_WRITE)
                problem = endpoint.wait_send(first + len(windows) - 1, WAIT_S)
            except (OSError, TransportError) as exc:
                problem = str(exc)
            self.bind_seconds += time.perf_counter() - t0
            if problem:
                self._deallocate(windows)
                broken = self._break(endpoint, f"binding {len(windows)} memory windows for request generation "
                                               f"{gen} failed: {problem}")
            else:
                for w, key in zip(windows, rkeys):
                    w.rkey = int(key)
                    w.state = "bound"
                records["rkey"] = rkeys
                self._grants[gen] = _Grant(gen, endpoint, windows, wide, rkeys=rkeys)
                self.counters["granted"] += 1
                self.counters["windows_bound"] += len(windows)
                if wide:
                    self.counters["wide"] += 1
        if broken:
            self._on_broken(endpoint, broken)
            raise TransportError(broken)
        return encode_access(epoch, records)

    def revoke(self, gen: int) -> None:
        """No new write through ``gen``'s windows can land once this returns (see the invariants).
        Idempotent; a generation without windows is a no-op. Never raises for a device failure: the
        QP is moved to the error state instead, which stops every write on it."""
        broken = ""
        with self._lock:
            grant = self._grants.pop(gen, None)
            if grant is None or grant.state != "bound":
                return
            endpoint = grant.endpoint
            if endpoint.state != "rts":  # its QP already refuses everything: the windows go with it
                self._deallocate(grant.windows)
                grant.state = "disposed"
                self.counters["disposed"] += 1
                return
            first = self._next_wr
            self._next_wr += len(grant.windows)
            t0 = time.perf_counter()
            try:
                endpoint.post_invalidates(first, grant.rkeys)
                problem = endpoint.wait_send(first + len(grant.windows) - 1, WAIT_S)
            except (OSError, TransportError) as exc:
                problem = str(exc)
            self.invalidate_seconds += time.perf_counter() - t0
            if problem:
                self._deallocate(grant.windows)
                grant.state = "disposed"
                self.counters["disposed"] += 1
                broken = self._break(endpoint, f"invalidating the memory windows of request generation {gen} "
                                               f"failed: {problem}")
            else:
                for w in grant.windows:
                    w.state = "free"
                    self._free.append(w)
                grant.state = "revoked"
                self.counters["revoked"] += 1
                self.counters["windows_invalidated"] += len(grant.windows)
        if broken:
            self._on_broken(endpoint, broken)

    def dispose(self, endpoint: Any) -> int:
        """``endpoint``'s QP is in the error state (fenced) and about to be destroyed: deallocate the
        windows bound on it (a bound type-2 window holds its QP). Returns the grants disposed."""
        with self._lock:
            gone = [g for g in self._grants.values() if g.endpoint is endpoint]
            for grant in gone:
                del self._grants[grant.gen]
                self._deallocate(grant.windows)
                grant.state = "disposed"
            self.counters["disposed"] += len(gone)
            return len(gone)

    def holds(self, gen: int) -> bool:
        with self._lock:
            return gen in self._grants

    def stats(self) -> dict[str, Any]:
        with self._lock:
            granted = self.counters["granted"]
            revoked = self.counters["revoked"]
            return {
                "granted": granted,
                "wide": self.counters["wide"],
                "wide_for_pool": self.counters["wide_for_pool"],
                "revoked": revoked,
                "disposed": self.counters["disposed"],
                "bound_now": len(self._grants),
                "windows_bound": self.counters["windows_bound"],
                "windows_invalidated": self.counters["windows_invalidated"],
                "windows_allocated": self.allocated,
                "windows_free": len(self._free),
                "max_runs": self.max_runs,
                "bind_seconds": round(self.bind_seconds, 6),
                "invalidate_seconds": round(self.invalidate_seconds, 6),
                "bind_us_per_request": round(1e6 * self.bind_seconds / granted, 1) if granted else 0.0,
                "invalidate_us_per_request": round(1e6 * self.invalidate_seconds / revoked, 1) if revoked else 0.0,
            }

    def close(self) -> None:
        """Deallocate every window (the caller destroys the QPs and MRs afterwards). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for grant in self._grants.values():
                self._deallocate(grant.windows)
            self._grants.clear()
            self._deallocate(list(self._free))
            self._free.clear()
            for info in self._bind_infos:
                info.close()
            self._bind_infos.clear()

    # the pool (under the lock) --------------------------------------------------------------------------
    def _take(self, count: int, endpoint: Any) -> list[_Window] | None:
        """``count`` free windows, the longest-freed first; the pool allocates what it lacks, and up to
        ``reserve`` more while the device allows (freed windows wait that long before they are
        rebound). None when even ``count`` is past the device's limit."""
        missing = count - len(self._free)
        if missing > 0 and self.allocated + missing > self.max_mw:
            return None
        missing = max(missing, min(count + self.reserve - len(self._free), self.max_mw - self.allocated))
        if missing > 0:
            pv = self.device.pv
            context = endpoint.native_context()
            try:
                for _ in range(missing):
                    mw = pv.MW(self.device.pd, pv.enums.IBV_MW_TYPE_2)
                    ptr = endpoint.native.mw_handle(mw, mw.rkey, context)
                    self._free.append(_Window(mw, ptr, int(mw.rkey)))
                    self.allocated += 1
            except Exception as exc:  # ENOMEM from the device: serve what the pool holds
                log.warning("cannot allocate a memory window (%s): %d allocated", exc, self.allocated)
                self.max_mw = self.allocated
                if len(self._free) < count:
                    return None
        return [self._free.popleft() for _ in range(count)]

    def _deallocate(self, windows: list[_Window]) -> None:
        for w in windows:
            if w.state != "deallocated":
                try:
                    w.mw.close()
                except Exception as exc:  # pragma: no cover - the device is gone
                    log.warning("deallocating a memory window failed: %s", exc)
                w.state = "deallocated"
                self.allocated -= 1

    def _mr_pointers(self, endpoint: Any) -> np.ndarray:
        """Each buffer's ibv_mr pointer (bind work requests name the MR), read once through pyverbs."""
        if self._mr_ptrs is None:
            pv = self.device.pv
            context = endpoint.native_context()
            ptrs = []
            by_mr: dict[int, int] = {}
            for mr, spec in zip(self.device.buffer_mr, self.device.layout.buffers):
                if id(mr) not in by_mr:
                    info = pv.MWBindInfo(mr, int(spec.region.address), int(spec.region.nbytes), ACCESS_REMOTE_WRITE)
                    self._bind_infos.append(info)
                    by_mr[id(mr)] = endpoint.native.mr_handle(info, mr.lkey, context)
                ptrs.append(by_mr[id(mr)])
            self._mr_ptrs = np.array(ptrs, dtype=np.uint64)
        return self._mr_ptrs

    def _break(self, endpoint: Any, reason: str) -> str:
        """A window operation failed: the QP goes to the error state (nothing more lands through it)
        and every window bound on it is deallocated; the caller reports it (outside the lock)."""
        log.error("verbs: %s; the connection's queue pair goes to the error state", reason)
        try:
            endpoint.to_error()
        except Exception as exc:  # pragma: no cover - already destroyed
            log.warning("moving the queue pair to the error state failed: %s", exc)
        for grant in [g for g in self._grants.values() if g.endpoint is endpoint]:
            del self._grants[grant.gen]
            self._deallocate(grant.windows)
            grant.state = "disposed"
            self.counters["disposed"] += 1
        self.counters["broken"] += 1
        return reason


__all__ = ["MAX_WINDOWS", "WINDOW_DTYPE", "ReceiverWindows", "WindowTable", "encode_access", "inc_rkey",
           "page_runs", "plan_windows"]
