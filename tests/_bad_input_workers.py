"""The bad-input probe ("70 of 70 collective bad inputs raise a clear error on every rank within 2 s, 0 silent
wrong"): one table of cases over the public collectives, run on a real gloo group of 3 ranks.

Each case is a function of (rank, group) that calls one collective (or a short sequence) with bad input on some
ranks and good input on the others. A case expects a clear error (``match``: a regex every rank's message must
match, naming the bad value or rank), or, for a documented valid input, an exact result (``want``: the numpy
reference of every rank's result); a case with both accepts either (a refusal, or the right answer).

Every case runs on a fresh process group (``dist.new_group``), so a case that leaves its group broken (a rank
that raised before the metadata round leaves the others to time out) cannot spoil the next one. Each call gets
``timeout=CALL_TIMEOUT``: a hang becomes a ``PeerError`` just past the 2 s target instead of a stuck test.
After a case in which no rank hung or crashed, a follow-up allreduce on the same group checks it still works.

Records go to one JSON-lines file per rank as each case finishes, after a "started" line: a case that kills a
rank (gloo aborts the process on a message longer than the receive posted for it) is then known by name, and
the parent relaunches the cases after it (``test_bad_inputs.probe``).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import sparsync
from sparsync import LinkModel, SparseStream, choose_fastest, grouped_allreduce, sparse_allgather, sparse_allreduce
from sparsync.compress import BF16, FP16, QSGD, BlockTopK, Identity, RandomK, Threshold, TopK
from sparsync.replicator import PER_WORKER, ReplicaContext, split_batch

WORLD = 3
CALL_TIMEOUT = 2.2  # seconds per call: just past the 2 s target, so a hang fails its case, not the test run
LIMIT = 2.0  # every rank raises within 2 s
LINK = LinkModel(alpha=1e-4, beta=1e-9)  # every case group's link model: "auto" chooses without measuring
OTHER_LINK = LinkModel(alpha=5e-5, beta=1e-8)
ALGORITHMS = ("auto", *sparsync.ALGORITHMS)
NAN, INF = float("nan"), float("inf")
COLLECTIVES = {
    "sar": "sparse_allreduce",
    "sag": "sparse_allgather",
    "ar": "allreduce (dense)",
    "coo": "allreduce (COO)",
    "grp": "grouped_allreduce",
    "cmp": "reduce (compressors)",
    "rep": "ReplicaContext primitives",
}


@dataclass(frozen=True)
class Case:
    name: str  # "<collective prefix>_<what>[/<variant>]"
    bad: str  # the ranks given bad input: "1", "0,2", "all"
    run: Callable[[int, dist.ProcessGroup], Any]
    match: str | None  # a clear error: every rank raises ValueError/TypeError matching this regex
    want: Callable[[], Any] | None = None  # a valid input: every rank's exact result (numpy reference)
    note: str = ""  # what the input is, for the report
    # Sends mismatched sizes through a raw torch collective, where gloo aborts the process: run last, so that a
    # crash costs one relaunch (module doc).
    may_abort: bool = False

    @property
    def collective(self) -> str:
        return COLLECTIVES[self.name.split("_", 1)[0]]


# --- inputs -------------------------------------------------------------------------------------------------
def st(
    dim: int = 10,
    idx: tuple[int, ...] = (1, 4),
    vals: tuple[float, ...] | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    row: int = 1,
) -> SparseStream:
    v = torch.tensor(vals, dtype=dtype) if vals is not None else torch.arange(1, len(idx) * row + 1, dtype=dtype)
    return SparseStream(torch.tensor(idx, dtype=torch.int64), v, dim, row=row)


def nan_at(rank: int, bad: int, first: float = 1.0, second: float = NAN) -> SparseStream:
    """``st()`` whose value at index 4 is ``second`` on rank ``bad`` (and ``first`` at index 1)."""
    return st(vals=(first, second) if rank == bad else (1.0, 2.0))


def emb_grad(rank: int, rows: int = 50, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A real ``nn.Embedding(sparse=True)`` gradient (width 4), uncoalesced: row 7 looked up twice."""
    emb = torch.nn.Embedding(rows, 4, sparse=True, dtype=dtype)
    (emb(torch.tensor([7, 7, rank, 20 + rank])) * torch.arange(1, 5, dtype=dtype)).sum().backward()
    assert emb.weight.grad is not None
    return emb.weight.grad


def coo(idx: list[list[int]], shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A COO tensor built without torch's invariant checks, so indices may lie out of range."""
    dense = shape[len(idx) :]
    vals = torch.arange(1, len(idx[0]) * math.prod(dense) + 1).to(dtype).reshape(len(idx[0]), *dense)
    return torch.sparse_coo_tensor(torch.tensor(idx), vals, shape, check_invariants=False)


def empty_coo(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.int64), torch.empty(0, *shape[1:]), shape)


