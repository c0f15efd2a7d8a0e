"""``kvxfer demo``: the main job. Two engine processes on loopback, one scripted session.

The session replays the incident's ingredients against kvxfer and checks each outcome by content,
not by status code:

1. a prefill pool smaller than the advertised context refuses to start (the capacity invariant),
   and starts only with the explicit, loudly logged override;
2. normal transfers arrive byte-exact (oracle check on every page read back);
3. a prompt in the unsafe band (larger than the prefill pool, within the advertised context) is
   rejected at admission on both sides: no page reserved, no byte moved;
4. an abort mid-transfer quarantines the decode pages until the writer's drain acknowledgement,
   then they return to the free list;
5. a byte flipped in flight is caught by the checksum; the request is never readable;
6. a write of an aborted request replayed after its pages were reused is refused, and the new
   owner's bytes are untouched.

Exit status 0 only if every expectation held. ``--json PATH`` writes the same results.

The engines' logs and key pairs live in one :class:`kvxfer.tools.procs.TempDir`: removed when the demo
ends, and by the engine processes themselves if the demo is killed before it can (they never
outlive it).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import AdmissionRejected, CapacityError, ConfigError, KvxferError, NotReadable
from ..wire.auth import write_cluster
from . import procs
from .node import NodeClient, NodeSpec, spawn

PAGE_TOKENS = 16
BUFFERS = 4
ITEM = 4096
PREFILL_PAGES = 64  # 1,024 tokens
DECODE_PAGES = 256  # 4,096 tokens
CONTEXT = 4096


class SetupFailed(ConfigError):
    """The demo's engines could not start (a port taken, a transport that cannot run here): no step's
    outcome, the demo never began. The command line checks these first; this catches what changed since."""


@dataclass
class Outcome:
    """One demo step's result: what was expected, whether it held, what was seen, and how long it took."""

    step: str
    expectation: str
    ok: bool
    detail: str
    seconds: float


