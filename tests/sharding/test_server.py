"""The ``server`` placement of ``sparsync.shard``'s plan, trained by ``HybridTrainer`` on real gloo groups and real
server processes: a mixed plan (one table replicated, one sharded, one on the servers) against one float64
process on the whole batch at P = 1, 3, 5, and what the trainers refuse of such a model.

The servers keep their tables in float32 (``sparsync.ps``: the wire and the update are float32), so exactness
holds where no server arithmetic has entered yet: after the first step every parameter but the server's table
equals the float64 reference to ``TOL`` (the server table starts float32-exact, so the first forward reads the
same values on both sides). The server's table carries float32 rounding from its first update on (each pushed
gradient row rounded once, the sums and the update in float32): ``SERVER_TOL`` bounds it (measured: at most
1.2e-7 at P = 3). Through the forward that rounding reaches every other parameter from the second step on:
``DOWNSTREAM_TOL`` bounds them (measured: at most 5.5e-9 at P = 3).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import _server_workers as sw
import _shard_workers as shw
import pytest

from sparsync import launch
from sparsync.ps import start_servers

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]
TOL = 1e-12  # float64 on both sides: only the order of the sums over ranks differs
SERVER_TOL = 1e-6  # the server table's float32 (module doc)
DOWNSTREAM_TOL = 1e-7  # the other parameters, once they read the server table's rounded rows (module doc)


@pytest.fixture(scope="module")
def server() -> Iterator[list[str]]:
    """Two servers for the module; each launch trains its own tables (``table_prefix``)."""
    sv = start_servers(2, wait_timeout=20.0)
    yield [s.address for s in sv]
    for s in sv:
        s.kill()


@pytest.fixture(scope="module")
def runs() -> dict[int, list[Any]]:
    return {}  # P -> every rank's result, so the refusals' test reuses the P = 3 run


def _run(runs: dict[int, list[Any]], server: list[str], P: int) -> list[Any]:
    if P not in runs:
        runs[P] = launch(sw.mixed_worker, nprocs=P, args=(server, f"mixed{P}/"), timeout=120)
    return runs[P]


@pytest.mark.parametrize("P", [1, 3, 5])
def test_a_mixed_plan_trains_as_one_float64_process(P: int, server: list[str], runs: dict[int, list[Any]]) -> None:
    res = _run(runs, server, P)
    for rank, r_rank in enumerate(res):
        assert len(r_rank["cases"]) == len(sw.CASES)
        for case, r in r_rank["cases"].items():
            where = (P, rank, case)
            assert r["placed"] == {"sh.weight": "Sharded", "srv.weight": "OnServer"}, where
            assert r["kinds"] == {
                "rep.weight": "dense_allreduce", "sh.weight": "sharded", "srv.weight": "ps",
                "fc.weight": "dense_allreduce", "fc.bias": "dense_allreduce",
            }, where  # fmt: skip
            assert r["on_servers"] == ["srv.weight"], where
            names = {"rep.weight", "sh.weight", "fc.weight", "fc.bias"} | ({"srv.weight"} if rank == 0 else set())
            assert set(r["errors"]) == names, where
            for name, errors in r["errors"].items():
                if name == "srv.weight":
                    assert max(errors) < SERVER_TOL, (where, name, errors)
                else:
                    assert errors[0] < TOL and max(errors) < DOWNSTREAM_TOL, (where, name, errors)
            assert r["moved"] > 1e-3  # the server table moved by far more than SERVER_TOL


def test_the_trainers_refuse_what_they_cannot_run_on_a_mixed_plan(
    server: list[str], runs: dict[int, list[Any]]
) -> None:
    res = [r["refused"] for r in _run(runs, server, 3)]
    m = shw.same_on_every_rank(res)
    assert m["async"].startswith("ValueError: mode='async' cannot train the sharded tables ['sh.weight']"), m
    assert "placements {'sh.weight': 'ps'} name shards" in m["moved"], m
    refused = m["distributed_optimizer"]
    assert refused.startswith("ValueError: parameters ['srv.weight'] are placed on the parameter server"), m
    assert "HybridTrainer" in refused, m


def test_ps_dense_puts_what_the_plan_does_not_shard_on_the_servers(server: list[str]) -> None:
    """``ps_dense=True`` with a shard plan: the table the plan left replicated and the dense layer go to the
    servers whole (the table's sparse gradient pushed as its dense form), the server table by rows, the shard
    keeps its exchange; all train as one float64 process, the servers' parameters to their float32 rounding."""
    res = launch(sw.ps_dense_worker, nprocs=3, args=(server, "psdense/"), timeout=120)
    for rank, r in enumerate(res):
        assert r["kinds"] == {
            "rep.weight": "ps", "sh.weight": "sharded", "srv.weight": "ps", "fc.weight": "ps", "fc.bias": "ps",
        }, rank  # fmt: skip
        assert set(r["errors"]) == ({"rep.weight", "sh.weight", "srv.weight", "fc.weight", "fc.bias"}
                                    if rank == 0 else {"sh.weight"})  # fmt: skip
        for name, error in r["errors"].items():
            assert error < (DOWNSTREAM_TOL if name == "sh.weight" else SERVER_TOL), (rank, name, error)
