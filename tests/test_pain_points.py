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

CASES = ("unused_table", "clip_norm", "clip_value", "accumulate", "padded", "grad_scaler")


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
