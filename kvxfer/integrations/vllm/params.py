"""``kv_transfer_params`` as kvxfer's connector writes and reads them (importable without vLLM).

The prefill's ``request_finished`` returns them to the client (through the router); the client passes
them to the decode unchanged. They only *name* KV: where the prefill's kvxfer engines listen and which
request to take. Nothing in them is trusted for safety: the prompt binding travels inside kvxfer's
verified DONE (:mod:`.binding`), the prefill accepts a destination for a request once, and the decode
checks every field here before it reserves a page. Keys are vLLM's usual ones (``do_remote_prefill``,
``remote_engine_id``, ``remote_request_id``, ``remote_host``, ``remote_port``) plus one ``kvxfer``
object::

    {"version": 1, "addresses": ["tcp://10.0.0.1:40123", ...one per prefill TP rank],
     "tokens": 517, "tp_size": 1, "block_size": 32}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

VERSION = 1
MAX_RID_CHARS = 512
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
        host, _, port = self.addresses[0].removeprefix("tcp://").rpartition(":")
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": self.request_id,
            "remote_host": host,
            "remote_port": int(port),
            "kvxfer": {"version": VERSION, "addresses": list(self.addresses), "tokens": self.tokens,
                       "tp_size": self.tp_size, "block_size": self.block_size},
        }


def _int(value: Any, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ParamsError(f"kv_transfer_params {name} must be an integer in [{low}, {high}], got {value!r}")
    return value


def parse(params: Any) -> TransferParams:
    """Check decode-side ``kv_transfer_params``; :class:`ParamsError` names the first bad field."""
    if not isinstance(params, dict):
        raise ParamsError(f"kv_transfer_params must be an object, got {type(params).__name__}")
    ours = params.get("kvxfer")
    if not isinstance(ours, dict):
        raise ParamsError("kv_transfer_params carry no 'kvxfer' object: they were not made by a kvxfer prefill")
    version = ours.get("version")
    if version != VERSION:
        raise ParamsError(f"kv_transfer_params kvxfer.version {version!r}, this decode reads {VERSION}")
    rid = params.get("remote_request_id")
    if not isinstance(rid, str) or not rid or len(rid) > MAX_RID_CHARS:
        raise ParamsError(f"kv_transfer_params remote_request_id must be a non-empty string of at most "
                          f"{MAX_RID_CHARS} characters, got {str(rid)[:80]!r}")
    engine_id = params.get("remote_engine_id")
    if not isinstance(engine_id, str) or not engine_id:
        raise ParamsError(f"kv_transfer_params remote_engine_id must be a non-empty string, got {engine_id!r}")
    addresses = ours.get("addresses")
    if not isinstance(addresses, list) or not 1 <= len(addresses) <= MAX_RANKS:
        raise ParamsError(f"kv_transfer_params kvxfer.addresses must be a list of 1 to {MAX_RANKS} addresses")
    for address in addresses:
        host, sep, port = str(address).removeprefix("tcp://").rpartition(":")
        if not (isinstance(address, str) and address.startswith("tcp://") and sep and host and port.isdigit()
                and 0 < int(port) < 65536):
            raise ParamsError(f"kv_transfer_params kvxfer.addresses holds {str(address)[:80]!r}, "
                              "not tcp://host:port")
    tp_size = _int(ours.get("tp_size"), "kvxfer.tp_size", 1, MAX_RANKS)
    if tp_size != len(addresses):
        raise ParamsError(f"kv_transfer_params kvxfer.tp_size {tp_size} but {len(addresses)} addresses")
    tokens = _int(ours.get("tokens"), "kvxfer.tokens", 1, 1 << 31)
    block_size = _int(ours.get("block_size"), "kvxfer.block_size", 1, 1 << 20)
    return TransferParams(engine_id=engine_id, request_id=rid, addresses=tuple(addresses), tokens=tokens,
                          tp_size=tp_size, block_size=block_size)
