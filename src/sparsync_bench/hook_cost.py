"""The DDP hook's fixed cost per bucket, for ``sparsync bench compress``: a tiny bucket through
``compression_hook(compressor)`` against the same bucket through DDP's own hook (``default_hooks.allreduce_hook``).

A bucket of ``TINY`` float32 values puts almost nothing on the wire, so its time is what every bucket pays before
any byte is saved: the hook's Python, its rounds of metadata and the round trip of one collective. Measured
without error feedback (a residual's update is per byte, not fixed). Slowest rank, median of ``repeats`` batches
of ``BATCH`` calls, after ``WARMUP`` calls (the first call of a bucket layout is the checked one).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from sparsync.compress import compression_hook, from_spec
from sparsync_bench.allreduce import _timed

TINY = 256  # float32 values in the bucket (1 KB)
BATCH = 20  # hook calls per timed batch
WARMUP = 2


@dataclass(frozen=True)
class _Bucket:
    """What a DDP comm hook reads of a ``dist.GradBucket`` (torch builds those in C++ only): one parameter
    whose gradient is the bucket's flat buffer."""

    param: torch.nn.Parameter
    source: torch.Tensor  # the gradient each call starts from (a hook writes its result into the buffer)

    def refill(self) -> None:
        self.buffer().copy_(self.source)

    def buffer(self) -> torch.Tensor:
        grad = self.param.grad
        assert grad is not None  # set by tiny_bucket
        return grad

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True

    def parameters(self) -> list[torch.Tensor]:
        return [self.param]

    def gradients(self) -> list[torch.Tensor]:
        return [self.buffer()]


def tiny_bucket(rank: int) -> _Bucket:
    p = torch.nn.Parameter(torch.zeros(TINY))
    source = torch.randn(TINY, generator=torch.Generator().manual_seed(rank))
    p.grad = source.clone()
    return _Bucket(p, source)


def _per_call(call: Callable[[], object], repeats: int) -> float:
    for _ in range(WARMUP):
        call()
    return statistics.median(_timed(call, batch=BATCH) for _ in range(repeats))


def ddp_hook_s(rank: int, repeats: int) -> float:
    """Seconds per tiny bucket through DDP's own allreduce hook (on the world group, as DDP's default)."""
    bucket = tiny_bucket(rank)

    def call() -> None:
        bucket.refill()
        allreduce_hook(dist.group.WORLD, bucket).wait()  # type: ignore[arg-type]

    return _per_call(call, repeats)


def hook_s(rank: int, spec: str, repeats: int) -> float:
    """Seconds per tiny bucket through ``compression_hook(from_spec(spec))`` (collective: every rank)."""
    hook = compression_hook(from_spec(spec))
    bucket = tiny_bucket(rank)

    def call() -> None:
        # a fresh gradient each call, as in training (a sketch's estimate re-sketched in place grows to ±Inf)
        bucket.refill()
        hook(None, bucket).wait()

    return _per_call(call, repeats)
