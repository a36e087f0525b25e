"""Worker of test_dense_below.py: ``TopK(ratio, dense_below=N)`` + ``ErrorFeedback`` through
``compressed_allreduce`` on a real group, in float64, on a small tensor (sent whole) and a large one."""

from __future__ import annotations

import torch

from sparsync.compress import ErrorFeedback, TopK, compressed_allreduce

STEPS, RATIO, DENSE_BELOW = 6, 0.05, 64
SHAPES = {"bias": (40,), "weight": (20, 30)}  # 40 < DENSE_BELOW: whole; 600 entries: top 5%


def gradients(rank: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(2000 + rank)
    return [
        {
            name: torch.randn(shape, generator=gen, dtype=torch.float64) * (1 + t % 3)
            for name, shape in SHAPES.items()
        }
        for t in range(STEPS)
    ]


def worker(rank: int) -> list[dict[str, torch.Tensor]]:
    """The sums over ranks that ``compressed_allreduce`` returned at each step, per name (``average=False``)."""
    comp, memory = TopK(RATIO, dense_below=DENSE_BELOW), ErrorFeedback()
    out = []
    for grads in gradients(rank):
        step = {}
        for name, g in grads.items():
            res = compressed_allreduce(g, comp, memory=memory, name=name, average=False)
            assert isinstance(res, torch.Tensor)
            step[name] = res
        out.append(step)
    return out
