"""``FP16`` / ``BF16``: send the tensor in 16 bits, summed in 16 bits, cast back on arrival.

Works on sparse COO gradients too: their stored values are cast and the pairs go through ``sparse_allreduce``
(torch DDP's ``fp16_compress_hook`` and Horovod's fp16 compression call dense-only ops on a COO tensor and
crash on ``nn.Embedding(sparse=True)`` gradients).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from sparsync.buffers import fresh
from sparsync.collectives.tensor import coo_to_stream
from sparsync.compress import base
from sparsync.compress.aggregate import DENSE_SUM, SPARSE_SUM
from sparsync.compress.cast_allreduce import MIN_VALUES, CastPipeline
from sparsync.stream import SparseStream


@dataclass(frozen=True, eq=False)
class _Cast(base.Compressor):
    accepts_sparse: ClassVar[bool] = True
    wire_dtype: ClassVar[torch.dtype]

    def compress(self, tensor: torch.Tensor, ctx: base.Context = base.NO_CONTEXT) -> base.Payload:
        if not tensor.dtype.is_floating_point:
            raise ValueError(f"{self.name} compresses floating tensors, got {tensor.dtype}")
        if tensor.is_sparse:
            s = coo_to_stream(tensor)
            return base.SparsePayload(
                SparseStream(s.indices, s.values.to(self.wire_dtype), s.dim, row=s.row, validate=False)
            )
        # a cast is a fresh tensor (unless already in the wire dtype): the allreduce sums into it, no copy
        return base.DensePayload(tensor.to(self.wire_dtype), owned=tensor.dtype != self.wire_dtype)

    def aggregator(self, enc: base.Encoding) -> base.Aggregator[Any]:
        """A large float32 dense tensor goes through the chunked pipeline (``cast_allreduce``), any other dense
        one through one dense allreduce of its cast, a COO tensor's cast pairs through ``sparse_allreduce``."""
        x = enc.x
        if x.dtype == torch.float32 and not x.is_sparse and enc.world_size > 1 and enc.spec.numel >= MIN_VALUES:
            return CastPipeline(self.wire_dtype)
        return SPARSE_SUM if x.is_sparse else DENSE_SUM

    def decompress(self, payload: base.Payload, spec: base.TensorSpec) -> torch.Tensor:
        if isinstance(payload, base.SparsePayload):
            return base.sparse_to_tensor(payload, spec)
        assert isinstance(payload, base.DensePayload)
        if spec.dtype != torch.float32:
            return payload.values.to(spec.dtype).reshape(spec.shape)
        out = fresh(spec.numel, device=payload.values.device)  # fresh memory: huge pages make it cheap (host)
        return out.copy_(payload.values.reshape(-1)).view(spec.shape)


@dataclass(frozen=True, eq=False)
class FP16(_Cast):
    """IEEE half precision on the wire (values beyond ±65504 overflow to inf: scale the loss if needed)."""

    name: ClassVar[str] = "fp16"
    wire_dtype: ClassVar[torch.dtype] = torch.float16


@dataclass(frozen=True, eq=False)
class BF16(_Cast):
    """bfloat16 on the wire: fp32's range, 8 bits of mantissa."""

    name: ClassVar[str] = "bf16"
    wire_dtype: ClassVar[torch.dtype] = torch.bfloat16
