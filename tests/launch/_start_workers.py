"""Ranks for test_start.py: what a rank sees of its launcher (environment, stdout), and its random draws."""

from __future__ import annotations

import os

import numpy as np


def report(rank: int, var: str) -> dict[str, object]:
    """``var`` as this rank's environment has it, a line on stdout, and a draw of numpy's global generator."""
    os.write(1, f"rank {rank} was here\n".encode())
    return {
        "var": os.environ.get(var),
        "draw": int(np.random.randint(1 << 62)),
        "pid": os.getpid(),
        "ppid": os.getppid(),
    }
