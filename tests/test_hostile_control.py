"""Hostile peers against the control plane and the resources it holds for them (issue 15, items 2
and 7 to 11): what a refused HELLO reveals, where an open control plane may bind, how many peers and
control sockets a HELLO flood leaves behind, sources pinned by a peer that never answers RESULT,
destination bytes a peer can make a prefill hold, log lines a peer can provoke, and the modes of
secret keys.

Real engines and real ZMQ sockets throughout (the ``engines`` fixture checks both pools after each
test); the attacker is a bare socket (``raw_peer``) or a real engine misused.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import stat
import subprocess
import sys
import time
import types

import numpy as np
import pytest
import zmq

from kvxfer import DecodeEngine, EngineConfig, PrefillEngine, ReceiverState, SenderState
from kvxfer.core.pool import PagePool
from kvxfer.engine.sender import Sender
from kvxfer.errors import ConfigError, PeerError
from kvxfer.integrations.sglang.settings import engine_config
from kvxfer.wire import messages as m
from kvxfer.wire.auth import Keyring

from .conftest import PAGE_TOKENS, fill_random, make_layout, wait_for
from .test_hostile_peers import raw_peer

R, S = ReceiverState, SenderState


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _closed_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports nothing listens on (bound once, then released)."""
    ports: set[int] = set()
    while len(ports) < count:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            ports.add(probe.getsockname()[1])
    return sorted(ports)


def _hello(identity: str, reply_to: str, *, page_size: int = PAGE_TOKENS, role: str = "decode",
           pages: int = 128) -> m.Hello:
    return m.Hello(engine=identity, role=role, session=os.urandom(16), reply_to=reply_to, transport="tcp",
                   page_size=page_size, num_pages=pages, item_lens=[1024] * 3, pool_tokens=pages * page_size,
                   max_context=pages * page_size, checksum="adler32")


def _transfer(pair, rid: str, tokens: int, *, seed: int = 0) -> np.ndarray:
    """An honest transfer (Pair.transfer) that must become READABLE with exactly the bytes written."""
    src = pair.transfer(rid, tokens, seed=seed)
    assert pair.decode.wait(rid).state is R.READABLE
    pair.expect_content(rid, src)
    return src


