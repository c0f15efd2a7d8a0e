"""Data-plane frames of the software (tcp) transport.

A frame is a fixed 32-byte header, a body and, for WRITE, a payload (``protocol/SPEC.md`` §3)::

    magic "KX" | version u8 | kind u8 | slot u32 | generation u64 | count u32 | body_len u32 | payload_len u64

* ``CONNECT`` (kind 1): body is a msgpack CONNECT message; first frame on a connection.
* ``WRITE``   (kind 2): body is ``count`` runs of ``<IIQQ`` (buffer, flags=0, offset, length), the
  payload is the runs' bytes back to back. ``(slot, generation)`` is the write's tag.
* ``ORDERED`` (kind 3): body is a msgpack control message (DONE, DRAIN_ACK, REJECT, ABORT) that
  must be acted on only after every earlier frame on the connection; the header's tag repeats the
  message's generation and slot.
* ``DONE``    (kind 5): a DONE in a fixed binary layout (:data:`DONE_FIXED`, then the request id and aux),
  ordered exactly as an ORDERED frame; the header's generation is the DONE's. A writer sends it for a DONE
  without a write log and with at most :data:`DONE_AUX_MAX` bytes of aux (any other DONE goes as ORDERED):
  the receiver's data thread reads it without a msgpack decoder (:func:`parse_done`).
* ``RESULT``  (kind 4): receiver -> writer, the only frame that travels that way: body is a msgpack
  RESULT message (at most :data:`RESULT_BODY_MAX` bytes), the header's generation repeats its ``gen``
  and its slot is 0. The receiver answers a verification on the connection the request's DONE came
  on, when it can without waiting (else on the control plane, as every other transport does).

All integers are little-endian. The parser checks every field and its limits and raises
:class:`~kvxfer.errors.ProtocolError`; a stream that produced one is out of sync and gets fenced.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.arguments import MAX_RID_STR
from ..core.pagesets import all_set, any_set, total
from ..core.runs import RUN_DTYPE
from ..core.runs import pack_runs as pack_runs  # a WRITE frame's body; the record is the runs' own
from ..errors import ProtocolError
from .messages import MAX_MESSAGE_BYTES

MAGIC = b"KX"
FRAME_VERSION = 1
HEADER = struct.Struct("<2sBBIQIIQ")
HEADER_SIZE = HEADER.size  # 32
RUN_SIZE = RUN_DTYPE.itemsize  # 24
MAX_RUNS = 8192
MAX_PAYLOAD = 1 << 30
MAX_OFFSET = 1 << 48  # no registered buffer is 256 TiB; larger offsets are hostile or corrupt

assert HEADER_SIZE == 32 and RUN_SIZE == 24


class FrameKind(enum.IntEnum):
    """The ``kind`` byte of a data-plane frame header (see the module docstring)."""

    CONNECT = 1
    WRITE = 2
    ORDERED = 3
    RESULT = 4
    DONE = 5


@dataclass(frozen=True)
class FrameHeader:
    """A frame's fixed 32-byte header as fields: :meth:`pack` encodes one, :func:`parse_header` decodes and
    checks one (magic, version, kind and every limit)."""

    kind: FrameKind
    slot: int
    generation: int
    count: int
    body_len: int
    payload_len: int

    def pack(self) -> bytes:
        return HEADER.pack(
            MAGIC,
            FRAME_VERSION,
            int(self.kind),
            self.slot,
            self.generation,
            self.count,
            self.body_len,
            self.payload_len,
        )


def parse_header(data: bytes | bytearray | memoryview, *, toward_writer: bool = False) -> FrameHeader:
    """Parse and check a frame header. A receiver reads CONNECT, WRITE, ORDERED and DONE frames; a writer
    (``toward_writer``) reads RESULT frames only."""
    if len(data) != HEADER_SIZE:
        raise ProtocolError(f"frame header must be {HEADER_SIZE} bytes, got {len(data)}")
    magic, version, kind, slot, gen, count, body_len, payload_len = HEADER.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic {bytes(magic)!r} (expected {MAGIC!r}): stream out of sync")
    if version != FRAME_VERSION:
        raise ProtocolError(f"unsupported frame version {version} (this engine speaks {FRAME_VERSION})")
    try:
        kind = FrameKind(kind)
    except ValueError:
        raise ProtocolError(f"unknown frame kind {kind}") from None
    if (kind is FrameKind.RESULT) != toward_writer:
        raise ProtocolError("a RESULT frame travels receiver -> writer only" if toward_writer is False
                            else f"the receiver sent a {kind.name} frame (only RESULT travels that way)")
    if kind is FrameKind.DONE:
        if count or payload_len:
            raise ProtocolError("DONE frame must have no runs and no payload")
        if not DONE_FIXED.size < body_len <= DONE_BODY_MAX:
            raise ProtocolError(f"DONE frame body of {body_len} bytes (allowed {DONE_FIXED.size + 1}..{DONE_BODY_MAX})")
    elif kind is FrameKind.WRITE:
        if not 1 <= count <= MAX_RUNS:
            raise ProtocolError(f"WRITE frame with {count} runs (allowed 1..{MAX_RUNS})")
        if body_len != count * RUN_SIZE:
            raise ProtocolError(f"WRITE frame body of {body_len} bytes for {count} runs")
        if not 1 <= payload_len <= MAX_PAYLOAD:
            raise ProtocolError(f"WRITE frame payload of {payload_len} bytes (allowed 1..{MAX_PAYLOAD})")
    else:
        if count or payload_len:
            raise ProtocolError(f"{kind.name} frame must have no runs and no payload")
        if not 1 <= body_len <= MAX_MESSAGE_BYTES:
            raise ProtocolError(f"{kind.name} frame body of {body_len} bytes")
    return FrameHeader(kind, slot, gen, count, body_len, payload_len)


def parse_runs(header: FrameHeader, body: bytes | bytearray | memoryview) -> np.ndarray:
    """The WRITE frame's run table; checks it adds up to the payload. A table the C twin of these checks
    (``check_run_table``, native/kvxfer_native.c) passes is returned at once; any other is checked here,
    and the ProtocolError names the rule."""
    runs = np.frombuffer(body, dtype=RUN_DTYPE, count=header.count)
    if _C_RUN_TABLE is not None and _C_RUN_TABLE(runs, header.payload_len, MAX_PAYLOAD, MAX_OFFSET):
        return runs
    runs = check_runs(runs, "WRITE")
    added = total(runs["length"])
    if added != header.payload_len:
        raise ProtocolError(f"WRITE runs add up to {added} bytes, header says {header.payload_len}")
    return runs


def _c_run_table() -> Any:
    from ..core import native

    return native.lib.check_run_table if native.provides("check_run_table") else None


_C_RUN_TABLE = _c_run_table()


def check_runs(runs: np.ndarray, what: str) -> np.ndarray:
    """Field limits of a run table (tcp WRITE frames, verbs write logs): no flags, no empty run,
    no run longer than a frame's payload limit, no offset past :data:`MAX_OFFSET`. With these, sums
    and page arithmetic on the runs cannot overflow."""
    if any_set(runs["flags"]):
        raise ProtocolError(f"{what} run with unknown flags")
    lengths = runs["length"]
    if not all_set(lengths):
        raise ProtocolError(f"{what} run of zero bytes")
    if any_set(lengths > MAX_PAYLOAD):
        raise ProtocolError(f"{what} run of {int(lengths.max())} bytes (at most {MAX_PAYLOAD})")
    if any_set(runs["offset"] >= MAX_OFFSET):
        raise ProtocolError(f"{what} run at offset {int(runs['offset'].max())} (offsets stay below 2^48)")
    return runs


def write_header(slot: int, generation: int, count: int, payload_len: int) -> bytes:
    """A WRITE frame's header (what ``FrameHeader(FrameKind.WRITE, ...).pack()`` gives, without the object)."""
    return HEADER.pack(MAGIC, FRAME_VERSION, _WRITE_KIND, slot, generation, count, count * RUN_SIZE, payload_len)


