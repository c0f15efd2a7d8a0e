"""The bench's contestants and their interleaved rounds, shared by the throughput report
(:mod:`kvxfer.tools.bench`) and the small-request report (:mod:`.small`)."""

from __future__ import annotations

import statistics
from typing import Any

from .cases import BenchConfig, CaseResult, KvxferSession, Session, Unavailable


def missing_baselines(config: BenchConfig) -> dict[str, str]:
    """The baselines that apply to the transport but are not installed here: name -> "not installed (...)"."""
    from . import baselines

    out = {}
    for name in config.baselines:
        runner = baselines.RUNNERS.get(name)
        if runner is not None and config.transport in runner.transports:
            reason = runner.missing()
            if reason:
                out[name] = reason
    return out


def sessions_for(config: BenchConfig, page_bytes: int, node_log: Any,
                 skip: dict[str, str] | None = None) -> list[Session]:
    from . import baselines

    checks = ["on", "off"] if config.checks == "both" else [config.checks]
    if config.compare_windows and config.transport == "verbs":
        out: list[Session] = [KvxferSession(config, page_bytes, c, node_log, windows=w)
                              for w in ("on", "off") for c in checks]
    else:
        out = [KvxferSession(config, page_bytes, c, node_log) for c in checks]
    if config.compare_inline and config.transport in ("tcp", "shm"):
        out += [KvxferSession(config, page_bytes, c, node_log, inline=False) for c in checks]
    if config.tp:
        from .tp import UnequalTpSession, parse_tp

        out += [UnequalTpSession(config, page_bytes, c, node_log, parse_tp(config.tp)) for c in checks]
    for name in config.baselines:
        runner = baselines.RUNNERS.get(name)
        if runner is not None and config.transport in runner.transports and name not in (skip or {}):
            out += [runner.session(config, page_bytes, c) for c in checks] if runner.checks \
                else [runner.session(config, page_bytes)]
    return out


def _run_rounds(config: BenchConfig, page_bytes: int, sessions: list[Session], results: list[CaseResult],
                console: Any, skipped: dict[str, str] | None = None) -> None:
    """Start the sessions of one page size, run the interleaved rounds, close them. A contestant that
    turns out not to be installed (:class:`Unavailable`) goes to ``skipped`` instead of ``results``."""
    from ..progress import current

    bar = current()  # a step per start and per round of each contestant
    bar.grow(len(sessions) * (config.repeat + 2))
    live: list[Session] = []
    for session in sessions:
        bar.status(f"{page_bytes:,} B pages: starting {session.result.transport}")
        try:
            session.start()
            results.append(session.result)
            live.append(session)
        except Unavailable as exc:
            session.close()
            if skipped is not None:
                skipped[session.result.transport] = str(exc)
        except Exception as exc:
            results.append(session.result)
            session.result.error = f"{type(exc).__name__}: {exc}"
            session.close()
        bar.advance(1 if session in live else config.repeat + 2)
    console.print(f"{page_bytes:,} B pages: {', '.join(s.result.transport + (' (checks on)' if s.result.checks == 'on' else '') for s in live)}; {config.repeat} rounds")
    for round_no in range(config.repeat + 1):
        shift = round_no % max(1, len(live))
        for session in live[shift:] + live[:shift]:
            if not session.result.error:
                which = "warm-up" if not round_no else f"round {round_no}/{config.repeat}"
                bar.status(f"{page_bytes:,} B pages, {which}: {session.result.transport}"
                           + (" (checks on)" if session.result.checks == "on" else ""))
                try:
                    seconds = session.run_once()
                    if round_no:
                        session.result.runs.append(seconds)
                except Exception as exc:
                    session.result.error = f"{type(exc).__name__}: {exc}"
            bar.advance()
    bar.status(f"{page_bytes:,} B pages: closing")
    for session in live:
        session.close()
        if session.result.runs:
            session.result.seconds = statistics.median(session.result.runs)


