"""The benchmarks' number formats and markdown tables, in one place: every report's text goes through these,
so a number reads the same in every table (``-`` where nothing was measured) and a markdown table is built one
way. Rich tables (``tables.show_table``) are for the console; these are for the ``.md`` files."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

MISSING = "-"  # a cell with nothing measured: None, or NaN (a method that did not run at that point)


def _missing(x: float | None) -> bool:
    return x is None or math.isnan(x)


def ms(seconds: float | None, spec: str = ".2f") -> str:
    """Seconds as milliseconds in ``spec`` (``"-"`` for None or NaN): ``ms(0.01234) == "12.34"``,
    ``ms(1.5, ",.1f") == "1,500.0"``."""
    return MISSING if seconds is None or _missing(seconds) else format(1e3 * seconds, spec)


def mb(nbytes: float | None, spec: str = ",.2f") -> str:
    """Bytes as MB (10^6 bytes) in ``spec`` (``"-"`` for None: byte counts are never NaN)."""
    return MISSING if nbytes is None else format(nbytes / 1e6, spec)


def times(r: float | None) -> str:
    """A ratio as ``"N.NNx"`` (``"-"`` for None or NaN)."""
    return MISSING if r is None or _missing(r) else f"{r:.2f}x"


def ratio(a: float | None, b: float | None) -> str:
    """a / b as ``"N.NNx"`` (``"-"`` when either is missing or b is 0)."""
    if a is None or b is None or b == 0 or _missing(a) or _missing(b):
        return MISSING
    return times(a / b)


def short_ms(x: float) -> str:
    """Milliseconds as few digits as still tell them apart: whole from 10 on, two significant digits below."""
    return f"{x:.0f}" if abs(x) >= 10 else f"{x:.2g}"


def unavailable_row(lead: Sequence[object], reason: object, width: int) -> list[str]:
    """The row of a method that did not run, ``width`` cells: ``lead`` (what names the row), then
    ``unavailable: <reason>`` in the first figure's place, ``-`` in the others."""
    return [*map(str, lead), f"unavailable: {reason}", *[MISSING] * (width - len(lead) - 1)]


def md_row(cells: Iterable[object]) -> str:
    """One row of a markdown table: ``| a | b |``."""
    return "| " + " | ".join(map(str, cells)) + " |"


def markdown_table(
    head: Sequence[object], body: Iterable[Iterable[object]] = (), *, rule: str = "---"
) -> list[str]:
    """A markdown table's lines: the head, its rule (``|---|---|``; ``rule=" --- "``: ``| --- | --- |``), a row
    per item of ``body``."""
    return [md_row(head), "|" + f"{rule}|" * len(head), *(md_row(r) for r in body)]
