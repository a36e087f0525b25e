"""The DDP hook and ``DistributedOptimizer`` send one bucket with as many collectives whatever the number of
parameters in it (a counter around ``torch.distributed``'s collective functions, on real gloo groups), PowerSGD
with two allreduces per bucket; and the hook's flat route (one compressor for the whole bucket) against
references written here."""

from __future__ import annotations

from typing import Any

import _bucket_calls_workers as bw
import numpy as np
import pytest

from sparsync import launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

P = 3
LAYERS = (1, 3)  # 2 and 6 parameters, one bucket either way
HOOK_SPECS = (
    "qsgd:bits=4,bucket=64",
    "fp16",
    "bf16",
    "sketch:rows=3,cols=300,block=8",
    "powersgd:rank=2",
    "topk:ratio=0.1",
    "threshold:ratio=0.1,lifespan=2",
)
RUNS = (*(f"hook:{s}" for s in HOOK_SPECS), "opt:powersgd:rank=2", "opt-bucket:qsgd:bits=4,bucket=64")


@pytest.fixture(scope="module")
def calls() -> list[dict[str, dict[int, Any]]]:
    return launch(bw.calls_worker, nprocs=P, args=(RUNS, LAYERS), timeout=240)


@pytest.mark.parametrize("run", RUNS)
def test_collectives_per_bucket_not_per_parameter(calls: list[dict[str, dict[int, Any]]], run: str) -> None:
    """Two counted steps of a model of 2 and of 6 parameters, one bucket each: the same collectives, by
    function, on every rank; one hook call per bucket per step."""
    for r, res in enumerate(calls):
        few, many = res[run][LAYERS[0]], res[run][LAYERS[1]]
        assert sum(many["calls"].values()) > 0, (run, r, many)
        assert many["calls"] == few["calls"], (run, r, few, many)
        if run.startswith("hook:"):
            assert few["hook_calls"] == many["hook_calls"] == 1, (run, r, few, many)


@pytest.mark.parametrize("run", ["hook:powersgd:rank=2", "opt:powersgd:rank=2"])
def test_powersgd_two_allreduces_per_bucket(calls: list[dict[str, dict[int, Any]]], run: str) -> None:
    """PowerSGD's data goes in two allreduces per bucket (its Ps with the vectors, its Qs); beside them per step
    one metadata round (a message to and from each of the P - 1 peers) and, in ``DistributedOptimizer``, one
    header allreduce."""
    header = 1 if run.startswith("opt:") else 0
    steps = len(bw.COUNTED)
    for res in calls:
        got = res[run][LAYERS[1]]["calls"]
        want = {"all_reduce": steps * (2 + header), "isend": steps * (P - 1), "irecv": steps * (P - 1)}
        assert {k: v for k, v in got.items() if v} == want, got


def _equal_on_every_rank(res: list[dict[str, Any]], key: str) -> None:
    for r in range(1, len(res)):
        for a, b in zip(res[0][key], res[r][key], strict=True):
            assert np.array_equal(a, b), (key, r)


@pytest.mark.parametrize("spec", ["qsgd:bits=4,bucket=64", "qsgd:bits=2,bucket=32"])
def test_flat_route_is_one_call_of_the_flat_buffer(spec: str) -> None:
    """QSGD through the hook: bit for bit one ``compressed_allreduce`` of the bucket's flat buffer named after
    its members (the reference replays every call with a fresh compressor), the same on every rank."""
    res = launch(bw.flat_worker, nprocs=P, args=(spec, False), timeout=120)
    _equal_on_every_rank(res, "outs")
    for r, out in enumerate(res):
        assert len(out["outs"]) == bw.STEPS
        for step, (got, want) in enumerate(zip(out["outs"], out["flat_ref"], strict=True)):
            assert np.array_equal(got, want), (r, step)


def test_flat_route_keeps_residuals_per_parameter() -> None:
    """FP16 with error feedback through the hook's flat route: results bit for bit the reference's (one call of
    the flat x = g + e), residuals bit for bit the reference's (e = x - fp16(x), kept here per parameter name)
    and those of one call per parameter (the cast is element-wise)."""
    res = launch(bw.flat_worker, nprocs=P, args=("fp16", True), timeout=120)
    _equal_on_every_rank(res, "outs")
    for r, out in enumerate(res):
        for step, got in enumerate(out["outs"]):
            assert np.array_equal(got, out["flat_ref"][step]), (r, step)
            # per parameter, gloo's ring sums each fp16 element in another order: equal to fp16 rounding
            np.testing.assert_allclose(got, out["per_param"][step], rtol=2e-3, atol=1e-5)
        assert out["residuals"].keys() == out["ref_residuals"].keys() == out["per_param_residuals"].keys()
        for name, e in out["residuals"].items():
            assert np.array_equal(e, out["ref_residuals"][name]), (r, name)
            assert np.array_equal(e, out["per_param_residuals"][name]), (r, name)
