"""A refusal reaches both halves of a request at once (issue 24, first item).

A decode that will not take a request (a layout it cannot serve, a setting it does not support) used
to fail its own half only: the prefill's half waited for a destination until its bootstrap timeout
(SGLang: 300 s, and a router retries). ``DecodeEngine.refuse`` tells the prefill, whether or not the
two are peered: a prefill that refused the decode's HELLO for its layout still takes its REJECTs.

Real engines and real ZMQ sockets; the layouts differ the way unequal tensor parallelism makes them
differ (the same buffers, half the bytes per page).
"""

from __future__ import annotations

import time

import pytest

from kvxfer import DecodeEngine, EngineConfig, PrefillEngine, SenderState
from kvxfer.errors import AdmissionRejected, InvalidArgument, PeerError
from kvxfer.wire import messages as m
from kvxfer.wire.auth import Keyring

from .conftest import BUFFERS, ITEM, PAGE_TOKENS, make_layout, wait_for
from .test_hostile_peers import raw_peer

S = SenderState
CONTEXT = 16 * PAGE_TOKENS


def _config(**kw) -> EngineConfig:
    return EngineConfig(**{"max_context": CONTEXT, "heartbeat_interval": 0.2, "meta_timeout": 30.0, **kw})


def _wait_state(prefill: PrefillEngine, rid: str, timeout: float = 1.0) -> tuple[object, float]:
    t0 = time.monotonic()
    wait_for(lambda: prefill.status(rid).state is not S.ADMITTED, timeout=timeout,
             what=f"the prefill's half of {rid} to fail")
    return prefill.status(rid), time.monotonic() - t0


@pytest.mark.parametrize("keyed", [False, True], ids=["open", "keyring"])
def test_a_decode_refused_for_its_layout_fails_the_prefills_half_within_a_second(keyed):
    rings = Keyring.cluster(["prefill", "decode"]) if keyed else {"prefill": None, "decode": None}
    with PrefillEngine(make_layout(32), _config(keyring=rings["prefill"])) as prefill, \
            DecodeEngine(make_layout(64, item=ITEM // 2), _config(keyring=rings["decode"])) as decode:
        with pytest.raises(PeerError, match="refused") as err:
            decode.connect(prefill.address, timeout=5.0)
        if keyed:  # an authenticated peer is told why, with both layouts named
            assert f"theirs: {BUFFERS} buffers of {ITEM // 2} B/page" in str(err.value)
            assert f"local: {BUFFERS} buffers of {ITEM} B/page" in str(err.value)
        # admitted before the refusal: fails at once, with the decode's words
        prefill.admit("room-1", 3 * PAGE_TOKENS, any_peer=True)
        decode.refuse("room-1", prefill.address, reason="layout_mismatch",
                      detail="prefill attention TP 2 != decode 1")
        req, took = _wait_state(prefill, "room-1")
        assert req.state is S.FAILED and took < 1.0, (req.state, took)
        assert isinstance(req.error, AdmissionRejected) and req.error.reason == "layout_mismatch"
        assert "prefill attention TP 2 != decode 1" in str(req.error)
        # refused before the prefill admits it: its admission fails at once
        decode.refuse("room-2", prefill.address, reason="layout_mismatch", detail="TP 2 != 1")
        wait_for(lambda: "room-2" in prefill.sender.peer_rejections, timeout=2, what="the remembered refusal")
        req = prefill.admit("room-2", 2 * PAGE_TOKENS, any_peer=True)
        assert req.state is S.FAILED and "TP 2 != 1" in str(req.error)
        assert prefill.peers == {} and decode.receiver.peers == {}  # still no peering
        wait_for(lambda: not decode._pending_hello, timeout=2, what="refuse()'s HELLO answered")


def test_a_peered_decode_refuses_a_request_it_will_not_take():
    with PrefillEngine(make_layout(32), _config()) as prefill, DecodeEngine(make_layout(64), _config()) as decode:
        decode.connect(prefill.address, timeout=5.0)
        prefill.admit("r", 2 * PAGE_TOKENS, any_peer=True)
        decode.refuse("r", prefill.address, reason="unsupported", detail="decode_prefix_len 16")
        req, took = _wait_state(prefill, "r")
        assert req.state is S.FAILED and took < 1.0 and "decode_prefix_len 16" in str(req.error)
        assert list(prefill.peers) == [decode.engine_id]  # the peering lives on, and serves the next request
        assert not decode._pending_hello


def test_only_a_decode_refused_for_what_it_is_may_still_reject():
    """A HELLO that lies about who sent it earns nothing; a sender that never said HELLO neither; and
    the leave to REJECT ends with the prefill's meta_timeout."""
    with PrefillEngine(make_layout(32), _config(meta_timeout=2.0)) as prefill:
        prefill.admit("a", PAGE_TOKENS, any_peer=True)
        refused = prefill.counters["refused_messages"]
        with raw_peer(prefill.address, ring=None, identity="liar") as sock:
            hello = m.Hello(engine="someone-else", role="decode", session=b"s" * 16, reply_to="tcp://127.0.0.1:9",
                            transport="tcp", page_size=PAGE_TOKENS, num_pages=8, item_lens=[1] * BUFFERS,
                            pool_tokens=8 * PAGE_TOKENS, max_context=CONTEXT, checksum="adler32")
            sock.send(m.encode(hello))
            sock.send(m.encode(m.Reject(rid="a", gen=1, reason="x", detail="from a liar")))
            wait_for(lambda: prefill.counters["refused_messages"] == refused + 1, timeout=2,
                     what="the liar's REJECT refused")
        with raw_peer(prefill.address, ring=None, identity="stranger") as sock:
            sock.send(m.encode(m.Reject(rid="a", gen=1, reason="x", detail="from a stranger")))
            wait_for(lambda: prefill.counters["refused_messages"] == refused + 2, timeout=2,
                     what="the stranger's REJECT refused")
        assert prefill.status("a").state is S.ADMITTED and "liar" not in prefill.refused_peers
        with DecodeEngine(make_layout(64, item=ITEM // 2), _config()) as decode:
            with pytest.raises(PeerError):
                decode.connect(prefill.address, timeout=5.0)
            assert decode.engine_id in prefill.refused_peers
            wait_for(lambda: decode.engine_id not in prefill.refused_peers, timeout=4, what="the leave to end")
            name = decode.engine_id
        prefill.admit("b", PAGE_TOKENS, any_peer=True)
        with raw_peer(prefill.address, ring=None, identity=name) as sock:  # its name, after the leave
            sock.send(m.encode(m.Reject(rid="b", gen=1, reason="x", detail="too late")))
            wait_for(lambda: prefill.counters["refused_messages"] == refused + 3, timeout=2,
                     what="the late REJECT refused")
        assert prefill.status("b").state is S.ADMITTED


def test_refuse_checks_its_arguments():
    with DecodeEngine(make_layout(16), _config()) as decode:
        with pytest.raises(InvalidArgument):
            decode.refuse("", "tcp://127.0.0.1:1")
        with pytest.raises(InvalidArgument):
            decode.refuse("r", "tcp://127.0.0.1:1", detail=b"bytes")  # type: ignore[arg-type]
