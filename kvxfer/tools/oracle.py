"""The content oracle: page contents anyone can recompute, so a reader can tell whose bytes it got.

The writer fills each page of each buffer from a keyed function of (request key, generation, page
position, buffer, seed). Every item starts with a 32-byte header naming its owner; the rest is a
splitmix64 stream of the same key. A reader recomputes what each of its pages must hold:

* a page equal to its expectation is **ok**;
* a page whose header names a *different* request or generation is a **leak** (another tenant's
  bytes), the failure this project exists to prevent;
* anything else is **corruption**.

Everything is vectorised numpy; items must be a multiple of 8 bytes and at least 32.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.layout import KVLayout
from ..errors import ConfigError

MAGIC = np.uint64(0x4F58564B_4F524143)  # "CAROKVXO" little-endian; any fixed non-zero value works
HEADER_WORDS = 4
_C1 = np.uint64(0x9E3779B97F4A7C15)
_C2 = np.uint64(0xBF58476D1CE4E5B9)
_C3 = np.uint64(0x94D049BB133111EB)


def rid_key(rid: Any) -> int:
    """A stable 64-bit key for a request id (str or int)."""
    digest = hashlib.blake2b(repr(rid).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


def _mix(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + _C1
        z = (z ^ (z >> np.uint64(30))) * _C2
        z = (z ^ (z >> np.uint64(27))) * _C3
        return z ^ (z >> np.uint64(31))


def _item_keys(key: int, gen: int, positions: np.ndarray, buffer: int, seed: int) -> np.ndarray:
    base = _mix(np.array([key ^ (gen << 1) ^ (seed << 33)], dtype=np.uint64) & np.uint64(2**64 - 1))
    pos = positions.astype(np.uint64) * np.uint64(1 << 16) + np.uint64(buffer)
    return _mix(base ^ _mix(pos))


def expected_items(
    item_len: int, *, key: int, gen: int, positions: np.ndarray, buffer: int, seed: int
) -> np.ndarray:
    """``(len(positions), item_len // 8)`` uint64 words the items must hold."""
    if item_len % 8 or item_len < 8 * HEADER_WORDS:
        raise ConfigError(f"oracle needs items of a multiple of 8 bytes, at least 32 (got {item_len})")
    words = item_len // 8
    keys = _item_keys(key, gen, positions, buffer, seed)
    with np.errstate(over="ignore"):
        body = _mix(keys[:, None] + np.arange(words, dtype=np.uint64)[None, :])
    body[:, 0] = MAGIC
    body[:, 1] = np.uint64(key)
    body[:, 2] = np.uint64(gen)
    body[:, 3] = (positions.astype(np.uint64) << np.uint64(32)) | np.uint64(buffer)
    return body


def fill(layout: KVLayout, pages: np.ndarray, *, rid: Any, gen: int, seed: int = 0) -> None:
    """Write the oracle contents of a request into ``pages`` (page i is request position i)."""
    key = rid_key(rid)
    positions = np.arange(len(pages), dtype=np.int64)
    for b, view in enumerate(layout.views()):
        words = expected_items(view.shape[1], key=key, gen=gen, positions=positions, buffer=b, seed=seed)
        view[pages] = words.view(np.uint8).reshape(len(pages), -1)


@dataclass
class OracleReport:
    """The verdict on a request's pages: how many were ok, which were leaked (another owner's bytes) or corrupted,
    and the (key, generation) owners the leaked bytes came from."""

    pages: int = 0
    ok: int = 0
    leaked: list[int] = field(default_factory=list)
    corrupted: list[int] = field(default_factory=list)
    leaked_from: set[tuple[int, int]] = field(default_factory=set)

    @property
    def clean(self) -> bool:
        return not self.leaked and not self.corrupted

    def to_dict(self) -> dict[str, Any]:
        return {
            "pages": self.pages,
            "ok": self.ok,
            "leaked_pages": len(self.leaked),
            "corrupted_pages": len(self.corrupted),
            "leaked_from": sorted(self.leaked_from)[:32],
        }


def check(layout: KVLayout, pages: np.ndarray, *, rid: Any, gen: int, seed: int = 0,
          views: list[np.ndarray] | None = None) -> OracleReport:
    """Compare what ``pages`` hold with what request ``(rid, gen)`` wrote there.

    ``views`` (per buffer, rows in request order) lets a caller pass already-read copies."""
    key = rid_key(rid)
    report = OracleReport(pages=len(pages))
    positions = np.arange(len(pages), dtype=np.int64)
    status = np.zeros(len(pages), dtype=np.int8)  # 0 ok, 1 corrupt, 2 leak (a leak dominates)
    for b, full in enumerate(layout.views()):
        rows = views[b] if views is not None else full[pages]
        actual = np.ascontiguousarray(rows).view(np.uint64)
        expect = expected_items(full.shape[1], key=key, gen=gen, positions=positions, buffer=b, seed=seed)
        bad = ~(actual == expect).all(axis=1)
        if not bad.any():
            continue
        foreign = bad & (actual[:, 0] == MAGIC) & ((actual[:, 1] != np.uint64(key)) | (actual[:, 2] != np.uint64(gen)))
        status = np.maximum(status, np.where(foreign, 2, np.where(bad, 1, 0)).astype(np.int8))
        for row in np.flatnonzero(foreign):
            report.leaked_from.add((int(actual[row, 1]), int(actual[row, 2])))
    report.leaked = [int(p) for p in pages[status == 2]]
    report.corrupted = [int(p) for p in pages[status == 1]]
    report.ok = int((status == 0).sum())
    return report
