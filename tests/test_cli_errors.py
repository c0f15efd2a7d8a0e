"""Issue 43: one error path for every subcommand of ``kvxfer``.

A mistake on the command line (a bad value, an output path that cannot be written, a busy port or one
outside 1..65535, memory the pools cannot have, a transport whose libraries are missing) is refused
before any work starts: exactly one line on stderr, ``kvxfer <command>: <reason>``, naming the flag,
exit status 2, no traceback, and nothing written to the output paths. ``kvxfer --debug`` shows the
traceback; ``kvxfer --version`` names the data path; an empty or wholly failed run never passes.

The first table runs the real command line (the cases the issue names), all at once; the second
calls :func:`kvxfer.tools.cli.main` in this process, with every job's body replaced by one that
fails the test if it is ever reached.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OUT = "{out}"  # replaced by a path in a writable directory: the refusal must leave it unwritten
PORT = "{port}"  # replaced by a port a socket of this module listens on


def _verbs_runs() -> bool:
    from kvxfer.transport import registry

    return registry.available("verbs")[0]


# (id, argv, command, what the line must name)
COMMAND_LINE = [
    ("serve-toy-busy-port", ["serve-toy", "--port", PORT], "serve-toy", "--port"),
    ("serve-toy-port-99999", ["serve-toy", "--port", "99999"], "serve-toy", "--port"),
    ("serve-toy-page-size-0", ["serve-toy", "--page-size", "0"], "serve-toy", "--page-size"),
    ("serve-toy-page-size-1e9", ["serve-toy", "--page-size", "1000000000"], "serve-toy", "--page-size"),
    ("bench-page-bytes-0", ["bench", "--page-bytes", "0", "--json", OUT], "bench", "--page-bytes"),
    ("bench-total-banana", ["bench", "--total", "banana", "--json", OUT], "bench", "--total"),
    ("bench-page-bytes-1T", ["bench", "--page-bytes", "1T", "--json", OUT], "bench", "--page-bytes"),
    ("bench-total-negative", ["bench", "--total", "-1", "--json", OUT], "bench", "--total"),
    ("bench-repeat-0", ["bench", "--repeat", "0", "--json", OUT], "bench", "--repeat"),
    ("bench-concurrency-negative", ["bench", "--concurrency", "-2", "--json", OUT], "bench", "--concurrency"),
    ("fleet-transport-bogus", ["fleet", "--transport", "bogus", "--json", OUT], "fleet", "--transport"),
    ("fleet-decodes-0", ["fleet", "--decodes", "0", "--json", OUT], "fleet", "--decodes"),
    ("simulate-pool-pages-1024", ["simulate", "--pool-pages", "1024", "--json", OUT], "simulate", "--pool-pages"),
    ("keygen-proc", ["keygen", "/proc/nope", "a"], "keygen", "directory /proc/nope"),
    ("stress-item-len-1e12", ["stress", "--item-len", "1000000000000", "--json", OUT], "stress", "--item-len"),
    ("stress-requests-negative", ["stress", "--requests", "-5", "--json", OUT], "stress", "--requests"),
    ("stress-json-no-dir", ["stress", "--requests", "5", "--json", "/nonexistent/dir/out.json"], "stress", "--json"),
    ("demo-json-no-dir", ["demo", "--json", "/nonexistent/d.json"], "demo", "--json"),
    ("demo-metrics-busy-port", ["demo", "--metrics-port", PORT, "--json", OUT], "demo", "--metrics-port"),
    ("demo-verbs-missing", ["demo", "--transport", "verbs", "--json", OUT], "demo", "--transport"),
    ("audit-probe-off-loopback", ["audit", "probe", "http://192.0.2.1:30000", "--words", "10"], "audit probe",
     "--i-own-this-deployment"),
    ("audit-capacity-no-log", ["audit", "capacity", "/nonexistent/prefill0.log"], "audit capacity", "LOG"),
]


@pytest.fixture(scope="module")
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _fill(argv: list[str], out: Path, port: int) -> list[str]:
    return [str(out) if part == OUT else str(port) if part == PORT else part for part in argv]


def _kvxfer(*argv: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    environment = {name: value for name, value in os.environ.items() if name != "KVXFER_DEBUG"}
    environment.update({"PYTHONPATH": str(ROOT), "COLUMNS": "200", **(env or {})})
    return subprocess.run([sys.executable, "-m", "kvxfer", *argv], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=environment)


@pytest.fixture(scope="module")
def command_line(busy_port: int, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """Every case of COMMAND_LINE run as a real command, four at a time: id -> (process, output path)."""
    base = tmp_path_factory.mktemp("outputs")

    def one(case: tuple) -> tuple:
        name, argv, _command, _flag = case
        out = base / f"{name}.json"
        if name == "demo-verbs-missing" and _verbs_runs():
            return None, out  # the demo would run: skipped below
        try:
            return _kvxfer(*_fill(argv, out, busy_port)), out
        except subprocess.TimeoutExpired as exc:  # the work started instead of a refusal
            return subprocess.CompletedProcess(exc.cmd, -1, exc.stdout or "", f"timed out: {exc.stderr!r}"), out

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip((case[0] for case in COMMAND_LINE), pool.map(one, COMMAND_LINE)))


def _assert_refused(code: int, out: str, err: str, command: str, flag: str) -> None:
    assert code == 2, f"exit status {code}, not 2; stderr: {err!r}"
    assert "Traceback" not in err and "Traceback" not in out, err
    assert err.count("\n") == 1 and err.endswith("\n"), f"not exactly one line on stderr: {err!r}"
    assert err.startswith(f"kvxfer {command}: "), err
    assert flag in err, f"{flag} not named: {err!r}"


@pytest.mark.parametrize(("name", "argv", "command", "flag"), COMMAND_LINE, ids=[case[0] for case in COMMAND_LINE])
def test_command_line_mistakes_are_one_line_naming_the_flag(command_line, name, argv, command, flag):
    if name == "demo-verbs-missing" and _verbs_runs():
        pytest.skip("verbs runs here: the demo would start")
    process, out = command_line[name]
    _assert_refused(process.returncode, process.stdout, process.stderr, command, flag)
    assert process.stdout == "", process.stdout
    assert not out.exists(), f"{out} was written"
    assert not Path("/nonexistent").exists() and not Path("/proc/nope").exists()


# in this process: every subcommand, a table of bad values -----------------------------------------------

IN_PROCESS = [
    # demo
    (["demo", "--linger", "-1", "--json", OUT], "demo", "--linger"),
    (["demo", "--metrics-port", "0"], "demo", "--metrics-port"),
    (["demo", "--metrics-port", "65535"], "demo", "--metrics-port"),
    (["demo", "--metrics-port", "http"], "demo", "--metrics-port"),
    (["demo", "--bogus"], "demo", "--bogus"),
    (["demo", "--transport", "rdma"], "demo", "--transport"),
    # stress
    (["stress", "--concurrency", "0", "--json", OUT], "stress", "--concurrency"),
    (["stress", "--duration", "0"], "stress", "--duration"),
    (["stress", "--duration", "nan"], "stress", "--duration"),
    (["stress", "--requests", "many"], "stress", "--requests"),
    (["stress", "--fault", "meteor=0.1"], "stress", "--fault"),
    (["stress", "--fault", "oversized=2"], "stress", "--fault"),
    (["stress", "--fault", "oversized"], "stress", "--fault"),
    (["stress", "--all-faults", "1.5"], "stress", "--all-faults"),
    (["stress", "--churn", "2", "--prefills", "2"], "stress", "--churn"),
    (["stress", "--prefills", "17"], "stress", "--prefills"),
    (["stress", "--decodes", "0"], "stress", "--decodes"),
    (["stress", "--item-len", "12"], "stress", "--item-len"),
    (["stress", "--item-len", "36"], "stress", "--item-len"),
    (["stress", "--layers", "0"], "stress", "--layers"),
    (["stress", "--decode-pages", "0"], "stress", "--decode-pages"),
    (["stress", "--max-chunks", "0"], "stress", "--max-chunks"),
    (["stress", "--sigma", "-1"], "stress", "--sigma"),
    (["stress", "--kv-heads", "0", "--prefill-tp", "2"], "stress", "--kv-heads"),
    (["stress", "--head-bytes", "36", "--prefill-tp", "2"], "stress", "--head-bytes"),
    (["stress", "--prefill-tp", "3"], "stress", "--prefill-tp"),
    (["stress", "--unsafe-legacy", "--prefill-pages", "8192", "--json", OUT], "stress", "--unsafe-legacy"),
    (["stress", "--report", "/nonexistent/r.png"], "stress", "--report"),
    (["stress", "--layers", "64", "--item-len", "1073741824"], "stress", "--item-len"),
    (["stress", "--gid-index", "-5"], "stress", "--gid-index"),
    (["stress", "--gid-index", "256"], "stress", "--gid-index"),
    # bench
    (["bench", "--total-small", "0"], "bench", "--total-small"),
    (["bench", "--request-bytes", "lots", "--json", OUT], "bench", "--request-bytes"),
    (["bench", "--page-bytes", "4.5"], "bench", "--page-bytes"),
    (["bench", "--baselines", "bogus,raw-socket", "--json", OUT], "bench", "--baselines"),
    (["bench", "--small-requests", "0,8"], "bench", "--small-requests"),
    (["bench", "--tp", "3:1"], "bench", "--tp"),
    (["bench", "--tp", "2:1", "--page-bytes", "100"], "bench", "--tp"),
    (["bench", "--ttft", "--ttft-tokens", "x"], "bench", "--ttft-tokens"),
    (["bench", "--ttft", "--flops", "0"], "bench", "--flops"),
    (["bench", "--ttft", "--model-layers", "0"], "bench", "--model-layers"),
    (["bench", "--first-request", "--decodes", "1"], "bench", "--decodes"),
    (["bench", "--first-request", "--steady", "0"], "bench", "--steady"),
    (["bench", "--small-requests", "--requests", "0"], "bench", "--requests"),
    (["bench", "--busy-caller", "2", "--ttft"], "bench", "--busy-caller"),
    (["bench", "--small-requests", "--busy-caller", "-1"], "bench", "--busy-caller"),
    (["bench", "--json", "/nonexistent/b.json"], "bench", "--json"),
    (["bench", "--request-bytes", "1G", "--total", "1G", "--concurrency", "64", "--json", OUT], "bench",
     "--request-bytes"),
    # the other modes' pools are sized before any child starts (terabytes: more than any machine here)
    (["bench", "--small-requests", "8,4096", "--page-bytes", "1G", "--json", OUT], "bench", "--small-requests"),
    (["bench", "--ttft", "--ttft-tokens", "128,50000000", "--json", OUT], "bench", "--ttft-tokens"),
    (["bench", "--first-request", "--request-bytes", "4096G", "--json", OUT], "bench", "--first-request"),
    (["bench", "--gid-index", "x"], "bench", "--gid-index"),
    # serve-toy
    (["serve-toy", "--context", "0"], "serve-toy", "--context"),
    (["serve-toy", "--decode-pages", "1"], "serve-toy", "--decode-pages"),
    (["serve-toy", "--host", "192.0.2.1", "--port", "0"], "serve-toy", "--host"),
    (["serve-toy", "--port", "-1"], "serve-toy", "--port"),
    (["serve-toy", "--max-seconds", "0"], "serve-toy", "--max-seconds"),
    (["serve-toy", "--token-cost-us", "-1"], "serve-toy", "--token-cost-us"),
    # fleet
    (["fleet", "--per-process", "0", "--json", OUT], "fleet", "--per-process"),
    (["fleet", "--max-peers", "0"], "fleet", "--max-peers"),
    (["fleet", "--connect-timeout", "0"], "fleet", "--connect-timeout"),
    (["fleet", "--json", "/nonexistent/f.json"], "fleet", "--json"),
    # simulate
    (["simulate", "--seeds", "0", "--json", OUT], "simulate", "--seeds"),
    (["simulate", "--hold-steps", "5-2"], "simulate", "--hold-steps"),
    (["simulate", "--hold-steps", "x"], "simulate", "--hold-steps"),
    (["simulate", "--policies", "mru"], "simulate", "--policies"),
    (["simulate", "--warmups", "1,x"], "simulate", "--warmups"),
    (["simulate", "--sigma", "-1"], "simulate", "--sigma"),
    (["simulate", "--oversized-tokens", "0"], "simulate", "--oversized-tokens"),
    (["simulate", "--png", "/nonexistent/p.png"], "simulate", "--png"),
    # audit
    (["audit", "probe", "http://127.0.0.1:9", "--words", "0"], "audit probe", "--words"),
    (["audit", "probe", "http://127.0.0.1:9", "--words", "5", "--max-requests", "1"], "audit probe", "--max-requests"),
    (["audit", "probe", "http://127.0.0.1:9", "--words", "5", "--timeout", "0"], "audit probe", "--timeout"),
    (["audit", "probe", "http://127.0.0.1:99999", "--words", "5"], "audit probe", "URL"),
    (["audit", "probe", "ftp://127.0.0.1/", "--words", "5"], "audit probe", "URL"),
    (["audit", "probe", "http://127.0.0.1:9", "--words", "5"], "audit probe", "URL"),  # nothing listens there
    (["audit", "capacity", "{dir}"], "audit capacity", "LOG"),
    # keygen
    (["keygen", "{dir}", "a", "a"], "keygen", "NAME"),
    (["keygen", "{dir}", "..."], "keygen", "NAME"),
    (["keygen", "{file}", "a"], "keygen", "directory"),
    (["keygen", "{dir}", "existing"], "keygen", "--force"),
]


class WorkStarted(BaseException):
    """A job's body ran: the mistake was not refused before the work."""


