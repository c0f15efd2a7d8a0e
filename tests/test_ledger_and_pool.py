"""The page ledger, allocation and free policies, the capacity invariant, regions and layouts."""

from __future__ import annotations

import mmap
import warnings

import numpy as np
import pytest

from kvxfer.core import native as native_module
from kvxfer.core.checksum import ChecksumAlgo, checksum_pages, page_runs
from kvxfer.core.layout import KVLayout
from kvxfer.core.ledger import AllocPolicy, PageLedger, PageState
from kvxfer.core.memory import HostRegion, as_region
from kvxfer.core.pool import POISON_PATTERN, FreePolicy, PagePool, check_capacity, poison_offsets
from kvxfer.core.runs import build_batch, coalesce
from kvxfer.errors import CapacityError, ConfigError, LedgerInvariantError, PageStateError, PoolExhausted

from .conftest import make_layout


def test_lifo_hands_out_most_recently_freed_pages():
    ledger = PageLedger(16, policy="lifo")
    a = ledger.allocate(4, 1)
    b = ledger.allocate(4, 2)
    ledger.release(a, 1, allowed=(PageState.RESERVED,))
    c = ledger.allocate(4, 3)
    assert sorted(c.tolist()) == sorted(a.tolist())
    assert not set(b.tolist()) & set(c.tolist())
    ledger.check_invariants()


def test_fifo_hands_out_least_recently_freed_pages():
    ledger = PageLedger(8, policy="fifo")
    a = ledger.allocate(4, 1)
    ledger.release(a, 1, allowed=(PageState.RESERVED,))
    b = ledger.allocate(4, 2)  # the never-used pages come first
    assert not set(a.tolist()) & set(b.tolist())
    c = ledger.allocate(4, 3)
    assert sorted(c.tolist()) == sorted(a.tolist())
    ledger.check_invariants()


def test_random_policy_is_seeded_and_covers_the_pool():
    first = PageLedger(64, policy="random", seed=5).allocate(10, 1)
    again = PageLedger(64, policy="random", seed=5).allocate(10, 1)
    other = PageLedger(64, policy="random", seed=6).allocate(10, 1)
    assert np.array_equal(first, again) and not np.array_equal(first, other)
    ledger = PageLedger(64, policy="random", seed=1)
    pages = ledger.allocate(64, 1)
    assert sorted(pages.tolist()) == list(range(64))
    ledger.check_invariants()


@pytest.fixture(params=["c", "numpy"])
def random_pop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Large random pops in C (``random_take``, where the extension is built) or with numpy's choice."""
    from kvxfer.core import ledger as ledger_module

    if request.param == "c" and ledger_module._RANDOM_TAKE is None:
        pytest.skip(f"the native random_take: {native_module.describe()}")
    if request.param == "numpy":
        monkeypatch.setattr(ledger_module, "_RANDOM_TAKE", None)
    return request.param


def test_random_pops_are_uniform_over_the_free_pages(random_pop: str):
    """Pops of 40 pages (past the one-by-one picks) from 200 free pages, 3,000 times: every page is drawn
    about as often as any other (each count within 6 standard deviations of 600), and a pop's order is
    random too (its first entry is no more often the list's first than any other)."""
    ledger = PageLedger(200, policy="random", seed=3)
    counts = np.zeros(200, dtype=np.int64)
    first = np.zeros(200, dtype=np.int64)
    for gen in range(1, 3001):
        pages = ledger.allocate(40, gen)
        assert len(np.unique(pages)) == 40
        counts[pages] += 1
        first[pages[0]] += 1
        ledger.release(pages, gen, allowed=(PageState.RESERVED,))
    expected, sd = 3000 * 40 / 200, (3000 * 0.2 * 0.8) ** 0.5
    assert np.abs(counts - expected).max() < 6 * sd, counts
    assert first.max() < 15 + 6 * (15 ** 0.5), first  # 3,000 firsts over 200 pages: 15 each


def test_random_take_refuses_what_does_not_fit_its_arrays():
    if not native_module.provides("random_take"):
        pytest.skip(f"the native random_take: {native_module.describe()}")
    items, out = np.arange(10, dtype=np.int64), np.empty(4, dtype=np.int64)
    for bad in ((items, 11, out), (items, 3, out), (items, -1, out), (items.astype(np.int32)[:9], 2, out)):
        with pytest.raises(ValueError, match="int64"):
            native_module.lib.random_take(*bad, 7)
    native_module.lib.random_take(items, 10, out, 7)
    assert sorted(out.tolist() + items[:6].tolist()) == list(range(10))


