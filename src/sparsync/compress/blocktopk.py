"""``BlockTopK(ratio, block)``: S2 §2.2 block-wise top-k. The flattened gradient is cut into blocks of
``block`` consecutive entries; the K = ceil(ratio·n_blocks) blocks of largest ℓ2 norm are sent whole. The
result is block-sparse, the shape S2's bitmap encodes well, and it is a contraction with δ = K/n_blocks in the
worst case (S2 Thm. 2: the kept blocks carry at least K/n_blocks of ‖g‖²).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sparsync.compress.base import (
    NO_CONTEXT,
    Context,
    SparsePayload,
    Sparsifier,
    check_positive_int,
    count_for,
    selected,
)


@dataclass(frozen=True, eq=False)
class BlockTopK(Sparsifier):
    """Keep the blocks of largest ℓ2 norm."""

    name: ClassVar[str] = "blocktopk"

    block: int = 64  # entries per block (the last block may be short)

    def __post_init__(self) -> None:
        super().__post_init__()  # ratio: the fraction of blocks kept
        check_positive_int(self.block, "block")

    def compress(self, tensor: torch.Tensor, ctx: Context = NO_CONTEXT) -> SparsePayload:
        flat = tensor.reshape(-1)
        n = flat.numel()
        nb = -(-n // self.block)
        sq = torch.nn.functional.pad(flat * flat, (0, nb * self.block - n)).reshape(nb, self.block)
        top = torch.topk(sq.sum(1), count_for(self.ratio, nb), sorted=False).indices
        pos = (top.unsqueeze(1) * self.block + torch.arange(self.block)).reshape(-1)
        return selected(flat, None, pos[pos < n], n)
