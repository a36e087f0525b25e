"""Workers and case builders for the row-sparse stream tests; see test_rows.py.

Inputs are deterministic functions of (case, rank, world), so the parent rebuilds every rank's input and the
exact sum. Values are multiples of 1/4 in [-8, 8]: every partial sum is exact in float16 and up, so float32
and float64 results must equal the reference bit for bit whatever the summation order; the half-precision
rounding case has its own inputs (``half_input``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from _workers import ALGORITHMS

import sparsync
from sparsync import CommLog, SparseStream, sparse_allreduce

SPLIT = ("ssar_split_allgather", "dsar_split_allgather")
PATTERNS = ("empty", "one_row", "hot", "all_rows", "zipf")
WIDTHS = (1, 3, 64, 257)
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}
ROWS = 97  # prime: no world size divides it
TIMEOUT = 30.0


@dataclass(frozen=True)
class RowCase:
    pattern: str
    width: int
    dtype: str


def cases() -> list[RowCase]:
    """Every pattern at every width in float32; every dtype at two widths for the patterns that matter."""
    out = [RowCase(p, b, "float32") for p in PATTERNS for b in WIDTHS]
    out += [
        RowCase(p, b, d) for p in ("hot", "zipf", "all_rows") for b in (3, 64) for d in DTYPES if d != "float32"
    ]
    return out


def calls() -> list[tuple[str, str]]:
    """(algorithm, partition) pairs: the split algorithms under both partitions."""
    out = []
    for alg in ALGORITHMS:
        for part in ("stride", "range") if alg in SPLIT else ("auto",):
            out.append((alg, part))
    return out


def rows_of(case: RowCase, rank: int, world: int) -> np.ndarray:
    rng = np.random.default_rng([PATTERNS.index(case.pattern), case.width, rank, world])
    if case.pattern == "empty":
        return np.empty(0, dtype=np.int64)
    if case.pattern == "one_row":
        return np.array([ROWS - 1 - rank % 2], dtype=np.int64)
    if case.pattern == "hot":  # the same hot rows on every rank, plus a few of its own
        return np.unique(np.concatenate([[0, 1, 2, 5], rng.choice(ROWS, 3, replace=False)]))
    if case.pattern == "all_rows":
        return np.arange(ROWS, dtype=np.int64)
    p = 1.0 / np.arange(1, ROWS + 1) ** 1.1
    return np.unique(rng.choice(ROWS, 20, p=p / p.sum()))


def make_stream(case: RowCase, rank: int, world: int) -> SparseStream:
    rows = rows_of(case, rank, world)
    rng = np.random.default_rng([7, case.width, rank, world, rows.size])
    vals = rng.integers(-32, 33, size=rows.size * case.width) / 4.0
    t = torch.from_numpy(vals).to(DTYPES[case.dtype])
    return SparseStream(torch.from_numpy(rows), t, ROWS * case.width, row=case.width)


def expected(case: RowCase, world: int) -> np.ndarray:
    return np.sum([make_stream(case, r, world).to_dense().double().numpy() for r in range(world)], axis=0)


def half_input(rank: int, dtype: torch.dtype) -> SparseStream:
    """Values in [0.5, 2) with full mantissas: fp32 sums of up to 8 of them are exact, fp16 sums round."""
    g = torch.Generator().manual_seed(50 + rank)
    v = (torch.rand(ROWS * 8, generator=g, dtype=torch.float64) * 1.5 + 0.5).to(dtype)
    return SparseStream(torch.arange(ROWS), v, ROWS * 8, row=8)


def coo_inputs(rank: int) -> dict[str, torch.Tensor]:
    """COO tensors with 1 and 2 dense dims, explicit zero rows, rows that cancel across ranks, duplicates."""
    g = torch.Generator().manual_seed(300 + rank)
    ids = torch.tensor([3, 9, 9, 40 + rank, 60])
    one = torch.sparse_coo_tensor(ids[None], torch.randn(5, 6, generator=g), (70, 6), check_invariants=True)
    vals = torch.randn(4, 2, 3, generator=g)
    vals[1] = 0.0  # an explicit zero row
    vals[2] = 1.0 if rank % 2 == 0 else -1.0  # row 50 cancels on an even world size
    two = torch.sparse_coo_tensor(torch.tensor([[1, 20, 50, 64]]), vals, (65, 2, 3), check_invariants=True)
    return {"dense_dims_1": one, "dense_dims_2": two}


def _result(s: SparseStream) -> dict[str, Any]:
    idx = None if s.indices is None else s.indices.numpy().copy()
    return {"dense": s.to_dense().double().numpy(), "indices": idx, "row": s.row, "dtype": str(s.dtype)}


def rows_worker(rank: int) -> dict[str, Any]:
    world = dist.get_world_size()
    out: dict[str, Any] = {"grid": {}, "coo": {}, "half": {}, "bytes": {}}
    group = dist.new_group()
    for case in cases():
        s = make_stream(case, rank, world)
        before = s.values.clone()
        for alg, part in calls():
            key = f"{case.pattern}/{case.width}/{case.dtype}/{alg}/{part}"
            try:
                log = CommLog()
                got = sparse_allreduce(s, algorithm=alg, partition=part, group=group, log=log, timeout=TIMEOUT)
                out["grid"][key] = _result(got)
                out["grid"][key]["partition_bytes"] = log.last.partition_bytes
                out["grid"][key]["unchanged"] = torch.equal(before, s.values)
            except Exception as e:  # reported to the parent, which fails the test naming the case
                out["grid"][key] = {"error": f"{type(e).__name__}: {e}"}
    for dtype in ("float16", "bfloat16"):
        s = half_input(rank, DTYPES[dtype])
        for alg in ("allgather", "ssar_split_allgather", "dsar_split_allgather", "ssar_recursive_double", "dense"):
            out["half"][f"{dtype}/{alg}"] = _result(sparse_allreduce(s, algorithm=alg, group=group))
    for name, t in coo_inputs(rank).items():
        for alg, part in calls():
            log = CommLog()
            r = sparsync.allreduce(t, algorithm=alg, partition=part, group=group, timeout=TIMEOUT, log=log)
            assert isinstance(r, torch.Tensor)
            out["coo"][f"{name}/{alg}/{part}"] = {
                "sparse": r.is_sparse,
                "coalesced": r.is_coalesced(),
                "shape": tuple(r.shape),
                "dims": (r.sparse_dim(), r.dense_dim()),
                "indices": r.indices().numpy().copy(),
                "values": r.values().numpy().copy(),
                "row": log.last.row,
                "nnz_in": log.last.nnz_in,
            }
    out["bytes"] = _eager_bytes(rank, world)
    out["errors"] = _errors(rank, world)
    return out


def _eager_bytes(rank: int, world: int) -> dict[str, int]:
    """A small call after an embedding-sized allgather call: what the small call puts on the wire."""
    group = dist.new_group()
    big = SparseStream(torch.arange(300), torch.ones(300 * 64), 1000 * 64, row=64)  # 78 kB payload per rank
    for _ in range(2):
        sparse_allreduce(big, algorithm="allgather", group=group, timeout=TIMEOUT)
    small = SparseStream.from_dense(torch.arange(19, dtype=torch.float64))
    log = CommLog()
    sparse_allreduce(small, algorithm="allgather", group=group, log=log, timeout=TIMEOUT)
    big_log = CommLog()
    sparse_allreduce(
        big, algorithm="auto", group=group, log=big_log, timeout=TIMEOUT, link=sparsync.LinkModel(1e-4, 1e-9)
    )
    return {
        "small_sent": log.last.bytes_sent,
        "small_meta": log.last.phase_bytes.get("meta", 0),
        "big_phases": len(big_log.last.phases),
        "big_meta": big_log.last.phase_bytes.get("meta", 0),
    }


def _errors(rank: int, world: int) -> dict[str, str]:
    """Bad input on one rank: every rank raises the same ValueError, and the group stays usable."""
    group = dist.new_group()
    out: dict[str, str] = {}
    bad = world - 1
    ids = torch.tensor([[1, 70 if rank == bad else 2]])
    t = torch.sparse_coo_tensor(ids, torch.ones(2, 4), (10, 4), check_invariants=False)
    try:
        sparsync.allreduce(t, group=group, timeout=TIMEOUT)
        out["out_of_range"] = "no error"
    except ValueError as e:
        out["out_of_range"] = str(e)
    width = 2 if rank == bad else 4
    s = SparseStream(torch.tensor([1]), torch.ones(width), 40, row=width)
    try:
        sparse_allreduce(s, group=group, timeout=TIMEOUT)
        out["row_mismatch"] = "no error"
    except ValueError as e:
        out["row_mismatch"] = str(e)
    ok = sparse_allreduce(SparseStream(torch.tensor([rank % 10]), torch.ones(4), 40, row=4), group=group)
    out["after"] = str(float(ok.to_dense().sum()))
    return out
