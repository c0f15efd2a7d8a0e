"""Hostile and broken peers over every transport, on an authenticated control plane.

Each behaviour gets a clear refusal, loses nothing (the honest requests still complete, byte-exact)
and exposes nothing (no page becomes readable that holds bytes its reader did not get written, every
page is accounted for at the end: the ``engines`` fixture checks both pools after each test).
Writes outside the window, forged completions, stale acks and late writes have more cases in
``test_lifecycle_paths.py``; this file is organised by the attacker.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import zmq

from kvxfer import DecodeEngine, EngineConfig, ReceiverState, SenderState
from kvxfer.core.checksum import checksum_pages
from kvxfer.errors import NotReadable, PeerError
from kvxfer.wire import frames as f
from kvxfer.wire import messages as m
from kvxfer.wire.auth import Keyring, split_address, z85_to_hex

from .conftest import PAGE_TOKENS, fill_random, make_layout, needs, wait_for

R, S = ReceiverState, SenderState
pytestmark = pytest.mark.usefixtures("transport", "send_mode")  # every transport, whole and layer-wise sends


@contextmanager
def raw_peer(address: str, *, ring: Keyring | None, identity: str) -> Iterator[zmq.Socket]:
    """A bare DEALER toward ``address``: with ``ring`` it does the CURVE handshake under that key."""
    endpoint, server_key = split_address(address)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 2000)  # a refused handshake can leave no pipe: a send would block for ever
    if ring is not None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_key, ring.public, ring.secret
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.connect(endpoint)
    try:
        yield sock
    finally:
        sock.close(0)
        ctx.term()


def _write(pair, slot: int, gen: int, page: int, fill: int, buffer: int = 0) -> None:
    """One raw page write on the prefill's data connection, tagged (slot, gen)."""
    needs(pair, "raw_frames")
    item = int(pair.decode.layout.item_lens[buffer])
    header = f.write_header(slot, gen, 1, item)
    runs = f.pack_runs(np.array([buffer]), np.array([page * item]), np.array([item]))
    pair.link.post_raw([header, runs, bytes([fill]) * item])


# unauthenticated and wrongly keyed peers -------------------------------------------------------


def test_a_peer_with_an_untrusted_key_cannot_peer_and_is_logged(engines, caplog):
    pair = engines()
    stranger = Keyring.generate("stranger")
    stranger.trusted.update({k: v for k, v in pair.prefill.control.keyring.trusted.items()})  # it trusts them
    with DecodeEngine(make_layout(16), EngineConfig(max_context=16 * PAGE_TOKENS, keyring=stranger)) as intruder:
        with pytest.raises(PeerError, match="no answer"):
            intruder.connect(pair.prefill.address, timeout=1.0)
    assert pair.prefill.counters["auth_denied"] >= 1
    assert list(pair.prefill.peers) == [pair.decode.engine_id]
    assert any('"event": "auth_denied"' in r.getMessage() and z85_to_hex(stranger.public) in r.getMessage()
               for r in caplog.records)
    src = pair.transfer("still", 2 * PAGE_TOKENS)
    assert pair.decode.wait("still").state is R.READABLE
    pair.expect_content("still", src)


def test_unauthenticated_messages_never_reach_the_request_logic(engines):
    pair = engines()
    pair.prefill.admit("target", 2 * PAGE_TOKENS)
    req = pair.decode.admit("target", 2 * PAGE_TOKENS, peer=pair.peer)
    pair.prefill.wait_ready("target")
    before = dict(pair.prefill.sender.stats)
    forged = [m.Abort(rid="target", gen=req.gen, reason="x", detail="forged"),
              m.Meta(rid="other", gen=req.gen + 1, slot=1, tokens=16, pages=np.array([0], dtype=np.uint32)),
              m.Heartbeat(engine="x", seq=1)]
    with raw_peer(pair.prefill.address, ring=None, identity=pair.decode.engine_id) as plain, \
            raw_peer(pair.prefill.address, ring=Keyring.generate("stranger"), identity="stranger") as keyed:
        for msg in forged:
            for sock in (plain, keyed):
                try:
                    sock.send(m.encode(msg))
                except zmq.Again:  # refused before a pipe existed: it cannot arrive either
                    pass
        wait_for(lambda: pair.prefill.counters["auth_denied"] >= 2, what="both handshakes refused")
    assert dict(pair.prefill.sender.stats) == before
    assert pair.prefill.counters["malformed_messages"] == 0 and pair.prefill.counters["refused_messages"] == 0
    assert pair.prefill.status("target").state is S.READY
    fill_random(pair.prefill.layout, pair.prefill.source_pages("target"), 3)
    pair.prefill.send("target")
    assert pair.decode.wait("target").state is R.READABLE


