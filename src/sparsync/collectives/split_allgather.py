"""SSAR_Split_AllGather and DSAR_Split_AllGather: SparCML §4.1, "The Bandwidth Dominated Case" and
"The Dynamic Case".

Split phase (shared): the R rows (elements of an element stream) are partitioned over the P ranks
(``partition.py``: contiguous ranges as in the paper, or the stride of the row id for skewed row-sparse data;
the paper assumes P | N, we allow empty or short partitions); every rank sends each partition of its stream
directly to the partition's owner (the paper's direct sparse sends, all receives posted before the sends), and
the owner sums what it received. Blocks travel framed (size in the block), so this is one all-to-all round.

- SSAR: the owners' partial results are gathered by a sparse allgather (recursive doubling of framed blocks,
  log2 P rounds) and concatenated, the partitions being disjoint (§3).
- DSAR: each owner densifies its partition and a dense allgather (torch ``all_gather_into_tensor``) finishes.

A rank whose input is already dense sends its blocks dense (the format bit travels in the header), so a full
rank never pays index bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sparsync.collectives._gather import allgather_blocks, allgather_fixed, allgather_var
from sparsync.collectives.comm import Comm
from sparsync.collectives.partition import Partition
from sparsync.collectives.wire import (
    FRAME_BYTES,
    frame_length,
    framed,
    max_framed_payload,
    payload_nbytes,
    unframe,
)
from sparsync.costmodel import (
    AlgorithmEntry,
    LinkModel,
    Problem,
    fresh_cost,
    gather_latency,
    mean_bytes,
    share,
    sum_cost,
    terms,
)
from sparsync.stream import SparseStream, dense_threshold, sum_streams

if TYPE_CHECKING:
    from sparsync.collectives.meta import Meta


def partition_bounds(dim: int, parts: int) -> list[int]:
    """P+1 boundaries of the contiguous split: partitions of ceil(N/P) entries, trailing ones short or empty."""
    return Partition("range", dim, parts).bounds()


def frame_cap(rows: int, dim: int, dtype: torch.dtype, row: int) -> int:
    """The largest frame a block (or a sum of blocks) with at most ``rows`` stored rows of a ``dim``-value
    vector can take. Below delta rows it is sparse (``framed`` only switches to dense when that is smaller); from
    delta on a sum may have gone dense (SparCML §3), whichever format is larger."""
    sparse = payload_nbytes(False, rows, dim, dtype, row)
    most = sparse if rows < dense_threshold(dim, dtype, row) else max(sparse, payload_nbytes(True, 0, dim, dtype))
    return FRAME_BYTES + max_framed_payload(most)


def split_reduce(comm: Comm, stream: SparseStream, part: Partition, nnz: tuple[int, ...]) -> SparseStream | None:
    """The split phase: this rank's partition of the global sum (None when its partition is empty).
    Records the bytes sent to each owner in ``comm.traffic.partition_bytes``.

    One all-to-all round: each block travels framed (its size in a 24-byte header), into a receive posted
    for the largest block the owner can get, its partition in the dense format (a block that fills up is sent
    dense, SparCML §3), and never more rows than the sender stores (``nnz``: every rank's stored rows, from
    the metadata round). SparCML sends sizes first; here that round is saved (at P = 8 on 2 cores a
    round of tiny messages costs milliseconds). Under NCCL's rules (``comm.exact``: a receive must be posted for
    exactly the bytes sent) the sizes do go first, as SparCML sends them, in one allgather of P sizes per rank
    over the host metadata group."""
    P, rank, dtype, b = comm.size, comm.rank, stream.dtype, stream.row
    counts = part.counts()
    blocks = part.split(stream)
    n = counts[rank] * b
    empty = torch.empty(0, dtype=torch.uint8, device=comm.device)
    out_frames = [framed(blk) if counts[j] else empty for j, blk in enumerate(blocks)]
    comm.traffic.partition_bytes = [int(f.numel()) for f in out_frames]
    if comm.exact:
        with comm.phase("split_sizes"):
            table = allgather_fixed(comm.meta, torch.tensor(comm.traffic.partition_bytes, dtype=torch.int64))
        caps = [int(x) for x in table[:, rank]]
    else:
        caps = [frame_cap(min(nnz[j], counts[rank]), n, dtype, b) if n else 0 for j in range(P)]
    with comm.phase("split_payload"):
        received = comm.alltoallv(out_frames, caps, torch.uint8)
    if not n:
        return None
    with comm.phase("split_sum"):
        parts = []
        for j in range(P):
            got = unframe(received[j], n, dtype, b)
            if got is None:
                raise ValueError(f"{comm.op}: rank {j} sent no block for partition {rank}")
            if j != rank and not comm.exact:
                comm.traffic.bytes_recv -= caps[j] - frame_length(received[j])
            parts.append(got)
        return sum_streams(parts)


def gather_frames(comm: Comm, frame: torch.Tensor, cap: int) -> list[torch.Tensor]:
    """Every rank's ``frame`` (at most ``cap`` bytes) on every rank: one round into receives of ``cap`` bytes on
    gloo; under NCCL's rules (``comm.exact``) the frames' sizes first, over the host metadata group."""
    frame = frame.to(comm.device)
    if not comm.exact:
        return allgather_var(comm, frame, cap, frame_length)
    sizes = [int(x) for x in allgather_fixed(comm.meta, torch.tensor([frame.numel()]))[:, 0]]
    return allgather_blocks(comm, frame, sizes)


def ssar_split_allgather(
    comm: Comm, stream: SparseStream, nnz: tuple[int, ...], partition: str = "range"
) -> SparseStream:
    """``nnz``: every rank's stored rows (the metadata round's), which bound every block's size."""
    if comm.size == 1:
        return stream
    P, dim, dtype, b = comm.size, stream.dim, stream.dtype, stream.row
    part = Partition(partition, stream.num_rows, P)
    counts = part.counts()
    mine = split_reduce(comm, stream, part, nnz)
    # Each owner's result travels framed, received into the largest frame any owner's result can take.
    cap = max(frame_cap(min(sum(nnz), c), c * b, dtype, b) for c in counts)
    with comm.phase("allgather_payload"):
        blocks = gather_frames(comm, framed(mine), cap)
    with comm.phase("concat"):
        parts = [unframe(blocks[j], counts[j] * b, dtype, b) if counts[j] else None for j in range(P)]
        return part.assemble(parts, dim, b, dtype, stream.device)


