"""Data-plane frames of the software (tcp) transport.

A frame is a fixed 32-byte header, a body and, for WRITE, a payload (``protocol/SPEC.md`` §3)::

    magic "KX" | version u8 | kind u8 | slot u32 | generation u64 | count u32 | body_len u32 | payload_len u64

* ``CONNECT`` (kind 1): body is a msgpack CONNECT message; first frame on a connection.
* ``WRITE``   (kind 2): body is ``count`` runs of ``<IIQQ`` (buffer, flags=0, offset, length), the
  payload is the runs' bytes back to back. ``(slot, generation)`` is the write's tag.
* ``ORDERED`` (kind 3): body is a msgpack control message (DONE, DRAIN_ACK, REJECT, ABORT) that
  must be acted on only after every earlier frame on the connection; the header's tag repeats the
  message's generation and slot.
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
    """Parse and check a frame header. A receiver reads CONNECT, WRITE and ORDERED frames; a writer
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
    if kind is FrameKind.WRITE:
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
    return FrameHeader(FrameKind.WRITE, slot, generation, count, count * RUN_SIZE, payload_len).pack()


CONNECT_BODY_MAX = 32 << 10  # a CONNECT holds an engine id (at most 4096 characters), an epoch and a proof


def message_frame(kind: FrameKind, body: bytes, *, slot: int = 0, generation: int = 0) -> bytes:
    return FrameHeader(kind, slot, generation, 0, len(body), 0).pack() + body


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
