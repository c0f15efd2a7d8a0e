"""The native data path is built where it can be, and its choice is reported."""

from __future__ import annotations

import os
import socket
import threading

import numpy as np
import pytest

from kvxfer.core import native

from .conftest import read_in_background


def test_choice_is_reported():
    text = native.describe()
    assert ("native C" in text) == native.available()
    if os.environ.get("KVXFER_REQUIRE_NATIVE") == "1":
        assert native.available(), text


@pytest.mark.skipif(not native.available(), reason=native.describe())
def test_native_scatter_gather_moves_exact_bytes():
    a, b = socket.socketpair()
    src = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros(1 << 20, dtype=np.uint8)
    offsets = np.array([0, 4096, 700_000, 12], dtype=np.uint64)
    lengths = np.array([4096, 100_000, 300_000, 0], dtype=np.uint64)
    src_addr = (src.ctypes.data + offsets).astype(np.uint64)
    dst_addr = (dst.ctypes.data + offsets[::-1].copy()).astype(np.uint64)
    t = threading.Thread(target=native.lib.send_runs, args=(a.fileno(), b"HEAD", src_addr.tobytes(), lengths.tobytes()))
    t.start()
    head = b.recv(4, socket.MSG_WAITALL)
    native.lib.recv_runs(b.fileno(), dst_addr.tobytes(), lengths[::-1].copy().tobytes())
    t.join()
    assert head == b"HEAD"
    sent = np.concatenate([src[int(o):int(o + n)] for o, n in zip(offsets, lengths)])
    got = np.concatenate([dst[int(o):int(o + n)] for o, n in zip(offsets[::-1], lengths[::-1])])
    assert np.array_equal(sent, got)
    a.close()
    with pytest.raises(ConnectionError):
        native.lib.recv_runs(b.fileno(), dst_addr[:1].tobytes(), lengths[:1].tobytes())
    b.close()
    with pytest.raises(ValueError):
        native.lib.recv_runs(0, b"\x00" * 8, b"")


