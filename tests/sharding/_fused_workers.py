"""Workers of tests/sharding/test_fused.py: the 7-table model of ``_shard_workers`` sharded with each fused
optimizer, against one float64 process of the unsharded model (torch's optimizers; row-wise Adagrad written
here)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import _shard_workers as sw
import torch
import torch.distributed as dist
from torch import nn

import sparsync
from sparsync.sharding import SGD, Adagrad, Adam, RowwiseAdagrad, dense_parameters
from sparsync.sharding.group import Fused

LR = {"sgd": 0.05, "adagrad": 0.1, "rowwise_adagrad": 0.1, "adam": 0.01}
FUSED: dict[str, Callable[[], Fused]] = {
    "sgd": lambda: SGD(lr=LR["sgd"]),
    "adagrad": lambda: Adagrad(lr=LR["adagrad"]),
    "rowwise_adagrad": lambda: RowwiseAdagrad(lr=LR["rowwise_adagrad"]),
    "adam": lambda: Adam(lr=LR["adam"]),
}


class RowwiseReference:
    """Row-wise Adagrad on whole tables with sparse gradients: ``m_r += mean(g_r²)``,
    ``w_r -= lr · g_r / (sqrt(m_r) + eps)`` for the rows of the gradient (fbgemm's exact row-wise Adagrad)."""

    def __init__(self, params: list[nn.Parameter], lr: float, eps: float = 1e-10) -> None:
        self.params, self.lr, self.eps = params, lr, eps
        self.sums = [torch.zeros(p.shape[0], dtype=p.dtype) for p in params]

    def step(self) -> None:
        with torch.no_grad():
            for p, m in zip(self.params, self.sums, strict=True):
                if p.grad is None:
                    continue
                g = p.grad.coalesce()
                rows, values = g.indices()[0], g.values()
                for r, v in zip(rows.tolist(), values, strict=True):
                    m[r] += (v * v).mean()
                    p[r] -= self.lr * v / (m[r].sqrt() + self.eps)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def _reference(name: str, params: list[nn.Parameter]) -> Any:
    if name == "sgd":
        return torch.optim.SGD(params, lr=LR[name])
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=LR[name])
    if name == "adam":
        return torch.optim.SparseAdam(params, lr=LR[name])
    return RowwiseReference(params, LR[name])


def _batch(step: int, rank: int, P: int) -> dict[str, tuple[Any, ...]]:
    """``_shard_workers._batch``, but at step 1 no rank calls ``emb``: torch's optimizers leave a table without a
    gradient alone (SparseAdam's step count of it stays), and so must the fused ones."""
    batch = sw._batch(step, rank, P)
    return {k: v for k, v in batch.items() if not (step == 1 and k == "emb")}


def fused_worker(rank: int) -> dict[str, Any]:
    """Per fused optimizer: the largest difference of this rank's shard rows from the reference's after each
    step, whether any table parameter got a ``.grad``, and what ``dense_parameters`` left."""
    P = dist.get_world_size()
    out: dict[str, Any] = {}
    for name, make in FUSED.items():
        model = sparsync.shard(sw.Tables(seed=rank), optimizer=make())  # rank 0's rows win
        ref = sw.Tables(seed=0, sparse=True)
        ref_opt = _reference(name, list(ref.parameters()))
        errors, grads = [], []
        for step in range(sw.STEPS):
            sw._loss(model(_batch(step, rank, P))).backward()
            grads.append(any(p.grad is not None for p in model.parameters()))
            ref_opt.zero_grad()
            (sum(sw._loss(ref(_batch(step, r, P))) for r in range(P)) / P).backward()  # type: ignore[union-attr]
            ref_opt.step()
            errors.append(sw._shard_error(model, ref, rank, P))
        out[name] = {"errors": errors, "grads": grads, "dense": len(dense_parameters(model))}
    return out


def misuse_worker(rank: int) -> dict[str, str]:
    """A torch optimizer class given as the fused optimizer; a model converted after sharding (its tables'
    parameters no longer view their group's storage)."""
    out = {}
    try:
        sparsync.shard(sw.Tables(seed=0), optimizer=torch.optim.SGD)  # type: ignore[arg-type]
        out["class"] = "accepted"
    except TypeError as e:
        out["class"] = str(e)
    model = sparsync.shard(sw.Tables(seed=0)).float().double()  # float64 again, in new storage
    try:
        model(sw._batch(0, rank, 1))
        out["converted"] = "looked up"
    except ValueError as e:
        out["converted"] = str(e)
    return out
