"""A batch of several WRITE frames leaves in C calls of several frames each (``send_frames``).

The C loop is held to what the per-frame path sends: the same bytes on the wire, frame by frame
(every frame's header and run table, then its runs), and the same item checksums; its argument
checks refuse what would read past its arrays. Real tcp engines move scattered multi-frame requests
byte-exact and verified through it, with each checksum algorithm and without one, including a
request cut into more frames than one call takes.
"""

from __future__ import annotations

import socket
import threading
import zlib

import numpy as np
import pytest

from kvxfer import ReceiverState
from kvxfer.core import native
from kvxfer.transport import tcp

from .conftest import fill_random, read_in_background, wait_for

needs_send_frames = pytest.mark.skipif(
    not native.provides("send_frames") or not native.checksums_in_c,
    reason=f"the native send_frames with zlib-ng checksums: {native.describe()}")

ALGOS = {-1: None, 0: zlib.adler32, 1: zlib.crc32}
INITIAL = {-1: 0, 0: 1, 1: 0}


def _random_frames(rng: np.random.Generator, src: np.ndarray) -> tuple[list[bytes], list[list[tuple[int, int, int]]]]:
    """Frames of random prefixes and runs of whole items (offset, length, item) within ``src``."""
    prefixes, frames = [], []
    for _ in range(int(rng.integers(1, 7))):
        prefixes.append(rng.integers(0, 256, int(rng.integers(0, 200)), dtype=np.uint8).tobytes())
        runs = []
        for _ in range(int(rng.integers(1, 40))):
            item = int(rng.choice([1, 64, 1000, 4096]))
            length = item * int(rng.integers(1, 300 if item < 4096 else 40))
            runs.append((int(rng.integers(0, len(src) - length)), length, item))
        frames.append(runs)
    return prefixes, frames


def _send_and_read(prefixes: list[bytes], frames: list[list[tuple[int, int, int]]], src: np.ndarray, algo: int,
                   chunk: int) -> tuple[bytes, bytes | None]:
    runs = [run for frame in frames for run in frame]
    addresses = np.array([src.ctypes.data + o for o, _, _ in runs], dtype=np.uint64)
    lengths = np.array([n for _, n, _ in runs], dtype=np.uint64)
    items = np.array([i for _, _, i in runs], dtype=np.uint64).tobytes() if algo >= 0 else b""
    prefix_ends = np.cumsum([len(p) for p in prefixes]).astype(np.uint64)
    run_ends = np.cumsum([len(frame) for frame in frames]).astype(np.uint64)
    total = int(prefix_ends[-1]) + int(lengths.sum())
    a, b = socket.socketpair()
    reader, got = read_in_background(b, total)
    try:
        sums = native.lib.send_frames(a.fileno(), b"".join(prefixes), prefix_ends.tobytes(), run_ends.tobytes(),
                                      addresses.tobytes(), lengths.tobytes(), items, algo, INITIAL[algo], chunk)
    finally:
        reader.join(10)
        a.close()
        b.close()
    return bytes(got), sums


@needs_send_frames
@pytest.mark.parametrize("algo", [-1, 0, 1], ids=["unsummed", "adler32", "crc32"])
@pytest.mark.parametrize("seed", range(6))
def test_random_frames_leave_as_the_per_frame_path_sends_them(algo: int, seed: int):
    """Random frames (prefixes of 0-200 bytes, 1-40 runs of whole items of 1 B to 4 KiB, groups of
    random size): the bytes read back are each frame's prefix then its runs, in order, and the sums
    are every item's checksum from the algorithm's initial value, as send_runs_summed gives them."""
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, 4 << 20, dtype=np.uint8)
    prefixes, frames = _random_frames(rng, src)
    chunk = int(rng.choice([4096, 65536, 1 << 20]))
    wire, sums = _send_and_read(prefixes, frames, src, algo, chunk)
    expected = b"".join(prefix + b"".join(src[o : o + n].tobytes() for o, n, _ in frame)
                        for prefix, frame in zip(prefixes, frames))
    assert wire == expected
    if algo < 0:
        assert sums is None
        return
    fn = ALGOS[algo]
    want = [fn(src[o + k : o + k + item].tobytes(), INITIAL[algo]) for frame in frames for o, n, item in frame
            for k in range(0, n, item)]
    assert np.frombuffer(sums, dtype=np.uint32).tolist() == want
    # the per-frame call gives the same sums for the same runs
    runs = [run for frame in frames for run in frame]
    single = native.lib.send_runs_summed(
        _sink(), b"",
        np.array([src.ctypes.data + o for o, _, _ in runs], dtype=np.uint64).tobytes(),
        np.array([n for _, n, _ in runs], dtype=np.uint64).tobytes(),
        np.array([i for _, _, i in runs], dtype=np.uint64).tobytes(), algo, INITIAL[algo], chunk)
    assert single == sums


_sinks: list[socket.socket] = []


def _sink() -> int:
    """A socket whose peer discards what it reads (closed at the end of the module)."""
    a, b = socket.socketpair()
    threading.Thread(target=lambda: [None for _ in iter(lambda: b.recv(1 << 20), b"")], daemon=True).start()
    _sinks.extend((a, b))
    return a.fileno()


@pytest.fixture(autouse=True, scope="module")
def _close_sinks():
    yield
    for sock in _sinks:
        sock.close()


