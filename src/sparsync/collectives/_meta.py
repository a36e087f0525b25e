"""The metadata exchange every sparse collective starts with, and the cross-rank checks it makes possible.

One tiny allgather (recursive doubling, log2(P) latency) of eight int64 per rank gives every rank every rank's
nnz and format (the sizes "allgather" needs, the inputs "auto" needs) and lets all ranks raise the *same*
ValueError for bad input on any rank, instead of the good ranks hanging on the bad one.

Eager protocol (our addition; SparCML has no metadata round to piggyback on): each rank's row also carries
its whole payload when that fits in ``EAGER_BYTES``. When every rank's payload fits, the metadata allgather
*is* the data allgather and the call needs no second round, which is what decides the latency-bound,
very sparse case. The region has the same fixed size on every rank and in every call (a per-call size would
need agreeing on first), so every call pays ``EAGER_BYTES·(P-1)`` extra bytes: 2 KiB is 16 µs per peer at
1 Gbit/s, below one message latency, and holds 256 float32 entries with int32 indices.

Adaptive region: a group's next region size is agreed without a message, from the table every rank already
holds. After a call that ran ``allgather`` (chosen by auto, forced, or ``sparse_allgather``), the group's next
region is that call's largest payload plus 25%, rounded up to 1 KiB, between EAGER_BYTES and EAGER_MAX; after
any other algorithm it falls back to EAGER_BYTES. Training issues calls of similar nnz step after step, so
from the second call on, a reduction that the model sends through allgather needs one round instead of two.
The cost: while the region is large, every metadata round on the group carries it (the replicator's
primitives included), and a call whose payload outgrows it pays the region and then a real algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsync.collectives._comm import Comm, payload_nbytes, payload_of
from sparsync.collectives._fold import allgather_blocks
from sparsync.group import EAGER_BYTES, group_state
from sparsync.stream import FLOAT_DTYPES, SparseStream

# The replicator's primitives (sparsync.replicator.primitives) share this table's first two columns (call
# number, collective) and the group's call counter, so a sparse collective issued on one replica while another
# issues a primitive is reported as a collective mismatch on every rank instead of misreading the other's row.
OPS = (
    "sparse_allreduce",
    "sparse_allgather",
    "all_reduce",
    "all_gather",
    "broadcast",
    "all_reduce_grad",
    "all_gather_grad",
    "broadcast_grad",
)
ALGORITHM_CODES = (
    "auto",
    "ssar_recursive_double",
    "ssar_split_allgather",
    "dsar_split_allgather",
    "allgather",
    "dense",
    "-",
)
_F = ("seq", "op", "dim", "dtype", "nnz", "dense", "nan", "algorithm")
ROW_BYTES = 8 * len(_F)
EAGER_MAX = 256 * 1024  # the most payload bytes a row carries inline (EAGER_BYTES: the default; module doc)


@dataclass(frozen=True)
class Meta:
    nnz: tuple[int, ...]
    dense: tuple[bool, ...]
    # Every rank's payload (the wire bytes of its stream), when all of them fitted in the metadata round.
    eager: tuple[torch.Tensor, ...] | None = None
    sizes: tuple[int, ...] = ()  # every rank's payload bytes


# The largest payload next_eager_bytes can still make room for (for the cost model's Problem.eager_limit).
EAGER_LIMIT = EAGER_MAX * 4 // 5


def next_eager_bytes(sizes: tuple[int, ...], algorithm: str) -> int:
    """The group's metadata region for its next call, from this call's payload sizes and algorithm (module
    doc). Every rank holds the same sizes and algorithm, so every rank computes the same value."""
    want = -(-(max(sizes, default=0) * 5 // 4) // 1024) * 1024
    if algorithm != "allgather" or want > EAGER_MAX:
        return EAGER_BYTES
    return max(EAGER_BYTES, want)


def update_eager(comm: Comm, meta: Meta, algorithm: str) -> None:
    group_state(comm.group).eager_bytes = next_eager_bytes(meta.sizes, algorithm)


def allgather_rows(
    comm: Comm, row: torch.Tensor, eager: torch.Tensor | None = None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Allgather every rank's 8-int64 ``row`` plus the group's eager region holding ``eager``'s bytes.

    Every metadata round on a group goes through here, whatever the operation, so on every rank the message
    has the group's current size (``GroupState.eager_bytes``, which evolves identically everywhere): gloo
    aborts the whole process when a message is longer than the posted receive, and a size mismatch would
    turn a reportable call mismatch into a crash. Returns the [P, 8] table and each rank's eager region.
    """
    if row.dtype != torch.int64 or row.numel() != len(_F):
        raise ValueError(f"a metadata row is {len(_F)} int64, got {row.numel()} {row.dtype}")
    capacity = group_state(comm.group).eager_bytes
    buf = torch.zeros(ROW_BYTES + capacity, dtype=torch.uint8)
    buf[:ROW_BYTES] = row.view(torch.uint8)
    if eager is not None:
        if eager.numel() > capacity:
            raise ValueError(f"eager payload of {eager.numel()} bytes exceeds the group's region of {capacity}")
        buf[ROW_BYTES : ROW_BYTES + eager.numel()] = eager
    with comm.phase("meta"):
        blocks = allgather_blocks(comm, buf, [buf.numel()] * comm.size)
    # Each block is a slice at a multiple of ROW_BYTES + capacity (a multiple of 8): int64-aligned.
    table = torch.stack([b[:ROW_BYTES].view(torch.int64) for b in blocks])
    return table, [b[ROW_BYTES:] for b in blocks]


