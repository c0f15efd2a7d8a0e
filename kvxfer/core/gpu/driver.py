"""The CUDA driver API, through cuda-python, as kvxfer uses it.

Owns: the lazy import of the bindings, error checking (every failing call raises
:class:`~kvxfer.errors.GpuError` naming the call and CUDA's error name), the primary context of a
device made current in whichever thread calls, pinned host buffers, streams, asynchronous copies,
dma-buf export and the kernel module loaded from the shipped PTX.

Nothing here is imported by the CPU path: :mod:`kvxfer.core.memory` reaches it only for GPU objects.
Invariants: resources are context managers with idempotent ``close()``; a pointer handed out by
:class:`PinnedBuffer` lives exactly as long as the object.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import GpuError

PTX_PATH = Path(__file__).with_name("kvxfer_gpu.ptx")


@functools.lru_cache(maxsize=1)
def cuda() -> Any:
    """The driver bindings module (cuda-python 12.6+: ``cuda.bindings.driver``; older: ``cuda.cuda``)."""
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # type: ignore[no-redef]
        except ImportError as exc:
            raise GpuError("GPU memory needs cuda-python (pip install 'kvxfer[gpu]'): "
                           f"the CUDA driver API is not importable ({exc})") from exc
    try:
        status = driver.cuInit(0)
    except Exception as exc:  # no libcuda: the bindings raise their own library-not-found errors
        raise GpuError(f"the CUDA driver library cannot be loaded: {exc}") from exc
    check(status, "cuInit")
    return driver


def check(result: Any, what: str) -> Any:
    """Unpack a cuda-python result tuple; raise GpuError on a CUDA error."""
    if isinstance(result, tuple):
        status, *values = result
    else:
        status, values = result, []
    if int(status) != 0:
        raise GpuError(f"{what} failed: {error_name(status)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def error_name(status: Any) -> str:
    try:
        driver = cuda()
        err, name = driver.cuGetErrorName(status)
        return name.decode() if int(err) == 0 else str(status)
    except Exception:  # pragma: no cover - reporting must never fail
        return str(status)


def available() -> tuple[bool, str]:
    """Whether a CUDA device can be used here, and why not."""
    try:
        driver = cuda()
        count = check(driver.cuDeviceGetCount(), "cuDeviceGetCount")
    except GpuError as exc:
        return False, str(exc)
    if not count:
        return False, "no CUDA device"
    return True, f"{count} CUDA device(s)"


_contexts: dict[int, Any] = {}
_contexts_lock = threading.Lock()


def use_device(ordinal: int) -> Any:
    """Make ``ordinal``'s primary context (the one torch and cupy use) current in this thread."""
    driver = cuda()
    with _contexts_lock:
        ctx = _contexts.get(ordinal)
        if ctx is None:
            device = check(driver.cuDeviceGet(ordinal), "cuDeviceGet")
            ctx = check(driver.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
            _contexts[ordinal] = ctx
    check(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return ctx


def pointer_device(address: int) -> int:
    """The device ordinal owning device pointer ``address``."""
    driver = cuda()
    attribute = driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    return int(check(driver.cuPointerGetAttribute(attribute, address), "cuPointerGetAttribute"))


# dma-buf -------------------------------------------------------------------------------------------


@dataclass
class DmaBufExport:
    """A dma-buf file descriptor for the allocation holding a device range."""

    fd: int
    base: int  # the allocation's device address (the dma-buf's byte 0)
    size: int
    offset: int  # where the requested range starts inside the dma-buf
    _closed: bool = False

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self.fd)

    def __enter__(self) -> DmaBufExport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def export_dmabuf(address: int, nbytes: int) -> DmaBufExport:
    """Export the allocation containing ``[address, address + nbytes)`` as a dma-buf.

    The torch caching allocator (and cupy's pool) packs tensors into larger allocations, and the
    driver exports whole allocations, so this exports the allocation's range
    (``cuMemGetAddressRange``) and reports the tensor's offset inside it."""
    driver = cuda()
    base, size = check(driver.cuMemGetAddressRange(address), "cuMemGetAddressRange")
    base, size = int(base), int(size)
    if address + nbytes > base + size:
        raise GpuError(f"range {address:#x}+{nbytes} runs past its allocation {base:#x}+{size}")
    # The driver wants a host-page-aligned range; allocations start on one and are backed in whole
    # GPU pages (>= 64 KiB), so rounding the length up stays inside the backing (NCCL does the same).
    page = os.sysconf("SC_PAGESIZE")
    if base % page:
        raise GpuError(f"allocation {base:#x} is not aligned to the host page size {page}: no dma-buf export")
    span = -(-size // page) * page
    handle_type = driver.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
    fd = check(driver.cuMemGetHandleForAddressRange(base, span, handle_type, 0),
               f"cuMemGetHandleForAddressRange({base:#x}, {span}, DMA_BUF_FD)")
    return DmaBufExport(fd=int(fd), base=base, size=span, offset=address - base)


def sync_memops(address: int) -> None:
    """Make synchronous CUDA copies on ``address``'s allocation complete before they return, as
    GPUDirect RDMA needs (``CU_POINTER_ATTRIBUTE_SYNC_MEMOPS``): an RDMA read or write that follows a
    ``cudaMemcpy`` then sees its bytes."""
    driver = cuda()
    attribute = driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_SYNC_MEMOPS
    check(driver.cuPointerSetAttribute(1, attribute, address), "cuPointerSetAttribute(SYNC_MEMOPS)")


# host memory, streams, copies -----------------------------------------------------------------------


class PinnedBuffer:
    """Page-locked host memory (``cuMemHostAlloc``) the GPU copies to and from asynchronously."""

    def __init__(self, nbytes: int, device: int) -> None:
        use_device(device)
        self.nbytes = int(nbytes)
        self.address = int(check(cuda().cuMemHostAlloc(self.nbytes, 0), "cuMemHostAlloc"))
        raw = (ctypes.c_uint8 * self.nbytes).from_address(self.address)
        self.array = np.ctypeslib.as_array(raw)
        self._closed = False

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.array = np.empty(0, dtype=np.uint8)
            check(cuda().cuMemFreeHost(self.address), "cuMemFreeHost")

    def __enter__(self) -> PinnedBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Stream:
    """A CUDA stream on a device, for one thread's copies and kernels."""

    def __init__(self, device: int) -> None:
        self.device = device
        use_device(device)
        flags = cuda().CUstream_flags.CU_STREAM_NON_BLOCKING
        self.handle = check(cuda().cuStreamCreate(flags), "cuStreamCreate")
        self._closed = False

    def to_host(self, host: int, device: int, nbytes: int) -> None:
        check(cuda().cuMemcpyDtoHAsync(host, device, nbytes, self.handle), "cuMemcpyDtoHAsync")

    def to_device(self, device: int, host: int, nbytes: int) -> None:
        check(cuda().cuMemcpyHtoDAsync(device, host, nbytes, self.handle), "cuMemcpyHtoDAsync")

    def synchronize(self) -> None:
        check(cuda().cuStreamSynchronize(self.handle), "cuStreamSynchronize")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            use_device(self.device)
            check(cuda().cuStreamDestroy(self.handle), "cuStreamDestroy")

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DeviceMemory:
    """An uninitialised device allocation of ``nbytes`` (staging buffers)."""

    def __init__(self, nbytes: int, device: int) -> None:
        use_device(device)
        self.nbytes = max(int(nbytes), 1)
        self.address = int(check(cuda().cuMemAlloc(self.nbytes), f"cuMemAlloc({self.nbytes})"))
        self._closed = False

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            check(cuda().cuMemFree(self.address), "cuMemFree")

    def __enter__(self) -> DeviceMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DeviceArray(DeviceMemory):
    """A small device allocation holding a copy of ``data`` (kernel arguments: page lists, bases, results)."""

    def __init__(self, data: np.ndarray, device: int, stream: Stream) -> None:
        self.data = np.ascontiguousarray(data)
        super().__init__(self.data.nbytes, device)
        if self.data.nbytes:
            stream.to_device(self.address, self.data.ctypes.data, self.data.nbytes)

    def fetch(self, stream: Stream) -> np.ndarray:
        out = np.empty_like(self.data)
        stream.to_host(out.ctypes.data, self.address, out.nbytes)
        stream.synchronize()
        return out


# kernels ---------------------------------------------------------------------------------------------

_modules: dict[int, Any] = {}


def kernel(device: int, name: str) -> Any:
    """A kernel from the shipped PTX, loaded (JIT-compiled by the driver) once per device."""
    use_device(device)
    module = _modules.get(device)
    if module is None:
        image = np.frombuffer(PTX_PATH.read_bytes() + b"\0", dtype=np.uint8)  # NUL-terminated PTX text
        module = check(cuda().cuModuleLoadData(image.ctypes.data), "cuModuleLoadData (JIT of kvxfer_gpu.ptx)")
        _modules[device] = module
    return check(cuda().cuModuleGetFunction(module, name.encode()), f"cuModuleGetFunction({name})")


def launch(device: int, name: str, grid: int, block: int, stream: Stream, args: list[tuple[Any, Any]]) -> None:
    """Launch ``name`` with ``args`` as ``(value, ctypes type)`` pairs."""
    function = kernel(device, name)
    values = tuple(value for value, _ in args)
    types = tuple(kind for _, kind in args)
    check(cuda().cuLaunchKernel(function, grid, 1, 1, block, 1, 1, 0, stream.handle, (values, types), 0),
          f"cuLaunchKernel({name})")
