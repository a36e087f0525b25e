"""The ``dense`` algorithm: densify and run torch's allreduce (gloo: ring), pipelined for large sparse-stored
inputs (``costmodel.DENSE_PIPELINE_MIN``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from sparsync.collectives.comm import Comm
from sparsync.costmodel import (
    DENSE_CHUNKS,
    DENSE_PIPELINE_MIN,
    AlgorithmEntry,
    LinkModel,
    Problem,
    fresh_cost,
    share,
    terms,
)
from sparsync.stream import SparseStream

if TYPE_CHECKING:
    from sparsync.collectives.meta import Meta


def dense_allreduce(comm: Comm, stream: SparseStream) -> SparseStream:
    """Densify and run torch's allreduce (gloo: ring, 2(P-1)/P·N values per rank each way)."""
    if stream.is_dense or stream.dim < DENSE_PIPELINE_MIN:
        buf = stream.to_dense().clone() if stream.is_dense else stream.to_dense()
        with comm.phase("dense_allreduce"):
            comm.run_collective("dense all_reduce", dist.all_reduce, buf)
        calls = 1
    else:
        buf, calls = _pipelined_dense(comm, stream), DENSE_CHUNKS
    comm.count_ring_allreduce(buf.numel() * buf.element_size(), calls)
    return SparseStream(None, buf, stream.dim, row=stream.row, validate=False)


def _pipelined_dense(comm: Comm, stream: SparseStream) -> torch.Tensor:
    """Densify chunk by chunk, starting each chunk's allreduce before filling the next, so the densify of chunk
    i+1 overlaps the transfer of chunk i (same result and bytes as one allreduce of the whole buffer; every rank
    cuts at the same offsets whatever its input). Timings against gloo's allreduce of a dense buffer:
    docs/results_design.md."""
    R, b, idx, vals = stream.num_rows, stream.row, stream.indices, stream.rows2d
    assert idx is not None
    buf = torch.empty(stream.dim, dtype=stream.dtype, device=stream.device)
    rows2d = buf.view(R, b)
    bounds = [R * c // DENSE_CHUNKS for c in range(DENSE_CHUNKS + 1)]  # in rows
    cuts = torch.searchsorted(idx, torch.tensor(bounds, dtype=idx.dtype, device=idx.device)).tolist()
    works = []
    with comm.phase("dense_allreduce"):
        for c in range(DENSE_CHUNKS):
            part = rows2d[bounds[c] : bounds[c + 1]]
            part.zero_()
            lo, hi = cuts[c], cuts[c + 1]
            part[idx[lo:hi].to(torch.int64) - bounds[c]] = vals[lo:hi]
            works.append(comm.start_collective("dense all_reduce", dist.all_reduce, part))
        comm.wait_collectives("dense all_reduce", works)
    return buf


def run(comm: Comm, stream: SparseStream, meta: Meta, partition: str) -> SparseStream:
    """The registry's runner: the metadata and partition are not needed."""
    return dense_allreduce(comm, stream)


def predict_time(p: Problem, link: LinkModel) -> float:
    """gloo's ring: 2(P-1) steps moving 2(P-1)/P of the dense vector, after a densify of sparse-stored inputs."""
    P, N, a, b_ring, _ = terms(p, link)
    # A rank whose input is stored sparse (nnz below delta) densifies it first: one scatter per pair, the
    # slowest rank setting the pace (the scatter term predicts the measured difference to gloo's allreduce of
    # an already dense buffer: docs/results_design.md). From
    # DENSE_PIPELINE_MIN elements the densify runs chunk by chunk under the transfers: the first chunk's shows.
    exposed = 1 / DENSE_CHUNKS if N >= DENSE_PIPELINE_MIN else 1.0
    densify = exposed * max((p.per_row(link.gamma_scatter, link) * n for n in p.nnz if n < p.delta), default=0.0)
    return (
        2 * (P - 1) * a
        + b_ring * 2 * (P - 1) / P * N * p.value_bytes
        + (link.gamma_dense + fresh_cost(link)) * N * p.row  # a fresh buffer (densified or copied), one pass
        + densify
    )


def predict_bytes(p: Problem) -> float:
    return 4 * share(p) * p.dim * p.value_bytes


# SparCML §3's dense switch.
ENTRY = AlgorithmEntry("dense", code=5, simplicity=1, time=predict_time, nbytes=predict_bytes, runner=run)