@pytest.fixture
def no_work(monkeypatch):
    """Every job's body, replaced by one that raises WorkStarted."""
    import kvxfer.tools.audit.capacity as capacity
    import kvxfer.tools.audit.probe as probe
    import kvxfer.tools.bench as bench
    import kvxfer.tools.bench.ttft as ttft
    import kvxfer.tools.demo as demo
    import kvxfer.tools.fleet as fleet
    import kvxfer.tools.simulate as simulate
    import kvxfer.tools.stress as stress
    import kvxfer.tools.toy as toy

    def started(*args, **kwargs):
        raise WorkStarted()

    for module, name in ((bench, "run_bench"), (ttft, "run_ttft"), (stress, "run_stress"), (demo, "run_demo"),
                         (toy, "serve"), (fleet, "run_fleet"), (simulate, "sweep"), (probe, "run_probe"),
                         (capacity, "analyse")):
        monkeypatch.setattr(module, name, started)


@pytest.mark.parametrize(("argv", "command", "flag"), IN_PROCESS, ids=["_".join(case[0])[:60] for case in IN_PROCESS])
def test_every_subcommand_refuses_bad_values_before_any_work(no_work, capsys, tmp_path, argv, command, flag):
    from kvxfer.tools import cli

    out = tmp_path / "out" / "result.json"
    out.parent.mkdir()
    (tmp_path / "file").write_text("not a directory\n")
    (tmp_path / "existing").mkdir()
    argv = [part.replace("{dir}", str(tmp_path)).replace("{file}", str(tmp_path / "file"))
            .replace(OUT, str(out)) for part in argv]
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse's own exit: not main's one error path
        code = f"SystemExit({exc.code})"
    captured = capsys.readouterr()
    _assert_refused(code, captured.out, captured.err, command, flag)
    assert captured.out == "", captured.out
    assert sorted(p.name for p in out.parent.iterdir()) == [], "an output was written"


