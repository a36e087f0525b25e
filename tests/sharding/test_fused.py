"""Optimizers fused into the sharded tables' backward (``sparsync.shard(optimizer=...)``, fbgemm's TBE way): each
exact against one float64 process of the unsharded model with torch's optimizer (row-wise Adagrad against the
reference written in ``_fused_workers``) at P = 1, 3, 5, over ``_shard_workers``' nine tables (every mode; its
steps: uneven and empty batches, every id on one owner, ids absent, rows never looked up)."""

from __future__ import annotations

import _fused_workers as fw
import pytest

from sparsync import launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]
TOL = 1e-12  # float64 on both sides: only the order of the sums over ranks differs


@pytest.mark.parametrize("P", [1, 3, 5])
def test_each_fused_optimizer_equals_torchs_on_one_float64_process(P: int) -> None:
    for rank, res in enumerate(launch(fw.fused_worker, nprocs=P)):
        for name in fw.FUSED:
            r = res[name]
            assert max(r["errors"]) < TOL, (P, rank, name, r["errors"])
            assert r["grads"] == [False] * len(r["grads"]), (name, r["grads"])  # updated in backward: no .grad
            assert r["dense"] == 0, name  # the model is all tables: nothing left for another optimizer


def test_misuse_gets_a_clear_error() -> None:
    m = launch(fw.misuse_worker, nprocs=1)[0]
    assert "SGD" in m["class"] and "RowwiseAdagrad" in m["class"] and "leave optimizer None" in m["class"], m
    assert "no longer views the group's storage" in m["converted"] and "model.to(dtype)" in m["converted"], m
