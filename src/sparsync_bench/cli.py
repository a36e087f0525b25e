"""The ``sparsync`` command: ``demo``, ``bench allreduce``, ``bench compress``, ``bench embedding``,
``bench hybrid``, ``plan``, ``cluster``, ``trace merge``."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

BENCH_EXTRA = "the sparsync command needs the bench extra: pip install -e '.[bench]' in the checkout"

_SIZE = re.compile(r"^(\d+)([kKmMgG]?)$")


def parse_size(text: str) -> int:
    """'16M' -> 16*2**20, '1000' -> 1000."""
    m = _SIZE.match(text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: expected e.g. 16M, 1M, 500k, 1000")
    return int(m.group(1)) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[m.group(2).lower()]


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(parse_size(x) for x in text.split(","))


def _methods(text: str) -> tuple[str, ...]:
    from sparsync_bench.allreduce import HIERARCHICAL, METHODS, QUANTIZED

    out = tuple(text.split(","))
    valid = [*METHODS, *QUANTIZED, *HIERARCHICAL]
    bad = [m for m in out if m not in valid]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown methods {bad}; valid: {', '.join(valid)}")
    return out


def _choices(valid: tuple[str, ...], what: str) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        out = tuple(text.split(","))
        bad = [m for m in out if m not in valid]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {what} {bad}; valid: {', '.join(valid)}")
        return out

    return parse


def shown_default(default: Any) -> str:
    """An option's default as ``--help`` shows it: a tuple as the comma list the option takes, a list as the
    separate values, 0 as 0, and nothing given (None, an empty list) as "none"."""
    if default is None or (isinstance(default, tuple | list) and not default):
        return "none"
    if isinstance(default, tuple):
        return ",".join(map(str, default))
    if isinstance(default, list):
        return " ".join(map(str, default))
    return '""' if default == "" else str(default)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default (``shown_default``), unless the help already names it. A flag
    (an option that takes no value, e.g. ``store_true``) has none to show: it is on when given, off otherwise."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            not action.option_strings
            or action.nargs == 0
            or action.default is argparse.SUPPRESS
            or "default" in text
        ):
            return text
        return f"{text} (default: {shown_default(action.default).replace('%', '%%')})"


def _parents() -> dict[str, argparse.ArgumentParser]:
    """Option groups shared by several subcommands."""
    net = argparse.ArgumentParser(add_help=False)
    net.add_argument("--net", default=None, help="shape each rank's link, e.g. 1gbit, 100mbit (needs root)")
    net.add_argument("--latency", default=None, help="extra one-way delay per link with --net, e.g. 0.5ms")
    progress = argparse.ArgumentParser(add_help=False)
    progress.add_argument("--no-progress", action="store_true", help="no progress bar")
    hosts = argparse.ArgumentParser(add_help=False)
    hosts.add_argument("--hosts", type=int, default=None, help="emulated hosts (with --procs-per-host)")
    hosts.add_argument("--procs-per-host", type=int, default=None, help="ranks per emulated host (shared link)")
    return {"net": net, "progress": progress, "hosts": hosts}


def _add_embedding_parser(bsub: Any, parents: dict[str, argparse.ArgumentParser]) -> None:
    from sparsync_bench.allreduce import HIERARCHICAL
    from sparsync_bench.embedding import HOT
    from sparsync_bench.embedding import METHODS as EMB_METHODS

    em = bsub.add_parser(
        "embedding",
        help="nn.Embedding(sparse=True) gradients: torch's own paths vs sparsync",
        parents=[parents["net"], parents["hosts"], parents["progress"]],
        formatter_class=HelpFormatter,
    )
    em.add_argument("--procs", type=_ints, default=(2, 4, 8), help="world sizes, e.g. 2,4,8")
    em.add_argument("--rows", type=parse_size, default=2**20, help="embedding rows (default 1M)")
    em.add_argument("--dims", type=_ints, default=(16, 64, 128), help="embedding widths, e.g. 16,64,128")
    em.add_argument("--tokens", type=parse_size, default=8192, help="token ids per rank")
    em.add_argument("--zipf", type=_floats, default=(0.9, 1.1, 1.3), help="Zipf exponents, e.g. 0.9,1.1,1.3")
    em.add_argument("--hot", type=_choices(HOT, "hot"), default=HOT,
                    help=f"where the hot rows are: {', '.join(HOT)} (comma-separated)")  # fmt: skip
    em.add_argument("--repeats", type=int, default=11, help="timed calls per point (the median is reported)")
    em.add_argument("--methods", type=_choices((*EMB_METHODS, *HIERARCHICAL), "methods"), default=EMB_METHODS,
                    help=f"comma-separated; also {', '.join(HIERARCHICAL)} with --hosts")  # fmt: skip
    em.add_argument(
        "--sketch-lambda",
        type=_floats,
        default=(1.0,),
        dest="sketch_lambdas",
        help="S2's λ for method 'sketch': one method sketch@λ per value, e.g. 0.5,1,2,4 (ratio = λ·α, α the "
        "expected row density)",
    )
    em.add_argument(
        "--out", type=Path, default=Path("results/embedding"), help="path stem for .csv/.json/.png/.md"
    )
    em.set_defaults(func=_bench_embedding)


def _add_dlrm_parser(bsub: Any, parents: dict[str, argparse.ArgumentParser]) -> None:
    from sparsync_bench.dlrm_train import METHODS as DLRM_METHODS
    from sparsync_bench.dlrm_train import OPTIONAL as DLRM_OPTIONAL

    dl = bsub.add_parser(
        "dlrm",
        help="DLRM on Criteo-format data: torch DDP (dense, sparse) and torchrec vs sparsync (tables replicated "
        "or sharded: sparsync_sharded, sparsync_auto, sparsync_sharded_bf16)",
        parents=[parents["net"]],
        formatter_class=HelpFormatter,
    )
    dl.add_argument("--procs", type=_ints, default=(4,), help="world sizes, e.g. 4,8")
    dl.add_argument("--data", type=Path, default=None, help="a Criteo-format file (default: generate one)")
    dl.add_argument("--steps", type=int, default=30, help="training steps per method")
    dl.add_argument("--batch", type=int, default=128, help="samples per rank per step")
    dl.add_argument("--max-rows", type=parse_size, default=100_000, help="rows per table at most")
    dl.add_argument("--dim", type=int, default=16, help="embedding width")
    dl.add_argument(
        "--mlp",
        choices=("small", "kaggle", "terabyte", "mlperf"),
        default="small",
        help="small, or dlrm_s_pytorch.py's MLPs: kaggle (13-512-256-64-dim, 512-256-1; its dim is 16), "
        "terabyte (13-512-256-dim, 512-512-256-1; dim 64), mlperf (13-512-256-dim, 1024-1024-512-256-1; dim 128)",
    )
    dl.add_argument("--methods", type=_choices((*DLRM_METHODS, *DLRM_OPTIONAL), "methods"), default=None,
                    help=f"comma-separated (default {','.join(DLRM_METHODS)}, and torchrec_tw,torchrec_rw "
                         "where scripts/torchrec_env.sh made their environment); "
                         f"also {','.join(DLRM_OPTIONAL)}")  # fmt: skip
    dl.add_argument("--out", type=Path, default=Path("results/dlrm"), help="path stem for .json/.md")
    dl.add_argument("--tensorboard", type=Path, default=None,
                    help="rank 0 writes per-step bytes, time and algorithm counts here")  # fmt: skip
    dl.set_defaults(func=_bench_dlrm)


def _add_bench_parsers(sub: Any, parents: dict[str, argparse.ArgumentParser]) -> None:
    from sparsync.compress.registry import COMPRESSORS
    from sparsync_bench.allreduce import HIERARCHICAL, METHODS, QUANTIZED, BenchConfig
    from sparsync_bench.compress import DEFAULT_COMPRESSORS
    from sparsync_bench.hybrid import METHODS as HYBRID_METHODS

    bench = sub.add_parser("bench", help="benchmarks", formatter_class=HelpFormatter)
    bsub = bench.add_subparsers(dest="bench", required=True)
    net, progress, hosts = parents["net"], parents["progress"], parents["hosts"]
    ar = bsub.add_parser("allreduce", help="SparCML Fig. 4: time vs density per algorithm",
                         parents=[net, hosts, progress], formatter_class=HelpFormatter)  # fmt: skip
    ar.add_argument("--n", type=parse_size, default=16 * 2**20, help="vector length N (default 16M)")
    ar.add_argument("--procs", type=_ints, default=(2, 4, 8), help="world sizes, e.g. 2,4,8")
    ar.add_argument("--densities", type=_floats, default=BenchConfig().densities,
                    help="fractions of N stored per rank, comma-separated, each in (0, 1]")  # fmt: skip
    ar.add_argument("--repeats", type=int, default=5, help="timed calls per point (median and quartiles)")
    ar.add_argument("--methods", type=_methods, default=METHODS,
                    help=f"comma-separated; also {', '.join((*QUANTIZED, *HIERARCHICAL))}")  # fmt: skip
    ar.add_argument("--out", type=Path, default=Path("results/allreduce"), help="path stem for .csv/.json/.png")
    ar.set_defaults(func=_bench_allreduce)
    cp = bsub.add_parser("compress", help="compressors: time, bytes, error vs a dense allreduce",
                         parents=[net, progress], formatter_class=HelpFormatter)  # fmt: skip
    cp.add_argument("--sizes", type=_sizes, default=(1_000_000, 25_000_000), help="N per rank, e.g. 1000000,25M")
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
    cp.set_defaults(func=_bench_compress)
    hy = bsub.add_parser("hybrid", help="Parallax Table 4: allreduce vs allgather vs PS vs hybrid training",
                         parents=[net, progress], formatter_class=HelpFormatter)  # fmt: skip
    hy.add_argument("--procs", type=_ints, default=(4,), help="world sizes (one server per rank)")
    hy.add_argument("--seq", type=_ints, default=(20,), help="sequence lengths: the α sweep, e.g. 5,20,80")
    hy.add_argument("--vocab", type=parse_size, default=100_000, help="vocabulary (embedding rows)")
    hy.add_argument("--dim", type=int, default=128, help="embedding width")
    hy.add_argument("--hidden", type=int, default=256, help="LSTM width")
    hy.add_argument("--batch", type=int, default=32, help="sequences per rank per step")
    hy.add_argument("--steps", type=int, default=10, help="timed steps per method and round")
    hy.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    hy.add_argument("--rounds", type=int, default=2, help="methods interleave in this many rounds")
    hy.add_argument("--partitions", type=int, default=None, help="PS partitions per table (default: the plan's)")
    hy.add_argument("--methods", default=None,
                    help=f"comma-separated subset of {','.join(HYBRID_METHODS)} (default: all but "
                    "hybrid_sketch, omnireduce)")  # fmt: skip
    hy.add_argument("--text", type=Path, nargs="*", default=(), help="train on the words of these text files")
    hy.add_argument("--out", type=Path, default=Path("results/hybrid"), help="path stem for .csv/.json/.png")
    hy.add_argument("--search-partitions", action="store_true", help="run Parallax's partition search first")
    hy.add_argument("--no-prefetch", action="store_true", help="PS methods: pull each step's rows in that step")
    hy.set_defaults(func=_bench_hybrid)
    _add_embedding_parser(bsub, parents)
    _add_dlrm_parser(bsub, parents)


def version() -> str:
    """The installed package's version (importlib.metadata), else the source tree's ``sparsync.__version__``."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("sparsync")
    except PackageNotFoundError:
        import sparsync

        return str(sparsync.__version__)


