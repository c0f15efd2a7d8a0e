"""The shm transport's two halves driven directly, in one process and across two: writes land through
the write guard with their content and checksums, refused writes never land, frames wrap around the
ring, a fence revokes the writer, ordered messages follow earlier writes, bad frames end the
connection once, foreign OFFERs are refused and no ring file outlives the receiver. The whole file
runs again under ``KVXFER_PURE_PYTHON=1`` (the fallback data path)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import msgpack
import numpy as np
import pytest

from kvxfer.core import native
from kvxfer.core.checksum import ChecksumAlgo, checksum_pages
from kvxfer.core.layout import KVLayout
from kvxfer.core.ledger import PageLedger
from kvxfer.core.runs import build_batch
from kvxfer.core.writeguard import Window, WriteGuard
from kvxfer.errors import ConfigError, ProtocolError, TransportError
from kvxfer.transport import registry, shm
from kvxfer.transport.base import LinkRequest, ReceiverHooks
from kvxfer.transport.options import ShmOptions
from kvxfer.wire import frames as f
from kvxfer.wire import messages as m

from .conftest import wait_for

SESSION = b"s" * 16
PROOF = b"p" * 32  # the receiver here accepts any CONNECT; the engine checks proofs (test_hostile_peers.py)
ITEM = 4096


class Rig:
    """A decode pool with its ledger, guard and ShmReceiver, and a prefill pool with its ShmTransport."""

    def __init__(self, directory: str, *, ring_bytes: int = 256 << 10, item: int = ITEM, pages: int = 64,
                 buffers: int = 2, checksum: str = "adler32") -> None:
        self.options = ShmOptions(ring_bytes=ring_bytes, directory=directory)
        self.src = KVLayout.allocate(num_buffers=buffers, item_len=item, num_pages=pages, page_size=16)
        self.dst = KVLayout.allocate(num_buffers=buffers, item_len=item, num_pages=pages, page_size=16)
        rng = np.random.default_rng(1)
        for view in self.src.views():
            view[:] = rng.integers(0, 256, view.shape, dtype=np.uint8)
        for view in self.dst.views():
            view[:] = 0x5A
        self.ledger = PageLedger(pages)
        self.guard = WriteGuard(self.dst, self.ledger)
        self.events: list[tuple[Any, ...]] = []
        self.closed: list[tuple[Any, str]] = []
        self.ordered_seen_uncovered: list[int] = []
        self.refuse = False
        hooks = ReceiverHooks(on_connect=self._on_connect, on_ordered=self._on_ordered, on_closed=self._on_closed)
        self.receiver = shm.ShmReceiver(self.dst, self.guard, hooks=hooks, checksum=checksum, options=self.options)
        self.transport = shm.ShmTransport(self.src, checksum=checksum, options=self.options)
        self.link_closed: list[str] = []
        self.gen = 0

    def _on_connect(self, msg: m.Connect) -> Any:
        self.events.append(("connect", msg.engine, msg.epoch))
        return None if self.refuse else (msg.engine, msg.epoch)

    def _on_ordered(self, conn: Any, msg: Any) -> None:
        window = self.guard.window(msg.gen)
        uncovered = self.guard.uncovered(window.pages).size if window is not None else -1
        self.ordered_seen_uncovered.append(uncovered)
        self.events.append(("ordered", conn, msg))

    def _on_closed(self, conn: Any, reason: str) -> None:
        self.closed.append((conn, reason))

    def connect(self, epoch: int = 1) -> shm.ShmLink:
        blob = self.receiver.offer("pf", SESSION, epoch)
        link = self.transport.connect(LinkRequest(engine="pf", peer="dc", proof=PROOF, epoch=epoch, blob=blob,
                                                  on_closed=lambda _link, reason: self.link_closed.append(reason),
                                                  send_control=lambda msg: None))
        wait_for(lambda: ("pf", epoch) in self.receiver.connections(), what="CONNECT")
        return link

    def reserve(self, count: int, *, epoch: int = 1, shuffle: bool = True) -> tuple[Window, np.ndarray]:
        self.gen += 1
        pages = self.ledger.allocate(count, self.gen)
        if shuffle:
            pages = np.random.default_rng(self.gen).permutation(pages)
        window = Window(rid=f"r{self.gen}", gen=self.gen, slot=self.gen % 7, conn=("pf", epoch), pages=pages)
        self.guard.open(window)
        return window, pages

    def post(self, link: shm.ShmLink, window: Window, src_pages: np.ndarray, dst_pages: np.ndarray) -> list:
        batch = build_batch(self.src, src_pages, dst_pages, slot=window.slot, gen=window.gen)
        done: list = []
        link.post_writes(batch, lambda b, n, e: done.append((n, e)))
        return done

    def same(self, src_pages: np.ndarray, dst_pages: np.ndarray) -> bool:
        return all(np.array_equal(d[dst_pages], s[src_pages]) for s, d in zip(self.src.views(), self.dst.views()))

    def untouched(self, dst_pages: np.ndarray) -> bool:
        return all((d[dst_pages] == 0x5A).all() for d in self.dst.views())

    def close(self) -> None:
        self.receiver.close()
        self.transport.close()  # its sending threads end with it


@pytest.fixture
def rig(tmp_path):
    made: list[Rig] = []

    def factory(**kwargs: Any) -> Rig:
        made.append(Rig(str(tmp_path), **kwargs))
        return made[-1]

    yield factory
    for r in made:
        r.close()
    assert os.listdir(tmp_path) == [], "a ring file outlived its receiver"


def test_registered_with_declared_capabilities():
    factory = registry.get("shm")
    assert factory.name == "shm" and factory.options is ShmOptions
    caps = factory.capabilities
    assert caps.same_host and caps.raw_frames and not caps.write_log and not caps.ordered_via_control
    assert factory.available()[0], factory.available()[1]


def test_data_path_choice_matches_the_environment():
    assert native.available() == (os.environ.get("KVXFER_PURE_PYTHON") != "1" and native.lib is not None)


def test_allowed_writes_land_exactly_with_checksums_and_done_follows(rig):
    r = rig()
    link = r.connect()
    window, dst = r.reserve(40)
    src = np.arange(10, 50)
    done = r.post(link, window, src, dst)
    link.post_ordered(m.Done(rid=window.rid, gen=window.gen, bytes=40 * 2 * ITEM, pages=40, checksum=0,
                             algo="adler32"), slot=window.slot, gen=window.gen)
    wait_for(lambda: any(e[0] == "ordered" for e in r.events), what="DONE")
    assert r.ordered_seen_uncovered == [0]  # every write before DONE had landed when DONE was handed over
    assert r.same(src, dst)
    assert sum(n for n, _ in done) == len(build_batch(r.src, src, dst, slot=0, gen=1)) and all(e == 0 for _, e in done)
    assert window.bytes_landed == 40 * 2 * ITEM and r.guard.uncovered(dst).size == 0
    expected = checksum_pages(r.src, src, "adler32")
    assert checksum_pages(r.dst, dst, "adler32") == expected
    if native.checksums_in_c:  # item checksums taken as the bytes landed, on both sides
        assert r.guard.landed_checksum(dst, ChecksumAlgo.ADLER32) == expected
    assert link.bytes_sent == 40 * 2 * ITEM and link.alive
    assert r.receiver.stats()["frames"] >= 2 and r.receiver.stats()["protocol_errors"] == 0


def test_write_outside_the_window_is_refused_and_lands_nowhere(rig):
    r = rig()
    link = r.connect()
    window, dst = r.reserve(8)
    outside = np.setdiff1d(np.arange(r.dst.num_pages), dst)[:8]  # free pages: no window covers them
    r.post(link, window, np.arange(8), outside)
    stale = Window(rid="gone", gen=99, slot=1, conn=("pf", 1), pages=dst)  # a generation never opened
    r.post(link, stale, np.arange(8, 16), dst)
    r.post(link, window, np.arange(16, 24), dst)  # the connection goes on: this one lands
    wait_for(lambda: r.guard.uncovered(dst).size == 0, what="the allowed write")
    assert r.untouched(outside)
    assert r.same(np.arange(16, 24), dst)
    refused = r.guard.counters()["refused_by_reason"]
    assert refused.get("not_reserved") == 1 and refused.get("unknown_tag") == 1  # one frame each
    assert link.alive and not r.closed


def test_frames_larger_than_the_ring_stream_around_it(rig):
    r = rig(ring_bytes=shm.MIN_RING_BYTES, item=8192, pages=128, buffers=1)
    link = r.connect()
    moved = []
    for count in (6, 5, 12, 7, 20, 3, 9):  # frames from 24 KiB to 160 KiB through a 64 KiB ring
        window, dst = r.reserve(count)
        src = np.random.default_rng(window.gen).choice(128, count, replace=False)
        r.post(link, window, src, dst)
        moved.append((src, dst))
    for _, dst in moved:
        wait_for(lambda dst=dst: r.guard.uncovered(dst).size == 0, what="a frame that wrapped")
    for src, dst in moved:
        assert r.same(src, dst)
    assert link._producer > 4 * shm.MIN_RING_BYTES  # went around the ring several times
    assert r.receiver.stats()["protocol_errors"] == 0
    if native.checksums_in_c:
        src = np.concatenate([s for s, _ in moved])
        dst = np.concatenate([d for _, d in moved])
        assert r.guard.landed_checksum(dst, ChecksumAlgo.ADLER32) == checksum_pages(r.src, src, "adler32")


def test_fence_revokes_the_writer(rig):
    r = rig()
    link = r.connect()
    window, dst = r.reserve(8)
    r.post(link, window, np.arange(8), dst)
    wait_for(lambda: r.guard.uncovered(dst).size == 0, what="the first write")
    assert r.receiver.fence(("pf", 1)) is True
    assert r.receiver.fence(("pf", 1)) is False and r.receiver.connections() == []
    for view in r.dst.views():
        view[dst] = 0x5A
    done: list = []
    try:  # the link may not have noticed yet: the write goes into a ring nobody reads
        done = r.post(link, window, np.arange(20, 28), dst)
    except TransportError:
        pass
    wait_for(lambda: not link.alive, timeout=2.0, what="the writer noticing the fence")
    assert r.link_closed and "fenced" in r.link_closed[0]
    time.sleep(0.1)
    assert r.untouched(dst)
    assert all(n == 0 for n, _ in done)
    assert r.closed == []  # the fencer settles the connection; on_closed is not called for it
    with pytest.raises(TransportError):
        r.post(link, window, np.arange(8), dst)


def test_link_notices_a_fence_while_waiting_for_room(rig):
    r = rig(ring_bytes=shm.MIN_RING_BYTES, item=8192, pages=64, buffers=1)
    link = r.connect()
    window, dst = r.reserve(16, shuffle=False)
    hold = threading.Event()
    original = r.guard.check

    def slow_check(*args: Any) -> Any:  # the reader stalls on the first frame: the ring fills up
        hold.wait(5)
        return original(*args)

    r.guard.check = slow_check  # type: ignore[method-assign]
    done = r.post(link, window, np.arange(16), dst)
    time.sleep(0.2)
    fencer = threading.Thread(target=r.receiver.fence, args=(("pf", 1),))
    fencer.start()
    time.sleep(0.05)
    hold.set()
    fencer.join(5)
    wait_for(lambda: not link.alive, timeout=2.0, what="the writer noticing the fence")
    assert sum(e for _, e in done) > 0  # the rest of the batch was reported failed


def test_malformed_frame_ends_the_connection_once(rig):
    r = rig()
    link = r.connect()
    link.post_raw([b"XX" + bytes(30)])  # bad magic: the stream is out of sync
    wait_for(lambda: len(r.closed) == 1, what="on_closed")
    assert r.closed[0][0] == ("pf", 1) and "protocol error" in r.closed[0][1]
    assert r.receiver.stats()["protocol_errors"] == 1 and r.receiver.connections() == []
    wait_for(lambda: not link.alive, timeout=2.0, what="the writer noticing")
    assert r.receiver.fence(("pf", 1)) is False
    time.sleep(0.1)
    assert len(r.closed) == 1


def test_wrong_first_frame_ends_the_offered_connection_once(rig):
    r = rig()
    blob = r.receiver.offer("pf", SESSION, 3)
    offer = msgpack.unpackb(blob)
    ring = shm._open_ring(offer["path"], offer["size"])
    try:
        ack = m.DrainAck(rid="x", gen=1, posted=0, completed=0)
        frame = f.message_frame(f.FrameKind.ORDERED, m.encode(ack), generation=1)
        ring.write(0, memoryview(frame))
        ring.store(shm.W_PRODUCER, len(frame))
        wait_for(lambda: len(r.closed) == 1, what="on_closed")
        assert ring.load(shm.W_READER_STATE) == shm.READER_FENCED
    finally:
        ring.close()
    assert r.closed[0][0] == ("pf", 3) and "first frame must be CONNECT" in r.closed[0][1]
    assert not any(e[0] == "connect" for e in r.events)


def test_refused_connect_and_wrong_epoch(rig):
    r = rig()
    r.refuse = True
    blob = r.receiver.offer("pf", SESSION, 1)
    link = r.transport.connect(LinkRequest(engine="pf", peer="dc", proof=PROOF, epoch=1, blob=blob,
                                           on_closed=lambda _l, reason: r.link_closed.append(reason),
                                           send_control=lambda msg: None))
    wait_for(lambda: not link.alive, timeout=2.0, what="the refused writer noticing")
    assert r.receiver.connections() == [] and r.closed == []
    r.refuse = False
    blob = r.receiver.offer("pf", SESSION, 2)
    link = r.transport.connect(LinkRequest(engine="pf", peer="dc", proof=PROOF, epoch=5, blob=blob,
                                           on_closed=lambda _l, reason: None, send_control=lambda msg: None))
    wait_for(lambda: len(r.closed) == 1, what="on_closed")
    assert "epoch 5" in r.closed[0][1]
    wait_for(lambda: not link.alive, timeout=2.0, what="the writer noticing")


def test_foreign_or_bogus_offers_are_refused(rig, tmp_path):
    r = rig()
    blob = msgpack.unpackb(r.receiver.offer("pf", SESSION, 1))
    request = dict(engine="pf", peer="dc", proof=PROOF, epoch=1, on_closed=lambda *a: None,
                   send_control=lambda msg: None)
    with pytest.raises(TransportError, match="another host or boot"):
        r.transport.connect(LinkRequest(blob=msgpack.packb({**blob, "boot_id": "not-this-boot"}), **request))
    with pytest.raises(ProtocolError):
        r.transport.connect(LinkRequest(blob=b"\xc1garbage", **request))
    with pytest.raises(ProtocolError, match="not a kvxfer ring"):
        r.transport.connect(LinkRequest(blob=msgpack.packb({**blob, "path": "/etc/passwd"}), **request))
    impostor = tmp_path / ("kvxfer-ring-1-" + "0" * 32)
    impostor.write_bytes(bytes(shm.HEADER_BYTES + blob["size"]))
    impostor.chmod(0o600)
    try:
        with pytest.raises(TransportError, match="does not hold"):
            r.transport.connect(LinkRequest(blob=msgpack.packb({**blob, "path": str(impostor)}), **request))
        assert impostor.read_bytes() == bytes(shm.HEADER_BYTES + blob["size"])  # nothing written into it
    finally:
        impostor.unlink()
    link = r.transport.connect(LinkRequest(blob=msgpack.packb(blob), **request))  # the real one still works
    with pytest.raises(TransportError, match="already has a writer|cannot open"):  # the name goes at CONNECT
        r.transport.connect(LinkRequest(blob=msgpack.packb(blob), **request))
    link.close()


def test_non_cpu_layout_is_a_config_error(rig):
    r = rig()

    class _Gpu:
        device = "cuda"

    with pytest.raises(ConfigError, match="host pages only"):
        shm.ShmTransport(_Gpu())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="host pages only"):
        shm.ShmReceiver(_Gpu(), r.guard, hooks=r.receiver.hooks)  # type: ignore[arg-type]


def test_close_removes_every_ring_and_reports_each_connection_once(rig, tmp_path):
    r = rig()
    link = r.connect(epoch=1)
    r.receiver.offer("pf", SESSION, 2)
    r.receiver.offer("other", SESSION, 1)
    r.receiver.offer("gone", SESSION, 4)
    assert len(os.listdir(tmp_path)) == 3  # the connected ring's name went when CONNECT arrived
    r.receiver.withdraw("gone", 4)
    assert len(os.listdir(tmp_path)) == 2
    r.receiver.close()
    r.receiver.close()
    assert os.listdir(tmp_path) == []
    assert r.closed == [(("pf", 1), "receiver closed")]
    wait_for(lambda: not link.alive, timeout=2.0, what="the writer noticing")
    link.close()
    with pytest.raises(TransportError):
        r.receiver.offer("pf", SESSION, 9)


def test_writer_close_flushes_then_ends_the_connection(rig):
    r = rig()
    link = r.connect()
    window, dst = r.reserve(30)
    r.post(link, window, np.arange(30), dst)
    link.close(flush=True)
    wait_for(lambda: len(r.closed) == 1, what="on_closed")
    assert r.closed[0] == (("pf", 1), "writer closed the connection")
    assert r.same(np.arange(30), dst)
    assert r.link_closed == ["closed"] and not link.alive


def test_stale_rings_of_dead_processes_are_reaped(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    stale = tmp_path / f"kvxfer-ring-{pid}-{'a' * 32}"
    stale.write_bytes(b"x")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    mine = tmp_path / f"kvxfer-ring-{os.getpid()}-{'b' * 32}"
    mine.write_bytes(b"x")
    os.utime(mine, (time.time() - 3600, time.time() - 3600))
    assert shm.reap_stale_rings(str(tmp_path)) == 1
    assert os.listdir(tmp_path) == [mine.name]
    mine.unlink()


# the native loops --------------------------------------------------------------------------------


@pytest.mark.skipif(not shm._native() or not native.checksums_in_c, reason="native data path with C checksums")
def test_native_copy_runs_and_summed_copy_match_zlib():
    import zlib

    rng = np.random.default_rng(9)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    src_off = np.array([0, 40960, 700416, 12288], dtype=np.uint64)
    dst_off = np.array([600000, 0, 320000, 700000], dtype=np.uint64)
    lens = np.array([8192, 300 * 1024, 4096, 12288], dtype=np.uint64)  # one run longer than the chunk
    native.lib.copy_runs((dst.ctypes.data + dst_off).tobytes(), (src.ctypes.data + src_off).tobytes(), lens.tobytes())
    for s_, d_, n_ in zip(src_off.tolist(), dst_off.tolist(), lens.tolist()):
        assert np.array_equal(dst[d_ : d_ + n_], src[s_ : s_ + n_])
    dst[:] = 0
    raw = native.lib.copy_runs_summed((dst.ctypes.data + dst_off).tobytes(), (src.ctypes.data + src_off).tobytes(),
                                      lens.tobytes(), np.full(4, 4096, np.uint64).tobytes(), 1, 0, 64 << 10)
    expected = [zlib.crc32(src[s_ + k : s_ + k + 4096].tobytes())
                for s_, n_ in zip(src_off.tolist(), lens.tolist()) for k in range(0, n_, 4096)]
    assert np.frombuffer(raw, np.uint32).tolist() == expected
    for s_, d_, n_ in zip(src_off.tolist(), dst_off.tolist(), lens.tolist()):
        assert np.array_equal(dst[d_ : d_ + n_], src[s_ : s_ + n_])
    with pytest.raises(ValueError):
        native.lib.copy_runs(b"\0" * 8, b"", b"\0" * 8)
    words = np.zeros(4, dtype=np.uint64)
    native.lib.ring_store(words.ctypes.data + 8, 2**64 - 1)
    assert native.lib.ring_load(words.ctypes.data + 8) == 2**64 - 1 and words[1] == 2**64 - 1
    with pytest.raises(ValueError, match="aligned"):
        native.lib.ring_load(words.ctypes.data + 4)


@pytest.mark.skipif(not shm._native() or not native.checksums_in_c, reason="native data path with C checksums")
def test_ring_copy_streams_scattered_pages_through_a_small_ring():
    """Two threads, pages -> 12 KiB ring -> pages, 40 scattered 8 KiB runs: exact bytes, the same item
    checksums on both sides, both positions at the end; then each early return."""
    import zlib

    lib = native.lib
    item, size = 4096, 12288
    rng = np.random.default_rng(11)
    src = rng.integers(0, 256, (64, 2 * item), dtype=np.uint8)
    dst = np.zeros_like(src)
    ring = np.zeros(size, dtype=np.uint8)
    words = np.zeros(8, dtype=np.uint64)  # 0: producer, 1: consumer, 2: stop, 3: closed
    addr = [int(words.ctypes.data) + 8 * i for i in range(4)]
    src_pages, dst_pages = rng.permutation(64)[:40], rng.permutation(64)[:40]
    lengths = np.full(40, 2 * item, np.uint64)
    items = np.full(40, item, np.uint64)
    out: dict[str, Any] = {}
    start = 5000  # positions need not start at a multiple of the ring size

    words[0] = words[1] = start

    def writer() -> None:
        out["w"] = lib.ring_copy((src.ctypes.data + src_pages.astype(np.uint64) * 2 * item).tobytes(), lengths.tobytes(),
                                 items.tobytes(), 0, 1, 4096, ring.ctypes.data, size, start, 0, addr[1], addr[0],
                                 addr[2], 1, addr[3], 1, 0)

    thread = threading.Thread(target=writer)
    thread.start()
    got = lib.ring_copy((dst.ctypes.data + dst_pages.astype(np.uint64) * 2 * item).tobytes(), lengths.tobytes(),
                        items.tobytes(), 0, 1, 4096, ring.ctypes.data, size, start, 1, addr[0], addr[1],
                        addr[2], 1, addr[3], 1, 0)
    thread.join(10)
    assert got[0] == 0 and out["w"][0] == 0
    assert np.array_equal(dst[dst_pages], src[src_pages])
    expected = [zlib.adler32(src[p, k * item : (k + 1) * item].tobytes()) for p in src_pages for k in range(2)]
    assert np.frombuffer(got[1], np.uint32).tolist() == expected == np.frombuffer(out["w"][1], np.uint32).tolist()
    assert words[0] == words[1] == start + 40 * 2 * item
    # early returns: nothing published to wait for
    pos = int(words[0])
    one = (dst.ctypes.data + np.zeros(1, np.uint64)).tobytes()
    args = (np.full(1, item, np.uint64).tobytes(), np.full(1, item, np.uint64).tobytes(), -1, 0, 4096,
            ring.ctypes.data, size, pos, 1, addr[0], addr[1])
    words[2] = 1
    assert lib.ring_copy(one, *args, addr[2], 1, addr[3], 1, 0) == (1, None)  # fenced
    words[2], words[3] = 0, 1
    assert lib.ring_copy(one, *args, addr[2], 1, addr[3], 1, 0) == (2, None)  # the writer closed
    words[3] = 0
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert lib.ring_copy(one, *args, addr[2], 1, addr[3], 1, int(dead.stdout)) == (3, None)  # its process is gone
    assert words[1] == pos  # nothing was consumed



def _words(n: int = 8) -> tuple[np.ndarray, list[int]]:
    words = np.zeros(n, dtype=np.uint64)
    return words, [int(words.ctypes.data) + 8 * i for i in range(n)]


@pytest.mark.skipif(not shm._native(), reason="native data path")
def test_a_publish_wakes_a_sleeping_waiter_only_when_it_reaches_its_want():
    """ring_wait sleeps in a futex announced in its want word; a publish short of it leaves it asleep,
    one that reaches it clears the word and wakes it at once (not at the 10 ms sleep bound's mercy:
    the waiter's own timeout is 5 s)."""
    lib = native.lib
    words, addr = _words()  # 0: position, 1: want, 2: stop, 3: closed
    out: dict[str, Any] = {}

    def waiter() -> None:
        started = time.monotonic()
        out["rc"] = lib.ring_wait(addr[0], 100, addr[1], addr[2], 1, addr[3], 1, 0, 5.0)
        out["s"] = time.monotonic() - started

    thread = threading.Thread(target=waiter)
    thread.start()
    wait_for(lambda: words[1] != 0, timeout=5)  # it announced itself: it sleeps
    assert words[1] == 100
    lib.ring_publish(addr[0], 50, addr[1])  # not enough: no wake, the want word stays
    time.sleep(0.05)
    assert thread.is_alive() and words[1] == 100
    lib.ring_publish(addr[0], 100, addr[1])
    thread.join(5)
    assert out["rc"] == 0 and words[1] == 0 and out["s"] < 1.0


@pytest.mark.skipif(not shm._native(), reason="native data path")
def test_a_state_change_wakes_a_sleeper_and_each_early_return_says_why():
    lib = native.lib
    words, addr = _words()
    out: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out.setdefault(
        "rc", lib.ring_wait(addr[0], 1, addr[1], addr[2], 2, addr[3], 2, 0, 30.0)))
    thread.start()
    wait_for(lambda: words[1] != 0, timeout=5)
    started = time.monotonic()
    words[2] = 2
    lib.ring_wake(addr[0])  # what a fence does after storing FENCED
    thread.join(5)
    assert out["rc"] == 1 and time.monotonic() - started < 1.0 and words[1] == 0
    words[2], words[3] = 0, 2
    assert lib.ring_wait(addr[0], 1, addr[1], addr[2], 2, addr[3], 2, 0, 1.0) == 2  # closed, unmet
    words[0] = 1
    assert lib.ring_wait(addr[0], 1, addr[1], addr[2], 2, addr[3], 2, 0, 1.0) == 0  # closed but met
    words[0], words[3] = 0, 0
    started = time.monotonic()
    assert lib.ring_wait(addr[0], 1, addr[1], addr[2], 2, addr[3], 2, 0, 0.05) == 4  # timed out
    assert 0.04 < time.monotonic() - started < 1.0
    with pytest.raises(ValueError, match="aligned"):
        lib.ring_wait(addr[0] + 4, 1, addr[1], addr[2], 2, addr[3], 2, 0, 0.05)


