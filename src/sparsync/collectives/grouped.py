"""``grouped_allreduce(tensors)``: several tensors summed by one sparse allreduce, so one metadata round.

Horovod's tensor fusion (``hvd.grouped_allreduce``) and DDP's buckets, for a mix of sparse and dense gradients:
the COO tensors (one row width b = the product of their dense dims, one dtype) become one row-sparse stream,
each at its own row offset, and the dense tensors are packed behind them into rows of b values (the last row
zero-padded). Every rank holds every dense row, so their sum is the dense sum; each COO result keeps the union
of its rows, as ``allreduce`` does.

Why (``sparsync demo``): a model with an embedding and a small MLP paid two calls per step, each
with its own metadata round, where DDP overlaps its buckets with the backward pass. Grouped, one call carries
both, and when the payloads fit the eager protocol (``meta``) the whole step's reduction is one allgather.
The choice of algorithm (auto) prices the fused stream as one problem: dense rows count as rows every rank
touched, so a large dense part pushes auto toward the split algorithms (whose bytes for it equal a ring
allreduce's), never toward densifying the embeddings.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sparsync.collectives.allreduce import CallOptions, refuse, start_allreduce
from sparsync.collectives.comm import Comm
from sparsync.collectives.meta import BadIndex
from sparsync.collectives.tensor import _coo_rows, _union_rows, stream_to_coo
from sparsync.handle import Work
from sparsync.record import CommLog
from sparsync.stream import SparseStream, index_dtype_for


@dataclass(frozen=True)
class _Layout:
    """Where each tensor sits in the fused stream: sparse tensors' rows at ``offsets``, then the dense block."""

    row: int  # values per row
    offsets: tuple[int, ...]  # first row of each sparse tensor (in the order of ``sparse``)
    sparse: tuple[int, ...]  # positions (in the caller's list) of the sparse tensors
    dense: tuple[int, ...]  # positions of the dense tensors, packed in this order
    dense_base: int  # first row of the dense block
    dense_rows: int
    total_rows: int


