"""``sparsync bench tta``: its options and its run (one point of the runner's sweep per model, every rank
running ``tta.worker``, which trains every method in turn). What it measures is ``sparsync_bench.tta``, what it
shows ``sparsync_bench.tta_report``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console

from sparsync_bench import options
from sparsync_bench import tta_report as tr
from sparsync_bench.benchmark import Benchmark
from sparsync_bench.runner import Rows, Run, run_ranks
from sparsync_bench.tta import METHODS, MODELS, TTAConfig, worker


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", type=options.choices(tuple(MODELS), "models"), default=("transformer", "lm"),
                   help=f"comma-separated, of {','.join(MODELS)}")  # fmt: skip
    p.add_argument("--methods", type=options.choices(tuple(METHODS), "methods"), default=tuple(METHODS),
                   help="comma-separated, trained in this order")  # fmt: skip
    p.add_argument("--steps", type=int, default=60, help="training steps per method")
    p.add_argument("--block", type=int, default=10,
                   help="steps per turn: the methods take turns, block by block")  # fmt: skip
    p.add_argument("--procs", type=int, default=4, help="world size P")
    p.add_argument("--seed", type=int, default=0, help="the initial weights' and the samples' seed")
    p.add_argument("--out", type=Path, default=Path("results/tta"), help="path stem for .json/.csv/.md/.png")


def command(args: argparse.Namespace, console: Console) -> int:
    cfgs = [
        TTAConfig(model=m, steps=args.steps, block=args.block, methods=args.methods, seed=args.seed)
        for m in args.models
    ]
    run_tta(cfgs, procs=args.procs, out=args.out, net=args.net, latency=args.latency, console=console,
            progress=not args.no_progress)  # fmt: skip
    return 0


def run_tta(
    cfgs: list[TTAConfig],
    *,
    procs: int = 4,
    out: Path,
    net: str | None = None,
    latency: str | None = None,
    console: Console | None = None,
    progress: bool = True,
    timeout: float = 1800.0,
) -> Rows:
    """``sparsync bench tta``: every config (one model each) on ``procs`` ranks; print, save, plot."""
    meta: dict[str, Any] = {"configs": [{k: v for k, v in c.__dict__.items() if k != "spec"} for c in cfgs],
                            "models": {c.model: c.spec.__dict__ for c in cfgs}, "procs": procs, "net": net,
                            "latency": latency}  # fmt: skip
    run = Run.start(out, meta, net=net, latency=latency, console=console, link_procs=procs)
    by_model = {c.model: c for c in cfgs}
    rows = run.sweep(
        list(by_model),
        lambda m: run_ranks(worker, procs, (by_model[m], progress), spec=run.spec, timeout=timeout),
        lambda m: f"[bold]{m}[/], {len(by_model[m].methods)} methods x {by_model[m].steps} steps, {run.where}",
    )
    title = f"P = {procs}, {run.where}"
    return run.show(tr.analyse(rows), title, tables=tr.print_table, check=tr.check_targets, plot=tr.plot,
                    markdown=tr.markdown, width=140)  # fmt: skip


BENCHMARK = Benchmark(
    "tta",
    "time to accuracy: DDP, torch's fp16 and PowerSGD hooks, sparsync's compressors, same weights and samples",
    add_options,
    command,
    worker,
    shared=("net", "progress"),
)