class _Inbox:
    """A ROUTER the stranger gives as its ``reply_to``: what the prefill answers arrives here."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"

    def receive(self, timeout_ms: int = 5000) -> tuple[bytes, m.Message]:
        assert self.sock.poll(timeout_ms), "no answer came back"
        identity, data = self.sock.recv_multipart()
        return identity, m.decode(data)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


# item 2: a refused HELLO reveals nothing; an open control plane stays on loopback ----------------------


def test_a_refused_hello_reveals_nothing_about_the_engine(engines, caplog):
    pair = engines(keyed=False)
    prefill = pair.prefill
    inbox = _Inbox()
    try:
        with raw_peer(prefill.address, ring=None, identity="stranger") as sock:
            refusals = [_hello("stranger", inbox.address, page_size=7),  # a layout probe
                        _hello("stranger", inbox.address, role="prefill"),  # the wrong role
                        _hello("someone-else", inbox.address)]  # a name that is not its own
            for hello in refusals:
                sock.send(m.encode(hello))
                identity, ack = inbox.receive()
                assert isinstance(ack, m.HelloAck) and not ack.ok
                # nothing about the engine: not its id (neither in the message nor as the routing id),
                # not its layout, not its capacity, and a reason that names no difference
                assert prefill.engine_id.encode() not in identity and prefill.engine_id not in ack.error
                assert ack.engine == ""
                assert (ack.page_size, ack.num_pages, ack.item_lens, ack.pool_tokens, ack.max_context) == (0, 0, [], 0, 0)
                assert not any(ch.isdigit() for ch in ack.error), ack.error
                assert "page_size" not in ack.error and "role" not in ack.error
    finally:
        inbox.close()
    assert prefill.counters["refused_hellos"] == 3
    assert list(prefill.peers) == [pair.decode.engine_id]
    # the details are in the refusing engine's own log
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "page_size 7" in logged and "'prefill'" in logged and "someone-else" in logged
    _transfer(pair, "after", 2 * PAGE_TOKENS)


def test_an_open_engine_refused_for_its_layout_learns_only_that_it_was_refused(engines):
    pair = engines(keyed=False)
    config = EngineConfig(max_context=16 * 8, heartbeat_interval=0.2)
    with DecodeEngine(make_layout(16, page_size=8), config) as other:
        with pytest.raises(PeerError, match="refused") as err:
            other.connect(pair.prefill.address, timeout=5.0)
    assert "page_size" not in str(err.value) and pair.prefill.engine_id not in str(err.value)


def test_an_authenticated_peer_refused_for_its_layout_is_told_why(engines):
    rings = Keyring.cluster(["prefill", "decode", "other"])
    pair = engines(prefill_config={"keyring": rings["prefill"]}, decode_config={"keyring": rings["decode"]})
    config = EngineConfig(max_context=16 * 8, keyring=rings["other"], heartbeat_interval=0.2)
    with DecodeEngine(make_layout(16, page_size=8), config) as other:
        with pytest.raises(PeerError, match="page_size 8 tokens != local 16"):
            other.connect(pair.prefill.address, timeout=5.0)


def test_an_open_control_plane_binds_loopback_only_unless_told_otherwise(caplog):
    for host in ("0.0.0.0", "10.1.2.3", "*", "eth0", "my-host.example"):
        with pytest.raises(ConfigError, match="allow_open_control") as err:
            EngineConfig(max_context=64, host=host).validate()
        assert "keyring" in str(err.value)
    with pytest.raises(ConfigError, match="KVXFER_ALLOW_OPEN_CONTROL"):
        EngineConfig.from_env({"KVXFER_MAX_CONTEXT": "64", "KVXFER_HOST": "10.0.0.7"})
    with pytest.raises(ConfigError, match="KVXFER_KEYRING"):  # an SGLang rank told to bind a real address
        engine_config(types.SimpleNamespace(context_length=2048), pool_tokens=4096, rank=0,
                      environ={"KVXFER_HOST": "10.0.0.7"})
    with pytest.raises(ConfigError, match="allow_open_control"):
        PrefillEngine(make_layout(16), EngineConfig(max_context=16 * PAGE_TOKENS, host="0.0.0.0"))
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"):
        EngineConfig(max_context=64, host=host).validate()  # loopback: open is fine
    EngineConfig(max_context=64, host="10.1.2.3", keyring=Keyring.generate("k")).validate()  # authenticated
    assert EngineConfig.from_env({"KVXFER_MAX_CONTEXT": "64", "KVXFER_HOST": "10.0.0.7",
                                  "KVXFER_ALLOW_OPEN_CONTROL": "1"}).allow_open_control is True
    # told explicitly: it starts, and says so
    caplog.set_level(logging.WARNING, logger="kvxfer")
    config = EngineConfig(max_context=16 * PAGE_TOKENS, host="0.0.0.0", allow_open_control=True,
                          advertise_host="127.0.0.1")
    with PrefillEngine(make_layout(16), config) as engine:  # binds every interface, advertises what peers reach
        assert engine.address.startswith("tcp://127.0.0.1:")
    assert any("allow_open_control" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


# item 7: a HELLO flood leaves a bounded peer table and no sockets behind ------------------------------


def test_a_hello_flood_leaves_a_bounded_peer_table_and_no_sockets_behind(engines):
    pair = engines(keyed=False, max_peers=8, peer_timeout=1.0)
    prefill = pair.prefill
    time.sleep(0.3)
    baseline = _open_fds()
    flooders = 40
    ports = _closed_ports(flooders + 20)
    ctx = zmq.Context()
    socks = []
    try:
        for i in range(flooders):  # distinct identities, each with its own reply address
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, f"flood-{i}".encode())
            sock.connect(prefill.address)
            socks.append(sock)
            sock.send(m.encode(_hello(f"flood-{i}", f"tcp://127.0.0.1:{ports[i]}")))
        for j in range(20):  # one identity HELLOing again and again, each time from a new address
            socks[0].send(m.encode(_hello("flood-0", f"tcp://127.0.0.1:{ports[flooders + j]}")))
        wait_for(lambda: prefill.counters["refused_hellos"] >= flooders - 7, what="HELLOs beyond max_peers refused")
        time.sleep(0.3)
        assert len(prefill.peers) <= 8
        assert len(prefill.control._out) <= 8, "a control socket per address the flood named"
    finally:
        for sock in socks:
            sock.close(0)
        ctx.term()
    # the stranger left: its peers go silent, are forgotten, and their sockets closed
    wait_for(lambda: list(prefill.peers) == [pair.decode.engine_id], timeout=10, what="silent peers forgotten")
    wait_for(lambda: len(prefill.control._out) == 1, timeout=5, what="their control sockets closed")
    wait_for(lambda: _open_fds() <= baseline + 4, timeout=5, what=f"file descriptors back near {baseline}")
    assert prefill.counters["peers_forgotten"] >= 7
    _transfer(pair, "after", 2 * PAGE_TOKENS)


def test_a_full_peer_table_makes_room_by_evicting_a_dead_peer(engines):
    pair = engines(keyed=False, max_peers=2, peer_timeout=0.5, peer_expiry=60.0)
    other = DecodeEngine(make_layout(16), EngineConfig(max_context=16 * PAGE_TOKENS, heartbeat_interval=0.2,
                                                       peer_timeout=0.5))
    inbox = _Inbox()
    try:
        other.connect(pair.prefill.address)
        gone = other.engine_id
        wait_for(lambda: pair.prefill.peers[gone].link is not None, what="its data connection")
        with raw_peer(pair.prefill.address, ring=None, identity="late") as sock:
            sock.send(m.encode(_hello("late", inbox.address)))
            _, ack = inbox.receive()
            assert not ack.ok  # two live peers: the table is full
            other.close()
            wait_for(lambda: not pair.prefill.peers[gone].alive, what="the closed decode seen dead")
            assert gone in pair.prefill.peers  # it had a data connection: kept until peer_expiry ...
            sock.send(m.encode(_hello("late", inbox.address)))
            _, ack = inbox.receive()
            assert ack.ok  # ... unless its place is needed
    finally:
        other.close()
        inbox.close()
    assert gone not in pair.prefill.peers and {"late", pair.decode.engine_id} <= set(pair.prefill.peers)
    assert pair.prefill.counters["peers_forgotten"] == 1
    _transfer(pair, "after", 2 * PAGE_TOKENS)


# item 8: a peer that takes the KV and never answers RESULT ---------------------------------------------


@pytest.mark.usefixtures("transport")
def test_a_peer_that_never_answers_result_cannot_pin_the_sources(engines):
    pair = engines(result_timeout=0.5)
    decode_send = pair.decode.receiver._send
    pair.decode.receiver._send = lambda peer, msg, conn=None: (None if isinstance(msg, m.Result)
                                                              else decode_send(peer, msg, conn))
    try:
        pair.prefill.admit("mute", 6 * PAGE_TOKENS, peer=pair.decode.engine_id)
        pair.decode.admit("mute", 6 * PAGE_TOKENS, peer=pair.peer)
        pair.prefill.wait_ready("mute")
        fill_random(pair.prefill.layout, pair.prefill.source_pages("mute"), 1)
        pair.prefill.send("mute")
        assert pair.decode.wait("mute").state is R.READABLE  # it took the KV, and heartbeats on
        final = pair.prefill.wait("mute", timeout=10)
        assert final.state is S.FAILED and final.error.reason == "result_timeout"
        wait_for(lambda: pair.prefill.pool.ledger.free_count == pair.prefill.layout.num_pages,
                 what="the sources released")
        assert pair.prefill.sender.stats["result_timeouts"] == 1
    finally:
        pair.decode.receiver._send = decode_send
    pair.decode.release("mute")
    _transfer(pair, "next", 3 * PAGE_TOKENS, seed=2)  # the connection still serves


@pytest.mark.usefixtures("transport")
def test_a_result_timeout_with_writes_still_in_flight_closes_the_link_before_freeing(engines):
    pair = engines(result_timeout=0.5)
    pair.prefill.admit("stuck", 6 * PAGE_TOKENS, peer=pair.decode.engine_id)
    pair.decode.admit("stuck", 6 * PAGE_TOKENS, peer=pair.peer)
    pair.prefill.wait_ready("stuck")
    pair.faults.pause()  # the writes never leave: as if the peer stopped reading the data socket
    pair.prefill.send("stuck")
    final = pair.prefill.wait("stuck", timeout=10)  # settled: failed, and the link known drained
    assert final.state is S.FAILED and final.error.reason == "result_timeout"
    wait_for(lambda: pair.prefill.pool.ledger.free_count == pair.prefill.layout.num_pages,
             what="the sources released")
    assert pair.decode.wait("stuck", timeout=10).state in (R.FAILED, R.ABORTED)
    wait_for(lambda: pair.decode.pool.ledger.free_count == pair.decode.layout.num_pages, what="decode pages freed")
    pair.wait_reconnected(1)
    _transfer(pair, "next", 2 * PAGE_TOKENS, seed=3)


class _HeldLink:
    """A link that completes every write at once but holds what it is asked to order: DONE stays
    unbuilt until the test builds it (a transport still busy before it), or the link ends."""

    conn_id = ("decode", 1)
    epoch = 1

    def __init__(self) -> None:
        self.alive = True
        self.ordered: list = []

    def post_writes(self, batch, on_complete) -> None:
        on_complete(batch, len(batch), 0)

    def post_ordered(self, msg, *, slot: int, gen: int) -> None:
        self.ordered.append(msg)


def test_after_a_result_timeout_the_sources_wait_until_done_is_built_or_the_link_ends():
    """The drain rule, exactly: the request fails at ``result_timeout``, but its sources return to
    the pool (and ``settled`` says so) only once the transport built DONE (its checksum may still read
    them) or the link is gone."""
    pool = PagePool(make_layout(16))
    now = [0.0]
    link = _HeldLink()
    sender = Sender(pool, max_context=16 * PAGE_TOKENS, checksum="none", result_timeout=5.0,
                    link_for=lambda peer: link, clock=lambda: now[0])
    for gen, rid in enumerate(("built", "gone"), start=1):
        sender.admit(rid, 4 * PAGE_TOKENS, peer="decode")
        sender.on_meta("decode", m.Meta(rid=rid, gen=gen, slot=gen, tokens=4 * PAGE_TOKENS,
                                        pages=np.arange(4, dtype=np.uint32) + 4 * gen))
        sender.send(rid)
    built, gone = sender._lookup("built"), sender._lookup("gone")
    assert built.state is gone.state is S.DONE_SENT and built.quiescent and gone.quiescent
    now[0] = 4.9
    sender.tick()
    assert built.state is S.DONE_SENT
    now[0] = 5.1
    assert sender.tick() == []  # every write was taken: no link to close
    assert built.state is gone.state is S.FAILED and built.error.reason == "result_timeout"
    assert not sender.settled(built) and not sender.settled(gone) and pool.ledger.free_count == 8
    done = link.ordered[0]()  # the transport reaches the first DONE and builds it
    assert isinstance(done, m.Done) and done.rid == "built"
    assert sender.settled(built) and not sender.settled(gone) and pool.ledger.free_count == 12
    link.alive = False  # the link ends with the second DONE still queued
    sender.tick()
    assert sender.settled(gone) and pool.ledger.free_count == 16 and not sender.undrained
    assert sender.stats["result_timeouts"] == 2
    sender.check_accounting()


# item 9: destination bytes held for a peer ------------------------------------------------------------


def test_a_meta_larger_than_any_prompt_this_engine_admits_is_not_held(engines):
    rings = Keyring.cluster(["prefill", "decode", "flooder"])
    pair = engines(prefill_config={"keyring": rings["prefill"]}, decode_config={"keyring": rings["decode"]})
    most = pair.prefill.layout.pages_for_tokens(pair.prefill.config.max_context)
    with DecodeEngine(make_layout(16), EngineConfig(max_context=16 * PAGE_TOKENS, keyring=rings["flooder"])) as flooder:
        flooder.connect(pair.prefill.address)
        for i in range(8):
            meta = m.Meta(rid=f"huge-{i}", gen=10 + i, slot=1, tokens=PAGE_TOKENS,
                          pages=np.arange(1_000_000, dtype=np.uint32))
            flooder.control.send(pair.prefill.address, meta)
        # one just past the largest prompt this prefill admits, for a prompt of that size
        meta = m.Meta(rid="one-more", gen=100, slot=1, tokens=(most + 1) * PAGE_TOKENS,
                      pages=np.arange(most + 1, dtype=np.uint32))
        flooder.control.send(pair.prefill.address, meta)
        wait_for(lambda: pair.prefill.sender.stats["oversized_meta"] >= 9, timeout=20, what="oversized METAs refused")
        assert not pair.prefill.sender.pending_meta
    _transfer(pair, "honest", 2 * PAGE_TOKENS)


def test_destinations_held_for_a_peer_are_capped_in_bytes(engines):
    rings = Keyring.cluster(["prefill", "decode", "flooder"])
    cap = 64 * 1024
    pair = engines(prefill_config={"keyring": rings["prefill"], "max_pending_meta_bytes": cap},
                   decode_config={"keyring": rings["decode"]})
    pages = pair.prefill.layout.pages_for_tokens(pair.prefill.config.max_context)  # the largest allowed
    with DecodeEngine(make_layout(16), EngineConfig(max_context=16 * PAGE_TOKENS, keyring=rings["flooder"])) as flooder:
        flooder.connect(pair.prefill.address)
        for i in range(400):
            meta = m.Meta(rid=f"flood-{i}", gen=10 + i, slot=1, tokens=pages * PAGE_TOKENS,
                          pages=np.arange(pages, dtype=np.uint32))
            flooder.control.send(pair.prefill.address, meta)
        held_most = cap // (pages * 8)
        wait_for(lambda: pair.prefill.sender.stats["meta_bytes_refused"] >= 400 - held_most, timeout=20,
                 what="destinations past the byte cap refused")
        held = sum(e[1].pages.nbytes for entries in pair.prefill.sender.pending_meta.values() for e in entries)
        assert held <= cap and len(pair.prefill.sender.pending_meta) == held_most
        _transfer(pair, "honest", 2 * PAGE_TOKENS)  # another peer's destinations are not held up


# item 10: every log line a peer can provoke is rate limited --------------------------------------------


def _warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("kvxfer")]


def test_messages_from_a_non_peer_do_not_flood_the_log(engines, caplog):
    rings = Keyring.cluster(["prefill", "decode", "noisy"])
    pair = engines(prefill_config={"keyring": rings["prefill"]}, decode_config={"keyring": rings["decode"]})
    caplog.clear()
    count = 3000
    with raw_peer(pair.prefill.address, ring=rings["noisy"], identity="noisy") as sock:
        for i in range(count):
            sock.send(m.encode(m.Heartbeat(engine="noisy", seq=i)))
        wait_for(lambda: pair.prefill.counters["refused_messages"] >= count, timeout=30, what="all counted")
    lines = _warnings(caplog)
    assert len(lines) <= 150, f"{len(lines)} warning lines from {count} messages"
    assert any("suppressed" in r.getMessage() for r in lines) or len(lines) < count


def test_aborts_for_requests_a_peer_never_had_do_not_flood_the_log(engines, caplog):
    pair = engines()
    caplog.clear()
    count = 2000
    for i in range(count):
        pair.decode.control.send(pair.prefill.address, m.Abort(rid=f"nope-{i}", gen=100_000 + i, reason="x",
                                                               detail="never had it"))
    wait_for(lambda: pair.prefill.sender.stats["stale_abort"] >= count, timeout=30, what="all counted")
    wait_for(lambda: pair.decode.receiver.stats["stale_messages"] >= count, timeout=30, what="acks came back")
    time.sleep(0.5)  # the ERRORs the decode sends back
    lines = _warnings(caplog)
    assert len(lines) <= 200, f"{len(lines)} warning lines from {count} ABORTs"
    _transfer(pair, "after", 2 * PAGE_TOKENS)


def test_a_flood_from_many_identities_is_rate_limited_as_a_whole(engines, caplog):
    pair = engines(keyed=False)
    caplog.clear()
    ctx = zmq.Context()
    socks = []
    try:
        for i in range(150):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, f"noisy-{i}".encode())
            sock.connect(pair.prefill.address)
            socks.append(sock)
        for _ in range(4):
            for i, sock in enumerate(socks):
                sock.send(m.encode(m.Heartbeat(engine=f"noisy-{i}", seq=1)))
        wait_for(lambda: pair.prefill.counters["refused_messages"] >= 600, timeout=30, what="all counted")
    finally:
        for sock in socks:
            sock.close(0)
        ctx.term()
    lines = _warnings(caplog)
    assert len(lines) <= 300, f"{len(lines)} warning lines from 600 messages of 150 identities"
    assert len(pair.prefill.events._seen) <= 2 * pair.prefill.events.max_keys + 16


# item 11: secret key files --------------------------------------------------------------------------


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_saving_a_keyring_over_a_readable_secret_makes_it_private(tmp_path):
    ring = Keyring.generate("p0")
    ring.save(tmp_path / "p0")
    secret = tmp_path / "p0" / "self.key_secret"
    os.chmod(secret, 0o644)
    inode = os.stat(secret).st_ino
    ring.save(tmp_path / "p0")
    assert _mode(secret) == 0o600
    assert os.stat(secret).st_ino != inode  # replaced (atomically), not rewritten in place
    assert not [p.name for p in (tmp_path / "p0").iterdir() if p.name.startswith(".")]  # no temporary left
    assert Keyring.load(tmp_path / "p0").secret == ring.secret


def test_keygen_force_over_a_readable_secret_leaves_it_private(tmp_path):
    keygen = [sys.executable, "-m", "kvxfer", "keygen", str(tmp_path), "p0", "d0"]
    assert subprocess.run(keygen, capture_output=True, timeout=60).returncode == 0
    secret = tmp_path / "p0" / "self.key_secret"
    os.chmod(secret, 0o644)
    out = subprocess.run([*keygen, "--force"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert _mode(secret) == 0o600 and _mode(tmp_path / "d0" / "self.key_secret") == 0o600


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_loading_a_secret_others_can_read_is_refused(tmp_path, mode):
    Keyring.generate("p0").save(tmp_path / "p0")
    secret = tmp_path / "p0" / "self.key_secret"
    os.chmod(secret, mode)
    with pytest.raises(ConfigError, match=re.escape(str(secret)) + f".*0o?{mode:o}") as err:
        Keyring.load(tmp_path / "p0")
    assert "chmod 600" in str(err.value)
    with pytest.raises(ConfigError, match="chmod 600"):
        PrefillEngine(make_layout(16), EngineConfig(max_context=16 * PAGE_TOKENS, keyring=str(tmp_path / "p0")))
    os.chmod(secret, 0o600)
    Keyring.load(tmp_path / "p0")
    os.chmod(secret, 0o400)
    Keyring.load(tmp_path / "p0")


@pytest.mark.parametrize("keyed", [False, True], ids=["open", "keyring"])
def test_a_peer_that_reopens_its_socket_before_its_old_messages_were_read_is_still_heard(keyed):
    """A prefill forgets a decode (closing its control socket) while the decode is stopped or busy,
    then tells it "not peered" over a new socket under the same engine id. If the decode had not read
    the old socket's messages yet, ZMQ's ROUTER refused the new connection's id as a duplicate and
    parked it: nothing from that peer was ever delivered again, so the decode never peered again
    (CI: test_a_decode_the_prefill_forgot_while_it_was_stopped_peers_again_by_itself). The newer
    connection must take over the id, with or without a keyring."""
    from kvxfer.wire.control import ControlPlane

    rings = Keyring.cluster(["decode", "prefill"]) if keyed else {"decode": None, "prefill": None}
    receiver = ControlPlane("decode", keyring=rings["decode"])
    sender = ControlPlane("prefill", keyring=rings["prefill"])
    try:
        address = receiver.address
        sender.send(address, m.Heartbeat(engine="prefill", seq=0))
        deadline = time.monotonic() + 5
        got: list[tuple[str, bytes]] = []
        while not got and time.monotonic() < deadline:
            got = receiver.receive(100)
        assert got and got[0][0] == "prefill"
        for seq in range(1, 21):  # queued at the receiver, which does not read them yet
            sender.send(address, m.Heartbeat(engine="prefill", seq=seq))
        time.sleep(0.3)
        sender.forget(address)  # the old socket goes
        time.sleep(0.1)
        sender.send(address, m.Error(about="HEARTBEAT", code="not_peered", rid="?", gen=0, detail="HELLO again"))
        time.sleep(0.3)
        heard: list[m.Message] = []  # under the engine id
        renamed: list[m.Message] = []  # the old connection's unread rest, under a name ZMQ made up
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any(isinstance(x, m.Error) for x in heard):
            for identity, data in receiver.receive(100):
                (heard if identity == "prefill" else renamed).append(m.decode(data))
        assert any(isinstance(x, m.Error) for x in heard), f"the new socket's message was lost: heard {len(heard)}"
        # nothing of the new socket goes astray; what the old one left unread comes under another
        # name (a peering that ended: the engines refuse it as from a stranger)
        assert all(isinstance(x, m.Heartbeat) for x in renamed), renamed
    finally:
        sender.close()
        receiver.close()


# issue 41, finding 4: what a failed connect leaves on a decode ------------------------------------------


def test_failed_connects_leave_no_control_socket_and_no_pending_hello(engines):
    """A decode asked to peer with addresses nothing listens on, or with a prefill that refuses it, keeps
    no socket reconnecting to them (3 of 3 stayed open and retrying before) and no pending HELLO; the
    peering it has keeps working."""
    pair = engines(keyed=False)
    decode = pair.decode
    baseline = decode.control.open_sockets()
    assert baseline == 1  # the prefill it peered with
    for port in _closed_ports(3):  # nothing answers: timed out
        with pytest.raises(PeerError, match=f"no answer from prefill at tcp://127.0.0.1:{port}"):
            decode.connect(f"tcp://127.0.0.1:{port}", timeout=0.3)
    with PrefillEngine(make_layout(16, page_size=8),
                       EngineConfig(max_context=16 * 8, heartbeat_interval=0.2)) as other:
        with pytest.raises(PeerError, match="refused"):  # a prefill refusing the peering (its layout)
            decode.connect(other.address, timeout=5.0)
    wait_for(lambda: decode.control.open_sockets() == baseline, timeout=3,
             what=f"the decode's control sockets back to {baseline}")
    assert not decode._pending_hello
    assert list(decode.receiver.peers) == [pair.peer]
    _transfer(pair, "after", 2 * PAGE_TOKENS)


def test_a_refusal_sent_to_an_unreachable_address_is_released_after_peer_timeout(engines):
    """refuse() to an address with no prefill behind it: its HELLO waits for no answer, and once that
    wait ends (peer_timeout) nothing is left: no pending HELLO, no control socket."""
    pair = engines(keyed=False, peer_timeout=1.0)
    decode = pair.decode
    baseline = decode.control.open_sockets()
    for port in _closed_ports(3):
        decode.refuse(f"nobody-{port}", f"tcp://127.0.0.1:{port}")
    assert decode.control.open_sockets() == baseline + 3 and len(decode._pending_hello) == 3
    wait_for(lambda: not decode._pending_hello and decode.control.open_sockets() == baseline, timeout=5,
             what="refusals' HELLOs and sockets released")
    _transfer(pair, "after", 2 * PAGE_TOKENS)


def test_a_keyed_decode_refusing_keyless_or_untrusted_addresses_keeps_nothing_for_them(engines):
    """A keyed decode refuses, before sending anything, to talk to an address without a trusted key:
    connect() and refuse() raise naming the address, and leave no pending HELLO and no socket."""
    pair = engines()
    decode = pair.decode
    baseline = decode.control.open_sockets()
    (port,) = _closed_ports(1)
    keyless = f"tcp://127.0.0.1:{port}"
    untrusted = Keyring.generate("stranger").address(keyless)
    with pytest.raises(PeerError, match=re.escape(keyless) + ".*no server key"):
        decode.connect(keyless, timeout=1.0)
    with pytest.raises(PeerError, match="not in this engine's keyring"):
        decode.connect(untrusted, timeout=1.0)
    with pytest.raises(PeerError, match=re.escape(keyless) + ".*no server key"):
        decode.refuse("r1", keyless)
    assert not decode._pending_hello
    assert decode.control.open_sockets() == baseline
    _transfer(pair, "after", 2 * PAGE_TOKENS)


# issue 41, finding 5: a prefill's per-peer state belongs to one peering ---------------------------------


def test_meta_replay_protection_is_per_peering_and_forgetting_a_peer_drops_its_state():
    """Within one peering a META not after the newest is a replay (stale_meta); Sender.forget_peer (a
    new HELLO, or the peer forgotten) ends that peering: its replay entry goes, a destination it left
    held for a request not admitted here becomes a rejection naming it (admission fails at once, not
    bound to pages of a peering that ended), and the next peering's generation 1 is taken, and names
    the next peering's request, not the old one's."""
    pool = PagePool(make_layout(32))
    link = _HeldLink()
    sender = Sender(pool, max_context=16 * PAGE_TOKENS, checksum="none", link_for=lambda peer: link)

    def meta(rid: str, gen: int) -> m.Meta:
        return m.Meta(rid=rid, gen=gen, slot=gen, tokens=2 * PAGE_TOKENS, pages=np.arange(2, dtype=np.uint32) + 2 * gen)

    sender.admit("a", 2 * PAGE_TOKENS, peer="pod-0")
    sender.on_meta("pod-0", meta("a", 1))
    sender.abort("a")
    sender.on_meta("pod-0", meta("held", 2))  # a destination for a request not admitted here
    sender.on_meta("pod-0", meta("replay", 2))  # the same peering: refused as a replay
    assert sender.stats["stale_meta"] == 1 and "replay" not in sender.pending_meta
    assert sender.meta_gen_seen == {"pod-0": 2} and "held" in sender.pending_meta
    assert sender.forget_peer("pod-0", "test: a new HELLO") == {"meta_gen_seen": 1, "pending_meta": 1}
    assert sender.meta_gen_seen == {} and sender.pending_meta == {}
    assert sender.forget_peer("pod-0", "again") == {"meta_gen_seen": 0, "pending_meta": 0}
    failed = sender.admit("held", 2 * PAGE_TOKENS, peer="pod-0")
    assert failed.state is S.FAILED and "decode pod-0's destination for it is gone" in str(failed.error)
    # the next peering (a restarted decode) counts from 1 again: taken, and (peer, 1) is its request now
    assert sender.by_gen[("pod-0", 1)].rid == "a"
    sender.admit("b", 2 * PAGE_TOKENS, peer="pod-0")
    sender.on_meta("pod-0", meta("b", 1))
    assert sender.stats["stale_meta"] == 1 and sender._lookup("b").state is S.READY
    assert sender.by_gen[("pod-0", 1)].rid == "b"
    sender.on_meta("pod-0", meta("c", 1))  # and within this peering, replays are refused again
    assert sender.stats["stale_meta"] == 2
    sender.abort("b")
    sender.check_accounting()
    assert pool.ledger.free_count == 32
