"""The same script runs under torchrun: ``launch`` joins torchrun's group instead of spawning."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_example_under_torchrun() -> None:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not found")
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}
    proc = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "3", str(ROOT / "examples" / "sparse_allreduce.py")],
        capture_output=True,
        text=True,
        timeout=170,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("rank ")]
    # One line per torchrun rank (not 4 spawned ranks per torchrun process), every one in a world of 3.
    assert sorted(ln.split(":")[0] for ln in lines) == ["rank 0/3", "rank 1/3", "rank 2/3"]
    outs = {ln.split("-> out ")[1].split(";")[0] for ln in lines}
    assert len(outs) == 1, f"ranks disagree on the result's nnz: {outs}"
