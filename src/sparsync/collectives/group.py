"""Per-group state (measured link model, call counter, async queue, background group, flight recorder,
timeline), owned by the ProcessGroup.

torch's ProcessGroup accepts no attributes, so the state lives in a WeakKeyDictionary keyed by the group: it
is created on first use and dies with the group, the same lifetime as an attribute would have. This is the one
module-level container of runtime state in sparsync (``ops``' names of op codes are filled at import):
nothing in it outlives its group or is shared between groups (but for a group and its background group, which
share one flight recorder: a call submitted on the one communicates on the other). The flight recorder's ring
is per group for the same reason as the rest: it must die with its group, and a process-wide ring would need a
global. This module holds the table; the modules above read and fill it: ``timeline`` (the tracer),
``background`` (sparsync's own groups), ``fifo`` (the queue every sparsync operation of a group runs through),
``transport`` (the metadata group).
"""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from sparsync.collectives import trace
from sparsync.collectives.flight import FlightRecorder
from sparsync.costmodel import REFERENCE_LINK, LinkModel

EAGER_BYTES = 2048  # default payload bytes a metadata row carries inline (see sparsync.collectives.meta)


@dataclass
class GroupState:
    """Mutable per-group state, attached to the ProcessGroup object (see ``group_state``)."""

    link: LinkModel | None = None  # α-β model measured at first use of "auto" (or set by the user)
    link_set: bool = False  # ``link`` came from the user (set_link, set_deterministic), not from a measurement
    # seconds of an all-to-all round that follows compute, measured by sparsync.shard's plan="auto" unless the
    # user set the link (sharding/auto.py), then kept for the next "auto" on the group
    exchange_round: float | None = None
    calls: int = 0  # collectives issued on this group, to detect ranks that diverge
    # Inline payload limits per call signature (dim, row, dtype code) grown by allgather calls
    # (collectives.meta); a signature not in it inlines up to EAGER_BYTES.
    eager_limits: dict[tuple[int, int, int], int] = field(default_factory=dict)
    executor: ThreadPoolExecutor | None = None  # FIFO queue for async_op=True calls
    pending: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    # sparsync's own group over these ranks (background_group), held weakly (``background``)
    background_ref: weakref.ReferenceType[dist.ProcessGroup] | None = None
    # (intra-host, inter-host) link models agreed by every rank of the world, held by a host's group
    # (collectives/hierarchical.py)
    levels: tuple[LinkModel, LinkModel] | None = None
    # The gloo side group of a pure NCCL group, for CPU metadata, and the backend per device type, read once
    # (collectives/transport.py).
    meta: dist.ProcessGroup | None = None
    backends: dict[str, str] | None = None
    # Set by transport.use_nccl_rules: this group's payload follows NCCL's rules, its metadata goes here.
    nccl_rules: dist.ProcessGroup | None = None
    # This process's rank and the group's size, and the transport rules per payload device, read at the first
    # Comm on the group: every call's Comm asks, and torch's lookups cost more than the small calls they serve
    # (collectives/comm.py). use_nccl_rules forgets the rules.
    rank_size: tuple[int, int] | None = None
    # the transport rules per payload device (``transport.Transport``, typed there: this module is below it)
    transports: dict[torch.device, Any] = field(default_factory=dict)
    # The world group's holds this process's timeline (sparsync.trace, SPARSYNC_TRACE; collectives/trace.py):
    # one per process, seen by every thread (caller, queue, parameter-server I/O), gone with the group.
    tracer: trace.Tracer | None = None
    trace_env_checked: bool = False  # SPARSYNC_TRACE read (once per world group)
    # The group's last calls, dumped when a call fails (collectives/flight.py); shared with its background group.
    flight: FlightRecorder = field(default_factory=FlightRecorder)
    published: int = 0  # Comms that published this rank's endpoints (peers.publish; the first two do)
    # A side group's (``side_group``): the caller's group, whose link model "auto" uses here too (set_link and
    # set_deterministic name the caller's group; a link measured on a side group is the caller's link); held weakly
    parent_ref: weakref.ReferenceType[dist.ProcessGroup] | None = None

    # The states live as long as their groups (a weak key); a group they named strongly (the background group, a
    # side group's parent, a group its own background) would keep itself or another alive for good, past
    # dist.destroy_process_group, to be freed at the interpreter's exit, where gloo can abort the process.
    @property
    def background(self) -> dist.ProcessGroup | None:
        return None if self.background_ref is None else self.background_ref()

    @background.setter
    def background(self, group: dist.ProcessGroup | None) -> None:
        self.background_ref = None if group is None else weakref.ref(group)

    @property
    def parent(self) -> dist.ProcessGroup | None:
        return None if self.parent_ref is None else self.parent_ref()

    @parent.setter
    def parent(self, group: dist.ProcessGroup | None) -> None:
        self.parent_ref = None if group is None else weakref.ref(group)


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


def states() -> list[tuple[dist.ProcessGroup, GroupState]]:
    """Every live group with its state (for the flight recorder's dump)."""
    return list(_STATES.items())


def next_call(group: dist.ProcessGroup) -> int:
    """This call's number on ``group``, taken at issue time (in the caller's thread, also for queued calls); every
    sparsync collective and primitive on the group shares the counter, so ranks that diverge show up in the
    metadata round."""
    state = group_state(group)
    seq = state.calls
    state.calls += 1
    return seq


def link_state(group: dist.ProcessGroup) -> GroupState:
    """The state that holds ``group``'s link model: its own, or a side group's caller's."""
    state = group_state(group)
    return state if state.parent is None else group_state(state.parent)


def set_link(link: LinkModel | None, *, group: dist.ProcessGroup | None = None) -> None:
    """Set (or, with None, forget) the link model "auto" uses for ``group`` instead of measuring it.

    Call it with the same model on every rank: ranks that hold different models may choose differently.
    """
    state = link_state(resolve_group(group))
    state.link, state.link_set = link, link is not None


def set_deterministic(*, group: dist.ProcessGroup | None = None, link: LinkModel = REFERENCE_LINK) -> None:
    """Make "auto" on ``group`` choose from ``link`` (default ``REFERENCE_LINK``) instead of a link measured by
    timing, so that its choices, and with them the summation order, depend on the calls' data only: two runs
    with the same seeds and data give the same bits. Call it on every rank, before the first call.

    Example::

        >>> sparsync.set_deterministic()          # every rank, right after init
        >>> sparsync.allreduce(emb.weight.grad)   # same algorithm, same bits, run after run
    """
    set_link(link, group=group)
