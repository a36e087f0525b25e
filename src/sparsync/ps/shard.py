"""One partition of one sparse table on a server: rows lo, lo + stride, ... below hi (a contiguous range when
stride is 1, every stride-th row of a stride split), its optimizer state, the sync accumulator, and the
checkpoint file of a server's partitions.

Sync mode is Parallax §5's chief-triggered update: every pusher's gradient for step s is accumulated, and
the update is applied once, when the chief's APPLY(s) finds all ``pushers`` pushes of step s (the pushers are
the machines with local aggregation, else the workers). The pushes are summed in worker order (by sender id),
not arrival order, so two sync runs give identical bits. The table's version counts applied steps;
a pull may wait for a version, which is how the other workers wait for the chief's update. Async mode
(TF-Replicator's asynchronous PS replicator) applies every push at once, without waiting for anyone.
"""

from __future__ import annotations

import json
import os
import re
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sparsync.ps.optim import OptimizerConfig, SparseOptimizer, checked_int, checked_real, coalesce

MODES = ("sync", "async")
MAX_ROWS = 2**48  # rows of one table: far below int64, so row arithmetic cannot wrap (-2^63 did)
MAX_DIM = 2**20
MAX_PUSHERS = 2**16
MAX_NAME = 256  # characters of a table name
MAX_STEP = 2**62  # versions and step counters, in a checkpoint too
SHARD_OVERHEAD = 4096  # bytes counted per partition besides its arrays, so many tiny tables are bounded too


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
    stride: int = 1  # rows lo, lo + stride, ... below hi: 1 for a range split, the partition count if stride

    def __post_init__(self) -> None:
        # A CREATE from the wire lands here: every field is checked for type and range before a server uses it.
        if not isinstance(self.name, str) or len(self.name) > MAX_NAME:
            raise ValueError(
                f"table name must be a string of at most {MAX_NAME} characters, got {self.name!r}"[:300]
            )
        rows = checked_int("rows", self.rows, 1, MAX_ROWS)
        lo, hi = checked_int("lo", self.lo, 0, MAX_ROWS), checked_int("hi", self.hi, 0, MAX_ROWS)
        checked_int("dim", self.dim, 1, MAX_DIM)
        checked_int("stride", self.stride, 1, MAX_ROWS)
        if not lo <= hi <= rows:
            raise ValueError(f"bad shard: rows [{lo}, {hi}) stride {self.stride} of {rows}, dim {self.dim}")
        if not isinstance(self.mode, str) or self.mode not in MODES:
            raise KeyError(f"unknown mode {self.mode!r}; valid: {', '.join(MODES)}"[:300])
        checked_int("pushers", self.pushers, 1, MAX_PUSHERS)
        checked_real("divisor", self.divisor, low=0.0, strict=True)
        if not isinstance(self.optimizer, OptimizerConfig):
            raise TypeError(f"optimizer must be an OptimizerConfig, got {type(self.optimizer).__name__}")
        object.__setattr__(self, "divisor", float(self.divisor))

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
            raise ValueError(f"unknown table config keys {sorted(set(d) - known)}"[:300])
        opt = d.pop("optimizer", {})
        if not isinstance(opt, dict):
            raise ValueError(f"optimizer must be a JSON object, got {type(opt).__name__}")
        if set(opt) - set(OptimizerConfig.__dataclass_fields__):
            raise ValueError(
                f"unknown optimizer keys {sorted(set(opt) - set(OptimizerConfig.__dataclass_fields__))}"[:300]
            )
        return cls(**d, optimizer=OptimizerConfig(**opt))

    @property
    def size(self) -> int:
        """Rows this partition holds."""
        return -(-(self.hi - self.lo) // self.stride)

    @property
    def nbytes(self) -> int:
        """Memory of the partition: weights, optimizer state, bookkeeping."""
        return self.size * self.dim * 4 * (1 + self.optimizer.state_slots) + SHARD_OVERHEAD


class Shard:
    def __init__(self, cfg: ShardConfig) -> None:
        self.cfg = cfg
        self.weights = np.zeros((cfg.size, cfg.dim), dtype=np.float32)
        self.opt = SparseOptimizer(cfg.optimizer, cfg.size, cfg.dim)
        self.version = 0  # applied steps (sync) or applied pushes (async)
        self.pending: dict[int, dict[int, tuple[np.ndarray, np.ndarray]]] = {}  # sync: step -> sender -> push
        self.pending_bytes = 0  # held by ``pending``

    def local(self, rows: np.ndarray) -> np.ndarray:
        """Global row ids -> local offsets; ValueError naming the first row outside this partition."""
        c = self.cfg
        # Compare before subtracting: rows - lo wraps for rows near -2^63.
        wrong = (rows < c.lo) | (rows >= c.hi)
        off = np.where(wrong, 0, rows) - c.lo
        if c.stride > 1:
            wrong |= off % c.stride != 0
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

    def push(self, rows: np.ndarray, grads: np.ndarray, step: int, sender: int) -> None:
        """Async: apply now. Sync: hold worker ``sender``'s gradient for ``step`` (one push per worker and step,
        at most ``pushers`` per step)."""
        loc = self.local(rows)
        if self.cfg.mode == "async":
            self._apply([(loc, grads)])
            return
        name = self.cfg.name
        if step < self.version:
            raise ValueError(f"push for step {step} of table {name!r}, already at step {self.version}")
        got = self.pending.get(step, {})
        if sender in got:
            raise ValueError(f"worker {sender} already pushed step {step} of table {name!r}")
        if len(got) >= self.cfg.pushers:
            raise ValueError(f"step {step} of table {name!r} already has all {self.cfg.pushers} pushes")
        got[sender] = (loc, np.array(grads))
        self.pending[step] = got
        self.pending_bytes += loc.nbytes + grads.nbytes

    def arrived(self, step: int) -> int:
        return len(self.pending.get(step, ()))

    def apply_step(self, step: int) -> None:
        """Sync: apply step ``step`` once (caller checked all pushes arrived and ``step == version``), summing
        the pushes in sender order."""
        got = self.pending.pop(step, {})
        self.pending_bytes -= sum(loc.nbytes + g.nbytes for loc, g in got.values())
        self._apply([got[k] for k in sorted(got)])

    def _apply(self, parts: list[tuple[np.ndarray, np.ndarray]]) -> None:
        if parts:
            rows = np.concatenate([p[0] for p in parts])
            vals = np.concatenate([p[1] for p in parts]).astype(np.float32, copy=False)
        else:
            rows, vals = np.zeros(0, np.int64), np.zeros((0, self.cfg.dim), np.float32)
        rows, vals = coalesce(rows, vals)  # duplicates across pushers sum, in the order of ``parts``
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
    def from_arrays(cls, key: str, read: Reader, *, allow_nonfinite: bool = False) -> Shard:
        """The partition saved under ``key``; ``CheckpointError`` when an array's shape or dtype differs from
        what its config implies (a 1-row weights array was broadcast to every row) or, unless
        ``allow_nonfinite``, when it holds NaN or Inf."""
        cfg, version, opt_step = read_meta(key, read)
        s = cls(cfg)
        s.version, s.opt.step = version, opt_step
        shape, f32 = (s.cfg.size, s.cfg.dim), np.dtype("<f4")
        s.weights = read(f"{key}/weights", shape, f32)
        for k in s.opt.state:
            s.opt.state[k] = read(f"{key}/state/{k}", shape, f32)
        for name, a in [("weights", s.weights), *s.opt.state.items()]:
            if not allow_nonfinite and not np.isfinite(a).all():
                raise CheckpointError(f"{key}/{name} holds NaN or Inf (load with load_nonfinite=True to accept)")
        return s


# --- checkpoint files ---------------------------------------------------------------------------------------
class CheckpointError(ValueError):
    """A checkpoint that is truncated, corrupt, or does not match the tables it describes."""


Reader = Callable[[str, tuple[int, ...] | None, np.dtype[Any]], np.ndarray]


def read_meta(key: str, read: Reader) -> tuple[ShardConfig, int, int]:
    """(config, version, optimizer step) of the partition saved under ``key``, each checked."""
    meta = json.loads(bytes(read(f"{key}/meta", None, np.dtype(np.uint8))).decode())
    if not isinstance(meta, dict) or set(meta) != {"config", "version", "opt_step"}:
        raise CheckpointError(f"{key}/meta must hold config, version and opt_step")
    try:
        cfg = ShardConfig.from_json(meta["config"])
        version = checked_int(f"{key} version", meta["version"], 0, MAX_STEP)
        return cfg, version, checked_int(f"{key} opt_step", meta["opt_step"], 0, MAX_STEP)
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(e.args[0] if isinstance(e, KeyError) and e.args else str(e)) from None


def save_checkpoint(path: Path, shards: Mapping[tuple[int, int], Shard]) -> None:
    """Write every partition to ``path`` atomically: a temporary file, fsync'ed, renamed, the directory fsync'ed
    (without the fsyncs a power cut after the rename can leave an empty file)."""
    arrays: dict[str, np.ndarray] = {}
    for (t, p), s in shards.items():
        arrays.update(s.arrays(f"t{t}p{p}"))
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)  # type: ignore[arg-type]  # numpy stubs type **kwds as allow_pickle
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(
    path: Path, *, allow_nonfinite: bool = False, max_shard_bytes: int, max_total_bytes: int
) -> dict[tuple[int, int], Shard]:
    """Every partition in ``path``; ``CheckpointError`` naming the file and what is wrong with it."""
    try:
        with zipfile.ZipFile(path) as zf:
            return _load(zf, allow_nonfinite, max_shard_bytes, max_total_bytes)
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint {path}: {e}") from None
    except Exception as e:  # a truncated or crafted file fails in zipfile, numpy or json, in many ways
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt: {type(e).__name__}: {e}") from None


