"""What DDP and torchrec users trip on, handled by ``DistributedOptimizer`` with no flag, each equal to a float64
single-process reference at P = 1, 3, 5: a table unused on some ranks (DDP: "Expected sparse gradient to be
defined", pytorch#80496) and a layer unused everywhere; ``clip_grad_norm_``/``clip_grad_value_`` over sparse
gradients (torch's raise for SparseCPU); gradient accumulation with ``no_sync()``; ``padding_idx``, ``max_norm``,
``per_sample_weights`` and ``include_last_offset``; a GradScaler whose overflow on one rank skips the step on
every rank."""

from __future__ import annotations

import _pain_workers as pw
import pytest

from sparsync import launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

CASES = ("unused_table", "clip_norm", "clip_value", "accumulate", "padded")


@pytest.fixture(scope="module", params=(1, 3, pytest.param(5, marks=pytest.mark.large)), ids=lambda p: f"P{p}")
def results(request: pytest.FixtureRequest) -> list[dict[str, dict[str, object]]]:
    return launch(pw.all_cases, nprocs=request.param, args=(CASES,), timeout=240)


@pytest.mark.parametrize("case", CASES)
def test_equals_the_single_process_reference(results: list[dict[str, dict[str, object]]], case: str) -> None:
    for rank, r in enumerate(results):
        got = r[case]
        tol = 1e-6 if case == "grad_scaler" else 1e-9  # float64 model; GradScaler's unscale multiplies in float32
        assert got["max_diff"] <= tol, (rank, case, got)
        assert got["unused_untouched"], (rank, case)
        if case == "accumulate":  # two micro-batches' rows, coalesced as they accumulated
            assert got["coalesced"] == [True] * pw.STEPS, got["coalesced"]
        if case == "clip_norm":
            assert got["norms"] == pytest.approx(got["ref_norms"], rel=1e-12), got
            assert any(n > 0.5 for n in got["norms"])  # the clip did clip


@pytest.fixture(scope="module", params=(1, 3, 5), ids=lambda p: f"P{p}")
def scaled(request: pytest.FixtureRequest) -> list[dict[str, dict[str, object]]]:
    return launch(pw.all_cases, nprocs=request.param, args=(pw.SCALER_CASES,), timeout=240)


@pytest.mark.parametrize("case", pw.SCALER_CASES)
def test_grad_scaler_skips_an_overflow_on_every_rank_with_no_flag(
    scaled: list[dict[str, dict[str, object]]], case: str
) -> None:
    """``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()`` over the default optimizer (float64;
    float32 under bf16 autocast; reduction in step(), with ``opt.synchronize()`` before the scaler): one rank's
    loss overflows at one step; every rank skips that step and halves its scale, and the model equals the
    single-process reference that skips the same step. Before the deferred non-finite error, every rank raised
    "contributed +Inf" in backward unless ``check_nan=False``."""
    tol = 1e-5 if case == "grad_scaler_bf16" else 1e-6  # GradScaler's unscale multiplies in float32
    for rank, r in enumerate(scaled):
        got = r[case]
        assert got["max_diff"] <= tol, (rank, case, got)
        assert got["unused_untouched"], (rank, case)
        # the initial 2^8 kept at step 0, halved by the overflow at step 1 on every rank, kept at step 2
        assert got["scales"] == [2.0**8, 2.0**7, 2.0**7], (rank, got["scales"])
        assert not got["dumped"], rank  # a routine overflow dumps no flight recorder and reports no failure
