"""``sparsync bench compress``: its options and its run (one point of the runner's sweep at P ranks, every rank
running ``compress.worker``). What it measures and shows (the table, the targets, the figure, the markdown) is
``sparsync_bench.compress``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console

from sparsync.compress.registry import COMPRESSORS
from sparsync_bench import compress as cb
from sparsync_bench import options
from sparsync_bench.benchmark import Benchmark
from sparsync_bench.compress import DEFAULT_COMPRESSORS, CompressBenchConfig, worker
from sparsync_bench.runner import Rows, Run, run_ranks


def add_options(cp: argparse.ArgumentParser) -> None:
    cp.add_argument(
        "--sizes", type=options.sizes, default=(1_000_000, 25_000_000), help="N per rank, e.g. 1000000,25M"
    )
    cp.add_argument("--procs", type=int, default=4, help="world size P")
    cp.add_argument("--repeats", type=int, default=3, help="timed calls per compressor (the median is reported)")
    cp.add_argument(
        "--compressor",
        action="append",
        dest="compressors",
        help="a registry spec such as 'topk:ratio=0.01' (repeatable; names: "
        f"{', '.join(sorted(COMPRESSORS))}; default: {' '.join(DEFAULT_COMPRESSORS)})",
    )
    cp.add_argument("--out", type=Path, default=Path("results/compress"), help="path stem for .csv/.json/.png")


def command(args: argparse.Namespace, console: Console) -> int:
    ccfg = CompressBenchConfig(sizes=args.sizes, repeats=args.repeats)
    if args.compressors:
        ccfg = CompressBenchConfig(sizes=args.sizes, repeats=args.repeats, compressors=tuple(args.compressors))
    run_compress_bench(ccfg, procs=args.procs, out=args.out, net=args.net, latency=args.latency, console=console,
                       progress=not args.no_progress)  # fmt: skip
    return 0


def run_compress_bench(
    cfg: CompressBenchConfig,
    *,
    procs: int = 4,
    out: Path,
    net: str | None = None,
    latency: str | None = None,
    console: Console | None = None,
    progress: bool = True,
    timeout: float = 1800.0,
) -> Rows:
    """``sparsync bench compress`` on ``procs`` ranks; print, save, plot. Returns the rows."""
    meta: dict[str, Any] = {"config": {**cfg.__dict__}, "procs": procs, "net": net, "latency": latency}
    run = Run.start(out, meta, net=net, latency=latency, console=console, link_procs=procs)
    sizes = ", ".join(f"{n:,}" for n in cfg.sizes)
    rows = run.sweep(
        (procs,),
        lambda P: run_ranks(worker, P, (cfg, progress), spec=run.spec, timeout=timeout),
        lambda P: f"[bold]P = {P}[/], N = {sizes} float32, {run.where}",
    )
    title = f"compressors, P={procs}, {run.where}"
    return run.show(  # ten numeric columns: at least 165 wide
        rows, title, tables=cb.print_table, check=cb.check_targets, plot=cb.plot, markdown=cb.markdown, width=165
    )


BENCHMARK = Benchmark(
    "compress",
    "compressors: time, bytes, error vs a dense allreduce",
    add_options,
    command,
    worker,
    shared=("net", "progress"),
    grid=lambda p: (
        f"default grid: {len(p.get_default('sizes'))} sizes x every compressor at P = "
        f"{p.get_default('procs')}; 251 s with --net 1gbit, 277 s on loopback (docs/results_compress.md)."
    ),
)
