"""Where sparsync's time goes, in the tools people look with: ``torch.profiler`` ranges and a per-rank timeline.

**Profiler ranges.** Every call runs inside a ``record_function`` range ``sparsync:<op>:<algorithm>`` (the
algorithm asked for; ``auto`` opens a nested ``sparsync:<op>:<chosen>`` once it chose), every named phase of
a ``Comm`` inside ``sparsync:<op>:<phase>``, compressors' steps inside ``sparsync:<op>:compress`` /
``decompress``. ``record_function`` takes an ``args`` string, but torch 2.13's trace export drops it (checked:
the exported event carries an empty input), so a call's facts (bytes, rows, P, auto's choice and prediction)
follow its name after a space: ``sparsync:sparse_allreduce:auto bytes=4096 rows=128 P=4``; phases keep bare
names so ``key_averages()`` sums them across calls. They cost one C call per call and per phase when no
profiler is active (``profiling()``); ``SPARSYNC_RANGES=0`` compiles them out, for measuring that cost
(docs/profiling.md).

**Timeline.** A ``Tracer`` keeps one rank's events (trace-event format: "X" complete events, µs since the
tracer started) and writes them as one Chrome-trace / Perfetto JSON file per rank; ``sparsync trace merge``
puts the ranks on one clock. The running call's ``CallSpan`` sits in a ContextVar of the thread that runs it
(the caller's, or the group's queue thread), so a ``Comm`` finds the call it belongs to without an argument
through every algorithm.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ENV = "SPARSYNC_TRACE"  # a directory: every rank writes its timeline there (rank<r>.json)
# Read once at import: "0" removes the ranges and the tracer's hooks from every call (the baseline the
# overhead benchmark compares against). A constant, not a switch to flip at run time.
RANGES = os.environ.get("SPARSYNC_RANGES", "1") != "0"
MAX_EVENTS = 2_000_000  # a rank's timeline stops growing here (the count of dropped events is written)


def profiling() -> bool:
    """Whether a ``torch.profiler`` (or the autograd profiler) records in this process: one module attribute
    read. Not ``torch._C._autograd._profiler_enabled()``: it is per thread (false on the queue thread) and
    false everywhere under ``profile_all_threads=True``, which records every thread's ranges."""
    return RANGES and bool(torch.autograd.profiler._is_profiler_enabled)


def describe(**facts: object) -> str:
    """``k=v`` pairs for a range's name suffix and args, leaving out empty ones."""
    return " ".join(f"{k}={v}" for k, v in facts.items() if v is not None and v != "")


@contextmanager
def profiler_range(name: str, facts: str = "") -> Iterator[None]:
    """A ``record_function`` range named ``name`` (+ ``facts`` after a space), while a profiler records."""
    if not profiling():
        yield
        return
    with torch.autograd.profiler.record_function(f"{name} {facts}" if facts else name, facts or None):
        yield


