"""grouped_allreduce (one call per step for an embedding and its MLP) on real gloo groups of
1, 3 and 5 ranks: every algorithm against the exact sum, sparse results holding the union of input rows,
async, and bad input raised on every rank; plus the layout checks that need no group."""

from __future__ import annotations

from typing import Any

import _grouped_workers as gw
import numpy as np
import pytest
import torch
from _nccl_rules import check_clean, under_nccl_rules

from sparsync import grouped_allreduce, launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


# P = 5 with gloo's semantics by hand (`-m large`): it runs under NCCL's rules by default (CI time)
@pytest.fixture(
    scope="module",
    params=(
        1,
        3,
        pytest.param(5, marks=pytest.mark.large),
        pytest.param("1-nccl", marks=pytest.mark.large),
        "3-nccl",
        "5-nccl",
    ),
    ids=lambda p: f"P{p}",
)
def run(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    """Every rank's results; "-nccl": under NCCL's rules on gloo (tests/_nccl_rules.py), checked clean here."""
    world = int(str(request.param).split("-")[0])
    if "nccl" not in str(request.param):
        return world, launch(gw.grouped_worker, nprocs=world, timeout=240)
    out = launch(under_nccl_rules, nprocs=world, args=(gw.grouped_worker,), timeout=240)
    check_clean([o["nccl_rules"] for o in out])
    return world, [o["result"] for o in out]


def _expected(pattern: str, dtype: torch.dtype, world: int) -> list[dict[str, Any]]:
    per_rank = [[gw.describe(t) for t in gw.inputs(pattern, dtype, r, world)] for r in range(world)]
    out = []
    for i, first in enumerate(per_rank[0]):
        want = {"dense": np.sum([p[i]["dense"] for p in per_rank], axis=0), "sparse": first["sparse"]}
        if first["sparse"]:
            want["rows"] = np.unique(np.concatenate([p[i]["rows"] for p in per_rank], axis=1), axis=1)
        out.append(want)
    return out


def test_every_algorithm_is_exact_and_keeps_the_union(run: tuple[int, list[dict[str, Any]]]) -> None:
    world, results = run
    failures = []
    for key in results[0]["grid"]:
        pattern, dname, _ = key.split("/")
        want = _expected(pattern, getattr(torch, dname), world)
        for rank, res in enumerate(results):
            got = res["grid"][key]
            if "error" in got:
                failures.append(f"{key} rank {rank}: {got['error']}")
                continue
            if not got["unchanged"] or got["calls"] != 1:
                failures.append(f"{key}: input modified or {got['calls']} calls logged")
            for i, (g, w) in enumerate(zip(got["out"], want, strict=True)):
                if g["sparse"] != w["sparse"] or not np.array_equal(g["dense"], w["dense"]):
                    failures.append(f"{key} rank {rank} tensor {i}: wrong sum or layout")
                elif g["dtype"] != f"torch.{dname}":
                    failures.append(f"{key} tensor {i}: dtype {g['dtype']}")
                elif g["sparse"] and (not g["coalesced"] or not np.array_equal(g["rows"], w["rows"])):
                    failures.append(f"{key} rank {rank} tensor {i}: rows {g['rows']} != union {w['rows']}")
    assert not failures, "\n".join(failures[:20])


def test_async_and_bad_index_on_every_rank(run: tuple[int, list[dict[str, Any]]]) -> None:
    world, results = run
    want = _expected("zipf", torch.float32, world)
    for res in results:
        for g, w in zip(res["async"], want, strict=True):
            assert np.array_equal(g["dense"], w["dense"])
        assert f"rank {world - 1} passed index 31 at position 1 of tensor 2, out of range [0, 31)" in res["bad"]
        assert res["after"] == [float(world)] * 3


def test_wrap_optimizer_default_is_one_grouped_call(run: tuple[int, list[dict[str, Any]]]) -> None:
    world, results = run
    per_rank = [[gw.describe(t) for t in gw.optimizer_grads(r, world)] for r in range(world)]
    want = [np.sum([p[i]["dense"] for p in per_rank], axis=0) for i in range(3)]
    for res in results:
        pl = res["placements"]
        assert pl["fused"]["calls"] == 1 and pl["separate"]["calls"] == 2 and pl["dense_apart"]["calls"] == 2
        for name in ("fused", "separate", "dense_apart"):
            got = pl[name]["grads"]
            assert [g["sparse"] for g in got] == [True, False, False], name
            for g, w in zip(got, want, strict=True):
                assert np.array_equal(g["dense"], w), name


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ([], "at least one tensor"),
        ([torch.ones(2), torch.ones(2, dtype=torch.float64)], "dtypes"),
        ([torch.ones(2, 3).to_sparse(1), torch.ones(2, 4).to_sparse(1)], r"row widths \[3, 4\]"),
        ([torch.ones(0)], "tensor 0 is empty"),
        ([torch.ones(2), "x"], "item 1 is a str"),
    ],
)
def test_layout_errors_name_the_bad_value(tensors: list[Any], message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        grouped_allreduce(tensors)
