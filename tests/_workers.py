"""Module-level worker functions and shared case builders for the multiprocess tests.

``launch`` spawns its ranks, which unpickles the worker by qualified name: everything a rank runs lives here.
The case builders are deterministic functions of (case, rank, world size), so the parent test process rebuilds
every rank's input to compute the exact expected sum without shipping inputs around.

Workers never let one failing case abort the run: each case's exception is caught and reported as text, and
every collective gets a ``timeout`` so a desynchronised group fails instead of hanging.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from _pids import read_pids, write_pid

import sparsync
from sparsync import CommLog, SparseStream, sparse_allgather, sparse_allreduce

ALGORITHMS = (
    "ssar_recursive_double",
    "ssar_split_allgather",
    "dsar_split_allgather",
    "allgather",
    "dense",
    "auto",
)
DENSITIES = (0.0, 1e-4, 1e-2, 0.3, 1.0)
PATTERNS = ("identical", "disjoint", "random", "one_empty", "one_full")
DIMS = (1, 3, 1001, 20011)  # 20011 is prime: no world size divides it, and 1e-4 of it is 2 entries
DTYPES = ("float32", "float64")
CALL_TIMEOUT = 30.0  # seconds per collective inside workers: a desynchronised group fails, never hangs


@dataclass(frozen=True)
class Case:
    """One sparse_allreduce input across all ranks; every rank builds its own part from it."""

    dim: int
    density: float
    pattern: str
    dtype: str
    seed: int


# --- inputs -------------------------------------------------------------------------------------------------
def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng(list(key))


def _values(n: int, dtype: str, *key: int) -> np.ndarray:
    """Random values of magnitude in [0.5, 1.5) and random sign: never zero, no catastrophic cancellation."""
    g = _rng(*key)
    mag = g.uniform(0.5, 1.5, n)
    sign = np.where(g.random(n) < 0.5, -1.0, 1.0)
    return (mag * sign).astype(dtype)


def special_rank(case: Case, world: int) -> int:
    """The rank that is empty ("one_empty") or full ("one_full")."""
    return case.seed % world


def rank_arrays(case: Case, rank: int, world: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """(sorted unique int64 indices, values, dense_format) of ``rank``'s input for ``case``."""
    N = case.dim
    n = round(case.density * N)
    shared = _rng(case.seed, 1_000_003)
    mine = _rng(case.seed, rank, 7)
    dense_format = False
    if case.pattern == "identical":
        idx = shared.choice(N, n, replace=False)
    elif case.pattern == "disjoint":
        slots = shared.permutation(N)[rank::world]  # rank r owns perm[r], perm[r + P], ...
        idx = slots[: min(n, slots.size)]
    elif case.pattern in ("random", "one_empty", "one_full"):
        idx = mine.choice(N, n, replace=False)
        if case.pattern == "one_empty" and rank == special_rank(case, world):
            idx = idx[:0]
        if case.pattern == "one_full" and rank == special_rank(case, world):
            idx, dense_format = np.arange(N), True
    else:
        raise ValueError(f"unknown pattern {case.pattern!r}")
    idx = np.sort(idx.astype(np.int64))
    return idx, _values(idx.size, case.dtype, case.seed, rank, 11), dense_format


def make_stream(case: Case, rank: int, world: int) -> SparseStream:
    """The rank's input as a stream; alternately built sparse (any nnz) and by ``from_dense`` (which switches
    to the dense format at delta), so the collectives see every mix of formats."""
    idx, vals, dense_format = rank_arrays(case, rank, world)
    if dense_format:
        return SparseStream(None, torch.from_numpy(vals.copy()), case.dim)
    if (rank + case.seed) % 2 == 0:
        dense = np.zeros(case.dim, dtype=case.dtype)
        dense[idx] = vals
        return SparseStream.from_dense(torch.from_numpy(dense))
    return SparseStream(torch.from_numpy(idx.copy()), torch.from_numpy(vals.copy()), case.dim)


def expected_sum(case: Case, world: int) -> np.ndarray:
    """The exact sum (float64) of every rank's input, inputs rounded to their dtype first."""
    out = np.zeros(case.dim, dtype=np.float64)
    for r in range(world):
        idx, vals, _ = rank_arrays(case, r, world)
        np.add.at(out, idx, vals.astype(np.float64))
    return out


