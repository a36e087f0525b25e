"""``allreduce(tensor)``: dense tensors and torch sparse COO tensors in, the same kind out.

A COO tensor with sparse dims S and dense dims D (``nn.Embedding(sparse=True)``: S = (rows,), D = (dim,)) is
sent as a row-sparse stream: one index per stored row of prod(D) values, built from the coalesced
tensor's indices and values without per-element work, and turned back into a coalesced COO tensor the same way.

The result keeps every row any rank passed, zero or not, as torch's own sparse allreduce does (a row that
cancels across ranks, or an explicit zero row, is still a row of the result, so optimizers like SparseAdam
step the same whatever the algorithm). A sparse result holds exactly that union; when the sum went dense
(SparCML §3) the union is recovered with one allreduce of a bitmap of R bits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from sparsync.collectives.allreduce import CallOptions, refuse, start_allreduce
from sparsync.collectives.comm import Comm
from sparsync.collectives.meta import BadIndex
from sparsync.handle import Work
from sparsync.record import CommLog
from sparsync.stream import SparseStream, index_dtype_for, merge_rows


def coo_to_stream(t: torch.Tensor) -> SparseStream:
    """Row-sparse stream of a COO tensor: one row per stored index of the sparse dims (rows of the dense dims'
    size, at least 1). Raises ValueError naming an out-of-range index."""
    stream, bad = _coo_rows(t)
    if bad is not None:
        raise ValueError(
            f"sparse tensor: index {bad.value} at position {bad.position} is out of range [0, {bad.rows})"
        )
    return stream


def _coo_rows(t: torch.Tensor, tensor: int = -1) -> tuple[SparseStream, BadIndex | None]:
    """(stream, None), or (an empty placeholder stream, the first out-of-range index) for a bad index
    (``tensor``: its number in a grouped call)."""
    shape, sd = t.shape, t.sparse_dim()
    if t.numel() == 0:
        raise ValueError(f"allreduce of an empty sparse tensor (shape {tuple(shape)})")
    b = math.prod(shape[sd:])
    R = math.prod(shape[:sd])
    if t.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"sparse tensor must have a floating dtype, got {t.dtype}")
    raw = t._indices() if not t.is_coalesced() else t.indices()
    for d in range(sd):  # coalesce() would fail (or worse) on out-of-range indices: check first
        bad = torch.nonzero((raw[d] < 0) | (raw[d] >= shape[d]), as_tuple=True)[0]
        if bad.numel():
            pos, value = int(bad[0]), int(raw[d, bad[0]])
            placeholder = SparseStream.empty(t.numel(), t.dtype, row=b, device=t.device)
            return placeholder, BadIndex(pos, value, shape[d], tensor)
    if sd == 1:
        rows = raw[0]
    else:
        steps = [math.prod(shape[i + 1 : sd]) for i in range(sd)]
        strides = torch.tensor(steps, dtype=torch.int64, device=t.device)
        rows = (raw * strides[:, None]).sum(0)  # linear row index over the sparse dims
    vals = t._values().reshape(-1, b)
    if not t.is_coalesced():
        rows, vals = merge_rows(rows, vals)  # faster than coalesce() (docs/results_design.md)
    return SparseStream(rows.to(index_dtype_for(R)), vals.reshape(-1), R * b, row=b, validate=False), None


def stream_to_coo(
    s: SparseStream, shape: torch.Size, sparse_dim: int, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse of ``coo_to_stream``: a coalesced COO tensor of ``shape``. A sparse stream keeps its rows; a
    dense one keeps ``rows`` when given, else its rows with any non-zero value. Element streams (row 1, as the
    compressors build) are grouped into rows of the dense dims' size."""
    dense_shape = shape[sparse_dim:]
    b = math.prod(dense_shape)
    if s.indices is None:
        v2 = s.values.reshape(-1, b)
        if rows is None:
            rows = torch.nonzero(v2.ne(0).any(1), as_tuple=True)[0]
        vals = v2[rows]
    elif s.row == b:
        rows, vals = s.indices.to(torch.int64), s.rows2d
    else:
        lin = s.elements().indices
        assert lin is not None
        lin = lin.to(torch.int64)
        rows, inverse = torch.unique(lin // b, return_inverse=True)
        vals = torch.zeros(rows.numel(), b, dtype=s.dtype, device=s.device)
        vals[inverse, lin % b] = s.values
    if sparse_dim == 1:
        idx = rows.to(torch.int64).reshape(1, -1)
    elif rows.numel():
        idx = torch.stack(torch.unravel_index(rows.to(torch.int64), tuple(shape[:sparse_dim])))
    else:
        idx = torch.empty(sparse_dim, 0, dtype=torch.int64, device=s.device)
    return torch.sparse_coo_tensor(
        idx, vals.reshape(-1, *dense_shape), shape, is_coalesced=True, check_invariants=False
    )


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool vector as int32 words, 32 flags per word (what gloo reduces with BOR: it has no uint8 BOR)."""
    packed = np.packbits(mask.numpy(), bitorder="little")
    words = np.zeros(-(-packed.size // 4) * 4, dtype=np.uint8)
    words[: packed.size] = packed
    return torch.from_numpy(words.view(np.int32))


def unpack_bits(words: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of ``pack_bits``: the first ``count`` flags."""
    return torch.from_numpy(np.unpackbits(words.numpy().view(np.uint8), count=count, bitorder="little")).bool()


def _union_rows(comm: Comm, mine: torch.Tensor, result: SparseStream) -> torch.Tensor:
    """Rows of a dense result that any rank passed: one allreduce (BOR) of a bitmap of R bits. Cheaper than
    scanning the dense result for non-zero rows (a 268 MB table's bitmap is 128 KB), and exact
    where a scan is not (rows that cancel, explicit zeros). NCCL has no BOR (transport.py): there one byte
    per row reduced with MAX, on the device (8x the bytes of the bitmap, no host round trip)."""
    R = result.num_rows
    if comm.exact:
        flags = torch.zeros(R, dtype=torch.uint8, device=comm.device)
        flags[mine.to(torch.int64)] = 1
        with comm.phase("union_rows"):
            comm.run_collective("union of rows", dist.all_reduce, flags, op=dist.ReduceOp.MAX)
        comm.count_ring_allreduce(R)
        return torch.nonzero(flags, as_tuple=True)[0]
    touched = torch.zeros(R, dtype=torch.bool)
    touched[mine.to(torch.int64).cpu()] = True
    bits = pack_bits(touched)  # R/8 bytes (one int32 per packed byte sent R/2 before); gloo: on the host
    with comm.phase("union_rows"):
        comm.run_collective("union of rows", dist.all_reduce, bits, op=dist.ReduceOp.BOR)
    comm.count_ring_allreduce(bits.numel() * 4)
    return torch.nonzero(unpack_bits(bits, R), as_tuple=True)[0].to(comm.device)


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
    coalesced sparse COO out, holding every row any rank passed (module doc). Routed through
    ``sparse_allreduce`` (auto by default; ``partition=`` and the other options pass through), so a
    mostly-zero dense tensor also travels sparse. Does not modify ``tensor``. An out-of-range index on any
    rank raises the same ValueError on every rank.

    Example::

        >>> g = emb.weight.grad                  # nn.Embedding(sparse=True)
        >>> g_sum = allreduce(g)                 # sparse COO, summed over ranks
    """
    try:
        stream, finish, bad, shape = _prepare(tensor, dense=algorithm == "dense")
    except (TypeError, ValueError) as e:  # every rank raises it, not only this one
        refuse(group, "sparse_allreduce", e, kwargs.get("timeout"), async_op)
    opts = CallOptions(algorithm=algorithm, **kwargs)
    return start_allreduce(stream, finish, opts, group=group, async_op=async_op, log=log, bad=bad, shape=shape)


Finish = Callable[[Comm, SparseStream], torch.Tensor]


def _prepare(
    tensor: torch.Tensor, *, dense: bool = False
) -> tuple[SparseStream, Finish, BadIndex | None, tuple[str, tuple[int, ...]]]:
    """The stream ``allreduce`` sends for ``tensor``, how to turn the sum back into a tensor, this rank's first
    out-of-range index, and the (layout, shape) checked across ranks. Raises for input no rank could send.
    ``dense`` (the caller forced the dense algorithm): a strided tensor is taken as a dense stream as it is,
    without the scan for its non-zeros (which the dense algorithm would only undo)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"allreduce takes a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_sparse:
        stream, bad = _coo_rows(tensor)
        shape, sd = tensor.shape, tensor.sparse_dim()
        mine = (
            stream.indices.to(torch.int64)
            if stream.indices is not None
            else torch.empty(0, dtype=torch.int64, device=tensor.device)
        )

        def finish(comm: Comm, s: SparseStream) -> torch.Tensor:
            rows = _union_rows(comm, mine, s) if s.is_dense else None
            return stream_to_coo(s, shape, sd, rows)

        return stream, finish, bad, ("sparse_coo", tuple(shape))
    if tensor.layout != torch.strided:
        raise ValueError(f"allreduce supports strided and sparse COO tensors, got layout {tensor.layout}")
    if tensor.numel() == 0:
        raise ValueError(f"allreduce of an empty tensor (shape {tuple(tensor.shape)})")
    if not tensor.is_floating_point():
        raise ValueError(f"allreduce needs a floating dtype, got {tensor.dtype} (shape {tuple(tensor.shape)})")
    dstream = SparseStream(None, tensor.reshape(-1), tensor.numel()) if dense else SparseStream.from_dense(tensor)
    dshape = tensor.shape

    def back(comm: Comm, s: SparseStream) -> torch.Tensor:
        return s.to_dense().reshape(dshape)

    return dstream, back, None, ("strided", tuple(dshape))
