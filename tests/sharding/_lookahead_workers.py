"""Workers for test_lookahead.py (module-level: ``launch`` pickles them): test_shard's nine tables and batches,
trained with and without ``sparsync.shard.Lookahead``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import _shard_workers as sw
import torch
import torch.distributed as dist
from torch import nn

import sparsync
from sparsync.optim import DistributedOptimizer
from sparsync.record import CommLog
from sparsync.sharding import SGD, Adagrad, Adam, Lookahead, plan_of
from sparsync.sharding.group import Fused

Batch = dict[str, tuple[Any, ...]]
FUSED: dict[str, Callable[[], Fused]] = {
    "sgd": lambda: SGD(lr=0.05),
    "adagrad": lambda: Adagrad(lr=0.1),
    "adam": lambda: Adam(lr=0.01),
}


def table_ids(batch: Batch) -> dict[str, Any]:
    """What each table of ``sw.Tables`` is looked up with: its first argument (``Tables.forward``)."""
    return {f"t.{name}": args[0] for name, args in batch.items()}


class _Counter:
    """Counts the all-to-all rounds started: per step (from the ``next()`` that hands its batch out to the end of
    its optimizer step: ``steps``) and, of them, while ``inside`` is set (the model's forward: ``rounds``)."""

    def __init__(self) -> None:
        self.inside = False
        self.rounds: list[int] = []
        self.steps: list[int] = []
        self.real = dist.all_to_all_single

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.steps:
            self.steps[-1] += 1
        if self.inside:
            self.rounds[-1] += 1
        return self.real(*args, **kwargs)

    def batches(self, source: Iterator[Batch]) -> Iterator[Batch]:
        """``source``'s batches, a new step counted from each ``next()``."""
        while True:
            self.steps.append(0)
            self.rounds.append(0)
            batch = next(source, None)
            if batch is None:
                self.steps.pop()
                self.rounds.pop()
                return
            yield batch


def _model(
    rank: int, make_opt: Any, fused: Callable[[], Fused] | None, log: CommLog, rows: str | None = None
) -> tuple[nn.Module, Any]:
    """test_shard's tables, sharded (``rows``: the wire precision of the rows), and the optimizer of the step:
    ``DistributedOptimizer`` over ``make_opt``'s (sparse gradients), or None with a ``fused`` optimizer (the
    tables updated in their backward)."""
    model = sparsync.shard(sw.Tables(seed=rank), log=log, rows=rows, optimizer=None if fused is None else fused())
    if fused is not None:
        return model, None
    return model, DistributedOptimizer(make_opt(model.parameters()), model, plan=plan_of(model),
                                       sync_parameters=False)  # fmt: skip


def _run(
    rank: int,
    make_opt: Any,
    ahead: bool,
    fused: Callable[[], Fused] | None = None,
    batch: Any = sw._batch,
    rows: str | None = None,
) -> dict[str, Any]:
    """Train ``sw.STEPS`` steps (``make_opt`` over sparse gradients, or the tables' ``fused`` optimizer; ``rows``:
    the rows' wire precision), through ``Lookahead`` or not; the states, losses and rounds after each step, and
    the log."""
    P = dist.get_world_size()
    log = CommLog()
    model, opt = _model(rank, make_opt, fused, log, rows)
    batches = [batch(step, rank, P) for step in range(sw.STEPS)]
    counter = _Counter()
    states, losses = [], []
    with mock.patch.object(dist, "all_to_all_single", counter):
        for b in counter.batches(Lookahead(batches, model, ids=table_ids) if ahead else iter(batches)):
            if opt is not None:
                opt.zero_grad()
            counter.inside = True
            outs = model(b)
            counter.inside = False
            loss = sw._loss(outs)
            loss.backward()
            if opt is not None:
                opt.step()
            losses.append(float(loss.detach()))
            states.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"states": states, "losses": losses, "forward_rounds": counter.rounds, "step_rounds": counter.steps,
            "log": log.records}  # fmt: skip


def _compare(plain: dict[str, Any], ahead: dict[str, Any]) -> dict[str, Any]:
    return {
        "identical": [
            all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(plain["states"], ahead["states"], strict=True)
        ],
        "losses_equal": plain["losses"] == ahead["losses"],
        "steps": len(ahead["states"]),
        "rounds": (plain["forward_rounds"], ahead["forward_rounds"]),
        "step_rounds": (plain["step_rounds"], ahead["step_rounds"]),
        "ops": [r.op for r in ahead["log"]],
        # per exchange and direction: bytes sent by phase, without lookahead and with it
        "bytes": [(a.phase_bytes, b.phase_bytes) for a, b in zip(plain["log"], ahead["log"], strict=True)],
        "messages": [(a.messages, b.messages) for a, b in zip(plain["log"], ahead["log"], strict=True)],
    }


