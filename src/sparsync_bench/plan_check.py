"""The planner's step against the step measured on emulated links: ``python -m sparsync_bench.plan_check``.

For P ranks on links of one rate and one-way delay (``netem``: one network namespace per rank, tc tbf and netem;
or loopback), each part of a DLRM-like step is timed as the trainer sends it and priced by the planner
(``sparsync.plan``) for the same sizes:

- dense: the Kaggle MLPs' gradients in ``DistributedOptimizer``'s buckets (``plan.step.bucket_layout``), one
  ``dist.all_reduce`` per bucket (gloo's ring);
- sparse: the tables' row-sparse gradients replicated, in one ``grouped_allreduce`` (the algorithm the planner
  prices, forced, so both sides price one algorithm);
- sharded: the tables sharded (``sparsync.shard``): a forward and a backward, its exchange's three all-to-all
  rounds (ids, rows; gradient rows) and the CPU between them.

Each rank looks up ``batch`` uniform ids per table; the planner is given the distinct rows they touch.
Measured: the median over ``repeats`` of the slowest rank's time of a call after a barrier (dense, sparse);
for the sharded tables, of the slowest rank's forward plus the slowest rank's backward (a barrier before
each): what the step pays for them, the exchange's CPU included. ``sharded_rounds`` keeps the rounds alone
(each round's time on the slowest rank, from its own scope, summed).

The planner prices the link three ways (``PREDICTIONS``: ``Setting.derived_link``, the same with γ off, and
``sparsync.measure_link``'s link measured in the same run) and the exchange's CPU with an ``ExchangeCPU``
fitted before the grid (``fit_exchange_cpu``: the exchange's process CPU time on loopback at P = 2, where no
link or shared core stretches it). On the check's host the P ranks share C cores: where P > C the ranks' CPU
runs P/C times slower in wall time, so the check prices the exchange's CPU times ``cpu_factor`` = max(1, P/C),
a property of the host the check runs on, not of a cluster's plan (one rank a machine there).
"""

from __future__ import annotations

import argparse
import math
import os
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import sparsync
from sparsync.collectives.calibrate import measure_link
from sparsync.collectives.grouped import grouped_allreduce
from sparsync.costmodel import LinkModel
from sparsync.launch import launch
from sparsync.plan import Cluster, ExchangeCPU, ParamStats, make_plan
from sparsync.plan.step import bucket_layout
from sparsync.record import CommLog
from sparsync_bench.criteo import table_rows
from sparsync_bench.dlrm import mlp_shapes
from sparsync_bench.netem import NetNamespaces, NetSpec, parse_latency, parse_rate
from sparsync_bench.report import write_json_md

PARTS = ("dense", "sparse", "sharded")
# the planner's predictions: its link as derived (α measured, β the rate, γ this host's), the same with γ off,
# and ``measure_link``'s link
PREDICTIONS = ("predicted", "predicted_gamma_off", "predicted_measured_link")
EXCHANGE_PHASES = ("ids", "rows", "grads")  # the sharded rounds' scopes (``sharding.kernels.Link``), not pooling


@dataclass(frozen=True)
class Setting:
    """One measured point."""

    world: int  # P ranks
    rate: str | None = None  # tc rate of every link, e.g. "1gbit"; None: loopback
    delay: str | None = None  # one-way delay netem adds to each message, e.g. "1ms"
    batch: int = 512  # ids per table per rank
    max_rows: int = 100_000  # Kaggle's 26 tables' cardinalities, capped
    tables: int = 26  # the first this many of them
    dim: int = 16
    repeats: int = 5  # timed repeats after one warm-up
    seed: int = 0
    burst: int | None = None  # bytes of every link's tbf bucket; None: ``netem``'s (512 KB)

    def __post_init__(self) -> None:
        if self.world < 2:
            raise ValueError(f"world must be >= 2 (a step with no peer sends nothing), got {self.world}")
        if self.delay is not None and self.rate is None:
            raise ValueError(f"delay={self.delay!r} needs a rate (emulated links)")
        if self.rate is not None:
            NetSpec(self.rate, self.delay)
        if self.burst is not None and self.burst < 2048:
            raise ValueError(f"burst must be >= 2048 bytes (more than a packet), got {self.burst}")
        if not (1 <= self.tables <= 26 and self.batch >= 1 and self.repeats >= 1 and self.dim >= 1):
            raise ValueError(
                f"want 1 <= tables <= 26, batch, repeats, dim >= 1; got {self.tables}, {self.batch}, "
                f"{self.repeats}, {self.dim}"
            )

    @property
    def rows(self) -> list[int]:
        return table_rows(self.max_rows)[: self.tables]

    def derived_link(self, step: float, host: LinkModel | None = None) -> LinkModel:
        """α = ``step`` (a ring step's time, measured: ``ring_step``) plus the added one-way delay, β = 1/rate
        (loopback: 10 GB/s); the γ terms (a rank's CPU per element merged, added, scattered, written) those of
        ``host`` (``measure_link``'s), None: off (module doc)."""
        alpha = step + (parse_latency(self.delay) or 0.0)
        bandwidth = parse_rate(self.rate) / 8 if self.rate is not None else 10e9
        off = LinkModel(alpha=alpha, beta=1 / bandwidth, gamma_sparse=0, gamma_dense=0, gamma_scatter=0)
        if host is None:
            return off
        return replace(off, gamma_sparse=host.gamma_sparse, gamma_dense=host.gamma_dense,
                       gamma_scatter=host.gamma_scatter, gamma_fresh=host.gamma_fresh)  # fmt: skip


