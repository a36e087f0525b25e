"""``SparsyncStrategy`` (sparsync.integrations.lightning) on real gloo groups: ``Trainer.fit`` of a small
LightningModule (a sparse table, a sparse bag, a linear layer; Adagrad) ends bit for bit at the parameters of the
hand-written sparsync loop on the same samples, for each path: ``DistributedOptimizer`` (reduction during
backward), ``sparsync.shard`` of both tables, and DDP with ``compression_hook(TopK, ErrorFeedback)``; with
``accumulate_grad_batches=2`` (``no_sync()`` on the micro-batches) at P = 3.

Why bit for bit: the strategy adds no arithmetic. Lightning's automatic optimisation runs the same forward,
``zero_grad`` and backward (the loss divided by ``accumulate_grad_batches``, as the loop does), then the
optimizer's ``step(closure)``, which ``DistributedOptimizer`` evaluates once before stepping; the ranks see the
same samples (the loop uses the DistributedSampler Lightning inserts: shuffled, seed 0). The ranks' processes
come from ``sparsync.launch``; Lightning joins their group (``ProcessGroupEnvironment``) and starts none."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("lightning", reason="needs the lightning extra: pip install -e '.[lightning]'")

import _lightning_workers as lw  # imports lightning

from sparsync import launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _check(res: list[dict[str, Any]], cases: tuple[tuple[str, int], ...]) -> None:
    """Per case and rank: Lightning's parameters equal the loop's bit for bit, training moved every one,
    and the replicated ones (all but a sharded case's tables) hold the same bits on every rank."""
    for rank, r in enumerate(res):
        for case, accumulate in cases:
            got, want = r[f"{case}/{accumulate}"]["lightning"], r[f"{case}/{accumulate}"]["plain"]
            assert got.keys() == want.keys(), (case, rank)
            for name, w in want.items():
                assert np.array_equal(got[name], w), (case, rank, name, float(np.abs(got[name] - w).max()))
                if case != "shard" or name.startswith("fc."):
                    assert not np.array_equal(w, r["start"][name]), (case, rank, name, "did not train")
                    assert np.array_equal(w, res[0][f"{case}/{accumulate}"]["plain"][name]), (case, rank, name)


def test_fit_equals_the_plain_loop_bit_for_bit_at_two_ranks() -> None:
    cases = (("optimizer", 1), ("shard", 1), ("hook", 1))
    _check(launch(lw.compare_worker, nprocs=2, args=(cases,)), cases)


def test_fit_with_gradient_accumulation_at_three_ranks() -> None:
    """P = 3 (the shards differ in size: 14, 13, 13 rows), ``accumulate_grad_batches=2`` over 3 batches a
    rank and epoch: a step after batch 2 and after the epoch's last batch, the micro-batches before a step
    inside ``no_sync()``."""
    cases = (("optimizer", 2), ("shard", 2), ("hook", 2))
    _check(launch(lw.compare_worker, nprocs=3, args=(cases,)), cases)


def test_misuse_raises_naming_the_bad_value() -> None:
    for r in launch(lw.misuse_worker, nprocs=1):  # refused before any collective: one rank shows it
        assert r["not_torch_optimizer"].startswith("TypeError: SparsyncStrategy: configure_optimizers returned a "
                                                   "NotATorchOptimizer"), r["not_torch_optimizer"]  # fmt: skip
        assert r["precision"].startswith("ValueError: SparsyncStrategy: precision='16-true' is not supported"), r
        assert r["hook_and_shard"].startswith("ValueError: SparsyncStrategy: ['shard_plan']"), r["hook_and_shard"]
        assert "ddp_options ['find_unused_parameters'] apply only with comm_hook=" in r["ddp_options_without_hook"]