def same_worker(rank: int) -> dict[str, Any]:
    """Per optimizer (torch's over sparse gradients, and the tables' own in their backward: ``FUSED``): whether
    the run through Lookahead equals the run without, bit for bit after every step; the all-to-all rounds each
    step and each forward started, both ways; the exchanges' bytes and messages, both ways."""
    out: dict[str, Any] = {}
    for name, make_opt in sw.OPTIMIZERS.items():
        out[name] = _compare(_run(rank, make_opt, False), _run(rank, make_opt, True))
    for name, fused in FUSED.items():
        out[f"fused_{name}"] = _compare(_run(rank, None, False, fused), _run(rank, None, True, fused))
    # the rows and gradient rows in bf16 on the wire, the ids beside them as int64
    bf16 = [_run(rank, None, ahead, FUSED["adagrad"], rows="bf16") for ahead in (False, True)]
    out["bf16_fused_adagrad"] = _compare(*bf16)
    return out


def steady_worker(rank: int) -> dict[str, Any]:
    """The all-to-all rounds of each step, without Lookahead and with it, on a batch whose ids fit the blocks
    after the first step (the same batch every step), with torch's SGD and with the tables' own."""
    out: dict[str, Any] = {}
    for name, fused in (("sgd", None), ("fused_adam", FUSED["adam"])):
        make_opt = sw.OPTIMIZERS["sgd"]
        runs = [_run(rank, make_opt, ahead, fused, batch=lambda s, r, P: sw._batch(0, r, P)) for ahead in (0, 1)]
        out[name] = _compare(*runs)
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

    def changed(b: Batch) -> Batch:  # rank 1 changes ids in place after they went ahead, before the forward:
        if rank == 1:  # those of t.bag_mean, alone in its group (the width 2)
            b["bag_mean"][0].add_(1).remainder_(11)
        return b

    out["other_ids"] = sw.message(lambda: first_step(other_ids))
    out["changed"] = sw.message(lambda: first_step(table_ids, changed))
    batches[0] = sw._batch(0, rank, P)  # the same batch, as it was before ``changed``
    out["bad_id"] = sw.message(lambda: first_step(bad_id))
    fewer = {k: v for k, v in table_ids(batches[0]).items() if k != "t.bag_sum"}
    out["fewer_tables"] = sw.message(lambda: first_step(lambda b: {k: table_ids(b)[k] for k in fewer}))
    unknown = Lookahead(batches, model, ids=lambda b: {"t.nope": torch.tensor([1])})
    out["unknown"] = sw.message(lambda: next(unknown))
    out["no_tables"] = sw.message(lambda: Lookahead(batches, nn.Linear(2, 2), ids=table_ids))
    first_step(table_ids)  # still in step with the others
    out["after"] = "trained"
    return out


KINDS = ("train", "eval", "train", "forward", "train", "eval", "eval", "train")  # eval: under no_grad


def _mixed(rank: int, ahead: bool, fused: Callable[[], Fused] | None) -> dict[str, Any]:
    """``KINDS``' steps, through Lookahead or not: a training step, a forward under ``torch.no_grad`` ("eval"),
    or a forward with no backward ("forward"); each step's outputs, states and all-to-all rounds."""
    P = dist.get_world_size()
    model, opt = _model(rank, sw.OPTIMIZERS["adagrad"], fused, CommLog())
    batches = [sw._batch(s % sw.STEPS, rank, P) for s in range(len(KINDS))]
    counter = _Counter()
    outs, states = [], []
    with mock.patch.object(dist, "all_to_all_single", counter):
        source = Lookahead(batches, model, ids=table_ids) if ahead else iter(batches)
        for kind, b in zip(KINDS, counter.batches(source), strict=True):
            if opt is not None:
                opt.zero_grad()
            with torch.set_grad_enabled(kind != "eval"):
                got = model(b)
            outs.append({k: v.detach().clone() for k, v in got.items()})
            if kind == "train":
                sw._loss(got).backward()
                if opt is not None:
                    opt.step()
            states.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"outs": outs, "states": states, "step_rounds": counter.steps}


