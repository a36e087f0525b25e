"""Sync training is bit-identical run to run with fixed seeds. With
``sparsync.set_deterministic()`` auto chooses from a fixed link model, so its choice (and the summation order)
depends on the data only; two runs at P = 2, 3 and 4 end at the same bits for every placement."""

from __future__ import annotations

import _determinism_workers as dw
import pytest

from sparsync import launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.large)])
def test_two_sync_runs_are_bit_identical(world: int) -> None:
    first = launch(dw.train, nprocs=world, args=(6,), timeout=120)
    second = launch(dw.train, nprocs=world, args=(6,), timeout=120)
    for name in first[0]:
        digests = {r[name]["digest"] for r in first + second}
        assert len(digests) == 1, f"{name}: {len(digests)} different results over 2 runs x {world} ranks"
    # The plans really differ: the default groups everything into one sparse allreduce, "dense" runs gloo.
    assert "dense" not in first[0]["default"]["algorithms"] and first[0]["dense"]["algorithms"] == ["dense"]
