"""The control plane: ZMQ sockets carrying :mod:`kvxfer.wire.messages` between engines.

Each engine binds one ROUTER socket (its control address) and opens one DEALER per peer address,
with the engine id as its routing identity, so every inbound message arrives as
``(sender engine id, bytes)``. Only the engine's control thread receives; sends may come from any
thread and are serialised per socket. ZMQ's own ``MAXMSGSIZE`` drops oversized messages before they
reach the decoder, and sends never block: a full queue raises :class:`PeerError`.

Invariants: sockets are closed exactly once (``close()`` is idempotent); nothing here interprets a
message, it only moves bytes.
"""

from __future__ import annotations

import logging
import threading

import zmq

from .errors import PeerError
from .wire import messages as m

log = logging.getLogger("kvxfer.control")


class ControlPlane:
    def __init__(self, engine_id: str, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.engine_id = engine_id
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, m.MAX_MESSAGE_BYTES + 4096)
        self._router.setsockopt(zmq.RCVHWM, 100_000)
        if port:
            self._router.bind(f"tcp://{host}:{port}")
        else:
            port = self._router.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._out: dict[str, tuple[zmq.Socket, threading.Lock]] = {}
        self._out_lock = threading.Lock()
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._closed = False
        self.sent = 0
        self.received = 0

    def _dealer(self, address: str) -> tuple[zmq.Socket, threading.Lock]:
        with self._out_lock:
            if self._closed:
                raise PeerError("control plane is closed")
            entry = self._out.get(address)
            if entry is None:
                sock = self._ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.IDENTITY, self.engine_id.encode())
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 100_000)
                sock.setsockopt(zmq.IMMEDIATE, 0)
                sock.connect(address)
                entry = (sock, threading.Lock())
                self._out[address] = entry
            return entry

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

    def receive(self, timeout_ms: int) -> list[tuple[str, bytes]]:
        """Messages that arrived within ``timeout_ms`` (control thread only)."""
        out: list[tuple[str, bytes]] = []
        if self._closed or not self._poller.poll(timeout_ms):
            return out
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            except zmq.ZMQError:
                return out
            self.received += 1
            if len(frames) != 2:
                identity = frames[0].decode("utf-8", "replace") if frames else "?"
                out.append((identity, b""))  # the decoder reports it as malformed
                continue
            out.append((frames[0].decode("utf-8", "replace"), frames[1]))
            if len(out) >= 1000:
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
        self._router.close(0)
        self._ctx.term()
