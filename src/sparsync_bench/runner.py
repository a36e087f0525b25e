"""The benchmarks' one runner. ``ranks`` sets up where P local ranks run (loopback, or each emulated host in its
own network namespace behind a shaped link with ``--net``; parameter servers colocated one per rank when a
benchmark asks), ``run_ranks`` launches a worker there and returns rank 0's rows, and ``sweep`` runs it point
after point (a world size, or a world size and a sequence length), saving the rows so far after each point, so
a failure at a later point keeps the earlier ones.

Every benchmark's run (``sparsync_bench.bench``: one module per benchmark, each with its ``Benchmark`` entry) has
that one shape, kept once in ``Run``: the links (``Run.start``), a sweep, then the tables, the target checks and
the files of ``report`` (``out.json``, ``out.csv``, figures, ``out.md``: ``Run.show`` and ``Run.finish``). The
runner knows no benchmark: each one's module hands it its worker and its report functions."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console

from sparsync.launch import RankSetup, launch
from sparsync.ps.process import ServerProcess
from sparsync.ps.server import ServerConfig
from sparsync_bench import linkcheck, report
from sparsync_bench.netem import NetNamespaces, NetSpec, describe, net_spec, parse_rate, shaped
from sparsync_bench.report import Check

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
class Run:
    """One benchmark run, from its links to its files: where it prints, its links and how a title names them,
    the ``out`` its files go to, the meta they carry and when it started. ``Run.start`` is every benchmark's
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
    ) -> Run:
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
