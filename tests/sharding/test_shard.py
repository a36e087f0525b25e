"""Sharded tables on real gloo groups (``sparsync.shard``): exact against one float64 process at P = 1, 2, 3, 5 for
every mode of nn.Embedding and nn.EmbeddingBag under SGD, Adagrad and SparseAdam, in one exchange per direction
per step; a mixed model (one table replicated, one sharded); the same clear error on every rank for bad input;
a checkpoint saved at 3 ranks loaded at 5.

The steps of ``_shard_workers._batch``: 0 uneven batches (2 + rank samples); 1 an empty batch on one rank; 2 every
id on one owner; 3 two tables' ids absent from the whole step; 4 the upper half of every table never looked up.
"""

from __future__ import annotations

import socket
from pathlib import Path

import _shard_workers as sw
import pytest
import torch

from sparsync import launch
from sparsync.plan import KINDS, Cluster, ParamStats, make_plan
from sparsync.sharding import AUTO_KINDS, Ownership
from sparsync.sharding.auto import _cores, _hidden_share
from sparsync.sharding.group import INIT_BLOCK, init_rows

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]
TOL = 1e-12  # float64 on both sides: only the order of the sums over ranks differs


# P = 2 as well: there emb_pad's padding row (5) is its owner's local row 2, and the global id 5 is another
# owned row (11), so an owner that filtered by the global id would drop a real gradient and keep the padding's
@pytest.mark.parametrize("P", [1, 2, 3, 5])
def test_sharded_tables_equal_one_float64_process(P: int) -> None:
    for rank, res in enumerate(launch(sw.exact_worker, nprocs=P)):
        for opt in sw.OPTIMIZERS:
            r = res[opt]
            assert max(r["errors"]) < TOL, (P, rank, opt, r["errors"])
            assert r["identical"] == [True], (P, rank, opt)  # the pooled outputs equal torch's, bit for bit
            # all nine tables in one exchange per direction and step
            assert r["ops"] == ["shard_lookup", "shard_grad"] * sw.STEPS, r["ops"]
            if P > 1:  # the first step's ids overflow capacity 0; later steps' fit, except the one with every id
                # on one owner, wider than any before it (both paths of the ids round, header.py)
                assert r["rounds"][0] == 3 and 2 in r["rounds"], r["rounds"]
            assert r["plain"]  # model(x) hands back tensors
            assert all(got == want for got, want in r["bytes"]), r["bytes"]  # each distinct id once, each row once
        for opt, r in res["mixed"].items():
            assert max(r["errors"]) < TOL, (P, rank, "mixed", opt, r["errors"])
            # clip_grad_norm_'s norm: the whole gradient's on every rank, shards included
            assert all(abs(got - want) < TOL * want for got, want in r["norms"]), (P, rank, r["norms"])
            assert len(r["norms"]) == (3 if opt == "clip" else 0) and all(w > sw.CLIP for _, w in r["norms"])
            assert r["kinds"] == {
                "rep.weight": "ByLayout", "sh.weight": "Sharded", "fc.weight": "ByLayout", "fc.bias": "ByLayout"
            }  # fmt: skip


def test_bad_input_gets_the_same_clear_error_on_every_rank() -> None:
    res = launch(sw.errors_worker, nprocs=3)
    m = sw.same_on_every_rank(res)
    assert m["out_of_range"].startswith("ValueError: sharded lookup refused on rank 1: 't.emb'")
    assert "id 17 is out of range; ids must lie in [0, 17)" in m["out_of_range"]
    assert "rank 2" in m["negative"] and "id -1 is negative" in m["negative"] and "'t.bag_mean'" in m["negative"]
    assert "rank 0" in m["torch_refuses"] and "per_sample_weights" in m["torch_refuses"]
    assert "different sharded tables" in m["other_tables"] and "rank 2" in m["other_tables"]
    assert "t.bag_last" in m["other_tables"]
    assert "the ranks' models differ" in m["mismatched_at_shard"] and "rank 1" in m["mismatched_at_shard"]
    assert "mode='max'" in m["max_mode"] and "EmbeddingBag" in m["max_mode"]
    assert "cannot shard '0'" in m["max_norm"] and "max_norm=1.0" in m["max_norm"]
    assert "scale_grad_by_freq=True" in m["scale_grad"]
    assert "plan='server' would put every table" in m["server"] and "pass sample=" in m["auto"]
    assert m["unknown"].startswith("KeyError") and "nope" in m["unknown"]
    assert "are no shards" in m["unswapped"]
    assert m["after"] == "looked up 9 tables"  # every error left the ranks in step


