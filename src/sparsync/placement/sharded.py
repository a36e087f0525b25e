"""The ``sharded`` placement: a table whose rows are owned by the ranks (``sparsync.shard``), so each rank holds
only its own rows and its gradient is summed over the ranks inside the module's own backward.

``sparsync.shard`` swaps an embedding module for a sharded one whose backward sends each rank's gradient rows to
their owners (one grouped all-to-all); when backward leaves, the owner's shard already holds the *sum* over the
ranks (the parameter-server push of Parallax §3.1, with the servers inside the training group). Nothing is
left for an optimizer wrapper to send: ``communicates`` is False and ``aggregate`` only checks that it was given
shards; ``DistributedOptimizer`` divides by P for ``op="mean"`` as for any placement.

The shard parameters carry their placement (``PLACEMENT_ATTR``): ``placement_of(param)`` finds it, so a plan can
be read off the model (``plan_of``, also ``sparsync.sharding.plan_of``; the server tables' mark, ``OnServer``, is
read the same way) and a plan that names ``sharded`` for a module nobody swapped is refused instead of silently
not reducing it.
"""

from __future__ import annotations

import torch

from sparsync.placement.base import NamedParam, Placement, ReduceEnv

PLACEMENT_ATTR = "sparsync_placement"  # set on a parameter: the placement its module chose for it
IN_BACKWARD_ATTR = "sparsync_updated_in_backward"  # set on a parameter its table's optimizer updates in backward


class Sharded(Placement):
    """Rows owned by the ranks; the gradient already summed over them when backward leaves (module doc).
    Each rank's parameter is its own shard (``replicated`` False): it differs across ranks in values and, when
    the rows do not divide evenly, in shape, so it must never be broadcast from one rank to the others."""

    kind = "sharded"
    communicates = False
    replicated = False

    def aggregate(self, params: list[NamedParam], env: ReduceEnv) -> None:
        """Nothing to send. Raises ValueError naming a parameter that is no shard (its module was not swapped
        by ``sparsync.shard``: nobody would sum its gradient). Mutates nothing."""
        del env
        plain = [p.name for p in params if not isinstance(placement_of(p.param), Sharded)]
        if plain:
            raise ValueError(
                f"parameters {plain} are placed 'sharded' but are no shards: swap their modules with "
                "sparsync.shard(model, plan=...) first, which sums their gradients in backward (placed "
                "'sharded' as they are, nobody would)"
            )


def mark(param: torch.Tensor, placement: Placement) -> None:
    """Record on ``param`` the placement its module chose for it. Mutates ``param`` (one attribute)."""
    setattr(param, PLACEMENT_ATTR, placement)


def placement_of(param: torch.Tensor) -> Placement | None:
    """The placement recorded on ``param`` by its module (``mark``), or None."""
    pl = getattr(param, PLACEMENT_ATTR, None)
    return pl if isinstance(pl, Placement) else None


def plan_of(model: torch.nn.Module) -> dict[str, Placement]:
    """Parameter name -> placement, for every parameter ``sparsync.shard`` placed: its shards (``Sharded``) and
    the weights of its server tables (``OnServer``). Pass it to ``DistributedOptimizer(plan=...)``, which
    reduces the other parameters by its default (and refuses server tables), or let ``HybridTrainer`` read it
    off the model. Tables placed ``"replicated"`` carry no placement and are not in it."""
    return {n: pl for n, p in model.named_parameters() if (pl := placement_of(p)) is not None}


def mark_updated_in_backward(param: torch.Tensor) -> None:
    """Record on ``param`` that its table's optimizer updates it at the end of backward
    (``sparsync.shard(optimizer=...)``), so no optimizer after backward may step it. Mutates ``param``."""
    setattr(param, IN_BACKWARD_ATTR, True)


def updated_in_backward(model: torch.nn.Module) -> list[str]:
    """The names of ``model``'s parameters that their tables' optimizer updates in backward
    (``mark_updated_in_backward``)."""
    return [n for n, p in model.named_parameters() if getattr(p, IN_BACKWARD_ATTR, False)]
