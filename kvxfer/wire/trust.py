"""Which prefills a decode may open a control connection to (``EngineConfig.trusted_prefills``).

A decode connects to the addresses its callers name, and in a disaggregated engine those come from
clients (vLLM's ``kv_transfer_params``, SGLang's bootstrap registry). With a keyring an address must
carry a key the keyring trusts (:mod:`kvxfer.wire.control`); without one nothing says who is at the
other end, so the decode connects only to loopback addresses and to those this allowlist names.
The check runs before any socket is opened, so a refused address costs the decode nothing.

Entries are comma-separated: a host (``prefill-0.svc``, ``198.18.0.1``), a ``host:port``
(``[fd00::1]:5555`` for IPv6) or a network in CIDR form (``198.18.0.0/15``). Names are compared as
written, never resolved.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

from ..core.arguments import check_host, split_host_port, split_tcp_endpoint
from ..errors import ConfigError, InvalidArgument, PeerError
from .auth import is_loopback, split_address


def _host_port(endpoint: str) -> tuple[str, int | None]:
    """A control endpoint (``tcp://host:port``) as (host without brackets, lower case; port), or
    (endpoint, None) when it is not one (then only a network entry can match nothing, and a host
    entry must equal it whole)."""
    try:
        host, port = split_tcp_endpoint(endpoint)
    except InvalidArgument:
        return endpoint.lower(), None
    return host.lower(), port


def _entry(text: str) -> tuple[str, int | None]:
    """One allowlist entry that is not a network: ``host`` or ``host:port`` (IPv6: bare, or
    ``[addr]:port``), checked strictly (:func:`kvxfer.core.arguments.check_host`)."""
    try:
        if text.startswith("[") or text.count(":") == 1:
            host, port = split_host_port(text, "entry")
            return host.lower(), port
        return check_host(text, "entry").lower(), None
    except InvalidArgument as exc:
        raise ConfigError(f"trusted_prefills: {text!r} is not a host, host:port or CIDR network ({exc.detail})") \
            from None


def key_problem(address: str, keyring: Any) -> str | None:
    """Why an engine with ``keyring`` (None: without one) will not open a control connection to
    ``address`` for its key, or None: with a keyring the address must carry a key it trusts (CurveZMQ
    then authenticates the peer); without one it must carry none (it could not authenticate it)."""
    _endpoint, key = split_address(address)
    if keyring is None:
        if key is not None:
            return "it requires authenticated peers; give this engine a keyring (KVXFER_KEYRING)"
        return None
    if key is None:
        return ("no server key in the address, and this engine only talks to authenticated peers "
                "(its keyring, KVXFER_KEYRING)")
    if not keyring.is_trusted(key):
        return "its key is not in this engine's keyring"
    return None


@dataclass(frozen=True)
class PeerAllowlist:
    """Parsed ``trusted_prefills``: hosts, host:port pairs and networks."""

    hosts: frozenset[str] = frozenset()
    endpoints: frozenset[tuple[str, int]] = frozenset()
    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()

    @classmethod
    def parse(cls, text: str) -> PeerAllowlist:
        if not isinstance(text, str):
            raise ConfigError(f"trusted_prefills must be a comma-separated string, got {type(text).__name__}")
        hosts, endpoints, networks = set(), set(), []
        for raw in text.split(","):
            entry = raw.strip()
            if not entry:
                continue
            if "/" in entry:
                try:
                    networks.append(ipaddress.ip_network(entry, strict=False))
                except ValueError:
                    raise ConfigError(f"trusted_prefills: {entry!r} is not a network (CIDR)") from None
                continue
            host, port = _entry(entry)
            if port is None:
                hosts.add(host)
            else:
                endpoints.add((host, port))
        return cls(frozenset(hosts), frozenset(endpoints), tuple(networks))

    @property
    def empty(self) -> bool:
        return not (self.hosts or self.endpoints or self.networks)

    def allows(self, address: str) -> bool:
        """Whether ``address`` (a control address, ``tcp://host:port`` with or without a key) is listed."""
        endpoint, _key = split_address(address)
        host, port = _host_port(endpoint)
        if host in self.hosts or (port is not None and (host, port) in self.endpoints):
            return True
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(ip.version == net.version and ip in net for net in self.networks)

    def check(self, address: str, *, keyed: bool) -> None:
        """Raise :class:`PeerError` naming ``address`` unless a decode may connect to it: listed, or
        (the list empty) authenticated by the keyring (``keyed``) or on loopback."""
        endpoint, _key = split_address(address)
        host, _port = _host_port(endpoint)
        if self.allows(address) or is_loopback(host) or (self.empty and keyed):
            return
        why = ("it is not in trusted_prefills" if not self.empty else
               "this decode has no keyring, so it connects only to loopback addresses and those "
               "trusted_prefills (KVXFER_TRUSTED_PREFILLS) names")
        raise PeerError(f"refusing to connect to prefill at {address[:200]}: {why}")


# The engine's refusals (DecodeEngine._check_trusted, ControlPlane._open_dealer), all raised before a
# socket is opened. PeerError has no reason code, so its sentence is what tells them from a prefill
# that could not be reached.
_TRUST_REFUSALS = ("refusing to connect to",)


def refused_by_trust(exc: BaseException) -> bool:
    """Whether ``exc`` (from :meth:`kvxfer.DecodeEngine.connect`) is the engine refusing an address it does
    not trust, rather than a prefill it could not reach (the SGLang and vLLM adapters answer it 403)."""
    return isinstance(exc, PeerError) and any(mark in str(exc) for mark in _TRUST_REFUSALS)
