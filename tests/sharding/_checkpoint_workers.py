"""Workers for test_checkpoint.py (module-level: ``launch`` pickles them): DCP checkpoints of sharded tables
saved at one world size and resumed at another, against the same state loaded through the full state dict."""

from __future__ import annotations

import copy
import tracemalloc
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import sparsync
from sparsync.optim import DistributedOptimizer
from sparsync.sharding import (
    Adagrad,
    Adam,
    RowwiseAdagrad,
    checkpoint,
    dense_parameters,
    load_optimizer_state_dict,
    optimizer_state_dict,
    plan_of,
)
from sparsync.sharding.group import Fused
from sparsync_bench.op_profile import allocation_peak

ROWS = (151, 97)  # no world size of the tests divides them; blocks of 26 rows and more, 2 or 3 a window
BLOCK = 3  # rows per stored chunk and per window share, at most: many windows, each with rows of several owners
STEPS = (2, 5)  # steps before the checkpoint, and in all
# a torch optimizer over the model's parameters (SparseAdam: the tables' only; the head stays), or, for the
# fused ones, sparsync.shard's optimizer on the tables and SGD with momentum (torch's Adam beside the fused Adam)
# on the head
TORCH: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "sgd_momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
    "adagrad": lambda m: torch.optim.Adagrad(m.parameters(), lr=0.1),
    "sparse_adam": lambda m: torch.optim.SparseAdam([m.bag.weight, m.emb.weight], lr=0.01),
}
FUSED: dict[str, Callable[[], Fused]] = {
    "fused_adagrad": lambda: Adagrad(lr=0.1),
    "fused_rowwise_adagrad": lambda: RowwiseAdagrad(lr=0.1),
    "fused_adam": lambda: Adam(lr=0.01),
}
OPTIMIZERS = (*TORCH, *FUSED)


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
    if opt in FUSED:
        model = sparsync.shard(Net(seed), optimizer=FUSED[opt]())
        head = dense_parameters(model)
        adam = opt == "fused_adam"  # torch's Adam on the head, its state in the checkpoint's rest
        inner = torch.optim.Adam(head, lr=0.01) if adam else torch.optim.SGD(head, lr=0.05, momentum=0.9)
    else:
        model = sparsync.shard(Net(seed)) if sharded else Net(seed, sparse=True)
        inner = TORCH[opt](model)
    plan = None if opt in FUSED else plan_of(model) or None  # the fused tables are not the optimizer's
    return model, DistributedOptimizer(inner, model, plan=plan, sync_parameters=False, overlap=False)


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
    """Two steps at this P, then the DCP checkpoint at ``path``, the full state dicts (the reference) and the
    uninterrupted run's next steps (losses, the model) at ``ref`` (rank 0)."""
    model, opt = make(0, opt_name, sharded)
    train(model, opt, range(STEPS[0]))
    checkpoint.save(path, model, opt, block_rows=BLOCK)
    full = {k: v.clone() for k, v in model.state_dict().items()}  # the live parameters train on
    ostate = optimizer_state_dict(opt, model) if sharded else opt.state_dict()
    ostate = None if ostate is None else _dense(ostate)
    on = (train(model, opt, range(*STEPS)), model.state_dict())
    if rank == 0:
        torch.save((full, ostate, on), ref)


def resume_worker(rank: int, path: str, ref: str, opt_name: str) -> dict[str, Any]:
    """At this P: the tables as loaded from the DCP checkpoint (gathered whole on rank 0), then the next steps
    from it and from the same state loaded through the full state dicts: losses and the model gathered whole."""
    out: dict[str, Any] = {}
    model, opt = make(rank + 1, opt_name)  # other values: the checkpoint must replace them
    checkpoint.load(path, model, opt)
    out["loaded"] = {k: v.clone() for k, v in model.state_dict().items()}
    out["loaded_opt"] = _dense(optimizer_state_dict(opt, model) or {"state": {}})
    out["dcp"] = (train(model, opt, range(*STEPS)), model.state_dict())
    again, again_opt = make(rank + 2, opt_name)
    full, ostate, _ = torch.load(ref, weights_only=False)
    again.load_state_dict(full)
    load_optimizer_state_dict(again_opt, again, ostate)
    out["full"] = (train(again, again_opt, range(*STEPS)), again.state_dict())
    return out