def test_addresses_without_a_trusted_key_are_refused_before_connecting(engines):
    pair = engines()
    endpoint, _ = split_address(pair.prefill.address)
    keyed = pair.decode
    with pytest.raises(PeerError, match="no server key"):
        keyed.connect(endpoint, timeout=1.0)
    with pytest.raises(PeerError, match="not in this engine's keyring"):
        keyed.connect(Keyring.generate("x").address(endpoint), timeout=1.0)
    with DecodeEngine(make_layout(16), EngineConfig(max_context=16 * PAGE_TOKENS)) as open_engine:
        with pytest.raises(PeerError, match="requires authenticated peers"):
            open_engine.connect(pair.prefill.address, timeout=1.0)


def test_a_trusted_peer_cannot_speak_under_another_engines_id(engines):
    rings = Keyring.cluster(["prefill", "decode", "insider"])
    pair = engines(prefill_config={"keyring": rings["prefill"]}, decode_config={"keyring": rings["decode"]})
    pair.prefill.admit("mine", 2 * PAGE_TOKENS)
    req = pair.decode.admit("mine", 2 * PAGE_TOKENS, peer=pair.peer)
    pair.prefill.wait_ready("mine")
    # the identity "ghost" is first seen under the insider's key ...
    with raw_peer(pair.prefill.address, ring=rings["insider"], identity="ghost") as sock:
        sock.send(m.encode(m.Heartbeat(engine="ghost", seq=1)))
        wait_for(lambda: pair.prefill.counters["refused_messages"] >= 1, what="heartbeat from a non-peer refused")
    # ... and the decode's own id is bound to the decode's key: the insider cannot use either
    with raw_peer(pair.prefill.address, ring=rings["decode"], identity="ghost") as sock:
        sock.send(m.encode(m.Abort(rid="mine", gen=req.gen, reason="x", detail="as ghost")))
        wait_for(lambda: pair.prefill.counters["impersonation_refused"] >= 1, what="impersonation refused")
    assert pair.prefill.status("mine").state is S.READY
    pair.prefill.send("mine")
    assert pair.decode.wait("mine").state is R.READABLE


def test_garbage_from_a_trusted_peer_is_counted_and_survived(engines):
    rings = Keyring.cluster(["prefill", "decode", "buggy"])
    pair = engines(prefill_config={"keyring": rings["prefill"]}, decode_config={"keyring": rings["decode"]})
    with raw_peer(pair.prefill.address, ring=rings["buggy"], identity="buggy") as sock:
        for junk in (b"", b"\xc1", b"\x93\x07\xa4META\x80", b"\x93\x01\xa3FOO\x80", b"\xff" * 10_000):
            sock.send(junk)
        wait_for(lambda: pair.prefill.counters["malformed_messages"] >= 5, what="malformed counted")
    src = pair.transfer("after", 3 * PAGE_TOKENS)
    assert pair.decode.wait("after").state is R.READABLE
    pair.expect_content("after", src)


# a hostile writer -------------------------------------------------------------------------------


def test_writes_into_someone_elses_pages_land_nowhere(engines):
    pair = engines()
    done_src = pair.transfer("done", 2 * PAGE_TOKENS, seed=1)
    done = pair.decode.wait("done")
    pair.prefill.admit("other", 2 * PAGE_TOKENS)
    other = pair.decode.admit("other", 2 * PAGE_TOKENS, peer=pair.peer)
    pair.prefill.admit("mine", 2 * PAGE_TOKENS)
    mine = pair.decode.admit("mine", 2 * PAGE_TOKENS, peer=pair.peer)
    pair.prefill.wait_ready("mine")
    pair.prefill.wait_ready("other")
    view = pair.decode.layout.views()[0]
    snapshot = view[np.concatenate([done.pages, other.pages])].copy()
    for page in (*done.pages[:1], *other.pages[:1]):  # under my own valid tag, into their pages
        _write(pair, mine.slot, mine.gen, int(page), 0xEE)
    _write(pair, other.slot, other.gen, int(mine.pages[0]), 0xEE)  # their tag, my page
    wait_for(lambda: sum(pair.decode.stats()["writes"]["refused_by_reason"].values()) >= 3, what="refusals")
    assert set(pair.decode.stats()["writes"]["refused_by_reason"]) == {"not_reserved"}
    assert np.array_equal(view[np.concatenate([done.pages, other.pages])], snapshot)
    pair.expect_content("done", done_src)
    for rid in ("other", "mine"):
        fill_random(pair.prefill.layout, pair.prefill.source_pages(rid), 5)
        pair.prefill.send(rid)
        assert pair.decode.wait(rid).state is R.READABLE


