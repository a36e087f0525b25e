"""Rank bodies of tests/test_group_lifetime.py: a model whose tables sparsync holds (sharded, in a replicated
group) and whose dense layer ``DistributedOptimizer`` reduces, trained on a group of its own; then that group
and the groups sparsync made beside it destroyed."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import sparsync


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tables = nn.ModuleList(nn.EmbeddingBag(50, 4, mode="sum") for _ in range(2))
        self.top = nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(0, ids.numel(), 2)
        return self.top(torch.cat([t(ids, offsets) for t in self.tables], 1)).squeeze(1)


def _trained(group: dist.ProcessGroup, fused: bool) -> tuple[nn.Module, Any]:
    plan = {"tables.0": "sharded", "tables.1": "replicated" if fused else "sharded"}
    optimizer = sparsync.sharding.SGD(lr=0.1) if fused else None
    model = sparsync.shard(_Model(), plan, group=group, optimizer=optimizer)
    params = sparsync.sharding.dense_parameters(model)
    opt = sparsync.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), model, group=group)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        opt.zero_grad()
        model(torch.randint(0, 50, (8,), generator=g)).square().mean().backward()
        opt.step()
    return model, opt


def freed_after_destroy(rank: int, fused: bool) -> dict[str, Any]:
    """Train, free the model and its optimizer, destroy the groups made since: how many of them still live, and,
    with a second model kept alive past its group's end, what calling it raises."""
    before = set(dist.distributed_c10d._world.pg_map)
    group = dist.new_group(backend="gloo")
    model, opt = _trained(group, fused)
    made = [g for g in dist.distributed_c10d._world.pg_map if g not in before]
    refs = [weakref.ref(g) for g in made]
    del model, opt, group
    gc.collect()
    for g in made:
        dist.destroy_process_group(g)
    del made, g
    gc.collect()
    alive_after_free = sum(r() is not None for r in refs)

    kept_group = dist.new_group(backend="gloo")
    kept = sparsync.shard(_Model(), {"tables.0": "sharded", "tables.1": "sharded"}, group=kept_group)
    ref = weakref.ref(kept_group)
    dist.destroy_process_group(kept_group)
    del kept_group
    gc.collect()
    try:
        kept(torch.arange(4))
        error = ""
    except RuntimeError as e:
        error = str(e)
    return {"groups": len(refs), "alive": alive_after_free, "kept_group_freed": ref() is None, "error": error}
