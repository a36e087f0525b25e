"""Ranks for test_row_schema.py: two ranks that disagree on one column of a metadata row, in the sparse
collectives' round and in compressed_allreduce's. Each returns the message it got."""

from __future__ import annotations

import torch

from sparsync import SparseStream, compressed_allreduce, sparse_allreduce
from sparsync.compress import Identity


def disagree(rank: int) -> dict[str, str]:
    out = {}
    dtype = torch.float64 if rank == 1 else torch.float32
    try:
        sparse_allreduce(SparseStream.from_dense(torch.ones(8, dtype=dtype)), algorithm="allgather", timeout=20)
        out["dtype"] = "no error"
    except ValueError as e:
        out["dtype"] = str(e)
    try:
        compressed_allreduce(torch.ones((2, 5) if rank == 1 else (5, 2)), Identity(), timeout=20)
        out["shape"] = "no error"
    except ValueError as e:
        out["shape"] = str(e)
    return out