@pytest.mark.skipif(not shm._native() or not native.checksums_in_c, reason="native data path with C checksums")
def test_ring_copy_streams_checksummed_items_larger_than_the_ring():
    """128 KiB Adler-32 items (the one-pass AVX2 copy where the CPU has it) through a 64 KiB ring:
    copied in pieces, each item summed once whole, the same sums on both sides (this deadlocked
    before: each side waited for a whole item the ring cannot hold)."""
    import zlib

    lib = native.lib
    item, size, chunk = 128 << 10, 64 << 10, 256 << 10
    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, (16, 2 * item), dtype=np.uint8)
    dst = np.zeros_like(src)
    ring = np.zeros(size, dtype=np.uint8)
    words, addr = _words(16)  # 0 producer, 1 consumer, 2 stop, 3 closed, 4 reader want, 5 writer want
    sp, dp = rng.permutation(16)[:10], rng.permutation(16)[:10]
    lengths, items = np.full(10, 2 * item, np.uint64), np.full(10, item, np.uint64)
    out: dict[str, Any] = {}

    def writer() -> None:
        out["w"] = lib.ring_copy((src.ctypes.data + sp.astype(np.uint64) * 2 * item).tobytes(), lengths.tobytes(),
                                 items.tobytes(), 0, 1, chunk, ring.ctypes.data, size, 0, 0, addr[1], addr[0],
                                 addr[2], 1, addr[3], 1, 0, addr[5], addr[4])

    thread = threading.Thread(target=writer)
    thread.start()
    got = lib.ring_copy((dst.ctypes.data + dp.astype(np.uint64) * 2 * item).tobytes(), lengths.tobytes(),
                        items.tobytes(), 0, 1, chunk, ring.ctypes.data, size, 0, 1, addr[0], addr[1],
                        addr[2], 1, addr[3], 1, 0, addr[4], addr[5])
    thread.join(10)
    assert got[0] == 0 and out["w"][0] == 0
    assert np.array_equal(dst[dp], src[sp])
    expected = [zlib.adler32(src[p, k * item : (k + 1) * item].tobytes()) for p in sp for k in range(2)]
    assert np.frombuffer(got[1], np.uint32).tolist() == expected == np.frombuffer(out["w"][1], np.uint32).tolist()
    assert words[0] == words[1] == 20 * item and words[4] == words[5] == 0


