"""An optimizer's state across world sizes: the per-row state of the shards (Adagrad's sums, Adam's moments)
gathered whole like the tables (``optimizer_state_dict``), and dealt back to the rows' owners at any P
(``load_optimizer_state_dict``), so that a checkpoint saved at one P continues exactly at another.

Which state is per row: a tensor of the shard's shape (``[rows owned, D]``) in the shard's entry of the
optimizer's state; it is gathered into ``[rows, D]`` by the table's ownership (``transfer.gather_rows``). Anything
else (a step count, a scalar) is the same on every rank and is kept as rank 0 has it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sparsync.sharding.modules import ShardedTable
from sparsync.sharding.transfer import gather_rows


def _optimizer(opt: Any) -> torch.optim.Optimizer:
    """The torch optimizer itself (``DistributedOptimizer`` wraps one as ``.optimizer``)."""
    inner = getattr(opt, "optimizer", opt)
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"expected a torch optimizer or sparsync.DistributedOptimizer, got {type(opt).__name__}")
    return inner


def _shards(opt: torch.optim.Optimizer, model: nn.Module) -> Iterator[tuple[int, ShardedTable]]:
    """(index of the parameter in the optimizer's state dict, its table) for every shard the optimizer holds."""
    tables = {id(m.weight): m for m in model.modules() if isinstance(m, ShardedTable)}
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        if id(p) in tables:
            yield i, tables[id(p)]


def optimizer_state_dict(opt: Any, model: nn.Module) -> dict[str, Any] | None:
    """``opt.state_dict()`` with each shard's per-row state gathered whole (``[rows, D]``) on the shards' group
    rank 0; None on the other ranks (a model without shards: None on every rank but the world's rank 0).
    ``opt``: a torch optimizer over ``model``'s parameters (or a ``DistributedOptimizer``).
    Collective over the shards' group: every rank calls it."""
    inner = _optimizer(opt)
    # the wrapper's own state_dict: a DistributedOptimizer adds its bucket layout, without which the resumed
    # run's first round would reduce the step-time way and differ in the last bits
    sd = opt.state_dict()
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    for i, table in _shards(inner, model):
        rank0 = table.exchanger.rank == 0
        # a copy: torch's state_dict() holds the optimizer's live per-parameter dicts, which must keep the shard's
        # rows (a step after saving would otherwise find the whole table, or None, in place of its state)
        if i not in sd["state"]:
            continue
        state = sd["state"][i] = dict(sd["state"][i])
        for key in sorted(state):
            value = state[key]
            if isinstance(value, torch.Tensor) and value.shape == table.weight.shape and value.dim() == 2:
                # a sparse gradient's momentum (SGD) is a sparse tensor of the shard's shape: gathered dense
                dense = value.to_dense() if value.is_sparse else value
                state[key] = gather_rows(dense, table.ownership, table.exchanger.group)
    return sd if rank0 else None


def load_optimizer_state_dict(opt: Any, model: nn.Module, state_dict: dict[str, Any]) -> None:
    """Load ``state_dict`` (from ``optimizer_state_dict``, saved at any P) into ``opt``: each shard's whole per-row
    state ``[rows, D]`` gives this rank its rows; a ``DistributedOptimizer`` also takes the saved bucket layout,
    so the resumed run reduces in the same buckets from its first step. Every rank calls it with the same dict.
    Mutates ``opt``."""
    inner = _optimizer(opt)
    states = {i: dict(s) for i, s in state_dict["state"].items()}
    sd = {**state_dict, "state": states}  # other keys (a DistributedOptimizer's bucket layout) as saved
    for i, table in _shards(inner, model):
        state = sd["state"].get(i, {})
        whole = (table.num_embeddings, table.embedding_dim)
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and tuple(value.shape) == whole:
                state[key] = value[table.ownership.global_rows(table.exchanger.rank)].clone()
    opt.load_state_dict(sd)
