"""``sparsync bench allreduce``: SparCML Fig. 4 on this machine (time vs density, per P, per algorithm).

Each point: every rank draws k = density·N uniformly random indices with random values (SparCML §6,
"Micro-Benchmarks"), then each method runs ``repeats`` times after one warm-up (at least ``fast_repeats`` times
when a call takes under FAST_S), methods interleaved round by round. A repeat's time is the slowest
rank's (a collective is done when its last rank is), taken with an allreduce(MAX) outside the timed region.
A repeat of a call that takes under FAST_S is a batch of back-to-back calls, timed together and divided by
their number, as the OSU micro-benchmarks time a loop of iterations: on a host with few cores a single
sub-millisecond call is dominated by when each rank's threads get woken (the barrier before it included), see
``_batch``.
Methods: torch gloo dense allreduce, torch gloo sparse COO allreduce, and every sparsync algorithm plus auto
(sparsync's "allgather" is the Horovod/DDP way: gather everything, sum locally).
"""

from __future__ import annotations

import math
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from sparsync import costmodel
from sparsync.collectives.allreduce import sparse_allreduce
from sparsync.collectives.calibrate import measure_link
from sparsync.collectives.hierarchical import (
    Topology,
    detect_topology,
    hierarchical_allreduce,
    measured_levels,
    predict_levels,
)
from sparsync.collectives.meta import EAGER_LIMIT
from sparsync.compress import QSGD
from sparsync.costmodel import LinkModel, Problem, lower_bound, predict
from sparsync.record import CommLog, workload_bytes
from sparsync.stream import SparseStream, index_dtype_for
from sparsync_bench.report import progress


def default_methods() -> tuple[str, ...]:
    """The default methods: gloo's dense and sparse COO allreduce, every registered SparCML algorithm
    (``costmodel.ALGORITHMS`` as it is now), and ``auto``."""
    return ("gloo_dense", "gloo_sparse_coo", *costmodel.ALGORITHMS, "auto")


def __getattr__(name: str) -> tuple[str, ...]:
    """``METHODS``: ``default_methods()`` when read, as ``costmodel.ALGORITHMS`` is (an algorithm registered
    after this module is imported is one of them)."""
    if name == "METHODS":
        return default_methods()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# DSAR with its dense phase quantized by QSGD at 4 or 8 bits (compress/dsar_quantized.py): lossy, so
# only when asked for (``--methods``), and never auto's choice.
QUANTIZED = {"dsar_split_allgather/q4": 4, "dsar_split_allgather/q8": 8}
# Hosts of several ranks (``--hosts``/``--procs-per-host``): ``hierarchical`` always runs the three
# stages of collectives/hierarchical.py (auto inside each level), ``auto_2level`` chooses flat or hierarchical
# per call from the two-level model. Without hosts they equal a flat auto.
HIERARCHICAL = {"hierarchical": "hierarchical", "auto_2level": "auto"}
BASELINES = ("gloo_dense", "gloo_sparse_coo", "allgather")
# torch's gloo sparse allreduce gathers every rank's COO tensor (int64 indices + values) on every rank and then
# sorts and coalesces it: skip points where that gathered tensor would take more than COO_MEMORY_CAP bytes per
# rank, or where COO_PEAK_FACTOR times it on all P local ranks would exceed COO_MACHINE_SHARE of this machine's
# memory (P = 8 at density 0.3 was killed by the kernel's OOM killer on a 24 GB machine: 8 x 0.48 GB gathered).
COO_MEMORY_CAP = 1 << 30
COO_PEAK_FACTOR = 4
COO_MACHINE_SHARE = 0.5


def coo_too_big(nnz_all: list[int], memory_bytes: int) -> bool:
    """Whether gloo's sparse COO allreduce of these per-rank nnz is skipped (see COO_MEMORY_CAP)."""
    gathered = sum(nnz_all) * (8 + 4)
    machine_peak = len(nnz_all) * COO_PEAK_FACTOR * gathered
    return gathered > COO_MEMORY_CAP or machine_peak > COO_MACHINE_SHARE * memory_bytes


