"""The fuzz targets under hypothesis, and every input of the kept corpus replayed (regressions).

The coverage-guided runs live in ``tools/fuzz.py`` (atheris; CI gives each target 60 s)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer.errors import ProtocolError
from kvxfer.wire import frames as f
from kvxfer.wire import fuzzing
from kvxfer.wire import messages as m

CORPUS = Path(__file__).resolve().parent.parent / "protocol" / "fuzz-corpus"
KEPT = sorted((t, p) for t in fuzzing.TARGETS for p in (CORPUS / t).iterdir())


def test_the_kept_corpus_exists_for_every_target():
    for target in fuzzing.TARGETS:
        assert len(list((CORPUS / target).iterdir())) >= 3, target


@pytest.mark.parametrize(("target", "path"), KEPT, ids=[f"{t}/{p.name}" for t, p in KEPT])
def test_kept_corpus_input_is_handled(target, path):
    fuzzing.TARGETS[target](path.read_bytes())


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=4096))
def test_arbitrary_bytes_as_a_control_message(data):
    fuzzing.control_message(data)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=4096))
def test_arbitrary_bytes_as_a_frame_stream(data):
    fuzzing.frame_stream(data)


_NO_SURROGATES = st.characters(blacklist_categories=("Cs",))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=4096))
def test_arbitrary_bytes_as_a_result_stream(data):
    fuzzing.result_stream(data)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.one_of(st.text(_NO_SURROGATES, min_size=1, max_size=20), st.integers(0, 2**63)),
                          st.integers(1, 2**64 - 1), st.booleans(), st.text(_NO_SURROGATES, max_size=300)),
                min_size=1, max_size=8),
       st.binary(max_size=64))
def test_result_frames_then_anything_read_whole_and_in_pieces_alike(results, tail):
    """Real RESULT frames followed by arbitrary bytes: the reader returns the same messages however the
    stream is cut (the target's own check), and every whole frame before the tail is read."""
    frames = [f.result_frame(m.Result(rid=rid, gen=gen, ok=ok, reason="" if ok else "x", detail=detail))
              for rid, gen, ok, detail in results]
    fuzzing.result_stream(b"".join(frames) + tail)
    assert f.ResultReader().feed(b"".join(frames))[-1].gen == results[-1][1]


U64 = 2**64
ITEM = fuzzing.FUZZ_ITEM


def _offsets() -> st.SearchStrategy[int]:
    window_page = st.integers(0, fuzzing.FUZZ_PAGES + 2).map(lambda p: p * ITEM)
    return st.one_of(window_page, st.integers(1, 4).map(lambda k: U64 - k * ITEM), st.integers(0, U64 - 1))


def _lengths() -> st.SearchStrategy[int]:
    return st.one_of(st.integers(1, 4).map(lambda k: k * ITEM), st.integers(1, 4).map(lambda k: U64 - k * ITEM),
                     st.integers(1, U64 - 1))


@settings(max_examples=600, deadline=None)
@given(runs=st.lists(st.tuples(st.integers(0, 3), _offsets(), _lengths()), min_size=1, max_size=6),
       slot=st.sampled_from([fuzzing.FUZZ_SLOT, 0]), gen=st.sampled_from([fuzzing.FUZZ_GEN, 1, 8]),
       claimed=st.one_of(st.none(), st.integers(1, 8 * ITEM)))
def test_structured_write_frames_aimed_at_the_open_window(runs, slot, gen, claimed):
    """Tags and offsets the guard accepts, with lengths that wrap 64 bits: refused, never a crash."""
    buffers, offsets, lengths = (np.array(col, dtype=np.uint64) for col in zip(*runs))
    table = f.pack_runs(buffers, offsets, lengths)
    payload_len = claimed if claimed is not None else int(lengths.sum(dtype=np.uint64)) or 1
    payload_len = min(max(payload_len, 1), f.MAX_PAYLOAD)
    header = f.write_header(slot, gen, len(runs), payload_len)
    fuzzing.frame_stream(header + table + b"\x00" * min(payload_len, 8 * ITEM))
    done = m.encode(m.Done(rid="fuzz", gen=fuzzing.FUZZ_GEN, bytes=1, pages=1, checksum=1, algo="adler32",
                           runs=table))
    fuzzing.control_message(done)


def test_run_lengths_that_wrap_are_a_protocol_error():
    page = int(fuzzing._fuzz_guard().window(fuzzing.FUZZ_GEN).pages[0])
    table = f.pack_runs(np.array([0, 0]), np.array([page * ITEM] * 2), np.array([U64 - ITEM, 2 * ITEM], dtype=np.uint64))
    header = f.parse_header(f.write_header(fuzzing.FUZZ_SLOT, fuzzing.FUZZ_GEN, 2, ITEM))
    with pytest.raises(ProtocolError, match="at most"):
        f.parse_runs(header, table)
    from kvxfer.wire.frames import parse_write_log

    with pytest.raises(ProtocolError, match="write log run of"):
        parse_write_log(table)
