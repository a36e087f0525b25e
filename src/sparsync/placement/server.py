"""The ``server`` choice of ``sparsync.shard``'s plan: a table left whole on every rank whose rows the parameter
server keeps (Parallax §3.1), marked on its weight so that the trainer that runs the servers finds it.

The placement that pulls and pushes the rows is ``sparsync.ps.placement.ParameterServer``; it needs running
servers and a client, so ``sparsync.shard`` cannot make it. It marks the weight with ``OnServer`` instead, and
``sparsync.hybrid.HybridTrainer`` puts every weight so marked on its servers by rows. Nothing else runs the
servers' per-step protocol (pull before the forward, push and the chief's apply after backward), so
``OnServer.aggregate`` refuses: ``DistributedOptimizer`` given such a model raises instead of leaving the table
untrained or reducing it behind the plan's back.
"""

from __future__ import annotations

from sparsync.placement.base import NamedParam, Placement, ReduceEnv


class OnServer(Placement):
    """A table whose rows live on the parameter server (module doc). ``kind`` is the plan registry's ``ps``, the
    kind ``HybridTrainer`` runs on its servers."""

    kind = "ps"
    overlaps = False  # pushed once per step by the trainer, never bucket by bucket in backward

    def aggregate(self, params: list[NamedParam], env: ReduceEnv) -> None:
        """Raises ValueError naming ``params``: only ``HybridTrainer`` trains a table on the servers."""
        del env
        names = [p.name for p in params]
        raise ValueError(
            f"parameters {names} are placed on the parameter server (sparsync.shard's plan 'server'): train the "
            "model with sparsync.hybrid.HybridTrainer, which pulls and pushes their rows each step; a collective "
            "optimizer cannot (place them 'replicated' or 'sharded' for DistributedOptimizer)"
        )
