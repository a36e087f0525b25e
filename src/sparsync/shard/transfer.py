"""Whole tables in and out of the ranks' shards: rank 0's table dealt to its owners (``sparsync.shard``
initialises every shard from it, so training starts where the replicated path would), and the shards gathered
back into one table on rank 0 (``state_dict``). Each moves the table once over the group (a scatter, a gather),
never P copies of it."""

from __future__ import annotations

import torch
import torch.distributed as dist

from sparsync.shard.ownership import Ownership


def scatter_rows(table: torch.Tensor, ownership: Ownership, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's rows of group rank 0's ``table`` ``[rows, D]`` (the other ranks' ``table`` gives only the shape
    and dtype). Collective over ``group``."""
    rank, P = dist.get_rank(group), dist.get_world_size(group)
    if P == 1:
        return table.detach().clone()
    D = table.shape[1:]
    mine = torch.empty(ownership.chunk, *D, dtype=table.dtype)
    blocks = list(ownership.to_blocks(table.detach()).unbind(0)) if rank == 0 else None
    dist.scatter(mine, blocks, group=group, group_src=0)
    return mine[: ownership.counts()[rank]].clone()


def gather_rows(shard: torch.Tensor, ownership: Ownership, group: dist.ProcessGroup) -> torch.Tensor | None:
    """The whole table ``[rows, D]`` from every rank's ``shard``, on group rank 0; None on the others.
    Collective over ``group``."""
    rank, P = dist.get_rank(group), dist.get_world_size(group)
    if P == 1:
        return shard.detach().clone()
    padded = torch.zeros(ownership.chunk, *shard.shape[1:], dtype=shard.dtype)
    padded[: shard.shape[0]] = shard.detach()
    parts = [torch.empty_like(padded) for _ in range(P)] if rank == 0 else None
    dist.gather(padded, parts, group=group, group_dst=0)
    return ownership.from_blocks(torch.stack(parts)) if parts is not None else None
