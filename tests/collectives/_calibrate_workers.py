"""Ranks for test_calibrate.py."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from sparsync.collectives import calibrate
from sparsync.collectives.traffic import Traffic


def count_barriers(rank: int, reps: int) -> tuple[int, float, float]:
    """The barriers ``_collective_latencies`` calls for ``reps`` samples, and its α and α of an all-to-all."""
    calls: list[int] = []
    real = dist.barrier

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    dist.barrier = counted  # this rank's process only, for this call
    try:
        alpha, alpha_a2a = calibrate._collective_latencies(dist.group.WORLD, reps, Traffic())
    finally:
        dist.barrier = real
    return len(calls), alpha, alpha_a2a
