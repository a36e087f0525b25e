"""A CNN on scikit-learn's bundled digits (8x8 images), data parallel with the Replicator (TF-Replicator §5 at
laptop scale). One input pipeline per worker (PER_WORKER), split across the replicas by batch.

    python examples/replicator_digits_cnn.py                  # 4 local processes
    python examples/replicator_digits_cnn.py --replicas 1     # the same script, one process
    torchrun --nproc-per-node 2 examples/replicator_digits_cnn.py
    torchrun --nproc-per-node 2 examples/replicator_digits_cnn.py --ddp   # the same training by torch DDP
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import torch.nn.functional as F  # noqa: N812
from sklearn.datasets import load_digits
from torch import nn

from sparsync.launch import under_torchrun
from sparsync.replicator import ReplicaContext, Replicator

GLOBAL_BATCH, EPOCHS = 96, 8


def data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(y)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    return x[:1500], y[:1500], x[1500:], y[1500:]


def input_fn(worker_id: int) -> object:
    """The whole worker's pipeline: shuffled global batches (the replicator splits them per replica)."""
    x, y, _, _ = data()
    g = torch.Generator().manual_seed(1)
    for _ in range(EPOCHS):
        perm = torch.randperm(len(y), generator=g)
        for i in range(0, len(y) - GLOBAL_BATCH + 1, GLOBAL_BATCH):
            idx = perm[i : i + GLOBAL_BATCH]
            yield {"x": x[idx], "y": y[idx]}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 16, 10),
    )  # fmt: skip


def replica(ctx: ReplicaContext, curve: str | None = None) -> str:
    model = make_model()
    opt = ctx.wrap_optimizer(torch.optim.Adam(model.parameters(), lr=3e-3), op="mean", model=model)

    def step_fn(b: dict[str, torch.Tensor]) -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(b["x"]), b["y"])
        loss.backward()
        opt.step()
        return loss

    losses = [ctx.run(step_fn, b, outputs="mean") for b in ctx.input(input_fn)]
    if curve and ctx.replica_id == 0:  # the loss curve (mean over replicas), for `sparsync reproduce`
        with open(curve, "w") as f:
            json.dump([float(x) for x in losses], f)
    _, _, xt, yt = data()
    with torch.no_grad():
        correct = ctx.all_sum((model(xt).argmax(1) == yt).sum())  # the same test set everywhere: R x
    acc = float(correct) / (len(yt) * ctx.num_replicas)
    return (
        f"replica {ctx.replica_id}/{ctx.num_replicas}: {len(losses)} steps of {GLOBAL_BATCH // ctx.num_replicas} "
        f"per replica, loss {float(losses[0]):.3f} -> {float(losses[-1]):.3f}, test accuracy {acc:.3f}"
    )


def ddp_main(curve: str | None) -> None:
    """The same training by torch's DistributedDataParallel under torchrun (the baseline): each rank takes its
    contiguous share of every global batch, as the Replicator splits it."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(make_model())
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    n, losses = GLOBAL_BATCH // world, []
    for b in input_fn(0):
        opt.zero_grad()
        loss = F.cross_entropy(model(b["x"][rank * n : (rank + 1) * n]), b["y"][rank * n : (rank + 1) * n])
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    if curve and rank == 0:
        with open(curve, "w") as f:
            json.dump(losses, f)
    print(f"DDP rank {rank}/{world}: {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--replicas", type=int, default=None, help="default: torchrun's world, else 4")
    p.add_argument("--curve", default=None, help="write the loss per step (JSON list) to this file")
    p.add_argument("--ddp", action="store_true", help="train with torch DDP instead (under torchrun)")
    args = p.parse_args()
    if args.ddp:
        ddp_main(args.curve)
        raise SystemExit(0)
    n = args.replicas or (None if under_torchrun() else 4)
    for line in Replicator(num_replicas=n).start(functools.partial(replica, curve=args.curve)):
        print(line)
