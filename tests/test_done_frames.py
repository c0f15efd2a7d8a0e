"""DONE in its fixed binary layout (the DONE frame, kind 5, ``protocol/SPEC.md`` §3.0.1) on tcp and shm.

The binary layout must say exactly what the msgpack DONE says: random DONEs read back field for field
equal to what the ORDERED frame of the same message decodes to; a DONE that does not fit the layout (a
write log, aux over 4 KiB, pages past 2^32) goes as ORDERED. Every broken body is a ProtocolError naming
its rule. Over real engines, a small request's DONE travels in the binary frame (counted by the receiver),
a DONE with long aux still goes as ORDERED and is verified alike, and a hostile DONE frame ends that data
connection with a named reason while the next connection transfers byte-exact.
"""

from __future__ import annotations

import random
import socket
import struct

import pytest

from kvxfer import ReceiverState
from kvxfer.core import native
from kvxfer.core.arguments import MAX_RID_STR
from kvxfer.errors import ProtocolError
from kvxfer.transport import tcp
from kvxfer.wire import frames as f
from kvxfer.wire import messages as m
from kvxfer.wire.golden import example_messages

from .conftest import PAGE_TOKENS, wait_for

R = ReceiverState
FIELDS = ("rid", "gen", "bytes", "pages", "checksum", "algo", "aux", "runs")


def _random_rid(rng: random.Random) -> str | int:
    roll = rng.random()
    if roll < 0.3:
        return rng.choice([0, 1, (1 << 64) - 1, rng.getrandbits(64)])
    alphabet = "abcXYZ-_0123456789" + "éß漢字😀\u0000"
    return "".join(rng.choice(alphabet) for _ in range(rng.choice([1, 2, 17, MAX_RID_STR])))


def _random_done(rng: random.Random) -> m.Done:
    return m.Done(rid=_random_rid(rng), gen=rng.choice([0, 1, rng.getrandbits(64)]),
                  bytes=rng.choice([0, 4096, rng.getrandbits(64)]), pages=rng.choice([0, 1, rng.getrandbits(32)]),
                  checksum=rng.getrandbits(32), algo=rng.choice(["adler32", "crc32"]),
                  aux=rng.randbytes(rng.choice([0, 1, 100, f.DONE_AUX_MAX])))


def _read(frame: bytes) -> m.Message:
    header = f.parse_header(frame[: f.HEADER_SIZE])
    assert len(frame) == f.HEADER_SIZE + header.body_len
    return f.ordered_message(header, frame[f.HEADER_SIZE :])


def _fields(msg: m.Message) -> tuple:
    return tuple(getattr(msg, name) for name in FIELDS)


@pytest.mark.parametrize("seed", range(3))
def test_a_done_frame_reads_back_what_the_ordered_frame_of_the_same_done_reads(seed):
    rng = random.Random(seed)
    for _ in range(500):
        done = _random_done(rng)
        slot = rng.getrandbits(32)
        frame = f.ordered_frame(done, slot=slot, generation=done.gen)
        header = f.parse_header(frame[: f.HEADER_SIZE])
        assert (header.kind, header.slot, header.generation) == (f.FrameKind.DONE, slot, done.gen)
        ordered = f.message_frame(f.FrameKind.ORDERED, m.encode(done), slot=slot, generation=done.gen)
        assert _fields(_read(frame)) == _fields(_read(ordered)) == _fields(done)
        assert type(_read(frame)) is m.Done


@pytest.mark.parametrize("change", [
    {"runs": bytes(24)},  # a verbs write log
    {"aux": bytes(f.DONE_AUX_MAX + 1)},
    {"pages": 1 << 32},
])
def test_a_done_the_layout_cannot_hold_goes_as_ordered(change):
    fields = dict(rid="r", gen=5, bytes=4096, pages=1, checksum=7, algo="adler32")
    done = m.Done(**{**fields, **change})
    assert f.done_frame(done, slot=1) is None
    frame = f.ordered_frame(done, slot=1, generation=5)
    assert f.parse_header(frame[: f.HEADER_SIZE]).kind is f.FrameKind.ORDERED
    assert _fields(_read(frame)) == _fields(done)


