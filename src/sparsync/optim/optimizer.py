"""``DistributedOptimizer``: drop sparsync into an existing training script in two lines.

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = sparsync.DistributedOptimizer(opt, model)        # after dist.init_process_group(...)

It is a ``torch.optim.Optimizer`` (LR schedulers, ``state_dict``, hooks and ``isinstance`` checks work) that
shares the wrapped optimizer's ``param_groups`` and ``state``, and replaces every gradient by its mean (or sum)
over the ranks of the group by a per-parameter plan of ``sparsync.placement`` placements (the default sends
sparse COO gradients, e.g. ``nn.Embedding(sparse=True)``'s, by the row-sparse allreduce and dense ones by a
dense allreduce). On more than one rank it reduces during backward, bucket by bucket as DDP does
(``optim.overlap``), so ``loss.backward()`` returns with reduced gradients; without overlap (one rank,
``overlap=False``, or a parameter-server placement in the plan) ``step()`` (or ``synchronize()``) reduces them
all at once by ``ReplicatedOptimizer.aggregate``. ``step()`` then steps the wrapped optimizer. The API follows
Horovod's ``DistributedOptimizer`` (``synchronize()`` for gradient clipping) without re-creating the user's
optimizer, so an optimizer built and loaded before wrapping keeps its state.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from sparsync.collectives.group import resolve_group
from sparsync.collectives.meta import NonFiniteError
from sparsync.optim.overlap import OverlapReducer
from sparsync.optim.weak import method_hook
from sparsync.placement import Placement, ReduceEnv, placement_of
from sparsync.placement.bucketing import CAP_BYTES
from sparsync.record import CommLog
from sparsync.replicator.optimizer import PlanSpec, ReplicatedOptimizer

LAYOUT_KEY = "sparsync_buckets"  # the bucket layout in a state dict


class DistributedOptimizer(torch.optim.Optimizer):
    """``optimizer`` whose gradients are reduced over ``group`` (default: the default group) before it steps.

    ``model``: names the parameters for ``plan`` and for error messages (``model.named_parameters()``).
    ``plan``: per parameter name a ``Placement`` (``DenseAllreduce``, ``SparseAllreduce``, ``Compressed``,
    ``Grouped``, ``CustomReduce``, ``ByLayout``) or a callable ``(name, param) -> Placement``; parameters it
    does not name get ``default`` (``ByLayout()``). ``op``: "mean" (DDP's convention) or "sum". ``log``: a
    ``CommLog`` that receives one record per collective (bytes, algorithm): the broadcast at construction, the
    agreement rounds (op ``record.AGREE``) and every reduction. ``sync_parameters``: broadcast
    rank 0's parameters now, as DDP does at construction. ``overlap``: reduce during backward (the default on
    more than one rank; off, or with a parameter-server placement in the plan, every gradient is reduced in
    ``step()``). ``bucket_cap_mb``: the size of a dense bucket (DDP's 25 MiB; the first is 1 MiB).
    ``check_nan``: a NaN or ±Inf that any rank contributed raises ``NonFiniteError`` (the same on every rank)
    from ``step()``, while the reduced gradients hold non-finite values on every rank, so a ``GradScaler``'s
    inf check skips that ``step()`` alike everywhere (no flag needed); False steps on the IEEE 754 sums.
    Collective: every rank wraps the same parameters in the same order.

    Mutates: the parameters' ``.grad`` at the end of each backward (or in ``step()``/``synchronize()`` without
    overlap; replaced by the aggregate), and the parameters themselves at construction when
    ``sync_parameters``.
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
        check_nan: bool = True,
        overlap: bool = True,
        bucket_cap_mb: float = CAP_BYTES / 2**20,
    ) -> None:
        _check_wrappable(optimizer)
        g = resolve_group(group)
        env = ReduceEnv(g, dist.get_world_size(g), timeout, log, check_nan)
        named = list(model.named_parameters()) if model is not None else None
        self.replicated = ReplicatedOptimizer(
            optimizer, env, op=op, named_parameters=named, plan=_with_chosen(plan, named, optimizer),
            default=default, sync_parameters=sync_parameters,
        )  # fmt: skip
        self.optimizer = optimizer
        # torch's own set-up (hook tables, step profiling) over the same group dicts, then share, not copy:
        # an LR scheduler's change to param_groups[i]["lr"] is the wrapped optimizer's.
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self._synchronized = False
        self._nonfinite: NonFiniteError | None = None  # without overlap: synchronize()'s, for step()
        self._reducer = self._overlap_reducer(overlap, env, bucket_cap_mb)
        if self._reducer is None:  # else the reducer's hooks call _accumulated first
            self._hook_accumulation(optimizer)
        self._max_norm_modules = _max_norm_embeddings(model)

    def _hook_accumulation(self, optimizer: torch.optim.Optimizer) -> None:
        """Gradient accumulation: autograd adds a sparse gradient to ``.grad`` by concatenating indices, so k
        micro-batches hold k copies of a hot row. Coalescing after each one keeps one row per index
        (docs/optimizer.md measures peak memory against torch's accumulation). Without a reducer only: the
        reducer's hook calls ``_accumulated`` first, so a bucket starts from the coalesced gradient."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(method_hook(self._accumulated))  # optim.weak

    def _overlap_reducer(self, overlap: bool, env: ReduceEnv, bucket_cap_mb: float) -> OverlapReducer | None:
        """The reducer that reduces during backward, or None: off, on one rank, or with a placement in the plan
        that cannot overlap (a parameter server's)."""
        if not (overlap and env.num_replicas > 1 and all(pl.overlaps for pl in self.replicated.plan.values())):
            return None
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        return OverlapReducer(
            self.replicated, cap_bytes=max(1, int(bucket_cap_mb * 2**20)), on_accumulate=self._accumulated
        )

    def _accumulated(self, p: torch.Tensor) -> None:
        """After autograd accumulated into ``p.grad``: a new local gradient, which the next ``step()`` (or
        ``clip_grad_norm_``) must aggregate even if ``synchronize()`` ran for the last one (a step a
        ``GradScaler`` skipped never reached ``step()``)."""
        self._synchronized = False
        _coalesce_grad(p)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's ``no_sync()`` for gradient accumulation: backward passes inside it accumulate locally; the
        next backward outside it (or ``step()``) reduces the accumulated gradients. Without it, every backward
        reduces (the results add up, as under DDP)."""
        r = self._reducer
        if r is None:
            yield
            return
        before, r.syncing = r.syncing, False
        try:
            yield
        finally:
            r.syncing = before

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over every parameter's *aggregated* gradient, sparse ones
        included (torch's raises for sparse gradients): aggregates first unless ``synchronize()`` did, then one
        norm for the whole set (a coalesced row counted once), the same on every rank: the replicated
        parameters' gradients are, and a sharded table's rows (each rank holds its own) count with every
        rank's rows, combined over the group (collective then).
        Returns the total norm, as torch's does. Mutates the gradients (scaled by ``max_norm / norm`` when the
        norm exceeds it)."""
        if not self._synchronized:
            self.synchronize()
        params = self._params_with_grad()
        grads = [p.grad for p in params if p.grad is not None]
        own = [not (pl.replicated if (pl := placement_of(p)) is not None else True) for p in params]
        group = self.replicated.env.group if any(own) else None
        return clip_grad_norm(grads, params, max_norm, norm_type, error_if_nonfinite, own=own, group=group)

    def clip_grad_value_(self, clip_value: float) -> None:
        """``torch.nn.utils.clip_grad_value_`` over the aggregated gradients, sparse ones included: every value
        clamped to [-clip_value, clip_value]. Aggregates first unless ``synchronize()`` did."""
        if not self._synchronized:
            self.synchronize()
        for p in self._params_with_grad():
            g = p.grad
            assert g is not None
            if g.is_sparse:
                g = g.coalesce()
                p.grad = torch.sparse_coo_tensor(
                    g.indices(), g.values().clamp(-clip_value, clip_value), g.shape, is_coalesced=True
                )
            else:
                g.clamp_(-clip_value, clip_value)

    def _params_with_grad(self) -> list[torch.nn.Parameter]:
        return [p for g in self.param_groups for p in g["params"] if p.grad is not None]

    def synchronize(self) -> None:
        """Make sure the gradients are aggregated (e.g. to clip them before ``step()``): with overlap, backward
        did it and this waits for nothing, unless this rank ran no backward since the last step (then it
        reduces what its gradients hold, as the others' backward did); without, it aggregates now. The next
        ``step()`` does not aggregate again. Collective."""
        if self._reducer is not None:
            self._reducer.finish()
        else:
            nonfinite = self.replicated.aggregate_deferred()[1]
            self._nonfinite = self._nonfinite or nonfinite
        self._synchronized = True

    def _raise_nonfinite(self) -> None:
        """Raise the NaN or ±Inf error of the gradients about to be stepped, if they still hold it. A round that
        refused a non-finite value leaves NaN or ±Inf in the reduced gradients on every rank and keeps its error
        for here; a ``GradScaler`` that saw them skipped ``step()``, and gradients computed since (finite) mean
        that the error belongs to that skipped step. The same decision on every rank: the gradients are."""
        pending = self._nonfinite or (self._reducer.nonfinite if self._reducer is not None else None)
        self._nonfinite = None
        if self._reducer is not None:
            self._reducer.nonfinite = None
        if pending is None:
            return
        for p in self._params_with_grad():
            g = p.grad
            assert g is not None
            values = g.coalesce().values() if g.is_sparse else g
            if not bool(torch.isfinite(values).all()):
                raise pending

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Aggregate (unless ``synchronize()`` already did), then step the wrapped optimizer. A ``closure``
        is evaluated once, before the aggregation (optimizers that re-evaluate it, like LBFGS, would see
        local gradients: not supported)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._synchronized:
            self.synchronize()
        self._synchronized = False
        if self._reducer is not None:
            self._reducer.stepped()
        self._raise_nonfinite()
        self._renorm_union()
        self.optimizer.step()
        return loss

    def _renorm_union(self) -> None:
        """``nn.Embedding(max_norm=...)`` renormalises, in its forward, the rows its batch looks up: on each rank
        only its own batch's rows, so the ranks' copies differ where a single process (one forward over every
        batch) would have renormalised them all. The aggregated COO gradient holds every row any rank looked up
        (``allreduce``'s union of rows): renormalising those rows here, before the step, gives every rank the
        single process's weights (renormalising a row twice changes nothing)."""
        for module in self._max_norm_modules:
            g = module.weight.grad
            if g is None or not g.is_sparse or module.max_norm is None:
                continue  # a dense gradient does not say which rows were looked up
            rows = g.coalesce().indices()[0]
            with torch.no_grad():
                torch.embedding_renorm_(module.weight, rows, module.max_norm, module.norm_type)

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
        """The wrapped optimizer's state dict, plus the agreed bucket layout under ``LAYOUT_KEY`` (so a resumed
        run reduces in the same buckets, bit for bit; a plain torch optimizer ignores the key)."""
        out = self.optimizer.state_dict()
        layout = self._reducer.layout_state() if self._reducer is not None else None
        return out if layout is None else {**out, LAYOUT_KEY: layout}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        layout = state_dict.get(LAYOUT_KEY)
        self.optimizer.load_state_dict({k: v for k, v in state_dict.items() if k != LAYOUT_KEY})
        if layout is not None and self._reducer is not None:
            self._reducer.load_layout(layout)
        # torch's load replaces the wrapped optimizer's group dicts and state: share the new ones
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r})"


