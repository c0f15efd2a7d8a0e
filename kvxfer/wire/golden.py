"""Golden vectors: one fixed example of every control message and data frame, and their exact bytes.

``protocol/golden/`` holds the bytes (``<NAME>.bin``) and a readable index (``vectors.json``);
``protocol/schema.json`` holds :func:`kvxfer.wire.messages.schema`. ``tools/gen_golden.py``
regenerates them; the tests fail if the code and the files disagree, so a wire change cannot slip in
without the spec changing with it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from ..core.geometry import KVGeometry
from . import frames as f
from . import messages as m

SESSION = bytes(range(16))
NONCE = bytes(range(100, 116))
GID = bytes(10) + b"\xff\xff\x0a\x63\x00\x01"
# Transport blobs (SPEC §5): msgpack maps each transport encodes and decodes itself; the transport
# tests check that their encoders produce exactly these bytes.
TCP_OFFER_BLOB = msgpack.packb({"v": 1, "addr": "10.0.0.2:5602"}, use_bin_type=True)
VERBS_OFFER_BLOB = msgpack.packb({"v": 1, "epoch": 1, "qpn": 0x11, "psn": 0x123456, "gid": GID, "mtu": 5,
                                  "addrs": [0x7F0000000000, 0x7F0000100000], "rkeys": [0x1234, 0x1234]},
                                 use_bin_type=True)
VERBS_ACCEPT_BLOB = msgpack.packb({"v": 1, "qpn": 0x12, "psn": 0x654321, "gid": GID}, use_bin_type=True)
# META.access of verbs with memory windows: pages [9, 10, 11, 40, 41] of two buffers are two runs per
# buffer, one window each (16-byte <buffer, first page, pages, rkey> records, little-endian u32)
VERBS_META_ACCESS = msgpack.packb({"v": 1, "epoch": 1, "windows": np.array(
    [(0, 9, 3, 0x1001A), (0, 40, 2, 0x1011B), (1, 9, 3, 0x1021C), (1, 40, 2, 0x1031D)],
    dtype=[("buffer", "<u4"), ("first", "<u4"), ("pages", "<u4"), ("rkey", "<u4")]).tobytes()}, use_bin_type=True)


def example_messages() -> dict[str, m.Message]:
    """One example per message type, with fixed values."""
    return {
        "HELLO": m.Hello(
            engine="decode-a", role="decode", session=SESSION, reply_to="tcp://10.0.0.2:5601",
            transport="tcp", page_size=64, num_pages=32768,
            item_lens=[4096, 4096], pool_tokens=2097152, max_context=1048576, checksum="adler32",
        ),
        "HELLO_ACK": m.HelloAck(
            engine="prefill-a", role="prefill", session=SESSION, ok=True, error="", page_size=64,
            num_pages=10645, item_lens=[4096, 4096], pool_tokens=681280, max_context=1048576,
        ),
        "HELLO_TP": m.Hello(
            engine="decode-b1", role="decode", session=SESSION, reply_to="tcp://10.0.0.3:5601",
            transport="tcp", page_size=64, num_pages=32768,
            item_lens=[32768, 32768], pool_tokens=2097152, max_context=1048576, checksum="adler32",
            geometry=KVGeometry.attention(layers=1, total_heads=8, head_dim=64, itemsize=2, dtype="bfloat16",
                                          tp_rank=1, tp_size=2, group="decode-b"),
        ),
        "CONNECT": m.Connect(engine="prefill-a", epoch=1, proof=m.connect_proof(SESSION, NONCE, "prefill-a", 1)),
        "META": m.Meta(rid="req-42", gen=7, slot=3, tokens=300, pages=np.array([9, 10, 11, 40, 41], dtype=np.int64)),
        "META_INT_RID": m.Meta(rid=18446744073709551615, gen=8, slot=65535, tokens=1, pages=np.array([0])),
        "META_VERBS": m.Meta(rid="req-42", gen=7, slot=3, tokens=300, pages=np.array([9, 10, 11, 40, 41], dtype=np.int64),
                             access=VERBS_META_ACCESS),
        "META_SLICE": m.Meta(rid="req-44", gen=9, slot=4, tokens=300, pages=np.array([3, 4, 5, 6, 7], dtype=np.int64),
                             heads=(4, 4)),
        "REJECT": m.Reject(rid="req-43", gen=0, reason="exceeds_pool",
                           detail="prompt of 800,000 tokens can never fit this prefill pool of 681,280 tokens"),
        "ABORT": m.Abort(rid="req-42", gen=7, reason="aborted", detail="client disconnected"),
        "DRAIN_ACK": m.DrainAck(rid="req-42", gen=7, posted=12, completed=12),
        "DONE": m.Done(rid="req-42", gen=7, bytes=40960, pages=5, checksum=0x1234ABCD, algo="adler32",
                       aux=b"\x01\x02"),
        "DONE_VERBS": m.Done(rid="req-42", gen=7, bytes=8192, pages=1, checksum=0x0BADF00D, algo="crc32",
                             runs=bytes(range(24))),
        "OFFER_TCP": m.Offer(epoch=1, nonce=NONCE, blob=TCP_OFFER_BLOB),
        "OFFER_VERBS": m.Offer(epoch=1, nonce=NONCE, blob=VERBS_OFFER_BLOB),
        "ACCEPT_TCP": m.Accept(engine="prefill-a", epoch=1, proof=m.connect_proof(SESSION, NONCE, "prefill-a", 1),
                               blob=b""),
        "ACCEPT_VERBS": m.Accept(engine="prefill-a", epoch=1, proof=m.connect_proof(SESSION, NONCE, "prefill-a", 1),
                                 blob=VERBS_ACCEPT_BLOB),
        "RESULT": m.Result(rid="req-42", gen=7, ok=False, reason="checksum",
                           detail="adler32 of the destination pages is 0x00000001, DONE claims 0x1234abcd"),
        "FENCED": m.Fenced(epoch=1, reason="drain_timeout"),
        "HEARTBEAT": m.Heartbeat(engine="decode-a", seq=99),
        "ERROR": m.Error(about="DONE", code="unknown_request", detail="no such request", rid="?", gen=0),
    }


def example_frames() -> dict[str, bytes]:
    """Data-plane frames of the tcp transport (header + body; WRITE payload included)."""
    runs = f.pack_runs(np.array([0, 1]), np.array([9 * 4096, 9 * 4096]), np.array([8192, 8192]))
    write = f.write_header(slot=3, generation=7, count=2, payload_len=16384) + runs + bytes(16384)
    done = example_messages()["DONE"]
    return {
        "FRAME_CONNECT": f.message_frame(f.FrameKind.CONNECT, m.encode(example_messages()["CONNECT"])),
        "FRAME_WRITE": write,
        "FRAME_ORDERED_DONE": f.message_frame(f.FrameKind.ORDERED, m.encode(done), slot=3, generation=7),
        "FRAME_DONE": f.done_frame(done, slot=3),
        "FRAME_RESULT": f.result_frame(example_messages()["RESULT"]),
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, KVGeometry):
        return value.wire()
    if value is None:
        return []  # a geometry the layout does not have: [] on the wire
    if isinstance(value, tuple):
        return list(value)
    return value


def golden_files() -> dict[str, bytes]:
    """Every file under ``protocol/`` that is generated, by relative path."""
    out: dict[str, bytes] = {}
    index: dict[str, Any] = {}
    for name, msg in example_messages().items():
        data = m.encode(msg)
        out[f"golden/{name}.bin"] = data
        index[name] = {
            "type": msg.TYPE,
            "fields": {k: _jsonable(v) for k, v in vars(msg).items()},
            "hex": data.hex(),
        }
    for name, data in example_frames().items():
        if name == "FRAME_WRITE":
            shown = data[: f.HEADER_SIZE + 2 * f.RUN_SIZE]
            index[name] = {"hex_header_and_runs": shown.hex(), "payload": "16384 zero bytes"}
        else:
            index[name] = {"hex": data.hex()}
        out[f"golden/{name}.bin"] = data
    out["golden/vectors.json"] = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
    out["schema.json"] = (json.dumps(m.schema(), indent=2) + "\n").encode()
    return out


BEGIN = "<!-- BEGIN GENERATED MESSAGES (tools/gen_golden.py) -->"
END = "<!-- END GENERATED MESSAGES -->"


def messages_markdown() -> str:
    """The SPEC's message reference, generated from the message classes."""
    lines = []
    for name, cls in m.MESSAGE_TYPES.items():
        lines.append(f"### `{name}`\n")
        lines.append(f"{cls.DOC}\n")
        lines.append("| field | type | meaning |")
        lines.append("|---|---|---|")
        for fld in dataclasses.fields(cls):
            kind = fld.metadata["kind"]
            type_name = kind.name
            maximum = getattr(kind, "maximum", None)
            if maximum is not None and maximum != m.U64:
                type_name += f" ≤ {maximum}"
            lines.append(f"| `{fld.name}` | {type_name} | {fld.metadata['doc']} |")
        lines.append("")
    return "\n".join(lines)


def spec_with_messages(spec: str) -> str:
    head, _, rest = spec.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n\n{messages_markdown()}\n{END}{tail}"


def write(protocol_dir: Path) -> list[Path]:
    written = []
    for rel, data in golden_files().items():
        path = protocol_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        written.append(path)
    spec = protocol_dir / "SPEC.md"
    spec.write_text(spec_with_messages(spec.read_text()))
    written.append(spec)
    return written
