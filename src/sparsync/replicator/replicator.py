"""``Replicator``: run one replica program on every process, as one process, as N local processes
(``sparsync.launch``) or inside torchrun's group, chosen by the constructor or the environment.

The world is a grid (TF-Replicator §3.3): ``num_replicas`` data-parallel replicas x ``devices_per_replica``
logical devices. Global rank = replica * devices_per_replica + device. Process groups: one data-parallel group per
device index (the same device of every replica: gradients and primitives), one model-parallel group per replica
(its logical devices: activations across splits), one group per worker (machine: PER_WORKER input).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import HashStore  # type: ignore[attr-defined]  # re-exported from C++

from sparsync.collectives.fifo import stop_queues
from sparsync.launch import RankSetup, launch, under_torchrun
from sparsync.replicator.context import ReplicaContext
from sparsync.replicator.dctmp import DCTMP
from sparsync.replicator.inputs import PER_WORKER, InputReplication, SplitFn, per_replica_batch_size, split_batch

ENV_REPLICAS = "SPARSYNC_NUM_REPLICAS"


@dataclass(frozen=True)
class Replicator:
    """How to deploy a replica program (``start(fn)``, where ``fn(ctx, *args)`` runs on every process).

    Example::

        >>> def replica(ctx):
        ...     return float(ctx.all_sum(torch.tensor(1.0)))
        >>> Replicator(num_replicas=3).start(replica)      # 3 local processes
        [3.0, 3.0, 3.0]
    """

    num_replicas: int | None = (
        None  # None: $SPARSYNC_NUM_REPLICAS, or torchrun's WORLD_SIZE / devices_per_replica, else 1
    )
    devices_per_replica: int = 1  # logical devices (processes) per replica, for model parallelism
    input_replication: InputReplication = PER_WORKER  # one pipeline per worker, or one per replica
    input_split_fn: SplitFn = split_batch  # PER_WORKER: (batch, n) -> n pieces; module-level (it is pickled)
    split_compression: DCTMP | None = None  # default compression of tensors crossing logical devices
    backend: str = "gloo"
    timeout: float = 120.0  # seconds any collective or transfer may wait for a peer
    record: bool = False  # keep a record of every collective (ctx.log) and split transfer (ctx.split_records)

    def __post_init__(self) -> None:
        if self.num_replicas is not None and (not isinstance(self.num_replicas, int) or self.num_replicas < 1):
            raise ValueError(f"num_replicas must be a positive int, got {self.num_replicas!r}")
        if not isinstance(self.devices_per_replica, int) or self.devices_per_replica < 1:
            raise ValueError(f"devices_per_replica must be a positive int, got {self.devices_per_replica!r}")
        if not isinstance(self.input_replication, InputReplication):
            raise ValueError(
                f"input_replication must be PER_WORKER or PER_REPLICA, got {self.input_replication!r}"
            )
        if self.timeout <= 0:
            raise ValueError(f"timeout must be positive, got {self.timeout}")

    def resolved_replicas(self) -> int:
        if self.num_replicas is not None:
            return self.num_replicas
        if ENV_REPLICAS in os.environ:
            try:
                n = int(os.environ[ENV_REPLICAS])
            except ValueError:
                raise ValueError(f"${ENV_REPLICAS} must be an int, got {os.environ[ENV_REPLICAS]!r}") from None
            if n < 1:
                raise ValueError(f"${ENV_REPLICAS} must be >= 1, got {n}")
            return n
        if under_torchrun():
            world = int(os.environ["WORLD_SIZE"])
            if world % self.devices_per_replica:
                raise ValueError(
                    f"torchrun's WORLD_SIZE={world} is not a multiple of "
                    f"devices_per_replica={self.devices_per_replica}"
                )
            return world // self.devices_per_replica
        return 1

    def per_replica_batch_size(self, global_batch: int) -> int:
        """``global_batch / num_replicas``; ValueError when it does not divide."""
        return per_replica_batch_size(global_batch, self.resolved_replicas())

    def start(self, fn: Callable[..., Any], *args: Any, setup: RankSetup | None = None) -> list[Any]:
        """Run ``fn(ctx, *args)`` on every process; return the results by global rank (this process's only,
        under torchrun). ``fn`` must be a module-level function when processes are spawned. ``setup`` runs
        first in each local process, as ``launch``'s (e.g. entering a bandwidth-shaped network namespace)."""
        R = self.resolved_replicas()
        W = R * self.devices_per_replica
        if under_torchrun():
            world = int(os.environ["WORLD_SIZE"])
            if world != W:
                raise ValueError(
                    f"torchrun started {world} processes but the replicator needs num_replicas x "
                    f"devices_per_replica = {R} x {self.devices_per_replica} = {W}"
                )
            return launch(_entry, nprocs=W, backend=self.backend, args=(self, R, fn, args), timeout=self.timeout)
        if W == 1 and setup is None:
            return [_inline(self, fn, args)]
        return launch(
            _entry, nprocs=W, backend=self.backend, args=(self, R, fn, args), timeout=self.timeout, setup=setup
        )


