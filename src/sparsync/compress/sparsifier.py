"""``Sparsifier``: the base of the compressors that keep part of the entries (top-k, threshold, random-k, block
top-k) and send them as a sparse stream through ``sparse_allreduce`` (SparCML §4)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sparsync.compress.aggregate import SPARSE_SUM
from sparsync.compress.base import (
    Aggregator,
    Compressor,
    Encoding,
    SparsePayload,
    TensorSpec,
    check_ratio,
    sparse_to_tensor,
)


@dataclass(frozen=True, eq=False)
class Sparsifier(Compressor):
    """A compressor that keeps part of the entries, ``ratio`` of them (or of blocks), and sends them as a sparse
    stream through ``sparse_allreduce``: top-k, threshold, random-k, block top-k. Subclasses choose the entries
    (``compress``); the ratio check, the aggregation and the decompression are theirs in common."""

    ratio: float  # fraction kept, in (0, 1]

    def __post_init__(self) -> None:
        check_ratio(self.ratio)

    @property
    def per_tensor(self) -> bool:
        """Whether it selects within each tensor, so that a DDP bucket of such gradients goes as one sparse
        allreduce of per-parameter selections (``bucket_sparse``); False: it selects over the bucket's flat
        buffer at once (``TopK(scope="bucket")``)."""
        return True

    def aggregator(self, enc: Encoding) -> Aggregator[Any]:
        return SPARSE_SUM

    def decompress(self, payload: SparsePayload, spec: TensorSpec) -> torch.Tensor:
        return sparse_to_tensor(payload, spec)
