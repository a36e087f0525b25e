"""Sparse collectives on torch.distributed (SparCML §4)."""

from sparsync.collectives.allreduce import sparse_allgather, sparse_allreduce
from sparsync.collectives.tensor import allreduce

__all__ = ["allreduce", "sparse_allgather", "sparse_allreduce"]
