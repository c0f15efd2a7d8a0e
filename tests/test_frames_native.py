"""The tcp receiver's frame head in C (``recv_frame_head``, native/kvxfer_native.c) and the run-table
check every transport's parse_runs takes first (``check_run_table``) held to the Python parsers they stand
in for (kvxfer/wire/frames.py: parse_header and parse_runs).

Random frames, most of them broken on purpose (magic, version, kind, run count, body and payload lengths,
run flags, empty, oversized and far-off runs, lengths that do not add up), are written into a real
socket pair; what the receiver's reader returns must be exactly what the Python parsers make of the same
bytes: the same header and run table, or the same ProtocolError.
"""

from __future__ import annotations

import socket
import struct

import numpy as np
import pytest

from kvxfer.core import native
from kvxfer.errors import ProtocolError
from kvxfer.transport import tcp
from kvxfer.wire import frames as f
from kvxfer.wire import messages as m
from kvxfer.wire.messages import MAX_MESSAGE_BYTES

pytestmark = pytest.mark.skipif(
    not native.provides("recv_frame_head"),
    reason=f"needs the C extension kvxfer._native with recv_frame_head ({native.describe()})",
)


def _random_frame(rng: np.random.Generator) -> bytes:
    """A frame header and, for a WRITE, a body of the header's length: valid about half the time."""
    kind = int(rng.choice([2, 2, 2, 3, 5, 1, 0, 4, 255]))
    count = int(rng.integers(1, 6))
    lengths = rng.integers(1, 1 << 16, count).astype(np.uint64)
    offsets = rng.integers(0, 1 << 40, count).astype(np.uint64)
    flags = np.zeros(count, dtype=np.uint32)
    payload = int(lengths.sum())
    body_len = count * f.RUN_SIZE
    magic, version, slot, gen = f.MAGIC, f.FRAME_VERSION, int(rng.integers(0, 1 << 32)), int(rng.integers(0, 1 << 64, dtype=np.uint64))
    roll = rng.random()
    if kind != 2:
        count_field, payload = (0, 0) if rng.random() < 0.8 else (int(rng.integers(0, 3)), int(rng.integers(0, 3)))
        if kind == 5:  # a DONE frame: its body is read with the header whenever its length is allowed
            body_len = int(rng.choice([0, 24, 25, 77, f.DONE_BODY_MAX, f.DONE_BODY_MAX + 1, MAX_MESSAGE_BYTES]))
        else:
            body_len = int(rng.choice([0, 1, 77, MAX_MESSAGE_BYTES, MAX_MESSAGE_BYTES + 1]))
        header = struct.pack("<2sBBIQIIQ", magic, version, kind, slot, gen, count_field, body_len, payload)
        limit = f.DONE_BODY_MAX if kind == 5 else MAX_ORDERED
        return header + (rng.integers(0, 256, body_len, dtype=np.uint8).tobytes() if body_len <= limit else b"")
    if roll < 0.05:
        magic = b"XK"
    elif roll < 0.1:
        version = int(rng.choice([0, 2, 255]))
    elif roll < 0.15:
        count = int(rng.choice([0, f.MAX_RUNS + 1]))  # refused at the header: no body follows
        return struct.pack("<2sBBIQIIQ", magic, version, kind, slot, gen, count, count * f.RUN_SIZE, payload)
    elif roll < 0.2:
        body_len += int(rng.choice([-24, -1, 1, 24]))
    elif roll < 0.25:
        payload = int(rng.choice([0, f.MAX_PAYLOAD + 1, payload + 1, payload - 1]))
    elif roll < 0.3:
        flags[int(rng.integers(0, count))] = int(rng.integers(1, 1 << 32))
    elif roll < 0.35:
        i = int(rng.integers(0, count))
        payload -= int(lengths[i])
        lengths[i] = 0
    elif roll < 0.4:
        i = int(rng.integers(0, count))
        payload += f.MAX_PAYLOAD + 1 - int(lengths[i])
        lengths[i] = f.MAX_PAYLOAD + 1
    elif roll < 0.45:
        far = [f.MAX_OFFSET, f.MAX_OFFSET - 1, (1 << 64) - 1][int(rng.integers(0, 3))]
        offsets[int(rng.integers(0, count))] = np.uint64(far)
    header = struct.pack("<2sBBIQIIQ", magic, version, kind, slot, gen, count, body_len, payload % (1 << 64))
    runs = np.zeros(count, dtype=f.RUN_DTYPE)
    runs["flags"], runs["offset"], runs["length"] = flags, offsets, lengths
    return header + runs.tobytes()


