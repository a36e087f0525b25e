"""``SparsyncStrategy`` (sparsync.integrations.lightning) on real gloo groups: ``Trainer.fit`` of a small
LightningModule (a sparse table, a sparse bag, a linear layer; Adagrad) ends bit for bit at the parameters of the
hand-written sparsync loop on the same samples, for each path: ``DistributedOptimizer`` (reduction during
backward), ``sparsync.shard`` of both tables, and DDP with ``compression_hook(TopK, ErrorFeedback)``; at
``precision="64-true"`` and ``"bf16-mixed"`` too; with ``accumulate_grad_batches=2`` (``no_sync()`` on the
micro-batches) at P = 3.

Why bit for bit: the strategy adds no arithmetic. Lightning's automatic optimisation runs the same forward,
``zero_grad`` and backward (the loss divided by ``accumulate_grad_batches``, as the loop does), then the
optimizer's ``step(closure)``, which ``DistributedOptimizer`` evaluates once before stepping; the ranks see the
same samples (the loop uses the DistributedSampler Lightning inserts: shuffled, seed 0); the precision plugins'
contexts are torch's (``torch.autocast`` for bf16-mixed, float64 module and inputs for 64-true), which the loop
uses too. The ranks' processes come from ``sparsync.launch``; Lightning joins their group
(``ProcessGroupEnvironment``) and starts none, but in ``test_lightning_launches_the_ranks_itself``, where
Lightning's own launcher starts them. Clipping (``gradient_clip_val``, ``clip_gradients``), two optimizers
(manual optimisation) and a ``ModelCheckpoint`` resumed by ``fit(ckpt_path=...)`` are compared the same way: with
the loop, or with the uninterrupted run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("lightning", reason="needs the lightning extra: pip install -e '.[lightning]'")

import _lightning_workers as lw  # imports lightning

from sparsync import launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
Case = tuple[str, int, str]  # (path, accumulate_grad_batches, precision)
# what a launcher (torchrun, sparsync.launch, Lightning's own) sets in its ranks: absent when Lightning launches
LAUNCH_VARIABLES = {"MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"}
LAUNCH_VARIABLES |= {"NODE_RANK", "GROUP_RANK"}


def _check(res: list[dict[str, Any]], cases: tuple[Case, ...]) -> None:
    """Per case and rank: Lightning's parameters equal the loop's bit for bit, training moved every one,
    and the replicated ones (all but a sharded case's tables) hold the same bits on every rank."""
    for rank, r in enumerate(res):
        for case in cases:
            key = "/".join(map(str, case))
            got, want = r[key]["lightning"], r[key]["plain"]
            assert got.keys() == want.keys(), (key, rank)
            for name, w in want.items():
                assert np.array_equal(got[name], w), (key, rank, name, float(np.abs(got[name] - w).max()))
                if case[0] != "shard" or name.startswith("fc."):
                    assert not np.array_equal(w, r["start"][name]), (key, rank, name, "did not train")
                    assert np.array_equal(w, res[0][key]["plain"][name]), (key, rank, name, "ranks differ")


FIT_CASES: tuple[Case, ...] = (
    ("optimizer", 1, "32-true"),
    ("shard", 1, "32-true"),
    ("hook", 1, "32-true"),
    ("optimizer", 1, "bf16-mixed"),
    ("optimizer", 1, "64-true"),
    ("hook", 1, "bf16-mixed"),
    ("hook", 1, "64-true"),
)
CLIP_CASES = (("optimizer", "norm", 0.05), ("optimizer", "value", 0.01), ("shard", "value", 0.01),
              ("shard", "norm", 0.05))  # fmt: skip
CHECKPOINT_CASES = ("optimizer", "shard")


@pytest.fixture(scope="module")
def at_two(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The tests at P = 2 below in one launch (a launch's ranks import Lightning anew): the fits against the
    loop, the clipping and two optimizers, the checkpoint, the validation (``lw.parts_worker``)."""
    root = str(tmp_path_factory.mktemp("lightning_checkpoints"))
    parts = {
        "fit": ("compare_worker", (FIT_CASES,)),
        "clip": ("clip_worker", (CLIP_CASES,)),
        "checkpoint": ("checkpoint_worker", (root, CHECKPOINT_CASES)),
        "validate": ("validate_worker", ()),
    }
    return launch(lw.parts_worker, nprocs=2, args=(parts,))


def _part(at_two: list[dict[str, Any]], label: str) -> list[Any]:
    """Every rank's result of one part of ``at_two``; a part that raised fails the test with its error (and can
    leave the group out of step for the parts after it, whose tests then fail too)."""
    for rank, r in enumerate(at_two):
        if isinstance(r[label], str):
            pytest.fail(f"rank {rank}: {r[label].splitlines()[0]}\n{r[label][-3000:]}")
    return [r[label] for r in at_two]


def test_fit_equals_the_plain_loop_bit_for_bit_at_two_ranks(at_two: list[dict[str, Any]]) -> None:
    res = _part(at_two, "fit")
    _check(res, FIT_CASES)
    fp32, bf16 = res[0]["optimizer/1/32-true"]["lightning"], res[0]["optimizer/1/bf16-mixed"]["lightning"]
    assert not np.array_equal(fp32["fc.weight"], bf16["fc.weight"]), "bf16-mixed ran in float32"


@pytest.mark.slow
def test_fit_with_gradient_accumulation_at_three_ranks() -> None:
    """P = 3 (the shards differ in size: 14, 13, 13 rows), ``accumulate_grad_batches=2`` over 3 batches a
    rank and epoch: a step after batch 2 and after the epoch's last batch, the micro-batches before a step
    inside ``no_sync()``."""
    cases = (("optimizer", 2, "32-true"), ("shard", 2, "32-true"), ("hook", 2, "32-true"))
    _check(launch(lw.compare_worker, nprocs=3, args=(cases,)), cases)


@pytest.mark.slow
def test_lightning_launches_the_ranks_itself(tmp_path: Path) -> None:
    """No process group before ``fit``: ``Trainer(devices=2, accelerator="cpu")`` runs the script again in a
    second process (Lightning's ``popen`` launcher, as for ``DDPStrategy``) and makes the gloo group; the fit
    (both tables sharded) ends bit for bit where the plain loop does in that group."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    script = Path(__file__).with_name("_lightning_launched.py")
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=240,
        env={**env, "TORCH_CPP_LOG_LEVEL": "ERROR"}, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(2)]
    for rank, r in enumerate(res):
        assert (r["group_before_fit"], r["world"]) == (False, 2), (rank, r["group_before_fit"], r["world"])
        for name, want in r["plain"].items():
            got = r["lightning"][name]
            assert np.array_equal(got, want), (rank, name, float(np.abs(got - want).max()))
    for name in ("fc.weight", "fc.bias"):  # the tables: each rank its own rows
        assert not np.array_equal(res[0]["plain"][name], res[0]["start"][name]), (name, "did not train")
        assert np.array_equal(res[0]["plain"][name], res[1]["plain"][name]), (name, "ranks differ")


def test_gradient_clipping_and_two_optimizers_equal_the_plain_loop_at_two_ranks(
    at_two: list[dict[str, Any]],
) -> None:
    """``gradient_clip_val`` by norm and by value (sharded tables too: their norm counts every rank's rows) ends
    bit for bit where the plain loop that clips through
    ``DistributedOptimizer`` does, and apart from the loop without clipping (the clipping acted). Two optimizers
    (manual optimisation: Lightning's way to several; Adagrad on the tables, SGD with momentum on the linear
    layer, each clipped by ``clip_gradients``: the tables' sparse gradients by norm, the layer's by value) each
    wrapped in a ``DistributedOptimizer``, bit for bit against the loop with two."""
    res = _part(at_two, "clip")
    for rank, r in enumerate(res):
        for case, algorithm, value in CLIP_CASES:
            run = r[f"{case}/{algorithm}/{value}"]
            for name, want in run["plain"].items():
                got = run["lightning"][name]
                assert np.array_equal(got, want), (case, algorithm, rank, name, float(np.abs(got - want).max()))
                assert not np.array_equal(want, run["unclipped"][name]), (
                    case,
                    algorithm,
                    rank,
                    name,
                    "not clipped",
                )
                if case != "shard" or name.startswith("fc."):
                    other = res[0][f"{case}/{algorithm}/{value}"]["plain"][name]
                    assert np.array_equal(want, other), (case, algorithm, rank, name, "ranks differ")
        two = r["two_optimizers"]
        assert two["kinds"] == ["DistributedOptimizer"] * 2, two["kinds"]
        for name, want in two["plain"].items():
            assert np.array_equal(two["lightning"][name], want), (rank, name, "two optimizers")
            assert not np.array_equal(want, two["start"][name]), (rank, name, "did not train")
            assert np.array_equal(want, res[0]["two_optimizers"]["plain"][name]), (rank, name, "ranks differ")


def test_checkpoint_resumes_bit_for_bit(at_two: list[dict[str, Any]]) -> None:
    """``ModelCheckpoint`` after each of 2 epochs, then a module from another seed ``fit(ckpt_path=<epoch 0>)``
    to the same end: its parameters equal the uninterrupted run's bit for bit, on the default path and with both
    tables sharded, whose checkpoint (written by rank 0) holds each table whole and its whole Adagrad state."""
    res = _part(at_two, "checkpoint")
    for rank, r in enumerate(res):
        for case in CHECKPOINT_CASES:
            for name, want in r[case]["uninterrupted"].items():
                got = r[case]["resumed"][name]
                assert np.array_equal(got, want), (case, rank, name, float(np.abs(got - want).max()))
    whole = {"emb.weight": (40, 4), "sums": [(40, 4), (24, 4), (1, 8), (1,)]}
    assert res[0]["shard"]["saved"] == res[0]["optimizer"]["saved"] == whole, res[0]["shard"]["saved"]
    shard_rows = res[0]["shard"]["uninterrupted"]["emb.weight"].shape
    assert shard_rows == (20, 4), shard_rows


def test_validate_shards_and_broadcasts_rank_zeros_module(at_two: list[dict[str, Any]]) -> None:
    """``trainer.validate`` (no optimizer to broadcast the parameters) of a module whose ranks start apart: every
    rank ends with rank 0's linear layer and its own rows (r, r + 2, ...) of rank 0's tables, and the logged loss
    (each rank's 12 samples, averaged over the ranks) is rank 0's module's on all 24 samples in one process,
    within float32 rounding of the two summation orders."""
    for rank, r in enumerate(_part(at_two, "validate")):
        for name in ("emb.weight", "bag.weight"):
            assert np.array_equal(r["after"][name], r["rank0"][name][rank::2]), (rank, name)
        for name in ("fc.weight", "fc.bias"):
            assert np.array_equal(r["after"][name], r["rank0"][name]), (rank, name)
        assert r["val_loss"] == pytest.approx(r["whole"], rel=1e-6), r


def test_misuse_raises_naming_the_bad_value() -> None:
    """Each refusal names the bad value; an optimizer that is a DistributedOptimizer already is used as it is;
    and the reason for ``comm_hook=``: Lightning's own ``DDPStrategy`` never
    registers a ``ddp_comm_hook`` on CPU (its ``_register_ddp_hooks`` does so on CUDA only), where
    ``SparsyncStrategy`` does: once per bucket and step, 3 buckets (DDP gives each sparse gradient a bucket of its
    own) and 12 steps (2 epochs of 24 samples in batches of 4, one rank)."""
    for r in launch(lw.misuse_worker, nprocs=1):  # refused before any collective: one rank shows it
        assert r["already_wrapped"] == "no error, the same: True", r["already_wrapped"]
        assert r["hook_calls"] == {"DDPStrategy": 0, "SparsyncStrategy": 3 * 12}, r["hook_calls"]
        assert r["not_torch_optimizer"].startswith(
            "TypeError: SparsyncStrategy: configure_optimizers returned a NotATorchOptimizer"
        ), r["not_torch_optimizer"]
        assert r["precision"].startswith("ValueError: SparsyncStrategy: precision='16-true' is not supported"), r
        assert r["fit_twice"].startswith("ValueError: SparsyncStrategy: this Net was fitted"), r["fit_twice"]
        assert r["hook_and_shard"].startswith("ValueError: SparsyncStrategy: ['shard_plan']"), r["hook_and_shard"]
        assert "ddp_options ['find_unused_parameters'] apply only with comm_hook=" in r["ddp_options_without_hook"]
        assert "multiple optimizers is only supported with manual optimization" in r["two_automatic"], r
        assert r["clip_sparse_hook"].startswith(
            "ValueError: SparsyncStrategy: gradient_clip_val=0.05 (gradient_clip_algorithm='norm') with "
            "comm_hook=: 2 sparse gradient(s)"
        ), r["clip_sparse_hook"]
        assert r["checkpoint_local"].startswith(
            "ValueError: SparsyncStrategy: shard_options state_dict='local' cannot go into a Lightning checkpoint"
        ), r["checkpoint_local"]
        assert r["checkpoint_fused"].startswith(
            "ValueError: SparsyncStrategy: shard_options optimizer=Adagrad keeps its per-row state"
        ), r["checkpoint_fused"]


@pytest.mark.slow
def test_the_example_trains_each_way() -> None:
    """examples/lightning_recommender.py at P = 2 for 2 epochs: every way's loss falls (0.70 to about 0.66),
    and the sharded tables train as the replicated ones do (the same loss to 4 digits)."""
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "lightning_recommender.py"), "--epochs", "2"],
        capture_output=True, text=True, timeout=280, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    loss = {
        w.strip(): (float(a), float(b))
        for w, a, b in re.findall(r"^  (.+?)\s+loss (\S+) -> (\S+)$", proc.stdout, re.M)
    }
    assert set(loss) == {"DistributedOptimizer", "sharded tables", "top-k on the MLP", "DDP + compression_hook"}, (
        proc.stdout
    )
    assert all(last < first - 0.02 for first, last in loss.values()), loss
    assert loss["sharded tables"] == loss["DistributedOptimizer"], loss


def test_the_trainer_of_the_pytorch_lightning_package_refuses_it() -> None:
    """docs/integrations.md: the strategy is a ``lightning.pytorch`` class; ``pytorch_lightning``'s Trainer, the
    same code installed under another name, takes only its own classes."""
    ptl = pytest.importorskip("pytorch_lightning", reason="pytorch_lightning is not installed")
    from sparsync.integrations.lightning import SparsyncStrategy

    with pytest.raises(ValueError, match=re.escape("instance of `pytorch_lightning.strategies.Strategy`")):
        ptl.Trainer(strategy=SparsyncStrategy(), accelerator="cpu", logger=False)


def test_import_sparsync_imports_neither_extra() -> None:
    code = "import sys, sparsync; print(sorted({'lightning', 'accelerate'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]", done.stdout
