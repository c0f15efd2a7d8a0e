"""Completion verification: what must hold before a received request's pages become readable.

Given the writer's DONE claim and what the write guard saw land, a request is readable only if:

(a) coverage: every reserved page was covered in every buffer by writes of this generation;
(b) bytes: the claim's page and byte counts equal the reservation, and so do the unique bytes landed;
(c) checksum: the receiver's own checksum over the destination pages equals the claim's;
(d) poison: with the poison free policy, no page still holds the poison pattern.

Every transport calls this one function. The error names each check that differed, with numbers and
pages, so an operator can tell a short write from a corrupted one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import VerificationFailed, describe_pages
from .checksum import ChecksumAlgo, checksum_pages
from .pool import PagePool
from .writeguard import WriteGuard


@dataclass(frozen=True)
class Claim:
    """What the writer says it wrote (from DONE)."""

    bytes: int
    pages: int
    checksum: int
    algo: str


def verify_completion(
    pool: PagePool,
    guard: WriteGuard,
    *,
    rid: Any,
    gen: int,
    pages: np.ndarray,
    claim: Claim,
    algo: ChecksumAlgo,
    actual_checksum: int | None = None,
) -> None:
    """Raise :class:`VerificationFailed` naming every check that failed; return if all hold.

    ``actual_checksum`` is the receiver's checksum when it was computed beforehand (outside the lock)."""
    layout = pool.layout
    expected_bytes = layout.bytes_for_pages(len(pages))
    problems: list[tuple[str, str]] = []
    bad_pages: list[int] = []

    if claim.pages != len(pages):
        problems.append(("pages", f"DONE claims {claim.pages} pages, {len(pages)} reserved"))
    if claim.bytes != expected_bytes:
        problems.append(("bytes", f"DONE claims {claim.bytes} bytes, reservation is {expected_bytes}"))
    uncovered = guard.uncovered(pages)
    if uncovered.size:
        covered_items = int(guard.covered[:, pages].sum())
        landed = int((guard.covered[:, pages] * layout.item_lens[:, None]).sum())
        problems.append(
            (
                "coverage",
                f"{uncovered.size} of {len(pages)} reserved pages were not written in every buffer "
                f"({describe_pages(uncovered)}); {landed} of {expected_bytes} bytes landed "
                f"({covered_items} of {len(pages) * layout.num_buffers} page items)",
            )
        )
        bad_pages.extend(uncovered.tolist())
    window = guard.window(gen)
    if guard.requires_final and (window is None or window.final_writes == 0):
        problems.append(("final_write", "the final write (RDMA WRITE with the request's tag as immediate) never arrived"))
    poisoned = pool.poisoned(pages)
    if poisoned.size:
        problems.append(
            ("poison", f"{poisoned.size} pages still hold the poison pattern ({describe_pages(poisoned)})")
        )
        bad_pages.extend(poisoned.tolist())
    if claim.algo != algo.value:
        problems.append(("checksum", f"DONE uses {claim.algo}, this engine verifies {algo.value}"))
    elif not problems and algo is not ChecksumAlgo.NONE:
        actual = checksum_pages(layout, pages, algo) if actual_checksum is None else actual_checksum
        if actual != claim.checksum:
            problems.append(
                (
                    "checksum",
                    f"{algo.value} of the destination pages is {actual:#010x}, "
                    f"DONE claims {claim.checksum:#010x}",
                )
            )
    if problems:
        text = "; ".join(f"{name}: {what}" for name, what in problems)
        raise VerificationFailed(
            f"transfer not verified: {text}",
            check=problems[0][0],
            rid=rid,
            generation=gen,
            pages=sorted(set(bad_pages))[:64] or None,
        )
