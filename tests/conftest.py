"""Shared fixtures: real engines on loopback (real ZMQ and TCP sockets), checked after every test."""

from __future__ import annotations

import logging
import os
import random
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest

from kvxfer import DecodeEngine, EngineConfig, KVLayout, PrefillEngine
from kvxfer.transport import faults as faults_mod
from kvxfer.transport.faults import FaultInjector
from kvxfer.wire.auth import Keyring

faults_mod.enable()
logging.getLogger("kvxfer").setLevel(logging.INFO)

# Process hygiene: every process the suite starts inherits this marker (children copy os.environ), so
# whatever still carries it when the session ends, pytest itself aside, was left behind by a test.
SESSION_MARKER = "KVXFER_TEST_SESSION"
os.environ[SESSION_MARKER] = uuid.uuid4().hex

ITEM = 1024
BUFFERS = 3
PAGE_TOKENS = 16


def make_layout(pages: int, *, buffers: int = BUFFERS, item: int = ITEM, page_size: int = PAGE_TOKENS) -> KVLayout:
    return KVLayout.allocate(num_buffers=buffers, item_len=item, num_pages=pages, page_size=page_size)


def fill_random(layout: KVLayout, pages: np.ndarray, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for view in layout.views():
        view[pages] = rng.integers(0, 256, size=(len(pages), view.shape[1]), dtype=np.uint8)


def free_port_pair() -> int:
    """A free TCP port whose successor is free too (a tool that serves on PORT and PORT + 1)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no two consecutive free ports")


def read_in_background(sock: socket.socket, total: int) -> tuple[threading.Thread, bytearray]:
    """A started thread reading ``sock`` into the returned bytearray until ``total`` bytes or EOF (join it)."""
    got = bytearray()

    def read() -> None:
        while len(got) < total:
            chunk = sock.recv(1 << 20)
            if not chunk:
                return
            got.extend(chunk)

    reader = threading.Thread(target=read)
    reader.start()
    return reader, got


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


@dataclass
class Pair:
    prefill: PrefillEngine
    decode: DecodeEngine
    peer: str
    faults: FaultInjector | None

    @property
    def link(self) -> Any:
        """The prefill's data link (the decode may see the connection a moment before the prefill
        has stored it)."""
        wait_for(lambda: self.prefill.peers[self.decode.engine_id].link is not None, timeout=5,
                 what="the prefill's data link")
        return self.prefill.peers[self.decode.engine_id].link

    def wait_reconnected(self, old_epoch: int, *, timeout: float = 10.0) -> None:
        """Both halves hold one data connection newer than epoch ``old_epoch``: the decode's (CONNECT and
        ACCEPT both arrived: ``PeerInfo.connected``) and the prefill's live link of that epoch."""
        def agreed() -> bool:
            info = self.decode.receiver.peers.get(self.peer)
            link = self.prefill.peers[self.decode.engine_id].link
            return (info is not None and info.connected and info.epoch > old_epoch and link is not None
                    and link.alive and link.epoch == info.epoch)

        wait_for(agreed, timeout=timeout, what=f"both halves on a data connection newer than epoch {old_epoch}")

    def transfer(self, rid: Any, tokens: int, *, seed: int = 0) -> np.ndarray:
        """Admit on both sides, fill the source pages, send, wait until readable; returns src pages."""
        self.prefill.admit(rid, tokens, peer=self.decode.engine_id)
        self.decode.admit(rid, tokens, peer=self.peer)
        self.prefill.wait_ready(rid)
        src = self.prefill.source_pages(rid)
        fill_random(self.prefill.layout, src, seed)
        self.prefill.send(rid)
        return src

    def expect_content(self, rid: Any, src: np.ndarray) -> None:
        with self.decode.read(rid) as kv:
            for b in range(self.decode.layout.num_buffers):
                assert np.array_equal(kv.buffer(b), self.prefill.layout.views()[b][src])


VERBS_IN_VM = ("verbs: no RDMA device on this host; these run inside the soft-RoCE VM "
               "(tools/softroce/run, .ci/run does it)")


