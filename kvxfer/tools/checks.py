"""What the command line checks before any work starts, shared by every subcommand.

Two kinds of check, both naming the flag as the user typed it:

* **argparse types** (:func:`integer`, :func:`number`, :func:`size`, :func:`port`, :func:`output_path`):
  a bad value stops the parse, and ``kvxfer``'s parser prints one line, ``kvxfer <command>: argument
  --flag: <why>``, with exit status 2 (:class:`kvxfer.tools.cli._Parser`);
* **checks after parsing** (:func:`port_free`, :func:`memory_for`, :func:`transport_runs`,
  :func:`importable`, :func:`directory_creatable`): they need more than one flag or ask the machine,
  and raise :class:`~kvxfer.errors.ConfigError` whose message starts with the flag;
  :func:`kvxfer.tools.cli.main` prints it as the same one line, exit status 2.

Nothing here writes a file, keeps a port or keeps memory: an output path is checked (its directory
exists and is writable), a port is bound and let go, memory is mapped and unmapped untouched.
"""

from __future__ import annotations

import argparse
import errno
import math
import mmap
import os
import socket
from collections.abc import Callable, Iterable

from ..errors import ConfigError

SIZE_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


# argparse types ------------------------------------------------------------------------------------


def integer(minimum: int | None = None, maximum: int | None = None, what: str = "") -> Callable[[str], int]:
    """An argparse type: an integer in ``minimum..maximum`` (either end open when None)."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"{value} is out of range: {_range(minimum, maximum, what)}")
        return value

    parse.__name__ = "integer"
    return parse


def number(minimum: float | None = None, maximum: float | None = None, *, above: float | None = None,
           what: str = "") -> Callable[[str], float]:
    """An argparse type: a finite number, at least ``minimum`` (or above ``above``), at most ``maximum``."""

    def parse(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        low_bad = (minimum is not None and value < minimum) or (above is not None and value <= above)
        if low_bad or (maximum is not None and value > maximum):
            limits = []
            if above is not None:
                limits.append(f"above {above:g}")
            if minimum is not None:
                limits.append(f"at least {minimum:g}")
            if maximum is not None:
                limits.append(f"at most {maximum:g}")
            raise argparse.ArgumentTypeError(f"{value:g} is out of range: must be {' and '.join(limits)}"
                                             + (f" ({what})" if what else ""))
        return value

    parse.__name__ = "number"
    return parse


def _range(minimum: int | None, maximum: int | None, what: str) -> str:
    if minimum is not None and maximum is not None:
        text = f"must be {minimum}..{maximum}"
    elif minimum is not None:
        text = f"must be at least {minimum}"
    else:
        text = f"must be at most {maximum}"
    return text + (f" ({what})" if what else "")


def parse_size(text: str | int) -> int:
    """``"64K"`` -> 65536; a number of bytes with an optional K, M or G suffix (KiB, MiB, GiB; "64KiB"
    and "64kb" too). ValueError for anything else."""
    if isinstance(text, int):
        return text
    raw = str(text).strip().lower()
    if raw.endswith("ib") and raw[-3:-2] in SIZE_UNITS:
        raw = raw[:-2]
    elif raw.endswith("b"):
        raw = raw[:-1]
    scale = 1
    if raw and raw[-1] in SIZE_UNITS:
        scale, raw = SIZE_UNITS[raw[-1]], raw[:-1]
    value = float(raw)  # ValueError for "banana", "1t", ""
    if not math.isfinite(value) or (scale == 1 and value != int(value)):
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(value * scale)


def size(text: str) -> int:
    """An argparse type: a size above 0 bytes (K, M, G suffixes)."""
    try:
        value = parse_size(text)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (bytes, with an optional K, M or G suffix: "
                                         "64K, 1.5M, 2G)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size above 0 bytes")
    return value


size.__name__ = "size"


def port(*, allow_zero: bool = False) -> Callable[[str], int]:
    """An argparse type: a TCP port, 1..65535 (0 too where it means "any free port")."""
    return integer(0 if allow_zero else 1, 65535, "a TCP port" + (", 0 for any free one" if allow_zero else ""))


def output_path(text: str) -> str:
    """An argparse type: a file the command will write at the end. Its directory must exist and be
    writable now, and the path must not be a directory, so that a run never ends in a write that fails."""
    problem = output_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


output_path.__name__ = "output path"


def output_problem(path: str) -> str:
    """Why ``path`` cannot be written, or ""."""
    if not path:
        return "an empty path"
    if os.path.isdir(path):
        return f"{path} is a directory, not a file"
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        return f"cannot write {path}: the directory {directory} does not exist"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"cannot write {path}: the directory {directory} is not writable"
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return f"cannot write {path}: the file is not writable"
    return ""


# checks after parsing ----------------------------------------------------------------------------------


def port_free(flag: str, host: str, number: int, *, role: str = "", host_flag: str | None = None) -> None:
    """ConfigError naming ``flag`` unless a server could listen on ``host``:``number`` now (0: any port);
    ``role`` says whose port it is, ``host_flag`` the flag that gave ``host`` (for an unknown address)."""
    whose = f" ({role})" if role else ""
    if not 0 <= number <= 65535:
        raise ConfigError(f"{flag}: {number}{whose} is not a TCP port (1..65535)")
    try:
        infos = socket.getaddrinfo(host or None, number, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(f"{host_flag or flag} {host}: cannot resolve the address: {_reason(exc)}") from None
    family, kind, proto, _name, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do: TIME_WAIT is no conflict
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"{flag}: port {number}{whose} on {host} is already in use") from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise ConfigError(f"{host_flag or flag} {host}: not an address of this machine") from None
            raise ConfigError(f"{flag}: cannot listen on {host}:{number}{whose}: {_reason(exc)}") from None


def memory_total() -> int:
    """This machine's memory in bytes (0 when unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def human_bytes(count: float) -> str:
    for unit, scale in (("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{int(count)} B"


def memory_for(flags: str, pools: Iterable[tuple[str, int]]) -> None:
    """ConfigError naming ``flags`` unless every pool of ``pools`` ((what, bytes)) can be allocated here,
    and all of them together fit this machine's memory (the pools are written to, every page of them)."""
    pools = list(pools)
    total = sum(nbytes for _, nbytes in pools)
    what = " + ".join(f"{name} {human_bytes(nbytes)}" for name, nbytes in pools)
    machine = memory_total()
    if machine and total > machine:
        raise ConfigError(f"{flags}: the pools would take {what}, more than this machine's {human_bytes(machine)} "
                          "of memory")
    for name, nbytes in pools:
        reason = mappable(nbytes)
        if reason:
            raise ConfigError(f"{flags}: the {name} of {human_bytes(nbytes)} cannot be allocated here ({reason})")


def mappable(nbytes: int) -> str:
    """"" when ``nbytes`` of anonymous memory can be mapped now (mapped and unmapped at once, never
    touched), else why not."""
    if nbytes <= 0:
        return "no bytes"
    try:
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, OverflowError, ValueError, MemoryError) as exc:
        return _reason(exc)
    region.close()
    return ""


def transport_runs(label: str, name: str) -> None:
    """ConfigError starting with ``label`` (the flag and value, "--transport verbs") unless transport
    ``name`` can run here (its libraries import, a device exists)."""
    from ..transport import registry

    try:
        ok, why = registry.available(name)
    except ConfigError as exc:
        raise ConfigError(f"{label}: {exc}") from None
    if not ok:
        raise ConfigError(f"{label}: {why}")


def importable(flag: str, module: str, install: str) -> None:
    """ConfigError naming ``flag`` unless ``module`` imports (an optional dependency the flag needs)."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"{flag} needs {module} ({install}): {_reason(exc)}") from None


def directory_creatable(flag: str, path: str) -> None:
    """ConfigError naming ``flag`` unless ``path`` is a writable directory or could be made one."""
    target = os.path.abspath(path)
    if os.path.exists(target):
        if not os.path.isdir(target):
            raise ConfigError(f"{flag} {path}: exists and is not a directory")
        if not os.access(target, os.W_OK | os.X_OK):
            raise ConfigError(f"{flag} {path}: the directory is not writable")
        return
    parent = os.path.dirname(target)
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: cannot create it: {parent} is not a writable directory")


def _reason(exc: BaseException) -> str:
    """An exception's words without its class or errno: "Cannot allocate memory"."""
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


__all__ = ["directory_creatable", "human_bytes", "importable", "integer", "mappable", "memory_for", "memory_total",
           "number", "output_path", "output_problem", "parse_size", "port", "port_free", "size", "transport_runs"]