# --- results ------------------------------------------------------------------------------------------------
def digest(s: SparseStream) -> str:
    """Bitwise fingerprint of a stream: format, dimension, dtype, index bytes, value bytes."""
    h = hashlib.sha256(f"{s.is_dense}/{s.dim}/{s.dtype}/".encode())
    if s.indices is not None:
        h.update(s.indices.contiguous().numpy().tobytes())
    h.update(b"|")
    h.update(s.values.contiguous().numpy().tobytes())
    return h.hexdigest()


def compact(s: SparseStream) -> tuple[bool, np.ndarray | None, np.ndarray, int, str]:
    """A picklable copy of a stream: (is_dense, indices or None, values, dim, dtype name)."""
    idx = None if s.indices is None else s.indices.numpy().copy()
    return s.is_dense, idx, s.values.numpy().copy(), s.dim, str(s.dtype).removeprefix("torch.")


def compact_to_dense(c: tuple[bool, np.ndarray | None, np.ndarray, int, str]) -> np.ndarray:
    is_dense, idx, vals, dim, _ = c
    if is_dense:
        return vals.astype(np.float64)
    out = np.zeros(dim, dtype=np.float64)
    out[idx.astype(np.int64)] = vals.astype(np.float64)
    return out


def _snapshot(s: SparseStream) -> tuple[bytes | None, bytes]:
    idx = None if s.indices is None else s.indices.numpy().tobytes()
    return idx, s.values.numpy().tobytes()


def _record_summary(log: CommLog) -> dict[str, Any]:
    r = log.last
    d = r.decision
    return {
        "op": r.op,
        "algorithm": r.algorithm,
        "rank": r.rank,
        "world_size": r.world_size,
        "dim": r.dim,
        "nnz_in": r.nnz_in,
        "nnz_out": r.nnz_out,
        "bytes_sent": r.bytes_sent,
        "bytes_recv": r.bytes_recv,
        "messages": r.messages,
        "phase_bytes": dict(r.phase_bytes),
        "seconds": r.seconds,
        "decision": None if d is None else d.algorithm,
        "predictions": None if d is None else dict(d.predictions),
    }


# --- the collectives worker ---------------------------------------------------------------------------------
def grid_cases(full: bool) -> list[tuple[str, Case]]:
    """(algorithm, case) pairs. ``full``: the whole cartesian product of algorithm, density, pattern, dim and
    dtype. Otherwise the full algorithm x density x pattern grid at the large prime dim in float32, plus a thin
    sweep of every algorithm over every dim and dtype on a few density/pattern pairs chosen for edge cases."""
    out: list[tuple[str, Case]] = []
    seed = 0

    def add(alg: str, dim: int, density: float, pattern: str, dtype: str) -> None:
        nonlocal seed
        seed += 1
        out.append((alg, Case(dim, density, pattern, dtype, seed)))

    if full:
        for dim in DIMS:
            for dtype in DTYPES:
                for alg in ALGORITHMS:
                    for density in DENSITIES:
                        for pattern in PATTERNS:
                            add(alg, dim, density, pattern, dtype)
        return out
    for alg in ALGORITHMS:
        for density in DENSITIES:
            for pattern in PATTERNS:
                add(alg, DIMS[-1], density, pattern, "float32")
    thin = [
        (0.0, "random"),
        (1e-2, "one_full"),
        (0.3, "disjoint"),
        (0.3, "one_empty"),
        (0.3, "identical"),
        (1.0, "random"),
    ]
    for dim in DIMS:
        for dtype in DTYPES:
            for alg in ALGORITHMS:
                for density, pattern in thin:
                    add(alg, dim, density, pattern, dtype)
    return out


