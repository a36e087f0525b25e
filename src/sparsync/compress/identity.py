"""``Identity``: no compression. Dense tensors go through one plain dense allreduce, sparse COO tensors through
``sparse_allreduce``; every other compressor's path is checked against this one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from sparsync.collectives.tensor import coo_to_stream
from sparsync.compress import base
from sparsync.compress.aggregate import DENSE_SUM, SPARSE_SUM


@dataclass(frozen=True, eq=False)
class Identity(base.Compressor):
    """Sends the tensor as it is."""

    name: ClassVar[str] = "identity"
    accepts_sparse: ClassVar[bool] = True
    unbiased: ClassVar[bool] = True

    def compress(self, tensor: torch.Tensor, ctx: base.Context = base.NO_CONTEXT) -> base.Payload:
        if tensor.is_sparse:
            return base.SparsePayload(coo_to_stream(tensor))
        return base.DensePayload(tensor)

    def aggregator(self, enc: base.Encoding) -> base.Aggregator[Any]:
        return SPARSE_SUM if enc.x.is_sparse else DENSE_SUM

    def decompress(self, payload: base.Payload, spec: base.TensorSpec) -> torch.Tensor:
        if isinstance(payload, base.SparsePayload):
            return base.sparse_to_tensor(payload, spec)
        assert isinstance(payload, base.DensePayload)
        return payload.values.to(spec.dtype).reshape(spec.shape)