def test_a_checkpoint_saved_at_three_ranks_loads_at_five(tmp_path: Path) -> None:
    path = str(tmp_path / "tables.pt")
    launch(sw.save_worker, nprocs=3, args=(path,))
    for r in launch(sw.load_worker, nprocs=5, args=(path,)):
        assert r["loaded_equal"]  # the whole tables gathered at 5 ranks are the ones saved at 3
        assert r["step_error"] < TOL  # one more step equals the replicated path's from the same checkpoint
        assert r["local_equal"]  # each rank's own rows round-trip


def test_plan_auto_measures_the_tables_and_chooses_what_the_planner_chooses_from_the_measured_counts() -> None:
    """At P = 3 on a fixed link: every rank makes the same choice, which is make_plan's on the distinct rows
    counted here from the ranks' samples; the small table read whole stays replicated and the large
    ones are sharded."""
    P = 3
    res = launch(sw.auto_worker, nprocs=P)
    samples = [sw.auto_sample(r) for r in range(P)]
    per_table = {"small": [s[0] for s in samples], "big": [s[1] for s in samples], "big2": [s[3] for s in samples]}
    distinct = {
        n: (
            sum(torch.unique(x).numel() for x in xs) / P,
            torch.unique(torch.cat([x.reshape(-1) for x in xs])).numel(),
        )
        for n, xs in per_table.items()
    }
    rows = {"small": 8, "big": 5000, "big2": 5000}
    stats = [
        ParamStats(f"{n}.weight", (rows[n], 4 if n == "small" else 8), distinct[n][0] / rows[n], True,
                   distinct[n][0] / rows[n])
        for n in ("small", "big", "big2")
    ] + [ParamStats("fc.weight", (1, 20), 1.0, False), ParamStats("fc.bias", (1,), 1.0, False)]  # fmt: skip
    kinds = [KINDS.entry(k) for k in AUTO_KINDS]
    for r in res:
        assert r["backward"] == res[0]["backward"] > 0  # the slowest rank's backward, on every rank
        # the part of it the replicated reduction hides behind: none where the 3 ranks use all of a host's cores
        share = _hidden_share([(socket.gethostname(), _cores(), True)] * P)
        assert r["overlap"] == r["backward"] * share
        want = make_plan(stats, Cluster(P, measured=sw.AUTO_LINK), swap_modules=True, kinds=kinds,
                         overlap_seconds=r["overlap"]).kinds  # fmt: skip
        assert r["distinct"] == distinct
        assert r["kinds"] == want
        assert r["tables"] == {"small": "replicated", "big": "sharded", "big2": "sharded"}
        assert r["modules"] == {"small": "Embedding", "big": "ShardedEmbeddingBag", "big2": "ShardedEmbedding"}
        assert r["finite"]
        assert r["round"] is None  # a link the user set: no measured round, the choice depends on the data alone


def test_plan_auto_prices_each_round_as_measured_after_compute() -> None:
    """A round priced at 1 s keeps every table replicated where a free one shards the large tables (the
    exchange's three rounds, paid once: ``Plan.shared``); with nothing set, "auto" measures the round after the
    sample's forward, the same on every rank, and keeps it on the group for the next "auto"."""
    res = launch(sw.auto_round_worker, nprocs=3)
    for r in res:
        assert r["slow"] == {"small": "replicated", "big": "replicated", "big2": "replicated"}, r["slow"]
        assert r["free"] == {"small": "replicated", "big": "sharded", "big2": "sharded"}, r["free"]
        assert r["round"] == res[0]["round"] > 0 and r["again"] == r["round"] == r["kept"]
        assert r["a2a"] is not None  # measure_link's, which the plan prices rounds at least at