@pytest.mark.skipif(not shm._native(), reason="native data path")
def test_a_sleeping_reader_never_asks_for_more_than_its_frame():
    """The landing thread asks to be woken once half the ring more was published, but never past
    the end of the payload it copies: the writer stops there (the frame ends) and would not wake it."""
    lib = native.lib
    size = 1 << 20
    ring = np.zeros(size, dtype=np.uint8)
    dst = np.zeros(8192, dtype=np.uint8)
    words, addr = _words()  # 0 producer, 1 consumer, 2 stop, 3 closed, 4 reader want, 5 writer want
    out: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out.setdefault("rc", lib.ring_copy(
        np.array([dst.ctypes.data], np.uint64).tobytes(), np.array([8192], np.uint64).tobytes(),
        np.array([8192], np.uint64).tobytes(), -1, 0, 4096, ring.ctypes.data, size, 0, 1, addr[0], addr[1],
        addr[2], 1, addr[3], 1, 0, addr[4], addr[5])))
    thread.start()
    wait_for(lambda: words[4] != 0, timeout=5)
    assert words[4] == 8192  # the frame's end, not 4096 + 512 KiB
    ring[:8192] = 7
    lib.ring_publish(addr[0], 8192, addr[4])
    thread.join(5)
    assert out["rc"] == (0, None) and (dst == 7).all() and words[1] == 8192

