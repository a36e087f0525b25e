"""SSAR_Split_AllGather and DSAR_Split_AllGather: SparCML §4.1, "The Bandwidth Dominated Case" and
"The Dynamic Case".

Split phase (shared): the dimension N is cut into P contiguous partitions of ceil(N/P) entries (the last ones
shorter, or empty when N < P: the paper assumes P | N, we pad instead); every rank sends each partition of its
stream directly to the partition's owner (per-block headers, then payloads, each with all receives posted
before the sends: the paper's direct sparse sends), and the owner sums what it received.

- SSAR: the owners' partial results are gathered by a sparse allgather (recursive doubling) and concatenated,
  the partitions being disjoint (§3).
- DSAR: each owner densifies its partition and a dense allgather (torch ``all_gather_into_tensor``) finishes.

A rank whose input is already dense sends its blocks dense (the format bit travels in the header), so a full
rank never pays index bytes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sparsync.collectives._comm import (
    HEADER_WORDS,
    Comm,
    payload_nbytes,
    payload_of,
    stream_from_payload,
)
from sparsync.collectives._fold import allgather_blocks, allgather_fixed
from sparsync.stream import SparseStream, concat_disjoint, sum_streams

# torch 2.13 renamed all_gather_into_tensor; keep working on older releases.
_ALLGATHER_SINGLE = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def partition_bounds(dim: int, parts: int) -> list[int]:
    """P+1 boundaries of the split: partitions of ceil(N/P) entries, trailing ones short or empty."""
    chunk = -(-dim // parts)
    return [min(j * chunk, dim) for j in range(parts + 1)]


def split_reduce(comm: Comm, stream: SparseStream) -> SparseStream | None:
    """The split phase: this rank's partition of the global sum (None when its partition is empty)."""
    P, rank, dim, dtype = comm.size, comm.rank, stream.dim, stream.dtype
    bounds = partition_bounds(dim, P)
    blocks = [stream.slice(bounds[j], bounds[j + 1]) if bounds[j] < bounds[j + 1] else None for j in range(P)]
    headers = torch.zeros(P, HEADER_WORDS, dtype=torch.int64)
    for j, b in enumerate(blocks):
        if b is not None:
            headers[j, 0], headers[j, 1] = int(b.is_dense), b.nnz
    with comm.phase("split_headers"):
        got = comm.alltoallv(list(headers.unbind(0)), [HEADER_WORDS] * P, torch.int64)
        headers_in = torch.stack(got)
    lo, hi = bounds[rank], bounds[rank + 1]
    in_sizes = [
        payload_nbytes(bool(headers_in[j, 0]), int(headers_in[j, 1]), hi - lo, dtype) if hi > lo else 0
        for j in range(P)
    ]
    out_payloads = [payload_of(b) if b is not None else torch.empty(0, dtype=torch.uint8) for b in blocks]
    with comm.phase("split_payload"):
        received = comm.alltoallv(out_payloads, in_sizes, torch.uint8)
    if hi == lo:
        return None
    with comm.phase("split_sum"):
        parts = [
            stream_from_payload(received[j], bool(headers_in[j, 0]), int(headers_in[j, 1]), hi - lo, dtype)
            for j in range(P)
        ]
        return sum_streams(parts)


def ssar_split_allgather(comm: Comm, stream: SparseStream) -> SparseStream:
    if comm.size == 1:
        return stream
    P, dim, dtype = comm.size, stream.dim, stream.dtype
    mine = split_reduce(comm, stream)
    bounds = partition_bounds(dim, P)
    with comm.phase("allgather_sizes"):
        hdr = torch.tensor([int(mine.is_dense), mine.nnz] if mine is not None else [0, 0], dtype=torch.int64)
        table = allgather_fixed(comm, hdr)
    sizes = [
        payload_nbytes(bool(table[j, 0]), int(table[j, 1]), bounds[j + 1] - bounds[j], dtype)
        if bounds[j + 1] > bounds[j]
        else 0
        for j in range(P)
    ]
    with comm.phase("allgather_payload"):
        blocks = allgather_blocks(
            comm, payload_of(mine) if mine is not None else torch.empty(0, dtype=torch.uint8), sizes
        )
    with comm.phase("concat"):
        parts, offsets = [], []
        for j in range(P):
            if bounds[j + 1] > bounds[j]:
                n = bounds[j + 1] - bounds[j]
                parts.append(stream_from_payload(blocks[j], bool(table[j, 0]), int(table[j, 1]), n, dtype))
                offsets.append(bounds[j])
        return concat_disjoint(parts, offsets, dim)


def dsar_split_allgather(comm: Comm, stream: SparseStream) -> SparseStream:
    if comm.size == 1:
        return stream.densified()
    P, dim, dtype = comm.size, stream.dim, stream.dtype
    mine = split_reduce(comm, stream)
    chunk = -(-dim // P)
    local = torch.zeros(chunk, dtype=dtype)
    if mine is not None:
        local[: mine.dim] = mine.to_dense()
    out = torch.empty(chunk * P, dtype=dtype)
    with comm.phase("dense_allgather"):
        comm.run_collective("dense allgather", _ALLGATHER_SINGLE, out, local)
        nb = chunk * local.element_size() * (P - 1)
        comm.count_collective(nb, nb, P - 1)
    return SparseStream(None, out[:dim], dim, validate=False)
