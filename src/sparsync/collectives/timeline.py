"""This process's timeline (``tracer``) and its public entry points: ``sparsync.trace(dir)`` and
``sparsync.trace_step(n)``.

The tracer is held by the world group's state (``group.GroupState.tracer``), not by a module global: it is one
per process and per group lifetime, as the timeline file it writes, and the threads that add events (the
caller's, the group's queue thread, the parameter-server client's I/O thread) all reach it through the group.
"""

from __future__ import annotations

import atexit
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from sparsync.collectives import trace as events
from sparsync.collectives.group import group_state, resolve_group


def tracer() -> events.Tracer | None:
    """This process's timeline, or None: the one ``sparsync.trace`` set, else one started at the first call
    when ``SPARSYNC_TRACE`` names a directory (each rank alone: "wall" clock; written at exit, by ``launch``
    and by ``write_trace``). Held by the world group's state (see ``GroupState.tracer``)."""
    if not events.RANGES or not dist.is_available() or not dist.is_initialized():
        return None
    world = dist.group.WORLD
    if world is None:
        return None
    state = group_state(world)
    if state.tracer is None and not state.trace_env_checked:
        state.trace_env_checked = True
        directory = os.environ.get(events.ENV, "")
        if directory:
            state.tracer = events.Tracer(directory, dist.get_rank(), dist.get_world_size())
            atexit.register(state.tracer.write)
    return state.tracer


def set_tracer(t: events.Tracer | None) -> events.Tracer | None:
    """Make ``t`` this process's timeline (None: none); returns the one it replaces."""
    state = group_state(resolve_group(None))
    state.trace_env_checked = True  # an explicit choice wins over SPARSYNC_TRACE
    old, state.tracer = state.tracer, t
    return old


def write_trace() -> Path | None:
    """Write this process's timeline now (``SPARSYNC_TRACE``'s is otherwise written at exit); its path."""
    t = tracer()
    return t.write() if t is not None else None


@contextmanager
def trace(directory: str | os.PathLike[str]) -> Iterator[events.Tracer]:
    """Record this rank's sparsync calls, their phases, async waits, compressor steps and parameter-server
    requests, and write them to ``directory/rank<r>.json`` (Chrome trace-event format; open it in Perfetto or
    merge the ranks with ``sparsync trace merge DIR``) when the block ends.

    Collective over the world: every rank enters it. The ranks leave one barrier before the timeline starts,
    so their zeros are one instant (the merge needs no wall clock). Calls still queued when the block ends
    are not in the file. ``SPARSYNC_TRACE=DIR`` traces a whole run without code (each rank's own wall clock).

    Example::

        >>> with sparsync.trace("traces"):
        ...     for step, batch in enumerate(loader):
        ...         with sparsync.trace_step(step):
        ...             train_step(batch)
        $ sparsync trace merge traces      # traces/merged.json, traces/slowest_step.png
    """
    world = resolve_group(None)
    dist.barrier(group=world)
    t = events.Tracer(directory, dist.get_rank(), dist.get_world_size(), clock="barrier")
    previous = set_tracer(t)
    try:
        yield t
    finally:
        set_tracer(previous)
        t.write()


@contextmanager
def trace_step(step: int) -> Iterator[None]:
    """Mark one training step on the timeline (the merge draws the slowest step) and in a profiler's trace
    (``sparsync:step:<step>``). Free when neither records."""
    t = tracer()
    if t is None and not events.profiling():
        yield
        return
    t0 = time.perf_counter()
    with events.profiler_range(f"sparsync:step:{step}"):
        yield
    if t is not None:
        t.complete(f"step {step}", "step", t0, time.perf_counter(), {"step": step})
