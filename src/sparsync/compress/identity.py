"""``Identity``: no compression. Dense tensors go through one plain dense allreduce, sparse COO tensors through
``sparse_allreduce``; every other compressor's path is checked against this one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sparsync.collectives.tensor import coo_to_stream
from sparsync.compress.base import (
    NO_CONTEXT,
    Compressor,
    Context,
    DensePayload,
    Payload,
    SparsePayload,
    TensorSpec,
    sparse_to_tensor,
)


@dataclass(frozen=True, eq=False)
class Identity(Compressor):
    """Sends the tensor as it is."""

    name: ClassVar[str] = "identity"
    accepts_sparse: ClassVar[bool] = True
    unbiased: ClassVar[bool] = True

    def compress(self, tensor: torch.Tensor, ctx: Context = NO_CONTEXT) -> Payload:
        if tensor.is_sparse:
            return SparsePayload(coo_to_stream(tensor))
        return DensePayload(tensor)

    def decompress(self, payload: Payload, spec: TensorSpec) -> torch.Tensor:
        if isinstance(payload, SparsePayload):
            return sparse_to_tensor(payload, spec)
        assert isinstance(payload, DensePayload)
        return payload.values.to(spec.dtype).reshape(spec.shape)