def test_a_done_claiming_more_than_was_written_never_becomes_readable(engines):
    pair = engines()
    pages = 6
    pair.prefill.admit("claim", pages * PAGE_TOKENS)
    req = pair.decode.admit("claim", pages * PAGE_TOKENS, peer=pair.peer)
    pair.prefill.wait_ready("claim")
    src = pair.prefill.source_pages("claim")
    fill_random(pair.prefill.layout, src, 2)
    for buffer in range(pair.decode.layout.num_buffers):  # two pages of six, every buffer
        for page in req.pages[:2]:
            _write(pair, req.slot, req.gen, int(page), 0x11, buffer)
    claim = m.Done(rid="claim", gen=req.gen, bytes=pair.prefill.layout.bytes_for_pages(pages), pages=pages,
                   checksum=checksum_pages(pair.prefill.layout, src, "adler32"), algo="adler32")
    pair.link.post_ordered(claim, slot=req.slot, gen=req.gen)
    final = pair.decode.wait("claim")
    assert final.state is R.FAILED
    assert final.error.check in ("coverage", "bytes")
    assert "4 of 6 reserved pages were not written" in str(final.error)
    with pytest.raises(NotReadable):
        pair.decode.read("claim")
    assert pair.decode.pool.ledger.free_count == pair.decode.layout.num_pages
    pair.prefill.abort("claim")


def test_a_drain_ack_it_never_earned_cannot_make_its_later_writes_land(engines):
    pair = engines()
    pair.prefill.sender.on_abort = lambda peer, msg: None  # the writer ignores the abort ...
    pair.prefill.admit("liar", 4 * PAGE_TOKENS)
    liar = pair.decode.admit("liar", 4 * PAGE_TOKENS, peer=pair.peer)
    pair.prefill.wait_ready("liar")
    slot, gen, liar_pages = liar.slot, liar.gen, liar.pages.copy()
    pair.decode.abort("liar")
    assert pair.decode.status("liar").state is R.QUARANTINED
    # ... and acks a drain while it still means to write
    pair.link.post_ordered(m.DrainAck(rid="liar", gen=gen, posted=0, completed=0), slot=slot, gen=gen)
    assert pair.decode.wait("liar").state is R.ABORTED
    src = pair.transfer("next", 4 * PAGE_TOKENS, seed=8)  # LIFO: the liar's pages again
    nxt = pair.decode.wait("next")
    assert set(nxt.pages.tolist()) == set(liar_pages.tolist())
    for page in liar_pages:
        _write(pair, slot, gen, int(page), 0xEE)
    wait_for(lambda: pair.decode.stats()["writes"]["refused_by_reason"].get("stale_tag", 0) >= len(liar_pages),
             what="the liar's writes refused")
    pair.expect_content("next", src)
    del pair.prefill.sender.on_abort
    pair.prefill.abort("liar")


