"""The Replicator API (TF-Replicator §3 in PyTorch idiom): a replica program runs unchanged as one process, as
N local processes or under torchrun; cross-replica primitives; ``wrap_optimizer`` with a per-parameter plan;
logical devices for model parallelism with DCT-MP at each split (DCT §2.2)."""

from sparsync.placement import (
    ByLayout,
    Compressed,
    CustomReduce,
    DenseAllreduce,
    Grouped,
    NamedParam,
    Placement,
    ReduceEnv,
    Sketch,
    SparseAllreduce,
)
from sparsync.replicator.context import ReplicaContext
from sparsync.replicator.dctmp import DCTMP
from sparsync.replicator.inputs import PER_REPLICA, PER_WORKER, InputReplication, split_batch
from sparsync.replicator.logical import Remote, SplitRecord
from sparsync.replicator.optimizer import PlanSpec, ReplicatedOptimizer
from sparsync.replicator.replicator import Replicator

__all__ = [
    "DCTMP",
    "PER_REPLICA",
    "PER_WORKER",
    "ByLayout",
    "Compressed",
    "CustomReduce",
    "DenseAllreduce",
    "Grouped",
    "InputReplication",
    "NamedParam",
    "Placement",
    "PlanSpec",
    "ReduceEnv",
    "Remote",
    "ReplicaContext",
    "ReplicatedOptimizer",
    "Replicator",
    "Sketch",
    "SparseAllreduce",
    "SplitRecord",
    "split_batch",
]
