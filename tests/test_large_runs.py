"""Runs of any size on the tcp transport (issue 12, finding 8).

A long prompt on a fresh pool is one contiguous run per buffer on both sides (the allocator hands
out ascending pages). The tcp frame cutter used to put at least one whole run in every frame, so a
run longer than the 32 MiB staging buffer overran it (SIGSEGV in the sender), and a frame announcing
more than the receiver's staging buffer overran that one (EFAULT, then SIGSEGV). Now frames are cut
to the frame limit whatever the run length: long runs are split at item (page) boundaries.

The end-to-end transfers run in a child process (``python3 -c``): a crash of the data path shows as
a failed test with the child's exit status, instead of killing pytest.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvxfer import DecodeEngine, EngineConfig, KVLayout, PrefillEngine, ReceiverState
from kvxfer.core.runs import WriteBatch, cut_frames
from kvxfer.transport import tcp
from kvxfer.wire import frames as f

from .conftest import PAGE_TOKENS, fill_random, wait_for

MIB = 1 << 20

# One buffer of 2 MiB items (page_size 16 tokens), 150 pages per side: one 300 MiB run per request.
CHILD = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from kvxfer import DecodeEngine, EngineConfig, KVLayout, PrefillEngine, ReceiverState

    staging, checksum, item, pages, buffers = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    PT = 16
    options = {"tcp": {"staging": "host"}} if staging == "host" else {}
    config = EngineConfig(max_context=pages * PT, checksum=checksum, transport_options=options,
                          transfer_timeout=300.0)

    def layout():
        return KVLayout.allocate(num_buffers=buffers, item_len=item, num_pages=pages, page_size=PT)

    with PrefillEngine(layout(), config) as prefill, DecodeEngine(layout(), config) as decode:
        peer = decode.connect(prefill.address)
        prefill.admit("big", pages * PT)
        req = decode.admit("big", pages * PT, peer=peer)
        prefill.wait_ready("big")
        src = prefill.source_pages("big")
        dst = np.asarray(req.pages)
        assert len(src) == len(dst) == pages, (len(src), len(dst))
        assert (np.diff(src) == 1).all() and (np.diff(dst) == 1).all(), "not one contiguous run per buffer"
        rng = np.random.default_rng(7)
        for view in prefill.layout.views():
            view[src] = rng.integers(0, 256, size=(len(src), view.shape[1]), dtype=np.uint8)
        for view in decode.layout.views():
            view[:] = 0xA5  # whatever the pages held before
        t0 = time.perf_counter()
        prefill.send("big")
        final = decode.wait("big", timeout=300)
        elapsed = time.perf_counter() - t0
        assert final.state is ReceiverState.READABLE, (final.state, final.error)
        kv = decode.read("big")
        for b in range(buffers):
            assert np.array_equal(kv.buffer(b), prefill.layout.views()[b][src]), f"buffer {b} differs"
        frames = decode.stats()["data_path"]["frames"]
        decode.release("big")
        prefill.wait("big")
        print(f"OK {elapsed:.3f} s, {frames} frames, {pages * item * buffers / (1 << 20):.0f} MiB")
    """
)


def _run_child(staging: str, checksum: str, *, item: int, pages: int, buffers: int = 1,
               env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, staging, checksum, str(item), str(pages), str(buffers)],
        capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"transfer child exited with {proc.returncode}:\n{out[-4000:]}"
    assert "OK " in proc.stdout, out[-4000:]
    return proc.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("staging", ["plain", "host"])
def test_one_run_of_300_mib_per_buffer_arrives_byte_exact(staging, capsys):
    line = _run_child(staging, "adler32", item=2 * MIB, pages=150)
    with capsys.disabled():
        print(f"\n[{staging}] 300 MiB single run: {line}")
    frames = int(line.split(", ")[1].split()[0])
    assert frames >= 300 // 32  # cut into frames of at most the 32 MiB staging size


def test_an_item_larger_than_the_frame_limit_still_moves(capsys):
    """48 MiB items (larger than FRAME_MAX_BYTES): the frame limit and both staging buffers grow to
    one item; two buffers, crc32."""
    line = _run_child("host", "crc32", item=48 * MIB, pages=3, buffers=2)
    with capsys.disabled():
        print(f"\n[host] 48 MiB items: {line}")
    assert int(line.split(", ")[1].split()[0]) == 6  # one item per frame: 3 pages x 2 buffers


# the frame cutter ------------------------------------------------------------------------------------


def _batch(buffers, src, dst, lengths) -> WriteBatch:
    return WriteBatch(slot=1, gen=1, buffers=np.array(buffers, dtype=np.int64),
                      src_offsets=np.array(src, dtype=np.int64), dst_offsets=np.array(dst, dtype=np.int64),
                      lengths=np.array(lengths, dtype=np.int64))