MAX_ORDERED = 100  # ORDERED bodies up to this size are read with the header


def _python(frame: bytes) -> tuple[tuple, list] | str:
    saved, f._C_RUN_TABLE = f._C_RUN_TABLE, None  # the Python rules alone
    try:
        return _parse(frame)
    finally:
        f._C_RUN_TABLE = saved


def _parse(frame: bytes) -> tuple[tuple, list] | str:
    try:
        header = f.parse_header(frame[: f.HEADER_SIZE])
        if header.kind is f.FrameKind.DONE:
            return (header, _done_fields(f.parse_done(header, frame[f.HEADER_SIZE : f.HEADER_SIZE + header.body_len])))
        if header.kind is f.FrameKind.ORDERED and header.body_len <= MAX_ORDERED:
            return (header, frame[f.HEADER_SIZE : f.HEADER_SIZE + header.body_len])
        if header.kind is not f.FrameKind.WRITE:
            return (header, None)
        runs = f.parse_runs(header, frame[f.HEADER_SIZE : f.HEADER_SIZE + header.body_len])
        return (header, runs.tolist())
    except ProtocolError as exc:
        return str(exc)


def _done_fields(done: m.Done) -> tuple:
    return tuple(getattr(done, name) for name in ("rid", "gen", "bytes", "pages", "checksum", "algo", "aux", "runs"))


def _native(frame: bytes) -> tuple[tuple, list] | str:
    a, b = socket.socketpair()
    try:
        a.sendall(frame)
        try:
            header, body = tcp.recv_frame_head(b, MAX_ORDERED)
        except ProtocolError as exc:
            return str(exc)
        if isinstance(body, m.Done):
            return (header, _done_fields(body))
        return (header, body.tolist() if isinstance(body, np.ndarray) else body)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("seed", range(4))
def test_the_c_frame_head_reads_what_the_python_parsers_read(seed):
    rng = np.random.default_rng(seed)
    outcomes = {"write": 0, "ordered": 0, "other": 0, "refused": 0}
    for _ in range(1000):
        frame = _random_frame(rng)
        expected = _python(frame)
        assert _native(frame) == expected, frame.hex()
        key = ("refused" if isinstance(expected, str) else "write" if isinstance(expected[1], list)
               else "ordered" if expected[1] is not None else "other")
        outcomes[key] += 1
    assert min(outcomes.values()) > 25, outcomes


@pytest.mark.parametrize("seed", range(2))
def test_parse_runs_with_the_c_table_check_is_the_python_rule(seed):
    """parse_runs (the shm ring's frames, verbs write logs) takes a table the C check passes at once;
    on random and broken frames it returns or refuses exactly as the Python rules alone do."""
    assert f._C_RUN_TABLE is not None
    rng = np.random.default_rng(50 + seed)
    writes = 0
    for _ in range(1000):
        frame = _random_frame(rng)
        expected = _python(frame)
        assert _parse(frame) == expected, frame.hex()
        writes += isinstance(expected, tuple) and isinstance(expected[1], list)
    assert writes > 100


def test_the_c_frame_head_reports_a_closed_peer():
    a, b = socket.socketpair()
    try:
        a.sendall(f.write_header(1, 2, 1, 64)[:10])
        a.close()
        with pytest.raises(ConnectionError):
            tcp.recv_frame_head(b)
    finally:
        b.close()