# two processes --------------------------------------------------------------------------------------

_CHILD = textwrap.dedent("""
    import sys, time
    import numpy as np
    from kvxfer.core.layout import KVLayout
    from kvxfer.core.runs import build_batch
    from kvxfer.transport.base import LinkRequest
    from kvxfer.transport.options import ShmOptions
    from kvxfer.transport.shm import ShmTransport
    from kvxfer.wire import messages as m

    blob, directory, mode = bytes.fromhex(sys.argv[1]), sys.argv[2], sys.argv[3]
    layout = KVLayout.allocate(num_buffers=2, item_len=4096, num_pages=64, page_size=16)
    rng = np.random.default_rng(1)
    for view in layout.views():
        view[:] = rng.integers(0, 256, view.shape, dtype=np.uint8)
    transport = ShmTransport(layout, checksum="adler32", options=ShmOptions(ring_bytes=256 << 10, directory=directory))
    closed = []
    link = transport.connect(LinkRequest(engine="child", peer="dc", proof=b"p" * 32, epoch=1, blob=blob,
                                         on_closed=lambda _l, reason: closed.append(reason),
                                         send_control=lambda msg: None))
    print("connected", flush=True)
    if mode == "hang":
        time.sleep(60)
    dst = np.array([int(x) for x in sys.argv[4].split(",")])
    src = np.arange(len(dst))
    batch = build_batch(layout, src, dst, slot=2, gen=1)
    link.post_writes(batch, lambda b, n, e: None)
    link.post_ordered(m.Done(rid="r", gen=1, bytes=0, pages=len(dst), checksum=0, algo="adler32"), slot=2, gen=1)
    link.close(flush=True)
    print("sent", link.bytes_sent, closed, flush=True)
""")


