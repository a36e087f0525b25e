"""The tables that ``sparsync.shard(optimizer=...)`` updates in backward, left out of torch's
``DistributedDataParallel``: a model whose tables sparsync shards or groups can have the rest of it in DDP, as
torchrec's ``DistributedModelParallel`` puts its dense layers in DDP beside its sharded tables.

DDP reads the names to leave alone from the module it wraps (``_ddp_params_and_buffers_to_ignore``, the list
torch's own ``_set_params_and_buffers_to_ignore_for_model`` sets, which torchrec sets too): neither its broadcast
at construction (a shard would take rank 0's rows) nor its allreduce (the rows are already the ranks' mean,
applied in backward) touch them. Tables sharded without ``optimizer`` are not left out: their gradient is the
sum over the ranks, for ``DistributedOptimizer``, which divides it by P; DDP has no such divisor.
"""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sparsync.placement import updated_in_backward


def leave_to_sparsync(model: nn.Module) -> None:
    """Add the parameters of ``model`` updated in backward (``placement.updated_in_backward``) to those DDP
    leaves alone when it wraps ``model``, beside any already named. Mutates ``model``."""
    named = list(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    ours = [n for n in updated_in_backward(model) if n not in named]
    if ours:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, named + ours)  # type: ignore[no-untyped-call]
