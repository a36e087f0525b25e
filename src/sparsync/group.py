"""Per-group state (measured link model, async queue, call counter), owned by the ProcessGroup.

torch's ProcessGroup accepts no attributes, so the state lives in a WeakKeyDictionary keyed by the group: it
is created on first use and dies with the group, the same lifetime as an attribute would have. This is the one
module-level container in sparsync (STYLE 6): nothing in it outlives its group or is shared between groups.
"""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch.distributed as dist

from sparsync.costmodel import LinkModel

EAGER_BYTES = 2048  # default payload bytes a metadata row carries inline (see sparsync.collectives._meta)


@dataclass
class GroupState:
    """Mutable per-group state, attached to the ProcessGroup object (see ``group_state``)."""

    link: LinkModel | None = None  # α-β model measured at first use of "auto" (or set by the user)
    calls: int = 0  # collectives issued on this group, to detect ranks that diverge
    # Inline payload limits per call signature (dim, row, dtype code) grown by allgather calls
    # (collectives._meta); a signature not in it inlines up to EAGER_BYTES.
    eager_limits: dict[tuple[int, int, int], int] = field(default_factory=dict)
    executor: ThreadPoolExecutor | None = None  # FIFO queue for async_op=True calls
    pending: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


_STATES: weakref.WeakKeyDictionary[dist.ProcessGroup, GroupState] = weakref.WeakKeyDictionary()


def resolve_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: run inside sparsync.launch(...) or torchrun, "
            "or call torch.distributed.init_process_group first"
        )
    if group is None:
        world = dist.group.WORLD
        assert isinstance(world, dist.ProcessGroup)  # initialized above
        return world
    return group


def group_state(group: dist.ProcessGroup) -> GroupState:
    state = _STATES.get(group)
    if state is None:
        state = _STATES.setdefault(group, GroupState())
    return state


def set_link(link: LinkModel | None, *, group: dist.ProcessGroup | None = None) -> None:
    """Set (or, with None, forget) the link model "auto" uses for ``group`` instead of measuring it.

    Call it with the same model on every rank: ranks that hold different models may choose differently.
    """
    group_state(resolve_group(group)).link = link
