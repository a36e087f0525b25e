"""``sparsync plan``: the placement plan for a described model or recorded statistics on a cluster of any
size (8 to 4096 machines and beyond): the simulation we use to reason past one machine."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from sparsync.plan.backend import BACKENDS
from sparsync.plan.cluster import Cluster, ExchangeCPU
from sparsync.plan.detect import ParamStats
from sparsync.plan.planner import Plan, levels_from_json, make_plan, stats_from_json
from sparsync.plan.registry import KINDS
from sparsync_bench.criteo import table_rows
from sparsync_bench.dlrm import MLPS, dlrm_stats
from sparsync_bench.lm import lm_stats
from sparsync_bench.netem import parse_latency, parse_rate
from sparsync_bench.report import ENTRY_COLUMNS, entry_cells
from sparsync_bench.tables import show_table


def _ints(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(x < 1 for x in out):
        raise argparse.ArgumentTypeError(f"machine counts must be >= 1, got {text!r}")
    return out


def _override(text: str) -> tuple[str, str]:
    name, sep, pl = text.partition("=")
    if not sep or pl not in KINDS:  # read when parsing: a kind registered from outside is accepted too
        raise argparse.ArgumentTypeError(
            f"expected NAME=PLACEMENT with PLACEMENT in {', '.join(KINDS.names)}, got {text!r}"
        )
    return name, pl


def add_parser(sub: Any, formatter_class: type[argparse.HelpFormatter] = argparse.HelpFormatter) -> None:
    p = sub.add_parser(
        "plan",
        help="placement plan + predicted step communication time for a cluster",
        formatter_class=formatter_class,
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--stats", type=Path, help="recorded statistics: JSON list of {name, shape, row_fraction, sparse}"
    )
    src.add_argument("--model", default="lm", choices=["lm", "dlrm"],
                     help="built-in model description (dlrm: Criteo Kaggle's 26 tables, which may also be "
                     "sharded over the ranks, sparsync.shard)")  # fmt: skip
    p.add_argument("--vocab", type=int, default=100_000, help="--model lm: vocabulary (embedding rows)")
    p.add_argument("--dim", type=int, default=None, help="embedding width (default: lm 128, dlrm 16)")
    p.add_argument("--batch", type=int, default=512, help="--model dlrm: samples per rank per step")
    p.add_argument("--max-rows", type=int, default=100_000, help="--model dlrm: rows per table at most")
    p.add_argument("--mlp", default="kaggle", choices=sorted(MLPS), help="--model dlrm: MLP configuration")
    p.add_argument("--hidden", type=int, default=512, help="--model lm: LSTM width")
    p.add_argument("--tokens", type=int, default=64 * 20, help="tokens per worker per step (batch x sequence)")
    p.add_argument("--zipf", type=float, default=None,
                   help="Zipf exponent of the ids (default: lm 1.0, dlrm 1.05 as bench dlrm's data)")  # fmt: skip
    p.add_argument("--machines", "--world", type=_ints, default=(8, 64, 512, 4096),
                   help="cluster sizes to plan for, comma-separated, each >= 1")  # fmt: skip
    p.add_argument("--procs-per-machine", type=int, default=1, help="ranks per machine (local aggregation)")
    p.add_argument("--bandwidth", "--link", default="10gbit", help="per machine link, e.g. 1gbit, 100gbit")
    p.add_argument("--latency", default="50us", help="per message, e.g. 50us, 1ms")
    p.add_argument(
        "--intra-bandwidth",
        default=None,
        help="link between the ranks of a machine (e.g. 100gbit): price sparse allreduce on two levels",
    )
    p.add_argument("--intra-latency", default="5us", help="per message inside a machine")
    p.add_argument("--backend", default="gloo", choices=BACKENDS,
                   help="whose dense allreduce prices the buckets: gloo runs a ring at every size, nccl a ring "
                   "or a tree, whichever its model finds faster (docs/hybrid.md, the step)")  # fmt: skip
    p.add_argument(
        "--levels",
        type=Path,
        default=None,
        help="price two levels with the links a `bench allreduce --hosts` run measured (its JSON)",
    )
    p.add_argument("--exchange-cpu", type=Path, default=None,
                   help="price the sharded exchange's CPU with these constants: a JSON {per_step, per_table, "
                   "per_key} or a plan_check run's JSON (its fit); default: unpriced")  # fmt: skip
    p.add_argument("--override", type=_override, action="append", default=[], help="NAME=PLACEMENT")
    p.add_argument("--allow-lossy", action="store_true", help="let the plan pick the sketch placement")
    p.add_argument("--json", type=Path, default=None, help="also write the plans to this file")
    p.set_defaults(func=run)


def exchange_cpu_from(path: Path) -> ExchangeCPU:
    """The ``ExchangeCPU`` in ``path``: a JSON object of its three terms, or a ``plan_check`` run's points (the
    fit they were priced with)."""
    obj = json.loads(path.read_text())
    if isinstance(obj, list) and obj and isinstance(obj[0], dict) and obj[0].get("exchange_cpu"):
        obj = obj[0]["exchange_cpu"]
    if not isinstance(obj, dict) or set(obj) != {"per_step", "per_table", "per_key"}:
        raise ValueError(f"{path}: want a JSON object {{per_step, per_table, per_key}} or a plan_check run's JSON")
    return ExchangeCPU(**obj)


def _stats(args: argparse.Namespace) -> list[ParamStats]:
    if args.stats is not None:
        return stats_from_json(json.loads(args.stats.read_text()))
    if args.model == "dlrm":
        rows = table_rows(args.max_rows)
        return dlrm_stats(rows, args.dim or 16, args.batch, args.mlp, procs_per_machine=args.procs_per_machine,
                          zipf=1.05 if args.zipf is None else args.zipf)  # fmt: skip
    zipf = 1.0 if args.zipf is None else args.zipf
    return lm_stats(args.vocab, args.dim or 128, args.hidden, args.tokens, args.procs_per_machine, zipf)


def run(args: argparse.Namespace, console: Console) -> int:
    if console.width < 140:  # the plan table has eight columns; don't squeeze names into ellipses
        console = Console(width=140, file=console.file)
    bw = parse_rate(args.bandwidth) / 8.0
    lat = parse_latency(args.latency) or 0.0
    summary = Table(title=f"predicted communication per step ({args.bandwidth}, {args.latency} per message, "
                          f"{args.backend})")  # fmt: skip
    for col in ("machines", "placements", "MB/machine", "step ms", "all dense AR ms", "speedup"):
        summary.add_column(col, justify="right" if col != "placements" else "left")
    plans = []
    levels = None if args.levels is None else levels_from_json(json.loads(args.levels.read_text()))
    cpu = None if args.exchange_cpu is None else exchange_cpu_from(args.exchange_cpu)
    for N in args.machines:
        stats = _stats(args)
        intra = None if args.intra_bandwidth is None else parse_rate(args.intra_bandwidth) / 8.0
        cluster = Cluster(N, args.procs_per_machine, bw, lat, intra_bandwidth=intra, levels=levels,
                          intra_latency=parse_latency(args.intra_latency) or 0.0,
                          backend=args.backend, exchange_cpu=cpu)  # fmt: skip
        plan = make_plan(stats, cluster, overrides=dict(args.override), allow_lossy=args.allow_lossy,
                         swap_modules=args.stats is None and args.model == "dlrm")  # fmt: skip
        print_entries(plan, console)
        print_step(plan, console)
        plans.append(plan.as_dict())
        kinds = sorted({e.placement for e in plan.entries})
        base = plan.with_kind("dense_allreduce").step_seconds
        speedup = f"{base / plan.step_seconds:.1f}x" if plan.step_seconds else "-"
        mb, ms = f"{plan.bytes_per_machine / 1e6:.2f}", f"{plan.step_seconds * 1e3:.2f}"
        summary.add_row(str(N), ", ".join(kinds), mb, ms, f"{base * 1e3:.2f}", speedup)
    show_table(console, summary)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(plans, indent=1))
        console.print(f"wrote {args.json}")
    return 0


def _title(plan: Plan) -> str:
    c = plan.cluster
    two = f", {c.intra_bandwidth * 8 / 1e9:g} Gbit/s inside" if c.two_level and c.intra_bandwidth else ""
    return (f"plan: {c.machines} machines x {c.procs_per_machine} procs, {c.bandwidth * 8 / 1e9:g} Gbit/s{two}, "
            f"{c.latency * 1e6:g} µs, {c.backend}")  # fmt: skip


def print_entries(plan: Plan, console: Console) -> None:
    """Per parameter its α, placement, bytes and what it adds to its kind's call (``Entry.seconds``)."""
    t = Table(title=_title(plan))
    for col in (*ENTRY_COLUMNS, "adds ms"):
        t.add_column(col, justify="left" if col in ("parameter", "placement") else "right")
    for e in plan.entries:
        t.add_row(*entry_cells(e))
    show_table(console, t)


def print_step(plan: Plan, console: Console) -> None:
    """The step as the trainer sends the plan (``Plan.step``): each call or round, what it carries, the algorithm
    that runs it and its time; then the step's total and what of it is exposed behind backward."""
    t = Table(title=f"the step: {plan.cluster.machines} machines ({plan.cluster.backend})")
    for col in ("part", "parameters", "MB/machine", "algorithm", "ms", "beside backward"):
        t.add_column(col, justify="left" if col in ("part", "algorithm") else "right")
    for p in plan.step.parts:
        shared = plan.shared.get(p.kind)
        how = p.algorithm or (f"{shared * 1e3:.3g} ms shared + each its own" if shared else "each its own")
        t.add_row(p.label, str(len(p.members)), f"{p.nbytes / 1e6:.3f}", how, f"{p.seconds * 1e3:.3f}",
                  "yes" if p.hidden else "no")  # fmt: skip
    t.add_row("step", str(len(plan.entries)), f"{plan.bytes_per_machine / 1e6:.3f}", "",
              f"{plan.step_seconds * 1e3:.3f}", "")  # fmt: skip
    show_table(console, t)
