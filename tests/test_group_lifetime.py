"""sparsync does not keep a process group alive past ``dist.destroy_process_group`` once the model and the
optimizer that use it are freed (a group freed only at the interpreter's exit can make gloo abort the process:
docs/sharding.md, "Ending a torchrun script"); sharded and replicated tables hold their group weakly even while
they live, and say so when it is gone."""

from __future__ import annotations

import pytest
from _group_lifetime_workers import freed_after_destroy

import sparsync

pytestmark = [pytest.mark.multiprocess]


@pytest.mark.parametrize("fused", [False, True], ids=["drop-in", "fused"])
@pytest.mark.parametrize("P", [1, 3])
def test_destroyed_groups_are_freed_once_the_model_and_optimizer_are(P: int, fused: bool) -> None:
    for got in sparsync.launch(freed_after_destroy, nprocs=P, args=(fused,)):
        assert got["groups"] >= 1  # the caller's group, and any sparsync made beside it
        assert got["alive"] == 0, got
        assert got["kept_group_freed"], got  # a live sharded model does not hold its group
        if P > 1:  # at one rank the tables exchange nothing: no group needed
            assert "process group of these sharded or replicated tables was destroyed" in got["error"], got
        else:
            assert got["error"] == "", got
