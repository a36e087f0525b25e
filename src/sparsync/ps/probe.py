"""What a parameter-server step costs, measured: the planner's price for the ``ps`` placement when the servers
run (``plan.ServerModel``), instead of the α-β model's six latencies and bytes, which leave out the request
path (the client's thread, ZeroMQ, the server's Python loop) and the servers' CPU when they share the workers'
cores (docs/results_demo.md: the model's price was an order of magnitude low on loopback).

Every rank of ``group`` pulls at once, as a sync step does: first one row from every server (a request's round
trip: the fixed cost), then ``rows`` rows of ``dim`` float32 (the per-byte cost, the round trip subtracted).
Medians over ``repeats`` after a warm-up, the slowest rank's. The probe's table (``name``, ``rows`` x world
rows) stays on the servers: the protocol has no delete.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from sparsync.ps.client import PSClient
from sparsync.ps.table import PSTable


class ServerTimes(NamedTuple):
    round_trip: float  # seconds: a pull of one row from every server, every rank at once
    per_byte: float  # seconds per byte a rank pulls, every rank at once


def measure_server(
    client: PSClient,
    *,
    rows: int,
    dim: int,
    group: dist.ProcessGroup | None = None,
    repeats: int = 5,
    name: str = "__sparsync_probe",
) -> ServerTimes:
    """The round trip and the per-byte cost of pulls from ``client``'s servers (module doc). Collective: every
    rank of ``group`` calls it with the same arguments."""
    if rows < 1 or dim < 1 or repeats < 1:
        raise ValueError(f"rows, dim and repeats must be >= 1, got {rows}, {dim}, {repeats}")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    servers = client.num_servers
    table = PSTable(client, f"{name}:{rows}x{dim}", max(rows * world, servers), dim, mode="async")
    table.create().wait()
    one = np.arange(servers)  # stride split: row p lives on server p
    mine = np.arange(rank * rows, (rank + 1) * rows) if rows * world >= servers else np.arange(rows)

    def timed(pull: Callable[[], object]) -> float:
        times = []
        for i in range(repeats + 1):
            dist.barrier(group)
            t0 = time.perf_counter()
            pull()
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            if i:  # the first: warm-up (connections, the table's first touch)
                times.append(float(t))
        return statistics.median(times)

    rt = timed(lambda: table.pull(one).wait())
    big = timed(lambda: table.pull(mine).wait())
    return ServerTimes(rt, max(0.0, big - rt) / (rows * dim * 4))
