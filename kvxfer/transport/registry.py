"""The registered transports, by name, loaded lazily.

Each entry names the module that defines a module-level ``TRANSPORT``
(:class:`~kvxfer.transport.base.TransportFactory`). Nothing here imports a fabric's libraries:
:func:`names` is what the CLI and :class:`~kvxfer.engine.EngineConfig` offer and check, and
:func:`get` imports one transport module only when an engine is built on it.

Adding a fabric: write ``kvxfer/transport/<name>.py`` with its receiver backend, sender transport,
options dataclass (in :mod:`kvxfer.transport.options`) and ``TRANSPORT``, then add one line below.
"""

from __future__ import annotations

import importlib

from ..errors import ConfigError
from .base import TransportFactory

_MODULES: dict[str, str] = {
    "tcp": "kvxfer.transport.tcp",
    "shm": "kvxfer.transport.shm",
    "verbs": "kvxfer.transport.verbs",
}


def names() -> tuple[str, ...]:
    """Every registered transport name (whether or not this machine can run it)."""
    return tuple(_MODULES)


def get(name: str) -> TransportFactory:
    """The transport called ``name``; ConfigError for a name nobody registered."""
    module = _MODULES.get(name)
    if module is None:
        raise ConfigError(f"unknown transport {name!r} (available: {', '.join(_MODULES)})")
    factory = importlib.import_module(module).TRANSPORT
    if not isinstance(factory, TransportFactory) or factory.name != name:  # pragma: no cover - a wiring bug
        raise ConfigError(f"{module}.TRANSPORT does not describe transport {name!r}")
    return factory


def available(name: str) -> tuple[bool, str]:
    """Whether this machine can run transport ``name``, and why not."""
    return get(name).available()
