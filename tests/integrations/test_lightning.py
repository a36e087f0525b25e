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
(``ProcessGroupEnvironment``) and starts none."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("lightning", reason="needs the lightning extra: pip install -e '.[lightning]'")

import _lightning_workers as lw  # imports lightning

from sparsync import launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
Case = tuple[str, int, str]  # (path, accumulate_grad_batches, precision)


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


def test_fit_equals_the_plain_loop_bit_for_bit_at_two_ranks() -> None:
    cases = (
        ("optimizer", 1, "32-true"),
        ("shard", 1, "32-true"),
        ("hook", 1, "32-true"),
        ("optimizer", 1, "bf16-mixed"),
        ("optimizer", 1, "64-true"),
        ("hook", 1, "bf16-mixed"),
        ("hook", 1, "64-true"),
    )
    res = launch(lw.compare_worker, nprocs=2, args=(cases,))
    _check(res, cases)
    fp32, bf16 = res[0]["optimizer/1/32-true"]["lightning"], res[0]["optimizer/1/bf16-mixed"]["lightning"]
    assert not np.array_equal(fp32["fc.weight"], bf16["fc.weight"]), "bf16-mixed ran in float32"


@pytest.mark.slow
def test_fit_with_gradient_accumulation_at_three_ranks() -> None:
    """P = 3 (the shards differ in size: 14, 13, 13 rows), ``accumulate_grad_batches=2`` over 3 batches a
    rank and epoch: a step after batch 2 and after the epoch's last batch, the micro-batches before a step
    inside ``no_sync()``."""
    cases = (("optimizer", 2, "32-true"), ("shard", 2, "32-true"), ("hook", 2, "32-true"))
    _check(launch(lw.compare_worker, nprocs=3, args=(cases,)), cases)


def test_validate_shards_and_broadcasts_rank_zeros_module() -> None:
    """``trainer.validate`` (no optimizer to broadcast the parameters) of a module whose ranks start apart: every
    rank ends with rank 0's linear layer and its own rows (r, r + 2, ...) of rank 0's tables, and the logged loss
    (each rank's 12 samples, averaged over the ranks) is rank 0's module's on all 24 samples in one process,
    within float32 rounding of the two summation orders."""
    for rank, r in enumerate(launch(lw.validate_worker, nprocs=2)):
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