_WRITE_KIND = int(FrameKind.WRITE)


CONNECT_BODY_MAX = 32 << 10  # a CONNECT holds an engine id (at most 4096 characters), an epoch and a proof


def message_frame(kind: FrameKind, body: bytes, *, slot: int = 0, generation: int = 0) -> bytes:
    return FrameHeader(kind, slot, generation, 0, len(body), 0).pack() + body


# A DONE frame's body: bytes u64 | pages u32 | checksum u32 | algo u8 | rid kind u8 | rid_len u16 | aux_len u32,
# then rid_len bytes of request id (kind 1: a uint64, rid_len 8; kind 2: UTF-8, 1..MAX_RID_STR characters)
# and aux_len bytes of aux; body_len is exactly the sum.
DONE_FIXED = struct.Struct("<QIIBBHI")
DONE_AUX_MAX = 4096  # a DONE with more aux (or with a write log) travels as an ORDERED msgpack DONE
DONE_RID_MAX = MAX_RID_STR * 4  # UTF-8 bytes of the longest string request id
DONE_BODY_MAX = DONE_FIXED.size + DONE_RID_MAX + DONE_AUX_MAX
DONE_ALGOS = {"adler32": 1, "crc32": 2}
DONE_CHECKSUM_AT = HEADER_SIZE + 12  # the checksum's offset in a DONE frame (after bytes u64 and pages u32)
DONE_ALGO_NAMES = {code: name for name, code in DONE_ALGOS.items()}
RID_UINT, RID_STR = 1, 2
_U32 = 0xFFFFFFFF
_U64 = (1 << 64) - 1
assert DONE_FIXED.size == 24


