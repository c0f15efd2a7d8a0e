"""What callers may pass to the engines' APIs, checked before anything is reserved, opened or sent.

One place for the rules ``protocol/SPEC.md`` §2.1 writes down, so both roles refuse the same inputs
the same way: every function here returns the normalised value or raises
:class:`~kvxfer.errors.InvalidArgument` naming the request and the value, and none has a side
effect. The engines call them first, so on any error the ledger, the write windows and the peers
are exactly as they were.

The integrations and the tcp transport parse what arrives from outside (vLLM's ``kv_transfer_params``,
SGLang's bootstrap registry, a peer's OFFER) with the same strict rules: :func:`parse_port` (ASCII
digits only, 1..65535, never ``bool``), :func:`check_host`, :func:`split_host_port`,
:func:`split_tcp_endpoint` and :func:`split_control_address` (an endpoint with an optional key); ids
must encode as UTF-8 (:func:`utf8_problem`). They translate the :class:`~kvxfer.errors.InvalidArgument`
into their own error, naming the field.
"""

from __future__ import annotations

import ipaddress
import operator
import re
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
MAX_ENGINE_ID = 4096  # characters in an engine id (the wire's longest string)
PORT_MAX = 65535
MAX_HOST_NAME = 253  # characters in a DNS name (an IPv6 address is judged by ipaddress)

# Strict forms of what arrives from outside as text. ``str.isdigit()`` and ``int()`` take any Unicode
# digit ("٤٠١٢٣", "４０１２３"; isdigit() also "²", which int() then refuses with a bare ValueError), and
# int() refuses more than 4300 digits: these patterns take ASCII only, and nothing int() refuses.
_PORT_TEXT = re.compile(r"[1-9][0-9]{0,4}")  # no sign, blank, underscore or leading zero
_HOST_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # a DNS name or an IPv4 address
_IPV6_TEXT = re.compile(r"[0-9A-Za-z:.%_-]+")  # what ipaddress.IPv6Address then judges (a zone after %)


def _shown(value: Any) -> str:
    """``repr(value)``, at most 60 characters: safe in any message (a lone surrogate is escaped)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


shown = _shown  # for the integrations, whose errors show external values the same way


def utf8_problem(text: str) -> str | None:
    """Why ``text`` cannot travel (the wire, JSON and ZMQ carry UTF-8), or None when it can: a lone
    surrogate (which a JSON string can carry as ``\\ud800``) has no UTF-8 encoding."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"does not encode as UTF-8 (lone surrogate {text[exc.start]!r} at index {exc.start})"
    return None


def check_rid(rid: Any) -> str | int:
    """A request id: a ``str`` of 1..512 characters that encodes as UTF-8, or an ``int`` in
    [0, 2**64 - 1] (not ``bool``, not a numpy scalar: ids are compared and hashed, and travel in
    every message)."""
    if isinstance(rid, str):
        if not 1 <= len(rid) <= MAX_RID_STR:
            problem = f"a string of {len(rid)} characters (allowed 1..{MAX_RID_STR})"
        elif (why := utf8_problem(rid)) is not None:
            problem = f"{_shown(rid)}, which {why}"
        else:
            return rid
    elif type(rid) is int:
        if 0 <= rid <= U64:
            return rid
        problem = f"the integer {rid}, outside [0, 2**64 - 1]"
    elif isinstance(rid, np.integer):
        problem = f"a numpy {type(rid).__name__}; pass int(rid)"
    else:
        problem = f"a {type(rid).__name__} ({_shown(rid)})"
    raise InvalidArgument(f"request id is {problem}: ids are str (1..{MAX_RID_STR} characters, UTF-8) or "
                          "int in [0, 2**64 - 1]")


def check_tokens(tokens: Any, rid: Any) -> int:
    """A token count: an integer (Python or numpy, not ``bool``). Values <= 0 are left to admission,
    which rejects them as empty prompts."""
    if isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer)):
        raise InvalidArgument(f"token count is a {type(tokens).__name__} ({_shown(tokens)}), not an integer",
                              rid=rid)
    return operator.index(tokens)


def engine_id_problem(value: Any) -> str | None:
    """Why ``value`` is no engine id, or None. An engine id is a ``str`` of 1..4096 characters that
    encodes as UTF-8: engine ids travel in HELLO, ACCEPT and the connect proof."""
    if not isinstance(value, str):
        return f"is a {type(value).__name__} ({_shown(value)}), not a str"
    if not 1 <= len(value) <= MAX_ENGINE_ID:
        return f"is a string of {len(value)} characters (allowed 1..{MAX_ENGINE_ID})"
    why = utf8_problem(value)
    return None if why is None else f"is {_shown(value)}, which {why}"


def check_peer(peer: Any, rid: Any) -> str | None:
    """A peer: None, or an engine id (:func:`engine_id_problem`)."""
    if peer is None:
        return None
    why = engine_id_problem(peer)
    if why is None:
        return peer
    raise InvalidArgument(f"peer must be an engine id (a non-empty str that encodes as UTF-8), but it {why}",
                          rid=rid)


