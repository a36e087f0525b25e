"""``BlockTopK(ratio, block)``: S2 §2.2 block-wise top-k. The flattened gradient is cut into blocks of
``block`` consecutive entries; the K = ceil(ratio·n_blocks) blocks of largest ℓ2 norm are sent whole. The
result is block-sparse, the shape S2's bitmap encodes well, and it is a contraction with δ = K/n_blocks in the
worst case (S2 Thm. 2: the kept blocks carry at least K/n_blocks of ‖g‖²).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sparsync.compress import base
from sparsync.compress.sparsifier import Sparsifier


@dataclass(frozen=True, eq=False)
class BlockTopK(Sparsifier):
    """Keep the blocks of largest ℓ2 norm."""

    name: ClassVar[str] = "blocktopk"

    block: int = 64  # entries per block (the last block may be short)

    def __post_init__(self) -> None:
        super().__post_init__()  # ratio: the fraction of blocks kept
        base.check_positive_int(self.block, "block")

    def compress(self, tensor: torch.Tensor, ctx: base.Context = base.NO_CONTEXT) -> base.SparsePayload:
        flat = tensor.reshape(-1)
        n = flat.numel()
        nb = -(-n // self.block)
        sq = torch.nn.functional.pad(flat * flat, (0, nb * self.block - n)).reshape(nb, self.block)
        top = torch.topk(sq.sum(1), base.count_for(self.ratio, nb), sorted=False).indices
        pos = (top.unsqueeze(1) * self.block + torch.arange(self.block, device=flat.device)).reshape(-1)
        return base.selected(flat, None, pos[pos < n], n)
