"""The shm landing thread's frame reader in C (``ring_frame_head``, native/kvxfer_native.c) held to its
Python twin (``ShmReceiver._next_frame`` without it: ``_wait``, ``parse_header``, ``parse_runs``,
``parse_done``, ``ordered_message``).

Random frames, most broken on purpose (the generator of tests/test_frames_native.py: magic, version, kind,
run counts, body and payload lengths, run flags, empty, oversized and far-off runs, DONE bodies), are
written into a real ring at random places (so that headers and bodies wrap at its end) and read by the
receiver's own reader, once through C and once through Python: the same header and body, or the same
error, and the same bytes consumed. Then what only a ring has: bodies larger than the ring streamed in by
a writer thread, a hostile producer position, and each way a wait ends (fenced, the writer closed inside a
frame or at its boundary, the writer's process gone, a frame found while busy polling).
"""

from __future__ import annotations

import mmap
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

from kvxfer.core import native
from kvxfer.core.layout import KVLayout
from kvxfer.core.ledger import PageLedger
from kvxfer.core.writeguard import WriteGuard
from kvxfer.errors import ProtocolError
from kvxfer.transport import shm
from kvxfer.transport.base import ReceiverHooks
from kvxfer.transport.options import ShmOptions
from kvxfer.wire import frames as f
from kvxfer.wire import messages as m

from .conftest import wait_for
from .test_frames_native import MAX_ORDERED, _random_frame

pytestmark = pytest.mark.skipif(shm._native() is None or f.native_reader("ring_frame_head") is None,
                                reason=f"needs kvxfer._native's ring_frame_head ({native.describe()})")

RING = 64 << 10  # the smallest ring a receiver makes: a frame of up to 196 KiB of run table streams through it


class _Reader:
    """A real ShmReceiver (no offer: its reader is driven on a ring of the test's own) and that ring."""

    def __init__(self, directory: str, ring_bytes: int = RING) -> None:
        layout = KVLayout.allocate(num_buffers=1, item_len=64, num_pages=4, page_size=1)
        ledger = PageLedger(4)
        hooks = ReceiverHooks(on_connect=lambda msg: None, on_ordered=lambda conn, msg: None,
                              on_closed=lambda conn, reason: None)
        self.receiver = shm.ShmReceiver(layout, WriteGuard(layout, ledger), hooks=hooks,
                                        options=ShmOptions(directory=directory, ring_bytes=ring_bytes,
                                                           busy_poll_us=0),
                                        max_ordered_body=MAX_ORDERED)
        self.mm = mmap.mmap(-1, shm.HEADER_BYTES + ring_bytes)
        self.ring = shm._Ring(self.mm, ring_bytes, "(test ring)")
        self.inbound = shm._Inbound("pf", 1, self.ring)
        self.c_head = self.receiver._c_head

    def load(self, frame: bytes, at: int, *, closed: bool = True) -> None:
        """The ring holding `frame` at stream position `at`, nothing consumed yet, the writer closed."""
        self.ring.write(at, memoryview(frame))
        for word, value in ((shm.W_CONSUMER, at), (shm.W_PRODUCER, at + len(frame)), (shm.W_READER_WANT, 0),
                            (shm.W_WRITER_WANT, 0), (shm.W_READER_STATE, shm.READER_OPEN),
                            (shm.W_WRITER_STATE, shm.WRITER_CLOSED if closed else shm.WRITER_OPEN)):
            self.ring.store(word, value)
        self.inbound.consumer = at

    def read(self, *, in_c: bool) -> tuple[Any, int]:
        """What the receiver's reader makes of the ring's next frame, and the consumer position after."""
        self.receiver._c_head = self.c_head if in_c else None
        try:
            header, body = self.receiver._next_frame(self.inbound)
        except (ProtocolError, ConnectionError) as exc:
            return f"{type(exc).__name__}: {exc}", -1
        except (shm._Ended, shm._Stopped) as exc:
            return type(exc).__name__, -1
        finally:
            self.receiver._c_head = self.c_head
        consumed = self.inbound.consumer
        assert self.ring.load(shm.W_CONSUMER) == consumed  # published behind what was copied out
        if isinstance(body, np.ndarray):
            body = body.tolist()
        elif isinstance(body, m.Done):
            body = tuple(getattr(body, k) for k in ("rid", "gen", "bytes", "pages", "checksum", "algo", "aux"))
        return (header, body), consumed

    def close(self) -> None:
        self.receiver.close()
        self.ring.close()