def _check_wrappable(optimizer: torch.optim.Optimizer) -> None:
    """Raise unless ``optimizer`` is a plain torch optimizer and torch.distributed is initialized."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, DistributedOptimizer):
        raise ValueError("this optimizer is already a DistributedOptimizer: wrapping twice would sum twice")
    if not dist.is_initialized():
        raise RuntimeError(
            "DistributedOptimizer needs torch.distributed: call dist.init_process_group first "
            "(or run under sparsync.launch / torchrun)"
        )


def _with_chosen(
    plan: PlanSpec, named: list[tuple[str, torch.nn.Parameter]] | None, optimizer: torch.optim.Optimizer
) -> PlanSpec:
    """``plan`` with the placements that parameters' modules chose (sparsync.shard's shards) for the parameters
    ``optimizer`` holds (a table whose optimizer runs in its backward is not among them): each keeps its own
    unless ``plan`` names it."""
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    chosen = {n: pl for n, p in named or () if id(p) in held and (pl := placement_of(p)) is not None}
    if chosen and (plan is None or isinstance(plan, Mapping)):
        return {**chosen, **(plan or {})}
    if chosen and callable(plan):
        given = plan
        return lambda n, p: chosen.get(n) or given(n, p)
    return plan


def _max_norm_embeddings(model: torch.nn.Module | None) -> list[torch.nn.Embedding | torch.nn.EmbeddingBag]:
    """``model``'s embeddings that renormalise looked-up rows (``max_norm`` set): ``step()`` renormalises
    every rank's rows (``_renorm_union``)."""
    return [
        m
        for m in (model.modules() if model is not None else ())
        if isinstance(m, torch.nn.Embedding | torch.nn.EmbeddingBag) and m.max_norm is not None
    ]


