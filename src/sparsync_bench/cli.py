"""The ``sparsync`` command: ``demo``, ``bench NAME`` (one subcommand per entry of ``bench.BENCHMARKS``),
``plan``, ``cluster``, ``trace merge``, ``reproduce``. It imports no module that needs the bench extra until
``main`` has checked that the extra is there (so it can say so instead of failing on an import): those imports
sit in the functions that use them."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

from sparsync_bench.options import HelpFormatter, choices, parse_size, shared_options, shown_default

if TYPE_CHECKING:
    from sparsync_bench.benchmark import Benchmark

BENCH_EXTRA = "the sparsync command needs the bench extra: pip install -e '.[bench]' in the checkout"
__all__ = ["BENCH_EXTRA", "HelpFormatter", "build_parser", "main", "parse_size", "shown_default"]


def version() -> str:
    """The installed package's version (importlib.metadata), else the source tree's ``sparsync.__version__``."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("sparsync")
    except PackageNotFoundError:
        import sparsync

        return str(sparsync.__version__)


Grids = dict[str, Callable[[argparse.ArgumentParser], str]]

# What a subcommand runs by default, for its --help: the grid's size and, where measured, its time on the 2-core
# development machine (docs/results_*.md). A benchmark's is its entry's ``grid``.
GRIDS: Grids = {
    "reproduce": lambda p: (
        "--quick took 5 min 26 s and the full run 21 min 59 s with --net 1gbit (docs/results_reproduce.md)."
    ),
}


def _describe(p: argparse.ArgumentParser, grids: Grids, path: tuple[str, ...] = ()) -> None:
    """Every subcommand's --help opens with a description (its one-line help where it has none) and, where it runs
    a grid, the grid's size."""
    for a in p._actions:
        if not isinstance(a, argparse._SubParsersAction):
            continue
        helps = {c.dest: c.help for c in a._choices_actions}
        for name, sp in a.choices.items():
            sub = (*path, name)
            if not sp.description:
                sp.description = helps.get(name) or name
            grid = grids.get(" ".join(sub))
            if grid is not None:
                sp.description = f"{sp.description}\n\n{grid(sp)}"
            _describe(sp, grids, sub)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsync", description="Sparse collectives for PyTorch training.",
                                formatter_class=HelpFormatter)  # fmt: skip
    p.add_argument(
        "--version", action="version", version=f"%(prog)s {version()}", help="print the version and exit"
    )
    sub = p.add_subparsers(dest="command", required=True)
    parents = shared_options()
    _add_demo_parser(sub, parents["progress"])
    _add_trace_parser(sub)
    from sparsync_bench.bench import BENCHMARKS

    _add_bench_parsers(sub, parents, BENCHMARKS)
    _add_cluster_parser(sub)
    from sparsync_bench import plan_cli as cli_plan

    cli_plan.add_parser(sub, formatter_class=HelpFormatter)
    _add_reproduce_parser(sub)
    _describe(p, {**GRIDS, **{f"bench {b.name}": b.grid for b in BENCHMARKS if b.grid is not None}})
    return p


