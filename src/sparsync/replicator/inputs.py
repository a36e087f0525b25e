"""Input replication (TF-Replicator §3.2): PER_WORKER (one pipeline per worker, split across that worker's
replicas by an ``input_split_fn``, by default along the leading batch dimension) and PER_REPLICA (each replica
builds its own pipeline from its replica id).

An ``input_fn`` returns an iterable of batches or a callable that returns one batch per call; a batch is any
nested structure of tensors. Under PER_WORKER the worker's lowest rank runs the one pipeline instance and
scatters the pieces to the processes of the worker (every logical device of a replica gets its replica's piece).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from sparsync.collectives.transport import meta_group


class InputReplication(enum.Enum):
    PER_WORKER = "per_worker"
    PER_REPLICA = "per_replica"


PER_WORKER = InputReplication.PER_WORKER
PER_REPLICA = InputReplication.PER_REPLICA

SplitFn = Callable[[Any, int], list[Any]]


def split_batch(batch: Any, n: int) -> list[Any]:
    """The default ``input_split_fn``: every tensor of ``batch`` cut into ``n`` equal parts along dim 0."""
    leaves, spec = pytree.tree_flatten(batch)
    parts: list[list[Any]] = [[] for _ in range(n)]
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
            raise ValueError(f"cannot split leaf {i} of the batch along its batch dimension: {leaf!r:.60}")
        if leaf.shape[0] % n:
            raise ValueError(
                f"batch dimension {leaf.shape[0]} of leaf {i} is not divisible by the {n} replicas of this worker"
            )
        for r, chunk in enumerate(torch.chunk(leaf, n, dim=0)):
            parts[r].append(chunk)
    return [pytree.tree_unflatten(p, spec) for p in parts]


def per_replica_batch_size(global_batch: int, num_replicas: int) -> int:
    if not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global batch size must be a positive int, got {global_batch!r}")
    if global_batch % num_replicas:
        raise ValueError(
            f"global batch size {global_batch} is not divisible by num_replicas={num_replicas} "
            f"(nearest divisible: {global_batch - global_batch % num_replicas} or "
            f"{global_batch + num_replicas - global_batch % num_replicas})"
        )
    return global_batch // num_replicas


def iterate(source: Any) -> Iterator[Any]:
    """An input_fn's result as an iterator: iterables are iterated, callables called once per batch."""
    if hasattr(source, "__iter__"):
        yield from source
        return
    if callable(source):
        while True:
            yield source()
    raise TypeError(f"input_fn must return an iterable or a callable, got {type(source).__name__}")


def per_worker(
    input_fn: Callable[[int], Any],
    split_fn: SplitFn,
    *,
    worker_id: int,
    group: dist.ProcessGroup,
    slot: list[int],
) -> Iterator[Any]:
    """Batches for this process: the worker's leader (group rank 0) runs ``input_fn(worker_id)``, splits each
    batch into ``max(slot) + 1`` pieces and scatters piece ``slot[i]`` to group rank i."""
    me = dist.get_rank(group)
    n = max(slot) + 1
    it = iterate(input_fn(worker_id)) if me == 0 else None
    while True:
        send: list[Any] | None = None
        error: Exception | None = None
        if it is not None:
            try:
                pieces = split_fn(next(it), n)
                if len(pieces) != n:
                    raise ValueError(f"input_split_fn returned {len(pieces)} pieces for {n} replicas")
                send = [("batch", pieces[slot[i]]) for i in range(len(slot))]
            except StopIteration:
                send = [("end", None)] * len(slot)
            except Exception as e:  # the other processes learn of it too, instead of waiting for a batch
                error = e
                send = [("error", f"{type(e).__name__}: {e}")] * len(slot)
        out: list[Any] = [None]
        # host objects: on the group's host side (its gloo part; NCCL takes no objects on the payload path)
        dist.scatter_object_list(out, send, group=meta_group(group), group_src=0)
        kind, payload = out[0]
        if error is not None:
            raise error
        if kind == "error":
            raise ValueError(f"the worker's input pipeline failed on its leader: {payload}")
        if kind == "end":
            return
        yield payload
