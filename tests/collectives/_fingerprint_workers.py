"""Workers for test_fingerprint.py: calls that differ across ranks in shape, auto's inputs
or finiteness raise the same ValueError on every rank, promptly, and the group keeps working."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _bad_input_workers import ctx

from sparsync import LinkModel, SparseStream, allreduce, choose_fastest, grouped_allreduce, sparse_allreduce
from sparsync.compress import Identity, compressed_allreduce
from sparsync.costmodel import Decision, Problem

LINK = LinkModel(alpha=1e-4, beta=1e-9)


def _cases(rank: int) -> dict[str, Callable[[], Any]]:
    odd = rank % 2 == 1
    emb = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.ones(2, 6), (4, 6))
    emb_t = torch.sparse_coo_tensor(torch.tensor([[0, 1], [0, 1]]), torch.ones(2, 6), (2, 2, 6))
    inf = torch.tensor([1.0, float("inf") if rank == 0 else float("-inf") if rank == 1 else 0.0])
    return {
        "dense_shape": lambda: allreduce(torch.ones(2, 5) if odd else torch.ones(5, 2), timeout=20.0),
        "coo_shape": lambda: allreduce(emb_t if odd else emb, timeout=20.0),
        "grouped_shape": lambda: grouped_allreduce([torch.ones(2, 5) if odd else torch.ones(5, 2)], timeout=20.0),
        "link": lambda: allreduce(torch.ones(8), link=LINK if rank == 0 else None, timeout=20.0),
        "policy": lambda: (
            allreduce(torch.ones(8), link=LINK, policy=choose_fastest if odd else None, timeout=20.0)
            if odd
            else allreduce(torch.ones(8), link=LINK, timeout=20.0)
        ),
        "inf": lambda: allreduce(inf, algorithm="allgather", timeout=20.0),
        "inf_ieee": lambda: allreduce(inf, algorithm="allgather", check_nan=False, timeout=20.0).tolist(),
        "nan": lambda: allreduce(torch.tensor([float("nan") if rank == 1 else 0.0]), timeout=20.0),
        # Rank 1 skips the first of two calls: its second pairs with the others' first.
        "skipped": lambda: [allreduce(t, timeout=20.0) for t in _sequence(rank, skip=True)],
        # Rank 1 issues the two calls in the other order.
        "reordered": lambda: [allreduce(t, timeout=20.0) for t in _sequence(rank, skip=False)],
        # Rank 2 skips the call on one line and makes the next one (same shape) on another.
        "site": lambda: _from_two_lines(rank, None),
        "site_named": lambda: _from_two_lines(rank, "x"),
        "site_reduce": lambda: _reduce_from_two_lines(rank),
        "site_replica": lambda: _all_sum_from_two_lines(rank),
        # A policy holding per-rank state: same qualified name everywhere, different choices.
        "stateful_policy": lambda: allreduce(
            torch.ones(8), link=LINK, policy=_per_rank_policy(rank), timeout=20.0
        ),
        # validate=False lets index 10 of a 10-value stream through the constructor.
        "unvalidated": lambda: sparse_allreduce(
            SparseStream(torch.tensor([10 if rank == 1 else 1]), torch.tensor([1.0]), 10, validate=False),
            timeout=20.0,
        ).to_dense(),
    }


def _from_two_lines(rank: int, name: str | None) -> torch.Tensor:
    if rank == 2:
        return allreduce(torch.full((4,), 2.0), name=name, timeout=20.0)
    return allreduce(torch.ones(4), name=name, timeout=20.0)


def _reduce_from_two_lines(rank: int) -> torch.Tensor:
    if rank == 2:
        return compressed_allreduce(torch.full((4,), 2.0), Identity(), timeout=20.0)
    return compressed_allreduce(torch.ones(4), Identity(), timeout=20.0)


def _all_sum_from_two_lines(rank: int) -> torch.Tensor:
    group = dist.group.WORLD
    assert isinstance(group, dist.ProcessGroup)
    c = ctx(group)
    if rank == 2:
        return c.all_sum(torch.full((4,), 2.0))
    return c.all_sum(torch.ones(4))


def _per_rank_policy(rank: int) -> Callable[[Problem, LinkModel], Decision]:
    def policy(p: Problem, link: LinkModel) -> Decision:
        return Decision("dense" if rank == 0 else "allgather")

    return policy


def _sequence(rank: int, *, skip: bool) -> list[torch.Tensor]:
    calls = [torch.ones(4), torch.ones(2, 3)]
    if rank != 1:
        return calls
    return calls[1:] if skip else calls[::-1]


def fingerprint_worker(rank: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name, fn in _cases(rank).items():
        dist.barrier()
        t0 = time.perf_counter()
        try:
            res = fn()
            out[name] = {"ok": res.tolist() if isinstance(res, torch.Tensor) else res}
        except ValueError as e:
            out[name] = {"error": str(e)}
        out[name]["seconds"] = time.perf_counter() - t0
        # The group still works, and agrees on the next call.
        out[name]["after"] = allreduce(torch.ones(3), timeout=20.0).tolist()
    return out