def verbs_skip_reason() -> str | None:
    """Why the verbs tests cannot run here, or None when they can. Without an RDMA device the answer
    is the VM, whatever else is missing (CI installs pyverbs and still has no device on the host);
    with a device, the transport's own reason (e.g. pyverbs not importable) is the one to act on."""
    from kvxfer.transport import registry

    try:
        ok, why = registry.available("verbs")
    except ImportError as exc:
        ok, why = False, str(exc)
    if ok:
        return None
    try:
        devices = os.listdir("/sys/class/infiniband")
    except OSError:
        devices = []
    return f"verbs: {why}" if devices else VERBS_IN_VM


def transport_params() -> list[Any]:
    """One pytest param per registered transport; verbs carries the ``verbs`` mark (it runs inside the
    soft-RoCE VM), and a transport this machine cannot run is skipped with the reason."""
    from kvxfer.transport import registry

    params = []
    for name in registry.names():
        marks: list[Any] = [pytest.mark.verbs] if name == "verbs" else []
        if name == "verbs":
            reason = verbs_skip_reason()
        else:
            try:
                ok, why = registry.available(name)
            except ImportError as exc:
                ok, why = False, str(exc)
            reason = None if ok else f"transport {name} unavailable here: {why}"
        if reason:
            marks.append(pytest.mark.skip(reason=reason))
        params.append(pytest.param(name, marks=marks, id=name))
    return params


@pytest.fixture(params=transport_params())
def transport(request: pytest.FixtureRequest) -> str:
    """The transport a suite runs over: a module with ``pytestmark = pytest.mark.usefixtures("transport")``
    runs every test once per registered transport (the ``engines`` pairs use it)."""
    return request.param


def needs(pair: Any, capability: str) -> None:
    """Skip the test unless the pair's transport declares ``capability`` (kvxfer.transport.base.Capabilities)."""
    caps = pair.decode.capabilities
    if not getattr(caps, capability):
        pytest.skip(f"transport {pair.decode.config.transport} has no {capability}")


LAYERS = ((0, 1), (2,))  # the "layers" of make_layout's BUFFERS buffers for layer-wise sends: K+V, and one more


def send_layerwise(prefill: PrefillEngine, *, seed: int = 0) -> None:
    """Make every ``prefill.send(...)`` a layer-wise send: the same chunk, one real call per layer, the
    layers in a new random order each time (seeded): ``send_layer(rid, layer, ...)`` for each layer
    of the layout's geometry, or ``send(..., buffers=layer)`` for each of :data:`LAYERS` without one.
    What the caller gets back is the last call's; an error comes from the first call that raises, as
    a whole-request send's would."""
    rng = random.Random(seed)
    whole = type(prefill).send.__get__(prefill)
    geometry = prefill.layout.geometry

    def one_layer(rid: Any, src_pages: Any, layer: Any, kwargs: dict[str, Any]) -> Any:
        if geometry is not None:
            return prefill.send_layer(rid, layer, src_pages, **kwargs)
        return whole(rid, src_pages, buffers=list(layer), **kwargs)

    def send(rid: Any, src_pages: Any = None, **kwargs: Any) -> Any:
        if kwargs.get("buffers") is not None:
            return whole(rid, src_pages, **kwargs)
        layers = list(geometry.layers if geometry is not None else LAYERS)
        rng.shuffle(layers)
        result = None
        for layer in layers:
            result = one_layer(rid, src_pages, layer, kwargs)
        return result

    prefill.send = send  # type: ignore[method-assign]


@pytest.fixture(params=["whole", "layerwise"])
def send_mode(request: pytest.FixtureRequest) -> str:
    """How the suite's prefills send: whole chunks, or each chunk layer by layer (:func:`send_layerwise`).
    A module with ``usefixtures("send_mode")`` runs every test both ways (the ``engines`` pairs use it)."""
    return request.param


