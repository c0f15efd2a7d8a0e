"""GPU memory support: CUDA regions, RDMA registration of GPU memory, GPU checksums and scrubbing.

Imported lazily, only when GPU memory is registered (``kvxfer.core.memory.as_region`` on a torch CUDA
tensor or a cupy array), so the CPU install never loads CUDA libraries. What it needs at run time:
the CUDA driver (``libcuda``) and cuda-python (``pip install 'kvxfer[gpu]'``); the kernels ship as
PTX that the driver compiles, so no CUDA toolkit is needed.

* :mod:`.region`: :class:`CudaRegion` and its RDMA registration (dma-buf, else nvidia-peermem);
* :mod:`.driver`: the driver API (contexts, streams, pinned memory, copies, dma-buf export, kernels);
* :mod:`.kernels`: per-item checksums and scrubbing on the GPU, and the host math they rely on.
"""

from __future__ import annotations

from typing import Any

from ...errors import ConfigError, GpuError


def gpu_region(obj: Any, *, name: str = "") -> Any:
    """A :class:`~kvxfer.core.gpu.region.CudaRegion` for a torch CUDA tensor or cupy array."""
    from .region import gpu_region as make

    return make(obj, name=name)


def require_gpu_scrubber() -> None:
    """Raise unless the zero/poison free policies can run on this machine's GPU."""
    from .driver import available

    ok, why = available()
    if not ok:
        raise GpuError(f"free policies zero/poison on GPU memory need the CUDA driver API: {why}")


def available() -> tuple[bool, str]:
    """Whether GPU memory can be used here, and why not."""
    try:
        from .driver import available as driver_available
    except ImportError as exc:  # pragma: no cover - numpy missing
        return False, str(exc)
    return driver_available()


__all__ = ["ConfigError", "GpuError", "available", "gpu_region", "require_gpu_scrubber"]
