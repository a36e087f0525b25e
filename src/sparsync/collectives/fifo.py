"""Each group's FIFO queue: every sparsync operation of a group runs through ``submit``, now or (async) on the
group's queue thread, in issue order on every rank; ``stop_queues`` ends the threads.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch.distributed as dist

from sparsync.collectives import trace
from sparsync.collectives.failure import guard
from sparsync.collectives.group import group_state, states
from sparsync.collectives.timeline import tracer
from sparsync.handle import Work

T = TypeVar("T")


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
    fn = guard(state.flight, fn)  # closes the call's flight entries; on failure dumps them (collectives/flight.py)
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


def stop_queues(*, wait: bool = True) -> None:
    """Stop every group's queue thread, joining it with ``wait=True`` (after the queued work ran); with
    ``wait=False`` queued work not yet started is dropped. Part of an orderly teardown before
    ``destroy_process_group``: a gloo group torn down under a live queue thread, or left to interpreter exit,
    aborts the process ("terminate called without an active exception")."""
    for _, state in states():
        with state.lock:
            executor, state.executor = state.executor, None
        if executor is not None:
            executor.shutdown(wait=wait, cancel_futures=not wait)
