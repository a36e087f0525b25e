"""``DistributedOptimizer`` reduces while backward runs (optim/overlap.py): a bucket's reduction starts
before backward ends; results equal a float64 single-process reference (dense, sparse, an unused layer, a layer
unused on some ranks, accumulation with and without ``no_sync``, a compressor with error feedback, a bucket that
sends nothing) and, for compressed plans, reduction in ``step()`` bit for bit; the fast path sends no metadata
round; a NaN, a skipped step and models that differ are refused on every rank."""

from __future__ import annotations

import re

import _overlap_workers as ov
import numpy as np
import pytest

from sparsync import launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


@pytest.mark.parametrize("P", [1, 3, 5])
def test_exact_against_the_reference_and_step_time_reduction(P: int) -> None:
    res = launch(ov.exact_worker, nprocs=P, timeout=240)
    for r in res:
        for ours, again, ref in zip(r["default"], r["default_again"], r["ref"], strict=True):
            np.testing.assert_allclose(ours, ref, rtol=1e-10, atol=1e-12)
            assert np.array_equal(ours, again)  # run to run: the same bits
        for key in ("accumulate", "accumulate_sync"):
            for ours, ref in zip(r[key], r["ref2"], strict=True):
                np.testing.assert_allclose(ours, ref, rtol=1e-10, atol=1e-12, err_msg=key)
        for ours, ref in zip(r["compressed"], r["compressed_ref"], strict=True):
            np.testing.assert_allclose(ours, ref, rtol=1e-10, atol=1e-12, err_msg="compressed")
        if P > 1:  # on one rank overlap is off: step()-time reduction is what ran
            _check_step_time(r)
        for key in r:
            for a, b in zip(r[key], res[0][key], strict=True):
                assert np.array_equal(a, b), key  # every rank holds the same bits