FAST_S = 0.05  # methods faster than this per call ...
MAX_BATCH = 64  # ... get BenchConfig.fast_repeats timed runs, each a batch of at most this many calls


@dataclass(frozen=True)
class BenchConfig:
    dim: int = 16 * 2**20  # N, float32 entries
    densities: tuple[float, ...] = (1e-5, 1e-4, 1e-3, 1e-2, 0.1, 0.3, 1.0)
    repeats: int = 5  # timed runs per point, after one warm-up
    # Timed runs of a method faster than FAST_S per call, each a batch lasting about batch_s (see _batch).
    # 101: with 21, the medians of two methods running the same code differed by up to 1.26x on 1 Gbit links.
    fast_repeats: int = 101
    batch_s: float = 0.02
    methods: tuple[str, ...] = field(default_factory=default_methods)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dim < 1:
            raise ValueError(f"dim must be >= 1, got {self.dim}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.fast_repeats < 1 or not self.batch_s >= 0:
            raise ValueError(
                f"fast_repeats must be >= 1 and batch_s >= 0, got fast_repeats={self.fast_repeats}, "
                f"batch_s={self.batch_s}"
            )
        bad = [d for d in self.densities if not 0.0 <= d <= 1.0]
        if bad:
            raise ValueError(f"densities must lie in [0, 1], got {bad}")
        valid = [*default_methods(), *QUANTIZED, *HIERARCHICAL]
        unknown = [m for m in self.methods if m not in valid]
        if unknown:
            raise ValueError(f"unknown methods {unknown}; valid: {', '.join(valid)}")


@dataclass
class Row:
    world_size: int
    density: float
    method: str
    median_s: float
    p25_s: float
    p75_s: float
    times_s: list[float]
    bytes_sent_per_rank: float  # mean over ranks
    predicted_s: float | None  # α-β(-γ) model; for auto: the prediction of the algorithm it chose
    lower_bound_s: float  # SparCML Lemma 4.1 / Thm 4.2 with the measured α, β
    chosen: str = ""  # for auto: the algorithm(s) it picked
    note: str = ""
    link: dict[str, float] = field(default_factory=dict)
    calls_per_repeat: int = 1  # each of times_s is the mean of this many back-to-back calls (see _batch)
    levels: dict[str, dict[str, Any]] | None = None  # two-level methods: the world, intra, inter links priced


def _make_stream(rank: int, cfg: BenchConfig, density: float, point: int) -> SparseStream:
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + point * 101 + rank)
    k = round(density * cfg.dim)
    if k >= cfg.dim:
        return SparseStream.from_dense(torch.rand(cfg.dim, generator=g) + 0.5)
    idx = torch.randperm(cfg.dim, generator=g)[:k].sort().values.to(index_dtype_for(cfg.dim))
    return SparseStream(idx, torch.rand(k, generator=g) + 0.5, cfg.dim, validate=False)


def _runner(
    method: str,
    stream: SparseStream,
    log: CommLog,
    link: LinkModel,
    group: dist.ProcessGroup,
    topo: Topology | None = None,
) -> Callable[[], object]:
    if method == "gloo_dense":
        dense = stream.to_dense()
        return lambda: dist.all_reduce(dense.clone(), group=group)
    if method == "gloo_sparse_coo":
        idx = stream.indices if stream.indices is not None else torch.arange(stream.dim)
        coo = torch.sparse_coo_tensor(
            idx.to(torch.int64)[None], stream.values, (stream.dim,), check_invariants=False
        ).coalesce()
        return lambda: dist.all_reduce(coo, group=group)
    if topo is not None:
        return lambda: hierarchical_allreduce(stream, topo, mode=HIERARCHICAL[method], log=log)
    if method in QUANTIZED:
        q = QSGD(bits=QUANTIZED[method])  # one per method and rank: its noise advances call by call
        alg = method.partition("/")[0]
        return lambda: sparse_allreduce(stream, algorithm=alg, log=log, group=group, quantize=q)
    # auto gets the link measured at the start of the run, so its choices and the table's predictions agree.
    return lambda: sparse_allreduce(stream, algorithm=method, log=log, link=link, group=group)