def _check_cut(batch: WriteBatch, item_lens: np.ndarray, limit: int, max_runs: int) -> list:
    cuts = cut_frames(batch, item_lens, limit, max_runs)
    # every byte of every run once, in order, as whole items, within the limits
    got = []
    done = 0
    for cut in cuts:
        assert 1 <= len(cut.lengths) <= max_runs
        assert cut.nbytes == int(cut.lengths.sum()) <= limit
        assert (cut.lengths > 0).all()
        its = item_lens[cut.buffers]
        assert (cut.lengths % its == 0).all() and (cut.dst_offsets % its == 0).all()
        assert (cut.src_offsets % its == 0).all()
        got += list(zip(cut.buffers.tolist(), cut.src_offsets.tolist(), cut.dst_offsets.tolist(),
                        cut.lengths.tolist()))
        done += cut.runs_done
        assert cut.runs_before == done - cut.runs_done
    assert done == len(batch)
    # expanding pieces and runs into items gives the same item sequence (the checksum order)
    def expand(rows):
        out = []
        for b, s, d, n in rows:
            it = int(item_lens[b])
            out += [(b, s + k, d + k) for k in range(0, n, it)]
        return out

    want = list(zip(batch.buffers.tolist(), batch.src_offsets.tolist(), batch.dst_offsets.tolist(),
                    batch.lengths.tolist()))
    assert expand(got) == expand(want)
    assert sum(c.nbytes for c in cuts) == int(batch.lengths.sum())
    return cuts


def test_cutter_leaves_small_runs_whole_as_before():
    item_lens = np.array([1024, 1024, 1024])
    batch = _batch([0, 0, 1, 1, 2, 2], [0, 8192, 0, 8192, 0, 8192], [4096, 0, 4096, 0, 4096, 0],
                   [2048, 1024, 2048, 1024, 2048, 1024])
    cuts = _check_cut(batch, item_lens, 4096, 512)
    assert [len(c.lengths) for c in cuts] == [2, 2, 2]
    assert [c.runs_done for c in cuts] == [2, 2, 2]
    cuts = _check_cut(batch, item_lens, 1 << 20, 4)
    assert [len(c.lengths) for c in cuts] == [4, 2]


def test_cutter_splits_a_long_run_at_item_boundaries():
    item_lens = np.array([3 * MIB, 1 * MIB])
    # a 300-item run, a small run, a run longer than the limit in another buffer, a small run
    batch = _batch([0, 0, 1, 1], [0, 900 * MIB, 0, 64 * MIB], [30 * MIB, 0, 0, 100 * MIB],
                   [900 * MIB, 3 * MIB, 40 * MIB, 1 * MIB])
    cuts = _check_cut(batch, item_lens, 32 * MIB, 512)
    # the first run goes in pieces of 10 items (30 MiB: 11 would not fit in 32 MiB), the 30th completes it
    assert [c.nbytes for c in cuts[:30]] == [30 * MIB] * 30
    assert [c.runs_done for c in cuts[:30]] == [0] * 29 + [1]
    assert [c.dst_offsets[0] for c in cuts[:3]] == [30 * MIB, 60 * MIB, 90 * MIB]
    # the small run does not fit beside the 40 MiB run, which is split 32 + 8 MiB; its rest and the
    # last run share a frame
    assert [(c.nbytes, c.runs_done, c.runs_before) for c in cuts[30:]] == [
        (3 * MIB, 1, 1), (32 * MIB, 0, 2), (9 * MIB, 2, 2)]
    assert cuts[-1].src_offsets.tolist() == [32 * MIB, 64 * MIB]
    assert cuts[-1].lengths.tolist() == [8 * MIB, 1 * MIB]
    assert batch.lengths.tolist() == [900 * MIB, 3 * MIB, 40 * MIB, 1 * MIB]  # the batch is untouched


def test_cutter_handles_runs_over_the_wire_limit_and_items_as_large_as_the_frame():
    """A 3 GiB run (over MAX_PAYLOAD, which the receiver refuses as one run) goes in frame-sized
    pieces; an item exactly the frame limit goes one per frame."""
    item_lens = np.array([2 * MIB, 32 * MIB])
    batch = _batch([0, 1], [0, 0], [0, 32 * MIB], [3 << 30, 96 * MIB])
    cuts = _check_cut(batch, item_lens, 32 * MIB, 512)
    assert len(cuts) == 96 + 3 and all(c.nbytes == 32 * MIB for c in cuts)
    assert max(int(c.lengths.max()) for c in cuts) <= f.MAX_PAYLOAD
    with pytest.raises(ValueError, match="does not fit a frame"):
        cut_frames(batch, item_lens, 16 * MIB, 512)


def test_frame_limit_is_at_least_one_item():
    small = KVLayout.allocate(num_buffers=2, item_len=4096, num_pages=4, page_size=PAGE_TOKENS)
    assert tcp.frame_limit(small) == tcp.FRAME_MAX_BYTES
    big = KVLayout.allocate(num_buffers=1, item_len=tcp.FRAME_MAX_BYTES + 4096, num_pages=1,
                            page_size=PAGE_TOKENS)
    assert tcp.frame_limit(big) == tcp.FRAME_MAX_BYTES + 4096


# the receiver: a frame larger than its staging buffer ------------------------------------------------


