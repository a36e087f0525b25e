"""Sharded embedding tables inside the training group (docs/sharding.md): each rank owns the rows of a table
whose id is its rank modulo P (``group.Ownership``); the tables of one width and dtype form a group held as one
flat tensor per rank (``group``, fbgemm's TBE layout), each table's parameter a view of its slice. A step runs in
stage order (``exchange``): the ids stage (``ids``: distinct keys to their owners, headed by each rank's
verdict), the rows stage and the pooling (``rows``), and in backward the gradient rows stage, whose sums become
the tables' sparse gradients or, with ``sparsync.shard(optimizer=...)``, their update in place (``group``: the
tables' storage and its optimizers).
``kernels`` holds the primitives the stages call: the C kernels and the rounds' transport (``Link``). With a
fused optimizer the tables placed ``"replicated"`` form groups too, whole on every rank (``replicated``).
``sparsync.shard(model, plan=...)`` swaps a model's embedding modules for sharded ones (``api``, ``modules``),
with ``plan="auto"`` where the cost model says (``auto``), and marks the tables a dict plan places ``"server"``
for the parameter server (``OnServer``: they stay whole); ``plan_of(model)`` gives ``DistributedOptimizer``
their placement (``Sharded``), and ``HybridTrainer`` reads both off the model. ``Lookahead`` runs the ids stage
of a batch during the step before it (``api``). ``checkpoint.save`` / ``load``: a model and its optimizer
as one ``torch.distributed.checkpoint`` checkpoint, each rank writing its rows, loaded at any world size
(``checkpoint``, ``dcp``: the rows re-blocked between the stride shards and contiguous row blocks).

``sparsync.shard`` is the function; this package is ``sparsync.sharding``
(``from sparsync.sharding import plan_of``, ``import sparsync.sharding.exchange as ex``).
"""

from sparsync.placement.sharded import plan_of
from sparsync.sharding.api import Lookahead, shard
from sparsync.sharding.auto import AUTO_KINDS, AutoPlan, auto_plan
from sparsync.sharding.checkpoint import load_optimizer_state_dict, optimizer_state_dict
from sparsync.sharding.exchange import Exchanger, LazyLookup
from sparsync.sharding.group import SGD, Adagrad, Adam, Ownership, RowwiseAdagrad
from sparsync.sharding.modules import ShardedEmbedding, ShardedEmbeddingBag, ShardedTable, dense_parameters

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
