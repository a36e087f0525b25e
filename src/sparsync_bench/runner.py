"""The benchmarks' one runner. ``ranks`` sets up where P local ranks run (loopback, or each emulated host in its
own network namespace behind a shaped link with ``--net``; parameter servers colocated one per rank when a
benchmark asks), ``run_ranks`` launches a worker there and returns rank 0's rows, and ``sweep`` runs it point
after point (a world size, or a world size and a sequence length), saving the rows so far after each point, so
a failure at a later point keeps the earlier ones.

Every ``run_*_bench`` below has that one shape, kept once in ``_Run``: the links (``_Run.start``), a sweep, then
the tables, the target checks and the files of ``report`` (``out.json``, ``out.csv``, figures, ``out.md``:
``_Run.show`` and ``_Run.finish``). What each benchmark measures is in its worker (``allreduce``, ``compress``,
``embedding``, ``hybrid``, ``dlrm_train``); what it shows, in its report functions (``allreduce_report``,
``compress``, ``embedding_report``, ``hybrid_report``, ``dlrm_train``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from rich.console import Console

from sparsync.launch import RankSetup, launch
from sparsync.ps.process import ServerProcess
from sparsync.ps.server import ServerConfig
from sparsync_bench import linkcheck, report
from sparsync_bench.netem import NetNamespaces, NetSpec, describe, net_spec, parse_rate, shaped
from sparsync_bench.report import Check

if TYPE_CHECKING:
    from sparsync.plan.partition_search import PartitionSearch
    from sparsync_bench.allreduce import BenchConfig
    from sparsync_bench.compress import CompressBenchConfig
    from sparsync_bench.dlrm_train import DlrmBenchConfig
    from sparsync_bench.embedding import EmbeddingBenchConfig
    from sparsync_bench.hybrid import HybridBenchConfig

Rows = list[dict[str, Any]]
Point = TypeVar("Point")


@dataclass(frozen=True)
class Ranks:
    """Where a run's ranks are: the per-host set-up ``launch`` runs in each of them (None: loopback) and the
    addresses of their colocated servers (server i beside rank i; empty without servers)."""

    setup: RankSetup | None
    servers: list[str]


@contextmanager
def bench_servers(P: int, ns: NetNamespaces | None) -> Iterator[list[str]]:
    """One parameter server per rank (in rank i's namespace with ``ns``), as the benchmarks and the demo
    colocate them; yields their addresses and kills them on exit."""
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


@contextmanager
def ranks(
    nprocs: int, spec: NetSpec | None, *, procs_per_host: int | None = None, servers: bool = False
) -> Iterator[Ranks]:
    """Shaped namespaces for ``spec`` (one per host of ``procs_per_host`` ranks, default one rank per host)
    and, with ``servers``, one parameter server per rank beside it; everything is removed on exit."""
    if servers and procs_per_host is not None:
        raise ValueError("servers are colocated one per rank; procs_per_host groups ranks into hosts: not both")
    hosts = nprocs // (procs_per_host or 1)
    with shaped(hosts, spec) as ns, ExitStack() as stack:
        addrs = stack.enter_context(bench_servers(nprocs, ns)) if servers else []
        yield Ranks(None if ns is None else ns.rank_setup(), addrs)


def run_ranks(
    worker: Callable[..., Any],
    nprocs: int,
    args: tuple[Any, ...] = (),
    *,
    spec: NetSpec | None,
    timeout: float,
    procs_per_host: int | None = None,
    servers: bool = False,
) -> Any:
    """``worker(rank, *args)`` on ``nprocs`` local ranks set up by ``ranks`` (with ``servers``, the servers'
    addresses are the worker's last argument); rank 0's result."""
    with ranks(nprocs, spec, procs_per_host=procs_per_host, servers=servers) as where:
        args = (*args, where.servers) if servers else args
        res = launch(worker, nprocs=nprocs, args=args, timeout=timeout, procs_per_host=procs_per_host,
                     setup=where.setup)  # fmt: skip
    return res[0]


def links(net: str | None, latency: str | None, procs_per_host: int | None = None) -> tuple[NetSpec | None, str]:
    """The ``--net``/``--latency`` links, checked before any work starts, and how a title describes them."""
    spec = net_spec(net, latency)
    if procs_per_host is None:
        return spec, describe(spec)
    return spec, f"hosts of {procs_per_host} ranks, " + (f"{spec.rate} link per host" if spec else "loopback")


def sweep(
    points: Sequence[Point],
    run_point: Callable[[Point], Rows],
    *,
    header: Callable[[Point], str],
    out: Path,
    meta: dict[str, Any],
    console: Console,
) -> Rows:
    """``run_point`` at each point after its header line; the rows so far go to ``out.json``/``out.csv`` after
    each point (``meta["points_done"]``: the points they cover)."""
    rows: Rows = []
    for i, pt in enumerate(points):
        console.print(header(pt))
        rows += run_point(pt)
        report.write_files(rows, {**meta, "points_done": list(points[: i + 1])}, out)
    return rows


def _print_link(rows: Rows, console: Console) -> None:
    link = rows[0]["link"] if rows else {}
    console.print(
        f"  measured link: α = {link.get('alpha', 0) * 1e6:.0f} µs per exchange step, "
        f"all-to-all round {(link.get('alpha_a2a') or 0) * 1e6:.0f} µs, "
        f"1/β = {1 / max(link.get('beta', 1e-12), 1e-12) / 1e6:.0f} MB/s"
    )


def _wide(console: Console, width: int) -> Console:
    """``console``, or one as wide as ``width`` on the same file: never squeeze many numeric columns."""
    return console if console.width >= width else Console(width=width, file=console.file)


@dataclass
class _Run:
    """One benchmark run, from its links to its files: where it prints, its links and how a title names them,
    the ``out`` its files go to, the meta they carry and when it started. ``_Run.start`` is every benchmark's
    head, ``finish`` its tail (``show``: the tail of those whose report is tables, targets, a figure and
    markdown)."""

    console: Console
    spec: NetSpec | None
    where: str
    out: Path
    meta: dict[str, Any]
    t0: float = field(default_factory=time.perf_counter)

    @classmethod
    def start(
        cls,
        out: Path,
        meta: dict[str, Any],
        *,
        net: str | None,
        latency: str | None,
        console: Console | None,
        procs_per_host: int | None = None,
        width: int = 0,
        link_procs: int = 0,
    ) -> _Run:
        """The links checked (before any work starts), the console (at least ``width`` wide), the clock; on
        shaped links with ``link_procs`` ≥ 2 ranks, the link sanity check (``linkcheck``) printed and kept in
        the meta."""
        spec, where = links(net, latency, procs_per_host)
        run = cls(_wide(console or Console(), width), spec, where, out, meta)
        if spec is not None and link_procs >= 2:
            res = run_ranks(
                linkcheck.link_worker, link_procs, spec=spec, timeout=300, procs_per_host=procs_per_host
            )
            summary = linkcheck.summarize(res, parse_rate(spec.rate))
            run.console.print(linkcheck.render(summary, link_procs, spec.rate))
            meta["link_check"] = {**res, **summary}
        return run

    def sweep(
        self, points: Sequence[Point], run_point: Callable[[Point], Rows], header: Callable[[Point], str]
    ) -> Rows:
        return sweep(points, run_point, header=header, out=self.out, meta=self.meta, console=self.console)

    def linked_point(
        self, worker: Callable[..., Any], args: tuple[Any, ...], *, timeout: float, procs_per_host: int | None
    ) -> Callable[[int], Rows]:
        """A point of a sweep over world sizes that runs ``worker(rank, *args)`` and prints the link measured."""

        def point(P: int) -> Rows:
            rows: Rows = run_ranks(worker, P, args, spec=self.spec, timeout=timeout, procs_per_host=procs_per_host)
            _print_link(rows, self.console)
            return rows

        return point

    def show(
        self,
        rows: Rows,
        title: str,
        *,
        tables: Callable[[Rows, Console, str], None],
        check: Callable[[Rows], list[Check]],
        plot: Callable[[Rows, Path, str], Path],
        markdown: Callable[[Rows, list[Check], str], str],
        width: int = 0,
        show_targets: bool = True,
    ) -> Rows:
        """The tables (on a console at least ``width`` wide), the target checks, then ``finish`` with the
        figure and the markdown."""
        tables(rows, _wide(self.console, width), title)
        checks = check(rows)
        if show_targets:
            report.print_targets(checks, self.console)
        return self.finish(rows, checks, pngs=[plot(rows, self.out, title)], md=markdown(rows, checks, title))

    def finish(
        self,
        rows: Rows,
        checks: list[Check] | None,
        *,
        pngs: Sequence[Path] = (),
        md: str | None = None,
        **more: Any,
    ) -> Rows:
        """The meta completed (the seconds taken, the target checks, ``more``) and the files written."""
        self.meta.update(seconds=time.perf_counter() - self.t0)
        if checks is not None:
            self.meta.update(targets=[list(c) for c in checks])
        self.meta.update(more)
        report.write_report(rows, self.meta, self.out, self.console, pngs=pngs, md=md)
        return rows


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
    from sparsync_bench import allreduce_report as ar
    from sparsync_bench.allreduce import worker

    meta: dict[str, Any] = {"config": {**cfg.__dict__}, "procs": list(procs), "net": net, "latency": latency,
                            "procs_per_host": procs_per_host}  # fmt: skip
    run = _Run.start(out, meta, net=net, latency=latency, console=console, procs_per_host=procs_per_host,
                     link_procs=max(procs))  # fmt: skip
    rows = run.sweep(
        procs,
        run.linked_point(worker, (cfg, progress), timeout=timeout, procs_per_host=procs_per_host),
        lambda P: f"[bold]P = {P}[/], N = {cfg.dim:,} float32, {run.where}, {cfg.repeats} repeats",
    )
    title = f"sparse allreduce, N={cfg.dim:,}, {run.where}"
    return run.show(rows, title, tables=ar.print_table, check=ar.check_targets, plot=ar.plot, markdown=ar.markdown,
                    show_targets=show_targets)  # fmt: skip


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
    from sparsync_bench import compress as cb

    meta: dict[str, Any] = {"config": {**cfg.__dict__}, "procs": procs, "net": net, "latency": latency}
    run = _Run.start(out, meta, net=net, latency=latency, console=console, link_procs=procs)
    sizes = ", ".join(f"{n:,}" for n in cfg.sizes)
    rows = run.sweep(
        (procs,),
        lambda P: run_ranks(cb.worker, P, (cfg, progress), spec=run.spec, timeout=timeout),
        lambda P: f"[bold]P = {P}[/], N = {sizes} float32, {run.where}",
    )
    title = f"compressors, P={procs}, {run.where}"
    return run.show(  # ten numeric columns: at least 165 wide
        rows, title, tables=cb.print_table, check=cb.check_targets, plot=cb.plot, markdown=cb.markdown, width=165
    )


def run_embedding_bench(
    cfg: EmbeddingBenchConfig,
    procs: tuple[int, ...],
    *,
    out: Path,
    net: str | None = None,
    latency: str | None = None,
    console: Console | None = None,
    progress: bool = True,
    timeout: float = 1800.0,
    procs_per_host: int | None = None,
) -> Rows:
    """``sparsync bench embedding`` at each world size in ``procs`` (hosts of ``procs_per_host`` ranks sharing
    one namespace and link); print, save, plot. Returns the rows."""
    from sparsync_bench import embedding_report as er
    from sparsync_bench.embedding import worker

    meta: dict[str, Any] = {"config": {**cfg.__dict__}, "procs": list(procs), "net": net, "latency": latency,
                            "procs_per_host": procs_per_host}  # fmt: skip
    run = _Run.start(out, meta, net=net, latency=latency, console=console, procs_per_host=procs_per_host,
                     link_procs=max(procs))  # fmt: skip

    def header(P: int) -> str:
        return (f"[bold]P = {P}[/], embedding {cfg.rows:,} rows x {', '.join(map(str, cfg.dims))} fp32, "
                f"{cfg.tokens:,} Zipf tokens per rank, {run.where}, {cfg.repeats} repeats")  # fmt: skip

    rows = run.sweep(
        procs, run.linked_point(worker, (cfg, progress), timeout=timeout, procs_per_host=procs_per_host), header
    )
    title = f"embedding gradients, {cfg.rows:,} rows, {cfg.tokens:,} tokens/rank, {run.where}"
    check = partial(er.check_targets, loopback=run.spec is None)
    return run.show(
        rows, title, tables=er.print_tables, check=check, plot=er.plot, markdown=er.markdown, width=170
    )


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
    from sparsync_bench import hybrid_report as hr
    from sparsync_bench.hybrid import config_dict, worker

    meta: dict[str, Any] = {"config": config_dict(cfg), "procs": list(procs), "seqs": list(seqs), "net": net}
    run = _Run.start(out, meta, net=net, latency=latency, console=console, width=130, link_procs=max(procs))
    console = run.console

    def point(at: tuple[int, int]) -> Rows:
        P, seq = at
        c = replace(cfg, seq=seq)
        rows: Rows = run_ranks(worker, P, (c, progress), spec=run.spec, timeout=timeout, servers=True)
        hr.add_predictions(rows, c, P, net)
        return rows

    def header(at: tuple[int, int]) -> str:
        return (
            f"[bold]P = {at[0]}[/], seq = {at[1]}, vocab {cfg.vocab:,} x {cfg.dim}, LSTM {cfg.hidden}, {run.where}"
        )

    rows = run.sweep([(P, seq) for P in procs for seq in seqs], point, header)
    title = f"hybrid training, vocab {cfg.vocab:,} x {cfg.dim}, batch {cfg.batch}, {run.where}"
    hr.print_table(rows, console, title)
    for line in hr.compare_lines(rows):
        console.print(line)
    checks = hr.check_targets(rows)
    report.print_targets(checks, console)
    errors = hr.plan_time_errors(rows)
    for m, e in errors.items():
        console.print(f"plan's communication time vs measured, {m}: mean |error| {100 * e:.1f}%")
    pngs = [hr.plot(rows, out, title), *([hr.plot_plan_time(rows, out, title)] if errors else [])]
    return run.finish(rows, checks, pngs=pngs, speedup_vs_baselines=hr.relative_speed(rows),
                      plan_time_mean_abs_error=errors)  # fmt: skip


def search_hybrid_partitions(
    cfg: HybridBenchConfig, P: int, *, console: Console, max_partitions: int = 256, timeout: float = 900.0
) -> PartitionSearch:
    """Parallax §3.2 for real: iteration times of the hybrid method on loopback for sampled partition counts,
    the fit, and the chosen count."""
    from sparsync.plan.partition_search import search_partitions
    from sparsync_bench.hybrid import worker

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


def run_dlrm_bench(
    cfg: DlrmBenchConfig,
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
    from sparsync_bench import dlrm_train as dt

    meta: dict[str, Any] = {"config": dt.config_dict(cfg), "procs": list(procs), "net": net}
    run = _Run.start(out, meta, net=net, latency=latency, console=console, link_procs=max(procs))
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
