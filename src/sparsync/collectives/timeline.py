"""The timeline's public entry points: ``sparsync.trace(dir)`` and ``sparsync.trace_step(n)``.

The tracer is held by the world group's state (``group.GroupState.tracer``), not by a module global: it is one
per process and per group lifetime, as the timeline file it writes, and the threads that add events (the
caller's, the group's queue thread, the parameter-server client's I/O thread) all reach it through the group.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from sparsync.collectives import trace as events
from sparsync.collectives.group import resolve_group, set_tracer, tracer


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