def _run_grid(rank: int, world: int, cases: list[tuple[str, Case]]) -> list[dict[str, Any]]:
    out = []
    for alg, case in cases:
        s = make_stream(case, rank, world)
        before = _snapshot(s)
        log = CommLog()
        entry: dict[str, Any] = {}
        try:
            res = sparse_allreduce(s, algorithm=alg, log=log, timeout=CALL_TIMEOUT)
            entry["digest"] = digest(res)
            entry["dim"], entry["dtype"] = res.dim, str(res.dtype).removeprefix("torch.")
            entry["input_unchanged"] = _snapshot(s) == before
            entry["log"] = _record_summary(log) if len(log) == 1 else f"{len(log)} records"
            if rank == 0:
                entry["result"] = compact(res)
        except Exception as e:
            entry["error"] = f"{type(e).__name__}: {e}"
        out.append(entry)
    return out


def allgather_inputs(rank: int, world: int) -> list[SparseStream]:
    """Streams of variable sizes per rank, including empty ones and dense ones, in several dims/dtypes."""
    out = []
    for j, (dim, dtype) in enumerate(((1, "float32"), (3, "float64"), (1001, "float32"), (1001, "float64"))):
        nnz = [0, 1, 7, dim][(rank + j) % 4] if dim > 1 else (rank + j) % 2
        nnz = min(nnz, dim)
        g = _rng(99, j, rank)
        idx = np.sort(g.choice(dim, nnz, replace=False)).astype(np.int64)
        vals = _values(nnz, dtype, 99, j, rank, 1)
        if nnz == dim and dim > 1:
            out.append(SparseStream(None, torch.from_numpy(vals), dim))
        else:
            out.append(SparseStream(torch.from_numpy(idx), torch.from_numpy(vals), dim))
    return out


def _async_checks(rank: int, world: int) -> dict[str, Any]:
    """Several async ops in flight at once (issued in the same order on every rank), then a blocking call that
    queues behind them; results must equal the blocking results of the same inputs."""
    plan = [
        ("ssar_recursive_double", Case(1001, 0.01, "random", "float32", 501)),
        ("dense", Case(1001, 0.3, "random", "float64", 502)),
        ("ssar_split_allgather", Case(20011, 1e-2, "disjoint", "float32", 503)),
        ("allgather", Case(3, 1.0, "identical", "float64", 504)),
        ("dsar_split_allgather", Case(1001, 0.3, "one_empty", "float32", 505)),
    ]
    blocking = [digest(sparse_allreduce(make_stream(c, rank, world), algorithm=a)) for a, c in plan]
    works = [
        sparse_allreduce(make_stream(c, rank, world), algorithm=a, async_op=True, timeout=CALL_TIMEOUT)
        for a, c in plan
    ]
    ag_work = sparse_allgather(allgather_inputs(rank, world)[2], async_op=True, timeout=CALL_TIMEOUT)
    # A blocking call while async work is pending must queue behind it (same order on every rank).
    queued = digest(sparse_allreduce(make_stream(plan[0][1], rank, world), algorithm=plan[0][0]))
    is_work = [isinstance(w, sparsync.Work) for w in works]
    waited = [digest(w.wait(timeout=120)) for w in works]
    ag = [compact(s) for s in ag_work.wait(timeout=120)]
    dense_in = torch.zeros(6, 7, dtype=torch.float64)
    dense_in[rank % 6, rank % 7] = rank + 1.0
    t_work = sparsync.allreduce(dense_in, algorithm="dense", async_op=True)
    t_res = t_work.wait(timeout=120)
    return {
        "blocking": blocking,
        "waited": waited,
        "is_work": is_work,
        "queued": queued,
        "allgather": ag,
        "tensor": t_res.numpy().copy(),
        "tensor_is_work": isinstance(t_work, sparsync.Work),
    }


def odd_stride_stream(rank: int) -> SparseStream:
    """Tensors torch calls contiguous but whose stride is not 1: an empty array from numpy (stride 0) on even
    ranks, a one-element step slice (stride 5) on odd ranks."""
    if rank % 2 == 0:
        empty = np.random.default_rng(0).uniform(0.5, 1.5, 0)
        return SparseStream(torch.from_numpy(empty.astype(np.int64)), torch.from_numpy(empty.astype("float32")), 4)
    idx = torch.tensor([rank % 4, 0, 0])[::5]
    vals = torch.full((3,), rank + 1.0)[::5]
    return SparseStream(idx, vals, 4)


