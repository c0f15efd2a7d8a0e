"""``kv_transfer_params`` as kvxfer's connector writes and reads them (importable without vLLM).

The prefill's ``request_finished`` returns them to the client (through the router); the client passes
them to the decode unchanged. They only *name* KV: where the prefill's kvxfer engines listen and which
request to take. Nothing in them is trusted for safety: the prompt binding travels inside kvxfer's
verified DONE (:mod:`.binding`), the prefill accepts a destination for a request once, and the decode
checks every field here before it reserves a page, strictly (:mod:`kvxfer.core.arguments`: ports in
ASCII digits, integers that are not booleans, ids that encode as UTF-8), so a bad value is a
:class:`ParamsError` naming the field (HTTP 400), never another exception. Keys are vLLM's usual
ones (``do_remote_prefill``, ``remote_engine_id``, ``remote_request_id``, ``remote_host``,
``remote_port``: the decode reads the first three, not the last two) plus one ``kvxfer`` object::

    {"version": 1, "addresses": ["tcp://10.0.0.1:40123", ...one per prefill TP rank],
     "tokens": 517, "tp_size": 1, "block_size": 32}

An address is a kvxfer control address: ``tcp://host:port``, or with a keyring (which kvxfer requires
off loopback) ``tcp://host:port#curve=<64 hex digits>``, the prefill engine's public key
(:func:`kvxfer.core.arguments.split_control_address`). ``remote_host`` and ``remote_port`` are the
first address's endpoint. Parsing says nothing about trust: which prefills a decode connects to is
:mod:`.trust`'s question, asked after these checks and before any connection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn

from ...core.arguments import MAX_RID_STR, check_rid, engine_id_problem, shown, split_control_address
from ...errors import InvalidArgument

VERSION = 1
MAX_RID_CHARS = MAX_RID_STR
MAX_RANKS = 256


class ParamsError(ValueError):
    """``kv_transfer_params`` that kvxfer cannot use; the message says which field and why."""


@dataclass(frozen=True)
class TransferParams:
    """What a decode needs to take a request's KV from its prefill."""

    engine_id: str
    request_id: str
    addresses: tuple[str, ...]
    tokens: int
    tp_size: int
    block_size: int

    def to_json(self) -> dict[str, Any]:
        """The params a client carries from the prefill to the decode. Raises :class:`ParamsError` (naming
        the address) only for an address :func:`parse` would refuse; the prefill's addresses are checked
        once, when the workers report them (:meth:`SchedulerSide.set_addresses`), so it does not raise
        there. ``remote_host``/``remote_port`` are the first address's endpoint (brackets and key left out)."""
        try:
            host, port, _key = split_control_address(self.addresses[0], "kvxfer.addresses[0]")
        except (InvalidArgument, IndexError) as exc:
            raise ParamsError(f"kv_transfer_params cannot name the prefill at {shown(self.addresses[:1])}: "
                              f"{getattr(exc, 'detail', exc)}") from None
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": self.request_id,
            "remote_host": host,
            "remote_port": port,
            "kvxfer": {"version": VERSION, "addresses": list(self.addresses), "tokens": self.tokens,
                       "tp_size": self.tp_size, "block_size": self.block_size},
        }


def _refuse(field: str, problem: str) -> NoReturn:
    raise ParamsError(f"kv_transfer_params {field} {problem}")


def _int(value: Any, field: str, low: int, high: int) -> int:
    """An integer field: a JSON integer (not ``true``/``false``, not ``1.0``) in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        _refuse(field, f"must be an integer in [{low}, {high}], got {shown(value)}")
    return int(value)


def _request_id(value: Any) -> str:
    """``remote_request_id``: the prefill's request id, a string the engines take (:func:`check_rid`)."""
    if not isinstance(value, str):
        _refuse("remote_request_id", f"must be a string, got {shown(value)}")
    try:
        return str(check_rid(value))
    except InvalidArgument as exc:
        _refuse("remote_request_id", f"is not a kvxfer request id: {exc.detail}")


def _engine_id(value: Any) -> str:
    """``remote_engine_id``: an engine id (:func:`engine_id_problem`)."""
    why = engine_id_problem(value)
    if why is not None:
        _refuse("remote_engine_id", f"must be an engine id (a non-empty string that encodes as UTF-8), but it {why}")
    return value


def _addresses(value: Any) -> tuple[str, ...]:
    """``kvxfer.addresses``: 1..256 control addresses, ``tcp://host:port`` with an optional
    ``#curve=<64 hex digits>`` key (:func:`split_control_address`)."""
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_RANKS:
        _refuse("kvxfer.addresses", f"must be a list of 1 to {MAX_RANKS} addresses, got {shown(value)}")
    for index, address in enumerate(value):
        try:
            split_control_address(address)
        except InvalidArgument as exc:
            _refuse(f"kvxfer.addresses[{index}]", f"is bad: {exc.detail}")
    return tuple(value)


def parse(params: Any) -> TransferParams:
    """Check decode-side ``kv_transfer_params``; :class:`ParamsError` names the first bad field and its
    value. Nothing else is raised, whatever JSON (lone surrogates included) the client sent."""
    if not isinstance(params, dict):
        raise ParamsError(f"kv_transfer_params must be an object, got {type(params).__name__}")
    ours = params.get("kvxfer")
    if not isinstance(ours, dict):
        raise ParamsError("kv_transfer_params carry no 'kvxfer' object: they were not made by a kvxfer prefill")
    version = ours.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version != VERSION:
        _refuse("kvxfer.version", f"is {shown(version)}, this decode reads the integer {VERSION}")
    rid = _request_id(params.get("remote_request_id"))
    engine_id = _engine_id(params.get("remote_engine_id"))
    addresses = _addresses(ours.get("addresses"))
    tp_size = _int(ours.get("tp_size"), "kvxfer.tp_size", 1, MAX_RANKS)
    if tp_size != len(addresses):
        _refuse("kvxfer.tp_size", f"is {tp_size} but kvxfer.addresses holds {len(addresses)}")
    tokens = _int(ours.get("tokens"), "kvxfer.tokens", 1, 1 << 31)
    block_size = _int(ours.get("block_size"), "kvxfer.block_size", 1, 1 << 20)
    return TransferParams(engine_id=engine_id, request_id=rid, addresses=addresses, tokens=tokens,
                          tp_size=tp_size, block_size=block_size)
