"""Control-plane messages: their fields, their msgpack encoding and a strict decoder.

Encoding (``protocol/SPEC.md`` §2): a msgpack array ``[version, type, body]`` where ``version`` is
:data:`PROTOCOL_VERSION`, ``type`` the message name and ``body`` a map of field name to value, keys
in the order the fields are declared here, every field present. Page lists travel as little-endian
``uint32`` arrays in a bin field. The encoding is deterministic, so ``protocol/golden/`` holds the
exact bytes of every message and the tests compare both ways.

The decoder accepts exactly what the encoder produces: anything else (not msgpack, trailing bytes,
wrong version, unknown type, missing or unexpected field, wrong type, out-of-range value, oversized
message) raises :class:`~kvxfer.errors.ProtocolError` naming the problem. It never raises anything
else, which the hypothesis tests check.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import numpy as np

from ..core.arguments import MAX_RID_STR, U64
from ..core.geometry import KVGeometry
from ..errors import ProtocolError

PROTOCOL_VERSION = 6  # 6: DONE frames (a DONE in a fixed binary layout) on tcp and shm data connections;
# 5: RESULT frames back on a tcp data connection (a writer reads them);
# 4: HELLO/HELLO_ACK.geometry and META.heads (unequal TP and page sizes);
# 3: META.access (per-request memory windows); 2: OFFER/ACCEPT carry each transport's handshake
# (1 had VERBS_INFO/VERBS_CONNECT)
MAX_BLOB = 1 << 20
PROOF_BYTES = 32
_PROOF_CONTEXT = b"kvxfer connect proof v2\x00"
MAX_MESSAGE_BYTES = 64 << 20
MAX_STR = 4096
MAX_PAGES = (64 << 20) // 4 - 1024

Rid = str | int


# field kinds ---------------------------------------------------------------------------------


class Kind:
    """A field's kind: its wire type name and ``check``, which returns the value or raises TypeError/ValueError."""

    name = "any"

    def check(self, value: Any) -> Any:  # pragma: no cover - overridden
        raise NotImplementedError


class _UInt(Kind):
    name = "uint64"

    def __init__(self, maximum: int = U64) -> None:
        self.maximum = maximum

    def check(self, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"expected an unsigned integer, got {type(value).__name__}")
        if not 0 <= value <= self.maximum:
            raise ValueError(f"{value} outside [0, {self.maximum}]")
        return value


class _Str(Kind):
    name = "str"

    def __init__(self, max_len: int = MAX_STR) -> None:
        self.max_len = max_len

    def check(self, value: Any) -> str:
        if not isinstance(value, str):
            raise TypeError(f"expected a string, got {type(value).__name__}")
        if len(value) > self.max_len:
            raise ValueError(f"string of {len(value)} characters exceeds {self.max_len}")
        return value


class _Bytes(Kind):
    name = "bin"

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len

    def check(self, value: Any) -> bytes:
        if not isinstance(value, (bytes, bytearray)):
            raise TypeError(f"expected bytes, got {type(value).__name__}")
        if len(value) > self.max_len:
            raise ValueError(f"{len(value)} bytes exceed {self.max_len}")
        return bytes(value)


class _Bool(Kind):
    name = "bool"

    def check(self, value: Any) -> bool:
        if not isinstance(value, bool):
            raise TypeError(f"expected a boolean, got {type(value).__name__}")
        return value


class _Rid(Kind):
    """A request id: a non-empty string (at most 512 characters) or an unsigned 64-bit integer."""

    name = "rid"

    def check(self, value: Any) -> Rid:
        if isinstance(value, str):
            if not value or len(value) > MAX_RID_STR:
                raise ValueError(f"request id string must have 1..{MAX_RID_STR} characters")
            return value
        return _UInt().check(value)


