"""``sparsync cluster`` and ``run_cluster`` refuse bad arguments before making anything, and give each host its
environment (no root needed)."""

from __future__ import annotations

import pytest

from sparsync_bench import cluster
from sparsync_bench.cli import main
from sparsync_bench.cluster import rank_threads, run_cluster, torchrun_argv
from sparsync_bench.netem import NetSpec


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"argv": []}, "nothing to run"),
        ({"hosts": 0}, "hosts and procs_per_host must be >= 1, got 0 and 2"),
        ({"procs_per_host": 0}, "hosts and procs_per_host must be >= 1, got 2 and 0"),
        ({"max_restarts": -1}, "max_restarts must be >= 0, got -1"),
    ],
)
def test_run_cluster_refuses(kw: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"argv": ["x.py"], "hosts": 2, "procs_per_host": 2, "net": NetSpec("1gbit"), **kw}
    with pytest.raises(ValueError, match=match):
        run_cluster(**args)  # type: ignore[arg-type]


def test_torchrun_command_line_of_a_host() -> None:
    cmd = torchrun_argv(["train.py", "--lr", "0.1"], host=1, hosts=3, procs_per_host=4, endpoint="10.9.0.1:29400",
                        run_id="r", address="10.9.0.2", max_restarts=3)  # fmt: skip
    text = " ".join(cmd)
    for part in ("--nnodes 3", "--nproc-per-node 4", "--rdzv-backend c10d", "--rdzv-endpoint 10.9.0.1:29400",
                 "--rdzv-conf is_host=0", "--local-addr 10.9.0.2", "--max-restarts 3"):  # fmt: skip
        assert part in text, (part, text)
    assert cmd[-3:] == ["train.py", "--lr", "0.1"]


def test_cli_cluster_needs_a_link(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cluster", "--net", "", "--", "x.py"]) == 2
    assert "--net is required" in capsys.readouterr().out


def test_ranks_share_the_cores_unless_the_user_says_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each emulated rank gets cores / ranks intra-op threads (torchrun sets none with one rank per host), and a
    user's OMP_NUM_THREADS wins: the environment run_cluster gives a host."""
    assert rank_threads(4, cores=2) == 1 and rank_threads(4, cores=16) == 4 and rank_threads(3, cores=16) == 5
    seen: list[dict[str, str]] = []

    class StopError(Exception):
        pass

    def popen(cmd: list[str], **kw: object) -> None:
        seen.append(dict(kw["env"]))  # type: ignore[call-overload]
        raise StopError

    class NoNet:
        def __init__(self, *a: object) -> None:
            pass

        def __enter__(self) -> NoNet:
            return self

        def __exit__(self, *a: object) -> None:
            pass

        def address(self, i: int) -> str:
            return f"10.0.0.{i + 1}"

        def ifname(self, i: int) -> str:
            return f"v{i}"

        def namespace(self, i: int) -> str:
            return f"ns{i}"

    monkeypatch.setattr(cluster, "NetNamespaces", NoNet)
    monkeypatch.setattr(cluster.subprocess, "Popen", popen)
    monkeypatch.setattr(cluster, "_stop", lambda procs, namespaces: None)
    monkeypatch.setattr(cluster.os, "cpu_count", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with pytest.raises(StopError):
        run_cluster(["x.py"], hosts=4, procs_per_host=1, net=NetSpec("1gbit"), echo=None)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    with pytest.raises(StopError):
        run_cluster(["x.py"], hosts=4, procs_per_host=1, net=NetSpec("1gbit"), echo=None)
    assert [e["OMP_NUM_THREADS"] for e in seen] == ["2", "3"]