class Demo:
    """The scripted demo session: owns the two engine node processes, their keys and logs, and the outcomes.

    Every step is judged by content; a step that raises is recorded as failed, never propagated."""

    def __init__(self, *, transport: str = "tcp", verbose: bool = False,
                 transport_options: dict[str, Any] | None = None, metrics_port: int | None = None,
                 linger: float = 0.0, announce: Callable[[str], None] = print) -> None:
        self.transport = transport
        self.transport_options = dict(transport_options or {})  # EngineConfig.transport_options of both engines
        self.verbose = verbose
        self.metrics_port = metrics_port
        self.linger = linger
        self.announce = announce
        self.outcomes: list[Outcome] = []
        self._logs = procs.TempDir(prefix="kvxfer-demo-")
        # one key pair per engine, each trusting the other: the control plane is authenticated
        self.keyrings = {path.name: str(path) for path in write_cluster(Path(self._logs.name) / "keys",
                                                                         ["prefill", "decode"])}
        self.prefill: NodeClient | None = None
        self.decode: NodeClient | None = None
        self.peer = ""

    def _spec(self, role: str, pages: int, **config: Any) -> NodeSpec:
        base: dict[str, Any] = {"max_context": CONTEXT, "transport": self.transport, "drain_timeout": 10.0,
                                "transport_options": self.transport_options, "keyring": self.keyrings[role]}
        if self.metrics_port is not None:  # decode on the port given, prefill on the next one
            base["metrics_port"] = self.metrics_port + (1 if role == "prefill" else 0)
        if self.transport == "verbs":
            base.update(drain_timeout=3.0, peer_timeout=60.0)
        base.update(config)
        return NodeSpec(role=role, num_buffers=BUFFERS, item_len=ITEM, num_pages=pages, page_size=PAGE_TOKENS,
                        config=base, faults={} if role == "prefill" else None,
                        log_level="INFO" if self.verbose else "ERROR")

    def _spawn(self, spec: NodeSpec) -> NodeClient:
        stderr = None if self.verbose else open(Path(self._logs.name) / f"{spec.role}.log", "a")  # noqa: SIM115
        return spawn(spec, stderr=stderr)

    def expect(self, step: str, expectation: str, check: Callable[[], str]) -> bool:
        start = time.monotonic()
        try:
            detail = check()
            ok = True
        except SetupFailed:  # not an outcome of the session: the session never began
            raise
        except AssertionError as exc:
            ok, detail = False, f"expectation failed: {exc}"
        except Exception as exc:  # anything else is a failure of the step, reported, not raised
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        self.outcomes.append(Outcome(step, expectation, ok, detail, time.monotonic() - start))
        return ok

    # steps ----------------------------------------------------------------------------------------
    def step_capacity(self) -> str:
        try:
            node = self._spawn(self._spec("prefill", PREFILL_PAGES))
        except CapacityError as exc:
            refusal = str(exc)
        except KvxferError as exc:  # refused for another reason: a setup failure, not this row's
            raise SetupFailed(f"the prefill engine did not start: {exc}") from exc
        else:
            node.close()
            raise AssertionError("an undersized prefill pool started without the override")
        assert "1,024 tokens < context 4,096 tokens" in refusal, refusal
        try:
            self.prefill = self._spawn(self._spec("prefill", PREFILL_PAGES, allow_undersized_pool=True))
            self.decode = self._spawn(self._spec("decode", DECODE_PAGES))
            self.peer = self.decode.connect(address=self.prefill.control)
        except KvxferError as exc:  # a port taken, a transport that cannot run: the demo cannot begin
            raise SetupFailed(f"the engines did not start: {exc}") from exc
        return f"refused: {refusal.split('. Enlarge')[0]}; started with the override (warning logged)"

    def _transfer(self, rid: str, tokens: int, *, seed: int = 0, count: int | None = None) -> dict[str, Any]:
        assert self.prefill is not None and self.decode is not None
        self.prefill.admit(rid=rid, tokens=tokens)
        self.decode.admit(rid=rid, tokens=tokens, peer=self.peer)
        self.prefill.prepare(rid=rid, seed=seed)
        return self.prefill.send(rid=rid, count=count)

    def step_normal(self) -> str:
        assert self.prefill is not None and self.decode is not None
        sizes = [100, 517, 1000, 1024]
        checked = 0
        for i, tokens in enumerate(sizes):
            rid = f"normal-{i}"
            self._transfer(rid, tokens, seed=i)
            state = self.decode.wait(rid=rid)
            assert state["state"] == "READABLE", state
            report = self.decode.read_check(rid=rid, seed=i)
            assert report["ok"] == report["pages"] and report["pages"] > 0, report
            checked += report["pages"]
            assert self.prefill.wait(rid=rid)["state"] == "SUCCEEDED"
        return f"{len(sizes)} requests, {checked} pages read back byte-exact through the ownership check"

    def step_unsafe_band(self) -> str:
        assert self.prefill is not None and self.decode is not None
        landed = self.decode.stats()["writes"]["landed_bytes"]
        sent = self.prefill.stats()["bytes_sent"]
        errors = []
        for node, kwargs in ((self.decode, {"peer": self.peer}), (self.prefill, {})):
            try:
                node.admit(rid="band", tokens=3000, **kwargs)
            except AdmissionRejected as exc:
                errors.append(str(exc))
            else:
                raise AssertionError(f"{node.spec.role} admitted a 3,000-token prompt")
        dstats, pstats = self.decode.stats(), self.prefill.stats()
        assert dstats["pool_free"] == DECODE_PAGES and pstats["pool_free"] == PREFILL_PAGES, "pages reserved"
        assert dstats["writes"]["landed_bytes"] == landed and pstats["bytes_sent"] == sent, "bytes moved"
        try:
            self.decode.read_check(rid="band")
        except NotReadable:
            pass
        else:
            raise AssertionError("a rejected request was readable")
        return f"decode: {errors[0]} | prefill: {errors[1]} | 0 pages reserved, 0 bytes moved"

    def step_abort_quarantine(self) -> str:
        assert self.prefill is not None and self.decode is not None
        self.prefill.fault(op="pause")
        self._transfer("abort-me", 800, count=10)  # 10 of 50 pages posted, the link stalls
        self.decode.abort(rid="abort-me", reason="client disconnected")
        time.sleep(0.5)
        held = self.decode.stats()["pages"]["quarantined"]
        state = self.decode.status(rid="abort-me")["state"]
        assert state == "QUARANTINED" and held == 50, f"state {state}, {held} quarantined pages"
        self.prefill.fault(op="resume")
        final = self.decode.wait(rid="abort-me")
        stats = self.decode.stats()
        assert final["state"] == "ABORTED", final
        assert stats["pages"]["quarantined"] == 0 and stats["pool_free"] == DECODE_PAGES, stats["pages"]
        return (f"{held} pages QUARANTINED for 0.5 s while the writer stalled; after its drain ack "
                f"all {DECODE_PAGES} pages free")

    def step_corruption(self) -> str:
        assert self.prefill is not None and self.decode is not None
        self.prefill.fault(op="flip_next")
        self._transfer("flipped", 300, seed=3)
        final = self.decode.wait(rid="flipped")
        assert final["state"] == "FAILED" and final["check"] == "checksum", final
        try:
            self.decode.read_check(rid="flipped")
        except NotReadable:
            pass
        else:
            raise AssertionError("a corrupted request was readable")
        return final["error"].split(": transfer not verified: ")[-1]

    def step_late_write(self) -> str:
        if self.transport == "verbs":
            return self._late_write_verbs()
        assert self.prefill is not None and self.decode is not None
        self.prefill.fault(op="capture_next")
        self._transfer("old", 200, seed=4)
        assert self.decode.wait(rid="old")["state"] == "READABLE"
        self.decode.abort(rid="old", reason="client disconnected after completion")
        self.prefill.wait(rid="old")
        self._transfer("new", 200, seed=5)
        assert self.decode.wait(rid="new")["state"] == "READABLE"
        before = self.decode.stats()["writes"]["refused_by_reason"].get("stale_tag", 0)
        replayed = self.prefill.fault(op="replay_captured")
        deadline = time.monotonic() + 5
        after = before
        while time.monotonic() < deadline and after == before:
            time.sleep(0.05)
            after = self.decode.stats()["writes"]["refused_by_reason"].get("stale_tag", 0)
        assert replayed == 1 and after == before + 1, f"replayed {replayed}, refused {after - before}"
        report = self.decode.read_check(rid="new", seed=5)
        assert report["ok"] == report["pages"], report
        return f"late write of 'old' refused as a stale tag; 'new' ({report['pages']} pages, same pool) intact"

    def _late_write_verbs(self) -> str:
        """Over RDMA a region's rkey admits any write, so the guarantee is the fence: a writer that never
        proves its drain gets its queue pair moved to ERR before the pages are reused."""
        assert self.prefill is not None and self.decode is not None
        self.prefill.fault(op="configure", ignore_aborts=True, keep_fenced_links=True)
        self._transfer("old", 200, seed=4, count=2)
        self.decode.abort(rid="old", reason="client disconnected")
        final = self.decode.wait(rid="old", timeout=60)
        assert final["state"] == "ABORTED", final
        fences = self.decode.stats()["engine_counters"].get("fences", 0)
        assert fences >= 1, "no fence"
        self.prefill.fault(op="configure", ignore_aborts=False)
        self.prefill.wait(rid="old", timeout=60)
        self.prefill.admit(rid="new", tokens=200)
        deadline = time.monotonic() + 60
        while True:  # the decode offers a fresh queue pair after the fence; wait until it is connected
            try:
                self.decode.admit(rid="new", tokens=200, peer=self.peer)
                break
            except KvxferError as exc:
                if time.monotonic() > deadline or "not connected" not in str(exc):
                    raise
                time.sleep(0.2)
        self.prefill.prepare(rid="new", seed=5)
        self.prefill.send(rid="new")
        assert self.decode.wait(rid="new", timeout=60)["state"] == "READABLE"
        new_pages = self.decode.pages(rid="new")
        late = self.prefill.fault(op="write_via_stale_link", pages=new_pages)
        assert late["failed"], f"the late write completed on the wire: {late}"
        report = self.decode.read_check(rid="new", seed=5)
        assert report["ok"] == report["pages"], report
        return (f"writer ignored the abort; decode fenced its queue pair after the drain timeout; a late write "
                f"on it never completed and flushed with status {late['statuses']}; 'new' ({report['pages']} pages) intact")

    def step_authentication(self) -> str:
        """A client whose key the engines do not trust cannot peer, reserve, complete or abort anything."""
        import zmq

        from ..wire import messages as m
        from ..wire.auth import Keyring, split_address

        assert self.prefill is not None and self.decode is not None
        before = self.prefill.stats()
        endpoint, server_key = split_address(self.prefill.control)
        stranger = Keyring.generate("stranger")
        ctx = zmq.Context()
        try:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_key, stranger.public, stranger.secret
            sock.setsockopt(zmq.IDENTITY, self.peer.encode())  # even under the real decode's name
            sock.connect(endpoint)
            sock.send(m.encode(m.Abort(rid="new", gen=1, reason="hostile", detail="stranger")), zmq.NOBLOCK)
            deadline = time.monotonic() + 10
            while self.prefill.stats()["engine_counters"].get("auth_denied", 0) <= \
                    before["engine_counters"].get("auth_denied", 0):
                assert time.monotonic() < deadline, "the stranger's handshake was never refused"
                time.sleep(0.05)
            sock.close(0)
        finally:
            ctx.term()
        after = self.prefill.stats()
        assert after["requests"] == before["requests"], "a stranger's message reached the request logic"
        denied = after["engine_counters"]["auth_denied"]
        return f"a client with an untrusted key, even under the decode's engine id, was refused at the handshake ({denied} denial(s) logged); nothing reached the request logic"

    def step_accounting(self) -> str:
        assert self.prefill is not None and self.decode is not None
        for node, total in ((self.decode, DECODE_PAGES), (self.prefill, PREFILL_PAGES)):
            node.accounting()
            stats = node.stats()
            assert stats["pool_free"] == total, f"{node.spec.role}: {stats['pool_free']} of {total} free"
        return f"invariant holds; decode {DECODE_PAGES}/{DECODE_PAGES} and prefill {PREFILL_PAGES}/{PREFILL_PAGES} pages free"

    def run(self, *, keep_open: bool = False) -> list[Outcome]:
        """Run every step; the engines are closed at the end unless ``keep_open`` (then call close())."""
        steps = [
            ("startup", "undersized prefill pool refused without the override", self.step_capacity),
            ("normal", "transfers arrive byte-exact", self.step_normal),
            ("unsafe band", "prompt larger than the prefill pool rejected on both sides", self.step_unsafe_band),
            ("abort", "aborted pages quarantined until drained, then freed", self.step_abort_quarantine),
            ("corruption", "flipped byte caught by the checksum", self.step_corruption),
            ("late write", "late write after abort lands nowhere, reused pages intact", self.step_late_write),
            ("authentication", "an unkeyed peer is refused before it can touch a request", self.step_authentication),
            ("accounting", "every page accounted for at the end", self.step_accounting),
        ]
        self.expected_steps = len(steps)
        try:
            for index, (step, expectation, fn) in enumerate(steps):
                if not self.expect(step, expectation, fn) and index == 0:
                    break
        finally:
            if not keep_open:
                self.close()
        return self.outcomes

    def close(self) -> None:
        for node in (self.decode, self.prefill):
            if node is not None:
                node.close()
        self.decode = self.prefill = None

    def remove_files(self) -> None:
        """Remove the logs and key pairs (after close(); log_tail() has nothing to show afterwards)."""
        self._logs.cleanup()

    def linger_here(self) -> None:
        """Keep the engines (and their metrics endpoints) up for ``linger`` seconds after the session."""
        if self.metrics_port is None and not self.linger:
            return
        urls = [f"{node.spec.role} {node.metrics}" for node in (self.decode, self.prefill)
                if node is not None and node.metrics]
        if urls:
            self.announce(f"metrics: {', '.join(urls)}")
        if self.linger > 0:
            self.announce(f"lingering {self.linger:g} s")
            time.sleep(self.linger)

    def log_tail(self) -> str:
        out = []
        for path in sorted(Path(self._logs.name).glob("*.log")):
            text = path.read_text().strip().splitlines()[-15:]
            if text:
                out.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(out)


