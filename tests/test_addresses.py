"""Binding and advertising are separate settings, and a decode connects only to prefills it trusts
(issue 42): real engines, real sockets on this host."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest

from kvxfer import DecodeEngine, EngineConfig, PrefillEngine, ReceiverState
from kvxfer.errors import ConfigError, PeerError
from kvxfer.wire.addresses import advertised_host, local_addresses
from kvxfer.wire.auth import Keyring
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


def test_an_engine_bound_to_every_interface_advertises_what_peers_reach_and_transfers():
    rings = Keyring.cluster(["prefill", "decode"])
    base = EngineConfig(max_context=CONTEXT, heartbeat_interval=0.2, host="0.0.0.0", advertise_host="127.0.0.1")
    engines = []
    try:
        prefill = PrefillEngine(make_layout(16), replace(base, keyring=rings["prefill"]))
        engines.append(prefill)
        decode = DecodeEngine(make_layout(32), replace(base, keyring=rings["decode"]))
        engines.append(decode)
        assert prefill.address.startswith("tcp://127.0.0.1:") and "0.0.0.0" not in prefill.address
        assert decode.transport.address.startswith("127.0.0.1:")
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