def test_replayed_messages_are_refused_by_generation(engines):
    pair = engines()
    pair.transfer("room", 2 * PAGE_TOKENS, seed=1)
    first = pair.decode.wait("room")
    first_gen, first_slot, first_pages = first.gen, first.slot, first.pages.copy()
    old_done = m.Done(rid="room", gen=first_gen, bytes=pair.prefill.layout.bytes_for_pages(2), pages=2,
                      checksum=0, algo="adler32")
    old_meta = m.Meta(rid="room", gen=first_gen, slot=first_slot, tokens=2 * PAGE_TOKENS, pages=first_pages)
    pair.decode.release("room")
    pair.prefill.wait("room")
    pair.prefill.admit("room", 2 * PAGE_TOKENS)
    second = pair.decode.admit("room", 2 * PAGE_TOKENS, peer=pair.peer)
    pair.prefill.wait_ready("room")
    # the old DONE and DRAIN_ACK replayed on the data path, the old META replayed on the control plane
    stale_before = pair.decode.receiver.stats["stale_messages"]
    pair.link.post_ordered(old_done, slot=first_slot, gen=first_gen)
    pair.link.post_ordered(m.DrainAck(rid="room", gen=first_gen, posted=0, completed=0), slot=first_slot,
                           gen=first_gen)
    pair.decode.control.send(pair.prefill.address, old_meta)
    wait_for(lambda: pair.decode.receiver.stats["stale_messages"] >= stale_before + 1, what="stale DONE")
    wait_for(lambda: pair.decode.receiver.stats["unexpected_drain_ack"] >= 1, what="stale DRAIN_ACK")
    wait_for(lambda: pair.prefill.sender.stats["stale_meta"] >= 1, what="replayed META refused")
    assert pair.decode.status("room").state is R.RESERVED and pair.decode.status("room").gen == second.gen
    assert pair.prefill.status("room").gen == second.gen
    fill_random(pair.prefill.layout, pair.prefill.source_pages("room"), 6)
    pair.prefill.send("room")
    assert pair.decode.wait("room").state is R.READABLE


def test_a_destination_from_the_wrong_decode_is_refused(engines):
    rings = Keyring.cluster(["prefill", "decode", "thief"])
    pair = engines(prefill_config={"keyring": rings["prefill"]}, decode_config={"keyring": rings["decode"]})
    thief = DecodeEngine(make_layout(64), EngineConfig(max_context=64 * PAGE_TOKENS, keyring=rings["thief"],
                                                       heartbeat_interval=0.2,
                                                       transport=pair.decode.config.transport))
    try:
        thief_peer = thief.connect(pair.prefill.address)
        pair.prefill.admit("secret", 2 * PAGE_TOKENS, peer=pair.decode.engine_id)
        thief.admit("secret", 2 * PAGE_TOKENS, peer=thief_peer)  # asks for the KV of a request it does not serve
        wait_for(lambda: pair.prefill.sender.stats[f"refused_{PeerError.code}"] >= 1, what="thief refused")
        assert pair.prefill.status("secret").state is S.ADMITTED
        assert thief.stats()["writes"]["landed_bytes"] == 0
        pair.decode.admit("secret", 2 * PAGE_TOKENS, peer=pair.peer)
        pair.prefill.wait_ready("secret")
        assert pair.prefill.status("secret").peer == pair.decode.engine_id
        fill_random(pair.prefill.layout, pair.prefill.source_pages("secret"), 4)
        pair.prefill.send("secret")
        assert pair.decode.wait("secret").state is R.READABLE
        thief.abort("secret")
    finally:
        thief.close()


# floods ---------------------------------------------------------------------------------------------


def test_a_flood_of_destinations_for_unknown_requests_is_capped(engines):
    rings = Keyring.cluster(["prefill", "decode", "flooder"])
    pair = engines(prefill_config={"keyring": rings["prefill"], "max_pending_meta": 32},
                   decode_config={"keyring": rings["decode"]})
    with DecodeEngine(make_layout(16), EngineConfig(max_context=16 * PAGE_TOKENS, keyring=rings["flooder"],
                                                          transport=pair.decode.config.transport)) as flooder:
        flooder.connect(pair.prefill.address)
        for i in range(400):
            meta = m.Meta(rid=f"flood-{i}", gen=10 + i, slot=1, tokens=PAGE_TOKENS, pages=np.array([0], dtype=np.uint32))
            flooder.control.send(pair.prefill.address, meta)
        wait_for(lambda: pair.prefill.sender.stats["flood_refused"] >= 368, what="flood refused")
        assert len(pair.prefill.sender.pending_meta) == 32
        src = pair.transfer("honest", 2 * PAGE_TOKENS)  # another peer's requests are not held up
        assert pair.decode.wait("honest").state is R.READABLE
        pair.expect_content("honest", src)


def test_a_flood_of_bad_writes_is_refused_without_flooding_the_log(engines, caplog):
    pair = engines()
    pair.prefill.admit("busy", 2 * PAGE_TOKENS)
    req = pair.decode.admit("busy", 2 * PAGE_TOKENS, peer=pair.peer)
    pair.prefill.wait_ready("busy")
    for i in range(3000):
        _write(pair, req.slot, req.gen + 1 + i % 5, int(req.pages[0]), 0xEE)
    wait_for(lambda: sum(pair.decode.stats()["writes"]["refused_by_reason"].values()) >= 3000, what="refusals",
             timeout=30)
    lines = [r for r in caplog.records if r.name == "kvxfer.events" and "write_refused" in r.getMessage()]
    assert len(lines) <= 60
    fill_random(pair.prefill.layout, pair.prefill.source_pages("busy"), 7)
    pair.prefill.send("busy")
    assert pair.decode.wait("busy").state is R.READABLE


