"""Worker of test_feedback_invariant.py: error feedback's promise through compressed_allreduce over many
steps, Σ(results) + Σ(final residuals) = Σ(gradients), on every rank's data."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from sparsync.compress import QSGD, ErrorFeedback, TopK, compressed_allreduce

STEPS, N = 10, 2048


def invariant_worker(rank: int, specs: list[str]) -> dict[str, float]:
    """Per compressor: the relative gap |Σ g - (Σ results + Σ residuals)| / |Σ g| (summed over ranks)."""
    out: dict[str, float] = {}
    for spec in specs:
        comp: Any = QSGD(bits=int(spec.split("=")[1])) if spec.startswith("qsgd") else TopK(0.01)
        memory = ErrorFeedback()
        g_sum = torch.zeros(N, dtype=torch.float64)
        got = torch.zeros(N, dtype=torch.float64)
        gen = torch.Generator().manual_seed(100 + rank)
        for _ in range(STEPS):
            g = torch.randn(N, generator=gen)
            g_sum += g.double()
            res = compressed_allreduce(g, comp, memory=memory, name="w", average=False)
            assert isinstance(res, torch.Tensor)
            got += res.double()  # the same on every rank: the sum over ranks
        errors = memory.state_dict()["errors"]
        assert isinstance(errors, dict)
        residual = errors["w"].double().reshape(-1) if "w" in errors else torch.zeros(N, dtype=torch.float64)
        total = torch.stack([g_sum, residual])
        dist.all_reduce(total)  # Σ over ranks of the gradients and of the final residuals
        out[spec] = float((total[0] - (got + total[1])).norm() / total[0].norm())
    return out
