"""Workers of tests/test_pain_points.py: what DDP and torchrec users trip on, through ``DistributedOptimizer``,
each against a float64 single-process reference (every rank's batch through one model; the mean gradient).

A case is a model, a per-rank batch per step and what happens between backward and step (clipping,
accumulation, a GradScaler). The reference runs the same model on every rank's batch in one process and steps
with the mean of their gradients, clipped or skipped the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import sparsync
from sparsync.collectives.flight import flight_dir

STEPS = 3
ROWS, DIM = 50, 4


class Tables(nn.Module):
    """Two sparse tables, one of them read only on even ranks (an unused table on the others), an MLP, and a
    layer no forward reads (no gradient anywhere)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True)
        self.b = nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True)
        self.mlp = nn.Linear(DIM, 1)
        self.unused = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = self.a(x)
        if use_b:
            h = h + self.b(x)
        return self.mlp(h).square().sum()


class Padded(nn.Module):
    """``padding_idx`` and ``max_norm`` on an Embedding; an EmbeddingBag with ``per_sample_weights`` and
    ``include_last_offset``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(ROWS, DIM, padding_idx=0, max_norm=1.0, sparse=True)
        self.bag = nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True, include_last_offset=True)
        self.mlp = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        flat = x.reshape(-1)
        offsets = torch.arange(0, flat.numel() + 1, x.shape[1])
        weights = torch.linspace(0.5, 1.5, flat.numel(), dtype=torch.float64)
        h = self.emb(x).sum(1) + self.bag(flat, offsets, per_sample_weights=weights)
        return self.mlp(h).square().sum()


def _batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.rand(6, 3, generator=g) ** 2 * ROWS).long()  # skewed ids, row 0 (padding) included


# GradScaler cases: "grad_scaler" (float64: autocast leaves float64 alone), "grad_scaler_bf16" (float32 under
# bf16 autocast), "grad_scaler_step" (reduction in step(), overlap=False: opt.synchronize() before the scaler)
SCALER_CASES = ("grad_scaler", "grad_scaler_bf16", "grad_scaler_step")
OVERFLOW_STEP = 1


def _model(kind: str, dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    model: nn.Module = Tables() if kind == "tables" else Padded()
    return model.to(dtype)


def _autocast(case: str) -> Any:
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "grad_scaler_bf16")


def _dtype(case: str) -> torch.dtype:
    return torch.float32 if case == "grad_scaler_bf16" else torch.float64


# What runs between backward and step: (distributed optimizer, step) -> extra; the reference gets the same
# name and applies the same operation to its mean gradient.
Between = Callable[[sparsync.DistributedOptimizer], Any]


def run_case(rank: int, case: str) -> dict[str, Any]:
    """One case on this rank; the reference on every rank (deterministic, so every rank computes the same)."""
    P = dist.get_world_size()
    kind = "padded" if case == "padded" else "tables"
    model = _model(kind, _dtype(case))
    # no flag for a GradScaler: the defaults
    opt = sparsync.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model, overlap=case != "grad_scaler_step"
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if case in SCALER_CASES else None
    scales = []
    norms = []
    coalesced = []  # the accumulated sparse gradient before aggregation (the optimizer's coalescing hook)
    for step in range(STEPS):
        opt.zero_grad()
        micro = 2 if case == "accumulate" else 1
        for m in range(micro):
            x = _batch(10 * step + m, rank)
            with _autocast(case):
                loss = model(x, use_b=rank % 2 == 0)
            if scaler is not None:
                # one step: one rank's loss overflows; every rank must skip that step
                loss = loss * (float("inf") if step == OVERFLOW_STEP and rank == P - 1 else 1.0)
                scaler.scale(loss).backward()
            elif case == "accumulate" and m == 0:
                with opt.no_sync():
                    loss.backward()
            else:
                loss.backward()
        g = model.a.weight.grad if kind == "tables" else None
        if g is not None:
            coalesced.append(bool(g.is_coalesced()))
        if case == "clip_norm":
            norms.append(float(opt.clip_grad_norm_(0.5)))
        if case == "clip_value":
            opt.clip_grad_value_(0.01)
        if scaler is not None:
            if case == "grad_scaler_step":
                opt.synchronize()  # reduction in step(): the scaler's inf check must see the reduced gradient
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        else:
            opt.step()
    ref, ref_norms = reference(case, P)
    ours = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    return {
        "max_diff": max(float(np.abs(ours[n] - ref[n]).max()) for n in ours),
        "unused_untouched": bool(np.array_equal(ours["unused.weight"], ref["unused.weight"]))
        if "unused.weight" in ours
        else True,
        "norms": norms,
        "ref_norms": ref_norms,
        "scales": scales,
        # an overflow is refused alike everywhere, not a failure: no flight-recorder dump (collectives.failure)
        "dumped": (flight_dir() / f"rank{dist.get_rank()}.json").exists(),
        "coalesced": coalesced,
    }


def reference(case: str, P: int) -> tuple[dict[str, np.ndarray], list[float]]:
    """One process: each step, every rank's batch through the model, the mean gradient, then the case's
    operation and the same optimizer."""
    kind = "padded" if case == "padded" else "tables"
    model = _model(kind, _dtype(case))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        micro = 2 if case == "accumulate" else 1
        for r in range(P):
            for m in range(micro):
                with _autocast(case):
                    loss = model(_batch(10 * step + m, r), use_b=r % 2 == 0)
                loss.backward()
        if case in SCALER_CASES and step == OVERFLOW_STEP:
            continue  # the overflowing step is skipped everywhere
        for p in model.parameters():
            if p.grad is not None:
                p.grad = (p.grad.to_dense() if p.grad.is_sparse else p.grad) / P
        if case == "padded":
            # a single process's forwards renormalised every looked-up row; the SGD below steps them
            pass
        if case == "clip_norm":
            norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        if case == "clip_value":
            nn.utils.clip_grad_value_(model.parameters(), 0.01)
        opt.step()
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}, norms


def all_cases(rank: int, cases: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    return {case: run_case(rank, case) for case in cases}