def test_other_ordered_messages_keep_the_ordered_frame():
    examples = example_messages()
    for msg in (examples["DRAIN_ACK"], examples["ABORT"], examples["REJECT"], examples["DONE_VERBS"]):
        frame = f.ordered_frame(msg, slot=0, generation=msg.gen)
        assert f.parse_header(frame[: f.HEADER_SIZE]).kind is f.FrameKind.ORDERED
        assert m.encode(_read(frame)) == m.encode(msg)


def _body(nbytes=4096, pages=1, checksum=9, algo=1, rid_kind=2, rid=b"req", aux=b"", rid_len=None, aux_len=None):
    rid_len = len(rid) if rid_len is None else rid_len
    aux_len = len(aux) if aux_len is None else aux_len
    return f.DONE_FIXED.pack(nbytes, pages, checksum, algo, rid_kind, rid_len, aux_len) + rid + aux


def _frame(body: bytes, *, count: int = 0, payload: int = 0, body_len: int | None = None) -> bytes:
    length = len(body) if body_len is None else body_len
    return struct.pack("<2sBBIQIIQ", f.MAGIC, f.FRAME_VERSION, 5, 1, 42, count, length, payload) + body


BAD_FRAMES = {
    "unknown algorithm": (_frame(_body(algo=3)), "checksum algorithm 3"),
    "algorithm 0": (_frame(_body(algo=0)), "checksum algorithm 0"),
    "unknown request id kind": (_frame(_body(rid_kind=3)), "request id kind 3"),
    "integer id of 4 bytes": (_frame(_body(rid_kind=1, rid=b"\x01\x02\x03\x04")), "integer request id of 4 bytes"),
    "id not UTF-8": (_frame(_body(rid=b"\xff\xfe")), "not UTF-8"),
    "empty string id": (_frame(_body(rid=b"", aux=b"x")), "request id of 0 characters"),
    "id too long": (_frame(_body(rid=b"a" * (MAX_RID_STR + 1))), f"request id of {MAX_RID_STR + 1} characters"),
    "lengths past the body": (_frame(_body(rid_len=200)), "holds a 200-byte request id"),
    "lengths short of the body": (_frame(_body(aux=b"xy", aux_len=1)), "and 1 bytes of aux"),
    "runs in the header": (_frame(_body(), count=1), "no runs and no payload"),
    "payload in the header": (_frame(_body(), payload=8), "no runs and no payload"),
    "fixed part only": (_frame(_body()[: f.DONE_FIXED.size]), "DONE frame body of 24 bytes"),
    "aux over the limit": (_frame(_body(aux=bytes(f.DONE_AUX_MAX + 1))), f"{f.DONE_AUX_MAX + 1} bytes of aux"),
    "body over the limit": (_frame(_body(rid=b"a" * (f.DONE_RID_MAX + 1), aux=bytes(f.DONE_AUX_MAX))),
                            f"DONE frame body of {f.DONE_BODY_MAX + 1} bytes"),
}


@pytest.mark.parametrize("case", sorted(BAD_FRAMES))
def test_a_broken_done_frame_is_a_protocol_error_naming_its_rule(case):
    frame, needle = BAD_FRAMES[case]
    with pytest.raises(ProtocolError, match=needle):
        _read(frame)


def test_a_done_frame_toward_a_writer_is_refused():
    frame = f.done_frame(m.Done(rid="r", gen=5, bytes=1, pages=1, checksum=1, algo="crc32"), slot=1)
    with pytest.raises(ProtocolError, match="only RESULT"):
        f.parse_header(frame[: f.HEADER_SIZE], toward_writer=True)


