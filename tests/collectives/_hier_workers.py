"""Workers for test_hierarchical.py: hierarchical sparse allreduce over emulated hosts.

Inputs are deterministic functions of (case, rank); values are small integers, so every partial sum is exact
in float32 and float64 and the result must equal the dense reference bit for bit whatever the summation order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from sparsync import CommLog, SparseStream
from sparsync.collectives.group import set_link
from sparsync.collectives.hierarchical import MODES, detect_topology, hierarchical_allreduce, predict_levels
from sparsync.costmodel import LinkModel, Problem

ROWS = 97  # prime: no host size divides it
DENSITIES = (0.0, "one", 0.05, 0.3, 1.0)
WIDTHS = (1, 3)
DTYPES = (torch.float32, torch.float64)


def stream_of(rank: int, density: float | str, width: int, dtype: torch.dtype) -> SparseStream:
    g = torch.Generator().manual_seed(hash((rank, str(density), width)) % (2**31))
    if density == "one":
        idx = torch.tensor([ROWS - 1 - rank % 2])
    else:
        n = round(ROWS * float(density))
        idx = torch.randperm(ROWS, generator=g)[:n].sort().values
    vals = torch.randint(-4, 5, (idx.numel() * width,), generator=g).to(dtype)
    if density == 1.0:
        return SparseStream(None, vals, ROWS * width, row=width)
    return SparseStream(idx.to(torch.int32), vals, ROWS * width, row=width)


def exact_worker(rank: int, procs_per_host: int | None) -> dict[str, Any]:
    topo = detect_topology(procs_per_host)
    out: dict[str, Any] = {"topology": (topo.host, topo.hosts, topo.local_rank, topo.local_size), "cases": {}}
    for mode in MODES:
        for density in DENSITIES:
            for width in WIDTHS:
                for dtype in DTYPES:
                    s = stream_of(rank, density, width, dtype)
                    ref = s.to_dense().clone()
                    dist.all_reduce(ref)
                    log = CommLog()
                    r = hierarchical_allreduce(s, topo, mode=mode, log=log)
                    out["cases"][(mode, str(density), width, str(dtype))] = (
                        torch.equal(r.to_dense(), ref),
                        r.to_dense().tolist(),
                        log.last.algorithm,
                        r.dim == s.dim and r.row == s.row and r.dtype == s.dtype,
                    )
    return out


def choice_worker(rank: int, procs_per_host: int) -> dict[str, Any]:
    """With a slow link between hosts and a fast one inside them (set, not measured), the model prices the
    hierarchical allreduce below the flat one for a dense-ish call, and mode auto runs it."""
    topo = detect_topology(procs_per_host)
    # Each host and cross group holds a link of its own (as measured links differ): the model must still
    # price the levels the same on every rank, or ranks would choose differently and hang.
    fast = LinkModel(alpha=20e-6 * (1 + topo.host), beta=1e-10)
    slow = LinkModel(alpha=200e-6, beta=8e-9 * (1 + topo.local_rank))
    set_link(LinkModel(alpha=200e-6, beta=8e-9), group=topo.world)
    set_link(slow, group=topo.cross)
    set_link(fast, group=topo.local)
    n = 20_000
    p = Problem(topo.size, 1 << 20, (n,) * topo.size, 4, 4)
    preds = predict_levels(p, topo)
    g = torch.Generator().manual_seed(rank)
    idx = torch.randperm(1 << 20, generator=g)[:n].sort().values.to(torch.int32)
    s = SparseStream(idx, torch.ones(n), 1 << 20)
    log = CommLog()
    r = hierarchical_allreduce(s, topo, mode="auto", log=log)
    ref = s.to_dense().clone()
    dist.all_reduce(ref)
    tiny = SparseStream(torch.tensor([rank], dtype=torch.int32), torch.ones(1), 1 << 20)
    log_tiny = CommLog()
    hierarchical_allreduce(tiny, topo, mode="auto", log=log_tiny)
    return {
        "preds": preds,
        "chosen": log.last.algorithm,
        "exact": torch.equal(r.to_dense(), ref),
        "decision": dict(log.last.decision.predictions) if log.last.decision else {},
        "tiny_chosen": log_tiny.last.algorithm,
    }


def unequal_worker(rank: int) -> str:
    import os

    os.environ["GROUP_RANK"] = "0" if rank < 2 else "1"  # hosts of 2 and 1 ranks
    try:
        detect_topology()
    except ValueError as e:
        return str(e)
    return "no error"


def bad_input_worker(rank: int) -> list[str]:
    """NaN on one rank, then a dimension that differs on one rank: every rank raises the same ValueError (the
    world's metadata round), none hangs in a stage."""
    topo = detect_topology(2)
    out = []
    for case in ("nan", "dim"):
        vals = torch.ones(2)
        dim = ROWS
        if case == "nan" and rank == 1:
            vals[1] = float("nan")
        if case == "dim" and rank == 2:
            dim = ROWS + 1
        s = SparseStream(torch.tensor([0, 5], dtype=torch.int32), vals, dim)
        try:
            hierarchical_allreduce(s, topo, mode="hierarchical", timeout=30)
            out.append("no error")
        except ValueError as e:
            out.append(str(e))
    return out
