"""The crash of scripts/ddp_sparse_crash.py with nothing of sparsync: torch's DDP with sparse gradients (26
`EmbeddingBag(sparse=True)` tables, Zipf ids, gloo), ranks spawned by `torch.multiprocessing`, in rounds; prints
each round's exit codes (a negative one: the signal that killed a rank) and "CRASH" for a round with one.

    .venv/bin/python scripts/ddp_sparse_crash_torch.py 3 100 20 32   # ranks, steps a round, rounds, samples
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class M(nn.Module):
    def __init__(self, T: int, rows: int, dim: int) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum", sparse=True) for _ in range(T))
        self.mlp = nn.Sequential(nn.Linear(13, 64), nn.ReLU(), nn.Linear(64, dim))
        self.top = nn.Sequential(nn.Linear(dim * (T + 1), 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, dense: torch.Tensor, cats: torch.Tensor) -> torch.Tensor:
        xs = [self.mlp(dense)] + [t(cats[:, i : i + 1]) for i, t in enumerate(self.tables)]
        out: torch.Tensor = self.top(torch.cat(xs, 1)).squeeze(1)
        return out


def train(rank: int, steps: int, batch: int) -> int:
    """``steps`` steps of DDP over ``M`` on this rank's Zipf-like ids, in the current process group."""
    torch.manual_seed(0)
    T, rows = 26, 2000
    m = DistributedDataParallel(M(T, rows, 8))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        u = torch.rand(batch, T, generator=g)  # Zipf-like ids: hot rows low
        cats = (rows * u**3).long().clamp_(max=rows - 1)
        dense = torch.randn(batch, 13, generator=g)
        y = (torch.rand(batch, generator=g) > 0.5).float()
        opt.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(m(dense, cats), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
    return steps


def run(rank: int, P: int, steps: int, port: int, batch: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=P)
    torch.set_num_threads(1)
    train(rank, steps, batch)
    dist.destroy_process_group()


if __name__ == "__main__":
    P, steps, rounds, batch = (int(a) for a in sys.argv[1:5])
    for r in range(rounds):
        ctx = mp.get_context("spawn")
        ps = [ctx.Process(target=run, args=(i, P, steps, 29500 + r % 100, batch)) for i in range(P)]
        for p in ps:
            p.start()
        for p in ps:
            p.join()
        codes = [p.exitcode for p in ps]
        print(r, codes, flush=True)
        if any(c != 0 for c in codes):
            print("CRASH", codes, flush=True)
