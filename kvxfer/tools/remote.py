"""Processes on another machine for the tools: an agent there, a local stand-in process here.

``kvxfer stress --two-hosts --peer-agent tcp://HOST:PORT`` runs its decodes on a second machine (the
soft-RoCE pair's guest b: verbs across a real wire, which network namespaces cannot give on the VM's
kernel). That machine runs the agent, ``python -m kvxfer.tools.remote serve --listen HOST:PORT``, on a
management link that the stress run's faults never touch; the driver reaches it two ways:

* **spawn** (:func:`proxy_argv`, the ``proxy`` command): a local *stand-in* process asks the agent to
  start a program there and relays its standard output line by line, so the stand-in can be driven as
  the program itself (:func:`kvxfer.tools.node.spawn` takes its argv as a prefix). SIGTERM or SIGINT
  to the stand-in is passed on; when the stand-in dies (SIGKILL included: its connection closes) the
  agent SIGKILLs the program: a kill of the stand-in is a kill of the remote process, sockets and
  queue pairs and all. The stand-in exits with the program's status; when the agent stops, it kills its
  programs and their stand-ins exit 1 saying the agent went away.
* **run** (:func:`run`): one command, its exit status and output (the wire faults on that machine).

Invariants: the agent serves only a client that presents its token (``KVXFER_REMOTE_TOKEN``, the same
on both machines; compared in constant time; the agent refuses to start without one); every program
it starts dies with its connection or with the agent, whichever goes first; a stop signal ends the
agent and its programs. This is a test tool for machines the tester owns, on a private link; it is
not a remote-execution service for production hosts.
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import signal
import socket
import socketserver
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any

from ..core.arguments import split_host_port
from ..errors import ConfigError, InvalidArgument, PeerError
from . import procs

TOKEN_ENV = "KVXFER_REMOTE_TOKEN"
CONNECT_TIMEOUT = 10.0
RUN_TIMEOUT = 60.0
_PASSED_ENV = ("KVXFER_",)  # the stand-in passes these on to the program (minus the lifeline's own)
_LOCAL_ONLY = (procs.LIFELINE_ENV, procs.ORPHAN_PATHS_ENV, procs.CPUS_ENV, TOKEN_ENV)


def _token() -> str:
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        raise ConfigError(f"{TOKEN_ENV} is not set: the agent and its clients share a token")
    return token


def _endpoint(address: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``tcp://HOST:PORT``."""
    try:
        return split_host_port(address.removeprefix("tcp://"), "agent address")
    except InvalidArgument as exc:
        raise ConfigError(exc.detail) from None


def _connect(address: str, request: dict[str, Any]) -> tuple[socket.socket, Any]:
    host, port = _endpoint(address)
    try:
        sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT)
    except OSError as exc:
        raise PeerError(f"no agent at {address}: {exc}") from None
    sock.settimeout(None)
    sock.sendall(json.dumps({"token": _token(), **request}).encode() + b"\n")
    return sock, sock.makefile("r", encoding="utf-8")


