"""Ranks for test_flight.py: a rank that dies mid-loop, ranks that disagree on a call. Each survivor writes the
text of the error it got to ``<out>/rank<R>.err``, since the launcher reports one survivor's error only."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from sparsync import SparseStream, sparse_allreduce

STEPS = 8
KILL_AT = 3


def _loop(rank: int, dead: int, out: str) -> int:
    rows = torch.tensor([rank, 5 + rank, 9])  # 3 of 16 rows of 4 values
    stream = SparseStream(rows, torch.ones(12), dim=64, row=4)
    try:
        for step in range(STEPS):
            if step == KILL_AT and rank == dead:
                os.kill(os.getpid(), signal.SIGKILL)
            # allgather: every survivor talks to the dead rank directly, so each fails on its connection
            sparse_allreduce(stream, algorithm="allgather", timeout=20)
    except Exception as e:
        (Path(out) / f"rank{rank}.err").write_text(f"{type(e).__name__}: {e}")
        raise
    return rank


def die_in_loop(rank: int, dead: int, out: str) -> int:
    """Under ``launch``: rank ``dead`` kills itself with SIGKILL at step ``KILL_AT`` of a loop of reductions."""
    return _loop(rank, dead, out)


def mismatch(rank: int) -> str:
    """Two calls agree, then rank 1 reduces a stream of another dimension: the same ValueError everywhere."""
    for _ in range(2):
        sparse_allreduce(SparseStream.from_dense(torch.ones(8)), algorithm="allgather")
    try:
        sparse_allreduce(SparseStream.from_dense(torch.ones(16 if rank == 1 else 8)), algorithm="allgather")
    except ValueError as e:
        return str(e)
    return "no error"


if __name__ == "__main__":  # under torchrun: ``python -m torch.distributed.run ... _flight_workers.py OUT``
    dist.init_process_group("gloo")
    try:
        _loop(dist.get_rank(), dist.get_world_size() - 1, sys.argv[1])
    except Exception:
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
