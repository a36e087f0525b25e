"""``wrap_optimizer``: aggregate gradients across replicas before ``step()``, by a per-parameter plan.

A plan maps each parameter (by name) to a ``Placement``: one small class per way of aggregating, all
joined by one template method, ``ReplicatedOptimizer.aggregate``: group the parameters by placement (in plan
order, the same on every replica), let each placement replace its parameters' gradients by their *sum* over
replicas, then divide by the number of replicas when ``op="mean"`` (TF-Replicator's ``wrap_optimizer``
averages, §3.4; the sum is explicit, never implied).

The placements (``DenseAllreduce``, ``SparseAllreduce``, ``Compressed``, ``CustomReduce``, ``Grouped``,
``ByLayout``, ``Sketch``) are ``sparsync.placement``'s, the one interface ``HybridTrainer`` and the DDP hook use
too (``sparsync.replicator`` re-exports them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from sparsync.collectives.comm import Comm
from sparsync.collectives.fifo import submit
from sparsync.collectives.meta import NonFiniteError
from sparsync.placement import ByLayout, NamedParam, Placement, ReduceEnv, aggregate
from sparsync.placement.base import nan_grad, zero_grad
from sparsync.record import AGREE
from sparsync.replicator import primitives as prim

OPS = ("mean", "sum")
NONE, DENSE, SPARSE = 0, 1, 2  # a gradient's layout, as fill_missing_grads agrees it


def fill_missing_grads(params: list[NamedParam], env: ReduceEnv) -> list[int]:
    """Give every parameter that has a gradient on some replica but none here a zero gradient of that layout
    (an empty COO tensor for a sparse one, as ``nn.Embedding(sparse=True)`` gives; dense zeros otherwise), so
    every replica's aggregation has the same tensors. One allreduce (MAX) of one int32 per parameter on the
    group's host side, queued behind the group's sparsync work like any of its calls, and recorded in
    ``env.log`` (op ``AGREE``, phase "layouts"). DDP's ``find_unused_parameters`` walks the autograd graph
    instead (docs/optimizer.md compares the two). Returns the agreed layout codes (0 none, 1 dense, 2 sparse).
    Mutates ``p.grad`` of the parameters that lack one."""
    codes = torch.tensor(
        [NONE if p.param.grad is None else SPARSE if p.param.grad.is_sparse else DENSE for p in params],
        dtype=torch.int32,
    )

    def agree() -> None:
        t0 = time.perf_counter()
        meta = Comm(env.group, env.timeout).meta
        meta.op = "DistributedOptimizer: gradient layouts"
        with meta.phase("layouts"):
            meta.run_collective("gradient layouts", dist.all_reduce, codes, op=dist.ReduceOp.MAX)
        meta.count_ring_allreduce(codes.numel() * codes.element_size())
        if env.log is not None:
            n = codes.numel()
            env.log.append(meta.record(AGREE, "gloo", t0, dim=n, nnz_in=n, nnz_out=n))

    submit(env.group, agree, False)
    agreed: list[int] = codes.tolist()
    for p, code in zip(params, agreed, strict=True):
        if p.param.grad is None and code != NONE:
            p.param.grad = zero_grad(p.param, sparse=code == SPARSE)
    return agreed


PlanSpec = Mapping[str, Placement] | Callable[[str, torch.nn.Parameter], Placement] | None


class ReplicatedOptimizer:
    """A torch optimizer whose ``step()`` first aggregates gradients across replicas (``aggregate()``)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        env: ReduceEnv,
        *,
        op: str,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
        plan: PlanSpec = None,
        default: Placement | None = None,
        sync_parameters: bool = True,
    ) -> None:
        if op not in OPS:
            raise ValueError(f"wrap_optimizer op must be one of {OPS} (explicit mean or sum), got {op!r}")
        self.optimizer = optimizer
        self.env = env
        self.op = op
        names = {id(p): n for n, p in named_parameters} if named_parameters is not None else {}
        params: list[NamedParam] = []
        for gi, group in enumerate(optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                params.append(NamedParam(names.get(id(p), f"group{gi}.param{pi}"), p))
        known = [p.name for p in params]
        if len(set(known)) != len(known):
            raise ValueError("a parameter appears twice in the optimizer's param_groups")
        base = default if default is not None else ByLayout()
        if isinstance(plan, Mapping):
            unknown = sorted(set(plan) - set(known))
            if unknown:
                raise KeyError(f"plan names unknown parameters {unknown}; valid names: {known}")
            bad = [k for k, v in plan.items() if not isinstance(v, Placement)]
            if bad:
                raise ValueError(f"plan entries {bad} are not Placement instances")
            self.plan = {p.name: plan.get(p.name, base) for p in params}
        elif callable(plan):
            self.plan = {p.name: plan(p.name, p.param) for p in params}
        else:
            self.plan = {p.name: base for p in params}
        self.params = params
        if sync_parameters and env.num_replicas > 1:
            self.broadcast_parameters()

    def broadcast_parameters(self, source: int = 0) -> None:
        """Copy replica ``source``'s parameter values to every replica (as DDP does at construction), so
        replicas that initialised their models differently start from the same point: the replicator's
        ``broadcast`` primitive, recorded in ``env.log`` (op "broadcast": its metadata round and gloo's
        broadcast, each rank's bytes by ``Comm.count_broadcast``). Mutates the parameters."""
        params = [p for p in self.params if self.plan[p.name].replicated]  # a shard differs per rank by design
        data = [p.param.detach() for p in params]
        env = prim.Env(self.env.group, self.env.timeout, self.env.log)
        got = prim.raw_broadcast(env, data, pytree.tree_flatten(data)[1], source, "broadcast")
        with torch.no_grad():
            for p, g in zip(params, got, strict=True):
                p.param.copy_(g)

    # --- the template method ----------------------------------------------------------------------------------
    def aggregate(self) -> list[int]:
        """Replace every parameter's gradient by its sum (op="sum") or mean (op="mean") over replicas.
        A parameter with a gradient on some replicas only (a table or branch unused on the others) counts as
        zero where it has none; one without a gradient anywhere is skipped (its optimizer skips it too).
        Returns each parameter's gradient layout as the replicas agreed it (``fill_missing_grads``; on one
        replica its own)."""
        codes, nonfinite = self.aggregate_deferred()
        if nonfinite is not None:
            raise nonfinite
        return codes

    def aggregate_deferred(self) -> tuple[list[int], NonFiniteError | None]:
        """``aggregate``, except that a NaN or ±Inf some replica contributed (``check_nan``) is returned, not
        raised: every gradient then holds NaN on every replica (``placement.base.nan_grad``; the placements refuse
        before sending, and a compressor's state must not take the values in, so there are no sums), which a
        ``GradScaler``'s inf check sees alike everywhere."""
        codes = [
            NONE if p.param.grad is None else SPARSE if p.param.grad.is_sparse else DENSE for p in self.params
        ]
        if self.env.num_replicas > 1:
            codes = fill_missing_grads(self.params, self.env)
        nonfinite = None
        try:
            aggregate(self.plan, self.params, self.env)
        except NonFiniteError as e:  # raised alike on every replica, at the same placement's call
            nonfinite = e
            for p in self.params:
                if p.param.grad is not None:
                    p.param.grad = nan_grad(p.param, p.param.grad)
        if self.op == "mean" and self.env.num_replicas > 1:
            for p in self.params:
                if p.param.grad is not None:
                    p.param.grad = p.param.grad / self.env.num_replicas
        return codes, nonfinite

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        self.aggregate()
        return self.optimizer.step(closure)

    # --- delegation -------------------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)
