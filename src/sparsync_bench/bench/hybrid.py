"""``sparsync bench hybrid`` (Parallax Table 4): its options, its run (each world size and sequence length a
point of the runner's sweep, one server per rank, every rank running ``hybrid.worker``; Parallax's partition
search first with ``--search-partitions``), and what it shows: the table, the targets of the
hybrid issue, the speeds relative to the baselines, and the plan's predictions next to the measurements
(``sparsync plan`` validation): bytes per machine per step, and communication time per step priced with the link
each run measured (``Cluster(measured=...)``, the dense allreduce fused as the trainers send it)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from sparsync.costmodel import LinkModel
from sparsync.plan.cluster import Cluster
from sparsync.plan.detect import ParamStats
from sparsync.plan.partition_search import search_partitions
from sparsync.plan.planner import Plan, make_plan
from sparsync_bench import options, report
from sparsync_bench.benchmark import Benchmark
from sparsync_bench.hybrid import METHODS, HybridBenchConfig, config_dict, worker
from sparsync_bench.lm import SampledLM
from sparsync_bench.report import Check, pyplot, save_figure
from sparsync_bench.runner import Rows, Run, run_ranks
from sparsync_bench.tables import show_table

if TYPE_CHECKING:
    from sparsync.plan.partition_search import PartitionSearch

# method -> the plan placement of the embedding that describes it (dense parameters: dense allreduce)
PLAN_OF = {
    "allreduce": "dense_allreduce",
    "sparse_ar": "sparse_allreduce",
    "hybrid": "ps",
    "hybrid_sketch": "sketch",
}


def method_plan(
    cfg: HybridBenchConfig, P: int, alpha: float, method: str, link: LinkModel | None = None
) -> Plan | None:
    """The plan describing ``method`` at P machines with the measured α (and the measured ``link`` when given);
    None where no plan placement matches."""
    if method not in PLAN_OF or P < 2:
        return None
    model = SampledLM(cfg.vocab, cfg.dim, cfg.hidden)
    stats = [
        ParamStats(n, tuple(p.shape), alpha if n == "emb.weight" else 1.0, n == "emb.weight", alpha)
        for n, p in model.named_parameters()
    ]
    return make_plan(stats, Cluster(P, measured=link), overrides={"emb.weight": PLAN_OF[method]},
                     sketch_ratio=cfg.sketch_ratio)  # fmt: skip


def _error(pred: float | None, measured: float) -> float | None:
    return None if pred is None or measured <= 0 else (pred - measured) / measured


def add_predictions(rows: list[dict[str, Any]], cfg: HybridBenchConfig, P: int, net: str | None) -> None:
    """Give each row of one run (P ranks) its plan's bytes and communication time, priced with the link the
    run measured, and their errors against the measurements (changes ``rows``)."""
    for r in rows:
        plan = method_plan(cfg, P, r["alpha"], r["method"], LinkModel(**r["link"]))
        r["net"] = net or "loopback"
        r["predicted_bytes"] = None if plan is None else plan.bytes_per_machine
        r["bytes_error"] = _error(r["predicted_bytes"], r["bytes_per_step_per_machine"])
        r["predicted_comm_ms"] = None if plan is None else 1e3 * plan.fused_seconds
        r["comm_error"] = _error(r["predicted_comm_ms"], r["comm_ms"])


def print_table(rows: list[dict[str, Any]], console: Console, title: str) -> None:
    t = Table(title=title)
    cols = ("P", "seq", "α", "method", "words/s", "ms/step", "MB/step/machine", "plan MB", "plan err", "comm ms",
            "plan ms", "loss")  # fmt: skip
    for col in cols:
        t.add_column(col, justify="left" if col == "method" else "right")
    for r in rows:
        pred, err = r["predicted_bytes"], r["bytes_error"]
        t.add_row(
            str(r["P"]), str(r["seq"]), f"{r['alpha']:.4f}", r["method"], f"{r['words_per_s']:,.0f}",
            f"{r['step_s'] * 1e3:.1f}", f"{r['bytes_per_step_per_machine'] / 1e6:.3f}",
            "-" if pred is None else f"{pred / 1e6:.3f}", "-" if err is None else f"{err * 100:+.1f}%",
            f"{r['comm_ms']:.1f}", "-" if r.get("predicted_comm_ms") is None else f"{r['predicted_comm_ms']:.1f}",
            f"{r['loss']:.4f}",
        )  # fmt: skip
    show_table(console, t)


BASELINES = {"allreduce": "dense allreduce", "ddp_sparse": "DDP (sparse grads)"}


def relative_speed(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per "P=.. seq=..": every method's words/s over each baseline's (``BASELINES``) that ran there."""
    groups: dict[tuple[int, int], dict[str, float]] = {}
    for r in rows:
        groups.setdefault((r["P"], r["seq"]), {})[r["method"]] = r["words_per_s"]
    return {
        f"P={P} seq={seq}": {b: {m: x / w[b] for m, x in w.items() if m != b} for b in BASELINES if b in w}
        for (P, seq), w in groups.items()
    }


