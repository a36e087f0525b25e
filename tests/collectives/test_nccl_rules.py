"""The NCCL-rules wrapper (tests/_nccl_rules.py) refuses what NCCL refuses, so the suites that pass under it
prove something: each refused call below is one NCCL would refuse, and a sparsync that ignored the rules fails."""

from __future__ import annotations

import _nccl_rules_workers as nw
import pytest

from sparsync import launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def test_the_wrapper_refuses_what_nccl_refuses() -> None:
    res = launch(nw.refusals_worker, nprocs=2, timeout=60)
    for rank, r in enumerate(res):
        for what in ("bor", "sparse", "object", "unequal_gather", "lone_isend", "ignored_rules"):
            assert r[what].startswith("refused: ") and "NCCL would refuse" in r[what], (rank, what, r[what])
        assert r["sum"] == "ok", r["sum"]
        assert r["calls"]["all_reduce"] >= 3
    assert res[0]["short_send"] == "ok"
    assert "a receive of 16 bytes for a send of 8" in res[1]["short_send"], res[1]["short_send"]
