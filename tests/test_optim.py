"""``sparsync.DistributedOptimizer``: a ``torch.optim.Optimizer`` that reduces the gradients by a per-parameter
plan (during backward on more than one rank). Exact against a float64 reference and equal to torch's DDP with
sparse gradients over world sizes 1, 3, 5 and batches from empty to every row; LR schedulers, checkpoints,
``synchronize()``; a plan with a compressor and a log; clear errors."""

from __future__ import annotations

import _optim_workers as ow
import numpy as np
import pytest
import torch
from _nccl_rules import check_clean, under_nccl_rules

from sparsync import launch
from sparsync.optim import DistributedOptimizer

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


DENSITIES = (0.0, 0.01, 0.2, 1.0)  # of the vocabulary a batch can read; 0: an empty batch, empty COO


@pytest.mark.parametrize("P", [1, 3, pytest.param(5, marks=pytest.mark.large)])  # P = 5: under NCCL's rules below
def test_equals_the_exact_average_and_ddp_with_sparse_gradients(P: int) -> None:
    by_density = launch(ow.exact_worker, nprocs=P, args=(DENSITIES,))
    for density in DENSITIES:
        _check_exact([r[density] for r in by_density])


@pytest.mark.parametrize("P", [pytest.param(1, marks=pytest.mark.large), 3, 5])
def test_exact_under_nccl_rules(P: int) -> None:
    """The same training under NCCL's rules on gloo (tests/_nccl_rules.py): the same results, and not one call
    that NCCL would refuse."""
    out = launch(under_nccl_rules, nprocs=P, args=(ow.exact_worker, DENSITIES))
    check_clean([o["nccl_rules"] for o in out])
    for density in DENSITIES:
        _check_exact([o["result"][density] for o in out])


def _check_exact(res: list[dict[str, list[np.ndarray]]]) -> None:
    for r in res:
        for ours, ref, ddp in zip(r["ours"], r["ref"], r["ddp"], strict=True):
            # float32 sums in another order than the float64 reference's, over 4 steps
            np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(ours, ddp, rtol=1e-5, atol=1e-6)
        for a, b in zip(r["ours"], res[0]["ours"], strict=True):
            assert np.array_equal(a, b)  # every rank holds the same bits


def test_schedulers_checkpoints_and_synchronize() -> None:
    res = launch(ow.scheduler_worker, nprocs=3)
    for r in res:
        assert r["lrs"] == [0.25, 0.125, 0.0625, 0.03125] and r["lrs2"] == r["lrs"]  # the scheduler reached it
        [(saved, resumed)] = r["layouts"]
        assert saved is not None and resumed == saved, r["layouts"]
        for a, b, c in zip(r["straight"], r["resumed"], r["clipped"], strict=True):
            assert np.array_equal(a, b)  # resumed from state_dict: same bits
            assert np.array_equal(a, c)  # synchronize() then step(): aggregated once, same update


def test_a_bound_never_reached_leaves_the_gradients_and_the_norm_unclipped() -> None:
    """``clip_grad_norm_`` scales by ``max_norm / norm`` clamped to 1: with the norm far below the bound, every
    aggregated gradient, sparse and dense, keeps its bits and the returned norm is that of no clipping (without
    the clamp the gradients would be scaled up by about 1e6 / norm)."""
    res = launch(ow.unreached_clip_worker, nprocs=2)
    for r in res:
        assert r["sparse"] == [True, False, False]  # the embedding's gradient, the linear layer's two
        assert 0 < r["norm"] < 1e6 and r["norm"] == r["unclipped"]
        for before, after in zip(r["before"], r["after"], strict=True):
            assert np.array_equal(before, after)


def test_a_plan_with_a_compressor_and_a_log() -> None:
    """The plan decides 2.weight's update: the mean of each rank's TopK(0.5) of its gradient (error feedback
    starts at zero), sent as one 18-of-36 sparse call; every other parameter gets the exact mean."""
    res = launch(ow.plan_worker, nprocs=3)
    assert all(r["bytes"] > 0 for r in res)
    assert all(("sparse_allreduce", 36, 18) in r["calls"] for r in res), [r["calls"] for r in res]
    for i, name in enumerate(res[0]["before"]):
        p0 = res[0]["before"][name][0].astype(np.float64)
        grads = [r["before"][name][1].astype(np.float64) for r in res]
        mean = np.mean(grads, 0)
        if name == "2.weight":  # keep each rank's 18 largest magnitudes
            kept = [np.where(np.abs(g) >= np.sort(np.abs(g), axis=None)[-18], g, 0.0) for g in grads]
            assert all(np.count_nonzero(g) == 18 for g in kept)
            assert not np.allclose(np.mean(kept, 0), mean)  # the plan must show in the result
            mean = np.mean(kept, 0)
        for r in res:
            np.testing.assert_allclose(r["params"][i], p0 - 0.1 * mean, rtol=1e-6, atol=1e-7, err_msg=name)
            assert np.array_equal(r["params"][i], res[0]["params"][i])  # the same bits on every rank


def test_bad_use_is_refused_with_a_message() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer, got list"):
        DistributedOptimizer([1, 2], model)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"call dist\.init_process_group first"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)


def test_misuse_in_a_group_is_refused_with_a_message() -> None:
    for msgs in launch(ow.errors_worker, nprocs=2):
        assert "already a DistributedOptimizer" in msgs[0], msgs
        assert "before wrapping it" in msgs[1], msgs
        assert "op must be one of" in msgs[2] and "'avg'" in msgs[2], msgs
        assert "unknown parameters ['nope']" in msgs[3], msgs


def test_ddp_hook_keeps_sparse_gradients_lossless_unless_the_plan_says_otherwise() -> None:
    res = launch(ow.hook_worker, nprocs=3)
    for r in res:
        np.testing.assert_allclose(r["default"]["emb"], r["exact"], rtol=1e-6, atol=1e-7)  # lossless
        assert not np.allclose(r["plan"]["emb"], r["exact"], rtol=1e-3)  # TopK(0.1) on the embedding
        assert r["default"]["records"] >= 2 and r["default"]["bytes"] > 0, r["default"]
        assert "plan= needs module=" in r["errors"][0] and "unknown parameters ['nope']" in r["errors"][1]
    for r in res[1:]:
        assert np.array_equal(r["plan"]["emb"], res[0]["plan"]["emb"])


@pytest.mark.parametrize("P", [1, 3, 5])
def test_bucketed_compression_is_exact_lossless_and_equals_flattening_by_hand(P: int) -> None:
    for r in launch(ow.bucket_worker, nprocs=P):
        assert max(r["lossless"]) < 1e-6, r["lossless"]
        assert all(r["lossy_same"]), r["lossy_same"]
