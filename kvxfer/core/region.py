"""The base of every memory region: what host (:mod:`kvxfer.core.memory`) and GPU
(:mod:`kvxfer.core.gpu.region`) regions share.

Kept apart from :mod:`kvxfer.core.memory` so that the GPU regions can subclass it while
:mod:`kvxfer.core.memory` reaches :mod:`kvxfer.core.gpu` lazily: both depend on this module, it
depends on neither, and there is no import cycle.

Invariants: a region never changes address or length after construction; its backing object stays
referenced until ``close()``; ``close()`` is idempotent and only drops references.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError


class MemoryRegion:
    """Base class of registered memory. Subclasses set ``device``, ``address``, ``nbytes``."""

    device: str = "cpu"

    def __init__(self, address: int, nbytes: int, *, owner: Any, name: str = "") -> None:
        if nbytes <= 0:
            raise ConfigError(f"region {name or hex(address)} is empty")
        self.address = int(address)
        self.nbytes = int(nbytes)
        self.name = name
        self._owner = owner
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        self._closed = True
        self._owner = None

    def __enter__(self) -> MemoryRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, device={self.device}, "
            f"address={self.address:#x}, nbytes={self.nbytes})"
        )
