"""Workers for the grouped allreduce tests (test_grouped.py): inputs are deterministic functions of
(case, rank, world) with values in multiples of 1/4, so every partial sum is exact and the parent rebuilds the
exact sum of every tensor."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from _workers import ALGORITHMS

from sparsync import CommLog, grouped_allreduce
from sparsync.record import AGREE

PATTERNS = ("empty", "zipf", "all_rows", "mixed")  # mixed: empty on even ranks, Zipf on odd ones
WIDTH = 8
EMB_ROWS = (97, 31)
# A COO tensor with two sparse dims (5 x 7 rows of WIDTH), and dense tensors whose sizes (15 + 7 + 12 = 34)
# leave the last fused row padded.
GRID_SHAPE = (5, 7, WIDTH)
DENSE_SHAPES = ((3, 5), (7,), (2, 2, 3))


def _vals(rng: np.random.Generator, n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(rng.integers(-32, 33, size=n) / 4.0).to(dtype)


def _rows(pattern: str, rows: int, rng: np.random.Generator, rank: int) -> np.ndarray:
    if pattern == "empty" or (pattern == "mixed" and rank % 2 == 0):
        return np.empty(0, dtype=np.int64)
    if pattern == "all_rows":
        return np.arange(rows, dtype=np.int64)
    p = 1.0 / np.arange(1, rows + 1) ** 1.1
    # Duplicates on purpose: the embedding backward's COO gradient is uncoalesced.
    return rng.choice(rows, 12, p=p / p.sum())


def inputs(pattern: str, dtype: torch.dtype, rank: int, world: int) -> list[torch.Tensor]:
    """[embedding 0 (COO), dense, embedding 1 (COO), dense, grid (COO, 2 sparse dims), dense]."""
    rng = np.random.default_rng([PATTERNS.index(pattern), rank, world])
    out: list[torch.Tensor] = []
    for i, rows in enumerate(EMB_ROWS):
        r = _rows(pattern, rows, rng, rank)
        idx = torch.from_numpy(r).reshape(1, -1)
        out.append(
            torch.sparse_coo_tensor(idx, _vals(rng, r.size * WIDTH, dtype).reshape(-1, WIDTH), (rows, WIDTH))
        )
        out.append(_vals(rng, int(np.prod(DENSE_SHAPES[i])), dtype).reshape(DENSE_SHAPES[i]))
    r = _rows(pattern, GRID_SHAPE[0] * GRID_SHAPE[1], rng, rank)
    idx = torch.from_numpy(np.stack(np.unravel_index(r, GRID_SHAPE[:2])))
    out.append(torch.sparse_coo_tensor(idx, _vals(rng, r.size * WIDTH, dtype).reshape(-1, WIDTH), GRID_SHAPE))
    out.append(_vals(rng, int(np.prod(DENSE_SHAPES[2])), dtype).reshape(DENSE_SHAPES[2]))
    return out


def describe(t: torch.Tensor) -> dict[str, Any]:
    if t.is_sparse:
        c = t.coalesce() if not t.is_coalesced() else t
        return {"sparse": True, "dense": c.to_dense().double().numpy(), "rows": c.indices().numpy(),
                "coalesced": t.is_coalesced(), "dtype": str(t.dtype), "shape": tuple(t.shape)}  # fmt: skip
    return {"sparse": False, "dense": t.double().numpy(), "dtype": str(t.dtype), "shape": tuple(t.shape)}


def grouped_worker(rank: int) -> dict[str, Any]:
    world = dist.get_world_size()
    torch.set_num_threads(1)
    out: dict[str, Any] = {"grid": {}}
    for pattern in PATTERNS:
        for dname, dtype in (("float32", torch.float32), ("float64", torch.float64)):
            for alg in (*ALGORITHMS, "auto"):
                key = f"{pattern}/{dname}/{alg}"
                ts = inputs(pattern, dtype, rank, world)
                before = [describe(t)["dense"].copy() for t in ts]
                log = CommLog()
                try:
                    res = grouped_allreduce(ts, algorithm=alg, log=log, timeout=30.0)
                    assert isinstance(res, list)
                    unchanged = all(
                        np.array_equal(describe(t)["dense"], b) for t, b in zip(ts, before, strict=True)
                    )
                    out["grid"][key] = {"out": [describe(t) for t in res], "unchanged": unchanged,
                                        "calls": len(log.records)}  # fmt: skip
                except Exception as e:  # reported to the parent, which names the failing case
                    out["grid"][key] = {"error": f"{type(e).__name__}: {e}"}
    # Async: a handle whose wait() gives the same list.
    ts = inputs("zipf", torch.float32, rank, world)
    work = grouped_allreduce(ts, async_op=True)
    out["async"] = [describe(t) for t in work.wait()]  # type: ignore[union-attr]
    # An out-of-range row in tensor 2 on the last rank: the same ValueError on every rank.
    ts = inputs("zipf", torch.float32, rank, world)
    if rank == world - 1:
        ts[2] = torch.sparse_coo_tensor(torch.tensor([[3, 31]]), torch.ones(2, WIDTH), (31, WIDTH))
    try:
        grouped_allreduce(ts, timeout=30.0)
        out["bad"] = "no error"
    except ValueError as e:
        out["bad"] = str(e)
    # The group still works after the error.
    one = grouped_allreduce([torch.ones(3)], timeout=30.0)
    out["after"] = one[0].tolist()  # type: ignore[index]
    out["placements"] = placements(rank, world)
    dist.barrier()
    return out


def optimizer_grads(rank: int, world: int) -> list[torch.Tensor]:
    """Exact gradients for an embedding (31 x WIDTH, COO) and a linear layer (3 x WIDTH, 3)."""
    ts = inputs("zipf", torch.float32, rank, world)
    rng = np.random.default_rng([99, rank, world])
    return [ts[2], _vals(rng, 3 * WIDTH, torch.float32).reshape(3, WIDTH), _vals(rng, 3, torch.float32)]


def placements(rank: int, world: int) -> dict[str, Any]:
    """wrap_optimizer's default (ByLayout, fused into one Grouped call), ByLayout(fuse=False) and Grouped with
    the dense part left to DenseAllreduce: the same sums, in 1, 2 and 2 calls."""
    from torch import nn

    from sparsync.replicator import ByLayout, Grouped, ReduceEnv, ReplicatedOptimizer

    emb, lin = nn.Embedding(31, WIDTH, sparse=True), nn.Linear(WIDTH, 3)
    params = [emb.weight, lin.weight, lin.bias]
    res: dict[str, Any] = {}
    for name, placement in (("fused", ByLayout()), ("separate", ByLayout(fuse=False)),
                            ("dense_apart", Grouped(max_dense=1))):  # fmt: skip
        log = CommLog()
        env = ReduceEnv(dist.group.WORLD, world, 30.0, log)
        opt = ReplicatedOptimizer(torch.optim.SGD(params, lr=0.0), env, op="sum", default=placement)
        for p, g in zip(params, optimizer_grads(rank, world), strict=True):
            p.grad = g
        opt.aggregate()
        # the reductions (the construction's broadcast and the layouts' agreement round left out)
        calls = [r for r in log.records if r.op not in ("broadcast", AGREE)]
        res[name] = {"grads": [describe(p.grad) for p in params if p.grad is not None], "calls": len(calls)}
    return res
