"""Two hosts on one machine: two network namespaces joined by a veth pair, with network faults.

A :class:`TwoHosts` owns exactly these kernel objects, all created by its constructor and all gone
after :meth:`TwoHosts.close`:

* two network namespaces, ``<tag>a`` and ``<tag>b`` (hosts "a" and "b"), where ``<tag>`` is
  ``kvx<creator pid>x<3 hex digits>``: unique per instance and at most 14 characters, so the veth
  ends, named ``<tag>a`` in host a and ``<tag>b`` in host b, stay within the kernel's 15-character
  limit for device names;
* one veth pair between them (deleting either namespace deletes it), with ``198.18.N.1/24`` on host
  a's end and ``198.18.N.2/24`` on host b's, for a /24 drawn at random from 198.18.0.0/15 (RFC 2544,
  reserved for benchmarking: the addresses live only inside namespaces this module created, and
  no route leads out of them); each host's loopback is up too;
* the faults applied to them (:meth:`link_down`, :meth:`drop`, :meth:`blackhole`, :meth:`slow`), each
  with its undo, recorded in :attr:`TwoHosts.faults`; :meth:`heal` undoes every one.

Invariants:

* **Always removed.** :meth:`close` is idempotent and deletes both namespaces (and with them the
  veth and every fault); a constructor that fails half-way deletes what it made before raising; an
  instance never closed is closed at interpreter exit (``weakref.finalize``); and a creator that
  was SIGKILLed leaves namespaces whose name still carries its pid, which :func:`sweep_stale`
  deletes once their creator is gone (every :class:`TwoHosts` calls it first).
* **Never someone else's.** Only namespaces an instance made itself are deleted by it, and a
  namespace is never swept while its creator lives, so parallel runs leave each other alone. "Lives"
  is decided by a lock: the creator holds an exclusive ``flock`` on ``/run/kvxfer-netns/<tag>.lock``
  for the instance's life (the kernel drops it when the process dies, however it dies), so a reused
  pid or a creator in another PID namespace is not mistaken; without a lock file (it was removed by
  hand), by whether the pid in the name is alive.
* **Processes die with their parent.** :meth:`TwoHosts.argv` wraps a command in ``ip netns exec``,
  which enters the namespace and *execs* the command (no fork: the process started is the command
  itself, with the same pid, environment and inherited descriptors), so a kvxfer child started
  with :func:`kvxfer.tools.procs.popen` keeps its lifeline and sets its parent-death signal as
  usual. A process still running in a deleted namespace keeps it (and the veth) alive until it exits.
* **Faults are exact.** Link down takes the carrier away on both ends; a drop silently discards
  every IPv4 packet *arriving* at the receiving end's device (ARP still flows, nothing is answered:
  a partition TCP only notices by its timers); a blackhole route makes the sending host's sends to
  the other's address fail locally. Each fault is applied once (applying it again is a no-op) and
  its undo removes exactly what it added.

The host kernel here has no netem and no iptables: drops use tc's ``clsact`` qdisc with a classic
BPF filter that returns ``TC_ACT_SHOT`` (2) in direct-action mode. :func:`available` says whether
this machine can do all of it (root, ``ip`` and ``tc``, a namespace with a veth and the filter), and
if not, why, so tests skip with the reason.
"""

from __future__ import annotations

import enum
import fcntl
import ipaddress
import os
import random
import re
import shutil
import subprocess
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import KvxferError

PREFIX = "kvx"
NETWORK = ipaddress.IPv4Network("198.18.0.0/15")
_NAME = re.compile(rf"^{PREFIX}(?P<pid>\d+)x(?P<salt>[0-9a-f]{{3}})(?P<host>[ab])$")
_DROP_BYTECODE = "1,6 0 0 2,"  # classic BPF: "ret #2" (TC_ACT_SHOT in direct-action mode)
_TIMEOUT = 15.0  # seconds for one ip/tc command
LOCK_DIR = "/run/kvxfer-netns"  # <tag>.lock: held (flock) by the live creator of namespaces <tag>a, <tag>b

__all__ = ["Direction", "Fault", "Host", "NetnsError", "TwoHosts", "available", "sweep_stale"]


class NetnsError(KvxferError):
    """A namespace, link or fault could not be created or removed (the command and its error named)."""

    code = "netns"


class Direction(enum.Enum):
    """Which traffic a fault stops: from host a to host b, from b to a, or both ways."""

    BOTH = "both"
    A_TO_B = "a_to_b"
    B_TO_A = "b_to_a"

    @classmethod
    def parse(cls, value: Direction | str) -> Direction:
        if isinstance(value, Direction):
            return value
        try:
            return cls(str(value).replace("-", "_").lower())
        except ValueError:
            raise NetnsError(f"unknown direction {value!r} (known: both, a_to_b, b_to_a)") from None

    def senders(self) -> tuple[str, ...]:
        """The hosts whose sends the fault stops."""
        return {"both": ("a", "b"), "a_to_b": ("a",), "b_to_a": ("b",)}[self.value]