def _coalesce_grad(p: torch.Tensor) -> None:
    g = p.grad
    if g is not None and g.is_sparse and not g.is_coalesced():
        p.grad = g.coalesce()


def clip_grad_norm(
    grads: list[torch.Tensor],
    params: list[torch.nn.Parameter],
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
    *,
    own: Sequence[bool] = (),
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """torch's ``clip_grad_norm_`` semantics (the total norm of the per-tensor norms; coefficient
    ``max_norm / (norm + 1e-6)`` clamped to 1) over dense and sparse gradients: a sparse one contributes the
    norm of its coalesced values. ``own``: per gradient, whether it holds only this rank's part of a parameter
    (a sharded table's rows); their norms are combined over ``group`` (a sum of p-th powers, or a max for the
    infinity norm: collective), so every rank gets the norm of the whole set. Mutates ``p.grad`` of
    ``params``."""
    if not grads:
        return torch.tensor(0.0)
    norm_type = float(norm_type)
    values = [g.coalesce().values() if g.is_sparse else g for g in grads]
    per = [torch.linalg.vector_norm(v.detach(), norm_type) for v in values]
    devices = {t.device for t in per}
    if len(devices) > 1:
        raise ValueError(f"gradients on several devices {sorted(map(str, devices))}: clip each device's apart")
    if group is not None and any(own):
        per = [n for n, o in zip(per, own, strict=True) if not o] + [_group_norm(per, own, norm_type, group)]
    total: torch.Tensor = torch.linalg.vector_norm(torch.stack(per), norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite ({float(total)}), so it cannot "
            "be clipped (error_if_nonfinite=False lets it through)"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        g = p.grad
        assert g is not None
        if g.is_sparse:
            g = g.coalesce()
            p.grad = torch.sparse_coo_tensor(
                g.indices(), g.values() * coef.to(g.dtype), g.shape, is_coalesced=True
            )
        else:
            g.mul_(coef.to(g.dtype))
    return total


def _group_norm(
    per: list[torch.Tensor], own: Sequence[bool], norm_type: float, group: dist.ProcessGroup
) -> torch.Tensor:
    """The norm of order ``norm_type`` of every rank's ``own`` parts together, from this rank's per-tensor
    norms ``per``: the p-th powers summed over the group (the largest, for the infinity norm), in float64.
    Collective over ``group``."""
    mine = torch.stack([n.double() for n, o in zip(per, own, strict=True) if o])
    if math.isinf(norm_type):
        part = mine.max() if norm_type > 0 else mine.min()
        dist.all_reduce(part, op=dist.ReduceOp.MAX if norm_type > 0 else dist.ReduceOp.MIN, group=group)
        return part.to(per[0].dtype)
    part = (mine**norm_type).sum()
    dist.all_reduce(part, group=group)
    return (part ** (1.0 / norm_type)).to(per[0].dtype)
