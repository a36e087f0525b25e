"""The built-in sparse allreduce algorithms, collected into ``costmodel.REGISTRY``: each module declares its
entry (name, metadata code, tie order, time and bytes models, runner) beside the code it runs; this module only
lists them. Imported by ``sparsync.collectives`` first, so every algorithm is registered before any call.

Adding one: write its module with an ``AlgorithmEntry`` at the bottom, and name that entry here."""

from __future__ import annotations

from sparsync.collectives import allgather, dense, recursive_double, split_allgather
from sparsync.costmodel import REGISTRY, AlgorithmEntry

# SparCML §4.1's three cases, Horovod/DDP's allgather, and the dense switch (§3).
BUILTIN: tuple[AlgorithmEntry, ...] = (
    recursive_double.ENTRY,
    split_allgather.SSAR,
    split_allgather.DSAR,
    allgather.ENTRY,
    dense.ENTRY,
)

for _entry in BUILTIN:
    REGISTRY.register(_entry)