class _UIntList(Kind):
    name = "array<uint64>"

    def __init__(self, max_len: int = 65536) -> None:
        self.max_len = max_len

    def check(self, value: Any) -> list[int]:
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"expected an array, got {type(value).__name__}")
        if len(value) > self.max_len:
            raise ValueError(f"array of {len(value)} items exceeds {self.max_len}")
        return [_UInt().check(v) for v in value]


class _Pages(Kind):
    """Page indices as little-endian uint32 in a bin field; decodes to an int64 numpy array."""

    name = "bin<uint32le[]>"

    def check(self, value: Any) -> np.ndarray:
        if isinstance(value, np.ndarray):
            if value.ndim != 1:
                raise ValueError("page array must be one-dimensional")
            if value.size and (value.min() < 0 or value.max() > 0xFFFFFFFF):
                raise ValueError("page index outside uint32")
            if value.size > MAX_PAGES:
                raise ValueError(f"{value.size} pages exceed {MAX_PAGES}")
            return value.astype(np.int64)
        if not isinstance(value, (bytes, bytearray)):
            raise TypeError(f"expected page bytes, got {type(value).__name__}")
        if len(value) % 4:
            raise ValueError(f"page bytes length {len(value)} is not a multiple of 4")
        if len(value) // 4 > MAX_PAGES:
            raise ValueError(f"{len(value) // 4} pages exceed {MAX_PAGES}")
        return np.frombuffer(bytes(value), dtype="<u4").astype(np.int64)


class _Geometry(Kind):
    """A layout's geometry (:meth:`KVGeometry.wire`): ``[]`` when the layout has none."""

    name = "geometry"

    def check(self, value: Any) -> KVGeometry | None:
        if value is None or isinstance(value, KVGeometry):
            return value
        return KVGeometry.from_wire(value)


class _Heads(Kind):
    """A leg's heads: ``[]`` (page for page) or ``[first, count]`` (count 0: nothing to write)."""

    name = "array<uint32>[0|2]"

    def check(self, value: Any) -> tuple[int, ...]:
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"expected an array, got {type(value).__name__}")
        if len(value) not in (0, 2):
            raise ValueError(f"heads is [] or [first, count], got {len(value)} numbers")
        return tuple(_UInt((1 << 32) - 1).check(v) for v in value)


UINT = _UInt()
U32 = _UInt((1 << 32) - 1)
STR = _Str()
BOOL = _Bool()
RID = _Rid()
PAGES = _Pages()


def _f(kind: Kind, doc: str, default: Any = dataclasses.MISSING) -> Any:
    meta = {"kind": kind, "doc": doc}
    if default is dataclasses.MISSING:
        return field(metadata=meta)
    return field(default=default, metadata=meta)


def connect_proof(session: bytes, nonce: bytes, engine: str, epoch: int) -> bytes:
    """HMAC-SHA256 keyed by the peering's session secret over one offer (its nonce and epoch) and the
    writer's engine id. The session travels only in HELLO on the control plane (encrypted when
    keyrings are on); the data path carries this proof, which is worth nothing for any other offer."""
    import hashlib
    import hmac

    message = _PROOF_CONTEXT + bytes(nonce) + int(epoch).to_bytes(8, "little") + engine.encode()
    return hmac.new(bytes(session), message, hashlib.sha256).digest()


def proof_matches(proof: bytes, session: bytes, nonce: bytes, engine: str, epoch: int) -> bool:
    """Constant-time check of a CONNECT or ACCEPT proof against the offer it claims to answer."""
    import hmac

    return hmac.compare_digest(bytes(proof), connect_proof(session, nonce, engine, epoch))


class VersionMismatch(ProtocolError):
    """A well-formed envelope of another protocol version. ``reply_to`` is the sender's control
    address when the message names one (a HELLO), so the engine can tell the peer why it is refused."""

    code = "protocol_version"

    def __init__(self, detail: str, *, version: int, reply_to: str | None) -> None:
        super().__init__(detail)
        self.version = version
        self.reply_to = reply_to


