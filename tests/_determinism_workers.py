"""Worker for test_determinism.py: a short sync training whose final parameters are
returned as bytes, so two runs can be compared bit for bit."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch import nn

import sparsync
from sparsync.compress import ErrorFeedback, Threshold
from sparsync.record import AGREE
from sparsync.replicator import (
    ByLayout,
    Compressed,
    DenseAllreduce,
    Placement,
    ReduceEnv,
    ReplicatedOptimizer,
    SparseAllreduce,
)

VOCAB, DIM = 5000, 16


def _placements() -> dict[str, Placement]:
    return {
        "default": ByLayout(),
        "separate": ByLayout(fuse=False),
        "dense": DenseAllreduce(),
        "sparse_auto": SparseAllreduce(),
        "dct_dp": Compressed(Threshold(0.05, lifespan=3), ErrorFeedback()),
    }


def train(rank: int, steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    sparsync.set_deterministic()
    world = dist.get_world_size()
    probs = 1.0 / torch.arange(1, VOCAB + 1, dtype=torch.float64) ** 1.1
    out: dict[str, Any] = {}
    for name, placement in _placements().items():
        torch.manual_seed(0)
        emb = nn.Embedding(VOCAB, DIM, sparse=name != "dct_dp")
        mlp = nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Linear(32, 4))
        params = [("emb.weight", emb.weight), *(("mlp." + n, p) for n, p in mlp.named_parameters())]
        env = ReduceEnv(dist.group.WORLD, world, 30.0, sparsync.CommLog())
        opt = ReplicatedOptimizer(
            torch.optim.SGD([p for _, p in params], lr=0.5),
            env,
            op="mean",
            named_parameters=params,
            default=placement,
        )
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(steps):
            tok = torch.multinomial(probs, 64 * 8, replacement=True, generator=g).view(64, 8)
            y = tok[:, 0] % 4
            opt.zero_grad()
            F.cross_entropy(mlp(emb(tok).mean(1)), y).backward()  # type: ignore[no-untyped-call]
            opt.step()
        h = hashlib.sha256()
        for _, p in params:
            h.update(p.detach().numpy().tobytes())
        assert env.log is not None
        reductions = [r for r in env.log.records if r.op not in ("broadcast", AGREE)]
        out[name] = {"digest": h.hexdigest(), "algorithms": sorted({r.algorithm for r in reductions})}
    return out
