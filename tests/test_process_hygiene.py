"""Process hygiene: every process a kvxfer tool starts dies with the tool, and leaves no port or temp dir.

Each test runs the real command line (``python -m kvxfer TOOL``) as a subprocess with a TMPDIR of its
own and a unique marker variable in its environment. Children inherit the environment, so scanning
``/proc/*/environ`` for the marker finds every process the tool started, however it started it. The
tool is stopped as an operator would stop it: SIGKILL (nothing of the tool's own code runs),
SIGTERM to its PID (``kill``), or SIGINT to its process group (Ctrl-C in a terminal).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from .conftest import free_port_pair, processes_carrying

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]

MARKER = "KVXFER_HYGIENE_MARKER"
GONE_WITHIN = 15.0  # seconds for every process, port and temp dir of a stopped tool to go


# /proc ---------------------------------------------------------------------------------------------------


def marked_processes(value: str) -> dict[int, str]:
    """PID -> command line of every live process whose environment carries ``MARKER=value``."""
    return processes_carrying(MARKER, value)


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError:
        pass
    return inodes


def listening_sockets() -> dict[int, int]:
    """Inode -> port of every TCP socket in LISTEN state (IPv4 and IPv6) in this network namespace."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A":
                out[int(fields[9])] = int(fields[1].rsplit(":", 1)[1], 16)
    return out


def listening_of(pids: list[int]) -> dict[int, int]:
    """Inode -> port of the listening sockets these processes hold."""
    mine = set().union(*(_socket_inodes(pid) for pid in pids)) if pids else set()
    return {inode: port for inode, port in listening_sockets().items() if inode in mine}


def _refuses(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return False
    except OSError:
        return True


# one tool run ------------------------------------------------------------------------------------------


class ToolRun:
    """``python -m kvxfer ARGS`` in its own session, with its own TMPDIR and marker; output collected."""

    def __init__(self, args: list[str], tmp: Path) -> None:
        self.marker = uuid.uuid4().hex
        self.tmp = tmp
        env = dict(os.environ, TMPDIR=str(tmp), PYTHONUNBUFFERED="1", **{MARKER: self.marker})
        env.pop("COLUMNS", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "kvxfer", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._readers = [threading.Thread(target=self._drain, args=(stream, into), daemon=True)
                         for stream, into in ((self.proc.stdout, self.stdout), (self.proc.stderr, self.stderr))]
        for reader in self._readers:
            reader.start()
        self.seen: set[int] = set()

    @staticmethod
    def _drain(stream: object, into: list[str]) -> None:
        for line in stream:  # type: ignore[attr-defined]
            into.append(line)

    def processes(self) -> dict[int, str]:
        """The tool's live processes (itself included until it is reaped)."""
        found = marked_processes(self.marker)
        self.seen.update(pid for pid, cmd in found.items() if "kvxfer.tools.node" in cmd)
        return found

    def nodes_seen(self) -> int:
        """How many engine node processes this run has had so far (a restarted writer is a new one)."""
        self.processes()
        return len(self.seen)

    def children(self, module: str) -> list[int]:
        return [pid for pid, cmd in self.processes().items() if pid != self.proc.pid and f"-m {module}" in cmd]

    def wait_until(self, what: str, predicate: Callable[[], bool], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.proc.poll() is not None:
                raise AssertionError(f"the tool exited ({self.proc.returncode}) before {what}:\n{self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}:\n{self.output()}")
            time.sleep(0.05)

    def printed(self, text: str) -> bool:
        return any(text in line for line in self.stdout)

    def output(self) -> str:
        return "".join(self.stdout)[-3000:] + "\n--- stderr\n" + "".join(self.stderr)[-3000:]

    def exit_status(self, timeout: float = GONE_WITHIN) -> int:
        try:
            status = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the tool did not exit within {timeout:g} s:\n{self.output()}") from None
        for reader in self._readers:
            reader.join(timeout=5)
        return status

    def kill_everything(self) -> None:
        """Teardown: whatever this run left, SIGKILLed (the assertions have already been made)."""
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        for reader, stream in zip(self._readers, (self.proc.stdout, self.proc.stderr)):
            reader.join(timeout=10)
            if not reader.is_alive():
                stream.close()  # type: ignore[union-attr]


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., ToolRun]]:
    runs: list[ToolRun] = []

    def starter(*args: str) -> ToolRun:
        tmp = tmp_path / f"tmp{len(runs)}"
        tmp.mkdir()
        runs.append(ToolRun(list(args), tmp))
        return runs[-1]

    yield starter
    for run in runs:
        run.kill_everything()


def assert_left_nothing(run: ToolRun, sockets: dict[int, int], ports: tuple[int, ...] = ()) -> None:
    """Within GONE_WITHIN seconds: no process of the run, none of its listening sockets, no kvxfer-* temp dir."""
    assert sockets, "the check is void: the tool's processes held no listening socket before the stop"
    deadline = time.monotonic() + GONE_WITHIN
    while True:
        survivors = run.processes()
        held = {inode: port for inode, port in listening_sockets().items() if inode in sockets}
        leftovers = sorted(p.name for p in run.tmp.glob("kvxfer-*"))
        if not survivors and not held and not leftovers:
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"{GONE_WITHIN:g} s after the stop: surviving processes {survivors}, "
                                 f"ports still listening {sorted(held.values())}, temp dirs left {leftovers}")
        time.sleep(0.1)
    for port in ports:
        assert _refuses(port), f"port {port} still accepts connections"