def _bytes(method: str, stream: SparseStream, P: int, log: CommLog, nnz_all: list[int]) -> float:
    if method == "gloo_dense":  # gloo ring allreduce
        return 2 * (P - 1) / P * stream.dim * stream.values.element_size()
    if method == "gloo_sparse_coo":  # gloo allgathers int64 indices + values of every rank (ring: forwards)
        return float(sum(nnz_all) - stream.nnz) * (8 + stream.values.element_size())
    return float(statistics.mean(workload_bytes(r) for r in log.records)) if log.records else 0.0


def worker(rank: int, cfg: BenchConfig, show_progress: bool) -> list[dict[str, Any]]:
    """Runs on every rank; rank 0 returns the rows."""
    P = dist.get_world_size()
    link = measure_link()
    # One group per method, as each would be in its own training job: a group carries state from call to
    # call (the metadata round's eager region, sparsync.collectives.meta), which must not leak between methods.
    groups = {m: dist.new_group(backend="gloo") for m in cfg.methods}
    # The hierarchical methods get subgroups of their own, for the same reason.
    topos = {m: detect_topology(group=groups[m]) for m in cfg.methods if m in HIERARCHICAL}
    rows: list[dict[str, Any]] = []
    with progress(show_progress and rank == 0, f"P={P} N={cfg.dim}", len(cfg.densities)) as update:
        for point, density in enumerate(cfg.densities):
            rows.extend(_measure_point(rank, P, cfg, density, point, link, groups, topos))
            update(None, 1)
    return rows if rank == 0 else []


