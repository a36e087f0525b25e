"""Sharded embedding tables inside the training group (docs/sharding.md): each rank owns the rows of a table
whose id is its rank modulo P (``ownership``), looks rows up and pushes gradient rows in one grouped all-to-all per
direction for all of a model's tables (``exchange``: the ids of ``route`` headed by ``header``'s row, then the
rows of ``rows``), and
holds only its own rows (``modules``). ``sparsync.shard(model, plan=...)`` swaps a model's embedding modules
for sharded ones (``api``), with ``plan="auto"`` where the cost model says (``auto``), and marks the tables a
dict plan places ``"server"`` for the parameter server (``OnServer``: they stay whole); ``plan_of(model)`` gives
``DistributedOptimizer`` their placement (``Sharded``), and ``HybridTrainer`` reads both off the model.
``Lookahead`` runs the ids round of a batch during the step before it (``lookahead``).

``sparsync.shard`` is the function; this package is ``sparsync.sharding``
(``from sparsync.sharding import plan_of``, ``import sparsync.sharding.exchange as ex``).
"""

from sparsync.placement.sharded import plan_of
from sparsync.sharding.api import shard
from sparsync.sharding.auto import AUTO_KINDS, AutoPlan, auto_plan
from sparsync.sharding.exchange import Exchanger
from sparsync.sharding.fused import SGD, Adagrad, Adam, RowwiseAdagrad, dense_parameters
from sparsync.sharding.lazy import LazyLookup
from sparsync.sharding.lookahead import Lookahead
from sparsync.sharding.modules import ShardedEmbedding, ShardedEmbeddingBag, ShardedTable
from sparsync.sharding.optim_state import load_optimizer_state_dict, optimizer_state_dict
from sparsync.sharding.ownership import Ownership

__all__ = [
    "AUTO_KINDS",
    "SGD",
    "Adagrad",
    "Adam",
    "AutoPlan",
    "Exchanger",
    "LazyLookup",
    "Lookahead",
    "Ownership",
    "RowwiseAdagrad",
    "ShardedEmbedding",
    "ShardedEmbeddingBag",
    "ShardedTable",
    "auto_plan",
    "dense_parameters",
    "load_optimizer_state_dict",
    "optimizer_state_dict",
    "plan_of",
    "shard",
]
