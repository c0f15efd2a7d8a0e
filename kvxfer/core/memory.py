"""Memory regions: spans of memory an engine registers so that pages can be written into them.

A region owns (a reference to) the object that holds the memory, its base address and its length.
Host regions expose a writable ``uint8`` numpy view; that view is what the software transport
receives into and what checksums read. GPU regions (torch CUDA tensors, cupy arrays) plug in here
later with ``device == "cuda"``; nothing outside this module needs to know how a region was made.
The base class, :class:`~kvxfer.core.region.MemoryRegion` (re-exported here), lives in
:mod:`kvxfer.core.region` so that :mod:`kvxfer.core.gpu` builds on it without importing this module:
the dependency runs one way, memory -> gpu (lazily) -> region.

Invariants: a region never changes address or length after construction; its backing object stays
referenced for the region's lifetime; ``close()`` is idempotent and only drops references (a
transport that registered the region must unregister first, see ``transport``).
"""

from __future__ import annotations

import ctypes
import mmap
from typing import Any

import numpy as np

from ..errors import ConfigError
from .region import MemoryRegion


class HostRegion(MemoryRegion):
    """Host memory: numpy arrays, ``bytearray``, ``mmap``, writable memoryviews, CPU tensors."""

    device = "cpu"

    def __init__(self, array: np.ndarray, *, owner: Any, name: str = "") -> None:
        if array.dtype != np.uint8 or array.ndim != 1:
            raise ConfigError("HostRegion needs a flat uint8 array")
        if not array.flags.writeable:
            raise ConfigError(f"region {name!r} is read-only; kvxfer writes into regions")
        super().__init__(array.ctypes.data, array.nbytes, owner=owner, name=name)
        self.array = array

    def close(self) -> None:
        super().close()
        self.array = np.empty(0, dtype=np.uint8)

    def prefault(self) -> None:
        """Touch every OS page so the first transfer does not pay for page faults.

        Each touched byte is OR-ed with 0, a real store of the value already there (a plain
        self-assignment can be skipped by numpy), so contents are unchanged."""
        if self.nbytes == 0:
            return
        touched = self.array[:: mmap.PAGESIZE]
        np.bitwise_or(touched, 0, out=touched)

    @classmethod
    def from_pointer(cls, address: int, nbytes: int, *, name: str = "", owner: Any = None) -> HostRegion:
        """Wrap raw host memory (an engine's own allocation, as SGLang passes ``kv_data_ptrs``).

        The caller keeps the memory alive for the region's lifetime; pass ``owner`` to let the
        region hold a reference."""
        if address == 0:
            raise ConfigError(f"region {name!r}: null pointer")
        buf = (ctypes.c_uint8 * nbytes).from_address(address)
        array = np.ctypeslib.as_array(buf)
        return cls(array, owner=(owner, buf), name=name)


def _is_torch_tensor(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def _is_cupy_array(obj: Any) -> bool:
    return type(obj).__module__.startswith("cupy")


def as_region(obj: Any, *, name: str = "") -> MemoryRegion:
    """Make a region from a memory-holding object, without copying.

    Accepts numpy arrays (C-contiguous), ``bytearray``, ``mmap.mmap``, writable memoryviews,
    existing regions, and torch CPU tensors. GPU objects raise a clear error until GPU regions
    are supported by the running build."""
    if isinstance(obj, MemoryRegion):
        return obj
    if _is_torch_tensor(obj):
        device = str(getattr(obj, "device", "cpu"))
        if not device.startswith("cpu"):
            return _gpu_region(obj, name=name)
        if not obj.is_contiguous():
            raise ConfigError(f"region {name!r}: torch tensor is not contiguous")
        array = obj.detach().numpy().reshape(-1).view(np.uint8)
        return HostRegion(array, owner=obj, name=name)
    if _is_cupy_array(obj):
        return _gpu_region(obj, name=name)
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ConfigError(f"region {name!r}: numpy array is not C-contiguous")
        return HostRegion(obj.reshape(-1).view(np.uint8), owner=obj, name=name)
    if isinstance(obj, (bytearray, mmap.mmap, memoryview)):
        try:
            array = np.frombuffer(obj, dtype=np.uint8)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"region {name!r}: cannot view {type(obj).__name__}: {exc}") from exc
        if not array.flags.writeable:
            raise ConfigError(f"region {name!r}: {type(obj).__name__} is read-only")
        return HostRegion(array, owner=obj, name=name)
    if isinstance(obj, bytes):
        raise ConfigError(f"region {name!r}: bytes are immutable; use bytearray or numpy")
    raise ConfigError(f"region {name!r}: cannot register a {type(obj).__name__}")


def _gpu_region(obj: Any, *, name: str) -> MemoryRegion:
    try:
        from .gpu import gpu_region  # lazy: the CPU install never imports CUDA libraries
    except ImportError as exc:
        raise ConfigError(
            f"region {name!r}: GPU memory needs kvxfer's GPU support ({exc})"
        ) from exc
    return gpu_region(obj, name=name)


def region_at(address: int, nbytes: int, *, device: str = "auto", name: str = "") -> MemoryRegion:
    """A region over memory someone else allocated (an engine's KV buffers), host or GPU.

    With ``device="auto"`` the CUDA driver, when installed, says whether ``address`` is device
    memory; without one the memory is host memory."""
    if device == "auto":
        device = "cpu"
        try:
            from .gpu import available
            from .gpu.driver import pointer_device

            if available()[0]:
                pointer_device(address)
                device = "cuda"
        except ConfigError:  # not a device pointer (or no CUDA): host memory
            device = "cpu"
    if device == "cpu":
        return HostRegion.from_pointer(address, nbytes, name=name)
    if device == "cuda":
        from .gpu.region import CudaRegion

        return CudaRegion.from_pointer(address, nbytes, name=name)
    raise ConfigError(f"region {name!r}: unknown device {device!r} (cpu, cuda or auto)")


def allocate_host(nbytes: int, *, name: str = "", prefault: bool = True) -> HostRegion:
    """Allocate page-aligned anonymous host memory for a region (used by tools and tests)."""
    size = max(int(nbytes), 1)
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE") and size >= (2 << 20):
        try:  # fewer TLB misses when scattered pages are copied in and out (as numpy does for big arrays)
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    region = HostRegion(np.frombuffer(mm, dtype=np.uint8), owner=mm, name=name)
    if prefault:
        region.prefault()
    return region
