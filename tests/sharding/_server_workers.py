"""Workers for test_server.py (module-level: ``launch`` pickles them): a model whose plan mixes the three
placements of ``sparsync.shard`` (one table replicated, one sharded, one on the parameter server), trained by
``HybridTrainer`` beside one float64 process on every rank's batch."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from _shard_workers import message
from torch import nn

import sparsync
from sparsync.hybrid import HybridConfig, HybridTrainer
from sparsync.optim import DistributedOptimizer
from sparsync.placement import Sharded, placement_of
from sparsync.ps import OptimizerConfig
from sparsync.sharding import plan_of

PLAN = {"rep": "replicated", "sh": "sharded", "srv": "server"}
LR = 0.1
STEPS = 4
# (sparse_reduce, dense_reduce, procs_per_machine: None = P, one machine whose chief pushes the server's rows)
CASES: list[tuple[str, str, int | None]] = [("sum", "sum", 1), ("mean", "mean", 1), ("mean", "sum", None)]


class Trio(nn.Module):
    """One table per placement and a dense layer over the three pooled outputs. ``srv`` is a plain
    ``nn.Embedding`` (dense gradient): the servers take it by rows whatever its ``sparse`` flag. Its values start
    float32-exact, as the servers keep them (rank 0 writes its table there in float32)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.rep = nn.Embedding(20, 3, sparse=True)
        self.sh = nn.EmbeddingBag(30, 3, mode="mean")  # 30 rows: even shards at P = 1, 3, 5
        self.srv = nn.Embedding(24, 3)
        self.fc = nn.Linear(9, 2)
        self.double()
        with torch.no_grad():
            self.srv.weight.copy_(self.srv.weight.float().double())

    def forward(self, x: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        pooled = [self.rep(x).sum(1), self.sh(ids, offsets), self.srv(z).mean(1)]
        return self.fc(torch.cat(pooled, dim=1)).tanh()


def batch(step: int, rank: int) -> tuple[torch.Tensor, ...]:
    """Uneven batches (1 to 3 samples), duplicate ids within a batch."""
    g = torch.Generator().manual_seed(97 * step + rank)
    n = 1 + (rank + step) % 3
    return (
        torch.randint(0, 20, (n, 2), generator=g),
        torch.randint(0, 30, (2 * n,), generator=g),
        2 * torch.arange(n),
        torch.randint(0, 24, (n, 3), generator=g),
    )


def loss_of(model: nn.Module, b: tuple[torch.Tensor, ...]) -> torch.Tensor:
    out: torch.Tensor = model(*b).square().sum()
    return out


def reference(P: int, sparse_reduce: str, dense_reduce: str) -> list[dict[str, torch.Tensor]]:
    """One float64 process on every rank's batch: the sum of the ranks' losses, each table's gradient divided by
    P where ``sparse_reduce`` says mean, the dense layer's where ``dense_reduce`` does; plain SGD. The weights
    after each step."""
    ref = Trio(seed=0)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    after = []
    for step in range(STEPS):
        opt.zero_grad()
        sum(loss_of(ref, batch(step, r)) for r in range(P)).backward()  # type: ignore[union-attr]
        for name, p in ref.named_parameters():
            mean = (sparse_reduce if not name.startswith("fc.") else dense_reduce) == "mean"
            if mean and p.grad is not None:
                p.grad = p.grad / P
        opt.step()
        after.append({n: p.detach().clone() for n, p in ref.named_parameters()})
    return after


def mixed_worker(rank: int, addresses: list[str], prefix: str) -> dict[str, Any]:
    """Each of ``CASES``: train ``Trio`` (each rank from its own seed: rank 0's weights must win) placed by
    ``PLAN`` with ``HybridTrainer`` and compare every parameter, after every step, with ``reference``: this rank's
    replicated parameters whole, its shard's rows, and (rank 0) the server's table; then ``refusals``."""
    P = dist.get_world_size()
    out: dict[str, Any] = {"cases": {}}
    for k, (sparse_reduce, dense_reduce, ppm) in enumerate(CASES):
        model = sparsync.shard(Trio(seed=rank), plan=PLAN)
        placed = {n: type(pl).__name__ for n, pl in plan_of(model).items()}
        local = [p for n, p in model.named_parameters() if n != "srv.weight"]
        cfg = HybridConfig(
            mode="sync", sparse_reduce=sparse_reduce, dense_reduce=dense_reduce,
            optimizer=OptimizerConfig("sgd", lr=LR), procs_per_machine=ppm or P, table_prefix=f"{prefix}{k}/",
            timeout=30.0,
        )  # fmt: skip
        tr = HybridTrainer(model, addresses, cfg, dense_optimizer=torch.optim.SGD(local, lr=LR))
        want = reference(P, sparse_reduce, dense_reduce)
        errors: dict[str, list[float]] = {}
        losses = []
        for step in range(STEPS):
            b = batch(step, rank)
            losses.append(tr.step(lambda b=b, m=model: loss_of(m, b)))
            got = {n: p.detach() for n, p in model.named_parameters() if n != "srv.weight"}
            if rank == 0:
                got["srv.weight"] = tr.tables["srv.weight"].read_all().to(torch.float64)
            for n, g in got.items():
                w = want[step][n]
                if isinstance(placement_of(model.get_parameter(n)), Sharded):
                    w = w[rank::P]
                errors.setdefault(n, []).append(float((g - w).abs().max()))
        dist.barrier()
        out["cases"][f"{sparse_reduce}/{dense_reduce}/ppm={ppm or P}"] = {
            "errors": errors,
            "placed": placed,
            "kinds": dict(tr.placements),
            "on_servers": list(tr.sparse_names),
            "losses": losses,
            "moved": float((want[-1]["srv.weight"] - Trio(seed=0).srv.weight.detach()).abs().max()),
        }
        tr.close()
    out["refused"] = refusals(rank, addresses)
    return out


def refusals(rank: int, addresses: list[str]) -> dict[str, str]:
    """What HybridTrainer and DistributedOptimizer refuse of a model placed by ``PLAN`` (the test reads P = 3)."""
    out = {}
    model = sparsync.shard(Trio(seed=0), plan=PLAN)
    out["async"] = message(lambda: HybridTrainer(model, addresses, HybridConfig(mode="async", timeout=10.0)))
    cfg = HybridConfig(timeout=10.0, table_prefix="refused/")
    out["moved"] = message(lambda: HybridTrainer(model, addresses, cfg, placements={"sh.weight": "ps"}))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), model, overlap=False)
    opt.zero_grad()
    loss_of(model, batch(0, rank)).backward()
    out["distributed_optimizer"] = message(opt.step)
    return out


