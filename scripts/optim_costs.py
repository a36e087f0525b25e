"""What DistributedOptimizer's pain-point handling costs (docs/optimizer.md#distributedoptimizer-what-ddp-and-torchrec-users-trip-on-and-what-handling-it-costs).

1. The round that agrees which gradients exist (``fill_missing_grads``: one MAX allreduce of an int32 per
   parameter) against DDP's ``find_unused_parameters=True`` (a walk of the autograd graph each backward):
   median step time of a small embedding model at P ranks on loopback, DistributedOptimizer vs DDP with and
   without the option, interleaved.
2. Peak memory of gradient accumulation over 8 micro-batches of a Zipf-skewed embedding lookup: torch's own
   accumulation (indices concatenated: k copies of a hot row) against DistributedOptimizer's (coalesced after
   each micro-batch), in separate processes so peak RSS is each one's own.

    .venv/bin/python scripts/optim_costs.py [--procs 3] [--steps 30]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import sparsync

ROWS, DIM = 200_000, 64


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True), nn.Linear(DIM, 1))


def _batch(step: int, rank: int, tokens: int = 4096) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.rand(tokens // 8, 8, generator=g) ** 4 * ROWS).long()


def step_times(rank: int, steps: int) -> dict[str, float]:
    """Median seconds per step (forward, backward, aggregation, SGD step) of three set-ups, interleaved."""
    setups: dict[str, tuple[nn.Module, Any]] = {}
    m = _model()
    setups["sparsync"] = (m, sparsync.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.01), m))
    for unused in (False, True):
        d = nn.parallel.DistributedDataParallel(_model(), find_unused_parameters=unused)
        setups[f"ddp find_unused={unused}"] = (d, torch.optim.SGD(d.parameters(), lr=0.01))
    times: dict[str, list[float]] = {k: [] for k in setups}
    for step in range(steps):
        for name, (model, opt) in setups.items():
            x = _batch(step, rank)
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            if step >= 3:  # warm-up
                times[name].append(time.perf_counter() - t0)
    out = {k: statistics.median(v) for k, v in times.items()}
    # the agreement round alone, on the same parameters (every gradient present, as in most steps)
    from sparsync.placement import NamedParam, ReduceEnv
    from sparsync.replicator.optimizer import fill_missing_grads

    world = dist.group.WORLD
    assert isinstance(world, dist.ProcessGroup)
    env = ReduceEnv(world, dist.get_world_size())
    named = [NamedParam(n, p) for n, p in m.named_parameters()]
    rounds = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        fill_missing_grads(named, env)
        rounds.append(time.perf_counter() - t0)
    out["the agreement round alone"] = statistics.median(rounds)
    return out


def _accumulate(kind: str, out: Any) -> None:
    """One process: 8 micro-batches' sparse gradients accumulated into .grad; reports peak RSS growth (MiB)
    and the stored rows of the accumulated gradient."""
    model = _model()
    if kind == "sparsync":
        # DistributedOptimizer's coalescing hook, without a group: the same hook it registers
        from sparsync.optim.optimizer import _coalesce_grad

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(_coalesce_grad)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for m in range(8):
        model(_batch(m, 0, tokens=65536)).square().mean().backward()
    g = model[0].weight.grad
    rows = int(g._nnz())
    out.put((kind, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024, rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, default=3, help="ranks for the step-time comparison (default 3)")
    ap.add_argument("--steps", type=int, default=30, help="steps per set-up (default 30, 3 of them warm-up)")
    a = ap.parse_args()
    per_rank = sparsync.launch(step_times, nprocs=a.procs, args=(a.steps,), timeout=600)
    print(f"step time, P = {a.procs}, loopback, {ROWS:,} x {DIM} EmbeddingBag + Linear, 4,096 tokens per rank")
    for name in per_rank[0]:
        worst = max(r[name] for r in per_rank)
        print(f"  {name:28} {worst * 1e3:8.2f} ms (slowest rank's median)")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    print("accumulation of 8 micro-batches (65,536 Zipf-skewed tokens each), one process each")
    for kind in ("torch", "sparsync"):
        p = ctx.Process(target=_accumulate, args=(kind, q))
        p.start()
        p.join()
        k, mib, rows = q.get()
        print(f"  {k:10} peak RSS growth {mib:8.1f} MiB, stored rows of the accumulated gradient {rows:,}")


if __name__ == "__main__":
    main()
