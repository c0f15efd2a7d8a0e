"""The stress workload: prompt lengths, fault plans and their settings.

Prompt lengths are log-normal around a configurable median (long-context traffic has a heavy right
tail). Each request draws its own plan of request-level faults (aborts at each phase, client
disconnects, an oversized prompt in the unsafe band, killing the writer process); link-level faults
(flipped bytes, duplicated and late writes, slow frames) are per-frame rates handed to the writer's
transport. Everything derives from ``seed``, so a failing run can be replayed.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ...errors import ConfigError

REQUEST_FAULTS = (
    "abort_before_bootstrap",
    "abort_mid_transfer",
    "abort_after_done",
    "client_disconnect",
    "oversized",
    "kill_sender",
)
LINK_FAULTS = ("late_write", "duplicate_write", "flip_byte", "slow_link")
ALL_FAULTS = REQUEST_FAULTS + LINK_FAULTS
_LINK_RATE_NAMES = {
    "late_write": "late_rate",
    "duplicate_write": "duplicate_rate",
    "flip_byte": "flip_rate",
    "slow_link": "slow_rate",
}


@dataclass
class StressConfig:
    """A stress run's parameters; checked on construction (known faults, rates in [0, 1], a way to stop)."""

    transport: str = "tcp"
    requests: int | None = 200
    duration: float | None = None
    concurrency: int = 16
    median_tokens: int = 1500
    sigma: float = 1.0
    page_size: int = 16
    layers: int = 2
    item_len: int = 1024
    prefill_pages: int = 2048
    decode_pages: int = 8192
    context: int | None = None
    alloc_policy: str = "lifo"
    free_policy: str = "keep"
    checksum: str = "adler32"
    seed: int = 0
    max_chunks: int = 4
    unsafe_legacy: bool = False
    drain_timeout: float = 2.0
    transfer_timeout: float = 30.0
    settle_timeout: float = 60.0
    transport_options: dict[str, Any] = field(default_factory=dict)  # EngineConfig.transport_options
    faults: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.faults) - set(ALL_FAULTS)
        if unknown:
            raise ConfigError(f"unknown fault types {sorted(unknown)} (known: {', '.join(ALL_FAULTS)})")
        for name, rate in self.faults.items():
            if not 0.0 <= rate <= 1.0:
                raise ConfigError(f"fault rate {name}={rate} outside [0, 1]")
        if self.requests is None and self.duration is None:
            raise ConfigError("give --requests, --duration or both: the workload must stop by itself")
        if self.concurrency < 1:
            raise ConfigError("concurrency must be at least 1")
        if self.item_len % 8 or self.item_len < 32:
            raise ConfigError("item_len must be a multiple of 8 bytes, at least 32")
        if self.prefill_pages < 1 or self.decode_pages < 1:
            raise ConfigError("pools need at least one page")

    @property
    def buffers(self) -> int:
        return 2 * self.layers  # K and V per layer

    @property
    def max_context(self) -> int:
        return self.context or self.decode_pages * self.page_size

    @property
    def prefill_tokens(self) -> int:
        return self.prefill_pages * self.page_size

    @property
    def unsafe_band(self) -> tuple[int, int] | None:
        """Prompt lengths that pass the context check but cannot fit the prefill pool."""
        low, high = self.prefill_tokens + 1, min(self.max_context, self.decode_pages * self.page_size)
        return (low, high) if low <= high else None

    def link_faults(self) -> dict[str, float]:
        return {_LINK_RATE_NAMES[name]: self.faults.get(name, 0.0) for name in LINK_FAULTS}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RequestPlan:
    """One request as the workload drew it: id, prompt tokens, the fault it carries (at most one), chunks."""

    rid: str
    tokens: int
    faults: set[str]
    chunks: int
    decode_first: bool = False
    disconnect_at: int = 0  # client_disconnect: 0 after prefill admission, 1 after decode's, 2 mid-transfer


class Workload:
    """Draws request plans from a :class:`StressConfig`, deterministically for a given seed."""

    def __init__(self, config: StressConfig) -> None:
        self.config = config
        self._rng = random.Random(config.seed)
        self._np = np.random.default_rng(config.seed)
        self._count = 0

    def next(self) -> RequestPlan:
        cfg = self.config
        self._count += 1
        # At most one request-level fault per request, each drawn with exactly its configured rate
        # (a categorical draw; rates are scaled down only if they add up to more than 1).
        rates = [(name, cfg.faults.get(name, 0.0)) for name in REQUEST_FAULTS]
        if cfg.unsafe_band is None:
            rates = [(n, r) for n, r in rates if n != "oversized"]
        total = sum(r for _, r in rates)
        scale = 1.0 / total if total > 1.0 else 1.0
        draw = self._rng.random()
        faults: set[str] = set()
        cumulative = 0.0
        for name, rate in rates:
            cumulative += rate * scale
            if draw < cumulative:
                faults = {name}
                break
        band = cfg.unsafe_band
        if "oversized" in faults:
            assert band is not None
            # Stay in the lower part of the band so a legacy (unsafe) decode can still reserve it.
            high = min(band[1], band[0] + max(1, (band[1] - band[0]) // 4))
            tokens = self._rng.randint(band[0], high)
        else:
            limit = min(cfg.prefill_tokens, cfg.max_context) // 2
            tokens = int(self._np.lognormal(np.log(cfg.median_tokens), cfg.sigma))
            tokens = max(1, min(tokens, limit))
        chunks = self._rng.randint(1, max(1, cfg.max_chunks))
        return RequestPlan(
            rid=f"s{self._count}",
            tokens=tokens,
            faults=faults,
            chunks=chunks,
            decode_first=self._rng.random() < 0.5,
            disconnect_at=self._rng.randrange(3),
        )