def odd_stride_expected(world: int) -> np.ndarray:
    out = np.zeros(4)
    for r in range(1, world, 2):
        out[r % 4] += r + 1.0
    return out


def _odd_stride_checks(rank: int, world: int) -> dict[str, Any]:
    s = odd_stride_stream(rank)
    out: dict[str, Any] = {}
    for alg in ALGORITHMS:
        out[alg] = _try_value(lambda a=alg: compact(sparse_allreduce(s, algorithm=a, timeout=CALL_TIMEOUT)))
    out["allgather_op"] = _try_value(lambda: [compact(x) for x in sparse_allgather(s, timeout=CALL_TIMEOUT)])
    return out


def _try_value(fn: Any) -> Any:
    try:
        return fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def dense_tensor_input(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    t = torch.randn(3, 5, 7, generator=g, dtype=torch.float64)
    return t * (torch.rand(3, 5, 7, generator=g) < 0.2)  # mostly zero: "auto" may send it sparse


def embedding_grad(rank: int, world: int) -> torch.Tensor:
    """A real ``nn.Embedding(sparse=True)`` gradient: sparse_dim=1, dense_dim=1 (embedding dim 4), uncoalesced
    (duplicate rows). The last rank of a group of 3+ looks up nothing: an empty gradient of the same shape."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(50, 4, sparse=True)
    g = torch.Generator().manual_seed(2000 + rank)
    if world >= 3 and rank == world - 1:
        empty = torch.empty(1, 0, dtype=torch.int64)
        return torch.sparse_coo_tensor(empty, torch.empty(0, 4), (50, 4), check_invariants=True)
    ids = torch.randint(0, 50, (6 + rank,), generator=g)
    ids[0] = ids[1] = 7  # a row every rank touches, twice
    w = torch.randn(6 + rank, 4, generator=g)
    (emb(ids) * w).sum().backward()
    grad = emb.weight.grad
    assert grad is not None
    return grad


def coo2_input(rank: int) -> torch.Tensor:
    """A hybrid COO tensor with two sparse dims and one dense dim."""
    g = torch.Generator().manual_seed(3000 + rank)
    idx = torch.stack([torch.randint(0, 6, (5,), generator=g), torch.randint(0, 5, (5,), generator=g)])
    return torch.sparse_coo_tensor(idx, torch.randn(5, 3, generator=g), (6, 5, 3), check_invariants=True)


def _tensor_checks(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    t = dense_tensor_input(rank)
    t_before = t.clone()
    for alg in ("auto", "ssar_recursive_double", "dense"):
        r = sparsync.allreduce(t, algorithm=alg)
        out[f"dense/{alg}"] = (r.layout == torch.strided, tuple(r.shape), r.dtype == t.dtype, r.numpy().copy())
    out["dense_unchanged"] = torch.equal(t, t_before)
    g = embedding_grad(rank, world)
    for alg in ("auto", "ssar_split_allgather", "allgather"):
        r = sparsync.allreduce(g, algorithm=alg)
        out[f"coo/{alg}"] = (
            r.is_sparse,
            r.is_coalesced(),
            r.sparse_dim(),
            r.dense_dim(),
            tuple(r.shape),
            r.to_dense().numpy().copy(),
        )
    h = coo2_input(rank)
    r = sparsync.allreduce(h, algorithm="ssar_recursive_double")
    out["coo2"] = (r.is_sparse, r.sparse_dim(), r.dense_dim(), tuple(r.shape), r.to_dense().numpy().copy())
    return out


def collectives_worker(rank: int, full: bool) -> dict[str, Any]:
    world = dist.get_world_size()
    out: dict[str, Any] = {"world": world, "pid": os.getpid()}
    t0 = time.perf_counter()
    out["grid"] = _run_grid(rank, world, grid_cases(full))
    out["grid_seconds"] = time.perf_counter() - t0
    parts = allgather_inputs(rank, world)
    out["allgather"] = []
    for s in parts:
        log = CommLog()
        got = sparse_allgather(s, log=log, timeout=CALL_TIMEOUT)
        out["allgather"].append(([compact(x) for x in got], _record_summary(log)))
    out["odd_strides"] = _odd_stride_checks(rank, world)
    out["async"] = _async_checks(rank, world)
    out["tensor"] = _tensor_checks(rank, world)
    out["override"] = _override_checks(rank, world)
    out["eager"] = _eager_checks(rank, world)
    out["adaptive_eager"] = _adaptive_eager_checks(rank)
    out["pipelined_dense"] = _pipelined_dense_checks(rank, world)
    lm = sparsync.measure_link()
    out["link"] = lm
    out["link_finite"] = all(math.isfinite(v) for v in (lm.alpha, lm.beta, lm.gamma_sparse, lm.gamma_dense))
    return out


PIPELINE_DIM = 2**22 + 7  # above DENSE_PIPELINE_MIN, not a multiple of the chunk count


def pipelined_dense_input(rank: int, world: int, density: float, dtype: torch.dtype) -> SparseStream:
    """Sparse-stored input of the chunked ``dense`` algorithm: random rows plus the entries on each side of
    every chunk boundary; the last rank empty when world > 1; small integer values, so every sum is exact."""
    from sparsync.costmodel import DENSE_CHUNKS, DENSE_PIPELINE_MIN

    assert PIPELINE_DIM >= DENSE_PIPELINE_MIN

    if world > 1 and rank == world - 1:
        return SparseStream(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=dtype), PIPELINE_DIM)
    g = torch.Generator().manual_seed(1000 * rank + int(density * 1e6))
    n = PIPELINE_DIM
    cuts = [n * c // DENSE_CHUNKS for c in range(DENSE_CHUNKS + 1)]
    edges = torch.tensor([i for c in cuts for i in (c - 1, c) if 0 <= i < n])
    rows = torch.randint(0, n, (int(density * n),), generator=g)
    idx = torch.unique(torch.cat([rows, edges]))
    vals = torch.randint(-8, 9, (idx.numel(),), generator=g).to(dtype)
    return SparseStream(idx, vals, n)


def _pipelined_dense_checks(rank: int, world: int) -> dict[str, Any]:
    """``dense`` on sparse-stored inputs of 1M+ entries (densified chunk by chunk, each chunk's allreduce started
    before the next is filled) against the exact sum of every rank's input, recomputed here; and which
    ranks' results are bitwise equal (by digest)."""
    out: dict[str, Any] = {}
    for dtype in (torch.float32, torch.float64):
        for density in (0.0, 1e-3, 0.3):
            s = pipelined_dense_input(rank, world, density, dtype)
            assert not s.is_dense
            log = CommLog()
            got = sparse_allreduce(s, algorithm="dense", log=log, timeout=CALL_TIMEOUT).to_dense()
            want = torch.zeros(PIPELINE_DIM, dtype=torch.float64)
            for r in range(world):
                x = pipelined_dense_input(r, world, density, dtype)
                assert x.indices is not None
                want[x.indices.to(torch.int64)] += x.values.to(torch.float64)
            out[f"{dtype}/{density}"] = (
                float((got.to(torch.float64) - want).abs().max()),
                got.dtype == dtype,
                hashlib.sha256(got.numpy().tobytes()).hexdigest(),
                log.last.messages,
            )
    return out


def _override_checks(rank: int, world: int) -> dict[str, Any]:
    """set_link / link= / policy= steer "auto" and show up in its recorded Decision."""
    s = SparseStream(torch.tensor([rank]), torch.tensor([1.0]), dim=2**20)
    out: dict[str, Any] = {}
    # Latency-free, bandwidth-starved link: the dense allreduce of N = 2^20 cannot win; neither can a
    # 1-entry-per-rank sparse algorithm lose to it.
    starved = sparsync.LinkModel(alpha=0.0, beta=1.0)
    sparsync.set_link(starved)
    log = CommLog()
    sparse_allreduce(s, log=log, timeout=CALL_TIMEOUT)
    out["set_link"] = (log.last.decision.link if log.last.decision else None, log.last.algorithm)
    sparsync.set_link(None)

    def always_dense(problem: sparsync.Problem, link: sparsync.LinkModel) -> sparsync.Decision:
        return sparsync.Decision("dense", {"dense": 0.0}, 0.0, problem, link)

    log = CommLog()
    got = sparse_allreduce(s, log=log, policy=always_dense, link=starved, timeout=CALL_TIMEOUT)
    out["policy"] = (log.last.algorithm, got.is_dense, got.to_dense()[: world + 1].tolist())
    return out


def _eager_checks(rank: int, world: int) -> dict[str, Any]:
    """Payloads that fit in the metadata round finish in it; one rank's bigger payload sends everyone on."""
    link = sparsync.LinkModel(alpha=1e-4, beta=1e-9)
    out: dict[str, Any] = {}
    for name in ("fits", "one_too_big"):
        s = eager_inputs(name, rank)
        log = CommLog()
        # Fresh groups: a group's eager region adapts to its previous calls (see _adaptive_eager_checks).
        got = sparse_allreduce(s, log=log, link=link, timeout=CALL_TIMEOUT, group=dist.new_group())
        agl = CommLog()
        parts = sparse_allgather(s, log=agl, timeout=CALL_TIMEOUT, group=dist.new_group())
        r = log.last
        out[name] = {
            "sum": compact(got),
            "gathered": [compact(x) for x in parts],
            "algorithm": r.algorithm,
            "phases": sorted(r.phases),
            "allgather_phases": sorted(agl.last.phases),
            "predictions": dict(r.decision.predictions) if r.decision else {},
            "meta_bytes": r.phase_bytes.get("meta", 0),
        }
    return out


def _adaptive_eager_checks(rank: int) -> dict[str, Any]:
    """A group's eager region grows to fit the payloads of an allgather-run call, so the next call of that
    size finishes in the metadata round; another algorithm shrinks it back (collectives.meta)."""
    group = dist.new_group()
    link = sparsync.LinkModel(alpha=1e-4, beta=1e-9)  # latency-bound: auto picks allgather for 12 kB
    s = eager_inputs("one_too_big", rank)
    steps: list[tuple[str, str, list[str], int, Any]] = []
    for alg in ("auto", "auto", "auto", "dense", "auto", "ssar_recursive_double", "allgather", "auto"):
        log = CommLog()
        got = sparse_allreduce(s, algorithm=alg, log=log, link=link, timeout=CALL_TIMEOUT, group=group)
        r = log.last
        steps.append((alg, r.algorithm, sorted(r.phases), r.phase_bytes.get("meta", 0), compact(got)))
    return {"steps": steps}


def eager_inputs(name: str, rank: int) -> SparseStream:
    nnz = 10 if name == "fits" or rank else 1000
    g = torch.Generator().manual_seed(rank)
    idx = torch.randperm(20011, generator=g)[:nnz].sort().values
    return SparseStream(idx, torch.rand(nnz, generator=g, dtype=torch.float64) + 0.5, dim=20011)


# --- error workers ------------------------------------------------------------------------------------------
def _try(fn: Any) -> tuple[str, str]:
    try:
        fn()
    except Exception as e:
        return type(e).__name__, str(e)
    return "ok", ""


def errors_worker(rank: int) -> dict[str, tuple[str, str] | Any]:
    """Bad input on some ranks: every rank must raise the same kind of error (no hang), and the group must
    remain usable afterwards."""
    t = CALL_TIMEOUT

    def stream(dim: int = 10, dtype: torch.dtype = torch.float32) -> SparseStream:
        return SparseStream(torch.tensor([1, 4]), torch.tensor([1.0, 2.0], dtype=dtype), dim)

    out: dict[str, Any] = {}
    out["dim"] = _try(lambda: sparse_allreduce(stream(10 + (rank == 1)), algorithm="allgather", timeout=t))
    out["dim_allgather"] = _try(lambda: sparse_allgather(stream(10 + (rank == 2)), timeout=t))
    out["dtype"] = _try(
        lambda: sparse_allreduce(stream(dtype=torch.float64 if rank == 2 else torch.float32), timeout=t)
    )
    out["algorithm"] = _try(
        lambda: sparse_allreduce(stream(), algorithm="dense" if rank == 0 else "allgather", timeout=t)
    )

    def nan_stream() -> SparseStream:
        v = torch.ones(10)
        if rank == 1:
            v[7] = float("nan")
        return SparseStream.from_dense(v)

    out["nan"] = _try(lambda: sparse_allreduce(nan_stream(), algorithm="ssar_recursive_double", timeout=t))

    def nan_sparse() -> SparseStream:
        vals = torch.tensor([1.0, float("nan") if rank == 2 else 2.0])
        return SparseStream(torch.tensor([3, 8]), vals, 10)

    out["nan_sparse"] = _try(lambda: sparse_allreduce(nan_sparse(), algorithm="dense", timeout=t))
    res = sparse_allreduce(nan_stream(), algorithm="ssar_split_allgather", check_nan=False, timeout=t)
    out["nan_unchecked"] = res.to_dense().numpy().copy()
    out["collective"] = _try(
        lambda: sparse_allgather(stream(), timeout=t) if rank == 0 else sparse_allreduce(stream(), timeout=t)
    )
    # After all that, the group still works and every rank agrees on the call sequence.
    ok = sparse_allreduce(stream(), algorithm="ssar_recursive_double", timeout=t)
    out["after"] = ok.to_dense().numpy().copy()
    return out


def _all_pids_written(pid_dir: str) -> None:
    """Wait (30 s at most) until every rank has written its pid, so a test that checks that every started rank
    was reaped finds every pid even when the failing rank is fast and a slow one is terminated early."""
    deadline = time.monotonic() + 30.0
    while read_pids(pid_dir, dist.get_world_size()) is None and time.monotonic() < deadline:
        time.sleep(0.01)


def raise_on_rank(rank: int, bad: int, message: str, pid_dir: str) -> int:
    write_pid(pid_dir, rank)
    if rank == bad:
        _all_pids_written(pid_dir)
        raise RuntimeError(message)
    # The good ranks block in a collective the bad rank never joins; launch must terminate them.
    sparse_allreduce(SparseStream.empty(16), algorithm="allgather")
    return rank


def die_before_collective(rank: int, bad: int, code: int, pid_dir: str) -> int:
    write_pid(pid_dir, rank)
    if rank == bad:
        _all_pids_written(pid_dir)
        os._exit(code)  # no report, no destroy_process_group: a crashed peer
    sparse_allreduce(SparseStream.empty(16), algorithm="ssar_recursive_double", timeout=5)
    return rank


def stall_before_collective(rank: int, bad: int, pid_dir: str) -> int:
    """The bad rank is alive but never joins; the others pass no per-call timeout, so only the process
    group's timeout (launch's ``timeout``) can end their wait."""
    write_pid(pid_dir, rank)
    if rank == bad:
        time.sleep(300)
        return rank
    sparse_allreduce(SparseStream.empty(16), algorithm="dense")
    return rank


def doubling_worker(rank: int) -> dict[str, Any]:
    """Every algorithm with sparsync's allgathers forced to recursive doubling (as beyond DIRECT_GATHER_MAX
    ranks), against the same calls with one-round gathers: results per algorithm, both ways."""
    from sparsync.collectives import _gather

    g = torch.Generator().manual_seed(rank)
    rows = torch.unique(torch.randint(0, 400, (60 + 40 * rank,), generator=g)).to(torch.int32)
    s = SparseStream(rows, torch.randint(-5, 6, (rows.numel() * 4,), generator=g).float(), 1600, row=4)
    big = SparseStream(rows, torch.ones(rows.numel() * 4), 1600, row=4)
    out: dict[str, Any] = {}
    default = _gather.DIRECT_GATHER_MAX
    algorithms = ("allgather", "ssar_split_allgather", "dsar_split_allgather", "ssar_recursive_double", "auto")
    for mode, limit in (("direct", default), ("doubling", 1)):
        _gather.DIRECT_GATHER_MAX = limit
        try:
            for alg in algorithms:
                for i in range(3):  # the second allgather call rides in the metadata round
                    res = sparsync.sparse_allreduce(s if i < 2 else big, algorithm=alg)
                    out[f"{mode}/{alg}/{i}"] = res.to_dense().numpy()
        finally:
            _gather.DIRECT_GATHER_MAX = default
    return out
