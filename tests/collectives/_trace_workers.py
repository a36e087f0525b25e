"""Workers of test_trace.py: a few small sparsync calls of each kind, under torch.profiler and under
``sparsync.trace``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile

import sparsync
from sparsync import CommLog, SparseStream
from sparsync.compress import TopK


def _calls(rank: int, log: CommLog | None = None) -> None:
    """One call of each kind: auto, a fixed algorithm, async, an allgather, a compressed reduction."""
    g = torch.Generator().manual_seed(rank)
    dim = 1000 * 8
    rows = torch.randperm(1000, generator=g)[:50].sort().values
    s = SparseStream(rows, torch.randn(50 * 8, generator=g), dim, row=8)
    sparsync.sparse_allreduce(s, log=log, timeout=60)
    sparsync.sparse_allreduce(s, algorithm="ssar_split_allgather", log=log, timeout=60)
    sparsync.sparse_allreduce(s, async_op=True, log=log, timeout=60).wait()
    sparsync.sparse_allgather(s, log=log, timeout=60)
    sparsync.compressed_allreduce(torch.randn(512, generator=g), TopK(0.1), log=log, timeout=60)


def profiler_worker(rank: int, out: str) -> list[dict[str, Any]]:
    """The calls under torch.profiler (CPU); the trace's sparsync events, and the records of the same calls."""
    sparsync.set_deterministic()
    _calls(rank)  # warm-up outside the profile (calibration, background group)
    log = CommLog()
    # profile_all_threads: the async call runs on the group's queue thread (docs/profiling.md)
    cfg = _ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], experimental_config=cfg) as prof:
        _calls(rank, log)
    path = Path(out) / f"prof{rank}.json"
    prof.export_chrome_trace(str(path))
    events = sorted(json.loads(path.read_text())["traceEvents"], key=lambda e: e.get("ts", 0))  # threads mixed
    return [{"names": [e["name"] for e in events if str(e.get("name", "")).startswith("sparsync:")],
             "records": [(r.op, r.algorithm, r.world_size) for r in log.records]}]  # fmt: skip


def timeline_worker(rank: int, out: str) -> list[dict[str, Any]]:
    """The calls inside ``sparsync.trace`` over two marked steps; the records of the calls."""
    sparsync.set_deterministic()
    log = CommLog()
    with sparsync.trace(out):
        for step in range(2):
            with sparsync.trace_step(step):
                _calls(rank, log)
    return [r.as_dict() for r in log.records]


def env_worker(rank: int) -> None:
    """One call, traced by SPARSYNC_TRACE alone."""
    s = SparseStream(torch.tensor([rank]), torch.ones(1), 8)
    sparsync.sparse_allreduce(s, algorithm="dense", timeout=60)
