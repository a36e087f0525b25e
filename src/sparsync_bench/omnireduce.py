"""An OmniReduce-style block-sparse allreduce (Fei et al., SIGCOMM'21): the baseline S2 Reducer measures
itself against (S2 §4, Fig. 3 and 4), written on sparsync's collectives for ``sparsync reproduce``.

OmniReduce cuts the gradient into blocks of ``B`` contiguous values, sends only the blocks holding a non-zero
value, and shards the block space over aggregators that sum the blocks they own and return the non-zero sums.
Here: the gradient's rows are grouped into blocks of ``B // dim`` rows (one row per block when a row is wider
than ``B``), the non-zero blocks form a row stream, and ``ssar_split_allgather`` reduces it (its reduce-scatter
is the aggregators' sum of their shard, its allgather the return of the non-zero sums).

Choices where OmniReduce is not ours to copy: it streams blocks through aggregators with a "next non-zero
block" pointer per worker and overlaps blocks in flight; we send each shard's non-zero blocks in one message.
``B = 256`` values by default (OmniReduce tunes B to the network; 256 is one of its settings). The result is a
COO tensor of the rows whose sum is non-zero (rows of a block that no rank touched are zeros and dropped), so
a touched row whose sum is exactly 0 is missing where torch's sum keeps it.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

import sparsync
from sparsync.costmodel import LinkModel
from sparsync.record import CommLog

BLOCK = 256


def to_blocks(grad: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, int]:
    """(COO of the non-zero blocks: shape (ceil(rows / r), r·dim), r rows per block; r)."""
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    if grad.layout != torch.sparse_coo or grad.sparse_dim() != 1:
        raise ValueError(f"need a COO tensor with one sparse dim (an embedding gradient), got {grad.layout}")
    g = grad.coalesce()
    rows, dim = g.shape[0], math.prod(g.shape[1:])
    per = max(1, block // dim)
    idx, vals = g.indices()[0], g.values().reshape(-1, dim)
    ids, inv = torch.unique(idx // per, return_inverse=True)
    blocks = vals.new_zeros(ids.numel(), per, dim)
    blocks[inv, idx % per] = vals
    shape = (-(-rows // per), per * dim)
    return torch.sparse_coo_tensor(ids.unsqueeze(0), blocks.reshape(-1, per * dim), shape, is_coalesced=True), per


def from_blocks(out: torch.Tensor, per: int, shape: torch.Size) -> torch.Tensor:
    """The rows of a reduced block COO whose values are not all zero, as a COO of ``shape``."""
    out = out.coalesce()
    dim = math.prod(shape[1:])
    rows = (out.indices()[0].unsqueeze(1) * per + torch.arange(per)).reshape(-1)
    vals = out.values().reshape(-1, dim)
    keep = (rows < shape[0]) & vals.ne(0).any(1)
    return torch.sparse_coo_tensor(
        rows[keep].unsqueeze(0), vals[keep].reshape(-1, *shape[1:]), shape, is_coalesced=True
    )


def block_allreduce(
    grad: torch.Tensor,
    *,
    block: int = BLOCK,
    group: dist.ProcessGroup | None = None,
    log: CommLog | None = None,
    link: LinkModel | None = None,
) -> torch.Tensor:
    """Sum of ``grad`` (a row-sparse COO tensor) over the group, non-zero blocks only (module doc)."""
    blocks, per = to_blocks(grad, block)
    out = sparsync.allreduce(blocks, algorithm="ssar_split_allgather", group=group, log=log, link=link)
    assert isinstance(out, torch.Tensor)
    return from_blocks(out, per, grad.shape)
