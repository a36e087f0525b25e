"""``FP16`` / ``BF16``: send the tensor in 16 bits, summed in 16 bits, cast back on arrival.

Works on sparse COO gradients too: their stored values are cast and the pairs go through ``sparse_allreduce``
(torch DDP's ``fp16_compress_hook`` and Horovod's fp16 compression call dense-only ops on a COO tensor and
crash on ``nn.Embedding(sparse=True)`` gradients).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sparsync.buffers import fresh
from sparsync.collectives.tensor import coo_to_stream
from sparsync.compress import base
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