def run(address: str, argv: Sequence[str], *, timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess[str]:
    """``argv`` run on the agent's machine: its status and output (stdout and stderr together)."""
    sock, lines = _connect(address, {"op": "run", "argv": list(argv), "timeout": timeout})
    with sock, lines:
        sock.settimeout(timeout + CONNECT_TIMEOUT)
        line = lines.readline()
    if not line:
        raise PeerError(f"the agent at {address} closed the connection running {' '.join(argv)}")
    answer = json.loads(line)
    if "error" in answer:
        raise PeerError(f"the agent at {address}: {answer['error']}")
    return subprocess.CompletedProcess(list(argv), int(answer["exit"]), answer.get("out", ""), "")


def proxy_argv(address: str) -> list[str]:
    """The argv prefix that runs a program on the agent's machine behind a local stand-in."""
    return [sys.executable, "-m", "kvxfer.tools.remote", "proxy", "--agent", address, "--"]


# the stand-in ------------------------------------------------------------------------------------


def _proxy(address: str, argv: list[str]) -> int:
    procs.adopt()  # the stand-in dies with the driver, and so the remote program
    env = {k: v for k, v in os.environ.items() if k.startswith(_PASSED_ENV) and k not in _LOCAL_ONLY}
    sock, lines = _connect(address, {"op": "spawn", "argv": argv, "env": env})
    send_lock = threading.Lock()

    def forward(signum: int, _frame: object) -> None:
        with send_lock:
            try:
                sock.sendall(json.dumps({"signal": signum}).encode() + b"\n")
            except OSError:
                pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    for line in lines:
        message = json.loads(line)
        if "out" in message:
            sys.stdout.write(message["out"])
            sys.stdout.flush()
        elif "exit" in message:
            return int(message["exit"])
        elif "error" in message:
            print(f"kvxfer remote: {message['error']}", file=sys.stderr)
            return 1
    print(f"kvxfer remote: the agent at {address} went away", file=sys.stderr)
    return 1


# the agent ---------------------------------------------------------------------------------------


class _Handler(socketserver.StreamRequestHandler):
    server: _Agent

    def handle(self) -> None:
        try:
            request = json.loads(self.rfile.readline() or b"{}")
        except ValueError:
            return self._send({"error": "not a JSON request"})
        if not isinstance(request, dict) or not hmac.compare_digest(str(request.get("token", "")).encode(),
                                                                     self.server.token.encode()):
            return self._send({"error": "refused: wrong or missing token"})
        argv = request.get("argv")
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            return self._send({"error": "argv must be a non-empty list of strings"})
        if request.get("op") == "run":
            return self._run(argv, float(request.get("timeout") or RUN_TIMEOUT))
        if request.get("op") == "spawn":
            return self._spawn(argv, request.get("env") or {})
        return self._send({"error": f"unknown op {request.get('op')!r} (known: run, spawn)"})

    def _send(self, message: dict[str, Any]) -> None:
        try:
            self.wfile.write(json.dumps(message).encode() + b"\n")
            self.wfile.flush()
        except OSError:
            pass

    def _run(self, argv: list[str], timeout: float) -> None:
        try:
            done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
            self._send({"exit": done.returncode, "out": done.stdout[-4000:]})
        except (OSError, subprocess.TimeoutExpired) as exc:
            self._send({"error": f"{' '.join(argv)}: {exc}"})

    def _spawn(self, argv: list[str], env: dict[str, str]) -> None:
        child_env = dict(os.environ)
        child_env.pop(TOKEN_ENV, None)
        child_env.update({str(k): str(v) for k, v in env.items() if str(k).startswith(_PASSED_ENV)})
        try:
            child = procs.popen(argv, env=child_env, stdout=subprocess.PIPE, text=True)
        except OSError as exc:
            return self._send({"error": f"{argv[0]}: {exc}"})
        self.server.children.add(child)

        def watch_client() -> None:  # a signal to pass on, or the stand-in gone: the program goes too
            for line in self.rfile:
                try:
                    signum = int(json.loads(line).get("signal"))
                    child.send_signal(signum)
                except (ValueError, TypeError, AttributeError, OSError):
                    pass
            if child.poll() is None:
                child.kill()

        threading.Thread(target=watch_client, daemon=True, name="kvxfer-remote-client").start()
        try:
            assert child.stdout is not None
            for line in child.stdout:
                self._send({"out": line})
            status = child.wait()
            if not self.server.stopping.is_set():  # a kill by the stopping agent is the agent's death, not the program's
                self._send({"exit": status if status >= 0 else 128 - status})  # a signal's death as the shell says it
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
            self.server.children.discard(child)


class _Agent(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], token: str) -> None:
        self.token = token
        self.children: set[subprocess.Popen] = set()
        self.stopping = threading.Event()
        super().__init__(address, _Handler)

    def kill_children(self) -> None:
        """Kill every program on the agent's way out; their stand-ins see the agent go away (exit 1), never
        the status of a program the agent killed (set before the kills, so no handler can race it)."""
        self.stopping.set()
        for child in list(self.children):
            if child.poll() is None:
                child.kill()


def _serve(listen: str) -> int:
    host, port = _endpoint(listen)
    token = _token()
    procs.stop_on_signals()
    agent = _Agent((host, port), token)
    print(f"kvxfer remote agent: listening on {host}:{agent.server_address[1]}", flush=True)
    thread = threading.Thread(target=agent.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.5)
    except procs.Interrupted as stop:
        return 128 + stop.signum
    finally:
        agent.shutdown()
        agent.kill_children()
        agent.server_close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvxfer.tools.remote", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="the agent: start programs for clients that present the token")
    serve.add_argument("--listen", required=True, metavar="HOST:PORT", help="where to listen (the management link)")
    proxy = sub.add_parser("proxy", help="a local stand-in for a program run by the agent")
    proxy.add_argument("--agent", required=True, metavar="HOST:PORT")
    proxy.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            return _serve(args.listen)
        program = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        if not program:
            parser.error("proxy: the program to run follows --")
        return _proxy(args.agent, program)
    except (ConfigError, PeerError) as exc:
        print(f"kvxfer remote: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