def _child(blob: bytes, directory: str, mode: str, dst: np.ndarray | None = None) -> subprocess.Popen:
    args = [sys.executable, "-c", _CHILD, blob.hex(), directory, mode]
    if dst is not None:
        args.append(",".join(str(int(p)) for p in dst))
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_writer_in_another_process(rig, tmp_path):
    r = rig()
    pages = r.ledger.allocate(24, 1)
    dst = np.random.default_rng(5).permutation(pages)
    r.guard.open(Window(rid="r", gen=1, slot=2, conn=("child", 1), pages=dst))
    child = _child(r.receiver.offer("child", SESSION, 1), str(tmp_path), "write", dst)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    assert "sent 196608 ['closed']" in out
    wait_for(lambda: len(r.closed) == 1, what="the writer's close")
    assert r.closed[0] == (("child", 1), "writer closed the connection")
    assert [e[0] for e in r.events] == ["connect", "ordered"] and r.ordered_seen_uncovered == [0]
    assert r.same(np.arange(24), dst)
    if native.checksums_in_c:
        assert r.guard.landed_checksum(dst, ChecksumAlgo.ADLER32) == checksum_pages(r.src, np.arange(24), "adler32")


def test_a_dead_writer_process_ends_the_connection(rig, tmp_path):
    r = rig()
    child = _child(r.receiver.offer("child", SESSION, 1), str(tmp_path), "hang")
    try:
        assert child.stdout.readline().strip() == "connected"
        wait_for(lambda: r.receiver.connections() == [("child", 1)], what="CONNECT")
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        wait_for(lambda: len(r.closed) == 1, timeout=3 * shm.LIVENESS_AFTER + 2, what="the dead writer noticed")
        assert "exited" in r.closed[0][1]
    finally:
        if child.poll() is None:
            child.kill()
        child.communicate()


