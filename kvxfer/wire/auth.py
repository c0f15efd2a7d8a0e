"""Authentication of the control plane: CurveZMQ key pairs and the set of keys an engine trusts.

Why CurveZMQ rather than a shared secret with per-message MACs: each engine has its own key pair,
so an authenticated peer is a *specific* engine, not "anyone holding the cluster secret"; the
handshake authenticates both ends before a single message is delivered (a wrongly keyed or
unkeyed peer never reaches the decoder); messages are encrypted, which keeps the per-request data
connection session secret (:class:`~kvxfer.wire.messages.Hello`) confidential; CurveZMQ's nonces
refuse replays within a connection, and the generation each message carries refuses replays across
requests. It costs one handshake per connection and nothing per page: only control messages use it.

A keyring is this engine's key pair plus the public keys it trusts (by name). An engine with a
keyring advertises its control address as ``tcp://host:port#curve=<64 hex digits>``; a peer
connects only to an address whose key it trusts, and accepts only clients whose key it trusts.
On disk (``kvxfer keygen``) a keyring is a directory ``NAME/`` holding ``self.key_secret`` (ZMQ's
certificate format) and ``trusted/*.key`` (public certificates, one per trusted engine).

Invariants: secret keys never leave the keyring object or its ``self.key_secret`` file (written
0600, replacing any older file atomically; a secret file open to group or others is refused when
loaded); an address without a key is refused by an engine that has a keyring.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigError, PeerError

KEY_MARK = "#curve="


class Keyring:
    """One engine's CurveZMQ key pair and the public keys (z85) it trusts, with their names."""

    def __init__(self, public: bytes, secret: bytes, trusted: Mapping[bytes, str] | None = None, *,
                 name: str = "self") -> None:
        from zmq.utils import z85

        for what, key in (("public", public), ("secret", secret)):
            if len(key) != 40:
                raise ConfigError(f"keyring {name!r}: {what} key must be 40 z85 characters, got {len(key)}")
            z85.decode(key)  # raises on a malformed key
        self.name = name
        self.public = bytes(public)
        self._secret = bytes(secret)
        self.trusted: dict[bytes, str] = {bytes(k): v for k, v in (trusted or {}).items()}
        self.trusted.setdefault(self.public, name)

    def __repr__(self) -> str:  # never print the secret
        return f"Keyring(name={self.name!r}, public={self.public.decode()}, trusted={len(self.trusted)})"

    def __deepcopy__(self, memo: dict[int, Any]) -> Keyring:
        return self  # immutable in use; EngineConfig.to_dict() must not clone key material

    @property
    def secret(self) -> bytes:
        return self._secret

    # construction ---------------------------------------------------------------------------------
    @classmethod
    def generate(cls, name: str = "self") -> Keyring:
        import zmq

        public, secret = zmq.curve_keypair()
        return cls(public, secret, name=name)

    @classmethod
    def cluster(cls, names: Iterable[str]) -> dict[str, Keyring]:
        """Fresh keyrings for ``names``, each trusting all of them (tests, the demo, one-host setups)."""
        rings = {name: cls.generate(name) for name in names}
        everyone = {ring.public: name for name, ring in rings.items()}
        for ring in rings.values():
            ring.trusted.update(everyone)
        return rings

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Keyring:
        """Read a keyring directory written by :meth:`save` or ``kvxfer keygen``."""
        import zmq.auth

        root = Path(path)
        own = root / "self.key_secret"
        if not own.is_file():
            raise ConfigError(f"keyring {root}: no self.key_secret (create one with `kvxfer keygen`)")
        try:
            public, secret = zmq.auth.load_certificate(own)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"keyring {root}: cannot read self.key_secret: {exc}") from exc
        if secret is None:
            raise ConfigError(f"keyring {root}: self.key_secret holds no secret key")
        mode = stat.S_IMODE(own.stat().st_mode)
        if mode & 0o077:
            raise ConfigError(f"keyring {root}: the secret key {own} is open to {_who(mode)} (mode {mode:#o}); "
                              f"run `chmod 600 {own}` (or `kvxfer keygen --force` for new keys)")
        trusted: dict[bytes, str] = {}
        trusted_dir = root / "trusted"
        for cert in sorted(trusted_dir.glob("*.key")) if trusted_dir.is_dir() else []:
            try:
                key, _ = zmq.auth.load_certificate(cert)
            except (OSError, ValueError) as exc:
                raise ConfigError(f"keyring {root}: cannot read {cert.name}: {exc}") from exc
            trusted[key] = cert.stem
        return cls(public, secret, trusted, name=root.name)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write this keyring as a directory (the secret file readable by its owner only)."""
        root = Path(path)
        trusted_dir = root / "trusted"
        trusted_dir.mkdir(parents=True, exist_ok=True)
        own = root / "self.key_secret"
        # a new file, private from its first byte, replacing the old one at once: an existing secret's
        # mode (0644 from a copy, say) is never kept, and no reader sees half a file
        fd, tmp = tempfile.mkstemp(dir=root, prefix=".self.key_secret.")
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(_certificate(self.public, self._secret))
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, own)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        for stale in trusted_dir.glob("*.key"):
            stale.unlink()
        for key, name in sorted(self.trusted.items(), key=lambda item: item[1]):
            (trusted_dir / f"{_safe(name)}.key").write_text(_certificate(key, None))
        return root

    # use ------------------------------------------------------------------------------------------
    def is_trusted(self, public: bytes) -> bool:
        return bytes(public) in self.trusted

    def label(self, public: bytes) -> str | None:
        return self.trusted.get(bytes(public))

    def address(self, endpoint: str) -> str:
        """``endpoint`` with this engine's public key attached, for peers to connect to."""
        return f"{endpoint}{KEY_MARK}{z85_to_hex(self.public)}"


