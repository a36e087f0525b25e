"""Rank pid files, for the tests that kill ranks or their launcher (test_faults, test_errors) and for
scripts/fault_probe.py: each rank writes its pid, the test reads them all and asks which processes still run.
Standard library only (the probe imports it while measuring older sparsync checkouts); module-level, so spawned
ranks can unpickle ``sleep_forever``."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sparsync.replicator import ReplicaContext


def write_pid(pid_dir: str, rank: int) -> None:
    """``rank{rank}.pid`` in ``pid_dir``: written whole, then renamed, so no reader sees a half-written pid."""
    tmp = Path(pid_dir) / f".rank{rank}.pid"
    tmp.write_text(str(os.getpid()))
    tmp.rename(Path(pid_dir) / f"rank{rank}.pid")


def read_pids(pid_dir: str | Path, n: int) -> list[int] | None:
    """The pids of ranks 0 to ``n`` - 1 (``write_pid``), or None while one of them has not written it."""
    files = [Path(pid_dir) / f"rank{r}.pid" for r in range(n)]
    return [int(f.read_text()) for f in files] if all(f.exists() for f in files) else None


def running(pid: int) -> bool:
    """The process exists and is not a zombie (a zombie has exited; only its parent has not reaped it)."""
    try:
        state = re.search(r"^State:\s+(\S)", Path(f"/proc/{pid}/status").read_text(), re.M)
    except OSError:
        return False
    return state is not None and state.group(1) != "Z"


def sleep_forever(rank: int, pid_dir: str) -> int:
    """A rank that is busy (sleeping, two minutes at most) until it is killed; its launcher is the one killed."""
    write_pid(pid_dir, rank)
    for _ in range(600):
        time.sleep(0.2)
    return rank


def replica_sleep_forever(ctx: ReplicaContext, pid_dir: str) -> int:
    """``sleep_forever`` as a Replicator's function."""
    return sleep_forever(ctx.replica_id, pid_dir)
