"""Workers for test_checkpoint.py (module-level: ``launch`` pickles them): DCP checkpoints of sharded tables
saved at one world size and resumed at another, against the same state loaded through the full state dict."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import sparsync
from sparsync.optim import DistributedOptimizer
from sparsync.sharding import checkpoint, load_optimizer_state_dict, optimizer_state_dict, plan_of

ROWS = (37, 23)  # no world size of the tests divides them
BLOCK = 3  # rows per stored chunk and per window share: many windows, each holding rows of several owners
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
}


class Net(nn.Module):
    """Two tables (a bag and an embedding) and a dense head, float64."""

    def __init__(self, seed: int, sparse: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.bag = nn.EmbeddingBag(ROWS[0], 3, mode="sum", sparse=sparse)
        self.emb = nn.Embedding(ROWS[1], 3, sparse=sparse)
        self.fc = nn.Linear(3, 1)
        self.double()

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor, more: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bag(ids, offsets) + self.emb(more).sum(1)).squeeze(1)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1009 * step + rank)
    n = 2 + (rank + step) % 3
    return (torch.randint(0, ROWS[0], (3 * n,), generator=g), 3 * torch.arange(n),
            torch.randint(0, ROWS[1], (n, 2), generator=g))  # fmt: skip


def make(seed: int, opt: str, sharded: bool = True) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = sparsync.shard(Net(seed)) if sharded else Net(seed, sparse=True)
    plan = plan_of(model) or None
    o = DistributedOptimizer(OPTIMIZERS[opt](model.parameters()), model, plan=plan, sync_parameters=False,
                             overlap=False)  # fmt: skip
    return model, o


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    rank = dist.get_rank()
    losses = []
    for step in steps:
        opt.zero_grad()
        loss = model(*batch(step, rank)).square().mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _dense(sd: dict[str, Any]) -> dict[str, Any]:
    """A copy of an optimizer state dict, its sparse tensors dense (the checkpoint writes per-row state dense)."""
    state = {i: {k: (v.to_dense() if v.is_sparse else v.clone()) if isinstance(v, torch.Tensor) else v
                 for k, v in s.items()} for i, s in sd["state"].items()}  # fmt: skip
    return {**sd, "state": state}


def save_worker(rank: int, path: str, ref: str, opt_name: str, sharded: bool = True) -> None:
    """Two steps at this P, then the DCP checkpoint at ``path`` and the full state dicts (the reference) at
    ``ref`` (rank 0)."""
    model, opt = make(0, opt_name, sharded)
    train(model, opt, range(2))
    checkpoint.save(path, model, opt, block_rows=BLOCK)
    full = model.state_dict()
    ostate = optimizer_state_dict(opt, model) if sharded else opt.state_dict()
    if rank == 0:
        torch.save((full, _dense(ostate)), ref)  # type: ignore[arg-type]


def resume_worker(rank: int, path: str, ref: str, opt_name: str) -> dict[str, Any]:
    """At this P: the tables as loaded from the DCP checkpoint (gathered whole on rank 0), then three more steps
    from it and from the same state loaded through the full state dicts: losses and the model gathered whole."""
    out: dict[str, Any] = {}
    model, opt = make(rank + 1, opt_name)  # other values: the checkpoint must replace them
    checkpoint.load(path, model, opt)
    out["loaded"] = {k: v.clone() for k, v in model.state_dict().items()}
    out["loaded_opt"] = _dense(optimizer_state_dict(opt, model) or {"state": {}})
    out["dcp"] = (train(model, opt, range(2, 5)), model.state_dict())
    again, again_opt = make(rank + 2, opt_name)
    full, ostate = torch.load(ref, weights_only=False)
    again.load_state_dict(full)
    load_optimizer_state_dict(again_opt, again, ostate)
    out["full"] = (train(again, again_opt, range(2, 5)), again.state_dict())
    return out


def unsharded_worker(rank: int, path: str, opt_name: str) -> dict[str, Any]:
    """One process: the unsharded model and its optimizer loaded from the DCP checkpoint."""
    model, opt = make(9, opt_name, sharded=False)
    checkpoint.load(path, model, opt)
    return {"model": model.state_dict(), "opt": _dense(opt.state_dict())}


def grid_save_worker(rank: int, folder: str, sharded: bool = True) -> None:
    """``save_worker`` for each optimizer, into ``folder``/<optimizer>{,.pt}."""
    for name in OPTIMIZERS:
        save_worker(rank, f"{folder}/{name}", f"{folder}/{name}.pt", name, sharded)


def grid_resume_worker(rank: int, folder: str) -> dict[str, Any]:
    return {name: resume_worker(rank, f"{folder}/{name}", f"{folder}/{name}.pt", name) for name in OPTIMIZERS}


def grid_unsharded_worker(rank: int, folder: str) -> dict[str, Any]:
    return {name: unsharded_worker(rank, f"{folder}/{name}", name) for name in OPTIMIZERS}


# --- memory -----------------------------------------------------------------------------------------------------
BIG = (10_000, 32)  # float32: 1.28 MB whole, 320 kB a shard at P = 4
BIG_BLOCK = 64  # rows per stored chunk and window share


def peak_bytes(fn: Callable[[], object]) -> int:
    """The most bytes ``fn``'s CPU allocations held at once (torch's profiler: each op's own allocations and the
    frees and allocations outside ops, in time order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.time_range.start, e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage)
        for e in prof.events()
    )
    live = top = 0
    for _, change in events:
        live += change
        top = max(top, live)
    return top


