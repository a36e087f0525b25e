"""Hybrid training (dense allreduce + parameter server) on real gloo groups and real server processes."""

from __future__ import annotations

from collections.abc import Iterator

import _ps_workers as pw
import pytest
import torch

from sparsync import launch
from sparsync.hybrid import PHASES
from sparsync.ps import ServerProcess, start_servers

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


@pytest.fixture
def servers(request: pytest.FixtureRequest) -> Iterator[list[ServerProcess]]:
    sv = start_servers(getattr(request, "param", 2), wait_timeout=20.0)
    yield sv
    for s in sv:
        s.kill()


CASES = {
    1: [dict(opt="sgd", reduce="sum", steps=4), dict(opt="adam", reduce="mean", steps=4)],
    3: [
        dict(opt="sgd", reduce="sum", steps=4),
        dict(opt="adam", reduce="mean", steps=4, partitions=5, split="range"),
        dict(opt="adagrad", reduce="sum", steps=3, bag=True),
        dict(opt="sgd", reduce="mean", steps=3, ps_dense=True, local_agg=False),  # PS only, no aggregation
        dict(opt="adam", reduce="mean", steps=3, ps_dense=True, dense_whole=True),  # Parallax's PS placement
        dict(opt="adam", reduce="sum", steps=4, prefetch=True),  # next step's rows pulled during this one
    ],
    4: [
        dict(opt="adam", reduce="sum", steps=3, ppm=2),  # 2 machines x 2 workers, local aggregation
        dict(opt="sgd", reduce="mean", steps=3, ppm=2, local_agg=False, prefetch=True),
    ],
}


@pytest.mark.parametrize("world", [1, 3, pytest.param(4, marks=pytest.mark.large)])
def test_sync_hybrid_equals_single_process(world: int) -> None:
    # One fresh pair of servers per case: each case trains its own table from step 0.
    pairs = pw.start_pairs(len(CASES[world]), wait_timeout=20.0)
    procs = [s for sv in pairs for s in sv]
    try:
        cases = [{**c, "addresses": [s.address for s in sv]} for c, sv in zip(CASES[world], pairs, strict=True)]
        res = launch(pw.hybrid_worker, nprocs=world, args=([], cases), timeout=120)
    finally:
        for s in procs:
            s.kill()
    for i, c in enumerate(cases):
        emb, losses = pw.reference(world, c["steps"], c["opt"], c["reduce"], c.get("bag", False))
        torch.testing.assert_close(res[0][i]["table"], emb, rtol=1e-5, atol=1e-6, msg=lambda m, c=c: f"{c}: {m}")
        init = pw.TinyLM(bool(c.get("bag", False))).emb.weight.detach()
        assert (res[0][i]["table"] - init).abs().max() > 1e-3  # training moved the table
        ref_head = [p for n, p in _ref_model(world, c).named_parameters() if not n.startswith("emb")]
        for r in range(world if not c.get("ps_dense") else 0):  # ps_dense: the head lives on the servers
            for a, b in zip(res[r][i]["head"], ref_head, strict=True):
                torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)
        if c.get("dense_whole"):  # each dense variable whole on one server, round-robin over the two
            dense = [v for n, v in res[0][i]["servers"].items() if not n.startswith("emb")]
            assert dense == [[k % 2] for k in range(len(dense))], dense
        assert res[0][i]["servers"]["emb.weight"] == [0, 1]  # the sparse table spans both servers
        for r in range(world):
            ph = res[r][i]["phases"]
            assert set(ph) == set(PHASES) and min(ph.values()) >= 0 and ph["forward_backward"] > 0, ph
        # Worker losses of one step sum (or average) to the reference loss of that step.
        for s in range(c["steps"]):
            tot = sum(res[r][i]["losses"][s] for r in range(world)) / (world if c["reduce"] == "mean" else 1)
            assert abs(tot - losses[s]) < 1e-4 * max(1.0, abs(losses[s])), (c, s, tot, losses[s])


def _ref_model(world: int, c: dict[str, object]) -> torch.nn.Module:
    """The reference run again, returning the model (for its dense parameters)."""
    model = pw.TinyLM(bool(c.get("bag", False)))
    dense = [p for n, p in model.named_parameters() if not n.startswith("emb")]
    o_d, o_s = pw.dense_opt(str(c["opt"]), dense), pw.sparse_opt(str(c["opt"]), [model.emb.weight])
    for s in range(int(c["steps"])):  # type: ignore[call-overload]
        o_d.zero_grad()
        o_s.zero_grad()
        parts = [
            torch.nn.functional.cross_entropy(model(pw.batch(s, r)[0]), pw.batch(s, r)[1]) for r in range(world)
        ]
        loss = sum(parts) / (world if c["reduce"] == "mean" else 1)
        loss.backward()  # type: ignore[union-attr]
        o_d.step()
        o_s.step()
    return model


@pytest.mark.parametrize("fault", ["slow", "dead"])
def test_async_proceeds_with_a_slow_or_dead_worker(servers: list[ServerProcess], fault: str) -> None:
    steps = 30
    res = launch(pw.async_worker, nprocs=3, args=([s.address for s in servers], steps, fault), timeout=120)
    for r in res[:2]:  # the healthy workers finish every step, and learn
        assert r["steps"] == steps
        assert sum(r["losses"][-3:]) < sum(r["losses"][:3]), r["losses"]
    faulty = res[2]
    if fault == "dead":
        assert faulty["dead"] and faulty["steps"] == 1
    else:
        assert faulty["steps"] < steps  # it fell behind while the others finished