def done_frame(msg: Any, *, slot: int) -> bytes | None:
    """The DONE frame of ``msg`` (a :class:`~kvxfer.wire.messages.Done`), or None when it does not fit
    the binary layout (a write log, more than :data:`DONE_AUX_MAX` bytes of aux, a field out of its
    range): the caller then sends it as an ORDERED frame. Values are those ``encode`` accepts."""
    algo = DONE_ALGOS.get(msg.algo)
    rid, aux = msg.rid, msg.aux
    if (msg.runs or algo is None or len(aux) > DONE_AUX_MAX or not 0 <= msg.pages <= _U32
            or not 0 <= msg.bytes <= _U64 or not 0 <= msg.checksum <= _U32 or not 0 <= msg.gen <= _U64):
        return None
    if type(rid) is str:
        if not 1 <= len(rid) <= MAX_RID_STR:
            return None
        rid_kind, rid_bytes = RID_STR, rid.encode()
    elif type(rid) is int and 0 <= rid <= _U64:
        rid_kind, rid_bytes = RID_UINT, rid.to_bytes(8, "little")
    else:
        return None
    body_len = DONE_FIXED.size + len(rid_bytes) + len(aux)
    return b"".join((HEADER.pack(MAGIC, FRAME_VERSION, FrameKind.DONE, slot, msg.gen, 0, body_len, 0),
                     DONE_FIXED.pack(msg.bytes, msg.pages, msg.checksum, algo, rid_kind, len(rid_bytes), len(aux)),
                     rid_bytes, aux))


