"""Workers of test_auto_meta.py: ``plan="auto"`` on a model with a table on the meta device, against the same
model with its table real; every tensor a rank makes is watched for one of the whole table's size."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from _shard_workers import AUTO_LINK
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import sparsync
from sparsync.optim import DistributedOptimizer
from sparsync.sharding import AutoPlan, Ownership, ShardedEmbeddingBag, auto_plan
from sparsync.sharding.group import INIT_BLOCK

ROWS, DIM = 3 * INIT_BLOCK + 5, 8  # a whole table of 6.3 MB in fp32, three init blocks and a short one


class Model(nn.Module):
    """A small table every sample reads whole (on ``small_device``), a large one each sample reads a few rows of
    (on ``device``: "meta", or None for the real equivalent), a dense layer over both."""

    def __init__(self, device: str | None, small_device: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.small = nn.Embedding(8, 4, device=small_device)
        self.big = nn.EmbeddingBag(ROWS, DIM, mode="sum", device=device)
        self.fc = nn.Linear(4 + DIM, 1)

    def forward(self, small: torch.Tensor, big: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.small(small).sum(1), self.big(big, offsets)], dim=1)).squeeze(1)


def sample(rank: int, step: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(100 * step + rank)
    n = 4 + rank  # uneven batches
    return torch.arange(8).repeat(n, 1), torch.randint(0, ROWS, (3 * n,), generator=g), 3 * torch.arange(n)


class Largest(TorchDispatchMode):
    """The most bytes of any CPU tensor an op returns while the mode is on (this thread's)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self.bytes = max(self.bytes, t.numel() * t.element_size())
        return out


def _priced(chosen: AutoPlan) -> list[tuple[str, str, float, float]]:
    return [(e.name, e.placement, e.bytes_per_machine, e.seconds) for e in chosen.plan.entries]


def sgd_losses(
    model: nn.Module, params: list[nn.Parameter], batches: list[tuple[torch.Tensor, ...]]
) -> list[float]:
    """A step of torch's SGD (lr 0.1) through ``DistributedOptimizer`` over ``params`` per batch of ``batches``,
    on the mean square of ``model``'s output: each step's loss."""
    opt = DistributedOptimizer(torch.optim.SGD(params, lr=0.1), model)
    losses = []
    for batch in batches:
        opt.zero_grad()
        loss = model(*batch).square().mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def auto_meta_worker(rank: int) -> dict[str, Any]:
    """``auto_plan`` of the meta model, then ``sparsync.shard(..., "auto")`` of another and two SGD steps, all
    under ``Largest``; ``auto_plan`` of the real model (outside it) priced on the meta run's overlap."""
    sparsync.set_link(AUTO_LINK)
    group = dist.group.WORLD
    assert isinstance(group, dist.ProcessGroup)
    with Largest() as largest:
        measured_model = Model("meta")
        measured = auto_plan(measured_model, sample(rank), group)
        model = sparsync.shard(Model("meta"), "auto", sample=sample(rank), seed=3)
        losses = sgd_losses(model, list(model.parameters()), [sample(rank, step + 1) for step in range(2)])
    # priced on the meta run's overlap (its backward times the spare cores' share), not on a backward of its own
    real = auto_plan(Model(None), sample(rank), group, backward_seconds=measured.overlap)
    # the small table on the meta device too: sharded although replicated is priced faster (it has no rows)
    both = auto_plan(Model("meta", "meta"), sample(rank), group, backward_seconds=measured.overlap)
    return {
        "largest": largest.bytes,
        "meta": {"tables": measured.tables, "distinct": dict(measured.distinct), "stats": measured.stats,
                 "priced": _priced(measured), "backward": measured.backward_seconds},
        "real": {"tables": real.tables, "distinct": dict(real.distinct), "stats": real.stats,
                 "priced": _priced(real), "backward": real.backward_seconds},
        "both_meta": {"tables": both.tables, "distinct": dict(both.distinct)},
        # the measured model afterwards: its own forward back, its table still on the meta device, no gradient
        "stand_in_left": "forward" in vars(measured_model.big),
        "measured_big": (measured_model.big.weight.device.type, measured_model.big.weight.grad is None),
        "modules": {n: type(getattr(model, n)).__name__ for n in ("small", "big")},
        "shard": tuple(model.big.weight.shape),
        "rows_owned": Ownership(ROWS, dist.get_world_size()).counts()[rank],
        "devices": sorted({p.device.type for p in model.parameters()}),
        "losses": losses,
        "finite": all(bool(p.isfinite().all()) for p in model.parameters()),
        "sharded_kind": isinstance(model.big, ShardedEmbeddingBag),
    }  # fmt: skip
