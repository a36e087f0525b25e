"""sparsync's async work runs on a process group of its own over the caller's ranks, so the
caller's own collectives on its group, issued while sparsync's queue thread is busy and in a different order
on each rank, neither hang nor mix with sparsync's (the DDP hook's case is in test_faults.py)."""

from __future__ import annotations

import _background_workers as bw
import pytest

from sparsync import launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def test_async_reductions_beside_the_callers_own_collectives() -> None:
    results = launch(bw.overlap_worker, nprocs=3, timeout=30)
    for res in results:
        for step, ((sparse, dense), mine) in enumerate(zip(res["sums"], res["mine"], strict=True)):
            want = [0.0] * 20
            for r in range(3):
                want[r] += 1.0
            want[10 + step] += 6.0
            assert sparse == want and dense == [3.0] * 4 and mine == [3.0] * 3
