"""The sharded tables under NCCL's rules (tests/_nccl_rules.py): ``sparsync.shard``, forward, backward, a
``DistributedOptimizer`` step, the full state dict gathered and loaded, and a refused id, at P = 3 on a gloo
group that refuses every call NCCL would; the results equal the same run without the rules, bit for bit."""

from __future__ import annotations

from pathlib import Path

import _shard_nccl_workers as nw
import pytest
import torch
from _nccl_rules import check_clean, under_nccl_rules

from sparsync import launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]
P = 3


def test_the_sharded_path_under_nccl_rules_equals_the_run_without_them(tmp_path: Path) -> None:
    plain = launch(nw.sharded_run, nprocs=P, args=(str(tmp_path / "plain.pt"),))
    ruled = launch(under_nccl_rules, nprocs=P, args=(nw.sharded_run, str(tmp_path / "ruled.pt")))
    rules = [r["nccl_rules"] for r in ruled]
    check_clean(rules)
    for rank, s in enumerate(rules):
        calls = s["calls"]
        # the payload went on the ruled group: the exchanges, the scatter at shard(), the gathers of state dicts
        assert calls.get("all_to_all_single", 0) >= 3 * 5, (rank, calls)  # 3 rounds an exchange, 5 exchanges
        assert calls.get("scatter", 0) >= 2 and calls.get("gather", 0) >= 3, (rank, calls)
    for rank, (a, r) in enumerate(zip(plain, (o["result"] for o in ruled), strict=True)):
        assert a["losses"] == r["losses"] and a["resumed_loss"] == r["resumed_loss"], rank
        for key in ("third", "params", "resumed", "full", "reloaded"):
            assert a[key].keys() == r[key].keys(), (rank, key)
            for name in a[key]:
                assert torch.equal(a[key][name], r[key][name]), (rank, key, name)
        assert a["refused"] == r["refused"], (rank, a["refused"], r["refused"])
    # what the run itself must show, with or without the rules
    for res in (plain, [o["result"] for o in ruled]):
        assert res[0]["full"].keys() == {"rep.weight", "bag.weight", "emb.weight", "fc.weight", "fc.bias"}
        # the sharded tables whole on rank 0 only; the replicated parameters as every rank holds them
        assert all(r["full"].keys() == {"rep.weight", "fc.weight", "fc.bias"} for r in res[1:])
        assert res[0]["reloaded"].keys() == res[0]["full"].keys()
        assert all(torch.equal(res[0]["reloaded"][k], v) for k, v in res[0]["full"].items())
        for rank, r in enumerate(res):
            assert r["shapes"]["bag.weight"] == ((nw.BAD_ID - rank + P - 1) // P, 4)  # only this rank's rows
            assert r["resumed_loss"] == r["losses"][2]  # the checkpoint continues exactly
            assert all(torch.equal(r["third"][k], v) for k, v in r["resumed"].items()), rank
            assert r["refused"] == res[0]["refused"]  # the same error on every rank
            # the checkpoint carries the bucket layout; the resumed optimizer reduces in it from its first round
            lay = r["layouts"]
            assert rank != 0 or lay["saved"] is not None, lay
            assert lay["given"] is not None and lay["given"] == lay["resumed"] == res[0]["layouts"]["saved"], lay
        assert res[0]["refused"].startswith("ValueError: sharded lookup refused on rank 1: 'bag'")
        assert f"id {nw.BAD_ID} is out of range" in res[0]["refused"]