# disconnects at every step ----------------------------------------------------------------------------

STEPS = ["before_meta", "after_meta", "mid_write", "after_done", "in_quarantine"]


@pytest.mark.parametrize("step", STEPS)
def test_writer_vanishing_at_any_step_loses_and_exposes_nothing(engines, step):
    pair = engines(peer_timeout=1.0)
    tokens = 8 * PAGE_TOKENS
    pair.prefill.admit("r", tokens)
    if step == "before_meta":
        pair.link.abort_connection()
        pair.prefill.close()
        wait_for(lambda: not pair.decode.receiver.peers[pair.peer].ready, timeout=5, what="writer seen dead")
        with pytest.raises(PeerError, match="not connected"):
            pair.decode.admit("r", tokens, peer=pair.peer)
        assert pair.decode.pool.ledger.free_count == pair.decode.layout.num_pages
        return
    req = pair.decode.admit("r", tokens, peer=pair.peer)
    pair.prefill.wait_ready("r")
    fill_random(pair.prefill.layout, pair.prefill.source_pages("r"), 1)
    if step == "mid_write":
        pair.faults.pause()
        pair.prefill.send("r", count=4)
    elif step == "after_done":
        pair.prefill.send("r")
        assert pair.decode.wait("r").state is R.READABLE
    elif step == "in_quarantine":
        pair.faults.pause()
        pair.prefill.send("r", count=4)
        pair.decode.abort("r")
        assert pair.decode.status("r").state is R.QUARANTINED
    pair.link.abort_connection()  # the process died: socket gone, no more heartbeats
    pair.prefill.close()
    final = pair.decode.wait("r", timeout=10)
    if step == "after_done":
        assert final.state is R.READABLE  # verified before the writer left: still correct and readable
        pair.expect_content("r", pair.prefill.source_pages("r"))
        pair.decode.release("r")
    else:
        assert final.state in (R.FAILED, R.ABORTED)
        with pytest.raises(NotReadable):
            pair.decode.read("r")
    wait_for(lambda: pair.decode.pool.ledger.free_count == pair.decode.layout.num_pages, what="pages freed")
    del req


@pytest.mark.parametrize("step", ["after_meta", "mid_write", "after_done"])
def test_reader_vanishing_at_any_step_frees_the_writers_sources(engines, step):
    pair = engines(peer_timeout=1.0)
    tokens = 8 * PAGE_TOKENS
    pair.prefill.admit("r", tokens)
    pair.decode.admit("r", tokens, peer=pair.peer)
    pair.prefill.wait_ready("r")
    if step == "mid_write":
        pair.faults.pause()
        pair.prefill.send("r", count=4)
    elif step == "after_done":
        pair.faults.pause()
        pair.prefill.send("r")
    pair.decode.close()
    pair.faults.resume()
    final = pair.prefill.wait("r", timeout=10)
    assert final.state in (S.FAILED, S.ABORTED)
    wait_for(lambda: pair.prefill.pool.ledger.free_count == pair.prefill.layout.num_pages, what="sources freed")


def test_a_peer_speaking_the_old_protocol_version_is_told_why(engines):
    """A version-1 engine's HELLO is refused, counted, and answered with an ERROR naming both versions
    at the address the HELLO gave, so the old peer's log says why it cannot peer (open control plane:
    an old engine has no key in this cluster's keyring)."""
    import msgpack

    pair = engines(prefill_config={"keyring": None}, decode_config={"keyring": None})
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.ROUTER)
    inbox.setsockopt(zmq.LINGER, 0)
    port = inbox.bind_to_random_port("tcp://127.0.0.1")
    try:
        with raw_peer(pair.prefill.address, ring=None, identity="old-decode") as sock:
            body = {"engine": "old-decode", "role": "decode", "session": bytes(16),
                    "reply_to": f"tcp://127.0.0.1:{port}", "transport": "tcp", "data_addr": "127.0.0.1:1"}
            sock.send(msgpack.packb([1, "HELLO", body], use_bin_type=True))
            assert inbox.poll(5000), "no ERROR came back to the old peer"
            _identity, data = inbox.recv_multipart()
        version, kind, reply = msgpack.unpackb(data, raw=False)
        assert (version, kind) == (m.PROTOCOL_VERSION, "ERROR")
        assert reply["code"] == "protocol_version"
        assert f"unsupported protocol version 1 (this engine speaks {m.PROTOCOL_VERSION})" in reply["detail"]
        assert pair.prefill.counters["malformed_messages"] == 1
        assert "old-decode" not in pair.prefill.peers
    finally:
        inbox.close(0)
        ctx.term()
    src = pair.transfer("after", 2 * PAGE_TOKENS)  # the engines keep serving
    assert pair.decode.wait("after").state is R.READABLE
    pair.expect_content("after", src)


