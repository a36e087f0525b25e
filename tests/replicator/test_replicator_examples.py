"""The replicator examples run end to end and learn (slow: `-m large`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(name: str) -> str:
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name)], capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.large
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_examples() -> None:
    out = _run("replicator_digits_cnn.py")
    accs = [float(a) for a in re.findall(r"test accuracy (\d\.\d+)", out)]
    assert len(accs) == 4 and min(accs) > 0.9, out
    out = _run("replicator_batch_norm.py")
    diff = float(re.search(r"largest parameter difference after \d+ steps: (\S+)", out).group(1))  # type: ignore[union-attr]
    assert diff < 1e-5, out
    out = _run("replicator_multi_loss.py")
    means = [float(m) for m in re.findall(r"generated mean (-?\d+\.\d+)", out)]
    assert len(means) == 4 and all(abs(m - 3.0) < 0.5 for m in means), out
    out = _run("dlrm_hybrid.py")
    ratio = float(re.search(r"sends (\d+\.\d+)x fewer bytes", out).group(1))  # type: ignore[union-attr]
    assert ratio > 7.0, out
    # DCT-DP (Threshold + error feedback) on the dense layers still trains: the loss falls in both runs.
    losses = [(float(a), float(b)) for a, b in re.findall(r"loss (\d\.\d+) -> (\d\.\d+)", out)]
    assert len(losses) == 2 and all(b < a for a, b in losses), out
