"""Worker of test_dgc.py: Deep Gradient Compression (``TopK(warmup=)`` + ``MomentumCorrection``) through
``compressed_allreduce`` on a real group, and through the DDP hook, in float64."""

from __future__ import annotations

import torch

from sparsync.compress import MomentumCorrection, TopK, compressed_allreduce

STEPS, N, RATIO, WARMUP, MOMENTUM = 12, 400, 0.01, 8, 0.9


def gradients(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + rank)
    return [torch.randn(N, generator=gen, dtype=torch.float64) * (1 + t % 3) for t in range(STEPS)]


def dgc_worker(rank: int) -> list[torch.Tensor]:
    """The sums over ranks that ``compressed_allreduce`` returned at each step (``average=False``)."""
    comp, memory = TopK(RATIO, warmup=WARMUP), MomentumCorrection(MOMENTUM)
    out = []
    for g in gradients(rank):
        res = compressed_allreduce(g, comp, memory=memory, name="w", average=False)
        assert isinstance(res, torch.Tensor)
        out.append(res)
    return out
