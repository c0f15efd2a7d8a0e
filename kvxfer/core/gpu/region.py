"""GPU memory regions: torch CUDA tensors, cupy arrays, or raw device pointers an engine owns.

A :class:`CudaRegion` records the device pointer, size and device ordinal, and keeps the owning
object alive. For RDMA it registers itself (:meth:`CudaRegion.register_verbs`): first through a
dma-buf exported from the CUDA allocation (no kernel module needed beyond dma-buf support), else
as a plain MR on the device pointer (works only with nvidia-peermem loaded); if neither works the
error names both attempts.

Invariant: a region never outlives its owner (it holds a reference); ``close()`` is idempotent.
"""

from __future__ import annotations

import logging
from typing import Any

from ...errors import ConfigError, GpuError
from ..region import MemoryRegion

log = logging.getLogger("kvxfer.gpu")


class CudaRegion(MemoryRegion):
    """A span of CUDA device memory on device ``device_index``: pointer, size and the owning object.

    Holds its owner (tensor, cupy array or ``None`` for a caller-owned pointer) until ``close()``."""

    device = "cuda"

    def __init__(self, address: int, nbytes: int, *, device_index: int, owner: Any, name: str = "") -> None:
        if address == 0:
            raise ConfigError(f"region {name!r}: null device pointer")
        super().__init__(address, nbytes, owner=owner, name=name)
        self.device_index = int(device_index)

    def __repr__(self) -> str:
        return (f"CudaRegion(name={self.name!r}, device=cuda:{self.device_index}, address={self.address:#x}, "
                f"nbytes={self.nbytes})")

    # construction -------------------------------------------------------------------------------------
    @classmethod
    def from_torch(cls, tensor: Any, *, name: str = "") -> CudaRegion:
        if not tensor.is_cuda:
            raise ConfigError(f"region {name!r}: tensor is on {tensor.device}, not a CUDA device")
        if not tensor.is_contiguous():
            raise ConfigError(f"region {name!r}: CUDA tensor is not contiguous")
        nbytes = tensor.numel() * tensor.element_size()
        return cls(tensor.data_ptr(), nbytes, device_index=tensor.device.index or 0, owner=tensor, name=name)

    @classmethod
    def from_cupy(cls, array: Any, *, name: str = "") -> CudaRegion:
        if not array.flags.c_contiguous:
            raise ConfigError(f"region {name!r}: cupy array is not C-contiguous")
        return cls(int(array.data.ptr), int(array.nbytes), device_index=int(array.device.id), owner=array, name=name)

    @classmethod
    def from_pointer(cls, address: int, nbytes: int, *, device_index: int | None = None, name: str = "",
                     owner: Any = None) -> CudaRegion:
        """A device allocation the caller owns (SGLang passes ``kv_data_ptrs``); it must outlive the region."""
        if device_index is None:
            from .driver import pointer_device

            device_index = pointer_device(address)
        return cls(address, nbytes, device_index=device_index, owner=owner, name=name)

    # RDMA registration ----------------------------------------------------------------------------------
    def register_verbs(self, device: Any, access: int) -> Any:
        """Register with a pyverbs device; returns a :class:`VerbsRegistration`."""
        from .driver import export_dmabuf, sync_memops

        try:
            sync_memops(self.address)
        except GpuError as exc:
            log.warning("%s: %s; RDMA may observe a synchronous cudaMemcpy late", self.name, exc)
        attempts = []
        try:
            with export_dmabuf(self.address, self.nbytes) as export:
                from pyverbs.mr import DmaBufMR

                # ibv_reg_dmabuf_mr(pd, offset, length, iova=offset, fd): the MR addresses its bytes
                # by dma-buf offset, so byte 0 of this region is at iova ``export.offset``.
                mr = DmaBufMR(device.pd, self.nbytes, access, dmabuf=export.fd, offset=export.offset)
                log.info("%s: registered through dma-buf (allocation %#x+%d, offset %d)", self.name,
                         export.base, export.size, export.offset)
                return VerbsRegistration(mr, iova=export.offset, path="dma-buf")
        except Exception as exc:  # pyverbs raises PyverbsRDMAError/PyverbsError; CUDA raises GpuError
            attempts.append(f"dma-buf: {exc}")
        try:
            mr = device.pv.MR(device.pd, self.nbytes, access, address=self.address)
            log.info("%s: registered as a plain MR on the device pointer (nvidia-peermem)", self.name)
            return VerbsRegistration(mr, iova=self.address, path="peermem")
        except Exception as exc:
            attempts.append(f"plain MR on the device pointer (needs nvidia-peermem): {exc}")
        raise GpuError(f"region {self.name!r} (cuda:{self.device_index}, {self.nbytes} bytes) cannot be registered "
                       f"for RDMA: {'; '.join(attempts)}")


class VerbsRegistration:
    """A memory registration with the address (iova) its byte 0 has in work requests."""

    def __init__(self, mr: Any, *, iova: int, path: str) -> None:
        self.mr = mr
        self.iova = int(iova)
        self.path = path
        self.lkey = mr.lkey
        self.rkey = mr.rkey

    def close(self) -> None:
        self.mr.close()


def gpu_region(obj: Any, *, name: str = "") -> CudaRegion:
    """A region for a GPU object (torch CUDA tensor or cupy array)."""
    module = type(obj).__module__
    if module.startswith("torch"):
        return CudaRegion.from_torch(obj, name=name)
    if module.startswith("cupy"):
        return CudaRegion.from_cupy(obj, name=name)
    raise ConfigError(f"region {name!r}: {module}.{type(obj).__name__} is not GPU memory kvxfer knows")
