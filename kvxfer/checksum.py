"""Transfer checksums over a request's pages, in the order both sides agree on.

Canonical order: for each buffer ``b`` in layout order, for each page in the *request's* page order
(the i-th source page pairs with the i-th destination page), the ``item_len[b]`` bytes of that page.
Both engines compute the same value from their own pages, so a match says the destination holds
exactly the source's bytes. Adler-32 is the default (as SGLang's
``--disaggregation-enable-kv-checksum``), CRC32 is selectable; both come from zlib-ng, which runs
them at memory speed. Runs of consecutive pages are checksummed in one call.
"""

from __future__ import annotations

import enum

import numpy as np
from zlib_ng import zlib_ng

from .errors import ConfigError
from .layout import KVLayout


class ChecksumAlgo(str, enum.Enum):
    ADLER32 = "adler32"
    CRC32 = "crc32"
    NONE = "none"  # benchmarks only ("checks off"): no checksum is computed or compared

    @classmethod
    def parse(cls, value: str | ChecksumAlgo) -> ChecksumAlgo:
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(a.value for a in cls)
            raise ConfigError(f"unknown checksum {value!r} (choose {choices})") from None

    @property
    def initial(self) -> int:
        return 1 if self is ChecksumAlgo.ADLER32 else 0

    def update(self, data: object, value: int) -> int:
        if self is ChecksumAlgo.ADLER32:
            return zlib_ng.adler32(data, value)
        return zlib_ng.crc32(data, value)


def page_runs(pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split a page sequence into runs of consecutive indices: ``(starts, lengths)``."""
    pages = np.asarray(pages, dtype=np.int64)
    if pages.size == 0:
        return pages, pages
    breaks = np.flatnonzero(np.diff(pages) != 1) + 1
    starts_idx = np.concatenate(([0], breaks))
    ends_idx = np.concatenate((breaks, [pages.size]))
    return pages[starts_idx], ends_idx - starts_idx


def checksum_pages(layout: KVLayout, pages: np.ndarray, algo: ChecksumAlgo | str) -> int:
    """Checksum of ``pages`` of ``layout`` in canonical order (host layouts)."""
    algo = ChecksumAlgo.parse(algo)
    if algo is ChecksumAlgo.NONE:
        return 0
    value = algo.initial
    starts, lengths = page_runs(pages)
    for b in range(layout.num_buffers):
        flat = layout.flat_view(b)
        item = int(layout.item_lens[b])
        for start, length in zip(starts.tolist(), lengths.tolist()):
            value = algo.update(flat[start * item : (start + length) * item], value)
    return value
