"""EngineConfig: every setting of both roles, validated in one place."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from ..core.checksum import ChecksumAlgo
from ..errors import ConfigError

log = logging.getLogger("kvxfer.engine")

TRANSPORTS = ("tcp", "verbs")


@dataclass
class EngineConfig:
    """Settings shared by both roles. Times are seconds."""

    max_context: int
    alloc_policy: str = "lifo"
    free_policy: str = "keep"
    checksum: str = "adler32"
    transport: str = "tcp"
    host: str = "127.0.0.1"
    control_port: int = 0
    data_port: int = 0
    allow_undersized_pool: bool = False
    max_inflight: int = 4096
    transfer_timeout: float = 60.0
    drain_timeout: float = 10.0
    meta_timeout: float = 60.0
    heartbeat_interval: float = 1.0
    peer_timeout: float = 15.0
    seed: int | None = None
    engine_id: str | None = None
    unsafe_legacy: bool = False
    ib_device: str | None = None
    ib_port: int = 1
    gid_index: int | None = None
    keyring: Any = None  # a kvxfer.wire.auth.Keyring or a keyring directory: authenticated control plane
    metrics_port: int | None = None  # serve Prometheus metrics here (0: any free port); None: off
    metrics_host: str | None = None  # default: ``host``
    max_pending_meta: int = 4096  # prefill: destinations held for requests not admitted yet, per peer
    # extra["tcp_staging"] = "host": send and land host pages through the staging buffers GPU pages
    # use (tests and diagnostics of that pipeline on machines without a GPU)
    extra: dict[str, Any] = field(default_factory=dict)

    def load_keyring(self) -> Any:
        """The :class:`~kvxfer.wire.auth.Keyring` to use, or None for an unauthenticated control plane."""
        if self.keyring is None or self.keyring == "":
            return None
        from ..wire.auth import Keyring

        return self.keyring if isinstance(self.keyring, Keyring) else Keyring.load(self.keyring)

    def verbs_options(self) -> Any:
        from ..transport.verbs import VerbsOptions

        return VerbsOptions.from_config({"ib_device": self.ib_device, "ib_port": self.ib_port,
                                         "gid_index": self.gid_index})

    def validate(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"unknown transport {self.transport!r} (available: {', '.join(TRANSPORTS)})")
        ChecksumAlgo.parse(self.checksum)
        for name in ("transfer_timeout", "drain_timeout", "meta_timeout", "heartbeat_interval", "peer_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port {self.metrics_port} is not a TCP port")
        if self.max_pending_meta <= 0:
            raise ConfigError("max_pending_meta must be positive")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


