"""SSAR_Split_AllGather and DSAR_Split_AllGather: SparCML §4.1, "The Bandwidth Dominated Case" and
"The Dynamic Case".

Split phase (shared): the R rows (elements of an element stream) are partitioned over the P ranks
(``partition.py``: contiguous ranges as in the paper, or the stride of the row id for skewed row-sparse data;
the paper assumes P | N, we allow empty or short partitions); every rank sends each partition of its stream
directly to the partition's owner (per-block headers, then payloads, each with all receives posted before the
sends: the paper's direct sparse sends), and the owner sums what it received.

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
    HEADER_BYTES,
    HEADER_WORDS,
    Comm,
    payload_nbytes,
    payload_of,
    stream_from_payload,
)
from sparsync.collectives._fold import allgather_blocks, allgather_fixed
from sparsync.collectives.partition import Partition
from sparsync.stream import SparseStream, sum_streams

# torch 2.13 renamed all_gather_into_tensor; keep working on older releases.
_ALLGATHER_SINGLE = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def partition_bounds(dim: int, parts: int) -> list[int]:
    """P+1 boundaries of the contiguous split: partitions of ceil(N/P) entries, trailing ones short or empty."""
    return Partition("range", dim, parts).bounds()


def split_reduce(comm: Comm, stream: SparseStream, part: Partition) -> SparseStream | None:
    """The split phase: this rank's partition of the global sum (None when its partition is empty).
    Records the bytes sent to each owner in ``comm.traffic.partition_bytes``."""
    P, rank, dtype, b = comm.size, comm.rank, stream.dtype, stream.row
    counts = part.counts()
    blocks = part.split(stream)
    headers = torch.zeros(P, HEADER_WORDS, dtype=torch.int64)
    for j, blk in enumerate(blocks):
        if blk is not None:
            headers[j, 0], headers[j, 1] = int(blk.is_dense), blk.nrows
    with comm.phase("split_headers"):
        got = comm.alltoallv(list(headers.unbind(0)), [HEADER_WORDS] * P, torch.int64)
        headers_in = torch.stack(got)
    n = counts[rank] * b
    in_sizes = [
        payload_nbytes(bool(headers_in[j, 0]), int(headers_in[j, 1]), n, dtype, b) if n else 0 for j in range(P)
    ]
    out_payloads = [payload_of(blk) if blk is not None else torch.empty(0, dtype=torch.uint8) for blk in blocks]
    comm.traffic.partition_bytes = [
        HEADER_BYTES + int(p.numel()) if j != rank else int(p.numel()) for j, p in enumerate(out_payloads)
    ]
    with comm.phase("split_payload"):
        received = comm.alltoallv(out_payloads, in_sizes, torch.uint8)
    if not n:
        return None
    with comm.phase("split_sum"):
        parts = [
            stream_from_payload(received[j], bool(headers_in[j, 0]), int(headers_in[j, 1]), n, dtype, b)
            for j in range(P)
        ]
        return sum_streams(parts)


def ssar_split_allgather(comm: Comm, stream: SparseStream, partition: str = "range") -> SparseStream:
    if comm.size == 1:
        return stream
    P, dim, dtype, b = comm.size, stream.dim, stream.dtype, stream.row
    part = Partition(partition, stream.num_rows, P)
    counts = part.counts()
    mine = split_reduce(comm, stream, part)
    with comm.phase("allgather_sizes"):
        hdr = torch.tensor([int(mine.is_dense), mine.nrows] if mine is not None else [0, 0], dtype=torch.int64)
        table = allgather_fixed(comm, hdr)
    sizes = [
        payload_nbytes(bool(table[j, 0]), int(table[j, 1]), counts[j] * b, dtype, b) if counts[j] else 0
        for j in range(P)
    ]
    with comm.phase("allgather_payload"):
        blocks = allgather_blocks(
            comm, payload_of(mine) if mine is not None else torch.empty(0, dtype=torch.uint8), sizes
        )
    with comm.phase("concat"):
        parts: list[SparseStream | None] = [
            stream_from_payload(blocks[j], bool(table[j, 0]), int(table[j, 1]), counts[j] * b, dtype, b)
            if counts[j]
            else None
            for j in range(P)
        ]
        return part.assemble(parts, dim, b, dtype)


def dsar_split_allgather(comm: Comm, stream: SparseStream, partition: str = "range") -> SparseStream:
    if comm.size == 1:
        return stream.densified()
    P, dim, dtype, b = comm.size, stream.dim, stream.dtype, stream.row
    part = Partition(partition, stream.num_rows, P)
    mine = split_reduce(comm, stream, part)
    chunk = max(part.counts())
    local = torch.zeros(chunk * b, dtype=dtype)
    if mine is not None:
        local[: mine.dim] = mine.to_dense()
    out = torch.empty(chunk * b * P, dtype=dtype)
    with comm.phase("dense_allgather"):
        comm.run_collective("dense allgather", _ALLGATHER_SINGLE, out, local)
        nb = chunk * b * local.element_size() * (P - 1)
        comm.count_collective(nb, nb, P - 1)
    return SparseStream(None, part.gather_dense(out, chunk, b), dim, row=b, validate=False)
