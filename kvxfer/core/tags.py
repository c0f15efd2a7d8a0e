"""Write tags: the (slot, generation) pair every one-sided write carries.

The receiving engine admits a request into a *slot* of its request table and gives it a
*generation* from a per-engine counter that only increases, so ``(slot, generation)`` names one
incarnation of one request even when request ids are reused. The software transport carries both in
full (32-bit slot, 64-bit generation). RDMA's WRITE_WITH_IMM has 32 bits of immediate data, so the
verbs transport carries :meth:`Tag.imm32`: the slot in the low ``SLOT_BITS`` and the generation
modulo ``2**GEN_BITS`` in the high bits.

Wrap-around: an immediate names the slot exactly and the generation modulo 65,536. The receiver
resolves it to the slot's *current* full tag and compares the low bits; a stale write could only be
mistaken for a current one if its generation is congruent and the slot was reused while the stale
write was still in flight. kvxfer never reuses a slot (or its pages) until the previous owner's
writes are proven drained or the connection fenced, so that cannot happen; the low bits are a second
line of defence, not the first.
"""

from __future__ import annotations

from dataclasses import dataclass

SLOT_BITS = 16
GEN_BITS = 32 - SLOT_BITS
MAX_SLOTS = 1 << SLOT_BITS
SLOT_MASK = MAX_SLOTS - 1
GEN_MASK = (1 << GEN_BITS) - 1
MAX_GENERATION = (1 << 64) - 1


@dataclass(frozen=True, order=True)
class Tag:
    """The ``(slot, generation)`` a write carries; valid by construction: slot in [0, ``MAX_SLOTS``),
    generation in [1, 2**64)."""

    slot: int
    generation: int

    def __post_init__(self) -> None:
        if not 0 <= self.slot < MAX_SLOTS:
            raise ValueError(f"slot {self.slot} outside [0, {MAX_SLOTS})")
        if not 0 < self.generation <= MAX_GENERATION:
            raise ValueError(f"generation {self.generation} outside [1, 2**64)")

    def imm32(self) -> int:
        """The 32-bit RDMA immediate for this tag (host order; the verbs layer byte-swaps)."""
        return ((self.generation & GEN_MASK) << SLOT_BITS) | self.slot

    def matches_imm32(self, imm: int) -> bool:
        """Whether an immediate could have been produced by this tag."""
        return imm == self.imm32()

    def __str__(self) -> str:
        return f"slot {self.slot} generation {self.generation}"


def split_imm32(imm: int) -> tuple[int, int]:
    """``(slot, generation mod 2**GEN_BITS)`` of an immediate."""
    if not 0 <= imm < (1 << 32):
        raise ValueError(f"immediate {imm} is not a 32-bit value")
    return imm & SLOT_MASK, imm >> SLOT_BITS
