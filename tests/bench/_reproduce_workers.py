"""Workers for test_reproduce.py (module-level: ``launch`` pickles them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from sparsync.record import CommLog
from sparsync_bench.omnireduce import block_allreduce

ROWS = 257  # not a multiple of the 4 rows a block of 256 holds at dim 64: the last block is short


def grad(rank: int, density: float, dim: int, seed: int = 0) -> torch.Tensor:
    """An uncoalesced embedding-style COO gradient touching about density·ROWS rows (repeats included)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    n = round(density * ROWS)
    idx = torch.randint(0, ROWS, (2 * n,), generator=g)[: 2 * n] if n else torch.zeros(0, dtype=torch.long)
    if density == 1.0:
        idx = torch.cat([torch.arange(ROWS), idx])
    vals = torch.randn(idx.numel(), dim, generator=g, dtype=torch.float64)
    return torch.sparse_coo_tensor(idx.unsqueeze(0), vals, (ROWS, dim))


def omnireduce_worker(rank: int, densities: tuple[float, ...], dims: tuple[int, ...]) -> list[dict[str, object]]:
    """block_allreduce against the float64 sum of every rank's gradient (computed on every rank)."""
    P = dist.get_world_size()
    out = []
    for d in densities:
        for dim in dims:
            log = CommLog()
            got = block_allreduce(grad(rank, d, dim), group=None, log=log).coalesce()
            ref = sum(grad(r, d, dim).to_dense() for r in range(P))
            assert isinstance(ref, torch.Tensor)
            out.append({
                "density": d, "dim": dim, "equal": bool(torch.allclose(got.to_dense(), ref, rtol=0, atol=1e-12)),
                "rows": got.indices()[0].tolist(), "ref_rows": ref.ne(0).any(1).nonzero().flatten().tolist(),
                "bytes": log.last.bytes_sent,
            })  # fmt: skip
    return out
