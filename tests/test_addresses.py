"""Binding and advertising are separate settings, and a decode connects only to prefills it trusts
(issue 42): real engines, real sockets on this host."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import pytest

from kvxfer import DecodeEngine, EngineConfig, PrefillEngine, ReceiverState
from kvxfer.errors import ConfigError, PeerError
from kvxfer.tools.node import NodeSpec, spawn
from kvxfer.wire.addresses import advertised_host, local_addresses
from kvxfer.wire.auth import Keyring, write_cluster
from kvxfer.wire.trust import PeerAllowlist

from .conftest import PAGE_TOKENS, close_checked, fill_random, make_layout, wait_for

CONTEXT = 16 * PAGE_TOKENS


def test_a_wildcard_host_advertises_the_one_address_or_refuses_naming_them():
    assert advertised_host("127.0.0.1", None) == "127.0.0.1"
    assert advertised_host("0.0.0.0", "198.18.0.9") == "198.18.0.9"
    with pytest.raises(ConfigError, match="advertise_host '0.0.0.0' is a wildcard"):
        advertised_host("198.18.0.9", "0.0.0.0")
    found = local_addresses()
    for wildcard in ("0.0.0.0", "::", ""):
        if len(found) == 1:
            assert advertised_host(wildcard, None) == found[0]
            continue
        with pytest.raises(ConfigError, match="binds every interface") as err:
            advertised_host(wildcard, None)
        assert all(address in str(err.value) for address in found) and "KVXFER_ADVERTISE_HOST" in str(err.value)
    if len(found) != 1:  # the engine refuses at construction, before it binds anything
        with pytest.raises(ConfigError, match="binds every interface"):
            PrefillEngine(make_layout(16), EngineConfig(max_context=CONTEXT, host="0.0.0.0",
                                                        allow_open_control=True))


def _has_ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("host,advertise", [("0.0.0.0", "127.0.0.1"), ("::", "127.0.0.1"), ("[::]", "::1")],
                         ids=["ipv4-any", "ipv6-any-ipv4-peer", "ipv6-any-ipv6-peer"])
def test_an_engine_bound_to_every_interface_advertises_what_peers_reach_and_transfers(host, advertise):
    """A wildcard binds every interface (``::`` both families: an IPv4 peer reaches it too) and peers are
    told the advertised address, over which a request transfers."""
    if ":" in host and not _has_ipv6_loopback():
        pytest.skip("IPv6: this host has no ::1 to bind")
    rings = Keyring.cluster(["prefill", "decode"])
    base = EngineConfig(max_context=CONTEXT, heartbeat_interval=0.2, host=host, advertise_host=advertise)
    shown = f"[{advertise}]" if ":" in advertise else advertise
    engines = []
    try:
        prefill = PrefillEngine(make_layout(16), replace(base, keyring=rings["prefill"]))
        engines.append(prefill)
        decode = DecodeEngine(make_layout(32), replace(base, keyring=rings["decode"]))
        engines.append(decode)
        assert prefill.address.startswith(f"tcp://{shown}:") and "0.0.0.0" not in prefill.address
        assert decode.transport.address.startswith(f"{shown}:")
        peer = decode.connect(prefill.address, timeout=5)
        prefill.admit("w", 3 * PAGE_TOKENS, peer=decode.engine_id)
        decode.admit("w", 3 * PAGE_TOKENS, peer=peer)
        prefill.wait_ready("w")
        src = prefill.source_pages("w")
        fill_random(prefill.layout, src, 3)
        prefill.send("w")
        assert decode.wait("w").state is ReceiverState.READABLE
        with decode.read("w") as kv:
            for b in range(decode.layout.num_buffers):
                assert np.array_equal(kv.buffer(b), prefill.layout.views()[b][src])
        decode.release("w")
    finally:
        close_checked(engines)


def _node(role: str, keyring: str, host: str) -> NodeSpec:
    return NodeSpec(role=role, num_buffers=2, item_len=2048, num_pages=64 if role == "prefill" else 128, page_size=16,
                    config={"max_context": 1024, "heartbeat_interval": 0.2, "transport": "tcp", "keyring": keyring,
                            "host": host}, log_level="ERROR")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="network namespaces are Linux's")
def test_a_wildcard_host_with_one_address_advertises_it_and_a_peer_on_another_host_transfers(two_hosts, tmp_path):
    """Issue 42's default: engines bound to 0.0.0.0 with no advertise_host, each on a host (a network
    namespace of the TwoHosts bed) whose one non-loopback address is its 198.18 one. Each listens on
    every interface, advertises that address (the prefill's control address; the decode's reply address
    and data address, which the prefill dials from the other host), and requests arrive intact."""
    rings = {path.name: str(path) for path in write_cluster(tmp_path / "keys", ["prefill", "decode"])}
    for host in (two_hosts.a, two_hosts.b):  # what the engine inside sees: one address, its 198.18 one
        found = subprocess.run(host.argv([sys.executable, "-c", "from kvxfer.wire.addresses import "
                                          "local_addresses as f; print(*f())"]),
                               capture_output=True, text=True, check=True).stdout.split()
        assert found == [host.address]
    prefill = spawn(_node("prefill", rings["prefill"], "0.0.0.0"), netns=two_hosts.a)
    try:
        decode = spawn(_node("decode", rings["decode"], "0.0.0.0"), netns=two_hosts.b)
    except BaseException:
        prefill.close()
        raise
    try:
        assert prefill.control.startswith(f"tcp://{two_hosts.a.address}:") and "#curve=" in prefill.control
        assert decode.control.startswith(f"tcp://{two_hosts.b.address}:") and "0.0.0.0" not in decode.control
        port = prefill.control.split("#")[0].rsplit(":", 1)[1]
        listening = subprocess.run(two_hosts.argv("a", ["ss", "-ltn"]), capture_output=True, text=True).stdout
        assert f"0.0.0.0:{port} " in listening  # bound to every interface, advertised as the one address
        peer = decode.connect(address=prefill.control, timeout=10)
        for i in range(2):
            rid = f"w{i}"
            prefill.admit(rid=rid, tokens=800)
            decode.admit(rid=rid, tokens=800, peer=peer)
            prefill.prepare(rid=rid)
            prefill.send(rid=rid)
            assert decode.wait(rid=rid, timeout=15)["state"] == "READABLE"
            report = decode.read_check(rid=rid)
            assert report["pages"] == report["ok"] == 50 and report["corrupted_pages"] == 0, report
            # the next request needs this one's source pages (64 in the pool, 50 each): freed once the
            # prefill took the RESULT, which may come after the decode's READABLE
            assert prefill.wait(rid=rid, timeout=15)["state"] == "SUCCEEDED"
        # the prefill reached the decode at its advertised address: control (its answers) and data
        sockets = subprocess.run(two_hosts.argv("a", ["ss", "-tn"]), capture_output=True, text=True).stdout
        assert f"{two_hosts.b.address}:{decode.control.split('#')[0].rsplit(':', 1)[1]}" in sockets
        decode.accounting()
        prefill.accounting()
    finally:
        decode.close()
        prefill.close()


def test_a_prefill_says_which_decode_does_not_hear_its_answers_and_where_it_sent_them(caplog):
    """A decode advertising a reply address nothing listens at (127.0.0.2 on the port it bound on
    127.0.0.1) never hears the prefill's HELLO answer. The prefill's dial there fails without a word
    from the control plane; the prefill says so itself, naming the decode and the address, when the
    decode asks again without having offered a connection and when it goes silent; a decode that
    hears its answers is never named."""
    caplog.set_level(logging.WARNING, logger="kvxfer.engine")
    engines = []
    try:
        prefill = PrefillEngine(make_layout(16), EngineConfig(max_context=CONTEXT, heartbeat_interval=0.2,
                                                              peer_timeout=3.0))
        engines.append(prefill)
        deaf = DecodeEngine(make_layout(32), EngineConfig(max_context=CONTEXT, heartbeat_interval=0.2,
                                                          advertise_host="127.0.0.2"))
        engines.append(deaf)
        healthy = DecodeEngine(make_layout(32), EngineConfig(max_context=CONTEXT, heartbeat_interval=0.2))
        engines.append(healthy)
        assert deaf.address.startswith("tcp://127.0.0.2:")
        assert healthy.connect(prefill.address, timeout=5) == prefill.engine_id
        for _ in range(2):  # the second HELLO comes 1.2 s after the first was answered, nothing offered
            with pytest.raises(PeerError, match="no answer from prefill"):
                deaf.connect(prefill.address, timeout=1.2)

        def named() -> list[str]:
            return [r.getMessage() for r in caplog.records if "without offering a connection" in r.getMessage()]

        wait_for(lambda: len(named()) == 1, timeout=5, what="the prefill's warning at the second HELLO")
        assert deaf.engine_id in named()[0] and deaf.address in named()[0] and "asked to peer again" in named()[0]
        wait_for(lambda: prefill.counters["dead_peers"] >= 1, timeout=10, what="the deaf decode declared dead")
        wait_for(lambda: len(named()) == 2, timeout=5, what="the prefill's warning when it went silent")
        assert deaf.engine_id in named()[1] and deaf.address in named()[1] and "went silent" in named()[1]
        assert prefill.counters["unheard_replies"] == 2 and prefill.counters["dead_peers"] == 1
        assert not any(healthy.engine_id in line for line in named())
        assert healthy.engine_id in prefill.peers and prefill.peers[healthy.engine_id].alive
    finally:
        close_checked(engines)


def test_allowlist_entries_parse_and_match_as_written():
    allow = PeerAllowlist.parse(" 198.18.0.0/15, prefill-0.svc ,10.0.0.7:5555,[fd00::1]:7000,")
    assert allow.allows("tcp://198.19.3.4:1234") and not allow.allows("tcp://198.20.0.1:1234")
    assert allow.allows("tcp://prefill-0.svc:99") and not allow.allows("tcp://prefill-1.svc:99")
    assert allow.allows("tcp://10.0.0.7:5555") and not allow.allows("tcp://10.0.0.7:5556")
    assert allow.allows("tcp://[fd00::1]:7000") and not allow.allows("tcp://[fd00::1]:7001")
    assert PeerAllowlist.parse("").empty
    for bad in ("198.18.0.0/99", "host:port", "a:1:", "[fd00::1]:x", "ö.example"):
        with pytest.raises(ConfigError, match="trusted_prefills"):
            PeerAllowlist.parse(bad)
    with pytest.raises(ConfigError, match="trusted_prefills"):
        EngineConfig(max_context=CONTEXT, trusted_prefills="10.0.0.0/40").validate()


def test_a_decode_without_a_keyring_connects_only_to_loopback_and_listed_prefills():
    """An address a client names costs the decode nothing unless it trusts it: refused before any
    socket is opened; a listed one is tried (and, nobody answering, released afterwards)."""
    engines = []
    try:
        open_decode = DecodeEngine(make_layout(32), EngineConfig(max_context=CONTEXT, heartbeat_interval=0.2))
        engines.append(open_decode)
        sockets = open_decode.control.open_sockets()
        for address in ("tcp://198.18.77.1:5555", "tcp://[2001:db8::1]:5555", "tcp://example.com:80"):
            with pytest.raises(PeerError, match="refusing to connect to prefill at .*no keyring"):
                open_decode.connect(address, timeout=0.5)
            with pytest.raises(PeerError, match="refusing to connect"):
                open_decode.refuse("r", address)
        assert open_decode.control.open_sockets() == sockets and not open_decode._pending_hello
        assert open_decode.counters["untrusted_addresses"] == 6
        listed = DecodeEngine(make_layout(32), EngineConfig(max_context=CONTEXT, heartbeat_interval=0.2,
                                                            trusted_prefills="198.18.0.0/15"))
        engines.append(listed)
        started = time.monotonic()
        with pytest.raises(PeerError, match="no answer from prefill at tcp://198.18.77.1:5555"):
            listed.connect("tcp://198.18.77.1:5555", timeout=0.5)  # tried: nothing there
        assert time.monotonic() - started >= 0.5
        wait_for(lambda: listed.control.open_sockets() == 0, timeout=5, what="the tried address's socket closed")
        with pytest.raises(PeerError, match="not in trusted_prefills"):
            listed.connect("tcp://10.1.2.3:5555", timeout=0.5)
        # loopback is always allowed: a prefill on this host peers as before
        prefill = PrefillEngine(make_layout(16), EngineConfig(max_context=CONTEXT, heartbeat_interval=0.2))
        engines.append(prefill)
        assert listed.connect(prefill.address, timeout=5) == prefill.engine_id
    finally:
        close_checked(engines)
