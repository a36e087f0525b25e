"""Placement: where each parameter is synchronised (Parallax): dense allreduce, sparse allreduce, sketch, or
a parameter server; the parameter server itself (``PSTable`` over ``PSClient``, server processes); the plan;
the partition search; and a hybrid training loop."""

from sparsync.placement.client import PSClient, PSError, PSTimeoutError
from sparsync.placement.nodes import NodeServers, node_servers
from sparsync.placement.optim import OptimizerConfig
from sparsync.placement.process import ServerProcess, start_servers
from sparsync.placement.server import ServerConfig
from sparsync.placement.table import PSTable, save_servers, server_stats
from sparsync.placement.wire import CurveKeys, WireError

__all__ = [
    "CurveKeys",
    "NodeServers",
    "OptimizerConfig",
    "PSClient",
    "PSError",
    "PSTable",
    "PSTimeoutError",
    "ServerConfig",
    "ServerProcess",
    "WireError",
    "node_servers",
    "save_servers",
    "server_stats",
    "start_servers",
]