def _mutated(rng: random.Random) -> bytes:
    """A DONE frame's bytes, valid about half the time: each broken one breaks one rule of the body."""
    done = _random_done(rng)
    frame = bytearray(f.done_frame(done, slot=rng.getrandbits(32)))
    body = f.HEADER_SIZE
    roll = rng.random()
    if roll < 0.08:
        frame[body + 16] = rng.choice([0, 3, 255])  # algo
    elif roll < 0.16:
        frame[body + 17] = rng.choice([0, 3, 1 if isinstance(done.rid, str) else 2])  # rid kind
    elif roll < 0.24:
        struct.pack_into("<H", frame, body + 18, rng.choice([0, 1, 9, 0xFFFF]))  # rid_len
    elif roll < 0.32:
        struct.pack_into("<I", frame, body + 20, rng.choice([0, 1, f.DONE_AUX_MAX + 1, 0xFFFFFFFF]))  # aux_len
    elif roll < 0.40 and isinstance(done.rid, str):
        frame[body + 24] = rng.choice([0xFF, 0xC0, 0x80])  # the id's first byte: never valid UTF-8 there
    elif roll < 0.45 and isinstance(done.rid, str) and len(done.rid.encode()) >= 3:
        frame[body + 24 : body + 27] = b"\xed\xa0\x80"  # an encoded surrogate: not UTF-8 either
    return bytes(frame)


@pytest.mark.skipif(tcp._C_FRAME_HEAD is None, reason=f"needs kvxfer._native's recv_frame_head ({native.describe()})")
@pytest.mark.parametrize("seed", range(3))
def test_the_c_reader_parses_done_frames_as_parse_done_does(seed):
    """The tcp receiver reads a DONE frame's body in C (recv_frame_head): over a real socket pair, random
    DONE frames, about half of them broken in one rule, give exactly what parse_done gives: the same
    fields, or the same ProtocolError."""
    rng = random.Random(100 + seed)
    outcomes = {"read": 0, "refused": 0}
    for _ in range(600):
        frame = _mutated(rng)
        try:
            expected: object = _fields(_read(frame))
        except ProtocolError as exc:
            expected = str(exc)
        a, b = socket.socketpair()
        try:
            a.sendall(frame)
            try:
                header, body = tcp.recv_frame_head(b, 100)
                got: object = _fields(body if isinstance(body, m.Done) else f.ordered_message(header, body))
            except ProtocolError as exc:
                got = str(exc)
        finally:
            a.close()
            b.close()
        assert got == expected, frame.hex()
        outcomes["refused" if isinstance(expected, str) else "read"] += 1
    assert min(outcomes.values()) > 150, outcomes


# a small request's DONE summed and sent in one C call (send_summed_done) ----------------------------------

@pytest.mark.skipif(tcp._C_SEND_SUMMED_DONE is None or not native.checksums_in_c,
                    reason=f"needs kvxfer._native's send_summed_done and zlib-ng's checksums in C ({native.describe()})")