def test_a_connect_seen_on_the_wire_opens_no_connection_and_takes_none_over(engines):
    """Finding 1: an on-path observer sees the CONNECT that opened the prefill's data connection.
    Replayed, sent under a higher epoch, or raced against the writer's reconnect after a fence, it
    is refused: CONNECT carries a proof bound to one offer's nonce, never the session secret."""
    import socket

    from kvxfer.transport.tcp import parse_address

    pair = engines()
    if pair.decode.config.transport != "tcp":
        pytest.skip("the observer reads a tcp stream (shm rings are mode 0600; verbs CONNECTs on the control plane)")
    info = pair.decode.receiver.peers[pair.peer]
    conn = info.conn
    seen = m.Connect(engine=pair.peer, epoch=conn[1],
                     proof=m.connect_proof(pair.prefill.peers[pair.decode.engine_id].session, info.offer_nonce,
                                           pair.peer, conn[1]))  # exactly the bytes that crossed the wire

    def attempt(msg: m.Connect) -> None:
        before = pair.decode.counters["refused_connections"]
        with socket.create_connection(parse_address(pair.decode.data_address), timeout=5) as sock:
            sock.sendall(f.message_frame(f.FrameKind.CONNECT, m.encode(msg)))
            sock.settimeout(5)
            assert sock.recv(1) == b"", "the decode kept a connection it should have refused"
        wait_for(lambda: pair.decode.counters["refused_connections"] == before + 1, what="refusal counted")

    attempt(seen)  # replayed as is
    attempt(m.Connect(engine=seen.engine, epoch=seen.epoch + 1, proof=seen.proof))  # a higher epoch
    assert pair.decode.receiver.peers[pair.peer].conn == conn
    # the writer's connection is fenced; the decode offers epoch + 1 with a fresh nonce: race it
    assert pair.decode.fence(conn, "test fence")
    wait_for(lambda: pair.decode.receiver.peers[pair.peer].offered > conn[1], what="the next offer")
    attempt(m.Connect(engine=seen.engine, epoch=conn[1] + 1, proof=seen.proof))  # refused before or after
    pair.wait_reconnected(conn[1])
    src = pair.transfer("after", 3 * PAGE_TOKENS, seed=5)
    assert pair.decode.wait("after").state is R.READABLE
    pair.expect_content("after", src)