@pytest.fixture
def reader(tmp_path):
    made: list[_Reader] = []

    def make(**kwargs: Any) -> _Reader:
        made.append(_Reader(str(tmp_path), **kwargs))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _valid_message_frame(rng: np.random.Generator) -> bytes:
    """A DONE or ORDERED frame a writer sends (random fields), sometimes with one byte of its body flipped."""
    gen = int(rng.integers(0, 1 << 63))
    rid: Any = int(rng.integers(0, 1 << 62)) if rng.random() < 0.5 else "r" * int(rng.integers(1, 40))
    if rng.random() < 0.5:
        msg: Any = m.Done(rid=rid, gen=gen, bytes=int(rng.integers(0, 1 << 40)), pages=int(rng.integers(0, 1 << 20)),
                          checksum=int(rng.integers(0, 1 << 32)), algo=str(rng.choice(["adler32", "crc32"])),
                          aux=bytes(int(rng.integers(0, 50))))
    else:
        msg = m.DrainAck(rid=rid, gen=gen, posted=int(rng.integers(0, 99)), completed=int(rng.integers(0, 99)))
    frame = bytearray(f.ordered_frame(msg, slot=int(rng.integers(0, 1 << 32)), generation=gen))
    if rng.random() < 0.3:
        frame[int(rng.integers(f.HEADER_SIZE, len(frame)))] ^= 0xFF
    return bytes(frame)


@pytest.mark.parametrize("seed", range(3))
def test_the_c_ring_reader_reads_what_the_python_reader_reads(reader, seed):
    r = reader()
    rng = np.random.default_rng(100 + seed)
    outcomes = {"write": 0, "message": 0, "refused": 0}
    for _ in range(600):
        frame = _random_frame(rng) if rng.random() < 0.85 else _valid_message_frame(rng)
        at = int(rng.integers(0, 1 << 40)) if rng.random() < 0.5 else RING * 7 - int(rng.integers(0, 64))
        r.load(frame, at)
        expected = r.read(in_c=False)
        r.load(frame, at)
        assert r.read(in_c=True) == expected, frame.hex()
        outcome, _ = expected
        key = "refused" if isinstance(outcome, str) else "write" if outcome[0].kind is f.FrameKind.WRITE else "message"
        outcomes[key] += 1
    assert min(outcomes.values()) > 20, outcomes


def test_valid_frames_of_each_kind_wrapping_at_the_ring_end(reader):
    r = reader()
    done = m.Done(rid="req-1", gen=9, bytes=4096, pages=1, checksum=123, algo="crc32", aux=b"x")
    drain = m.DrainAck(rid="req-1", gen=9, posted=1, completed=1)
    runs = np.zeros(3, dtype=f.RUN_DTYPE)
    runs["offset"], runs["length"] = [0, 1 << 20, 5], [10, 20, 30]
    connect = f.message_frame(f.FrameKind.CONNECT, b"\x80")
    frames = {"done": f.done_frame(done, slot=2), "ordered": f.ordered_frame(drain, slot=2, generation=9),
              "write": f.write_header(2, 9, 3, 60) + runs.tobytes(), "connect": connect}
    for name, frame in frames.items():
        for at in range(RING - len(frame), RING + 1, 7):  # every split of the frame across the ring's end
            r.load(frame, at)
            got, consumed = r.read(in_c=True)
            r.load(frame, at)
            assert (got, consumed) == r.read(in_c=False), (name, at)
            header, body = got
            assert consumed == at + len(frame) and header.generation == (0 if name == "connect" else 9)
        if name == "done":
            assert body == ("req-1", 9, 4096, 1, 123, "crc32", b"x")
        elif name == "ordered":
            assert body == drain
        elif name == "write":
            assert body == runs.tolist()
        else:
            assert body == b"\x80"  # a CONNECT's body is read after the head, by the Python reader


