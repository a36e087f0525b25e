"""Tables printed to a file or a CI log: markdown at their natural width, nothing truncated."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from sparsync_bench.tables import show_table

LONG = "1,234,567.89 ms (p25-p75 1,000,000.00-2,000,000.00)"


def _table() -> Table:
    t = Table(title="compressors, P=4, 1gbit links (tc tbf, one netns per rank)")
    for col in ("N", "compressor", "aggregation", "compress ms", "decompress ms", "reduce ms", "note"):
        t.add_column(col)
    spec = "qsgd:bits=4,bucket=512,aggregation=allgather"
    t.add_row("26,214,400", spec, "allgather", "51.59", "64.88", LONG, "-")
    return t


def test_not_a_terminal_prints_markdown_at_natural_width() -> None:
    buf = io.StringIO()
    show_table(Console(file=buf, width=80), _table())
    lines = buf.getvalue().splitlines()
    assert lines[0] == "compressors, P=4, 1gbit links (tc tbf, one netns per rank)"
    rows = [ln for ln in lines if ln.startswith("|")]
    assert len(rows) == 3  # header, separator, one row: no cell wrapped onto a second line
    assert "qsgd:bits=4,bucket=512,aggregation=allgather" in rows[2] and LONG in rows[2]
    assert [c.strip() for c in rows[0].strip("|").split("|")][:3] == ["N", "compressor", "aggregation"]
    assert set(rows[1].replace("|", "").replace(":", "")) == {"-"}
    assert "…" not in buf.getvalue() and len(rows[2]) > 80


def test_terminal_keeps_the_boxed_table() -> None:
    buf = io.StringIO()
    show_table(Console(file=buf, width=200, force_terminal=True), _table())
    assert "┃" in buf.getvalue() or "│" in buf.getvalue()
