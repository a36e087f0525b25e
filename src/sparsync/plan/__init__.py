"""Planning (Parallax §2.2, §3): which parameters are sparse and how many rows a step touches (``detect``), a
placement per parameter by predicted communication time (``planner``: Table 3 with the α-β model), and the
partition search for the parameter server (``partition``: §3.2)."""

from sparsync.placement.embeddings import embedding_modules
from sparsync.plan.detect import ParamStats, RowFractionMeter, sparse_param_names
from sparsync.plan.kinds import PLAN_KINDS, Estimate, PlacementKind, ServerModel, machine_row_fraction
from sparsync.plan.partition_search import PartitionSearch, fit_iteration_time, search_partitions
from sparsync.plan.planner import (
    PLACEMENTS,
    Cluster,
    Entry,
    Plan,
    make_plan,
    zipf_row_fraction,
)

__all__ = [
    "PLACEMENTS",
    "PLAN_KINDS",
    "Cluster",
    "Entry",
    "Estimate",
    "ParamStats",
    "PartitionSearch",
    "PlacementKind",
    "Plan",
    "RowFractionMeter",
    "ServerModel",
    "embedding_modules",
    "fit_iteration_time",
    "machine_row_fraction",
    "make_plan",
    "search_partitions",
    "sparse_param_names",
    "zipf_row_fraction",
]
