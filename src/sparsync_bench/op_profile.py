"""``SPARSYNC_PROFILE=<dir>``: rank 0's ``torch.profiler`` operator table of a ``bench dlrm`` method's timed
steps, for every method (sparsync's in ``dlrm_train``, torchrec's in ``torchrec_runner``), so that both
systems' steps can be read op by op side by side; ``allocation_peak``: the most bytes a call's torch allocations
held at once. Imports torch only: torchrec's environment runs it too."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.profiler import ProfilerActivity, profile, schedule

PROFILE_ENV = "SPARSYNC_PROFILE"  # a directory: <method>_rank0.txt per method


def step_profiler(method: str, rank: int, warmup: int, steps: int) -> Any:
    """With ``PROFILE_ENV`` set, on rank 0: a started ``torch.profiler`` over the steps after ``warmup`` (call
    its ``step()`` after each step, ``stop()`` after the last) that writes its operator table (self CPU time,
    the top 40) to ``<dir>/<method>_rank0.txt``; else None. The profiler slows the steps it records: a profiled
    run's times are not the benchmark's."""
    directory = os.environ.get(PROFILE_ENV, "")
    if not directory or rank != 0:
        return None

    def write(prof: Any) -> None:
        os.makedirs(directory, exist_ok=True)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
        with open(os.path.join(directory, f"{method}_rank0.txt"), "w") as f:
            f.write(table)

    p = profile(activities=[ProfilerActivity.CPU], on_trace_ready=write,
                schedule=schedule(wait=warmup, warmup=1, active=max(1, steps - warmup - 1), repeat=1))  # fmt: skip
    p.start()
    return p


def allocation_peak(fn: Callable[[], object]) -> int:
    """The most bytes ``fn``'s CPU allocations held at once: torch's profiler records every allocation and free
    (its trace's ``[memory]`` events, with their sizes and addresses), summed in time order. A free on another
    thread (gloo's, which drops a finished collective's tensors) is not in the trace: an address allocated again
    while still live was freed in between."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = [e for e in json.loads(Path(f.name).read_text())["traceEvents"] if e.get("name") == "[memory]"]
    live: dict[int, int] = {}
    total = top = 0
    for e in sorted(events, key=lambda e: e["ts"]):
        addr, change = e["args"]["Addr"], e["args"]["Bytes"]
        if change > 0:
            total -= live.pop(addr, 0)  # its free was not recorded
            live[addr] = change
        else:
            live.pop(addr, None)
        total += change
        top = max(top, total)
    return top
