"""The tables that ``sparsync.shard(optimizer=...)`` updates in backward, left out of torch's
``DistributedDataParallel``: a model whose tables sparsync shards or groups can have the rest of it in DDP, as
torchrec's ``DistributedModelParallel`` puts its dense layers in DDP beside its sharded tables.

DDP reads the names to leave alone from the module it wraps (``_ddp_params_and_buffers_to_ignore``, the list
torch's own ``_set_params_and_buffers_to_ignore_for_model`` sets, which torchrec sets too): neither its broadcast
at construction (a shard would take rank 0's rows) nor its allreduce (the rows are already the ranks' mean,
applied in backward) touch them.

Tables sharded without ``optimizer`` cannot be left out: their gradient is the sum over the ranks, for
``DistributedOptimizer``, which divides it by P; DDP has no such divisor, and left in, DDP broadcast rank 0's rows
over every rank's shard at construction and failed at the first backward ("Cannot access storage of
SparseTensorImpl"). So DDP is refused on such a model: the list it reads first thing, before its broadcast, is a
``RefuseDDP``, whose reading raises a RuntimeError naming the tables and the two ways out. So are tables placed
on the parameter server (``"server"``): only ``HybridTrainer`` trains them, as ``DistributedOptimizer`` says too.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sparsync.placement import OnServer, Sharded, placement_of, updated_in_backward

ATTR = "_ddp_params_and_buffers_to_ignore"


class RefuseDDP:
    """DDP's list of names to leave alone on a model DDP must not wrap (module doc): iterating it (``set(...)`` in
    DDP's constructor) raises RuntimeError naming ``shards`` (sharded without ``optimizer=``) and ``server``
    (tables on the parameter server). ``names``: the list as it would otherwise be, for ``leave_to_sparsync`` to
    extend."""

    def __init__(self, names: list[str], shards: list[str], server: list[str]) -> None:
        self.names, self.shards, self.server = names, shards, server

    def __iter__(self) -> Iterator[str]:
        why = []
        if self.shards:
            why.append(
                f"tables sparsync.shard sharded without optimizer= ({', '.join(self.shards)}): DDP would "
                "broadcast rank 0's rows over every rank's shard and average gradients that are each rank's own "
                "rows, already summed over the ranks. Shard them with optimizer= (e.g. "
                "sparsync.sharding.SGD(lr=...)): they are then updated in backward and DDP leaves them alone; or "
                "keep the drop-in and reduce the model with sparsync.DistributedOptimizer instead of DDP"
            )
        if self.server:
            why.append(
                f"tables placed on the parameter server ({', '.join(self.server)}): their rows live on the "
                "servers, pulled and pushed by sparsync.hybrid.HybridTrainer, which trains the whole model"
            )
        raise RuntimeError("torch's DistributedDataParallel cannot wrap a model with " + "; and ".join(why))


def leave_to_sparsync(model: nn.Module) -> None:
    """Add the parameters of ``model`` updated in backward (``placement.updated_in_backward``) to those DDP
    leaves alone when it wraps ``model``, beside any already named; when ``model`` has shards not updated in
    backward or tables on the parameter server, make DDP refuse it (``RefuseDDP``). Mutates ``model``."""
    present = getattr(model, ATTR, ())
    named = list(present.names if isinstance(present, RefuseDDP) else present)
    named += [n for n in updated_in_backward(model) if n not in named]
    left = set(named)
    placed = [(n, placement_of(p)) for n, p in model.named_parameters() if n not in left]
    shards = [n for n, pl in placed if isinstance(pl, Sharded)]
    server = [n for n, pl in placed if isinstance(pl, OnServer)]
    if shards or server:
        setattr(model, ATTR, RefuseDDP(named, shards, server))
    elif named:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, named)  # type: ignore[no-untyped-call]