def run_demo(*, json_path: str | None = None, transport: str = "tcp", verbose: bool = False,
             transport_options: dict[str, Any] | None = None, metrics_port: int | None = None,
             linger: float = 0.0) -> int:
    from rich.console import Console

    console = Console()
    console.print(f"[bold]kvxfer demo[/bold]: prefill and decode engines in two processes, {transport} transport, "
                  f"pools of {PREFILL_PAGES * PAGE_TOKENS:,} and {DECODE_PAGES * PAGE_TOKENS:,} tokens, "
                  f"advertised context {CONTEXT:,}")
    demo = Demo(transport=transport, verbose=verbose, transport_options=transport_options,
                metrics_port=metrics_port, linger=linger,
                announce=lambda text: console.print(text, markup=False, highlight=False, soft_wrap=True))
    started = time.monotonic()
    try:
        outcomes = demo.run(keep_open=True)
        elapsed = time.monotonic() - started
        _print_outcomes(console, demo, outcomes, elapsed, verbose)
        demo.linger_here()
    finally:
        try:
            demo.close()
        finally:
            demo.remove_files()
    ok = len(outcomes) == demo.expected_steps and all(o.ok for o in outcomes)
    if json_path:
        Path(json_path).write_text(json.dumps({
            "ok": ok, "transport": transport, "seconds": round(elapsed, 3),
            "outcomes": [asdict(o) for o in outcomes],
        }, indent=2) + "\n")
    return 0 if ok else 1


def _print_outcomes(console: Any, demo: Demo, outcomes: list[Outcome], elapsed: float, verbose: bool) -> None:
    from rich.table import Table

    table = Table(show_lines=False)
    table.add_column("step")
    table.add_column("expectation")
    table.add_column("held")
    table.add_column("what happened", overflow="fold")
    for o in outcomes:
        table.add_row(o.step, o.expectation, "[green]yes[/green]" if o.ok else "[red]NO[/red]", o.detail)
    console.print(table)
    ok = len(outcomes) == demo.expected_steps and all(o.ok for o in outcomes)
    console.print(f"{'[green]all expectations held[/green]' if ok else '[red]some expectations failed[/red]'} "
                  f"in {elapsed:.1f} s")
    if not ok and not verbose:
        tail = demo.log_tail()
        if tail:
            console.print(tail, markup=False, highlight=False)


__all__ = ["Demo", "Outcome", "run_demo", "KvxferError"]
