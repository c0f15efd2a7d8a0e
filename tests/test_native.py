"""The native data path is built where it can be, and its choice is reported."""

from __future__ import annotations

import os
import socket
import threading

import numpy as np
import pytest

from kvxfer import native


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
