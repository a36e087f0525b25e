"""``wrap_optimizer``: aggregate gradients across replicas before ``step()``, by a per-parameter plan.

A plan maps each parameter (by name) to a ``Placement``: one small class per way of aggregating (STYLE 1), all
joined by one template method, ``ReplicatedOptimizer.aggregate``: group the parameters by placement (in plan
order, the same on every replica), let each placement replace its parameters' gradients by their *sum* over
replicas, then divide by the number of replicas when ``op="mean"`` (TF-Replicator's ``wrap_optimizer``
averages, §3.4; the sum is explicit, never implied).

Placements here: ``DenseAllreduce`` (one bucketed allreduce per dtype), ``SparseAllreduce`` (SparCML's
``sparsync.allreduce`` per tensor, COO in, COO out), ``Compressed`` (a ``sparsync.compress`` compressor with error
feedback through ``sparsync.compressed_allreduce``: ``Threshold`` + ``ErrorFeedback`` is DCT-DP), ``CustomReduce``
(any ``(grad, name, group) -> sum`` callable), ``Grouped`` (sparse and small dense gradients in one
``grouped_allreduce``) and ``ByLayout`` (the default: sparse gradients to ``SparseAllreduce``, dense ones to
``DenseAllreduce``, both in one ``Grouped`` call when those two are the defaults). A
parameter-server placement subclasses ``Placement`` the same way.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from sparsync.collectives.grouped import grouped_allreduce
from sparsync.collectives.tensor import allreduce
from sparsync.compress import Compressor, ErrorFeedback, compressed_allreduce
from sparsync.record import CommLog
from sparsync.replicator import primitives as prim

ReduceFn = Callable[[torch.Tensor, str, dist.ProcessGroup], torch.Tensor]
OPS = ("mean", "sum")


@dataclass(frozen=True)
class NamedParam:
    name: str
    param: torch.nn.Parameter


@dataclass(frozen=True)
class ReduceEnv:
    """What a placement may use: the data-parallel group (one member per replica) and where to log bytes."""

    group: dist.ProcessGroup
    num_replicas: int
    timeout: float | None = None
    log: CommLog | None = None


class Placement(ABC):
    """How a set of parameters' gradients is aggregated across replicas."""

    kind: str = "placement"

    @abstractmethod
    def aggregate(self, params: list[NamedParam], env: ReduceEnv) -> None:
        """Replace ``p.grad`` of every given parameter (all have a gradient) by its sum over replicas.
        Mutates ``p.grad``; collective over ``env.group``: every replica calls it with the same parameters."""


@dataclass(frozen=True)
class DenseAllreduce(Placement):
    """Dense allreduce (gloo ring), all gradients of one dtype in one bucket. A sparse gradient is densified:
    this is what plain data parallelism (Horovod, DDP) does with an embedding's gradient."""

    kind = "dense_allreduce"

    def aggregate(self, params: list[NamedParam], env: ReduceEnv) -> None:
        grads: list[torch.Tensor] = []
        for p in params:
            g = p.param.grad
            assert g is not None  # aggregate() passes only parameters with a gradient
            grads.append(g.to_dense() if g.is_sparse else g)
        penv = prim.Env(env.group, env.timeout, env.log)
        spec = pytree.tree_flatten(grads)[1]
        summed = prim.raw_all_reduce(penv, grads, spec, "sum", "all_reduce")
        for p, g in zip(params, summed, strict=True):
            p.param.grad = g.clone()


@dataclass(frozen=True)
class SparseAllreduce(Placement):
    """SparCML sparse allreduce per gradient (``sparsync.allreduce``): COO gradients of
    ``nn.Embedding(sparse=True)`` stay COO; dense ones travel sparse when "auto" finds that cheaper."""

    algorithm: str = "auto"
    kind = "sparse_allreduce"

    def aggregate(self, params: list[NamedParam], env: ReduceEnv) -> None:
        for p in params:
            g = p.param.grad
            assert g is not None
            p.param.grad = allreduce(  # type: ignore[assignment]
                g, algorithm=self.algorithm, group=env.group, log=env.log, timeout=env.timeout, name=p.name
            )


@dataclass(frozen=True)
class CustomReduce(Placement):
    """Any reduction ``fn(grad, name, group) -> sum over the group`` (same kind of tensor as ``grad``): the plug
    point for compressors with error feedback, keyed by the parameter's stable name."""

    fn: ReduceFn
    kind = "custom"

    def aggregate(self, params: list[NamedParam], env: ReduceEnv) -> None:
        for p in params:
            g = p.param.grad
            assert g is not None
            out = self.fn(g, p.name, env.group)
            if not isinstance(out, torch.Tensor) or out.shape != g.shape:
                raise ValueError(
                    f"CustomReduce for {p.name!r} returned {type(out).__name__} "
                    f"{tuple(getattr(out, 'shape', ()))}, expected a tensor of shape {tuple(g.shape)}"
                )
            p.param.grad = out


