"""sparsync: send only what matters, and pick how to send it.

Layers: transport (torch.distributed) -> collectives (SparCML) -> compressors -> placement -> planning, parameter
server and sharded tables -> replicator API.
See docs/architecture.md.
"""

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
from sparsync.sharding import shard
from sparsync.stream import SparseStream, add, dense_threshold, sum_streams

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
