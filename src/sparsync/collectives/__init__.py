"""Sparse collectives on torch.distributed (SparCML §4)."""

from sparsync.collectives.allreduce import sparse_allgather, sparse_allreduce
from sparsync.collectives.grouped import grouped_allreduce
from sparsync.collectives.tensor import allreduce

__all__ = ["allreduce", "grouped_allreduce", "sparse_allgather", "sparse_allreduce"]