def unsharded_worker(rank: int, path: str, opt_name: str) -> dict[str, Any]:
    """One process: the unsharded model and its optimizer loaded from the DCP checkpoint."""
    model, opt = make(9, opt_name, sharded=False)
    checkpoint.load(path, model, opt)
    return {"model": model.state_dict(), "opt": _dense(opt.state_dict())}


def grid_save_worker(rank: int, folder: str, sharded: bool = True) -> None:
    """``save_worker`` for each optimizer (the torch ones alone for the unsharded model), into
    ``folder``/<optimizer>{,.pt}."""
    for name in OPTIMIZERS if sharded else TORCH:
        save_worker(rank, f"{folder}/{name}", f"{folder}/{name}.pt", name, sharded)


def grid_resume_worker(rank: int, folder: str, names: tuple[str, ...] = OPTIMIZERS) -> dict[str, Any]:
    return {name: resume_worker(rank, f"{folder}/{name}", f"{folder}/{name}.pt", name) for name in names}


def grid_unsharded_worker(rank: int, folder: str) -> dict[str, Any]:
    return {name: unsharded_worker(rank, f"{folder}/{name}", name) for name in TORCH}


def local_worker(rank: int) -> dict[str, Any]:
    """Per fused optimizer, at this P: two steps, then the local state dicts (the model's shards, the fused
    optimizer's ``state_dict()``, the head's optimizer) loaded into a model of other values, and three more steps
    of each: losses and the model gathered whole; and a fused state of another shape refused."""
    out: dict[str, Any] = {}
    for name in FUSED:
        model, opt = make(0, name)
        train(model, opt, range(STEPS[0]))
        fused = model.bag.group.fused
        with checkpoint._local(model):
            saved = (
                {k: v.clone() for k, v in model.state_dict().items()},
                fused.state_dict(),
                copy.deepcopy(opt.state_dict()),
            )  # torch's load keeps the given tensors: the head's momentum
        other, other_opt = make(rank + 1, name)
        with checkpoint._local(other):
            other.load_state_dict(saved[0])
        other.bag.group.fused.load_state_dict(saved[1])
        other_opt.load_state_dict(saved[2])
        out[name] = {"on": (train(model, opt, range(*STEPS)), model.state_dict()),
                     "loaded": (train(other, other_opt, range(*STEPS)), other.state_dict())}  # fmt: skip
        bad = {**saved[1], "state": {k: v[:-1] for k, v in saved[1]["state"].items()}}
        try:
            other.bag.group.fused.load_state_dict(bad)
            out[name]["bad"] = "no error"
        except ValueError as e:
            out[name]["bad"] = str(e)
    return out


# --- memory -----------------------------------------------------------------------------------------------------
BIG = (128_000, 32)  # float32: 16.4 MB whole, 4.1 MB a shard at P = 4 (DCP's Python objects, ~0.6 MB, a part)
BIG_BLOCK = 4096  # rows per stored chunk and window share, at most: 16 windows per block at P = 3, 4 and 6


def big_model(seed: int) -> nn.Module:
    """One table on the meta device (each rank draws only its rows: ``group.init_rows``) with its fused Adam,
    whose moments are set to the rows and their squares and its step count to ``seed``."""
    table = nn.ModuleDict({"t": nn.EmbeddingBag(*BIG, mode="sum", device="meta")})
    model = sparsync.shard(table, seed=seed, optimizer=Adam(lr=0.01))
    state = model["t"].group.fused.state
    state["exp_avg"].copy_(model["t"].group.flat)
    state["exp_avg_sq"].copy_(model["t"].group.flat.square())
    state["step"].fill_(seed)
    return model


def peaks(fn: Callable[[], object]) -> dict[str, int]:
    """``fn`` run twice: the most bytes its torch allocations held at once (``allocation_peak``: every tensor,
    sparsync's and DCP's reader's), then its Python heap's peak beyond what it held before (``tracemalloc``: DCP's
    plans and metadata, the bytes it reads), apart, since the profiler's own Python objects would count."""
    out = {"torch": allocation_peak(fn)}
    tracemalloc.start()
    try:
        fn()
        out["python"] = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return out


