"""Rank functions for tests/compress/test_dsar_quantized.py (``launch`` unpickles workers by qualified name).

Inputs are deterministic functions of (rank, case) with small integer values, so every partial sum is exact
and the parent rebuilds each rank's quantization noise bit for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import sparsync
from sparsync.compress import QSGD
from sparsync.stream import SparseStream

ROWS, ROW = 300, 4  # a row-sparse stream of 300 rows of 4 values
DENSITIES = ("empty", "sparse", "full")


def rank_input(rank: int, density: str, seed: int = 0) -> SparseStream:
    """Rank r's stream: none, a sixth of the rows (overlapping across ranks), or every row; integer values."""
    g = torch.Generator().manual_seed(31 * rank + 7 * seed + 1)
    if density == "empty":
        return SparseStream.empty(ROWS * ROW, row=ROW)
    if density == "full":
        return SparseStream(None, torch.randint(-8, 9, (ROWS * ROW,), generator=g).float(), ROWS * ROW, row=ROW)
    rows = torch.unique(torch.randint(0, ROWS, (ROWS // 6,), generator=g))
    vals = torch.randint(-8, 9, (rows.numel() * ROW,), generator=g).float()
    return SparseStream(rows.to(torch.int32), vals, ROWS * ROW, row=ROW)


def q_of(seed: int) -> QSGD:
    return QSGD(bits=4, bucket=32, seed=seed)


def cases_worker(rank: int) -> dict[str, Any]:
    """One quantized DSAR per density and partition (fresh QSGD of seed 0 each: the parent replays its noise),
    the unquantized DSAR (exact), and the refusals."""
    out: dict[str, Any] = {}
    for density in DENSITIES:
        for part in ("stride", "range"):
            s = rank_input(rank, density)
            res = sparsync.sparse_allreduce(s, algorithm="dsar_split_allgather", partition=part, quantize=q_of(0))
            out[f"{density}/{part}"] = res.to_dense().numpy()
            exact = sparsync.sparse_allreduce(s, algorithm="dsar_split_allgather", partition=part)
            out[f"{density}/{part}/exact"] = exact.to_dense().numpy()
    s = rank_input(rank, "sparse")
    for key, kwargs in (
        ("other_algorithm", {"algorithm": "ssar_split_allgather", "quantize": q_of(0)}),
        ("not_qsgd", {"algorithm": "dsar_split_allgather", "quantize": "4 bits"}),
        ("bits_differ", {"algorithm": "dsar_split_allgather", "quantize": QSGD(bits=8 if rank == 1 else 4)}),
    ):
        try:
            sparsync.sparse_allreduce(s, **kwargs)  # type: ignore[arg-type]
            out[key] = "no error"
        except (TypeError, ValueError) as e:
            out[key] = f"{type(e).__name__}: {e}"
    out["after"] = sparsync.sparse_allreduce(s, algorithm="allgather").to_dense().numpy()
    return out


def unbiased_worker(rank: int, density: str, draws: int) -> dict[str, Any]:
    """``draws`` quantized DSAR sums of this rank's input, one QSGD seed each: their sum and sum of squares."""
    s = rank_input(rank, density)
    total = np.zeros(ROWS * ROW)
    squares = np.zeros(ROWS * ROW)
    for seed in range(draws):
        y = sparsync.sparse_allreduce(s, algorithm="dsar_split_allgather", quantize=q_of(seed))
        v = y.to_dense().double().numpy()
        total += v
        squares += v * v
    return {"sum": total, "squares": squares}
