"""Where an engine binds and what it tells its peers: the two are separate settings.

An engine binds its control socket (and, on tcp, its data socket) to ``host`` and advertises
``advertise_host`` in every address it hands out (HELLO's ``reply_to``, OFFER's tcp data address).
Without ``advertise_host`` the engine advertises ``host`` itself, unless ``host`` is a wildcard
(``0.0.0.0``, ``::``, ``*`` or empty: every interface), which no peer can connect to. Then it
advertises this host's one non-loopback address, and refuses to start (a
:class:`~kvxfer.errors.ConfigError` naming the addresses it found) when there is none or more than
one, since it cannot know which of them its peers reach.

Invariant: an address an engine advertises is never a wildcard.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

from ..errors import ConfigError

WILDCARDS = frozenset({"", "*", "0.0.0.0", "::", "[::]"})
_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def is_wildcard(host: str) -> bool:
    """Whether binding ``host`` binds every interface (an address no peer can connect to)."""
    return host.strip().lower() in WILDCARDS


def local_addresses() -> list[str]:
    """This host's (this network namespace's) non-loopback unicast addresses, IPv4 first, each once."""
    found: list[str] = []
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _index, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address on it
                continue
            address = socket.inet_ntoa(answer[20:24])
            if not ipaddress.ip_address(address).is_loopback and address not in found:
                found.append(address)
    finally:
        probe.close()
    try:
        with open("/proc/net/if_inet6") as table:
            for line in table:
                fields = line.split()
                if len(fields) < 4 or fields[3] != "00":  # global scope only
                    continue
                address = str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))
                if address not in found:
                    found.append(address)
    except OSError:  # no IPv6 on this host
        pass
    return found


def advertised_host(host: str, advertise_host: str | None) -> str:
    """The host an engine bound to ``host`` tells its peers (see the module docstring)."""
    if advertise_host:
        if is_wildcard(advertise_host):
            raise ConfigError(f"advertise_host {advertise_host!r} is a wildcard: peers need an address they "
                              "can connect to (this host's address on the network they share)")
        return advertise_host
    if not is_wildcard(host):
        return host
    candidates = local_addresses()
    if len(candidates) == 1:
        return candidates[0]
    found = ", ".join(candidates) if candidates else "none"
    raise ConfigError(f"host {host!r} binds every interface, and peers cannot connect to a wildcard: set "
                      f"advertise_host (KVXFER_ADVERTISE_HOST) to the address they reach this engine at "
                      f"(non-loopback addresses here: {found})")
