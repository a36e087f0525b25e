"""Benchmarks behind ``sparsync bench ...``; they reproduce the papers' figures on this machine."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from sparsync_bench.allreduce import BenchConfig, worker
from sparsync_bench.compress import CompressBenchConfig
from sparsync_bench.embedding import EmbeddingBenchConfig
from sparsync_bench.report import check_targets, markdown, plot, print_table, print_targets, write_files
from sparsync.launch import launch
from sparsync_bench.netem import NetSpec, describe, net_spec, shaped


def _per_world_size(
    procs: tuple[int, ...],
    spec: NetSpec | None,
    worker_fn: Callable[..., list[dict[str, Any]]],
    args: tuple[Any, ...],
    *,
    header: Callable[[int], str],
    out: Path,
    meta: dict[str, Any],
    console: Console,
    timeout: float,
    procs_per_host: int | None = None,
) -> list[dict[str, Any]]:
    """Launch ``worker_fn`` on P ranks (in shaped namespaces for ``spec``) for each P; rank 0's rows of every P.
    The rows so far are written after each P, so a failure at a later world size keeps the earlier ones."""
    rows: list[dict[str, Any]] = []
    for P in procs:
        console.print(header(P))
        hosts = P if procs_per_host is None else P // procs_per_host
        with shaped(hosts, spec) as ns:
            res = launch(worker_fn, nprocs=P, args=args, timeout=timeout, netns=ns, procs_per_host=procs_per_host)
        rows.extend(res[0])
        link = res[0][0]["link"] if res[0] else {}
        console.print(
            f"  measured link: α = {link.get('alpha', 0) * 1e6:.0f} µs per exchange step, "
            f"all-to-all round {(link.get('alpha_a2a') or 0) * 1e6:.0f} µs, "
            f"1/β = {1 / max(link.get('beta', 1e-12), 1e-12) / 1e6:.0f} MB/s"
        )
        write_files(rows, {**meta, "procs_done": sorted({r["world_size"] for r in rows})}, out)
    return rows


def _write_report(
    rows: list[dict[str, Any]], meta: dict[str, Any], out: Path, png: Path, md_text: str, console: Console
) -> None:
    """The final .json/.csv, the plot already written to ``png``, the .md; prints what was written."""
    files = [*write_files(rows, meta, out), png]
    md = out.with_suffix(".md")
    md.write_text(md_text)
    files.append(md)
    console.print("wrote " + ", ".join(str(f) for f in files))


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
) -> list[dict[str, Any]]:
    """Run the allreduce benchmark for each world size in ``procs``; print, save, plot. Returns the rows.
    ``procs_per_host``: ranks per emulated host (one namespace and link per host with ``net``; issue 18)."""
    console = console or Console()
    spec = net_spec(net, latency)
    t0 = time.perf_counter()
    where = describe(spec)
    if procs_per_host is not None:
        where = f"hosts of {procs_per_host} ranks, " + (f"{spec.rate} link per host" if spec else "loopback")
    rows = _per_world_size(
        procs,
        spec,
        worker,
        (cfg, progress),
        out=out,
        meta={"config": {**cfg.__dict__}},
        console=console,
        timeout=timeout,
        header=lambda P: f"[bold]P = {P}[/], N = {cfg.dim:,} float32, {where}, {cfg.repeats} repeats",
        procs_per_host=procs_per_host,
    )
    title = f"sparse allreduce, N={cfg.dim:,}, {where}"
    print_table(rows, console, title)
    checks = check_targets(rows)
    if show_targets:
        print_targets(checks, console)
    meta = {
        "config": {**cfg.__dict__},
        "procs": list(procs),
        "net": net,
        "latency": latency,
        "procs_per_host": procs_per_host,
        "seconds": time.perf_counter() - t0,
        "targets": [list(c) for c in checks],
    }
    _write_report(rows, meta, out, plot(rows, out, title), markdown(rows, checks, title), console)
    return rows


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
) -> list[dict[str, Any]]:
    """Run ``sparsync bench compress`` on ``procs`` ranks (in shaped namespaces with ``net``); print, save,
    plot. Returns the rows."""
    from sparsync_bench import compress as cb

    console = console or Console()
    spec = net_spec(net, latency)
    where = describe(spec)
    console.print(f"[bold]P = {procs}[/], N = {', '.join(f'{n:,}' for n in cfg.sizes)} float32, {where}")
    t0 = time.perf_counter()
    with shaped(procs, spec) as ns:
        res = launch(cb.worker, nprocs=procs, args=(cfg, progress), timeout=timeout, netns=ns)
    rows: list[dict[str, Any]] = res[0]
    title = f"compressors, P={procs}, {where}"
    # nine numeric columns: never squeeze them into a pipe's default 80 columns
    cb.print_table(rows, Console(width=max(console.width, 150), file=console.file), title)
    checks = cb.check_targets(rows)
    print_targets(checks, console)
    meta = {
        "config": {**cfg.__dict__},
        "procs": procs,
        "net": net,
        "latency": latency,
        "seconds": time.perf_counter() - t0,
        "targets": [list(c) for c in checks],
    }
    _write_report(rows, meta, out, cb.plot(rows, out, title), cb.markdown(rows, checks, title), console)
    return rows


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
) -> list[dict[str, Any]]:
    """Run ``sparsync bench embedding`` (issue 13, item 4) for each world size in ``procs`` (in shaped
    namespaces with ``net``; hosts of ``procs_per_host`` ranks sharing one, issue 18); print, save, plot.
    Returns the rows."""
    from sparsync_bench import embedding as eb
    from sparsync_bench import embedding_report as er

    console = console or Console()
    spec = net_spec(net, latency)
    where = describe(spec)
    if procs_per_host is not None:
        where = f"hosts of {procs_per_host} ranks, " + (f"{spec.rate} link per host" if spec else "loopback")
    t0 = time.perf_counter()
    meta: dict[str, Any] = {"config": {**cfg.__dict__}, "procs": list(procs), "net": net, "latency": latency,
                            "procs_per_host": procs_per_host}  # fmt: skip
    rows = _per_world_size(
        procs,
        spec,
        eb.worker,
        (cfg, progress),
        out=out,
        meta=meta,
        console=console,
        timeout=timeout,
        header=lambda P: (
            f"[bold]P = {P}[/], embedding {cfg.rows:,} rows x {', '.join(map(str, cfg.dims))} fp32, "
            f"{cfg.tokens:,} Zipf tokens per rank, {where}, {cfg.repeats} repeats"
        ),
        procs_per_host=procs_per_host,
    )
    title = f"embedding gradients, {cfg.rows:,} rows, {cfg.tokens:,} tokens/rank, {where}"
    er.print_tables(rows, Console(width=max(console.width, 170), file=console.file), title)
    checks = er.check_targets(rows, loopback=spec is None)
    print_targets(checks, console)
    meta.update(seconds=time.perf_counter() - t0, targets=[list(c) for c in checks])
    _write_report(rows, meta, out, er.plot(rows, out, title), er.markdown(rows, checks, title), console)
    return rows


__all__ = [
    "BenchConfig",
    "CompressBenchConfig",
    "EmbeddingBenchConfig",
    "run_allreduce_bench",
    "run_compress_bench",
    "run_embedding_bench",
]
