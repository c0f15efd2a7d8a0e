"""Staging buffers for the tcp transport when pages live where a socket cannot read or write them
(GPU memory): frames go through two pinned host buffers, and the copies overlap the socket I/O.

Sender: while frame k leaves from buffer A, frame k+1 is copied device-to-host into buffer B.
Receiver: frame k lands in buffer A from the socket and its runs are copied host-to-device
asynchronously while frame k+1 lands in buffer B; before a buffer is reused, and before an ORDERED
frame (DONE, DRAIN_ACK, ...) is handed on or the connection ends, every copy issued is waited for,
so the drain-proof rule of the transport still holds: when an ordered message is acted on, or a
fence returns, every earlier write is in the pages (or was refused), none is still in flight.

Item checksums are taken from the staged host bytes, in cache, exactly as for host pages.

Two copy engines share one interface: :class:`CudaCopy` (pinned memory, one CUDA stream, one
``copy_runs`` kernel launch per frame to pack or unpack its runs on the device) and
:class:`HostCopy` (``memmove``; host pages forced through the same pipeline, which is how the
pipeline is tested on machines without a GPU).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from ..errors import ConfigError, GpuError


def packed_offsets(lengths: np.ndarray) -> np.ndarray:
    """Where each run starts when runs of ``lengths`` lie back to back (in a staging buffer)."""
    lengths = np.asarray(lengths, dtype=np.uint64)
    starts = np.zeros(lengths.size, dtype=np.uint64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return starts


class HostCopy:
    """Copies between host buffers with ``memmove`` (synchronous), executing the same descriptor
    table (:func:`~kvxfer.core.gpu.kernels.split_runs`) that :class:`CudaCopy` hands its kernel."""

    def __init__(self) -> None:
        self._buffers: list[np.ndarray] = []

    def buffer(self, nbytes: int) -> np.ndarray:
        array = np.empty(nbytes, dtype=np.uint8)
        self._buffers.append(array)
        return array

    @staticmethod
    def _copy_runs(sources: np.ndarray, destinations: np.ndarray, lengths: np.ndarray) -> None:
        from ..core.gpu.kernels import split_runs  # host math only: no CUDA

        for src, dst, n in split_runs(sources, destinations, lengths).tolist():
            ctypes.memmove(dst, src, n)

    def gather(self, host: int, sources: np.ndarray, lengths: np.ndarray) -> None:
        self._copy_runs(sources, np.uint64(host) + packed_offsets(lengths), lengths)

    def scatter(self, destinations: np.ndarray, host: int, lengths: np.ndarray) -> None:
        self._copy_runs(np.uint64(host) + packed_offsets(lengths), destinations, lengths)

    def wait(self) -> None:
        pass

    def close(self) -> None:
        self._buffers.clear()


class _CudaSlot:
    """One staging buffer's resources: pinned host bytes, their device twin, and the copy_runs
    descriptor table (pinned on the host, copied to the device with each frame)."""

    def __init__(self, driver: Any, device: int, nbytes: int) -> None:
        from ..core.gpu.kernels import PIECE
        from ..wire.frames import MAX_RUNS

        self.capacity = MAX_RUNS + nbytes // PIECE + 1  # pieces of one frame, at most
        self._owned: list[Any] = []
        try:
            self.host = self._own(driver.PinnedBuffer(nbytes, device))
            self.device = self._own(driver.DeviceMemory(nbytes, device))
            self.table_host = self._own(driver.PinnedBuffer(self.capacity * 24, device))
            self.table_device = self._own(driver.DeviceMemory(self.capacity * 24, device))
        except BaseException:
            self.close()
            raise
        self.table = self.table_host.array.view(np.uint64).reshape(self.capacity, 3)

    def _own(self, resource: Any) -> Any:
        self._owned.append(resource)
        return resource

    def describe(self, sources: np.ndarray, destinations: np.ndarray, lengths: np.ndarray) -> int:
        """Write the descriptor table of these runs into the pinned table; returns its row count."""
        from ..core.gpu.kernels import split_runs

        table = split_runs(sources, destinations, lengths)
        if len(table) > self.capacity:
            raise GpuError(f"a frame of {len(lengths)} runs needs {len(table)} copy pieces "
                           f"(the staging table holds {self.capacity})")
        self.table[: len(table)] = table
        return len(table)

    def close(self) -> None:
        owned, self._owned = self._owned, []
        for resource in reversed(owned):
            resource.close()


class CudaCopy:
    """Copies between pinned host buffers and device pages on one stream (asynchronous).

    Per frame, whatever its number of runs: one host/device copy of the whole frame between the
    pinned buffer and its device twin, one copy of the descriptor table, and one ``copy_runs``
    kernel moving the runs between the twin and the pages (a copy call per run would cost more
    than the bytes when pages are small)."""

    def __init__(self, device: int) -> None:
        from ..core.gpu import driver

        self._driver = driver
        self.device = device
        self._stream: Any = None
        self._slots: dict[int, _CudaSlot] = {}

    def _bind(self) -> Any:
        """The stream, created (and the device's context made current) in the calling thread."""
        self._driver.use_device(self.device)
        if self._stream is None:
            self._stream = self._driver.Stream(self.device)
        return self._stream

    def buffer(self, nbytes: int) -> np.ndarray:
        slot = _CudaSlot(self._driver, self.device, nbytes)
        self._slots[int(slot.host.address)] = slot
        return slot.host.array

    def _copy_runs(self, stream: Any, slot: _CudaSlot, sources: np.ndarray, destinations: np.ndarray,
                   lengths: np.ndarray) -> None:
        from ..core.gpu.kernels import BLOCK

        pieces = slot.describe(sources, destinations, lengths)
        stream.to_device(slot.table_device.address, slot.table_host.address, pieces * 24)
        self._driver.launch(self.device, "copy_runs", pieces, BLOCK, stream,
                            [(slot.table_device.address, ctypes.c_void_p), (pieces, ctypes.c_int)])

    def gather(self, host: int, sources: np.ndarray, lengths: np.ndarray) -> None:
        stream, slot = self._bind(), self._slots[host]
        packed = np.uint64(slot.device.address) + packed_offsets(lengths)
        self._copy_runs(stream, slot, sources, packed, lengths)
        stream.to_host(host, slot.device.address, int(lengths.sum()))

    def scatter(self, destinations: np.ndarray, host: int, lengths: np.ndarray) -> None:
        stream, slot = self._bind(), self._slots[host]
        stream.to_device(slot.device.address, host, int(lengths.sum()))
        packed = np.uint64(slot.device.address) + packed_offsets(lengths)
        self._copy_runs(stream, slot, packed, destinations, lengths)

    def wait(self) -> None:
        if self._stream is not None:
            self._bind().synchronize()

    def close(self) -> None:
        if self._stream is not None:
            self._bind().synchronize()
            self._stream.close()
            self._stream = None
        slots, self._slots = self._slots, {}
        for slot in slots.values():
            slot.close()


def copy_engine(layout: Any, forced: str | None = None) -> Any:
    """The copy engine a tcp endpoint needs for ``layout``: None for host pages (zero copy)."""
    if forced == "host":
        return HostCopy()
    if forced not in (None, ""):
        raise ConfigError(f"unknown tcp staging {forced!r} (only 'host' can be forced)")
    if layout.device == "cpu":
        return None
    if layout.device == "cuda":
        devices = {getattr(spec.region, "device_index", None) for spec in layout.buffers}
        if len(devices) != 1:
            raise ConfigError("the tcp transport stages GPU pages of one device per engine; the layout spans "
                              f"{sorted(devices)}")
        from ..core.gpu import available

        ok, why = available()
        if not ok:
            raise GpuError(f"the tcp transport cannot stage GPU pages here: {why}")
        return CudaCopy(devices.pop())
    raise ConfigError(f"the tcp transport cannot move {layout.device} pages")


class Staging:
    """Two staging buffers used in turn, each ``capacity`` bytes, over a copy engine."""

    def __init__(self, engine: Any, capacity: int) -> None:
        self.engine = engine
        self.capacity = capacity
        self._buffers: list[np.ndarray] = []
        self._turn = 0
        self._pending = [False, False]  # copies issued from/to this buffer and not yet waited for

    def take(self) -> tuple[np.ndarray, int]:
        """The next buffer (waiting first for copies still using it) and its address."""
        if not self._buffers:
            self._buffers = [self.engine.buffer(self.capacity), self.engine.buffer(self.capacity)]
        index = self._turn
        self._turn ^= 1
        if self._pending[index]:
            self.engine.wait()
            self._pending = [False, False]
        buffer = self._buffers[index]
        self._last = index
        return buffer, int(buffer.ctypes.data)

    def mark_pending(self) -> None:
        self._pending[self._last] = True

    def drain(self) -> None:
        """Wait for every copy issued so far."""
        if any(self._pending):
            self.engine.wait()
            self._pending = [False, False]

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self.engine.close()
            self._buffers = []
