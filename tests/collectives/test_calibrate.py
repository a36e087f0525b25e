"""``measure_link``'s α samples (collectives/calibrate.py): back to back after one barrier, as a run's calls follow
each other. A barrier before each sample lined the ranks up as no run does and under-reported α on the 2-core
development host (docs/results_demo.md); this keeps the samples free of barriers, whatever their number."""

from __future__ import annotations

import _calibrate_workers as cw
import pytest

from sparsync import launch


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("reps", [1, 61])
def test_alpha_samples_run_back_to_back_after_one_barrier_each(reps: int) -> None:
    for barriers, alpha, alpha_a2a in launch(cw.count_barriers, nprocs=3, args=(reps,)):
        assert barriers == 2  # one before the allgathers, one before the all-to-alls
        assert alpha > 0 and alpha_a2a > 0