def test_random_policy_keeps_the_free_list_exact_through_churn(random_pop: str):
    """The random free list closes the holes a pop leaves with its tail's survivors: through random
    allocations and releases every page is either free once or held once, and every page is handed out
    over time (the choice stays uniform over what is free, not biased to the list's front)."""
    ledger = PageLedger(500, policy="random", seed=9)
    rng = np.random.default_rng(2)
    held: list[tuple[int, np.ndarray]] = []
    handed_out: set[int] = set()
    for gen in range(1, 800):
        if held and (rng.random() < 0.45 or ledger.free_count < 40):
            old_gen, pages = held.pop(int(rng.integers(0, len(held))))
            ledger.release(pages, old_gen, allowed=(PageState.RESERVED,))
        else:
            pages = ledger.allocate(int(rng.integers(1, 40)), gen)
            handed_out.update(pages.tolist())
            held.append((gen, pages))
        ledger.check_invariants()
        free = ledger.free_pages().tolist()
        in_use = [p for _, pages in held for p in pages.tolist()]
        assert len(set(free)) == len(free) and sorted(free + in_use) == list(range(500))
    assert len(handed_out) == 500


def test_generation_changes_on_every_allocation():
    ledger = PageLedger(4)
    seen = []
    for gen in range(1, 6):
        pages = ledger.allocate(4, gen)
        seen.append(int(ledger.generation[pages[0]]))
        ledger.release(pages, gen, allowed=(PageState.RESERVED,))
    assert seen == [1, 2, 3, 4, 5]


def test_state_moves_are_checked_against_owner_and_state():
    ledger = PageLedger(8)
    pages = ledger.allocate(3, 7)
    with pytest.raises(PageStateError, match=r"page \d+ is RESERVED of generation 7, expected RESERVED of generation 8"):
        ledger.move(pages, 8, PageState.QUARANTINED, allowed=(PageState.RESERVED,))
    with pytest.raises(PageStateError, match="expected WRITTEN"):
        ledger.move(pages, 7, PageState.READABLE, allowed=(PageState.WRITTEN,))
    assert (ledger.state[pages] == PageState.RESERVED).all()  # unchanged
    ledger.move(pages, 7, PageState.QUARANTINED, allowed=(PageState.RESERVED,))
    with pytest.raises(PageStateError):
        ledger.release(pages, 7, allowed=(PageState.RESERVED,))
    with pytest.raises(PageStateError, match="out of range"):
        ledger.release(np.array([99]), 7, allowed=(PageState.QUARANTINED,))
    with pytest.raises(PageStateError, match="use release"):
        ledger.move(pages, 7, PageState.FREE, allowed=(PageState.QUARANTINED,))
    ledger.release(pages, 7, allowed=(PageState.QUARANTINED,))
    assert ledger.free_count == 8
    ledger.check_invariants()


def test_mark_written_skips_pages_that_changed_owner_or_state():
    ledger = PageLedger(8)
    pages = ledger.allocate(4, 1)
    ledger.move(pages[:2], 1, PageState.QUARANTINED, allowed=(PageState.RESERVED,))
    assert ledger.mark_written(pages, 1) == 2
    assert (ledger.state[pages[2:]] == PageState.WRITTEN).all()
    assert (ledger.state[pages[:2]] == PageState.QUARANTINED).all()


def test_adopt_takes_exactly_the_named_free_pages():
    ledger = PageLedger(10, policy="fifo")
    ledger.adopt([3, 5], 1)
    assert ledger.state[3] == PageState.RESERVED and 3 not in ledger.free_pages().tolist()
    with pytest.raises(PageStateError, match="not free"):
        ledger.adopt([5, 6], 2)
    with pytest.raises(PageStateError, match="out of range"):
        ledger.adopt([10], 2)
    with pytest.raises(PageStateError, match="twice"):
        ledger.adopt([6, 6], 2)
    ledger.check_invariants()


def test_pool_exhaustion_is_retryable_and_changes_nothing():
    ledger = PageLedger(4)
    ledger.allocate(3, 1)
    with pytest.raises(PoolExhausted, match="2 pages requested, 1 of 4 free"):
        ledger.allocate(2, 2)
    assert ledger.free_count == 1
    ledger.check_invariants()


def test_invariant_catches_corrupted_bookkeeping():
    ledger = PageLedger(6)
    ledger.allocate(2, 1)
    ledger.state[5] = PageState.READABLE  # a page marked held but still on the free list
    with pytest.raises(LedgerInvariantError, match="free list and page states disagree"):
        ledger.check_invariants()


def test_counts_always_sum_to_the_pool():
    ledger = PageLedger(10)
    p = ledger.allocate(6, 1)
    ledger.move(p[:2], 1, PageState.QUARANTINED, allowed=(PageState.RESERVED,))
    counts = ledger.counts()
    assert counts == {"free": 4, "reserved": 4, "written": 0, "readable": 0, "quarantined": 2}


