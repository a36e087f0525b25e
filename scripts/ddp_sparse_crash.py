"""Torch's DDP with sparse gradients (26 `EmbeddingBag(sparse=True)` tables, Zipf ids, gloo) trained in rounds of
ranks started by `sparsync.launch`; counts the rounds a rank died of a signal and prints the first lines of each
error (faulthandler's stacks included). It runs nothing of sparsync's but the launcher: a crash here is in torch.

    .venv/bin/python scripts/ddp_sparse_crash.py --procs 3 --steps 100 --rounds 60 [--start-method spawn]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sparsync import LaunchError, launch

TABLES, ROWS, DIM = 26, 2000, 8


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True) for _ in range(TABLES))
        self.bottom = nn.Sequential(nn.Linear(13, 64), nn.ReLU(), nn.Linear(64, DIM))
        self.top = nn.Sequential(nn.Linear(DIM * (TABLES + 1), 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, dense: torch.Tensor, cats: torch.Tensor) -> torch.Tensor:
        xs = [self.bottom(dense)] + [t(cats[:, i : i + 1]) for i, t in enumerate(self.tables)]
        out: torch.Tensor = self.top(torch.cat(xs, 1)).squeeze(1)
        return out


def train(rank: int, steps: int, batch: int) -> int:
    torch.manual_seed(0)
    model = DistributedDataParallel(Model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        cats = (ROWS * torch.rand(batch, TABLES, generator=g) ** 3).long().clamp_(max=ROWS - 1)
        dense, y = torch.randn(batch, 13, generator=g), (torch.rand(batch, generator=g) > 0.5).float()
        opt.zero_grad()
        nn.functional.binary_cross_entropy_with_logits(model(dense, cats), y).backward()  # type: ignore[no-untyped-call]
        opt.step()
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--start-method", default="forkserver", choices=("forkserver", "spawn"))
    a = ap.parse_args()
    crashes = 0
    for r in range(a.rounds):
        try:
            launch(train, nprocs=a.procs, args=(a.steps, a.batch), timeout=120, start_method=a.start_method)
            print(f"round {r}: ok", flush=True)
        except LaunchError as e:
            crashes += 1
            print(f"round {r}: {str(e)[:3000]}", flush=True)
    print(f"{crashes} of {a.rounds} rounds ended by a crash ({a.procs} ranks x {a.steps} steps a round)")


if __name__ == "__main__":
    main()
