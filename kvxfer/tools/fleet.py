"""``kvxfer fleet``: one prefill engine against many decode engines that all peer with it at once.

What a router in front of N x M engines does to one prefill: a handshake storm (every decode calls
``connect()`` in the same instant), one bound transfer per decode, every decode restarting at once,
decodes beyond ``max_peers``, and the decodes going away. The prefill runs in a node process of its
own (:mod:`kvxfer.tools.node`), so its threads, descriptors and memory are read from ``/proc`` as
an operator would; the decodes run ``--per-process`` to a worker process (:func:`worker_main`),
driven over JSON lines on stdin/stdout.

A run reports, per phase: how many decodes peered, how many were refused (and how fast the refusal
came), the time until every decode had its answer, how many bound transfers landed with the right
bytes (the content oracle, :mod:`kvxfer.tools.oracle`), and the prefill's threads / open
descriptors / RSS before, with the peers, and after the decodes left. It exits 1 when a peered
decode's transfer failed or came back wrong, when a refused decode waited for "no answer", or when
the prefill's pool is not whole at the end.

Every process it starts dies with it (:mod:`kvxfer.tools.procs`).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from . import procs

PAGE_TOKENS = 16
BUFFERS = 2
ITEM = 1024  # bytes per buffer per page: transfers are small, the storm is what is measured


@dataclass
class FleetConfig:
    """One ``kvxfer fleet`` run."""

    decodes: int = 128
    per_process: int = 64  # decode engines per worker process
    max_peers: int = 256
    restart: bool = False  # after the first round, every decode process is killed and started again
    tokens: int = 2 * PAGE_TOKENS  # each bound transfer's prompt
    transport: str = "tcp"
    connect_timeout: float = 30.0
    settle_s: float = 10.0  # after the decodes left: how long the prefill may take to forget them
    peer_expiry: float = 300.0
    peer_timeout: float = 15.0
    json_path: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# the worker process: decode engines ------------------------------------------------------------------


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class _Worker:
    """``count`` decode engines in this process, answering one JSON command per stdin line."""

    def __init__(self, count: int, spec: dict[str, Any]) -> None:
        from ..core.layout import KVLayout
        from ..engine import DecodeEngine, EngineConfig

        self.engines: list[Any] = []
        for _ in range(count):
            layout = KVLayout.allocate(num_buffers=BUFFERS, item_len=ITEM, num_pages=spec["pages"],
                                       page_size=PAGE_TOKENS)
            config = EngineConfig(max_context=spec["max_context"], transport=spec["transport"],
                                  peer_timeout=spec["peer_timeout"])
            self.engines.append(DecodeEngine(layout, config))

    def close(self) -> None:
        for engine in self.engines:
            engine.close()

    def connect(self, address: str, timeout: float, at: float) -> list[dict[str, Any]]:
        """Every engine calls ``connect(address)`` at wall-clock time ``at``, each on its own thread."""
        results: list[dict[str, Any]] = [{} for _ in self.engines]

        def one(i: int, engine: Any) -> None:
            delay = at - time.time()
            if delay > 0:
                time.sleep(delay)
            start = time.monotonic()
            try:
                peer = engine.connect(address, timeout=timeout)
                results[i] = {"engine": engine.engine_id, "ok": True, "peer": peer,
                              "seconds": time.monotonic() - start}
            except Exception as exc:  # the refusal is what is measured
                results[i] = {"engine": engine.engine_id, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                              "seconds": time.monotonic() - start}

        threads = [threading.Thread(target=one, args=(i, e), daemon=True) for i, e in enumerate(self.engines)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return results

    def receive(self, rids: dict[str, Any], prefill: str, tokens: int, timeout: float) -> list[dict[str, Any]]:
        """The decode half of one bound transfer per engine named in ``rids``: admit, wait, read and check."""
        from . import oracle

        by_id = {e.engine_id: e for e in self.engines}
        results: list[dict[str, Any]] = []
        lock = threading.Lock()

        def one(engine: Any, rid: Any) -> None:
            out: dict[str, Any] = {"engine": engine.engine_id, "rid": rid}
            try:
                engine.admit(rid, tokens, peer=prefill)
                engine.wait(rid, timeout=timeout)
                with engine.read(rid) as kv:
                    views = [kv.buffer(b) for b in range(engine.layout.num_buffers)]
                    report = oracle.check(engine.layout, kv.pages, rid=rid, gen=kv.generation, views=views)
                engine.release(rid)
                out.update(ok=report.pages > 0 and report.ok == report.pages, leaked=len(report.leaked),
                           corrupted=len(report.corrupted))
            except Exception as exc:
                out.update(ok=False, error=f"{type(exc).__name__}: {exc}")
            with lock:
                results.append(out)

        threads = [threading.Thread(target=one, args=(by_id[name], rid), daemon=True) for name, rid in rids.items()
                   if name in by_id]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return results


def worker_main(argv: list[str]) -> int:
    """``python -m kvxfer.tools.fleet <count> <spec json>``: serve commands until stdin closes."""
    import logging

    procs.adopt()
    _raise_fd_limit()
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    count, spec = int(argv[0]), json.loads(argv[1])
    worker = _Worker(count, spec)
    _say({"engines": [e.engine_id for e in worker.engines]})
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            op = cmd.pop("op")
            if op == "connect":
                _say({"connected": worker.connect(**cmd)})
            elif op == "receive":
                _say({"received": worker.receive(**cmd)})
            elif op == "stop":
                break
    finally:
        worker.close()
    return 0


def _say(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


# the parent ------------------------------------------------------------------------------------------


class _WorkerProcess:
    def __init__(self, count: int, spec: dict[str, Any]) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.process = procs.popen([sys.executable, "-m", "kvxfer.tools.fleet", str(count), json.dumps(spec)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.engines: list[str] = self.answer()["engines"]

    def ask(self, **cmd: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(cmd) + "\n")
        self.process.stdin.flush()

    def answer(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"fleet worker {self.process.pid} exited with status {self.process.wait()}")
        return json.loads(line)

    def stop(self) -> None:
        try:
            self.ask(op="stop")
        except (OSError, ValueError):
            pass
        procs.stop(self.process, grace=30)
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass


def process_load(pid: int) -> dict[str, int]:
    """Threads, open descriptors and resident bytes of process ``pid`` (from /proc)."""
    import mmap

    with open(f"/proc/{pid}/statm") as f:
        rss = int(f.read().split()[1]) * mmap.PAGESIZE
    return {"threads": len(os.listdir(f"/proc/{pid}/task")), "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "rss": rss}


class Fleet:
    """One prefill node and the decode worker processes of a :class:`FleetConfig`."""

    def __init__(self, config: FleetConfig) -> None:
        from .node import NodeSpec, spawn

        self.config = config
        pages = 4 * ((config.tokens + PAGE_TOKENS - 1) // PAGE_TOKENS)
        self.max_context = config.tokens
        prefill_pages = max(64, (config.decodes + 8) * (pages // 4))
        self.decode_spec = {"pages": pages, "max_context": config.tokens, "transport": config.transport,
                            "peer_timeout": config.peer_timeout}
        engine = {"max_context": config.tokens, "transport": config.transport, "max_peers": config.max_peers,
                  "peer_expiry": config.peer_expiry, "peer_timeout": config.peer_timeout,
                  "max_pending_meta": 4096, **config.extra}
        engine["max_peers"] = config.max_peers + 1  # and one for the steady decode
        self.prefill = spawn(NodeSpec(role="prefill", num_buffers=BUFFERS, item_len=ITEM, num_pages=prefill_pages,
                                      page_size=PAGE_TOKENS, config=engine, log_level="ERROR"))
        self.prefill_id = self.prefill.engine_id
        self.workers: list[_WorkerProcess] = []
        self._next_rid = 0
        # one decode peered before any storm, transferring all along: do handshakes hold up a peered engine?
        self.steady = _WorkerProcess(1, self.decode_spec)
        self.steady.ask(op="connect", address=self.prefill.control, timeout=config.connect_timeout, at=0)
        if not self.steady.answer()["connected"][0]["ok"]:
            raise RuntimeError("the steady decode could not peer with the prefill")

    def steady_transfers(self, stop: threading.Event | None = None, count: int = 0) -> dict[str, Any]:
        """Bound transfers to the steady decode, one after another: ``count`` of them, or until ``stop``."""
        name = self.steady.engines[0]
        latencies: list[float] = []
        failures: list[str] = []
        while (stop is not None and not stop.is_set()) or len(latencies) < count:
            self._next_rid += 1
            rid = self._next_rid
            began = time.monotonic()
            try:
                self.prefill.admit(rid=rid, tokens=self.config.tokens, peer=name)
                self.steady.ask(op="receive", rids={name: rid}, prefill=self.prefill_id, tokens=self.config.tokens,
                                timeout=60.0)
                self.prefill.prepare(rid=rid, timeout=60.0)
                self.prefill.send(rid=rid)
                result = self.steady.answer()["received"][0]
                if not result["ok"]:
                    failures.append(result.get("error", "wrong bytes"))
            except Exception as exc:
                failures.append(f"{type(exc).__name__}: {exc}"[:300])
            latencies.append(time.monotonic() - began)
        ordered = sorted(latencies) or [0.0]
        return {"transfers": len(latencies), "failed": len(failures), "errors": failures[:3],
                "p50_ms": round(1000 * ordered[len(ordered) // 2], 2), "max_ms": round(1000 * ordered[-1], 2)}

    def start_decodes(self) -> float:
        started = time.monotonic()
        left = self.config.decodes
        while left > 0:
            count = min(left, self.config.per_process)
            self.workers.append(_WorkerProcess(count, self.decode_spec))
            left -= count
        return time.monotonic() - started

    def storm(self) -> dict[str, Any]:
        """Every decode connects at once; then one bound transfer per peered decode."""
        before = self.steady_transfers(count=20)
        stop = threading.Event()
        during: dict[str, Any] = {}
        background = threading.Thread(target=lambda: during.update(self.steady_transfers(stop)), daemon=True)
        at = time.time() + 0.5
        began = time.monotonic()
        for worker in self.workers:
            worker.ask(op="connect", address=self.prefill.control, timeout=self.config.connect_timeout, at=at)
        background.start()
        results = [r for worker in self.workers for r in worker.answer()["connected"]]
        answered = time.monotonic() - began - 0.5
        stop.set()
        background.join()
        peered = [r for r in results if r["ok"]]
        refused = [r for r in results if not r["ok"]]
        load = process_load(self.prefill.pid)
        transfer = self._transfers([r["engine"] for r in peered])
        return {
            "decodes": len(results), "peered": len(peered), "refused": len(refused),
            "all_answered_s": round(answered, 3),
            "slowest_peering_s": round(max((r["seconds"] for r in peered), default=0.0), 3),
            "slowest_refusal_s": round(max((r["seconds"] for r in refused), default=0.0), 3),
            "refusals_unanswered": sum("no answer" in r["error"] for r in refused),
            "refusal_sample": refused[0]["error"][:300] if refused else "",
            "prefill_with_peers": load, "steady_before": before, "steady_during": during, **transfer,
        }

    def _transfers(self, engines: list[str]) -> dict[str, Any]:
        rids: dict[str, int] = {}
        failed_admit = 0
        for name in engines:
            self._next_rid += 1
            try:
                self.prefill.admit(rid=self._next_rid, tokens=self.config.tokens, peer=name)
                rids[name] = self._next_rid
            except Exception:
                failed_admit += 1
        began = time.monotonic()
        for worker in self.workers:
            mine = {name: rid for name, rid in rids.items() if name in worker.engines}
            worker.ask(op="receive", rids=mine, prefill=self.prefill_id, tokens=self.config.tokens,
                       timeout=self.config.connect_timeout + 30)
        send_errors: list[str] = []
        for rid in rids.values():
            try:
                self.prefill.prepare(rid=rid, timeout=self.config.connect_timeout + 30)
                self.prefill.send(rid=rid)
            except Exception as exc:
                send_errors.append(str(exc)[:300])
        results = [r for worker in self.workers for r in worker.answer()["received"]]
        errors = [r.get("error", "wrong bytes") for r in results if not r["ok"]]
        return {"transfers": len(rids), "transfers_correct": sum(r["ok"] for r in results),
                "transfers_failed": len(errors) + failed_admit, "transfer_s": round(time.monotonic() - began, 3),
                "transfer_errors": (errors + send_errors)[:3]}

    def restart_decodes(self) -> float:
        """SIGKILL every decode process and start them again (new engines), as a fleet-wide restart does."""
        for worker in self.workers:
            worker.kill()
        self.workers = []
        return self.start_decodes()

    def stop_decodes(self) -> None:
        for worker in self.workers:
            worker.stop()
        self.workers = []

    def close(self) -> None:
        for worker in [*self.workers, self.steady]:
            worker.kill()
        self.workers = []
        self.prefill.close()


def run_fleet(config: FleetConfig) -> dict[str, Any]:
    """The phases of one run; the report as a dict (``ok`` False when a check failed)."""
    fleet = Fleet(config)
    try:
        time.sleep(0.5)
        report: dict[str, Any] = {"config": asdict(config), "prefill_idle": process_load(fleet.prefill.pid)}
        report["decodes_started_s"] = round(fleet.start_decodes(), 3)
        report["storm"] = fleet.storm()
        if config.restart:
            report["restarted_s"] = round(fleet.restart_decodes(), 3)
            report["storm_after_restart"] = fleet.storm()
        fleet.stop_decodes()
        left = time.monotonic()
        idle_fds = report["prefill_idle"]["fds"]
        while time.monotonic() - left < config.settle_s and process_load(fleet.prefill.pid)["fds"] > idle_fds + 4:
            time.sleep(0.1)
        report["forgotten_after_s"] = round(time.monotonic() - left, 3)
        report["prefill_after"] = process_load(fleet.prefill.pid)
        stats = fleet.prefill.stats()
        report["prefill_pool_free"] = [stats["pool_free"], stats["pool_total"]]
        report["prefill_counters"] = stats["engine_counters"]
    finally:
        fleet.close()
    report["problems"] = _problems(report, config)
    report["ok"] = not report["problems"]
    return report


def _problems(report: dict[str, Any], config: FleetConfig) -> list[str]:
    out = []
    if config.decodes < 1 or not report.get("storm", {}).get("decodes"):
        out.append("no decode took part: nothing was tested")  # an empty run is never a pass
    for phase in ("storm", "storm_after_restart"):
        r = report.get(phase)
        if r is None:
            continue
        expect = min(config.decodes, config.max_peers)
        if r["peered"] != expect:
            out.append(f"{phase}: {r['peered']} of {config.decodes} decodes peered, expected {expect} "
                       f"(max_peers {config.max_peers})")
        if r["transfers_correct"] != r["peered"]:
            out.append(f"{phase}: {r['transfers_correct']} of {r['peered']} peered decodes got correct bytes "
                       f"({r['transfer_errors']})")
        if r["steady_during"]["failed"] or r["steady_before"]["failed"]:
            out.append(f"{phase}: the steady decode's transfers failed: {r['steady_during']['errors']}")
        if r["refusals_unanswered"]:
            out.append(f"{phase}: {r['refusals_unanswered']} refused decodes got no answer (waited for a timeout)")
    if report["prefill_after"]["fds"] > report["prefill_idle"]["fds"] + 4:
        out.append(f"prefill still holds {report['prefill_after']['fds']} descriptors {report['forgotten_after_s']} s "
                   f"after the decodes left (idle: {report['prefill_idle']['fds']})")
    free, total = report["prefill_pool_free"]
    if free != total:
        out.append(f"prefill pool: {total - free} of {total} pages still held after every request ended")
    return out


def format_report(report: dict[str, Any]) -> str:
    c = report["config"]
    lines = [f"kvxfer fleet: 1 prefill x {c['decodes']} decodes ({c['per_process']} per process, "
             f"max_peers {c['max_peers']}, {c['transport']})"]

    def load(name: str, value: dict[str, int]) -> str:
        return f"  prefill {name:<12} threads {value['threads']:>5}  fds {value['fds']:>5}  rss {value['rss'] >> 20} MiB"

    lines.append(load("idle", report["prefill_idle"]))
    for phase in ("storm", "storm_after_restart"):
        r = report.get(phase)
        if r is None:
            continue
        lines.append(f"  {phase}: {r['peered']} peered, {r['refused']} refused "
                     f"(slowest refusal {r['slowest_refusal_s']} s, {r['refusals_unanswered']} unanswered), "
                     f"all answered in {r['all_answered_s']} s; transfers {r['transfers_correct']}/"
                     f"{r['transfers']} correct in {r['transfer_s']} s")
        lines.append(load("with peers", r["prefill_with_peers"]))
        b, d = r["steady_before"], r["steady_during"]
        lines.append(f"  a peered decode's transfers: before the storm p50 {b['p50_ms']} ms max {b['max_ms']} ms; "
                     f"during it {d['transfers']} transfers, {d['failed']} failed, p50 {d['p50_ms']} ms "
                     f"max {d['max_ms']} ms")
    lines.append(load("after", report["prefill_after"]) + f"  (decodes gone {report['forgotten_after_s']} s)")
    free, total = report["prefill_pool_free"]
    lines.append(f"  prefill pool {free}/{total} free")
    lines.extend(f"  PROBLEM: {p}" for p in report["problems"])
    lines.append("PASS" if report["ok"] else "FAIL")
    return "\n".join(lines)


def add_arguments(parser: Any) -> None:
    from ..transport.registry import names
    from .checks import integer, number, output_path

    parser.add_argument("--decodes", type=integer(1), default=128, help="decode engines, all peering at once")
    parser.add_argument("--per-process", type=integer(1), default=64, help="decode engines per worker process")
    parser.add_argument("--max-peers", type=integer(1), default=256, help="the prefill's max_peers")
    parser.add_argument("--restart", action="store_true",
                        help="then SIGKILL every decode process, start them again and storm once more")
    parser.add_argument("--transport", dest="fleet_transport", default="tcp", choices=names(),
                        help="the data transport")
    parser.add_argument("--connect-timeout", type=number(above=0), default=30.0, help="each decode's connect() timeout")
    parser.add_argument("--json", metavar="PATH", type=output_path, default=None, help="also write the report as JSON")


def check(args: Any) -> None:
    """Before any process starts (``kvxfer fleet``): the transport runs here."""
    from .checks import transport_runs

    transport_runs(f"--transport {args.fleet_transport}", args.fleet_transport)


def main(args: Any) -> int:
    config = FleetConfig(decodes=args.decodes, per_process=args.per_process, max_peers=args.max_peers,
                         restart=args.restart, transport=args.fleet_transport, connect_timeout=args.connect_timeout,
                         json_path=args.json)
    report = run_fleet(config)
    print(format_report(report))
    if config.json_path:
        with open(config.json_path, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
