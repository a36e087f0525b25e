"""Running ``sparsync bench hybrid``: servers (one per rank, inside its namespace with ``--net``), the ranks,
then the table, CSV/JSON/PNG, the targets of the hybrid issue and the plan's predicted bytes next to the
measured ones (``sparsync plan`` validation)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from sparsync.bench.hybrid import HybridBenchConfig, config_dict, worker
from sparsync.bench.lm import SampledLM
from sparsync.bench.report import write_files
from sparsync.launch import launch
from sparsync.netem import NetNamespaces, describe, net_spec, shaped
from sparsync.placement.detect import ParamStats
from sparsync.placement.partition import PartitionSearch, search_partitions
from sparsync.placement.plan import Cluster, make_plan
from sparsync.placement.server import ServerConfig, ServerProcess

# method -> the plan placement of the embedding that describes it (dense parameters: dense allreduce)
PLAN_OF = {
    "allreduce": "dense_allreduce",
    "sparse_ar": "sparse_allreduce",
    "hybrid": "ps",
    "hybrid_sketch": "sketch",
}


@contextmanager
def bench_servers(P: int, ns: NetNamespaces | None) -> Iterator[list[str]]:
    """One server per rank (in rank i's namespace with ``ns``), as the benchmarks and the demo colocate them;
    yields their addresses and kills them on exit."""
    out: list[ServerProcess] = []
    addrs: list[str] = []
    try:
        for i in range(P):
            host = ns.address(i) if ns is not None else "127.0.0.1"
            sp = ServerProcess(ServerConfig(server_id=i, host=host, wait_timeout=300.0),
                               netns=ns.namespace(i) if ns is not None else None)  # fmt: skip
            out.append(sp)
            addrs.append(sp.start())
        yield addrs
    finally:
        for sp in out:
            sp.kill()


def predicted_bytes(cfg: HybridBenchConfig, P: int, alpha: float, method: str) -> float | None:
    """Bytes per machine per step the plan predicts for ``method`` (None where no plan placement matches)."""
    if method not in PLAN_OF or P < 2:
        return None
    model = SampledLM(cfg.vocab, cfg.dim, cfg.hidden)
    stats = [
        ParamStats(n, tuple(p.shape), alpha if n == "emb.weight" else 1.0, n == "emb.weight", alpha)
        for n, p in model.named_parameters()
    ]
    plan = make_plan(stats, Cluster(P), overrides={"emb.weight": PLAN_OF[method]}, sketch_ratio=cfg.sketch_ratio)
    return plan.bytes_per_machine


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
) -> list[dict[str, Any]]:
    console = console or Console()
    if console.width < 130:  # ten columns
        console = Console(width=130, file=console.file)
    spec = net_spec(net, latency)
    where = describe(spec)
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for P in procs:
        for seq in seqs:
            c = replace(cfg, seq=seq)
            console.print(f"[bold]P = {P}[/], seq = {seq}, vocab {c.vocab:,} x {c.dim}, LSTM {c.hidden}, {where}")
            with shaped(P, spec) as ns, bench_servers(P, ns) as addrs:
                res = launch(worker, nprocs=P, args=(c, addrs, progress), timeout=timeout, netns=ns)
            for r in res[0]:
                pred = predicted_bytes(c, P, r["alpha"], r["method"])
                r["net"] = net or "loopback"
                r["predicted_bytes"] = pred
                r["bytes_error"] = (
                    None
                    if pred is None
                    else (pred - r["bytes_per_step_per_machine"]) / r["bytes_per_step_per_machine"]
                )
                rows.append(r)
    title = f"hybrid training, vocab {cfg.vocab:,} x {cfg.dim}, batch {cfg.batch}, {where}"
    print_table(rows, console, title)
    checks = check_targets(rows)
    for name, ok, detail in checks:
        console.print(f"{'[green]PASS' if ok else '[red]MISS'}[/] {name}: {detail}")
    meta = {"config": config_dict(cfg), "procs": list(procs), "seqs": list(seqs), "net": net,
            "seconds": time.perf_counter() - t0, "targets": [list(x) for x in checks]}  # fmt: skip
    files = write_files(rows, meta, out)
    files.append(plot(rows, out, title))
    console.print("wrote " + ", ".join(str(f) for f in files))
    return rows


def search_hybrid_partitions(
    cfg: HybridBenchConfig, P: int, *, console: Console, max_partitions: int = 256, timeout: float = 900.0
) -> PartitionSearch:
    """Parallax §3.2 for real: iteration times of the hybrid method on loopback for sampled partition counts,
    the fit, and the chosen count."""

    def measure(parts: int) -> list[float]:
        c = replace(cfg, partitions=parts, methods=("hybrid",))
        with bench_servers(P, None) as addrs:
            res = launch(worker, nprocs=P, args=(c, addrs, False), timeout=timeout)
        times: list[float] = res[0][0]["times_s"]
        console.print(f"  partitions = {parts}: {1e3 * sum(times) / len(times):.1f} ms/step")
        return times

    console.print(f"[bold]partition search[/] (Parallax §3.2), hybrid, P = {P}, loopback")
    res = search_partitions(measure, P, max_partitions=max_partitions, servers=P)  # one server per rank
    t0, t1, t2 = res.theta
    console.print(f"  fit t(P) = {t0 * 1e3:.2f} + {t1 * 1e3:.2f}/P + {t2 * 1e3:.4f}·P ms; chosen P = {res.best}")
    return res


def print_table(rows: list[dict[str, Any]], console: Console, title: str) -> None:
    t = Table(title=title)
    for col in ("P", "seq", "α", "method", "words/s", "ms/step", "MB/step/machine", "plan MB", "plan err", "loss"):
        t.add_column(col, justify="left" if col == "method" else "right")
    for r in rows:
        pred, err = r["predicted_bytes"], r["bytes_error"]
        t.add_row(
            str(r["P"]), str(r["seq"]), f"{r['alpha']:.4f}", r["method"], f"{r['words_per_s']:,.0f}",
            f"{r['step_s'] * 1e3:.1f}", f"{r['bytes_per_step_per_machine'] / 1e6:.3f}",
            "-" if pred is None else f"{pred / 1e6:.3f}", "-" if err is None else f"{err * 100:+.1f}%",
            f"{r['loss']:.4f}",
        )  # fmt: skip
    console.print(t)


def check_targets(rows: list[dict[str, Any]]) -> list[tuple[str, bool, str]]:
    """Per (P, seq): hybrid >= 3x all-dense allreduce and >= 1.5x allgather in words/s; AR < PS < hybrid."""
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
        if "allreduce" in w and "ps" in w:
            ok = w["allreduce"] < w["ps"] < w["hybrid"]
            out.append((f"P={P} seq={seq}: AR < PS < hybrid (Parallax Table 4)", ok,
                        f"{w['allreduce']:,.0f} / {w['ps']:,.0f} / {w['hybrid']:,.0f} words/s"))  # fmt: skip
    return out


def plot(rows: list[dict[str, Any]], out: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.tight_layout()
    png = out.with_suffix(".png")
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png
