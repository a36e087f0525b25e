"""Workers of test_comm_state.py (module-level: ``launch`` pickles them)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from sparsync.collectives.comm import Comm
from sparsync.collectives.transport import use_nccl_rules


def facts_worker(rank: int) -> dict[str, Any]:
    """A Comm's rank, size and transport rules on the world, on a group of ranks 1 and 2, on a group made again
    over every rank after that one was destroyed, and on the world after ``use_nccl_rules``."""
    cpu = torch.device("cpu")
    world = Comm(dist.group.WORLD)  # type: ignore[arg-type]
    out: dict[str, Any] = {"world": (world.rank, world.size, world.exact)}
    pair = dist.new_group([1, 2])
    if rank in (1, 2):
        c = Comm(pair, device=cpu)
        out["pair"] = (c.rank, c.size)
    dist.destroy_process_group(pair)
    again = dist.new_group([0, 1, 2])
    c = Comm(again, device=cpu)
    out["again"] = (c.rank, c.size)
    meta = dist.new_group(backend="gloo")
    use_nccl_rules(dist.group.WORLD, meta)  # type: ignore[arg-type]
    after = Comm(dist.group.WORLD)  # type: ignore[arg-type]
    out["nccl_rules"] = (after.exact, after.meta.group is meta)
    return out