# the pure-Python fallback ----------------------------------------------------------------------------


@pytest.mark.skipif(os.environ.get("KVXFER_PURE_PYTHON") == "1", reason="already the fallback")
def test_the_pure_python_fallback_passes_the_same_tests():
    env = dict(os.environ, KVXFER_PURE_PYTHON="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__],
                          capture_output=True, text=True, timeout=300, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout


# the bench's shm case -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("KVXFER_PURE_PYTHON") == "1", reason="once is enough")
def test_bench_reports_shm_against_a_scattered_memcpy(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, KVXFER_SHM_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "kvxfer", "bench", "--transport", "shm", "--total", "16M",
                           "--request-bytes", "4M", "--page-bytes", "64K", "--repeat", "2",
                           "--baselines", "scattered-memcpy,two-copy-memcpy", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    cases = {(c["transport"], c["checks"]): c for c in report["cases"]}
    for key in (("kvxfer-shm", "on"), ("kvxfer-shm", "off"), ("scattered-memcpy", "off"), ("two-copy-memcpy", "off")):
        assert not cases[key]["error"] and cases[key]["gbps"] > 0, cases[key]
    assert cases[("two-copy-memcpy", "off")]["tool"] == "native copy_runs, 2 threads at once"
    against = {r["against"]: r for r in report["ratios"]}
    for label in ("scattered-memcpy", "two-copy-memcpy", "kvxfer-shm checks off"):
        assert against[label]["gbps_ratio"] > 0, against
    assert [p for p in os.listdir(tmp_path) if p.startswith("kvxfer-ring")] == []