def parse_done(header: FrameHeader, body: bytes | bytearray | memoryview) -> Any:
    """The :class:`~kvxfer.wire.messages.Done` a DONE frame carries (its generation the header's), or a
    ProtocolError naming the rule the body breaks."""
    from .messages import Done

    body = bytes(body)
    if len(body) != header.body_len or len(body) <= DONE_FIXED.size:
        raise ProtocolError(f"DONE frame body of {len(body)} bytes (header says {header.body_len})")
    nbytes, pages, checksum, algo, rid_kind, rid_len, aux_len = DONE_FIXED.unpack_from(body)
    if DONE_FIXED.size + rid_len + aux_len != len(body):
        raise ProtocolError(f"DONE frame body of {len(body)} bytes holds a {rid_len}-byte request id and "
                            f"{aux_len} bytes of aux")
    name = DONE_ALGO_NAMES.get(algo)
    if name is None:
        raise ProtocolError(f"DONE frame names checksum algorithm {algo} (1: adler32, 2: crc32)")
    if aux_len > DONE_AUX_MAX:
        raise ProtocolError(f"DONE frame with {aux_len} bytes of aux (at most {DONE_AUX_MAX})")
    raw = body[DONE_FIXED.size : DONE_FIXED.size + rid_len]
    if rid_kind == RID_UINT:
        if rid_len != 8:
            raise ProtocolError(f"DONE frame: an integer request id of {rid_len} bytes (8)")
        rid: Any = int.from_bytes(raw, "little")
    elif rid_kind == RID_STR:
        try:
            rid = raw.decode()
        except UnicodeDecodeError:
            raise ProtocolError("DONE frame: the request id is not UTF-8") from None
        if not 1 <= len(rid) <= MAX_RID_STR:
            raise ProtocolError(f"DONE frame: a request id of {len(rid)} characters (1..{MAX_RID_STR})")
    else:
        raise ProtocolError(f"DONE frame: request id kind {rid_kind} (1: integer, 2: string)")
    return Done(rid=rid, gen=header.generation, bytes=nbytes, pages=pages, checksum=checksum, algo=name,
                aux=body[DONE_FIXED.size + rid_len :])


def ordered_frame(msg: Any, *, slot: int, generation: int) -> bytes:
    """The frame that carries an ordered message: a DONE frame where :func:`done_frame` takes it, else an
    ORDERED frame of its msgpack encoding."""
    from .messages import Done, encode

    if type(msg) is Done and msg.gen == generation:
        frame = done_frame(msg, slot=slot)
        if frame is not None:
            return frame
    return message_frame(FrameKind.ORDERED, encode(msg), slot=slot, generation=generation)


def ordered_message(header: FrameHeader, body: bytes | bytearray | memoryview) -> Any:
    """The message an ORDERED or DONE frame carries, checked: one of DONE, DRAIN_ACK, REJECT and ABORT, for
    the header's generation; ProtocolError otherwise."""
    from .messages import Abort, Done, DrainAck, Reject, decode

    if header.kind is FrameKind.DONE:
        return parse_done(header, body)
    msg = decode(body)
    if not isinstance(msg, (Done, DrainAck, Reject, Abort)):
        raise ProtocolError(f"{msg.TYPE} may not travel as an ORDERED frame")
    if msg.gen != header.generation:
        raise ProtocolError(f"ORDERED frame tagged generation {header.generation} carries {msg.TYPE} "
                            f"for generation {msg.gen}")
    return msg


_KINDS = {int(kind): kind for kind in FrameKind}
# what a C frame reader checks a header against: version, runs, payload, message body and offset limits
NATIVE_LIMITS = (FRAME_VERSION, MAX_RUNS, MAX_PAYLOAD, MAX_MESSAGE_BYTES, MAX_OFFSET)


def native_reader(name: str) -> Any:
    """The C frame reader ``name`` of kvxfer._native (``recv_frame_head``, ``ring_frame_head``) where the
    built extension has it and knows this protocol's DONE frame (its limits are this module's), else None."""
    from ..core import native

    lib = native.lib
    return (getattr(lib, name) if native.provides(name) and getattr(lib, "DONE_BODY_MAX", None) == DONE_BODY_MAX
            and getattr(lib, "DONE_AUX_MAX", None) == DONE_AUX_MAX else None)