def ids_of(setting: Setting, rank: int, table: int) -> torch.Tensor:
    """The ids rank ``rank`` looks up in table ``table``: ``batch`` uniform draws, the same every run."""
    g = torch.Generator().manual_seed(setting.seed * 1_000_003 + rank * 1009 + table)
    return torch.randint(0, setting.rows[table], (setting.batch,), generator=g)


def mlp_stats(setting: Setting) -> list[ParamStats]:
    return [ParamStats(n, s, 1.0, False) for n, s in mlp_shapes(len(setting.rows), setting.dim)]


def table_stats(setting: Setting, distinct: Sequence[float]) -> list[ParamStats]:
    """The tables as the planner sees them: ``distinct`` rows a rank touches per table (the mean over ranks)."""
    return [ParamStats(f"tables.{j}.weight", (n, setting.dim), distinct[j] / n, True, distinct[j] / n)
            for j, n in enumerate(setting.rows)]  # fmt: skip


def dense_buckets(setting: Setting) -> list[int]:
    """Elements of each of ``DistributedOptimizer``'s dense buckets of the MLPs, in launch order."""
    stats = mlp_stats(setting)
    layout = bucket_layout([(math.prod(s.shape) * 4, 4) for s in stats])
    return [sum(math.prod(stats[i].shape) for i in b) for b in layout]


def cpu_factor(world: int, cores: int | None = None) -> float:
    """max(1, P/C): how much slower in wall time each of ``world`` ranks runs its CPU work on ``cores`` cores
    (default: the cores this process may run on) than on cores of its own."""
    c = cores if cores is not None else len(os.sched_getaffinity(0))
    return max(1.0, world / c)


# --- prediction --------------------------------------------------------------------------------------------------
def predict(
    setting: Setting, link: LinkModel, distinct: Sequence[float], cpu: ExchangeCPU | None = None
) -> dict[str, Any]:
    """The planner's seconds of each part (module doc) on ``link``, the exchange's CPU priced by ``cpu`` (None:
    not priced), and the sparse call's algorithm."""
    cluster = Cluster(setting.world, 1, measured=link, exchange_cpu=cpu)
    tables = table_stats(setting, distinct)
    dense = make_plan(mlp_stats(setting), cluster).step
    out: dict[str, Any] = {"dense": sum(p.seconds for p in dense.parts),
                           "dense_buckets": [p.seconds for p in dense.parts]}  # fmt: skip
    for part, kind in (("sparse", "sparse_allreduce"), ("sharded", "sharded")):
        plan = make_plan(tables, cluster, overrides={t.name: kind for t in tables}, swap_modules=True)
        (p,) = [p for p in plan.step.parts if p.kind == kind]
        out[part] = p.seconds
        out[f"{part}_bytes"] = p.nbytes
        if part == "sparse":
            out["sparse_algorithm"] = p.algorithm
    out["sharded_cpu"] = 0.0 if cpu is None else cpu.seconds(len(tables), sum(distinct))
    return out


