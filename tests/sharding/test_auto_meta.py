"""``plan="auto"`` through a table on the meta device (``shard.auto``'s module doc): its ids counted by a stand-in
that returns zeros, its pricing by its real shape, and the table never made whole on any rank."""

from __future__ import annotations

import _auto_meta_workers as aw
import pytest

from sparsync import launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def test_auto_through_a_meta_table_chooses_and_counts_as_on_the_real_table_and_never_builds_it() -> None:
    res = launch(aw.auto_meta_worker, nprocs=3)
    for rank, r in enumerate(res):
        meta, real = r["meta"], r["real"]
        # what the stand-in counted is what the real table's lookups read, and the meta table priced by its shape
        assert meta["distinct"] == real["distinct"], (rank, meta["distinct"], real["distinct"])
        assert meta["distinct"]["big"][0] > 0 and meta["distinct"]["big"][1] > meta["distinct"]["big"][0]
        assert meta["stats"] == real["stats"], rank
        assert meta["priced"] == real["priced"], rank  # same choices, same bytes and seconds, table by table
        assert meta["tables"] == real["tables"] == {"small": "replicated", "big": "sharded"}, rank
        assert meta["backward"] == res[0]["meta"]["backward"] > 0  # the slowest rank's, through the zeros
        # a meta table is sharded whatever the price: replicated, it would have to exist whole on every rank
        assert r["both_meta"] == {"tables": {"small": "sharded", "big": "sharded"}, "distinct": meta["distinct"]}
        # sparsync.shard(..., "auto") swapped the meta table for a shard of this rank's rows and trained on
        assert r["modules"] == {"small": "Embedding", "big": "ShardedEmbeddingBag"} and r["sharded_kind"]
        assert r["shard"] == (r["rows_owned"], aw.DIM) and r["rows_owned"] < aw.ROWS // 2
        assert r["devices"] == ["cpu"] and r["finite"] and len(r["losses"]) == 2
        # nothing the size of the whole table was ever made on this rank (the shard and one init block were)
        assert r["rows_owned"] * aw.DIM * 4 <= r["largest"] < aw.ROWS * aw.DIM * 4, (rank, r["largest"])
        assert not r["stand_in_left"] and r["measured_big"] == ("meta", True)
