"""Workers of test_auto_cpu.py: ``plan="auto"`` with the tables' CPU priced (``sharding.table_cpu.TableCpu``),
given by hand on a fast fixed link, and measured where nobody set the link."""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist
from _auto_meta_workers import sgd_losses
from torch import nn

import sparsync
from sparsync.costmodel import LinkModel
from sparsync.plan import Plan
from sparsync.sharding import SGD, AutoPlan, ShardedEmbeddingBag, auto_plan, dense_parameters
from sparsync.sharding.table_cpu import TableCpu

TABLES, ROWS, DIM = 5, 64, 4
NAMES = [f"tables.{j}" for j in range(TABLES)]
# a fast link: the rounds and bytes cost microseconds, so the tables' CPU decides
FAST = LinkModel(alpha=2e-6, beta=1e-9, gamma_sparse=0.0, gamma_dense=0.0, gamma_scatter=0.0)
SLOW = LinkModel(alpha=2e-6, beta=1e-4, gamma_sparse=0.0, gamma_dense=0.0, gamma_scatter=0.0)
MS = 1e-3


class Many(nn.Module):
    """``TABLES`` small bag tables, one dense layer over their pooled rows."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.tables = nn.ModuleList(nn.EmbeddingBag(ROWS, DIM, mode="sum") for _ in range(TABLES))
        self.fc = nn.Linear(TABLES * DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pooled = [t(ids[:, j].contiguous(), torch.arange(0, ids.shape[0], 4)) for j, t in enumerate(self.tables)]
        out: torch.Tensor = self.fc(torch.cat(pooled, dim=1)).squeeze(1)
        return out


def sample(rank: int, step: int = 0) -> tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + rank)
    return (torch.randint(0, ROWS, (4 * (6 + rank), TABLES), generator=g),)  # bags of 4, uneven batches


def cpu_of(replicated: list[float], sharded: list[float], fixed: float, contention: float = 1.0) -> TableCpu:
    """A ``TableCpu`` given by hand (milliseconds), every table in one group."""
    return TableCpu(dict(zip(NAMES, [r * MS for r in replicated], strict=True)),
                    dict(zip(NAMES, [s * MS for s in sharded], strict=True)),
                    dict.fromkeys(NAMES, ("D=4 torch.float32", fixed * MS)), 0.0, contention)  # fmt: skip


GIVEN = {  # name -> (replicated ms per table, sharded ms per table, the group's fixed ms)
    "replicated_costly": ([2.0] * TABLES, [0.1] * TABLES, 0.3),
    "sharded_costly": ([0.1] * TABLES, [2.0] * TABLES, 0.3),
    "one_costly": ([0.1, 0.1, 9.0, 0.1, 0.1], [0.2] * TABLES, 0.5),  # only tables.2 pays for the group
    "two_costly": ([3.0, 0.1, 0.1, 3.0, 0.1], [0.2] * TABLES, 4.0),  # one alone would not pay the fixed 4 ms
}


def exhaustive(chosen: AutoPlan, cpu: TableCpu) -> tuple[float, dict[str, str]]:
    """The least step over every placement of the tables (each on any of its kinds: sharded, dense or sparse
    allreduce), priced as the test reads the module doc: the step's exposed communication plus the tables'
    CPU; with the tables as placed there (sharded or replicated)."""
    plan = chosen.plan
    entries = [next(e for e in plan.entries if e.name == f"{name}.weight") for name in NAMES]
    best: tuple[float, dict[str, str]] | None = None
    for kinds in itertools.product(*(sorted(e.candidates) for e in entries)):
        trial: Plan = plan.moved({e.name: k for e, k in zip(entries, kinds, strict=True)})
        placed = {n: "sharded" if k == "sharded" else "replicated" for n, k in zip(NAMES, kinds, strict=True)}
        cost = trial.step_exposed_seconds + cpu.seconds(placed)
        if best is None or cost < best[0]:
            best = (cost, placed)
    assert best is not None
    return best


def given_worker(rank: int) -> dict[str, Any]:
    """``auto_plan`` on ``FAST`` with no CPU priced and with each of ``GIVEN``; the exhaustive reference; then
    ``sparsync.shard(..., "auto", optimizer=SGD)`` trains two steps (the link set: nothing measured)."""
    sparsync.set_link(FAST)
    group = dist.group.WORLD
    assert isinstance(group, dist.ProcessGroup)
    out: dict[str, Any] = {"none": auto_plan(Many(), sample(rank), group).tables}
    for name, (rep, shd, fixed) in GIVEN.items():
        cpu = cpu_of(rep, shd, fixed, contention=2.0)
        chosen = auto_plan(Many(), sample(rank), group, cpu=cpu)
        cost, placed = exhaustive(chosen, cpu)
        step = chosen.forward_seconds + chosen.backward_seconds + chosen.plan.exposed_seconds
        out[name] = {
            "tables": chosen.tables, "best": placed, "cpu_is_given": chosen.cpu is cpu,
            "cost": chosen.plan.step_exposed_seconds + cpu.seconds(chosen.tables), "best_cost": cost,
            "step": chosen.step_seconds(), "step_ref": step + cpu.seconds(chosen.tables),
        }  # fmt: skip
    sparsync.set_link(SLOW)  # where the communication alone shards every table
    out["fused_run"] = {"auto": _two_steps(rank, fused=True), "every_table_sharded": _two_steps(rank, fused=False)}
    return out


def _two_steps(rank: int, *, fused: bool) -> dict[str, Any]:
    """Two SGD steps of ``Many`` placed by ``sparsync.shard(..., "auto", optimizer=SGD)`` (``fused``), or every
    table sharded, torch's SGD over their sparse gradients: the losses and how many tables were sharded."""
    if fused:
        model = sparsync.shard(Many(), "auto", sample=sample(rank), optimizer=SGD(lr=0.1))
        params = dense_parameters(model)
    else:
        model = sparsync.shard(Many())
        params = list(model.parameters())
    losses = sgd_losses(model, params, [sample(rank, step + 1) for step in range(2)])
    return {"sharded": sum(isinstance(t, ShardedEmbeddingBag) for t in model.modules()), "losses": losses}


def measured_worker(rank: int) -> dict[str, Any]:
    """``auto_plan`` where nobody set the link: the tables' CPU measured (sparse gradients, then the optimizer in
    backward); where the link is set: not measured."""
    group = dist.group.WORLD
    assert isinstance(group, dist.ProcessGroup)
    plain = auto_plan(Many(), sample(rank), group)
    fused = auto_plan(Many(), sample(rank), group, fused=True)
    sparsync.set_link(FAST)
    set_link = auto_plan(Many(), sample(rank), group)
    return {"plain": plain.cpu, "fused": fused.cpu, "set_link": set_link.cpu, "tables": plain.tables,
            "step": plain.step_seconds(), "fwd_bwd": plain.forward_seconds + plain.backward_seconds,
            "exposed": plain.plan.exposed_seconds}  # fmt: skip