def test_offers_pointing_at_a_black_hole_do_not_hold_up_other_peers(engines):
    """Finding 6: a peer's OFFER makes the prefill connect where the peer says. Two rogue decodes
    point it at a port that never answers (a full accept queue): the honest transfer still completes
    while those connects hang, because they run off the control thread."""
    import socket

    from kvxfer.transport.tcp import encode_offer

    pair = engines(keyed=False)
    if pair.decode.config.transport != "tcp":
        pytest.skip("the black hole is a tcp port")
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(0)
    fillers = []
    for _ in range(3):  # fill the accept queue: further SYNs are dropped, connects hang
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(hole.getsockname())
        fillers.append(s)
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.ROUTER)
    inbox.setsockopt(zmq.LINGER, 0)
    port = inbox.bind_to_random_port("tcp://127.0.0.1")
    layout = pair.decode.layout
    rogues = ["rogue-1", "rogue-2"]
    try:
        for name in rogues:
            with raw_peer(pair.prefill.address, ring=None, identity=name) as sock:
                sock.send(m.encode(m.Hello(
                    engine=name, role="decode", session=bytes(16), reply_to=f"tcp://127.0.0.1:{port}",
                    transport="tcp", page_size=layout.page_size, num_pages=layout.num_pages,
                    item_lens=[int(x) for x in layout.item_lens], pool_tokens=layout.pool_tokens,
                    max_context=pair.decode.config.max_context, checksum=pair.decode.config.checksum)))
                wait_for(lambda n=name: n in pair.prefill.peers, what="rogue peered")
                sock.send(m.encode(m.Offer(epoch=1, nonce=bytes(16),
                                           blob=encode_offer("{}:{}".format(*hole.getsockname())))))
                wait_for(lambda n=name: pair.prefill.peers[n].connector is not None, what="connect started")
        src = pair.transfer("honest", 3 * PAGE_TOKENS, seed=6)
        assert pair.decode.wait("honest").state is R.READABLE
        pair.expect_content("honest", src)
        # the rogue connects were still hanging all along (a tcp connect gives up after 10 s)
        assert all(pair.prefill.peers[n].connector is not None for n in rogues)
    finally:
        inbox.close(0)
        ctx.term()
        for s in fillers:
            s.close()
        hole.close()


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_a_dropped_data_connection_is_noticed_by_both_and_replaced(engines, side):
    """Finding 5: one side's data connection ends (decode: a stream error; prefill: its socket gone).
    Within a few heartbeat intervals (0.2 s here) both sides hold the same new epoch, the request in
    flight ended under the usual rules, and the next request goes through: no restart."""
    pair = engines()
    old = pair.decode.receiver.peers[pair.peer].conn
    pair.prefill.admit("victim", 2 * PAGE_TOKENS)
    pair.decode.admit("victim", 2 * PAGE_TOKENS, peer=pair.peer)
    pair.prefill.wait_ready("victim")
    if side == "decode":
        needs(pair, "raw_frames")
        pair.link.post_raw([b"XX" + b"\x00" * 30])  # the decode's parser fails: it drops the stream
    else:  # the writer's end fails; over verbs the decode learns it from the writer's FENCED
        pair.link.abort_connection()

    pair.wait_reconnected(old[1], timeout=2.0)
    assert pair.decode.wait("victim").state is R.FAILED
    assert pair.prefill.wait("victim").state in (S.FAILED, S.ABORTED)
    src = pair.transfer("next", 3 * PAGE_TOKENS, seed=8)
    assert pair.decode.wait("next").state is R.READABLE
    pair.expect_content("next", src)


def test_a_request_is_bound_to_one_decode_by_default(engines):
    """Finding 2: with several decodes peered, admit() without a peer is refused (it would let any of
    them take the KV); with one it binds to it; any_peer=True is the explicit opt-in, under which the
    first META binds and another decode's META for the same request is refused."""
    from kvxfer.errors import InvalidArgument

    rings = Keyring.cluster(["prefill", "decode", "other"])
    pair = engines(prefill_config={"keyring": rings["prefill"]}, decode_config={"keyring": rings["decode"]})
    only = pair.prefill.admit("solo", 2 * PAGE_TOKENS)  # one decode peered: bound to it
    assert only.expected_peer == pair.decode.engine_id
    pair.prefill.abort("solo")
    other = DecodeEngine(make_layout(64), EngineConfig(max_context=64 * PAGE_TOKENS, keyring=rings["other"],
                                                       heartbeat_interval=0.2, transport=pair.decode.config.transport))
    try:
        other_peer = other.connect(pair.prefill.address)
        with pytest.raises(InvalidArgument, match="pass peer="):
            pair.prefill.admit("ambiguous", 2 * PAGE_TOKENS)
        assert pair.prefill.pool.ledger.free_count == pair.prefill.layout.num_pages  # nothing held
        pair.prefill.admit("open", 2 * PAGE_TOKENS, any_peer=True)
        other.admit("open", 2 * PAGE_TOKENS, peer=other_peer)  # the first META binds it to `other`
        wait_for(lambda: pair.prefill.status("open").peer == other.engine_id, what="bound by the first META")
        pair.decode.admit("open", 2 * PAGE_TOKENS, peer=pair.peer)  # a second decode's META is refused
        wait_for(lambda: pair.prefill.sender.stats[f"refused_{PeerError.code}"] >= 1, what="second META refused")
        assert pair.prefill.status("open").peer == other.engine_id
        pair.decode.abort("open")
        other.abort("open")
        pair.prefill.abort("open")
    finally:
        other.close()