@pytest.fixture
def engines(request: pytest.FixtureRequest) -> Iterator[Callable[..., Pair]]:
    """Factory of connected (prefill, decode) pairs; every engine's accounting is checked at teardown.
    Over the test's ``transport`` when it uses that fixture, else tcp."""
    made: list[Any] = []
    default_transport = request.getfixturevalue("transport") if "transport" in request.fixturenames else "tcp"
    layerwise = "send_mode" in request.fixturenames and request.getfixturevalue("send_mode") == "layerwise"

    def factory(
        *,
        prefill_pages: int = 64,
        decode_pages: int = 128,
        max_context: int | None = None,
        allow_undersized: bool = False,
        decode_config: dict[str, Any] | None = None,
        prefill_config: dict[str, Any] | None = None,
        keyed: bool = True,
        fault_injection: bool = True,
        **common: Any,
    ) -> Pair:
        context = max_context or prefill_pages * PAGE_TOKENS
        common.setdefault("transport", default_transport)
        if common["transport"] == "verbs":
            common.setdefault("peer_timeout", 60.0)  # the emulated VM can stall a heartbeat for seconds
        base = EngineConfig(max_context=context, heartbeat_interval=0.2, **common)
        faults = FaultInjector(seed=1) if fault_injection else None  # None: the links run as in production
        rings = Keyring.cluster(["prefill", "decode"]) if keyed else {"prefill": None, "decode": None}
        pcfg = replace(base, **{"allow_undersized_pool": allow_undersized, "keyring": rings["prefill"],
                                **(prefill_config or {})})
        dcfg = replace(base, **{"keyring": rings["decode"], **(decode_config or {})})
        prefill = PrefillEngine(make_layout(prefill_pages), pcfg, faults=faults)
        made.append(prefill)
        if layerwise:
            send_layerwise(prefill, seed=len(made))
        decode = DecodeEngine(make_layout(decode_pages), dcfg)
        made.append(decode)
        peer = decode.connect(prefill.address)
        return Pair(prefill, decode, peer, faults)

    yield factory
    close_checked(made)


def close_checked(made: list[Any]) -> None:
    """Check every engine's pool accounting (faults resumed first), close them all, newest first, and
    fail naming each engine whose accounting was broken."""
    errors = []
    for engine in made:
        if engine.faults is not None:
            engine.faults.resume()
        try:
            if not engine._closed:
                engine.check_accounting()
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(f"{engine.role} {engine.engine_id}: {exc}")
    for engine in reversed(made):
        engine.close()
    assert not errors, "pool accounting invariant broken: " + "; ".join(errors)


def processes_carrying(name: str, value: str) -> dict[int, str]:
    """PID -> command line of every live process whose environment holds ``name=value`` (Linux /proc)."""
    entry = f"{name}={value}".encode()
    found: dict[int, str] = {}
    if not os.path.isdir("/proc"):
        return found
    for pid in (int(n) for n in os.listdir("/proc") if n.isdigit()):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if entry not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                found[pid] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind() -> Iterator[None]:
    """At the end of the session, fail if a process the suite started is still running (and kill it)."""
    yield
    deadline = time.monotonic() + 15  # processes being stopped right now get time to finish
    while True:
        left = {pid: cmd for pid, cmd in processes_carrying(SESSION_MARKER, os.environ[SESSION_MARKER]).items()
                if pid != os.getpid()}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if left:
        pytest.fail("processes left behind by the test session (now killed): "
                    + "; ".join(f"{pid}: {cmd[:200]}" for pid, cmd in sorted(left.items())), pytrace=False)


@pytest.fixture
def two_hosts() -> Iterator[Any]:
    """Two hosts on this machine (:class:`kvxfer.tools.netns.TwoHosts`: two network namespaces joined by a
    veth, addresses in 198.18.0.0/15); skipped, with the reason, where namespaces cannot be made (not
    root, no ``ip``/``tc``). Closed after the test, which fails if either namespace is left."""
    from kvxfer.tools import netns

    ok, why = netns.available()
    if not ok:
        pytest.skip(f"two hosts: {why}")
    hosts = netns.TwoHosts()
    try:
        yield hosts
    finally:
        hosts.close()
    left = set(hosts.namespaces) & set(netns.list_namespaces())
    assert not left, f"namespaces left behind: {sorted(left)}"