def compare_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line per (P, seq) and baseline: each method's speed (words/s) as a multiple of the baseline's."""
    out = []
    for where, per in relative_speed(rows).items():
        for b, rel in per.items():
            ms = ", ".join(f"{m} {x:.2f}x" for m, x in rel.items())
            out.append(f"{where}, words/s relative to {BASELINES[b]}: {ms}")
    return out


def check_targets(rows: list[dict[str, Any]]) -> list[Check]:
    """Per (P, seq): hybrid >= 3x all-dense allreduce, >= 1.5x allgather and >= 1.5x DDP with sparse
    gradients (torch's own allgather way) in words/s; AR < PS < hybrid."""
    out = []
    groups: dict[tuple[int, int], dict[str, float]] = {}
    for r in rows:
        groups.setdefault((r["P"], r["seq"]), {})[r["method"]] = r["words_per_s"]
    for (P, seq), w in groups.items():
        if "hybrid" not in w:
            continue
        if "allreduce" in w:
            x = w["hybrid"] / w["allreduce"]
            out.append((f"P={P} seq={seq}: hybrid >= 3x all-dense allreduce", x >= 3, f"{x:.2f}x"))
        if "allgather" in w:
            x = w["hybrid"] / w["allgather"]
            out.append((f"P={P} seq={seq}: hybrid >= 1.5x allgather", x >= 1.5, f"{x:.2f}x"))
        if "ddp_sparse" in w:
            x = w["hybrid"] / w["ddp_sparse"]
            out.append((f"P={P} seq={seq}: hybrid >= 1.5x DDP (sparse grads)", x >= 1.5, f"{x:.2f}x"))
        if "allreduce" in w and "ps" in w:
            ok = w["allreduce"] < w["ps"] < w["hybrid"]
            out.append((f"P={P} seq={seq}: AR < PS < hybrid (Parallax Table 4)", ok,
                        f"{w['allreduce']:,.0f} / {w['ps']:,.0f} / {w['hybrid']:,.0f} words/s"))  # fmt: skip
    return out


def plan_time_errors(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Mean |predicted - measured| / measured communication time per step, per method with a plan."""
    errs: dict[str, list[float]] = {}
    for r in rows:
        if r.get("comm_error") is not None:
            errs.setdefault(r["method"], []).append(abs(r["comm_error"]))
    return {m: sum(e) / len(e) for m, e in errs.items()}


def plot_plan_time(rows: list[dict[str, Any]], out: Path, title: str) -> Path:
    """Predicted (dashed) and measured (solid) communication ms per step against P, one colour per method."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    planned = [r for r in rows if r.get("predicted_comm_ms") is not None]
    for k, m in enumerate(dict.fromkeys(r["method"] for r in planned)):
        for seq in dict.fromkeys(r["seq"] for r in planned):
            rs = sorted((r for r in planned if r["method"] == m and r["seq"] == seq), key=lambda r: r["P"])
            label = m if len(rs) == len([r for r in planned if r["method"] == m]) else f"{m} seq={seq}"
            ps = [r["P"] for r in rs]
            ax.plot(ps, [r["comm_ms"] for r in rs], "o-", color=f"C{k}", label=f"{label} measured")
            ax.plot(ps, [r["predicted_comm_ms"] for r in rs], "x--", color=f"C{k}", label=f"{label} plan")
    ax.set_xlabel("P (machines)")
    ax.set_ylabel("communication ms per step")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.set_title("sparsync plan vs measured: " + title, fontsize=8)
    return save_figure(fig, out.with_name(out.name + "_plan_time.png"), dpi=120)


def plot(rows: list[dict[str, Any]], out: Path, title: str) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    groups = list(dict.fromkeys((r["P"], r["seq"]) for r in rows))
    width = 0.8 / max(1, len(methods))
    for k, m in enumerate(methods):
        for ax, key, scale in ((axes[0], "words_per_s", 1.0), (axes[1], "bytes_per_step_per_machine", 1e-6)):
            ys = [next((r[key] * scale for r in rows if r["method"] == m and (r["P"], r["seq"]) == g), 0.0)
                  for g in groups]  # fmt: skip
            ax.bar([i + k * width for i in range(len(groups))], ys, width, label=m)
    for ax, label in ((axes[0], "words/s"), (axes[1], "MB per step per machine")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
        ax.set_xticklabels([f"P={P}\nseq={s}" for P, s in groups])
        ax.set_ylabel(label)
        ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, out.with_suffix(".png"), dpi=120)


def add_options(hy: argparse.ArgumentParser) -> None:
    hy.add_argument("--procs", type=options.ints, default=(4,), help="world sizes (one server per rank)")
    hy.add_argument("--seq", type=options.ints, default=(20,), help="sequence lengths: the α sweep, e.g. 5,20,80")
    hy.add_argument("--vocab", type=options.parse_size, default=100_000, help="vocabulary (embedding rows)")
    hy.add_argument("--dim", type=int, default=128, help="embedding width")
    hy.add_argument("--hidden", type=int, default=256, help="LSTM width")
    hy.add_argument("--batch", type=int, default=32, help="sequences per rank per step")
    hy.add_argument("--steps", type=int, default=10, help="timed steps per method and round")
    hy.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    hy.add_argument("--rounds", type=int, default=2, help="methods interleave in this many rounds")
    hy.add_argument("--partitions", type=int, default=None, help="PS partitions per table (default: the plan's)")
    hy.add_argument("--methods", default=None,
                    help=f"comma-separated subset of {','.join(METHODS)} (default: all but "
                    "hybrid_sketch, omnireduce)")  # fmt: skip
    hy.add_argument("--text", type=Path, nargs="*", default=(), help="train on the words of these text files")
    hy.add_argument("--out", type=Path, default=Path("results/hybrid"), help="path stem for .csv/.json/.png")
    hy.add_argument("--search-partitions", action="store_true", help="run Parallax's partition search first")
    hy.add_argument("--no-prefetch", action="store_true", help="PS methods: pull each step's rows in that step")


def command(args: argparse.Namespace, console: Console) -> int:
    hcfg = HybridBenchConfig(
        vocab=args.vocab, dim=args.dim, hidden=args.hidden, batch=args.batch, steps=args.steps,
        warmup=args.warmup, rounds=args.rounds, partitions=args.partitions, prefetch=not args.no_prefetch,
        files=tuple(map(str, args.text)),
        methods=tuple(args.methods.split(",")) if args.methods else METHODS,
    )  # fmt: skip
    if args.search_partitions:
        found = search_hybrid_partitions(hcfg, args.procs[0], console=console)
        hcfg = HybridBenchConfig(**{**hcfg.__dict__, "partitions": found.best})
    run_hybrid_bench(hcfg, args.procs, args.seq, out=args.out, net=args.net, latency=args.latency,
                     console=console, progress=not args.no_progress)  # fmt: skip
    return 0


def run_hybrid_bench(
    cfg: HybridBenchConfig,
    procs: tuple[int, ...],
    seqs: tuple[int, ...],
    *,
    out: Path,
    net: str | None = None,
    latency: str | None = None,
    console: Console | None = None,
    progress: bool = True,
    timeout: float = 1800.0,
) -> Rows:
    """``sparsync bench hybrid`` (Parallax Table 4) at each world size and sequence length, one server per rank;
    print, save, plot, with the plan's predictions beside the measurements. Returns the rows."""
    meta: dict[str, Any] = {"config": config_dict(cfg), "procs": list(procs), "seqs": list(seqs), "net": net}
    run = Run.start(out, meta, net=net, latency=latency, console=console, width=130, link_procs=max(procs))
    console = run.console

    def point(at: tuple[int, int]) -> Rows:
        P, seq = at
        c = replace(cfg, seq=seq)
        rows: Rows = run_ranks(worker, P, (c, progress), spec=run.spec, timeout=timeout, servers=True)
        add_predictions(rows, c, P, net)
        return rows

    def header(at: tuple[int, int]) -> str:
        return (
            f"[bold]P = {at[0]}[/], seq = {at[1]}, vocab {cfg.vocab:,} x {cfg.dim}, LSTM {cfg.hidden}, {run.where}"
        )

    rows = run.sweep([(P, seq) for P in procs for seq in seqs], point, header)
    title = f"hybrid training, vocab {cfg.vocab:,} x {cfg.dim}, batch {cfg.batch}, {run.where}"
    print_table(rows, console, title)
    for line in compare_lines(rows):
        console.print(line)
    checks = check_targets(rows)
    report.print_targets(checks, console)
    errors = plan_time_errors(rows)
    for m, e in errors.items():
        console.print(f"plan's communication time vs measured, {m}: mean |error| {100 * e:.1f}%")
    pngs = [plot(rows, out, title), *([plot_plan_time(rows, out, title)] if errors else [])]
    return run.finish(rows, checks, pngs=pngs, speedup_vs_baselines=relative_speed(rows),
                      plan_time_mean_abs_error=errors)  # fmt: skip


def search_hybrid_partitions(
    cfg: HybridBenchConfig, P: int, *, console: Console, max_partitions: int = 256, timeout: float = 900.0
) -> PartitionSearch:
    """Parallax §3.2 for real: iteration times of the hybrid method on loopback for sampled partition counts,
    the fit, and the chosen count."""

    def measure(parts: int) -> list[float]:
        c = replace(cfg, partitions=parts, methods=("hybrid",))
        times: list[float] = run_ranks(worker, P, (c, False), spec=None, timeout=timeout, servers=True)[0][
            "times_s"
        ]
        console.print(f"  partitions = {parts}: {1e3 * sum(times) / len(times):.1f} ms/step")
        return times

    console.print(f"[bold]partition search[/] (Parallax §3.2), hybrid, P = {P}, loopback")
    res = search_partitions(measure, P, max_partitions=max_partitions, servers=P)  # one server per rank
    t0, t1, t2 = res.theta
    console.print(f"  fit t(P) = {t0 * 1e3:.2f} + {t1 * 1e3:.2f}/P + {t2 * 1e3:.4f}·P ms; chosen P = {res.best}")
    return res


BENCHMARK = Benchmark(
    "hybrid",
    "Parallax Table 4: allreduce vs allgather vs PS vs hybrid training",
    add_options,
    command,
    worker,
    shared=("net", "progress"),
)
