"""A page pool: a :class:`~kvxfer.core.ledger.PageLedger` over a :class:`~kvxfer.core.layout.KVLayout`.

The pool adds what needs the memory itself: the free policy (keep, zero or poison pages when they
return to the free list), the poison check used at completion, and the startup capacity invariant.

Invariants: pages are scrubbed *before* they return to the free list, so an allocation never sees a
half-scrubbed page; the poison pattern is drawn once per process boot and is never all zeros.
"""

from __future__ import annotations

import enum
import logging
import secrets
import warnings
from collections.abc import Iterable

import numpy as np

from ..errors import CapacityError, ConfigError
from .layout import KVLayout
from .ledger import AllocPolicy, PageLedger, PageState

log = logging.getLogger("kvxfer.pool")


class FreePolicy(str, enum.Enum):
    """What happens to a page's bytes when it returns to the free list."""

    KEEP = "keep"
    """Leave the bytes (SGLang's default; fastest; stale bytes stay until overwritten)."""
    ZERO = "zero"
    """Zero every byte of the page in every buffer."""
    POISON = "poison"
    """Write the per-boot poison pattern to a few words of the page in every buffer."""

    @classmethod
    def parse(cls, value: str | FreePolicy) -> FreePolicy:
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(p.value for p in cls)
            raise ConfigError(f"unknown free policy {value!r} (choose {choices})") from None


def _draw_poison() -> bytes:
    while True:
        value = secrets.randbits(64)
        if value != 0:
            return value.to_bytes(8, "little")


POISON_PATTERN: bytes = _draw_poison()
"""Per-boot random 64-bit poison pattern (little-endian bytes)."""


def poison_offsets(item_len: int) -> list[int]:
    """Byte offsets of the poison words in an item: first, middle and last 8-byte word."""
    if item_len < 8:
        raise ConfigError(f"poison needs items of at least 8 bytes (got {item_len})")
    last = item_len - 8
    middle = (item_len // 2) // 8 * 8
    return sorted({0, min(middle, last), last})


def check_capacity(
    *, role: str, pool_tokens: int, max_context: int, allow_undersized: bool = False
) -> None:
    """The startup invariant: the pool must hold the whole configured context.

    Raises :class:`CapacityError` naming both numbers unless ``allow_undersized`` is set, in
    which case it warns loudly, because every prompt in the band between the two numbers is then
    a request the engine must reject at admission."""
    if max_context <= 0:
        raise ConfigError(f"{role}: max_context must be positive (got {max_context})")
    if pool_tokens >= max_context:
        return
    band = (
        f"prompts of {pool_tokens + 1:,}-{max_context:,} tokens "
        f"({max_context - pool_tokens:,} tokens, {100 * (max_context - pool_tokens) / max_context:.0f}% "
        "of the window) pass the context check but cannot fit the pool"
    )
    message = (
        f"{role} pool {pool_tokens:,} tokens < context {max_context:,} tokens: {band}. "
        "Enlarge the pool or lower the configured context"
    )
    if not allow_undersized:
        raise CapacityError(message + " (allow_undersized_pool overrides this, unsafely).")
    banner = f"UNSAFE CONFIGURATION (override in force): {message}; such prompts will be rejected."
    log.warning("!" * 20 + " " + banner + " " + "!" * 20)
    warnings.warn(banner, RuntimeWarning, stacklevel=3)


class PagePool:
    """Pages of a layout with their ledger and free policy."""

    def __init__(
        self,
        layout: KVLayout,
        *,
        alloc_policy: AllocPolicy | str = AllocPolicy.LIFO,
        free_policy: FreePolicy | str = FreePolicy.KEEP,
        seed: int | None = None,
    ) -> None:
        self.layout = layout
        self.free_policy = FreePolicy.parse(free_policy)
        self.ledger = PageLedger(layout.num_pages, policy=alloc_policy, seed=seed)
        self._poison = np.frombuffer(POISON_PATTERN, dtype=np.uint8)
        self._poison_offsets = (
            [poison_offsets(int(n)) for n in layout.item_lens]
            if self.free_policy is FreePolicy.POISON
            else []
        )
        if self.free_policy is not FreePolicy.KEEP and layout.device != "cpu":
            from .gpu import require_gpu_scrubber  # lazy

            require_gpu_scrubber()
        if self.free_policy is FreePolicy.POISON:
            # A page nobody ever wrote must be detectable too: poison the whole pool at start.
            self.scrub(np.arange(layout.num_pages, dtype=np.int64))

    @property
    def num_pages(self) -> int:
        return self.layout.num_pages

    def scrub(self, pages: np.ndarray) -> None:
        """Apply the free policy to ``pages`` (all buffers)."""
        if self.free_policy is FreePolicy.KEEP or pages.size == 0:
            return
        if self.layout.device == "cuda":
            from .gpu.kernels import scrub  # lazy: GPU only

            scrub(self.layout, pages, zero=self.free_policy is FreePolicy.ZERO,
                  poison_offsets=self._poison_offsets, pattern=POISON_PATTERN)
            return
        views = self.layout.views()
        if self.free_policy is FreePolicy.ZERO:
            for view in views:
                view[pages] = 0
            return
        for view, offsets in zip(views, self._poison_offsets):
            for off in offsets:
                view[pages, off : off + 8] = self._poison

    @property
    def poisons(self) -> bool:
        """Whether freed pages are poisoned (completion verification then looks for the pattern)."""
        return self.free_policy is FreePolicy.POISON

    def poisoned(self, pages: np.ndarray) -> np.ndarray:
        """Pages (of ``pages``) where some buffer still holds a poison word: nobody wrote them."""
        if self.free_policy is not FreePolicy.POISON or pages.size == 0:
            return np.empty(0, dtype=np.int64)
        hit = np.zeros(pages.size, dtype=bool)
        if self.layout.device == "cuda":
            from .gpu.kernels import poisoned_pages  # lazy: GPU only

            return poisoned_pages(self.layout, pages, self._poison_offsets, POISON_PATTERN)
        for view, offsets in zip(self.layout.views(), self._poison_offsets):
            for off in offsets:
                hit |= (view[pages, off : off + 8] == self._poison).all(axis=1)
        return pages[hit]

    def release(self, pages: np.ndarray, generation: int, *, allowed: Iterable[PageState]) -> None:
        """Scrub (per policy) and free pages owned by ``generation``, after checking ownership."""
        allowed = tuple(allowed)
        if self.free_policy is FreePolicy.KEEP:  # nothing to scrub: the ledger's one check-and-free pass
            self.ledger.release(pages, generation, allowed=allowed)
            return
        if not self.ledger.holds(pages, generation, allowed):
            # Let the ledger raise its detailed error before any byte is scrubbed.
            self.ledger.release(pages, generation, allowed=allowed)
        self.scrub(pages)
        self.ledger.release(pages, generation, allowed=allowed)