def _subcommands(parser, prefix: str = "") -> set[str]:
    """Every subcommand of ``parser`` that runs a job, as its errors name it ("stress", "audit probe")."""
    import argparse

    found: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                below = _subcommands(sub, f"{prefix}{name} ")
                found |= below or {f"{prefix}{name}"}
    return found


def test_the_tables_cover_every_subcommand():
    """A subcommand added to the parser without a bad-value row here fails this test."""
    from kvxfer.tools import cli

    commands = _subcommands(cli.build_parser())
    assert {"demo", "stress", "bench", "audit probe", "audit capacity"} <= commands  # the walk finds them
    covered = {case[1] for case in IN_PROCESS}
    assert commands <= covered, f"no bad-value row for: {sorted(commands - covered)}"
    assert {case[2] for case in COMMAND_LINE} <= commands


@pytest.mark.parametrize("command", ["demo", "stress", "bench"])
def test_a_bad_transport_variable_is_named(no_work, capsys, monkeypatch, command):
    monkeypatch.setenv("KVXFER_TRANSPORT", "bogus")
    from kvxfer.tools import cli

    code = cli.main([command])
    captured = capsys.readouterr()
    _assert_refused(code, captured.out, captured.err, command, "KVXFER_TRANSPORT=bogus")
    assert "unknown transport 'bogus' (available: " in captured.err
    assert cli.main([command, "--transport", "rdma"]) == 2  # the flag, when given, is what is judged
    assert "argument --transport" in capsys.readouterr().err