# messages ------------------------------------------------------------------------------------

MESSAGE_TYPES: dict[str, type[Message]] = {}


@dataclass(frozen=True)
class Message:
    """Base of every control message: a frozen dataclass encoded field by field in declaration order; ``TYPE`` is its wire name, ``DOC`` its SPEC text."""

    TYPE: ClassVar[str] = ""
    DOC: ClassVar[str] = ""

    def encode(self) -> bytes:
        return encode(self)

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
                if not np.array_equal(np.asarray(a), np.asarray(b)):
                    return False
            elif a != b:
                return False
        return True

    __hash__ = None  # type: ignore[assignment]


def _register(cls: type[Message]) -> type[Message]:
    MESSAGE_TYPES[cls.TYPE] = cls
    return cls


@_register
@dataclass(frozen=True, eq=False)
class Hello(Message):
    """HELLO (receiver -> writer): opens a peering with the receiver's identity, transport, layout and capacity."""

    TYPE: ClassVar[str] = "HELLO"
    DOC: ClassVar[str] = (
        "receiver -> writer, control. Opens a peering: who the receiver is, its transport, layout "
        "and capacity. The writer answers HELLO_ACK; the receiver then sends OFFER."
    )
    engine: str = _f(STR, "sender's engine id")
    role: str = _f(STR, "'decode' (receiver) or 'prefill' (writer)")
    session: bytes = _f(_Bytes(64), "random token the writer presents when it opens the data path")
    reply_to: str = _f(STR, "sender's control address (zmq endpoint)")
    transport: str = _f(STR, "data transport, a registered name: 'tcp', 'shm' or 'verbs'")
    page_size: int = _f(U32, "tokens per page")
    num_pages: int = _f(U32, "pages in the sender's pool")
    item_lens: list = _f(_UIntList(), "bytes per page of each buffer, in layout order")
    pool_tokens: int = _f(UINT, "tokens the sender's pool holds")
    max_context: int = _f(UINT, "sender's configured maximum context length (tokens)")
    checksum: str = _f(STR, "checksum algorithm the sender expects: 'adler32' or 'crc32'")
    geometry: Any = _f(_Geometry(), "what each buffer's page holds: [tp_rank, tp_size, group, [[layer, kind, "
                       "head_start, head_count, total_heads, head_bytes, dtype, order], ...]] (SPEC §1.2); [] when "
                       "the layout does not say (pages then pair one to one, equal item lengths only)", None)


@_register
@dataclass(frozen=True, eq=False)
class HelloAck(Message):
    """HELLO_ACK (writer -> receiver): accepts or refuses a peering, with the writer's layout and capacity."""

    TYPE: ClassVar[str] = "HELLO_ACK"
    DOC: ClassVar[str] = (
        "writer -> receiver, control. Accepts (ok) or refuses a peering, with the writer's own "
        "layout and capacity, so the receiver can reject prompts the writer's pool cannot hold."
    )
    engine: str = _f(STR, "sender's engine id")
    role: str = _f(STR, "'prefill'")
    session: bytes = _f(_Bytes(64), "the session token from HELLO")
    ok: bool = _f(BOOL, "whether the peering is accepted")
    error: str = _f(STR, "why not, when ok is false")
    page_size: int = _f(U32, "tokens per page")
    num_pages: int = _f(U32, "pages in the writer's pool")
    item_lens: list = _f(_UIntList(), "bytes per page of each buffer")
    pool_tokens: int = _f(UINT, "tokens the writer's pool holds")
    max_context: int = _f(UINT, "writer's configured maximum context length")
    geometry: Any = _f(_Geometry(), "the writer's geometry, as in HELLO", None)


