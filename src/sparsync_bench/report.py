"""The benchmarks' one way to show and keep results: a run's files (``out.json`` with its meta and rows,
``out.csv``, the figures, ``out.md``), the target checks as a table and as markdown, a placement plan as a
table, rank 0's progress bar, and matplotlib set up for files. What a benchmark's table, markdown and figure
hold stays with the benchmark (``bench.allreduce``, ``bench.embedding``, ``bench.hybrid``, ``compress``,
``dlrm_train``)."""

from __future__ import annotations

import contextlib
import csv
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from sparsync.plan.planner import Entry, Plan
from sparsync_bench.fmt import markdown_table
from sparsync_bench.progress import display
from sparsync_bench.tables import show_table

Check = tuple[str, bool, str]  # (target, met, the measured value as text)


def write_files(rows: list[dict[str, Any]], meta: dict[str, Any], out: Path) -> list[Path]:
    """``out.json`` ({meta, rows}) and ``out.csv`` (the rows' scalar columns: not ``times_s`` or ``link``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    js = out.with_suffix(".json")
    js.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    cs = out.with_suffix(".csv")
    keys = [k for k in rows[0] if k not in ("times_s", "link")] if rows else []
    with cs.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return [js, cs]


def write_json_md(out: Path, data: Any, text: str) -> list[Path]:
    """``out.json`` (``data``, indented) and ``out.md`` (``text``): a comparison's results and its table."""
    out.parent.mkdir(parents=True, exist_ok=True)
    js, md = out.with_suffix(".json"), out.with_suffix(".md")
    js.write_text(json.dumps(data, indent=1) + "\n")
    md.write_text(text)
    return [js, md]


def write_report(
    rows: list[dict[str, Any]],
    meta: dict[str, Any],
    out: Path,
    console: Console,
    *,
    pngs: Sequence[Path] = (),
    md: str | None = None,
) -> list[Path]:
    """A finished run's files: ``out.json`` and ``out.csv`` (``write_files``), the figures already saved
    (``pngs``), ``out.md`` when given; prints what was written and returns the paths."""
    files = [*write_files(rows, meta, out), *pngs]
    if md is not None:
        files.append(out.with_suffix(".md"))
        files[-1].write_text(md)
    console.print("wrote " + ", ".join(str(f) for f in files))
    return files


def print_targets(checks: list[Check], console: Console) -> None:
    """The target checks as a table (nothing when this run measured nothing that has a target)."""
    if not checks:
        return
    table = Table(title="targets (side by side, this run)")
    table.add_column("target")
    table.add_column("measured", justify="right")
    table.add_column("met")
    for name, ok, val in checks:
        table.add_row(name, val, "[green]yes[/]" if ok else "[red]no[/]")
    show_table(console, table)


def targets_markdown(checks: list[Check], heading: str | None = None) -> list[str]:
    """The markdown lines of the target checks: how many were met, then a table (under ``## heading``)."""
    met = sum(ok for _, ok, _ in checks)
    lines = ["", f"## {heading}"] if heading else []
    lines += ["", f"Targets met: {met} of {len(checks)}.", ""]
    body = [[name, val, "yes" if ok else "**no**"] for name, ok, val in checks]
    return lines + markdown_table(["target", "measured", "met"], body)


ENTRY_COLUMNS = ("parameter", "shape", "α", "α machine", "placement", "MB/machine/step")


def entry_cells(e: Entry) -> list[str]:
    """A plan entry's cells under ``ENTRY_COLUMNS``, then what it adds to its kind's call in ms."""
    how = e.placement + (" (override)" if e.overridden else "") + (f" via {e.detail}" if e.detail else "")
    return [e.name, "x".join(map(str, e.shape)), f"{e.row_fraction:.4g}", f"{e.row_fraction_machine:.4g}", how,
            f"{e.bytes_per_machine / 1e6:.3f}", f"{e.seconds * 1e3:.3f}"]  # fmt: skip


def print_plan(plan: Plan, console: Console | None = None, title: str | None = None) -> None:
    """A placement plan as a table: per parameter its α, placement, bytes and what it adds to its kind's call
    (``ms/step``; ``all-AR ms``: what it would add to the dense buckets), then the step as the trainer sends it
    (``Plan.step_seconds``: buckets, grouped calls, exchanges) beside the step with every parameter dense."""
    c = plan.cluster
    t = Table(
        title=title
        or f"plan: {c.machines} machines x {c.procs_per_machine} procs, {c.bandwidth * 8 / 1e9:g} Gbit/s, "
        f"{c.latency * 1e6:g} µs"
    )
    for col in (*ENTRY_COLUMNS, "ms/step", "all-AR ms"):
        t.add_column(col, justify="left" if col in ("parameter", "placement") else "right")
    for e in plan.entries:
        t.add_row(*entry_cells(e), f"{e.candidates['dense_allreduce'][1] * 1e3:.3f}")
    for kind, seconds in plan.shared.items():  # one grouped exchange's latency, paid once for all its tables
        t.add_row(f"({kind}: one exchange)", "", "", "", kind, "", f"{seconds * 1e3:.3f}", "")
    all_dense = plan.with_kind("dense_allreduce").step_seconds
    t.add_row("step", "", "", "", "", f"{plan.bytes_per_machine / 1e6:.3f}", f"{plan.step_seconds * 1e3:.3f}",
              f"{all_dense * 1e3:.3f}")  # fmt: skip
    show_table(console or Console(), t)


@contextlib.contextmanager
def progress(show: bool, title: str, total: int) -> Iterator[Callable[[str | None, int], None]]:
    """``update(description, advance)`` of a transient progress bar, or of progress lines when stdout is not a
    terminal (``progress.display``; ``description`` None: keep it), or a no-op when not ``show`` (every rank
    but 0, ``--no-progress``)."""
    if not show:
        yield lambda _desc, _adv: None
        return
    with display() as bar:
        task = bar.add_task(title, total=total)

        def update(desc: str | None, advance: int) -> None:
            if desc is None:
                bar.advance(task, advance)
            else:
                bar.update(task, description=desc, advance=advance)

        yield update


def pyplot() -> Any:
    """``matplotlib.pyplot`` drawing to files (the Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, png: Path, *, dpi: int) -> Path:
    """Lay ``fig`` out (``tight_layout`` unless it was made with a layout engine, e.g. ``layout="constrained"``),
    write it to ``png`` and close it."""
    if fig.get_layout_engine() is None:
        fig.tight_layout()
    fig.savefig(png, dpi=dpi)
    pyplot().close(fig)
    return png
