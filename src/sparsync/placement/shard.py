"""One partition of one sparse table on a server: rows lo, lo + stride, ... below hi (a contiguous range when
stride is 1, every stride-th row of a strided split), its optimizer state, and the sync accumulator.

Sync mode is Parallax §5's chief-triggered update: every pusher's gradient for step s is accumulated, and
the update is applied once, when the chief's APPLY(s) finds all ``pushers`` pushes of step s (the pushers are
the machines with local aggregation, else the workers). The table's version counts applied steps; a pull may
wait for a version, which is how the other workers wait for the chief's update. Async mode (TF-Replicator's
asynchronous PS replicator) applies every push at once, without waiting for anyone.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from sparsync.placement.optim import OptimizerConfig, SparseOptimizer, coalesce

MODES = ("sync", "async")


@dataclass(frozen=True)
class ShardConfig:
    name: str  # table name
    rows: int  # rows of the whole table
    lo: int  # first row of this partition
    hi: int  # rows of this partition are below it
    dim: int  # row width
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    mode: str = "sync"  # "sync" (chief-triggered apply) or "async" (apply each push at once)
    pushers: int = 1  # sync: pushes that make one step
    divisor: float = 1.0  # the summed gradient is divided by it: 1 = sum, number of workers = mean
    stride: int = 1  # rows lo, lo + stride, ... below hi: 1 for a range split, the partition count if strided

    def __post_init__(self) -> None:
        if not (0 <= self.lo <= self.hi <= self.rows) or self.dim < 1 or self.stride < 1:
            raise ValueError(
                f"bad shard: rows [{self.lo}, {self.hi}) stride {self.stride} of {self.rows}, dim {self.dim}"
            )
        if self.mode not in MODES:
            raise KeyError(f"unknown mode {self.mode!r}; valid: {', '.join(MODES)}")
        if self.pushers < 1 or not self.divisor > 0:
            raise ValueError(f"pushers must be >= 1 and divisor > 0, got {self.pushers}, {self.divisor}")

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["optimizer"] = self.optimizer.as_dict()
        return d

    @classmethod
    def from_json(cls, d: Any) -> ShardConfig:
        if not isinstance(d, dict):
            raise ValueError(f"table config must be a JSON object, got {type(d).__name__}")
        d = dict(d)
        known = set(cls.__dataclass_fields__)
        if set(d) - known:
            raise ValueError(f"unknown table config keys {sorted(set(d) - known)}")
        opt = d.pop("optimizer", {})
        if not isinstance(opt, dict):
            raise ValueError("optimizer must be a JSON object")
        return cls(**d, optimizer=OptimizerConfig(**opt))

    @property
    def size(self) -> int:
        """Rows this partition holds."""
        return -(-(self.hi - self.lo) // self.stride)


class Shard:
    def __init__(self, cfg: ShardConfig) -> None:
        self.cfg = cfg
        self.weights = np.zeros((cfg.size, cfg.dim), dtype=np.float32)
        self.opt = SparseOptimizer(cfg.optimizer, cfg.size, cfg.dim)
        self.version = 0  # applied steps (sync) or applied pushes (async)
        self.pending: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}  # sync: step -> pushes

    def local(self, rows: np.ndarray) -> np.ndarray:
        """Global row ids -> local offsets; ValueError naming the first row outside this partition."""
        c = self.cfg
        off = rows - c.lo
        wrong = (off < 0) | (rows >= c.hi) | (off % c.stride != 0) if c.stride > 1 else (off < 0) | (rows >= c.hi)
        if rows.size and wrong.any():
            where = f"[{c.lo}, {c.hi})" + (f" stride {c.stride}" if c.stride > 1 else "")
            raise ValueError(f"row {int(rows[wrong][0])} is outside partition {where} of table {c.name!r}")
        out: np.ndarray = off // c.stride if c.stride > 1 else off
        return out

    def pull(self, rows: np.ndarray) -> np.ndarray:
        out: np.ndarray = self.weights[self.local(rows)]
        return out

    def set(self, rows: np.ndarray, values: np.ndarray) -> None:
        self.weights[self.local(rows)] = values

    def push(self, rows: np.ndarray, grads: np.ndarray, step: int) -> None:
        loc = self.local(rows)
        if self.cfg.mode == "async":
            self._apply([(loc, grads)])
            return
        if step < self.version:
            raise ValueError(f"push for step {step} of table {self.cfg.name!r}, already at step {self.version}")
        self.pending.setdefault(step, []).append((loc, np.array(grads)))

    def arrived(self, step: int) -> int:
        return len(self.pending.get(step, ()))

    def apply_step(self, step: int) -> None:
        """Sync: apply step ``step`` once (caller checked all pushes arrived and ``step == version``)."""
        self._apply(self.pending.pop(step, []))

    def _apply(self, parts: list[tuple[np.ndarray, np.ndarray]]) -> None:
        if parts:
            rows = np.concatenate([p[0] for p in parts])
            vals = np.concatenate([p[1] for p in parts]).astype(np.float32, copy=False)
        else:
            rows, vals = np.zeros(0, np.int64), np.zeros((0, self.cfg.dim), np.float32)
        rows, vals = coalesce(rows, vals)  # duplicates across pushers sum (global aggregation)
        if self.cfg.divisor != 1.0:
            vals = vals / np.float32(self.cfg.divisor)
        self.opt.apply(self.weights, rows, vals)
        self.version += 1

    # --- checkpoint -------------------------------------------------------------------------------------
    def arrays(self, key: str) -> dict[str, np.ndarray]:
        meta = {"config": self.cfg.to_json(), "version": self.version, "opt_step": self.opt.step}
        out: dict[str, np.ndarray] = {f"{key}/weights": self.weights}
        out[f"{key}/meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
        for k, v in self.opt.state.items():
            out[f"{key}/state/{k}"] = v
        return out

    @classmethod
    def from_arrays(cls, key: str, arrays: Any) -> Shard:
        meta = json.loads(bytes(arrays[f"{key}/meta"]).decode())
        s = cls(ShardConfig.from_json(meta["config"]))
        s.weights[...] = arrays[f"{key}/weights"]
        for k in s.opt.state:
            s.opt.state[k][...] = arrays[f"{key}/state/{k}"]
        s.version, s.opt.step = int(meta["version"]), int(meta["opt_step"])
        return s
