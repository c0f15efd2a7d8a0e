"""``kvxfer stress``: a transfer stress and chaos tool with a leak oracle.

Drives prefill and decode engines in separate processes with a bounded workload and every fault
the design names, and judges the run by the bytes the decode side reads (see :mod:`.driver`). With a
topology (``--prefill-tp``, ``--decode-tp``, page sizes per role) every tensor-parallel rank is its
own process and decode pages, assembled from head slices, are checked cell by cell (:mod:`.ranks`).
A fleet (``--prefills``, ``--decodes``, ``--churn``) runs N prefill and M decode processes, each
decode peered with every prefill, routes each request to a random pair, and kills, restarts, adds and
retires processes while requests run (:mod:`.fleet`). ``--two-hosts`` runs the fleet's prefills and
decodes in two network namespaces joined by a veth (:mod:`kvxfer.tools.netns`), and ``--net-fault``
cuts, drops or blackholes the wire between them, or kills or stops a process, on a timeline
(:mod:`.netfaults`); with ``--peer-agent`` host b is another machine reached through its agent
(:mod:`kvxfer.tools.guests`, :mod:`kvxfer.tools.remote`: verbs across the soft-RoCE pair's wire). ``--unsafe-legacy`` switches off admission
rejection, completion verification and deferred release, reproducing the incident's behaviour, as a
negative control for the oracle.
"""

from __future__ import annotations

import sys
import tempfile
from typing import Any

from .driver import StressDriver, StressResult
from .workload import ALL_FAULTS, StressConfig

__all__ = ["ALL_FAULTS", "StressConfig", "StressDriver", "StressResult", "run_stress"]


def run_stress(config: StressConfig, *, json_path: str | None = None, report_path: str | None = None,
               progress: bool | None = None) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..progress import wanted
    from . import report

    console = Console()
    show = wanted(progress)  # a bar on a terminal, none on a pipe or file (--no-progress: none)
    total = config.requests
    bar: Any = None
    task = None
    if show:
        bar = Progress(TextColumn("[bold]stress[/bold]"), BarColumn(), MofNCompleteColumn(),
                       TextColumn("{task.fields[status]}"), TimeElapsedColumn(), console=console)
        task = bar.add_task("stress", total=total, status="")
        bar.start()

    def on_progress(result: StressResult, in_flight: int) -> None:
        if bar is None:
            return
        done = sum(result.outcomes.values())
        status = (f"live {in_flight} leak {result.leaked_pages} corrupt {result.corrupted_pages} "
                  f"fail {result.outcomes['failed']} ({result.unexpectedly('failed')} unexpectedly)")
        bar.update(task, completed=done, status=status)

    with tempfile.TemporaryFile("w+") as node_log:
        driver = StressDriver(config, on_progress=on_progress, node_log=node_log)
        try:
            result = driver.run()
        except Exception:
            _print_node_log_tail(node_log)  # why a node would not start, say: its own words
            raise
        finally:
            if bar is not None:
                bar.stop()
    summary = result.summary()
    if "fleet" in summary:
        console.print(report.topology_text(summary), markup=False, highlight=False)
    console.print(report.summary_table(result))
    if "fleet" in summary:
        console.print(report.process_table(summary))
    console.print(report.outcome_text(summary), markup=False, highlight=False)
    if json_path:
        report.write_json(result, json_path)
    if report_path:
        report.write_png(result, report_path)
    console.print(report.verdict_text(summary), style="green" if result.ok else "red", markup=False, highlight=False)
    return 0 if result.ok else 1


def _print_node_log_tail(node_log: Any, lines: int = 20) -> None:
    """The last ``lines`` lines the engine processes wrote to stderr, on this process's stderr."""
    try:
        node_log.flush()
        node_log.seek(0)
        tail = node_log.read().splitlines()[-lines:]
    except (OSError, ValueError):
        return
    if tail:
        print("the engine processes' last words:\n  " + "\n  ".join(tail), file=sys.stderr)
