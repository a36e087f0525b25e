"""Runs a script under ``torchrun --standalone`` for the tests of several packages (launch, replicator)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def run_torchrun(script: Path, nprocs: int = 3) -> str:
    """``script`` under ``torchrun --standalone`` as ``nprocs`` processes (the test is skipped without torchrun):
    their stdout, which they share; a non-zero exit fails the test with the end of their stderr."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not found")
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}
    proc = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", str(nprocs), str(script)],
        capture_output=True, text=True, timeout=170, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout
