"""``sparsync bench allreduce`` (SparCML Fig. 4): its options, its run (each world size a point of the runner's
sweep, every rank running ``allreduce.worker``), and what it shows: a table on screen, a markdown summary, a
log-log PNG like SparCML Fig. 4, and the side-by-side target checks of the foundation issue (files and target
tables: ``report``)."""

from __future__ import annotations

import argparse
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from sparsync_bench import options
from sparsync_bench.allreduce import BASELINES, HIERARCHICAL, QUANTIZED, BenchConfig, default_methods, worker
from sparsync_bench.benchmark import Benchmark
from sparsync_bench.fmt import markdown_table, ms
from sparsync_bench.report import Check, pyplot, save_figure, targets_markdown
from sparsync_bench.runner import Rows, Run
from sparsync_bench.tables import show_table


def print_table(rows: list[dict[str, Any]], console: Console, title: str) -> None:
    table = Table(title=title)
    for col in (
        "P",
        "density",
        "method",
        "median ms",
        "p25-p75 ms",
        "MB sent/rank",
        "model ms",
        "bound ms",
        "auto chose",
    ):
        table.add_column(col, justify="right" if col not in ("method", "auto chose") else "left")
    for r in rows:
        spread = "-" if math.isnan(r["p25_s"]) else f"{ms(r['p25_s'])}-{ms(r['p75_s'])}"
        table.add_row(
            str(r["world_size"]),
            f"{r['density']:g}",
            r["method"],
            ms(r["median_s"]),
            spread,
            f"{r['bytes_sent_per_rank'] / 1e6:.3f}",
            ms(r["predicted_s"]),
            ms(r["lower_bound_s"]),
            r["chosen"] or r["note"],
        )
    show_table(console, table)


def markdown(rows: list[dict[str, Any]], checks: list[Check], title: str) -> str:
    """Medians (ms) as a P x density by method table, auto's choice, and the target checks."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    pts: dict[tuple[int, float], dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in rows:
        pts[(r["world_size"], r["density"])][r["method"]] = r
    lines = [f"### {title}", "", "Median ms per allreduce (slowest rank), auto's choice in the last column.", ""]
    body = [
        [P, f"{d:g}", *(ms(by[m]["median_s"]) if m in by else "-" for m in methods),
         by["auto"]["chosen"] if "auto" in by else ""]
        for (P, d), by in sorted(pts.items())
    ]  # fmt: skip
    lines += markdown_table(["P", "density", *methods, "auto chose"], body)
    return "\n".join(lines + targets_markdown(checks)) + "\n"


def plot(rows: list[dict[str, Any]], out: Path, title: str) -> Path:
    plt = pyplot()
    by_p: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_p[r["world_size"]].append(r)
    fig, axes = plt.subplots(1, len(by_p), figsize=(6 * len(by_p), 4.6), squeeze=False)
    for ax, (P, prow) in zip(axes[0], sorted(by_p.items()), strict=True):
        methods = list(dict.fromkeys(r["method"] for r in prow))
        for m in methods:
            pts = [r for r in prow if r["method"] == m and not math.isnan(r["median_s"]) and r["density"] > 0]
            if not pts:
                continue
            x = [r["density"] for r in pts]
            y = [r["median_s"] for r in pts]
            err = [[r["median_s"] - r["p25_s"] for r in pts], [r["p75_s"] - r["median_s"] for r in pts]]
            style = {"lw": 2.6, "color": "black"} if m == "auto" else {"lw": 1.2}
            ax.errorbar(x, y, yerr=err, marker="o", ms=3, capsize=2, label=m, **style)
        bound = sorted({(r["density"], r["lower_bound_s"]) for r in prow if r["density"] > 0})
        if bound:
            ax.plot([b[0] for b in bound], [b[1] for b in bound], ":", color="gray", label="α-β lower bound")
        model = sorted(
            {
                (r["density"], r["predicted_s"])
                for r in prow
                if r["method"] == "auto" and r["predicted_s"] and r["density"] > 0
            }
        )
        if model:
            ax.plot(
                [b[0] for b in model],
                [b[1] for b in model],
                "--",
                color="black",
                alpha=0.5,
                label="α-β model (auto)",
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("density (nnz / N per rank)")
        ax.set_ylabel("time per allreduce (s)")
        ax.set_title(f"P = {P}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left")
    fig.suptitle(title)
    return save_figure(fig, out.with_suffix(".png"), dpi=110)


def check_targets(rows: list[dict[str, Any]]) -> list[Check]:
    """The foundation issue's targets, evaluated on one run's side-by-side medians."""
    pts: dict[tuple[int, float], dict[str, float]] = defaultdict(dict)
    for r in rows:
        if not math.isnan(r["median_s"]):
            pts[(r["world_size"], r["density"])][r["method"]] = r["median_s"]
    out: list[Check] = []
    for (P, d), m in sorted(pts.items()):
        if "auto" not in m:
            continue
        base = {b: m[b] for b in BASELINES if b in m}
        if base:
            best = min(base, key=lambda b: base[b])
            ratio = m["auto"] / base[best]
            out.append((f"P={P} d={d:g}: auto <= 1.1x fastest baseline ({best})", ratio <= 1.1, f"{ratio:.2f}x"))
        if d <= 1e-3 and "gloo_dense" in m:
            sp = m["gloo_dense"] / m["auto"]
            out.append((f"P={P} d={d:g}: auto >= 10x faster than gloo dense", sp >= 10, f"{sp:.1f}x faster"))
        if P == 8 and abs(d - 0.1) < 1e-12 and "gloo_dense" in m:
            ratio = m["auto"] / m["gloo_dense"]
            out.append((f"P={P} d={d:g}: auto within 1.2x of gloo dense", ratio <= 1.2, f"{ratio:.2f}x"))
    return out


def add_options(ar: argparse.ArgumentParser) -> None:
    ar.add_argument("--n", type=options.parse_size, default=16 * 2**20, help="vector length N (default 16M)")
    ar.add_argument("--procs", type=options.ints, default=(2, 4, 8), help="world sizes, e.g. 2,4,8")
    ar.add_argument("--densities", type=options.floats, default=BenchConfig().densities,
                    help="fractions of N stored per rank, comma-separated, each in (0, 1]")  # fmt: skip
    ar.add_argument("--repeats", type=int, default=5, help="timed calls per point (median and quartiles)")
    methods = default_methods()
    also = (*QUANTIZED, *HIERARCHICAL)
    ar.add_argument("--methods", type=options.choices((*methods, *also), "methods"), default=methods,
                    help=f"comma-separated; also {', '.join(also)}")  # fmt: skip
    ar.add_argument("--out", type=Path, default=Path("results/allreduce"), help="path stem for .csv/.json/.png")


def command(args: argparse.Namespace, console: Console) -> int:
    on_hosts = ("gloo_dense", "gloo_sparse_coo", "allgather", "auto", *HIERARCHICAL)
    procs, per_host, methods = options.hosts_and_methods(args, default_methods(), on_hosts)
    cfg = BenchConfig(dim=args.n, densities=args.densities, repeats=args.repeats, methods=methods)
    run_allreduce_bench(cfg, procs, procs_per_host=per_host, out=args.out, net=args.net, latency=args.latency,
                        console=console, progress=not args.no_progress)  # fmt: skip
    return 0


def run_allreduce_bench(
    cfg: BenchConfig,
    procs: tuple[int, ...],
    *,
    out: Path,
    net: str | None = None,
    latency: str | None = None,
    console: Console | None = None,
    progress: bool = True,
    timeout: float = 600.0,
    show_targets: bool = True,
    procs_per_host: int | None = None,
) -> Rows:
    """``sparsync bench allreduce`` (SparCML Fig. 4) at each world size in ``procs``; print, save, plot. Returns
    the rows. ``procs_per_host``: ranks per emulated host (one namespace and link per host with ``net``)."""
    meta: dict[str, Any] = {"config": {**cfg.__dict__}, "procs": list(procs), "net": net, "latency": latency,
                            "procs_per_host": procs_per_host}  # fmt: skip
    run = Run.start(out, meta, net=net, latency=latency, console=console, procs_per_host=procs_per_host,
                     link_procs=max(procs))  # fmt: skip
    rows = run.sweep(
        procs,
        run.linked_point(worker, (cfg, progress), timeout=timeout, procs_per_host=procs_per_host),
        lambda P: f"[bold]P = {P}[/], N = {cfg.dim:,} float32, {run.where}, {cfg.repeats} repeats",
    )
    title = f"sparse allreduce, N={cfg.dim:,}, {run.where}"
    return run.show(rows, title, tables=print_table, check=check_targets, plot=plot, markdown=markdown,
                    show_targets=show_targets)  # fmt: skip


BENCHMARK = Benchmark(
    "allreduce",
    "SparCML Fig. 4: time vs density per algorithm",
    add_options,
    command,
    worker,
    shared=("net", "hosts", "progress"),
    grid=lambda p: (
        f"default grid: {len(p.get_default('procs')) * len(p.get_default('densities'))} "
        "points (world sizes x densities), every method at each; the full sweep took 19 min with --net 1gbit "
        "(docs/results_allreduce.md)."
    ),
)