def test_unknown_policy_names_fail_clearly():
    with pytest.raises(ConfigError, match="unknown allocation policy 'mru'"):
        AllocPolicy.parse("mru")
    with pytest.raises(ConfigError, match="unknown free policy"):
        FreePolicy.parse("shred")


# capacity ---------------------------------------------------------------------------------------


def test_capacity_invariant_names_both_numbers_and_the_band():
    with pytest.raises(CapacityError) as err:
        check_capacity(role="prefill", pool_tokens=681_280, max_context=1_048_576)
    text = str(err.value)
    assert "prefill pool 681,280 tokens < context 1,048,576 tokens" in text
    assert "681,281-1,048,576" in text and "367,296 tokens, 35%" in text
    check_capacity(role="prefill", pool_tokens=2_040_000, max_context=1_048_576)


def test_capacity_override_warns_loudly(caplog):
    with pytest.warns(RuntimeWarning, match="UNSAFE CONFIGURATION"):
        check_capacity(role="decode", pool_tokens=10, max_context=20, allow_undersized=True)
    assert any("UNSAFE CONFIGURATION" in r.message for r in caplog.records)


# free policies ---------------------------------------------------------------------------------


def test_keep_policy_leaves_bytes():
    pool = PagePool(make_layout(8), free_policy="keep")
    pages = pool.ledger.allocate(2, 1)
    pool.layout.views()[0][pages] = 7
    pool.release(pages, 1, allowed=(PageState.RESERVED,))
    assert (pool.layout.views()[0][pages] == 7).all()


def test_zero_policy_zeroes_every_buffer():
    pool = PagePool(make_layout(8), free_policy="zero")
    pages = pool.ledger.allocate(2, 1)
    for view in pool.layout.views():
        view[pages] = 9
    pool.release(pages, 1, allowed=(PageState.RESERVED,))
    assert all((view[pages] == 0).all() for view in pool.layout.views())


def test_poison_policy_marks_unwritten_pages_detectably():
    pool = PagePool(make_layout(8), free_policy="poison")
    assert pool.poisoned(np.arange(8)).size == 8  # a never-written pool is poisoned from the start
    pages = pool.ledger.allocate(3, 1)
    for view in pool.layout.views():
        view[pages[:2]] = 1  # two pages written in full, one not
    assert pool.poisoned(pages).tolist() == [int(pages[2])]
    pool.layout.views()[1][pages[0], -8:] = np.frombuffer(POISON_PATTERN, dtype=np.uint8)
    assert set(pool.poisoned(pages).tolist()) == {int(pages[0]), int(pages[2])}
    pool.release(pages, 1, allowed=(PageState.RESERVED,))
    assert pool.poisoned(pages).size == 3
    assert POISON_PATTERN != bytes(8)


def test_poison_offsets_cover_start_middle_end():
    assert poison_offsets(1024) == [0, 512, 1016]
    assert poison_offsets(8) == [0]
    with pytest.raises(ConfigError):
        poison_offsets(4)


def test_release_refuses_before_scrubbing_foreign_pages():
    pool = PagePool(make_layout(8), free_policy="zero")
    pages = pool.ledger.allocate(2, 1)
    pool.layout.views()[0][pages] = 5
    with pytest.raises(PageStateError):
        pool.release(pages, 2, allowed=(PageState.RESERVED,))
    assert (pool.layout.views()[0][pages] == 5).all()


# regions and layouts -----------------------------------------------------------------------------


def test_regions_from_every_host_memory_kind():
    arr = np.zeros((4, 16), dtype=np.float32)
    assert as_region(arr).nbytes == 256
    ba = bytearray(100)
    region = as_region(ba)
    region.array[0] = 3
    assert ba[0] == 3
    mm = mmap.mmap(-1, 4096)
    assert as_region(mm).nbytes == 4096
    with pytest.raises(ConfigError, match="immutable"):
        as_region(b"abc")
    with pytest.raises(ConfigError, match="not C-contiguous"):
        as_region(np.zeros((4, 4))[:, ::2])
    with pytest.raises(ConfigError, match="cannot register"):
        as_region(object())
    ptr_region = HostRegion.from_pointer(arr.ctypes.data, arr.nbytes, owner=arr)
    ptr_region.array[:4] = 255
    assert arr.view(np.uint8)[0, :4].tolist() == [255] * 4


def test_torch_cpu_tensor_region():
    torch = pytest.importorskip("torch")
    t = torch.zeros(8, 32, dtype=torch.float16)
    region = as_region(t)
    region.array[:2] = 0xFF
    assert t.view(torch.uint8)[0, :2].tolist() == [255, 255]