def _add_demo_parser(sub: Any, progress: argparse.ArgumentParser) -> None:
    """``sparsync demo`` and its options; ``progress``: the shared progress option group."""
    demo = sub.add_parser(
        "demo",
        help="train a sparse-embedding model on 4 local processes: dense allreduce vs sparsync's plans",
        parents=[progress],
        formatter_class=HelpFormatter,
    )
    demo.add_argument("--out", type=Path, default=Path("results/demo_train"), help="path stem for .json/.md")
    demo.add_argument("--steps", type=int, default=150, help="training steps per plan")
    demo.add_argument("--block", type=int, default=10,
                      help="steps each plan trains in its turn: the plans alternate block by block, and each "
                           "ratio between plans is printed with its spread over the blocks")  # fmt: skip
    demo.add_argument("--plan-pricing", choices=("measured", "assumed"), default="measured",
                      help="the automatic plan's prices: the demo's measured link and parameter servers, or an "
                           "assumed 1 Gbit/s, 50 µs link")  # fmt: skip
    demo.add_argument("--net", default="auto",
                      help="each process's link: a rate such as 1gbit (emulated: a network namespace and a "
                           "tc-shaped link per process, needs root), 'loopback', or 'auto': 1gbit when run as "
                           "root with ip and tc, else loopback")  # fmt: skip
    demo.add_argument("--no-tables", action="store_true",
                      help="skip the second part: a table set placed by sparsync.shard(plan='auto'), replicated "
                           "and sharded trained side by side (on loopback)")  # fmt: skip
    demo.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="write each rank's timeline to this directory (then: sparsync trace merge DIR)",
    )
    demo.add_argument(
        "--tensorboard",
        type=Path,
        default=None,
        help="write per-step bytes, time and algorithm counts for TensorBoard to this directory",
    )
    demo.set_defaults(func=_demo)


def _add_trace_parser(sub: Any) -> None:
    """``sparsync trace merge DIR`` and its options."""
    tr = sub.add_parser(
        "trace", help="timelines written by sparsync.trace or SPARSYNC_TRACE", formatter_class=HelpFormatter
    )
    trsub = tr.add_subparsers(dest="trace_command", required=True)
    mg = trsub.add_parser(
        "merge",
        help="merge the ranks' timelines onto one clock (DIR/merged.json, for Perfetto) and draw the slowest "
        "step (DIR/slowest_step.png)",
        formatter_class=HelpFormatter,
    )
    mg.add_argument("dir", type=Path, help="the directory holding rank<r>.json")
    mg.add_argument("--step", type=int, default=None, help="draw this step instead of the slowest")
    mg.add_argument("--from-step", type=int, default=0, help="the slowest among the steps numbered this or more")
    mg.add_argument("--png", type=Path, default=None, help="the picture's path (default: DIR/slowest_step.png)")
    mg.set_defaults(func=_trace_merge)


def _add_cluster_parser(sub: Any) -> None:
    """``sparsync cluster -- SCRIPT`` and its options."""
    cl = sub.add_parser(
        "cluster",
        help="run a script under torchrun on emulated hosts (one network namespace each, shaped links)",
        description="Run SCRIPT under `torchrun --nnodes HOSTS --nproc-per-node PROCS --rdzv-backend c10d` on "
        "every emulated host, as on a cluster (needs root). Example: sparsync cluster --hosts 2 "
        "--procs-per-host 2 -- examples/sparse_allreduce.py",
        formatter_class=HelpFormatter,
    )
    cl.add_argument("--hosts", type=int, default=2, help="emulated hosts (network namespaces)")
    cl.add_argument("--procs-per-host", type=int, default=2, help="ranks per host (torchrun --nproc-per-node)")
    cl.add_argument("--net", default="1gbit", help="each host's link, both directions")
    cl.add_argument("--latency", default=None, help="extra one-way delay per link, e.g. 0.5ms")
    cl.add_argument("--max-restarts", type=int, default=0, help="torchrun --max-restarts (elastic restarts)")
    cl.add_argument("--timeout", type=float, default=None, help="seconds before every host is stopped")
    cl.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...] (as given to torchrun)")
    cl.set_defaults(func=_cluster)


def _add_bench_parsers(
    sub: Any, parents: dict[str, argparse.ArgumentParser], benchmarks: tuple[Benchmark, ...]
) -> None:
    """``sparsync bench NAME`` for each benchmark: its shared option groups, its own options, its command."""
    bench = sub.add_parser("bench", help="benchmarks", formatter_class=HelpFormatter)
    bsub = bench.add_subparsers(dest="bench", required=True)
    for b in benchmarks:
        bp = bsub.add_parser(b.name, help=b.help, parents=[parents[s] for s in b.shared],
                             formatter_class=HelpFormatter)  # fmt: skip
        b.add_options(bp)
        bp.set_defaults(func=b.command)