def dsar_split_allgather(
    comm: Comm, stream: SparseStream, nnz: tuple[int, ...], partition: str = "range"
) -> SparseStream:
    if comm.size == 1:
        return stream.densified()
    P, dim, dtype, b = comm.size, stream.dim, stream.dtype, stream.row
    part = Partition(partition, stream.num_rows, P)
    mine = split_reduce(comm, stream, part, nnz)
    chunk = max(part.counts())
    local = torch.zeros(chunk * b, dtype=dtype, device=comm.device)
    if mine is not None and mine.indices is None:
        local[: mine.dim] = mine.values
    elif mine is not None and mine.indices is not None:  # in place: to_dense() fills a second fresh N/P buffer
        local.view(chunk, b)[mine.indices.to(torch.int64)] = mine.rows2d
    out = torch.empty(chunk * b * P, dtype=dtype, device=comm.device)
    with comm.phase("dense_allgather"):
        comm.all_gather_into("dense allgather", out, local)
        comm.count_ring_allgather(chunk * b * local.element_size())
    return SparseStream(None, part.gather_dense(out, chunk, b), dim, row=b, validate=False)


def run_ssar(comm: Comm, stream: SparseStream, meta: Meta, partition: str) -> SparseStream:
    """The registry's runner of SSAR_Split_allgather."""
    return ssar_split_allgather(comm, stream, meta.nnz, partition)


def run_dsar(comm: Comm, stream: SparseStream, meta: Meta, partition: str) -> SparseStream:
    """The registry's runner of DSAR_Split_allgather."""
    return dsar_split_allgather(comm, stream, meta.nnz, partition)


def _split_time(p: Problem, link: LinkModel) -> float:
    """The split phase both split algorithms start with: one all-to-all round of framed blocks; each owner
    merges the P blocks of its partition, about sum(nnz)/P pairs on N/P entries."""
    P, N, a, _, b = terms(p, link)
    a2a = link.alpha_a2a if link.alpha_a2a is not None else (P - 1) * a
    return a2a + b * mean_bytes(p) * (P - 1) / P + sum_cost(p, link, sum(p.nnz) / P, N / P)


def ssar_time(p: Problem, link: LinkModel) -> float:
    """The split phase, then an allgather of the owners' sparse results (the expected union) and their
    concatenation."""
    P, N, _, _, b = terms(p, link)
    result = p.stream_bytes(p.union(P))
    if p.union(P) >= p.delta:
        concat = link.gamma_dense * N * p.row
    else:
        concat = p.per_row(link.gamma_scatter, link) * p.union(P)
    return _split_time(p, link) + gather_latency(P, link) + b * result * (P - 1) / P + concat


def dsar_time(p: Problem, link: LinkModel) -> float:
    """The split phase, then torch's dense allgather of N/P values per rank (a ring: P - 1 steps)."""
    P, N, a, b_ring, _ = terms(p, link)
    # The gathered vector is fresh memory, and a row stream's stride partition (collectives/partition.py)
    # reorders it into a second fresh vector.
    fresh = (2 if p.row > 1 else 1) * fresh_cost(link) * N * p.row
    return _split_time(p, link) + (P - 1) * a + b_ring * N * p.value_bytes * (P - 1) / P + fresh


def ssar_bytes(p: Problem) -> float:
    return 2 * share(p) * (mean_bytes(p) + p.stream_bytes(p.union(p.world_size)))


def dsar_bytes(p: Problem) -> float:
    return 2 * share(p) * (mean_bytes(p) + p.dim * p.value_bytes)


# SparCML §4.1, "The Bandwidth Dominated Case" and "The Dynamic Case".
SSAR = AlgorithmEntry("ssar_split_allgather", code=2, simplicity=3, time=ssar_time, nbytes=ssar_bytes,
                      runner=run_ssar, uses_partition=True)  # fmt: skip
DSAR = AlgorithmEntry("dsar_split_allgather", code=3, simplicity=4, time=dsar_time, nbytes=dsar_bytes,
                      runner=run_dsar, uses_partition=True)  # fmt: skip