def _timed(run: Callable[[], object], batch: int = 1) -> float:
    """Time per call of ``batch`` back-to-back runs, on the slowest rank (the reduction of the time is
    outside the timed region)."""
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(batch):
        run()
    t = torch.tensor([(time.perf_counter() - t0) / batch], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _batch(first_s: float, batch_s: float) -> int:
    """Calls per timed repeat, from the warm-up call's time (the same on every rank: it is max-reduced).

    Why batch: a sub-millisecond collective here costs anything from 0.05 to 4 ms depending on whether the
    peer's threads were awake (measured: 60 gloo allreduces of 8 floats, 20-50% of them 4 ms; system time,
    not user time, makes the difference). One call after a barrier also pays the ranks' skew in leaving the
    barrier. A batch's mean counts those costs at the rate they really occur instead of letting one draw
    decide a sample, and amortises the barrier's skew over the batch.
    """
    if first_s > FAST_S:
        return 1
    return max(1, min(MAX_BATCH, round(batch_s / max(first_s, 1e-6))))


def _problem(rank: int, P: int, cfg: BenchConfig, stream: SparseStream) -> tuple[list[int], Problem]:
    """Every rank's nnz (collective) and the cost model's problem of this point."""
    nnz_t = torch.zeros(P, dtype=torch.int64)
    nnz_t[rank] = stream.nnz
    dist.all_reduce(nnz_t)
    nnz_all = [int(x) for x in nnz_t]
    problem = Problem(P, cfg.dim, tuple(nnz_all), 4, index_dtype_for(cfg.dim).itemsize, eager_limit=EAGER_LIMIT)
    return nnz_all, problem


def _methods_that_fit(cfg: BenchConfig, nnz_all: list[int]) -> list[str]:
    """``cfg.methods`` less gloo's sparse COO allreduce where it would not fit (``coo_too_big``, on the
    smallest memory over the ranks: the same decision on every rank; collective)."""
    memory = torch.tensor([os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")], dtype=torch.float64)
    dist.all_reduce(memory, op=dist.ReduceOp.MIN)
    skip_coo = coo_too_big(nnz_all, int(memory))
    return [m for m in cfg.methods if not (m == "gloo_sparse_coo" and skip_coo)]


def _interleaved(
    runs: dict[str, Callable[[], object]], logs: dict[str, CommLog], cfg: BenchConfig, point: int
) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Each method's timed repeats and its calls per repeat: one warm-up call each (its records cleared from
    ``logs``), then rounds that run every method once in a fresh order."""
    methods = list(runs)
    first = {m: _timed(runs[m]) for m in methods}
    rounds = {m: cfg.repeats if first[m] > FAST_S else max(cfg.repeats, cfg.fast_repeats) for m in methods}
    batch = {m: _batch(first[m], cfg.batch_s) for m in methods}
    for log in logs.values():
        log.clear()
    times: dict[str, list[float]] = {m: [] for m in methods}
    order = random.Random(cfg.seed * 7919 + point)  # same seed on every rank: same order everywhere
    for r in range(max(rounds.values())):
        # A fresh order each round: the call right after a heavy one runs slower (freed buffers, drained
        # token buckets), and that penalty must not always land on the same method.
        for m in order.sample(methods, len(methods)):
            if r < rounds[m]:
                times[m].append(_timed(runs[m], batch[m]))
    return times, batch


def _prediction(
    method: str, problem: Problem, link: LinkModel, log: CommLog, topos: dict[str, Topology]
) -> tuple[float | None, str, dict[str, dict[str, Any]] | None]:
    """(the model's time for ``method``'s calls, the algorithms auto or a two-level method chose, the two-level
    methods' links priced); (None, "", None) for a method the model does not price."""
    if method in costmodel.ALGORITHMS:
        return predict(method, problem, link), "", None
    picks = sorted({rec.algorithm for rec in log.records})
    if method in HIERARCHICAL:
        topo = topos[method]
        levels = predict_levels(problem, topo)
        level_json = dict(zip(("world", "intra", "inter"), map(asdict, measured_levels(topo)), strict=True))
        # A flat call records the flat algorithm it ran.
        pred = statistics.mean(levels["hierarchical" if a == "hierarchical" else "flat"] for a in picks)
        return pred, "/".join(picks), level_json
    if method == "auto":
        return statistics.mean(predict(a, problem, link) for a in picks), "/".join(picks), None
    return None, "", None


def _measure_point(
    rank: int,
    P: int,
    cfg: BenchConfig,
    density: float,
    point: int,
    link: LinkModel,
    groups: dict[str, dist.ProcessGroup],
    topos: dict[str, Topology],
) -> list[dict[str, Any]]:
    """All methods at one density, interleaved: round r runs every method once, so drift in the machine's
    state hits all methods alike. Methods faster than FAST_S get more rounds: at a few ms per call, the noise
    of thread wake-ups on a loaded host is of the same order as the differences being measured."""
    stream = _make_stream(rank, cfg, density, point)
    nnz_all, problem = _problem(rank, P, cfg, stream)
    lb = lower_bound(problem, link)
    methods = _methods_that_fit(cfg, nnz_all)
    logs = {m: CommLog() for m in methods}
    runs = {m: _runner(m, stream, logs[m], link, groups[m], topos.get(m)) for m in methods}
    times, batch = _interleaved(runs, logs, cfg, point)
    rows = []
    for m in cfg.methods:
        if m not in methods:
            skipped = "skipped: gathered COO would exceed the memory cap (COO_MEMORY_CAP)"
            rows.append(asdict(Row(P, density, m, math.nan, math.nan, math.nan, [], 0.0, None, lb, note=skipped)))
            continue
        ts = times[m]
        qs = statistics.quantiles(ts, n=4) if len(ts) > 1 else [ts[0]] * 3
        pred, chosen, level_json = _prediction(m, problem, link, logs[m], topos)
        nbytes = _bytes(m, stream, P, logs[m], nnz_all)
        row = Row(P, density, m, statistics.median(ts), qs[0], qs[2], ts, nbytes, pred, lb, chosen,
                  link=asdict(link), calls_per_repeat=batch[m], levels=level_json)  # fmt: skip
        rows.append(asdict(row))
    return rows
