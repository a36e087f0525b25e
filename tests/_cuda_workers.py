"""Workers of tests/test_cuda.py: the same calls on CPU and on CUDA tensors in one rank, compared bit for bit.

Every rank builds its input on the host (tests/_workers.py's cases), runs the call on it, then on a copy on its
GPU, and reports, per case, whether the results agree, where the CUDA result lives and the first difference.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from _workers import Case, make_stream

import sparsync
from sparsync import ALGORITHMS, CommLog, SparseStream, sparse_allgather, sparse_allreduce

TIMEOUT = 60.0
DENSITIES = (0.0, 0.001, 0.05, 0.3, 1.0)


def _device() -> torch.device:
    # NCCL: launch set one GPU per rank; gloo ranks share GPU 0 (gloo's CUDA path, staged through the host).
    return torch.device("cuda", torch.cuda.current_device())


def _to(s: SparseStream, device: torch.device) -> SparseStream:
    idx = None if s.indices is None else s.indices.to(device)
    return SparseStream(idx, s.values.to(device), s.dim, row=s.row, validate=False)


def _compare(cpu: torch.Tensor, dev: torch.Tensor) -> dict[str, Any]:
    host = dev.cpu()
    same = cpu.shape == host.shape and bool(torch.equal(cpu, host))
    diff = 0.0 if same or cpu.shape != host.shape else float((cpu.double() - host.double()).abs().max())
    return {"device": str(dev.device.type), "equal": same, "max_diff": diff}


def collectives_worker(rank: int) -> dict[str, Any]:
    """Every algorithm (and auto) over densities and dtypes, sparse_allgather, allreduce of a dense and of a COO
    tensor, grouped_allreduce: CUDA results against the CPU results of the same inputs."""
    sparsync.set_deterministic()
    P, dev = dist.get_world_size(), _device()
    out: dict[str, Any] = {"backend": dist.get_backend_config(), "world": P, "cases": {}}
    for alg in ("auto", *ALGORITHMS):
        for density in DENSITIES:
            for dtype in ("float32", "float64"):
                case = Case(dim=20011, density=density, pattern="random", dtype=dtype, seed=7)
                s = make_stream(case, rank, P)
                logs = (CommLog(), CommLog())
                want = sparse_allreduce(s, algorithm=alg, timeout=TIMEOUT, log=logs[0])
                got = sparse_allreduce(_to(s, dev), algorithm=alg, timeout=TIMEOUT, log=logs[1])
                row = _compare(want.to_dense(), got.to_dense())
                row["values_device"] = got.values.device.type
                # auto may choose otherwise for the second call of a signature (its eager limit grew): the same
                # bits are owed only for the same algorithm
                row["same_algorithm"] = logs[0].last.algorithm == logs[1].last.algorithm
                out["cases"][f"{alg}/{density}/{dtype}"] = row
    s = make_stream(Case(dim=1001, density=0.05, pattern="random", dtype="float32", seed=3), rank, P)
    parts_cpu = sparse_allgather(s, timeout=TIMEOUT)
    parts_dev = sparse_allgather(_to(s, dev), timeout=TIMEOUT)
    assert isinstance(parts_cpu, list) and isinstance(parts_dev, list)
    out["allgather"] = [_compare(a.to_dense(), b.to_dense()) for a, b in zip(parts_cpu, parts_dev, strict=True)]
    g = torch.Generator().manual_seed(rank)
    dense = torch.randn(64, 33, generator=g)
    out["dense"] = _compare(
        sparsync.allreduce(dense, timeout=TIMEOUT), sparsync.allreduce(dense.to(dev), timeout=TIMEOUT)
    )
    rows = torch.unique(torch.randint(0, 5000, (300 + 50 * rank,), generator=g))
    coo = torch.sparse_coo_tensor(rows[None], torch.randn(rows.numel(), 16, generator=g), (5000, 16)).coalesce()
    for alg in ("auto", *ALGORITHMS):
        a = sparsync.allreduce(coo, algorithm=alg, timeout=TIMEOUT)
        b = sparsync.allreduce(coo.to(dev), algorithm=alg, timeout=TIMEOUT)
        row = _compare(a.to_dense(), b.to_dense())
        row["rows_equal"] = bool(torch.equal(a.indices(), b.indices().cpu()))
        row["is_sparse"] = b.is_sparse
        out["cases"][f"coo/{alg}"] = row
    a_list = sparsync.grouped_allreduce([coo, dense], timeout=TIMEOUT)
    b_list = sparsync.grouped_allreduce([coo.to(dev), dense.to(dev)], timeout=TIMEOUT)
    out["grouped"] = [_compare(x.to_dense(), y.to_dense()) for x, y in zip(a_list, b_list, strict=True)]
    return out


def mismatched_device_worker(rank: int) -> str:
    """Rank 0 passes a CUDA stream, the others CPU streams: every rank must raise the same ValueError."""
    s = SparseStream(torch.tensor([rank]), torch.tensor([1.0]), dim=8)
    if rank == 0:
        s = _to(s, _device())
    try:
        sparse_allreduce(s, timeout=TIMEOUT)
    except ValueError as e:
        return str(e)
    return "no error"


def optimizer_worker(rank: int) -> dict[str, Any]:
    """DistributedOptimizer on a CUDA model (a sparse embedding and a Linear) against the same model on the CPU,
    trained on the same batches."""
    from torch import nn

    dev = _device()
    params: dict[str, list[np.ndarray]] = {}
    for where in ("cpu", "cuda"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.EmbeddingBag(10_000, 16, sparse=True), nn.Linear(16, 2))
        model = model.to(dev if where == "cuda" else "cpu")
        opt = sparsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
        g = torch.Generator().manual_seed(rank)
        for _ in range(5):
            x = (torch.rand(32, 8, generator=g) ** 3 * 10_000).long().to(next(model.parameters()).device)
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        params[where] = [p.detach().cpu().numpy().copy() for p in model.parameters()]
        params[where + "_device"] = [str(p.device.type) for p in model.parameters()]  # type: ignore[list-item]
    return {
        "max_diff": max(float(np.abs(a - b).max()) for a, b in zip(params["cpu"], params["cuda"], strict=True)),
        "devices": params["cuda_device"],
        "pid": os.getpid(),
    }
