"""Fuzz targets: every decoder a peer's bytes reach, driven with arbitrary input.

Three targets, shared by the coverage-guided fuzzer (``tools/fuzz.py``, atheris/libFuzzer), the
hypothesis tests and the corpus replay test:

* :func:`control_message`: one control message as it arrives on the control plane
  (:func:`kvxfer.wire.messages.decode`), plus DONE's verbs write log when present;
* :func:`frame_stream`: a data-plane byte stream as the tcp receiver consumes it: frame headers,
  WRITE run tables checked by a real :class:`~kvxfer.core.writeguard.WriteGuard` against a real ledger
  with a write window open (its C check where built, then held to the Python rules), ORDERED and
  CONNECT message bodies, and DONE frames' binary bodies;
* :func:`result_stream`: what a writer reads back on its data connection (RESULT frames), through
  :class:`~kvxfer.wire.frames.ResultReader`, whole and in pieces (both must read the same messages).

The contract under test: malformed input raises :class:`~kvxfer.errors.ProtocolError`, a write the
guard refuses raises :class:`~kvxfer.errors.WriteRefused`, and nothing else escapes. A target
returns normally for input that is fine; any other exception is a bug.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ProtocolError, WriteRefused
from . import frames as f
from . import messages as m

FUZZ_PAGES = 64
FUZZ_ITEM = 256
FUZZ_BUFFERS = 2
FUZZ_SLOT = 3
FUZZ_GEN = 7
_guard = None


def control_message(data: bytes) -> None:
    try:
        msg = m.decode(data)
    except ProtocolError:
        return
    # what decodes must re-encode to a message that decodes equal (no half-validated fields)
    again = m.decode(m.encode(msg))
    if type(again) is not type(msg):
        raise AssertionError(f"{msg.TYPE} re-decoded as {again.TYPE}")
    if isinstance(msg, m.Done) and msg.runs:
        from .frames import parse_write_log

        try:
            runs = parse_write_log(msg.runs)
        except ProtocolError:
            return
        _check_runs_with_guard(runs, conn="fuzz", slot=FUZZ_SLOT, gen=FUZZ_GEN)


def frame_stream(data: bytes) -> None:
    view = memoryview(data)
    pos = 0
    while pos + f.HEADER_SIZE <= len(view):
        try:
            header = f.parse_header(view[pos : pos + f.HEADER_SIZE])
        except ProtocolError:
            return  # the receiver fences the connection here
        pos += f.HEADER_SIZE
        body = view[pos : pos + header.body_len]
        if len(body) < header.body_len:
            return  # the stream ended mid-frame: connection lost
        pos += header.body_len
        try:
            if header.kind is f.FrameKind.WRITE:
                runs = f.parse_runs(header, body)
                _check_runs_with_guard(runs, conn="fuzz", slot=header.slot, gen=header.generation)
                pos += header.payload_len
            elif header.kind is f.FrameKind.CONNECT:
                m.decode(body)
            else:
                f.ordered_message(header, body)
        except ProtocolError:
            return
        except WriteRefused:
            pos += header.payload_len  # the receiver discards the payload and carries on


def result_stream(data: bytes) -> None:
    whole = _read_results(data, [len(data)])
    # the same bytes in pieces (sizes from the input itself) must read the same messages
    sizes = [1 + (b % 37) for b in data[:64]] or [1]
    pieces = _read_results(data, sizes)
    if whole != pieces:
        raise AssertionError(f"RESULT frames read whole ({whole!r}) and in pieces ({pieces!r}) differ")


def _read_results(data: bytes, sizes: list[int]) -> Any:
    reader = f.ResultReader()
    out: list[m.Message] = []
    pos, i = 0, 0
    while pos < len(data) and reader.error is None:
        size = sizes[i % len(sizes)]
        out += reader.feed(data[pos : pos + size])
        pos, i = pos + size, i + 1
    for msg in out:
        if not isinstance(msg, m.Result):
            raise AssertionError(f"the RESULT reader let {msg.TYPE} through")
    if reader.error is not None:
        try:
            reader.feed(b"")
        except ProtocolError:
            pass
        else:
            raise AssertionError("a reader out of sync read on")
        return ("refused", [msg.encode() for msg in out])
    return ("read", [msg.encode() for msg in out], reader.pending)


def _check_runs_with_guard(runs: np.ndarray, *, conn: str, slot: int, gen: int) -> None:
    guard = _fuzz_guard()
    try:
        window, counts = guard.check(conn, slot, gen, runs)
    except WriteRefused:
        return
    # an accepted write must stay inside the window's pages and the layout
    if (counts <= 0).any():
        raise AssertionError(f"accepted a run of {counts.min()} pages")
    items = guard.layout.item_lens[runs["buffer"].astype(np.int64)]
    first = runs["offset"].astype(np.int64) // items
    if (first < 0).any() or ((first + counts) > guard.layout.num_pages).any():
        raise AssertionError("accepted a write outside the layout")
    if not np.isin(first, window.pages).all():
        raise AssertionError("accepted a write outside the window")
    if guard._c is not None:  # the C check accepted it: the Python rules, the reference, must agree
        try:
            reference = guard._check_runs(window, runs)
        except WriteRefused as exc:
            raise AssertionError(f"the C write guard accepted a write its Python rules refuse: {exc}") from None
        if reference.tolist() != np.asarray(counts).tolist():
            raise AssertionError(f"C and Python page counts differ: {counts} against {reference}")


def _fuzz_guard():  # one small real guard with one window open, built once per process
    global _guard
    if _guard is None:
        from ..core.layout import KVLayout
        from ..core.ledger import PageLedger
        from ..core.writeguard import Window, WriteGuard

        layout = KVLayout.allocate(num_buffers=FUZZ_BUFFERS, item_len=FUZZ_ITEM, num_pages=FUZZ_PAGES, page_size=16)
        ledger = PageLedger(FUZZ_PAGES)
        pages = ledger.allocate(8, FUZZ_GEN)
        _guard = WriteGuard(layout, ledger)
        _guard.open(Window(rid="fuzz", gen=FUZZ_GEN, slot=FUZZ_SLOT, conn="fuzz", pages=pages))
    return _guard


TARGETS = {"messages": control_message, "frames": frame_stream, "results": result_stream}
