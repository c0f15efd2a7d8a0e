"""Engine nodes: one engine per OS process, driven over a small RPC, for the demo and stress tools.

A node owns its memory (a freshly allocated, pre-faulted layout), one engine and a ZMQ REP socket.
The parent (the "scheduler") spawns it with :func:`spawn`, which reads the node's first stdout line
(its addresses) and returns a :class:`NodeClient`. RPC calls are msgpack ``[method, kwargs]``;
answers are ``[true, result]`` or ``[false, {code, message}]`` and the client re-raises the same
:mod:`kvxfer.errors` class, so a rejection in the child reads exactly as it would in-process.

The node fills and checks page contents with :mod:`kvxfer.tools.oracle` (a layout with a geometry, one
tensor-parallel rank's: cell by cell with :mod:`kvxfer.tools.head_oracle`), so what a test asserts is
the bytes the decode process actually holds, not a status code.

A node never outlives its parent (:mod:`kvxfer.tools.procs`): it watches the parent's lifeline, and SIGTERM
or SIGINT (from the parent, a terminal, or the kernel when the parent dies) closes its engine before
it exits with status 128 + N.

A node can run on another "host": ``spawn(spec, netns=hosts.a)`` starts it inside a network namespace
of a :class:`kvxfer.tools.netns.TwoHosts` (``ip netns exec`` execs it, so it is still this process's
child, with the same lifeline). Its engine then binds that host's address (``config["host"]``, unless
the spec names one), and its RPC socket is a unix socket in a temporary directory of the parent's
(``NodeSpec.rpc = "ipc"``: a path crosses network namespaces, loopback TCP does not); the directory
is removed when the client closes, or by the children if the parent dies first. Without ``netns``
the RPC stays on loopback TCP. :meth:`NodeClient.kill`, :meth:`NodeClient.suspend` and
:meth:`NodeClient.resume` signal the node process (SIGKILL, SIGSTOP, SIGCONT) for chaos tests.
"""

from __future__ import annotations

import argparse
import enum
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

import msgpack
import numpy as np
import zmq

from ..core.geometry import KVGeometry
from ..core.layout import KVLayout
from ..engine import DecodeEngine, EngineConfig, PrefillEngine
from ..errors import ERROR_CLASSES, ConfigError, KvxferError, PeerError
from ..transport import faults as faults_mod
from . import head_oracle, oracle, procs

log = logging.getLogger("kvxfer.tools.node")


@dataclass
class NodeSpec:
    """Everything an engine node process needs to start (sent to it as JSON): role, KV layout, engine
    config, fault injection, seed and log level. ``geometry`` (:meth:`KVGeometry.wire` form) gives the
    layout a geometry (its buffers then follow it, ``num_buffers`` and ``item_len`` must agree): the
    node's pages are filled and checked cell by cell (:mod:`kvxfer.tools.head_oracle`)."""

    role: str
    num_buffers: int
    item_len: int
    num_pages: int
    page_size: int
    config: dict[str, Any] = field(default_factory=dict)
    faults: dict[str, Any] | None = None
    seed: int = 0
    log_level: str = "WARNING"
    geometry: list[Any] | None = None
    rpc: str = "tcp"  # "tcp": the RPC socket on loopback; "ipc": a unix socket in rpc_dir (crosses namespaces)
    rpc_dir: str | None = None  # "ipc": the directory of the socket (spawn makes one when it is None)
    rpc_host: str = "127.0.0.1"  # "tcp": the address the RPC socket binds (another machine's: its management link)


RPC_KINDS = ("tcp", "ipc")
_UNIX_PATH_MAX = 107  # bytes of a unix socket's path (sun_path, less its NUL)


# the child ---------------------------------------------------------------------------------------


