"""Progress of long runs: rich's bar on a terminal; on a pipe, a file or a CI log (where the bar shows
nothing) plain lines, each task's description and count at every tenth of its total, flushed as they come."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, TextIO

from rich.console import Console


@dataclass
class _Task:
    description: str
    total: float
    done: float = 0.0
    shown: int = 0  # tenths of ``total`` already printed


class LineProgress:
    """The part of ``rich.progress.Progress`` the benchmarks use (``add_task``, ``update``, ``advance``,
    ``start``/``stop`` or ``with``), printing lines instead of redrawing a bar."""

    def __init__(self, file: TextIO | None = None, steps: int = 10) -> None:
        self.file = file if file is not None else sys.stdout
        self.steps = steps
        self.tasks: list[_Task] = []

    def start(self) -> None:
        """Nothing to set up (a bar would start redrawing here)."""

    def stop(self) -> None:
        """Nothing to tear down."""

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def add_task(self, description: str, total: float | None = None, **_: Any) -> int:
        self.tasks.append(_Task(description, float(total or 0)))
        return len(self.tasks) - 1

    def update(self, task: int, *, description: str | None = None, advance: float = 0, **_: Any) -> None:
        t = self.tasks[task]
        if description is not None:
            t.description = description
        t.done += advance
        tenth = int(self.steps * t.done / t.total) if t.total else 0
        if tenth > t.shown:
            t.shown = tenth
            print(f"{t.description}: {t.done:g}/{t.total:g}", file=self.file, flush=True)

    def advance(self, task: int, advance: float = 1) -> None:
        self.update(task, advance=advance)


def display() -> Any:
    """A transient rich progress bar when stdout is a terminal, else a ``LineProgress`` on stdout."""
    if Console().is_terminal:
        from rich.progress import Progress

        return Progress(transient=True)
    return LineProgress()
