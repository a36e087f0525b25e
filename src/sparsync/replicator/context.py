"""``ReplicaContext``: what a replica's code sees (TF-Replicator §3.2-3.4) — its id, the cross-replica
primitives on nested structures, its input, ``run(step_fn, batch)``, ``wrap_optimizer`` and its logical
devices."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import InitVar, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from sparsync.collectives.allreduce import refuse
from sparsync.placement import Placement, ReduceEnv
from sparsync.record import CommLog
from sparsync.replicator import primitives as prim
from sparsync.replicator.dctmp import DCTMP
from sparsync.replicator.inputs import (
    PER_WORKER,
    InputReplication,
    SplitFn,
    iterate,
    per_replica_batch_size,
    per_worker,
)
from sparsync.replicator.logical import LogicalDevices, Remote, SplitRecord
from sparsync.replicator.optimizer import PlanSpec, ReplicatedOptimizer

OUTPUTS = ("local", "gather", "mean", "sum")


@dataclass(eq=False, kw_only=True)
class ReplicaContext:
    """One process's view of its replica. Primitives are collective over the replicas (every replica calls
    them in the same order); with ``devices_per_replica > 1`` each logical device reduces the values it owns
    with the same device of the other replicas, and leaves that live elsewhere (``Remote``) pass through.
    ``build_context`` (``replicator.py``) makes it from the process grid."""

    replica_id: int
    num_replicas: int
    device_id: int
    devices_per_replica: int
    dp_group: dist.ProcessGroup
    mp_group: dist.ProcessGroup | None
    worker_id: int
    worker_group: dist.ProcessGroup = field(repr=False)  # this worker's processes: PER_WORKER inputs
    worker_slots: list[int] = field(repr=False)  # each of them: its replica's slot among the worker's replicas
    input_replication: InputReplication
    input_split_fn: SplitFn
    split_compression: InitVar[DCTMP | None]
    timeout: float | None
    record: InitVar[bool] = False
    # With record=True: a CommRecord of every primitive and gradient reduction of this process (bytes, time,
    # algorithm) and a SplitRecord of every transfer across a split. Off by default: both lists grow by a few
    # entries per step. Per-split byte totals (``split_bytes``) are always kept.
    log: CommLog | None = field(init=False, repr=False)
    devices: LogicalDevices = field(init=False, repr=False)

    def __post_init__(self, split_compression: DCTMP | None, record: bool) -> None:
        self.log = CommLog() if record else None
        self.devices = LogicalDevices(
            self.mp_group, self.device_id, self.devices_per_replica, self.timeout, split_compression, record
        )

    @property
    def _env(self) -> prim.Env:
        return prim.Env(self.dp_group, self.timeout, self.log)

    # --- primitives (TF-Replicator §3.4) ----------------------------------------------------------------------
    def _apply(
        self,
        value: Any,
        fn: Callable[[list[torch.Tensor], pytree.TreeSpec], list[Any]],
        name: str,
        check: Callable[[list[torch.Tensor]], None] = lambda t: None,
    ) -> Any:
        try:
            leaves, spec = prim.flatten(value, skip=Remote)
            pos = [i for i, x in enumerate(leaves) if not isinstance(x, Remote)]
            check([leaves[i] for i in pos])
        except (TypeError, ValueError) as e:  # every replica raises it, not only this one
            refuse(self.dp_group, name, e, self.timeout)
        if pos:
            tensors = [leaves[i] for i in pos]
            out = fn(tensors, spec)
            for i, o in zip(pos, out, strict=True):
                leaves[i] = o
        return pytree.tree_unflatten(leaves, spec)

    def all_reduce(self, value: Any, op: str = "sum", *, check_nan: bool = True, name: str | None = None) -> Any:
        """Reduce (``sum``, ``mean``, ``max``, ``min``) every tensor of ``value`` over the replicas.
        Differentiable for sum and mean (the gradient is the all-sum of the gradients). NaN or ±Inf on any
        replica raises the same ValueError everywhere unless ``check_nan=False`` on every replica (then IEEE
        754 sums; replicas that disagree about check_nan raise). ``name``: a label every replica gives this
        call, compared across replicas, so that calls of one structure skipped or issued in another order on
        some replica raise instead of being summed with each other (every primitive takes it).

        Example::

            >>> ctx.all_reduce({"n": torch.tensor(1.0)})      # on 4 replicas
            {'n': tensor(4.)}
        """
        return self._apply(
            value,
            lambda t, s: prim.all_reduce(self._env, t, s, op, check_nan, name),
            "all_reduce",
            lambda t: prim.check_reduce(t, op),
        )

    def all_sum(self, value: Any, *, name: str | None = None) -> Any:
        return self.all_reduce(value, "sum", name=name)

    def all_mean(self, value: Any, *, name: str | None = None) -> Any:
        return self.all_reduce(value, "mean", name=name)

    def all_gather(self, value: Any, *, name: str | None = None) -> Any:
        """Every replica's ``value``, each tensor stacked along a new leading ``num_replicas`` dimension."""
        return self._apply(value, lambda t, s: prim.all_gather(self._env, t, s, name), "all_gather")

    def broadcast(self, value: Any, source: int, *, name: str | None = None) -> Any:
        """Replica ``source``'s ``value`` on every replica (same structure and shapes everywhere)."""

        def check(_: list[torch.Tensor]) -> None:
            if not (isinstance(source, int) and 0 <= source < self.num_replicas):
                raise ValueError(f"unknown replica id {source!r}; valid: 0..{self.num_replicas - 1}")

        return self._apply(value, lambda t, s: prim.broadcast(self._env, t, s, source, name), "broadcast", check)

    def map_reduce(self, fn: Callable[[Any], Any], value: Any, op: str = "sum", *, name: str | None = None) -> Any:
        """reduce over replicas r of ``fn(value_r)``: each replica maps its own value, one collective reduces."""
        return self.all_reduce(fn(value), op, name=name)

    def map_gather(self, fn: Callable[[Any], Any], value: Any, *, name: str | None = None) -> Any:
        """[fn(value_0), ..., fn(value_{R-1})] stacked along a leading ``num_replicas`` dimension."""
        return self.all_gather(fn(value), name=name)

    # --- input (§3.2) -----------------------------------------------------------------------------------------
    def per_replica_batch_size(self, global_batch: int) -> int:
        return per_replica_batch_size(global_batch, self.num_replicas)

    def input(self, input_fn: Callable[[int], Any], replication: InputReplication | None = None) -> Iterator[Any]:
        """This replica's batches. PER_REPLICA: ``input_fn(replica_id)``; PER_WORKER: ``input_fn(worker_id)``
        run once per worker and split across the worker's replicas by ``input_split_fn``. ``replication``
        overrides the replicator's ``input_replication`` for this pipeline."""
        if replication is not None and not isinstance(replication, InputReplication):
            raise ValueError(f"replication must be PER_WORKER or PER_REPLICA, got {replication!r}")
        if (replication or self.input_replication) is PER_WORKER:
            return per_worker(
                input_fn,
                self.input_split_fn,
                worker_id=self.worker_id,
                group=self.worker_group,
                slot=self.worker_slots,
            )
        return iterate(input_fn(self.replica_id))

    # --- steps ------------------------------------------------------------------------------------------------
    def run(self, step_fn: Callable[[Any], Any], batch: Any, *, outputs: str = "local") -> Any:
        """Run one step of this replica; returns its outputs detached, with values that live on another logical
        device fetched here. ``outputs``: "local" (this replica's), "gather" (every replica's, stacked along a
        leading ``num_replicas`` dimension), "mean" or "sum" (reduced over replicas)."""
        if outputs not in OUTPUTS:
            raise ValueError(f"outputs must be one of {OUTPUTS}, got {outputs!r}")
        out = self.fetch(step_fn(batch))
        with torch.no_grad():
            if outputs == "gather":
                return self.all_gather(out)
            if outputs in ("mean", "sum"):
                return self.all_reduce(out, outputs)
        return out

    def wrap_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        op: str,
        model: torch.nn.Module | None = None,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
        plan: PlanSpec = None,
        default: Placement | None = None,
        sync_parameters: bool = True,
    ) -> ReplicatedOptimizer:
        """``optimizer`` whose ``step()`` first replaces gradients by their ``op`` ("mean" or "sum") over
        replicas, each parameter by its plan entry (default: sparse gradients by SparCML sparse allreduce,
        dense ones by one bucketed dense allreduce). Names come from ``model.named_parameters()``.
        ``sync_parameters``: first copy replica 0's parameter values to every replica (collective)."""
        if model is not None and named_parameters is not None:
            raise ValueError("pass model or named_parameters, not both")
        named = list(model.named_parameters()) if model is not None else named_parameters
        env = ReduceEnv(self.dp_group, self.num_replicas, self.timeout, self.log)
        return ReplicatedOptimizer(
            optimizer,
            env,
            op=op,
            named_parameters=named,
            plan=plan,
            default=default,
            sync_parameters=sync_parameters,
        )

    # --- logical devices (§3.3) -------------------------------------------------------------------------------
    def on_device(
        self,
        device: int,
        fn: Callable[..., Any],
        *args: Any,
        compression: DCTMP | None = None,
        name: str | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run ``fn(*args, **kwargs)`` on logical ``device`` of this replica; elsewhere return a ``Remote``.
        Argument tensors living on another device are sent there (gradients come back in backward), compressed
        by ``compression`` (DCT-MP) or the replicator's ``split_compression``; ``name`` labels the split in
        ``split_records``."""
        if self.devices_per_replica == 1:
            self.devices.check_device(device)
            return fn(*args, **kwargs)
        return self.devices.on_device(device, fn, args, kwargs, compression, name)

    def fetch(self, value: Any) -> Any:
        """``value`` with every leaf that lives on another logical device copied here (detached)."""
        if self.devices_per_replica == 1:
            return pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, value)
        leaves, spec = pytree.tree_flatten(value, is_leaf=lambda x: isinstance(x, Remote))
        return pytree.tree_unflatten([self.devices.fetch_leaf(x) for x in leaves], spec)

    @property
    def split_records(self) -> list[SplitRecord]:
        """Every transfer this process sent across a model split (forward activations, backward gradients);
        empty unless the replicator was made with ``record=True``."""
        return self.devices.records

    def split_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes this process sent per split name and direction, headers included (always counted)."""
        return {name: dict(d) for name, d in self.devices.totals.items()}