def test_rows_in_bf16_or_fp16_halve_the_rows_bytes_and_stay_near_fp32() -> None:
    """Opt-in lossy rows: the rows and gradient rows rounds carry half of fp32's bytes, the ids and sizes the same;
    after three SGD steps (lr 0.5) the losses are within 0.5% of fp32's and the shards differ from fp32's (each
    value rounded once per round) by under 3% of the largest weight for bf16, under 0.5% for fp16, which keeps
    more bits and lands nearer."""
    for r in launch(sw.wire_worker, nprocs=3):
        fp32 = r["None"]
        assert fp32["phases"]["rows"] > 0 and fp32["phases"]["grads"] > 0
        worst = {}
        for rows, bound in (("bf16", 3e-2), ("fp16", 5e-3)):
            low = r[rows]
            assert low["phases"]["rows"] * 2 == fp32["phases"]["rows"], rows
            assert low["phases"]["grads"] * 2 == fp32["phases"]["grads"], rows
            for phase in ("ids", "header", "padding"):  # the ids travel alike
                assert low["phases"][phase] == fp32["phases"][phase], (rows, phase)
            assert low["losses"] == pytest.approx(fp32["losses"], rel=5e-3), rows
            diffs = [float((a - b).abs().max()) for a, b in zip(low["shards"], fp32["shards"], strict=True)]
            scale = max(float(b.abs().max()) for b in fp32["shards"])
            worst[rows] = max(diffs)
            assert 0 < worst[rows] < bound * scale, (rows, diffs, scale)  # lossy, and said so: not equal
        assert worst["fp16"] < worst["bf16"]
        assert "rows='int8'" in r["bad"] and "bf16" in r["bad"]


def test_a_table_on_the_meta_device_is_drawn_in_shards_and_is_the_same_table_at_any_world_size() -> None:
    """No rank builds it whole: each draws its own rows; gathered, they are the table one process draws (P = 1),
    ``padding_idx``'s row zero; one SGD step moves exactly the rows looked up, by the summed gradient."""
    rows, small_rows = sw.META_ROWS
    ref = {
        "big.weight": init_rows(Ownership(rows, 1), 0, 3, torch.float32, 7, 2),
        "small.weight": init_rows(Ownership(small_rows, 1), 0, 3, torch.float32, 7, None),
    }
    assert float(ref["big.weight"][2].abs().sum()) == 0 and float(ref["big.weight"].std()) == pytest.approx(
        1, abs=0.02
    )
    # the documented rule, written out here: block b of 65,536 rows from a generator seeded by (seed, b)
    seeded = [torch.Generator().manual_seed(7 * 1_000_003 + b) for b in range(-(-rows // INIT_BLOCK))]
    blocks = [torch.randn(min(INIT_BLOCK, rows - start), 3, generator=g)
              for g, start in zip(seeded, range(0, rows, INIT_BLOCK), strict=True)]  # fmt: skip
    want = torch.cat(blocks)
    want[2] = 0  # padding_idx
    assert torch.equal(ref["big.weight"], want)
    res = launch(sw.meta_worker, nprocs=3)
    assert set(res[0]["whole"]) == set(ref) and all(torch.equal(res[0]["whole"][k], ref[k]) for k in ref)
    assert all(r["whole"] == {} for r in res[1:])  # the whole tables on rank 0 only
    step = {k: v.clone() for k, v in ref.items()}
    for r in res:
        ids, small = r["ids"]
        for i in ids[ids != 2]:  # sum pooling: each id's row gets -lr·1 per lookup (padding_idx none)
            step["big.weight"][i] -= 0.5
        for i in small:
            step["small.weight"][i] -= 0.5
    for rank, r in enumerate(res):
        assert r["devices"] == ["cpu"]
        for name, shard in zip(("big.weight", "small.weight"), r["shards"], strict=True):
            n = step[name].shape[0]
            assert torch.allclose(shard, step[name][torch.arange(rank, n, 3)], atol=1e-6), (rank, name)


def test_adagrad_and_sparse_adam_state_saved_at_three_ranks_continues_exactly_at_five(tmp_path: Path) -> None:
    """The shards' per-row optimizer state (Adagrad's sums, Adam's moments) is gathered whole and dealt to the
    rows' new owners: one step at 5 ranks after two at 3 equals one float64 process's three steps."""
    path = str(tmp_path / "state.pt")
    launch(sw.save_state_worker, nprocs=3, args=(path,))
    for rank, errors in enumerate(launch(sw.load_state_worker, nprocs=5, args=(path, 3))):
        assert all(e < TOL for e in errors.values()), (rank, errors)
