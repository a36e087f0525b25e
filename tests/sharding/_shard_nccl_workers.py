"""Workers of test_shard_nccl.py: the sharded-table path end to end (shard, steps, checkpoint, a refused id), the
same run with and without NCCL's rules (tests/_nccl_rules.py), so the test can compare the two bit for bit."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import sparsync
from sparsync.optim import LAYOUT_KEY, DistributedOptimizer
from sparsync.sharding import load_optimizer_state_dict, optimizer_state_dict, plan_of

PLAN = {"rep": "replicated"}  # "bag" and "emb" sharded
BAD_ID = 31  # one past the last row of "bag"


class Model(nn.Module):
    """One table replicated (DistributedOptimizer's sparse reduction), two sharded ones of uneven shards at P = 3
    (31 and 17 rows), a dense layer over the three."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.rep = nn.Embedding(20, 3, sparse=True)
        self.bag = nn.EmbeddingBag(BAD_ID, 4, mode="mean")
        self.emb = nn.Embedding(17, 4, padding_idx=2)
        self.fc = nn.Linear(11, 1)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        pooled = [self.rep(x).sum(1), self.bag(ids, offsets), self.emb(y).sum(1)]
        return self.fc(torch.cat(pooled, dim=1)).tanh()


def batch(step: int, rank: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(97 * step + rank)
    n = 1 + (rank + step) % 3  # uneven batches
    return (
        torch.randint(0, 20, (n, 2), generator=g),
        torch.randint(0, BAD_ID, (2 * n,), generator=g),
        2 * torch.arange(n),
        torch.randint(0, 17, (n, 3), generator=g),
    )


def _step(model: nn.Module, opt: DistributedOptimizer, step: int, rank: int) -> float:
    opt.zero_grad()
    loss = model(*batch(step, rank)).square().sum()
    loss.backward()
    opt.step()
    return float(loss.detach())


def _build(seed: int) -> tuple[nn.Module, DistributedOptimizer]:
    model = sparsync.shard(Model(seed), plan=PLAN)  # every rank's own init: group rank 0's rows win
    opt = DistributedOptimizer(torch.optim.Adagrad(model.parameters(), lr=0.1), model, plan=plan_of(model))
    return model, opt


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return _copy(dict(model.named_parameters()))


def _layout(opt: DistributedOptimizer) -> Any:
    """The bucket layout ``opt`` reduces in (or was loaded to reduce in before its first round); None if none."""
    state = opt.state_dict().get(LAYOUT_KEY)
    reducer = opt._reducer
    if state is None and reducer is not None and reducer.loaded is not None:
        order, layouts = reducer.loaded
        return {"order": list(order), "layouts": list(layouts)}
    return state


def _copy(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies: a state dict's replicated entries share the live parameters, which later steps change."""
    return {k: v.detach().clone() for k, v in tensors.items()}


def sharded_run(rank: int, path: str) -> dict[str, Any]:
    """Two Adagrad steps; the tables and the optimizer state gathered whole on rank 0 and saved to ``path``; a
    second model (another init) loads them and both take a third step; a bad id on rank 1, which every rank
    must refuse with the same error; a good step after it. Returns every value the test compares."""
    sparsync.set_deterministic()  # the replicated table's algorithm chosen from data alone, not timings
    model, opt = _build(seed=rank)
    losses = [_step(model, opt, step, rank) for step in range(2)]
    full = _copy(model.state_dict())  # collective: whole tables on rank 0
    state = optimizer_state_dict(opt, model)
    if rank == 0:
        torch.save((full, state), path)
    dist.barrier()
    saved, saved_state = torch.load(path)
    loaded, loaded_opt = _build(seed=100 + rank)  # other values: the checkpoint must replace them
    loaded.load_state_dict(saved)
    load_optimizer_state_dict(loaded_opt, loaded, saved_state)
    # the path itself, not the values' luck: the resumed optimizer holds the saved bucket layout before its
    # first round (without it that round reduces the step-time way, whose last bits differ only for some values)
    given_layout = _layout(loaded_opt)
    reloaded = _copy(loaded.state_dict())
    losses.append(_step(model, opt, 2, rank))
    resumed_loss = _step(loaded, loaded_opt, 2, rank)
    third = _params(model)
    layouts = {"saved": (state or {}).get(LAYOUT_KEY), "given": given_layout, "resumed": _layout(loaded_opt)}
    x, ids, offsets, y = batch(3, rank)
    if rank == 1:
        ids = ids.clone()
        ids[0] = BAD_ID
    try:
        model(x, ids, offsets, y)
        refused = "no error"
    except ValueError as e:
        refused = f"ValueError: {e}"
    losses.append(_step(model, opt, 4, rank))  # the ranks stayed in step
    return {
        "losses": losses,
        "resumed_loss": resumed_loss,
        "third": third,
        "params": _params(model),
        "resumed": _params(loaded),
        "full": full,
        "reloaded": reloaded,
        "refused": refused,
        "layouts": layouts,
        "shapes": {n: tuple(p.shape) for n, p in model.named_parameters()},
    }