def eval_worker(rank: int) -> dict[str, Any]:
    """Per optimizer (Adagrad over sparse gradients, the tables' Adagrad in backward): whether the outputs and
    states of ``KINDS``' steps through Lookahead equal those without, bit for bit; each step's rounds, both
    ways."""
    out: dict[str, Any] = {}
    for name, fused in (("adagrad", None), ("fused_adagrad", FUSED["adagrad"])):
        plain, ahead = _mixed(rank, False, fused), _mixed(rank, True, fused)
        out[name] = {
            "outs": [
                all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(plain["outs"], ahead["outs"], strict=True)
            ],
            "states": [
                all(torch.equal(a[k], b[k]) for k in a)
                for a, b in zip(plain["states"], ahead["states"], strict=True)
            ],
            "step_rounds": (plain["step_rounds"], ahead["step_rounds"]),
        }
    return out


def ahead_errors_worker(rank: int) -> dict[str, str]:
    """On three ranks: rank 1's forward under no_grad while the others' has a backward to carry the next ids
    ("mismatch"); rank 2's ids of the second batch out of range, sent in the first step's gradient rows round
    ("bad_ahead"), the tables then as the first step left them ("untouched"); the ranks stay in step after each
    (the last case trains)."""
    P = dist.get_world_size()
    out: dict[str, str] = {}
    log = CommLog()
    model, _ = _model(rank, None, FUSED["sgd"], log)
    batches = [sw._batch(step, rank, P) for step in range(3)]
    it = Lookahead(batches, model, ids=table_ids)
    first = next(it)

    def mismatch() -> None:
        with torch.set_grad_enabled(rank != 1):
            model(first)

    out["mismatch"] = sw.message(mismatch)
    sw._loss(model(next(it))).backward()  # the pending ids then go in a round of their own: in step again

    def bad_ahead(b: Batch) -> dict[str, Any]:  # rank 2's second batch looks bag_mean up beyond its 11 rows
        given = table_ids(b)
        if rank == 2 and b is batches[1]:
            given["t.bag_mean"] = torch.full_like(b["bag_mean"][0], 11)
        return given

    it = Lookahead(batches, model, ids=bad_ahead)
    sw._loss(model(next(it))).backward()
    out["carried"] = str(sorted(log.records[-1].phase_bytes))  # the grads round took the ids along
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["bad_ahead"] = sw.message(lambda: next(it))
    out["untouched"] = str(all(torch.equal(p, before[n]) for n, p in model.named_parameters()))
    it = Lookahead(batches, model, ids=table_ids)
    sw._loss(model(next(it))).backward()
    out["after"] = "trained"
    return out


ONE_WIDTH = ("emb_pad", "bag_psw", "bag_pad", "col_one")  # test_shard's tables of width 3: one group


def _one_group_batch(step: int, rank: int, P: int) -> Batch:
    return {k: v for k, v in sw._batch(step, rank, P).items() if k in ONE_WIDTH}


def one_group_worker(rank: int) -> dict[str, Any]:
    """``same_worker``'s comparison on the tables of one width (one group, ``rows.with_verdicts``'s own branch;
    two of them with padding rows), with torch's SGD over sparse gradients, the tables'
    Adam in backward and their Adagrad with the rows in bf16 on the wire; then rank 1's forward under no_grad
    while the others' has a backward to carry the next ids ("mismatch"), and a step after it ("after")."""
    batch = _one_group_batch
    out: dict[str, Any] = {"sgd": _compare(*(_run(rank, sw.OPTIMIZERS["sgd"], a, batch=batch) for a in (0, 1)))}
    out["fused_adam"] = _compare(*(_run(rank, None, a, FUSED["adam"], batch=batch) for a in (False, True)))
    bf16 = [_run(rank, None, ahead, FUSED["adagrad"], batch=batch, rows="bf16") for ahead in (False, True)]
    out["bf16_fused_adagrad"] = _compare(*bf16)
    P = dist.get_world_size()
    model, _ = _model(rank, None, FUSED["sgd"], CommLog())
    it = Lookahead([batch(s, rank, P) for s in range(3)], model, ids=table_ids)
    first = next(it)

    def mismatch() -> None:
        with torch.set_grad_enabled(rank != 1):
            model(first)

    out["mismatch"] = sw.message(mismatch)
    sw._loss(model(next(it))).backward()
    out["after"] = "trained"
    return out