def _stop_line(run: ToolRun, before: int, tool: str, sig: signal.Signals) -> str:
    """The one line the tool wrote to stderr after the signal (``before``: stderr lines until then)."""
    assert "Traceback" not in "".join(run.stderr), run.output()
    lines = [line for line in run.stderr[before:] if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr after the signal, got {len(lines)}:\n{run.output()}"
    assert f"kvxfer {tool}" in lines[0] and sig.name in lines[0], lines[0]
    return lines[0]


# the tools, SIGKILLed ----------------------------------------------------------------------------------------


def test_sigkilled_demo_leaves_no_process_port_or_temp_dir(start):
    port = free_port_pair()
    run = start("demo", "--metrics-port", str(port), "--linger", "60")
    run.wait_until("the demo lingers", lambda: run.printed("lingering"))
    nodes = run.children("kvxfer.tools.node")
    assert len(nodes) == 2, run.processes()
    assert not _refuses(port) and not _refuses(port + 1), "the metrics endpoints are not up"
    assert list(run.tmp.glob("kvxfer-*")), "the demo keeps no temp dir: the check is void"
    sockets = listening_of(list(run.processes()))
    assert {port, port + 1} <= set(sockets.values()), sockets
    run.proc.kill()
    assert run.exit_status() == -signal.SIGKILL
    assert_left_nothing(run, sockets, ports=(port, port + 1))


@pytest.mark.parametrize("topology", [(), ("--prefill-tp", "2", "--decode-tp", "1", "--head-bytes", "32")],
                         ids=["pair", "prefill-tp2-decode-tp1"])
def test_sigkilled_stress_leaves_nothing_including_a_restarted_writer(start, topology):
    """One writer killed and replaced (with TP 2 on the prefill: one of its two rank processes)."""
    ranks = 3 if topology else 2
    run = start("stress", "--requests", "20000", "--concurrency", "4", "--prefill-pages", "512",
                "--decode-pages", "2048", "--median-tokens", "300", "--fault", "kill_sender=0.2", "--no-progress",
                *topology)
    # a writer was SIGKILLed and restarted at least once: one node process more than the ranks so far
    run.wait_until("a restarted writer", lambda: run.nodes_seen() >= ranks + 1)
    run.wait_until(f"{ranks} live nodes", lambda: len(run.children("kvxfer.tools.node")) == ranks)
    assert list(run.tmp.glob("kvxfer-*")), "stress keeps no temp dir: the check is void"
    sockets = listening_of(list(run.processes()))
    run.proc.kill()
    assert run.exit_status() == -signal.SIGKILL
    assert_left_nothing(run, sockets)


def _start_bench(start):
    """A long bench against the raw-socket baseline, once its two nodes and two peers run."""
    run = start("bench", "--total", "1G", "--request-bytes", "4M", "--page-bytes", "64K", "--repeat", "50",
                "--checks", "on", "--baselines", "raw-socket")
    run.wait_until("nodes and peers", lambda: len(run.children("kvxfer.tools.node")) == 2
                   and len(run.children("kvxfer.tools.bench.peers")) == 2)
    return run


def test_sigkilled_bench_leaves_no_node_or_peer_process(start):
    run = _start_bench(start)
    sockets = listening_of(list(run.processes()))
    run.proc.kill()
    assert run.exit_status() == -signal.SIGKILL
    assert_left_nothing(run, sockets)


# the tools, stopped: one line, 128 + N, nothing left ----------------------------------------------------------


def _signal(run: ToolRun, sig: signal.Signals, group: bool) -> int:
    """Send ``sig``; returns how many lines the tool had written to stderr until then."""
    time.sleep(0.2)  # let the readers catch up with what the tool wrote so far
    before = len(run.stderr)
    if group:  # Ctrl-C in a terminal: the whole foreground process group gets SIGINT
        os.killpg(run.proc.pid, sig)
    else:
        os.kill(run.proc.pid, sig)
    return before


@pytest.mark.parametrize(("sig", "group"), [(signal.SIGTERM, False), (signal.SIGINT, True)],
                         ids=["SIGTERM", "ctrl-c"])
def test_demo_stopped_mid_run_says_one_line_and_leaves_nothing(start, sig, group):
    run = start("demo", "--linger", "30")
    run.wait_until("both engine nodes", lambda: len(run.children("kvxfer.tools.node")) >= 2)
    sockets = listening_of(list(run.processes()))
    before = _signal(run, sig, group)
    assert run.exit_status() == 128 + sig, run.output()
    _stop_line(run, before, "demo", sig)
    assert_left_nothing(run, sockets)


def test_stress_stopped_by_ctrl_c_says_one_line_and_leaves_nothing(start):
    run = start("stress", "--requests", "20000", "--concurrency", "4", "--prefill-pages", "512",
                "--decode-pages", "2048", "--median-tokens", "300", "--no-progress")
    run.wait_until("two live nodes", lambda: len(run.children("kvxfer.tools.node")) == 2)
    time.sleep(1.0)  # mid-run: requests in flight
    sockets = listening_of(list(run.processes()))
    before = _signal(run, signal.SIGINT, True)
    assert run.exit_status() == 128 + signal.SIGINT, run.output()
    _stop_line(run, before, "stress", signal.SIGINT)
    assert_left_nothing(run, sockets)


def test_bench_stopped_by_sigterm_says_one_line_and_leaves_nothing(start):
    run = _start_bench(start)
    sockets = listening_of(list(run.processes()))
    before = _signal(run, signal.SIGTERM, False)
    assert run.exit_status() == 128 + signal.SIGTERM, run.output()
    _stop_line(run, before, "bench", signal.SIGTERM)
    assert_left_nothing(run, sockets)


@pytest.mark.parametrize(("sig", "group"), [(signal.SIGTERM, False), (signal.SIGINT, True)],
                         ids=["SIGTERM", "ctrl-c"])
def test_serve_toy_stopped_says_one_line_and_closes_its_port(start, sig, group):
    run = start("serve-toy", "--port", "0", "--max-seconds", "120")
    run.wait_until("the toy serves", lambda: run.printed("http://"))
    url = next(line for line in run.stdout if "http://" in line).split("http://", 1)[1].split()[0]
    port = int(url.rsplit(":", 1)[1])
    sockets = listening_of(list(run.processes()))
    assert port in sockets.values(), sockets
    before = _signal(run, sig, group)
    assert run.exit_status() == 128 + sig, run.output()
    _stop_line(run, before, "serve-toy", sig)
    assert_left_nothing(run, sockets, ports=(port,))
