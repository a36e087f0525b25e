"""Sharded embedding tables inside the training group (docs/sharding.md): each rank owns the rows of a table
whose id is its rank modulo P (``ownership``), looks rows up and pushes gradient rows in one grouped all-to-all per
direction for all of a model's tables (``exchange``: the ids of ``route`` headed by ``header``'s row, then the
rows of ``rows``), and
holds only its own rows (``modules``). ``sparsync.shard(model, plan=...)`` swaps a model's embedding modules
for sharded ones (``api``), with ``plan="auto"`` where the cost model says (``auto``), and marks the tables a
dict plan places ``"server"`` for the parameter server (``OnServer``: they stay whole); ``plan_of(model)`` gives
``DistributedOptimizer`` their placement (``Sharded``), and ``HybridTrainer`` reads both off the model.
``Lookahead`` runs the ids round of a batch during the step before it (``lookahead``).

Note: ``sparsync.shard`` (the package's attribute of ``sparsync``) is the function; import the rest from here:
``from sparsync.shard import plan_of``.
"""

from sparsync.placement.sharded import plan_of
from sparsync.shard.api import shard
from sparsync.shard.auto import AUTO_KINDS, AutoPlan, auto_plan
from sparsync.shard.exchange import Exchanger
from sparsync.shard.lazy import LazyLookup
from sparsync.shard.lookahead import Lookahead
from sparsync.shard.modules import ShardedEmbedding, ShardedEmbeddingBag, ShardedTable
from sparsync.shard.optim_state import load_optimizer_state_dict, optimizer_state_dict
from sparsync.shard.ownership import Ownership

__all__ = [
    "AUTO_KINDS",
    "AutoPlan",
    "Exchanger",
    "LazyLookup",
    "Lookahead",
    "Ownership",
    "ShardedEmbedding",
    "ShardedEmbeddingBag",
    "ShardedTable",
    "auto_plan",
    "load_optimizer_state_dict",
    "optimizer_state_dict",
    "plan_of",
    "shard",
]
