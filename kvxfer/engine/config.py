"""EngineConfig: every setting of both roles, validated in one place, and read from the environment
in one place (:meth:`EngineConfig.from_env`)."""

from __future__ import annotations

import dataclasses
import logging
import os
import types
import typing
import warnings
from collections.abc import Mapping
from dataclasses import KW_ONLY, InitVar, asdict, dataclass, field
from typing import Any

from ..core.checksum import ChecksumAlgo
from ..errors import ConfigError
from ..transport import registry
from ..transport.options import OPTIONS
from ..wire.auth import is_loopback
from ..wire.messages import MAX_MESSAGE_BYTES

log = logging.getLogger("kvxfer.engine")

ENV_PREFIX = "KVXFER_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

# Old spellings still accepted (with a DeprecationWarning): EngineConfig keyword -> (transport, option),
# and extra[key] -> (transport, option).
_LEGACY_KEYWORDS = {"ib_device": ("verbs", "device"), "ib_port": ("verbs", "port"),
                    "gid_index": ("verbs", "gid_index")}
_LEGACY_EXTRA = {"tcp_staging": ("tcp", "staging")}


@dataclass
class EngineConfig:
    """Settings shared by both roles. Times are seconds.

    :meth:`from_env` reads each scalar setting from ``KVXFER_<NAME>`` (``KVXFER_TRANSPORT``,
    ``KVXFER_MAX_CONTEXT``, ``KVXFER_DRAIN_TIMEOUT``, ...; all but ``unsafe_legacy``, which no
    environment can switch on) and each transport option from the variable its
    :mod:`kvxfer.transport.options` field names:

    * ``KVXFER_TCP_STAGING``: ``transport_options["tcp"]["staging"]`` (was ``extra["tcp_staging"]``)
    * ``KVXFER_SHM_RING_BYTES``, ``KVXFER_SHM_DIR``: ``transport_options["shm"]["ring_bytes"]``, ``["directory"]``
    * ``KVXFER_IB_DEVICE``: ``transport_options["verbs"]["device"]`` (was ``ib_device=`` and the
      variable ``KVXFER_RDMA_DEVICE``)
    * ``KVXFER_IB_PORT``, ``KVXFER_GID_INDEX``: ``transport_options["verbs"]["port"]``, ``["gid_index"]``
      (were ``ib_port=``, ``gid_index=``)

    Integers parse as decimal (or 0x/0o/0b literals), floats as Python floats, booleans as 1/0,
    true/false, yes/no, on/off; an empty variable counts as unset. :func:`env_table` lists them all.
    The old spellings still work, with a DeprecationWarning naming the new one.
    """

    max_context: int  # tokens a request may hold; required (the capacity invariant is checked against it)
    alloc_policy: str = "lifo"  # which free page is handed out next: lifo, fifo or random
    free_policy: str = "keep"  # what a freed page holds: keep (its bytes), zero or poison
    checksum: str = "adler32"  # DONE's checksum: adler32, crc32 or none
    transport: str = "tcp"  # the data transport, one of kvxfer.transport.registry.names()
    # per-transport options nested by transport name, {"verbs": {"device": "rxe0"}}; a value may also be
    # the option dataclass itself (kvxfer.transport.options); see options()
    transport_options: dict[str, Any] = field(default_factory=dict)
    host: str = "127.0.0.1"  # address the control socket (and tcp's data socket) binds; 0.0.0.0 / ::: every one
    # the address peers are told (control and tcp data); None: ``host``, or with a wildcard ``host`` this
    # host's one non-loopback address (several or none: refused, name it here); kvxfer.wire.addresses
    advertise_host: str | None = None
    control_port: int = 0  # control socket port (0: any free port)
    data_port: int = 0  # tcp data socket port (0: any free port)
    allow_undersized_pool: bool = False  # start although the pool holds fewer tokens than max_context (warns)
    max_inflight: int = 4096  # requests admitted and not yet finished, per engine
    transfer_timeout: float = 60.0  # a request's transfer must finish within this
    drain_timeout: float = 10.0  # an aborted request's writer must prove its drain within this, else a fence
    meta_timeout: float = 60.0  # prefill: destinations for a request must arrive within this
    heartbeat_interval: float = 1.0  # seconds between heartbeats to each peer
    peer_timeout: float = 15.0  # a peer silent this long is dead
    seed: int | None = None  # seed of the random allocation policy (None: from the OS)
    engine_id: str | None = None  # this engine's name on the wire (None: role-host-pid-random)
    unsafe_legacy: bool = False  # negative control only: the incident's behaviour; never read from the environment
    keyring: Any = None  # a kvxfer.wire.auth.Keyring or a keyring directory: authenticated control plane
    metrics_port: int | None = None  # serve Prometheus metrics here (0: any free port); None: off
    metrics_host: str | None = None  # address the metrics endpoint binds (None: ``host``)
    max_pending_meta: int = 4096  # prefill: destinations held for requests not admitted yet, per peer
    # decode, tcp data port (anyone who reaches it can connect; these bound what they make it hold):
    max_data_connections: int = 256  # data connections held at once, before CONNECT and live; more are closed
    connect_timeout: float = 5.0  # a data connection must complete its CONNECT frame within this, else closed
    max_ordered_body: int = 2 << 20  # largest ORDERED frame body (DONE with its 1 MiB aux), refused before reading
    # control plane (anyone who reaches it can send; these bound what a peer can make an engine hold):
    allow_open_control: bool = False  # without a keyring, bind a non-loopback host anyway (warns); else refused
    # decode without a keyring: the prefills it may connect to, comma-separated hosts, host:port or CIDRs
    # ("198.18.0.0/15,10.0.0.7:5555"); loopback is always allowed. With a keyring the keys decide, and a list
    # given here must match too. An address outside it is refused before any socket is opened.
    trusted_prefills: str = ""
    max_peers: int = 256  # prefill: peers held at once; a HELLO beyond it is refused unless a dead peer makes room
    peer_expiry: float = 300.0  # a peer silent this long (at least peer_timeout) is forgotten, its socket closed
    result_timeout: float = 120.0  # prefill: RESULT must follow DONE within this, else the request fails
    max_pending_meta_bytes: int = 64 << 20  # prefill: bytes of destination page lists held per peer (pending)
    # engine adapters (SGLang, vLLM): send each layer as the forward computes it, where the destination is
    # known before the forward; prompts shorter than layerwise_min_tokens go whole (a send per layer costs
    # more than the transfer it hides there). 256: kvxfer bench --ttft (docs/benchmarks.md) has layer-wise
    # never slower from 256 tokens at 1e14 and 4e14 FLOP/s, and within 5% at 256-512 at 1e15
    layerwise: bool = True
    layerwise_min_tokens: int = 256
    extra: dict[str, Any] = field(default_factory=dict)  # free-form data for callers; no setting lives here
    _: KW_ONLY
    # deprecated spellings of transport_options["verbs"][...]: accepted with a DeprecationWarning
    ib_device: InitVar[str | None] = None
    ib_port: InitVar[int | None] = None
    gid_index: InitVar[int | None] = None

    def __post_init__(self, ib_device: str | None, ib_port: int | None, gid_index: int | None) -> None:
        if not isinstance(self.transport_options, Mapping):
            raise ConfigError(f"transport_options must be a dict by transport name, not "
                              f"{type(self.transport_options).__name__}")
        options = {name: dict(given) if isinstance(given, Mapping) else given
                   for name, given in self.transport_options.items()}
        extra = dict(self.extra or {})
        legacy = [(name, value, _LEGACY_KEYWORDS[name]) for name, value in
                  (("ib_device", ib_device), ("ib_port", ib_port), ("gid_index", gid_index)) if value is not None]
        legacy += [(f'extra["{key}"]', extra[key], where) for key, where in _LEGACY_EXTRA.items()
                   if extra.get(key) is not None]
        for old, value, (transport, option) in legacy:
            _apply_legacy(options, old, value, transport, option)
        for key in _LEGACY_EXTRA:  # a setting, moved into transport_options above: extra stays free-form
            extra.pop(key, None)
        self.transport_options = options
        self.extra = extra

    # environment -------------------------------------------------------------------------------
    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> EngineConfig:
        """Settings from ``KVXFER_*`` variables (``environ``, default ``os.environ``), then ``overrides``.

        Keyword arguments win over the environment; ``transport_options`` merges per option, so
        ``transport_options={"verbs": {"port": 2}}`` keeps a device named by ``KVXFER_IB_DEVICE``.
        ``max_context`` is required, from ``KVXFER_MAX_CONTEXT`` or a keyword. A variable that does
        not parse, and a setting that does not validate, raise ConfigError naming it.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        hints = _hints(cls)
        for f in dataclasses.fields(cls):
            var = env_name(f)
            if var is None:
                continue
            text = _env_text(env, var)
            if text is not None:
                values[f.name] = _parse(text, hints[f.name], var)
        options: dict[str, Any] = {}
        for transport, opt_cls in OPTIONS.items():
            opt_hints = _hints(opt_cls)
            for f in dataclasses.fields(opt_cls):
                found = _option_env(env, f)
                if found is not None:
                    var, text = found
                    options.setdefault(transport, {})[f.name] = _parse(text, opt_hints[f.name], var)
        given = overrides.pop("transport_options", None) or {}
        if not isinstance(given, Mapping):
            raise ConfigError(f"transport_options must be a dict by transport name, not {type(given).__name__}")
        given = _legacy_overrides(overrides, given)
        for transport, value in given.items():
            if isinstance(value, Mapping) and isinstance(options.get(transport), dict):
                options[transport] = {**options[transport], **value}
            else:
                options[transport] = value
        values.update(overrides)
        if values.get("max_context") is None:
            raise ConfigError("max_context is required: set KVXFER_MAX_CONTEXT or pass max_context=")
        config = cls(**values, transport_options=options)
        config.validate()
        return config

    # transport options -------------------------------------------------------------------------
    def options(self, name: str | None = None) -> Any:
        """The validated option dataclass of transport ``name`` (default: the configured transport),
        defaults filled in; ConfigError naming the transport and field for an unknown key, a wrong
        type or a value outside the field's choices."""
        name = self.transport if name is None else name
        opt_cls = OPTIONS.get(name)
        if opt_cls is None:
            raise ConfigError(f"unknown transport {name!r} (available: {', '.join(registry.names())})")
        given = self.transport_options.get(name)
        if given is None:
            return opt_cls()
        if isinstance(given, opt_cls):
            values = {f.name: getattr(given, f.name) for f in dataclasses.fields(opt_cls)}
        elif isinstance(given, Mapping):
            known = [f.name for f in dataclasses.fields(opt_cls)]
            unknown = [key for key in given if key not in known]
            if unknown:
                raise ConfigError(f"unknown {name} transport option{'s' if len(unknown) > 1 else ''} "
                                  f"{', '.join(repr(k) for k in unknown)} (known: {', '.join(known)})")
            values = dict(given)
        else:
            raise ConfigError(f"transport_options[{name!r}] must be a dict or a {opt_cls.__name__}, "
                              f"not {type(given).__name__}")
        hints = _hints(opt_cls)
        for f in dataclasses.fields(opt_cls):
            if f.name in values:
                _check(values[f.name], hints[f.name], f.metadata.get("choices"), f"{name} option {f.name!r}")
        return given if isinstance(given, opt_cls) else opt_cls(**values)

    def verbs_options(self) -> Any:
        """Deprecated: ``options("verbs")``."""
        warnings.warn("EngineConfig.verbs_options() is deprecated; use EngineConfig.options('verbs')",
                      DeprecationWarning, stacklevel=2)
        return self.options("verbs")

    # the rest ------------------------------------------------------------------------------------
    def load_keyring(self) -> Any:
        """The :class:`~kvxfer.wire.auth.Keyring` to use, or None for an unauthenticated control plane."""
        if self.keyring is None or self.keyring == "":
            return None
        from ..wire.auth import Keyring

        return self.keyring if isinstance(self.keyring, Keyring) else Keyring.load(self.keyring)

    def validate(self) -> None:
        names = registry.names()
        if self.transport not in names:
            raise ConfigError(f"unknown transport {self.transport!r} (available: {', '.join(names)})")
        for name in self.transport_options:
            if name not in names:
                raise ConfigError(f"transport_options names unknown transport {name!r} "
                                  f"(available: {', '.join(names)})")
            self.options(name)
        ChecksumAlgo.parse(self.checksum)
        for name in ("transfer_timeout", "drain_timeout", "meta_timeout", "heartbeat_interval", "peer_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port {self.metrics_port} is not a TCP port")
        if self.max_pending_meta <= 0:
            raise ConfigError("max_pending_meta must be positive")
        if self.max_data_connections <= 0:
            raise ConfigError("max_data_connections must be positive")
        if self.connect_timeout <= 0:
            raise ConfigError("connect_timeout must be positive")
        if not 4096 <= self.max_ordered_body <= MAX_MESSAGE_BYTES:
            raise ConfigError(f"max_ordered_body must be between 4096 and {MAX_MESSAGE_BYTES} bytes")
        if self.max_peers <= 0:
            raise ConfigError("max_peers must be positive")
        if self.layerwise_min_tokens < 0:
            raise ConfigError("layerwise_min_tokens must be 0 or more")
        if self.max_pending_meta_bytes <= 0:
            raise ConfigError("max_pending_meta_bytes must be positive")
        for name in ("peer_expiry", "result_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if not self.allow_open_control and self.keyring in (None, "") and not is_loopback(self.host):
            raise ConfigError(
                f"host {self.host!r} is not a loopback address and the control plane has no keyring: any host "
                "that reaches it could peer with this engine. Give it a keyring (keyring=, KVXFER_KEYRING; "
                "`kvxfer keygen`) or, to run it unauthenticated anyway, set allow_open_control=True "
                "(KVXFER_ALLOW_OPEN_CONTROL=1)")
        from ..wire.addresses import advertised_host
        from ..wire.trust import PeerAllowlist

        advertised_host(self.host, self.advertise_host)  # a wildcard with no single address to tell peers
        PeerAllowlist.parse(self.trusted_prefills)

    def to_dict(self) -> dict[str, Any]:
        """Every setting as plain data (option dataclasses as dicts): ``EngineConfig(**d)`` rebuilds it."""
        return asdict(self)


def env_name(f: dataclasses.Field) -> str | None:
    """The environment variable of an EngineConfig field (None: never read from the environment)."""
    if f.name in ("transport_options", "extra", "unsafe_legacy"):
        return None
    return ENV_PREFIX + f.name.upper()


def env_table() -> list[tuple[str, str, tuple[str, ...]]]:
    """(variable, setting, deprecated variables) for every setting :meth:`EngineConfig.from_env` reads."""
    rows: list[tuple[str, str, tuple[str, ...]]] = []
    for f in dataclasses.fields(EngineConfig):
        var = env_name(f)
        if var is not None:
            rows.append((var, f.name, ()))
    for transport, opt_cls in OPTIONS.items():
        for f in dataclasses.fields(opt_cls):
            rows.append((f.metadata["env"], f'transport_options["{transport}"]["{f.name}"]',
                         tuple(f.metadata.get("deprecated_env", ()))))
    return rows


def _apply_legacy(options: dict[str, Any], old: str, value: Any, transport: str, option: str) -> None:
    new = f'transport_options["{transport}"]["{option}"]'
    current = options.get(transport)
    if dataclasses.is_dataclass(current):
        current = options[transport] = dataclasses.asdict(current)
    if current is None:
        current = options[transport] = {}
    if not isinstance(current, dict):
        return  # validate() reports the bad entry
    if option in current:
        if current[option] != value:
            warnings.warn(f"EngineConfig {old}={value!r} is deprecated and ignored: {new} = "
                          f"{current[option]!r} is set", DeprecationWarning, stacklevel=4)
        return
    warnings.warn(f"EngineConfig {old} is deprecated; use {new}", DeprecationWarning, stacklevel=4)
    current[option] = value


def _legacy_overrides(overrides: dict[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """from_env's keyword arguments in old spellings, moved into ``transport_options`` (warned), so
    that they win over the environment as every keyword does."""
    options = {name: dict(value) if isinstance(value, Mapping) else value for name, value in given.items()}
    moved: list[tuple[str, Any, tuple[str, str]]] = []
    for key, where in _LEGACY_KEYWORDS.items():
        value = overrides.pop(key, None)
        if value is not None:
            moved.append((key, value, where))
    extra = overrides.get("extra")
    if isinstance(extra, Mapping):
        moved += [(f'extra["{key}"]', extra[key], where) for key, where in _LEGACY_EXTRA.items()
                  if extra.get(key) is not None]
    for old, value, (transport, option) in moved:
        if isinstance(options.get(transport), Mapping) and option in options[transport]:
            continue  # the new spelling, given too, wins
        if options.get(transport) is None:
            options[transport] = {}
        if isinstance(options[transport], dict):
            warnings.warn(f"EngineConfig {old} is deprecated; use transport_options[\"{transport}\"][\"{option}\"]",
                          DeprecationWarning, stacklevel=3)
            options[transport][option] = value
    return options


def _env_text(env: Mapping[str, str], var: str) -> str | None:
    text = env.get(var)
    if text is None or not text.strip():
        return None
    return text.strip()


def _option_env(env: Mapping[str, str], f: dataclasses.Field) -> tuple[str, str] | None:
    """(variable, text) for a transport option field: its variable, else a deprecated one (warned)."""
    var = f.metadata["env"]
    text = _env_text(env, var)
    for old in f.metadata.get("deprecated_env", ()):
        old_text = _env_text(env, old)
        if old_text is None:
            continue
        if text is not None:
            if old_text != text:
                _deprecated_env(f"{old} is deprecated and ignored: {var} is set")
            continue
        _deprecated_env(f"{old} is deprecated; use {var}")
        var, text = old, old_text
    return None if text is None else (var, text)


def _deprecated_env(message: str) -> None:
    """An old variable name: a DeprecationWarning (for code and tests) and a log line (for operators,
    who do not see DeprecationWarnings by default)."""
    warnings.warn(message, DeprecationWarning, stacklevel=4)
    log.warning("%s", message)


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        hints = typing.get_type_hints(cls)
        _HINTS[cls] = {name: hint.type if isinstance(hint, InitVar) else hint for name, hint in hints.items()}
    return _HINTS[cls]


def _base_type(hint: Any) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return (args[0] if len(args) == 1 else Any), True
    return hint, hint is Any


def _parse(text: str, hint: Any, var: str) -> Any:
    """An environment variable's text as a value of the field's type; ConfigError naming ``var``."""
    kind, _ = _base_type(hint)
    if kind is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ConfigError(f"{var}={text!r}: expected a boolean (1/0, true/false, yes/no, on/off)")
    if kind in (int, float) and (not text.isascii() or "_" in text):
        # int() and float() take any Unicode digit ("٤٠", "４０") and underscores ("1_0"): a setting is
        # written in plain ASCII digits
        raise ConfigError(f"{var}={text!r}: expected {'an integer' if kind is int else 'a number'} in ASCII digits")
    if kind is int:
        for base in (10, 0):  # decimal first ("010" is ten), then 0x/0o/0b literals
            try:
                return int(text, base)
            except ValueError:
                pass
        raise ConfigError(f"{var}={text!r}: expected an integer")
    if kind is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"{var}={text!r}: expected a number") from None
    return text


def _check(value: Any, hint: Any, choices: Any, what: str) -> None:
    kind, optional = _base_type(hint)
    if value is None:
        ok = optional
    elif kind is Any:
        ok = True
    elif kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        expected = getattr(kind, "__name__", str(kind)) + (" or None" if optional else "")
        raise ConfigError(f"{what} must be {expected}, not {value!r}")
    if choices is not None and value not in choices:
        raise ConfigError(f"{what} is {value!r}; choose one of {', '.join(repr(c) for c in choices)}")
