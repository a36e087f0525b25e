"""``plan="auto"`` prices the tables' CPU per placement (``sharding.auto``'s module doc, ``TableCpu``): the choice
follows it (against an exhaustive search), the step it predicts includes it, and where nobody set the link it is
measured on the sample's lookups, the same on every rank."""

from __future__ import annotations

import dataclasses
import math
import socket

import _auto_cpu_workers as cw
import pytest
import torch
from torch import nn

from sparsync import launch
from sparsync.sharding.auto import _bags, _contention, _cores
from sparsync.sharding.table_cpu import TableCpu, _stand_in

P = 3


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_auto_chooses_the_least_step_with_the_tables_cpu_given() -> None:
    """On a fast link: tables whose replicated step costs CPU are sharded, tables whose sharded pass costs CPU
    stay replicated, a table costly enough alone pays for the group's fixed cost, two cheaper ones only
    together; each choice is the exhaustive search's split (exposed communication + CPU), and
    ``step_seconds`` counts the CPU. ``sparsync.shard(..., "auto", optimizer=SGD)`` trains on its choice."""
    res = launch(cw.given_worker, nprocs=P)
    sharded, replicated = dict.fromkeys(cw.NAMES, "sharded"), dict.fromkeys(cw.NAMES, "replicated")
    want = {
        "replicated_costly": sharded,
        "sharded_costly": replicated,
        "one_costly": {**replicated, "tables.2": "sharded"},
        "two_costly": {**replicated, "tables.0": "sharded", "tables.3": "sharded"},
    }
    for r in res:
        for name, placed in want.items():
            got = r[name]
            assert got == res[0][name]  # every rank chooses the same
            assert got["tables"] == placed, (name, got["tables"])
            # the exhaustive search's split; its replicated tables' kinds (dense or sparse allreduce) settled by a
            # greedy pass, as the planner's are, within 1% of the exhaustive search's least step
            assert got["best"] == placed and got["best_cost"] <= got["cost"] <= 1.01 * got["best_cost"], name
            assert got["cpu_is_given"] and math.isclose(got["step"], got["step_ref"], rel_tol=1e-12), name
        # without a CPU term (the link set: nothing measured) the communication alone keeps them replicated here
        assert r["none"] == want["sharded_costly"]
        # the tables' SGD in backward on auto's choice (here every table sharded) trains as torch's SGD does
        run, ref = r["fused_run"]["auto"], r["fused_run"]["every_table_sharded"]
        assert run["sharded"] == ref["sharded"] == cw.TABLES
        assert run["losses"][0] == ref["losses"][0]
        assert math.isclose(run["losses"][1], ref["losses"][1], rel_tol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_auto_measures_the_tables_cpu_where_nobody_set_the_link() -> None:
    """Measured: one ``TableCpu`` for every rank, each table's entries finite and not negative, the lookups
    counted, the contention of 3 ranks on this host; ``fused`` as asked; with the link set: none."""
    res = launch(cw.measured_worker, nprocs=P)
    contention = max(1.0, P / _cores())
    for r in res:
        for cpu in (r["plain"], r["fused"]):
            assert isinstance(cpu, TableCpu)
            assert set(cpu.replicated) == set(cpu.sharded) == set(cpu.group) == set(cw.NAMES)
            values = [*cpu.replicated.values(), *cpu.sharded.values(), *(t for _, t in cpu.group.values())]
            assert all(math.isfinite(v) and v >= 0 for v in values)
            assert cpu.lookup > 0
            assert len(set(cpu.group.values())) == 1  # one width and dtype: one group
            assert cpu.contention == contention
        assert not r["plain"].fused and r["fused"].fused
        assert min(r["plain"].replicated.values()) > 0  # each replicated table pays its own step
        assert r["plain"].replicated_group == {}
        grouped = r["fused"].replicated_group  # fused: the replicated tables in one group of one part
        assert set(grouped) == set(cw.NAMES) and len(set(grouped.values())) == 1
        assert all(math.isfinite(t) and t >= 0 for _, t in grouped.values())
        # a table's share of its group's pass may round to 0 (the fixed part is the rest); the pass itself costs
        assert sum(r["fused"].replicated.values()) + next(iter(grouped.values()))[1] > 0
        assert r["plain"] == res[0]["plain"] and r["fused"] == res[0]["fused"]  # averaged over the ranks
        assert r["set_link"] is None
        cpu = r["plain"]
        assert math.isclose(r["step"], r["fwd_bwd"] + r["exposed"] + cpu.seconds(r["tables"]), rel_tol=1e-12)


def test_table_cpu_seconds_pays_each_group_once_and_scales_by_contention() -> None:
    cpu = TableCpu(
        {"a": 1.0, "b": 2.0, "c": 4.0},
        {"a": 0.5, "b": 0.25, "c": 0.125},
        {"a": ("g", 8.0), "b": ("g", 8.0), "c": ("h", 16.0)},
        lookup=1.5,
        contention=2.0,
    )
    assert cpu.seconds({"a": "replicated", "b": "replicated", "c": "replicated"}) == 2.0 * (7.0 - 1.5)
    assert cpu.seconds({"a": "sharded", "b": "sharded", "c": "replicated"}) == 2.0 * (0.75 + 8.0 + 4.0 - 1.5)
    assert cpu.seconds({"a": "sharded", "b": "replicated", "c": "sharded"}) == 2.0 * (0.625 + 2.0 + 24.0 - 1.5)
    # fused: the replicated tables' groups pay their fixed seconds once each, as the sharded groups do
    fused = dataclasses.replace(
        cpu, fused=True, replicated_group={"a": ("r", 32.0), "b": ("r", 32.0), "c": ("s", 64.0)}
    )
    assert fused.seconds({"a": "replicated", "b": "replicated", "c": "replicated"}) == 2.0 * (7.0 + 96.0 - 1.5)
    assert fused.seconds({"a": "replicated", "b": "replicated", "c": "sharded"}) == 2.0 * (
        3.125 + 16.0 + 32.0 - 1.5
    )
    assert fused.seconds({"a": "sharded", "b": "replicated", "c": "sharded"}) == 2.0 * (
        0.625 + 2.0 + 24.0 + 32.0 - 1.5
    )


def test_contention_is_the_busiest_hosts_ranks_over_its_cores() -> None:
    assert _contention([("a", 2, True)] * 3) == 1.5
    assert _contention([("a", 2, True)] * 3 + [("b", 1, True)] * 4) == 4.0
    assert _contention([("a", 8, True)] * 2) == 1.0  # spare cores: a CPU second costs a second
    assert _contention([(socket.gethostname(), 4, False), (socket.gethostname(), 2, False)]) == 1.0


def test_the_recorded_lookups_pool_on_the_stand_in_rows_as_the_table_does() -> None:
    """Each table call recorded as ``embedding_bag``'s (ids, offsets), joined and renumbered onto one row per
    distinct id (``_stand_in``): pooling the real rows gathered in that order gives every call's output."""
    torch.manual_seed(3)
    bag = nn.EmbeddingBag(50, 3, mode="sum")
    last = nn.EmbeddingBag(50, 3, mode="sum", include_last_offset=True)
    emb = nn.Embedding(50, 3)
    calls = [
        (bag, (torch.tensor([4, 9, 4, 30, 2]), torch.tensor([0, 2, 2])), {}),
        (bag, (torch.tensor([[1, 4], [7, 7], [9, 0]]),), {}),
        (bag, (torch.tensor([5, 6, 49]),), {"offsets": torch.tensor([0, 1])}),
        (last, (torch.tensor([3, 8, 8, 1]), torch.tensor([0, 3, 3, 4])), {}),
        (emb, (torch.tensor([[2, 2, 40], [0, 1, 2]]),), {}),
    ]
    for module, args, kwargs in calls:
        ids, offsets, u = _stand_in([_bags(module, args, kwargs)])
        keys = torch.unique(args[0].reshape(-1))
        assert u == keys.numel()
        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        got = nn.functional.embedding_bag(ids, weight[keys], offsets, mode="sum")
        want = module(*args, **kwargs)
        torch.testing.assert_close(got, want.reshape(got.shape), rtol=0, atol=0)
    # two calls of one table joined: the second's offsets shifted past the first's ids
    ids, offsets, u = _stand_in([_bags(*calls[0][:2], {}), _bags(*calls[1][:2], {})])
    keys = torch.unique(torch.cat([calls[0][1][0], calls[1][1][0].reshape(-1)]))
    got = nn.functional.embedding_bag(ids, bag.weight[keys], offsets, mode="sum")
    want = torch.cat([bag(*calls[0][1]), bag(*calls[1][1])])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