@_register
@dataclass(frozen=True, eq=False)
class Connect(Message):
    """CONNECT (writer -> receiver, first data frame): binds a data connection to a peering under a new epoch."""

    TYPE: ClassVar[str] = "CONNECT"
    DOC: ClassVar[str] = (
        "writer -> receiver, first frame of a data connection. Binds the connection to the peering "
        "HELLO opened (by its session token) under a new epoch; later frames need no identity."
    )
    engine: str = _f(STR, "writer's engine id")
    epoch: int = _f(UINT, "the epoch of the OFFER this connection answers")
    proof: bytes = _f(_Bytes(PROOF_BYTES), "connect_proof(session, OFFER nonce, engine, epoch): proves the "
                      "session secret without sending it; good for this one offer only")


@_register
@dataclass(frozen=True, eq=False)
class Meta(Message):
    """META (receiver -> writer): a request was admitted; its destination pages and the (slot, gen) tag to write with."""

    TYPE: ClassVar[str] = "META"
    DOC: ClassVar[str] = (
        "receiver -> writer, control. The receiver admitted a request and reserved pages: "
        "write page i of the request into pages[i], tagged (slot, gen)."
    )
    rid: Rid = _f(RID, "request id")
    gen: int = _f(UINT, "request generation (receiver-assigned, unique, increasing)")
    slot: int = _f(_UInt(0xFFFF), "receiver's request slot (tag low bits)")
    tokens: int = _f(UINT, "prompt tokens")
    pages: np.ndarray = _f(PAGES, "destination page indices, little-endian uint32")
    access: bytes = _f(
        _Bytes(MAX_BLOB),
        "transport-specific: the keys this request's pages may be written with. verbs with memory windows: "
        "a msgpack map {v: 1, epoch, windows} whose windows are 16-byte <buffer u32, first page u32, pages u32, "
        "rkey u32> records, bound on the queue pair of connection epoch only and invalidated when the request "
        "ends (SPEC §3.2); empty when the OFFER's keys apply (tcp, shm, verbs without windows)",
        b"",
    )
    heads: tuple = _f(
        _Heads(),
        "this writer's share of the request (SPEC §1.2): [] = every page, page for page (equal layouts); "
        "[first, count] = KV heads first..first+count-1 of every buffer, placed by the two geometries "
        "(count 0: nothing to write, pages empty; the writer's half of the request completes for it)",
        (),
    )


@_register
@dataclass(frozen=True, eq=False)
class Reject(Message):
    """REJECT (either way): refused at admission; writer -> receiver on the ordered path, it also proves no write for gen is in flight."""

    TYPE: ClassVar[str] = "REJECT"
    DOC: ClassVar[str] = (
        "either way. The sender refused the request at admission. Writer -> receiver travels on "
        "the ordered data path, so it also proves no write for gen is in flight."
    )
    rid: Rid = _f(RID, "request id")
    gen: int = _f(UINT, "generation of the attempt refused (receivers give rejected attempts one too)")
    reason: str = _f(STR, "machine-readable reason (e.g. 'exceeds_pool')")
    detail: str = _f(STR, "human-readable error")


@_register
@dataclass(frozen=True, eq=False)
class Abort(Message):
    """ABORT (either way): stop writing gen (receiver -> writer), or the writer gave up, ordered behind its writes (writer -> receiver)."""

    TYPE: ClassVar[str] = "ABORT"
    DOC: ClassVar[str] = (
        "either way. Receiver -> writer (control): stop writing gen and send DRAIN_ACK once every "
        "posted write completed. Writer -> receiver (ordered data path): the writer gave up; being "
        "ordered behind its writes, it proves the drain."
    )
    rid: Rid = _f(RID, "request id")
    gen: int = _f(UINT, "request generation")
    reason: str = _f(STR, "machine-readable reason")
    detail: str = _f(STR, "human-readable detail")


