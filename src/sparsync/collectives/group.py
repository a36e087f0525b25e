"""Per-group state (measured link model, async queue, call counter, background group, flight recorder), owned by
the ProcessGroup.

torch's ProcessGroup accepts no attributes, so the state lives in a WeakKeyDictionary keyed by the group: it
is created on first use and dies with the group, the same lifetime as an attribute would have. This is the one
module-level container of runtime state in sparsync (``ops``' names of op codes are filled at import):
nothing in it outlives its group or is shared between groups (but for a group and its background group, which
share one flight recorder: a call submitted on the one communicates on the other). The flight recorder's ring
is per group for the same reason as the rest: it must die with its group, and a process-wide ring would need a
global. ``submit`` runs every sparsync operation of a group
through the group's FIFO queue.
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from sparsync.collectives import trace
from sparsync.collectives.flight import FlightRecorder
from sparsync.costmodel import REFERENCE_LINK, LinkModel
from sparsync.handle import Work

T = TypeVar("T")

EAGER_BYTES = 2048  # default payload bytes a metadata row carries inline (see sparsync.collectives.meta)


@dataclass
class GroupState:
    """Mutable per-group state, attached to the ProcessGroup object (see ``group_state``)."""

    link: LinkModel | None = None  # α-β model measured at first use of "auto" (or set by the user)
    calls: int = 0  # collectives issued on this group, to detect ranks that diverge
    # Inline payload limits per call signature (dim, row, dtype code) grown by allgather calls
    # (collectives.meta); a signature not in it inlines up to EAGER_BYTES.
    eager_limits: dict[tuple[int, int, int], int] = field(default_factory=dict)
    executor: ThreadPoolExecutor | None = None  # FIFO queue for async_op=True calls
    pending: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    background: dist.ProcessGroup | None = None  # sparsync's own group over these ranks (background_group)
    # (intra-host, inter-host) link models agreed by every rank of the world, held by a host's group
    # (collectives/hierarchical.py)
    levels: tuple[LinkModel, LinkModel] | None = None
    # The gloo side group of a pure NCCL group, for CPU metadata, and the backend per device type, read once
    # (collectives/transport.py).
    meta: dist.ProcessGroup | None = None
    backends: dict[str, str] | None = None
    # Set by transport.use_nccl_rules: this group's payload follows NCCL's rules, its metadata goes here.
    nccl_rules: dist.ProcessGroup | None = None
    # The world group's holds this process's timeline (sparsync.trace, SPARSYNC_TRACE; collectives/trace.py):
    # one per process, seen by every thread (caller, queue, parameter-server I/O), gone with the group.
    tracer: trace.Tracer | None = None
    trace_env_checked: bool = False  # SPARSYNC_TRACE read (once per world group)
    # The group's last calls, dumped when a call fails (collectives/flight.py); shared with its background group.
    flight: FlightRecorder = field(default_factory=FlightRecorder)
    published: int = 0  # Comms that published this rank's endpoints (peers.publish; the first two do)
    # A side group's (``side_group``): the caller's group, whose link model "auto" uses here too (set_link and
    # set_deterministic name the caller's group; a link measured on a side group is the caller's link)
    parent: dist.ProcessGroup | None = None


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


def tracer() -> trace.Tracer | None:
    """This process's timeline, or None: the one ``sparsync.trace`` set, else one started at the first call
    when ``SPARSYNC_TRACE`` names a directory (each rank alone: "wall" clock; written at exit, by ``launch``
    and by ``write_trace``). Held by the world group's state (see ``GroupState.tracer``)."""
    if not trace.RANGES or not dist.is_available() or not dist.is_initialized():
        return None
    world = dist.group.WORLD
    if world is None:
        return None
    state = group_state(world)
    if state.tracer is None and not state.trace_env_checked:
        state.trace_env_checked = True
        directory = os.environ.get(trace.ENV, "")
        if directory:
            state.tracer = trace.Tracer(directory, dist.get_rank(), dist.get_world_size())
            atexit.register(state.tracer.write)
    return state.tracer


