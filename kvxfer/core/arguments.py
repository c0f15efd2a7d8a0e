"""What callers may pass to the engines' APIs, checked before anything is reserved, opened or sent.

One place for the rules ``protocol/SPEC.md`` §2.1 writes down, so both roles refuse the same inputs
the same way: every function here returns the normalised value or raises
:class:`~kvxfer.errors.InvalidArgument` naming the request and the value, and none has a side
effect. The engines call them first, so on any error the ledger, the write windows and the peers
are exactly as they were.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from ..errors import InvalidArgument
from .pagesets import has_duplicates

# The limits of ``protocol/SPEC.md`` §2.1 that callers' values must meet. They are the core's rules;
# the wire encodes within them (kvxfer.wire.messages declares the same values, and the core never
# imports the wire: tests/test_layers.py checks that the two agree).
MAX_RID_STR = 512  # characters in a string request id
U64 = (1 << 64) - 1  # the largest integer request id, generation or counter
MAX_AUX_BYTES = 1 << 20  # DONE.aux


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_rid(rid: Any) -> str | int:
    """A request id: a ``str`` of 1..512 characters or an ``int`` in [0, 2**64 - 1] (not ``bool``,
    not a numpy scalar: ids are compared and hashed, and travel in every message)."""
    if isinstance(rid, str):
        if 1 <= len(rid) <= MAX_RID_STR:
            return rid
        problem = f"a string of {len(rid)} characters (allowed 1..{MAX_RID_STR})"
    elif type(rid) is int:
        if 0 <= rid <= U64:
            return rid
        problem = f"the integer {rid}, outside [0, 2**64 - 1]"
    elif isinstance(rid, np.integer):
        problem = f"a numpy {type(rid).__name__}; pass int(rid)"
    else:
        problem = f"a {type(rid).__name__} ({_shown(rid)})"
    raise InvalidArgument(f"request id is {problem}: ids are str (1..{MAX_RID_STR} characters) or int "
                          "in [0, 2**64 - 1]")


def check_tokens(tokens: Any, rid: Any) -> int:
    """A token count: an integer (Python or numpy, not ``bool``). Values <= 0 are left to admission,
    which rejects them as empty prompts."""
    if isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer)):
        raise InvalidArgument(f"token count is a {type(tokens).__name__} ({_shown(tokens)}), not an integer",
                              rid=rid)
    return operator.index(tokens)


def check_peer(peer: Any, rid: Any) -> str | None:
    if peer is None or (isinstance(peer, str) and peer):
        return peer
    raise InvalidArgument(f"peer must be an engine id (a non-empty str), got {_shown(peer)}", rid=rid)


MAX_WRITERS = 64


def check_peers(peers: Any, rid: Any) -> list[str] | None:
    """A request's writers (engine ids, in the order that decides who writes a head more than one
    holds): None, or 1..64 distinct non-empty strings."""
    if peers is None:
        return None
    if isinstance(peers, (str, bytes)) or not isinstance(peers, (list, tuple)):
        raise InvalidArgument(f"peers must be a list of engine ids, got {_shown(peers)}", rid=rid)
    names = [check_peer(p, rid) for p in peers]
    if not 1 <= len(names) <= MAX_WRITERS or None in names:
        raise InvalidArgument(f"peers must name 1..{MAX_WRITERS} engines, got {len(names)}", rid=rid)
    if len(set(names)) != len(names):
        raise InvalidArgument("peers must be distinct", rid=rid)
    return [str(n) for n in names]


def page_array(pages: Any, *, num_pages: int, rid: Any, what: str = "page list") -> np.ndarray:
    """A one-dimensional array of distinct page indices in ``[0, num_pages)``, as int64."""
    try:
        array = np.asarray(pages)
    except Exception as exc:  # ragged nesting and the like
        raise InvalidArgument(f"{what} is not an array of page indices: {exc}", rid=rid) from None
    if array.dtype.kind not in "iu":
        if array.size:
            raise InvalidArgument(f"{what} holds {array.dtype} values, not integer page indices", rid=rid)
        array = array.astype(np.int64)  # [] arrives as float64
    if array.ndim != 1:
        raise InvalidArgument(f"{what} must be one-dimensional (shape {array.shape})", rid=rid)
    array = array.astype(np.int64, copy=False)
    bad = array[(array < 0) | (array >= num_pages)]
    if bad.size:
        raise InvalidArgument(f"{what}: page index out of range [0, {num_pages})", rid=rid, pages=bad[:8])
    if has_duplicates(array):
        values, counts = np.unique(array, return_counts=True)
        raise InvalidArgument(f"{what} names a page twice", rid=rid, pages=values[counts > 1][:8])
    return array


def describe_buffers(buffers: np.ndarray) -> str:
    """A short name for a group of buffer indices: ``0-3``, ``4, 5``, ``0, 1, 2, ... (12)``."""
    values = [int(b) for b in buffers]
    if len(values) > 2 and values == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}-{values[-1]}"
    if len(values) > 6:
        return ", ".join(map(str, values[:3])) + f", ... ({len(values)})"
    return ", ".join(map(str, values))


def check_count(count: Any, total: int, rid: Any, generation: int | None) -> int:
    """A chunk size for ``send(count=...)``: an integer in ``[1, total]`` (the request's pages). A
    fixed chunk size larger than what is left sends what is left, as chunked senders expect."""
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)):
        raise InvalidArgument(f"count is a {type(count).__name__} ({_shown(count)}), not an integer",
                              rid=rid, generation=generation)
    count = operator.index(count)
    if not 1 <= count <= total:
        raise InvalidArgument(f"count {count} outside [1, {total}] (the request's pages)",
                              rid=rid, generation=generation)
    return count


def check_aux(aux: Any, rid: Any, generation: int | None) -> bytes:
    """Per-request metadata delivered with completion: bytes, at most 1 MiB."""
    if not isinstance(aux, (bytes, bytearray, memoryview)):
        raise InvalidArgument(f"aux must be bytes, got {type(aux).__name__}", rid=rid, generation=generation)
    aux = bytes(aux)
    if len(aux) > MAX_AUX_BYTES:
        raise InvalidArgument(f"aux of {len(aux):,} bytes exceeds {MAX_AUX_BYTES:,}", rid=rid, generation=generation)
    return aux
