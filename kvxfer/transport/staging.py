"""Staging buffers for the tcp transport when pages live where a socket cannot read or write them
(GPU memory): frames go through two pinned host buffers, and the copies overlap the socket I/O.

Sender: while frame k leaves from buffer A, frame k+1 is copied device-to-host into buffer B.
Receiver: frame k lands in buffer A from the socket and its runs are copied host-to-device
asynchronously while frame k+1 lands in buffer B; before a buffer is reused, and before an ORDERED
frame (DONE, DRAIN_ACK, ...) is handed on or the connection ends, every copy issued is waited for,
so the drain-proof rule of the transport still holds: when an ordered message is acted on, or a
fence returns, every earlier write is in the pages (or was refused), none is still in flight.

Item checksums are taken from the staged host bytes, in cache, exactly as for host pages.

Two copy engines share one interface: :class:`CudaCopy` (pinned memory, one CUDA stream) and
:class:`HostCopy` (``memmove``; host pages forced through the same pipeline, which is how the
pipeline is tested on machines without a GPU).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from ..errors import ConfigError, GpuError


class HostCopy:
    """Copies between host buffers with ``memmove`` (synchronous)."""

    def __init__(self) -> None:
        self._buffers: list[np.ndarray] = []

    def buffer(self, nbytes: int) -> np.ndarray:
        array = np.empty(nbytes, dtype=np.uint8)
        self._buffers.append(array)
        return array

    def gather(self, host: int, sources: np.ndarray, lengths: np.ndarray) -> None:
        for src, n in zip(sources.tolist(), lengths.tolist()):
            ctypes.memmove(host, src, n)
            host += n

    def scatter(self, destinations: np.ndarray, host: int, lengths: np.ndarray) -> None:
        for dst, n in zip(destinations.tolist(), lengths.tolist()):
            ctypes.memmove(dst, host, n)
            host += n

    def wait(self) -> None:
        pass

    def close(self) -> None:
        self._buffers.clear()


class CudaCopy:
    """Copies between pinned host buffers and device pages on one stream (asynchronous)."""

    def __init__(self, device: int) -> None:
        from ..gpu import driver

        self._driver = driver
        self.device = device
        self._stream: Any = None
        self._pinned: list[Any] = []

    def _bind(self) -> Any:
        """The stream, created (and the device's context made current) in the calling thread."""
        self._driver.use_device(self.device)
        if self._stream is None:
            self._stream = self._driver.Stream(self.device)
        return self._stream

    def buffer(self, nbytes: int) -> np.ndarray:
        pinned = self._driver.PinnedBuffer(nbytes, self.device)
        self._pinned.append(pinned)
        return pinned.array

    def gather(self, host: int, sources: np.ndarray, lengths: np.ndarray) -> None:
        stream = self._bind()
        for src, n in zip(sources.tolist(), lengths.tolist()):
            stream.to_host(host, src, n)
            host += n

    def scatter(self, destinations: np.ndarray, host: int, lengths: np.ndarray) -> None:
        stream = self._bind()
        for dst, n in zip(destinations.tolist(), lengths.tolist()):
            stream.to_device(dst, host, n)
            host += n

    def wait(self) -> None:
        if self._stream is not None:
            self._bind().synchronize()

    def close(self) -> None:
        if self._stream is not None:
            self._bind().synchronize()
            self._stream.close()
            self._stream = None
        for pinned in self._pinned:
            pinned.close()
        self._pinned.clear()


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
        from ..gpu import available

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
