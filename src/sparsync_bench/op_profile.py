"""``SPARSYNC_PROFILE=<dir>``: rank 0's ``torch.profiler`` operator table of a ``bench dlrm`` method's timed
steps, for every method (sparsync's in ``dlrm_train``, torchrec's in ``torchrec_runner``), so that both
systems' steps can be read op by op side by side. Imports torch only: torchrec's environment runs it too."""

from __future__ import annotations

import os
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
