"""Whole tables in and out of the ranks' shards: rank 0's table dealt to its owners (``sparsync.shard``
initialises every shard from it, so training starts where the replicated path would), and the shards gathered
back into one table on rank 0 (``state_dict``). Each moves the table once over the group (a scatter, a gather),
never P copies of it.

A table too large for one rank is built on the meta device (``nn.EmbeddingBag(rows, D, device="meta")``): no
rank ever holds it whole; each makes its own rows (``init_rows``) from a seed, the same rows whatever P is."""

from __future__ import annotations

import torch
import torch.distributed as dist

from sparsync.sharding.group import Ownership


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


INIT_BLOCK = 1 << 16  # rows drawn per generator seed by ``init_rows``


def init_rows(
    ownership: Ownership, rank: int, dim: int, dtype: torch.dtype, seed: int, padding: int | None
) -> torch.Tensor:
    """This rank's rows of a table that exists nowhere whole: N(0, 1), as ``nn.Embedding`` and
    ``nn.EmbeddingBag`` initialise theirs (the distribution, not torch's bits), ``padding``'s row zero. Row r is
    drawn in block r div ``INIT_BLOCK``, from a generator seeded by (``seed``, block), so a table's values depend
    on the seed alone, not on P: a checkpoint of it loads at any other P, and one process that calls this with
    P = 1 makes the whole table (the reference the tests compare with). Each rank draws every block and keeps
    its rows (stride ownership), so memory stays one block beside the shard; time is that of drawing the whole
    table once."""
    P = ownership.parts
    out = torch.empty(ownership.counts()[rank], dim, dtype=dtype)
    g = torch.Generator()
    for block, start in enumerate(range(0, ownership.rows, INIT_BLOCK)):
        n = min(INIT_BLOCK, ownership.rows - start)
        g.manual_seed(seed * 1_000_003 + block)
        values = torch.randn(n, dim, generator=g, dtype=torch.float32).to(dtype)
        first = (rank - start) % P  # the first row of the block that this rank owns, within the block
        mine = values[first::P]
        at = (start + first) // P  # its local row
        out[at : at + mine.shape[0]] = mine
    if padding is not None and int(ownership.owner(torch.tensor(padding))) == rank:
        out[int(ownership.local(torch.tensor(padding)))] = 0
    return out
