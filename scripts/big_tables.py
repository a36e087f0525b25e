"""Tables larger than one rank holds (docs/sharding.md): a table set built on the meta device, sharded over P
ranks by ``sparsync.shard`` (each rank draws only its rows), trained a few steps with sparse SGD through
``DistributedOptimizer``; each rank reports its peak RSS (``ru_maxrss``) before and after, beside the table set's
bytes.

    .venv/bin/python scripts/big_tables.py --procs 8 --tables 8 --rows 4000000 --dim 32 \\
        --out docs/data/big_tables_p8.json
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import sparsync


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kB


class Tables(nn.Module):
    def __init__(self, tables: int, rows: int, dim: int) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum", device="meta") for _ in range(tables))
        torch.manual_seed(0)
        self.top = nn.Linear(tables * dim, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(ids.shape[0])
        pooled = [t(ids[:, j].contiguous(), offsets) for j, t in enumerate(self.tables)]
        return self.top(torch.cat(pooled, dim=1)).squeeze(1)


def work(rank: int, tables: int, rows: int, dim: int, batch: int, steps: int) -> dict[str, Any]:
    before = _peak_mb()
    t0 = time.perf_counter()
    model = sparsync.shard(Tables(tables, rows, dim))
    built = time.perf_counter() - t0
    opt = sparsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, rows, (batch, tables), generator=g)
        opt.zero_grad()
        loss = model(ids).square().mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    shard_mb = sum(t.weight.numel() * t.weight.element_size() for t in model.tables) / 2**20
    dist.barrier()
    return {"rank": rank, "peak_rss_mb_before": before, "peak_rss_mb": _peak_mb(), "shard_mb": shard_mb,
            "build_s": built, "losses": losses}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    total_mb = a.tables * a.rows * a.dim * 4 / 2**20
    print(f"{a.tables} tables x {a.rows:,} rows x {a.dim} fp32 = {total_mb:,.0f} MB, {a.procs} ranks", flush=True)
    res = sparsync.launch(work, nprocs=a.procs, args=(a.tables, a.rows, a.dim, a.batch, a.steps))
    for r in res:
        grown = r["peak_rss_mb"] - r["peak_rss_mb_before"]
        print(f"  rank {r['rank']}: shard {r['shard_mb']:,.0f} MB, peak RSS {r['peak_rss_mb']:,.0f} MB "
              f"({grown:,.0f} MB above the process before sharding), built in {r['build_s']:.1f} s, "
              f"losses {[round(x, 4) for x in r['losses']]}")  # fmt: skip
    worst = max(r["peak_rss_mb"] for r in res)
    print(f"table set {total_mb:,.0f} MB = {total_mb / worst:.2f}x the largest rank's peak RSS ({worst:,.0f} MB)")
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"args": vars(a) | {"out": str(a.out)}, "table_mb": total_mb, "ranks": res},
                                    indent=1))  # fmt: skip
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