class _Node:
    def __init__(self, spec: NodeSpec) -> None:
        self.spec = spec
        if spec.rpc not in RPC_KINDS or (spec.rpc == "ipc" and not spec.rpc_dir):
            raise ConfigError(f"{spec.role} node: rpc must be 'tcp' or 'ipc' with an rpc_dir, got {spec.rpc!r} "
                              f"(rpc_dir {spec.rpc_dir!r})")
        geometry = KVGeometry.from_wire(spec.geometry) if spec.geometry else None
        self.layout = KVLayout.allocate(
            num_buffers=spec.num_buffers, item_len=spec.item_len, num_pages=spec.num_pages, page_size=spec.page_size,
            geometry=geometry,
        )
        if geometry is not None and (self.layout.num_buffers != spec.num_buffers
                                     or any(int(x) != spec.item_len for x in self.layout.item_lens)):
            raise ConfigError(f"{spec.role} node: the geometry describes {self.layout.num_buffers} buffers of "
                              f"{sorted(set(map(int, self.layout.item_lens)))} B/page, the spec says "
                              f"{spec.num_buffers} of {spec.item_len}")
        config = EngineConfig(**spec.config)
        self.faults = None
        if spec.faults is not None:
            faults_mod.enable()
            self.faults = faults_mod.FaultInjector(faults_mod.FaultConfig.from_dict(spec.faults), seed=spec.seed)
        cls = PrefillEngine if spec.role == "prefill" else DecodeEngine
        self.engine: Any = cls(self.layout, config, faults=self.faults)
        self.ctx = zmq.Context()
        self.rep = self.ctx.socket(zmq.REP)
        self.rep.setsockopt(zmq.LINGER, 0)
        if spec.rpc == "ipc":
            self.rpc_address = f"ipc://{os.path.join(spec.rpc_dir or '.', 'rpc')}"
            self.rep.bind(self.rpc_address)
        else:
            host = f"[{spec.rpc_host}]" if ":" in spec.rpc_host else spec.rpc_host
            port = self.rep.bind_to_random_port(f"tcp://{host}")
            self.rpc_address = f"tcp://{host}:{port}"

    def serve(self) -> None:
        print(json.dumps({"rpc": self.rpc_address, "control": self.engine.address, "engine": self.engine.engine_id,
                          "metrics": getattr(self.engine, "metrics_address", None)}), flush=True)
        running = True
        while running:
            if not self.rep.poll(200):  # wake up regularly, so a stop signal's handler runs promptly
                continue
            method, kwargs = msgpack.unpackb(self.rep.recv(), raw=False)
            try:
                result = getattr(self, f"rpc_{method}")(**kwargs)
                reply = [True, result]
            except KvxferError as exc:
                reply = [False, {"code": exc.code, "message": exc.detail, "rid": _plain(exc.rid),
                                 "generation": exc.generation, "reason": getattr(exc, "reason", None),
                                 "check": getattr(exc, "check", None), "text": str(exc)}]
            except Exception as exc:  # report, keep serving
                log.exception("rpc %s failed", method)
                reply = [False, {"code": "error", "message": f"{type(exc).__name__}: {exc}", "text": str(exc)}]
            self.rep.send(msgpack.packb(reply, use_bin_type=True, default=_plain))
            running = method != "shutdown"

    def close(self) -> None:
        """Close the engine, then the RPC socket (idempotent)."""
        try:
            self.engine.close()
        finally:
            self.rep.close(0)
            if not self.ctx.closed:
                self.ctx.term()

    # common ----------------------------------------------------------------------------------
    def rpc_ping(self) -> str:
        return self.engine.engine_id

    def rpc_stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def rpc_accounting(self) -> dict[str, int]:
        return self.engine.check_accounting()

    def rpc_status(self, rid: Any) -> dict[str, Any]:
        req = self.engine.status(rid)
        return _describe(req)

    def rpc_statuses(self, rids: list[Any]) -> dict[str, Any]:
        """Many statuses in one call (the stress driver polls with this); unknown ids are omitted.

        Keys are ``repr(rid)`` so int and str ids stay distinct across msgpack."""
        out = {}
        with self.engine.lock:
            for rid in rids:
                try:
                    req = self.engine.status(rid)
                except KvxferError:
                    continue
                described = _describe(req)
                if self.spec.role == "prefill":
                    described["settled"] = self.engine.sender.settled(req)
                out[repr(rid)] = described
        return out

    def rpc_abort(self, rid: Any, reason: str = "aborted by caller") -> dict[str, Any]:
        return _describe(self.engine.abort(rid, reason))

    def rpc_wait(self, rid: Any, timeout: float = 30.0) -> dict[str, Any]:
        return _describe(self.engine.wait(rid, timeout=timeout))

    def rpc_fault(self, op: str, **kwargs: Any) -> Any:
        if self.faults is None:
            if op == "counts":  # nothing injected, nothing fired
                return {}
            raise KvxferError("this node runs without fault injection")
        if op == "pause":
            self.faults.pause()
        elif op == "resume":
            self.faults.resume()
        elif op == "flip_next":
            self.faults.flip_next_write(kwargs.get("count", 1))
        elif op == "capture_next":
            self.faults.capture_next_write()
        elif op == "replay_captured":
            frames = self.faults.take_captured()
            link = next(p.link for p in self.engine.peers.values() if p.link is not None)
            for frame in frames:
                link.post_raw(frame)
            return len(frames)
        elif op == "configure":
            for name, value in kwargs.items():
                setattr(self.faults.config, name, value)
        elif op == "counts":
            return dict(self.faults.counts)
        elif op == "write_via_stale_link":
            return self._write_via_stale_link(kwargs["pages"])
        else:
            raise KvxferError(f"unknown fault operation {op!r}")
        return None

    def _write_via_stale_link(self, pages: list[int]) -> dict[str, Any]:
        """Verbs: post a one-page write toward ``pages[0]`` on a fenced queue pair (a late writer)."""
        import time as _time

        from ..transport import verbs

        if not self.faults.stale_links:
            raise KvxferError("no fenced link kept (configure keep_fenced_links first)")
        link = self.faults.stale_links.pop()
        item = int(self.layout.item_lens[0])
        free = np.flatnonzero(np.asarray(self.engine.pool.ledger.state) == 0)
        if free.size == 0:
            raise KvxferError("no free source page to write garbage from")
        spare = int(free[-1])  # garbage from a page the engine is not using
        self.layout.views()[0][spare] = 0xEE
        endpoint = link.endpoint
        dst = int(link._remote_addr[0]) + int(pages[0]) * item
        src = self.layout.buffers[0].address + spare * item
        endpoint.post_writes(1 << 40, np.array([src], dtype=np.uint64),
                             np.array([item], dtype=np.uint64), link.device.buffer_lkey[:1],
                             np.array([dst], dtype=np.uint64), link._remote_rkey[:1], -1)
        def poll_for(seconds: float) -> list[int]:
            out: list[int] = []
            deadline = _time.monotonic() + seconds
            while not out and _time.monotonic() < deadline:
                out = [int(r["status"]) for r in endpoint.poll()]
                _time.sleep(0.01)
            return out

        silent = poll_for(3.0)  # a real HCA retries and fails here; soft-RoCE stays silent
        endpoint.to_error()  # the writer acts on the fence: whatever it still had posted flushes
        statuses = silent + poll_for(20.0)
        link.close(flush=False)
        return {"statuses": statuses, "failed": bool(statuses) and verbs.WC_SUCCESS not in statuses}

    def rpc_shutdown(self) -> None:
        self.engine.close()

    # benchmark -----------------------------------------------------------------------------------
    def rpc_bench_start(self, requests: list[list[Any]], concurrency: int, peer: str | None = None,
                        peers: list[str] | None = None, busy_ms: float = 0.0) -> None:
        """Start this node's half of a benchmark in the background (see kvxfer.tools.bench_loops); a
        decode's ``peers``: the prefill ranks that write each request's heads; a prefill's ``busy_ms``:
        Python work after each send() (:func:`~kvxfer.tools.bench_loops.send_loop`)."""
        import threading

        from . import bench_loops as loops

        plan = [(str(rid), int(tokens)) for rid, tokens in requests]
        self._bench_result: dict[str, Any] | None = None

        def run() -> None:
            try:
                if self.spec.role == "decode":
                    writer = peer or (None if peers else self.engine.receiver.default_peer())
                    result = loops.receive_loop(self.engine, writer, plan, concurrency, peers=peers)
                else:
                    result = loops.send_loop(self.engine, plan, concurrency, busy_ms=busy_ms)
            except Exception as exc:  # reported to the driver
                result = {"error": f"{type(exc).__name__}: {exc}"}
            self._bench_result = result

        self._bench_thread = threading.Thread(target=run, daemon=True)
        self._bench_thread.start()

    def rpc_bench_wait(self, timeout: float = 600.0) -> dict[str, Any] | None:
        self._bench_thread.join(timeout)
        return self._bench_result

    def rpc_rss(self) -> dict[str, int]:
        """Resident memory of this process and the bytes of its registered regions."""
        import resource

        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        import mmap as _mmap

        regions = sum(r.nbytes for r in self.layout.regions)
        return {"rss": pages * _mmap.PAGESIZE, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "regions": regions}

    # decode ------------------------------------------------------------------------------------
    def rpc_connect(self, address: str, timeout: float = 10.0) -> str:
        return self.engine.connect(address, timeout=timeout)

    def rpc_admit(self, rid: Any, tokens: int, peer: str | None = None, peers: list[str] | None = None,
                  any_peer: bool = False) -> dict[str, Any]:
        """Admit on either role: ``peer`` names the one peer, ``peers`` every peer of a request of several
        tensor-parallel ranks (a decode: its writers in rank order; a prefill: the decode ranks it serves);
        ``any_peer`` lets a prefill's request bind to the first decode that sends its destination."""
        if self.spec.role == "decode":
            return _describe(self.engine.admit(rid, tokens, peer=peer, peers=peers))
        return _describe(self.engine.admit(rid, tokens, peer=peer, peers=peers, any_peer=any_peer))

    def rpc_read_check(self, rid: Any, seed: int = 0, release: bool = True) -> dict[str, Any]:
        """Read the request through the ownership-checked API and compare with the oracle (with a
        geometry: cell by cell, keyed by request id and its token count)."""
        with self.engine.read(rid) as kv:
            views = [kv.buffer(b) for b in range(self.layout.num_buffers)]
            if self.layout.geometry is not None:
                tokens = self.engine.status(rid).tokens
                report = head_oracle.check(self.layout, kv.pages, rid=rid, tokens=tokens, seed=seed, views=views)
            else:
                report = oracle.check(self.layout, kv.pages, rid=rid, gen=kv.generation, seed=seed, views=views)
        if release:
            self.engine.release(rid)
        return report.to_dict()

    def rpc_pages(self, rid: Any) -> list[int]:
        return [int(p) for p in self.engine.status(rid).pages]

    def rpc_release(self, rid: Any) -> None:
        self.engine.release(rid)

    # prefill -----------------------------------------------------------------------------------
    def rpc_prepare(self, rid: Any, seed: int = 0, timeout: float = 30.0) -> dict[str, Any]:
        """Wait for the destination, then 'compute' the KV: fill source pages with oracle bytes (with a
        geometry: this rank's heads of every token, cell by cell)."""
        req = self.engine.wait_ready(rid, timeout=timeout)
        if self.layout.geometry is not None:
            head_oracle.fill(self.layout, self.engine.source_pages(rid), rid=rid, tokens=req.tokens, seed=seed)
        else:
            oracle.fill(self.layout, req.pages, rid=rid, gen=req.gen, seed=seed)
        return _describe(req)

    def rpc_send(self, rid: Any, count: int | None = None, layer: int | None = None) -> dict[str, Any]:
        """The next ``count`` pages (default: all left); with ``layer`` only that layer's buffers: by the
        geometry's layers, or buffers ``2*layer`` and ``2*layer + 1`` (K and V) without one."""
        if layer is None:
            return _describe(self.engine.send(rid, count=count))
        geometry = self.layout.geometry
        buffers = geometry.layer_buffers(layer) if geometry is not None else [2 * layer, 2 * layer + 1]
        req = self.engine.status(rid)
        if req.buffer_sent is not None and (req.buffer_sent[buffers] >= req.total_pages).all():
            return _describe(req)  # the writer sent this layer whole already (a legacy placeholder's one page)
        if geometry is not None:
            return _describe(self.engine.send_layer(rid, layer, count=count))
        return _describe(self.engine.send(rid, count=count, buffers=buffers))


