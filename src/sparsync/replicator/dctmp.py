"""DCT-MP (DCT, Gupta et al. KDD'21, §2.2 Algorithm 2): per-sample top-k masks for activations at a model
split, and the same mask for their gradients on the way back.

Choices where the paper is vague (docs/architecture.md, "Replicator"):
- η is the sparsity factor, the fraction of each row *dropped* (the paper's tables: "η = 95%" is 20x
  compression); each row keeps k = d - floor(d·η) entries (at least 1), so η = 0 keeps every entry.
- Exactly k entries per row, chosen by ``torch.topk`` of |x| (ties broken by topk), rather than the paper's
  ``|x| >= τ_i``: after a ReLU more than d·η entries of a row may be 0, τ_i is then 0 and the threshold rule
  would keep (and send) the whole row. A fixed k also makes the wire size known in advance.
- The mask travels as whichever is smaller: a bitmap (d bits per row) or the kept column indices (uint8 for
  d <= 256, int16 for d <= 32768, else int32). The backward pass sends only the k gradient values per row:
  the sender still holds the mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MASK_KINDS = ("none", "bitmap", "index")
_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


@dataclass(frozen=True)
class DCTMP:
    """DCT-MP compression of the tensors crossing a model split (DCT Alg. 2)."""

    eta: float  # sparsity factor: fraction of each sample's activations dropped, 0 <= eta < 1

    def __post_init__(self) -> None:
        if not (isinstance(self.eta, (int, float)) and 0.0 <= self.eta < 1.0):
            raise ValueError(f"DCTMP eta must lie in [0, 1) (fraction of each row dropped), got {self.eta!r}")

    def kept(self, d: int) -> int:
        """Entries kept per row of width d (Alg. 2 line 6: the threshold is the floor(d·η)-th smallest |x|)."""
        return max(1, d - math.floor(d * self.eta))


def index_dtype(d: int) -> torch.dtype:
    if d <= 256:
        return torch.uint8
    if d <= 32768:
        return torch.int16
    return torch.int32


def mask_kind(rows: int, d: int, k: int) -> str:
    """The cheaper mask encoding for a [rows, d] matrix keeping k per row ("none" when nothing is dropped)."""
    if k >= d:
        return "none"
    bitmap = math.ceil(rows * d / 8)
    index = rows * k * torch.empty((), dtype=index_dtype(d)).element_size()
    return "bitmap" if bitmap < index else "index"


def select(x2d: torch.Tensor, k: int) -> torch.Tensor:
    """Column indices (sorted, int64) of the k largest |x| in each row: Alg. 2 lines 4-8."""
    idx = torch.topk(x2d.detach().abs(), k, dim=1, sorted=False).indices
    return torch.sort(idx, dim=1).values


def encode_mask(idx: torch.Tensor, d: int, kind: str) -> torch.Tensor:
    """The mask of ``idx`` ([rows, k] sorted columns) as uint8 bytes."""
    rows = idx.shape[0]
    if kind == "none":
        return torch.empty(0, dtype=torch.uint8)
    if kind == "index":
        return idx.to(index_dtype(d)).reshape(-1).view(torch.uint8)
    bits = torch.zeros(rows * d + (-rows * d) % 8, dtype=torch.uint8)
    bits[(idx + torch.arange(rows).unsqueeze(1) * d).reshape(-1)] = 1
    return (bits.view(-1, 8) * _BITS).sum(1, dtype=torch.uint8)


def decode_mask(buf: torch.Tensor, rows: int, d: int, k: int, kind: str) -> torch.Tensor:
    """Inverse of ``encode_mask``: [rows, k] sorted int64 column indices."""
    if kind == "none":
        return torch.arange(d).expand(rows, d)
    if kind == "index":
        return buf.view(index_dtype(d)).to(torch.int64).view(rows, k)
    bits = (buf.unsqueeze(1) & _BITS).ne(0).reshape(-1)[: rows * d]
    flat = torch.nonzero(bits, as_tuple=True)[0]
    return (flat % d).view(rows, k)


def mask_nbytes(rows: int, d: int, k: int, kind: str) -> int:
    if kind == "none":
        return 0
    if kind == "index":
        return rows * k * torch.empty((), dtype=index_dtype(d)).element_size()
    return math.ceil(rows * d / 8)


def gather_rows(x2d: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The kept values, [rows, k] (Alg. 2 line 10: X ⊙ M, stored compactly)."""
    return torch.gather(x2d, 1, idx)


def scatter_rows(values: torch.Tensor, idx: torch.Tensor, d: int) -> torch.Tensor:
    """Dense [rows, d] with ``values`` under the mask and exact zeros elsewhere."""
    out = torch.zeros(values.shape[0], d, dtype=values.dtype)
    return out.scatter_(1, idx, values)
