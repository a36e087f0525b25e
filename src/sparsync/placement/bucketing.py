"""DDP's rule for cutting dense gradients into buckets (Li et al., "PyTorch Distributed", VLDB 2020, §3.2.3):
consecutive gradients of one key (placement and dtype) in the order backward produces them, a bucket closed once
it holds ``FIRST_CAP_BYTES`` (the first bucket: small, so the first allreduce starts early in backward) or
``cap_bytes`` (the rest), and a new one at each change of key.

One rule for the two that need it: ``optim.buckets.lay_out`` cuts the fast path's buckets with it, and
``plan.step`` prices the buckets it cuts (the plan layer sits below the replicator, so the rule sits below both).
"""

from __future__ import annotations

from collections.abc import Hashable

FIRST_CAP_BYTES = 1 << 20  # DDP's first bucket
CAP_BYTES = 25 << 20  # DDP's bucket_cap_mb default


class DenseRuns:
    """The dense buckets being cut, one gradient at a time in backward's order (``add``); ``runs``: each bucket's
    members, in launch order."""

    def __init__(self, cap_bytes: int = CAP_BYTES, first_cap_bytes: int = FIRST_CAP_BYTES) -> None:
        self.cap_bytes = cap_bytes
        self.first_cap_bytes = first_cap_bytes
        self.runs: list[list[int]] = []
        self._keys: list[Hashable] = []
        self._filled = 0

    def add(self, index: int, key: Hashable, nbytes: int) -> None:
        """Put gradient ``index`` (``nbytes`` of key ``key``) in the open bucket, or open a new one."""
        cap = self.first_cap_bytes if len(self.runs) == 1 else self.cap_bytes
        if not self.runs or self._keys[-1] != key or self._filled >= cap:
            self.runs.append([])
            self._keys.append(key)
            self._filled = 0
        self.runs[-1].append(index)
        self._filled += nbytes