def _points(p: argparse.ArgumentParser, *dests: str) -> int:
    """The size of the grid that ``p``'s defaults for these list options span."""
    n = 1
    for d in dests:
        n *= len(p.get_default(d))
    return n


# What a subcommand runs by default, for its --help: the grid's size and, where measured, its time on the 2-core
# development machine (docs/results_*.md).
GRIDS: dict[str, Callable[[argparse.ArgumentParser], str]] = {
    "bench allreduce": lambda p: (
        f"default grid: {len(p.get_default('procs')) * len(p.get_default('densities'))} "
        "points (world sizes x densities), every method at each; the full sweep took 19 min with --net 1gbit "
        "(docs/results_allreduce.md)."
    ),
    "bench embedding": lambda p: (
        "default grid: "
        f"{_points(p, 'procs', 'dims', 'zipf', 'hot')}"
        " points (world sizes x dims x Zipf exponents x hot-row layouts), every method at each "
        "(docs/results_embedding.md)."
    ),
    "bench compress": lambda p: (
        f"default grid: {len(p.get_default('sizes'))} sizes x every compressor at P = "
        f"{p.get_default('procs')}; 251 s with --net 1gbit, 277 s on loopback (docs/results_compress.md)."
    ),
    "reproduce": lambda p: (
        "--quick took 5 min 26 s and the full run 21 min 59 s with --net 1gbit (docs/results_reproduce.md)."
    ),
}


