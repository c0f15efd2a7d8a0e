"""Two real machines as the two hosts of a stress run: this one (host a) and one reached through its agent.

:class:`kvxfer.tools.netns.TwoHosts` makes two hosts out of network namespaces on one kernel. Soft-RoCE
cannot cross namespaces on the soft-RoCE VM's kernel (rxe looks routes up in the initial namespace
only), so verbs across a wire needs two machines: the soft-RoCE pair's two guests, joined by a QEMU
network (``tools/softroce/pair --mgmt``). :class:`TwoGuests` gives the stress driver the same surface
as ``TwoHosts`` over them: ``a`` is this machine, ``b`` the machine whose agent
(:mod:`kvxfer.tools.remote`) listens on a management link, and the wire between them is each one's
``device`` (the data NIC, ``eth0``). The faults are the same commands as in namespaces, run here or
through the agent: link down (host a's NIC: its routes go, its queue pairs fail at their next packet),
a silent drop of every IPv4 packet on the receiving NIC's ingress (each way or both), a blackhole route
on the sender, a token-bucket rate. Processes on host b are started behind a local stand-in
(:func:`kvxfer.tools.remote.proxy_argv`), their RPC on the management link (``rpc_host``).

Invariants (as ``TwoHosts``): at most one of each fault in force, every fault undone by its undo or
:meth:`TwoGuests.heal`, and :meth:`TwoGuests.close` (idempotent) heals the wire; nothing here outlives
the run (the machines are not this tool's to remove).
"""

from __future__ import annotations

import enum
import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

from . import remote
from .netns import _DROP_BYTECODE, Direction, Fault, NetnsError

__all__ = ["GuestHost", "TwoGuests"]

_TIMEOUT = 15.0


