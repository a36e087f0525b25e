"""``sparsync demo``'s second part: a recommender's table set, placed by ``sparsync.shard(plan="auto")``, at two
widths (``TABLE_SETS``).

Twelve ``nn.EmbeddingBag`` tables of 200,000 rows (one Zipf(1.05) id per sample and table, as ``bench dlrm``'s
data), of width 16 and then 256, a small MLP over the pooled vectors, 1,024 samples per process and step. The
automatic plan measures each table's distinct rows on the first batch and the link (``shard.auto``) and prices the
step both ways: every table replicated (``DistributedOptimizer``'s grouped sparse allreduce of the gradients, whose
bytes grow with the union of the processes' rows) against sharded (each process sends each of its distinct ids once
to the row's owner and receives each row once, then pushes one gradient row per id). Then the demo trains both,
from the same weights on the same samples, interleaved block by block (``interleave``, as the first part), and says
which placement won, by how much, why (bytes and predicted time), and whether the plan chose it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import sparsync
from sparsync.record import CommLog, workload_bytes
from sparsync.sharding import auto_plan
from sparsync_bench.demo_report import block_sizes
from sparsync_bench.interleave import Trainer, interleave

PLACEMENTS = ("replicated", "sharded")


@dataclass(frozen=True)
class TablesConfig:
    procs: int = 4
    tables: int = 12
    rows: int = 200_000
    dim: int = 16
    batch: int = 1024  # samples per process and step
    zipf: float = 1.05
    steps: int = 24  # per placement, the first ``warmup`` left out of the timing
    warmup: int = 4
    block: int = 4
    lr: float = 0.05
    seed: int = 0


# What the demo runs: the narrow tables recommenders start with (dim 16, as bench dlrm's Kaggle DLRM), where the
# replicated tables' reduction costs less than the exchange's rounds on this host, and the same tables 16x wider
# (dim 256), where the union of every process's rows that replication merges and applies costs more
TABLE_SETS = (TablesConfig(), TablesConfig(dim=256))


class TableModel(nn.Module):
    """The tables' pooled vectors, concatenated, through a two-layer MLP to one logit."""

    def __init__(self, cfg: TablesConfig) -> None:
        super().__init__()
        torch.manual_seed(cfg.seed)
        self.tables = nn.ModuleList(
            nn.EmbeddingBag(cfg.rows, cfg.dim, mode="sum", sparse=True) for _ in range(cfg.tables)
        )
        self.top = nn.Sequential(nn.Linear(cfg.tables * cfg.dim, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(ids.shape[0])
        pooled = [t(ids[:, j].contiguous(), offsets) for j, t in enumerate(self.tables)]
        out: torch.Tensor = self.top(torch.cat(pooled, dim=1)).squeeze(1)
        return out


def batches(cfg: TablesConfig, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every step's (ids ``[batch, tables]``, labels) of this process: Zipf ranks scattered over the rows by a
    fixed permutation per table (hot rows anywhere in the table, as hashed ids are)."""
    rng = np.random.default_rng(cfg.seed + 1000 * (rank + 1))
    perms = np.random.default_rng(cfg.seed).permuted(np.tile(np.arange(cfg.rows), (cfg.tables, 1)), axis=1)
    out = []
    for _ in range(cfg.steps):
        ranks = np.minimum(rng.zipf(cfg.zipf, (cfg.batch, cfg.tables)), cfg.rows) - 1
        ids = perms[np.arange(cfg.tables), ranks]  # table t: the row its permutation puts at the Zipf rank
        labels = (ranks[:, 0] % 2).astype(np.float32)
        out.append((torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(labels)))
    return out


def _trainer(placement: str, cfg: TablesConfig, data: list[tuple[torch.Tensor, torch.Tensor]]) -> Trainer:
    """One placement's training as ``interleave`` takes it: yields once set up and after each step, returns its
    summary."""
    model: nn.Module = TableModel(cfg)
    log = CommLog()
    if placement == "sharded":
        model = sparsync.shard(model, log=log)
    opt = sparsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=cfg.lr), model, log=log)
    start = len(log.records)
    times, losses = [], []
    yield
    for ids, labels in data:
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(model(ids), labels)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        yield
    return {
        "step_ms": statistics.median(times[cfg.warmup :]) * 1e3,
        "times_ms": [t * 1e3 for t in times],
        "bytes_per_step": sum(workload_bytes(r) for r in log.records[start:]) / cfg.steps,
        "final_loss": statistics.fmean(losses[-4:]),
    }


def worker(rank: int, cfg: TablesConfig) -> dict[str, Any]:
    """Plan, then train both placements interleaved. Collective."""
    data = batches(cfg, rank)
    choice = auto_plan(TableModel(cfg), (data[0][0],), dist.group.WORLD)  # type: ignore[arg-type]
    priced = {p: choice.every_table(p) for p in PLACEMENTS}
    trainers = {p: _trainer(p, cfg, data) for p in PLACEMENTS}
    out, order = interleave(trainers, [cfg.warmup, *block_sizes(cfg.steps, cfg.warmup, cfg.block)])
    return {
        "chosen": choice.tables,
        "predicted_ms": {p: plan.grouped_seconds * 1e3 for p, plan in priced.items()},
        "predicted_mb": {p: plan.bytes_per_machine / 2e6 for p, plan in priced.items()},  # sent, per process
        "distinct": {n: d[0] for n, d in choice.distinct.items()},
        "runs": out,
        "order": order,
    }


def run_tables(cfg: TablesConfig) -> list[dict[str, Any]]:
    return sparsync.launch(worker, nprocs=cfg.procs, args=(cfg,))


def summary_lines(res: list[dict[str, Any]], cfg: TablesConfig) -> Iterator[str]:
    """What the demo says about the tables: the plan's choice and why, the measured steps, the winner."""
    r0 = res[0]
    chosen = set(r0["chosen"].values())
    plan_says = "sharded" if chosen == {"sharded"} else "replicated" if chosen == {"replicated"} else "mixed"
    step = {p: max(r["runs"][p]["step_ms"] for r in res) for p in PLACEMENTS}  # the slowest process's
    sent = {p: statistics.fmean(r["runs"][p]["bytes_per_step"] for r in res) / 1e6 for p in PLACEMENTS}
    loss = {p: r0["runs"][p]["final_loss"] for p in PLACEMENTS}
    u = statistics.fmean(r0["distinct"].values())
    yield (
        f"tables: {cfg.tables} x {cfg.rows:,} rows x {cfg.dim}, {cfg.batch} Zipf({cfg.zipf}) ids per process and "
        f"table and step ({u:.0f} distinct on average), {cfg.procs} processes"
    )
    pm, pb = r0["predicted_ms"], r0["predicted_mb"]
    yield (
        f"plan (shard(plan='auto')): {plan_says}; predicted communication per step: replicated "
        f"{pm['replicated']:.1f} ms ({pb['replicated']:.2f} MB sent), sharded {pm['sharded']:.1f} ms "
        f"({pb['sharded']:.2f} MB sent)"
    )
    for p in PLACEMENTS:
        yield f"  {p}: {step[p]:.1f} ms/step (median), {sent[p]:.2f} MB sent per process and step, " + (
            f"loss {loss[p]:.4f}"
        )
    won = min(PLACEMENTS, key=lambda p: step[p])
    lost = next(p for p in PLACEMENTS if p != won)
    why = (
        "each process sends each of its distinct rows once to its owner and the owners apply only their own rows, "
        "where replication merges and applies the union of every process's rows"
        if won == "sharded"
        else "at this size the replicated tables' one grouped call costs less than the exchange's rounds on the "
        "step's path"
    )
    agree = "the plan chose it" if won == plan_says else f"the plan chose {plan_says}"
    fewer = sent[won] < sent[lost]
    ratio = sent[lost] / max(sent[won], 1e-12) if fewer else sent[won] / max(sent[lost], 1e-12)
    yield (
        f"{won} won: {step[lost] / step[won]:.2f}x faster than {lost}, with {ratio:.2f}x "
        f"{'fewer' if fewer else 'more'} bytes ({why}); {agree}. Losses equal to "
        f"{abs(loss['sharded'] - loss['replicated']):.1e} (the same SGD steps, summed in another order)"
    )
