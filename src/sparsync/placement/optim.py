"""Server-side sparse optimizers: they update only the rows a gradient touches (Parallax §4.3: update ops live
on the server that holds the variable).

Semantics follow PyTorch's sparse-gradient optimizers exactly, so a PS run can be checked against a
single-process run: ``sgd`` = ``torch.optim.SGD`` (no momentum), ``adagrad`` = ``torch.optim.Adagrad`` on a
sparse gradient (accumulator and update on touched rows only), ``adam`` = ``torch.optim.SparseAdam`` (moments
of touched rows only; one step counter per shard, advanced at every apply, as SparseAdam advances it at every
``step()``). Gradients arrive coalesced (unique rows).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

OPTIMIZERS = ("sgd", "adagrad", "adam")


@dataclass(frozen=True)
class OptimizerConfig:
    name: str = "sgd"  # one of OPTIMIZERS
    lr: float = 0.01
    eps: float | None = None  # None: torch's default (adagrad 1e-10, adam 1e-8)
    beta1: float = 0.9  # adam
    beta2: float = 0.999  # adam
    initial_accumulator_value: float = 0.0  # adagrad
    lr_decay: float = 0.0  # adagrad

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise KeyError(f"unknown server optimizer {self.name!r}; valid: {', '.join(OPTIMIZERS)}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr!r}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"adam betas must lie in [0, 1), got ({self.beta1}, {self.beta2})")

    @property
    def epsilon(self) -> float:
        if self.eps is not None:
            return self.eps
        return 1e-10 if self.name == "adagrad" else 1e-8

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class SparseOptimizer:
    """Optimizer state of one shard (rows x dim); ``apply`` mutates ``weights`` and the state in place."""

    def __init__(self, cfg: OptimizerConfig, rows: int, dim: int) -> None:
        self.cfg = cfg
        self.step = 0
        self.state: dict[str, np.ndarray] = {}
        if cfg.name == "adagrad":
            self.state["sum"] = np.full((rows, dim), cfg.initial_accumulator_value, dtype=np.float32)
        elif cfg.name == "adam":
            self.state["exp_avg"] = np.zeros((rows, dim), dtype=np.float32)
            self.state["exp_avg_sq"] = np.zeros((rows, dim), dtype=np.float32)

    def apply(self, weights: np.ndarray, rows: np.ndarray, grad: np.ndarray) -> None:
        """Update ``weights[rows]`` (mutated, with the optimizer state) by the coalesced gradient ``grad``."""
        c = self.cfg
        self.step += 1
        if rows.size == 0:
            return
        if c.name == "sgd":
            weights[rows] -= np.float32(c.lr) * grad
        elif c.name == "adagrad":
            s = self.state["sum"]
            s[rows] += grad * grad
            clr = c.lr / (1 + (self.step - 1) * c.lr_decay)
            weights[rows] -= np.float32(clr) * (grad / (np.sqrt(s[rows]) + np.float32(c.epsilon)))
        else:
            m, v = self.state["exp_avg"], self.state["exp_avg_sq"]
            m_old, v_old = m[rows], v[rows]
            m_new = m_old + (grad - m_old) * np.float32(1 - c.beta1)
            v_new = v_old + (grad * grad - v_old) * np.float32(1 - c.beta2)
            m[rows], v[rows] = m_new, v_new
            bc1 = 1 - c.beta1**self.step
            bc2 = 1 - c.beta2**self.step
            step_size = c.lr * math.sqrt(bc2) / bc1
            weights[rows] -= np.float32(step_size) * (m_new / (np.sqrt(v_new) + np.float32(c.epsilon)))


def coalesce(rows: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sum the values of duplicate rows (local aggregation inside one message): sorted unique rows."""
    if rows.size == 0:
        return rows.astype(np.int64), values.reshape(0, values.shape[1] if values.ndim == 2 else 0)
    uniq, inv = np.unique(rows, return_inverse=True)
    if uniq.size == rows.size:
        order = np.argsort(rows, kind="stable")
        return rows[order].astype(np.int64), values[order]
    out = np.zeros((uniq.size, values.shape[1]), dtype=values.dtype)
    np.add.at(out, inv, values)
    return uniq.astype(np.int64), out
