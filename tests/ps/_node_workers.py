"""Workers for test_node_servers.py (module-level: ``launch`` pickles them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from sparsync.hybrid import HybridTrainer
from sparsync.ps import PSClient, PSError, PSTable, PSTimeoutError, node_servers
from sparsync.ps.wire import CurveKeys


def serve_worker(rank: int, per_node: int) -> dict[str, Any]:
    """Each node's servers serve a table every rank writes to and reads back; an impostor key is refused."""
    world = dist.get_world_size()
    with node_servers(per_node) as servers:
        client = PSClient(servers.addresses, keys=servers.keys, timeout=20.0)
        table = PSTable(client, "t", 4 * world, 3, partitions=len(servers.addresses), mode="async")
        if rank == 0:
            table.create().wait()
        dist.barrier()
        table.create().wait()
        rows = torch.arange(rank * 4, rank * 4 + 4)
        table.set(rows, torch.full((4, 3), float(rank))).wait()
        dist.barrier()
        got = table.read_all()
        refused = False
        if rank == 0:
            with PSClient(servers.addresses[-1:], keys=CurveKeys.generate(), timeout=1.0) as other:
                try:
                    PSTable(other, "t", 4 * world, 3, mode="async").create().wait()
                except (PSError, PSTimeoutError) as e:
                    refused = "CURVE handshake" in str(e)
        client.close()
        return {
            "addresses": servers.addresses, "node": servers.node, "nodes": servers.nodes,
            "started": [sp.cfg.server_id for sp in servers.local], "pids": [sp.pid for sp in servers.local],
            "table": got.numpy().tolist(), "refused": refused,
        }  # fmt: skip


def failing_worker(rank: int, ckpt: str) -> str:
    """Node 1's server finds a corrupt checkpoint and does not start: every rank must hear of it."""
    try:
        node_servers(checkpoint_dir=ckpt)
    except RuntimeError as e:
        return str(e)
    return "started"


def trainer_worker(rank: int) -> dict[str, Any]:
    """HybridTrainer's procs_per_machine from LOCAL_WORLD_SIZE; local aggregation on."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 4, sparse=True), nn.Flatten(), nn.Linear(8, 2))
    with node_servers() as servers:
        tr = HybridTrainer(model, servers.addresses)
        x = torch.randint(0, 50, (3, 2), generator=torch.Generator().manual_seed(rank))
        tr.step(lambda: model(x).square().mean())
        out = {"ppm": tr.procs_per_machine, "local_agg": tr.local_agg, "machine": tr.machine,
               "table": tr.tables["0.weight"].read_all().numpy().tolist()}  # fmt: skip
        tr.close()
    return out


def write_corrupt_checkpoint(path: Path) -> None:
    np.savez(path, junk=np.zeros(3))
