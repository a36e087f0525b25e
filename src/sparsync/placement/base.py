"""The one Placement interface: how a set of parameters' gradients is aggregated across the workers of a group.

Every way sparsync synchronises a parameter is one ``Placement`` (Parallax §3.1 calls the choice per variable
its placement; TF-Replicator §3.4's ``wrap_optimizer`` aggregates by one): the dense allreduce, SparCML's sparse
allreduce, a compressor with error feedback, S2's sketch (``placement.collective``, ``placement.sketch``) and
the parameter server (``sparsync.ps.placement``). The replicator's ``wrap_optimizer``, ``DistributedOptimizer``
and ``HybridTrainer`` all run them through ``aggregate``, the template method: group the parameters by
placement object in the given order (the same on every worker), and let each placement replace its parameters'
gradients by their *sum* over the group. (The DDP hook, which DDP calls per bucket and asynchronously, takes a
compressor per parameter instead: ``Compressed``'s part.)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from sparsync.record import CommLog


@dataclass(frozen=True)
class NamedParam:
    name: str
    param: torch.nn.Parameter


@dataclass(frozen=True)
class ReduceEnv:
    """What a placement may use: the group (one member per replica) and where to log bytes."""

    group: dist.ProcessGroup
    num_replicas: int
    timeout: float | None = None
    log: CommLog | None = None
    # False lets NaN and ±Inf through as IEEE 754 sums (under a GradScaler, whose inf check must see them)
    check_nan: bool = True


class Placement(ABC):
    """How a set of parameters' gradients is aggregated across replicas. ``kind`` is the name a plan uses
    (``sparsync.plan.KINDS``' names: ``dense_allreduce``, ``sparse_allreduce``, ``sketch``, ``ps``, ...)."""

    kind: str = "placement"
    # Whether DistributedOptimizer may run it on its queue thread while backward goes on (optim.overlap),
    # on a detached view of each parameter; the parameter server pushes every parameter each step, from step().
    overlaps: bool = True
    # False: the gradient already holds the sum over replicas when backward leaves it (a module that exchanged
    # it in its own backward, e.g. sharded rows); aggregate does nothing and DistributedOptimizer only divides
    # it for op="mean", in no bucket of its own.
    communicates: bool = True
    # False: each rank holds its own part of the parameter (a shard of a table), differing across ranks in values
    # and possibly in shape, so nothing may broadcast it from one rank or compare its shape across ranks.
    replicated: bool = True

    @abstractmethod
    def aggregate(self, params: list[NamedParam], env: ReduceEnv) -> None:
        """Replace ``p.grad`` of every given parameter (all have a gradient) by its sum over replicas.
        Mutates ``p.grad``; collective over ``env.group``: every replica calls it with the same parameters."""

    def state_dict(self) -> dict[str, Any] | None:
        """Per-worker state a checkpoint must keep (residuals, counters); None when there is none."""
        return None

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        del state  # stateless by default


def aggregate(plan: Mapping[str, Placement], params: Iterable[NamedParam], env: ReduceEnv) -> None:
    """The template method: every parameter with a gradient, grouped by its placement object (first
    appearance in ``params`` order), replaced by its sum over ``env.group``. Parameters without a gradient are
    skipped (they must lack it on every replica)."""
    groups: dict[int, tuple[Placement, list[NamedParam]]] = {}
    for p in params:
        if p.param.grad is None:
            continue
        pl = plan[p.name]
        groups.setdefault(id(pl), (pl, []))[1].append(p)
    for pl, members in groups.values():
        pl.aggregate(members, env)


def zero_grad(p: torch.nn.Parameter, *, sparse: bool) -> torch.Tensor:
    """What a worker that did not use ``p`` contributes to its aggregation: an empty COO gradient of the layout
    ``nn.Embedding(sparse=True)`` gives (one sparse dim, the rest dense) when ``sparse``, else dense zeros."""
    if sparse:
        idx = torch.empty(1, 0, dtype=torch.int64, device=p.device)
        vals = torch.empty(0, *p.shape[1:], dtype=p.dtype, device=p.device)
        return torch.sparse_coo_tensor(idx, vals, p.shape, is_coalesced=True)
    return torch.zeros_like(p)


def nan_grad(param: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor:
    """A non-finite stand-in for a refused gradient, the same on every rank: NaN of ``grad``'s layout (sparse:
    one row, row 0; none: sparse too) with ``param``'s shape."""
    if grad is not None and not grad.is_sparse:
        return torch.full_like(grad, float("nan"))
    if param.dim() == 0:
        return torch.full_like(param, float("nan"))
    row = torch.full((1, *param.shape[1:]), float("nan"), dtype=param.dtype, device=param.device)
    index = torch.zeros(1, 1, dtype=torch.int64, device=param.device)
    return torch.sparse_coo_tensor(index, row, param.shape, is_coalesced=True)


class _Stateful(Protocol):
    def load_state_dict(self, state: Any) -> None: ...


def load_optional_state(target: _Stateful | None, state: Any, what: str, option: str) -> None:
    """Restore optional per-worker state (residuals) from a checkpoint, refusing a checkpoint that has it when this
    worker keeps none (or the reverse): ``option`` names the setting that decides."""
    if (state is None) != (target is None):
        raise ValueError(
            f"the checkpoint {'has no' if state is None else 'has'} {what}, this trainer "
            f"{'keeps' if target is not None else 'does not keep'} it ({option})"
        )
    if target is not None and state is not None:
        target.load_state_dict(state)