class _StreamingWriter:
    """A writer thread that puts `data` into the ring as the reader frees room, publishing as it goes."""

    def __init__(self, r: _Reader, data: bytes, at: int) -> None:
        self.r, self.data, self.at = r, data, at
        r.load(b"", at, closed=False)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        ring, done = self.r.ring, 0
        while done < len(self.data):
            room = ring.size - (self.at + done - ring.load(shm.W_CONSUMER))
            if room <= 0:
                time.sleep(0.0002)
                continue
            piece = min(room, len(self.data) - done, 10_000)
            ring.write(self.at + done, memoryview(self.data)[done : done + piece])
            done += piece
            ring.publish(shm.W_PRODUCER, self.at + done, shm.W_READER_WANT)


def test_a_run_table_and_an_ordered_body_larger_than_the_ring_stream_through_it(reader):
    """8,192 runs (a 196 KiB run table) and a 150 KiB ORDERED body (a DONE with a large aux) through a 64 KiB ring: the reader copies
    them out in pieces, publishing its position behind each so that the writer can go on."""
    r = reader()
    r.receiver.max_ordered_body = 200 << 10
    runs = np.zeros(f.MAX_RUNS, dtype=f.RUN_DTYPE)
    runs["offset"] = np.arange(f.MAX_RUNS) * 4096
    runs["length"] = 4096
    write = f.write_header(1, 5, f.MAX_RUNS, f.MAX_RUNS * 4096) + runs.tobytes()
    big = m.Done(rid="r", gen=5, bytes=1, pages=1, checksum=1, algo="crc32", aux=bytes(150 << 10))
    ordered = f.ordered_frame(big, slot=1, generation=5)  # aux beyond a DONE frame's: an ORDERED frame
    assert len(write) > 3 * RING and len(ordered) > 2 * RING
    for frame, at in ((write, RING - 5), (ordered, 12345)):
        writer = _StreamingWriter(r, frame, at)
        (header, body), consumed = r.read(in_c=True)
        writer.thread.join(5)
        assert consumed == at + len(frame)
        if header.kind is f.FrameKind.WRITE:
            assert body == runs.tolist()
        else:
            assert header.kind is f.FrameKind.ORDERED and body == ("r", 5, 1, 1, 1, "crc32", big.aux)


def test_a_producer_position_out_of_reach_is_a_protocol_error(reader):
    r = reader()
    for producer in (1000 + RING + 1, 999, 1 << 63):
        r.load(b"", 1000, closed=False)
        r.ring.store(shm.W_PRODUCER, producer)
        for in_c in (True, False):
            outcome, _ = r.read(in_c=in_c)
            assert outcome.startswith("ProtocolError") and "is impossible" in outcome, (producer, in_c, outcome)


def test_each_way_a_wait_for_the_next_frame_ends(reader):
    r = reader()
    header = f.write_header(1, 2, 1, 64)
    for in_c in (True, False):
        r.load(b"", 64)  # the writer closed at a frame boundary
        assert r.read(in_c=in_c)[0] == "_Ended"
        r.load(header[:10], 64)  # ... or inside a frame
        assert r.read(in_c=in_c)[0] == "ConnectionError: the writer closed inside a frame"
        r.load(header, 64)  # inside a WRITE frame's run table
        assert r.read(in_c=in_c)[0] == "ConnectionError: the writer closed inside a frame"
    # fenced while it sleeps: the fence's store and wake end the wait
    r.load(b"", 64, closed=False)
    out: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out.setdefault("got", r.read(in_c=True)))
    thread.start()
    wait_for(lambda: r.ring.load(shm.W_READER_WANT) != 0, timeout=5, what="the reader asleep")
    r.ring.set_state(shm.W_READER_STATE, shm.READER_FENCED)
    thread.join(5)
    assert out["got"][0] == "_Stopped"
    # a fenced ring is not read even while frames keep coming
    r.load(header + bytes(24), 64, closed=False)
    r.ring.store(shm.W_READER_STATE, shm.READER_FENCED)
    assert r.read(in_c=True)[0] == "_Stopped"


