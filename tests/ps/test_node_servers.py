"""Parameter servers per node started by the job itself (``node_servers``), on emulated nodes
(``launch(procs_per_host=)``, loopback): one starter per node, every address known to every rank, each rank's
own key admitted and a stranger's refused, a failed start reported on every rank; ``procs_per_machine`` from
torchrun's ``LOCAL_WORLD_SIZE``."""

from __future__ import annotations

from pathlib import Path

import _node_workers as nw
import pytest

from sparsync import launch
from sparsync.hybrid import HybridConfig
from sparsync.ps import node_servers
from sparsync.ps.nodes import procs_per_machine_from_env

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


@pytest.mark.parametrize(("world", "per_host", "per_node"), [(1, 1, 1), (4, 2, 1), (6, 3, 2)])
def test_one_starter_per_node_and_every_rank_knows_every_server(world: int, per_host: int, per_node: int) -> None:
    results = launch(nw.serve_worker, nprocs=world, args=(per_node,), procs_per_host=per_host)
    nodes = world // per_host
    want = [[float(r)] * 3 for r in range(world) for _ in range(4)]
    for rank, r in enumerate(results):
        assert r["addresses"] == results[0]["addresses"] and len(r["addresses"]) == nodes * per_node
        assert (r["node"], r["nodes"]) == (rank // per_host, nodes)
        node = rank // per_host
        starts = rank % per_host == 0
        assert r["started"] == ([node * per_node + i for i in range(per_node)] if starts else []), (rank, r)
        assert r["table"] == want, rank  # written by every rank through every server, read back by each
    assert results[0]["refused"], "a client key that is not one of the job's ranks' was admitted"
    assert len({p for r in results for p in r["pids"]}) == nodes * per_node


def test_a_server_that_fails_to_start_is_reported_on_every_rank(tmp_path: Path) -> None:
    nw.write_corrupt_checkpoint(tmp_path / "server1.npz")
    results = launch(nw.failing_worker, nprocs=4, args=(str(tmp_path),), procs_per_host=2)
    assert all("failed to start on node(s)" in r and "{1:" in r for r in results), results
    assert all("{0:" not in r for r in results), results  # node 0 started; it is not blamed


def test_trainer_takes_procs_per_machine_from_local_world_size() -> None:
    results = launch(nw.trainer_worker, nprocs=4, procs_per_host=2)
    assert [(r["ppm"], r["local_agg"], r["machine"]) for r in results] == [(2, True, 0)] * 2 + [(2, True, 1)] * 2
    assert all(r["table"] == results[0]["table"] for r in results)


def test_local_world_size_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert procs_per_machine_from_env() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert procs_per_machine_from_env() == 8
    for bad in ("0", "two"):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", bad)
        with pytest.raises(ValueError, match=f"LOCAL_WORLD_SIZE must be .*{bad}"):
            procs_per_machine_from_env()
    with pytest.raises(ValueError, match="procs_per_machine must be >= 1, got 0"):
        HybridConfig(procs_per_machine=0)


def test_bad_settings_are_refused_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="per_node must be >= 1, got 0"):
        node_servers(0)
    with pytest.raises(ValueError, match=r"node_servers sets \['parent_pid', 'server_id'\] itself"):
        node_servers(server_id=3, parent_pid=1)
    with pytest.raises(ValueError, match="port must be in"):
        node_servers(port=70000)
