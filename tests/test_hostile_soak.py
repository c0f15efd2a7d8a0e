"""A soak: the attacks of tests/test_hostile_*.py at once, concurrently with honest traffic.

For a bounded time (SOAK_SECONDS) attacker threads run against a real prefill/decode pair on an
authenticated control plane, over every registered transport here (tcp and shm; verbs inside the
VM): a HELLO flood from untrusted keys, a flood of idle connections and oversized headers at the
decode's data port (tcp), replayed and forged CONNECTs, a trusted but malicious decode sending
destinations for requests it does not serve, and writes outside their window on the honest link.
Meanwhile the honest requests keep going. At the end: both engines are up, every honest request
became READABLE with exactly the bytes written, no page is leaked, corrupted or lost (the fixture's
accounting check), and the growth of memory and threads is bounded. The test writes its figures as
JSON (``soak.json`` in its temp dir, and on stdout).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import numpy as np
import pytest
import zmq

from kvxfer import DecodeEngine, EngineConfig, ReceiverState
from kvxfer.wire import frames as f
from kvxfer.wire import messages as m
from kvxfer.wire.auth import Keyring, split_address

from .conftest import PAGE_TOKENS, make_layout, needs

R = ReceiverState
pytestmark = [pytest.mark.usefixtures("transport"), pytest.mark.slow]
SOAK_SECONDS = float(os.environ.get("KVXFER_SOAK_SECONDS", "8"))


def _rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class _Attackers:
    """Attacker threads; each counts what it did and stops when told."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.counts: dict[str, int] = {}
        self.threads: list[threading.Thread] = []
        self.errors: list[str] = []

    def run(self, name: str, body) -> None:
        def loop() -> None:
            while not self.stop.is_set():
                try:
                    body()
                    self.counts[name] = self.counts.get(name, 0) + 1
                except Exception as exc:  # the attack failing is fine; the engines must not
                    self.counts[f"{name}_failed"] = self.counts.get(f"{name}_failed", 0) + 1
                    if len(self.errors) < 20:
                        self.errors.append(f"{name}: {type(exc).__name__}: {exc}")

        thread = threading.Thread(target=loop, name=f"soak-{name}", daemon=True)
        self.threads.append(thread)
        thread.start()

    def join(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=15)