def _check_step_time(r: dict[str, list[np.ndarray]]) -> None:
    """A compressed placement makes the same calls as step()-time reduction: with every parameter under it
    ("bucketed") the same bits; beside the default ("compressed") the default's parameters are summed in another
    order (buckets, not one grouped call), and every later gradient differs in its last bits."""
    for ours, step_time in zip(r["bucketed"], r["bucketed_step"], strict=True):
        assert np.array_equal(ours, step_time), "bucketed"
    for ours, step_time in zip(r["compressed"], r["compressed_step"], strict=True):
        np.testing.assert_allclose(ours, step_time, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("P", [2, 3])
def test_a_bucket_that_sends_nothing(P: int) -> None:
    """A placement whose gradients their own backward sums (``communicates`` False) gets a bucket of its own that
    sends nothing; overlap divides it by P, and leaves it None in the step where no rank has a gradient for it
    (momentum then skips it, as in one process): the float64 single process's parameters."""
    for rank, r in enumerate(launch(ov.summed_worker, nprocs=P, timeout=240)):
        assert r["none"] == [i == ov.SKIPPED for i in range(ov.STEPS)], r["none"]
        assert (["summed.weight", "summed.bias"], True) in r["buckets"], r["buckets"]
        assert [local for _, local in r["buckets"]].count(True) == 1, r["buckets"]
        for ours, ref in zip(r["ours"], r["ref"], strict=True):
            np.testing.assert_allclose(ours, ref, rtol=1e-10, atol=1e-12, err_msg=f"rank {rank}")


def test_a_bucket_starts_before_backward_ends() -> None:
    """Steps 2-4 reduce in buckets (step 1 lays them out); bucket 0 is the last layers' 1 MiB. At the first
    layer's hook, late in backward, bucket 0's allreduce has been issued and completes (the hook waits for
    that, not for a time: gloo's threads depend on the host's scheduler), and on the timeline it starts before
    backward ends."""
    for r in launch(ov.timeline_worker, nprocs=3, timeout=240):
        starts, ends, seen = r["bucket0_starts"], r["backward_ends"], r["seen"]
        assert len(starts) == 3 and len(ends) == 4 and len(seen) == 4, r
        assert r["buckets"] > 1, r
        for launched, running in seen[1:]:
            assert launched >= 1 and running, r  # the end-of-backward callback has not run yet
        for start, end in zip(starts, ends[1:], strict=True):
            assert start < end, r


def test_the_fast_path_sends_no_metadata_round() -> None:
    n = 2 * (300 * 300 + 300)  # two 300 x 300 layers' gradients: 722 KB, under the first bucket's 1 MiB
    for r in launch(ov.log_worker, nprocs=3):
        first, *later = r["steps"]
        assert any(op == "sparse_allreduce" for op, _, _ in first)  # the first step: ReplicatedOptimizer's
        assert r["buckets"] == 1
        for records in later:
            # one ring allreduce (2(P-1)/P of the payload per rank) of the gradients and the tail (status, c,
            # c², one per parameter), and nothing else
            assert records == [("bucket_allreduce", n, 2 * 2 * (n + 3 + 4) * 4 // 3)], records
        # issued on backward's thread (jobs.Issued): no queue thread ever ran a bucket
        assert r["queues"] == [], r["queues"]


@pytest.mark.parametrize(
    ("case", "expect"),
    [
        ("nan_dense", "NonFiniteError: rank 2 contributed NaN or ±Inf"),
        ("nan_sparse", "NonFiniteError: rank 2 contributed NaN"),
        ("nan_in_step", "NonFiniteError: rank 2 contributed NaN"),
        ("extra_round", "reduces another backward round"),
        ("shape", "mismatched structure/shape/dtype"),
        ("skip_step", "timeout or dead peer"),
    ],
)
def test_bad_input_is_refused_on_every_rank(case: str, expect: str) -> None:
    """NaN on one rank (in a fast dense bucket, in the sparse bucket's own metadata round, in step()-time
    reduction; raised by step(), outside a GradScaler), a second backward
    outside no_sync() on one rank, models that differ: the same error on every rank. A rank that skips a whole
    step pairs its next step with the others' (no count tells them apart, as under DDP): the others' last step
    fails on the timeout with a message, never a hang."""
    msgs = launch(ov.bad_worker, nprocs=3, args=(case,), timeout=120)
    if case == "skip_step":
        assert expect in msgs[0] and expect in msgs[2] and msgs[1] == "no error", msgs
        return
    assert all(expect in m for m in msgs), msgs
    assert len({_same(m) for m in msgs}) == 1, msgs  # the same error everywhere


def _same(message: str) -> str:
    """A message without what differs by rank: the rank that saw it, the flight recorder's file."""
    return re.sub(r"\(?seen on (rank|replica) \d+\)?|flight recorder:.*", "", message, flags=re.S)


@pytest.mark.parametrize("P", [2, 3])
def test_a_layer_no_rank_uses_after_the_first_round_keeps_no_gradient(P: int) -> None:
    """Used on every rank in the first round (laid out in a bucket), on none later: its ``.grad`` stays None, as
    under DDP, so SGD with momentum and Adam skip it; the parameters equal the float64 single process's."""
    for rank, r in enumerate(launch(ov.dropped_layer_worker, nprocs=P, timeout=240)):
        for name, got in r.items():
            assert got["head_grad_none"] == [False] + [True] * (ov.STEPS - 1), (P, rank, name, got)
            for ours, ref in zip(got["ours"], got["ref"], strict=True):
                np.testing.assert_allclose(ours, ref, rtol=1e-10, atol=1e-12, err_msg=f"{name} rank {rank}")


@pytest.mark.parametrize("P", [1, 3])
def test_accumulation_coalesces_and_the_fast_bucket_keeps_its_buffer(P: int) -> None:
    """A sparse gradient accumulated inside no_sync() is coalesced after each backward, with the reducer's hooks
    (P = 3) as without (P = 1); from the second reduced round on, the fast bucket's sums land in the buffer of
    the round before (the gradients of every step held, so a new buffer would lie elsewhere)."""
    for r in launch(ov.accumulate_worker, nprocs=P, timeout=120):
        assert r["coalesced"] == [True] * ov.STEPS, r["coalesced"]
        if P > 1:
            storages = r["storages"][1:]  # step 0 reduces in step()'s way and lays the buckets out
            assert all(len(s) == 1 for s in storages), storages  # one bucket, all views of it
            assert all(s == storages[0] for s in storages), storages
