"""Measure the α-β-γ link model of a group: tiny collectives for α, a ping-pong for β, local micro-benchmarks
for γ.

All pairs (0,1), (2,3), ... ping-pong at the same time, so the β measurement sees the contention the
collectives will see (on a shared host, cores; behind a shaped link, the link). α is timed on the message
patterns the algorithms use (see ``_collective_latencies``). The per-rank estimates are then averaged with one
allreduce so that every rank holds the same model: "auto" must choose the same algorithm everywhere.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from sparsync.collectives._gather import allgather_blocks, allgather_fixed
from sparsync.collectives.comm import Comm, ring_allreduce_bytes
from sparsync.collectives.group import resolve_group
from sparsync.collectives.meta import PARTITION_CODES, exchange_meta
from sparsync.collectives.partition import resolve_partition
from sparsync.collectives.traffic import Traffic
from sparsync.costmodel import REGISTRY, LinkModel, gather_steps
from sparsync.stream import SparseStream, add


def _pingpong(group: dist.ProcessGroup, rank: int, peer: int, nbytes: int, reps: int, tally: Traffic) -> float:
    """Median one-way time of an ``nbytes`` message between ``rank`` and ``peer``."""
    buf = torch.zeros(max(nbytes, 1), dtype=torch.uint8)
    tally.add((reps + 1) * buf.numel(), (reps + 1) * buf.numel(), reps + 1)
    times = []
    for _ in range(reps + 1):  # first round warms the connection up
        t0 = time.perf_counter()
        if rank < peer:
            dist.send(buf, group=group, group_dst=peer)
            dist.recv(buf, group=group, group_src=peer)
        else:
            dist.recv(buf, group=group, group_src=peer)
            dist.send(buf, group=group, group_dst=peer)
        times.append((time.perf_counter() - t0) / 2)
    return sorted(times[1:])[reps // 2]


def _reduction_costs(n: int = 200_000) -> tuple[float, float, float, float]:
    """Seconds per sparse pair merged, per dense element added, per pair scatter-added, and per element
    written into fresh memory (a new 8 MB tensor, page faults included), on this rank."""
    g = torch.Generator().manual_seed(0)
    dim = 100 * n
    a = SparseStream.coalesce(torch.randint(0, dim, (n,), generator=g), torch.rand(n, generator=g), dim)
    b = SparseStream.coalesce(torch.randint(0, dim, (n,), generator=g), torch.rand(n, generator=g), dim)
    t0 = time.perf_counter()
    add(a, b)
    gamma_sparse = (time.perf_counter() - t0) / (a.nnz + b.nnz)
    x, y = torch.rand(10 * n), torch.rand(10 * n)
    t0 = time.perf_counter()
    for _ in range(3):
        x.add_(y)
    gamma_dense = (time.perf_counter() - t0) / (30 * n)
    idx = torch.randint(0, 10 * n, (n,), generator=g)
    t0 = time.perf_counter()
    x.index_add_(0, idx, y[:n])
    gamma_scatter = (time.perf_counter() - t0) / n
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        torch.empty(10 * n).fill_(1.0)
        times.append(time.perf_counter() - t0)
    gamma_fresh = sorted(times)[1] / (10 * n)
    return gamma_sparse, gamma_dense, gamma_scatter, gamma_fresh


def _collective_latencies(group: dist.ProcessGroup, reps: int, tally: Traffic) -> tuple[float, float]:
    """α as the collectives see it: the median time of one exchange step of a tiny recursive-doubling allgather
    with every rank active, and the median time of one tiny all-to-all round (P-1 messages posted at once).

    A lone ping-pong under-reports α when P processes share few cores: a round is only over when every
    rank has been scheduled, and on this VM thread wake-ups alone take up to milliseconds. The samples run back
    to back after one barrier, as a run's calls follow each other: a barrier before each sample lines the ranks
    up as no run does, and under-reports α where ranks share cores (measured: docs/results_demo.md).
    """

    comm = Comm(group)
    steps = gather_steps(comm.size)
    row = torch.zeros(1, dtype=torch.int64)
    blocks = [torch.zeros(1, dtype=torch.int64) for _ in range(comm.size)]
    t_step, t_a2a = [], []
    dist.barrier(group=group)
    for i in range(reps + 1):  # the first of each is a warm-up
        t0 = time.perf_counter()
        allgather_fixed(comm, row, doubling=True)
        if i:
            t_step.append((time.perf_counter() - t0) / steps)
    dist.barrier(group=group)
    for i in range(reps + 1):
        t0 = time.perf_counter()
        comm.alltoallv(blocks, [1] * comm.size, torch.int64)
        if i:
            t_a2a.append(time.perf_counter() - t0)
    tally.add(comm.traffic.bytes_sent, comm.traffic.bytes_recv, comm.traffic.messages)
    return sorted(t_step)[reps // 2], sorted(t_a2a)[reps // 2]


def _allreduce_beta(group: dist.ProcessGroup, nbytes: int, reps: int, tally: Traffic) -> float:
    """Seconds per byte as a bandwidth-optimal dense allreduce sees it: (t(M) - t(tiny)) / (2(P-1)/P · M).

    On a real link this matches the ping-pong; when P processes share a few cores (loopback), the ping-pong of
    one pair overstates by up to 10x what every rank gets while all of them move data at once.
    """
    P = dist.get_world_size(group)
    big, tiny = torch.zeros(nbytes // 4), torch.zeros(1)

    def timed(t: torch.Tensor) -> float:
        ring = (reps + 1) * ring_allreduce_bytes(t.numel() * t.element_size(), P)
        tally.add(ring, ring, (reps + 1) * 2 * (P - 1))
        times = []
        for i in range(reps + 1):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            dist.all_reduce(t, group=group)
            if i:
                times.append(time.perf_counter() - t0)
        return sorted(times)[reps // 2]

    return max(timed(big) - timed(tiny), 1e-12) / (2 * (P - 1) / P * nbytes)


def _exchange_beta(group: dist.ProcessGroup, nbytes: int, reps: int, alpha_step: float, tally: Traffic) -> float:
    """Seconds per byte of sparsync's own exchanges: a recursive-doubling allgather of ``nbytes`` per rank
    after a barrier, as the sparse algorithms run it (not back to back: each phase of a sparse collective
    starts on connections that were idle), minus its latency, over the (P-1)·nbytes each rank receives."""

    comm = Comm(group)
    P = comm.size
    steps = gather_steps(comm.size)
    block = torch.zeros(nbytes, dtype=torch.uint8)
    times = []
    for i in range(reps + 1):
        dist.barrier(group=group)
        time.sleep(0.02)  # idle connections, as between the phases of a training step
        t0 = time.perf_counter()
        allgather_blocks(comm, block, [nbytes] * P, doubling=True)
        if i:
            times.append(time.perf_counter() - t0)
    tally.add(comm.traffic.bytes_sent, comm.traffic.bytes_recv, comm.traffic.messages)
    t = sorted(times)[reps // 2]
    return max(t - steps * alpha_step, 1e-12) / ((P - 1) * nbytes)


FIXED_ROWS, FIXED_ROW = 64, 16  # the stream of ``_fixed_costs``: one stored row of 16 values out of 64


def _fixed_costs(group: dist.ProcessGroup, reps: int, names: tuple[str, ...], tally: Traffic) -> list[float]:
    """Median seconds of each algorithm of ``names`` (registered ones) on a stream of one stored row: its
    metadata round, its rounds and the software around them, everything but β and γ (``LinkModel.fixed``).
    Run on the algorithms' own code (no nested public call: calibration may itself run inside one)."""

    stream = SparseStream(torch.zeros(1, dtype=torch.int32), torch.ones(FIXED_ROW), FIXED_ROWS * FIXED_ROW,
                          row=FIXED_ROW)  # fmt: skip
    part = resolve_partition("auto", FIXED_ROW)
    out = []
    for alg in names:
        run = REGISTRY.entry(alg).runner
        times = []
        for i in range(reps + 1):  # the first is a warm-up
            dist.barrier(group=group)
            t0 = time.perf_counter()
            comm = Comm(group)
            meta = exchange_meta(
                comm, "sparse_allreduce", stream, alg, -1, True, partition=PARTITION_CODES.index(part)
            )
            run(comm, stream, meta, part)
            tally.add(comm.traffic.bytes_sent, comm.traffic.bytes_recv, comm.traffic.messages)
            if i:
                times.append(time.perf_counter() - t0)
        out.append(sorted(times)[reps // 2])
    return out


def measure_link(
    group: dist.ProcessGroup | None = None,
    *,
    large_bytes: int = 4 << 20,
    reps: int = 5,
    traffic: Traffic | None = None,
) -> LinkModel:
    """Measure α (per exchange step), α of an all-to-all round, β (seconds per byte), γ; the same on every rank.

    Collective: every rank of ``group`` must call it. Takes well under a second on loopback, about
    ``reps * large_bytes * 2 / bandwidth`` behind a slow link.
    ``traffic``: where to add what this rank sent and received (the call that measures at its first "auto"
    counts it in its record). Mutates ``traffic``.
    """
    tally = traffic if traffic is not None else Traffic()
    g = resolve_group(group)
    rank, size = dist.get_rank(g), dist.get_world_size(g)
    gs, gd, gsc, gf = _reduction_costs()
    names = REGISTRY.names  # every registered algorithm's fixed cost, in the registry's order
    est = torch.zeros(9 + len(names), dtype=torch.float64)
    est[2], est[3], est[5], est[8] = gs, gd, gsc, gf
    peer = rank ^ 1
    if peer < size:
        t_small = _pingpong(g, rank, peer, 8, 4 * reps + 1, tally)
        t_large = _pingpong(g, rank, peer, large_bytes, reps, tally)
        est[1] = max(t_large - t_small, 1e-12) / large_bytes
        est[4] = 1.0
    if size > 1:
        est[0], est[6] = _collective_latencies(g, 12 * reps + 1, tally)  # cheap: tiny messages; noisy: many
        est[1] = max(float(est[1]), _allreduce_beta(g, large_bytes, reps, tally))
        est[7] = _exchange_beta(g, large_bytes // 4, reps, float(est[0]), tally)
        est[9:] = torch.tensor(_fixed_costs(g, 2 * reps + 1, names, tally), dtype=torch.float64)
    dist.all_reduce(est, group=g)
    ring = ring_allreduce_bytes(est.numel() * est.element_size(), size)
    tally.add(ring, ring, 2 * (size - 1))
    if size == 1:
        return LinkModel(alpha=0.0, beta=0.0, gamma_sparse=gs, gamma_dense=gd, gamma_scatter=gsc, gamma_fresh=gf)
    pairs = float(est[4])
    return LinkModel(
        alpha=float(est[0]) / size,
        alpha_a2a=float(est[6]) / size,
        beta=float(est[1]) / pairs,
        gamma_sparse=float(est[2]) / size,
        gamma_dense=float(est[3]) / size,
        gamma_scatter=float(est[5]) / size,
        beta_exchange=max(float(est[7]) / size, float(est[1]) / pairs),
        gamma_fresh=float(est[8]) / size,
        fixed=tuple((alg, float(t) / size) for alg, t in zip(names, est[9:], strict=True)),
    )
