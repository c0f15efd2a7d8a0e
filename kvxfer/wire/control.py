"""The control plane: ZMQ sockets carrying :mod:`kvxfer.wire.messages` between engines.

Each engine binds one ROUTER socket (its control address) and opens one DEALER per peer address,
with the engine id as its routing identity, so every inbound message arrives as
``(sender engine id, bytes)``. Only the engine's control thread receives; sends may come from any
thread and are serialised per socket. ZMQ's own ``MAXMSGSIZE`` drops oversized messages before they
reach the decoder, and sends never block: a full queue raises :class:`PeerError`.

With a :class:`~kvxfer.wire.auth.Keyring` the plane is authenticated (CurveZMQ): the ROUTER accepts
only clients whose public key the keyring trusts (a ZAP handler decides; denials and failed
handshakes become control events), DEALERs connect only to addresses carrying a trusted server key,
and each routing identity is bound to the key it first arrived with, so an authenticated engine
cannot speak under another engine's name. Without a keyring the plane is open, and says so once.

An answer to a peer the engine does not keep (a refused HELLO) goes out once on a socket of its own
without the engine's identity (:meth:`ControlPlane.send_once`): the socket is closed as soon as the
message is queued and lingers at most :data:`ONCE_LINGER_MS` to deliver it; at most :data:`MAX_ONCE`
such answers per :data:`ONCE_WINDOW_S`. Each engine closes the sockets of addresses no peer uses any
more (the prefill with :meth:`ControlPlane.retain`, the decode with :meth:`ControlPlane.forget` once no
peer or pending HELLO uses them), so what a stranger names cannot pile up sockets on either role.

Liveness of the connections themselves (:func:`keep_alive`): every socket pings its peer over ZMTP
every :data:`PING_IVL_MS` and drops a connection that carried nothing for :data:`PING_TIMEOUT_MS`
(a silent partition leaves a TCP connection in retransmission backoff, minutes long, that would
otherwise carry the first message after the network heals; a shorter blip is left to TCP, which
delivers what was in flight); a DEALER then dials again every
:data:`RECONNECT_IVL_MS` (up to :data:`RECONNECT_IVL_MAX_MS`), giving up each dial after
:data:`DIAL_TIMEOUT_MS`, so a healed link carries messages again within about three seconds. What a
dropped connection had in flight is lost, as on any control link that fails: every exchange that
matters has its own timeout in the roles.

Invariants: sockets are closed exactly once (``close()`` is idempotent); nothing here interprets a
message, it only moves bytes; with a keyring no message from an unauthenticated peer is delivered.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from ..errors import PeerError
from . import messages as m
from .auth import Keyring, is_loopback, split_address, z85_to_hex
from .trust import key_problem

log = logging.getLogger("kvxfer.control")
ZAP_DOMAIN = "kvxfer"
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_MAX_BOUND = 65536
ONCE_LINGER_MS = 1000  # a one-off answer's socket, closed at once, delivers for at most this long
ONCE_WINDOW_S = 1.0
MAX_ONCE = 1024  # one-off answers per ONCE_WINDOW_S; more are not sent (a flood of strangers)
# the control connections' own liveness (ZMTP heartbeats and dialling; see the module docstring)
PING_IVL_MS = 1000
# A connection silent this long (no ping answered), or with data unacknowledged this long (TCP_USER_TIMEOUT),
# is dropped and dialled again. Dropping loses what its socket still held (a META, a RESULT), so a blip
# shorter than this is left to TCP's retransmissions, which deliver it after the heal; longer cuts fail
# the requests on that peer anyway (its data connection fails after as long, kvxfer/transport/tcp.py).
PING_TIMEOUT_MS = 10_000
UNACKED_MAX_MS = PING_TIMEOUT_MS
RECONNECT_IVL_MS = 200
RECONNECT_IVL_MAX_MS = 1000
# A TCP connect not established by then is abandoned and tried again: a dial begun during a partition
# would otherwise wait out SYN retransmissions (1, 3, 7, 15, 31 s) after the heal. Two seconds leave room
# for one retransmitted SYN (a listener whose backlog overflowed in a storm of peers drops the first).
DIAL_TIMEOUT_MS = 2000
LISTEN_BACKLOG = 1024  # the ROUTER's listen backlog (ZMQ's default is 100): hundreds of peers dial at once


def zmq_bind_host(host: str) -> tuple[str, bool]:
    """``host`` as a ZMQ tcp endpoint's host, and whether the socket needs IPv6 for it: ``""`` and ``*``
    bind every IPv4 interface, an IPv6 address (``::`` every interface, dual-stack) is bracketed."""
    bare = host.strip().strip("[]")
    if bare in ("", "*"):
        return "*", False
    if ":" in bare:
        return f"[{bare}]", True
    return bare, False


def unmapped(address: str) -> str:
    """An IPv4 peer's address as IPv4 when a dual-stack socket reports it IPv4-mapped (``::ffff:a.b.c.d``)."""
    if isinstance(address, str) and address.lower().startswith("::ffff:") and "." in address:
        return address[7:]
    return address