@dataclass(frozen=True)
class GuestHost:
    """One of the two machines: its data NIC and address, the other's, and (host b) its agent and the
    address its processes' RPC binds."""

    name: str
    device: str
    address: str
    peer_address: str
    agent: str | None = None  # None: this machine
    rpc_host: str | None = None

    @property
    def netns(self) -> str:  # what reports print for a namespace host
        return f"guest {self.name}"

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run on this machine (behind a local stand-in when it is the other one)."""
        return [*remote.proxy_argv(self.agent), *argv] if self.agent else list(argv)

    def run(self, args: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
        try:
            if self.agent:
                proc = remote.run(self.agent, args, timeout=_TIMEOUT)
            else:
                proc = subprocess.run(args, capture_output=True, text=True, timeout=_TIMEOUT)
        except (OSError, subprocess.TimeoutExpired, remote.PeerError) as exc:
            raise NetnsError(f"`{' '.join(args)}` on host {self.name} failed: {exc}") from exc
        if check and proc.returncode != 0:
            raise NetnsError(f"`{' '.join(args)}` on host {self.name} failed (status {proc.returncode}): "
                             f"{(proc.stderr or proc.stdout or '').strip() or 'no message'}")
        return proc


class _State(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


class TwoGuests:
    """This machine and another one, reached through the agent at ``agent`` (``HOST:PORT`` on the
    management link); ``device``: the data NIC on both; ``address`` / ``peer_address``: the data
    addresses of this machine and the other one (default: the soft-RoCE pair's ``KVXFER_VM_IP`` and
    ``KVXFER_VM_PEER_IP``)."""

    def __init__(self, agent: str, *, device: str | None = None, address: str | None = None,
                 peer_address: str | None = None) -> None:
        device = device or os.environ.get("KVXFER_VM_NIC", "eth0")
        address = address or os.environ.get("KVXFER_VM_IP", "")
        peer_address = peer_address or os.environ.get("KVXFER_VM_PEER_IP", "")
        if not address or not peer_address:
            raise NetnsError("two guests need this machine's and the other machine's data addresses "
                             "(KVXFER_VM_IP and KVXFER_VM_PEER_IP, which tools/softroce/pair sets)")
        rpc_host, _ = remote._endpoint(agent)
        self.faults: dict[Fault, tuple[str, ...]] = {}
        # host a's processes: RPC on loopback (a unix socket would sit in TMPDIR, which the pair shares
        # over 9p for the keyrings, and 9p has no sockets)
        self.a = GuestHost("a", device, address, peer_address, rpc_host="127.0.0.1")
        self.b = GuestHost("b", device, peer_address, address, agent=agent, rpc_host=rpc_host)
        self._state = _State.OPEN
        self.b.run(["true"])  # the agent answers (and takes our token) before anything starts there

    def host(self, name: str | GuestHost) -> GuestHost:
        key = name.name if isinstance(name, GuestHost) else name
        if key not in ("a", "b"):
            raise NetnsError(f"no host {name!r} (the hosts are 'a' and 'b')")
        return self.a if key == "a" else self.b

    def argv(self, host: str | GuestHost, argv: Sequence[str]) -> list[str]:
        return self.host(host).argv(argv)

    @property
    def namespaces(self) -> tuple[str, str]:
        return (self.a.netns, self.b.netns)

    @property
    def closed(self) -> bool:
        return self._state is _State.CLOSED

    def _check_open(self) -> None:
        if self._state is _State.CLOSED:
            raise NetnsError("the two guests' wire is closed")

    # faults ------------------------------------------------------------------------------------------
    def link_down(self) -> None:
        """Host a's data NIC down (its routes go with it)."""
        self._check_open()
        if Fault.LINK_DOWN in self.faults:
            return
        self.faults[Fault.LINK_DOWN] = ()
        self.a.run(["ip", "link", "set", self.a.device, "down"])

    def link_up(self) -> None:
        self._check_open()
        if Fault.LINK_DOWN not in self.faults:
            return
        self.a.run(["ip", "link", "set", self.a.device, "up"])
        del self.faults[Fault.LINK_DOWN]
        deadline = time.monotonic() + 5.0
        while "LOWER_UP" not in self.a.run(["ip", "-o", "link", "show", "dev", self.a.device]).stdout:
            if time.monotonic() > deadline:
                raise NetnsError(f"{self.a.device} on host a has no carrier 5 s after link up")
            time.sleep(0.02)

    def drop(self, direction: Direction | str = Direction.BOTH) -> None:
        """Silently drop every IPv4 packet going ``direction``, on the receiving NIC's ingress."""
        self._check_open()
        direction = Direction.parse(direction)
        if self.faults.get(Fault.DROP) == (direction.value,):
            return
        self.undrop()
        self.faults[Fault.DROP] = (direction.value,)
        for sender in direction.senders():
            receiver = self.b if sender == "a" else self.a
            receiver.run(["tc", "qdisc", "add", "dev", receiver.device, "clsact"])
            receiver.run(["tc", "filter", "add", "dev", receiver.device, "ingress", "protocol", "ip", "bpf", "da",
                          "bytecode", _DROP_BYTECODE])

    def undrop(self) -> None:
        self._check_open()
        if Fault.DROP not in self.faults:
            return
        for host in (self.a, self.b):
            host.run(["tc", "qdisc", "del", "dev", host.device, "clsact"], check=False)
        del self.faults[Fault.DROP]

    def blackhole(self, direction: Direction | str = Direction.BOTH) -> None:
        """A blackhole route to the other machine's data address on the sender(s) of ``direction``."""
        self._check_open()
        direction = Direction.parse(direction)
        if self.faults.get(Fault.BLACKHOLE) == (direction.value,):
            return
        self.unblackhole()
        self.faults[Fault.BLACKHOLE] = (direction.value,)
        for sender in direction.senders():
            host = self.host(sender)
            host.run(["ip", "route", "add", "blackhole", f"{host.peer_address}/32"])

    def unblackhole(self) -> None:
        self._check_open()
        if Fault.BLACKHOLE not in self.faults:
            return
        for host in (self.a, self.b):
            host.run(["ip", "route", "del", "blackhole", f"{host.peer_address}/32"], check=False)
        del self.faults[Fault.BLACKHOLE]

    def heal(self) -> None:
        """Undo every fault in force."""
        self.link_up()
        self.undrop()
        self.unblackhole()

    def close(self) -> None:
        """Heal the wire (idempotent); the machines stay."""
        if self._state is _State.CLOSED:
            return
        try:
            self.heal()
        finally:
            self._state = _State.CLOSED

    def __enter__(self) -> TwoGuests:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TwoGuests(a={self.a.address}, b={self.b.address} via {self.b.agent}, {self._state.value})"