def ps_dense_worker(rank: int, addresses: list[str], prefix: str) -> dict[str, Any]:
    """``Trio`` placed by ``PLAN`` under ``HybridConfig(ps_dense=True)`` (every parameter the plan does not shard
    on the servers: the replicated table and the dense layer whole, the server table by rows): each parameter's
    largest error against ``reference`` over the steps, the servers' from rank 0, and the placements."""
    P = dist.get_world_size()
    model = sparsync.shard(Trio(seed=rank), plan=PLAN)
    cfg = HybridConfig(mode="sync", sparse_reduce="mean", dense_reduce="mean", ps_dense=True,
                       optimizer=OptimizerConfig("sgd", lr=LR), table_prefix=prefix, timeout=30.0)  # fmt: skip
    shard = [p for n, p in model.named_parameters() if n == "sh.weight"]
    tr = HybridTrainer(model, addresses, cfg, dense_optimizer=torch.optim.SGD(shard, lr=LR))
    want = reference(P, "mean", "mean")
    errors: dict[str, float] = {}
    for step in range(STEPS):
        b = batch(step, rank)
        tr.step(lambda b=b, m=model: loss_of(m, b))
        for n, p in model.named_parameters():
            if n == "sh.weight":
                got, w = p.detach(), want[step][n][rank::P]
            elif rank == 0:  # on the servers
                got, w = tr.tables[n].read_all().to(torch.float64).reshape(p.shape), want[step][n]
            else:
                continue
            errors[n] = max(errors.get(n, 0.0), float((got - w).abs().max()))
    out = {"kinds": dict(tr.placements), "errors": errors}
    tr.close()
    return out
