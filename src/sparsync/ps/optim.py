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
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from types import MappingProxyType
from typing import Any, ClassVar

import numpy as np

_F32_MAX = float(np.finfo(np.float32).max)


class ServerOptimizer:
    """One server-side optimizer (one class each, its state slots with it). ``slots``: the per-row
    state arrays (name, initial value) a shard keeps beside its weights; ``default_eps``: torch's default;
    ``update`` changes ``weights[rows]`` and the state's rows in place for the coalesced ``grad``, at the
    shard's ``step``-th apply (1-based)."""

    name: ClassVar[str]
    default_eps: ClassVar[float] = 0.0

    @staticmethod
    def slots(cfg: OptimizerConfig) -> tuple[tuple[str, float], ...]:
        return ()

    @staticmethod
    def update(
        cfg: OptimizerConfig, step: int, state: dict[str, np.ndarray], weights: np.ndarray, rows: np.ndarray,
        grad: np.ndarray,
    ) -> None:  # fmt: skip
        raise NotImplementedError


class SGD(ServerOptimizer):
    """``torch.optim.SGD`` without momentum."""

    name = "sgd"

    @staticmethod
    def update(
        cfg: OptimizerConfig, step: int, state: dict[str, np.ndarray], weights: np.ndarray, rows: np.ndarray,
        grad: np.ndarray,
    ) -> None:  # fmt: skip
        weights[rows] -= np.float32(cfg.lr) * grad


class Adagrad(ServerOptimizer):
    """``torch.optim.Adagrad`` on a sparse gradient: accumulator and update on the touched rows only."""

    name = "adagrad"
    default_eps = 1e-10

    @staticmethod
    def slots(cfg: OptimizerConfig) -> tuple[tuple[str, float], ...]:
        return (("sum", cfg.initial_accumulator_value),)

    @staticmethod
    def update(
        cfg: OptimizerConfig, step: int, state: dict[str, np.ndarray], weights: np.ndarray, rows: np.ndarray,
        grad: np.ndarray,
    ) -> None:  # fmt: skip
        s = state["sum"]
        s[rows] += grad * grad
        clr = cfg.lr / (1 + (step - 1) * cfg.lr_decay)
        weights[rows] -= np.float32(clr) * (grad / (np.sqrt(s[rows]) + np.float32(cfg.epsilon)))


class Adam(ServerOptimizer):
    """``torch.optim.SparseAdam``: moments of the touched rows only, one step counter per shard."""

    name = "adam"
    default_eps = 1e-8

    @staticmethod
    def slots(cfg: OptimizerConfig) -> tuple[tuple[str, float], ...]:
        return (("exp_avg", 0.0), ("exp_avg_sq", 0.0))

    @staticmethod
    def update(
        cfg: OptimizerConfig, step: int, state: dict[str, np.ndarray], weights: np.ndarray, rows: np.ndarray,
        grad: np.ndarray,
    ) -> None:  # fmt: skip
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m_old, v_old = m[rows], v[rows]
        m_new = m_old + (grad - m_old) * np.float32(1 - cfg.beta1)
        v_new = v_old + (grad * grad - v_old) * np.float32(1 - cfg.beta2)
        m[rows], v[rows] = m_new, v_new
        bc1 = 1 - cfg.beta1**step
        bc2 = 1 - cfg.beta2**step
        step_size = cfg.lr * math.sqrt(bc2) / bc1
        weights[rows] -= np.float32(step_size) * (m_new / (np.sqrt(v_new) + np.float32(cfg.epsilon)))


SERVER_OPTIMIZERS: Mapping[str, type[ServerOptimizer]] = MappingProxyType(
    {c.name: c for c in (SGD, Adagrad, Adam)}
)
OPTIMIZERS = tuple(SERVER_OPTIMIZERS)


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
        # at the first APPLY.
        if not isinstance(self.name, str) or self.name not in SERVER_OPTIMIZERS:
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
    def kind(self) -> type[ServerOptimizer]:
        return SERVER_OPTIMIZERS[self.name]

    @property
    def epsilon(self) -> float:
        return self.eps if self.eps is not None else self.kind.default_eps

    @property
    def state_slots(self) -> int:
        """Per-row state arrays a shard keeps beside its weights (for its memory bound)."""
        return len(self.kind.slots(self))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class SparseOptimizer:
    """Optimizer state of one shard (rows x dim); ``apply`` mutates ``weights`` and the state in place."""

    def __init__(self, cfg: OptimizerConfig, rows: int, dim: int) -> None:
        self.cfg = cfg
        self.step = 0
        self.state: dict[str, np.ndarray] = {
            k: np.full((rows, dim), v, dtype=np.float32) for k, v in cfg.kind.slots(cfg)
        }

    def apply(self, weights: np.ndarray, rows: np.ndarray, grad: np.ndarray) -> None:
        """Update ``weights[rows]`` (mutated, with the optimizer state) by the coalesced gradient ``grad``."""
        self.step += 1
        if rows.size == 0:
            return
        self.cfg.kind.update(self.cfg, self.step, self.state, weights, rows, grad)


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
    bound = "" if low is None else f" {'>' if strict else '>='} {low:g}"
    try:
        v = float(value)
    except OverflowError:  # a JSON integer has no bound (10^400): bad input, not a bug of the server
        raise ValueError(f"{name} must be a finite number{bound}, got {_short(value)}") from None
    if not abs(v) <= _F32_MAX or (low is not None and (v <= low if strict else v < low)):
        raise ValueError(f"{name} must be a finite number{bound}, got {value!r}")
    return v


def _short(value: Any) -> str:
    """``value`` for an error message; an integer of many digits by its first ones and its length."""
    if not isinstance(value, numbers.Integral):
        return repr(value)[:40]
    n = int(value)
    try:
        text = str(n)
    except ValueError:  # past Python's limit on int-to-text conversion (4300 digits)
        return f"an integer of about {int(abs(n).bit_length() * math.log10(2)) + 1} digits"
    return text if len(text) <= 40 else f"{text[:20]}... ({len(text.lstrip('-'))} digits)"


def checked_int(name: str, value: Any, low: int, high: int) -> int:
    """``value`` if it is an int in [low, high], else ``ValueError`` naming ``name`` and the value."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}"[:300])
    v = int(value)
    if not low <= v <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {v}"[:300])
    return v
