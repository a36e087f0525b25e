"""The parameter server (Parallax §4.3, §5): server processes (ZeroMQ ROUTER, CURVE authentication, bounded
memory), partitions and server-side optimizers, the worker-side client and row-partitioned tables, per-node
servers, and compressed pushes with error feedback."""

from sparsync.ps.client import PSClient, PSError, PSTimeoutError
from sparsync.ps.nodes import NodeServers, node_servers
from sparsync.ps.optim import OptimizerConfig
from sparsync.ps.probe import ServerTimes, measure_server
from sparsync.ps.process import ServerProcess, start_servers
from sparsync.ps.server import ServerConfig
from sparsync.ps.table import PSTable, save_servers, server_stats
from sparsync.ps.wire import CurveKeys, WireError

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
    "ServerTimes",
    "WireError",
    "measure_server",
    "node_servers",
    "save_servers",
    "server_stats",
    "start_servers",
]