def test_a_dead_writer_process_ends_the_wait(reader):
    r = reader()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    r.load(b"", 64, closed=False)
    r.inbound.writer_pid = child.pid
    started = time.monotonic()
    outcome, _ = r.read(in_c=True)
    assert outcome == f"ConnectionError: the writer's process {child.pid} exited"
    assert time.monotonic() - started < 5


@pytest.mark.skipif(not getattr(native.lib, "BUSY_POLLERS", 0), reason="needs kvxfer._native's busy polling")
def test_a_frame_published_while_the_reader_polls_is_found_by_the_poll(reader):
    r = reader()
    r.receiver._busy_poll = (int(5e9), int(r.receiver._poll_counts.ctypes.data))
    frame = f.done_frame(m.Done(rid=7, gen=3, bytes=1, pages=1, checksum=1, algo="adler32"), slot=1)
    r.load(b"", 128, closed=False)
    out: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out.setdefault("got", r.read(in_c=True)))
    thread.start()
    time.sleep(0.05)  # polling by now (for five seconds)
    assert thread.is_alive() and r.receiver._poll_counts.tolist() == [0, 0, 0]
    r.ring.write(128, memoryview(frame))
    r.ring.publish(shm.W_PRODUCER, 128 + len(frame), shm.W_READER_WANT)
    thread.join(5)
    (header, body), consumed = out["got"]
    assert header.kind is f.FrameKind.DONE and body[0] == 7 and consumed == 128 + len(frame)
    assert r.receiver._poll_counts.tolist() == [1, 0, 0]
    r.load(frame, 256)  # a frame already there is read without polling
    assert r.read(in_c=True)[0][0].kind is f.FrameKind.DONE
    assert r.receiver._poll_counts.tolist() == [1, 0, 0]