def split_address(address: str) -> tuple[str, bytes | None]:
    """``(zmq endpoint, server public key in z85 or None)`` of a control address."""
    if KEY_MARK not in address:
        return address, None
    endpoint, key_hex = address.split(KEY_MARK, 1)
    try:
        raw = bytes.fromhex(key_hex)
    except ValueError:
        raise PeerError(f"control address {address!r}: the key after {KEY_MARK} is not hex") from None
    if len(raw) != 32:
        raise PeerError(f"control address {address!r}: the key must be 32 bytes (64 hex digits)")
    from zmq.utils import z85

    return endpoint, z85.encode(raw)


def is_loopback(host: str) -> bool:
    """Whether a control socket bound to ``host`` is reachable from this machine only: a loopback
    address, ``localhost`` or the loopback interface ``lo``. Other names are not resolved (so not
    assumed local); ``*`` and ``0.0.0.0`` are every interface."""
    import ipaddress

    name = host.strip().strip("[]").lower()
    if name in ("localhost", "lo"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def z85_to_hex(key: bytes) -> str:
    from zmq.utils import z85

    return z85.decode(key).hex()


def write_cluster(directory: str | os.PathLike[str], names: Iterable[str], *, force: bool = False) -> list[Path]:
    """``kvxfer keygen``: one keyring directory per name under ``directory``, all trusting each other."""
    root = Path(directory)
    names = list(names)
    if len(set(names)) != len(names) or not names:
        raise ConfigError("give one or more distinct engine names")
    existing = [root / _safe(n) for n in names if (root / _safe(n)).exists()]
    if existing and not force:
        raise ConfigError(f"{', '.join(map(str, existing))} already exist (pass --force to replace)")
    for path in existing:
        shutil.rmtree(path)
    rings = Keyring.cluster(names)
    return [ring.save(root / _safe(name)) for name, ring in rings.items()]


def _who(mode: int) -> str:
    """Who besides the owner may use a file of ``mode``: "group", "others" or "group and others"."""
    return " and ".join(who for who, bits in (("group", 0o070), ("others", 0o007)) if mode & bits)


def _safe(name: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "-_." else "_" for c in name).strip(".")
    if not cleaned:
        raise ConfigError(f"engine name {name!r} has no usable characters")
    return cleaned


def _certificate(public: bytes, secret: bytes | None) -> str:
    """ZMQ's ZPL certificate text (what ``zmq.auth.load_certificate`` reads)."""
    lines = ["#   ****  Generated by kvxfer keygen  ****", "#   ZeroMQ CURVE Certificate", "",
             "metadata", "curve", f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"
