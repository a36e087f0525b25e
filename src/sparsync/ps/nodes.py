"""Parameter servers per node, started by the training job itself: under torchrun (or
``sparsync.launch``) every rank calls ``node_servers()``; the first rank of each node starts that node's servers,
bound to the node's address, and every rank learns every address.

- The node of a rank is torchrun's ``GROUP_RANK`` (``sparsync.launch(procs_per_host=)`` sets it too); without
  it every rank is on one node. The starter is the lowest rank of its node (torchrun's local rank 0).
- Authentication (CURVE): each rank keeps its own client keypair (``wire.run_client_keys``: the
  one in the environment, else a fresh one) and sends only the public key; each server admits exactly the
  job's ranks. Public keys and server addresses (which carry the servers' public keys) are exchanged over the
  job's torch.distributed group; secrets never leave their process.
- A server dies with the rank that started it (``ServerConfig.parent_pid``): when torchrun restarts the group,
  the new starters start new servers, which resume from ``checkpoint_dir`` (server ids are stable: node ·
  ``per_node`` + i), on new ports, whose addresses are exchanged again.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch.distributed as dist

from sparsync.ps import wire
from sparsync.ps.machine import default_max_total_bytes
from sparsync.ps.process import ServerProcess
from sparsync.ps.server import ServerConfig
from sparsync.ps.wire import CurveKeys

NODE_ADDR_ENV = "SPARSYNC_NODE_ADDR"  # this node's address for its servers, where the route guess is wrong


def node_address() -> str:
    """The address this node's servers bind to: ``SPARSYNC_NODE_ADDR`` if set; else the local address of the
    route to torchrun's ``MASTER_ADDR`` (the interface the job's own traffic leaves by; a UDP connect sends
    nothing); else loopback."""
    given = os.environ.get(NODE_ADDR_ENV)
    if given:
        return given
    master = os.environ.get("MASTER_ADDR")
    if not master:
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))
            return str(s.getsockname()[0])
    except (OSError, ValueError) as e:
        raise RuntimeError(
            f"cannot find this node's address on the route to MASTER_ADDR={master!r} ({e}); set {NODE_ADDR_ENV}"
        ) from None


@dataclass
class NodeServers:
    """Every node's servers, as seen by one rank. ``addresses``: all of them, node by node (pass to
    ``HybridTrainer``/``PSClient``); ``keys``: this rank's client keypair (None without auth); ``local``: the
    servers this rank started (its node's, on the node's first rank; else empty). ``stop()`` is collective."""

    addresses: list[str]
    keys: CurveKeys | None
    node: int
    nodes: int
    local: list[ServerProcess] = field(default_factory=list)
    group: dist.ProcessGroup | None = None

    def stop(self, *, wait: bool = True) -> None:
        """Stop this node's servers once every rank is done with them (``wait``: a barrier first; False when
        leaving on an error, where other ranks may never arrive)."""
        try:
            if wait and dist.is_initialized() and dist.get_world_size(self.group) > 1:
                dist.barrier(group=self.group)
        finally:
            for sp in self.local:
                sp.stop()

    def __enter__(self) -> NodeServers:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop(wait=kind is None)


def node_servers(
    per_node: int = 1,
    *,
    group: dist.ProcessGroup | None = None,
    host: str | None = None,
    auth: bool = True,
    timeout: float = 60.0,
    **server_fields: Any,
) -> NodeServers:
    """Start ``per_node`` parameter servers on each node and return every address. Collective over ``group``
    (default: the default group): every rank calls it at the same point.

    ``host``: the address to bind (default ``node_address()``); ``auth``: CURVE, admitting the job's ranks
    only; ``server_fields``: any other ``ServerConfig`` field (``checkpoint_dir``, limits; ``max_total_bytes``
    by default half the node's available memory, split between its servers). A server that fails to start
    raises ``RuntimeError`` on every rank, naming the node.

    Example (under torchrun, or ``sparsync.launch``)::

        with node_servers(checkpoint_dir="ckpt") as servers:
            trainer = HybridTrainer(model, servers.addresses, cfg)
    """
    _check_fields(per_node, server_fields)
    rank = dist.get_rank()
    node = int(os.environ.get("GROUP_RANK", "0"))
    keys = wire.run_client_keys() if auth else None
    peers = _allgather((rank, node, None if keys is None else keys.public), group)
    nodes = sorted({n for _, n, _ in peers})
    starter = min(r for r, n, _ in peers if n == node)
    local: list[ServerProcess] = []
    started: tuple[int, list[str], str | None] = (node, [], None)
    if rank == starter:
        admitted = [k for _, _, k in peers if k is not None]
        local, error = _start_node(node, per_node, host, auth, keys, admitted, timeout, server_fields)
        started = (node, [sp.address or "" for sp in local], error)
    everyone = _allgather(started, group)
    failed = [(n, err) for n, _, err in everyone if err is not None]
    if failed:
        for sp in local:
            sp.kill()
        raise RuntimeError(f"parameter servers failed to start on node(s): {dict(failed)}")
    by_node = {n: addrs for n, addrs, _ in everyone if addrs}
    addresses = [a for n in nodes for a in by_node[n]]
    return NodeServers(addresses, keys, nodes.index(node), len(nodes), local, group)


def _check_fields(per_node: int, server_fields: dict[str, Any]) -> None:
    """``node_servers``' checks of its settings, on every rank before anything starts."""
    if per_node < 1:
        raise ValueError(f"per_node must be >= 1, got {per_node}")
    bad = sorted(set(server_fields) & {"server_id", "host", "auth", "parent_pid"})
    if bad:
        raise ValueError(f"node_servers sets {bad} itself")
    ServerConfig(**server_fields)  # bad settings fail here, on every rank, before anything starts


def _allgather(mine: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's ``mine`` (picklable), in rank order."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, mine, group=group)
    return out


def _start_node(
    node: int,
    per_node: int,
    host: str | None,
    auth: bool,
    keys: CurveKeys | None,
    admitted: list[str],
    timeout: float,
    server_fields: dict[str, Any],
) -> tuple[list[ServerProcess], str | None]:
    """This node's ``per_node`` servers, started by its first rank, admitting the ``admitted`` public keys; or
    none and why: a failure is returned, not raised, since every rank must learn it, or the others wait in
    ``node_servers``' exchange."""
    local: list[ServerProcess] = []
    try:
        bind = host or node_address()
        # the node's servers share its memory (measured here, on the node, not on every rank)
        limits = {"max_total_bytes": default_max_total_bytes(per_node), **server_fields}
        for i in range(per_node):
            cfg = ServerConfig(server_id=node * per_node + i, host=bind, auth=auth, **limits)
            sp = ServerProcess(cfg, client_keys=keys, admit=admitted)
            local.append(sp)
            sp.start(timeout)
    except Exception as e:
        for sp in local:
            sp.kill()
        return [], f"{type(e).__name__}: {e}"
    return local, None


def procs_per_machine_from_env() -> int:
    """Ranks per machine for local aggregation (Parallax §4.3): torchrun's ``LOCAL_WORLD_SIZE``, else 1."""
    raw = os.environ.get("LOCAL_WORLD_SIZE", "1")
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE must be an integer, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE must be >= 1, got {value}")
    return value
