"""A process's CPU split by thread, for the benchmarks that ask where a step's CPU goes (``scripts/
dlrm_cpu_parts.py``, ``scripts/replicated_groups_cpu.py``): each thread's CPU seconds read from
``/proc/self/task`` (clock ticks, so a reading is exact to 1/``SC_CLK_TCK`` s: read it over many steps), and the
difference of two readings per step by kind of thread (``KINDS``): the calling thread (the model, autograd,
hooks), gloo's transport thread (``gloo_tcp_loop``: the messages of every collective of a group), gloo's work
threads (``pt_gloo_runloop``: where torch's collectives run) and every other thread (Python threads: sparsync's
queue threads)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

KINDS = ("main", "gloo transport", "gloo work", "python")
Reading = dict[int, tuple[str, float]]  # thread id -> (its name, its CPU seconds so far)


def reading() -> Reading:
    """Each thread of this process: its name and CPU seconds so far (user + system)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        out[int(tid)] = (name, (int(rest[11]) + int(rest[12])) / tick)  # utime + stime
    return out


def per_step(before: Reading, after: Reading, steps: int) -> list[float]:
    """CPU seconds per step of each kind of thread (``KINDS``, in order) between two readings, the calling
    thread being the main one."""
    main = threading.get_native_id()
    got = dict.fromkeys(KINDS, 0.0)
    for tid, (name, total) in after.items():
        kind = (
            "main" if tid == main
            else "gloo transport" if name.startswith("gloo_tcp_loop")
            else "gloo work" if name.startswith("pt_gloo_runloop")
            else "python"
        )  # fmt: skip
        got[kind] += total - before.get(tid, (name, 0.0))[1]
    return [got[k] / steps for k in KINDS]