def _inline(repl: Replicator, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """One process: a one-rank group in this process (no spawn), or the caller's group if it has one."""
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group(
            repl.backend, store=HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=repl.timeout)
        )
    try:
        if dist.get_world_size() != 1:
            raise ValueError(f"a process group of {dist.get_world_size()} ranks exists; the replicator needs 1")
        return _entry(0, repl, 1, fn, args)
    finally:
        if owned:
            dist.destroy_process_group()


def _new_group(made: list[dist.ProcessGroup], ranks: list[int]) -> Any:
    """``dist.new_group`` (called by every rank); a rank outside ``ranks`` gets a non-member marker."""
    g = dist.new_group(ranks)
    if isinstance(g, dist.ProcessGroup):
        made.append(g)
    return g


def _one_of(made: list[dist.ProcessGroup], groups: list[list[int]], mine: int) -> Any:
    """Create every group of ``groups`` (every rank, in the same order) and return number ``mine``."""
    return [_new_group(made, ranks) for ranks in groups][mine]


def _entry(rank: int, repl: Replicator, R: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    made: list[dist.ProcessGroup] = []
    finished = False
    try:
        out = fn(build_context(rank, repl, R, made), *args)
        finished = True
        return out
    finally:
        # Subgroups go before the default group is torn down, after fn's objects in reference cycles (autograd
        # graphs holding gloo work) and sparsync's queue threads: left to interpreter exit, they abort the
        # process ("terminate called without an active exception"), which torchrun reports.
        gc.collect()
        stop_queues(wait=finished)  # after a failure, queued work may wait on a dead peer: drop it
        for g in made:
            dist.destroy_process_group(g)


def build_context(rank: int, repl: Replicator, R: int, made: list[dist.ProcessGroup]) -> ReplicaContext:
    """Create the grid's process groups (every rank creates every group, in the same order; appended to
    ``made``) and this rank's context."""
    k = repl.devices_per_replica
    W = dist.get_world_size()
    if R * k != W:
        raise ValueError(f"world of {W} processes, but num_replicas x devices_per_replica = {R} x {k}")
    replica, device = divmod(rank, k)
    world = dist.group.WORLD
    assert isinstance(world, dist.ProcessGroup)
    # one data-parallel group per device index (that device of every replica), one model-parallel group per
    # replica (its k devices)
    dp_group = _one_of(made, [[r * k + d for r in range(R)] for d in range(k)], device) if k > 1 else world
    mp_group = _one_of(made, [[r * k + d for d in range(k)] for r in range(R)], replica) if k > 1 else None
    # Workers (machines) from torchrun's GROUP_RANK; one worker when spawned locally.
    node = int(os.environ.get("GROUP_RANK", "0")) if "GROUP_RANK" in os.environ else 0
    nodes: list[Any] = [None] * W
    if W > 1:
        dist.all_gather_object(nodes, node)
    else:
        nodes = [node]
    worker_group = world
    members = [r for r in range(W) if nodes[r] == node]
    if len(set(nodes)) > 1:
        for n in sorted(set(nodes)):
            g = _new_group(made, [r for r in range(W) if nodes[r] == n])
            if n == node:
                worker_group = g
    local_replicas = sorted({m // k for m in members})
    slots = [local_replicas.index(m // k) for m in members]
    return ReplicaContext(
        replica_id=replica,
        num_replicas=R,
        device_id=device,
        devices_per_replica=k,
        dp_group=dp_group,
        mp_group=mp_group,
        worker_id=sorted(set(nodes)).index(node),
        worker_group=worker_group,
        worker_slots=slots,
        input_replication=repl.input_replication,
        input_split_fn=repl.input_split_fn,
        split_compression=repl.split_compression,
        timeout=repl.timeout,
        record=repl.record,
    )
