"""Child processes that die with their parent, and the signals that stop kvxfer's tools.

kvxfer's tools (``demo``, ``stress``, ``bench``) run engines and baselines in child processes. This
module owns the rule that none of them outlives its tool, however the tool ends, SIGKILL included:

* **Lifeline.** Every child started with :func:`popen` inherits the read end of a pipe whose write
  end only the parent holds (one pipe per parent process, never written to). When the parent is gone,
  for whatever reason, the kernel closes the write end and the child's :func:`adopt` thread reads
  EOF. This needs no platform support and works whichever thread started the child.
* **Parent-death signal.** On Linux, a child started from the parent's main thread also asks the
  kernel for SIGTERM when its parent exits (``prctl(PR_SET_PDEATHSIG)``). The child sets it itself,
  first thing in :func:`adopt`, rather than in a ``preexec_fn`` (unsafe in a parent with threads);
  the kernel ties it to the *thread* that forked, so it is asked for only when that thread is the
  main thread, whose end is the process's end. A program that cannot call :func:`adopt`
  (``ib_write_bw``) gets SIGKILL as its parent-death signal from :func:`popen_foreign`'s
  ``preexec_fn`` instead, under the same main-thread rule.
* **Temporary directories.** A SIGKILLed parent cannot remove its own, and a directory nobody removes
  is a leak. So the parent creates them with :class:`TempDir`, which registers the path;
  :func:`popen` hands every registered path to the child, and a child that finds its parent gone
  removes them before it stops (idempotently: every child may try, any one suffices). A parent that
  ends normally removes them itself. The only window with nobody left to remove a directory is
  between creating it and starting the first child, which the tools keep to a few milliseconds.
* **Stopping a tool.** :func:`run_stoppable` turns SIGTERM, SIGINT and SIGHUP into
  :class:`Interrupted`, which unwinds the tool through its ``finally`` blocks (children stopped,
  temporary directories removed), prints one line naming the tool and the signal, and returns
  128 + N, the shell's convention for a death by signal N. A second signal while it unwinds exits at
  once; the children then still follow through the lifeline.
* **CPUs.** ``popen(..., cpus=...)`` asks the child to run on those CPUs only; :func:`adopt` applies
  it first thing, to every thread the child has (a library may have started some as it was
  imported) and so to every thread it starts later (the bench's ``--pin``: the prefill and the
  decode side on CPUs of their own, as on two machines).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

LIFELINE_ENV = "KVXFER_LIFELINE"  # "READ_FD PARENT_PID PDEATHSIG(0|1)", for adopt()
ORPHAN_PATHS_ENV = "KVXFER_ORPHAN_PATHS"  # directories the child removes if the parent dies first
CPUS_ENV = "KVXFER_CPUS"  # "0,1": the CPUs the child runs on (adopt() applies it)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1

_lock = threading.RLock()  # reentrant: a TempDir finalizer may run (GC) while it is held
_lifeline: tuple[int, int, int] | None = None  # (owner pid, read fd, write fd)
_registered: set[str] = set()
_parent = 0  # in an adopted child: the parent's pid
_orphan_paths: list[str] = []


class Interrupted(BaseException):
    """A stop signal arrived (a BaseException, like KeyboardInterrupt, so ``except Exception`` lets it by)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = int(signum)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


# the parent -------------------------------------------------------------------------------------------


def _lifeline_fd() -> int:
    """The read end of this process's lifeline (made on first use; a forked copy makes its own)."""
    global _lifeline
    with _lock:
        if _lifeline is None or _lifeline[0] != os.getpid():
            read, write = os.pipe()  # both close-on-exec: only pass_fds hands the read end on
            _lifeline = (os.getpid(), read, write)
        return _lifeline[1]


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def popen(args: list[str], *, env: dict[str, str] | None = None, cpus: Iterable[int] | None = None,
          **kwargs: Any) -> subprocess.Popen:
    """Start a kvxfer child (a Python program that calls :func:`adopt`) that dies with this process;
    with ``cpus``, it runs on those CPUs only."""
    fd = _lifeline_fd()
    env = dict(os.environ if env is None else env)
    env.pop(CPUS_ENV, None)
    if cpus is not None:
        env[CPUS_ENV] = ",".join(str(cpu) for cpu in sorted(cpus))
    env[LIFELINE_ENV] = f"{fd} {os.getpid()} {int(_on_main_thread() and sys.platform.startswith('linux'))}"
    with _lock:
        env[ORPHAN_PATHS_ENV] = os.pathsep.join(sorted(_registered))
    pass_fds = (fd, *kwargs.pop("pass_fds", ()))
    return subprocess.Popen(args, env=env, pass_fds=pass_fds, **kwargs)


def popen_foreign(args: list[str], **kwargs: Any) -> subprocess.Popen:
    """Start a program that cannot call :func:`adopt`; on Linux, from the main thread, it is SIGKILLed
    when this process ends (elsewhere its caller must stop it, in a ``finally``)."""
    preexec = None
    if sys.platform.startswith("linux") and _on_main_thread():
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before the fork
        parent = os.getpid()

        def preexec() -> None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
            if os.getppid() != parent:  # the parent died before the request took hold
                os._exit(1)

    return subprocess.Popen(args, preexec_fn=preexec, **kwargs)


