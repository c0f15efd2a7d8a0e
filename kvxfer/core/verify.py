"""Completion verification: what must hold before a received request's pages become readable.

Given the writer's DONE claim and what the write guard saw land, a request is readable only if:

(a) coverage: every reserved page was covered in every buffer by writes of this generation;
(b) bytes: the claim's page and byte counts equal the reservation, and so do the unique bytes landed;
(c) checksum: the receiver's own checksum over the destination pages equals the claim's;
(d) poison: with the poison free policy, no page still holds the poison pattern.

Every transport calls this one function, once per writer of the request (a *leg*: the request's one
writer, or with unequal tensor parallelism each writer's head slice, checked against its
:class:`~kvxfer.core.slicing.SliceTable`). The error names each check that differed, with numbers and
pages, so an operator can tell a short write from a corrupted one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import VerificationFailed, describe_pages
from .checksum import ChecksumAlgo, checksum_pages
from .pool import PagePool
from .slicing import SliceTable
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
    table: SliceTable | None = None,
    check_poison: bool = True,
) -> None:
    """Raise :class:`VerificationFailed` naming every check that failed; return if all hold.

    ``actual_checksum`` is the receiver's checksum when it was computed beforehand (outside the lock;
    required with ``table``). With ``table`` the writer owes its slice of the pages, not whole pages.
    ``check_poison``: whether this call also looks for the poison pattern (a request of several
    writers looks once, after all of them, with :func:`poison_problem`)."""
    layout = pool.layout
    expected_bytes = layout.bytes_for_pages(len(pages)) if table is None else table.nbytes
    problems: list[tuple[str, str]] = []
    bad_pages: list[int] = []

    if claim.pages != len(pages):
        problems.append(("pages", f"DONE claims {claim.pages} pages, {len(pages)} reserved"))
    if claim.bytes != expected_bytes:
        problems.append(("bytes", f"DONE claims {claim.bytes} bytes, {'its slice' if table else 'reservation'} "
                                  f"is {expected_bytes}"))
    uncovered = guard.uncovered(pages) if table is None else table.uncovered_pages()
    if table is not None and uncovered.size:
        total = table.covered.size
        problems.append(
            (
                "coverage",
                f"{uncovered.size} of {len(pages)} reserved pages were not written in every buffer within this "
                f"writer's slice ({describe_pages(uncovered)}); {table.covered_atoms()} of {total} pieces landed",
            )
        )
        bad_pages.extend(uncovered.tolist())
    elif uncovered.size:
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
    if check_poison:
        poisoned = poison_problem(pool, pages)
        if poisoned is not None:
            problems.append(poisoned[0])
            bad_pages.extend(poisoned[1].tolist())
    if claim.algo != algo.value:
        problems.append(("checksum", f"DONE uses {claim.algo}, this engine verifies {algo.value}"))
    elif not problems and algo is not ChecksumAlgo.NONE:
        if actual_checksum is None and table is not None:
            raise ValueError("a slice's checksum is computed by the caller")
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


def poison_problem(pool: PagePool, pages: np.ndarray) -> tuple[tuple[str, str], np.ndarray] | None:
    """The poison check (d) over ``pages``: ``(("poison", text), poisoned pages)``, or None."""
    poisoned = pool.poisoned(pages)
    if not poisoned.size:
        return None
    return ("poison", f"{poisoned.size} pages still hold the poison pattern ({describe_pages(poisoned)})"), poisoned
