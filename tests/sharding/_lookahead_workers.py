"""Workers for test_lookahead.py (module-level: ``launch`` pickles them): test_shard's nine tables and batches,
trained with and without ``sparsync.shard.Lookahead``."""

from __future__ import annotations

from typing import Any
from unittest import mock

import _shard_workers as sw
import torch
import torch.distributed as dist
from torch import nn

import sparsync
from sparsync.optim import DistributedOptimizer
from sparsync.record import CommLog
from sparsync.sharding import Lookahead, plan_of

Batch = dict[str, tuple[Any, ...]]


def table_ids(batch: Batch) -> dict[str, Any]:
    """What each table of ``sw.Tables`` is looked up with: its first argument (``Tables.forward``)."""
    return {f"t.{name}": args[0] for name, args in batch.items()}


class _Counter:
    """Counts the all-to-all rounds started while ``inside`` is set (the model's forward)."""

    def __init__(self) -> None:
        self.inside = False
        self.rounds: list[int] = []
        self.real = dist.all_to_all_single

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.inside:
            self.rounds[-1] += 1
        return self.real(*args, **kwargs)


def _run(rank: int, make_opt: Any, ahead: bool) -> dict[str, Any]:
    P = dist.get_world_size()
    log = CommLog()
    model = sparsync.shard(sw.Tables(seed=rank), log=log)
    opt = DistributedOptimizer(make_opt(model.parameters()), model, plan=plan_of(model), sync_parameters=False)
    batches = [sw._batch(step, rank, P) for step in range(sw.STEPS)]
    source = Lookahead(batches, model, ids=table_ids) if ahead else iter(batches)
    counter = _Counter()
    states, losses = [], []
    with mock.patch.object(dist, "all_to_all_single", counter):
        for batch in source:
            opt.zero_grad()
            counter.rounds.append(0)
            counter.inside = True
            outs = model(batch)
            counter.inside = False
            loss = sw._loss(outs)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            states.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"states": states, "losses": losses, "forward_rounds": counter.rounds, "log": log.records}


def same_worker(rank: int) -> dict[str, Any]:
    """Per optimizer: whether the run through Lookahead equals the run without, bit for bit after every step; the
    all-to-all rounds each forward started, both ways; the exchanges' bytes, both ways."""
    out: dict[str, Any] = {}
    for name, make_opt in sw.OPTIMIZERS.items():
        plain, ahead = _run(rank, make_opt, False), _run(rank, make_opt, True)
        out[name] = {
            "identical": [
                all(torch.equal(a[k], b[k]) for k in a)
                for a, b in zip(plain["states"], ahead["states"], strict=True)
            ],
            "losses_equal": plain["losses"] == ahead["losses"],
            "steps": len(ahead["states"]),
            "rounds": (plain["forward_rounds"], ahead["forward_rounds"]),
            "ops": [r.op for r in ahead["log"]],
            # per exchange and direction: bytes sent by phase, without lookahead and with it
            "bytes": [(a.phase_bytes, b.phase_bytes) for a, b in zip(plain["log"], ahead["log"], strict=True)],
        }
    return out


def errors_worker(rank: int) -> dict[str, str]:
    """Each bad use of a Lookahead on three ranks; the ranks stay in step after each (the last case trains)."""
    P = dist.get_world_size()
    out: dict[str, str] = {}
    model = sparsync.shard(sw.Tables(seed=0))
    batches = [sw._batch(step, rank, P) for step in range(3)]

    def first_step(ids: Any, batch_of: Any = None) -> None:
        it = Lookahead(batches, model, ids=ids)
        b = next(it)
        sw._loss(model(batch_of(b) if batch_of else b)).backward()

    def other_ids(b: Batch) -> dict[str, Any]:  # rank 1 sends ahead ids its forward will not look up
        given = table_ids(b)
        if rank == 1:
            given["t.emb"] = (given["t.emb"] + 1) % 17
        return given

    def bad_id(b: Batch) -> dict[str, Any]:  # rank 2 sends ahead an id beyond its table
        return {**table_ids(b), "t.bag_mean": torch.full_like(b["bag_mean"][0], 11 if rank == 2 else 0)}

    out["other_ids"] = sw.message(lambda: first_step(other_ids))
    out["bad_id"] = sw.message(lambda: first_step(bad_id))
    fewer = {k: v for k, v in table_ids(batches[0]).items() if k != "t.bag_sum"}
    out["fewer_tables"] = sw.message(lambda: first_step(lambda b: {k: table_ids(b)[k] for k in fewer}))
    unknown = Lookahead(batches, model, ids=lambda b: {"t.nope": torch.tensor([1])})
    out["unknown"] = sw.message(lambda: next(unknown))
    out["no_tables"] = sw.message(lambda: Lookahead(batches, nn.Linear(2, 2), ids=table_ids))
    first_step(table_ids)  # still in step with the others
    out["after"] = "trained"
    return out
