"""``sparsync cluster`` and ``run_cluster`` refuse bad arguments before making anything (no root needed)."""

from __future__ import annotations

import pytest

from sparsync_bench.cli import main
from sparsync_bench.cluster import run_cluster, torchrun_argv
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