@dataclass(frozen=True)
class Compressed(Placement):
    """A compressor from ``sparsync.compress`` with optional error feedback, through
    ``sparsync.compressed_allreduce``: e.g. ``Compressed(Threshold(0.01, lifespan=1000), ErrorFeedback())`` is
    DCT-DP (DCT Alg. 1). Residuals and the compressor's per-name state are keyed by the parameter's name."""

    compressor: Compressor
    memory: ErrorFeedback | None = None
    # One compression and one collective for all the dense gradients of a dtype, flattened in plan order under
    # the name "bucket:<first name>" (DCT Alg. 1 thresholds the gradient as one vector; per tensor, a model of
    # many small layers pays a collective per layer). Sparse (COO) gradients are always reduced one by one.
    bucket: bool = False
    kind = "compressed"

    def aggregate(self, params: list[NamedParam], env: ReduceEnv) -> None:
        buckets: dict[torch.dtype, list[NamedParam]] = {}
        for p in params:
            g = _grad(p)
            if self.bucket and not g.is_sparse:
                buckets.setdefault(g.dtype, []).append(p)
            else:
                p.param.grad = self._reduce(g, p.name, env)
        for group in buckets.values():
            grads = [_grad(p) for p in group]
            out = self._reduce(torch.cat([g.reshape(-1) for g in grads]), f"bucket:{group[0].name}", env)
            for p, g, piece in zip(group, grads, torch.split(out, [g.numel() for g in grads]), strict=True):
                p.param.grad = piece.view_as(g)

    def _reduce(self, g: torch.Tensor, name: str, env: ReduceEnv) -> torch.Tensor:
        out: torch.Tensor = compressed_allreduce(
            g, self.compressor, memory=self.memory, name=name, group=env.group, average=False, log=env.log,
            timeout=env.timeout,
        )  # fmt: skip
        return out


def _grad(p: NamedParam) -> torch.Tensor:
    g = p.param.grad
    assert g is not None
    return g


@dataclass(frozen=True)
class Grouped(Placement):
    """Sparse and small dense gradients together in one ``grouped_allreduce`` (one metadata round, and one
    allgather in all when the payloads fit the eager protocol): COO gradients grouped by (row width, dtype),
    one call per group, the dense gradients of a group's dtype packed into the first such call while their
    total is at most ``max_dense`` elements. Dense gradients left over go to ``DenseAllreduce``. Issue 13:
    the demo's embedding + MLP paid two calls with a metadata round each, and lost to DDP."""

    algorithm: str = "auto"
    # Above this many dense elements a ring allreduce of the dense part (2(P-1)/P of it per rank) is left to
    # DenseAllreduce: fused, auto may run allgather, which sends it P-1 times.
    max_dense: int = 1 << 16
    kind = "grouped"

    def aggregate(self, params: list[NamedParam], env: ReduceEnv) -> None:
        groups: dict[tuple[int, torch.dtype], list[NamedParam]] = {}
        dense: list[NamedParam] = []
        for p in params:
            g = p.param.grad
            assert g is not None
            if g.is_sparse:
                groups.setdefault((math.prod(g.shape[g.sparse_dim() :]), g.dtype), []).append(p)
            else:
                dense.append(p)
        fused: set[torch.dtype] = set()
        for (_, dtype), members in groups.items():
            extra: list[NamedParam] = []
            if dtype not in fused:
                extra = [p for p in dense if p.param.grad is not None and p.param.grad.dtype == dtype]
                if sum(p.param.numel() for p in extra) > self.max_dense:
                    extra = []
                fused.add(dtype)
            together = members + extra
            grads = [p.param.grad for p in together]
            out = grouped_allreduce(
                grads,  # type: ignore[arg-type]
                algorithm=self.algorithm, group=env.group, log=env.log, timeout=env.timeout,
                name=",".join(p.name for p in together),
            )  # fmt: skip
            for p, g in zip(together, out, strict=True):  # type: ignore[arg-type]
                p.param.grad = g
            done = {id(p) for p in extra}
            dense = [p for p in dense if id(p) not in done]
        if dense:
            DenseAllreduce().aggregate(dense, env)


@dataclass(frozen=True)
class ByLayout(Placement):
    """The default: sparse (COO) gradients by ``sparse``, dense ones by ``dense``. With the default
    placements on both sides and ``fuse`` on, the two go together through ``Grouped`` (one call where there
    were two, issue 13)."""

    dense: Placement = field(default_factory=DenseAllreduce)
    sparse: Placement = field(default_factory=SparseAllreduce)
    fuse: bool = True
    kind = "by_layout"

    def aggregate(self, params: list[NamedParam], env: ReduceEnv) -> None:
        sp = [p for p in params if p.param.grad is not None and p.param.grad.is_sparse]
        dn = [p for p in params if p.param.grad is not None and not p.param.grad.is_sparse]
        # A gradient's layout comes from its module (nn.Embedding(sparse=True)), so it is the same on every
        # replica and both sides skip an empty half alike.
        if self.fuse and sp and type(self.dense) is DenseAllreduce and type(self.sparse) is SparseAllreduce:
            Grouped(self.sparse.algorithm).aggregate(sp + dn, env)
            return
        if dn:
            self.dense.aggregate(dn, env)
        if sp:
            self.sparse.aggregate(sp, env)


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
        replicas that initialised their models differently start from the same point. Mutates the parameters."""
        data = [p.param.detach() for p in self.params]
        got = prim.raw_broadcast(
            prim.Env(self.env.group, self.env.timeout), data, pytree.tree_flatten(data)[1], source, "broadcast"
        )
        with torch.no_grad():
            for p, g in zip(self.params, got, strict=True):
                p.param.copy_(g)

    # --- the template method ----------------------------------------------------------------------------------
    def aggregate(self) -> None:
        """Replace every parameter's gradient by its sum (op="sum") or mean (op="mean") over replicas.
        Parameters without a gradient are skipped (they must lack it on every replica)."""
        groups: dict[int, tuple[Placement, list[NamedParam]]] = {}
        for p in self.params:
            if p.param.grad is None:
                continue
            pl = self.plan[p.name]
            groups.setdefault(id(pl), (pl, []))[1].append(p)
        for pl, members in groups.values():
            pl.aggregate(members, self.env)
        if self.op == "mean" and self.env.num_replicas > 1:
            for p in self.params:
                if p.param.grad is not None:
                    p.param.grad = p.param.grad / self.env.num_replicas

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
