"""``sparsync bench embedding``: the real embedding-gradient workload.

Workload, per point (P, dim, Zipf exponent s, hot-row placement): every rank builds the same
``nn.Embedding(rows, dim, sparse=True)`` (same seed), draws ``tokens`` ids from a Zipf(s) law over the finite
vocabulary, p(i) ∝ 1/(i+1)^s (inverse CDF by ``searchsorted``; numpy's ``zipf`` is unbounded and needs s > 1),
with a rank-dependent seed; hot rows sit at the low ids ("low") or are spread by a fixed permutation of the
vocabulary, the same on every rank ("permuted"). One forward of ``emb(tokens)``, the loss ``(out * w).sum()``
with a fixed random ``w``, and ``backward()`` leave an uncoalesced sparse COO gradient: the input of every method.

Methods, each on its own process group (a group carries state from call to call, e.g. sparsync's eager
region), interleaved in a fresh order every round:

- ``torch_dense``: ``dist.all_reduce`` of ``grad.to_dense()`` (densified outside the timed region), gloo.
- ``torch_coo``: ``dist.all_reduce(grad)`` on gloo, what DDP does with a sparse gradient (on a copy made outside
  the timed region: gloo writes the sum back into its input).
- ``torch_ddp``: ``DistributedDataParallel`` around the embedding module; each repeat times forward + backward
  with DDP's reduction (``ddp_step_s``) and, in the same repeat, forward + backward under ``no_sync()``; the
  row's median is the per-repeat difference, DDP's reduction time.
- every sparsync algorithm and ``auto``: ``sparsync.allreduce(grad, algorithm=..., group=g, log=log)``; the
  ``/range`` variants of the split algorithms pass ``partition="range"``.
- ``omnireduce``: S2's baseline, an OmniReduce-style block-sparse allreduce (non-zero blocks of 256 values,
  sharded aggregation; ``omnireduce.py``).
- ``sketch``: the S2 sketch, one method ``sketch@λ`` per λ of ``sketch_lambdas`` (``embedding_sketch.py``:
  ``sparsync.compressed_allreduce`` with ``SparseSketch(ratio=λ·α)``, α the point's expected row density; its
  rows add the aggregate's error, the bitmap's match and the compress/decompress time).

A repeat's time is the slowest rank's (max-reduced outside the timed region, after a barrier); rows report the
median and quartiles over ``repeats`` after one warm-up call.

Bytes sent per rank: sparsync's from its ``CommRecord.bytes_sent`` (mean over ranks). torch's are computed
from the algorithms gloo runs (ProcessGroupGloo.cpp): the dense allreduce is a ring, 2(P-1)/P·rows·dim·4 bytes;
the sparse allreduce coalesces, then runs three ring allgathers (9 int64 of metadata, the int64 row indices,
the values), so a rank forwards P-1 of the P blocks: on average (P-1)/P·Σ_r k_r·(8 + dim·4) + (P-1)·72 bytes,
k_r the rows rank r touched. DDP runs that same sparse allreduce. Per point also: k (rows touched per rank), U
(rows in the union), the lower bound 2·k·dim·4·(P-1)/P bytes (Lemma 4.1 with k rows of dim values) and its
time log2(P)·α + bytes·β at the link measured at the start, and the rows the issue's byte target counts
against: allgather (P-1)·k rows, a balanced reduce-scatter + allgather (k + U)(P-1)/P rows.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import sparsync
from sparsync import costmodel
from sparsync.collectives.group import EAGER_BYTES
from sparsync.collectives.hierarchical import Topology, detect_topology, hierarchical_allreduce
from sparsync.collectives.meta import EAGER_LIMIT
from sparsync.collectives.tensor import coo_to_stream, stream_to_coo
from sparsync.compress import SparseSketch
from sparsync.costmodel import LinkModel, predict
from sparsync.record import CommLog
from sparsync_bench import embedding_sketch as es
from sparsync_bench.allreduce import COO_MACHINE_SHARE, HIERARCHICAL, coo_too_big
from sparsync_bench.ddp_baseline import gloo_sparse_allreduce_bytes, ring_allreduce_bytes
from sparsync_bench.omnireduce import block_allreduce
from sparsync_bench.report import progress

SPLIT_RANGE = ("ssar_split_allgather/range", "dsar_split_allgather/range")
TORCH_METHODS = ("torch_dense", "torch_coo", "torch_ddp")
OMNIREDUCE = "omnireduce"  # S2's baseline: non-zero blocks of 256 values only (omnireduce.py)
HOT = ("low", "permuted")
DENSE_COPIES = 3  # torch_dense holds the dense gradient, its per-repeat copy and gloo's buffer on every rank


def default_methods() -> tuple[str, ...]:
    """The default methods: torch's paths, every registered SparCML algorithm (``costmodel.ALGORITHMS`` as it is
    now), the split algorithms on range partitions, ``auto``, S2's sketch and the OmniReduce-style baseline."""
    return (*TORCH_METHODS, *costmodel.ALGORITHMS, *SPLIT_RANGE, "auto", es.SKETCH, OMNIREDUCE)


