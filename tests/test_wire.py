"""The wire protocol: golden vectors both ways, strict decoding, and property tests."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.errors import ProtocolError
from kvxfer.wire import frames as f
from kvxfer.wire import golden
from kvxfer.wire import messages as m

V = m.PROTOCOL_VERSION
PROTOCOL = Path(__file__).resolve().parent.parent / "protocol"


@pytest.mark.parametrize("name", sorted(golden.example_messages()))
def test_golden_message_bytes_both_ways(name):
    msg = golden.example_messages()[name]
    expected = (PROTOCOL / "golden" / f"{name}.bin").read_bytes()
    assert m.encode(msg) == expected, f"{name} encodes differently from protocol/golden (run tools/gen_golden.py?)"
    assert m.decode(expected) == msg


@pytest.mark.parametrize("name", sorted(golden.example_frames()))
def test_golden_frames(name):
    assert golden.example_frames()[name] == (PROTOCOL / "golden" / f"{name}.bin").read_bytes()


def test_generated_protocol_files_are_current():
    for rel, data in golden.golden_files().items():
        assert (PROTOCOL / rel).read_bytes() == data, f"protocol/{rel} is stale: run tools/gen_golden.py"


def test_spec_documents_every_message_and_field():
    spec = (PROTOCOL / "SPEC.md").read_text()
    assert golden.spec_with_messages(spec) == spec, "SPEC.md message reference is stale: run tools/gen_golden.py"
    for name, cls in m.MESSAGE_TYPES.items():
        assert f"`{name}`" in spec, f"SPEC.md does not document {name}"
        for field in dataclasses.fields(cls):
            assert f"`{field.name}`" in spec, f"SPEC.md does not mention field {name}.{field.name}"


def test_every_message_type_has_an_example():
    assert {msg.TYPE for msg in golden.example_messages().values()} == set(m.MESSAGE_TYPES)


BAD_INPUTS = {
    "not msgpack": (b"\xc1", "not a msgpack message"),
    "empty": (b"", "empty message"),
    "truncated": (m.encode(golden.example_messages()["DONE"])[:-3], "truncated"),
    "trailing": (m.encode(golden.example_messages()["DONE"]) + b"\x00", "trailing bytes"),
    "not an array": (msgpack.packb({"t": "DONE"}), "envelope must be a 3-element array"),
    "wrong version": (msgpack.packb([1, "DONE", {}]), "unsupported protocol version 1 (this engine speaks 6)"),
    "previous version": (msgpack.packb([5, "DONE", {}]), "unsupported protocol version 5 (this engine speaks 6)"),
    "future version": (msgpack.packb([m.PROTOCOL_VERSION + 1, "DONE", {}]), f"unsupported protocol version {m.PROTOCOL_VERSION + 1}"),
    "unknown type": (msgpack.packb([V, "SELF_DESTRUCT", {}]), "unknown message type 'SELF_DESTRUCT'"),
    "missing field": (msgpack.packb([V, "FENCED", {"epoch": 1}]), "missing field 'reason'"),
    "unexpected field": (msgpack.packb([V, "FENCED", {"epoch": 1, "reason": "", "x": 1}]), "unexpected field 'x'"),
    "wrong type": (msgpack.packb([V, "FENCED", {"epoch": "one", "reason": ""}]), "FENCED.epoch: expected an unsigned"),
    "negative": (msgpack.packb([V, "FENCED", {"epoch": -1, "reason": ""}]), "outside"),
    "bool as int": (msgpack.packb([V, "FENCED", {"epoch": True, "reason": ""}]), "expected an unsigned"),
    "bad pages": (msgpack.packb([V, "META", {"rid": "a", "gen": 1, "slot": 0, "tokens": 1, "pages": b"\x00"}],
                                use_bin_type=True), "not a multiple of 4"),
    "slot too big": (msgpack.packb([V, "META", {"rid": "a", "gen": 1, "slot": 70000, "tokens": 1, "pages": b""}],
                                   use_bin_type=True), "META.slot"),
    "empty rid": (msgpack.packb([V, "ABORT", {"rid": "", "gen": 1, "reason": "", "detail": ""}]), "ABORT.rid"),
    "oversized": (b"\x00" * (m.MAX_MESSAGE_BYTES + 1), "exceeds"),
}


def _hello_with_geometry_order(order: str) -> bytes:
    version, kind, body = msgpack.unpackb(m.encode(golden.example_messages()["HELLO_TP"]))
    body["geometry"][3][0][7] = order  # the first buffer's in-page order
    return msgpack.packb([version, kind, body], use_bin_type=True)


BAD_INPUTS["geometry with an unknown order"] = (_hello_with_geometry_order("NBD"),
                                                "HELLO.geometry: buffer geometry: order 'NBD' is not one of")


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_decoder_rejects_bad_input_with_a_clear_error(case):
    data, needle = BAD_INPUTS[case]
    with pytest.raises(ProtocolError, match=re.escape(needle)):
        m.decode(data)


def test_encoder_refuses_invalid_fields():
    with pytest.raises(ProtocolError, match="Fenced|FENCED.epoch"):
        m.encode(m.Fenced(epoch=-5, reason="x"))
    with pytest.raises(ProtocolError, match="page index outside uint32"):
        m.encode(m.Meta(rid="r", gen=1, slot=0, tokens=1, pages=np.array([-1])))


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=512))
def test_decoder_never_raises_anything_but_protocol_error(data):
    try:
        m.decode(data)
    except ProtocolError:
        pass


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=20) | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(sorted(m.MESSAGE_TYPES)), st.dictionaries(st.text(max_size=10), msgpack_values, max_size=8),
       st.integers(0, 3))
def test_structured_garbage_is_rejected_cleanly(type_name, body, version):
    data = msgpack.packb([version, type_name, body], use_bin_type=True)
    try:
        msg = m.decode(data)
    except ProtocolError:
        return
    assert m.decode(m.encode(msg)) == msg  # anything accepted round-trips


@settings(max_examples=200, deadline=None)
@given(
    rid=st.one_of(st.text(min_size=1, max_size=40), st.integers(0, 2**64 - 1)),
    gen=st.integers(0, 2**64 - 1),
    slot=st.integers(0, 0xFFFF),
    pages=st.lists(st.integers(0, 2**32 - 1), max_size=50),
)
def test_meta_round_trips(rid, gen, slot, pages):
    msg = m.Meta(rid=rid, gen=gen, slot=slot, tokens=len(pages), pages=np.array(pages, dtype=np.int64))
    back = m.decode(m.encode(msg))
    assert back == msg and back.pages.dtype == np.int64


# frames --------------------------------------------------------------------------------------------


def test_frame_header_round_trip_and_limits():
    header = f.FrameHeader(f.FrameKind.WRITE, 3, 7, 2, 2 * f.RUN_SIZE, 100)
    assert f.parse_header(header.pack()) == header
    with pytest.raises(ProtocolError, match="bad frame magic"):
        f.parse_header(b"ZZ" + header.pack()[2:])
    with pytest.raises(ProtocolError, match="unsupported frame version"):
        f.parse_header(header.pack()[:2] + b"\x09" + header.pack()[3:])
    with pytest.raises(ProtocolError, match="unknown frame kind"):
        f.parse_header(header.pack()[:3] + b"\x09" + header.pack()[4:])
    with pytest.raises(ProtocolError, match="runs"):
        f.parse_header(f.FrameHeader(f.FrameKind.WRITE, 0, 1, 0, 0, 1).pack())
    with pytest.raises(ProtocolError, match="payload"):
        f.parse_header(f.FrameHeader(f.FrameKind.WRITE, 0, 1, 1, f.RUN_SIZE, f.MAX_PAYLOAD + 1).pack())
    with pytest.raises(ProtocolError, match="no runs"):
        f.parse_header(f.FrameHeader(f.FrameKind.ORDERED, 0, 1, 1, 10, 0).pack())


def test_run_table_must_add_up():
    runs = f.pack_runs(np.array([0]), np.array([0]), np.array([10]))
    header = f.FrameHeader(f.FrameKind.WRITE, 0, 1, 1, f.RUN_SIZE, 11)
    with pytest.raises(ProtocolError, match="add up to 10 bytes"):
        f.parse_runs(header, runs)
    zero = f.pack_runs(np.array([0]), np.array([0]), np.array([0]))
    with pytest.raises(ProtocolError, match="zero bytes"):
        f.parse_runs(f.FrameHeader(f.FrameKind.WRITE, 0, 1, 1, f.RUN_SIZE, 0), zero)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=f.HEADER_SIZE, max_size=f.HEADER_SIZE))
def test_frame_parser_never_raises_anything_but_protocol_error(data):
    try:
        f.parse_header(data)
    except ProtocolError:
        pass
