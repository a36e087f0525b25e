"""Sum a sparse vector over ranks with sparsync; the same script runs locally or under torchrun.

python examples/sparse_allreduce.py              # 4 local processes
torchrun --nproc-per-node 4 examples/sparse_allreduce.py   # nprocs must match launch(nprocs=4)
"""

from __future__ import annotations

import torch

import sparsync
from sparsync import CommLog, SparseStream, sparse_allreduce


def work(rank: int, dim: int) -> str:
    g = torch.Generator().manual_seed(rank)
    idx = torch.randperm(dim, generator=g)[: dim // 100].sort().values
    stream = SparseStream(idx, torch.randn(idx.numel(), generator=g), dim)
    log = CommLog()
    total = sparse_allreduce(stream, log=log)  # algorithm="auto"
    rec = log.last
    assert rec.decision is not None
    preds = ", ".join(f"{k}={v * 1e3:.2f}ms" for k, v in rec.decision.predictions.items())
    return (
        f"rank {rank}/{rec.world_size}: nnz in {stream.nnz} -> out {total.nnz}; auto chose {rec.algorithm} "
        f"({rec.seconds * 1e3:.1f} ms, {rec.bytes_sent} B sent); model: {preds}"
    )


if __name__ == "__main__":
    for line in sparsync.launch(work, nprocs=4, args=(1_000_000,)):
        print(line, flush=True)