class Tracer:
    """One rank's timeline: events in memory, written by ``write()`` as one trace-event JSON object
    (``{"traceEvents": [...], "otherData": {...}}``). Thread-safe: the caller's thread, the group's queue
    thread and the parameter-server client's I/O thread all add events.

    ``clock``: ``"barrier"`` when ``perf0`` was read as every rank left one barrier (``sparsync.trace``), so the
    ranks' zeros are one instant; ``"wall"`` when each rank started alone (``SPARSYNC_TRACE``): the merge then
    aligns the ranks by ``time.time()`` read with ``perf0`` (exact on one host, NTP's accuracy across hosts).
    """

    def __init__(self, directory: str | os.PathLike[str], rank: int, world_size: int, clock: str = "wall") -> None:
        if clock not in ("wall", "barrier"):
            raise ValueError(f"clock must be 'wall' or 'barrier', got {clock!r}")
        self.path = Path(directory) / f"rank{rank}.json"
        self.rank, self.world_size, self.clock = rank, world_size, clock
        self.wall0, self.perf0 = time.time(), time.perf_counter()
        self.dropped = 0
        self._events: list[dict[str, Any]] = []
        self._threads: dict[int, str] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)

    def us(self, t: float) -> float:
        """``time.perf_counter()`` value ``t`` as µs on this timeline."""
        return round((t - self.perf0) * 1e6, 3)

    def next_id(self) -> int:
        return next(self._ids)

    def _add(self, event: dict[str, Any], tid: int | None = None) -> None:
        if tid is None:
            tid = threading.get_native_id()
            if tid not in self._threads:
                self._threads[tid] = threading.current_thread().name
        event["pid"], event["tid"] = self.rank, tid
        with self._lock:
            if len(self._events) >= MAX_EVENTS:
                self.dropped += 1
                return
            self._events.append(event)

    def complete(self, name: str, cat: str, t0: float, t1: float, args: dict[str, Any] | None = None) -> None:
        """An "X" event on the calling thread from ``t0`` to ``t1`` (``perf_counter`` seconds)."""
        ts = self.us(t0)
        self._add({"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": max(0.0, self.us(t1) - ts),
                   "args": args or {}})  # fmt: skip

    def async_span(self, name: str, cat: str, t0: float, t1: float, tid: int, args: dict[str, Any]) -> None:
        """A "b"/"e" pair (nestable async events): requests in flight overlap, which "X" events on one thread
        may not. ``tid``: the thread that issued it."""
        ident = self.next_id()
        self._add({"name": name, "cat": cat, "ph": "b", "id": ident, "ts": self.us(t0), "args": args}, tid)
        self._add({"name": name, "cat": cat, "ph": "e", "id": ident, "ts": self.us(t1), "args": {}}, tid)

    def flow(self, phase: str, ident: int, t: float) -> None:
        """One end of an arrow (``phase`` "s" where async work was issued, "f" where it ran)."""
        event: dict[str, Any] = {"name": "issue", "cat": "flow", "ph": phase, "id": ident, "ts": self.us(t)}
        if phase == "f":
            event["bp"] = "e"  # binds to the enclosing slice: the queued call
        self._add(event)

    def to_json(self) -> dict[str, Any]:
        with self._lock:
            events = list(self._events)
            threads = dict(self._threads)
        meta: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0, "args": {"name": f"rank {self.rank}"}}
        ]
        meta += [
            {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": name}}
            for tid, name in threads.items()
        ]
        return {
            "traceEvents": meta + events,
            "displayTimeUnit": "ms",
            "otherData": {
                "sparsync_rank": self.rank,
                "world_size": self.world_size,
                "clock": self.clock,
                "wall_time_at_zero": self.wall0,  # time.time() read with perf0 (merge: "wall" clock)
                "dropped_events": self.dropped,
            },
        }

    def write(self) -> Path:
        """Write the timeline (atomically: a reader never sees half a file); returns its path."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_json()))
        tmp.replace(self.path)
        return self.path


@dataclass
class CallSpan:
    """One call on the timeline while it runs: the ``Comm``s it made add their traffic, ``Comm.running``
    the algorithm auto chose and its ``Decision``."""

    tracer: Tracer | None  # None: only profiler ranges
    op: str
    algorithm: str
    args: dict[str, Any]
    traffic: list[Any] = field(default_factory=list)  # every Comm's Traffic, once each
    decision: Any = None

    def add_traffic(self, traffic: Any) -> None:
        if all(t is not traffic for t in self.traffic):
            self.traffic.append(traffic)

    def event_args(self, seconds: float) -> dict[str, Any]:
        out = dict(self.args)
        out["algorithm"] = self.algorithm
        out["bytes_sent"] = sum(t.bytes_sent for t in self.traffic)
        out["bytes_recv"] = sum(t.bytes_recv for t in self.traffic)
        out["messages"] = sum(t.messages for t in self.traffic)
        out["measured_ms"] = round(seconds * 1e3, 4)
        d = self.decision
        if d is not None:
            out["auto_choice"] = d.algorithm
            out["predicted_ms"] = round(d.predictions[d.algorithm] * 1e3, 4)
            out["predictions_ms"] = {k: round(v * 1e3, 4) for k, v in d.predictions.items()}
        return out


# The call running on this thread (None outside a traced call). A ContextVar, not an argument: a Comm is made
# deep inside each algorithm, and every thread (caller, queue) has its own value.
CURRENT: ContextVar[CallSpan | None] = ContextVar("sparsync_call_span", default=None)


def traced_call(
    fn: Callable[[], Any],
    tracer: Tracer | None,
    label: str,
    facts: Callable[[], dict[str, Any]] | None,
    async_op: bool,
    group: str = "",
) -> Callable[[], Any]:
    """``fn`` inside the call's profiler range and, with a ``tracer``, on its timeline (``label``:
    "<op>:<algorithm asked for>"; ``facts``: the call's size, evaluated once; ``group``: the name of the group
    whose order the call takes, on the timeline only). For an async call, an arrow from the issuing thread to
    the queue thread that runs it."""
    info = facts() if facts is not None else {}
    flow = 0
    if tracer is not None and async_op:
        flow = tracer.next_id()
        tracer.flow("s", flow, time.perf_counter())
    op, _, algorithm = label.partition(":")

    def run() -> Any:
        span = CallSpan(tracer, op, algorithm, info)
        with profiler_range(f"sparsync:{label}", describe(**info)):
            token = CURRENT.set(span)
            t0 = time.perf_counter()
            try:
                return fn()
            finally:
                t1 = time.perf_counter()
                CURRENT.reset(token)
                if tracer is not None:
                    args = {"group": group, **span.event_args(t1 - t0)}
                    tracer.complete(f"{op}:{span.algorithm}", "call", t0, t1, args)
                    if flow:
                        tracer.flow("f", flow, t0)

    return run


@contextmanager
def scope(tracer: Tracer | None, op: str, name: str, **facts: object) -> Iterator[None]:
    """A step outside any ``Comm`` (a compressor's compress or decompress, a training step): a profiler range
    ``sparsync:<op>:<name>`` and, with a ``tracer``, an "X" event on this thread."""
    if not RANGES or (tracer is None and not profiling()):
        yield
        return
    t0 = time.perf_counter()
    with profiler_range(f"sparsync:{op}:{name}", describe(**facts)):
        yield
    if tracer is not None:
        tracer.complete(name, op, t0, time.perf_counter(), {k: v for k, v in facts.items() if v is not None})