@pytest.mark.parametrize("seed", range(3))
def test_the_done_summed_in_the_send_carries_the_checksum_of_the_bytes_in_run_order(seed):
    """Random runs of whole items (64 B to 4 KiB) over random bytes: the DONE frame that arrives carries, in
    its checksum field, the checksum of every run's bytes in order (each item summed, then combined), and
    every other byte of the frame as it was built; a socket whose buffer is full takes none of it and
    the caller sends the frame, filled in."""
    import numpy as np

    from kvxfer.core.checksum import ChecksumAlgo, native_id

    rng = random.Random(seed)
    memory = np.frombuffer(rng.randbytes(1 << 20), dtype=np.uint8).copy()
    base = memory.ctypes.data
    for _ in range(60):
        algo = rng.choice([ChecksumAlgo.ADLER32, ChecksumAlgo.CRC32])
        runs = []
        for _ in range(rng.randint(1, 6)):
            item = rng.choice([64, 128, 4096])
            count = rng.randint(1, 4)
            runs.append((rng.randrange(0, len(memory) - count * item), count * item, item))
        done = m.Done(rid=_random_rid(rng), gen=rng.getrandbits(64), bytes=rng.getrandbits(40), pages=len(runs),
                      checksum=0, algo=algo.value, aux=rng.randbytes(rng.choice([0, 7, 300])))
        frame = bytearray(f.done_frame(done, slot=rng.getrandbits(32)))
        built = bytes(frame)
        addresses, lengths, items = (struct.pack(f"<{len(runs)}Q", *(r[i] + (base if i == 0 else 0) for r in runs))
                                     for i in range(3))
        left, right = socket.socketpair()
        with left, right:
            full = rng.random() < 0.3  # the socket's buffer full: nothing of the frame leaves
            junk = 0
            if full:
                left.setblocking(False)
                try:
                    while True:
                        junk += left.send(bytes(65536))
                except BlockingIOError:
                    pass
            sent, checksum = tcp._C_SEND_SUMMED_DONE(left.fileno(), addresses, lengths, items, native_id(algo),
                                                     algo.initial, frame, f.DONE_CHECKSUM_AT)
            assert sent == (0 if full else len(frame))
            if full:
                right.recv_into(bytearray(junk), junk, socket.MSG_WAITALL)
                left.setblocking(True)
                left.sendall(frame[sent:])  # the caller sends the rest: the frame as filled in
            got = bytearray(len(frame))
            right.recv_into(got, len(frame), socket.MSG_WAITALL)
        expected = algo.update(b"".join(memory[o : o + n].tobytes() for o, n, _ in runs), algo.initial)
        assert checksum == expected
        arrived = f.parse_done(f.parse_header(got[: f.HEADER_SIZE]), got[f.HEADER_SIZE :])
        assert arrived.checksum == expected
        assert got[: f.DONE_CHECKSUM_AT] + got[f.DONE_CHECKSUM_AT + 4 :] == (
            built[: f.DONE_CHECKSUM_AT] + built[f.DONE_CHECKSUM_AT + 4 :])


# over real engines ------------------------------------------------------------------------------------------

pytestmark_engines = pytest.mark.parametrize("transport_name", ["tcp", "shm"])


def _done_frames(pair) -> int:
    return pair.decode.stats()["data_path"]["done_frames"]


@pytestmark_engines
def test_a_small_request_sends_its_done_in_the_binary_frame_and_a_long_aux_goes_ordered(engines, transport_name):
    pair = engines(transport=transport_name)
    before = _done_frames(pair)
    src = pair.transfer("small", 2 * PAGE_TOKENS, seed=1)
    assert pair.decode.wait("small", timeout=10).state is R.READABLE
    pair.expect_content("small", src)
    assert _done_frames(pair) == before + 1
    # aux over DONE_AUX_MAX: the same request goes as an ORDERED DONE, verified the same way
    pair.prefill.admit("long-aux", 2 * PAGE_TOKENS, peer=pair.decode.engine_id)
    pair.decode.admit("long-aux", 2 * PAGE_TOKENS, peer=pair.peer)
    pair.prefill.wait_ready("long-aux")
    aux = bytes(range(256)) * 20
    pair.prefill.send("long-aux", aux=aux)
    req = pair.decode.wait("long-aux", timeout=10)
    assert req.state is R.READABLE and req.aux == aux
    assert _done_frames(pair) == before + 1
    assert pair.prefill.wait("small", timeout=10).state.value == "SUCCEEDED"
    assert pair.prefill.wait("long-aux", timeout=10).state.value == "SUCCEEDED"


@pytest.mark.parametrize("case", ["unknown algorithm", "id not UTF-8", "lengths past the body"])
@pytest.mark.parametrize("transport_name", ["tcp", "shm"])
def test_a_hostile_done_frame_ends_that_connection_and_the_next_one_transfers(engines, case, transport_name):
    pair = engines(transport=transport_name)
    conn = pair.decode.receiver.peers[pair.peer].conn
    errors = pair.decode.stats()["data_path"]["protocol_errors"]
    pair.link.post_raw([BAD_FRAMES[case][0]])
    wait_for(lambda: pair.decode.stats()["data_path"]["protocol_errors"] > errors, timeout=5,
             what="the decode refusing the DONE frame")
    pair.wait_reconnected(conn[1])
    src = pair.transfer("after", 3 * PAGE_TOKENS, seed=6)
    assert pair.decode.wait("after", timeout=10).state is R.READABLE
    pair.expect_content("after", src)