def __getattr__(name: str) -> tuple[str, ...]:
    """``METHODS``: ``default_methods()`` when read, as ``costmodel.ALGORITHMS`` is (an algorithm registered
    after this module is imported is one of them)."""
    if name == "METHODS":
        return default_methods()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class EmbeddingBenchConfig:
    rows: int = 2**20  # vocabulary (embedding rows)
    dims: tuple[int, ...] = (16, 64, 128)  # embedding widths, fp32
    tokens: int = 8192  # token ids per rank per step
    zipf: tuple[float, ...] = (0.9, 1.1, 1.3)  # exponents s of p(i) ∝ 1/(i+1)^s
    hot: tuple[str, ...] = HOT  # "low": hot rows at low ids; "permuted": spread by a fixed permutation
    repeats: int = 11  # timed repeats per point, after one warm-up
    methods: tuple[str, ...] = field(default_factory=default_methods)
    sketch_lambdas: tuple[float, ...] = (1.0,)  # S2's λ for "sketch": one method sketch@λ per value
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rows < 1 or self.tokens < 1 or not self.dims or min(self.dims) < 1:
            raise ValueError(f"rows, tokens and dims must be >= 1, got {self.rows}, {self.tokens}, {self.dims}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if not self.zipf or min(self.zipf) < 0:
            raise ValueError(f"zipf exponents must be >= 0, got {self.zipf}")
        valid_methods = (*default_methods(), *HIERARCHICAL)
        for name, given, valid in (("hot", self.hot, HOT), ("methods", self.methods, valid_methods)):
            bad = [x for x in given if x not in valid]
            if bad or not given:
                raise ValueError(f"unknown {name} {bad or given}; valid: {', '.join(valid)}")
        if not self.sketch_lambdas or min(self.sketch_lambdas) <= 0:
            raise ValueError(f"sketch lambdas must be > 0 (S2's λ = m/(α·d)), got {self.sketch_lambdas}")

    @property
    def method_names(self) -> tuple[str, ...]:
        """The methods as they run and are reported: ``sketch`` becomes ``sketch@λ`` for each λ."""
        return es.expand(self.methods, self.sketch_lambdas)


@functools.lru_cache(maxsize=4)
def _zipf_cdf(rows: int, s: float) -> npt.NDArray[np.float64]:
    return np.cumsum(1.0 / np.arange(1, rows + 1, dtype=np.float64) ** s)


@functools.lru_cache(maxsize=2)
def _permutation(rows: int, seed: int) -> npt.NDArray[np.int64]:
    return np.random.default_rng([seed, 0x5EED]).permutation(rows).astype(np.int64)


def zipf_tokens(rows: int, s: float, n: int, hot: str, *, seed: int, rank: int) -> npt.NDArray[np.int64]:
    """``n`` ids in [0, rows) with p(i) ∝ 1/(i+1)^s, drawn with seed (seed, rank); ``hot="permuted"`` maps them
    through a permutation that depends on ``seed`` only, so every rank shares its hot rows."""
    if hot not in HOT:
        raise ValueError(f"unknown hot {hot!r}; valid: {', '.join(HOT)}")
    cdf = _zipf_cdf(rows, s)
    u = np.random.default_rng([seed, rank]).random(n) * cdf[-1]
    ids: npt.NDArray[np.int64] = np.minimum(np.searchsorted(cdf, u, side="right"), rows - 1).astype(np.int64)
    if hot == "permuted":
        ids = _permutation(rows, seed)[ids]
    return ids


class EmbeddingLoss(nn.Module):
    """``(emb(tokens) * w).sum()``: its gradient is ``w``'s rows scattered to the tokens' rows."""

    def __init__(self, rows: int, dim: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(rows, dim, sparse=True)

    def forward(self, tokens: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = (self.emb(tokens) * w).sum()
        return loss


@dataclass
class Row:
    world_size: int
    rows: int
    dim: int
    tokens: int
    zipf: float
    hot: str
    method: str
    median_s: float  # torch_ddp: DDP's reduction (step - step under no_sync), per repeat
    p25_s: float
    p75_s: float
    times_s: list[float]
    bytes_sent_per_rank: float  # mean over ranks
    k_mean: float  # rows touched per rank
    k_max: int
    union: int  # U: rows in the union over ranks
    bound_bytes: float  # 2·k_mean·dim·4·(P-1)/P
    bound_s: float  # log2(P)·α + bound_bytes·β, measured α, β
    allgather_bytes: float  # (P-1)·k_mean rows of dim values + one index
    rsag_bytes: float  # balanced reduce-scatter + allgather: (k_mean + U)(P-1)/P rows
    predicted_s: float | None = None  # auto's decision: this algorithm's prediction (auto: its choice's)
    chosen: str = ""  # auto: the algorithm(s) it ran
    partition: str = ""  # split algorithms: the partition asked for (or recorded by the call)
    partition_bytes: list[int] = field(default_factory=list)  # bytes delivered to each owner, summed over ranks
    partition_imbalance: float | None = None  # max/mean of partition_bytes
    ddp_step_s: float | None = None  # torch_ddp: median forward + backward with DDP's reduction
    vs_coo: float | None = None  # median / torch_coo's median
    # sketch@λ (embedding_sketch.py): λ, the expected row density α (ratio = λ·α), table cells r·c, the
    # aggregate's ‖est - exact‖/‖exact‖, the bitmap's Jaccard match with the union (1: exact), and the median
    # compress and decompress seconds per call (slowest rank)
    sketch_lambda: float | None = None
    sketch_alpha: float | None = None
    sketch_cells: int | None = None
    sketch_rel_error: float | None = None
    sketch_bitmap_match: float | None = None
    sketch_compress_s: float | None = None
    sketch_decompress_s: float | None = None
    note: str = ""
    link: dict[str, Any] = field(default_factory=dict)


@dataclass
class Workload:
    """One rank's batch at one point, and the module (DDP-wrapped when torch_ddp runs) that makes gradients."""

    model: EmbeddingLoss
    ddp: DistributedDataParallel | None
    tokens: torch.Tensor
    w: torch.Tensor

    def backward(self, *, sync: bool) -> None:
        """Forward + backward from a cleared gradient; through DDP when it exists (``sync``: with its
        reduction; otherwise under ``no_sync``, which leaves the hooks installed but idle)."""
        self.model.emb.weight.grad = None
        if self.ddp is None:
            self.model(self.tokens, self.w).backward()
            return
        with contextlib.nullcontext() if sync else self.ddp.no_sync():
            self.ddp(self.tokens, self.w).backward()

    def gradient(self) -> torch.Tensor:
        """This rank's local, uncoalesced sparse gradient (the input of every method)."""
        self.backward(sync=False)
        grad = self.model.emb.weight.grad
        self.model.emb.weight.grad = None
        if grad is None or not grad.is_sparse:
            raise RuntimeError("nn.Embedding(sparse=True) gave no sparse gradient")
        return grad


# A runner does one repeat and returns (seconds, seconds of the same repeat's reference step or None).
Runner = Callable[[], tuple[float, float | None]]


def _timed(run: Callable[[], object]) -> float:
    """Seconds of ``run`` on the slowest rank (the max-reduction is outside the timed region)."""
    dist.barrier()
    t0 = time.perf_counter()
    run()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _runner(method: str, work: Workload, grad: torch.Tensor, group: dist.ProcessGroup, ctx: _Context) -> Runner:
    if method == "torch_ddp":

        def ddp_run() -> tuple[float, float | None]:
            local = _timed(lambda: work.backward(sync=False))
            return _timed(lambda: work.backward(sync=True)), local

        return ddp_run
    if method in ("torch_dense", "torch_coo"):
        src = grad.to_dense() if method == "torch_dense" else grad

        def torch_run() -> tuple[float, float | None]:
            buf = src.clone()  # outside the timed region: gloo writes the sum back into its input
            return _timed(lambda: dist.all_reduce(buf, group=group)), None

        return torch_run
    if method in ctx.sketches:
        sk, slog = ctx.sketches[method], ctx.logs[method]
        return lambda: (_timed(lambda: es.reduce_sum(grad, sk, group, slog)), None)
    if method == OMNIREDUCE:
        olog = ctx.logs[method]
        return lambda: (_timed(lambda: block_allreduce(grad, group=group, log=olog, link=ctx.link)), None)
    if method in HIERARCHICAL:
        hlog = ctx.logs[method]
        return lambda: (_timed(lambda: _hierarchical(method, grad, ctx, hlog)), None)
    alg, _, part = method.partition("/")
    kwargs: dict[str, Any] = {"partition": part} if part else {}
    log = ctx.logs[method]
    return lambda: (
        _timed(lambda: sparsync.allreduce(grad, algorithm=alg, group=group, log=log, link=ctx.link, **kwargs)),
        None,
    )


@dataclass
class _Context:
    """What every point of one world size shares."""

    P: int
    cfg: EmbeddingBenchConfig
    link: LinkModel
    groups: dict[str, dist.ProcessGroup]
    memory: int  # bytes of the smallest machine (min over ranks)
    logs: dict[str, CommLog] = field(default_factory=dict)
    sketches: dict[str, SparseSketch] = field(default_factory=dict)  # this point's, by method
    topos: dict[str, Topology] = field(default_factory=dict)  # the hierarchical methods'


@dataclass(frozen=True)
class _Stats:
    """Per-point facts shared by every method's row."""

    k: tuple[int, ...]
    union: int
    bound_bytes: float
    bound_s: float
    allgather_bytes: float
    rsag_bytes: float


def _point_stats(grad: torch.Tensor, ctx: _Context, dim: int) -> _Stats:
    rows_here = torch.unique(grad.coalesce().indices()[0]).numpy()
    every: list[Any] = [None] * ctx.P
    dist.all_gather_object(every, rows_here)
    k = tuple(len(r) for r in every)
    union = len(np.unique(np.concatenate(every)))
    P, k_mean = ctx.P, statistics.mean(k)
    row_bytes = dim * 4 + (4 if ctx.cfg.rows < 2**31 else 8)
    bound = 2 * k_mean * dim * 4 * (P - 1) / P
    bound_s = math.ceil(math.log2(P)) * ctx.link.alpha + bound * ctx.link.beta if P > 1 else 0.0
    return _Stats(
        k, union, bound, bound_s, (P - 1) * k_mean * row_bytes, (k_mean + union) * (P - 1) / P * row_bytes
    )


def _skip_reason(method: str, ctx: _Context, dim: int, stats: _Stats) -> str:
    if method == "torch_dense" and ctx.P * ctx.cfg.rows * dim * 4 * DENSE_COPIES > COO_MACHINE_SHARE * ctx.memory:
        return f"skipped: {ctx.P} ranks x {DENSE_COPIES} dense copies exceed half of this machine's memory"
    if method == "torch_coo" and coo_too_big([n * dim for n in stats.k], ctx.memory):
        return "skipped: gathered COO would exceed the memory cap (COO_MEMORY_CAP)"
    return ""


def _torch_bytes(method: str, ctx: _Context, dim: int, stats: _Stats) -> float:
    P = ctx.P
    if method == "torch_dense":
        return ring_allreduce_bytes(ctx.cfg.rows * dim * 4, P).sent
    # Mean over ranks of what gloo's sparse allreduce sends (ddp_baseline.py has the derivation).
    return sum(gloo_sparse_allreduce_bytes(stats.k, dim * 4, r).sent for r in range(P)) / P


def _mean_over_ranks(x: float, P: int) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / P


def _partition(method: str, log: CommLog) -> tuple[str, list[int]]:
    """(label, bytes delivered to each partition owner summed over ranks); collective: every rank calls it."""
    rec = log.last
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, list(rec.partition_bytes))
    total = [sum(col) for col in zip(*every, strict=True)] if all(every) else []
    return rec.partition, total


def _hierarchical(method: str, grad: torch.Tensor, ctx: _Context, log: CommLog | None = None) -> torch.Tensor:
    """``allreduce(grad)`` by ``hierarchical_allreduce`` (COO to row stream and back, as ``allreduce`` does)."""
    out = hierarchical_allreduce(coo_to_stream(grad), ctx.topos[method], mode=HIERARCHICAL[method], log=log)
    return stream_to_coo(out, grad.shape, grad.sparse_dim())


def _result_note(method: str, ctx: _Context, grad: torch.Tensor, ref: torch.Tensor) -> str:
    """One untimed call of a sparsync method (its warm-up), checked against torch's sum."""
    alg, _, part = method.partition("/")
    kwargs: dict[str, Any] = {"partition": part} if part else {}
    if method in HIERARCHICAL:
        res = _hierarchical(method, grad, ctx).coalesce()
    elif method == OMNIREDUCE:
        res = block_allreduce(grad, group=ctx.groups[method], link=ctx.link)
    else:
        out = sparsync.allreduce(grad, algorithm=alg, group=ctx.groups[method], link=ctx.link, **kwargs)
        res = cast(torch.Tensor, out).coalesce()  # async_op=False: a tensor
    if not torch.equal(res.indices(), ref.indices()):
        return f"result rows differ from torch's sum ({res._nnz()} vs {ref._nnz()} rows)"
    if not torch.allclose(res.values(), ref.values(), rtol=1e-4, atol=1e-4):
        err = float((res.values() - ref.values()).abs().max())
        return f"result differs from torch's sum (max abs error {err:.2g})"
    return ""


FAST_S = 0.02  # a point whose slowest method's median is below this ...
FAST_REPEATS = 41  # ... gets this many rounds


def _quartiles(ts: list[float]) -> tuple[float, float, float]:
    qs = statistics.quantiles(ts, n=4) if len(ts) > 1 else [ts[0]] * 3
    return qs[0], statistics.median(ts), qs[2]


def _rounds(
    runs: dict[str, Runner], repeats: int, order: random.Random
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each method's times (its reference part taken off where it reports one: DDP's local backward) and whole
    times, over rounds that run every method once in ``order`` (the same on every rank)."""
    methods = list(runs)
    times: dict[str, list[float]] = {m: [] for m in methods}
    refs: dict[str, list[float]] = {m: [] for m in methods}
    rounds, done = repeats, 0
    while done < rounds:
        for m in order.sample(methods, len(methods)):
            t, r = runs[m]()
            times[m].append(t if r is None else t - r)
            refs[m].append(t)
        done += 1
        # Points where every method is fast are noise-dominated on a loaded host: they get FAST_REPEATS
        # rounds. Times are the slowest rank's, the same on every rank, so every rank decides alike.
        if done == repeats and max(statistics.median(times[m]) for m in methods) < FAST_S:
            rounds = max(rounds, FAST_REPEATS)
    return times, refs


def _point_fields(ctx: _Context, where: tuple[int, float, str], stats: _Stats) -> dict[str, Any]:
    """The fields every method's row at this point shares: the point, its gradients' sizes and bounds, the link."""
    cfg, (dim, zipf, hot) = ctx.cfg, where
    return {
        "world_size": ctx.P, "rows": cfg.rows, "dim": dim, "tokens": cfg.tokens, "zipf": zipf, "hot": hot,
        "k_mean": statistics.mean(stats.k), "k_max": max(stats.k), "union": stats.union,
        "bound_bytes": stats.bound_bytes, "bound_s": stats.bound_s, "allgather_bytes": stats.allgather_bytes,
        "rsag_bytes": stats.rsag_bytes, "link": asdict(ctx.link),
    }  # fmt: skip


def _set_vs_coo(rows: list[Row]) -> None:
    """Sets each measured row's ``vs_coo``: its median over torch's COO allreduce's (None without that)."""
    coo = next((r.median_s for r in rows if r.method == "torch_coo" and not math.isnan(r.median_s)), None)
    for row in rows:
        row.vs_coo = row.median_s / coo if coo and not math.isnan(row.median_s) else None


def _measure_point(
    ctx: _Context, work: Workload, where: tuple[int, float, str], point: int
) -> list[dict[str, Any]]:
    """Every method at one point, interleaved: round r runs each method once, in a fresh order (the same on
    every rank), so drift in the machine's state hits all methods alike."""
    cfg, (dim, zipf, _) = ctx.cfg, where
    grad = work.gradient()
    stats = _point_stats(grad, ctx, dim)
    names = cfg.method_names
    skip = {m: _skip_reason(m, ctx, dim, stats) for m in names}
    methods = [m for m in names if not skip[m]]
    ctx.logs = {m: CommLog() for m in methods if m not in TORCH_METHODS}
    alpha = es.expected_density(cfg.rows, zipf, cfg.tokens)
    ctx.sketches = {m: es.make_sketch(m, alpha, cfg.seed) for m in methods if es.is_sketch(m)}
    ref = grad.clone()
    dist.all_reduce(ref)
    exact = ref.coalesce()
    notes = {m: _result_note(m, ctx, grad, exact) for m in ctx.logs if m not in ctx.sketches}
    sketch_stats = es.measure(ctx.sketches, alpha, grad, exact, ctx.groups, cfg.repeats)  # warm-up, error, c+d
    runs = {m: _runner(m, work, grad, ctx.groups[m], ctx) for m in methods}
    for m in methods:
        if m in TORCH_METHODS:
            runs[m]()  # warm-up (DDP rebuilds its buckets after its first step)
    times, refs = _rounds(runs, cfg.repeats, random.Random(cfg.seed * 7919 + point))
    preds = _predictions(ctx)
    base = _point_fields(ctx, where, stats)
    out: list[Row] = []
    for m in names:
        if skip[m]:
            out.append(Row(method=m, median_s=math.nan, p25_s=math.nan, p75_s=math.nan, times_s=[],
                           bytes_sent_per_rank=0.0, note=skip[m], **base))  # fmt: skip
            continue
        p25, med, p75 = _quartiles(times[m])
        row = Row(method=m, median_s=med, p25_s=p25, p75_s=p75, times_s=times[m], bytes_sent_per_rank=0.0,
                  note=notes.get(m, ""), **base)  # fmt: skip
        if m in TORCH_METHODS:
            row.bytes_sent_per_rank = _torch_bytes(m, ctx, dim, stats)
            row.ddp_step_s = statistics.median(refs[m]) if m == "torch_ddp" else None
        else:
            _sparsync_details(row, ctx.logs[m], preds, ctx.P)
        if m in sketch_stats:
            row = replace(row, **sketch_stats[m].row_fields())
        out.append(row)
    _set_vs_coo(out)
    return [asdict(r) for r in out]


def _predictions(ctx: _Context) -> dict[str, float]:
    """The model's time for each algorithm's own calls at this point: auto's problem and link, with the
    metadata round carrying payloads only where that algorithm's calls do. (Auto's own predictions assume
    auto's eager state for every candidate: after auto ran allgather, the split's prediction included the
    inlined payloads its forced calls never send, over-predicting it 1.5-1.8x at P = 4.) Key "auto": the
    prediction auto made for the algorithm it chose."""
    log = ctx.logs.get("auto")
    dec = log.last.decision if log is not None and log.records else None
    if dec is None or dec.problem is None or dec.link is None:
        return {}
    p = dec.problem
    largest = max(p.input_bytes(r) for r in range(p.world_size))
    out = {"auto": dec.predictions[dec.algorithm]}
    for m in costmodel.ALGORITHMS:
        # Forced allgather grows its signature's inline limit (collectives/meta.py); the others inline only
        # payloads up to the default EAGER_BYTES.
        eager = largest <= (EAGER_LIMIT if m == "allgather" else EAGER_BYTES)
        out[m] = predict(m, replace(p, eager=eager), dec.link)
    return out


def _sparsync_details(row: Row, log: CommLog, preds: dict[str, float], P: int) -> None:
    """Bytes, auto's choice, the model's prediction and the partition loads; collective (all ranks call it in
    the same order)."""
    row.bytes_sent_per_rank = _mean_over_ranks(log.last.bytes_sent, P)
    picks = sorted({rec.algorithm for rec in log.records})
    if row.method == "auto_2level":  # the two-level model's prediction for the way it ran
        row.chosen = "/".join(picks)
        dec = log.last.decision
        way = "hierarchical" if picks == ["hierarchical"] else "flat"
        row.predicted_s = dec.predictions.get(way) if dec is not None and len(picks) == 1 else None
    elif row.method == "auto":
        row.chosen = "/".join(picks)
        row.predicted_s = preds.get("auto") if len(picks) == 1 else None
    else:
        row.predicted_s = preds.get(row.method)
    row.partition, row.partition_bytes = _partition(row.method, log)
    if row.partition_bytes and sum(row.partition_bytes) > 0:
        row.partition_imbalance = max(row.partition_bytes) / statistics.mean(row.partition_bytes)


def _min_memory() -> int:
    """Physical memory of the smallest rank's machine: the same skip decisions on every rank."""
    memory = torch.tensor([os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")], dtype=torch.float64)
    dist.all_reduce(memory, op=dist.ReduceOp.MIN)
    return int(memory)


def worker(rank: int, cfg: EmbeddingBenchConfig, show_progress: bool) -> list[dict[str, Any]]:
    """Runs on every rank; rank 0 returns the rows."""
    P = dist.get_world_size()
    link = sparsync.measure_link()
    # One group per method, as each would be in its own training job.
    groups = {m: dist.new_group(backend="gloo") for m in cfg.method_names}
    ctx = _Context(P, cfg, link, groups, _min_memory())
    ctx.topos = {m: detect_topology(group=groups[m]) for m in cfg.method_names if m in HIERARCHICAL}
    rows: list[dict[str, Any]] = []
    points = [(d, s, h) for d in cfg.dims for s in cfg.zipf for h in cfg.hot]
    with progress(show_progress and rank == 0, f"P={P}", len(points)) as update:
        model: EmbeddingLoss | None = None
        ddp: DistributedDataParallel | None = None
        for point, (dim, s, hot) in enumerate(points):
            update(f"P={P} dim={dim} zipf={s:g} {hot}", 0)
            if model is None or model.emb.embedding_dim != dim:
                del model, ddp
                gc.collect()  # one table at a time: 1M x 128 fp32 is 512 MB per rank
                model = EmbeddingLoss(cfg.rows, dim, cfg.seed)
                ddp = (
                    DistributedDataParallel(model, process_group=groups["torch_ddp"])
                    if "torch_ddp" in groups
                    else None
                )
            w = torch.randn(cfg.tokens, dim, generator=torch.Generator().manual_seed(cfg.seed))
            tokens = torch.from_numpy(zipf_tokens(cfg.rows, s, cfg.tokens, hot, seed=cfg.seed, rank=rank))
            rows.extend(_measure_point(ctx, Workload(model, ddp, tokens, w), (dim, s, hot), point))
            update(f"P={P} dim={dim} zipf={s:g} {hot}", 1)
    return rows if rank == 0 else []
