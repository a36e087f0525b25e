"""Workers of tests/sharding/test_replicated_groups.py: ``_shard_workers``' nine tables placed ``"replicated"``
(all, or beside sharded ones) with each fused optimizer, against one float64 process of the unfused model
(torch's optimizers; row-wise Adagrad: ``_fused_workers``' reference)."""

from __future__ import annotations

from typing import Any

import _fused_workers as fw
import _shard_workers as sw
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import sparsync
from sparsync.sharding import (
    SGD,
    Adam,
    Lookahead,
    ShardedTable,
    checkpoint,
    dense_parameters,
    load_optimizer_state_dict,
    optimizer_state_dict,
    plan_of,
)
from sparsync.sharding.replicated import ReplicatedTable

# every table replicated (groups of widths 4, 3, 2, 5), and a mixed plan: replicated tables of widths 4, 3, 2, 5
# beside sharded ones of widths 3 and 4 (a width with a replicated and a sharded group)
WHOLE = ("emb", "emb_pad", "bag_mean", "bag_psw", "bag_last")
ALL = {f"t.{n}": "replicated" for n in sw.SPECS}
MIXED = {f"t.{n}": "replicated" if n in WHOLE else "sharded" for n in sw.SPECS}
PLANS = {"replicated": ALL, "mixed": MIXED}


def _replicated_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    tables = [(n, m) for n, m in model.named_modules() if isinstance(m, ReplicatedTable)]
    return {f"{n}.weight": m.weight.detach().clone() for n, m in tables}


def _train(plan: dict[str, str], name: str, rank: int, P: int) -> dict[str, Any]:
    """One run of ``sw.STEPS`` steps of the grouped model beside the float64 reference: per step the largest
    difference of this rank's rows from the reference's; whether a table got a ``.grad``; the replicated
    weights at the end; the number of groups; what ``dense_parameters`` left."""
    model = sparsync.shard(sw.Tables(seed=rank), plan=plan, optimizer=fw.FUSED[name]())  # rank 0's rows win
    ref = sw.Tables(seed=0, sparse=True)
    ref_opt = fw._reference(name, list(ref.parameters()))
    errors, grads = [], []
    for step in range(sw.STEPS):
        sw._loss(model(fw._batch(step, rank, P))).backward()
        grads.append(any(p.grad is not None for p in model.parameters()))
        ref_opt.zero_grad()
        (sum(sw._loss(ref(fw._batch(step, r, P))) for r in range(P)) / P).backward()  # type: ignore[union-attr]
        ref_opt.step()
        errors.append(sw._shard_error(model, ref, rank, P))
    kinds = [m for m in model.modules() if isinstance(m, ReplicatedTable)]
    groups = len(kinds[0].exchanger.groups) if kinds else 0
    return {"errors": errors, "grads": grads, "weights": _replicated_weights(model), "groups": groups,
            "replicated": len(kinds), "dense": len(dense_parameters(model))}  # fmt: skip


def exact_worker(rank: int) -> dict[str, Any]:
    """Per plan and fused optimizer, one run (``_train``); for SGD on the mixed plan a second run, whose weights
    must equal the first's bit for bit."""
    P = dist.get_world_size()
    out: dict[str, Any] = {}
    for plan_name, plan in PLANS.items():
        for name in fw.FUSED:
            out[f"{plan_name}/{name}"] = _train(plan, name, rank, P)
    out["again"] = _train(MIXED, "sgd", rank, P)["weights"]
    return out


