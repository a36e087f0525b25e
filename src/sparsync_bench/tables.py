"""Printing rich tables so that they stay readable wherever the output goes."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

_UNBOUNDED = 100_000  # columns: measure a table's natural width without wrapping


def show_table(console: Console, table: Table) -> None:
    """Print ``table``: boxed and fitted to a terminal; to a file, a pipe or a CI log (no terminal) as a
    markdown table at its natural width (rich would wrap and truncate it to 80 columns there), its title as a
    line of its own above it."""
    if console.is_terminal:
        console.print(table)
        return
    title, table.title = table.title, None
    table.box = box.MARKDOWN
    width = Console(width=_UNBOUNDED).measure(table).maximum
    flat = Console(width=width, no_color=True, highlight=False)
    with flat.capture() as cap:
        flat.print(table)
    lines = [ln.rstrip() for ln in cap.get().splitlines() if ln.strip()]  # the markdown box's empty edges
    console.file.write("".join(f"{ln}\n" for ln in ([str(title)] if title else []) + lines))
