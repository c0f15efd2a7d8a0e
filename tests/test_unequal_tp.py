"""Prefill and decode with different tensor parallelism and page sizes (issue 24), over every
transport: each writer's head slice of every page lands in the decode rank that holds those heads,
and a request is readable only when every slice of every page arrived from the writer that owns it.

The lifecycle and hostile cases of ``test_lifecycle_paths.py`` and ``test_hostile_peers.py`` on
requests of two writers (prefill TP 2 into decode TP 1) and of two destinations (prefill TP 1 into
decode TP 2): aborts drain or fence every writer, a late write from any of them lands nowhere,
generations are per writer, a writer's bytes outside its slice are refused. Real engines, real
sockets; the ``made`` fixture checks every pool's accounting after each test.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvxfer import AdmissionRejected, KVLayout, ReceiverState, SenderState
from kvxfer.core.geometry import KVGeometry
from kvxfer.core.ledger import PageState
from kvxfer.errors import NotReadable, PeerError
from kvxfer.wire import frames as f
from kvxfer.wire import messages as m

from .conftest import close_checked, wait_for
from .tp_env import build

R, S = ReceiverState, SenderState
pytestmark = pytest.mark.usefixtures("transport")


@pytest.fixture
def made():
    engines: list = []
    yield engines
    close_checked(engines)


@pytest.fixture
def cluster(made, transport, request):
    """Engines of a topology; a test marked :data:`LAYERWISE_TOO` runs again with layer-wise sends."""
    layerwise = "send_mode" in request.fixturenames and request.getfixturevalue("send_mode") == "layerwise"

    def factory(**kw):
        return build(transport=transport, made=made, layerwise=layerwise, **kw)
    return factory


LAYERWISE_TOO = pytest.mark.usefixtures("send_mode")  # the 2-writer lifecycle, also over layer-wise sends


TOPOLOGIES = [(2, 1), (1, 2), (2, 2), (4, 2), (2, 4), (4, 1), (1, 4)]


@pytest.mark.parametrize("tp", TOPOLOGIES, ids=[f"p{a}d{b}" for a, b in TOPOLOGIES])
@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_unequal_tp_transfers_every_head_slice_exactly(cluster, tp, order):
    c = cluster(tp_prefill=tp[0], tp_decode=tp[1], heads=4, order=order)
    c.transfer("r", 5 * 16 - 3, seed=1)
    c.expect_readable("r")
    assert all(req.state is S.SUCCEEDED for req in c.wait_prefills("r"))
    c.release("r")
    assert c.all_free()


@pytest.mark.parametrize("pages", [(16, 32), (32, 16), (8, 32)], ids=["p16d32", "p32d16", "p8d32"])
@pytest.mark.parametrize("tp", [(1, 1), (2, 1), (1, 2)], ids=["p1d1", "p2d1", "p1d2"])
def test_unequal_page_sizes_map_tokens_onto_pages_with_a_partial_last_page(cluster, pages, tp):
    c = cluster(tp_prefill=tp[0], tp_decode=tp[1], prefill_page=pages[0], decode_page=pages[1],
                prefill_pages=64, decode_pages=64)
    for rid, tokens in (("a", 3 * 32 + 5), ("b", 1), ("c", 64)):
        c.transfer(rid, tokens, seed=len(rid))
        c.expect_readable(rid)
        c.release(rid)
    assert all(req.state is S.SUCCEEDED for req in c.wait_prefills("c"))
    wait_for(c.all_free, timeout=5, what="every pool free")


@LAYERWISE_TOO
def test_chunked_sends_from_two_writers_complete_only_with_the_last_chunk_of_both(cluster):
    c = cluster(tp_prefill=2, tp_decode=1)
    c.admit("c", 10 * 16)
    c.fill("c", seed=3)
    for prefill in c.prefills:
        prefill.send("c", count=4)
    c.prefills[0].send("c")  # writer 0 done, writer 1 still owes six pages
    time.sleep(0.2)
    assert c.decodes[0].status("c").state is R.RESERVED
    c.prefills[1].send("c", count=6)
    c.expect_readable("c")


@LAYERWISE_TOO
def test_mla_is_written_once_by_one_rank_and_verified(cluster):
    c = cluster(tp_prefill=2, tp_decode=1, mla=True, head_bytes=64)
    c.transfer("m", 40, seed=4)
    c.expect_readable("m")
    reqs = c.wait_prefills("m")
    assert [r.state for r in reqs] == [S.SUCCEEDED, S.SUCCEEDED]
    assert reqs[0].bytes_posted > 0 and reqs[1].bytes_posted == 0  # rank 1 was told it writes nothing
    legs = c.decodes[0].status("m").legs
    assert [leg.state.value for leg in legs] == ["CLAIMED", "NULL"]
    # one rank into two decode ranks: each gets the whole latent
    c2 = cluster(tp_prefill=1, tp_decode=2, mla=True, head_bytes=64)
    c2.transfer("m", 40, seed=5)
    c2.expect_readable("m")


@LAYERWISE_TOO
def test_abort_quarantines_until_every_writer_proved_its_drain(cluster):
    c = cluster(tp_prefill=2, tp_decode=1)
    c.admit("a", 20 * 16)
    c.fill("a", seed=6)
    c.faults[1].pause()  # writer 1's link stalls with writes posted
    for prefill in c.prefills:
        prefill.send("a", count=8)
    decode = c.decodes[0]
    pages = decode.status("a").pages.copy()
    decode.abort("a")
    assert decode.status("a").state is R.QUARANTINED
    wait_for(lambda: c.prefills[0].status("a").state is S.ABORTED, what="writer 0 drained and acknowledged")
    time.sleep(0.2)
    legs = decode.status("a").legs
    assert [leg.state.value for leg in legs] == ["DRAINED", "STOPPED"]
    assert (decode.pool.ledger.state[pages] == PageState.QUARANTINED).all()  # writer 1 may still write
    c.faults[1].resume()
    assert decode.wait("a").state is R.ABORTED
    assert decode.pool.ledger.free_count == decode.layout.num_pages
    assert [r.state for r in c.wait_prefills("a")] == [S.ABORTED, S.ABORTED]


@LAYERWISE_TOO
def test_a_writer_that_never_drains_is_fenced_and_only_then_are_the_pages_free(cluster):
    c = cluster(tp_prefill=2, tp_decode=1, decode_config={"drain_timeout": 0.5})
    c.admit("h", 8 * 16)
    c.fill("h", seed=7)
    c.faults[1].pause()
    for prefill in c.prefills:
        prefill.send("h", count=4)
    decode = c.decodes[0]
    decode.abort("h")
    time.sleep(0.3)
    assert decode.status("h").state is R.QUARANTINED
    assert decode.wait("h", timeout=10).state is R.ABORTED  # writer 1 fenced after drain_timeout
    assert decode.stats()["engine_counters"]["fences"] >= 1
    c.faults[1].resume()
    wait_for(lambda: c.prefills[1].status("h").fsm.terminal, what="writer 1 settled")
    # the fenced writer's next request goes over a fresh connection
    c.wait_connected()
    c.transfer("next", 3 * 16, seed=8)
    c.expect_readable("next")


@LAYERWISE_TOO
def test_one_writer_dying_fails_the_request_and_the_other_writer_is_stopped(cluster, made):
    c = cluster(tp_prefill=2, tp_decode=1)
    c.needs("sees_disconnect")  # verbs: a dead writer is found by its silence (test_verbs.py)
    c.admit("d", 12 * 16)
    c.fill("d", seed=9)
    c.faults[0].pause()
    c.prefills[0].send("d", count=4)
    c.prefills[1].close()  # writer 1 gone before it wrote: its connection ends
    decode = c.decodes[0]
    req = decode.wait("d", timeout=10, until=(R.QUARANTINED, R.FAILED))
    assert "connection closed" in str(req.error)
    c.faults[0].resume()
    assert decode.wait("d").state is R.FAILED
    assert c.prefills[0].wait("d").state in (S.ABORTED, S.FAILED)
    assert decode.pool.ledger.free_count == decode.layout.num_pages


@LAYERWISE_TOO
def test_a_decode_rank_aborting_stops_the_writer_for_every_rank(cluster):
    """Prefill TP 1 into decode TP 2: one decode rank's abort fails the prefill's request, and the
    other decode rank is told at once (a writer ABORT behind the writes) instead of timing out."""
    c = cluster(tp_prefill=1, tp_decode=2)
    c.admit("x", 12 * 16)
    c.fill("x", seed=10)
    c.faults[0].pause()
    c.prefills[0].send("x", count=5)
    c.decodes[0].abort("x")
    c.faults[0].resume()
    assert c.decodes[0].wait("x").state is R.ABORTED
    other = c.decodes[1].wait("x", timeout=5)
    assert other.state is R.ABORTED and "prefill aborted it" in str(other.error)
    assert c.prefills[0].wait("x").state is S.ABORTED
    wait_for(c.all_free, timeout=5, what="every pool free")


@LAYERWISE_TOO
def test_a_late_write_from_either_writer_lands_nowhere(cluster):
    c = cluster(tp_prefill=2, tp_decode=1)
    c.needs("raw_frames")
    c.faults[1].capture_next_write()
    c.transfer("victim", 4 * 16, seed=11)
    c.expect_readable("victim")
    late = c.faults[1].take_captured()
    assert late
    c.decodes[0].abort("victim")
    c.wait_prefills("victim")
    c.transfer("next", 4 * 16, seed=12)
    c.expect_readable("next")
    decode = c.decodes[0]
    before = decode.stats()["writes"]["refused_by_reason"].get("stale_tag", 0)
    link = c.prefills[1].peers[decode.engine_id].link
    for frame in late:
        link.post_raw(frame)
    wait_for(lambda: decode.stats()["writes"]["refused_by_reason"].get("stale_tag", 0) > before,
             what="the late write refused")
    c.expect_readable("next")


def _slice_write(c, writer: int, req, leg, offset: int, length: int, fill: int = 0xEE) -> None:
    header = f.write_header(leg.slot, leg.gen, 1, length)
    runs = f.pack_runs(np.array([0]), np.array([offset]), np.array([length]))
    c.prefills[writer].peers[c.decodes[0].engine_id].link.post_raw([header, runs, bytes([fill]) * length])


@LAYERWISE_TOO
def test_a_writer_cannot_write_the_other_writers_heads(cluster):
    c = cluster(tp_prefill=2, tp_decode=1, order="HND")
    c.needs("raw_frames")
    c.admit("s", 2 * 16)
    for prefill in c.prefills:
        prefill.wait_ready("s")
    decode = c.decodes[0]
    req = decode.status("s")
    leg0, leg1 = req.legs
    item = int(decode.layout.item_lens[0])
    page = int(req.pages[0])
    # HND: heads 0-1 are the first half of each page, heads 2-3 the second: writer 0 aims at writer 1's half
    _slice_write(c, 0, req, leg0, page * item + item // 2, item // 2)
    _slice_write(c, 0, req, leg1, page * item, item // 2)  # writer 1's tag, sent on writer 0's connection
    wait_for(lambda: sum(decode.stats()["writes"]["refused_by_reason"].values()) >= 2, what="both refused")
    assert set(decode.stats()["writes"]["refused_by_reason"]) == {"outside_slice", "wrong_connection"}
    c.fill("s", seed=13)
    c.send("s")
    c.expect_readable("s")


@LAYERWISE_TOO
def test_a_corrupted_slice_fails_verification_naming_its_writer(cluster):
    c = cluster(tp_prefill=2, tp_decode=1)
    c.faults[1].flip_next_write()
    c.transfer("bad", 6 * 16, seed=14)
    req = c.decodes[0].wait("bad")
    assert req.state is R.FAILED and req.error.check == "checksum"
    assert f"writer {c.prefills[1].engine_id}" in str(req.error) and "heads 2..3" in str(req.error)
    with pytest.raises(NotReadable):
        c.decodes[0].read("bad")
    reqs = c.wait_prefills("bad")
    assert reqs[1].state is S.FAILED
    wait_for(c.all_free, timeout=5, what="every pool free")


@LAYERWISE_TOO
def test_a_done_claiming_a_slice_it_did_not_write_never_becomes_readable(cluster):
    c = cluster(tp_prefill=2, tp_decode=1)
    c.needs("raw_frames")
    c.admit("claim", 4 * 16)
    c.fill("claim", seed=15)
    c.prefills[0].send("claim")
    req = c.decodes[0].status("claim")
    leg1 = req.legs[1]
    sliced = leg1.table
    claim = m.Done(rid="claim", gen=leg1.gen, bytes=sliced.nbytes, pages=len(req.pages), checksum=1,
                   algo="adler32")
    c.prefills[1].peers[c.decodes[0].engine_id].link.post_ordered(claim, slot=leg1.slot, gen=leg1.gen)
    final = c.decodes[0].wait("claim")
    assert final.state is R.FAILED and final.error.check == "coverage"
    assert "within this writer's slice" in str(final.error)
    c.prefills[1].abort("claim")
    wait_for(c.all_free, timeout=5, what="every pool free")


@LAYERWISE_TOO
def test_generations_are_per_writer_and_a_replayed_done_of_one_cannot_complete_the_next(cluster):
    c = cluster(tp_prefill=2, tp_decode=1)
    c.needs("raw_frames")
    c.transfer("room", 3 * 16, seed=16)
    c.expect_readable("room")
    first = c.decodes[0].status("room")
    gens = [leg.gen for leg in first.legs]
    assert len(set(gens)) == 2 and first.gen == gens[0]
    old_done = m.Done(rid="room", gen=gens[1], bytes=first.legs[1].table.nbytes if first.legs[1].table else 0,
                      pages=len(first.pages), checksum=0, algo="adler32")
    c.release("room")
    c.wait_prefills("room")
    c.admit("room", 3 * 16)
    new = c.decodes[0].status("room")
    assert min(leg.gen for leg in new.legs) > max(gens)
    link = c.prefills[1].peers[c.decodes[0].engine_id].link
    link.post_raw([f.message_frame(f.FrameKind.ORDERED, m.encode(old_done), generation=gens[1])])
    time.sleep(0.3)
    assert c.decodes[0].status("room").state is R.RESERVED
    c.fill("room", seed=17)
    c.send("room")
    c.expect_readable("room")


def test_a_decode_that_cannot_get_every_head_is_refused_on_both_halves(cluster):
    """A decode rank given only some of its writers: refused at admission, and every writer named
    hears it at once (its half fails instead of waiting for a destination)."""
    c = cluster(tp_prefill=2, tp_decode=1)
    for prefill in c.prefills:
        prefill.admit("half", 32, any_peer=True)
    with pytest.raises(AdmissionRejected, match="takes KV from writer ranks") as err:
        c.decodes[0].admit("half", 32, peers=[c.prefills[0].engine_id])
    assert err.value.reason == "layout_mismatch"
    req = c.prefills[0].wait("half", timeout=2)
    assert req.state is S.FAILED and "takes KV from writer ranks" in str(req.error)
    c.prefills[1].abort("half")


def test_pairs_kvxfer_cannot_translate_are_refused_at_peering_naming_both_layouts(made, transport):
    from dataclasses import replace as dc_replace

    from kvxfer import DecodeEngine, EngineConfig, PrefillEngine
    from kvxfer.wire.auth import Keyring

    rings = Keyring.cluster(["w", "r"])
    config = EngineConfig(max_context=256, heartbeat_interval=0.2, transport=transport)
    nhd = KVGeometry.attention(layers=1, total_heads=4, head_dim=8, itemsize=2, dtype="bfloat16")
    hnd = KVGeometry.attention(layers=1, total_heads=4, head_dim=8, itemsize=2, dtype="bfloat16", order="HND")
    tp3 = KVGeometry.attention(layers=1, total_heads=6, head_dim=8, itemsize=2, dtype="bfloat16", tp_size=3)
    tp2 = KVGeometry.attention(layers=1, total_heads=6, head_dim=8, itemsize=2, dtype="bfloat16", tp_size=2)
    cases = [(nhd, hnd, "in-page order HND != local NHD (kvxfer does not transpose pages)", "HND", "NHD"),
             (tp2, tp3, "TP size 3 and local 2: neither is a multiple of the other", "TP rank 0 of 3",
              "TP rank 0 of 2")]
    for writer, reader, words, theirs, local in cases:
        prefill = PrefillEngine(KVLayout.allocate(num_pages=16, page_size=16, geometry=writer),
                                dc_replace(config, keyring=rings["w"]))
        made.append(prefill)
        decode = DecodeEngine(KVLayout.allocate(num_pages=16, page_size=16, geometry=reader),
                              dc_replace(config, keyring=rings["r"]))
        made.append(decode)
        with pytest.raises(PeerError, match="refused") as err:
            decode.connect(prefill.address, timeout=5)
        text = str(err.value)
        assert words in text, text
        assert "theirs: " in text and theirs in text.split("theirs:")[1].split("; local:")[0], text
        assert local in text.split("; local:")[1], text
        assert prefill.counters["refused_hellos"] == 1


def test_a_leg_whose_writes_were_cancelled_gets_an_abort_not_a_done_claiming_them():
    """A request failed on another leg while this leg's DONE waited behind writes that were then
    dropped (fanout: one prefill rank, two decode ranks): what the transport builds in DONE's place is a
    writer ABORT (the decode rank ends "prefill aborted it" at once), never a DONE claiming writes that
    were not sent (which the decode would refuse as a coverage failure, naming the wrong cause)."""
    from kvxfer.core.checksum import ChecksumAlgo
    from kvxfer.core.runs import build_batch
    from kvxfer.engine.sender import DoneBuilder

    from .conftest import make_layout

    layout = make_layout(8)
    built: list[bool] = []
    batch = build_batch(layout, np.arange(4), np.arange(4, 8), slot=1, gen=7)
    done = DoneBuilder(layout=layout, algo=ChecksumAlgo.ADLER32, rid="q", gen=7, aux=b"", src=np.arange(4),
                       batches=[batch], write_log=False, on_built=lambda: built.append(True))
    assert isinstance(done(), m.Done) and built == [True]
    batch.cancelled = True
    msg = done()
    assert isinstance(msg, m.Abort) and msg.gen == 7 and "another of its legs" in msg.detail and built == [True, True]


ENDINGS = ["decode_abort", "writer1_abort", "writer1_closes", "transfer_timeout"]


@LAYERWISE_TOO
@pytest.mark.parametrize("ending", ENDINGS)
def test_a_writer_whose_done_was_claimed_hears_at_once_when_the_request_fails_for_another(cluster, ending):
    """Prefill TP 2 into decode TP 1: writer 0 sent everything and its DONE was claimed; then the request
    fails for writer 1's reason. Writer 0 gets its own RESULT (ok=false) at once and frees its sources,
    instead of holding them in DONE_SENT until its result_timeout (120 s by default)."""
    c = cluster(tp_prefill=2, tp_decode=1, decode_config={"transfer_timeout": 1.0, "drain_timeout": 1.0})
    if ending == "writer1_closes":
        c.needs("sees_disconnect")  # verbs: a dead writer is found by its silence (test_verbs.py)
    c.admit("r", 6 * 16)
    c.fill("r", seed=21)
    c.prefills[0].send("r")
    decode = c.decodes[0]
    wait_for(lambda: decode.status("r").legs[0].state.value == "CLAIMED", what="writer 0's DONE claimed")
    assert c.prefills[0].status("r").state is S.DONE_SENT
    if ending == "decode_abort":
        decode.abort("r")
    elif ending == "writer1_abort":
        c.prefills[1].abort("r")
    elif ending == "writer1_closes":
        c.prefills[1].close()
    # transfer_timeout: writer 1 stays silent; the decode gives up after 1 s
    writer0 = c.prefills[0].wait("r", timeout=8)
    assert writer0.state is S.FAILED, writer0.state
    assert writer0.error is not None and writer0.error.reason != "result_timeout", writer0.error
    assert c.prefills[0].pool.ledger.free_count == c.prefills[0].layout.num_pages  # its sources are free
    final = decode.wait("r", timeout=8, until=(R.ABORTED, R.FAILED, R.REJECTED))
    assert final.state in (R.ABORTED, R.FAILED, R.REJECTED)
    wait_for(lambda: decode.pool.ledger.free_count == decode.layout.num_pages, timeout=8, what="decode pages free")