def test_a_write_frame_larger_than_the_staging_buffer_is_refused_before_its_payload():
    """A writer announces a WRITE of 34 MiB (inside a real reservation, so the write guard would let
    it through) to a staging receiver whose buffers hold 32 MiB. It is refused as a protocol error
    from the header alone (the payload is never sent: a receiver that waited for it would hang), the
    connection ends, and the engine keeps serving: a fresh connection transfers byte-exact."""
    item = 1 * MIB

    def layout(pages: int) -> KVLayout:
        return KVLayout.allocate(num_buffers=1, item_len=item, num_pages=pages, page_size=PAGE_TOKENS)

    config = EngineConfig(max_context=40 * PAGE_TOKENS, heartbeat_interval=0.2,
                          transport_options={"tcp": {"staging": "host"}})
    with PrefillEngine(layout(40), config) as prefill, DecodeEngine(layout(40), config) as decode:
        peer = decode.connect(prefill.address)
        prefill.admit("big", 34 * PAGE_TOKENS)
        req = decode.admit("big", 34 * PAGE_TOKENS, peer=peer)
        prefill.wait_ready("big")
        link = prefill.peers[decode.engine_id].link
        first = int(req.pages[0])
        assert (np.diff(req.pages) == 1).all()
        payload = 34 * item
        assert payload > decode.transport.frame_limit
        header = f.write_header(req.slot, req.gen, 1, payload)
        runs = f.pack_runs(np.array([0]), np.array([first * item]), np.array([payload]))
        link.post_raw([header, runs])  # no payload follows
        wait_for(lambda: decode.transport.protocol_errors == 1, what="protocol error")
        assert decode.stats()["protocol_errors"] == 1
        assert decode.wait("big", timeout=10).state is ReceiverState.FAILED
        assert decode.stats()["writes"]["landed_bytes"] == 0
        # the engine keeps running: a fresh connection (another writer) is served, byte-exact
        with PrefillEngine(layout(40), config) as writer:
            peer2 = decode.connect(writer.address)
            writer.admit("next", 34 * PAGE_TOKENS)
            decode.admit("next", 34 * PAGE_TOKENS, peer=peer2)
            writer.wait_ready("next")
            src = writer.source_pages("next")
            fill_random(writer.layout, src, 5)
            writer.send("next")
            assert decode.wait("next", timeout=30).state is ReceiverState.READABLE
            assert np.array_equal(decode.read("next").buffer(0), writer.layout.views()[0][src])
            assert decode.transport.protocol_errors == 1
            assert decode.stats()["data_path"]["frames"] >= 2  # 34 MiB: cut to the 32 MiB staging size
            decode.release("next")
            writer.wait("next")
        decode.check_accounting()


def _greedy_reference(batch: WriteBatch, limit: int, max_runs: int) -> list[tuple[int, int, int]]:
    """(first run, end run, bytes) of each frame of runs no longer than ``limit``: as many whole runs
    as fit ``limit`` bytes and ``max_runs`` runs, in order."""
    frames, run, lengths = [], 0, batch.lengths.tolist()
    while run < len(lengths):
        end, nbytes = run, 0
        while end < len(lengths) and end - run < max_runs and nbytes + lengths[end] <= limit:
            nbytes += lengths[end]
            end += 1
        frames.append((run, end, nbytes))
        run = end
    return frames


@pytest.mark.parametrize("seed", range(40))
def test_cutting_by_run_count_gives_the_greedy_frames(seed: int):
    """Batches of whole-page runs no longer than the limit, cut with limits on both sides of
    ``max_runs`` times the longest run (where the cutter takes runs by count alone, and where bytes
    decide): every frame is the greedy one, whole runs, in order, with its units."""
    rng = np.random.default_rng(seed)
    item_lens = np.array([1024, 4096, 512], dtype=np.int64)
    n = int(rng.integers(2, 3000))
    buffers = rng.integers(0, 3, n)
    pages = rng.integers(1, 9, n)
    lengths = item_lens[buffers] * pages
    batch = _batch(buffers, rng.integers(0, 1000, n) * item_lens[buffers],
                   rng.integers(0, 1000, n) * item_lens[buffers], lengths)
    max_runs = int(rng.integers(1, 600))
    longest = int(lengths.max())
    limit = int(rng.choice([max_runs * longest, max_runs * longest + int(rng.integers(0, 5000)),
                            max(longest, max_runs * longest // 3)]))
    cuts = _check_cut(batch, item_lens, limit, max_runs)
    want = _greedy_reference(batch, limit, max_runs)
    assert [(c.runs_before, c.runs_before + c.runs_done, c.nbytes) for c in cuts] == want
    for cut, (a, b, _n) in zip(cuts, want):
        assert np.array_equal(cut.buffers, batch.buffers[a:b]) and np.array_equal(cut.lengths, batch.lengths[a:b])
        assert np.array_equal(cut.src_offsets, batch.src_offsets[a:b])
        assert np.array_equal(cut.dst_offsets, batch.dst_offsets[a:b])
        assert np.array_equal(cut.units, item_lens[batch.buffers[a:b]])
    assert np.array_equal(batch.item_counts(item_lens), pages)
