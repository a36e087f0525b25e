"""Replicated tables in groups with a fused optimizer (``sparsync.shard(plan, optimizer=...)``, ``replicated``):
exact against one float64 process of the unfused model with torch's optimizers (row-wise Adagrad against
``_fused_workers``' reference) at P = 1, 3, 5, every table replicated and beside sharded ones, over
``_shard_workers``' nine tables (sum and mean bags, per_sample_weights, padding_idx, include_last_offset,
nn.Embedding; uneven batches, an empty batch on one rank, ids absent from a step, tables absent from a step);
the replicas bit-identical across ranks and run to run; bad input refused alike on every rank; checkpoints of
the unfused model in and out, and of the grouped one with its fused state; ``DistributedOptimizer`` over every
parameter; ``Lookahead`` beside the groups; the path under NCCL's rules (``tests/_nccl_rules.py``)."""

from __future__ import annotations

from pathlib import Path

import _replicated_workers as rw
import pytest
import torch
from _nccl_rules import check_clean, under_nccl_rules

from sparsync import launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]
TOL = 1e-12  # float64 on both sides: only the order of the sums over ranks differs


@pytest.mark.parametrize("P", [1, 3, 5])
def test_replicated_groups_equal_torchs_optimizers_on_one_float64_process(P: int) -> None:
    res = launch(rw.exact_worker, nprocs=P)
    for rank, out in enumerate(res):
        for case, r in out.items():
            if case == "again":
                continue
            assert max(r["errors"]) < TOL, (P, rank, case, r["errors"])
            assert r["grads"] == [False] * len(r["grads"]), (case, r["grads"])  # updated in backward: no .grad
            assert r["dense"] == 0, case  # the model is all tables: nothing left for another optimizer
            assert (r["replicated"], r["groups"]) == ((9, 4) if case.startswith("replicated/") else (5, 4)), case
            for k, w in r["weights"].items():  # the replicas: bit-identical on every rank
                assert torch.equal(w, res[0][case]["weights"][k]), (P, rank, case, k)
        first = out["mixed/sgd"]["weights"]
        assert all(torch.equal(first[k], w) for k, w in out["again"].items()), (P, rank)  # run to run


def test_bad_input_is_refused_alike_on_every_rank_before_any_update() -> None:
    res = launch(rw.bad_input_worker, nprocs=3, timeout=30)  # a rank left waiting fails in 30 s, not 120
    for out in res:
        assert out["differ"] == res[0]["differ"] and "rank 1 has" in out["differ"], out["differ"]
        assert "t.emb (replicated): Embedding(18, 4)" in out["differ"], out["differ"]
        assert "replicated tables of width" in out["converted"], out["converted"]
        assert "no longer views the group's storage" in out["converted"], out["converted"]
        assert out["negative"] == res[0]["negative"] and out["past"] == res[0]["past"], res
        assert "refused on rank 0" in out["negative"] and "id -1 is negative" in out["negative"], out
        assert "refused on rank 2" in out["past"] and "id 17 is out of range" in out["past"], out
        assert "'t.emb' (replicated Embedding(17, 4" in out["past"], out
        assert out["unchanged"] and out["stepped"], out


def test_a_checkpoint_of_the_unfused_model_loads_into_the_grouped_one_and_back() -> None:
    res = launch(rw.checkpoint_worker, nprocs=3)
    for rank, out in enumerate(res):
        assert out["full"] and out["local"] and out["sharded"], (rank, out)  # whole tables, every layout
        assert out["loaded_rows"] and out["viewing"], (rank, out)
    assert res[0]["back"] and res[0]["moved"], res[0]


def test_a_checkpoint_of_the_grouped_model_and_its_fused_state_resumes_bit_for_bit(tmp_path: Path) -> None:
    for out in launch(rw.resume_worker, nprocs=3, args=(str(tmp_path / "ckpt"),)):
        assert out == {"dcp": True, "full": True}, out


def test_distributed_optimizer_over_every_parameter_leaves_the_grouped_tables_to_their_fused_optimizer() -> None:
    res = launch(rw.optimizer_worker, nprocs=3)
    for out in res:
        assert out["all plan"] == out["dense plan"] == [], out  # plan_of: the grouped tables carry no placement
        assert out["all aliased"] == out["dense aliased"] == [None, None], out  # the broadcast kept the views
        for k, v in out["dense"].items():
            assert torch.equal(out["all"][k], v), k  # not reduced nor stepped a second time
            assert torch.equal(res[0]["dense"][k], v), k  # the same on every rank


def test_lookahead_over_the_sharded_tables_beside_grouped_replicated_ones() -> None:
    assert launch(rw.lookahead_worker, nprocs=3) == [True] * 3


def test_the_grouped_replicated_path_under_nccl_rules_equals_the_run_without_them() -> None:
    plain = launch(rw.nccl_worker, nprocs=3)
    ruled = launch(under_nccl_rules, nprocs=3, args=(rw.nccl_worker,))
    check_clean([r["nccl_rules"] for r in ruled])
    for a, r in zip(plain, (o["result"] for o in ruled), strict=True):
        assert a["rows"].keys() == r["rows"].keys()
        assert all(torch.equal(a["rows"][k], r["rows"][k]) for k in a["rows"]), a["rows"].keys()
        assert a["refused"] == r["refused"], (a["refused"], r["refused"])
        assert "id 17 is out of range" in a["refused"], a["refused"]


def test_hybrid_trainer_refuses_tables_updated_in_backward() -> None:
    for out in launch(rw.hybrid_refusal_worker, nprocs=2):
        assert "HybridTrainer cannot train" in out["refused"], out
        for name in rw.MIXED:  # every table, the replicated groups' and the sharded ones'
            assert f"'{name}.weight'" in out["refused"], (name, out)
        assert out["plain"] == "", out  # without optimizer=: nothing updated in backward


@pytest.mark.parametrize("P", [1, 3, 5])
def test_ddp_over_the_rest_leaves_the_tables_updated_in_backward_alone(P: int) -> None:
    """``DistributedDataParallel(model)`` over a model with a sharded table and a replicated group trained in
    backward, as a torchrec user puts the dense layers in DDP: exact against one float64 process."""
    res = launch(rw.ddp_worker, nprocs=P)
    assert max(res[0]["errors"]) < TOL, res[0]["errors"]
    for out in res:
        assert out["ignored"] == ["a.weight", "b.weight"], out["ignored"]


@pytest.mark.parametrize("P", [1, 3])
def test_ddp_refuses_tables_sharded_without_an_optimizer_before_it_broadcasts(P: int) -> None:
    """Tables sharded for ``DistributedOptimizer`` (no ``optimizer=``) hold each rank's own rows and a gradient
    summed over the ranks: DDP around them broadcast rank 0's rows over every shard, then failed at the first
    backward with "Cannot access storage of SparseTensorImpl". Now its constructor raises, naming the table and
    the ways out, on every rank, before its broadcast; with ``optimizer=`` DDP wraps the model as before. A table
    on the parameter server is refused too (only ``HybridTrainer`` trains it)."""
    for out in launch(rw.ddp_refused_worker, nprocs=P, timeout=30):
        assert "without optimizer= (a.weight)" in out["refused"], out["refused"]
        assert "sparsync.DistributedOptimizer" in out["refused"], out["refused"]
        assert out["kept"]
        assert out["wrapped"] == ["a.weight", "b.weight"], out["wrapped"]
        assert "tables placed on the parameter server (a.weight)" in out["server"], out["server"]
        assert "HybridTrainer" in out["server"], out["server"]