@needs_send_frames
@pytest.mark.parametrize("prefix_ends, run_ends, match", [
    ([4], [1, 2], "one entry per frame"),
    ([], [], "one entry per frame"),
    ([4, 2], [1, 2], "must grow"),
    ([2, 4], [1, 1], "must grow"),
    ([2, 3], [1, 2], "end of prefixes"),
    ([2, 4], [1, 3], "end of prefixes and of the runs"),
])
def test_frame_tables_that_do_not_fit_their_arrays_are_refused(prefix_ends, run_ends, match):
    src = np.zeros(8192, dtype=np.uint8)
    addresses = np.array([src.ctypes.data, src.ctypes.data + 4096], dtype=np.uint64).tobytes()
    lengths = np.array([4096, 4096], dtype=np.uint64).tobytes()
    items = np.array([4096, 4096], dtype=np.uint64).tobytes()
    with pytest.raises(ValueError, match=match):
        native.lib.send_frames(_sink(), b"HEAD", np.array(prefix_ends, dtype=np.uint64).tobytes(),
                               np.array(run_ends, dtype=np.uint64).tobytes(), addresses, lengths, items, 0, 1, 65536)
    with pytest.raises(ValueError, match="whole number of items"):
        native.lib.send_frames(_sink(), b"HEAD", np.array([2, 4], dtype=np.uint64).tobytes(),
                               np.array([1, 2], dtype=np.uint64).tobytes(), addresses, lengths,
                               np.array([4096, 3000], dtype=np.uint64).tobytes(), 0, 1, 65536)
    with pytest.raises(ValueError, match="one uint64 per run"):
        native.lib.send_frames(_sink(), b"HEAD", np.array([2, 4], dtype=np.uint64).tobytes(),
                               np.array([1, 2], dtype=np.uint64).tobytes(), addresses, lengths, b"", 0, 1, 65536)


@needs_send_frames
def test_a_closed_peer_raises_instead_of_hanging():
    a, b = socket.socketpair()
    b.close()
    src = np.zeros(1 << 20, dtype=np.uint8)
    with pytest.raises(OSError):
        native.lib.send_frames(a.fileno(), b"HD", np.array([2], dtype=np.uint64).tobytes(),
                               np.array([1], dtype=np.uint64).tobytes(),
                               np.array([src.ctypes.data], dtype=np.uint64).tobytes(),
                               np.array([1 << 20], dtype=np.uint64).tobytes(), b"", -1, 0, 65536)
    a.close()


@needs_send_frames
@pytest.mark.parametrize("checksum", ["adler32", "crc32", "none"])
@pytest.mark.parametrize("max_runs, per_call", [(None, None), (5, 3)], ids=["real-frames", "many-calls"])
def test_multi_frame_requests_land_exact_and_verified(engines, monkeypatch, checksum: str, max_runs, per_call):
    """Scattered pages (random allocation on both sides) make one run per page and buffer: 1,200 pages of
    3 buffers are 3,600 runs, 8 frames of 512 runs, one C call; with frames of 5 runs and calls of 3
    frames, 720 frames in 240 calls. Either way the decode gets every byte, verifies the request and
    reads exactly what the prefill held, and the link counts every frame as sent through send_frames. The
    decode verifies each in one pass over the write guard and one over the ledger (no checksum: coverage
    and counts only), as it does a small request."""
    if max_runs is not None:
        monkeypatch.setattr(tcp, "FRAME_MAX_RUNS", max_runs)
        monkeypatch.setattr(tcp, "FRAMES_PER_CALL", per_call)
    pages = 1200
    pair = engines(prefill_pages=pages, decode_pages=pages + 64, checksum=checksum, fault_injection=False,
                   alloc_policy="random", seed=11)
    tokens = pages * 16
    for round_ in range(2):
        rid = f"r{round_}"
        pair.prefill.admit(rid, tokens)
        pair.decode.admit(rid, tokens, peer=pair.peer)
        pair.prefill.wait_ready(rid, timeout=10)
        src = pair.prefill.source_pages(rid)
        assert (np.diff(src) != 1).mean() > 0.9, "the pages are not scattered"
        fill_random(pair.prefill.layout, src, seed=round_)
        before = pair.link.frames_in_c
        at_once = pair.decode.receiver.stats["verified_at_once"]
        pair.prefill.send(rid)
        req = pair.decode.wait(rid, timeout=30)
        assert req.state is ReceiverState.READABLE, (req.state, req.error)
        # verified in one pass over the guard and one over the ledger, as a small request is
        assert pair.decode.receiver.stats["verified_at_once"] == at_once + 1
        with pair.decode.read(rid) as kv:  # the read's lease holds the pages until it ends
            for b, view in enumerate(pair.prefill.layout.views()):
                assert np.array_equal(kv.buffer(b), view[src]), f"buffer {b} differs"
        pair.decode.release(rid)
        pair.prefill.wait(rid, timeout=10)
        runs = pages * 3
        frames = -(-runs // (max_runs or tcp.FRAME_MAX_RUNS))
        wait_for(lambda before=before, frames=frames: pair.link.frames_in_c - before == frames, timeout=5)


def test_a_corrupted_large_request_is_still_refused_naming_the_checksum(engines):
    """The one-pass verification a large request now gets first accepts nothing the full one would
    refuse: a flipped byte in one frame of a 1,200-page scattered request fails it naming the checksum,
    the decode reads nothing, and every page is free again."""
    from kvxfer.errors import NotReadable

    pages = 1200
    pair = engines(prefill_pages=pages, decode_pages=pages + 64, alloc_policy="random", seed=12)
    pair.faults.flip_next_write()
    pair.transfer("bad", pages * 16, seed=3)
    req = pair.decode.wait("bad", timeout=30)
    assert req.state is ReceiverState.FAILED and req.error.check == "checksum", (req.state, req.error)
    with pytest.raises(NotReadable):
        pair.decode.read("bad")
    pair.prefill.wait("bad", timeout=10)
    assert pair.decode.pool.ledger.free_count == pair.decode.layout.num_pages