def bad_input_worker(rank: int) -> dict[str, Any]:
    """A table of another shape on rank 1 at ``sparsync.shard``; a model converted after it (its weights no
    longer view their groups); a negative id on rank 0 only, then an id past the table on the last rank only: the
    error each rank raised, and whether any replicated row changed; then a good step (the group still works)."""
    P = dist.get_world_size()
    out: dict[str, Any] = {}
    other = sw.Tables(seed=0)
    if rank == 1:  # another table on one rank
        other.t["emb"] = nn.Embedding(18, 4).double()
    try:
        sparsync.shard(other, plan=ALL, optimizer=SGD(lr=0.1))
        out["differ"] = "sharded"
    except ValueError as e:
        out["differ"] = str(e)
    converted = sparsync.shard(sw.Tables(seed=0), plan=ALL, optimizer=SGD(lr=0.1)).float().double()
    try:
        converted(sw._batch(0, rank, P))
        out["converted"] = "looked up"
    except ValueError as e:
        out["converted"] = str(e)
    model = sparsync.shard(sw.Tables(seed=0), plan=ALL, optimizer=SGD(lr=0.1))
    before = _replicated_weights(model)
    for case, (bad_rank, bad_id) in {"negative": (0, -1), "past": (P - 1, 17)}.items():
        batch = sw._batch(0, rank, P)
        if rank == bad_rank:
            ids = batch["emb"][0].clone()
            ids.view(-1)[0] = bad_id
            batch["emb"] = (ids,)
        try:
            sw._loss(model(batch)).backward()
            out[case] = "ran"
        except ValueError as e:
            out[case] = str(e)
    after = _replicated_weights(model)
    out["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    sw._loss(model(sw._batch(0, rank, P))).backward()
    out["stepped"] = not all(torch.equal(before[k], v) for k, v in _replicated_weights(model).items())
    return out


def checkpoint_worker(rank: int) -> dict[str, Any]:
    """The unfused model's full state dict loaded into the grouped one (mixed plan), what each state-dict layout
    gives for the replicated tables, and after a step the grouped model's state dict loaded into an unfused
    model."""
    P = dist.get_world_size()
    source = sw.Tables(seed=11)
    saved = {k: v.clone() for k, v in source.state_dict().items()}
    out: dict[str, Any] = {}
    for layout in ("full", "local", "sharded"):
        model = sparsync.shard(sw.Tables(seed=rank), plan=MIXED, optimizer=SGD(lr=0.1), state_dict=layout)
        model.load_state_dict(saved)
        sd = model.state_dict()
        whole = [f"t.{n}.weight" for n in WHOLE]
        out[layout] = all(type(sd[k]) is torch.Tensor and torch.equal(sd[k], saved[k]) for k in whole)
        if layout == "full":
            out["loaded_rows"] = sw._shard_error(model, source, rank, P) == 0.0
            sw._loss(model(sw._batch(0, rank, P))).backward()
            trained = model.state_dict()
            if rank == 0:
                back = sw.Tables(seed=5)
                back.load_state_dict(trained)
                out["back"] = all(torch.equal(back.state_dict()[k], trained[k]) for k in trained)
                out["moved"] = not all(torch.equal(trained[k], saved[k]) for k in whole)
            grouped = [m for m in model.modules() if isinstance(m, ReplicatedTable)]
            out["viewing"] = all(m.group.aliased() is None for m in grouped)
    return out


def _run(model: nn.Module, steps: range, rank: int, P: int) -> None:
    for step in steps:
        sw._loss(model(fw._batch(step, rank, P))).backward()


def _rows(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every table's rows on this rank and its fused state (its group's flat tensors), copies."""
    out = {k: v.detach().clone() for k, v in model.named_parameters()}
    for m in model.modules():
        if isinstance(m, ReplicatedTable | ShardedTable) and m.group.fused is not None:
            out.update({f"{m.table_name}.{k}": v.clone() for k, v in m.group.fused.table_state(m.slot).items()})
    return out


def resume_worker(rank: int, path: str) -> dict[str, bool]:
    """The mixed plan with the fused Adam: 2 steps, saved (a DCP checkpoint, and the full state dicts), loaded
    into a model of other rows, 2 more steps: against 4 steps straight, bit for bit (tables and fused state)."""
    P = dist.get_world_size()
    make = lambda seed: sparsync.shard(sw.Tables(seed=seed), plan=MIXED, optimizer=Adam(lr=0.01))  # noqa: E731
    straight = make(0)
    _run(straight, range(4), rank, P)
    first = make(0)
    _run(first, range(2), rank, P)
    checkpoint.save(path, first)
    held = [first.state_dict(), optimizer_state_dict(None, first)]  # whole on rank 0
    dist.broadcast_object_list(held, group_src=0)
    out = {}
    for route in ("dcp", "full"):
        resumed = make(rank + 3)
        if route == "dcp":
            checkpoint.load(path, resumed)
        else:
            resumed.load_state_dict(held[0])
            load_optimizer_state_dict(None, resumed, held[1])
        _run(resumed, range(2, 4), rank, P)
        want, got = _rows(straight), _rows(resumed)
        out[route] = want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    return out


class Head(nn.Module):
    """Two replicated bags of width 4 and a linear head: a model with parameters for another optimizer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.lin = nn.EmbeddingBag(10, 4), nn.EmbeddingBag(12, 4), nn.Linear(4, 1)
        self.double()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lin(self.a(ids) + self.b(ids)).tanh().sum()


def optimizer_worker(rank: int) -> dict[str, Any]:
    """``DistributedOptimizer`` over every parameter of a model whose tables are grouped, and over
    ``dense_parameters``: the tables after 3 steps (each must be updated by its fused optimizer only, the same
    either way), the head, ``plan_of``, whether the tables still view their group."""
    out: dict[str, Any] = {}
    for which in ("all", "dense"):
        model = sparsync.shard(Head(), plan={"a": "replicated", "b": "replicated"}, optimizer=SGD(lr=0.1))
        params = list(model.parameters()) if which == "all" else dense_parameters(model)
        opt = sparsync.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), model, plan=plan_of(model))
        for step in range(3):
            opt.zero_grad()
            model(torch.tensor([[rank, step], [3, 9]])).backward()
            opt.step()
        out[which] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        out[f"{which} plan"] = sorted(plan_of(model))
        out[f"{which} aliased"] = [m.group.aliased() for m in (model.a, model.b)]  # type: ignore[union-attr]
    return out