def set_tracer(t: trace.Tracer | None) -> trace.Tracer | None:
    """Make ``t`` this process's timeline (None: none); returns the one it replaces."""
    state = group_state(resolve_group(None))
    state.trace_env_checked = True  # an explicit choice wins over SPARSYNC_TRACE
    old, state.tracer = state.tracer, t
    return old


def write_trace() -> Path | None:
    """Write this process's timeline now (``SPARSYNC_TRACE``'s is otherwise written at exit); its path."""
    t = tracer()
    return t.write() if t is not None else None


def submit(
    group: dist.ProcessGroup,
    fn: Callable[[], T],
    async_op: bool,
    *,
    label: str = "",
    facts: Callable[[], dict[str, object]] | None = None,
) -> T | Work[T]:
    """Run ``fn`` now, or (``async_op=True``) on the group's FIFO worker and return its ``Work``. Once a group
    has async work in flight, blocking calls queue behind it too (and wait for their turn), so every rank issues
    the group's transfers in the same order. Every sparsync operation on a group runs through here: the sparse
    collectives, the compressed reductions, the replicator's primitives. ``label`` ("<op>:<algorithm>") and
    ``facts`` (its bytes, rows, P) name the call in a profiler's trace and on the timeline
    (collectives/trace.py); with neither active they cost one check."""
    if label and trace.RANGES:
        t = tracer()
        if t is not None or trace.profiling():
            # the group's name: the merge pairs the k-th call of a group across ranks (calls of a group run in
            # issue order on every rank)
            fn = trace.traced_call(fn, t, label, facts, async_op, group.group_name)
            if t is not None and async_op:
                return _traced_work(t, submit(group, fn, async_op))
    state = group_state(group)
    fn = state.flight.guard(fn)  # closes the call's flight entries; on failure dumps them (collectives/flight.py)
    with state.lock:
        busy = state.pending > 0
        if async_op or busy:
            if state.executor is None:
                state.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparsync")
            state.pending += 1
            fut = state.executor.submit(fn)
        else:
            fut = None
    if fut is None:
        return fn()

    def _done(_: object) -> None:
        with state.lock:
            state.pending -= 1

    fut.add_done_callback(_done)
    work = Work(fut)
    return work if async_op else work.wait()


def _traced_work(t: trace.Tracer, work: T | Work[T]) -> Work[T]:
    """``work`` whose ``wait()`` shows on the caller's timeline: the time the caller waited for the queue."""
    assert isinstance(work, Work)  # async_op=True

    def waited(t0: float, t1: float) -> None:
        t.complete("wait", "wait", t0, t1)

    return work.on_wait(waited)


def link_state(group: dist.ProcessGroup) -> GroupState:
    """The state that holds ``group``'s link model: its own, or a side group's caller's."""
    state = group_state(group)
    return state if state.parent is None else group_state(state.parent)


def set_link(link: LinkModel | None, *, group: dist.ProcessGroup | None = None) -> None:
    """Set (or, with None, forget) the link model "auto" uses for ``group`` instead of measuring it.

    Call it with the same model on every rank: ranks that hold different models may choose differently.
    """
    link_state(resolve_group(group)).link = link


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


def stop_queues(*, wait: bool = True) -> None:
    """Stop every group's queue thread, joining it with ``wait=True`` (after the queued work ran); with
    ``wait=False`` queued work not yet started is dropped. Part of an orderly teardown before
    ``destroy_process_group``: a gloo group torn down under a live queue thread, or left to interpreter exit,
    aborts the process ("terminate called without an active exception")."""
    for state in list(_STATES.values()):
        with state.lock:
            executor, state.executor = state.executor, None
        if executor is not None:
            executor.shutdown(wait=wait, cancel_futures=not wait)


def set_deterministic(*, group: dist.ProcessGroup | None = None, link: LinkModel = REFERENCE_LINK) -> None:
    """Make "auto" on ``group`` choose from ``link`` (default ``REFERENCE_LINK``) instead of a link measured by
    timing, so that its choices, and with them the summation order, depend on the calls' data only: two runs
    with the same seeds and data give the same bits. Call it on every rank, before the first call.

    Example::

        >>> sparsync.set_deterministic()          # every rank, right after init
        >>> sparsync.allreduce(emb.weight.grad)   # same algorithm, same bits, run after run
    """
    set_link(link, group=group)
