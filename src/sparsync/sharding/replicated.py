"""Replicated tables in groups, with a fused optimizer: ``sparsync.shard(model, plan, optimizer=F)`` groups the
tables the plan places ``"replicated"`` as it groups the sharded ones (``group``: one width and dtype per group,
one flat tensor, each table's weight a view of its slice), but every rank holds each such group whole.

The design: a replicated group is a ``TableGroup`` of one part (P = 1: every key its own row, ``base_t`` the
table's first row), driven by an ``Exchanger`` of its own whose ``Link`` has one rank (``LocalLink``): the
exchange's stages run as they do for sharded tables at P = 1, so its rounds send nothing, and a step's lookups of
a group are one deduplication, one ``index_select`` and one pooling per call signature, however many tables.
What P = 1 leaves out, this module adds:

- the verdict round (``ReplicatedExchanger.agreed``): the ids round that carries each rank's verdict on its
  calls at P > 1 does not run, so each forward sends one header row per rank (one small allreduce over the
  ranks): a rank that refuses its calls (an id out of range, a negative id, what ``embedding_bag`` refuses) or
  looks up other tables makes every rank raise the same ValueError (``ids.agree``), before any row is read;
- the sum over the ranks (``TableGroup.across``, ``sum_over``): at the end of backward the group's gradient rows,
  summed per row on this rank (one sort, as the owner's sum), are summed over the ranks in one row-sparse
  allreduce for the whole group (``sparsync.allreduce`` of one coalesced COO tensor, by ``SUM_ALGORITHM``: the
  union of the rows any rank looked up, bitwise identical on every rank and run to run); ``group.Fused`` then
  divides by P (``TableGroup.ranks``), the mean ``DistributedOptimizer``'s ``op="mean"`` gives a replicated
  table, and updates the rows in place on every rank. Every rank applies the same sums in the same order, so
  the replicas stay bit-identical;
- the start (``broadcast``): every replica starts from group rank 0's table (one broadcast per group), as the
  shards start from rank 0's table.

The modules (``ReplicatedEmbedding``, ``ReplicatedEmbeddingBag``) are ``modules.GroupedTable``s, not
``ShardedTable``s: code that looks for the shards (``Lookahead``, a sharded checkpoint's row blocks) passes them
by. The tables get no ``.grad`` (``modules.dense_parameters`` leaves them out) and carry no placement
(``plan_of`` leaves them out): a torch optimizer wrapped by ``DistributedOptimizer`` over
``dense_parameters(model)`` never sees them, and one given them finds no gradient to reduce or step. Their
state dicts are those of the user's modules, whatever ``state_dict=`` says: the whole table under
``<name>.weight`` on every rank, loaded in place (so a weight keeps viewing its group).

Without ``optimizer=``, replicated tables stay the user's own modules (one gradient each, reduced by
``DistributedOptimizer``), and so do replicated tables whose options the grouped modules cannot honour (the
sharded modules' limits: ``mode="max"``, ``max_norm``, ...).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from sparsync.collectives.tensor import allreduce
from sparsync.record import CommLog
from sparsync.sharding import ids as ids_stage
from sparsync.sharding.exchange import Exchanger, Sent
from sparsync.sharding.group import TableGroup
from sparsync.sharding.kernels import Link, alive
from sparsync.sharding.modules import BagLookup, EmbeddingLookup, GroupedTable


class LocalLink(Link):
    """A ``Link`` of one rank (no round sends anything) whose ``group`` is the ranks that hold the replicas."""

    def __init__(self, group: dist.ProcessGroup) -> None:  # no super().__init__: its rank and size are the group's
        self._group, self.wire, self.rank, self.size, self.log = weakref.ref(group), None, 0, 1, None


class ReplicatedExchanger(Exchanger):
    """The replicated groups of one ``sparsync.shard`` call (module doc): every row local, one verdict round per
    forward over ``replicas``, the ranks that hold them."""

    def __init__(self, replicas: dist.ProcessGroup, log: CommLog | None = None) -> None:
        super().__init__(LocalLink(replicas))
        self._replicas = weakref.ref(replicas)  # held weakly, as a ``Link`` holds its group (``kernels.alive``)
        self.log = log  # receives the sums' records (``sparsync.allreduce``)

    @property
    def replicas(self) -> dist.ProcessGroup:
        """The ranks that hold the replicas; a RuntimeError once the group is gone."""
        return alive(self._replicas)

    def agreed(self, sent: Sent, refusal: str | None) -> None:
        """Every rank's verdict on its calls and the key of the tables it looks up, one header row per rank
        (``ids.HEADER``: status, tables, no count); unless every rank is OK and looks up rank 0's tables, every
        rank raises the same ValueError (``ids.agree``). Collective over ``replicas``."""
        P, rank = dist.get_world_size(self.replicas), dist.get_rank(self.replicas)
        rows = torch.zeros(P, len(ids_stage.COLUMNS), dtype=torch.int64)
        rows[rank, ids_stage.HEADER.index("status")] = ids_stage.OK if refusal is None else ids_stage.REFUSED
        rows[rank, ids_stage.HEADER.index("tables")] = self._key(sent)
        if P > 1:
            dist.all_reduce(rows, group=self.replicas)  # each rank fills its own row: the sum is every row
        ids_stage.agree(rows, self.replicas, refusal=refusal, descriptions=sent.descriptions())


# the sum's algorithm, fixed: "auto" would choose by the link's measured timings, and the algorithms add the ranks'
# rows in different orders, so two runs could differ in the last bits. The allgather (every rank's rows to every
# rank, summed in rank order) is one round after the metadata: the fewest messages, which is what a step's CPU
# pays for (docs/sharding.md measures it against the split allgather, whose two rounds send less at large P)
SUM_ALGORITHM = "allgather"
Across = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # ``TableGroup.across``


def sum_over(replicas: ReplicatedExchanger, group: TableGroup, name: str) -> Across:
    """``group``'s sum of gradient rows over ``replicas``' ranks: (rows, values) of this rank, rows distinct and
    ascending, to (the union of every rank's rows, ascending; their sums), the same bits on every rank, in one
    ``sparsync.allreduce`` named ``name``, recorded in ``replicas.log``. Collective over ``replicas.replicas``
    (held weakly there: ``kernels.alive``)."""
    P = dist.get_world_size(replicas.replicas)
    shape = (int(group.flat.shape[0]), group.dim)

    def across(rows: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if P == 1:
            return rows, values
        coo = torch.sparse_coo_tensor(rows.unsqueeze(0), values, shape, is_coalesced=True, check_invariants=False)
        total = allreduce(coo, group=replicas.replicas, log=replicas.log, name=name, algorithm=SUM_ALGORITHM)
        assert isinstance(total, torch.Tensor)  # waited for: not a Work
        return total.indices()[0], total.values()

    return across


class ReplicatedTable(GroupedTable):
    """What the two replicated modules share: the whole table, a view of its slice of its group; the state dict
    the user's module's (``nn.Module``'s: loaded in place, so the weight keeps viewing its group; module doc)."""

    placed = "replicated"

    def first_rows(self, table: torch.Tensor) -> torch.Tensor:
        """The whole table as this rank has it (``broadcast`` then makes rank 0's every rank's)."""
        return table.detach()

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.options()}, replicated, in a group"


class ReplicatedEmbedding(ReplicatedTable, EmbeddingLookup):
    """``nn.Embedding``, whole on every rank, in a replicated group (module doc)."""


class ReplicatedEmbeddingBag(ReplicatedTable, BagLookup):
    """``nn.EmbeddingBag`` (modes ``sum`` and ``mean``), whole on every rank, in a replicated group (module
    doc)."""


def broadcast(groups: Sequence[TableGroup], replicas: dist.ProcessGroup) -> None:
    """Every group's flat tensor from group rank 0 of ``replicas``, in place. Collective over ``replicas``."""
    if dist.get_world_size(replicas) == 1:
        return
    for g in groups:
        with torch.no_grad():
            dist.broadcast(g.flat, group=replicas, group_src=0)
