"""A script that Lightning launches itself (test_lightning.py runs ``python _lightning_launched.py OUT``): no
process group exists, and ``Trainer(devices=2, accelerator="cpu", strategy=SparsyncStrategy(shard_plan=...))``
starts the second rank by running this script again (its ``popen`` launcher) and makes the gloo group. Each rank
then runs the plain sparsync loop (``DistributedOptimizer``, both tables sharded) in that group and writes both
runs' parameters to ``OUT/rank<r>.pt``."""

from __future__ import annotations

import sys
from pathlib import Path

import _lightning_workers as lw  # beside this script (sys.path[0] in every rank); imports lightning
import torch
import torch.distributed as dist


def main(out: Path) -> None:
    before = dist.is_initialized()
    lightning = lw.lightning_run("shard", 1, "32-true", devices=2, callbacks=[lw.Deterministic()])
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {
        "group_before_fit": before,
        "world": world,
        "start": lw._params(lw.Net()),
        "lightning": lightning,
        "plain": lw.plain_run("shard", 1, "32-true", rank, world),
    }
    torch.save(result, out / f"rank{rank}.pt")
    dist.barrier()  # rank 0, whose exit ends the test's wait, exits after every rank wrote


if __name__ == "__main__":
    main(Path(sys.argv[1]))
