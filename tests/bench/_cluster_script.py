"""Run by test_cluster.py under torchrun on emulated hosts: the topology comes from torchrun's environment, and
the hierarchical allreduce (both modes that can run it) equals a dense allreduce bit for bit."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import sparsync
from sparsync import SparseStream
from sparsync.collectives.hierarchical import detect_topology, hierarchical_allreduce


def work(rank: int) -> str:
    topo = detect_topology()
    g = torch.Generator().manual_seed(rank)
    dim, n = 1 << 16, 3000
    idx = torch.randperm(dim, generator=g)[:n].sort().values.to(torch.int32)
    s = SparseStream(idx, torch.randint(-4, 5, (n,), generator=g).float(), dim)
    ref = s.to_dense().clone()
    dist.all_reduce(ref)
    exact = all(
        torch.equal(hierarchical_allreduce(s, topo, mode=m).to_dense(), ref) for m in ("hierarchical", "auto")
    )
    return (
        f"rank {rank}: node {os.environ['GROUP_RANK']} local {os.environ['LOCAL_RANK']} "
        f"host {topo.host}/{topo.hosts} local {topo.local_rank}/{topo.local_size} exact {exact}"
    )


if __name__ == "__main__":
    for line in sparsync.launch(work, nprocs=4):  # torchrun's world: 2 hosts x 2
        print(line, flush=True)