def test_attacks_during_honest_traffic_change_no_outcome_and_leak_nothing(engines, tmp_path):
    rings = Keyring.cluster(["prefill", "decode", "mallory", "flooder"])
    pair = engines(prefill_config={"keyring": rings["prefill"], "result_timeout": 2.0},
                   decode_config={"keyring": rings["decode"]})
    mallory = DecodeEngine(make_layout(64), EngineConfig(max_context=64 * PAGE_TOKENS, keyring=rings["mallory"],
                                                         heartbeat_interval=0.2,
                                                         transport=pair.decode.config.transport))
    flooder = DecodeEngine(make_layout(16), EngineConfig(max_context=16 * PAGE_TOKENS, keyring=rings["flooder"],
                                                         heartbeat_interval=0.2,
                                                         transport=pair.decode.config.transport))
    attackers = _Attackers()
    ctx = zmq.Context()
    rss0, threads0 = _rss_mib(), threading.active_count()
    try:
        mallory_peer = mallory.connect(pair.prefill.address)
        flooder.connect(pair.prefill.address)
        endpoint, server_key = split_address(pair.prefill.address)
        serial = iter(range(10**9))

        def hello_flood() -> None:  # an untrusted key: refused at the CURVE handshake
            stranger = Keyring.generate(f"stranger-{next(serial)}")
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (server_key, stranger.public,
                                                                                 stranger.secret)
            sock.connect(endpoint)
            try:
                sock.send(b"\x93\x02\xa5HELLO\x80", zmq.NOBLOCK)
            except zmq.Again:
                pass
            time.sleep(0.01)
            sock.close(0)

        def meta_flood() -> None:  # a trusted decode claiming requests it does not serve
            rid = f"victim-{next(serial) % 64}"
            flooder.control.send(pair.prefill.address, m.Meta(rid=rid, gen=10**6 + next(serial), slot=1,
                                                              tokens=PAGE_TOKENS, pages=np.array([0])))
            time.sleep(0.002)

        attackers.run("hello_flood", hello_flood)
        attackers.run("meta_flood", meta_flood)
        if pair.decode.config.transport == "tcp":
            host, port = pair.decode.data_address.rsplit(":", 1)

            def idle_connections() -> None:  # connect and never say CONNECT
                socks = [socket.create_connection((host, int(port)), timeout=2) for _ in range(20)]
                time.sleep(0.2)
                for s in socks:
                    s.close()

            def oversized_header() -> None:  # announce a 64 MiB CONNECT body
                with socket.create_connection((host, int(port)), timeout=2) as s:
                    s.sendall(f.FrameHeader(f.FrameKind.CONNECT, 0, 0, 0, 64 << 20, 0).pack())
                    s.settimeout(2)
                    s.recv(1)

            def forged_connect() -> None:  # a CONNECT with a made-up proof under the next epochs
                info = pair.decode.receiver.peers[pair.peer]
                forged = m.Connect(engine=pair.peer, epoch=info.epoch + 1, proof=os.urandom(32))
                with socket.create_connection((host, int(port)), timeout=2) as s:
                    s.sendall(f.message_frame(f.FrameKind.CONNECT, m.encode(forged)))
                    s.settimeout(2)
                    s.recv(1)

            attackers.run("idle_connections", idle_connections)
            attackers.run("oversized_header", oversized_header)
            attackers.run("forged_connect", forged_connect)

        honest, slowest = 0, 0.0
        deadline = time.monotonic() + SOAK_SECONDS
        while time.monotonic() < deadline:
            rid = f"honest-{honest}"
            started = time.monotonic()
            src = pair.transfer(rid, (1 + honest % 5) * PAGE_TOKENS, seed=honest)
            if honest % 3 == 0 and pair.decode.capabilities.raw_frames:
                needs(pair, "raw_frames")
                # a write outside its window on the honest link: refused, the transfer unharmed
                req = pair.decode.status(rid)
                item = int(pair.decode.layout.item_lens[0])
                header = f.write_header(req.slot, req.gen + 1000, 1, item)
                runs = f.pack_runs(np.array([0]), np.array([int(req.pages[0]) * item]), np.array([item]))
                pair.link.post_raw([header, runs, b"\xee" * item])
            assert pair.decode.wait(rid, timeout=30).state is R.READABLE, rid
            pair.expect_content(rid, src)
            pair.decode.release(rid)
            slowest = max(slowest, time.monotonic() - started)
            honest += 1
        attackers.join()
        # mallory takes a KV and never answers RESULT: the prefill frees the sources after result_timeout
        pair.prefill.admit("taken", 2 * PAGE_TOKENS, peer=mallory.engine_id)
        send = mallory.control.send  # mallory keeps heartbeating but never answers RESULT, on either path
        mallory.control.send = lambda address, msg: None if msg.TYPE == "RESULT" else send(address, msg)
        mallory.transport.answer = lambda conn, msg: True  # "sent" on the data connection: nothing is
        mallory.admit("taken", 2 * PAGE_TOKENS, peer=mallory_peer)
        pair.prefill.wait_ready("taken")
        pair.prefill.send("taken")
        assert pair.prefill.wait("taken", timeout=15).state.value in ("FAILED", "ABORTED")
        report = {
            "transport": pair.decode.config.transport,
            "seconds": SOAK_SECONDS,
            "honest_requests": honest,
            "honest_slowest_s": round(slowest, 3),
            "attacks": dict(attackers.counts),
            "rss_growth_mib": round(_rss_mib() - rss0, 1),
            "thread_growth": threading.active_count() - threads0,
            "prefill_counters": dict(pair.prefill.counters),
            "decode_counters": dict(pair.decode.counters),
            "decode_data_path": pair.decode.stats()["data_path"],
            "writes_refused": pair.decode.stats()["writes"]["refused_by_reason"],
            "prefill_peers": len(pair.prefill.peers),
        }
        (tmp_path / "soak.json").write_text(json.dumps(report, indent=2, default=str))
        print(json.dumps(report, default=str))
        assert honest >= 5, report
        assert report["attacks"].get("meta_flood", 0) > 0, report
        assert report["rss_growth_mib"] < 300, report
        assert report["thread_growth"] < 40, report
        assert report["prefill_peers"] <= 3, report  # decode, mallory, flooder: strangers never peered
        assert pair.prefill.pool.ledger.free_count == pair.prefill.layout.num_pages
    finally:
        attackers.join()
        mallory.close()
        flooder.close()
        ctx.term()
