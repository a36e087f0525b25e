"""``TopK(ratio)``: the k = ceil(ratio·n) entries of largest magnitude; ``TopK(ratio, bucket=512)``: the
ceil(ratio·bucket) largest of every bucket of consecutive entries (SparCML §6.1, which selects "the biggest
elements in magnitude" per bucket of 512 so the selection parallelises; we select exactly, not randomised).

A contraction in the sense of Stich et al. (2018) Def. 2.1, the property DCT §2.1 relies on:
‖x - topk(x)‖² ≤ (1 - k/n)‖x‖². Biased: use it with error feedback.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sparsync.compress.base import (
    NO_CONTEXT,
    Compressor,
    Context,
    SparsePayload,
    TensorSpec,
    check_positive_int,
    check_ratio,
    count_for,
    flat_values,
    selected,
    sparse_to_tensor,
)


@dataclass(frozen=True, eq=False)
class TopK(Compressor):
    """Keep the largest-magnitude entries (of the stored entries, for a sparse COO input)."""

    name: ClassVar[str] = "topk"
    accepts_sparse: ClassVar[bool] = True

    ratio: float  # fraction of entries kept, in (0, 1]
    bucket: int | None = None  # None: exact top-k over the whole tensor; else top ceil(ratio·bucket) per bucket

    def __post_init__(self) -> None:
        check_ratio(self.ratio)
        if self.bucket is not None:
            check_positive_int(self.bucket, "bucket")

    def compress(self, tensor: torch.Tensor, ctx: Context = NO_CONTEXT) -> SparsePayload:
        values, indices = flat_values(tensor)
        n = values.numel()
        if self.bucket is None or n <= self.bucket:
            k = count_for(self.ratio, n)
            pos = torch.topk(values.abs(), k, sorted=False).indices
        else:
            pos = _bucket_topk(values.abs(), self.bucket, count_for(self.ratio, self.bucket))
        return selected(values, indices, pos, tensor.numel())

    def decompress(self, payload: SparsePayload, spec: TensorSpec) -> torch.Tensor:
        return sparse_to_tensor(payload, spec)


def _bucket_topk(mag: torch.Tensor, bucket: int, k: int) -> torch.Tensor:
    """Positions of the k largest of every bucket; the short last bucket is padded with -1 (never chosen
    before a real entry, since magnitudes are >= 0) and its padding positions dropped."""
    n = mag.numel()
    nb = -(-n // bucket)
    pad = nb * bucket - n
    m = torch.nn.functional.pad(mag, (0, pad), value=-1.0) if pad else mag
    top = torch.topk(m.reshape(nb, bucket), k, dim=1, sorted=False).indices
    pos = (top + torch.arange(nb).unsqueeze(1) * bucket).reshape(-1)
    return pos[pos < n] if pad else pos
