"""Worker for test_background.py."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from sparsync import SparseStream, allreduce, sparse_allreduce


def overlap_worker(rank: int) -> dict[str, Any]:
    """Async sparsync reductions in flight while this thread runs collectives of its own on the same group, in
    a different order on each rank (rank 0 starts its own first, the others after a pause)."""
    torch.set_num_threads(1)
    world = dist.get_world_size()
    out: dict[str, Any] = {"sums": [], "mine": []}
    for step in range(5):
        s = SparseStream(torch.tensor([rank, 10 + step]), torch.tensor([1.0, 2.0]), dim=20)
        mine = torch.full((3,), float(rank))

        def start(s: SparseStream = s) -> list[Any]:
            return [
                sparse_allreduce(s, async_op=True, timeout=20.0),
                allreduce(torch.ones(4), algorithm="dense", async_op=True),
            ]

        # The user's own (non-blocking) collective on the same default group: issued on rank 0 before
        # sparsync's queue thread starts its collectives, elsewhere after them, so both are in flight at once.
        if rank == 0:
            handle = dist.all_reduce(mine, async_op=True)
            works = start()
        else:
            works = start()
            time.sleep(0.05)
            handle = dist.all_reduce(mine, async_op=True)
        assert handle is not None
        handle.wait()
        out["mine"].append(mine.tolist())
        out["sums"].append([w.wait().to_dense().tolist() if i == 0 else w.wait().tolist()  # type: ignore[union-attr]
                            for i, w in enumerate(works)])  # fmt: skip
    out["world"] = world
    return out
