"""The same script runs under torchrun: ``launch`` joins torchrun's group instead of spawning."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_example_under_torchrun() -> None:
    stdout = run_torchrun(ROOT / "examples" / "sparse_allreduce.py")
    # One report per torchrun rank (not 4 spawned ranks per torchrun process), every one in a world of 3. The
    # three processes share the pipe, so search the text rather than trusting line boundaries.
    reports = re.findall(r"rank (\d+)/(\d+): nnz in \d+ -> out (\d+);", stdout)
    assert sorted((r, w) for r, w, _ in reports) == [("0", "3"), ("1", "3"), ("2", "3")], stdout
    outs = {out for _, _, out in reports}
    assert len(outs) == 1, f"ranks disagree on the result's nnz: {outs}"
