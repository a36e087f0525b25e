"""Which rank owns which rows of a sharded table: the stride partition, row r on rank r mod P at local row
r div P.

Why stride and not contiguous ranges: a recommender's or a language model's ids are Zipf-skewed, and the hot
ids of most vocabularies sit at the low end (ids assigned by frequency, or by first appearance, which favours
frequent ids). Ranges would give rank 0 nearly every hot row, and with them most of every step's requests,
rows and gradient rows: its links and its optimizer would bound the step. Stride puts consecutive ids on
different ranks, so the hot head is dealt round-robin; a hashed or permuted vocabulary is spread by the
permutation itself. It is the partition the split allreduce algorithms already use for row-sparse streams, for
the same reason (``collectives/partition.py``; Zen, OSDI'25), and it needs no table of its own: any rank maps any
id to its owner with one modulo, so the routing of a lookup costs no metadata.

The shard of rank j holds ``counts()[j]`` rows (ceil or floor of R/P): the ranks' shards differ by at most one
row. Whole tables move between the ranks' shards and one full table (initialisation from rank 0, checkpoints)
through ``to_blocks`` / ``from_blocks``: P equal blocks of ``chunk`` rows, the last rows of short shards
padded, as gloo's scatter and gather want them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsync.collectives.partition import Partition


@dataclass(frozen=True)
class Ownership:
    """The stride partition of ``rows`` rows over ``parts`` ranks (module doc)."""

    rows: int
    parts: int

    def __post_init__(self) -> None:
        if self.rows < 0 or self.parts < 1:
            raise ValueError(
                f"an ownership needs rows >= 0 and parts >= 1, got rows={self.rows}, parts={self.parts}"
            )

    @property
    def partition(self) -> Partition:
        return Partition("stride", self.rows, self.parts)

    def counts(self) -> list[int]:
        """Rows owned by each rank."""
        return self.partition.counts()

    @property
    def chunk(self) -> int:
        """Rows of the largest shard: the block size of ``to_blocks`` / ``from_blocks``."""
        return -(-self.rows // self.parts)

    def owner(self, ids: torch.Tensor) -> torch.Tensor:
        """The owning rank of each id (int64)."""
        return ids % self.parts

    def local(self, ids: torch.Tensor) -> torch.Tensor:
        """Each id's row in its owner's shard (int64)."""
        return ids // self.parts

    def global_rows(self, rank: int) -> torch.Tensor:
        """The table rows rank ``rank`` owns, in its shard's order."""
        return torch.arange(min(rank, self.rows), self.rows, self.parts, dtype=torch.int64)  # none past the end

    def to_blocks(self, table: torch.Tensor) -> torch.Tensor:
        """A whole table ``[rows, D]`` as ``[parts, chunk, D]``: block j holds rank j's shard, zero-padded."""
        P, c = self.parts, self.chunk
        padded = torch.zeros(c * P, *table.shape[1:], dtype=table.dtype, device=table.device)
        padded[: self.rows] = table
        # row m·P + j is rank j's local row m: [chunk, P, D] transposed
        return padded.view(c, P, *table.shape[1:]).transpose(0, 1).contiguous()

    def from_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """The whole table ``[rows, D]`` from the ranks' padded shards ``[parts, chunk, D]`` (``to_blocks``'s
        inverse)."""
        P, c = self.parts, self.chunk
        return blocks.transpose(0, 1).reshape(c * P, *blocks.shape[2:])[: self.rows].clone()