def exchange_meta(comm: Comm, op: str, stream: SparseStream, algorithm: str, seq: int, check_nan: bool) -> Meta:
    nan_pos = -1
    # NaN propagates through a sum, so one cheap reduction (10x cheaper than isnan().any() on 16M floats)
    # clears the common case; only a NaN sum (a NaN, or inf + -inf) pays for locating the first NaN.
    if check_nan and bool(torch.isnan(stream.values.sum())):
        bad = torch.isnan(stream.values)
        if bool(bad.any()):
            pos = int(torch.nonzero(bad, as_tuple=True)[0][0])
            nan_pos = pos if stream.indices is None else int(stream.indices[pos])
    row = torch.tensor(
        [
            seq,
            OPS.index(op),
            stream.dim,
            FLOAT_DTYPES.index(stream.dtype),
            stream.nnz,
            int(stream.is_dense),
            nan_pos,
            ALGORITHM_CODES.index(algorithm),
        ],
        dtype=torch.int64,
    )
    mine = payload_nbytes(stream.is_dense, stream.nnz, stream.dim, stream.dtype)
    capacity = group_state(comm.group).eager_bytes
    table, blocks = allgather_rows(comm, row, payload_of(stream) if mine <= capacity else None)
    _check(table, comm.rank)
    nnz = tuple(int(x) for x in table[:, 4])
    dense = tuple(bool(x) for x in table[:, 5])
    sizes = [payload_nbytes(dense[r], nnz[r], stream.dim, stream.dtype) for r in range(comm.size)]
    eager = None
    if max(sizes) <= capacity:
        eager = tuple(b[:n] for b, n in zip(blocks, sizes, strict=True))
    return Meta(nnz=nnz, dense=dense, eager=eager, sizes=tuple(sizes))


def _check(table: torch.Tensor, me: int) -> None:
    def names(col: int, r: int) -> str:
        v = int(table[r, col])
        if _F[col] == "op":
            return OPS[v]
        if _F[col] == "dtype":
            return str(FLOAT_DTYPES[v])
        if _F[col] == "algorithm":
            return ALGORITHM_CODES[v]
        return str(v)

    for col, what in ((1, "collective"), (0, "call number"), (7, "algorithm"), (2, "dim"), (3, "dtype")):
        bad = torch.nonzero(table[:, col] != table[0, col], as_tuple=True)[0]
        if bad.numel():
            r = int(bad[0])
            raise ValueError(
                f"{what} mismatch across ranks: rank 0 has {_F[col]}={names(col, 0)}, "
                f"rank {r} has {_F[col]}={names(col, r)} (seen on rank {me}); every rank must issue the same "
                "collectives in the same order on streams of the same dimension and dtype"
            )
    nans = torch.nonzero(table[:, 6] >= 0, as_tuple=True)[0]
    if nans.numel():
        r = int(nans[0])
        raise ValueError(
            f"rank {r} contributed NaN (at vector index {int(table[r, 6])}); refusing to reduce it "
            "(pass check_nan=False to skip this check)"
        )