@pytest.mark.parametrize("algo", [0, 1, -1])  # adler32, crc32, no sums
def test_ring_run_table_lands_what_ring_copy_lands(algo):
    """The shm reader's copy straight from a WRITE frame's run table (ring_run_table) against the address
    arrays built in numpy (ring_copy): random tables over three buffers of unequal items, 128 KiB items
    (the one-pass Adler-32 copy) among them, streamed by a writer thread through a 48 KiB ring; the same
    pages, the same item checksums (zlib's), the same consumer position; and a run outside its buffer or
    of part of an item refused naming it before anything is consumed."""
    import zlib

    if algo >= 0 and not native.checksums_in_c:
        pytest.skip(f"needs C checksums ({native.describe()})")
    lib = native.lib
    pages, size = 12, 48 << 10
    item_lens = np.array([4096, 1024, 128 << 10], dtype=np.int64)
    rng = np.random.default_rng(7 + algo)
    src = [rng.integers(0, 256, pages * int(n), dtype=np.uint8) for n in item_lens]
    bases = np.array([int(b.ctypes.data) for b in src], dtype=np.uint64)
    for trial in range(6):
        count = int(rng.integers(1, 20))
        runs = np.zeros(count, dtype=f.RUN_DTYPE)
        runs["buffer"] = rng.integers(0, 3, count)
        first = rng.integers(0, pages, count)
        span = np.minimum(rng.integers(1, 4, count), pages - first)
        runs["offset"] = first * item_lens[runs["buffer"]]
        runs["length"] = span * item_lens[runs["buffer"]]
        stream = b"".join(src[b][o : o + n].tobytes() for b, o, n in zip(runs["buffer"], runs["offset"], runs["length"]))
        landed = []
        for in_table in (True, False):
            dst = [np.zeros_like(b) for b in src]
            dst_bases = np.array([int(b.ctypes.data) for b in dst], dtype=np.uint64)
            ring = np.zeros(size, dtype=np.uint8)
            words = np.zeros(8, dtype=np.uint64)  # 0: producer, 1: consumer, 2: stop, 3: closed
            addr = [int(words.ctypes.data) + 8 * i for i in range(4)]
            start = int(rng.integers(0, 1 << 30))
            words[0] = words[1] = start
            blob = np.frombuffer(stream, dtype=np.uint8)
            writer = threading.Thread(target=lib.ring_copy, args=(
                np.array([blob.ctypes.data], np.uint64).tobytes(), np.array([blob.size], np.uint64).tobytes(),
                np.array([blob.size], np.uint64).tobytes(), -1, 0, 4096, ring.ctypes.data, size, start, 0, addr[1],
                addr[0], addr[2], 1, addr[3], 1, 0))
            writer.start()
            tail = (ring.ctypes.data, size, start, addr[0], addr[1], addr[2], 1, addr[3], 1, 0, 0, 0)
            if in_table:
                rc, raw = lib.ring_run_table(runs, dst_bases.tobytes(), item_lens.tobytes(), pages, algo, 1, 4096, *tail)
            else:
                lengths = runs["length"].astype(np.uint64)
                items = item_lens[runs["buffer"]].astype(np.uint64) if algo >= 0 else lengths
                rc, raw = lib.ring_copy((dst_bases[runs["buffer"]] + runs["offset"]).tobytes(), lengths.tobytes(),
                                        items.tobytes(), algo, 1, 4096, ring.ctypes.data, size, start, 1, addr[0],
                                        addr[1], addr[2], 1, addr[3], 1, 0)
            writer.join(10)
            assert rc == 0 and words[1] == start + len(stream)
            landed.append(([d.tobytes() for d in dst], raw))
        assert landed[0] == landed[1], trial
        dst_bytes, raw = landed[0]
        for b, o, n in zip(runs["buffer"], runs["offset"], runs["length"]):
            assert dst_bytes[b][o : o + n] == src[b][o : o + n].tobytes()
        if algo < 0:
            assert raw is None
        else:
            fn = zlib.adler32 if algo == 0 else zlib.crc32
            expected = [fn(src[b][p : p + int(item_lens[b])].tobytes(), 1)
                        for b, o, n in zip(runs["buffer"], runs["offset"], runs["length"])
                        for p in range(int(o), int(o + n), int(item_lens[b]))]
            assert np.frombuffer(raw, np.uint32).tolist() == expected
    ring = np.zeros(size, dtype=np.uint8)
    words = np.zeros(8, dtype=np.uint64)
    addr = [int(words.ctypes.data) + 8 * i for i in range(4)]
    tail = (ring.ctypes.data, size, 0, addr[0], addr[1], addr[2], 1, addr[3], 1, 0, 0, 0)
    outside = np.zeros(1, dtype=f.RUN_DTYPE)
    outside["buffer"], outside["offset"], outside["length"] = 1, (pages - 1) * 1024, 2048
    with pytest.raises(ValueError, match="run 0 .* is outside its buffer"):
        lib.ring_run_table(outside, bases.tobytes(), item_lens.tobytes(), pages, algo, 1, 4096, *tail)
    outside["buffer"] = 3
    with pytest.raises(ValueError, match="not whole items of a buffer of the layout"):
        lib.ring_run_table(outside, bases.tobytes(), item_lens.tobytes(), pages, algo, 1, 4096, *tail)
    if algo >= 0:
        part = np.zeros(1, dtype=f.RUN_DTYPE)
        part["buffer"], part["length"] = 0, 100
        with pytest.raises(ValueError, match="not whole items"):
            lib.ring_run_table(part, bases.tobytes(), item_lens.tobytes(), pages, algo, 1, 4096, *tail)
    assert words[1] == 0  # nothing consumed