def lookahead_worker(rank: int) -> bool:
    """The mixed plan trained on three batches with ``Lookahead`` over its sharded tables and without: the same
    rows, bit for bit (the grouped replicated tables run their own exchange beside the looked-ahead one)."""
    P = dist.get_world_size()
    plain, ahead = (sparsync.shard(sw.Tables(seed=0), plan=MIXED, optimizer=SGD(lr=0.1)) for _ in range(2))
    batches = [fw._batch(s, rank, P) for s in (0, 1, 2)]
    sharded = [n for n in sw.SPECS if n not in WHOLE]
    for batch in batches:
        sw._loss(plain(batch)).backward()
    for batch in Lookahead(batches, ahead, lambda b: {f"t.{n}": b[n][0] for n in sharded if n in b}):
        sw._loss(ahead(batch)).backward()
    return all(torch.equal(x, y) for x, y in zip(plain.parameters(), ahead.parameters(), strict=True))


def nccl_worker(rank: int) -> dict[str, Any]:
    """The mixed plan with the fused Adam, 5 steps (``_train``'s weights and rows), then an id past its table on
    the last rank: what the run leaves, to compare with and without NCCL's rules."""
    P = dist.get_world_size()
    model = sparsync.shard(sw.Tables(seed=rank), plan=MIXED, optimizer=Adam(lr=0.01))
    _run(model, range(sw.STEPS), rank, P)
    batch = fw._batch(0, rank, P)
    if rank == P - 1:
        batch["emb"] = (torch.full_like(batch["emb"][0], 17),)
    try:
        model(batch)
        refused = "ran"
    except ValueError as e:
        refused = str(e)
    return {"rows": _rows(model), "refused": refused}


def hybrid_refusal_worker(rank: int) -> dict[str, str]:
    """``HybridTrainer`` given a model whose tables ``sparsync.shard(optimizer=...)`` updates in backward (a
    replicated group and a sharded one, MIXED): its error, before it reaches any server; and without
    ``optimizer=``, no mark."""
    from sparsync.hybrid import HybridTrainer
    from sparsync.placement import updated_in_backward

    del rank
    model = sparsync.shard(sw.Tables(seed=0), plan=MIXED, optimizer=SGD(lr=0.1))
    try:
        HybridTrainer(model, ["tcp://127.0.0.1:1"])  # no server there: the refusal comes first
        refused = ""
    except ValueError as e:
        refused = str(e)
    plain = sparsync.shard(sw.Tables(seed=0), plan=MIXED)
    return {"refused": refused, "plain": ",".join(updated_in_backward(plain))}


def ddp_worker(rank: int) -> dict[str, Any]:
    """``Head`` with ``a`` sharded and ``b`` in a replicated group, SGD in backward, and the rest in torch's
    ``DistributedDataParallel`` (nothing else done to it), beside one float64 process of the unfused model with
    torch's SGD on the ranks' mean: per step the largest difference of the whole model (rank 0's full state
    dict; None elsewhere), and the names DDP left alone."""
    P = dist.get_world_size()
    model = sparsync.shard(Head(), plan={"a": "sharded", "b": "replicated"}, optimizer=SGD(lr=0.1))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(dense_parameters(model), lr=0.1)
    ref = Head()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    errors: list[float | None] = []
    for step in range(3):
        batches = [torch.tensor([[r % 10, step], [3, (r + 2 * step) % 10]]) for r in range(P)]
        opt.zero_grad()
        ddp(batches[rank]).backward()
        opt.step()
        ref_opt.zero_grad()
        (sum(ref(b) for b in batches) / P).backward()  # type: ignore[union-attr]
        ref_opt.step()
        full, want = model.state_dict(), ref.state_dict()  # collective: every table whole on rank 0
        errors.append(max(float((full[k] - want[k]).abs().max()) for k in want) if rank == 0 else None)
    return {"errors": errors, "ignored": sorted(ddp.parameters_to_ignore)}


def ddp_refused_worker(rank: int) -> dict[str, Any]:
    """``DistributedDataParallel`` over ``Head`` with ``a`` sharded without ``optimizer=`` (``b`` replicated):
    DDP's error, and whether this rank's shard is as it was (DDP's broadcast, which would give it rank 0's rows,
    must not have run). The same model sharded with ``optimizer=`` is wrapped; with ``a`` on the parameter server,
    DDP's error."""
    model = sparsync.shard(Head(), plan={"a": "sharded", "b": "replicated"})
    before = model.a.weight.detach().clone()
    dist.barrier()  # every rank's shard read before any rank could broadcast
    try:
        DistributedDataParallel(model)
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    kept = bool(torch.equal(model.a.weight.detach(), before))
    fused = sparsync.shard(Head(), plan={"a": "sharded", "b": "replicated"}, optimizer=SGD(lr=0.1))
    wrapped = sorted(DistributedDataParallel(fused).parameters_to_ignore)
    on_server = sparsync.shard(Head(), plan={"a": "server", "b": "replicated"})
    try:
        DistributedDataParallel(on_server)
        server = ""
    except RuntimeError as e:
        server = str(e)
    return {"refused": refused, "kept": kept, "wrapped": wrapped, "server": server}
