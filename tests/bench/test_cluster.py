"""Emulated hosts under torchrun (netns marker, root): ``sparsync cluster``'s engine runs unchanged
scripts as 2 hosts x 2 ranks, with the same results as local runs; an elastic restart resumes bit for bit."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_netem import CAN_NETNS
from test_readme import BLOCKS

from sparsync_bench.cluster import run_cluster
from sparsync_bench.netem import NetSpec

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.netns,
    pytest.mark.multiprocess,
    pytest.mark.timeout(400),
    pytest.mark.skipif(not CAN_NETNS, reason="needs root and ip/tc to create network namespaces"),
]
NET = NetSpec("1gbit")


def _cluster(argv: list[str], cwd: Path, max_restarts: int = 0) -> list[str]:
    res = run_cluster(
        argv, hosts=2, procs_per_host=2, net=NET, timeout=300, echo=None, cwd=cwd, max_restarts=max_restarts
    )
    text = "\n".join(res.text(h) for h in range(2))
    assert res.ok, f"exit statuses {res.returncodes}:\n{text[-4000:]}"
    return [res.text(0), res.text(1)]


def test_topology_and_hierarchical_allreduce_under_torchrun(tmp_path: Path) -> None:
    out = _cluster([str(ROOT / "tests" / "bench" / "_cluster_script.py")], tmp_path)
    found = {}
    for host, text in enumerate(out):
        # (True|False): two processes of a host share its stdout, and their lines can run together
        for m in re.finditer(r"rank (\d): node (\d) local (\d) host (\d)/2 local (\d)/2 exact (True|False)", text):
            rank, node, local, thost, tlocal, exact = m.groups()
            found[int(rank)] = (host, int(node), int(local), int(thost), int(tlocal), exact)
    assert sorted(found) == [0, 1, 2, 3], out
    for rank, (host, node, local, thost, tlocal, exact) in found.items():
        assert node == host == thost and local == tlocal, (rank, found[rank])
        assert exact == "True", (rank, found[rank])


def _copies(token: str) -> list[str]:
    """``token`` as k copies of its shortest repeating unit (``"1.51.5"`` -> ``["1.5", "1.5"]``)."""
    n = len(token)
    p = next(p for p in range(1, n + 1) if n % p == 0 and token == token[:p] * (n // p))
    return [token[:p]] * (n // p)


def test_copies_splits_interleaved_prints() -> None:
    assert _copies("1.39139282703399661.3913928270339966") == ["1.3913928270339966"] * 2
    assert _copies("1.11") == ["1.11"] and _copies("0.5") == ["0.5"]


def _readme_on_two_hosts_and_alone(
    tmp_path: Path, marker: str, one: tuple[str, str]
) -> tuple[list[float], float, list[str]]:
    """The python block of the README or its guide pages (``test_readme.BLOCKS``) that holds ``marker``, run as
    2 hosts x 2 ranks: the numbers its processes print (rank by rank), then the last number it prints as one
    process (``one``: the replacement that makes it one), and the hosts' output."""
    block = next(b for _, _, b in BLOCKS if marker in b)
    script = tmp_path / "readme.py"
    script.write_text(block)
    out = _cluster([str(script)], tmp_path)
    # Two processes of a host share its stdout, and print() writes a value and its newline in two calls, so
    # their lines can interleave as "vv\n\n": every process prints the same value, so a token is k copies.
    printed = [float(x) for tok in re.findall(r"^([-\d.e]+)$", "\n".join(out), re.M) for x in _copies(tok)]
    alone_script = tmp_path / "one.py"
    alone_script.write_text(block.replace(*one))
    alone = subprocess.run(
        [sys.executable, str(alone_script)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert alone.returncode == 0, alone.stderr[-3000:]
    return printed, float(alone.stdout.split()[-1]), out


def test_readme_replicator_example_on_two_hosts_equals_one_process(tmp_path: Path) -> None:
    losses, alone, out = _readme_on_two_hosts_and_alone(
        tmp_path, "PER_WORKER", ("num_replicas=4", "num_replicas=1")
    )
    assert len(losses) == 4, out  # one line per torchrun process
    # Two hosts run input_fn each (PER_WORKER) and split its batch over their 2 replicas: the mean gradient over
    # the 4 replicas is the full batch's, as in one process.
    assert losses == pytest.approx([alone] * 4, rel=1e-4)


def test_readme_hybrid_example_on_two_hosts_equals_one_process(tmp_path: Path) -> None:
    norms, alone, out = _readme_on_two_hosts_and_alone(tmp_path, "node_servers() as", ("nprocs=4", "nprocs=1"))
    assert len(norms) == 4 and len(set(norms)) == 1, out  # every rank holds the same dense weights
    # 4 ranks on 2 nodes, each node's server started by its local rank 0, pushes summed per node (local
    # aggregation from LOCAL_WORLD_SIZE): the mean gradient of the 4 shares is the full batch's, as in 1 process.
    assert norms[0] == pytest.approx(alone, rel=1e-4)


def _final(text: str) -> list[tuple[str, str, str, str]]:
    return re.findall(r"rank (\d): attempt (\d+) resumed at step (\d+), loss [-\d.]+, params ([0-9a-f]{16})", text)


@pytest.mark.large  # 35 s: `-m large` (CI time), as the plain elastic restart test
def test_elastic_hybrid_restart_resumes_servers_and_residuals_bit_for_bit(tmp_path: Path) -> None:
    example = str(ROOT / "examples" / "elastic_hybrid.py")
    out = _cluster([example, str(tmp_path / "killed"), "--kill-rank", "3", "--kill-step", "5"], tmp_path,
                   max_restarts=2)  # fmt: skip
    final = _final("\n".join(out))
    assert sorted(int(r) for r, *_ in final) == [0, 1, 2, 3], out
    assert all(int(s) == 5 for _, _, s, _ in final), final  # servers and workers resumed at the kill's step
    # The uninterrupted run: the same 2 nodes x 2 ranks (local aggregation alike), as local processes.
    clean = subprocess.run([sys.executable, example, str(tmp_path / "clean")], cwd=tmp_path, capture_output=True,
                           text=True, timeout=300)  # fmt: skip
    assert clean.returncode == 0, clean.stderr[-3000:]
    want = {p for *_, p in _final(clean.stdout)}
    assert len(want) == 1 and {p for *_, p in final} == want, (final, clean.stdout)


@pytest.mark.large  # by hand (`-m large`): the hybrid restart above covers it and more, in CI time
def test_elastic_restart_resumes_bit_for_bit(tmp_path: Path) -> None:
    example = str(ROOT / "examples" / "elastic_restart.py")
    out = _cluster([example, str(tmp_path / "killed"), "--kill-rank", "3", "--kill-step", "5"], tmp_path,
                   max_restarts=2)  # fmt: skip
    text = "\n".join(out)
    final = _final(text)
    assert sorted(int(r) for r, *_ in final) == [0, 1, 2, 3], text
    # Every rank restarted from a checkpoint; torchrun counts the restart (TORCHELASTIC_RESTART_COUNT) on the
    # killed rank's host only: the other host's workers restart on the membership change.
    assert all(int(s) >= 1 for _, _, s, _ in final), final
    assert {int(a) for r, a, _, _ in final if r in "23"} == {1}, final
    clean = subprocess.run([sys.executable, example, str(tmp_path / "clean")], cwd=tmp_path, capture_output=True,
                           text=True, timeout=300)  # fmt: skip
    assert clean.returncode == 0, clean.stderr[-3000:]
    want = set(re.findall(r"params ([0-9a-f]{16})", clean.stdout))
    assert len(want) == 1 and {p for *_, p in final} == want, (final, clean.stdout)
