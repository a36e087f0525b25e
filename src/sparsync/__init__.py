"""sparsync: send only what matters, and pick how to send it.

Layers: transport (torch.distributed) -> collectives (SparCML) -> compressors -> placement -> planning, parameter
server and sharded tables -> replicator API.
See docs/architecture.md.
"""

from typing import TYPE_CHECKING, Any

from sparsync.collectives import allreduce, grouped_allreduce, sparse_allgather, sparse_allreduce
from sparsync.collectives.background import background_group
from sparsync.collectives.calibrate import measure_link
from sparsync.collectives.comm import PeerError
from sparsync.collectives.group import set_deterministic, set_link
from sparsync.collectives.hierarchical import Topology, detect_topology, hierarchical_allreduce
from sparsync.collectives.meta import NonFiniteError
from sparsync.collectives.timeline import trace, trace_step
from sparsync.compress import Compressor, ErrorFeedback, compressed_allreduce
from sparsync.costmodel import (
    ALGORITHMS,
    REFERENCE_LINK,
    Decision,
    LinkModel,
    Problem,
    choose_fastest,
    choose_robust,
    lower_bound,
    predict,
)
from sparsync.handle import Work
from sparsync.launch import LaunchError, RankSetup, launch
from sparsync.optim import DistributedOptimizer
from sparsync.record import CommLog, CommRecord
from sparsync.stream import SparseStream, add, dense_threshold, sum_streams

if TYPE_CHECKING:
    from sparsync import sharding as sharding
    from sparsync.sharding import shard

__all__ = [
    "ALGORITHMS",
    "REFERENCE_LINK",
    "CommLog",
    "CommRecord",
    "Compressor",
    "Decision",
    "DistributedOptimizer",
    "ErrorFeedback",
    "LaunchError",
    "LinkModel",
    "NonFiniteError",
    "PeerError",
    "Problem",
    "RankSetup",
    "SparseStream",
    "Topology",
    "Work",
    "add",
    "allreduce",
    "background_group",
    "choose_fastest",
    "choose_robust",
    "compressed_allreduce",
    "dense_threshold",
    "detect_topology",
    "grouped_allreduce",
    "hierarchical_allreduce",
    "launch",
    "lower_bound",
    "measure_link",
    "predict",
    "set_deterministic",
    "set_link",
    "shard",
    "sparse_allgather",
    "sparse_allreduce",
    "sum_streams",
    "trace",
    "trace_step",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``sparsync.shard`` and ``sparsync.sharding``, imported at their first use: the sharded tables' modules
    import ``torch._dynamo`` (their ``torch.compiler.disable``), about 1 s of the 1.5 s ``import sparsync`` took,
    which a script that shards nothing need not pay (each README block, torchrun rank and server process did)."""
    if name in ("shard", "sharding"):
        import sparsync.sharding

        return sparsync.sharding if name == "sharding" else sparsync.sharding.shard
    raise AttributeError(f"module 'sparsync' has no attribute {name!r}")