def _outputs(out: Path) -> list[Path]:
    """What a run writing to ``out`` (a directory, or a path stem for .json/.csv/.md/.png) would overwrite."""
    if out.is_dir():
        return [out] if any(out.iterdir()) else []
    return [f for f in (Path(f"{out}{s}") for s in (".json", ".csv", ".md", ".png")) if f.exists()]


def warn_overwrite(args: argparse.Namespace, console: Console) -> list[Path]:
    """Say which results a run is about to overwrite (``--out`` already holds them): one line, no refusal."""
    out = getattr(args, "out", None)
    found = _outputs(Path(out)) if out is not None else []
    if found:
        console.print(f"overwriting {', '.join(map(str, found))}", markup=False, highlight=False)
    return found


def _add_reproduce_parser(sub: Any) -> None:
    from sparsync_bench.reproduce import SECTIONS

    rp = sub.add_parser(
        "reproduce",
        help="each paper's headline experiment at laptop scale, one report (markdown + plots)",
        description="Runs SparCML Fig. 4, S2 vs OmniReduce, DCT on DLRM, Parallax Table 3/4 on a language model "
        "and TF-Replicator's one-script-any-scale, each beside torch's own path, and writes OUT/report.md.",
        formatter_class=HelpFormatter,
    )
    rp.add_argument(
        "--quick", action="store_true", help="smaller sizes and P: about 5.5 min instead of 22 (measured)"
    )
    rp.add_argument("--net", default=None, help="shape each rank's link, e.g. 1gbit (needs root)")
    rp.add_argument("--sections", type=choices(SECTIONS, "sections"), default=SECTIONS,
                    help=f"comma-separated subset of {','.join(SECTIONS)}")  # fmt: skip
    rp.add_argument("--corpus", type=Path, default=None,
                    help="text for the language model (default GCIDE: apt-get install dict-gcide)")  # fmt: skip
    rp.add_argument("--out", type=Path, default=Path("results/reproduce"), help="directory for report.md")
    rp.set_defaults(func=_reproduce)


def _reproduce(args: argparse.Namespace, console: Console) -> int:
    from sparsync_bench.reproduce import FULL, QUICK, run_reproduce

    report = run_reproduce(args.out, scale=QUICK if args.quick else FULL, net=args.net, sections=args.sections,
                           corpus=args.corpus, console=console)  # fmt: skip
    console.print(f"[bold]report:[/] {report}")
    return 0


def _cluster(args: argparse.Namespace, console: Console) -> int:
    from sparsync_bench.cluster import run_cluster
    from sparsync_bench.netem import net_spec

    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    spec = net_spec(args.net, args.latency)
    if spec is None:
        raise ValueError("--net is required: emulated hosts are linked by shaped links (e.g. --net 1gbit)")
    console.print(
        f"[bold]sparsync cluster[/]: {args.hosts} hosts x {args.procs_per_host} ranks, {spec.rate} links per "
        f"host, torchrun --max-restarts {args.max_restarts}: {' '.join(script)}"
    )
    res = run_cluster(script, hosts=args.hosts, procs_per_host=args.procs_per_host, net=spec,
                      max_restarts=args.max_restarts, timeout=args.timeout)  # fmt: skip
    for i, rc in enumerate(res.returncodes):
        if rc:
            console.print(f"[red]host {i}: torchrun exited with status {rc}[/]")
    return 0 if res.ok else 1


def demo_link(net: str) -> tuple[str | None, str]:
    """The demo's ``--net`` resolved: (the rate to emulate, or None for loopback; the words that say which and
    why). "auto" emulates 1 Gbit/s links, the setting sparsync is meant for, where this process may (root, with
    ``ip`` and ``tc``); on loopback, where the dense allreduce is a memory copy, its advantage does not show."""
    import os
    import shutil

    if net == "loopback":
        return None, "loopback (asked for)"
    if net != "auto":
        return net, f"emulated {net} links, one network namespace per process (asked for)"
    if os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc"):
        return "1gbit", "emulated 1gbit links, one network namespace per process (running as root)"
    return None, (
        "loopback: emulated links need root, ip and tc; a loopback allreduce is a memory copy, where sending "
        "fewer bytes gains little (run as root, or with --net 1gbit, for the setting sparsync is meant for)"
    )


