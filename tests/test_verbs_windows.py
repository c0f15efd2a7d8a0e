"""The verbs memory windows' planning and their META.access blob, without a device: which windows a
request gets, the exact bytes META carries (the golden vector), and the writer's refusal of a run no
window covers. The windows themselves (bind, invalidate, a stale key failing in the NIC) are tested
on rxe in tests/test_verbs.py."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from kvxfer.errors import ProtocolError
from kvxfer.transport.verbs_windows import WINDOW_DTYPE, WindowTable, encode_access, inc_rkey, page_runs, plan_windows
from kvxfer.wire import golden


def test_runs_of_a_request_in_any_order():
    first, count = page_runs(np.array([41, 9, 11, 10, 40]))
    assert first.tolist() == [9, 40] and count.tolist() == [3, 2]


def test_one_window_per_buffer_and_run_then_wide_above_the_cap():
    pages = np.array([9, 10, 11, 40, 41])
    records, wide = plan_windows(pages, num_buffers=2, num_pages=64, max_runs=2, max_windows=960)
    assert not wide
    assert [tuple(int(x) for x in r) for r in records] == [(0, 9, 3, 0), (0, 40, 2, 0), (1, 9, 3, 0), (1, 40, 2, 0)]
    records, wide = plan_windows(pages, num_buffers=2, num_pages=64, max_runs=1, max_windows=960)
    assert wide and [tuple(int(x) for x in r) for r in records] == [(0, 0, 64, 0), (1, 0, 64, 0)]
    # more windows than one chain of binds may hold is wide too
    _, wide = plan_windows(np.arange(0, 40, 2), num_buffers=2, num_pages=64, max_runs=64, max_windows=39)
    assert wide


def test_the_access_blob_is_the_golden_vector():
    records = np.array([(0, 9, 3, 0x1001A), (0, 40, 2, 0x1011B), (1, 9, 3, 0x1021C), (1, 40, 2, 0x1031D)],
                       dtype=WINDOW_DTYPE)
    assert encode_access(1, records) == golden.VERBS_META_ACCESS
    assert golden.example_messages()["META_VERBS"].access == golden.VERBS_META_ACCESS


def test_the_writer_finds_each_runs_window_and_refuses_a_run_outside_them():
    table = WindowTable.decode(golden.VERBS_META_ACCESS, num_buffers=2, num_pages=64)
    items = np.array([4096, 8192])
    keys = table.rkeys(np.array([0, 0, 1, 1]), np.array([9 * 4096, 40 * 4096, 10 * 8192, 41 * 8192]),
                       np.array([3 * 4096, 2 * 4096, 2 * 8192, 8192]), items)
    assert keys.tolist() == [0x1001A, 0x1011B, 0x1021C, 0x1031D]
    for buffer, first, pages in [(0, 8, 1), (0, 11, 2), (1, 12, 1), (0, 39, 2), (1, 0, 1)]:
        with pytest.raises(ProtocolError, match="outside every memory window"):
            table.rkeys(np.array([buffer]), np.array([first * items[buffer]]), np.array([pages * items[buffer]]), items)


@pytest.mark.parametrize("blob, problem", [
    (b"\xc1", "not msgpack"),
    (msgpack.packb({"v": 2, "epoch": 1, "windows": b""}), "must be a map"),
    (msgpack.packb({"v": 1, "epoch": 0, "windows": bytes(16)}, use_bin_type=True), "epoch"),
    (msgpack.packb({"v": 1, "epoch": 1, "windows": bytes(15)}, use_bin_type=True), "16-byte records"),
    (msgpack.packb({"v": 1, "epoch": 1, "windows": np.array([(2, 0, 1, 5)], dtype=WINDOW_DTYPE).tobytes()},
                   use_bin_type=True), "outside the layout"),
    (msgpack.packb({"v": 1, "epoch": 1, "windows": np.array([(0, 60, 5, 5)], dtype=WINDOW_DTYPE).tobytes()},
                   use_bin_type=True), "outside the layout"),
    (msgpack.packb({"v": 1, "epoch": 1, "windows": np.array([(0, 6, 0, 5)], dtype=WINDOW_DTYPE).tobytes()},
                   use_bin_type=True), "outside the layout"),
])
def test_a_bad_access_blob_is_a_protocol_error(blob, problem):
    with pytest.raises(ProtocolError, match=problem):
        WindowTable.decode(blob, num_buffers=2, num_pages=64)


def test_a_windows_key_byte_advances_and_its_index_stays():
    assert inc_rkey(0x12345678) == 0x12345679
    assert inc_rkey(0x123456FF) == 0x12345600
