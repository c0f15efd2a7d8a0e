"""Live progress for long command-line jobs: a rich bar on a terminal, nothing otherwise.

The rule is ``stress``'s: a bar when stdout is a terminal, none when it is a pipe or a file (a log
stays free of redraws), ``--no-progress`` turns it off (:func:`wanted`). A job opens one with
:func:`bar`; code deep inside it reports through :func:`current` without being handed the bar, and
gets a bar that does nothing when there is none.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def wanted(progress: bool | None) -> bool:
    """``progress`` if given (the flag), else whether stdout is a terminal."""
    return sys.stdout.isatty() if progress is None else bool(progress)


class Bar:
    """A job's bar: steps done of a total that may grow as the job finds more work, and a status text."""

    def __init__(self, progress: Any = None, task: Any = None) -> None:
        self._progress = progress
        self._task = task
        self.total = 0
        self.done = 0

    def grow(self, steps: int) -> None:
        """There are ``steps`` more steps to do."""
        self.total += max(0, int(steps))
        if self._progress is not None:
            self._progress.update(self._task, total=self.total)

    def advance(self, steps: int = 1, status: str | None = None) -> None:
        self.done += steps
        if self._progress is not None:
            fields = {} if status is None else {"status": status}
            self._progress.update(self._task, completed=self.done, **fields)

    def status(self, text: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, status=text)


_NONE = Bar()
_current: list[Bar] = []


def current() -> Bar:
    """The bar of the job running now, or one that does nothing."""
    return _current[-1] if _current else _NONE


@contextmanager
def bar(label: str, console: Any, progress: bool | None) -> Iterator[Bar]:
    """A bar labelled ``label`` on ``console`` (rich) while the block runs, if :func:`wanted`; the
    console's own prints appear above it."""
    if not wanted(progress):
        yield _NONE
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    live = Progress(TextColumn(f"[bold]{label}[/bold]"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[status]}"), TimeElapsedColumn(), console=console, transient=True)
    task = live.add_task(label, total=None, status="")
    made = Bar(live, task)
    live.start()
    _current.append(made)
    try:
        yield made
    finally:
        _current.remove(made)
        live.stop()


__all__ = ["Bar", "bar", "current", "wanted"]