def _layout(tensors: Sequence[torch.Tensor]) -> _Layout:
    if len(tensors) == 0:
        raise ValueError("grouped_allreduce needs at least one tensor")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"grouped_allreduce: item {i} is a {type(t).__name__}, not a torch.Tensor")
        if not t.is_sparse and t.layout != torch.strided:
            raise ValueError(f"grouped_allreduce: tensor {i} has layout {t.layout}; strided or sparse COO only")
        if t.numel() == 0:
            raise ValueError(f"grouped_allreduce: tensor {i} is empty (shape {tuple(t.shape)})")
    for i, t in enumerate(tensors):
        if not t.is_floating_point():
            raise ValueError(f"grouped_allreduce: tensor {i} has dtype {t.dtype}; floating tensors only")
    devices = sorted({str(t.device) for t in tensors})
    if len(devices) > 1:
        raise ValueError(f"grouped_allreduce: tensors are on devices {devices}; group tensors of one device")
    dtypes = sorted({str(t.dtype) for t in tensors})
    if len(dtypes) > 1:
        raise ValueError(f"grouped_allreduce: tensors have dtypes {dtypes}; group tensors of one dtype")
    sparse = tuple(i for i, t in enumerate(tensors) if t.is_sparse)
    dense = tuple(i for i, t in enumerate(tensors) if not t.is_sparse)
    widths = sorted({math.prod(tensors[i].shape[tensors[i].sparse_dim() :]) for i in sparse})
    if len(widths) > 1:
        raise ValueError(
            f"grouped_allreduce: sparse tensors have row widths {widths} (product of their dense dims); "
            "group tensors of one row width"
        )
    b = widths[0] if widths else 1
    offsets, at = [], 0
    for i in sparse:
        offsets.append(at)
        at += math.prod(tensors[i].shape[: tensors[i].sparse_dim()])
    dense_rows = -(-sum(tensors[i].numel() for i in dense) // b)
    return _Layout(b, tuple(offsets), sparse, dense, at, dense_rows, at + dense_rows)


def _fuse(tensors: Sequence[torch.Tensor], lay: _Layout) -> tuple[SparseStream, torch.Tensor, BadIndex | None]:
    """The fused stream, its row ids (int64), and the first out-of-range index of any sparse tensor."""
    b, dtype, device = lay.row, tensors[0].dtype, tensors[0].device
    idx: list[torch.Tensor] = []
    vals: list[torch.Tensor] = []
    for i, off in zip(lay.sparse, lay.offsets, strict=True):
        s, bad = _coo_rows(tensors[i], tensor=i)
        if bad is not None:
            placeholder = SparseStream.empty(lay.total_rows * b, dtype, row=b, device=device)
            return placeholder, torch.empty(0, dtype=torch.int64, device=device), bad
        assert s.indices is not None  # _coo_rows returns sparse streams
        idx.append(s.indices.to(torch.int64) + off)
        vals.append(s.values)
    if lay.dense:
        flat = [tensors[i].detach().reshape(-1) for i in lay.dense]
        pad = lay.dense_rows * b - sum(f.numel() for f in flat)
        vals += [*flat, torch.zeros(pad, dtype=dtype, device=device)] if pad else flat
        idx.append(torch.arange(lay.dense_base, lay.total_rows, dtype=torch.int64, device=device))
    rows = torch.cat(idx) if idx else torch.empty(0, dtype=torch.int64, device=device)  # sorted: offsets increase
    values = torch.cat(vals) if vals else torch.empty(0, dtype=dtype, device=device)
    stream = SparseStream(
        rows.to(index_dtype_for(lay.total_rows)), values, lay.total_rows * b, row=b, validate=False
    )
    return stream, rows, None


def _split(
    comm: Comm, s: SparseStream, mine: torch.Tensor, tensors: Sequence[torch.Tensor], lay: _Layout
) -> list[torch.Tensor]:
    """The fused sum back into one tensor per input, of the input's kind and shape."""
    b = lay.row
    out: list[torch.Tensor | None] = [None] * len(tensors)
    ends = [*lay.offsets[1:], lay.dense_base][: len(lay.offsets)]
    if s.is_dense:
        v2 = s.values.view(lay.total_rows, b)
        union = _union_rows(comm, mine, s)
        for i, lo, hi in zip(lay.sparse, lay.offsets, ends, strict=True):
            sub = SparseStream(None, v2[lo:hi].reshape(-1), (hi - lo) * b, row=b, validate=False)
            rows = union[(union >= lo) & (union < hi)] - lo
            t = tensors[i]
            out[i] = stream_to_coo(sub, t.shape, t.sparse_dim(), rows)
        block = v2[lay.dense_base :].reshape(-1)
    else:
        assert s.indices is not None
        ids = s.indices.to(torch.int64)
        r2 = s.rows2d
        bounds = torch.tensor([*lay.offsets, lay.dense_base, lay.total_rows], device=ids.device)
        cuts = torch.searchsorted(ids, bounds).tolist()
        for k, (i, lo, hi) in enumerate(zip(lay.sparse, lay.offsets, ends, strict=True)):
            a, z = cuts[k], cuts[k + 1]
            sub = SparseStream(
                (ids[a:z] - lo).to(index_dtype_for(hi - lo)), r2[a:z].reshape(-1), (hi - lo) * b, row=b,
                validate=False,
            )  # fmt: skip
            t = tensors[i]
            out[i] = stream_to_coo(sub, t.shape, t.sparse_dim())
        a, z = cuts[-2], cuts[-1]
        dense_block = torch.zeros(lay.dense_rows, b, dtype=s.dtype, device=s.device)
        dense_block[ids[a:z] - lay.dense_base] = r2[a:z]
        block = dense_block.reshape(-1)
    at = 0
    for i in lay.dense:
        n = tensors[i].numel()
        out[i] = block[at : at + n].reshape(tensors[i].shape).clone()
        at += n
    return [t for t in out if t is not None]


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    *,
    algorithm: str = "auto",
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    log: CommLog | None = None,
    **kwargs: Any,
) -> list[torch.Tensor] | Work[list[torch.Tensor]]:
    """Sum of each tensor over the group, all in one sparse allreduce (module doc): dense tensors in, dense
    out; sparse COO in, coalesced COO out holding every row any rank passed. Tensors: one dtype, and the COO
    ones one row width (the product of their dense dims). Every rank passes the same list (shapes, layouts,
    order). Options as ``allreduce`` (``algorithm``, ``partition``, ``link``, ``policy``, ``timeout``, ...);
    the CommRecord describes the fused stream. An out-of-range index on any rank raises the same ValueError,
    naming the tensor, on every rank. Does not modify the inputs.

    Example::

        >>> emb_sum, w_sum = grouped_allreduce([emb.weight.grad, fc.weight.grad])   # one call, one round
    """
    try:
        lay = _layout(tensors)
        stream, mine, bad = _fuse(tensors, lay)
    except (TypeError, ValueError) as e:  # every rank raises it, not only this one
        refuse(group, "sparse_allreduce", e, kwargs.get("timeout"), async_op)

    def finish(comm: Comm, s: SparseStream) -> list[torch.Tensor]:
        return _split(comm, s, mine, tensors, lay)

    shapes = repr([("sparse_coo" if t.is_sparse else "strided", tuple(t.shape)) for t in tensors])
    opts = CallOptions(algorithm=algorithm, **kwargs)
    shape = (shapes, (len(tensors),))
    return start_allreduce(stream, finish, opts, group=group, async_op=async_op, log=log, bad=bad, shape=shape)