@_register
@dataclass(frozen=True, eq=False)
class DrainAck(Message):
    """DRAIN_ACK (writer -> receiver, ordered): every write posted for gen completed; gen's quarantined pages may be freed."""

    TYPE: ClassVar[str] = "DRAIN_ACK"
    DOC: ClassVar[str] = (
        "writer -> receiver, ordered data path. Every write the writer posted for gen has "
        "completed; the receiver may release gen's quarantined pages (only gen's)."
    )
    rid: Rid = _f(RID, "request id")
    gen: int = _f(UINT, "request generation being acknowledged")
    posted: int = _f(UINT, "writes posted for gen")
    completed: int = _f(UINT, "writes completed for gen (equals posted)")


@_register
@dataclass(frozen=True, eq=False)
class Done(Message):
    """DONE (writer -> receiver, ordered behind the last write): what was written, verified by the receiver before any read."""

    TYPE: ClassVar[str] = "DONE"
    DOC: ClassVar[str] = (
        "writer -> receiver, ordered data path, behind the request's last write. Claims what was "
        "written; the receiver verifies every claim against what landed before anyone may read."
    )
    rid: Rid = _f(RID, "request id")
    gen: int = _f(UINT, "request generation")
    bytes: int = _f(UINT, "bytes written for gen")
    pages: int = _f(UINT, "pages written for gen (each in every buffer)")
    checksum: int = _f(U32, "checksum of the source pages in canonical order")
    algo: str = _f(STR, "'adler32' or 'crc32'")
    aux: bytes = _f(_Bytes(1 << 20), "small per-request metadata delivered with completion", b"")
    runs: bytes = _f(
        _Bytes(MAX_MESSAGE_BYTES // 2),
        "verbs only: the write log, every run written for gen as 24-byte <buffer u32, flags u32, offset u64, "
        "length u64> records (the receiver cannot observe plain RDMA writes, so it checks and records "
        "this log with the same write guard tcp uses); empty on tcp",
        b"",
    )


@_register
@dataclass(frozen=True, eq=False)
class Offer(Message):
    """OFFER (receiver -> writer): a data connection prepared under a new epoch and how to reach the pool (transport-specific blob)."""

    TYPE: ClassVar[str] = "OFFER"
    DOC: ClassVar[str] = (
        "receiver -> writer, control. The receiver prepared a data connection for this peering under "
        "a new epoch; blob says how to reach its pool, in the transport's own encoding (SPEC §5). "
        "Sent after HELLO_ACK, after every fence and after a data connection ended. Epochs increase."
    )
    epoch: int = _f(UINT, "connection epoch of this offer")
    nonce: bytes = _f(_Bytes(32), "fresh random bytes; the writer's connect proof for this offer covers them")
    blob: bytes = _f(_Bytes(MAX_BLOB), "transport-specific: how to reach the receiver's pool")


@_register
@dataclass(frozen=True, eq=False)
class Accept(Message):
    """ACCEPT (writer -> receiver): the writer's half of the offered connection (transport-specific blob)."""

    TYPE: ClassVar[str] = "ACCEPT"
    DOC: ClassVar[str] = (
        "writer -> receiver, control. The writer opened its half of the offered connection; blob is "
        "what the receiver needs to finish it (verbs: the writer's queue pair; tcp and shm: empty, "
        "their data path opens with CONNECT)."
    )
    engine: str = _f(STR, "writer's engine id")
    epoch: int = _f(UINT, "the epoch from OFFER")
    proof: bytes = _f(_Bytes(PROOF_BYTES), "connect_proof(session, OFFER nonce, engine, epoch), as in CONNECT")
    blob: bytes = _f(_Bytes(MAX_BLOB), "transport-specific: the writer's half of the connection")


@_register
@dataclass(frozen=True, eq=False)
class Result(Message):
    """RESULT (receiver -> writer): the outcome of verifying gen."""

    TYPE: ClassVar[str] = "RESULT"
    DOC: ClassVar[str] = ("receiver -> writer, control, or on the data connection DONE came on (tcp: a RESULT "
                          "frame, SPEC §3.0.1). The outcome of verifying gen.")
    rid: Rid = _f(RID, "request id")
    gen: int = _f(UINT, "request generation")
    ok: bool = _f(BOOL, "verified and readable")
    reason: str = _f(STR, "machine-readable failure reason ('' when ok)")
    detail: str = _f(STR, "human-readable detail")


@_register
@dataclass(frozen=True, eq=False)
class Fenced(Message):
    """FENCED (either way): one side closed data connection ``epoch``; the other settles its half."""

    TYPE: ClassVar[str] = "FENCED"
    DOC: ClassVar[str] = (
        "either way, control. Receiver -> writer: the receiver closed data connection epoch and "
        "discards anything that arrives on it; every request in flight on it failed; it offers a new "
        "epoch. Writer -> receiver: the writer's end of connection epoch ended (its queue pair or "
        "socket failed): the receiver fences its half at once and offers a new epoch, instead of "
        "waiting for a timeout on a fabric where it cannot see the writer's end go."
    )
    epoch: int = _f(UINT, "data connection epoch that was fenced")
    reason: str = _f(STR, "why (e.g. 'drain_timeout')")


@_register
@dataclass(frozen=True, eq=False)
class Heartbeat(Message):
    """HEARTBEAT (either way): liveness, with an increasing sequence number."""

    TYPE: ClassVar[str] = "HEARTBEAT"
    DOC: ClassVar[str] = "either way, control. Liveness; a peer silent for too long is dead."
    engine: str = _f(STR, "sender's engine id")
    seq: int = _f(UINT, "increasing sequence number")


@_register
@dataclass(frozen=True, eq=False)
class Error(Message):
    """ERROR (either way): a received message could not be acted on; informational, it changes no state."""

    TYPE: ClassVar[str] = "ERROR"
    DOC: ClassVar[str] = (
        "either way, control. The sender could not act on a message it received (malformed, "
        "unknown request, stale generation...). Informational: it changes no state, except "
        "`not_peered` to a decode, which then peers again (§3.0)."
    )
    about: str = _f(STR, "type of the offending message, or '?' when it could not be decoded")
    code: str = _f(STR, "error code (kvxfer.errors codes)")
    detail: str = _f(STR, "human-readable error")
    rid: Rid = _f(RID, "request id concerned, when known", "?")
    gen: int = _f(UINT, "generation concerned, 0 when unknown", 0)


# encoding -------------------------------------------------------------------------------------


@functools.cache
def _kinds(cls: type) -> dict[str, Kind]:
    """A message class's fields and their kinds, in declaration order (``dataclasses.fields`` is
    slow enough to show on a small request's path; the classes never change)."""
    return {f.name: f.metadata["kind"] for f in dataclasses.fields(cls)}


def _to_wire(kind: Kind, value: Any) -> Any:
    if isinstance(kind, _Geometry):
        return [] if value is None else value.wire()
    if isinstance(kind, _Pages):
        array = np.asarray(value)
        if array.size and (array.min() < 0 or array.max() > 0xFFFFFFFF):
            raise ProtocolError("page index outside uint32")
        return array.astype("<u4").tobytes()
    return value


def encode(message: Message) -> bytes:
    """Deterministic msgpack bytes of ``message`` (validates fields first)."""
    cls = type(message)
    if MESSAGE_TYPES.get(cls.TYPE) is not cls:
        raise ProtocolError(f"{cls.__name__} is not a registered message type")
    body = {}
    for name, kind in _kinds(cls).items():
        value = getattr(message, name)
        try:
            kind.check(value)
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"cannot encode {cls.TYPE}.{name}: {exc}") from None
        body[name] = _to_wire(kind, value)
    data = msgpack.packb([PROTOCOL_VERSION, cls.TYPE, body], use_bin_type=True)
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"{cls.TYPE} of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return data