def stop(process: subprocess.Popen, *, grace: float = 10.0, term_grace: float = 10.0) -> int:
    """Give ``process`` ``grace`` seconds to end, then SIGTERM and ``term_grace`` seconds, then SIGKILL;
    returns its exit status."""
    try:
        return process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        process.terminate()
    try:
        return process.wait(timeout=term_grace)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


class TempDir:
    """A temporary directory: removed by :meth:`cleanup` (or at exit), or by this process's children
    started afterwards if this process dies first (see the module docstring)."""

    def __init__(self, prefix: str) -> None:
        self.name = tempfile.mkdtemp(prefix=prefix)
        with _lock:
            _registered.add(self.name)
        self._finalizer = weakref.finalize(self, TempDir._remove, self.name)

    @staticmethod
    def _remove(path: str) -> None:
        with _lock:
            _registered.discard(path)
        shutil.rmtree(path, ignore_errors=True)

    def cleanup(self) -> None:
        self._finalizer()

    def __enter__(self) -> str:
        return self.name

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def stop_on_signals(again: Callable[[int], None] | None = None) -> dict[int, Any]:
    """Make the first of SIGTERM, SIGINT, SIGHUP raise :class:`Interrupted` in the main thread; later
    ones call ``again(signum)`` (default: ignored, the stop is under way). Returns the old handlers."""
    fired = []

    def handler(signum: int, frame: object) -> None:
        if fired:
            if again is not None:
                again(signum)
            return
        fired.append(signum)
        raise Interrupted(signum)

    return {int(sig): signal.signal(sig, handler) for sig in STOP_SIGNALS}


def _say(line: str) -> None:
    try:
        os.write(sys.stderr.fileno(), (line + "\n").encode())
    except (OSError, ValueError):  # no stderr left (a closed terminal): the exit status still tells
        pass


def run_stoppable(tool: str, body: Callable[[], int]) -> int:
    """Run a tool's body; a stop signal ends it cleanly with one line on stderr and status 128 + N."""

    def forced(signum: int) -> None:
        _say(f"{tool}: stopped by {signal.Signals(signum).name} while stopping; exiting at once")
        os._exit(128 + signum)

    previous = stop_on_signals(again=forced) if _on_main_thread() else {}
    try:
        return body()
    except Interrupted as stop:
        _say(f"{tool}: stopped by {stop.name}")
        return 128 + stop.signum
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


# the child -------------------------------------------------------------------------------------------


def adopt(*, grace: float = 10.0) -> None:
    """In a child started by :func:`popen`: follow the parent out.

    When the parent is gone (the lifeline reads EOF; on Linux the kernel also sends SIGTERM), remove
    the directories it handed over, then SIGTERM this process so its own handler stops it cleanly;
    ``grace`` seconds later it is ended regardless. Started any other way (by hand), nothing happens.
    """
    global _parent
    _run_on_given_cpus()
    spec = os.environ.pop(LIFELINE_ENV, None)
    paths = os.environ.pop(ORPHAN_PATHS_ENV, "")
    if not spec:
        return
    fd, parent, pdeathsig = (int(part) for part in spec.split())
    _parent = parent
    _orphan_paths[:] = [path for path in paths.split(os.pathsep) if path]
    atexit.register(_remove_if_orphaned)  # SIGTERM from the kernel may end us before the thread runs
    if pdeathsig:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
        except (OSError, AttributeError):  # no prctl: the lifeline alone does it
            pass
    # a parent that died before prctl took hold has closed the lifeline already: the thread sees EOF
    threading.Thread(target=_watch, args=(fd, grace), name="kvxfer-lifeline", daemon=True).start()


def _run_on_given_cpus() -> None:
    """The CPUs the parent asked for (:data:`CPUS_ENV`), for every thread this process has now, so
    that every thread it starts later inherits them."""
    given = os.environ.pop(CPUS_ENV, "")
    if not given:
        return
    try:
        cpus = {int(cpu) for cpu in given.split(",")}
        os.sched_setaffinity(0, cpus)
        # threads a library started while the program imported it (a BLAS pool) move too
        tasks = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []
        for task in tasks:
            try:
                os.sched_setaffinity(int(task), cpus)
            except ProcessLookupError:  # it ended meanwhile
                pass
    except (AttributeError, ValueError, OSError) as exc:  # not Linux, or CPUs this process may not use
        print(f"kvxfer: cannot run on CPUs {given}: {exc}; running on any", file=sys.stderr)


def orphaned() -> bool:
    """True in an adopted child whose parent has exited."""
    return _parent != 0 and os.getppid() != _parent


def _remove_orphan_paths() -> None:
    for path in _orphan_paths:
        shutil.rmtree(path, ignore_errors=True)


def _remove_if_orphaned() -> None:
    if orphaned():
        _remove_orphan_paths()


def _watch(fd: int, grace: float) -> None:
    try:
        while os.read(fd, 1):  # the parent never writes: this returns only at EOF, when it is gone
            pass
    except OSError:
        pass
    _remove_orphan_paths()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace)
    os._exit(128 + signal.SIGTERM)


__all__ = ["Interrupted", "TempDir", "adopt", "orphaned", "popen", "popen_foreign", "run_stoppable",
           "stop", "stop_on_signals"]
