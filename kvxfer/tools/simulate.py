"""``kvxfer simulate``: whose data an incomplete transfer exposes when pages are reused without zeroing.

This module owns the exposure simulation of the 2026 incident (a prompt longer than the prefill pool
was replaced by a 1-token placeholder, prefill wrote one page and reported "complete", decode read
every page it had reserved for the whole prompt). It drives kvxfer's real :class:`PageLedger` and its
real LIFO / FIFO / random allocation; the ledger does not know who wrote a page, so this module keeps
that itself: ``writer[page]`` (the request that last wrote it, -1 = never written), each request's
customer and the order in which requests completed.

The model, one step at a time (step ``t = 0, 1, ...``):

* first every background request whose hold ends at ``t`` releases its pages, unscrubbed;
* then one background request arrives: a log-normal prompt (``median_tokens``, ``sigma``) of
  ``ceil(tokens / page_tokens)`` pages, a customer drawn from ``customers``, and a hold drawn
  uniformly from ``hold_min_steps..hold_max_steps``. It is admitted if the ledger can allocate its
  pages, and writes all of them at once; otherwise it is refused (dropped). So at most one new
  request enters per step.

After ``warmup`` steps the oversized request arrives and follows the incident path: it reserves pages
for its whole prompt (waiting head-of-line, with releases going on and no new arrivals, until they
fit, as a decode scheduler would) but writes only the first one. Every other page it reserved holds
whatever its last writer left there: another request's data (foreign) or nothing (never written).

Default holds are 30..120 steps (mean 75). A request averages about 207 pages (the log-normal mean
is ``median * exp(sigma**2 / 2)``, about 13,200 tokens), so about 75 requests, some 15,500 pages or
47% of the pool, are held in steady state (reached after ``hold_max_steps``), spread by about 2,300
pages. That is as busy as the pool can run and still, most of the time, have room at once for the
default oversized request (12,500 pages, 38% of the pool; when it does not fit, it waits a few steps),
and background requests are practically never refused. Releases start at step 30, so short warm-ups
still hand out never-written pages.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..core.ledger import AllocPolicy, PageLedger, PageState
from ..errors import ConfigError, PoolExhausted

NEVER_WRITTEN = -1


@dataclass
class SimulationConfig:
    """One sweep: the pool, the background workload, the oversized request and the cells to run."""

    pool_pages: int = 32768
    page_tokens: int = 64
    median_tokens: int = 8000
    sigma: float = 1.0
    customers: int = 200
    hold_min_steps: int = 30
    hold_max_steps: int = 120
    oversized_tokens: int = 800_000
    warmups: list[int] = field(default_factory=lambda: [0, 25, 50, 100, 200, 400, 800])
    policies: list[str] = field(default_factory=lambda: ["lifo", "fifo", "random"])
    seeds: int = 20
    seed: int = 0
    debug: bool = False
    """Check the ledger's invariant after every step (slow), not only at the end of each run."""

    def validate(self) -> None:
        """ConfigError naming the ``kvxfer simulate`` flag of the first setting that cannot work."""
        for flag, value in (("--pool-pages", self.pool_pages), ("--page-tokens", self.page_tokens),
                            ("--median-tokens", self.median_tokens), ("--customers", self.customers)):
            if value <= 0:
                raise ConfigError(f"{flag} {value}: pool pages, page tokens, median tokens and customers must be "
                                  "positive")
        if self.sigma < 0:
            raise ConfigError(f"--sigma {self.sigma:g}: must be 0 or more")
        if not 1 <= self.hold_min_steps <= self.hold_max_steps:
            raise ConfigError(f"--hold-steps {self.hold_min_steps}-{self.hold_max_steps}: holds need "
                              f"1 <= min <= max (got {self.hold_min_steps}..{self.hold_max_steps})")
        if not 1 <= self.oversized_pages <= self.pool_pages:
            raise ConfigError(f"--oversized-tokens {self.oversized_tokens:,} / --page-tokens {self.page_tokens}: the "
                              f"oversized request needs 1..{self.pool_pages} pages (--pool-pages), got "
                              f"{self.oversized_pages}")
        if self.seeds <= 0:
            raise ConfigError(f"--seeds {self.seeds}: need at least one seed")
        if not self.warmups or any(w < 0 for w in self.warmups):
            raise ConfigError(f"--warmups {','.join(map(str, self.warmups))}: need at least one warm-up, and no "
                              "negative warm-up")
        if not self.policies:
            raise ConfigError("--policies: need at least one policy")
        for policy in self.policies:
            try:
                AllocPolicy.parse(policy)
            except ConfigError as exc:
                raise ConfigError(f"--policies {','.join(self.policies)}: {exc}") from None

    @property
    def oversized_pages(self) -> int:
        return -(-self.oversized_tokens // self.page_tokens)


@dataclass
class Workload:
    """The background requests' draws, one per arrival step."""

    pages: np.ndarray
    holds: np.ndarray
    customers: np.ndarray
    victim_customer: int


@dataclass
class PoolRun:
    """A pool after its warm-up: the real ledger plus who wrote each page and when requests finished."""

    ledger: PageLedger
    writer: np.ndarray
    customer_of: np.ndarray
    completed_at: np.ndarray
    """Completion ordinal of each request (-1 while it holds its pages or was refused)."""
    held: dict[int, np.ndarray]
    due: list[list[int]]
    step: int = 0
    completions: int = 0
    refused: int = 0
    debug: bool = False


# the background workload ------------------------------------------------------------------------
def draw_workload(config: SimulationConfig, warmup: int, rng: np.random.Generator) -> Workload:
    tokens = rng.lognormal(mean=math.log(config.median_tokens), sigma=config.sigma, size=warmup)
    pages = np.clip(np.ceil(tokens / config.page_tokens), 1, config.pool_pages).astype(np.int64)
    holds = rng.integers(config.hold_min_steps, config.hold_max_steps + 1, size=warmup)
    customers = rng.integers(0, config.customers, size=warmup + 1)
    return Workload(pages=pages, holds=holds, customers=customers[:warmup], victim_customer=int(customers[-1]))


def new_pool(config: SimulationConfig, policy: str, warmup: int, ledger_seed: int, workload: Workload) -> PoolRun:
    requests = warmup + 1
    return PoolRun(
        ledger=PageLedger(config.pool_pages, policy=policy, seed=ledger_seed),
        writer=np.full(config.pool_pages, NEVER_WRITTEN, dtype=np.int64),
        customer_of=np.append(workload.customers, workload.victim_customer).astype(np.int64),
        completed_at=np.full(requests, -1, dtype=np.int64),
        held={},
        due=[[] for _ in range(warmup + config.hold_max_steps + 1)],
        debug=config.debug,
    )


def generation_of(rid: int) -> int:
    """Request ids count arrivals from 0; generations must be positive, unique and increasing."""
    return rid + 1


def release_due(run: PoolRun) -> None:
    """Requests whose hold ends now return their pages to the free list without scrubbing them."""
    if run.step >= len(run.due):
        return
    for rid in run.due[run.step]:
        run.ledger.release(run.held.pop(rid), generation_of(rid), allowed=(PageState.WRITTEN,))
        run.completed_at[rid] = run.completions
        run.completions += 1


def admit(run: PoolRun, rid: int, pages: int, hold: int) -> None:
    """A background request reserves its pages and writes all of them, or is refused."""
    try:
        got = run.ledger.allocate(pages, generation_of(rid))
    except PoolExhausted:
        run.refused += 1
        return
    run.ledger.mark_written(got, generation_of(rid))
    run.writer[got] = rid
    run.held[rid] = got
    run.due[run.step + hold].append(rid)


def advance(run: PoolRun) -> None:
    if run.debug:
        run.ledger.check_invariants()
    run.step += 1


def warm_pool(config: SimulationConfig, policy: str, warmup: int, seed: int) -> PoolRun:
    """Run ``warmup`` steps of background traffic on a fresh pool (seeded workload and ledger)."""
    workload_seq, ledger_seq = np.random.SeedSequence(seed).spawn(2)
    workload = draw_workload(config, warmup, np.random.default_rng(workload_seq))
    run = new_pool(config, policy, warmup, int(ledger_seq.generate_state(1)[0]), workload)
    for rid in range(warmup):
        release_due(run)
        admit(run, rid, int(workload.pages[rid]), int(workload.holds[rid]))
        advance(run)
    return run


# the incident ---------------------------------------------------------------------------------
def reserve_oversized(run: PoolRun, pages: int) -> tuple[int, np.ndarray, int, float]:
    """Reserve the oversized request's pages, waiting for releases until they fit.

    Returns its request id, its pages, the steps it waited and the pool's use when it arrived."""
    rid = len(run.customer_of) - 1
    release_due(run)
    used = 1.0 - run.ledger.free_count / run.ledger.num_pages
    waited = 0
    while run.ledger.free_count < pages:
        advance(run)
        waited += 1
        release_due(run)
    return rid, run.ledger.allocate(pages, generation_of(rid)), waited, used


def write_first_page(run: PoolRun, rid: int, pages: np.ndarray) -> np.ndarray:
    """The incident's prefill writes one page and says "complete". Returns the pages' previous writers."""
    previous = run.writer[pages].copy()
    run.ledger.mark_written(pages[:1], generation_of(rid))
    run.writer[pages[:1]] = rid
    return previous


def exposure(run: PoolRun, rid: int, pages: np.ndarray, previous: np.ndarray) -> dict[str, Any]:
    """What decode reads in the pages the oversized request did not write."""
    stale = previous[1:]
    foreign = stale[stale != NEVER_WRITTEN]
    customers = np.unique(run.customer_of[foreign])
    others = customers[customers != run.customer_of[rid]]
    ages = run.completions - run.completed_at[foreign]
    unwritten = int((run.ledger.state[pages] == PageState.RESERVED).sum())
    return {
        "reserved_pages": int(pages.size),
        "foreign_pages": int(foreign.size),
        "foreign_share": foreign.size / pages.size,
        "untouched_share": int((stale == NEVER_WRITTEN).sum()) / pages.size,
        "source_requests": int(np.unique(foreign).size),
        "customers_exposed": int(others.size),
        "stale_age_median": float(np.median(ages)) if ages.size else None,
        "leak_detected": bool(foreign.size),
        "ledger_unwritten_pages": unwritten,
    }


def incident(config: SimulationConfig, policy: str, warmup: int, seed: int) -> tuple[PoolRun, dict[str, Any]]:
    """One pool, ``warmup`` steps of traffic, then the oversized request: the pool and its exposure.

    The ledger's invariant is checked before returning (it raises if the accounting broke)."""
    run = warm_pool(config, policy, warmup, seed)
    rid, pages, waited, used = reserve_oversized(run, config.oversized_pages)
    previous = write_first_page(run, rid, pages)
    run.ledger.check_invariants()
    result = {"policy": policy, "warmup": warmup, "seed": seed}
    result.update(exposure(run, rid, pages, previous))
    result.update({"pool_used": used, "waited_steps": waited, "refused": run.refused})
    return run, result


def run_one(config: SimulationConfig, policy: str, warmup: int, seed: int) -> dict[str, Any]:
    """The oversized request's exposure after ``warmup`` steps, as a JSON-ready dict.

    ``foreign_share``: pages last written by another request / pages reserved; ``untouched_share``:
    never-written pages / pages reserved; ``customers_exposed``: customers other than the oversized
    request's own whose data it reads; ``source_requests``: requests whose data it reads;
    ``stale_age_median``: how many completions ago those requests finished (median over foreign
    pages); ``leak_detected``: a planted-canary content check would see foreign data."""
    return incident(config, policy, warmup, seed)[1]


# the sweep ------------------------------------------------------------------------------------
def sweep(config: SimulationConfig) -> list[dict[str, Any]]:
    """Every (policy, warm-up) cell over ``config.seeds`` seeds, aggregated into one row per cell.

    Seed ``config.seed + i`` draws the same workload for every policy, so policies are compared on
    identical traffic."""
    config.validate()
    rows = []
    for policy in config.policies:
        for warmup in config.warmups:
            runs = [run_one(config, policy, warmup, config.seed + i) for i in range(config.seeds)]
            rows.append(aggregate(policy, warmup, runs))
    return rows


def aggregate(policy: str, warmup: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    def values(key: str) -> np.ndarray:
        return np.array([r[key] for r in runs if r[key] is not None], dtype=float)

    row: dict[str, Any] = {"policy": policy, "warmup": warmup, "seeds": len(runs)}
    for key in ("foreign_share", "customers_exposed"):
        v = values(key)
        row.update({f"{key}_median": float(np.median(v)), f"{key}_min": float(v.min()), f"{key}_max": float(v.max())})
    medians = {"untouched_share": "untouched_share_median", "source_requests": "source_requests_median",
               "stale_age_median": "stale_age_median", "pool_used": "pool_used_median",
               "waited_steps": "waited_steps_median"}
    for key, name in medians.items():
        v = values(key)
        row[name] = float(np.median(v)) if v.size else None
    row["detection_rate"] = float(np.mean(values("leak_detected")))
    row["refused_total"] = int(values("refused").sum())
    row["ledger_unwritten_pages_min"] = int(values("ledger_unwritten_pages").min())
    return row


# output ---------------------------------------------------------------------------------------
def render_table(rows: list[dict[str, Any]]) -> Any:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=escape("exposure of the oversized request's context: median [min-max] over seeds"))
    for name in ("policy", "warm-up steps", "foreign share", "customers exposed", "source requests",
                 "never written", "stale age", "leak detected"):
        table.add_column(name, justify="left" if name == "policy" else "right")
    for r in rows:
        table.add_row(
            r["policy"], str(r["warmup"]),
            f"{r['foreign_share_median']:.1%} [{r['foreign_share_min']:.1%}-{r['foreign_share_max']:.1%}]",
            f"{r['customers_exposed_median']:.0f} [{r['customers_exposed_min']:.0f}-{r['customers_exposed_max']:.0f}]",
            f"{r['source_requests_median']:.0f}", f"{r['untouched_share_median']:.1%}",
            "-" if r["stale_age_median"] is None else f"{r['stale_age_median']:.0f}",
            f"{r['detection_rate']:.0%}",
        )
    return table


def interpret(rows: list[dict[str, Any]], config: SimulationConfig) -> list[str]:
    """A few sentences read off the rows (they describe what was measured, not what was expected)."""
    lines = [_cold_line(rows, min(config.warmups)), _reliable_line(rows, config.warmups)]
    lines += _warm_lines(rows, max(config.warmups), config.customers)
    lines.append(_ledger_line(rows, config.oversized_pages))
    return [line for line in lines if line]


def _cold_line(rows: list[dict[str, Any]], warmup: int) -> str:
    leaking = [r["policy"] for r in rows if r["warmup"] == warmup and r["foreign_share_max"] > 0]
    if leaking:
        return f"Pool after {warmup} steps: already exposes other requests' data under {', '.join(leaking)}."
    return f"Cold pool ({warmup} steps): no foreign data under any policy; never-written pages hold nobody's data."


def _reliable_line(rows: list[dict[str, Any]], warmups: list[int]) -> str:
    reliable = reliable_from(rows, warmups)
    if reliable is None:
        return "No warm-up leaked reliably (in 90% of runs under every policy)."
    later = [r for r in rows if r["warmup"] >= reliable]
    rate = sum(r["detection_rate"] * r["seeds"] for r in later) / sum(r["seeds"] for r in later)
    return (f"Warm pool: from {reliable} steps on, {rate:.0%} of runs exposed other requests' data (at least "
            f"{min(r['detection_rate'] for r in later):.0%} in every cell); a planted-canary check would catch those.")


def _warm_lines(rows: list[dict[str, Any]], warmup: int, customers: int) -> list[str]:
    warm = sorted((r for r in rows if r["warmup"] == warmup), key=lambda r: r["customers_exposed_median"])
    each = "; ".join(f"{r['policy']} reads {r['foreign_share_median']:.0%} foreign pages from "
                     f"{r['customers_exposed_median']:.0f} of {customers} customers, written a median "
                     f"{_age(r)} completions ago" for r in warm)
    lines = [f"After {warmup} steps: {each}."]
    if len(warm) > 1:
        lines.append(f"The allocation policy decides the blast radius: {warm[-1]['policy']} exposes "
                     f"{warm[-1]['customers_exposed_median']:.0f} customers, {warm[0]['policy']} "
                     f"{warm[0]['customers_exposed_median']:.0f}, on identical traffic.")
    return lines


def _ledger_line(rows: list[dict[str, Any]], reserved: int) -> str:
    unwritten = min(r["ledger_unwritten_pages_min"] for r in rows)
    return (f"kvxfer's own ledger still showed at least {unwritten:,} of the {reserved:,} reserved pages RESERVED, "
            "never WRITTEN, in every run; it makes only WRITTEN pages READABLE, so kvxfer's decode refuses such a "
            "transfer instead of reading it.")


def reliable_from(rows: list[dict[str, Any]], warmups: list[int], threshold: float = 0.9) -> int | None:
    """The shortest warm-up from which every longer one leaks in ``threshold`` of its runs, any policy."""
    found = None
    for warmup in sorted(warmups, reverse=True):
        if any(r["detection_rate"] < threshold for r in rows if r["warmup"] == warmup):
            break
        found = warmup
    return found


def _age(row: dict[str, Any]) -> str:
    return "-" if row["stale_age_median"] is None else f"{row['stale_age_median']:.0f}"


def write_json(rows: list[dict[str, Any]], config: SimulationConfig, seconds: float, path: str) -> None:
    data = {"config": asdict(config), "seconds": round(seconds, 3), "rows": rows}
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def write_png(rows: list[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise SystemExit(f"--png needs matplotlib (pip install 'kvxfer[report]'): {exc}") from exc
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for policy in dict.fromkeys(r["policy"] for r in rows):
        cells = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["warmup"])
        _plot_band(left, policy, cells, "foreign_share", 100.0)
        _plot_band(right, policy, cells, "customers_exposed", 1.0)
    left.set_ylabel("foreign share of the context (%)")
    left.set_title("other requests' data in the oversized request's context")
    right.set_ylabel("customers exposed")
    right.set_title("customers whose data it reads")
    warmups = sorted({r["warmup"] for r in rows})
    for ax in (left, right):
        ax.set_xscale("symlog", linthresh=max(1, min((w for w in warmups if w > 0), default=1)))
        ax.set_xticks(warmups, [str(w) for w in warmups])
        ax.minorticks_off()
        ax.set_xlabel("warm-up steps before the oversized request")
        ax.legend()
    fig.suptitle("kvxfer simulate: median over seeds, band = min-max")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_band(ax: Any, policy: str, cells: list[dict[str, Any]], key: str, scale: float) -> None:
    x = [c["warmup"] for c in cells]
    (line,) = ax.plot(x, [c[f"{key}_median"] * scale for c in cells], marker="o", label=policy)
    low, high = [c[f"{key}_min"] * scale for c in cells], [c[f"{key}_max"] * scale for c in cells]
    ax.fill_between(x, low, high, color=line.get_color(), alpha=0.2)


# command line ---------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``kvxfer simulate`` options; their defaults are :class:`SimulationConfig`'s."""
    from .checks import integer, number, output_path

    d = SimulationConfig()
    add = parser.add_argument
    add("--pool-pages", type=integer(1), default=d.pool_pages, help="pages in the pool (default %(default)s)")
    add("--page-tokens", type=integer(1), default=d.page_tokens, help="tokens per page (default %(default)s)")
    add("--median-tokens", type=integer(1), default=d.median_tokens,
        help="median of the background requests' log-normal prompt length (default %(default)s)")
    add("--sigma", type=number(0), default=d.sigma,
        help="log-normal sigma of the prompt length (default %(default)s)")
    add("--customers", type=integer(1), default=d.customers, help="simulated customers (default %(default)s)")
    add("--hold-steps", type=_int_range, default=(d.hold_min_steps, d.hold_max_steps), metavar="MIN-MAX",
        help=f"steps a background request holds its pages (default {d.hold_min_steps}-{d.hold_max_steps})")
    add("--oversized-tokens", type=integer(1), default=d.oversized_tokens,
        help="prompt length of the request that takes the incident path (default %(default)s)")
    add("--warmups", type=_int_list, default=d.warmups, metavar="N,N,...",
        help=f"steps of background traffic before the oversized request (default {_join(d.warmups)})")
    add("--policies", type=_str_list, default=d.policies, metavar="P,P,...",
        help=f"allocation policies to compare (default {_join(d.policies)})")
    add("--seeds", type=integer(1), default=d.seeds, help="seeds per (policy, warm-up) cell (default %(default)s)")
    add("--seed", type=integer(), default=d.seed, help="first seed (default %(default)s)")
    add("--debug", action="store_true", help="check the ledger's invariant after every step (slow)")
    add("--png", metavar="PATH", type=output_path, help="draw foreign share and customers exposed against warm-up")
    add("--json", metavar="PATH", type=output_path, help="write the config and the rows as JSON")


def check(args: argparse.Namespace) -> None:
    """Before the sweep (``kvxfer simulate``): settings that work together, matplotlib for ``--png``."""
    config_from_args(args).validate()
    if args.png:
        from .checks import importable

        importable("--png", "matplotlib", "pip install 'kvxfer[report]'")


def _join(items: list[Any]) -> str:
    return ",".join(str(item) for item in items)


def _int_list(text: str) -> list[int]:
    try:
        return [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not whole numbers separated by commas") from None


def _str_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _int_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    try:
        return int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not MIN-MAX (two whole numbers, e.g. 30-120)") from None


def config_from_args(args: argparse.Namespace) -> SimulationConfig:
    return SimulationConfig(
        pool_pages=args.pool_pages, page_tokens=args.page_tokens, median_tokens=args.median_tokens,
        sigma=args.sigma, customers=args.customers, hold_min_steps=args.hold_steps[0],
        hold_max_steps=args.hold_steps[1], oversized_tokens=args.oversized_tokens, warmups=list(args.warmups),
        policies=list(args.policies), seeds=args.seeds, seed=args.seed, debug=args.debug,
    )


def main(args: argparse.Namespace) -> int:
    """Run the sweep, print the table and what it shows, write the PNG / JSON asked for. Always 0."""
    from rich.console import Console

    config = config_from_args(args)
    config.validate()
    console = Console()
    if not console.is_terminal:  # a pipe or file has no width: keep each row on one line
        console.width = max(console.width, 140)
    console.print(f"[bold]kvxfer simulate[/bold]: pool of {config.pool_pages:,} pages x {config.page_tokens} tokens, "
                  f"{config.customers} customers, oversized request of {config.oversized_tokens:,} tokens "
                  f"({config.oversized_pages:,} pages) writes 1 page, {config.seeds} seeds per cell")
    started = time.monotonic()
    rows = sweep(config)
    seconds = time.monotonic() - started
    console.print(render_table(rows))
    for line in interpret(rows, config):
        console.print(line, highlight=False)
    console.print(f"{len(rows) * config.seeds} runs in {seconds:.1f} s", highlight=False)
    if args.png:
        write_png(rows, args.png)
    if args.json:
        write_json(rows, config, seconds, args.json)
    return 0