def parse_port(value: Any, what: str = "port") -> int:
    """A TCP port from outside: an ``int`` (not ``bool``) or its ASCII decimal digits (no sign, blank or
    leading zero), in 1..65535. ``what`` names the field in the error."""
    if isinstance(value, str) and _PORT_TEXT.fullmatch(value):
        number = int(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        number = int(value)
    else:
        number = -1
    if 1 <= number <= PORT_MAX:
        return number
    raise InvalidArgument(f"{what} {_shown(value)} is not an integer in 1..{PORT_MAX} (in ASCII digits)")


def _is_ipv6(text: str) -> bool:
    if not _IPV6_TEXT.fullmatch(text):
        return False
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def check_host(value: Any, what: str = "host") -> str:
    """A host from outside, brackets removed: a DNS name or IPv4 address (ASCII letters, digits, ``.``,
    ``-``, ``_``; at most 253 characters), or an IPv6 address, bare or in brackets (``[::1]``)."""
    if isinstance(value, str):
        if value.startswith("[") and value.endswith("]"):
            if _is_ipv6(value[1:-1]):
                return value[1:-1]
        elif ":" in value:
            if _is_ipv6(value):  # a tcp receiver bound to an IPv6 address announces it bare
                return value
        elif len(value) <= MAX_HOST_NAME and _HOST_NAME.fullmatch(value):
            return value
    raise InvalidArgument(f"{what} {_shown(value)} is not a host name, an IPv4 address or an IPv6 address")


def _split(text: str) -> tuple[str, int]:
    """``host:port`` as ``(host, port)``; the InvalidArgument says which half is wrong."""
    host, sep, port = text.rpartition(":")
    if not sep:
        raise InvalidArgument("no ':' before a port")
    return check_host(host), parse_port(port)


def split_host_port(value: Any, what: str = "address") -> tuple[str, int]:
    """``host:port`` from outside as ``(host, port)`` (:func:`check_host`, :func:`parse_port`); the
    port follows the last colon, so an IPv6 host may be bare or in brackets."""
    if not isinstance(value, str):
        raise InvalidArgument(f"{what} must be a string host:port, got {_shown(value)}")
    try:
        return _split(value)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{what} {_shown(value)} is not host:port: {exc.detail}") from None


def split_tcp_endpoint(value: Any, what: str = "address") -> tuple[str, int]:
    """``tcp://host:port`` from outside (a control-plane endpoint, unkeyed) as ``(host, port)``."""
    if not isinstance(value, str) or not value.startswith("tcp://"):
        raise InvalidArgument(f"{what} {_shown(value)} is not tcp://host:port")
    try:
        return _split(value.removeprefix("tcp://"))
    except InvalidArgument as exc:
        raise InvalidArgument(f"{what} {_shown(value)} is not tcp://host:port: {exc.detail}") from None


CONTROL_KEY_MARK = "#curve="  # what separates a keyed control address's endpoint from its key (the wire's KEY_MARK)
CONTROL_KEY_HEX = 64  # a CurveZMQ public key: 32 bytes, in hex
_KEY_TEXT = re.compile(r"[0-9A-Fa-f]{64}")  # ASCII only: re's [0-9] takes no other digits


def split_control_address(value: Any, what: str = "address") -> tuple[str, int, str | None]:
    """A control address from outside as ``(host, port, key)``: ``tcp://host:port`` (the endpoint,
    :func:`split_tcp_endpoint`), optionally followed by ``#curve=`` and exactly 64 ASCII hex digits, the
    public key of the engine that listens there (an engine with a keyring advertises its address so).
    ``key`` is those 64 digits as written, or None for an unkeyed address. Anything else after the
    endpoint (another mark, a short, long or non-ASCII key) is refused, naming ``what``."""
    if not isinstance(value, str):
        raise InvalidArgument(f"{what} {_shown(value)} is not tcp://host:port[#curve=<64 hex digits>]")
    endpoint, mark, key = value.partition("#")
    if mark:
        if not ("#" + key).startswith(CONTROL_KEY_MARK):
            raise InvalidArgument(f"{what} {_shown(value)}: after tcp://host:port only {CONTROL_KEY_MARK}<64 hex "
                                  "digits> may follow")
        key = key.removeprefix(CONTROL_KEY_MARK[1:])
        if not _KEY_TEXT.fullmatch(key):
            got = f"{len(key)} characters" if len(key) != CONTROL_KEY_HEX else "characters that are not all hex digits"
            raise InvalidArgument(f"{what} {_shown(value)}: the key after {CONTROL_KEY_MARK} must be exactly "
                                  f"{CONTROL_KEY_HEX} ASCII hex digits, got {got}")
    host, port = split_tcp_endpoint(endpoint, what)
    return host, port, key if mark else None


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
