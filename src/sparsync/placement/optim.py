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
import numbers
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

OPTIMIZERS = ("sgd", "adagrad", "adam")
_F32_MAX = float(np.finfo(np.float32).max)


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
        # Every field is checked for type too: a server must refuse {"lr_decay": "fast"} at CREATE, not crash
        # at the first APPLY (issue 14).
        if not isinstance(self.name, str) or self.name not in OPTIMIZERS:
            raise KeyError(f"unknown server optimizer {self.name!r}; valid: {', '.join(OPTIMIZERS)}")
        checked_real("lr", self.lr, low=0.0, strict=True)
        if self.eps is not None:
            checked_real("eps", self.eps, low=0.0, strict=True)
        for name in ("beta1", "beta2"):
            if not 0 <= checked_real(name, getattr(self, name), low=0.0) < 1:
                raise ValueError(f"adam {name} must lie in [0, 1), got {getattr(self, name)!r}")
        checked_real("initial_accumulator_value", self.initial_accumulator_value, low=0.0)
        checked_real("lr_decay", self.lr_decay, low=0.0)
        for f in fields(self):  # plain floats: equal configs compare equal and serialise as JSON
            v = getattr(self, f.name)
            if f.name != "name" and v is not None:
                object.__setattr__(self, f.name, float(v))

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


# --- field checks (shared with the table config) -------------------------------------------------------------
def checked_real(name: str, value: Any, *, low: float | None = None, strict: bool = False) -> float:
    """``value`` as a float that is finite in float32 (the servers compute in float32), or ``ValueError`` naming
    ``name`` and the value (a bool is not a number)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}"[:300])
    v = float(value)
    if not abs(v) <= _F32_MAX or (low is not None and (v <= low if strict else v < low)):
        bound = "" if low is None else f" {'>' if strict else '>='} {low:g}"
        raise ValueError(f"{name} must be a finite number{bound}, got {value!r}")
    return v


def checked_int(name: str, value: Any, low: int, high: int) -> int:
    """``value`` if it is an int in [low, high], else ``ValueError`` naming ``name`` and the value."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}"[:300])
    v = int(value)
    if not low <= v <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {v}"[:300])
    return v
