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

from sparsync.compress import base
from sparsync.compress.sparsifier import Sparsifier


@dataclass(frozen=True, eq=False)
class TopK(Sparsifier):
    """Keep the largest-magnitude entries (of the stored entries, for a sparse COO input)."""

    name: ClassVar[str] = "topk"
    accepts_sparse: ClassVar[bool] = True

    bucket: int | None = None  # None: exact top-k over the whole tensor; else top ceil(ratio·bucket) per bucket

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bucket is not None:
            base.check_positive_int(self.bucket, "bucket")

    def compress(self, tensor: torch.Tensor, ctx: base.Context = base.NO_CONTEXT) -> base.SparsePayload:
        values, indices = base.flat_values(tensor)
        n = values.numel()
        if self.bucket is None or n <= self.bucket:
            pos = largest(values.abs(), base.count_for(self.ratio, n))
        else:
            pos = _bucket_topk(values.abs(), self.bucket, base.count_for(self.ratio, self.bucket))
        return base.selected(values, indices, pos, tensor.numel())


SAMPLE = 1 << 16  # magnitudes sampled to pick the candidates' threshold (``largest``)


def largest(mag: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the k largest of ``mag`` (≥ 0, 1-D), unsorted: ``torch.topk``'s, found among candidates.

    ``torch.topk`` of a large k is slow on CPU (a heap over every value; docs/results_design.md). Instead: a
    threshold τ from a strided sample of SAMPLE magnitudes, at the sample's 1 - 2k/n quantile; the candidates
    |x| ≥ τ (one vectorized pass, about 2k of them); ``torch.topk`` of the candidates. Exact whenever there
    are at least k candidates, since then the k-th largest value is ≥ τ and every value above it is a
    candidate; otherwise (an unlucky sample, or NaN, which compares false and which topk ranks first) the
    full ``torch.topk``."""
    n = mag.numel()
    if n < 4 * SAMPLE or 8 * k > n:  # small, or a large k: the heap is cheap enough
        return torch.topk(mag, k, sorted=False).indices
    sample = mag[:: n // SAMPLE]
    rank = max(1, int(sample.numel() * (1 - 2 * k / n)))  # kthvalue's k-th smallest: about 2k of n above it
    tau = kth_smallest(sample, rank)
    cand = torch.nonzero(mag >= tau, as_tuple=True)[0]
    if cand.numel() < k or cand.numel() > n // 4 or not bool(torch.isfinite(mag.sum())):  # NaN: topk's order
        return torch.topk(mag, k, sorted=False).indices
    return cand[torch.topk(mag[cand], k, sorted=False).indices]


def kth_smallest(t: torch.Tensor, rank: int, by_topk: bool | None = None) -> torch.Tensor:
    """The ``rank``-th smallest of ``t`` (1-D), a 0-d tensor on its device: ``kthvalue`` on the host, the
    smallest of ``topk`` elsewhere (``by_topk``; CUDA's ``kthvalue`` sorts: 7.6 ns per value on an H200,
    docs/gpu.md)."""
    if not (t.device.type != "cpu" if by_topk is None else by_topk):
        return t.kthvalue(rank).values
    return torch.topk(t, t.numel() - rank + 1, sorted=False).values.min()


def _bucket_topk(mag: torch.Tensor, bucket: int, k: int) -> torch.Tensor:
    """Positions of the k largest of every bucket; the short last bucket is padded with -1 (never chosen
    before a real entry, since magnitudes are >= 0) and its padding positions dropped."""
    n = mag.numel()
    nb = -(-n // bucket)
    pad = nb * bucket - n
    m = torch.nn.functional.pad(mag, (0, pad), value=-1.0) if pad else mag
    top = torch.topk(m.reshape(nb, bucket), k, dim=1, sorted=False).indices
    pos = (top + torch.arange(nb, device=mag.device).unsqueeze(1) * bucket).reshape(-1)
    return pos[pos < n] if pad else pos
