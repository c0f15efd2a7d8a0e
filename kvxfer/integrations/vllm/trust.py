"""Which prefills a vLLM decode may connect to, asked before anything is opened (importable without vLLM).

``kv_transfer_params`` come from clients, so the addresses in them are a client's choice. A decode's
kvxfer engine refuses, before opening a socket, every address it does not trust
(:meth:`kvxfer.DecodeEngine.connect` raises :class:`~kvxfer.errors.PeerError`): with a keyring
(``KVXFER_KEYRING``) an address must carry a key the keyring trusts (``tcp://host:port#curve=<hex>``);
without one only loopback addresses and those ``trusted_prefills`` (``KVXFER_TRUSTED_PREFILLS``)
names; with both, the list must name it too (:mod:`kvxfer.wire.trust`, :mod:`kvxfer.wire.control`).

:class:`PrefillTrust` asks the same questions of the same settings without an engine, so the
connector's scheduler half refuses an untrusted address in the step the request arrives (HTTP 403,
``untrusted_prefill``) and its workers never see the load; the engine's own check stays the last word
(a refusal there maps to the same answer: :func:`refused_by_trust`). Invariant: :meth:`PrefillTrust.problem`
is None only for an address the engine's checks would also let through (the tests pair them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...core.arguments import shown
from ...engine.config import EngineConfig
from ...errors import PeerError
from ...wire.auth import Keyring
from ...wire.trust import PeerAllowlist, key_problem
from .outcomes import LoadFailure

STATUS = 403  # the request names a prefill this decode is not allowed to reach: refused, not retried
REASON = "untrusted_prefill"


@dataclass(frozen=True)
class PrefillTrust:
    """A decode's trust settings: its keyring (None: none) and its ``trusted_prefills`` allowlist."""

    keyring: Keyring | None
    allowlist: PeerAllowlist

    @classmethod
    def from_config(cls, config: EngineConfig, keyring: Keyring | None = None) -> PrefillTrust:
        """From an engine's settings; ``keyring`` is the one already loaded (an engine's), else the
        config's is loaded (:meth:`EngineConfig.load_keyring`)."""
        return cls(keyring if keyring is not None else config.load_keyring(),
                   PeerAllowlist.parse(config.trusted_prefills))

    def problem(self, address: str) -> str | None:
        """Why this decode will not connect to ``address`` (a control address that passed
        :func:`kvxfer.core.arguments.split_control_address`), or None when it will."""
        try:
            why = key_problem(address, self.keyring)  # the engine's own rules (kvxfer.wire.trust)
            if why is not None:
                return why
            self.allowlist.check(address, keyed=self.keyring is not None)
        except PeerError as exc:
            return exc.detail.split(": ", 1)[-1]  # the engine's sentence names the address; ours does below
        return None

    def refusal(self, addresses: Any) -> LoadFailure | None:
        """The answer to a load whose params name ``addresses``: None if every one is trusted, else a
        :data:`STATUS` ``untrusted_prefill`` failure naming the first that is not, and why."""
        for address in addresses:
            why = self.problem(address)
            if why is not None:
                return untrusted(address, why)
        return None


def untrusted(address: str, why: str) -> LoadFailure:
    """The :class:`LoadFailure` of a load refused because this decode does not trust ``address``."""
    return LoadFailure(STATUS, REASON, f"kv_transfer_params name a prefill this decode does not connect to, "
                                       f"{shown(address[:200])}: {why}")


