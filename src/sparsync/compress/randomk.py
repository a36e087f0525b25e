"""``RandomK(ratio)``: k = ceil(ratio·n) uniform draws of a coordinate, each sending (n/k)·x_i, so that
E[decompress(compress(x))] = x (Stich et al. 2018, "rand-k"). A cheap baseline: no sort, no selection.

Draws are with replacement (a coordinate drawn twice is sent once with twice the weight): unbiased all the
same, and O(k) instead of the O(n) permutation that drawing without replacement costs (for k << n the two
differ in about k²/2n draws).

The coordinates come from a generator seeded by (seed, name, call number), identical on every rank, so all
ranks pick the same k coordinates and the sparse sum stays k-sparse (nothing to merge). Pass
``shared=False`` for independent picks per rank.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from sparsync.compress import base
from sparsync.compress.sparsifier import Sparsifier
from sparsync.stream import SparseStream


@dataclass(frozen=True, eq=False)
class RandomK(Sparsifier):
    """Unbiased random sparsification: ``ratio`` is the fraction of coordinates sent."""

    name: ClassVar[str] = "randomk"
    unbiased: ClassVar[bool] = True

    seed: int = 0  # base seed; the same on every rank
    shared: bool = True  # same coordinates on every rank (True) or independent per rank
    _calls: dict[str, int] = field(default_factory=dict, init=False, repr=False)

    def compress(self, tensor: torch.Tensor, ctx: base.Context = base.NO_CONTEXT) -> base.SparsePayload:
        flat = tensor.reshape(-1)
        n = flat.numel()
        k = base.count_for(self.ratio, n)
        call = self._calls.get(ctx.name, 0)
        self._calls[ctx.name] = call + 1
        key = [self.seed, zlib.crc32(ctx.name.encode()), call, 0 if self.shared else ctx.rank + 1]
        g = torch.Generator().manual_seed(hash(tuple(key)) & 0x7FFF_FFFF_FFFF_FFFF)
        if k == n:
            return base.selected(flat, None, torch.arange(n, device=flat.device), n, presorted=True)
        # Drawn on the host from the CPU generator on every device, so that a CUDA rank picks the coordinates a
        # CPU run picks (a CUDA generator's stream differs): k int64 copied to the device, no pass over x.
        draws = torch.randint(0, n, (k,), generator=g, device="cpu").to(flat.device)
        pos, hits = torch.unique(draws, sorted=True, return_counts=True)
        vals = flat[pos] * (hits.to(flat.dtype) * (n / k))
        return base.SparsePayload(SparseStream(pos, vals, n, validate=False))

    def state_dict(self) -> dict[str, Any]:
        return {"calls": dict(self._calls)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._calls.clear()
        self._calls.update({str(k): int(v) for k, v in state.get("calls", {}).items()})