def keep_alive(sock: zmq.Socket, *, dialler: bool) -> None:
    """ZMTP heartbeats on ``sock`` (both ends of a control connection) and, on a ``dialler`` (a DEALER),
    quick redials: a connection that stalls is dropped within :data:`PING_TIMEOUT_MS` and the next
    dial after the network heals succeeds within about :data:`DIAL_TIMEOUT_MS` +
    :data:`RECONNECT_IVL_MAX_MS`."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, PING_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, PING_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, PING_TIMEOUT_MS)
    sock.setsockopt(zmq.TCP_MAXRT, UNACKED_MAX_MS)  # TCP_USER_TIMEOUT on Linux
    if dialler:
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        sock.setsockopt(zmq.CONNECT_TIMEOUT, DIAL_TIMEOUT_MS)


class _Gatekeeper(ThreadAuthenticator):
    """ZAP handler: admits a CURVE client only if the keyring trusts its key; reports denials."""

    def __init__(self, ctx: zmq.Context, keyring: Keyring, on_denied: Any) -> None:
        super().__init__(ctx, log=logging.getLogger("kvxfer.control.zap"))
        self._keyring = keyring
        self._on_denied = on_denied
        self._address = "?"

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        self._address = msg[3].decode("utf-8", "replace") if len(msg) > 3 else "?"
        await super().handle_zap_message(msg)

    def callback(self, domain: str, key: bytes) -> bool:  # the credentials provider
        trusted = self._keyring.is_trusted(key)
        if not trusted:
            self._on_denied(key, self._address)
        return trusted


class ControlPlane:
    """One engine's control sockets: its bound ROUTER (``address``) and a DEALER per peer it sends to.

    Moves encoded messages only; with a keyring, only authenticated peers' messages are delivered."""

    def __init__(self, engine_id: str, *, host: str = "127.0.0.1", port: int = 0,
                 keyring: Keyring | None = None, advertise: str | None = None) -> None:
        """Bind ``host`` (``port``, or any free one); ``address`` names ``advertise`` (default ``host``),
        what peers connect to (:mod:`kvxfer.wire.addresses`)."""
        self.engine_id = engine_id
        self.keyring = keyring
        self.events: collections.deque[tuple[str, dict[str, Any]]] = collections.deque(maxlen=10_000)
        self._ctx = zmq.Context()
        self._gate: _Gatekeeper | None = None
        self._monitor: zmq.Socket | None = None
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, m.MAX_MESSAGE_BYTES + 4096)
        self._router.setsockopt(zmq.RCVHWM, 100_000)
        # A peer that closes its socket to us and opens a new one under the same engine id (a prefill
        # forgetting a decode, then telling it "not peered") must be heard on the new one. Without
        # handover, a ROUTER that has not yet read the old connection's last messages refuses the new
        # one's id as a duplicate and parks it: nothing from it is delivered, ever. This ROUTER only
        # receives (answers go out on DEALERs), so handing the id over redirects no reply; with a
        # keyring each message is still checked against the key its id is bound to (_authenticated).
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        keep_alive(self._router, dialler=False)
        self._router.setsockopt(zmq.BACKLOG, LISTEN_BACKLOG)
        if keyring is not None:
            self._gate = _Gatekeeper(self._ctx, keyring, self._denied)
            self._gate.start()
            self._gate.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self._gate)
            self._router.curve_server = True
            self._router.curve_publickey = keyring.public
            self._router.curve_secretkey = keyring.secret
            self._router.zap_domain = ZAP_DOMAIN.encode()
            self._monitor = self._router.get_monitor_socket(_HANDSHAKE_FAILED)
        bind_host, ipv6 = zmq_bind_host(host)
        self._router.setsockopt(zmq.IPV6, int(ipv6))
        try:
            if port:
                self._router.bind(f"tcp://{bind_host}:{port}")
            else:
                port = self._router.bind_to_random_port(f"tcp://{bind_host}")
        except zmq.ZMQError:
            self._shutdown_sockets()
            raise
        shown = advertise or host
        self.endpoint = f"tcp://[{shown}]:{port}" if ":" in shown and not shown.startswith("[") else \
            f"tcp://{shown}:{port}"
        self.address = keyring.address(self.endpoint) if keyring is not None else self.endpoint
        self._bound: dict[str, bytes] = {}  # routing identity -> the client key it authenticated with
        self._sources: dict[str, str] = {}  # routing identity -> the IP its first message came from
        self._out: dict[str, tuple[zmq.Socket, threading.Lock]] = {}
        self._once: collections.deque[float] = collections.deque()  # when recent one-off answers went
        self._out_lock = threading.Lock()
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        if self._monitor is not None:
            self._poller.register(self._monitor, zmq.POLLIN)
        self._closed = False
        self.sent = 0
        self.received = 0
        if keyring is None:
            beyond = "" if is_loopback(host) else (" (a non-loopback address, allowed by allow_open_control: "
                                                   "give the engine a keyring instead)")
            log.warning("%s: control plane is NOT authenticated (no keyring): any host that reaches %s can "
                        "peer with this engine%s", engine_id, self.endpoint, beyond)

    def _denied(self, key: bytes, address: str) -> None:
        """ZAP thread: a handshake with an untrusted key (appended; the control thread reports it)."""
        self.events.append(("auth_denied", {"peer_address": address, "client_key": z85_to_hex(key),
                                            "why": "public key not in this engine's keyring"}))

    def _dealer(self, address: str) -> tuple[zmq.Socket, threading.Lock]:
        with self._out_lock:
            if self._closed:
                raise PeerError("control plane is closed")
            entry = self._out.get(address)
            if entry is None:
                entry = (self._open_dealer(address, self.engine_id.encode()), threading.Lock())
                self._out[address] = entry
            return entry

    def _open_dealer(self, address: str, identity: bytes | None, *, hwm: int = 100_000) -> zmq.Socket:
        """A DEALER connected to ``address`` under routing ``identity`` (CURVE with a keyring); with
        None the peer's ROUTER makes one up for the connection."""
        endpoint, server_key = split_address(address)
        why = key_problem(address, self.keyring)
        if why is not None:
            raise PeerError(f"refusing to connect to {address[:200]}: {why}")
        sock = self._ctx.socket(zmq.DEALER)
        try:
            if self.keyring is not None:
                sock.curve_serverkey = server_key
                sock.curve_publickey = self.keyring.public
                sock.curve_secretkey = self.keyring.secret
            if identity is not None:
                sock.setsockopt(zmq.IDENTITY, identity)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, hwm)
            keep_alive(sock, dialler=True)
            sock.setsockopt(zmq.IMMEDIATE, 0)
            sock.setsockopt(zmq.IPV6, int(endpoint.startswith("tcp://[")))
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            sock.close(0)
            raise PeerError(f"cannot connect to {address}: {exc}") from None
        return sock

    def send(self, address: str, msg: m.Message) -> None:
        """Queue ``msg`` for the engine at ``address``; raises :class:`PeerError` if it cannot."""
        data = m.encode(msg)
        self.send_raw(address, data)

    def send_raw(self, address: str, data: bytes) -> None:
        sock, lock = self._dealer(address)
        with lock:
            try:
                sock.send(data, zmq.NOBLOCK)
            except zmq.Again:
                raise PeerError(f"control queue to {address} is full (peer not reading?)") from None
            except zmq.ZMQError as exc:
                raise PeerError(f"cannot send to {address}: {exc}") from None
        self.sent += 1

    def send_once(self, address: str, msg: m.Message) -> bool:
        """Answer a peer this engine does not keep (a refused HELLO, another protocol version): one
        message over a socket of its own without a routing identity (the receiving ROUTER makes up a
        random one, so the answer does not name this engine), closed at once: it lingers at most
        :data:`ONCE_LINGER_MS` to deliver. At most :data:`MAX_ONCE` such answers per
        :data:`ONCE_WINDOW_S`; False (nothing sent) beyond that or when ``address`` is unusable."""
        data = m.encode(msg)
        now = time.monotonic()
        with self._out_lock:
            if self._closed:
                return False
            while self._once and self._once[0] <= now - ONCE_WINDOW_S:
                self._once.popleft()
            if len(self._once) >= MAX_ONCE:
                return False
            try:
                sock = self._open_dealer(address, None, hwm=16)
            except PeerError:
                return False
            self._once.append(now)
            try:
                sock.send(data, zmq.NOBLOCK)
                return True
            except zmq.ZMQError:
                return False
            finally:
                sock.close(ONCE_LINGER_MS)
                self.sent += 1

    def retain(self, addresses: set[str] | frozenset[str]) -> int:
        """Close the per-peer sockets of every address not in ``addresses`` (peers forgotten, answers
        to peers never kept); returns how many were closed."""
        with self._out_lock:
            stale = [self._out.pop(a) for a in list(self._out) if a not in addresses]
        for sock, lock in stale:
            with lock:
                sock.close(0)
        return len(stale)

    def open_sockets(self) -> int:
        """Per-peer sockets this plane holds toward others, for bookkeeping and tests."""
        with self._out_lock:
            return len(self._out)

    def addresses(self) -> frozenset[str]:
        """The addresses this plane holds a per-peer socket to (the engine closes those it no longer
        uses: :meth:`forget`, :meth:`retain`)."""
        with self._out_lock:
            return frozenset(self._out)

    def receive(self, timeout_ms: int) -> list[tuple[str, bytes]]:
        """Messages that arrived within ``timeout_ms`` (control thread only)."""
        out: list[tuple[str, bytes]] = []
        if self._closed:
            return out
        ready = dict(self._poller.poll(timeout_ms))
        if self._monitor is not None and self._monitor in ready:
            self._read_monitor()
        if self._router not in ready:
            return out
        # ZMQ_EVENTS says whether another message waits: reading until zmq.Again raised an exception
        # at the end of every batch, which cold cost more than the read (twice per request).
        while True:
            try:
                if not self._router.get(zmq.EVENTS) & zmq.POLLIN:
                    break
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.ZMQError:  # zmq.Again included, or the socket closing: nothing more now
                break
            self.received += 1
            identity = frames[0].bytes.decode("utf-8", "replace") if frames else "?"
            if self.keyring is not None and not self._authenticated(identity, frames[-1]):
                continue
            if identity not in self._sources:  # the first message under an identity (HELLO): where it came from
                if len(self._sources) >= _MAX_BOUND:
                    self._sources.pop(next(iter(self._sources)))
                try:
                    self._sources[identity] = unmapped(frames[-1].get("Peer-Address"))
                except zmq.ZMQError:
                    self._sources[identity] = ""
            if len(frames) != 2:
                out.append((identity, b""))  # the decoder reports it as malformed
                continue
            out.append((identity, frames[1].bytes))
            if len(out) >= 1000:
                break
        return out

    def source_of(self, identity: str) -> str:
        """The IP address the first message under ``identity`` came from ("" if unknown)."""
        return self._sources.get(identity, "")

    def _authenticated(self, identity: str, frame: zmq.Frame) -> bool:
        """Bind ``identity`` to the key it authenticated with; refuse it under any other key."""
        try:
            key = frame.get("User-Id").encode()
        except (zmq.ZMQError, AttributeError):  # pragma: no cover - CURVE always sets it
            key = b""
        bound = self._bound.get(identity)
        if bound is None:
            if len(self._bound) >= _MAX_BOUND:
                self._bound.pop(next(iter(self._bound)))
            self._bound[identity] = key
            return True
        if bound == key:
            return True
        self.events.append(("impersonation_refused", {
            "peer": identity, "client_key": z85_to_hex(key) if len(key) == 40 else "?",
            "why": f"engine id {identity!r} is bound to key {z85_to_hex(bound)[:16]}..., "
                   f"this message came with another key ({self.keyring.label(key) if self.keyring else '?'})",
        }))
        return False

    def _read_monitor(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        assert self._monitor is not None
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:
                return
            kind = {zmq.EVENT_HANDSHAKE_FAILED_AUTH: "denied by the key check",
                    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "security handshake failed (no or wrong mechanism)",
                    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "security handshake failed"}.get(event["event"])
            if kind is not None and event["event"] != zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                # AUTH failures were already reported, with the key, by the ZAP handler
                self.events.append(("auth_denied", {"why": kind, "code": event.get("value"),
                                                    "endpoint": event.get("endpoint", b"").decode("utf-8", "replace")}))

    def drain_events(self) -> list[tuple[str, dict[str, Any]]]:
        out = []
        while self.events:
            out.append(self.events.popleft())
        return out

    def forget(self, address: str) -> None:
        with self._out_lock:
            entry = self._out.pop(address, None)
        if entry is not None:
            with entry[1]:
                entry[0].close(0)

    def close(self) -> None:
        with self._out_lock:
            if self._closed:
                return
            self._closed = True
            entries = list(self._out.values())
            self._out.clear()
        for sock, lock in entries:
            with lock:
                sock.close(0)
        self._shutdown_sockets()

    def _shutdown_sockets(self) -> None:
        if self._monitor is not None:
            self._router.disable_monitor()
            self._monitor.close(0)
            self._monitor = None
        self._router.close(0)
        if self._gate is not None:
            self._gate.stop()
            self._gate = None
        self._ctx.term()
