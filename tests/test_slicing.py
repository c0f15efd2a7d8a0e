"""The slice mapping against a reference (issue 24): random TP pairs, head counts, page sizes and
orders. The reference builds the request's KV as a ``[token][head][byte]`` tensor, lays it into the
writer's pages and the receiver's pages the way each rank's geometry says, and the test checks that
copying the runs :func:`chunk_runs` produces (chunk by chunk) makes the receiver's pages exactly the
reference's, touches no byte outside the leg, and that the receiver's :class:`SliceTable` accepts
those runs, counts every atom covered and refuses anything else."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.core.checksum import ChecksumAlgo
from kvxfer.core.geometry import KVGeometry, heads_of_rank, pair_problem, plan_legs, serves, writers_of
from kvxfer.core.slicing import LegAtoms, LegShape, SliceTable, canonical_pieces, chunk_runs
from kvxfer.errors import ConfigError

from .tp_env import page_of


def checksum(flat: np.ndarray, addresses: np.ndarray, lengths: np.ndarray) -> int:
    value = ChecksumAlgo.ADLER32.initial
    for a, n in zip(addresses.tolist(), lengths.tolist()):
        value = ChecksumAlgo.ADLER32.update(flat[a:a + n].tobytes(), value)
    return value


@st.composite
def legs(draw):
    total = draw(st.sampled_from([1, 2, 4, 8]))
    tp_w = draw(st.sampled_from([1, 2, 4]))
    tp_r = draw(st.sampled_from([1, 2, 4]))
    order = draw(st.sampled_from(["NHD", "HND"]))
    base = draw(st.sampled_from([1, 2, 4]))
    src_page = base * draw(st.sampled_from([1, 2, 4]))
    dst_page = base * draw(st.sampled_from([1, 2, 4]))
    if max(src_page, dst_page) % min(src_page, dst_page):
        dst_page = src_page
    hb = draw(st.sampled_from([1, 2, 6]))
    tokens = draw(st.integers(1, 40))
    r_rank = draw(st.integers(0, tp_r - 1))
    receiver = KVGeometry.attention(layers=1, total_heads=total, head_dim=hb, itemsize=1, dtype="u8",
                                    tp_rank=r_rank, tp_size=tp_r, order=order)
    writers = [KVGeometry.attention(layers=1, total_heads=total, head_dim=hb, itemsize=1, dtype="u8",
                                    tp_rank=w, tp_size=tp_w, order=order) for w in writers_of(receiver, tp_w)]
    plan = plan_legs(receiver, writers)
    index = draw(st.sampled_from([i for i, (_, n) in enumerate(plan) if n]))
    shape = LegShape(tokens=tokens, src_page=src_page, dst_page=dst_page, src_heads=writers[index].heads[:2],
                     dst_heads=receiver.heads[:2], leg=plan[index], order=order)
    chunks = draw(st.lists(st.integers(1, 5), min_size=1, max_size=12))
    seed = draw(st.integers(0, 2**31))
    return shape, total, hb, chunks, seed


@given(legs())
@settings(max_examples=300, deadline=None)
def test_runs_put_every_byte_of_the_leg_where_the_reference_says_and_nothing_else(case):
    shape, total, hb, chunk_sizes, seed = case
    rng = np.random.default_rng(seed)
    kv = rng.integers(0, 256, size=(shape.tokens, total, hb), dtype=np.uint8)
    P, Q = shape.src_page, shape.dst_page
    src_item = P * shape.src_heads[1] * hb
    dst_item = Q * shape.dst_heads[1] * hb
    n_src, n_dst = shape.src_pages, shape.dst_pages
    src_pool, dst_pool = n_src + 5, n_dst + 5
    src_ids = rng.permutation(src_pool)[:n_src]
    dst_ids = rng.permutation(dst_pool)[:n_dst]
    src = rng.integers(0, 256, size=src_pool * src_item, dtype=np.uint8)  # stale bytes everywhere else
    for i, page in enumerate(src_ids):
        src[page * src_item:(page + 1) * src_item] = page_of(kv, shape.src_heads, P, shape.order, i)
    dst = rng.integers(0, 256, size=dst_pool * dst_item, dtype=np.uint8)
    before = dst.copy()
    atoms = LegAtoms(shape)
    table = SliceTable(atoms, dst_ids, np.array([dst_item]), np.array([hb]))
    sent = 0
    for size in chunk_sizes + [n_src]:
        take = min(size, n_src - sent)
        if take <= 0:
            break
        runs = chunk_runs(atoms, sent, src_ids[sent:sent + take], dst_ids, np.array([src_item]),
                          np.array([dst_item]), np.array([hb]))
        assert (runs.lengths % runs.units == 0).all()
        located = table.locate(runs.buffers, runs.dst_offsets, runs.lengths)
        assert located is not None, "the receiver refused an honest run"
        table.record(runs.buffers, *located)
        for s, d, n in zip(runs.src_offsets.tolist(), runs.dst_offsets.tolist(), runs.lengths.tolist()):
            dst[d:d + n] = src[s:s + n]
        sent += take
    assert table.uncovered_pages().size == 0 and table.duplicates == 0
    # every byte the leg owns is the reference's (tokens past the prompt: the writer's zero page tails);
    # every other byte is as it was
    expected = before.copy()
    a, n = shape.leg
    full = np.concatenate([kv, np.zeros((shape.covered - shape.tokens, total, hb), np.uint8)])
    mask = np.zeros((shape.covered, total, hb), dtype=np.uint8)
    mask[:, a:a + n] = 1
    for i, page in enumerate(dst_ids):
        want = page_of(full, shape.dst_heads, Q, shape.order, i)
        mine = page_of(mask, shape.dst_heads, Q, shape.order, i).astype(bool)
        expected[page * dst_item:(page + 1) * dst_item][mine] = want[mine]
    diff = np.flatnonzero(dst != expected)
    assert diff.size == 0, f"{diff.size} bytes differ from the reference (first at {diff[:4]})"
    # the canonical checksums agree, source against destination
    s_addr, s_len = canonical_pieces(atoms, src_ids, source=True, bases=np.array([0]), items=np.array([src_item]),
                                     head_bytes=np.array([hb]))
    d_addr, d_len = table.pieces(np.array([0]))
    assert s_len.sum() == d_len.sum() == table.nbytes
    assert checksum(src, s_addr, s_len) == checksum(dst, d_addr, d_len)


@given(legs(), st.integers(0, 2**31))
@settings(max_examples=200, deadline=None)
def test_the_receiver_accepts_exactly_the_runs_of_whole_adjacent_atoms(case, seed):
    """Oracle by brute force over bytes: a run is acceptable iff it starts where an atom starts, ends
    where one ends, and every byte between belongs to the leg's atoms in the reserved pages."""
    shape, _total, hb, _chunks, _ = case
    rng = np.random.default_rng(seed)
    dst_item = shape.dst_page * shape.dst_heads[1] * hb
    pool = shape.dst_pages + 3
    dst_ids = rng.permutation(pool)[:shape.dst_pages]
    table = SliceTable(LegAtoms(shape), dst_ids, np.array([dst_item]), np.array([hb]))
    starts, ends, _order, _gaps = table._tables[0]
    owned = np.zeros(pool * dst_item + 1, dtype=bool)
    for a, b in zip(starts.tolist(), ends.tolist()):
        owned[a:b] = True
    first, last = set(starts.tolist()), set(ends.tolist())
    for _ in range(60):
        if rng.random() < 0.5:  # near an atom: the interesting edges
            i = int(rng.integers(0, starts.size))
            j = min(starts.size - 1, i + int(rng.integers(0, 4)))
            off = int(starts[i]) + int(rng.integers(-1, 2))
            end = int(ends[j]) + int(rng.integers(-1, 2))
        else:
            off = int(rng.integers(0, pool * dst_item))
            end = off + int(rng.integers(1, 3 * dst_item))
        if off < 0 or end <= off:
            continue
        expect = off in first and end in last and end <= pool * dst_item and bool(owned[off:end].all())
        got = table.locate(np.array([0]), np.array([off]), np.array([end - off])) is not None
        assert got == expect, (off, end, expect)