def big_model(seed: int) -> nn.Module:
    """One table on the meta device: each rank draws only its rows (``transfer.init_rows``)."""
    return sparsync.shard(nn.ModuleDict({"t": nn.EmbeddingBag(*BIG, mode="sum", device="meta")}), seed=seed)


def big_save_worker(rank: int, path: str) -> dict[str, int]:
    model = big_model(seed=3)
    shard = model["t"].weight
    peak = peak_bytes(lambda: checkpoint.save(path, model, block_rows=BIG_BLOCK))
    return {"peak": peak, "shard": shard.numel() * shard.element_size()}


def big_load_worker(rank: int, path: str) -> dict[str, Any]:
    from sparsync.sharding import Ownership
    from sparsync.sharding.transfer import init_rows

    model = big_model(seed=4)  # other rows: the checkpoint must replace them
    shard = model["t"].weight
    peak = peak_bytes(lambda: checkpoint.load(path, model, block_rows=BIG_BLOCK))
    want = init_rows(Ownership(BIG[0], dist.get_world_size()), rank, BIG[1], torch.float32, 3, None)
    return {"peak": peak, "shard": shard.numel() * shard.element_size(), "equal": torch.equal(shard, want)}


# --- bad input --------------------------------------------------------------------------------------------------
def bad_worker(rank: int, path: str) -> dict[str, str]:
    """A checkpoint of ``Net`` loaded into models whose ``bag`` has another shape, or another dtype."""
    model, opt = make(0, "adagrad")
    checkpoint.save(path, model, opt, block_rows=BLOCK)
    out = {}
    for case, other in (
        ("shape", nn.EmbeddingBag(ROWS[0] + 1, 3).double()),
        ("dtype", nn.EmbeddingBag(ROWS[0], 3)),
    ):
        net = Net(0)
        net.bag = other
        wrong = sparsync.shard(net)
        try:
            checkpoint.load(path, wrong)
            out[case] = "no error"
        except ValueError as e:
            out[case] = str(e)
    return out


def plain_dcp_worker(rank: int, path: str) -> bool:
    """``state_dict="sharded"`` and DCP's own save and load (no ``checkpoint``): the tables come back as saved."""
    import torch.distributed.checkpoint as dcp

    model = sparsync.shard(Net(0), state_dict="sharded")
    dcp.save(model.state_dict(), checkpoint_id=path)
    other = sparsync.shard(Net(rank + 1), state_dict="sharded")
    sd = other.state_dict()
    dcp.load(sd, checkpoint_id=path)
    other.load_state_dict(sd)
    return all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters(), strict=True))
