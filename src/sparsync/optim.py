"""``DistributedOptimizer``: drop sparsync into an existing training script in two lines.

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = sparsync.DistributedOptimizer(opt, model)        # after dist.init_process_group(...)

It is a ``torch.optim.Optimizer`` (LR schedulers, ``state_dict``, hooks and ``isinstance`` checks work) that
shares the wrapped optimizer's ``param_groups`` and ``state`` and, in ``step()``, first aggregates every
gradient across the ranks of the group by a per-parameter plan (``replicator.optimizer``'s placements: the
default sends sparse COO gradients, e.g. ``nn.Embedding(sparse=True)``'s, by the row-sparse allreduce and dense
ones by one bucketed allreduce, both in one grouped call), then steps the wrapped optimizer. The design follows
Horovod's ``DistributedOptimizer`` (aggregate in ``step``, ``synchronize()`` for gradient clipping) without
re-creating the user's optimizer, so an optimizer built and loaded before wrapping keeps its state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from sparsync.collectives.group import resolve_group
from sparsync.placement import Placement, ReduceEnv
from sparsync.record import CommLog
from sparsync.replicator.optimizer import PlanSpec, ReplicatedOptimizer


class DistributedOptimizer(torch.optim.Optimizer):
    """``optimizer`` whose ``step()`` first aggregates gradients over ``group`` (default: the default group).

    ``model``: names the parameters for ``plan`` and for error messages (``model.named_parameters()``).
    ``plan``: per parameter name a ``Placement`` (``DenseAllreduce``, ``SparseAllreduce``, ``Compressed``,
    ``Grouped``, ``CustomReduce``, ``ByLayout``) or a callable ``(name, param) -> Placement``; parameters it
    does not name get ``default`` (``ByLayout()``). ``op``: "mean" (DDP's convention) or "sum". ``log``: a
    ``CommLog`` that receives one record per collective (bytes, algorithm). ``sync_parameters``: broadcast
    rank 0's parameters now, as DDP does at construction. Collective: every rank wraps the same parameters in
    the same order.

    Mutates: the parameters' ``.grad`` in ``step()``/``synchronize()`` (replaced by the aggregate), and the
    parameters themselves at construction when ``sync_parameters``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module | None = None,
        *,
        plan: PlanSpec = None,
        default: Placement | None = None,
        op: str = "mean",
        group: dist.ProcessGroup | None = None,
        log: CommLog | None = None,
        timeout: float | None = None,
        sync_parameters: bool = True,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, DistributedOptimizer):
            raise ValueError("this optimizer is already a DistributedOptimizer: wrapping twice would sum twice")
        if not dist.is_initialized():
            raise RuntimeError(
                "DistributedOptimizer needs torch.distributed: call dist.init_process_group first "
                "(or run under sparsync.launch / torchrun)"
            )
        g = resolve_group(group)
        env = ReduceEnv(g, dist.get_world_size(g), timeout, log)
        named = list(model.named_parameters()) if model is not None else None
        self.replicated = ReplicatedOptimizer(
            optimizer, env, op=op, named_parameters=named, plan=plan, default=default,
            sync_parameters=sync_parameters,
        )  # fmt: skip
        self.optimizer = optimizer
        # torch's own set-up (hook tables, step profiling) over the same group dicts, then share, not copy:
        # an LR scheduler's change to param_groups[i]["lr"] is the wrapped optimizer's.
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self._synchronized = False

    def synchronize(self) -> None:
        """Aggregate the gradients now (e.g. to clip them before ``step()``); the next ``step()`` then does
        not aggregate again. Collective."""
        self.replicated.aggregate()
        self._synchronized = True

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Aggregate (unless ``synchronize()`` already did), then step the wrapped optimizer. A ``closure``
        is evaluated once, before the aggregation (optimizers that re-evaluate it, like LBFGS, would see
        local gradients: not supported)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._synchronized:
            self.replicated.aggregate()
        self._synchronized = False
        self.optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_synchronized", None) is None:  # torch's __init__ adding the wrapped groups
            super().add_param_group(param_group)
            return
        raise ValueError(
            "add parameter groups to the optimizer before wrapping it: the aggregation plan is fixed at "
            "construction (a group added now would be stepped with unaggregated gradients)"
        )

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)
        # torch's load replaces the wrapped optimizer's group dicts and state: share the new ones
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r})"
