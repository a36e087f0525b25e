"""Sparse collectives on torch.distributed (SparCML §4)."""

# First: registers the built-in algorithms in ``costmodel.REGISTRY`` before anything can call one.
from sparsync.collectives import algorithms  # noqa: F401
from sparsync.collectives.allreduce import sparse_allgather, sparse_allreduce
from sparsync.collectives.grouped import grouped_allreduce
from sparsync.collectives.tensor import allreduce

__all__ = ["allreduce", "grouped_allreduce", "sparse_allgather", "sparse_allreduce"]
