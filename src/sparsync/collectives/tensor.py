"""``allreduce(tensor)``: dense tensors and torch sparse COO tensors in, the same kind out."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from sparsync.collectives.allreduce import sparse_allreduce
from sparsync.handle import Work
from sparsync.record import CommLog
from sparsync.stream import SparseStream, index_dtype_for


def coo_to_stream(t: torch.Tensor) -> SparseStream:
    """Flatten a COO tensor (sparse dims, then dense dims, as ``nn.Embedding(sparse=True)`` gradients are)."""
    t = t.coalesce()
    shape = t.shape
    sd = t.sparse_dim()
    dense_shape = shape[sd:]
    row_stride = int(torch.tensor(dense_shape).prod()) if len(dense_shape) else 1
    strides = torch.tensor([int(torch.tensor(shape[i + 1 : sd]).prod()) for i in range(sd)], dtype=torch.int64)
    rows = (t.indices().to(torch.int64) * strides[:, None]).sum(0)  # linear index over the sparse dims
    lin = (rows[:, None] * row_stride + torch.arange(row_stride)).reshape(-1)
    return SparseStream(lin.to(index_dtype_for(t.numel())), t.values().reshape(-1), t.numel())


def stream_to_coo(s: SparseStream, shape: torch.Size, sparse_dim: int) -> torch.Tensor:
    """Inverse of ``coo_to_stream``: rows touched by any entry are kept, as torch's own sparse sum keeps them."""
    dense_shape = shape[sparse_dim:]
    row_stride = int(torch.tensor(dense_shape).prod()) if len(dense_shape) else 1
    if s.indices is None:
        nz = s.values.reshape(-1, row_stride).ne(0).any(1)
        rows = torch.nonzero(nz, as_tuple=True)[0]
        vals = s.values.reshape(-1, row_stride)[rows]
    else:
        lin = s.indices.to(torch.int64)
        rows, inverse = torch.unique(lin // row_stride, return_inverse=True)
        vals = torch.zeros(rows.numel(), row_stride, dtype=s.dtype)
        vals[inverse, lin % row_stride] = s.values
    idx = (
        torch.stack(torch.unravel_index(rows, tuple(shape[:sparse_dim])))
        if rows.numel()
        else (torch.empty(sparse_dim, 0, dtype=torch.int64))
    )
    return torch.sparse_coo_tensor(
        idx, vals.reshape(-1, *dense_shape), shape, is_coalesced=True, check_invariants=False
    )


def allreduce(
    tensor: torch.Tensor,
    *,
    algorithm: str = "auto",
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    log: CommLog | None = None,
    **kwargs: Any,
) -> torch.Tensor | Work[torch.Tensor]:
    """Sum of ``tensor`` over the group, of the same kind: dense in, dense out (same shape); sparse COO in,
    coalesced sparse COO out. Routed through ``sparse_allreduce`` (auto by default), so a mostly-zero
    dense tensor also travels sparse. Does not modify ``tensor``.

    Example::

        >>> g = emb.weight.grad                  # nn.Embedding(sparse=True)
        >>> g_sum = allreduce(g)                 # sparse COO, summed over ranks
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"allreduce takes a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_sparse:
        stream = coo_to_stream(tensor)
        shape, sd = tensor.shape, tensor.sparse_dim()

        def back(s: SparseStream) -> torch.Tensor:
            return stream_to_coo(s, shape, sd)
    elif tensor.layout == torch.strided:
        if tensor.numel() == 0:
            raise ValueError("allreduce of an empty tensor")
        stream = SparseStream.from_dense(tensor)
        shape = tensor.shape

        def back(s: SparseStream) -> torch.Tensor:
            return s.to_dense().reshape(shape)
    else:
        raise ValueError(f"allreduce supports strided and sparse COO tensors, got layout {tensor.layout}")
    if async_op:
        work = sparse_allreduce(stream, algorithm=algorithm, group=group, async_op=True, log=log, **kwargs)
        return work.then(back)
    return back(sparse_allreduce(stream, algorithm=algorithm, group=group, log=log, **kwargs))
