"""A two-table recommender trained by PyTorch Lightning's ``Trainer`` under ``SparsyncStrategy``, four ways.

python examples/lightning_recommender.py              # 2 local processes (sparsync.launch), ~1 min on 2 cores
python examples/lightning_recommender.py --procs 3 --epochs 2

Needs the lightning extra (``pip install -e '.[lightning]'``). The model: a user table (``nn.Embedding``) and
an item-history table (``nn.EmbeddingBag``), both with sparse gradients, and an MLP over them, learning a click
target made from hidden user and item factors; skewed (Zipf-like) ids, the hot ones low. Each way starts from
the same weights and data and prints its mean training loss in the first and the last epoch:

- ``DistributedOptimizer``: ``SparsyncStrategy()``: the tables' rows by the row-sparse allreduce, the MLP in
  dense buckets, during backward;
- ``sharded tables``: ``SparsyncStrategy(shard_plan={})``: both tables' rows owned by the ranks
  (``sparsync.shard``), the MLP as above;
- ``top-k on the MLP``: ``optimizer_options={"plan": {...: Compressed(TopK(0.1), ErrorFeedback())}}``: the MLP's
  weight matrices by 10% top-k with error feedback;
- ``DDP + compression_hook``: ``comm_hook=compression_hook(TopK(0.1), ErrorFeedback(), module=module)``: the
  module in DDP, its buckets reduced by sparsync's hook.
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import sparsync
from sparsync.compress import ErrorFeedback, TopK
from sparsync.compress.hooks import compression_hook
from sparsync.integrations.lightning import SparsyncStrategy
from sparsync.placement import Compressed

USERS, ITEMS, DIM, HISTORY, SAMPLES = 5_000, 20_000, 16, 10, 4_096


class Recommender(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.users = nn.Embedding(USERS, DIM, sparse=True)
        self.items = nn.EmbeddingBag(ITEMS, DIM, mode="mean", sparse=True)
        self.mlp = nn.Sequential(nn.Linear(2 * DIM, 64), nn.ReLU(), nn.Linear(64, 1))
        self.losses: list[float] = []

    def forward(self, user: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        looked = [self.users(user), self.items(history)]  # both before either is used: one exchange if sharded
        return self.mlp(torch.cat(looked, 1)).squeeze(1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        user, history, clicked = batch
        loss = nn.functional.binary_cross_entropy_with_logits(self(user, history), clicked)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adagrad(self.parameters(), lr=0.05)


def data() -> TensorDataset:
    """Clicks from hidden factors: a user clicks when their factor agrees with their history's mean factor."""
    g = torch.Generator().manual_seed(1)
    user = (torch.rand(SAMPLES, generator=g) ** 2 * USERS).long()
    history = (torch.rand(SAMPLES, HISTORY, generator=g) ** 3 * ITEMS).long()
    u, i = torch.randn(USERS, 4, generator=g), torch.randn(ITEMS, 4, generator=g)
    clicked = ((u[user] * i[history].mean(1)).sum(1) > 0).float()
    return TensorDataset(user, history, clicked)


def strategy(way: str, module: Recommender) -> SparsyncStrategy:
    if way == "sharded tables":
        return SparsyncStrategy(shard_plan={})
    if way == "top-k on the MLP":
        plan = {name: Compressed(TopK(0.1), ErrorFeedback()) for name in ("mlp.0.weight", "mlp.2.weight")}
        return SparsyncStrategy(optimizer_options={"plan": plan})
    if way == "DDP + compression_hook":
        return SparsyncStrategy(comm_hook=compression_hook(TopK(0.1), ErrorFeedback(), module=module))
    return SparsyncStrategy()


WAYS = ("DistributedOptimizer", "sharded tables", "top-k on the MLP", "DDP + compression_hook")


def work(rank: int, epochs: int) -> dict[str, tuple[float, float]]:
    """Per way: the mean loss of this rank's first and last epoch."""
    sparsync.set_deterministic()
    out = {}
    for way in WAYS:
        module = Recommender()
        trainer = pl.Trainer(
            strategy=strategy(way, module), accelerator="cpu", max_epochs=epochs, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(module, DataLoader(data(), batch_size=64))
        per_epoch = len(module.losses) // epochs
        first, last = module.losses[:per_epoch], module.losses[-per_epoch:]
        out[way] = (sum(first) / per_epoch, sum(last) / per_epoch)
    return out


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=2, help="local processes (default 2)")
    parser.add_argument("--epochs", type=int, default=4, help="epochs of 4,096 samples (default 4)")
    args = parser.parse_args(argv)
    results = sparsync.launch(work, nprocs=args.procs, args=(args.epochs,))
    print(f"{args.procs} ranks, {args.epochs} epochs, mean training loss of rank 0 (first epoch -> last epoch):")
    for way in WAYS:
        first, last = results[0][way]
        print(f"  {way:24s} loss {first:.4f} -> {last:.4f}")


if __name__ == "__main__":
    main()
