"""DCP checkpoints of sharded tables (``sparsync.sharding.checkpoint``, ``dcp``) on real gloo groups: saved at
P = 4 and resumed at P = 4 (against the uninterrupted run), 3, 5, 6 and 1 (against the same state loaded through
the full state dicts) exactly, losses and parameters bit for bit, with torch's SGD with momentum, Adagrad and
SparseAdam on the tables and with the tables' fused Adagrad, row-wise Adagrad and Adam (their per-row state and
Adam's step counts); the fused optimizers' local state dicts at the same P; into the unsharded model and from
it; each rank's peak memory (torch's allocations and the Python heap) while saving and loading a table four
times its shard; a table of another shape or dtype, a fused table whose state the checkpoint lacks, or
optimizers of another kind, refused by name; the fused optimizers' saved hyperparameters loaded."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import _checkpoint_workers as cw
import pytest
import torch

from sparsync import launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The same keys, and each value the same tensor bit for bit (or the same number: SparseAdam's step)."""
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two optimizer state dicts' per-parameter tensors and fused tables' state, bit for bit."""
    fused_a, fused_b = a.get("fused", {}), b.get("fused", {})
    return (
        a["state"].keys() == b["state"].keys()
        and all(_same(dict(a["state"][i]), dict(b["state"][i])) for i in a["state"])
        and fused_a.keys() == fused_b.keys()
        and all(_same(fused_a[t], fused_b[t]) for t in fused_a)
    )


@pytest.fixture(scope="module")
def saved_at_four(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = str(tmp_path_factory.mktemp("dcp4"))
    launch(cw.grid_save_worker, nprocs=4, args=(folder,))
    return folder


@pytest.mark.parametrize("P", [4, 3, 5, 6, 1])
def test_a_checkpoint_saved_at_four_ranks_resumes_exactly_at_any_world_size(saved_at_four: str, P: int) -> None:
    res = launch(cw.grid_resume_worker, nprocs=P, args=(saved_at_four,))
    for name in cw.OPTIMIZERS:
        full, ostate, (on_losses, on_model) = torch.load(f"{saved_at_four}/{name}.pt", weights_only=False)
        r0 = res[0][name]
        assert _same(r0["loaded"], full), name  # the tables and the head as saved at 4 ranks
        assert _same_state(r0["loaded_opt"], ostate), name  # every row's state, the step counts, the head's
        for rank, r in enumerate(res):
            losses, model = r[name]["dcp"]
            want_losses, want_model = r[name]["full"]
            assert losses == want_losses, (name, rank, losses, want_losses)
            assert _same(model, want_model), (name, rank)
        if P == 4:  # the same sums in the same order: the resumed run is the uninterrupted one
            assert r0["dcp"][0] == on_losses and _same(r0["dcp"][1], on_model), name


def test_the_fused_optimizers_local_state_dicts_resume_exactly_at_the_same_world_size() -> None:
    for rank, r in enumerate(launch(cw.local_worker, nprocs=3)):
        for name, got in r.items():
            assert got["loaded"][0] == got["on"][0], (name, rank)
            assert _same(got["loaded"][1], got["on"][1]), (name, rank)
            assert "state 'sum' must have shape" in got["bad"] or "state 'exp_avg' must have shape" in got["bad"]


def test_the_unsharded_model_loads_a_sharded_checkpoint_and_writes_one_that_loads_sharded(
    saved_at_four: str, tmp_path: Path
) -> None:
    for name, r in launch(cw.grid_unsharded_worker, nprocs=1, args=(saved_at_four,))[0].items():
        full, ostate, _ = torch.load(f"{saved_at_four}/{name}.pt", weights_only=False)
        assert _same(r["model"], full), name
        assert _same_state(r["opt"], ostate), name
    folder = str(tmp_path)
    launch(cw.grid_save_worker, nprocs=1, args=(folder, False))  # the unsharded model (sparse gradients)
    res = launch(cw.grid_resume_worker, nprocs=3, args=(folder, tuple(cw.TORCH)))
    for name in cw.TORCH:
        full, ostate, _ = torch.load(f"{folder}/{name}.pt", weights_only=False)
        assert _same(res[0][name]["loaded"], full), name
        assert _same_state(res[0][name]["loaded_opt"], ostate), name
        for r in res:
            assert r[name]["dcp"][0] == r[name]["full"][0], name
            assert _same(r[name]["dcp"][1], r[name]["full"][1]), name


def test_no_rank_holds_more_than_its_shard_and_one_block_while_saving_or_loading(tmp_path: Path) -> None:
    """A table of 16.4 MB with its fused Adam (two per-row moments) saved at 4 ranks (a shard: a quarter of it)
    and loaded at 3 and 6: what each rank allocates beyond its shards (torch's allocations plus the Python heap's
    peak, each measured alone: ``peaks``) stays under one block of the checkpoint (a block, the rows one rank
    writes or reads, is a shard's size), since the rows are re-blocked and written or read one window at a time
    (measured at 1M rows: docs/data/dcp_peak.json); the rows loaded are the table and the moments drawn at 4
    ranks, the step count saved."""
    path = str(tmp_path / "big")
    row = cw.BIG[1] * 4
    for P, worker in ((4, cw.big_save_worker), (3, cw.big_load_worker), (6, cw.big_load_worker)):
        block = -(-cw.BIG[0] // P) * row
        for r in launch(worker, nprocs=P, args=(path,)):
            assert r.get("equal", True), (P, r)
            assert r["torch"] + r["python"] <= block, (P, r, block)


def test_a_table_of_another_shape_or_dtype_or_without_its_fused_state_is_refused_by_name(tmp_path: Path) -> None:
    for r in launch(cw.bad_worker, nprocs=3, args=(str(tmp_path / "ck"),)):
        assert "table 'bag.weight' has shape (151, 3) and dtype torch.float64" in r["shape"], r
        assert "model's has shape (152, 3)" in r["shape"], r
        assert "model's has shape (151, 3) and dtype torch.float32" in r["dtype"], r
        assert "table 'bag.weight' has no fused optimizer; the model's has Adam" in r["fused"], r
        assert "block_rows must be a positive int, got 0" in r["rows"], r


def test_optimizers_of_another_kind_are_refused_by_name_and_the_fused_hyperparameters_load(tmp_path: Path) -> None:
    for r in launch(cw.kinds_worker, nprocs=3, args=(str(tmp_path),)):
        for case in ("fused", "full"):
            assert (
                "table 'bag.weight' has the fused optimizer Adagrad; the model's has RowwiseAdagrad" in r[case]
            ), r
        assert "RowwiseAdagrad: the state dict is of another optimizer, Adagrad" in r["local"], r
        assert "the checkpoint holds the state of Adagrad; the optimizer given is SGD" in r["torch"], r
        assert "the checkpoint holds no optimizer state; the optimizer given is Adagrad" in r["none"], r
        assert "table 'bag.weight' has the fused optimizer Adam" in r["held"], r
        assert "the model's is updated by the Adam given" in r["held"], r
        assert r["lr"] == (0.01, (0.9, 0.999)), r


def test_the_sharded_layout_goes_through_dcp_save_and_load_as_they_are(tmp_path: Path) -> None:
    assert launch(cw.plain_dcp_worker, nprocs=3, args=(str(tmp_path / "plain"),)) == [True] * 3


@pytest.mark.slow
def test_the_elastic_example_resumes_on_another_world_size(tmp_path: Path) -> None:
    """examples/elastic_sharded.py: six steps at 4 ranks, then 3 ranks resume at step 6 from its DCP checkpoint;
    two such resumes from copies of it end at the same loss and parameters."""
    example = str(Path(__file__).resolve().parents[2] / "examples" / "elastic_sharded.py")

    def run(folder: Path, nprocs: int, steps: int) -> str:
        args = [sys.executable, example, str(folder), "--nprocs", str(nprocs), "--steps", str(steps)]
        done = subprocess.run(args, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip()

    assert run(tmp_path / "a", 4, 6).startswith("4 ranks resumed at step 0")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    first, second = run(tmp_path / "a", 3, 8), run(tmp_path / "b", 3, 8)
    assert first.startswith("3 ranks resumed at step 6, loss ") and first == second, (first, second)
