"""``bench dlrm``'s sharded methods (docs/sharding.md): the tables' rows owned by the ranks (``sparsync.shard``),
the MLPs by ``DistributedOptimizer`` as in ``sparsync`` (by DDP in ``DDP_METHODS``).

- ``sparsync_sharded``: every table sharded;
- ``sparsync_sharded_bf16``: the same, the rows and gradient rows sent in bf16 (``sparsync.shard(rows="bf16")``:
  half the rows' bytes, lossy; its loss beside ``sparsync_sharded``'s says how much);
- ``sparsync_sharded_lookahead``: ``sparsync_sharded`` with its batches through ``sparsync.shard``'s
  ``Lookahead``: each batch's ids round runs during the step before it, so the forward waits for the rows round
  only (the same values, bit for bit);
- ``sparsync_auto``: ``sparsync.shard(model, plan="auto", sample=first batch)``: each table where the cost model
  predicts the faster step (``sparsync.sharding.auto``: among dense allreduce, sparse allreduce and sharded, priced
  on the distinct rows of each rank's first batch and the group's measured link). The tables it leaves replicated
  go the ``sparsync`` way (``DistributedOptimizer``'s default, which chooses its algorithm itself), so the plan
  decides only where each table lives;
- ``sparsync_sharded_fused``, ``sparsync_auto_fused``: ``sparsync_sharded`` and ``sparsync_auto`` with the
  tables' SGD applied in their backward (``sparsync.shard(optimizer=SGD(lr))``): the same update, no sparse
  gradient per table, the optimizer over the MLPs only; the tables ``auto`` keeps replicated then go in
  replicated groups (``sparsync.sharding.replicated``: whole on every rank, one sum over the ranks per group);
- ``sparsync_replicated_fused``: every table in those replicated groups, its SGD in backward;
- ``sparsync_sharded_fused_lookahead``: ``sparsync_sharded_fused`` with its batches through ``Lookahead``;
- ``sparsync_sharded_fused_ddp``, ``sparsync_sharded_fused_lookahead_ddp``, ``sparsync_auto_fused_ddp``: those
  three with the MLPs in torch's ``DistributedDataParallel`` instead of ``DistributedOptimizer`` (``DDP_METHODS``;
  ``sparsync.sharding.ddp`` leaves the tables to sparsync), as torchrec's dense layers and the floor's: the
  tables' cost alone beside them.

A sharded model holds a part of each table per rank, so the figures the benchmark compares across methods
(``table_figures``) are summed over the ranks' shards, each row with its index in the whole table.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from sparsync.record import CommLog
from sparsync.sharding import SGD, Lookahead, ShardedTable, auto_plan, shard

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # dense features, categorical ids [n, tables], labels

FUSED_METHODS = (  # the tables' SGD in their backward
    "sparsync_sharded_fused", "sparsync_auto_fused", "sparsync_replicated_fused",
    "sparsync_sharded_fused_lookahead", "sparsync_sharded_fused_ddp", "sparsync_sharded_fused_lookahead_ddp",
    "sparsync_auto_fused_ddp",
)  # fmt: skip
SHARD_METHODS = (
    "sparsync_sharded", "sparsync_auto", "sparsync_sharded_bf16", "sparsync_sharded_lookahead", *FUSED_METHODS,
)  # fmt: skip
LOOKAHEAD_METHODS = (  # through Lookahead
    "sparsync_sharded_lookahead", "sparsync_sharded_fused_lookahead", "sparsync_sharded_fused_lookahead_ddp",
)  # fmt: skip
DDP_METHODS = (  # the MLPs in torch's DDP
    "sparsync_sharded_fused_ddp", "sparsync_sharded_fused_lookahead_ddp", "sparsync_auto_fused_ddp",
)  # fmt: skip
SHARD_OPS = ("shard_lookup", "shard_grad")  # the CommLog records of the sharded tables' exchanges


def shard_tables(
    method: str, model: nn.Module, sample: tuple[torch.Tensor, ...], log: CommLog, lr: float = 0.1
) -> dict[str, float]:
    """Swap ``model``'s tables for sharded ones per ``method`` (module doc); ``sample``: this rank's first batch,
    the arguments of ``model(...)``; ``lr``: the SGD fused into the sharded tables' backward (``FUSED_METHODS``).
    Returns the cost model's prediction for the placement it ran, from the statistics ``plan="auto"`` measures
    (every method measures them, so each row has one): the sharded tables' bytes sent per rank and step
    (``predicted_shard_bytes_per_step``: half of the plan's sent + received), the step's communication time as
    ``DistributedOptimizer`` and the exchange send it (``predicted_comm_s``: ``Plan.grouped_seconds``), and the
    step's time (``predicted_step_s``: ``AutoPlan.step_seconds``, the sample's forward and backward plus the
    communication the step waits for), with the all-to-all round it priced (``round_s``:
    ``AutoPlan.round_seconds``, 0 when none was measured). Collective: every rank calls it with the same method.
    Mutates ``model`` (its tables are replaced; a new optimizer must take its parameters)."""
    if method not in SHARD_METHODS:
        raise KeyError(f"unknown sharded method {method!r}; valid: {', '.join(SHARD_METHODS)}")
    choice = auto_plan(model, sample, dist.group.WORLD, fused=method in FUSED_METHODS)  # type: ignore[arg-type]
    plan = choice.plan
    if method == "sparsync_replicated_fused":
        plan = choice.every_table("replicated")
    elif not method.startswith("sparsync_auto"):
        plan = choice.every_table("sharded", itemsize=2 if method == "sparsync_sharded_bf16" else None)
    kinds = {n.removesuffix(".weight"): k for n, k in plan.kinds.items() if n.startswith("tables.")}
    tables = {n: "sharded" if k == "sharded" else "replicated" for n, k in kinds.items()}
    fused = SGD(lr=lr) if method in FUSED_METHODS else None
    shard(model, tables, log=log, rows="bf16" if method == "sparsync_sharded_bf16" else None, optimizer=fused)
    sent = sum(e.bytes_per_machine for e in plan.entries if e.placement == "sharded") / 2
    return {"predicted_shard_bytes_per_step": sent, "predicted_comm_s": plan.grouped_seconds,
            "predicted_step_s": choice.step_seconds(plan), "round_s": choice.round_seconds or 0.0}  # fmt: skip


def batches(method: str, model: nn.Module, steps: list[Batch]) -> Iterator[Batch]:
    """The steps' batches for ``method``: as they are, or through ``Lookahead`` (``LOOKAHEAD_METHODS``), DLRM's
    table j looked up with column j of the ids (``DLRM.forward``)."""
    if method not in LOOKAHEAD_METHODS:
        return iter(steps)
    sharded = [n for n, m in model.named_modules() if isinstance(m, ShardedTable)]
    return Lookahead(steps, model, ids=lambda b: {n: b[1][:, int(n.split(".")[-1])] for n in sharded})


def table_figures(tables: nn.ModuleList, initial: list[torch.Tensor]) -> tuple[float, float]:
    """(Σ |w| over the whole tables, Σ over rows of (row index + 1)·Σ|w_row - initial_row|), in float64, whether
    the tables are whole on every rank or sharded (their shards summed over the ranks: collective then). The
    second weighs each row's movement by its index, so a row update applied to the wrong row changes it too."""
    whole = torch.zeros(2, dtype=torch.float64)
    parts = torch.zeros(2, dtype=torch.float64)  # the shards', to be summed over the ranks
    sharded = False
    for t, w0 in zip(tables, initial, strict=True):
        w = _weight(t).detach().double()
        if isinstance(t, ShardedTable):
            rows, acc, sharded = t.ownership.global_rows(t.exchanger.rank), parts, True
        else:
            rows, acc = torch.arange(w.shape[0]), whole
        delta = (w - w0[rows].double()).abs().sum(1)
        acc[0] += w.abs().sum()
        acc[1] += (delta * (rows + 1).double()).sum()
    if sharded:
        dist.all_reduce(parts)
    out = whole + parts
    return float(out[0]), float(out[1])


def _weight(table: nn.Module) -> torch.Tensor:
    w = table.weight
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"a DLRM table's weight must be a tensor, got {type(w).__name__}")
    return w
