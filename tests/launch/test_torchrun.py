"""The same script runs under torchrun: ``launch`` joins torchrun's group instead of spawning."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _torchrun import run_torchrun

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_example_under_torchrun() -> None:
    stdout = run_torchrun(ROOT / "examples" / "sparse_allreduce.py", nprocs=4)  # the script's launch(nprocs=4)
    # One report per torchrun rank (not 4 spawned ranks per torchrun process), every one in a world of 4. The
    # four processes share the pipe, so search the text rather than trusting line boundaries.
    reports = re.findall(r"rank (\d+)/(\d+): nnz in \d+ -> out (\d+);", stdout)
    assert sorted((r, w) for r, w, _ in reports) == [(str(r), "4") for r in range(4)], stdout
    outs = {out for _, _, out in reports}
    assert len(outs) == 1, f"ranks disagree on the result's nnz: {outs}"


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_nprocs_other_than_torchruns_world_is_refused(tmp_path: Path) -> None:
    """``launch(nprocs=3)`` under a torchrun world of 2 raises ValueError naming both (it ran fn on 2 ranks,
    silently), before any process group starts."""
    script = tmp_path / "three.py"
    script.write_text(
        "import sparsync\n"
        "def work(rank):\n"
        "    return rank\n"
        "if __name__ == '__main__':\n"
        "    print('ran', sparsync.launch(work, nprocs=3), flush=True)\n"
    )
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not found")
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}
    proc = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "2", str(script)],
        capture_output=True, text=True, timeout=170, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode != 0 and "ran" not in proc.stdout, proc.stdout
    assert "ValueError: launch(nprocs=3) under torchrun, whose world has WORLD_SIZE=2" in proc.stderr, proc.stderr[
        -3000:
    ]


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_under_torchrun_launch_destroys_the_group_it_made(tmp_path: Path) -> None:
    """The README's promise: ``launch`` under torchrun destroys the process group it joined for its function (a
    group left to the interpreter's exit can make gloo abort the process); one the caller made stays theirs."""
    script = tmp_path / "ends.py"
    script.write_text(
        "import sys\n"
        "import torch.distributed as dist\n"
        "import sparsync\n"
        "def work(rank):\n"
        "    return dist.is_initialized()\n"
        "if __name__ == '__main__':\n"
        "    inside = sparsync.launch(work, nprocs=2)[0]\n"
        "    sys.stdout.write(f'made {inside} {dist.is_initialized()}\\n')  # one write: the ranks share stdout\n"
        "    dist.init_process_group('gloo')\n"
        "    sparsync.launch(work, nprocs=2)\n"
        "    sys.stdout.write(f'given {dist.is_initialized()}\\n')\n"
        "    dist.destroy_process_group()\n"
    )
    out = run_torchrun(script, nprocs=2)
    assert out.count("made True False") == 2, out
    assert out.count("given True") == 2, out


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_under_torchrun_launch_runs_again_in_the_same_script(tmp_path: Path) -> None:
    """Several ``launch`` calls in one torchrun script, each making and destroying its group, then a group of
    the caller's: each call's group is fresh and sums right. Before each call had store keys of its own, a later
    group read the earlier one's peer addresses (gloo's connectFullMesh refused, or a hang): 2 of 3 runs."""
    script = tmp_path / "again.py"
    script.write_text(
        "import sys\n"
        "import torch, torch.distributed as dist\n"
        "import sparsync\n"
        "def work(rank, n):\n"
        "    t = torch.tensor([float(rank + n)])\n"
        "    dist.all_reduce(t)\n"
        "    return float(t)\n"
        "if __name__ == '__main__':\n"
        "    sums = [sparsync.launch(work, nprocs=2, args=(n,), timeout=30)[0] for n in range(6)]\n"
        "    dist.init_process_group('gloo')\n"
        "    t = torch.ones(1)\n"
        "    dist.all_reduce(t)\n"
        "    sys.stdout.write(f'sums {sums} {float(t)}\\n')  # one write: the ranks share stdout\n"
        "    dist.destroy_process_group()\n"
    )
    out = run_torchrun(script, nprocs=2)
    assert out.count("sums [1.0, 3.0, 5.0, 7.0, 9.0, 11.0] 2.0") == 2, out
