"""``kvxfer simulate``: the exposure simulation on kvxfer's real page ledger, at small sizes.

A pool of 4,096 pages with 1,000-token median prompts (16 pages of 64 tokens) and holds of 20..60
steps keeps about a quarter of the pool busy; the oversized request takes 1,024 pages (another quarter)."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from kvxfer.core.ledger import PageState
from kvxfer.errors import ConfigError
from kvxfer.tools import simulate
from kvxfer.tools.simulate import NEVER_WRITTEN, SimulationConfig, incident, run_one, sweep

SMALL = SimulationConfig(
    pool_pages=4096, median_tokens=1000, customers=50, hold_min_steps=20, hold_max_steps=60,
    oversized_tokens=1024 * 64, warmups=[0, 300], seeds=6,
)
WARM = 300
SEEDS = range(6)


@pytest.mark.parametrize("policy", ["lifo", "fifo", "random"])
def test_a_cold_pool_exposes_nothing(policy: str) -> None:
    result = run_one(SMALL, policy, 0, seed=1)
    assert result["foreign_share"] == 0 and result["customers_exposed"] == 0
    assert result["untouched_share"] == pytest.approx(1 - 1 / result["reserved_pages"])
    assert not result["leak_detected"] and result["stale_age_median"] is None


@pytest.mark.parametrize("policy", ["lifo", "fifo", "random"])
def test_a_warm_pool_exposes_other_customers(policy: str) -> None:
    results = [run_one(SMALL, policy, WARM, seed) for seed in SEEDS]
    assert all(r["leak_detected"] for r in results)
    assert all(r["foreign_share"] > 0 for r in results)
    assert np.median([r["customers_exposed"] for r in results]) > 1
    assert all(r["stale_age_median"] >= 1 for r in results)
    assert all(r["foreign_share"] + r["untouched_share"] == pytest.approx(1 - 1 / r["reserved_pages"]) for r in results)


def test_the_allocation_policy_decides_how_many_customers_are_exposed() -> None:
    def mean_customers(policy: str) -> float:
        return float(np.mean([run_one(SMALL, policy, WARM, seed)["customers_exposed"] for seed in SEEDS]))

    lifo, fifo, rand = mean_customers("lifo"), mean_customers("fifo"), mean_customers("random")
    assert rand > fifo > lifo
    assert rand > 2 * lifo


def test_fifo_reads_only_stale_data_once_the_fresh_pages_are_used_up() -> None:
    result = run_one(SMALL, "fifo", WARM, seed=2)
    assert result["foreign_share"] == pytest.approx(1 - 1 / result["reserved_pages"])
    assert result["untouched_share"] == 0


@pytest.mark.parametrize("policy", ["lifo", "fifo", "random"])
def test_the_real_ledger_accounting_holds_after_a_run(policy: str) -> None:
    run, result = incident(SMALL, policy, WARM, seed=3)
    counts = run.ledger.check_invariants()
    held = sum(pages.size for pages in run.held.values())
    assert counts["written"] == held + 1  # every background page, and the oversized request's first
    assert counts["reserved"] == result["reserved_pages"] - 1 == result["ledger_unwritten_pages"]
    assert counts["free"] == SMALL.pool_pages - held - result["reserved_pages"]
    assert counts["readable"] == counts["quarantined"] == 0
    written = np.flatnonzero(run.ledger.state == PageState.WRITTEN)
    assert (run.writer[written] != NEVER_WRITTEN).all()


def test_the_debug_flag_checks_the_ledger_every_step() -> None:
    config = SimulationConfig(**{**SMALL.__dict__, "debug": True})
    assert run_one(config, "random", 100, seed=4) == run_one(SMALL, "random", 100, seed=4)


def test_runs_are_reproducible_and_seeds_differ() -> None:
    assert run_one(SMALL, "random", WARM, seed=5) == run_one(SMALL, "random", WARM, seed=5)
    assert run_one(SMALL, "random", WARM, seed=5) != run_one(SMALL, "random", WARM, seed=6)


def test_the_sweep_aggregates_one_row_per_cell() -> None:
    config = SimulationConfig(**{**SMALL.__dict__, "policies": ["lifo", "random"], "seeds": 3})
    rows = sweep(config)
    assert [(r["policy"], r["warmup"]) for r in rows] == [("lifo", 0), ("lifo", WARM), ("random", 0), ("random", WARM)]
    cold, warm = rows[2], rows[3]
    assert cold["detection_rate"] == 0 and cold["foreign_share_max"] == 0 and cold["customers_exposed_max"] == 0
    assert warm["detection_rate"] == 1
    assert warm["foreign_share_min"] <= warm["foreign_share_median"] <= warm["foreign_share_max"]
    assert warm["customers_exposed_min"] <= warm["customers_exposed_median"] <= warm["customers_exposed_max"]


def test_an_impossible_config_is_refused() -> None:
    with pytest.raises(ConfigError):
        sweep(SimulationConfig(**{**SMALL.__dict__, "oversized_tokens": 10 * SMALL.pool_pages * 64}))
    with pytest.raises(ConfigError):
        sweep(SimulationConfig(**{**SMALL.__dict__, "policies": ["lru"]}))


def test_main_prints_the_table_and_writes_png_and_json(tmp_path, capsys) -> None:
    parser = argparse.ArgumentParser()
    simulate.add_arguments(parser)
    png, out = tmp_path / "exposure.png", tmp_path / "exposure.json"
    args = parser.parse_args([
        "--pool-pages", "4096", "--median-tokens", "1000", "--customers", "50", "--hold-steps", "20-60",
        "--oversized-tokens", str(1024 * 64), "--warmups", "0,100,300", "--policies", "lifo,fifo,random",
        "--seeds", "3", "--png", str(png), "--json", str(out),
    ])
    assert simulate.main(args) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(out.read_text())
    assert len(data["rows"]) == 9 and data["config"]["pool_pages"] == 4096
    assert {(r["policy"], r["warmup"]) for r in data["rows"]} == {
        (p, w) for p in ("lifo", "fifo", "random") for w in (0, 100, 300)
    }
    printed = capsys.readouterr().out
    assert "Cold pool" in printed and "blast radius" in printed