def _demo(args: argparse.Namespace, console: Console) -> int:
    from sparsync_bench.train_demo import DemoConfig, print_demo, run_demo

    warmup = DemoConfig.warmup
    if args.steps <= warmup:
        raise ValueError(
            f"--steps must exceed the demo's {warmup} warm-up steps (they are left out of the timing), got "
            f"--steps {args.steps}"
        )
    demo_cfg = DemoConfig(steps=args.steps, plan_pricing=args.plan_pricing, block=args.block)
    args.net, why = demo_link(args.net)
    console.print(f"links: {why}")
    console.print(
        f"[bold]sparsync demo[/]: {demo_cfg.replicas} local processes train a classifier with a sparse "
        f"embedding (vocab {demo_cfg.vocab:,}, Zipf tokens), {demo_cfg.steps} steps per gradient plan, the plans "
        f"taking turns in blocks of {demo_cfg.block} steps"
    )
    if args.tensorboard is not None:
        from sparsync_bench.tensorboard import require_tensorboard

        require_tensorboard()  # before four processes start
    trace_dir, tensorboard = str(args.trace or ""), str(args.tensorboard or "")
    runs, diff, plan = run_demo(demo_cfg, show_progress=not args.no_progress, net=args.net,
                                trace_dir=trace_dir, tensorboard=tensorboard)  # fmt: skip
    print_demo(runs, diff, demo_cfg, console, args.out, args.net, plan)
    if args.trace is not None:
        console.print(f"timelines in {args.trace}: sparsync trace merge {args.trace}")
    if not args.no_tables:
        tables_part(args.out.with_name(args.out.name + "_tables"), console)
    return 0


def tables_part(out: Path, console: Console) -> None:
    """The demo's second part (``demo_shard``): each table set's lines on screen, the results in ``out``.json /
    .md."""
    from sparsync_bench.demo_shard import TABLE_SETS, run_tables, summary_lines

    sets, lines = [], []
    for cfg in TABLE_SETS:
        console.print(f"[bold]tables, dim {cfg.dim}[/]: sharded or replicated? {cfg.procs} processes, loopback")
        res = run_tables(cfg)
        mine = list(summary_lines(res, cfg))
        for line in mine:
            console.print(line)
        sets.append({"config": asdict(cfg), "ranks": res})
        lines += [*mine, ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"sets": sets}, indent=1))
    out.with_suffix(".md").write_text("\n".join(lines))
    console.print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")


def _trace_merge(args: argparse.Namespace, console: Console) -> int:
    from sparsync_bench.trace_merge import merge_and_draw

    merged, png = merge_and_draw(args.dir, args.step, args.png, args.from_step)
    console.print(f"merged timeline: {merged} (open in https://ui.perfetto.dev); picture: {png}")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:  # the library does without them; the command's tables, progress bars and plots do not
        import matplotlib  # noqa: F401
        from rich.console import Console
        from rich.markup import escape
    except ImportError as e:
        print(f"{BENCH_EXTRA} (missing: {(e.name or str(e)).split('.')[0]})", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    console = Console()
    if not console.is_terminal:  # a file or a CI log: lines as long as they are, not wrapped at 80 columns
        console = Console(soft_wrap=True)
    warn_overwrite(args, console)
    try:
        code: int = args.func(args, console)
        return code
    except KeyError as e:
        console.print(f"[red]error:[/] {escape(str(e.args[0] if e.args else e))}")
        return 2
    except (ValueError, OSError, RuntimeError) as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
