"""Several losses and optimizers in one step_fn (TF-Replicator §3.2, its GAN and D4PG cases): a tiny GAN that
learns a 1-D Gaussian, data parallel. Discriminator and generator each have their own wrapped optimizer.

    python examples/replicator_multi_loss.py                  # 4 local processes
    torchrun --nproc-per-node 2 examples/replicator_multi_loss.py
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from sparsync.launch import under_torchrun
from sparsync.replicator import PER_REPLICA, ReplicaContext, Replicator

BATCH, STEPS, TARGET_MEAN, TARGET_STD = 64, 400, 3.0, 0.5


def input_fn(replica_id: int) -> object:
    """Each replica its own pipeline (PER_REPLICA): real samples and generator noise."""
    g = torch.Generator().manual_seed(100 + replica_id)
    return lambda: (
        TARGET_MEAN + TARGET_STD * torch.randn(BATCH, 1, generator=g),
        torch.randn(BATCH, 4, generator=g),
    )


def replica(ctx: ReplicaContext) -> str:
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    disc = nn.Sequential(nn.Linear(1, 16), nn.ReLU(), nn.Linear(16, 1))
    g_opt = ctx.wrap_optimizer(torch.optim.Adam(gen.parameters(), lr=2e-3, betas=(0.5, 0.9)), op="mean", model=gen)
    d_opt = ctx.wrap_optimizer(
        torch.optim.Adam(disc.parameters(), lr=2e-3, betas=(0.5, 0.9)), op="mean", model=disc
    )
    ones, zeros = torch.ones(BATCH, 1), torch.zeros(BATCH, 1)

    def step_fn(batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        real, noise = batch
        fake = gen(noise)
        d_opt.zero_grad()
        d_loss = F.binary_cross_entropy_with_logits(disc(real), ones) + F.binary_cross_entropy_with_logits(
            disc(fake.detach()), zeros
        )
        d_loss.backward()
        d_opt.step()
        g_opt.zero_grad()
        g_loss = F.binary_cross_entropy_with_logits(disc(fake), ones)
        g_loss.backward()
        g_opt.step()
        return {"d_loss": d_loss, "g_loss": g_loss, "fake_mean": fake.mean(), "fake_std": fake.std()}

    data = ctx.input(input_fn, PER_REPLICA)
    for _ in range(STEPS):
        out = ctx.run(step_fn, next(data), outputs="mean")  # reduced over replicas
    return (
        f"replica {ctx.replica_id}/{ctx.num_replicas}: d_loss {float(out['d_loss']):.3f} "
        f"g_loss {float(out['g_loss']):.3f}; generated mean {float(out['fake_mean']):.2f} "
        f"(target {TARGET_MEAN}), std {float(out['fake_std']):.2f} (target {TARGET_STD})"
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--replicas", type=int, default=None, help="default: torchrun's world, else 4")
    args = p.parse_args()
    n = args.replicas or (None if under_torchrun() else 4)
    for line in Replicator(num_replicas=n).start(replica):
        print(line)
