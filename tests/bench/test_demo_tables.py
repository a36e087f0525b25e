"""``sparsync demo``'s second part (``demo_shard``): the table set placed by ``shard(plan="auto")``, both
placements trained from the same weights on the same samples, and what the demo says about them."""

from __future__ import annotations

import pytest

from sparsync_bench.demo_shard import PLACEMENTS, TablesConfig, batches, run_tables, summary_lines

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def test_both_placements_train_alike_and_the_demo_names_the_winner_and_the_plans_choice() -> None:
    cfg = TablesConfig(procs=3, tables=3, rows=2000, dim=4, batch=64, steps=6, warmup=2, block=2)
    res = run_tables(cfg)
    for r in res:
        runs = r["runs"]
        assert runs["sharded"]["final_loss"] == pytest.approx(runs["replicated"]["final_loss"], rel=1e-6)
        assert set(r["chosen"]) == {"tables.0", "tables.1", "tables.2"} and r["chosen"] == res[0]["chosen"]
        assert all(runs[p]["bytes_per_step"] > 0 and len(runs[p]["times_ms"]) == cfg.steps for p in PLACEMENTS)
        assert r["order"] == ["replicated", "sharded"] * 3  # the warm-up turn, then two blocks of two
    first = [batches(cfg, rank)[0][0] for rank in range(cfg.procs)]
    for j, name in enumerate(res[0]["chosen"]):  # the plan's u(B): the first batch's distinct ids, mean over ranks
        want = sum(len(set(ids[:, j].tolist())) for ids in first) / cfg.procs
        assert res[0]["distinct"][name] == pytest.approx(want), name
    lines = list(summary_lines(res, cfg))
    chosen = set(res[0]["chosen"].values())
    says = "sharded" if chosen == {"sharded"} else "replicated" if chosen == {"replicated"} else "mixed"
    assert lines[1].startswith(f"plan (shard(plan='auto')): {says}")
    won = min(PLACEMENTS, key=lambda p: max(r["runs"][p]["step_ms"] for r in res))
    assert lines[-1].startswith(f"{won} won") and ("the plan chose it" in lines[-1]) == (won == says)