# --- measurement (in each rank) ----------------------------------------------------------------------------------
def _slowest(fn: Callable[[], object]) -> float:
    """Seconds of ``fn`` after a barrier, on the slowest rank."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _call(fn: Callable[[torch.Tensor], object], x: torch.Tensor) -> Callable[[], float]:
    return lambda: _slowest(lambda: fn(x))


def _median(setting: Setting, fn: Callable[[], float]) -> float:
    fn()  # warm-up: connections, buffers, the exchange's agreed capacity
    return statistics.median(fn() for _ in range(setting.repeats))


def _sparse_grads(setting: Setting, rank: int) -> list[torch.Tensor]:
    out = []
    for j, n in enumerate(setting.rows):
        rows = torch.unique(ids_of(setting, rank, j))
        values = torch.ones(rows.numel(), setting.dim)
        grad = torch.sparse_coo_tensor(rows[None], values, (n, setting.dim), check_invariants=False)
        out.append(grad.coalesce())
    return out


def _sharded(setting: Setting, rank: int, log: CommLog) -> tuple[nn.ModuleList, list[torch.Tensor]]:
    """The tables sharded (their exchange's records appended to ``log``) and this rank's ids per table."""
    torch.manual_seed(setting.seed)
    bags = nn.ModuleList(nn.EmbeddingBag(n, setting.dim, mode="sum") for n in setting.rows)
    model = sparsync.shard(bags, log=log)
    if not isinstance(model, nn.ModuleList):  # shard returns the module it was given, its tables swapped
        raise TypeError(f"sparsync.shard returned a {type(model).__name__}, not the ModuleList it was given")
    return model, [ids_of(setting, rank, j) for j in range(len(setting.rows))]


def _lookup(model: nn.ModuleList, ids: Sequence[torch.Tensor], offsets: torch.Tensor) -> torch.Tensor:
    return torch.cat([m(i, offsets) for m, i in zip(model, ids, strict=True)], dim=1)


def _exchange_seconds(setting: Setting, rank: int, log: CommLog) -> Callable[[], tuple[float, float]]:
    """One sharded forward and backward of the tables; returns (the slowest rank's forward plus the slowest
    rank's backward, the rounds' seconds) (module doc)."""
    model, ids = _sharded(setting, rank, log)
    offsets = torch.arange(setting.batch)

    def once() -> tuple[float, float]:
        start = len(log.records)
        out: list[torch.Tensor] = []
        whole = _slowest(lambda: out.append(_lookup(model, ids, offsets)))
        whole += _slowest(lambda: out[0].sum().backward())  # type: ignore[no-untyped-call]
        phases: dict[str, float] = {}
        for r in log.records[start:]:
            for name, t in r.phases.items():
                phases[name] = phases.get(name, 0.0) + t
        mine = torch.tensor([phases.get(p, 0.0) for p in EXCHANGE_PHASES], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        return whole, float(mine.sum())

    return once


# --- the exchange's CPU, fitted (module doc) ---------------------------------------------------------------------
def cpu_grid(setting: Setting) -> list[tuple[int, int]]:
    """(tables, ids per table per rank) of the exchanges the CPU fit times: the setting's tables and a third of
    them, each at a quarter, one and four times its batch (tables and distinct keys varied apart)."""
    T, B = setting.tables, setting.batch
    return [(t, b) for t in dict.fromkeys((T, max(1, T // 3))) for b in (max(1, B // 4), B, 4 * B)]


def cpu_worker(rank: int, setting: Setting, grid: Sequence[tuple[int, int]]) -> list[tuple[float, float, float]]:
    """Per (tables, batch) of ``grid``: (tables, distinct keys this rank looks up, the least over ``repeats``
    of this process's CPU seconds in a sharded forward and backward)."""
    out = []
    for tables, batch in grid:
        s = replace(setting, tables=tables, batch=batch)
        model, ids = _sharded(s, rank, CommLog())
        offsets = torch.arange(batch)
        times = []
        for _ in range(s.repeats + 1):  # the first warms up (connections, the agreed capacity)
            dist.barrier()
            t0 = time.process_time()
            _lookup(model, ids, offsets).sum().backward()  # type: ignore[no-untyped-call]
            times.append(time.process_time() - t0)
        keys = sum(float(torch.unique(i).numel()) for i in ids)
        out.append((float(tables), keys, min(times[1:])))
    return out


def fit_exchange_cpu(setting: Setting) -> tuple[ExchangeCPU, list[tuple[float, float, float]]]:
    """``ExchangeCPU`` fitted to ``cpu_worker``'s samples over ``cpu_grid`` on loopback at P = 2 (both ranks'
    samples), and the samples."""
    res = launch(cpu_worker, nprocs=2, args=(replace(setting, world=2), cpu_grid(setting)), timeout=300.0)
    samples = [(float(t), float(k), float(c)) for r in res for t, k, c in r]
    return ExchangeCPU.fit(samples), samples


def ring_step(setting: Setting) -> float:
    """Seconds per step of gloo's ring at this P: a 4-byte allreduce (2(P-1) steps), the median of 21."""
    x = torch.zeros(1)
    steps = 2 * (dist.get_world_size() - 1)
    return statistics.median(_slowest(lambda: dist.all_reduce(x)) for _ in range(21)) / steps


def check_worker(rank: int, setting: Setting) -> dict[str, Any]:
    """Measured seconds of each part and what the planner needs to price them (run by ``launch``)."""
    step = ring_step(setting)
    buckets = [torch.zeros(n) for n in dense_buckets(setting)]
    per_bucket = [_median(setting, _call(dist.all_reduce, b)) for b in buckets]
    counts = [float(torch.unique(ids_of(setting, rank, j)).numel()) for j in range(len(setting.rows))]
    distinct = torch.tensor(counts, dtype=torch.float64)
    dist.all_reduce(distinct)
    distinct /= dist.get_world_size()
    link = measure_link()
    derived = predict(setting, setting.derived_link(step, link), distinct.tolist())
    grads = _sparse_grads(setting, rank)
    alg = derived["sparse_algorithm"]
    log = CommLog()
    sparse = _median(setting, lambda: _slowest(lambda: grouped_allreduce(grads, algorithm=alg, log=log)))
    shard_log = CommLog()
    once = _exchange_seconds(setting, rank, shard_log)
    once()  # warm-up
    sharded, rounds = (statistics.median(x) for x in zip(*(once() for _ in range(setting.repeats)), strict=True))
    nbytes = torch.tensor([_bytes(log, setting.repeats + 1), _bytes(shard_log, setting.repeats + 1)])
    dist.all_reduce(nbytes)
    return {"dense": sum(per_bucket), "dense_buckets": per_bucket, "sparse": sparse, "sparse_algorithm": alg,
            "sharded": sharded, "sharded_rounds": rounds, "distinct": distinct.tolist(), "link": asdict(link),
            "ring_step": step, "bytes": {"sparse": float(nbytes[0]) / dist.get_world_size(),
                      "sharded": float(nbytes[1]) / dist.get_world_size()}}  # fmt: skip


def _bytes(log: CommLog, calls: int) -> float:
    """Bytes sent + received per call of the ``calls`` calls in ``log``."""
    return sum(r.bytes_sent + r.bytes_recv for r in log.records) / calls


# --- one point, a grid, the report -------------------------------------------------------------------------------
def run_point(setting: Setting, cpu: ExchangeCPU | None = None, prefix: str = "spp") -> dict[str, Any]:
    """Measure ``setting`` (namespaces named ``prefix`` and a random suffix, made and removed here when it has
    a rate) and price it each way (``PREDICTIONS``), the exchange's CPU by ``cpu`` times ``cpu_factor`` (None:
    not priced)."""
    if setting.rate is None:
        res = launch(check_worker, nprocs=setting.world, args=(setting,), timeout=300.0)[0]
    else:  # names "<prefix><hex>...": this checker's, apart from other runs'
        spec = NetSpec(setting.rate, setting.delay)
        with NetNamespaces(setting.world, spec, prefix=prefix + secrets.token_hex(2)) as ns:
            if setting.burst is not None:
                set_burst(ns, setting.rate, setting.burst)
            res = launch(check_worker, nprocs=setting.world, args=(setting,), setup=ns.rank_setup(),
                         timeout=300.0)[0]  # fmt: skip
    link = LinkModel(**res["link"])
    factor = cpu_factor(setting.world)
    host = None if cpu is None else cpu.scaled(factor)
    derived = predict(setting, setting.derived_link(res["ring_step"], link), res["distinct"], host)
    nominal = predict(setting, setting.derived_link(res["ring_step"]), res["distinct"], host)
    measured_link = predict(setting, link, res["distinct"], host)
    keys = (*PARTS, "sharded_rounds", "dense_buckets", "sparse_algorithm", "bytes", "ring_step", "distinct")
    measured = {p: res[p] for p in keys}
    ratio = {p: derived[p] / measured[p] for p in PARTS}
    ratio["sharded_rounds"] = (derived["sharded"] - derived["sharded_cpu"]) / measured["sharded_rounds"]
    return {"setting": asdict(setting), "measured": measured, "predicted": derived, "predicted_gamma_off": nominal,
            "predicted_measured_link": measured_link, "ratio": ratio, "link": res["link"],
            "exchange_cpu": None if cpu is None else asdict(cpu), "cpu_factor": factor}  # fmt: skip


def set_burst(ns: NetNamespaces, rate: str, burst: int) -> None:
    """Give every link of ``ns`` a ``burst``-byte token bucket, both directions (``tc qdisc change``): a bucket
    that holds a whole round lets it leave at the veth's speed after an idle gap, faster than the rate."""
    tbf = ("tbf", "rate", f"{parse_rate(rate)}bit", "burst", str(burst), "latency", "100ms")
    for i in range(ns.nprocs):
        inside = ("ip", "netns", "exec", ns.namespace(i), "tc", "qdisc", "change", "dev", ns.ifname(i), "root")
        for cmd in ((*inside, "handle", "1:", *tbf), ("tc", "qdisc", "change", "dev", ns._port(i), "root", *tbf)):
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"command failed: {' '.join(cmd)}: {done.stderr.strip()}")


def grid(worlds: Sequence[int], delays: Sequence[str | None], rate: str | None, base: Setting) -> list[Setting]:
    return [replace(base, world=w, rate=rate, delay=d) for d in delays for w in worlds]


def table(points: Sequence[dict[str, Any]]) -> str:
    """A markdown table: per point and part, measured and predicted ms and their ratio; the sharded part also
    as its rounds alone against the network price alone (the exchange's CPU left out of both)."""
    lines = ["| P | link | part | measured ms | predicted ms | ratio | γ off: ms | ratio | measure_link: ms "
             "| ratio |", "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for pt in points:
        s = pt["setting"]
        link = f"{s['rate']} + {s['delay']}" if s["rate"] else "loopback"
        factor = f" (CPU x{pt.get('cpu_factor', 1.0):.3g})" if pt.get("exchange_cpu") else ""
        for p in (*PARTS, "sharded_rounds"):
            m = pt["measured"][p]
            name = {"sparse": f"sparse ({pt['measured']['sparse_algorithm']})", "sharded": f"sharded{factor}",
                    "sharded_rounds": "sharded: rounds, network price"}.get(p, p)  # fmt: skip
            got = [pt[k]["sharded"] - pt[k]["sharded_cpu"] if p == "sharded_rounds" else pt[k][p]
                   for k in PREDICTIONS]  # fmt: skip
            cells = [f"{g * 1e3:.2f} | {g / m:.2f}" for g in got]
            lines.append(f"| {s['world']} | {link} | {name} | {m * 1e3:.2f} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m sparsync_bench.plan_check", description=__doc__.split("\n")[0])
    ap.add_argument("--world", default="2,4", help="rank counts, comma-separated")
    ap.add_argument("--net", default=None, help="tc rate of every link, e.g. 1gbit (root); none: loopback")
    ap.add_argument("--delay", default="", help="one-way delays, comma-separated, e.g. 0.1ms,1ms,5ms (with --net)")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--tables", type=int, default=26)
    ap.add_argument("--max-rows", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--burst", type=int, default=None, help="bytes of every link's tbf bucket (default: netem's)")
    ap.add_argument("--no-cpu", action="store_true", help="leave the exchange's CPU unpriced (no fit)")
    ap.add_argument("--netns-prefix", default="spp", help="the namespaces' name prefix (a random suffix follows)")
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    base = Setting(2, batch=a.batch, tables=a.tables, max_rows=a.max_rows, repeats=a.repeats, burst=a.burst)
    delays: list[str | None] = [d for d in a.delay.split(",") if d] or [None]
    cpu, samples = (None, []) if a.no_cpu else fit_exchange_cpu(base)
    print(f"exchange CPU: {cpu}", flush=True)
    points = []
    for s in grid([int(w) for w in a.world.split(",")], delays, a.net, base):
        points.append({**run_point(s, cpu, a.netns_prefix), "exchange_cpu_samples": samples})
        print("\n".join(table(points[-1:]).splitlines()[2:]), flush=True)
    text = table(points)
    print(text)
    if a.out is not None:
        write_json_md(a.out, points, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