def native_head(head: tuple) -> tuple[FrameHeader, Any]:
    """What a C frame reader's ``(status, kind, slot, generation, count, body_len, payload_len, header,
    body)`` means (``recv_frame_head`` and ``ring_frame_head`` in native/kvxfer_native.c, the twins of
    :func:`parse_header`, :func:`parse_runs` and :func:`parse_done`): the header and, for a WRITE frame,
    its run table (an array), for a DONE frame its :class:`~kvxfer.wire.messages.Done`, for an ORDERED
    frame read with its header its body (bytes), else None (the body is still to be read). A frame C
    refused is parsed by the Python rules, which raise the ProtocolError naming the rule."""
    status, kind, slot, gen, count, body_len, payload_len, raw, body = head
    if status < 0:
        header = parse_header(raw)
        if status == -2:
            parse_runs(header, body)
        elif status == -3:
            parse_done(header, body)
        raise ProtocolError(f"frame refused by the native parser but not by the Python rules: {raw.hex()}")
    header = FrameHeader(_KINDS[kind], slot, gen, count, body_len, payload_len)
    if status == 3:  # a DONE frame, parsed in C by parse_done's rules
        from .messages import Done

        rid, nbytes, pages, checksum, algo, aux = body
        return header, Done(rid=rid, gen=gen, bytes=nbytes, pages=pages, checksum=checksum,
                            algo=DONE_ALGO_NAMES[algo], aux=aux)
    return header, (np.frombuffer(body, dtype=RUN_DTYPE) if status == 0 else body)


RESULT_BODY_MAX = 16 << 10  # a RESULT's detail is a short text; a longer answer goes on the control plane


def result_frame(msg: Any) -> bytes:
    """The RESULT frame of ``msg`` (a :class:`~kvxfer.wire.messages.Result`); ProtocolError when its body
    is over :data:`RESULT_BODY_MAX` (the caller answers on the control plane instead)."""
    from .messages import Result, encode

    if not isinstance(msg, Result):
        raise ProtocolError(f"only RESULT travels receiver -> writer on a data connection, not {msg.TYPE}")
    body = encode(msg)
    if len(body) > RESULT_BODY_MAX:
        raise ProtocolError(f"RESULT of {len(body)} bytes exceeds a RESULT frame's {RESULT_BODY_MAX}")
    return message_frame(FrameKind.RESULT, body, generation=msg.gen)


class ResultReader:
    """The writer's parser of what its receiver sends back on a data connection: whole RESULT frames
    out of a byte stream that arrives in arbitrary pieces. :meth:`feed` returns the RESULT messages
    completed so far and keeps a partial frame for the next call. Anything else (another frame kind, a
    slot, an over-long body, a body that is not a RESULT for the header's generation) puts the reader
    in :attr:`error`: the stream is out of sync and the connection ends. The messages before it are
    still returned, so how the bytes were cut never changes what is read."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self.error: ProtocolError | None = None

    @property
    def pending(self) -> int:
        """Bytes of a frame not yet complete."""
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> list[Any]:
        if self.error is not None:
            raise self.error
        self._buf += data
        out: list[Any] = []
        try:
            while len(self._buf) >= HEADER_SIZE:
                msg = self._next()
                if msg is None:
                    break
                out.append(msg)
        except ProtocolError as exc:
            self.error = exc
        return out

    def _next(self) -> Any:
        from .messages import Result, decode

        header = parse_header(bytes(self._buf[:HEADER_SIZE]), toward_writer=True)
        if header.slot or header.body_len > RESULT_BODY_MAX:
            raise ProtocolError(f"RESULT frame with slot {header.slot} and a body of {header.body_len} bytes "
                                f"(slot 0, at most {RESULT_BODY_MAX} bytes)")
        end = HEADER_SIZE + header.body_len
        if len(self._buf) < end:
            return None
        msg = decode(bytes(self._buf[HEADER_SIZE:end]))
        del self._buf[:end]
        if not isinstance(msg, Result):
            raise ProtocolError(f"a RESULT frame carries {msg.TYPE}")
        if msg.gen != header.generation:
            raise ProtocolError(f"RESULT frame tagged generation {header.generation} carries generation {msg.gen}")
        return msg


def parse_write_log(data: bytes) -> np.ndarray:
    """DONE's write log (fabrics whose receiver cannot see writes land) as a run table: the same
    records as WRITE frames."""
    if len(data) % RUN_SIZE:
        raise ProtocolError(f"write log of {len(data)} bytes is not a whole number of {RUN_SIZE}-byte runs")
    return check_runs(np.frombuffer(data, dtype=RUN_DTYPE), "write log")
