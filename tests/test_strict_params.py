"""Issue 41, finding 3: every externally supplied value (vLLM ``kv_transfer_params``, request ids,
engine ids, addresses, ports) goes through one strict parser, and a bad one is refused naming the
field, as :class:`ParamsError` (vLLM params) or :class:`InvalidArgument` (engine API), never as
another exception out of a scheduler hook and never "accepted now, failing later".

The property tests feed ``parse()`` arbitrary JSON-like values (lone surrogates included, which JSON
can carry) and valid params with one field replaced by an arbitrary value: ``parse()`` either returns
params whose every field is usable or raises :class:`ParamsError`.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer import ReceiverState
from kvxfer.errors import InvalidArgument
from kvxfer.integrations.vllm.params import ParamsError, TransferParams, parse
from kvxfer.wire.auth import split_address

from .conftest import PAGE_TOKENS, wait_for

GOOD: dict[str, Any] = {
    "do_remote_prefill": True, "remote_engine_id": "prefill-0", "remote_request_id": "req-1",
    "remote_host": "10.0.0.1", "remote_port": 40123,
    "kvxfer": {"version": 1, "addresses": ["tcp://10.0.0.1:40123"], "tokens": 40, "tp_size": 1, "block_size": 16},
}
NON_ASCII_DIGITS = ["٤٠١٢٣", "４０１２３", "²", "40¹23", "٤", "۴۰۱۲۳", "𝟒𝟎𝟏𝟐𝟑"]
SURROGATES = ["\ud800", "req-\udfff", "\udc80abc", "a\ud83db"]

# -- the parsed values must be usable as they are ---------------------------------------------------


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _assert_usable(params: TransferParams) -> None:
    """Everything the decode will use from ``params`` is what it looks like."""
    assert isinstance(params.request_id, str) and 1 <= len(params.request_id) <= 512
    assert _encodes(params.request_id)
    assert isinstance(params.engine_id, str) and params.engine_id and _encodes(params.engine_id)
    for name in ("tokens", "tp_size", "block_size"):
        assert type(getattr(params, name)) is int, name
    assert params.tokens >= 1 and params.block_size >= 1 and params.tp_size == len(params.addresses) >= 1
    for address in params.addresses:
        assert isinstance(address, str) and address.isascii() and address.startswith("tcp://")
        endpoint, mark, key = address.partition("#")
        if mark:  # a keyed address: the key the wire reads, 32 bytes (kvxfer.wire.auth.split_address)
            assert key.startswith("curve=") and re.fullmatch(r"[0-9a-fA-F]{64}", key.removeprefix("curve=")), address
            assert split_address(address)[1] is not None
        host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
        assert host and re.fullmatch(r"[0-9]+", port) and 1 <= int(port) <= 65535, address


def _parse_or_refuse(value: Any) -> None:
    try:
        result = parse(value)
    except ParamsError as exc:
        assert str(exc).startswith("kv_transfer_params"), exc
        str(exc).encode("utf-8")  # a refusal can be logged and sent back as it is
        return
    _assert_usable(result)


# -- arbitrary JSON-like values ------------------------------------------------------------------------

_any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)  # surrogates included
_surrogate = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
_with_surrogate = st.builds(lambda a, s, b: a + s + b, st.text(max_size=4), _surrogate, st.text(max_size=4))
_digits = st.text(st.characters(categories=["Nd", "No"]), min_size=1, max_size=6)  # isdigit() is not [0-9]
_tricky_text = _with_surrogate | _digits \
    | st.sampled_from(NON_ASCII_DIGITS + SURROGATES + ["", "0", "65536", "tcp://", "tcp://h:1", "1"])
_scalars = st.none() | st.booleans() | st.integers() | st.floats() | _any_text | _tricky_text
json_like = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4)
                         | st.dictionaries(_any_text | st.sampled_from(sorted(GOOD) + sorted(GOOD["kvxfer"])),
                                           inner, max_size=6),
                         max_leaves=20)

_port_text = st.sampled_from(NON_ASCII_DIGITS + ["", "0", "65536", "99999", "1", "65535", "+1", " 1", "1_0", "0x10",
                                                 "1" * 5000, "-1", "1.0"]) | _digits | _any_text \
    | st.integers(min_value=-10, max_value=70000).map(str)
_host_text = st.sampled_from(["127.0.0.1", "[::1]", "::1", "[::1", "host name", "", "h\ud800", "ｈｏｓｔ", "[]"]) \
    | _any_text | _with_surrogate
_hex = st.text(st.sampled_from("0123456789abcdefABCDEF"), min_size=64, max_size=64)
_key_text = _hex | st.sampled_from(["", "a" * 63, "a" * 65, "g" * 64, "٤" * 64, "ａ" * 64, "a" * 64 + "\n",
                                    " " + "a" * 63, "a" * 64 + "#curve=" + "a" * 64]) \
    | st.text(st.sampled_from("0123456789abcdefABCDEF٤ａg# \n"), max_size=70) | _any_text
_mark = st.sampled_from(["#curve=", "#curve=", "#CURVE=", "#curve", "#", "#key=", "#curve=="])
_address = st.builds(lambda h, p: f"tcp://{h}:{p}", _host_text, _port_text) \
    | st.builds(lambda h, p, m, k: f"tcp://{h}:{p}{m}{k}", _host_text, _port_text, _mark, _key_text) | json_like
_good_endpoint = st.builds(lambda h, p: f"tcp://{h}:{p}",
                           st.sampled_from(["127.0.0.1", "10.0.0.1", "[::1]", "[fd00::7]", "node-1.example", "h_x"]),
                           st.integers(min_value=1, max_value=65535))

FIELDS = ["remote_request_id", "remote_engine_id", "kvxfer", "kvxfer.version", "kvxfer.addresses",
          "kvxfer.addresses.0", "kvxfer.tokens", "kvxfer.tp_size", "kvxfer.block_size"]


def _replaced(field: str, value: Any) -> dict[str, Any]:
    params = {**GOOD, "kvxfer": {**GOOD["kvxfer"], "addresses": list(GOOD["kvxfer"]["addresses"])}}
    if field == "kvxfer.addresses.0":
        params["kvxfer"]["addresses"][0] = value
    elif field.startswith("kvxfer."):
        params["kvxfer"][field.removeprefix("kvxfer.")] = value
    else:
        params[field] = value
    return params


QUICK = settings(max_examples=300, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@QUICK
@given(json_like)
def test_parse_refuses_arbitrary_values_with_params_error_only(value):
    _parse_or_refuse(value)


@QUICK
@given(st.sampled_from(FIELDS), json_like | _tricky_text)
def test_parse_of_params_with_one_arbitrary_field_returns_usable_params_or_refuses(field, value):
    _parse_or_refuse(_replaced(field, value))
    if field == "kvxfer.version" and not (type(value) is int and value == 1):
        with pytest.raises(ParamsError, match=r"kvxfer\.version"):  # True and 1.0 equal 1, but are no version
            parse(_replaced(field, value))


@QUICK
@given(_address)
def test_parse_of_an_arbitrary_address_returns_usable_params_or_refuses(address):
    _parse_or_refuse(_replaced("kvxfer.addresses.0", address))


@QUICK
@given(_good_endpoint, _hex)
def test_a_keyed_address_parses_as_itself_and_the_wire_reads_its_key(endpoint, key):
    """Issue 42, finding 6: a prefill with a keyring advertises tcp://host:port#curve=<64 hex digits>; the
    params parser refused it. Now it is taken as it is, and ``to_json`` names its endpoint."""
    from kvxfer.core.arguments import split_control_address
    from kvxfer.core.arguments import split_tcp_endpoint as endpoint_of

    address = f"{endpoint}#curve={key}"
    params = parse(_replaced("kvxfer.addresses.0", address))
    assert params.addresses == (address,)
    _assert_usable(params)
    host, port = endpoint_of(endpoint)
    assert split_control_address(address) == (host, port, key)
    assert split_address(address) == (endpoint, split_address(f"{endpoint}#curve={key.lower()}")[1])
    out = params.to_json()
    assert (out["remote_host"], out["remote_port"]) == (host, port) and parse(out) == params


@pytest.mark.parametrize("suffix", ["#curve=", "#curve=" + "a" * 63, "#curve=" + "a" * 65, "#curve=" + "g" * 64,
                                    "#curve=" + "٤" * 64, "#curve=" + "ａ" * 64, "#curve=" + "a" * 64 + "\n",
                                    "#CURVE=" + "a" * 64, "#curve " + "a" * 64, "#", "#key=" + "a" * 64,
                                    "#curve=" + "a" * 64 + "#", "#curve=\ud800" + "a" * 63])
def test_anything_but_curve_and_64_ascii_hex_digits_after_the_endpoint_is_refused(suffix):
    from kvxfer.core.arguments import split_control_address

    with pytest.raises(ParamsError, match=r"kvxfer\.addresses\[0\]") as err:
        parse(_replaced("kvxfer.addresses.0", "tcp://10.0.0.1:40123" + suffix))
    str(err.value).encode("utf-8")
    with pytest.raises(InvalidArgument, match="kvxfer_address"):
        split_control_address("tcp://10.0.0.1:40123" + suffix, "kvxfer_address")


def test_the_core_and_the_wire_agree_on_the_key_mark():
    from kvxfer.core.arguments import CONTROL_KEY_HEX, CONTROL_KEY_MARK
    from kvxfer.wire.auth import KEY_MARK, Keyring

    assert CONTROL_KEY_MARK == KEY_MARK
    address = Keyring.generate().address("tcp://10.0.0.1:1")
    assert len(address.split(KEY_MARK)[1]) == CONTROL_KEY_HEX and parse(_replaced("kvxfer.addresses.0", address))


@pytest.mark.parametrize("port", NON_ASCII_DIGITS)
def test_a_port_of_non_ascii_digits_is_refused_naming_the_addresses(port):
    with pytest.raises(ParamsError, match=r"kvxfer\.addresses"):
        parse(_replaced("kvxfer.addresses.0", f"tcp://10.0.0.1:{port}"))


@pytest.mark.parametrize("field", ["remote_request_id", "remote_engine_id"])
@pytest.mark.parametrize("value", SURROGATES)
def test_an_id_that_does_not_encode_as_utf8_is_refused_naming_the_field(field, value):
    with pytest.raises(ParamsError, match=rf"{field}.*UTF-8") as err:
        parse(_replaced(field, value))
    str(err.value).encode("utf-8")


@pytest.mark.parametrize("version", [True, 1.0, "1", [1], None])
def test_version_must_be_the_integer_1(version):
    with pytest.raises(ParamsError, match=r"kvxfer\.version"):
        parse(_replaced("kvxfer.version", version))


# -- the shared rules (kvxfer.core.arguments) and the tcp transport's address parser -------------------


@pytest.mark.parametrize("text", NON_ASCII_DIGITS + ["", "0", "65536", "99999", "+1", " 1", "1 ", "1_0", "0x10",
                                                      "1" * 5000, "-1", "1.0", "\ud800", "01"])
def test_port_text_is_ascii_digits_in_range(text):
    from kvxfer.core.arguments import parse_port

    with pytest.raises(InvalidArgument, match="port"):
        parse_port(text)


@pytest.mark.parametrize("value", [True, False, 0, 65536, -1, 1.0, None, b"80", [80]])
def test_port_values_are_integers_not_booleans(value):
    from kvxfer.core.arguments import parse_port

    with pytest.raises(InvalidArgument, match="port"):
        parse_port(value)


def test_good_ports_and_host_ports():
    from kvxfer.core.arguments import parse_port, split_host_port

    assert [parse_port(p) for p in ("1", "80", "65535", 443)] == [1, 80, 65535, 443]
    assert split_host_port("127.0.0.1:5000") == ("127.0.0.1", 5000)
    assert split_host_port("node-1.example:80") == ("node-1.example", 80)
    assert split_host_port("[::1]:5000") == ("::1", 5000)
    assert split_host_port("::1:5000") == ("::1", 5000)  # what a tcp receiver bound to ::1 announces


@pytest.mark.parametrize("text", ["", ":5000", "5000", "host:", "host:٤٠", "[::1:5000", "[::1]5000", "[]:5000",
                                  "[10.0.0.1]:80", "a]b:80", "host name:80", "h\ud800:80", "ｈｏｓｔ:80",
                                  "host:123:456", "h/x:80", None, 80])
def test_bad_host_ports_are_refused(text):
    from kvxfer.core.arguments import split_host_port

    with pytest.raises(InvalidArgument, match="address"):
        split_host_port(text)


@pytest.mark.parametrize("text", ["h:٤٠١٢٣", "h:４０１２３", "h:²", "h:0", "h:65536", ":80", "h:" + "1" * 5000])
def test_tcp_parse_address_is_strict(text):
    from kvxfer.errors import TransportError
    from kvxfer.transport.tcp import parse_address

    with pytest.raises(TransportError, match="address"):
        parse_address(text)
    assert parse_address("[::1]:5000") == ("::1", 5000) and parse_address("127.0.0.1:80") == ("127.0.0.1", 80)


@pytest.mark.parametrize("rid", SURROGATES)
def test_check_rid_refuses_what_does_not_encode_as_utf8(rid):
    from kvxfer.core.arguments import check_peer, check_rid

    with pytest.raises(InvalidArgument, match="request id.*UTF-8"):
        check_rid(rid)
    with pytest.raises(InvalidArgument, match="peer.*UTF-8"):
        check_peer(rid, "r")


# -- the engines -------------------------------------------------------------------------------------------


def _ledger(engine) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ledger = engine.pool.ledger
    return ledger.state.copy(), ledger.generation.copy(), np.sort(ledger.free_pages())


def _same(before, after) -> bool:
    return all(np.array_equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("rid", SURROGATES[:2])
def test_prefill_admit_refuses_a_request_id_that_does_not_encode_as_utf8(engines, rid):
    pair = engines()
    before = _ledger(pair.prefill)
    with pytest.raises(InvalidArgument, match="request id.*UTF-8") as err:
        pair.prefill.admit(rid, 4 * PAGE_TOKENS, peer=pair.decode.engine_id)
    assert repr(rid) in str(err.value)  # the message names the id (escaped, so it can be logged)
    assert _same(before, _ledger(pair.prefill)) and not pair.prefill.sender.active


@pytest.mark.parametrize("rid", SURROGATES[:2])
def test_decode_admit_refuses_a_request_id_that_does_not_encode_as_utf8(engines, rid):
    pair = engines()
    before = _ledger(pair.decode)
    with pytest.raises(InvalidArgument, match="request id.*UTF-8") as err:
        pair.decode.admit(rid, 4 * PAGE_TOKENS, peer=pair.peer)
    assert repr(rid) in str(err.value)
    assert _same(before, _ledger(pair.decode))
    assert not pair.decode.receiver.active and not pair.decode.receiver.guard.open_windows()
    pair.transfer("after", 4 * PAGE_TOKENS, seed=1)  # the engines go on as before
    wait_for(lambda: pair.decode.status("after").state is ReceiverState.READABLE, what="readable")
    assert pair.decode.counters["fences"] == 0


def test_admit_refuses_a_peer_that_does_not_encode_as_utf8(engines):
    pair = engines()
    with pytest.raises(InvalidArgument, match="peer.*UTF-8"):
        pair.decode.admit("r-peer", 4 * PAGE_TOKENS, peer="d\ud800")
    with pytest.raises(InvalidArgument, match="peer.*UTF-8"):
        pair.prefill.admit("r-peer", 4 * PAGE_TOKENS, peer="d\ud800")
    assert not pair.decode.receiver.active and not pair.prefill.sender.active


def test_an_engine_id_is_at_most_the_wires_longest_string():
    from kvxfer.core.arguments import MAX_ENGINE_ID, check_peer
    from kvxfer.wire import messages

    assert MAX_ENGINE_ID == messages.MAX_STR
    assert check_peer("e" * MAX_ENGINE_ID, "r") == "e" * MAX_ENGINE_ID
    with pytest.raises(InvalidArgument, match="peer"):
        check_peer("e" * (MAX_ENGINE_ID + 1), "r")


# -- SGLang's bootstrap registry entries --------------------------------------------------------------------


@pytest.mark.parametrize("info", [{"rank_ip": "10.0.0.1", "rank_port": "٤٠١٢٣"}, {"rank_ip": "10.0.0.1", "rank_port": "²"},
                                  {"rank_ip": "10.0.0.1", "rank_port": True}, {"rank_ip": "10.0.0.1", "rank_port": 4.5},
                                  {"rank_ip": "10.0.0.1", "rank_port": 0}, {"rank_ip": "h\ud800", "rank_port": 1},
                                  {"rank_ip": None, "rank_port": 1}, {"rank_port": 1}, None])
def test_a_bad_sglang_registry_entry_is_invalid_argument_naming_the_field(info):
    pytest.importorskip("sglang", reason="sglang not installed (python3 tools/install_sglang.py)")
    from kvxfer.integrations.sglang.conn import rank_key, rank_text

    with pytest.raises(InvalidArgument, match="rank_port|rank_ip") as err:
        rank_key(info)
    str(err.value).encode("utf-8")
    rank_text(info).encode("utf-8")


def test_good_sglang_registry_entries():
    pytest.importorskip("sglang", reason="sglang not installed (python3 tools/install_sglang.py)")
    from kvxfer.integrations.sglang.conn import rank_endpoint, rank_key

    assert rank_key({"rank_ip": "10.0.0.1", "rank_port": 40123}) == ("10.0.0.1", 40123)
    assert rank_key({"rank_ip": "node-1", "rank_port": "40123"}) == ("node-1", 40123)
    assert rank_endpoint({"rank_ip": "[::1]", "rank_port": 5}) == "tcp://[::1]:5"
    keyed = "tcp://[::1]:5#curve=" + "ab" * 32  # what a prefill with a keyring registers beside rank_ip/rank_port
    assert rank_endpoint({"rank_ip": "[::1]", "rank_port": 5, "kvxfer_address": keyed}) == keyed


@pytest.mark.parametrize("address", ["tcp://10.0.0.2:5#curve=" + "ab" * 32, "tcp://10.0.0.1:6", "tcp://10.0.0.1:5#curve=ab",
                                     "tcp://10.0.0.1:5#x", 5, None])
def test_a_sglang_registry_entry_whose_kvxfer_address_is_bad_or_names_another_rank_is_refused(address):
    pytest.importorskip("sglang", reason="sglang not installed (python3 tools/install_sglang.py)")
    from kvxfer.integrations.sglang.conn import rank_endpoint

    entry = {"rank_ip": "10.0.0.1", "rank_port": 5, "kvxfer_address": address}
    if address is None:  # an older prefill registered none: its endpoint, unkeyed
        assert rank_endpoint(entry) == "tcp://10.0.0.1:5"
        return
    with pytest.raises(InvalidArgument, match="kvxfer_address"):
        rank_endpoint(entry)
