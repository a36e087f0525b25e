"""What a DLRM step's CPU is made of, variant by variant, in interleaved rounds
(docs/sharding.md#measured-the-grid-2026-11-28).

Each variant trains `bench dlrm`'s model (Kaggle MLPs, 26 tables capped at 100,000 rows, dim 16, Zipf ids) for
25 steps on P local gloo ranks, one thread each, and reports the ranks' mean process CPU per step (median over
the steps after 5) and rank 0's main-thread CPU:

- ``ddp``: DDP over the MLPs, the tables left out of DDP (each rank's own, never sent: ``floor_tables_unsent``);
- ``dmlp``: the same with ``sparsync.DistributedOptimizer`` over the MLPs instead of DDP;
- ``shard+ddp``, ``shard+dmlp``: the same with every table sharded (``sparsync.shard``).

The variants run one after another, ``--rounds`` times over, so that a drift of the host's speed reaches all of
them alike. Timings are this host's; compare the variants within one run.

    .venv/bin/python scripts/dlrm_cpu_parts.py --procs 2 --rounds 5 --out docs/data/dlrm_cpu_parts_p2.md
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

VARIANTS = ("ddp", "dmlp", "shard+ddp", "shard+dmlp")
STEPS, WARMUP = 25, 5


class _Both:
    """``DistributedOptimizer`` over the MLPs, plain SGD over each rank's own tables."""

    def __init__(self, model: nn.Module) -> None:
        from sparsync import DistributedOptimizer

        mlps = [p for n, p in model.named_parameters() if not n.startswith("tables.")]
        tables = [p for n, p in model.named_parameters() if n.startswith("tables.")]
        self.mlps = DistributedOptimizer(torch.optim.SGD(mlps, lr=0.01))
        self.tables = torch.optim.SGD(tables, lr=0.01)

    def zero_grad(self) -> None:
        self.mlps.zero_grad()
        self.tables.zero_grad()

    def step(self) -> None:
        self.mlps.step()
        self.tables.step()


def _batches(rows: list[int], batch: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(rank)
    out = []
    for _ in range(STEPS):
        u = torch.rand(batch, len(rows), generator=g)
        ids = torch.stack([(float(n) ** u[:, j] - 1).long().clamp(0, n - 1) for j, n in enumerate(rows)], 1)
        out.append((torch.randn(batch, 13, generator=g), ids, torch.rand(batch, generator=g).round()))
    return out


def _worker(rank: int, variant: str, batch: int) -> dict[str, float]:
    from sparsync.record import CommLog
    from sparsync_bench.criteo import table_rows
    from sparsync_bench.dlrm import DLRM, MLPS
    from sparsync_bench.dlrm_shard import shard_tables

    torch.manual_seed(0)
    rows = table_rows(100_000)
    bottom, top = MLPS["kaggle"]
    model = DLRM(rows, 16, bottom=(*bottom, 16), top=top, sparse=True)
    data = _batches(rows, batch, rank)
    if variant.startswith("shard+"):
        shard_tables("sparsync_sharded", model, data[0][:2], CommLog())
    forward: nn.Module = model
    opt: Any
    if variant.endswith("ddp"):
        tables = [n for n, _ in model.named_parameters() if n.startswith("tables.")]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, tables)  # type: ignore[no-untyped-call]
        forward = DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    else:
        opt = _Both(model)
    cpu, main = [], []
    for dense, ids, label in data:
        dist.barrier()
        c0, m0 = time.process_time(), time.thread_time()
        opt.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(forward(dense, ids), label)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        loss.item()
        cpu.append(time.process_time() - c0)
        main.append(time.thread_time() - m0)
    t = torch.tensor([statistics.median(cpu[WARMUP:])], dtype=torch.float64)
    dist.all_reduce(t)
    return {"cpu_ms": float(t) / dist.get_world_size() * 1e3, "main_ms": statistics.median(main[WARMUP:]) * 1e3}


def main() -> None:
    from sparsync import launch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    got: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for r in range(a.rounds):
        for v in VARIANTS:
            res = launch(_worker, nprocs=a.procs, args=(v, a.batch))[0]
            got[v].append(res)
            print(
                f"round {r + 1}/{a.rounds} {v}: CPU {res['cpu_ms']:.1f} ms/step, main thread {res['main_ms']:.1f}"
            )
    base = statistics.median(x["cpu_ms"] for x in got["ddp"])
    lines = [
        f"P = {a.procs}, {a.batch} samples per rank, {a.rounds} interleaved rounds "
        f"(`scripts/dlrm_cpu_parts.py --procs {a.procs} --batch {a.batch} --rounds {a.rounds}`)",
        "",
        "| variant | CPU ms/step (median of rounds) | range | over ddp | rank 0 main thread ms/step |",
        "|---|---|---|---|---|",
    ]
    for v in VARIANTS:
        c = [x["cpu_ms"] for x in got[v]]
        m = statistics.median(x["main_ms"] for x in got[v])
        lines.append(f"| {v} | {statistics.median(c):.1f} | {min(c):.1f}-{max(c):.1f} | "
                     f"{statistics.median(c) - base:+.1f} | {m:.1f} |")  # fmt: skip
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if a.out is not None:
        a.out.write_text(text)


if __name__ == "__main__":
    main()