def test_whole_legs_are_page_for_page():
    shape = LegShape(tokens=33, src_page=16, dst_page=16, src_heads=(0, 4), dst_heads=(0, 4), leg=(0, 4))
    assert shape.whole and shape.covered == 48
    assert not LegShape(tokens=33, src_page=16, dst_page=32, src_heads=(0, 4), dst_heads=(0, 4), leg=(0, 4)).whole
    assert not LegShape(tokens=33, src_page=16, dst_page=16, src_heads=(0, 8), dst_heads=(0, 4), leg=(0, 4)).whole


def test_head_split_follows_the_deployments_rule():
    assert [heads_of_rank(8, 2, r) for r in range(2)] == [(0, 4), (4, 4)]
    assert [heads_of_rank(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    d = KVGeometry.attention(layers=2, total_heads=8, head_dim=4, itemsize=2, dtype="bf16", tp_rank=1, tp_size=2)
    writers = [KVGeometry.attention(layers=2, total_heads=8, head_dim=4, itemsize=2, dtype="bf16", tp_rank=r,
                                    tp_size=4) for r in writers_of(d, 4)]
    assert writers_of(d, 4) == [2, 3] and plan_legs(d, writers) == [(4, 2), (6, 2)]
    one = KVGeometry.attention(layers=2, total_heads=8, head_dim=4, itemsize=2, dtype="bf16", tp_rank=0, tp_size=1)
    assert writers_of(d, 1) == [0] and plan_legs(d, [one]) == [(4, 4)] and serves(one, d)
    latent = [KVGeometry.latent(layers=2, token_bytes=64, dtype="bf16", tp_rank=r, tp_size=2) for r in range(2)]
    solo = KVGeometry.latent(layers=2, token_bytes=64, dtype="bf16")
    assert plan_legs(solo, latent) == [(0, 1), (0, 0)]  # MLA: written once, by the first rank


def test_pairs_kvxfer_cannot_translate_are_named():
    a = KVGeometry.attention(layers=2, total_heads=8, head_dim=4, itemsize=2, dtype="bf16")
    hnd = KVGeometry.attention(layers=2, total_heads=8, head_dim=4, itemsize=2, dtype="bf16", order="HND")
    assert "does not transpose" in pair_problem(a, 16, hnd, 16)
    assert "neither is a multiple" in pair_problem(a, 16, a, 24)
    f32 = KVGeometry.attention(layers=2, total_heads=8, head_dim=2, itemsize=4, dtype="f32")
    assert "dtype" in pair_problem(a, 16, f32, 16)
    tp3 = KVGeometry.attention(layers=2, total_heads=6, head_dim=4, itemsize=2, dtype="bf16", tp_size=3)
    tp2 = KVGeometry.attention(layers=2, total_heads=6, head_dim=4, itemsize=2, dtype="bf16", tp_size=2)
    assert "TP size" in pair_problem(tp2, 16, tp3, 16)
    assert pair_problem(a, 16, a, 64) == ""
    with pytest.raises(ConfigError, match="held by none"):
        plan_legs(a, [KVGeometry.attention(layers=2, total_heads=8, head_dim=4, itemsize=2, dtype="bf16",
                                           tp_rank=0, tp_size=2)])
