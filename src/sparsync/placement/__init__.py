"""Placement: how each parameter's gradient is synchronised. One interface (``Placement.aggregate``: replace
the gradients by their sum over the group) with one implementation per way: ``DenseAllreduce``,
``SparseAllreduce`` (SparCML), ``Compressed`` (any compressor with error feedback, e.g. DCT-DP),
``CustomReduce``, ``Grouped``, ``ByLayout``, ``Sketch`` (S2), ``Sharded`` (rows owned by the ranks,
``sparsync.shard``), and the parameter server (``sparsync.ps.ParameterServer``, Parallax; ``OnServer`` is
``sparsync.shard``'s mark of a table for it). ``sparsync.plan`` names them by kind (``plan.registry.KINDS``) and
chooses among them; the replicator's ``wrap_optimizer``, ``DistributedOptimizer`` and ``HybridTrainer`` run
them."""

from sparsync.placement.base import NamedParam, Placement, ReduceEnv, aggregate, load_optional_state
from sparsync.placement.collective import (
    ByLayout,
    Compressed,
    CustomReduce,
    DenseAllreduce,
    Grouped,
    ReduceFn,
    SparseAllreduce,
)
from sparsync.placement.server import OnServer
from sparsync.placement.sharded import (
    Sharded,
    mark_updated_in_backward,
    placement_of,
    plan_of,
    updated_in_backward,
)
from sparsync.placement.sketch import Sketch

__all__ = [
    "ByLayout",
    "Compressed",
    "CustomReduce",
    "DenseAllreduce",
    "Grouped",
    "NamedParam",
    "OnServer",
    "Placement",
    "ReduceEnv",
    "ReduceFn",
    "Sharded",
    "Sketch",
    "SparseAllreduce",
    "aggregate",
    "load_optional_state",
    "mark_updated_in_backward",
    "placement_of",
    "plan_of",
    "updated_in_backward",
]