def _plain(value: Any) -> Any:
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (set, tuple)):
        return list(value)
    return value


def _describe(req: Any) -> dict[str, Any]:
    return {
        "rid": _plain(req.rid),
        "state": req.state.value,
        "gen": int(req.gen),
        "pages": int(len(req.pages)) if req.pages is not None else 0,
        "error": str(req.error) if req.error is not None else None,
        "error_code": req.error.code if req.error is not None else None,
        "check": getattr(req.error, "check", None),
        "reason": getattr(req.error, "reason", None),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvxfer.tools.node")
    parser.add_argument("spec", help="NodeSpec as JSON")
    args = parser.parse_args(argv)
    spec = NodeSpec(**json.loads(args.spec))
    logging.basicConfig(level=spec.log_level, stream=sys.stderr,
                        format=f"%(asctime)s {spec.role} %(levelname)s %(name)s: %(message)s")
    procs.adopt()
    procs.stop_on_signals()
    try:
        try:
            node = _Node(spec)
        except KvxferError as exc:
            print(json.dumps({"error": {"code": exc.code, "message": exc.detail, "text": str(exc)}}), flush=True)
            return 2
        except Exception as exc:  # memory it cannot have, a library missing: the parent shows its own words
            words = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
            message = f"{spec.role} node could not start: {type(exc).__name__}: {words}"
            log.error("%s", message)
            print(json.dumps({"error": {"code": "error", "message": message, "text": message}}), flush=True)
            return 2
        try:
            node.serve()
        finally:
            node.close()
    except procs.Interrupted as stop:
        log.info("stopped by %s", stop.name)
        return 128 + stop.signum
    return 0


# the parent ---------------------------------------------------------------------------------------


class RunState(enum.Enum):
    """The node process as its client left it: running, stopped by :meth:`NodeClient.suspend` (SIGSTOP),
    or ended (it exited, was killed, or the client closed it)."""

    RUNNING = "running"
    SUSPENDED = "suspended"
    ENDED = "ended"


class NodeClient:
    """Drives one node process. Calls re-raise the child's kvxfer errors.

    Invariants: a suspended node is always resumed before the client stops it (a stopped process
    would not act on the shutdown call or SIGTERM); the client's RPC directory (``ipc``) is removed
    when it closes."""

    def __init__(self, spec: NodeSpec, process: subprocess.Popen, info: dict[str, Any], *, timeout: float,
                 rpc_dir: procs.TempDir | None = None) -> None:
        self.spec = spec
        self.process = process
        self.run_state = RunState.RUNNING
        self._rpc_dir = rpc_dir
        self.control = info["control"]
        self.engine_id = info["engine"]
        self.metrics: str | None = info.get("metrics")
        self._rpc_address = info["rpc"]
        self._timeout = timeout
        self._abandoned = False  # a call went unanswered: the node may still be busy with it
        self._ctx = zmq.Context()
        self._sock = self._new_socket()

    def _new_socket(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, int(self._timeout * 1000))
        sock.connect(self._rpc_address)
        return sock

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def call(self, method: str, **kwargs: Any) -> Any:
        return self._call(method, kwargs, self._timeout)

    def _call(self, method: str, kwargs: dict[str, Any], timeout: float) -> Any:
        if not self.alive():
            raise PeerError(f"{self.spec.role} node (pid {self.pid}) is not running")
        try:
            self._sock.send(msgpack.packb([method, kwargs], use_bin_type=True, default=_plain))
            ok, result = msgpack.unpackb(self._receive(method, timeout), raw=False, strict_map_key=False)
        except BaseException:
            # no answer (timeout, a dead node, a stop signal): the REQ socket still waits for it, replace it
            self._abandoned = True
            self._sock.close(0)
            self._sock = self._new_socket()
            raise
        if ok:
            return result
        cls = ERROR_CLASSES.get(result.get("code"), KvxferError)
        exc = cls.__new__(cls)
        KvxferError.__init__(exc, result.get("message", ""), rid=result.get("rid"), generation=result.get("generation"))
        if result.get("reason") is not None:
            exc.reason = result["reason"]
        if result.get("check") is not None:
            exc.check = result["check"]
        raise exc

    def _receive(self, method: str, timeout: float) -> bytes:
        """The answer, or PeerError as soon as the node is gone or ``timeout`` has passed."""
        deadline = time.monotonic() + timeout
        while not self._sock.poll(100):
            if not self.alive():
                raise PeerError(f"{self.spec.role} node (pid {self.pid}) exited with status "
                                f"{self.process.returncode} before it answered {method}")
            if time.monotonic() > deadline:
                raise PeerError(f"{self.spec.role} node did not answer {method} within {timeout:g} s")
        return self._sock.recv()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda **kwargs: self.call(name, **kwargs)

    def kill(self) -> None:
        """SIGKILL: the process dies mid-whatever, sockets and all (chaos testing)."""
        if self.alive():
            self.process.kill()
            self.process.wait(timeout=10)
        self.run_state = RunState.ENDED

    def suspend(self) -> bool:
        """SIGSTOP: the process freezes (a hung host: its sockets stay open, nothing answers) until
        :meth:`resume`; RPC calls meanwhile wait for it. False if it is not running."""
        if self.run_state is not RunState.RUNNING or not self.alive():
            return False
        try:
            os.kill(self.pid, signal.SIGSTOP)
        except ProcessLookupError:
            return False
        self.run_state = RunState.SUSPENDED
        return True

    def resume(self) -> bool:
        """SIGCONT after :meth:`suspend`; False if it was not suspended (or has ended meanwhile)."""
        if self.run_state is not RunState.SUSPENDED:
            return False
        self.run_state = RunState.RUNNING
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            return False
        return self.alive()

    def close(self) -> None:
        """Stop the node: the shutdown call, or SIGTERM when that fails or an earlier call went unanswered
        (the node may still be busy with it); SIGKILL as the last resort (:func:`kvxfer.tools.procs.stop`).
        A suspended node is resumed first."""
        self.resume()
        if self.alive():
            answered = False
            if not self._abandoned:
                try:
                    self.call("shutdown")
                    answered = True
                except KvxferError:
                    pass
            procs.stop(self.process, grace=10.0 if answered else 0.0)
        self.run_state = RunState.ENDED
        self._sock.close(0)
        self._ctx.term()
        if self.process.stdout is not None:
            self.process.stdout.close()
        if self._rpc_dir is not None:
            self._rpc_dir.cleanup()

    def __enter__(self) -> NodeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NamespaceHost(Protocol):
    """Where :func:`spawn` may start a node: a :class:`kvxfer.tools.netns.Host` (or anything with its
    ``argv`` and ``address``)."""

    address: str

    def argv(self, argv: Sequence[str]) -> list[str]: ...


def spawn(spec: NodeSpec, *, timeout: float = 60.0, stderr: Any = None, cpus: Any = None,
          netns: NamespaceHost | Sequence[str] | None = None) -> NodeClient:
    """Start a node process; raise the child's startup error (e.g. CapacityError) if it refuses.

    The node dies with this process (:func:`kvxfer.tools.procs.popen`), and removes this process's
    :class:`kvxfer.tools.procs.TempDir` directories if this process dies first. ``cpus``: the CPUs it
    runs on (all of them if None). ``netns``: run it inside a network namespace, given as a host of a
    :class:`kvxfer.tools.netns.TwoHosts` (its engine then binds that host's address unless
    ``spec.config`` names a ``host``) or as an argv prefix (``["ip", "netns", "exec", NAME]``); its RPC
    then goes over a unix socket (``rpc="ipc"``), or, for a host with an ``rpc_host`` (another
    machine, :class:`kvxfer.tools.guests.GuestHost`), over tcp at that address."""
    prefix: list[str] = []
    if netns is not None:
        if hasattr(netns, "argv"):
            prefix = list(netns.argv([]))  # type: ignore[union-attr]
            address = getattr(netns, "address", None)
            if address and "host" not in spec.config:
                spec = replace(spec, config={**spec.config, "host": address})
        else:
            prefix = [str(part) for part in netns]  # type: ignore[union-attr]
        rpc_host = getattr(netns, "rpc_host", None)
        if rpc_host:  # another machine (:mod:`kvxfer.tools.guests`): RPC over its management link
            spec = replace(spec, rpc="tcp", rpc_host=rpc_host)
        elif spec.rpc == "tcp":
            spec = replace(spec, rpc="ipc")
    rpc_dir = None
    if spec.rpc == "ipc" and not spec.rpc_dir:
        rpc_dir = procs.TempDir(prefix="kvxfer-rpc-")  # before the child starts: it removes it if we die
        spec = replace(spec, rpc_dir=rpc_dir.name)
    try:
        if spec.rpc == "ipc" and len(os.fsencode(os.path.join(spec.rpc_dir or ".", "rpc"))) > _UNIX_PATH_MAX:
            path = os.path.join(spec.rpc_dir or ".", "rpc")
            raise ConfigError(f"{spec.role} node: the RPC socket {path!r} is longer than the {_UNIX_PATH_MAX} bytes "
                              "a unix socket path may have: set TMPDIR to a shorter directory")
        return _start(spec, prefix, timeout=timeout, stderr=stderr, cpus=cpus, rpc_dir=rpc_dir)
    except BaseException:
        if rpc_dir is not None:
            rpc_dir.cleanup()
        raise


def _start(spec: NodeSpec, prefix: list[str], *, timeout: float, stderr: Any, cpus: Any,
           rpc_dir: procs.TempDir | None) -> NodeClient:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    process = procs.popen(
        [*prefix, sys.executable, "-m", "kvxfer.tools.node", json.dumps(asdict(spec))],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=env,
        cpus=cpus,
    )
    deadline = time.monotonic() + timeout
    assert process.stdout is not None
    try:
        line = process.stdout.readline()
    except BaseException:  # a stop signal while the node starts: it goes too
        process.kill()
        process.wait()
        raise
    if not line:
        process.wait(timeout=max(1.0, deadline - time.monotonic()))
        process.stdout.close()
        raise PeerError(f"{spec.role} node exited with status {process.returncode} before it started")
    info = json.loads(line)
    if "error" in info:
        process.wait(timeout=10)
        process.stdout.close()
        cls = ERROR_CLASSES.get(info["error"]["code"], KvxferError)
        exc = cls.__new__(cls)
        KvxferError.__init__(exc, info["error"]["message"])
        raise exc
    return NodeClient(spec, process, info, timeout=timeout, rpc_dir=rpc_dir)


if __name__ == "__main__":
    sys.exit(main())