def _load(zf: zipfile.ZipFile, nonfinite: bool, max_shard: int, max_total: int) -> dict[tuple[int, int], Shard]:
    def read(name: str, shape: tuple[int, ...] | None, dtype: np.dtype[Any]) -> np.ndarray:
        """The array ``name`` after checking its header: no allocation for a shape we did not expect."""
        if name + ".npy" not in members:
            raise CheckpointError(f"{name} is missing")
        with zf.open(name + ".npy") as f:
            version = np.lib.format.read_magic(f)
            if version not in ((1, 0), (2, 0)):
                raise CheckpointError(f"{name}: npy format version {version} not supported")
            read_header = (
                np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            )
            got_shape, _, got_dtype = read_header(f)
        ok = got_shape == shape if shape is not None else len(got_shape) == 1 and got_shape[0] <= 2**16
        if not ok or got_dtype != dtype:
            want = f"{dtype}{list(shape)}" if shape is not None else f"1-D {dtype}"
            raise CheckpointError(f"{name} is {got_dtype}{list(got_shape)}, the table needs {want}")
        with zf.open(name + ".npy") as f:
            out: np.ndarray = np.lib.format.read_array(f, allow_pickle=False)
        return out

    members = set(zf.namelist())
    shards: dict[tuple[int, int], Shard] = {}
    total = 0
    for key in sorted({m.split("/")[0] for m in members}):
        m = re.fullmatch(r"t(\d{1,10})p(\d{1,10})", key)
        if m is None or max(int(m[1]), int(m[2])) >= 2**32:
            raise CheckpointError(f"unexpected entry {key!r} (partitions are saved as t<table>p<partition>)"[:300])
        cfg = read_meta(key, read)[0]
        total += cfg.nbytes
        if cfg.nbytes > max_shard or total > max_total:
            raise CheckpointError(f"{key}: tables of {total} bytes exceed max_shard_bytes or max_total_bytes")
        shards[(int(m[1]), int(m[2]))] = s = Shard.from_arrays(key, read, allow_nonfinite=nonfinite)
        extra = {n for n in members if n.startswith(key + "/")} - {f"{n}.npy" for n in s.arrays(key)}
        if extra:
            raise CheckpointError(f"{key} has arrays its config does not use: {sorted(extra)}"[:300])
    return shards
