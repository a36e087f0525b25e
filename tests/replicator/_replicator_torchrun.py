"""Run by test_replicator_under_torchrun: the Replicator joins torchrun's group (num_replicas from WORLD_SIZE)."""

from __future__ import annotations

import torch

from sparsync.replicator import ReplicaContext, Replicator


def prog(ctx: ReplicaContext) -> str:
    model = torch.nn.Linear(3, 1)
    opt = ctx.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), op="mean", model=model)
    x = torch.full((2, 3), float(ctx.replica_id))
    model(x).sum().backward()
    opt.step()
    total = ctx.all_sum(torch.tensor(float(ctx.replica_id)))
    return f"replica {ctx.replica_id}/{ctx.num_replicas} sum={float(total):g} w={model.weight.sum().item():.6f}"


if __name__ == "__main__":
    for line in Replicator().start(prog):
        print(line, flush=True)