def x(rank: int, shape: tuple[int, ...] = (10,), dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A dense input: 10·rank + 0, 1, 2, ... (exact in every float dtype used here)."""
    return (torch.arange(math.prod(shape), dtype=torch.float64) + 10 * rank).to(dtype).reshape(shape)


def with_value(t: torch.Tensor, pos: int, value: float) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[pos] = value
    return t


def ref_sum(*per_rank: Any) -> np.ndarray:
    """Sum of the ranks' inputs (numpy float64; NaN and ±Inf propagate as IEEE 754 says)."""
    with np.errstate(invalid="ignore"):  # +Inf + -Inf
        return np.sum([np.asarray(v.to_dense() if hasattr(v, "to_dense") else v, np.float64) for v in per_rank], 0)


# --- calls --------------------------------------------------------------------------------------------------
def _done(res: Any, kw: dict[str, Any]) -> Any:
    return res.wait(timeout=4 * CALL_TIMEOUT) if kw.get("async_op") else res


def sar(g: dist.ProcessGroup, s: Any, **kw: Any) -> Any:
    return _done(sparse_allreduce(s, group=g, timeout=CALL_TIMEOUT, **kw), kw)


def sag(g: dist.ProcessGroup, s: Any, **kw: Any) -> Any:
    return _done(sparse_allgather(s, group=g, timeout=CALL_TIMEOUT, **kw), kw)


def ar(g: dist.ProcessGroup, t: Any, **kw: Any) -> Any:
    return _done(sparsync.allreduce(t, group=g, timeout=CALL_TIMEOUT, **kw), kw)


def gar(g: dist.ProcessGroup, ts: Any, **kw: Any) -> Any:
    return _done(grouped_allreduce(ts, group=g, timeout=CALL_TIMEOUT, **kw), kw)


def red(g: dist.ProcessGroup, t: Any, c: Any, **kw: Any) -> Any:
    return _done(sparsync.compressed_allreduce(t, c, group=g, timeout=CALL_TIMEOUT, average=False, **kw), kw)


def sequence(g: dist.ProcessGroup, values: tuple[float, ...], named: bool = False) -> list[Any]:
    """One allreduce per value, of streams of the same shape: calls nothing but their order (or, ``named``,
    their ``name=``) tells apart."""
    return [
        sar(g, st(vals=(v, v)), algorithm="allgather", **({"name": f"call{v:g}"} if named else {})) for v in values
    ]


def ctx(group: dist.ProcessGroup, timeout: float = CALL_TIMEOUT) -> ReplicaContext:
    """A replica's context on ``group``: one replica per rank, as Replicator.start builds it for 3 processes."""
    return ReplicaContext(
        replica_id=dist.get_rank(group), num_replicas=WORLD, device_id=0, devices_per_replica=1, dp_group=group,
        mp_group=None, worker_id=0, worker_group=group, worker_slots=list(range(WORLD)),
        input_replication=PER_WORKER, input_split_fn=split_batch, split_compression=None, timeout=timeout,
    )  # fmt: skip


# --- the table ----------------------------------------------------------------------------------------------
# fmt: off
def _sparse_allreduce() -> list[Case]:
    f32, f64 = torch.float32, torch.float64
    out = []
    for a in ALGORITHMS:
        out += [
            Case(f"sar_dim/{a}", "1", lambda r, g, a=a: sar(g, st(11 if r == 1 else 10), algorithm=a),
                 r"rank 1 has dim=11", note=f"dim 11 vs 10, algorithm={a}"),
            Case(f"sar_nan/{a}", "1", lambda r, g, a=a: sar(g, nan_at(r, 1), algorithm=a),
                 r"rank 1 contributed NaN \(at vector index 4\)", note=f"NaN, algorithm={a}"),
        ]
    return [
        *out,
        Case("sar_dtype/auto", "2", lambda r, g: sar(g, st(dtype=f64 if r == 2 else f32)),
             r"rank 2 has dtype=torch\.float64", note="float64 vs float32"),
        Case("sar_dtype/dense", "2", lambda r, g: sar(g, st(dtype=f64 if r == 2 else f32), algorithm="dense"),
             r"rank 2 has dtype=torch\.float64", note="float64 vs float32"),
        Case("sar_dtype_half/allgather", "1",
             lambda r, g: sar(g, st(dtype=torch.bfloat16 if r == 1 else torch.float16), algorithm="allgather"),
             r"rank 1 has dtype=torch\.bfloat16", note="bfloat16 vs float16 (same element size)"),
        Case("sar_row/ssar_split_allgather", "1",
             lambda r, g: sar(g, st(row=2 if r == 1 else 1), algorithm="ssar_split_allgather"),
             r"rank 1 has row=2", note="row width 2 vs 1, same dim"),
        Case("sar_row/auto", "0", lambda r, g: sar(g, st(idx=(0, 1), row=5 if r == 0 else 2)),
             r"rank 0 has row=5", note="row width 5 vs 2, same dim"),
        Case("sar_posinf/allgather", "2", lambda r, g: sar(g, nan_at(r, 2, second=INF), algorithm="allgather"),
             r"rank 2 contributed \+Inf \(at vector index 4\)", note="+Inf"),
        Case("sar_neginf/ssar_recursive_double", "0",
             lambda r, g: sar(g, nan_at(r, 0, -INF, 2.0), algorithm="ssar_recursive_double"),
             r"rank 0 contributed -Inf \(at vector index 1\)", note="-Inf"),
        Case("sar_inf_mixed/dense", "0,1",
             lambda r, g: sar(g, st(vals=(1.0, (INF, -INF, 2.0)[r])), algorithm="dense"),
             r"rank 0 contributed \+Inf", note="+Inf on rank 0, -Inf on rank 1 (would sum to NaN)"),
        Case("sar_inf_ieee/allgather", "0,1",
             lambda r, g: sar(g, st(vals=(1.0, (INF, -INF, 2.0)[r])), algorithm="allgather", check_nan=False),
             None, want=lambda: ref_sum(*[st(vals=(1.0, v)) for v in (INF, -INF, 2.0)]),
             note="check_nan=False: +Inf + -Inf sums to NaN (IEEE 754, documented)"),
        Case("sar_inf_ieee/dense", "2",
             lambda r, g: sar(g, nan_at(r, 2, second=INF), algorithm="dense", check_nan=False),
             None, want=lambda: ref_sum(*[nan_at(r, 2, second=INF) for r in range(WORLD)]),
             note="check_nan=False: +Inf on one rank sums to +Inf"),
        Case("sar_nan_ieee/ssar_split_allgather", "1",
             lambda r, g: sar(g, nan_at(r, 1), algorithm="ssar_split_allgather", check_nan=False),
             None, want=lambda: ref_sum(*[nan_at(r, 1) for r in range(WORLD)]),
             note="check_nan=False: NaN sums to NaN"),
        Case("sar_check_nan_differs", "1",
             lambda r, g: sar(g, nan_at(r, 1), algorithm="allgather", check_nan=r != 1),
             r"rank 1 .*(NaN|check_nan)", note="NaN and check_nan=False on rank 1, check_nan=True elsewhere"),
        Case("sar_algorithm_unknown/1", "1",
             lambda r, g: sar(g, st(), algorithm="bogus" if r == 1 else "allgather"),
             r"bogus", note="algorithm='bogus' on one rank"),
        Case("sar_algorithm_unknown/all", "all", lambda r, g: sar(g, st(), algorithm="bogus"),
             r"unknown algorithm 'bogus'", note="algorithm='bogus' everywhere"),
        Case("sar_algorithm_differs", "1", lambda r, g: sar(g, st(), algorithm="dense" if r == 1 else "allgather"),
             r"rank 1 has algorithm=dense", note="dense on rank 1, allgather elsewhere"),
        Case("sar_algorithm_auto_vs_forced", "0",
             lambda r, g: sar(g, st(), algorithm="auto" if r == 0 else "ssar_recursive_double"),
             r"algorithm mismatch .*rank 0 has algorithm=auto", note="auto on rank 0, forced elsewhere"),
        Case("sar_partition_unknown/1", "1",
             lambda r, g: sar(g, st(), algorithm="ssar_split_allgather", partition="hash" if r == 1 else "range"),
             r"hash", note="partition='hash' on one rank"),
        Case("sar_partition_unknown/all", "all",
             lambda r, g: sar(g, st(), algorithm="ssar_split_allgather", partition="hash"),
             r"unknown partition 'hash'", note="partition='hash' everywhere"),
        Case("sar_partition_differs", "1",
             lambda r, g: sar(g, st(12, (r, 5 + r, 11)), algorithm="ssar_split_allgather",
                              partition="stride" if r == 1 else "range"),
             r"partition", want=lambda: ref_sum(*[st(12, (r, 5 + r, 11)) for r in range(WORLD)]),
             note="partition='stride' on rank 1, 'range' elsewhere (refused, or the right sum)"),
        Case("sar_link_differs", "0", lambda r, g: sar(g, st(), link=OTHER_LINK if r == 0 else None),
             r"auto's inputs differ across ranks: rank \d uses another link model", note="link= on rank 0 only"),
        Case("sar_policy_differs", "1",
             lambda r, g: sar(g, st(), policy=choose_fastest) if r == 1 else sar(g, st()),
             r"auto's inputs differ across ranks: rank 1", note="policy=choose_fastest on rank 1 only"),
        Case("sar_link_differs_forced", "0",
             lambda r, g: sar(g, st(), algorithm="dense", link=OTHER_LINK if r == 0 else None),
             None, want=lambda: ref_sum(st(), st(), st()),
             note="link= differs, but the algorithm is forced: the link is unused, a valid call"),
        Case("sar_not_stream/1", "1", lambda r, g: sar(g, torch.zeros(10) if r == 1 else st()),
             r"SparseStream, got Tensor", note="a torch.Tensor instead of a SparseStream on one rank"),
        Case("sar_not_stream/all", "all", lambda r, g: sar(g, [1.0, 2.0]),
             r"SparseStream, got list", note="a list everywhere"),
        Case("sar_empty/1", "1", lambda r, g: sar(g, SparseStream.empty(10) if r == 1 else st()),
             None, want=lambda: ref_sum(st(), np.zeros(10), st()), note="an empty stream on one rank: valid"),
        Case("sar_empty/all", "all", lambda r, g: sar(g, SparseStream.empty(10), algorithm="dsar_split_allgather"),
             None, want=lambda: np.zeros(10), note="empty streams everywhere: valid, zeros"),
        Case("sar_collective_differs", "0", lambda r, g: sag(g, st()) if r == 0 else sar(g, st()),
             r"rank 0 has op=sparse_allgather", note="sparse_allgather on rank 0, sparse_allreduce elsewhere"),
        Case("sar_vs_tensor_allreduce", "1", lambda r, g: ar(g, torch.ones(10)) if r == 1 else sar(g, st()),
             r"shape mismatch .*rank 1", note="allreduce(tensor) on rank 1, sparse_allreduce(stream) elsewhere"),
        Case("sar_async_dim", "2",
             lambda r, g: sar(g, st(11 if r == 2 else 10), algorithm="allgather", async_op=True),
             r"rank 2 has dim=11", note="async_op=True, dim 11 vs 10: raised by wait()"),
        Case("sar_async_nan", "1", lambda r, g: sar(g, nan_at(r, 1), async_op=True),
             r"rank 1 contributed NaN", note="async_op=True, NaN: raised by wait()"),
        Case("sar_async_algorithm_unknown/1", "1",
             lambda r, g: sar(g, st(), algorithm="bogus" if r == 1 else "dense", async_op=True),
             r"bogus", note="async_op=True, algorithm='bogus' on one rank"),
        Case("sar_skipped_call", "1", lambda r, g: [sar(g, s) for s in ([st(12)] if r == 1 else [st(10), st(12)])],
             r"rank 1 has dim=12", note="rank 1 skips the first of two calls (different dims)"),
        Case("sar_skipped_call_same_shape", "1",
             lambda r, g: sequence(g, (2.0,) if r == 1 else (1.0, 2.0)),
             r"call|skip", note="rank 1 skips the first of two calls of the same shape"),
        Case("sar_reordered_calls", "1",
             lambda r, g: [sar(g, s) for s in ([st(12), st(10)] if r == 1 else [st(10), st(12)])],
             r"rank 1 has dim=12", note="rank 1 issues two calls (different dims) in the other order"),
        Case("sar_reordered_calls_same_shape", "1",
             lambda r, g: sequence(g, (2.0, 1.0) if r == 1 else (1.0, 2.0)),
             r"call|order", note="rank 1 issues two calls of the same shape in the other order"),
        Case("sar_skipped_named_call", "1",
             lambda r, g: sequence(g, (2.0,) if r == 1 else (1.0, 2.0), named=True),
             r"call name mismatch across ranks", note="as sar_skipped_call_same_shape, each call given name="),
        Case("sar_reordered_named_calls", "1",
             lambda r, g: sequence(g, (2.0, 1.0) if r == 1 else (1.0, 2.0), named=True),
             r"call name mismatch across ranks", note="as sar_reordered_calls_same_shape, each call given name="),
    ]


def _sparse_allgather() -> list[Case]:
    return [
        Case("sag_dim", "2",
             lambda r, g: sag(g, st(11 if r == 2 else 10)), r"rank 2 has dim=11", note="dim 11 vs 10"),
        Case("sag_dtype", "1", lambda r, g: sag(g, st(dtype=torch.float64 if r == 1 else torch.float32)),
             r"rank 1 has dtype=torch\.float64", note="float64 vs float32"),
        Case("sag_row", "1", lambda r, g: sag(g, st(row=2 if r == 1 else 1)), r"rank 1 has row=2",
             note="row width 2 vs 1"),
        Case("sag_nan", "0", lambda r, g: sag(g, nan_at(r, 0, NAN, 2.0)),
             r"rank 0 contributed NaN \(at vector index 1\)", note="NaN"),
        Case("sag_neginf", "2", lambda r, g: sag(g, nan_at(r, 2, second=-INF)), r"rank 2 contributed -Inf",
             note="-Inf"),
        Case("sag_nan_ieee", "1", lambda r, g: sag(g, nan_at(r, 1), check_nan=False),
             None, want=lambda: np.stack([ref_sum(nan_at(r, 1)) for r in range(WORLD)]),
             note="check_nan=False: the NaN is gathered as it is"),
        Case("sag_empty/1", "1", lambda r, g: sag(g, SparseStream.empty(10) if r == 1 else st()),
             None, want=lambda: np.stack([ref_sum(st()), np.zeros(10), ref_sum(st())]),
             note="an empty stream on one rank: valid"),
        Case("sag_not_stream/1", "1", lambda r, g: sag(g, torch.zeros(10) if r == 1 else st()),
             r"SparseStream, got Tensor", note="a torch.Tensor on one rank"),
        Case("sag_not_stream/all", "all", lambda r, g: sag(g, None), r"SparseStream, got NoneType",
             note="None everywhere"),
        Case("sag_async_dim", "0", lambda r, g: sag(g, st(11 if r == 0 else 10), async_op=True),
             r"rank \d has dim=11", note="async_op=True, dim 11 vs 10: raised by wait()"),
        Case("sag_async_nan", "2", lambda r, g: sag(g, nan_at(r, 2), async_op=True), r"rank 2 contributed NaN",
             note="async_op=True, NaN: raised by wait()"),
    ]


def _dense_allreduce() -> list[Case]:
    f32, f64, i64 = torch.float32, torch.float64, torch.int64
    ones = torch.ones
    return [
        Case("ar_shape_transposed", "1", lambda r, g: ar(g, ones((2, 5) if r == 1 else (5, 2))),
             r"rank 0 passed shape \(5, 2\), rank 1 shape \(2, 5\)", note="(2, 5) vs (5, 2), same numel"),
        Case("ar_shape_ndim", "2", lambda r, g: ar(g, ones((2, 5) if r == 2 else (10,))),
             r"rank 2 shape \(2, 5\)", note="(2, 5) vs (10,), same numel"),
        Case("ar_scalar_vs_vector", "1", lambda r, g: ar(g, ones(() if r == 1 else (1,))), r"rank 1 shape \(\)",
             note="a 0-d tensor vs shape (1,)"),
        Case("ar_numel", "1", lambda r, g: ar(g, ones(11 if r == 1 else 10)), r"rank 1 has dim=11",
             note="11 vs 10 elements"),
        Case("ar_dtype", "2", lambda r, g: ar(g, ones(10, dtype=f64 if r == 2 else f32)),
             r"rank 2 has dtype=torch\.float64", note="float64 vs float32"),
        Case("ar_int64/1", "1", lambda r, g: ar(g, ones(10, dtype=i64 if r == 1 else f32)), r"int64",
             note="int64 on one rank"),
        Case("ar_int64/all", "all", lambda r, g: ar(g, ones(10, dtype=i64)), r"floating dtype.*got torch\.int64",
             note="int64 everywhere"),
        Case("ar_bool/all", "all",
             lambda r, g: ar(g, ones(10, dtype=torch.bool)), r"floating dtype.*got torch\.bool",
             note="bool everywhere"),
        Case("ar_empty/1", "1", lambda r, g: ar(g, torch.zeros(0 if r == 1 else 10)), r"empty",
             note="an empty tensor on one rank"),
        Case("ar_empty/all", "all", lambda r, g: ar(g, torch.zeros(3, 0)),
             r"empty tensor .*\(3, 0\)", note="shape (3, 0) everywhere"),
        Case("ar_numpy/all", "all", lambda r, g: ar(g, np.ones(10)), r"torch\.Tensor, got ndarray",
             note="a numpy array everywhere"),
        Case("ar_list/all", "all", lambda r, g: ar(g, [1.0, 2.0]), r"torch\.Tensor, got list",
             note="a list everywhere"),
        Case("ar_csr/all", "all", lambda r, g: ar(g, torch.eye(3).to_sparse_csr()), r"layout torch\.sparse_csr",
             note="a CSR tensor everywhere"),
        Case("ar_nan", "1", lambda r, g: ar(g, with_value(x(r), 3, NAN) if r == 1 else x(r)),
             r"rank 1 contributed NaN \(at vector index 3\)", note="NaN"),
        Case("ar_posinf", "2", lambda r, g: ar(g, with_value(x(r), 0, INF) if r == 2 else x(r)),
             r"rank 2 contributed \+Inf \(at vector index 0\)", note="+Inf"),
        Case("ar_inf_ieee", "0,1", lambda r, g: ar(g, with_value(x(r), 2, (INF, -INF, 1.0)[r]), check_nan=False),
             None, want=lambda: ref_sum(*[with_value(x(r), 2, (INF, -INF, 1.0)[r]) for r in range(WORLD)]),
             note="check_nan=False: +Inf + -Inf sums to NaN (IEEE 754, documented)"),
        Case("ar_scalar", "all", lambda r, g: ar(g, torch.tensor(r + 1.0)), None, want=lambda: np.float64(6.0),
             note="0-d tensors everywhere: valid"),
        Case("ar_noncontiguous", "all", lambda r, g: ar(g, x(r, (4, 5)).t()),
             None, want=lambda: ref_sum(*[x(r, (4, 5)).t() for r in range(WORLD)]),
             note="a transposed (non-contiguous) view everywhere: valid"),
        Case("ar_requires_grad", "all", lambda r, g: ar(g, x(r).requires_grad_(True)),
             None, want=lambda: ref_sum(*[x(r) for r in range(WORLD)]), note="a leaf that requires grad: valid"),
        Case("ar_algorithm_differs", "1", lambda r, g: ar(g, ones(10), algorithm="dense" if r == 1 else "auto"),
             r"rank 1 has algorithm=dense", note="dense on rank 1, auto elsewhere"),
        Case("ar_partition_unknown/all", "all", lambda r, g: ar(g, ones(10), partition="diagonal"),
             r"unknown partition 'diagonal'", note="partition='diagonal' everywhere"),
        Case("ar_link_differs", "0", lambda r, g: ar(g, ones(8), link=OTHER_LINK if r == 0 else None),
             r"auto's inputs differ across ranks", note="link= on rank 0 only"),
        Case("ar_policy_differs", "2",
             lambda r, g: ar(g, ones(8), policy=choose_fastest) if r == 2 else ar(g, ones(8)),
             r"auto's inputs differ across ranks: rank 2", note="policy= on rank 2 only"),
        Case("ar_async_shape", "1", lambda r, g: ar(g, ones((2, 5) if r == 1 else (5, 2)), async_op=True),
             r"rank 1 shape \(2, 5\)", note="async_op=True, (2, 5) vs (5, 2): raised by wait()"),
        Case("ar_dense_vs_coo", "1", lambda r, g: ar(g, ones(4, 6).to_sparse(1) if r == 1 else ones(4, 6)),
             r"rank 1 has row=6", note="COO (sparse_dim 1) on rank 1, dense (4, 6) elsewhere"),
        Case("ar_dense_vs_coo_elementwise", "2",
             lambda r, g: ar(g, ones(4, 6).to_sparse() if r == 2 else ones(4, 6)),
             r"rank 0 and rank 2 passed the same shape with another layout",
             note="COO (sparse_dim 2) on rank 2, dense elsewhere"),
    ]


def _coo_allreduce() -> list[Case]:
    def oob(r: int, bad: int, idx: int) -> torch.Tensor:
        return coo([[2, idx if r == bad else 5]], (50, 4))

    return [
        Case("coo_shape", "1",
             lambda r, g: ar(g, coo([[0, 1], [0, 1]], (2, 2, 6)) if r == 1 else coo([[0, 1]], (4, 6))),
             r"rank 1 shape \(2, 2, 6\)", note="COO (2, 2, 6) vs (4, 6), same numel"),
        Case("coo_rows", "1", lambda r, g: ar(g, emb_grad(r, rows=51 if r == 1 else 50)), r"rank 1 has dim=204",
             note="embedding gradient of 51 rows vs 50"),
        Case("coo_width", "2",
             lambda r, g: ar(g, coo([[0, 1]], (6, 4) if r == 2 else (4, 6))), r"rank 2 has row=4",
             note="COO (6, 4) vs (4, 6): another row width"),
        Case("coo_dtype", "1", lambda r, g: ar(g, emb_grad(r, dtype=torch.float64 if r == 1 else torch.float32)),
             r"rank 1 has dtype=torch\.float64", note="float64 embedding gradient vs float32"),
        Case("coo_out_of_range/1", "1", lambda r, g: ar(g, oob(r, 1, 50)),
             r"rank 1 passed index 50 at position 1, out of range \[0, 50\)", note="row index 50 of 50"),
        Case("coo_negative/2", "2", lambda r, g: ar(g, oob(r, 2, -1)),
             r"rank 2 passed index -1 .*out of range \[0, 50\)", note="row index -1"),
        Case("coo_out_of_range/all", "all", lambda r, g: ar(g, oob(r, r, 99)), r"rank 0 passed index 99",
             note="row index 99 of 50 everywhere"),
        Case("coo_out_of_range_dim1", "1", lambda r, g: ar(g, coo([[0, 1], [2, 7 if r == 1 else 3]], (2, 5))),
             r"rank 1 passed index 7 .*out of range \[0, 5\)", note="second sparse dim: index 7 of 5"),
        Case("coo_out_of_range/dense", "1", lambda r, g: ar(g, oob(r, 1, 1000), algorithm="dense"),
             r"rank 1 passed index 1000", note="row index 1000 of 50, algorithm=dense"),
        Case("coo_async_out_of_range", "0", lambda r, g: ar(g, oob(r, 0, -5), async_op=True),
             r"rank 0 passed index -5", note="async_op=True, row index -5: raised by wait()"),
        Case("coo_nan", "1", lambda r, g: ar(g, emb_grad(r) * (NAN if r == 1 else 1.0)), r"rank 1 contributed NaN",
             note="NaN in an embedding gradient"),
        Case("coo_inf", "0", lambda r, g: ar(g, emb_grad(r) * (INF if r == 0 else 1.0)),
             r"rank 0 contributed [+-]Inf", note="±Inf in an embedding gradient"),
        Case("coo_empty_nnz/1", "1", lambda r, g: ar(g, empty_coo((50, 4)) if r == 1 else emb_grad(r)),
             None, want=lambda: ref_sum(emb_grad(0), np.zeros((50, 4)), emb_grad(2)),
             note="an embedding gradient with no rows on one rank: valid"),
        Case("coo_uncoalesced", "all", lambda r, g: ar(g, coo([[3, 1, 3]], (5, 2))),
             None, want=lambda: 3 * ref_sum(coo([[3, 1, 3]], (5, 2))),
             note="unsorted duplicate indices everywhere: valid, coalesced"),
        Case("coo_numel0/all", "all", lambda r, g: ar(g, empty_coo((0, 4))),
             r"empty sparse tensor \(shape \(0, 4\)\)", note="COO of shape (0, 4) everywhere"),
        Case("coo_int64/1", "1",
             lambda r, g: ar(g, coo([[0, 1]], (4, 6), torch.int64 if r == 1 else torch.float32)),
             r"int64", note="an int64 COO tensor on one rank"),
        Case("coo_int64/all", "all", lambda r, g: ar(g, coo([[0, 1]], (4, 6), torch.int64)),
             r"floating dtype, got torch\.int64", note="int64 COO everywhere"),
    ]


def _grouped() -> list[Case]:
    def pair(r: int, bad: int, pos: int, idx: int) -> list[torch.Tensor]:
        """Two COO tensors; tensor ``pos`` holds row index ``idx`` on rank ``bad``."""
        rows = [[1, idx if r == bad else 2]]
        return [coo(rows if pos == 0 else [[0, 1]], (6, 4)), coo(rows if pos == 1 else [[3]], (8, 4))]

    ones = torch.ones
    return [
        Case("grp_length", "1", lambda r, g: gar(g, [ones(4), ones(3)] if r == 1 else [ones(4)]),
             r"mismatch across ranks: .*rank 1", note="two tensors on rank 1, one elsewhere"),
        Case("grp_order", "1", lambda r, g: gar(g, [ones(3), ones(4)] if r == 1 else [ones(4), ones(3)]),
             r"shape mismatch across ranks: .*rank 1", note="the same two tensors in the other order on rank 1"),
        Case("grp_shape", "2", lambda r, g: gar(g, [ones((2, 5) if r == 2 else (5, 2))]),
             r"shape mismatch across ranks: .*rank 2", note="(2, 5) vs (5, 2), same numel"),
        Case("grp_dtype", "1", lambda r, g: gar(g, [ones(4, dtype=torch.float64 if r == 1 else torch.float32)]),
             r"rank 1 has dtype=torch\.float64", note="a float64 list vs float32"),
        Case("grp_layout", "1", lambda r, g: gar(g, [ones(4, 6) if r == 1 else coo([[0, 1]], (4, 6)), ones(6)]),
             r"mismatch across ranks: .*rank 1", note="dense (4, 6) on rank 1 where the others pass COO (4, 6)"),
        Case("grp_out_of_range/1", "1", lambda r, g: gar(g, pair(r, 1, 1, 8)),
             r"rank 1 passed index 8 at position 1 of tensor 1, out of range \[0, 8\)",
             note="row index 8 of 8 in tensor 1"),
        Case("grp_negative/2", "2", lambda r, g: gar(g, pair(r, 2, 0, -3)),
             r"rank 2 passed index -3 at position 1 of tensor 0", note="row index -3 in tensor 0"),
        Case("grp_async_out_of_range", "0", lambda r, g: gar(g, pair(r, 0, 1, 100), async_op=True),
             r"rank 0 passed index 100 .* of tensor 1", note="async_op=True, index 100 of 8: raised by wait()"),
        Case("grp_nan", "1",
             lambda r, g: gar(g, [coo([[0]], (6, 4)), with_value(ones(4, 4), 5, NAN if r == 1 else 1.0)]),
             r"rank 1 contributed NaN", note="NaN in the dense tensor of a COO + dense list"),
        Case("grp_dtype_mixed/all", "all", lambda r, g: gar(g, [ones(4), ones(3, dtype=torch.float64)]),
             r"dtypes \['torch\.float32', 'torch\.float64'\]", note="float32 + float64 in one list everywhere"),
        Case("grp_width_mixed/all", "all", lambda r, g: gar(g, [coo([[0]], (5, 4)), coo([[0]], (5, 6))]),
             r"row widths \[4, 6\]", note="COO of row widths 4 and 6 in one list everywhere"),
        Case("grp_empty_list/all", "all", lambda r, g: gar(g, []), r"at least one tensor",
             note="an empty list everywhere"),
        Case("grp_not_tensor/1", "1", lambda r, g: gar(g, [ones(3), [1.0] if r == 1 else ones(1)]),
             r"item 1 is a list", note="a list as item 1 on one rank"),
        Case("grp_not_tensor/all", "all", lambda r, g: gar(g, [ones(3), 2.0]), r"item 1 is a float",
             note="a float as item 1 everywhere"),
        Case("grp_empty_tensor/all", "all", lambda r, g: gar(g, [ones(3), ones(0)]), r"tensor 1 is empty",
             note="an empty tensor in the list everywhere"),
    ]


def _compress() -> list[Case]:
    return [
        Case("cmp_topk_ratio0/all", "all",
             lambda r, g: red(g, x(r), TopK(0)), r"ratio must lie in \(0, 1\], got 0",
             note="TopK(ratio=0) everywhere"),
        Case("cmp_topk_ratio_gt1/all", "all", lambda r, g: red(g, x(r), TopK(1.5)), r"got 1\.5",
             note="TopK(ratio=1.5) everywhere"),
        Case("cmp_threshold_negative/all", "all", lambda r, g: red(g, x(r), Threshold(-0.1)), r"got -0\.1",
             note="Threshold(ratio=-0.1) everywhere"),
        Case("cmp_qsgd_bits3/all", "all",
             lambda r, g: red(g, x(r), QSGD(bits=3)), r"bits must be 2, 4 or 8.*got 3",
             note="QSGD(bits=3) everywhere"),
        Case("cmp_qsgd_bits16/all", "all", lambda r, g: red(g, x(r), QSGD(bits=16)), r"got 16",
             note="QSGD(bits=16) everywhere"),
        Case("cmp_randomk_ratio0/all", "all", lambda r, g: red(g, x(r), RandomK(0.0)), r"got 0\.0",
             note="RandomK(ratio=0.0) everywhere"),
        Case("cmp_blocktopk_block0/all", "all", lambda r, g: red(g, x(r), BlockTopK(0.5, block=0)),
             r"block must be a positive int, got 0", note="BlockTopK(block=0) everywhere"),
        Case("cmp_not_compressor/all", "all", lambda r, g: red(g, x(r), "topk"), r"Compressor, got str",
             note="the string 'topk' as compressor everywhere"),
        Case("cmp_int64/all", "all", lambda r, g: red(g, torch.ones(10, dtype=torch.int64), TopK(0.5)),
             r"floating tensor, got torch\.int64", note="an int64 tensor everywhere"),
        Case("cmp_int64/1", "1",
             lambda r, g: red(g, x(r, dtype=torch.int64 if r == 1 else torch.float32), TopK(0.5)),
             r"int64", note="TopK: an int64 tensor on one rank"),
        Case("cmp_topk_shape", "1", lambda r, g: red(g, x(r, (2, 5) if r == 1 else (5, 2)), TopK(0.5)),
             r"shape", note="TopK: (2, 5) on rank 1, (5, 2) elsewhere"),
        Case("cmp_topk_dim", "1", lambda r, g: red(g, x(r, (11,) if r == 1 else (10,)), TopK(0.5)),
             r"rank 1 has dim=11", note="TopK: 11 vs 10 elements"),
        Case("cmp_topk_nan", "2", lambda r, g: red(g, with_value(x(r), 9, NAN) if r == 2 else x(r), TopK(0.5)),
             r"rank 2 contributed NaN", note="TopK: NaN on rank 2"),
        Case("cmp_topk_async_dim", "0",
             lambda r, g: red(g, x(r, (11,) if r == 0 else (10,)), TopK(0.5), async_op=True),
             r"rank \d has dim=11", note="TopK, async_op=True, 11 vs 10 elements: raised by wait()"),
        Case("cmp_identity_nan", "1",
             lambda r, g: red(g, with_value(x(r), 3, NAN) if r == 1 else x(r), Identity()),
             r"rank 1 holds NaN", note="Identity (dense allreduce path): NaN on rank 1"),
        Case("cmp_identity_shape", "1", lambda r, g: red(g, x(r, (2, 5) if r == 1 else (5, 2)), Identity()),
             r"shape", note="Identity: (2, 5) on rank 1, (5, 2) elsewhere"),
        Case("cmp_qsgd_shape", "2",
             lambda r, g: red(g, x(r, (2, 5) if r == 2 else (5, 2)), QSGD(bits=8, bucket=4)),
             r"shape", note="QSGD: (2, 5) on rank 2, (5, 2) elsewhere"),
        Case("cmp_cast_differs", "1", lambda r, g: red(g, x(r), FP16() if r == 1 else BF16()),
             r"fp16|bf16|compressor", note="FP16 on rank 1, BF16 elsewhere (same wire size)"),
        Case("cmp_identity_dim", "1", lambda r, g: red(g, x(r, (11,) if r == 1 else (10,)), Identity()),
             r"rank 1 differs from rank 0", note="Identity: 11 vs 10 elements", may_abort=True),
        Case("cmp_qsgd_bits_differs", "1",
             lambda r, g: red(g, x(r, (64,)), QSGD(bits=8 if r == 1 else 4, bucket=16)),
             r"payload size \(compressor settings\) mismatch", note="QSGD(bits=8) on rank 1, bits=4 elsewhere",
             may_abort=True),
    ]


def _replicator() -> list[Case]:
    z = torch.zeros
    return [
        Case("rep_shape", "1", lambda r, g: ctx(g).all_sum(z(4 if r == 1 else 3)), r"replica 1 has \[.*\(4,\)",
             note="all_sum: 4 vs 3 elements"),
        Case("rep_shape_same_numel", "1", lambda r, g: ctx(g).all_sum(z((2, 5) if r == 1 else (5, 2))),
             r"replica 1 has \[.*\(2, 5\)", note="all_sum: (2, 5) vs (5, 2)"),
        Case("rep_dtype", "2", lambda r, g: ctx(g).all_sum(z(2, dtype=torch.float64 if r == 2 else torch.float32)),
             r"replica 2 has \[.*float64", note="all_sum: float64 vs float32"),
        Case("rep_structure", "1", lambda r, g: ctx(g).all_sum([z(2)] if r == 1 else {"a": z(2)}),
             r"replica 1 has \[TreeSpec\(list", note="all_sum: a list vs a dict"),
        Case("rep_order", "1", lambda r, g: ctx(g).all_gather(z(2)) if r == 1 else ctx(g).all_sum(z(2)),
             r"replica 1 called all_gather", note="all_gather on replica 1, all_sum elsewhere"),
        Case("rep_vs_sparse", "1",
             lambda r, g: ar(g, z(2), algorithm="dense") if r == 1 else ctx(g).all_sum(z(2)),
             r"(replica|rank) 1 (called |has op=)sparse_allreduce",
             note="sparsync.allreduce on replica 1, all_sum elsewhere"),
        Case("rep_op_differs", "1", lambda r, g: ctx(g).all_reduce(z(2), "max" if r == 1 else "sum"),
             r"argument mismatch .*replica 1", note="op='max' on replica 1, 'sum' elsewhere"),
        Case("rep_op_unknown/1", "1", lambda r, g: ctx(g).all_reduce(z(2), "prod" if r == 1 else "sum"),
             r"prod", note="op='prod' on one replica"),
        Case("rep_op_unknown/all", "all", lambda r, g: ctx(g).all_reduce(z(2), "prod"),
             r"unknown reduction 'prod'", note="op='prod' everywhere"),
        Case("rep_source_differs", "1", lambda r, g: ctx(g).broadcast(z(2), 0 if r == 1 else 2),
             r"argument mismatch .*replica 1", note="broadcast source 0 on replica 1, 2 elsewhere"),
        Case("rep_source_out_of_range/all", "all", lambda r, g: ctx(g).broadcast(z(2), -1),
             r"unknown replica id -1", note="broadcast source -1 everywhere"),
        Case("rep_leaf_not_tensor/1", "1", lambda r, g: ctx(g).all_sum({"a": 1.0 if r == 1 else z(1)}),
             r"leaf 0 .*float", note="a float leaf on one replica"),
        Case("rep_leaf_not_tensor/all", "all", lambda r, g: ctx(g).all_sum({"a": "x"}),
             r"leaf 0 of the structure is a str", note="a str leaf everywhere"),
        Case("rep_nan", "1", lambda r, g: ctx(g).all_sum(with_value(z(3), 1, NAN if r == 1 else 0.0)),
             r"replica 1 .*NaN", note="all_sum: NaN on replica 1"),
        Case("rep_skipped_call_same_shape", "1",
             lambda r, g: [ctx(g).all_sum(torch.full((2,), v)) for v in ((2.0,) if r == 1 else (1.0, 2.0))],
             r"call|skip", note="replica 1 skips the first of two all_sums of the same shape"),
    ]
# fmt: on


def build_cases() -> list[Case]:
    """Every case, in the order they run: the table's order, with the cases that may abort a rank last."""
    cases = [
        *_sparse_allreduce(),
        *_sparse_allgather(),
        *_dense_allreduce(),
        *_coo_allreduce(),
        *_grouped(),
        *_compress(),
        *_replicator(),
    ]
    names = [c.name for c in cases]
    assert len(set(names)) == len(names), "case names must be unique"
    return sorted(cases, key=lambda c: c.may_abort)  # a stable sort


CASES = build_cases()
BY_NAME = {c.name: c for c in CASES}


# --- the worker ---------------------------------------------------------------------------------------------
def plain(v: Any) -> Any:
    """A JSON-able copy of a result: tensors (dense or COO) and streams as nested lists of floats."""
    if isinstance(v, SparseStream):
        return v.to_dense().double().tolist()
    if isinstance(v, torch.Tensor):
        return (v.to_dense() if v.is_sparse else v).detach().double().tolist()
    if isinstance(v, dict):
        return {k: plain(u) for k, u in v.items()}
    if isinstance(v, list | tuple):
        return [plain(u) for u in v]
    return v


def _append(path: str, obj: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(obj) + "\n")


def probe_worker(rank: int, names: list[str], out_dir: str) -> int:
    """Run the cases ``names`` in order, appending a "started" line and then the case's record (exception type
    and message, or the result; seconds; the follow-up's result) to ``out_dir/rank{rank}.jsonl``."""
    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"rank{rank}.jsonl")
    for name in names:
        g = dist.new_group()
        sparsync.set_link(LINK, group=g)
        _append(path, {"case": name, "started": True})
        dist.barrier()
        rec: dict[str, Any] = {"case": name}
        t0 = time.perf_counter()
        try:
            rec["value"] = plain(BY_NAME[name].run(rank, g))
            rec["kind"] = "ok"
        except Exception as e:  # a subclass (sparsync.NonFiniteError) counts as the ValueError it is
            base = next((k for k in (ValueError, TypeError) if isinstance(e, k)), type(e))
            rec["kind"], rec["message"] = base.__name__, str(e)
        rec["seconds"] = time.perf_counter() - t0
        kinds: list[Any] = [None] * WORLD
        dist.all_gather_object(kinds, rec["kind"])
        # The group still works afterwards. Not tried after a hang or crash (a rank timed out: the group's pairs
        # are closed), which fails the case anyway.
        if all(k in ("ok", "ValueError", "TypeError") for k in kinds):
            try:
                rec["after"] = plain(ar(g, torch.full((3,), rank + 1.0), algorithm="allgather"))
            except Exception as e:
                rec["after"] = f"{type(e).__name__}: {e}"
        _append(path, rec)
    return rank
