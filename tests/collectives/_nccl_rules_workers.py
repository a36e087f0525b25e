"""Workers of test_nccl_rules.py: calls NCCL would refuse, made under ``NcclRules`` on 2 gloo ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _nccl_rules import NcclRules, RefusedError
from torch.distributed import distributed_c10d as c10d

import sparsync
from sparsync import SparseStream
from sparsync.collectives import comm as comm_module
from sparsync.collectives.transport import Transport


def _outcome(fn: Callable[[], object]) -> str:
    try:
        fn()
    except RefusedError as e:
        return f"refused: {e}"
    except Exception as e:  # what reached the caller instead (sparsync wraps transport errors)
        if "NCCL would refuse" in str(e):
            return f"refused: {e}"
        return f"{type(e).__name__}: {e}"
    return "ok"


def refusals_worker(rank: int) -> dict[str, Any]:
    peer = 1 - rank
    out: dict[str, Any] = {}
    with NcclRules() as rules:
        out["bor"] = _outcome(lambda: dist.all_reduce(torch.zeros(4, dtype=torch.int32), op=dist.ReduceOp.BOR))
        coo = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.tensor([1.0]), (4,))
        out["sparse"] = _outcome(lambda: dist.all_reduce(coo))
        out["object"] = _outcome(lambda: dist.all_gather_object([None, None], rank))
        out["unequal_gather"] = _outcome(lambda: dist.all_gather([torch.zeros(2), torch.zeros(3)], torch.zeros(2)))
        out["lone_isend"] = _outcome(lambda: dist.isend(torch.zeros(2), dst=peer))
        out["sum"] = _outcome(lambda: dist.all_reduce(torch.ones(4)))
        # A batch whose receive is longer than the send (gloo would take it; NCCL would not): rank 0 sends
        # 2 floats, rank 1 posts 4. Rank 1 is refused before posting; it then drains the message itself.
        if rank == 0:
            send = dist.P2POp(c10d.isend, torch.ones(2), peer)
            out["short_send"] = _outcome(lambda: [w.wait() for w in dist.batch_isend_irecv([send])])
        else:
            recv = dist.P2POp(c10d.irecv, torch.empty(4), peer)
            out["short_send"] = _outcome(lambda: dist.batch_isend_irecv([recv]))
            c10d.recv(torch.empty(2), src=peer)
        dist.barrier()
        # A library that ignores the rules (Comm told the group is gloo) is caught: the split phase posts
        # receives for the largest frame, outside a batch.
        saved = comm_module.transport
        world = dist.group.WORLD
        assert isinstance(world, dist.ProcessGroup)
        comm_module.transport = lambda group, device: Transport(exact=False, stage=False, meta=rules.meta)
        try:
            s = SparseStream(torch.tensor([rank]), torch.tensor([1.0]), dim=64)
            out["ignored_rules"] = _outcome(
                lambda: sparsync.sparse_allreduce(s, algorithm="ssar_split_allgather", timeout=5)
            )
        finally:
            comm_module.transport = saved
    out["calls"] = rules.summary()["calls"]
    return out
