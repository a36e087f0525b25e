"""Cross-replica batch norm written with ``all_sum`` (TF-Replicator §3.4): the statistics of every replica's
batch together, so N replicas train exactly like one process with batch norm on the concatenated batch.

    python examples/replicator_batch_norm.py                  # 4 local processes, checked against 1 process
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from sparsync.launch import under_torchrun
from sparsync.replicator import PER_WORKER, ReplicaContext, Replicator

GLOBAL_BATCH, STEPS = 64, 30


class CrossReplicaBatchNorm(nn.Module):
    def __init__(self, ctx: ReplicaContext, width: int) -> None:
        super().__init__()
        self.ctx = ctx
        self.gamma = nn.Parameter(torch.ones(width))
        self.beta = nn.Parameter(torch.zeros(width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        R = self.ctx.num_replicas
        mean = self.ctx.all_sum(h.mean(0) / R)  # differentiable: the backward is an all-sum too
        mean_sq = self.ctx.all_sum((h**2).mean(0) / R)
        return self.gamma * (h - mean) / torch.sqrt(mean_sq - mean**2 + 1e-5) + self.beta


def input_fn(worker_id: int) -> object:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(10, 1, generator=g)
    for _ in range(STEPS):
        x = torch.randn(GLOBAL_BATCH, 10, generator=g) * 3 + 1
        yield x, (x @ w).tanh() + 0.1 * torch.randn(GLOBAL_BATCH, 1, generator=g)


def replica(ctx: ReplicaContext) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), CrossReplicaBatchNorm(ctx, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = ctx.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), op="mean", model=model)

    def step_fn(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    losses = [float(ctx.run(step_fn, b, outputs="mean")) for b in ctx.input(input_fn, PER_WORKER)]
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--replicas", type=int, default=None, help="default: torchrun's world, else 4")
    args = p.parse_args()
    n = args.replicas or (None if under_torchrun() else 4)
    many = Replicator(num_replicas=n).start(replica)
    one = Replicator(num_replicas=1).start(replica)  # the reference: one process, the whole batch
    losses, params = many[0]
    diff = max(float((params[k] - one[0][1][k]).abs().max()) for k in params)
    print(f"{len(many)} replicas: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(f"1 process:   loss {one[0][0][0]:.4f} -> {one[0][0][-1]:.4f}")
    print(f"largest parameter difference after {STEPS} steps: {diff:.2e}")
