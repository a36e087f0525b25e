"""DSAR with a quantized dense phase (``quantize=``, compress/dsar_quantized.py) on real gloo groups: bitwise
against a replay of every rank's noise, unbiased over many seeds, exact without ``quantize``, refusals on every
rank."""

from __future__ import annotations

from typing import Any

import _dsar_workers as dw
import numpy as np
import pytest
import torch
from _nccl_rules import check_run, merged_under_nccl_rules

from sparsync import launch
from sparsync.collectives.partition import Partition
from sparsync.compress import Context, QuantizedPayload
from sparsync.compress.qsgd_allreduce import encode_remote, simulate

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]


# "-nccl": the same run with the payload under NCCL's rules on gloo (tests/_nccl_rules.py), at P = 1, 3, 5.
# by hand (`-m large`, CI time): P = 5 with gloo's semantics (it runs under NCCL's rules by default) and P = 1
# under NCCL's rules (nothing travels at P = 1)
@pytest.fixture(
    scope="module",
    params=[
        1, 3, pytest.param(5, marks=pytest.mark.large),
        pytest.param("1-nccl", marks=pytest.mark.large), "3-nccl", "5-nccl",
    ],
    ids=lambda p: f"P{p}",
)  # fmt: skip
def run(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    P = int(str(request.param).split("-")[0])
    if "nccl" in str(request.param):
        return P, launch(merged_under_nccl_rules, nprocs=P, args=(dw.cases_worker,), timeout=120)
    return P, launch(dw.cases_worker, nprocs=P, timeout=120)


def replay(P: int, density: str, part: str) -> np.ndarray:
    """What every rank must get: the ranks' compressions and re-quantizations replayed with their generators."""
    inputs = [dw.rank_input(r, density) for r in range(P)]
    n = dw.ROWS * dw.ROW
    if P == 1:
        return inputs[0].to_dense().numpy()
    ctxs = [Context("dsar", r, P) for r in range(P)]
    if all(s.is_dense for s in inputs):  # both phases quantized: QSGD's reduce-scatter + allgather
        qs = [dw.q_of(0) for _ in range(P)]
        xs = [s.values for s in inputs]
        sent = [encode_remote(q, x, n, c, P) for q, x, c in zip(qs, xs, ctxs, strict=True)]
        return simulate(qs[0], sent, xs, ctxs, requantizers=qs).numpy()
    exact = sum(s.to_dense().double() for s in inputs).float()  # integer sums: exact in float32
    p = Partition(part, dw.ROWS, P)
    chunk = max(p.counts())
    gathered = torch.zeros(P * chunk * dw.ROW)
    rows2d = exact.view(dw.ROWS, dw.ROW)
    for j in range(P):
        mine = torch.arange(j, dw.ROWS, P) if part == "stride" else torch.arange(*p.bounds()[j : j + 2])
        local = torch.zeros(chunk, dw.ROW)
        local[: mine.numel()] = rows2d[mine]
        q = dw.q_of(0)
        pay: QuantizedPayload = q.compress(local.reshape(-1), ctxs[j])
        gathered[j * chunk * dw.ROW : (j + 1) * chunk * dw.ROW] = q.decode_sum([pay], chunk * dw.ROW)
    return p.gather_dense(gathered, chunk, dw.ROW).numpy()


@pytest.mark.parametrize("density", dw.DENSITIES)
@pytest.mark.parametrize("part", ["stride", "range"])
def test_bitwise_against_a_replay_and_the_same_on_every_rank(
    run: tuple[int, list[dict[str, Any]]], density: str, part: str
) -> None:
    P, results = run
    key = f"{density}/{part}"
    want = replay(P, density, part)
    for r, out in enumerate(results):
        assert np.array_equal(out[key], results[0][key]), f"rank {r} differs from rank 0"
        assert np.array_equal(out[key], want), (r, np.abs(out[key] - want).max())
        exact = sum(dw.rank_input(q, density).to_dense().double().numpy() for q in range(P))
        assert np.array_equal(out[f"{key}/exact"], exact)  # without quantize=: exact, as before
    if density == "empty":
        assert not want.any()


def test_bad_quantize_is_refused_on_every_rank(run: tuple[int, list[dict[str, Any]]]) -> None:
    P, results = run
    exact = sum(dw.rank_input(r, "sparse").to_dense().double().numpy() for r in range(P))
    for r, out in enumerate(results):
        assert "ValueError: quantize= needs algorithm='dsar_split_allgather'" in out["other_algorithm"], r
        assert "TypeError: quantize must be a sparsync.compress.QSGD or None, got str" in out["not_qsgd"], r
        if P > 1:
            assert out["bits_differ"].startswith("ValueError: quantize= setting mismatch across ranks"), r
        assert np.array_equal(out["after"], exact)  # the group still works


def test_nccl_rules_refuse_nothing(run: tuple[int, list[dict[str, Any]]]) -> None:
    """Under NCCL's rules quantized DSAR ran (the tests above passed on the same results) without one call NCCL
    would refuse: the quantized partitions gathered at equal sizes, the split phase in exact batched p2p."""
    _, results = run
    if "nccl_rules" not in results[0]:
        pytest.skip("this run is not under NCCL's rules")
    check_run(
        results,
        {
            ("all_gather_into_tensor", "all_gather_single"): 0,
            "all_to_all_single": 0,  # every rank dense: QSGD's reduce-scatter
            "batch_isend_irecv": 0,
        },
    )


def rounding_variance(x: np.ndarray, bucket: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(per-value variance of one QSGD rounding of ``x`` (scale = the bucket's max), each value's bucket max)."""
    s = 2 ** (bits - 1) - 1
    M = np.repeat(np.abs(np.pad(x, (0, -x.size % bucket))).reshape(-1, bucket).max(1), bucket)[: x.size]
    lev = np.divide(np.abs(x) * s, M, out=np.zeros_like(x), where=M > 0)
    p = lev - np.floor(lev)
    return (M / s) ** 2 * p * (1 - p), M


def variance_bound(P: int, density: str) -> np.ndarray:
    """Per value: the exact variance of the owners' one rounding (sparse: the split phase is exact), or, all
    ranks dense, the first rounding's exact variance plus the re-quantization's bound (qsgd_allreduce's doc)."""
    q, n = dw.q_of(0), dw.ROWS * dw.ROW
    xs = [dw.rank_input(r, density).to_dense().double().numpy() for r in range(P)]
    if density == "full":
        first, maxsum = np.zeros(n), np.zeros(n)
        for x in xs:
            v, M = rounding_variance(x, q.bucket, q.bits)
            first += v
            maxsum += M
        return first + maxsum**2 / (4 * q.levels**2)
    exact = np.sum(xs, axis=0)
    p = Partition("stride", dw.ROWS, P)
    chunk = max(p.counts())
    gathered = torch.zeros(P * chunk * dw.ROW, dtype=torch.float64)
    rows2d = exact.reshape(dw.ROWS, dw.ROW)
    for j in range(P):
        local = np.zeros((chunk, dw.ROW))
        mine = rows2d[j::P]
        local[: len(mine)] = mine
        v, _ = rounding_variance(local.reshape(-1), q.bucket, q.bits)
        gathered[j * chunk * dw.ROW : (j + 1) * chunk * dw.ROW] = torch.from_numpy(v)
    return p.gather_dense(gathered, chunk, dw.ROW).numpy()


@pytest.mark.parametrize("density", ["sparse", "full"])
def test_unbiased_over_seeds(density: str) -> None:
    """The mean of 200 quantized sums (one seed each) is within 5 standard errors of the exact sum at every
    value and on the whole, the standard error from the rounding's variance (exact for the sparse case's one
    rounding, the bound of qsgd_allreduce's doc for the two of the dense case); the measured variance is real
    and within that bound."""
    P, draws = 3, 200
    res = launch(dw.unbiased_worker, nprocs=P, args=(density, draws), timeout=300)
    assert all(np.array_equal(o["sum"], res[0]["sum"]) for o in res)
    exact = sum(dw.rank_input(r, density).to_dense().double().numpy() for r in range(P))
    bound = variance_bound(P, density)
    mean = res[0]["sum"] / draws
    var = res[0]["squares"] / draws - mean**2
    z = (mean - exact) / (np.sqrt(bound / draws) + 1e-6)
    assert np.abs(z).max() < 5.0, f"max |z| = {np.abs(z).max():.2f} at value {np.abs(z).argmax()}"
    assert abs((mean - exact).sum()) / np.sqrt(bound.sum() / draws) < 5.0  # the whole error averages out
    assert 0 < var.sum() <= 1.2 * bound.sum()