def big_save_worker(rank: int, path: str) -> dict[str, int]:
    model = big_model(seed=3)
    return peaks(lambda: checkpoint.save(path, model, block_rows=BIG_BLOCK))


def big_load_worker(rank: int, path: str) -> dict[str, Any]:
    from sparsync.sharding import Ownership
    from sparsync.sharding.group import init_rows

    model = big_model(seed=4)  # other rows: the checkpoint must replace them
    shard = model["t"].weight
    out: dict[str, Any] = peaks(lambda: checkpoint.load(path, model, block_rows=BIG_BLOCK))
    want = init_rows(Ownership(BIG[0], dist.get_world_size()), rank, BIG[1], torch.float32, 3, None)
    state = model["t"].group.fused.state
    equal = torch.equal(shard, want) and torch.equal(state["exp_avg"][: len(want)], want)
    out["equal"] = (
        equal and torch.equal(state["exp_avg_sq"][: len(want)], want.square()) and int(state["step"][0]) == 3
    )
    return out


# --- bad input --------------------------------------------------------------------------------------------------
def bad_worker(rank: int, path: str) -> dict[str, str]:
    """A checkpoint of ``Net`` with torch's Adagrad loaded into models whose ``bag`` has another shape, or another
    dtype, or whose tables have a fused optimizer, or with windows of 0 rows."""
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
    fused, _ = make(0, "fused_adam")  # a checkpoint without fused state, into tables that have it
    for case, call in (("fused", lambda: checkpoint.load(path, fused)),
                       ("rows", lambda: checkpoint.load(path, model, block_rows=0))):  # fmt: skip
        try:
            call()
            out[case] = "no error"
        except ValueError as e:
            out[case] = str(e)
    return out


def _error(call: Callable[[], object]) -> str:
    try:
        call()
    except ValueError as e:
        return str(e)
    return "no error"


def kinds_worker(rank: int, path: str) -> dict[str, Any]:
    """Checkpoints (DCP and full) of the fused Adagrad and of torch's Adagrad loaded into optimizers of other
    kinds: the fused row-wise Adagrad, torch's SGD, none saved, torch's Adam over the unsharded model's tables
    (where the fused Adam was); the fused optimizers' local state dict into another kind; and the fused Adam's
    saved hyperparameters taken by a model made with others."""
    fused, _ = make(0, "fused_adagrad")
    checkpoint.save(f"{path}/fused", fused)
    full = [optimizer_state_dict(None, fused)]  # rank 0's, given to every rank
    dist.broadcast_object_list(full, src=0)
    model, opt = make(0, "adagrad")
    checkpoint.save(f"{path}/torch", model, opt)
    checkpoint.save(f"{path}/none", model)
    adam, adam_opt = make(0, "fused_adam")
    checkpoint.save(f"{path}/adam", adam, adam_opt)
    rowwise, _ = make(0, "fused_rowwise_adagrad")
    sgd = make(0, "sgd_momentum")
    unsharded = Net(0, sparse=True)
    out = {
        "fused": _error(lambda: checkpoint.load(f"{path}/fused", rowwise)),
        "full": _error(lambda: load_optimizer_state_dict(None, rowwise, full[0])),
        "local": _error(lambda: rowwise.bag.group.fused.load_state_dict(fused.bag.group.fused.state_dict())),
        "torch": _error(lambda: checkpoint.load(f"{path}/torch", *sgd)),
        "none": _error(lambda: checkpoint.load(f"{path}/none", model, opt)),
        "held": _error(
            lambda: checkpoint.load(f"{path}/adam", unsharded, torch.optim.Adam(unsharded.parameters()))
        ),
    }
    other = sparsync.shard(Net(0), optimizer=Adam(lr=0.5, betas=(0.5, 0.6)))
    checkpoint.load(f"{path}/adam", other)
    out["lr"] = (other.bag.group.fused.lr, other.bag.group.fused.betas)
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
