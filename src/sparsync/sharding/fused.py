"""Optimizers applied to sharded tables at the end of backward, as fbgemm's table-batched embedding does (its
backward fused with the update; torchrec's ``fused_params``): ``sparsync.shard(model, optimizer=SGD(lr=0.1))``.

The owner sums each row's gradient over the ranks once per group (``rows._owner_sum``: one sort); the update
then runs on the group's flat tensor in place, a few ops for all of the group's tables, and no gradient is left
on the tables' parameters (``.grad`` stays None, so the optimizer of the rest of the model skips them:
``dense_parameters(model)`` leaves them out). The gradient is the mean over the ranks (the sum divided by P), as
``DistributedOptimizer``'s default ``op="mean"`` gives a replicated table, so an update equals the one torch's
optimizer makes from that gradient:

- ``SGD(lr)``: ``w_r -= lr · g_r`` (``torch.optim.SGD`` without momentum, which sparse gradients do not take);
- ``Adagrad(lr, eps)``: ``s_r += g_r²``, ``w_r -= lr · g_r / (sqrt(s_r) + eps)`` (``torch.optim.Adagrad``'s
  sparse path, ``lr_decay`` 0, ``initial_accumulator_value`` 0);
- ``RowwiseAdagrad(lr, eps)``: one accumulator per row, ``m_r += mean(g_r²)``,
  ``w_r -= lr · g_r / (sqrt(m_r) + eps)`` (fbgemm's exact row-wise Adagrad: D times less state);
- ``Adam(lr, betas, eps)``: lazy Adam, ``torch.optim.SparseAdam``: the moments of the rows in the step only, the
  bias corrections by each table's step count (a table counts the steps it was looked up in).

Only the rows a step looked up (on any rank) change; the state lives in the group (``state``), per row.

The row reads and writes and the SGD/Adagrad steps run in C where built (``kernels``: ``sharding.kernels``),
with the same bits as the torch ops (``index_put_`` with accumulate, each element ``t + v``, as torch's
optimizers' sparse ``add_`` computes it).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch
from torch import nn

from sparsync.sharding import kernels as native
from sparsync.sharding.group import Slot, TableGroup
from sparsync.sharding.modules import ShardedTable


@dataclass
class Fused:
    """What the fused optimizers share: the learning rate, and the divisor of the owners' sums (P: the mean)."""

    lr: float
    # the update's kernels: "auto" (C where built, else torch), "c" (raise if not built), "torch"; the same bits
    kernels: str = field(default="auto", kw_only=True)
    scale: float = field(default=1.0, init=False)  # 1/P, set by ``sparsync.shard``
    state: dict[str, torch.Tensor] = field(default_factory=dict, init=False)
    per_table: ClassVar[tuple[str, ...]] = ()  # the state held per table (one entry per slot), not per row

    def __post_init__(self) -> None:
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"{type(self).__name__}: lr must be a positive finite number, got {self.lr}")
        native.check(type(self).__name__, self.kernels)

    def bind(self, group: TableGroup) -> Fused:
        """A copy of this optimizer for ``group``, its state made (zeros) and its scale 1/P."""
        out = type(self)(**{k: getattr(self, k) for k in self._params()}, kernels=self.kernels)
        out.scale = 1.0 / group.parts
        out.init(group)
        return out

    def _params(self) -> Iterator[str]:
        """The hyperparameters (``kernels`` is not one: it does not change the result)."""
        return (f.name for f in fields(self) if f.init and f.name != "kernels")

    def init(self, group: TableGroup) -> None:
        """Make the per-row state."""

    def table_state(self, slot: Slot) -> dict[str, torch.Tensor]:
        """Views of table ``slot``'s state: each per-row tensor's rows of the table (``[owned, ...]``, in the
        shard's order) and each per-table entry (0-dim). Writing into them writes the state."""
        return {k: v[slot.index] if k in self.per_table else v[slot.first : slot.first + slot.owned]
                for k, v in self.state.items()}  # fmt: skip

    def hyperparameters(self) -> dict[str, Any]:
        """The hyperparameters by name (``lr``, ``eps``, ``betas``: what the constructor takes but ``kernels``)."""
        return {k: getattr(self, k) for k in self._params()}

    def set_hyperparameters(self, params: dict[str, Any]) -> None:
        """Set the hyperparameters ``params`` (``hyperparameters()``'s). Mutates this optimizer."""
        for k, value in params.items():
            setattr(self, k, tuple(value) if isinstance(value, list) else value)

    def state_dict(self) -> dict[str, Any]:
        """This rank's state (copies, as the group's flat tensor lays it out), the hyperparameters and the kind
        (the class name)."""
        return {"kind": type(self).__name__, "params": self.hyperparameters(),
                "state": {k: v.clone() for k, v in self.state.items()}}  # fmt: skip

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict`` (``state_dict()`` of the same group at the same P) into the state in place and the
        hyperparameters; ValueError naming another kind of optimizer, or a missing or misshapen entry. Mutates
        the state."""
        kind = state_dict.get("kind", type(self).__name__)
        if kind != type(self).__name__:
            raise ValueError(f"{type(self).__name__}: the state dict is of another optimizer, {kind}")
        state = state_dict["state"]
        for k, v in self.state.items():
            if k not in state or tuple(state[k].shape) != tuple(v.shape):
                got = tuple(state[k].shape) if k in state else "nothing"
                raise ValueError(f"{type(self).__name__}: state {k!r} must have shape {tuple(v.shape)}, got {got}")
        for k, v in self.state.items():
            v.copy_(state[k])
        self.set_hyperparameters(state_dict["params"])

    def apply(self, group: TableGroup, rows: torch.Tensor, values: torch.Tensor, slots: list[Slot]) -> None:
        """Update ``group``'s rows ``rows`` (distinct, ascending) with the summed gradient rows ``values``; the
        tables ``slots`` were looked up this step. Mutates the group's flat tensor and the state."""
        with torch.no_grad():
            self.update(group, rows, values * self.scale if self.scale != 1.0 else values, slots)

    def update(self, group: TableGroup, rows: torch.Tensor, g: torch.Tensor, slots: list[Slot]) -> None:
        raise NotImplementedError


