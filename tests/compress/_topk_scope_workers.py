"""Worker of test_topk_scope.py: ``compression_hook(TopK(ratio, scope="bucket"), ErrorFeedback())`` on a DDP model
of two layers (one bucket), in float64; each rank also returns its local gradients."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sparsync.compress import ErrorFeedback, TopK
from sparsync.compress.hooks import compression_hook

STEPS, RATIO = 5, 0.02


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 30), nn.Tanh(), nn.Linear(30, 5)).double()


def worker(rank: int) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Per step: (this rank's local gradients, the gradients DDP's hook left), at fixed weights."""
    net = model()
    ddp = DistributedDataParallel(net)
    ddp.register_comm_hook(None, compression_hook(TopK(RATIO, scope="bucket"), ErrorFeedback(), module=ddp))
    gen = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(STEPS):
        x = torch.randn(8, 20, generator=gen, dtype=torch.float64)
        local = torch.autograd.grad(net(x).square().sum(), list(net.parameters()))
        ddp.zero_grad(set_to_none=True)
        ddp(x).square().sum().backward()
        out.append(([g.clone() for g in local], [p.grad.clone() for p in net.parameters() if p.grad is not None]))
    return out
