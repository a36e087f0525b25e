"""Planning (Parallax §2.2, §3): which parameters are sparse and how many rows a step touches (``detect``), the
placement kinds, one record each with its cost estimate and how to make it (``kinds``), collected in one
registry (``registry``), a placement per parameter by predicted communication time (``planner``: Table 3 with
the α-β model on a ``cluster``), and the partition search for the parameter server (``partition``: §3.2)."""

from sparsync.placement.embeddings import embedding_modules
from sparsync.plan.cluster import Cluster, ExchangeCPU, ServerModel
from sparsync.plan.detect import ParamStats, RowFractionMeter, sparse_param_names
from sparsync.plan.kinds import Estimate, MakeOptions, PlacementKind, machine_row_fraction
from sparsync.plan.partition_search import PartitionSearch, fit_iteration_time, search_partitions
from sparsync.plan.planner import Entry, Plan, make_plan, zipf_row_fraction
from sparsync.plan.registry import KINDS, KindRegistry, kind_of, objects, resolve

__all__ = [
    "KINDS",
    "Cluster",
    "Entry",
    "Estimate",
    "ExchangeCPU",
    "KindRegistry",
    "MakeOptions",
    "ParamStats",
    "PartitionSearch",
    "PlacementKind",
    "Plan",
    "RowFractionMeter",
    "ServerModel",
    "embedding_modules",
    "fit_iteration_time",
    "kind_of",
    "machine_row_fraction",
    "make_plan",
    "objects",
    "resolve",
    "search_partitions",
    "sparse_param_names",
    "zipf_row_fraction",
]
