"""sparsync's own process groups: the background group beside a caller's (``background_group``) and the side
groups that follow a group's rules and share its flight recorder (``side_group``, ``new_group_like``).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from sparsync.collectives.group import group_state, resolve_group


def background_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup:
    """sparsync's own process group over the ranks of ``group`` (default: the world), made on first call.

    Work sparsync runs beside the caller's (DDP comm hooks, reductions on the queue thread) goes here, not on
    the caller's group: a model that issues collectives of its own in backward (DLRM's alltoall) would
    otherwise interleave them with sparsync's in a different order on each rank, which hangs or makes gloo
    abort on a "collective mismatch". Collective on the first call for a group: every rank
    of ``group`` calls it, in the same order relative to any other group creation (at hook registration,
    which every rank does). The new group has ``group``'s backend and timeout.
    """
    g = resolve_group(group)
    state = group_state(g)
    if state.background is None:
        state.background = side_group(g)
    return state.background


def side_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A new group of sparsync's own over ``group``'s ranks, following its rules (NCCL's, with the metadata on a
    side group of its own) and writing to its flight recorder; async calls on it stay on it. Collective over
    ``group``'s ranks, in the same order on each."""
    state = group_state(group)
    side = new_group_like(group)
    side_state = group_state(side)
    side_state.background = side
    side_state.flight = state.flight  # the caller's calls run their transfers here: one ring for both
    side_state.parent = state.parent or group
    if state.nccl_rules is not None:
        side_state.nccl_rules = new_group_like(state.nccl_rules)
    return side


def new_group_like(group: dist.ProcessGroup, backend: str | None = None) -> dist.ProcessGroup:
    """A new group over ``group``'s ranks, with its timeout and its backend configuration (or ``backend``).
    Collective over ``group``'s ranks."""
    ranks = dist.get_process_group_ranks(group)
    # Only the members of a subgroup get here, so they must synchronise among themselves; for the whole
    # world every rank is a member and the ordinary (global) creation applies.
    local = len(ranks) != dist.get_world_size()
    new = dist.new_group(
        ranks,
        timeout=_timeout_of(group),
        backend=backend or dist.get_backend_config(group),
        use_local_synchronization=local,
    )
    assert isinstance(new, dist.ProcessGroup)  # this rank is in ``ranks``
    return new


def _timeout_of(group: dist.ProcessGroup) -> timedelta | None:
    """The group's collective timeout (None: torch's default), so a dead peer fails background work as soon
    as it fails the caller's own collectives (``launch(timeout=...)``)."""
    try:
        # Private in torch 2.13; without it the new group gets torch's default (30 min for gloo).
        device = torch.device("cpu") if "cpu" in dist.get_backend_config(group) else torch.device("cuda")
        timeout: timedelta = group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None
    return timeout