@pytest.mark.skipif(not native.checksums_in_c, reason="zlib-ng checksums not loaded in C")
def test_item_checksums_in_c_match_zlib():
    import zlib

    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, 64 * 4096, dtype=np.uint8)
    addrs = (data.ctypes.data + np.array([0, 8 * 4096, 40 * 4096], dtype=np.uint64))
    lens = np.array([2 * 4096, 4 * 4096, 3 * 4096], dtype=np.uint64)
    items = np.full(3, 4096, dtype=np.uint64)
    raw = native.lib.checksum_items(0, 1, addrs.tobytes(), lens.tobytes(), items.tobytes())
    got = np.frombuffer(raw, dtype=np.uint32).tolist()
    expected = [zlib.adler32(data[int(a - data.ctypes.data) + k * 4096:][:4096].tobytes())
                for a, n in zip(addrs, lens) for k in range(int(n) // 4096)]
    assert got == expected
    crc = native.lib.checksum_runs(1, 0, addrs.tobytes(), lens.tobytes())
    assert crc == zlib.crc32(b"".join(data[int(a - data.ctypes.data):][: int(n)].tobytes() for a, n in zip(addrs, lens)))
    with pytest.raises(ValueError, match="whole number of items"):
        native.lib.checksum_items(0, 1, addrs.tobytes(), lens.tobytes(), np.full(3, 3000, np.uint64).tobytes())


@pytest.mark.skipif(not native.checksums_in_c, reason="zlib-ng checksums not loaded in C")
def test_summed_send_and_receive_checksum_every_item():
    import zlib

    a, b = socket.socketpair()
    rng = np.random.default_rng(4)
    src = rng.integers(0, 256, 256 * 1024, dtype=np.uint8)
    dst = np.zeros_like(src)
    offsets = np.arange(0, 256 * 1024, 8192, dtype=np.uint64)[::-1].copy()  # 32 scattered 8 KiB runs
    lens = np.full(len(offsets), 8192, dtype=np.uint64)
    items = np.full(len(offsets), 4096, dtype=np.uint64)
    out = {}

    def send():
        out["sent"] = native.lib.send_runs_summed(a.fileno(), b"P", (src.ctypes.data + offsets).tobytes(),
                                                  lens.tobytes(), items.tobytes(), 0, 1, 16384)

    t = threading.Thread(target=send)
    t.start()
    assert b.recv(1) == b"P"
    received = native.lib.recv_runs_summed(b.fileno(), (dst.ctypes.data + offsets).tobytes(), lens.tobytes(),
                                           items.tobytes(), 0, 1, 16384)
    t.join()
    assert np.array_equal(src, dst)
    expected = [zlib.adler32(src[int(o) + k * 4096:][:4096].tobytes()) for o in offsets for k in range(2)]
    assert np.frombuffer(out["sent"], np.uint32).tolist() == expected
    assert np.frombuffer(received, np.uint32).tolist() == expected
    a.close()
    b.close()


@pytest.mark.skipif(not native.available(), reason=native.describe())
def test_send_runs_in_groups_keeps_every_byte_in_order():
    """send_runs hands the kernel about 2 MiB per call now: 9 MiB of runs (one larger than a group,
    one empty) arrive whole and in order behind the prefix, and a prefix with no runs is still sent."""
    a, b = socket.socketpair()
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, 12 << 20, dtype=np.uint8)
    lengths = np.array([3 << 20, 0, 64 << 10, 1 << 20, (4 << 20) - (64 << 10), 1 << 20], dtype=np.uint64)
    offsets = np.array([8 << 20, 0, 1 << 20, 5 << 20, 2 << 20, 11 << 20], dtype=np.uint64)
    reader, got = read_in_background(b, 4 + int(lengths.sum()) + 2)
    native.lib.send_runs(a.fileno(), b"HEAD", (src.ctypes.data + offsets).tobytes(), lengths.tobytes())
    native.lib.send_runs(a.fileno(), b"PZ", b"", b"")
    reader.join(10)
    expected = b"HEAD" + b"".join(src[int(o):int(o + n)].tobytes() for o, n in zip(offsets, lengths)) + b"PZ"
    assert bytes(got) == expected
    a.close()
    b.close()


@pytest.mark.skipif(not native.checksums_in_c, reason="zlib-ng checksums not loaded in C")
@pytest.mark.parametrize("summed", [False, True], ids=["plain", "summed"])
def test_runs_longer_than_one_read_land_whole(summed: bool):
    """The receiver asks readv for a bounded amount per call (RECV_GROUP; the summed path its chunk),
    cutting a long run across calls: a 3 MiB run, runs of odd lengths and an empty run land byte-exact
    in scattered places, and the summed path still returns every item's checksum."""
    import zlib

    a, b = socket.socketpair()
    rng = np.random.default_rng(6)
    src = rng.integers(0, 256, 8 << 20, dtype=np.uint8)
    dst = np.zeros(9 << 20, dtype=np.uint8)  # room for the odd lengths past each run's place
    item = 4096
    lengths = np.array([3 << 20, 0, 12 * item, 1 << 20, 5 * item], dtype=np.uint64)
    src_offsets = np.array([0, 0, 3 << 20, 4 << 20, 6 << 20], dtype=np.uint64)
    dst_offsets = np.array([5 << 20, 0, 0, 1 << 20, 3 << 20], dtype=np.uint64)
    if not summed:  # lengths that are not whole items, and not multiples of any read size
        lengths = lengths + np.array([1, 0, 3, 7, 11], dtype=np.uint64)
    items = np.full(len(lengths), item, dtype=np.uint64)
    sender = threading.Thread(target=native.lib.send_runs,
                              args=(a.fileno(), b"", (src.ctypes.data + src_offsets).tobytes(), lengths.tobytes()))
    sender.start()
    addresses = (dst.ctypes.data + dst_offsets).tobytes()
    if summed:
        raw = native.lib.recv_runs_summed(b.fileno(), addresses, lengths.tobytes(), items.tobytes(), 0, 1, 64 << 10)
    else:
        native.lib.recv_runs(b.fileno(), addresses, lengths.tobytes())
    sender.join(10)
    for s, d, n in zip(src_offsets.tolist(), dst_offsets.tolist(), lengths.tolist()):
        assert np.array_equal(src[s:s + n], dst[d:d + n])
    if summed:
        expected = [zlib.adler32(src[s + k * item:s + (k + 1) * item].tobytes())
                    for s, n in zip(src_offsets.tolist(), lengths.tolist()) for k in range(n // item)]
        assert np.frombuffer(raw, np.uint32).tolist() == expected
    a.close()
    b.close()


@pytest.mark.skipif(not native.provides("recv_run_table") or not native.checksums_in_c,
                    reason=f"needs kvxfer._native with recv_run_table and zlib-ng ({native.describe()})")
@pytest.mark.parametrize("seed", range(3))
def test_landing_from_the_run_table_is_landing_from_address_arrays(seed):
    """recv_run_table (the tcp receiver's landing of an accepted WRITE frame) computes each run's
    destination from the run table and the buffers' bases in C; random tables over buffers of different
    item sizes land the same bytes in the same places, with the same item checksums (adler32 and crc32),
    as recv_runs / recv_runs_summed given the addresses numpy computes. A table it cannot take (a buffer
    outside the layout, a run not whole items when summing, a run past its buffer's end) is a ValueError
    before any byte is read."""
    from kvxfer.wire import frames as f

    rng = np.random.default_rng(seed)
    items = np.array([4096, 512, 1536], dtype=np.int64)
    pages = 32
    for trial in range(30):
        algo = int(rng.integers(-1, 2))  # -1: land only; 0 adler32, 1 crc32 (native_id)
        initial = 1 if algo == 0 else 0
        count = int(rng.integers(1, 12))
        buffers = rng.integers(0, len(items), count)
        first = rng.integers(0, pages, count)
        npages = np.minimum(rng.integers(1, 4, count), pages - first)
        runs = np.zeros(count, dtype=f.RUN_DTYPE)
        runs["buffer"], runs["offset"] = buffers, first * items[buffers]
        runs["length"] = npages * items[buffers]
        payload = rng.integers(0, 256, int(runs["length"].sum()), dtype=np.uint8)
        outs = []
        for way in ("table", "arrays"):
            pools = [np.zeros(pages * int(n), dtype=np.uint8) for n in items]
            bases = np.array([p.ctypes.data for p in pools], dtype=np.uint64)
            a, b = socket.socketpair()
            try:
                a.sendall(payload.tobytes())
                if way == "table":
                    raw = native.lib.recv_run_table(b.fileno(), runs, bases.tobytes(), items.tobytes(), pages,
                                                    algo, initial, 64 << 10)
                else:
                    addresses = (bases[runs["buffer"]] + runs["offset"]).tobytes()
                    lengths = runs["length"].astype(np.uint64).tobytes()
                    if algo < 0:
                        raw = native.lib.recv_runs(b.fileno(), addresses, lengths)
                    else:
                        per_run = items.astype(np.uint64)[runs["buffer"]].tobytes()
                        raw = native.lib.recv_runs_summed(b.fileno(), addresses, lengths, per_run, algo,
                                                          initial, 64 << 10)
            finally:
                a.close()
                b.close()
            outs.append((raw, [p.tobytes() for p in pools]))
        assert outs[0] == outs[1], (trial, algo, runs)
        assert any(any(p) for p in outs[0][1])
    a, b = socket.socketpair()
    try:
        bases, lens = np.zeros(3, dtype=np.uint64).tobytes(), items.tobytes()
        bad = np.zeros(1, dtype=f.RUN_DTYPE)
        bad["buffer"], bad["length"] = 3, 4096
        with pytest.raises(ValueError, match="run 0 .buffer 3"):
            native.lib.recv_run_table(b.fileno(), bad, bases, lens, pages, 0, 1, 64 << 10)
        bad["buffer"], bad["length"] = 1, 700  # not whole 512-byte items
        with pytest.raises(ValueError, match="not whole items"):
            native.lib.recv_run_table(b.fileno(), bad, bases, lens, pages, 0, 1, 64 << 10)
        for offset, length in ((pages * 512, 512), ((pages - 1) * 512, 1024), ((1 << 64) - 512, 512)):
            bad["buffer"], bad["offset"], bad["length"] = 1, offset, length  # past the buffer's 32 items
            with pytest.raises(ValueError, match="outside its buffer"):
                native.lib.recv_run_table(b.fileno(), bad, bases, lens, pages, -1, 0, 64 << 10)
    finally:
        a.close()
        b.close()