class Fault(enum.Enum):
    """The network faults a :class:`TwoHosts` applies (the keys of :attr:`TwoHosts.faults`)."""

    LINK_DOWN = "link_down"
    DROP = "drop"
    BLACKHOLE = "blackhole"
    SLOW = "slow"


class _State(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


@dataclass(frozen=True)
class Host:
    """One of the two hosts: its namespace, its veth end, its address and the other host's."""

    name: str  # "a" or "b"
    netns: str
    device: str
    address: str
    peer_address: str

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host's namespace (``ip netns exec`` execs it: same pid)."""
        return ["ip", "netns", "exec", self.netns, *argv]


# commands -----------------------------------------------------------------------------------------


def _run(args: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"`{' '.join(args)}` failed: {exc}") from exc
    if check and proc.returncode != 0:
        raise NetnsError(f"`{' '.join(args)}` failed (status {proc.returncode}): "
                         f"{(proc.stderr or proc.stdout).strip() or 'no message'}")
    return proc


def list_namespaces() -> list[str]:
    """The names of every network namespace (``ip netns list``), kvxfer's and others'."""
    proc = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: alive
        return True
    return True


def _lock_path(tag: str) -> str:
    return os.path.join(LOCK_DIR, f"{tag}.lock")


def _take_lock(tag: str) -> int | None:
    """The lock of ``tag``'s namespaces, held (its fd), or None if another process holds it."""
    os.makedirs(LOCK_DIR, mode=0o700, exist_ok=True)
    fd = os.open(_lock_path(tag), os.O_RDWR | os.O_CREAT, 0o600)  # not inherited by children (PEP 446)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _creator_gone(tag: str, pid: int) -> bool:
    if not os.path.exists(_lock_path(tag)):
        return not _pid_alive(pid)
    fd = _take_lock(tag)
    if fd is None:
        return False
    os.close(fd)  # released at once: the sweep deletes the namespaces, then the file
    return True


def sweep_stale() -> list[str]:
    """Delete the ``kvx<pid>x...`` namespaces whose creating process is gone (a SIGKILLed test or
    tool could not remove its own); returns the names deleted. Namespaces of live creators, and any
    name this module did not make, are left alone."""
    removed = []
    gone: dict[str, bool] = {}
    for name in list_namespaces():
        match = _NAME.match(name)
        if match is None:
            continue
        tag = name[:-1]
        if tag not in gone:
            gone[tag] = _creator_gone(tag, int(match["pid"]))
        if gone[tag] and _run(["ip", "netns", "del", name], check=False).returncode == 0:
            removed.append(name)
    for tag, dead in gone.items():
        if dead:
            try:
                os.unlink(_lock_path(tag))
            except FileNotFoundError:
                pass
    return removed


_availability: tuple[bool, str] | None = None


def available() -> tuple[bool, str]:
    """``(True, "")`` when this machine can run :class:`TwoHosts` and every fault, else ``(False, why)``:
    not root, no ``ip`` or ``tc``, or creating a namespace, a veth or the drop filter failed. Probed
    once per process, in a namespace of its own that is deleted again."""
    global _availability
    if _availability is None:
        _availability = _probe()
    return _availability


def _probe() -> tuple[bool, str]:
    if not hasattr(os, "geteuid") or not os.path.isdir("/proc"):
        return False, "network namespaces need Linux"
    if os.geteuid() != 0:
        return False, f"network namespaces need root (this process runs as uid {os.geteuid()})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"no `{tool}` binary on PATH (iproute2)"
    name = f"{PREFIX}{os.getpid()}x{random.randrange(4096):03x}a"
    try:
        _run(["ip", "netns", "add", name])
    except NetnsError as exc:
        return False, str(exc)
    try:
        _run(["ip", "-n", name, "link", "add", "kvxprobe0", "type", "veth", "peer", "name", "kvxprobe1"])
        _run(["tc", "-n", name, "qdisc", "add", "dev", "kvxprobe1", "clsact"])
        _run(["tc", "-n", name, "filter", "add", "dev", "kvxprobe1", "ingress", "protocol", "ip", "bpf", "da",
              "bytecode", _DROP_BYTECODE])
    except NetnsError as exc:
        return False, str(exc)
    finally:
        _run(["ip", "netns", "del", name], check=False)
    return True, ""


# the resource -------------------------------------------------------------------------------------


@dataclass
class _Owned:
    """What an instance made: its namespaces (only those are ever deleted by it) and its held lock."""

    tag: str
    namespaces: list[str]
    lock: int | None = None
    pid: int = 0  # the creator: a forked copy of it (exiting through atexit) leaves them alone


def _remove(owned: _Owned) -> None:
    """Delete the namespaces (whichever still exist), then the lock; the finalizer and
    :meth:`TwoHosts.close` use it."""
    if owned.pid != os.getpid():
        return
    if owned.namespaces:
        present = set(list_namespaces())
        for name in owned.namespaces:
            if name in present:
                _run(["ip", "netns", "del", name], check=False)
        owned.namespaces.clear()
    if owned.lock is not None:
        try:
            os.unlink(_lock_path(owned.tag))
        except FileNotFoundError:
            pass
        os.close(owned.lock)
        owned.lock = None


class TwoHosts:
    """Two hosts ("a" and "b") joined by one wire; see the module docstring for what it owns.

    >>> with TwoHosts() as hosts:                                       # doctest: +SKIP
    ...     subprocess.run(hosts.argv("a", ["ip", "-o", "addr"]))  # 198.18.N.1 on host a's veth end
    ...     hosts.drop("a_to_b")                                   # a's packets no longer reach b
    ...     hosts.heal()
    """

    def __init__(self, *, subnet: str | None = None) -> None:
        sweep_stale()
        try:
            net = ipaddress.IPv4Network(subnet) if subnet else self._draw_subnet()
        except ValueError as exc:
            raise NetnsError(f"subnet {subnet!r}: {exc}") from None
        if not net.subnet_of(NETWORK) or net.num_addresses < 4:
            raise NetnsError(f"subnet {net} is not a /30 or larger inside {NETWORK}")
        hosts = [net.network_address + 1, net.network_address + 2]
        self.subnet = str(net)
        tag, lock = self._tag()
        self.a = Host("a", f"{tag}a", f"{tag}a", str(hosts[0]), str(hosts[1]))
        self.b = Host("b", f"{tag}b", f"{tag}b", str(hosts[1]), str(hosts[0]))
        self.faults: dict[Fault, tuple[str, ...]] = {}  # applied fault -> its parameters (directions, rate)
        self._state = _State.OPEN
        self._owned = _Owned(tag=tag, namespaces=[], lock=lock, pid=os.getpid())
        self._finalizer = weakref.finalize(self, _remove, self._owned)  # at exit too, if never closed
        try:
            self._build(net.prefixlen)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _draw_subnet() -> ipaddress.IPv4Network:
        third = random.randrange(512)  # 512 /24s in 198.18.0.0/15
        return ipaddress.IPv4Network(f"198.{18 + third // 256}.{third % 256}.0/24")

    @staticmethod
    def _tag() -> tuple[str, int]:
        """A tag no namespace uses yet, and its lock, held."""
        taken = set(list_namespaces())
        for _ in range(64):
            tag = f"{PREFIX}{os.getpid()}x{random.randrange(4096):03x}"
            if f"{tag}a" in taken or f"{tag}b" in taken:
                continue
            try:
                lock = _take_lock(tag)
            except OSError as exc:
                raise NetnsError(f"cannot make the lock {_lock_path(tag)}: {exc}") from exc
            if lock is not None:
                return tag, lock
        raise NetnsError("no free namespace name left for this process (64 draws taken)")

    def _build(self, prefixlen: int) -> None:
        a, b = self.a, self.b
        for host in (a, b):
            _run(["ip", "netns", "add", host.netns])
            self._owned.namespaces.append(host.netns)
        _run(["ip", "link", "add", a.device, "netns", a.netns, "type", "veth", "peer", "name", b.device,
              "netns", b.netns])
        for host in (a, b):
            _run(["ip", "-n", host.netns, "addr", "add", f"{host.address}/{prefixlen}", "dev", host.device])
            _run(["ip", "-n", host.netns, "link", "set", "lo", "up"])
            _run(["ip", "-n", host.netns, "link", "set", host.device, "up"])
        self._wait_carrier()

    def _wait_carrier(self, timeout: float = 5.0) -> None:
        """Return once both ends have carrier (a veth end comes up a moment after ``link set up``)."""
        deadline = time.monotonic() + timeout
        while True:
            states = [_run(["ip", "-n", h.netns, "-o", "link", "show", "dev", h.device]).stdout
                      for h in (self.a, self.b)]
            if all("LOWER_UP" in s and "NO-CARRIER" not in s for s in states):
                return
            if time.monotonic() > deadline:
                raise NetnsError(f"the link {self.a.device} <-> {self.b.device} has no carrier after {timeout:g} s")
            time.sleep(0.01)

    # who is who --------------------------------------------------------------------------------------
    def host(self, name: str | Host) -> Host:
        if isinstance(name, Host):
            return name
        if name == "a":
            return self.a
        if name == "b":
            return self.b
        raise NetnsError(f"no host {name!r} (the hosts are 'a' and 'b')")

    def argv(self, host: str | Host, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside host ``host``'s namespace."""
        self._check_open()
        return self.host(host).argv(argv)

    @property
    def namespaces(self) -> tuple[str, str]:
        return self.a.netns, self.b.netns

    @property
    def closed(self) -> bool:
        return self._state is _State.CLOSED

    def _check_open(self) -> None:
        if self._state is _State.CLOSED:
            raise NetnsError(f"hosts {self.a.netns}/{self.b.netns} are closed")

    # faults ------------------------------------------------------------------------------------------
    def link_down(self) -> None:
        """Take the link down (the carrier goes on both ends)."""
        self._check_open()
        if Fault.LINK_DOWN in self.faults:
            return
        _run(["ip", "-n", self.a.netns, "link", "set", self.a.device, "down"])
        self.faults[Fault.LINK_DOWN] = ()

    def link_up(self) -> None:
        """Undo :meth:`link_down`."""
        self._check_open()
        if Fault.LINK_DOWN not in self.faults:
            return
        _run(["ip", "-n", self.a.netns, "link", "set", self.a.device, "up"])
        del self.faults[Fault.LINK_DOWN]
        self._wait_carrier()

    def drop(self, direction: Direction | str = Direction.BOTH) -> None:
        """Silently drop every IPv4 packet going ``direction`` (on the receiving device's ingress);
        replaces a drop in force in another direction."""
        self._check_open()
        direction = Direction.parse(direction)
        if self.faults.get(Fault.DROP) == (direction.value,):
            return
        self.undrop()
        receivers = [self.b if sender == "a" else self.a for sender in direction.senders()]
        self.faults[Fault.DROP] = (direction.value,)  # recorded first: undrop removes a half-made one
        for host in receivers:
            _run(["tc", "-n", host.netns, "qdisc", "add", "dev", host.device, "clsact"])
            _run(["tc", "-n", host.netns, "filter", "add", "dev", host.device, "ingress", "protocol", "ip", "bpf",
                  "da", "bytecode", _DROP_BYTECODE])

    def undrop(self) -> None:
        """Undo :meth:`drop`."""
        self._check_open()
        if Fault.DROP not in self.faults:
            return
        for host in (self.a, self.b):
            _run(["tc", "-n", host.netns, "qdisc", "del", "dev", host.device, "clsact"], check=False)
        del self.faults[Fault.DROP]

    def blackhole(self, direction: Direction | str = Direction.BOTH) -> None:
        """A blackhole route on the sending end(s) of ``direction`` to the other host's address: sends
        fail locally. Replaces a blackhole in force in another direction."""
        self._check_open()
        direction = Direction.parse(direction)
        if self.faults.get(Fault.BLACKHOLE) == (direction.value,):
            return
        self.unblackhole()
        self.faults[Fault.BLACKHOLE] = (direction.value,)
        for sender in direction.senders():
            host = self.host(sender)
            _run(["ip", "-n", host.netns, "route", "add", "blackhole", f"{host.peer_address}/32"])

    def unblackhole(self) -> None:
        """Undo :meth:`blackhole`."""
        self._check_open()
        if Fault.BLACKHOLE not in self.faults:
            return
        for host in (self.a, self.b):
            _run(["ip", "-n", host.netns, "route", "del", "blackhole", f"{host.peer_address}/32"], check=False)
        del self.faults[Fault.BLACKHOLE]

    def slow(self, rate: str = "100mbit", direction: Direction | str = Direction.BOTH) -> None:
        """Limit ``direction`` to ``rate`` (tc's units, e.g. ``"100mbit"``) with a token bucket on the
        sending device, so that a cut lands mid-transfer."""
        self._check_open()
        direction = Direction.parse(direction)
        self.unslow()
        self.faults[Fault.SLOW] = (direction.value, rate)
        for sender in direction.senders():
            host = self.host(sender)
            _run(["tc", "-n", host.netns, "qdisc", "replace", "dev", host.device, "root", "tbf", "rate", rate,
                  "burst", "1mb", "latency", "200ms"])

    def unslow(self) -> None:
        """Undo :meth:`slow`."""
        self._check_open()
        if Fault.SLOW not in self.faults:
            return
        for host in (self.a, self.b):
            _run(["tc", "-n", host.netns, "qdisc", "del", "dev", host.device, "root"], check=False)
        del self.faults[Fault.SLOW]

    def heal(self) -> None:
        """Undo every fault in force."""
        self.link_up()
        self.undrop()
        self.unblackhole()
        self.unslow()

    # the end -----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Delete both namespaces, with the veth and every fault (idempotent)."""
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSED
        self.faults.clear()
        self._finalizer()

    def __enter__(self) -> TwoHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"TwoHosts({self.a.netns} {self.a.address} <-> {self.b.netns} {self.b.address}, "
                f"{self._state.value}{', faults ' + ','.join(f.value for f in self.faults) if self.faults else ''})")