def test_unrecognized_and_missing_arguments_are_one_line(capsys):
    from kvxfer.tools import cli

    assert cli.main(["bench", "--totl", "1M"]) == 2
    assert capsys.readouterr().err == "kvxfer bench: unrecognized arguments: --totl 1M\n"
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvxfer: ") and err.count("\n") == 1 and "command" in err


# --debug, errors while working, --version ----------------------------------------------------------------


def test_debug_shows_the_traceback_and_still_the_one_line():
    plain = _kvxfer("simulate", "--pool-pages", "1024")
    _assert_refused(plain.returncode, plain.stdout, plain.stderr, "simulate", "--pool-pages")
    debug = _kvxfer("--debug", "simulate", "--pool-pages", "1024")
    assert debug.returncode == 2
    assert "Traceback (most recent call last)" in debug.stderr and "ConfigError" in debug.stderr
    assert debug.stderr.splitlines()[-1] == plain.stderr.strip()
    via_env = _kvxfer("simulate", "--pool-pages", "1024", env={"KVXFER_DEBUG": "1"})
    assert "Traceback" in via_env.stderr


def test_an_error_while_working_is_one_line_with_exit_1_and_debug_shows_where(monkeypatch, capsys):
    from kvxfer.tools import cli, simulate

    def broken(config):
        raise RuntimeError("the ledger caught fire")

    monkeypatch.setattr(simulate, "sweep", broken)
    assert cli.main(["simulate", "--seeds", "1", "--warmups", "0", "--policies", "lifo"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvxfer simulate: RuntimeError: the ledger caught fire")
    assert "--debug" in err and "Traceback" not in err
    assert cli.main(["--debug", "simulate", "--seeds", "1", "--warmups", "0", "--policies", "lifo"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "in broken" in err


def test_a_probe_whose_target_fails_during_the_work_is_exit_1():
    """Something accepts the connection (the check passes) and then drops every request: the probe ran and
    failed, an ERROR verdict with exit status 1, not the refusals' 2."""
    import threading

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.2)
        done = threading.Event()

        def drop() -> None:
            while not done.is_set():
                try:
                    server.accept()[0].close()
                except OSError:
                    continue

        thread = threading.Thread(target=drop, daemon=True)
        thread.start()
        try:
            out = _kvxfer("audit", "probe", f"http://127.0.0.1:{server.getsockname()[1]}", "--words", "5",
                          "--markers", "2", "--timeout", "5", "--json")
        finally:
            done.set()
            thread.join()
    assert out.returncode == 1, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["verdict"] == "ERROR" and report["planted"] == 0
    assert any(reason.startswith("planting failed: ") for reason in report["reasons"]), report["reasons"]


def test_a_node_that_cannot_start_says_why():
    """A child that fails to start reports its own reason (here: a pool no machine can map), not only
    that it exited with status 1."""
    from kvxfer.errors import KvxferError
    from kvxfer.tools.node import NodeSpec, spawn

    with pytest.raises(KvxferError, match="decode node could not start: OSError: Cannot allocate memory"):
        spawn(NodeSpec(role="decode", num_buffers=1, item_len=1 << 40, num_pages=1 << 20, page_size=1,
                       config={"max_context": 1}, log_level="CRITICAL"), stderr=subprocess.DEVNULL)


def test_version_names_the_data_path():
    from kvxfer.core import native

    out = _kvxfer("--version")
    assert out.returncode == 0 and out.stdout.startswith("kvxfer ")
    line = out.stdout.splitlines()[1]
    if native.available():
        assert line.startswith("data path: native C")
        assert ("zlib-ng, called from C" in line) == native.checksums_in_c
    else:
        assert line.startswith("data path: pure-Python fallback, because ")
    pure = _kvxfer("--version", env={"KVXFER_PURE_PYTHON": "1"})
    assert "data path: pure-Python fallback, because KVXFER_PURE_PYTHON=1" in pure.stdout


def test_version_says_why_the_extension_is_missing_and_what_to_install():
    """A missing extension reads as Python's "cannot import name '_native' from partially initialized
    module 'kvxfer' (most likely due to a circular import)": --version says what it means instead."""
    hide = ("import sys\n"
            "class Hide:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'kvxfer._native':\n"
            "            raise ModuleNotFoundError('No module named ' + repr(name), name=name)\n"
            "sys.meta_path.insert(0, Hide())\n"
            "from kvxfer.tools.cli import main\n"
            "sys.exit(main(['--version']))\n")
    out = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "KVXFER_PURE_PYTHON": "0"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[1].startswith("data path: pure-Python fallback, because the C extension kvxfer._native is not built")
    assert "partially initialized" not in out.stdout and "circular" not in out.stdout
    assert "C compiler" in lines[2] and "python3-dev" in lines[2] and "reinstall" in lines[2]


def test_a_command_on_the_fallback_says_so_unless_it_was_asked_for(tmp_path):
    """Built without a compiler, the demo runs (slower) on the pure-Python path and says so once, with
    what to install; KVXFER_PURE_PYTHON=1 (asked for) gets no note."""
    hide = ("import sys\n"
            "class Hide:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'kvxfer._native':\n"
            "            raise ModuleNotFoundError('No module named ' + repr(name), name=name)\n"
            "sys.meta_path.insert(0, Hide())\n"
            "from kvxfer.tools.cli import main\n"
            "sys.exit(main(['demo', '--json', sys.argv[1]]))\n")
    for value, noted in (("0", True), ("1", False)):
        out = subprocess.run([sys.executable, "-c", hide, str(tmp_path / f"demo-{value}.json")], capture_output=True,
                             text=True, timeout=300, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT), "KVXFER_PURE_PYTHON": value})
        assert out.returncode == 0, out.stderr[-2000:]
        notes = [line for line in out.stderr.splitlines() if line.startswith("kvxfer demo: note: pure-Python")]
        assert len(notes) == (1 if noted else 0), out.stderr[-2000:]
        if noted:
            assert "C compiler" in notes[0] and "reinstall" in notes[0]


# empty and failed runs never pass -------------------------------------------------------------------------


def test_unsafe_legacy_alone_injects_the_incidents_fault_and_fails():
    out = _kvxfer("stress", "--unsafe-legacy", "--requests", "40", "--no-progress", timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    text = " ".join(out.stdout.split())
    assert "injecting the incident's fault, oversized at rate 0.2" in text
    assert "FAIL: " in text and "leaked pages" in text and "PASS" not in text


@pytest.mark.parametrize("argv", [["--seed", "2"], ["--fault", "oversized=0"]], ids=["no-fault-drawn", "rate-0"])
def test_unsafe_legacy_that_injected_nothing_is_inconclusive(tmp_path, argv):
    """The negative control with no fault fired (seed 2 draws none of oversized=0.2 in 20 requests; a rate of
    0 never does) could not leak: not a PASS, exit 1."""
    report = tmp_path / "stress.json"
    out = _kvxfer("stress", "--unsafe-legacy", "--requests", "20", "--no-progress", "--json", str(report), *argv,
                  timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    text = " ".join(out.stdout.split())
    assert "INCONCLUSIVE: --unsafe-legacy injected nothing, so the incident's leak could not happen" in text
    assert "PASS" not in text and "Traceback" not in out.stderr
    summary = json.loads(report.read_text())
    assert summary["ok"] is False and not any(summary["faults"].values()) and summary["completed"] == 20


def test_the_unsafe_legacy_verdict_needs_a_fault_that_fired():
    from kvxfer.tools.stress.report import verdict_text

    clean = {"leaked_pages": 0, "corrupted_pages": 0, "lost_pages": 0, "rejected_succeeded": 0,
             "accounting_errors": [], "settled": True, "requests": 7, "completed": 7, "unsafe_legacy": True}
    assert verdict_text({**clean, "faults": {"oversized": 0}}).startswith("INCONCLUSIVE: --unsafe-legacy injected")
    assert verdict_text({**clean, "faults": {}, "net_faults": {"fired": {"link_down": 1}}}).startswith("PASS")
    assert verdict_text({**clean, "faults": {"oversized": 0}, "leaked_pages": 3}).startswith("FAIL: 3 leaked")
    assert verdict_text({**clean, "unsafe_legacy": False, "faults": {}}).startswith("PASS")


def test_a_stress_run_where_nothing_completed_is_not_a_pass():
    from kvxfer.tools.stress.report import verdict_text

    clean = {"leaked_pages": 0, "corrupted_pages": 0, "lost_pages": 0, "rejected_succeeded": 0,
             "accounting_errors": [], "settled": True}
    assert verdict_text({**clean, "requests": 0, "completed": 0}) == "FAIL: no request ran"
    assert verdict_text({**clean, "requests": 7, "completed": 0}).startswith("FAIL: none of the 7 requests completed")
    assert verdict_text({**clean, "requests": 7, "completed": 1}).startswith("PASS")


def test_a_bench_that_measured_nothing_exits_non_zero(monkeypatch, capsys):
    """``bench --repeat 0`` printed "FAILED: no round completed" for every case and exited 0."""
    from kvxfer.tools import bench
    from kvxfer.tools.bench import BenchConfig, CaseResult, Session

    class Idle(Session):
        def start(self):
            pass

        def run_once(self):
            return 0.01

        def close(self, *, measure=True):
            pass

    def sessions(config, page_bytes, node_log, skip=None):
        return [Idle(CaseResult(transport="kvxfer-tcp", page_bytes=page_bytes, bytes=page_bytes, seconds=0.0,
                                checks="on"))]

    monkeypatch.setattr(bench, "sessions_for", sessions)
    monkeypatch.setattr(bench, "missing_baselines", lambda config: {})
    assert bench.run_bench(BenchConfig(repeat=0, page_sizes=[4096], baselines=[]), progress=False) == 1
    assert "FAIL: 1 kvxfer case(s) measured nothing" in capsys.readouterr().out
    assert bench.run_bench(BenchConfig(repeat=1, page_sizes=[4096], baselines=[]), progress=False) == 0


def test_a_fleet_with_no_decode_is_not_a_pass():
    from kvxfer.tools.fleet import FleetConfig, _problems

    idle = {"fds": 10, "threads": 3, "rss": 0}
    report = {"prefill_idle": idle, "prefill_after": idle, "forgotten_after_s": 0.0, "prefill_pool_free": [64, 64]}
    assert _problems(report, FleetConfig(decodes=0)) == ["no decode took part: nothing was tested"]


def test_demo_engines_that_cannot_start_are_a_setup_failure_not_a_failed_row(busy_port, capsys):
    """What the command line cannot check ahead (the port was free then) still ends the demo as a setup
    failure, not as the row "undersized prefill pool refused without the override"."""
    from kvxfer.tools.demo import SetupFailed, run_demo

    with pytest.raises(SetupFailed, match="cannot serve metrics"):
        run_demo(metrics_port=busy_port - 1)  # the prefill's metrics go on P + 1: taken
    out = capsys.readouterr().out
    assert "undersized prefill pool" not in out and "expectations" not in out