def test_layout_geometry_and_compatibility():
    layout = KVLayout.from_arrays([np.zeros((10, 64), np.uint8), np.zeros((10, 32), np.uint16)], page_size=4)
    assert layout.num_pages == 10 and layout.item_lens.tolist() == [64, 64] and layout.pool_tokens == 40
    assert layout.pages_for_tokens(9) == 3 and layout.page_bytes == 128
    layout.check_compatible({"page_size": 4, "item_lens": [64, 64]})
    with pytest.raises(ConfigError, match="buffer 1 item_len 32 != local 64"):
        layout.check_compatible({"page_size": 4, "item_lens": [64, 32]})
    with pytest.raises(ConfigError, match="page_size 8 tokens"):
        layout.check_compatible({"page_size": 8, "item_lens": [64, 64]})
    with pytest.raises(ConfigError, match="out of range"):
        layout.check_pages(np.array([3, 10]))


def test_layout_from_pointers_like_sglang():
    bufs = [np.zeros(8 * 128, np.uint8) for _ in range(4)]
    layout = KVLayout.from_pointers([b.ctypes.data for b in bufs], [b.nbytes for b in bufs], [128] * 4, page_size=16)
    assert layout.num_pages == 8
    layout.views()[2][5] = 1
    assert bufs[2][5 * 128 : 6 * 128].sum() == 128
    with pytest.raises(ConfigError, match="disagree on the page count"):
        KVLayout.from_pointers([bufs[0].ctypes.data] * 2, [1024, 512], [128, 128], page_size=16)


def test_layout_rejects_overlap_and_overflow():
    region = as_region(np.zeros(1000, np.uint8))
    from kvxfer.core.layout import BufferSpec

    with pytest.raises(ConfigError, match="overlap"):
        KVLayout([BufferSpec(region, 0, 100), BufferSpec(region, 50, 100)], num_pages=2, page_size=1)
    with pytest.raises(ConfigError, match="do not fit"):
        KVLayout([BufferSpec(region, 0, 600)], num_pages=2, page_size=1)


# checksums and runs ------------------------------------------------------------------------------


def test_checksum_is_over_canonical_order_and_matches_zlib_semantics():
    import zlib

    layout = make_layout(8, buffers=2, item=64)
    rng = np.random.default_rng(0)
    for view in layout.views():
        view[:] = rng.integers(0, 256, view.shape, dtype=np.uint8)
    pages = np.array([5, 1, 2, 3])
    expected = b"".join(layout.views()[b][p].tobytes() for b in range(2) for p in pages)
    assert checksum_pages(layout, pages, "adler32") == zlib.adler32(expected)
    assert checksum_pages(layout, pages, ChecksumAlgo.CRC32) == zlib.crc32(expected)
    assert checksum_pages(layout, pages[::-1], "adler32") != zlib.adler32(expected)


def test_page_runs_and_coalescing():
    starts, lengths = page_runs(np.array([4, 5, 6, 9, 10, 2]))
    assert starts.tolist() == [4, 9, 2] and lengths.tolist() == [3, 2, 1]
    s, d, c = coalesce(np.array([0, 1, 2, 7, 8]), np.array([10, 11, 20, 21, 22]))
    assert (s.tolist(), d.tolist(), c.tolist()) == ([0, 2, 7], [10, 20, 21], [2, 1, 2])
    layout = make_layout(32, buffers=2, item=100)
    batch = build_batch(layout, np.array([0, 1, 5]), np.array([3, 4, 9]), slot=1, gen=2)
    assert batch.buffers.tolist() == [0, 0, 1, 1]
    assert batch.src_offsets.tolist() == [0, 500, 0, 500]
    assert batch.dst_offsets.tolist() == [300, 900, 300, 900]
    assert batch.lengths.tolist() == [200, 100, 200, 100]


def test_no_warnings_on_import():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        import importlib

        import kvxfer

        importlib.reload(kvxfer)


def test_checksum_combination_equals_the_checksum_of_the_concatenation():
    import zlib

    from hypothesis import given, settings
    from hypothesis import strategies as st

    from kvxfer.core.checksum import combine_adler32, combine_crc32

    @settings(max_examples=60, deadline=None)
    @given(st.lists(st.binary(min_size=0, max_size=6000), min_size=0, max_size=12))
    def check(pieces):
        joined = b"".join(pieces)
        lens = np.array([len(p) for p in pieces], dtype=np.int64)
        assert combine_adler32(np.array([zlib.adler32(p) for p in pieces]), lens) == zlib.adler32(joined)
        assert combine_crc32(np.array([zlib.crc32(p) for p in pieces]), lens) == zlib.crc32(joined)

    check()


def test_host_regions_are_really_prefaulted():
    import resource

    from kvxfer.core.memory import allocate_host

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    before = rss()
    region = allocate_host(64 << 20, prefault=True)
    assert rss() - before > 48 << 20
    region.close()
    del resource
