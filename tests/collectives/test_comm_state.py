"""A ``Comm`` reads its rank, its group's size and the transport rules once per group (``GroupState``): each group
keeps its own, a group made again after one was destroyed gets its own, and ``use_nccl_rules`` after a call on
the group changes the rules of the next calls."""

from __future__ import annotations

import _comm_state_workers as cw
import pytest

from sparsync import launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def test_each_group_keeps_its_own_rank_size_and_rules() -> None:
    res = launch(cw.facts_worker, nprocs=3, timeout=60)
    for rank, r in enumerate(res):
        assert r["world"] == (rank, 3, False), r
        assert r["nccl_rules"] == (True, True), r
    assert [r.get("pair") for r in res] == [None, (0, 2), (1, 2)]
    assert [r["again"] for r in res] == [(0, 3), (1, 3), (2, 3)]
