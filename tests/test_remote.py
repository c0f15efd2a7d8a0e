"""The agent and stand-in of kvxfer.tools.remote, as the two-machine stress run uses them, on loopback.

Real processes and sockets: an agent started as ``python -m kvxfer.tools.remote serve``, programs run
behind ``proxy``. Across the soft-RoCE pair (two guests, verbs, network faults) the same code runs in
CI through tools/softroce/stress-pair.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from kvxfer.errors import PeerError
from kvxfer.tools import remote

TOKEN = "test-token-0123456789"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def agent(monkeypatch):
    monkeypatch.setenv(remote.TOKEN_ENV, TOKEN)
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvxfer.tools.remote", "serve", "--listen", f"127.0.0.1:{port}"],
                            stdout=subprocess.PIPE, text=True, env=dict(os.environ, **{remote.TOKEN_ENV: TOKEN}))
    try:
        assert "listening on 127.0.0.1" in proc.stdout.readline()
        yield f"127.0.0.1:{port}", proc
    finally:
        proc.terminate()
        proc.wait(10)
        proc.stdout.close()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purposes
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _wait_gone(pid: int, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _pid_alive(pid):
            return True
        time.sleep(0.05)
    return False


def _stand_in(address: str, *program: str) -> subprocess.Popen:
    return subprocess.Popen([*remote.proxy_argv(address), *program], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_run_gives_the_status_and_output_of_a_command_there(agent):
    address, _ = agent
    done = remote.run(address, ["sh", "-c", "echo there; echo err >&2; exit 3"])
    assert done.returncode == 3 and done.stdout == "there\nerr\n"


def test_a_client_without_the_token_is_refused_and_nothing_runs(agent, monkeypatch, tmp_path):
    address, _ = agent
    marker = tmp_path / "ran"
    monkeypatch.setenv(remote.TOKEN_ENV, "not-the-token")
    with pytest.raises(PeerError, match="refused: wrong or missing token"):
        remote.run(address, ["touch", str(marker)])
    stand_in = _stand_in(address, "touch", str(marker))
    out, err = stand_in.communicate(timeout=30)
    assert stand_in.returncode == 1 and "refused: wrong or missing token" in err, (out, err)
    assert not marker.exists()


def test_the_stand_in_relays_output_and_exits_with_the_programs_status(agent):
    address, _ = agent
    stand_in = _stand_in(address, "sh", "-c", "echo one; sleep 0.2; echo two; exit 5")
    out, err = stand_in.communicate(timeout=30)
    assert (out, stand_in.returncode) == ("one\ntwo\n", 5), err


def test_sigkill_of_the_stand_in_kills_the_program_there(agent):
    address, _ = agent
    stand_in = _stand_in(address, "sh", "-c", "echo $$; exec sleep 300")
    pid = int(stand_in.stdout.readline())
    assert _pid_alive(pid)
    stand_in.kill()
    stand_in.wait(10)
    assert _wait_gone(pid), "the program outlived its stand-in's SIGKILL"
    stand_in.stdout.close()
    stand_in.stderr.close()


def test_sigterm_to_the_stand_in_reaches_the_program(agent):
    address, _ = agent
    stand_in = _stand_in(address, sys.executable, "-c",
                         "import os, signal, sys, time\n"
                         "signal.signal(signal.SIGTERM, lambda *a: (print('got TERM', flush=True), sys.exit(7)))\n"
                         "print(os.getpid(), flush=True)\n"
                         "time.sleep(300)")
    pid = int(stand_in.stdout.readline())
    stand_in.send_signal(signal.SIGTERM)
    out, _ = stand_in.communicate(timeout=30)
    assert (out, stand_in.returncode) == ("got TERM\n", 7)
    assert _wait_gone(pid)


def test_the_agents_programs_die_with_the_agent(agent):
    address, proc = agent
    stand_in = _stand_in(address, "sh", "-c", "echo $$; exec sleep 300")
    pid = int(stand_in.stdout.readline())
    proc.terminate()
    proc.wait(10)
    assert _wait_gone(pid), "a program outlived the agent"
    assert stand_in.wait(10) == 1 and "went away" in stand_in.stderr.read()
    stand_in.stdout.close()
    stand_in.stderr.close()


def test_the_agent_needs_a_token_and_a_clear_address(monkeypatch):
    env = {k: v for k, v in os.environ.items() if k != remote.TOKEN_ENV}
    for argv, message in ((["serve", "--listen", "127.0.0.1:1"], f"{remote.TOKEN_ENV} is not set"),
                          (["serve", "--listen", "nowhere"], "agent address 'nowhere' is not host:port")):
        run = subprocess.run([sys.executable, "-m", "kvxfer.tools.remote", *argv], capture_output=True, text=True,
                             env=dict(env, **({remote.TOKEN_ENV: TOKEN} if "nowhere" in argv else {})), timeout=60)
        assert run.returncode == 2 and run.stderr.count("\n") == 1 and message in run.stderr, run.stderr


def test_stress_peer_agent_mistakes_are_one_line_naming_the_flag(capsys):
    from kvxfer.tools import cli

    for extra, message in (
            (["--peer-agent", "127.0.0.1:7700"], "--peer-agent needs --two-hosts"),
            (["--two-hosts", "--peer-agent", "no-port"], "agent address 'no-port' is not host:port"),
            (["--two-hosts", "--peer-agent", "127.0.0.1:7700", "--transport", "shm"], "runs over tcp or verbs"),
            (["--two-hosts", "--peer-agent", "127.0.0.1:7700", "--net-fault", "stop_decode"],
             "--net-fault stop_decode: a process on the other machine"),
            (["--two-hosts", "--transport", "verbs"], "give --peer-agent")):
        assert cli.main(["stress", "--requests", "5", *extra]) == 2, extra
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("kvxfer stress: ") and message in err, (extra, err)