# One msgpack value of at most MAX_MESSAGE_BYTES, nothing after it (unpackb raises ExtraData), no
# extension types, string keys; the caps bound what a hostile message can make the decoder allocate.
_UNPACK_LIMITS = dict(raw=False, strict_map_key=True, max_str_len=MAX_STR * 4, max_bin_len=MAX_MESSAGE_BYTES,
                      max_array_len=1 << 17, max_map_len=64, max_ext_len=0)


def decode(data: bytes | bytearray | memoryview) -> Message:
    """Parse and validate one message; raise :class:`ProtocolError` on anything unexpected."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"message must be bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    if len(data) == 0:
        raise ProtocolError("empty message")
    try:
        envelope = msgpack.unpackb(bytes(data), **_UNPACK_LIMITS)
    except msgpack.ExtraData:
        raise ProtocolError("trailing bytes after the message") from None
    except Exception as exc:  # msgpack raises several types for malformed input
        if isinstance(exc, ValueError) and "incomplete input" in str(exc):
            raise ProtocolError("truncated message (msgpack ran out of data)") from None
        raise ProtocolError(f"not a msgpack message: {type(exc).__name__}: {exc}") from None
    if not isinstance(envelope, list) or len(envelope) != 3:
        raise ProtocolError("envelope must be a 3-element array [version, type, body]")
    version, type_name, body = envelope
    if isinstance(version, bool) or not isinstance(version, int):
        raise ProtocolError(f"protocol version must be an integer, got {type(version).__name__}")
    if version != PROTOCOL_VERSION:
        reply_to = body.get("reply_to") if isinstance(body, dict) else None
        raise VersionMismatch(
            f"unsupported protocol version {version} (this engine speaks {PROTOCOL_VERSION}): "
            f"both engines must run kvxfer releases speaking the same protocol version",
            version=version, reply_to=reply_to if isinstance(reply_to, str) and len(reply_to) <= MAX_STR else None,
        )
    if not isinstance(type_name, str):
        raise ProtocolError("message type must be a string")
    cls = MESSAGE_TYPES.get(type_name)
    if cls is None:
        raise ProtocolError(f"unknown message type {type_name[:64]!r}")
    if not isinstance(body, dict):
        raise ProtocolError(f"{type_name} body must be a map")
    kinds = _kinds(cls)
    unexpected = [k for k in body if k not in kinds]
    if unexpected:
        raise ProtocolError(f"{type_name}: unexpected field {str(unexpected[0])[:64]!r}")
    values = {}
    for name, kind in kinds.items():
        if name not in body:
            raise ProtocolError(f"{type_name}: missing field {name!r}")
        try:
            values[name] = kind.check(body[name])
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"{type_name}.{name}: {exc}") from None
    return cls(**values)


def schema() -> dict[str, Any]:
    """Machine-readable schema of every message (written to ``protocol/schema.json``)."""
    out: dict[str, Any] = {
        "protocol_version": PROTOCOL_VERSION,
        "envelope": "msgpack array [version: uint, type: str, body: map]",
        "max_message_bytes": MAX_MESSAGE_BYTES,
        "messages": {},
    }
    for name, cls in MESSAGE_TYPES.items():
        fields = []
        for f in dataclasses.fields(cls):
            kind: Kind = f.metadata["kind"]
            entry = {"name": f.name, "type": kind.name, "doc": f.metadata["doc"]}
            if isinstance(kind, _UInt) and kind.maximum != U64:
                entry["max"] = kind.maximum
            if isinstance(kind, (_Str, _Bytes)):
                entry["max_len"] = kind.max_len
            if f.default is not dataclasses.MISSING:
                default = f.default
                entry["default"] = (default.hex() if isinstance(default, bytes) else list(default)
                                    if isinstance(default, tuple) else [] if isinstance(kind, _Geometry) else default)
            fields.append(entry)
        out["messages"][name] = {"doc": cls.DOC, "fields": fields}
    return out
