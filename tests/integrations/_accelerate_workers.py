"""Workers for test_accelerate.py (module-level: ``launch`` pickles them): docs/integrations.md's two Accelerate
recipes, each against the plain sparsync loop on the batches that Accelerate's prepared loader gave this rank.

- ``hook``: ``accelerator.prepare(model, optimizer, loader)`` (the model wrapped in DDP), then the prepared
  model's ``register_comm_hook(None, compression_hook(...))``; against DDP with the same hook.
- ``optimizer``: ``DistributedOptimizer`` around the optimizer, and ``accelerator.prepare(optimizer, loader)``
  without the model (prepared, it would be wrapped in DDP and every gradient reduced twice); against the
  ``DistributedOptimizer`` loop."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import sparsync
from sparsync.compress import ErrorFeedback, TopK
from sparsync.compress.hooks import compression_hook

SAMPLES, BATCH, EPOCHS = 24, 4, 2


class Net(nn.Module):
    """A sparse-gradient table, a sparse-gradient bag and a linear layer over both."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(40, 4, sparse=True)
        self.bag = nn.EmbeddingBag(24, 4, mode="sum", sparse=True)
        self.fc = nn.Linear(8, 1)

    def forward(self, a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.emb(a).sum(1), self.bag(c)], 1)).squeeze(1)


def loader() -> DataLoader[Any]:
    """The same samples on every rank; Accelerate's prepared loader gives each rank its share."""
    g = torch.Generator().manual_seed(7)
    a = torch.randint(0, 40, (SAMPLES, 3), generator=g)
    c = torch.randint(0, 24, (SAMPLES, 2), generator=g)
    return DataLoader(TensorDataset(a, c, torch.randn(SAMPLES, generator=g)), batch_size=BATCH, shuffle=True)


def accelerator_in_group() -> Accelerator:
    """An Accelerator on the ranks ``sparsync.launch`` started: Accelerate reads the ranks from the environment
    (as ``accelerate launch`` and torchrun set it) and joins the initialised group."""
    rank, world = str(dist.get_rank()), str(dist.get_world_size())
    os.environ.update(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=world)
    return Accelerator(cpu=True)


def _hook(model: nn.Module) -> Any:
    return compression_hook(TopK(0.5), ErrorFeedback(), module=model)


def accelerate_run(case: str) -> tuple[dict[str, np.ndarray], list[list[torch.Tensor]]]:
    """The recipe's parameters, and the batches its prepared loader gave this rank, in order."""
    accelerator = accelerator_in_group()
    model = Net()
    opt: Any = torch.optim.Adagrad(model.parameters(), lr=0.1)
    if case == "hook":
        call, opt, data = accelerator.prepare(model, opt, loader())
        call.register_comm_hook(None, _hook(call))
    else:
        call = model.to(accelerator.device)
        opt, data = accelerator.prepare(sparsync.DistributedOptimizer(opt, model), loader())
    seen = []
    for _ in range(EPOCHS):
        for a, c, y in data:
            seen.append([a, c, y])
            accelerator.backward((call(a, c) - y).square().mean())
            opt.step()
            opt.zero_grad()
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}, seen


def plain_run(case: str, batches: list[list[torch.Tensor]]) -> dict[str, np.ndarray]:
    """The hand-written loop of the case's path on ``batches``."""
    model = Net()
    if case == "hook":
        call: nn.Module = nn.parallel.DistributedDataParallel(model)
        call.register_comm_hook(None, _hook(call))
        opt: Any = torch.optim.Adagrad(model.parameters(), lr=0.1)
    else:
        call = model
        opt = sparsync.DistributedOptimizer(torch.optim.Adagrad(model.parameters(), lr=0.1), model)
    for a, c, y in batches:
        (call(a, c) - y).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def compare_worker(rank: int, cases: tuple[str, ...]) -> dict[str, Any]:
    sparsync.set_deterministic()
    out: dict[str, Any] = {"start": {n: p.detach().numpy().copy() for n, p in Net().named_parameters()}}
    for case in cases:
        got, batches = accelerate_run(case)
        out[case] = {"accelerate": got, "plain": plain_run(case, batches), "batches": len(batches)}
        out[case]["first_ids"] = batches[0][0].numpy().copy()
    return out