def _describe(p: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> None:
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
            grid = GRIDS.get(" ".join(sub))
            if grid is not None:
                sp.description = f"{sp.description}\n\n{grid(sp)}"
            _describe(sp, sub)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsync", description="Sparse collectives for PyTorch training.",
                                formatter_class=HelpFormatter)  # fmt: skip
    p.add_argument(
        "--version", action="version", version=f"%(prog)s {version()}", help="print the version and exit"
    )
    sub = p.add_subparsers(dest="command", required=True)
    parents = _parents()
    demo = sub.add_parser(
        "demo",
        help="train a sparse-embedding model on 4 local processes: dense allreduce vs sparsync's plans",
        parents=[parents["progress"]],
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
    demo.add_argument("--net", default=None, help="shape each process's link, e.g. 1gbit (needs root)")
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
    _add_bench_parsers(sub, parents)
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
    from sparsync_bench import plan_cli as cli_plan

    cli_plan.add_parser(sub, formatter_class=HelpFormatter)
    _add_reproduce_parser(sub)
    _describe(p)
    return p


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
    rp.add_argument("--sections", type=_choices(SECTIONS, "sections"), default=SECTIONS,
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


def _hosts(args: argparse.Namespace, procs: tuple[int, ...]) -> tuple[tuple[int, ...], int | None]:
    """(world sizes, ranks per host) from ``--procs`` or ``--hosts`` with ``--procs-per-host``."""
    if args.hosts is None and args.procs_per_host is None:
        return procs, None
    if args.hosts is None or args.procs_per_host is None or min(args.hosts, args.procs_per_host) < 1:
        raise ValueError("give both --hosts and --procs-per-host (each >= 1)")
    return (args.hosts * args.procs_per_host,), args.procs_per_host


def _hosts_and_methods(
    args: argparse.Namespace, defaults: tuple[str, ...], on_hosts: tuple[str, ...]
) -> tuple[tuple[int, ...], int | None, tuple[str, ...]]:
    """``_hosts``, and the methods: ``on_hosts`` instead of the default list when hosts are emulated."""
    procs, per_host = _hosts(args, args.procs)
    methods = on_hosts if per_host is not None and args.methods == defaults else args.methods
    return procs, per_host, methods


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


def _demo(args: argparse.Namespace, console: Console) -> int:
    from sparsync_bench.train_demo import DemoConfig, print_demo, run_demo

    warmup = DemoConfig.warmup
    if args.steps <= warmup:
        raise ValueError(
            f"--steps must exceed the demo's {warmup} warm-up steps (they are left out of the timing), got "
            f"--steps {args.steps}"
        )
    demo_cfg = DemoConfig(steps=args.steps, plan_pricing=args.plan_pricing, block=args.block)
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
    return 0


def _trace_merge(args: argparse.Namespace, console: Console) -> int:
    from sparsync_bench.trace_merge import merge_and_draw

    merged, png = merge_and_draw(args.dir, args.step, args.png, args.from_step)
    console.print(f"merged timeline: {merged} (open in https://ui.perfetto.dev); picture: {png}")
    return 0


def _bench_hybrid(args: argparse.Namespace, console: Console) -> int:
    from sparsync_bench.hybrid import METHODS as HYBRID_METHODS
    from sparsync_bench.hybrid import HybridBenchConfig
    from sparsync_bench.runner import run_hybrid_bench

    hcfg = HybridBenchConfig(
        vocab=args.vocab, dim=args.dim, hidden=args.hidden, batch=args.batch, steps=args.steps,
        warmup=args.warmup, rounds=args.rounds, partitions=args.partitions, prefetch=not args.no_prefetch,
        files=tuple(map(str, args.text)),
        methods=tuple(args.methods.split(",")) if args.methods else HYBRID_METHODS,
    )  # fmt: skip
    if args.search_partitions:
        from sparsync_bench.runner import search_hybrid_partitions

        found = search_hybrid_partitions(hcfg, args.procs[0], console=console)
        hcfg = HybridBenchConfig(**{**hcfg.__dict__, "partitions": found.best})
    run_hybrid_bench(hcfg, args.procs, args.seq, out=args.out, net=args.net, latency=args.latency,
                     console=console, progress=not args.no_progress)  # fmt: skip
    return 0


def _bench_allreduce(args: argparse.Namespace, console: Console) -> int:
    from sparsync_bench.allreduce import HIERARCHICAL, METHODS, BenchConfig
    from sparsync_bench.runner import run_allreduce_bench

    on_hosts = ("gloo_dense", "gloo_sparse_coo", "allgather", "auto", *HIERARCHICAL)
    procs, per_host, methods = _hosts_and_methods(args, METHODS, on_hosts)
    cfg = BenchConfig(dim=args.n, densities=args.densities, repeats=args.repeats, methods=methods)
    run_allreduce_bench(cfg, procs, procs_per_host=per_host, out=args.out, net=args.net, latency=args.latency,
                        console=console, progress=not args.no_progress)  # fmt: skip
    return 0


def _bench_embedding(args: argparse.Namespace, console: Console) -> int:
    from sparsync_bench.allreduce import HIERARCHICAL
    from sparsync_bench.embedding import METHODS as EMB_METHODS
    from sparsync_bench.embedding import EmbeddingBenchConfig
    from sparsync_bench.runner import run_embedding_bench

    on_hosts = ("torch_coo", "torch_ddp", "allgather", "ssar_split_allgather", "auto", *HIERARCHICAL)
    procs, per_host, methods = _hosts_and_methods(args, EMB_METHODS, on_hosts)
    ecfg = EmbeddingBenchConfig(rows=args.rows, dims=args.dims, tokens=args.tokens, zipf=args.zipf,
                                hot=args.hot, repeats=args.repeats, methods=methods,
                                sketch_lambdas=args.sketch_lambdas)  # fmt: skip
    run_embedding_bench(ecfg, procs, out=args.out, net=args.net, latency=args.latency, console=console,
                        progress=not args.no_progress, procs_per_host=per_host)  # fmt: skip
    return 0


def _bench_dlrm(args: argparse.Namespace, console: Console) -> int:
    from sparsync_bench.dlrm_train import DlrmBenchConfig, default_data, default_methods
    from sparsync_bench.runner import run_dlrm_bench

    if args.tensorboard is not None:
        from sparsync_bench.tensorboard import require_tensorboard

        require_tensorboard()  # before any work: the generated data file alone is megabytes
    if args.methods is None:
        args.methods, note = default_methods()
        if note:
            console.print(f"[dim]{note}[/]")
    need = args.steps * args.batch * max(args.procs)
    data = args.data or default_data(Path("results/criteo_synthetic.txt"), need)
    dcfg = DlrmBenchConfig(str(data), steps=args.steps, batch=args.batch, max_rows=args.max_rows, dim=args.dim,
                           methods=args.methods, mlp=args.mlp,
                           tensorboard=str(args.tensorboard or ""))  # fmt: skip
    run_dlrm_bench(dcfg, args.procs, out=args.out, net=args.net, latency=args.latency, console=console)
    return 0


def _bench_compress(args: argparse.Namespace, console: Console) -> int:
    from sparsync_bench.compress import CompressBenchConfig
    from sparsync_bench.runner import run_compress_bench

    ccfg = CompressBenchConfig(sizes=args.sizes, repeats=args.repeats)
    if args.compressors:
        ccfg = CompressBenchConfig(sizes=args.sizes, repeats=args.repeats, compressors=tuple(args.compressors))
    run_compress_bench(ccfg, procs=args.procs, out=args.out, net=args.net, latency=args.latency, console=console,
                       progress=not args.no_progress)  # fmt: skip
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