def test_a_forged_done_frame_is_held_to_the_same_verification(engines):
    """A DONE frame the writer's link carries for an admitted request whose writes never came: the claim
    is verified like any DONE's, the request FAILS (nothing covered its pages) and nothing is readable."""
    pair = engines()
    pair.prefill.admit("forged", PAGE_TOKENS, peer=pair.decode.engine_id)
    pair.decode.admit("forged", PAGE_TOKENS, peer=pair.peer)
    pair.prefill.wait_ready("forged")
    req = pair.decode.status("forged")
    leg = req.writing[0]
    nbytes = pair.decode.layout.bytes_for_pages(len(req.pages))
    done = m.Done(rid="forged", gen=leg.gen, bytes=nbytes, pages=len(req.pages), checksum=1,
                  algo=pair.decode.config.checksum)
    pair.link.post_raw([f.done_frame(done, slot=leg.slot)])
    failed = pair.decode.wait("forged", timeout=10)
    assert failed.state is R.FAILED, failed.state
    assert failed.error.check == "coverage", failed.error
    with pytest.raises(Exception, match="not readable|FAILED|failed"):
        pair.decode.read("forged")
    pair.prefill.abort("forged")


@pytest.mark.skipif(tcp._C_SEND_SUMMED_DONE is None or not native.checksums_in_c,
                    reason=f"needs kvxfer._native's send_summed_done and zlib-ng's checksums in C ({native.describe()})")
@pytest.mark.parametrize("transport_name", ["tcp", "shm"])
@pytest.mark.parametrize("inline", [True, False], ids=["caller-thread", "lanes"])
@pytest.mark.parametrize("checksum", ["adler32", "crc32"])
def test_small_requests_are_summed_in_their_send_and_verified_in_one_pass(engines, checksum, inline, transport_name):
    """Production links (no fault injection): each small request's DONE leaves with its checksum filled in
    C behind its WRITE frame (tcp: summed in the one C call that sends it; shm: combined from the sums the
    WRITE frame's copy took; from the caller's thread and from a sending lane alike); its
    checksum is the source pages' own (the reference Python sum), the decode verifies it in one pass, and
    the bytes arrive exact. A request over DONE's binary layout (long aux) takes the other path and is
    verified as well."""
    from kvxfer.core.checksum import ChecksumAlgo, checksum_pages

    pair = engines(fault_injection=False, checksum=checksum, transport=transport_name,
                   transport_options={transport_name: {"inline_send": inline}})
    link = pair.link
    filled, at_once = link.done_filled, pair.decode.receiver.stats["verified_at_once"]
    for i, pages in enumerate([1, 2, 8, 3]):
        src = pair.transfer(f"r{i}", pages * PAGE_TOKENS, seed=i)
        req = pair.decode.wait(f"r{i}", timeout=10)
        assert req.state is R.READABLE, req.error
        assert req.writing[0].claim.checksum == checksum_pages(pair.prefill.layout, src, ChecksumAlgo.parse(checksum))
        pair.expect_content(f"r{i}", src)
        assert pair.prefill.wait(f"r{i}", timeout=10).state.value == "SUCCEEDED"
    assert link.done_filled == filled + 4
    assert pair.decode.receiver.stats["verified_at_once"] == at_once + 4
    pair.prefill.admit("long-aux", PAGE_TOKENS, peer=pair.decode.engine_id)
    pair.decode.admit("long-aux", PAGE_TOKENS, peer=pair.peer)
    pair.prefill.wait_ready("long-aux")
    pair.prefill.send("long-aux", aux=bytes(f.DONE_AUX_MAX + 1))
    assert pair.decode.wait("long-aux", timeout=10).state is R.READABLE
    assert link.done_filled == filled + 4

