"""``sparsync bench dlrm``: its options and its run (each world size a point of the runner's sweep, servers beside
the ranks when a parameter-server method runs, every rank running ``dlrm_train.worker``). What it trains and
reports (the methods, ``summarize``, ``markdown``) is ``sparsync_bench.dlrm_train``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console

from sparsync_bench import dlrm_train as dt
from sparsync_bench import options
from sparsync_bench.benchmark import Benchmark
from sparsync_bench.runner import Rows, Run, run_ranks
from sparsync_bench.tensorboard import require_tensorboard


def add_options(dl: argparse.ArgumentParser) -> None:
    dl.add_argument("--procs", type=options.ints, default=(4,), help="world sizes, e.g. 4,8")
    dl.add_argument("--data", type=Path, default=None, help="a Criteo-format file (default: generate one)")
    dl.add_argument("--steps", type=int, default=30, help="training steps per method")
    dl.add_argument("--batch", type=int, default=128, help="samples per rank per step")
    dl.add_argument("--max-rows", type=options.parse_size, default=100_000, help="rows per table at most")
    dl.add_argument("--dim", type=int, default=16, help="embedding width")
    dl.add_argument(
        "--mlp",
        choices=("small", "kaggle", "terabyte", "mlperf"),
        default="small",
        help="small, or dlrm_s_pytorch.py's MLPs: kaggle (13-512-256-64-dim, 512-256-1; its dim is 16), "
        "terabyte (13-512-256-dim, 512-512-256-1; dim 64), mlperf (13-512-256-dim, 1024-1024-512-256-1; dim 128)",
    )
    dl.add_argument("--methods", type=options.choices((*dt.METHODS, *dt.OPTIONAL), "methods"), default=None,
                    help=f"comma-separated (default {','.join(dt.METHODS)}, and torchrec_tw,torchrec_rw "
                         "where scripts/torchrec_env.sh made their environment); "
                         f"also {','.join(dt.OPTIONAL)}")  # fmt: skip
    dl.add_argument("--out", type=Path, default=Path("results/dlrm"), help="path stem for .json/.md")
    dl.add_argument("--tensorboard", type=Path, default=None,
                    help="rank 0 writes per-step bytes, time and algorithm counts here")  # fmt: skip


def command(args: argparse.Namespace, console: Console) -> int:
    if args.tensorboard is not None:
        require_tensorboard()  # before any work: the generated data file alone is megabytes
    if args.methods is None:
        args.methods, note = dt.default_methods()
        if note:
            console.print(f"[dim]{note}[/]")
    need = args.steps * args.batch * max(args.procs)
    data = args.data or dt.default_data(Path("results/criteo_synthetic.txt"), need)
    dcfg = dt.DlrmBenchConfig(str(data), steps=args.steps, batch=args.batch, max_rows=args.max_rows, dim=args.dim,
                              methods=args.methods, mlp=args.mlp,
                              tensorboard=str(args.tensorboard or ""))  # fmt: skip
    run_dlrm_bench(dcfg, args.procs, out=args.out, net=args.net, latency=args.latency, console=console)
    return 0


def run_dlrm_bench(
    cfg: dt.DlrmBenchConfig,
    procs: tuple[int, ...],
    *,
    out: Path,
    net: str | None = None,
    latency: str | None = None,
    console: Console | None = None,
    timeout: float = 1800.0,
) -> Rows:
    """``sparsync bench dlrm``: every method at each world size in ``procs`` (servers beside the ranks when a
    parameter-server method runs); prints and writes the markdown table. Returns the rows."""
    meta: dict[str, Any] = {"config": dt.config_dict(cfg), "procs": list(procs), "net": net}
    run = Run.start(out, meta, net=net, latency=latency, console=console, link_procs=max(procs))
    servers = any(m in dt.PS_METHODS for m in cfg.methods)
    rows = run.sweep(
        procs,
        lambda P: run_ranks(dt.worker, P, (cfg, dt.load(cfg, P)), spec=run.spec, timeout=timeout, servers=servers),
        lambda P: f"[bold]P = {P}[/], DLRM on {cfg.data}, {run.where}: {', '.join(cfg.methods)}",
    )
    dt.summarize(rows)
    text = dt.markdown(rows, cfg, run.where)
    run.console.print(text)
    return run.finish(rows, None, md=text)


BENCHMARK = Benchmark(
    "dlrm",
    "DLRM on Criteo-format data: torch DDP (dense, sparse) and torchrec vs sparsync (tables replicated or "
    "sharded: sparsync_sharded, sparsync_auto, sparsync_sharded_bf16, sparsync_sharded_lookahead)",
    add_options,
    command,
    dt.worker,
    shared=("net",),
)