@dataclass
class SGD(Fused):
    """``w_r -= lr · g_r`` (module doc)."""

    def update(self, group: TableGroup, rows: torch.Tensor, g: torch.Tensor, slots: list[Slot]) -> None:
        native.step_rows(group.flat, rows, g, self.lr, kernels=self.kernels)


@dataclass
class Adagrad(Fused):
    """``torch.optim.Adagrad``'s sparse update, per element (module doc)."""

    eps: float = 1e-10

    def init(self, group: TableGroup) -> None:
        self.state["sum"] = torch.zeros_like(group.flat)

    def update(self, group: TableGroup, rows: torch.Tensor, g: torch.Tensor, slots: list[Slot]) -> None:
        total = self.state["sum"]
        native.add_rows(total, rows, g, self.kernels, squares=True)
        std = native.gather(total, rows, self.kernels).sqrt_().add_(self.eps)
        native.step_rows(group.flat, rows, g, self.lr, std, self.kernels)


@dataclass
class RowwiseAdagrad(Fused):
    """One accumulator per row (module doc)."""

    eps: float = 1e-10

    def init(self, group: TableGroup) -> None:
        self.state["sum"] = torch.zeros(group.flat.shape[0], dtype=group.flat.dtype)

    def update(self, group: TableGroup, rows: torch.Tensor, g: torch.Tensor, slots: list[Slot]) -> None:
        total = self.state["sum"]
        native.add_rows(total, rows, g.pow(2).mean(1), self.kernels)
        std = total.index_select(0, rows).sqrt_().add_(self.eps)
        native.step_rows(group.flat, rows, g, self.lr, std, self.kernels)


@dataclass
class Adam(Fused):
    """``torch.optim.SparseAdam`` (module doc)."""

    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    per_table: ClassVar[tuple[str, ...]] = ("step",)

    def init(self, group: TableGroup) -> None:
        self.state["exp_avg"] = torch.zeros_like(group.flat)
        self.state["exp_avg_sq"] = torch.zeros_like(group.flat)
        self.state["step"] = torch.zeros(len(group.slots), dtype=torch.int64)

    def update(self, group: TableGroup, rows: torch.Tensor, g: torch.Tensor, slots: list[Slot]) -> None:
        b1, b2 = self.betas
        avg, avg_sq, step = self.state["exp_avg"], self.state["exp_avg_sq"], self.state["step"]
        step[[s.index for s in slots]] += 1
        old = native.gather(avg, rows, self.kernels)
        avg_update = g.sub(old).mul_(1 - b1)
        native.add_rows(avg, rows, avg_update, self.kernels)
        old_sq = native.gather(avg_sq, rows, self.kernels)
        sq_update = g.pow(2).sub_(old_sq).mul_(1 - b2)
        native.add_rows(avg_sq, rows, sq_update, self.kernels)
        numer = avg_update.add_(old)
        denom = sq_update.add_(old_sq).sqrt_().add_(self.eps)
        sizes = torch.tensor([self._step_size(int(n)) for n in step.tolist()], dtype=g.dtype)
        per_row = sizes[_table_of(group, rows)]
        native.add_rows(group.flat, rows, numer.div_(denom) * (-per_row).unsqueeze(1), self.kernels)

    def _step_size(self, n: int) -> float:
        if n == 0:
            return 0.0
        b1, b2 = self.betas
        return self.lr * math.sqrt(1 - b2**n) / (1 - b1**n)


def _table_of(group: TableGroup, rows: torch.Tensor) -> torch.Tensor:
    """The table (slot index) of each of the group's flat rows."""
    firsts = torch.tensor([s.first for s in group.slots], dtype=rows.dtype)
    return torch.searchsorted(firsts, rows, right=True) - 1


OPTIMIZERS = (SGD, Adagrad, RowwiseAdagrad, Adam)


def dense_parameters(model: nn.Module) -> list[nn.Parameter]:
    """``model``'s parameters but those of tables sharded with an optimizer (``sparsync.shard(optimizer=...)``),
    which backward updates itself: what the optimizer of the rest of the model takes."""
    fused = {id(m.weight) for m in model.modules() if isinstance(m, ShardedTable) and m.group.fused is not None}
    return [p for p in model.parameters() if id(p) not in fused]
