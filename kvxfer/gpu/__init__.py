"""GPU memory support (CUDA regions, GPU checksums and scrubbing).

Imported lazily, only when GPU memory is registered, so the CPU install never loads CUDA libraries.
This build registers host memory only; GPU regions arrive with GPU support.
"""

from __future__ import annotations

from typing import Any

from .errors import ConfigError


def gpu_region(obj: Any, *, name: str = "") -> Any:
    raise ConfigError(
        f"region {name!r}: {type(obj).__module__}.{type(obj).__name__} lives in GPU memory, "
        "which this build of kvxfer cannot register yet"
    )


def require_gpu_scrubber() -> None:
    raise ConfigError("free policies zero/poison on GPU memory are not supported by this build")
