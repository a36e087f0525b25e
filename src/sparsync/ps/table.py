"""A sparse table partitioned by rows across parameter servers (Parallax §3.2, §4.3).

Two splits of R rows into P partitions; partition p lives on server (first_server + p) mod S, so partitions
spread evenly over the servers (one per machine):

- ``stride`` (default): partition p holds rows p, p + P, p + 2P, ...; with P a multiple of S, row r lives on
  server r mod S. Zipf-distributed ids make the low rows the hot ones; striding spreads them over every server
  instead of piling them on server 0, which a range split does (Parallax §3.2 partitions to balance load).
- ``range``: partition p holds rows [p·⌈R/P⌉, (p+1)·⌈R/P⌉).

 Workers pull only the rows their batch needs and push only those rows'
gradients, duplicates summed first (local aggregation inside a worker); each partition is its own message, so
more partitions parallelise server work and cost more messages (the trade-off §3.2's search fits).
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import numpy as np
import torch

from sparsync.handle import Work
from sparsync.ps import wire
from sparsync.ps.client import PSClient
from sparsync.ps.optim import OptimizerConfig
from sparsync.ps.optim import coalesce as coalesce_rows
from sparsync.ps.shard import MODES, ShardConfig
from sparsync.ps.wire import Header, Op

SPLITS = ("stride", "range")

T = TypeVar("T")


def _all(
    futures: Sequence[Future[tuple[Header, bytes]]], combine: Callable[[list[tuple[Header, bytes]]], T]
) -> Work[T]:
    """One Work that completes when every future did (the first error wins)."""
    out: Future[T] = Future()
    left = [len(futures)]
    results: list[Any] = [None] * len(futures)

    def done(i: int, f: Future[tuple[Header, bytes]]) -> None:
        if out.done():
            return
        e = f.exception()
        if e is not None:
            out.set_exception(e)
            return
        results[i] = f.result()
        left[0] -= 1
        if left[0] == 0:
            try:
                out.set_result(combine(results))
            except BaseException as err:  # forwarded to whoever waits
                out.set_exception(err)

    if not futures:
        out.set_result(combine([]))
    for i, f in enumerate(futures):
        f.add_done_callback(functools.partial(done, i))
    return Work(out)


def _as_rows(rows: torch.Tensor | np.ndarray, n: int) -> np.ndarray:
    r = rows.detach().cpu().numpy() if isinstance(rows, torch.Tensor) else np.asarray(rows)
    r = r.reshape(-1).astype(np.int64, copy=False)
    if r.size and (r.min() < 0 or r.max() >= n):
        bad = r[(r < 0) | (r >= n)][0]
        raise ValueError(f"row {int(bad)} out of range [0, {n})")
    return r


class PSTable:
    """A handle on one table; every worker makes the same one (same name and shape)."""

    def __init__(
        self,
        client: PSClient,
        name: str,
        rows: int,
        dim: int,
        *,
        partitions: int | None = None,
        optimizer: OptimizerConfig | None = None,
        mode: str = "sync",
        pushers: int = 1,
        divisor: float = 1.0,
        split: str = "stride",
        first_server: int = 0,
    ) -> None:
        if rows < 1 or dim < 1:
            raise ValueError(f"table {name!r} needs rows >= 1 and dim >= 1, got {rows} x {dim}")
        if mode not in MODES:
            raise KeyError(f"unknown mode {mode!r}; valid: {', '.join(MODES)}")
        if split not in SPLITS:
            raise KeyError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
        P = partitions if partitions is not None else client.num_servers
        if not 1 <= P <= rows:
            raise ValueError(f"partitions must be in [1, rows={rows}], got {P}")
        self.client, self.name, self.rows, self.dim, self.mode = client, name, rows, dim, mode
        self.id = zlib.crc32(name.encode())
        if not 0 <= first_server < client.num_servers:
            raise ValueError(f"first_server must be in [0, {client.num_servers}), got {first_server}")
        self.partitions, self.split, self.first_server = P, split, first_server
        self.chunk = math.ceil(rows / P)
        opt = optimizer or OptimizerConfig()

        def bounds(p: int) -> tuple[int, int, int]:  # lo, hi, stride
            if split == "stride":
                return p, rows, P
            return min(p * self.chunk, rows), min((p + 1) * self.chunk, rows), 1

        self.configs = []
        for p in range(P):
            lo, hi, stride = bounds(p)
            self.configs.append(ShardConfig(name, rows, lo, hi, dim, opt, mode, pushers, divisor, stride))

    def server_of(self, p: int) -> int:
        return (self.first_server + p) % self.client.num_servers

    def _head(self, op: Op, p: int, **kw: int) -> Header:
        return self.client.header(op, table=self.id, partition=p, dim=self.dim, **kw)

    def _split(self, rows: np.ndarray) -> list[np.ndarray]:
        """Positions into ``rows`` per partition."""
        part = rows % self.partitions if self.split == "stride" else rows // self.chunk
        order = np.argsort(part, kind="stable")
        bounds = np.searchsorted(part[order], np.arange(self.partitions + 1))
        return [order[bounds[p] : bounds[p + 1]] for p in range(self.partitions)]

    def create(self) -> Work[int]:
        """Create the partitions (idempotent); the Work gives the step the table is at (0, or where a restarted
        server resumed from its checkpoint)."""
        futs = [
            self.client.request(self.server_of(p), self._head(Op.CREATE, p), wire.json_body(c.to_json()))
            for p, c in enumerate(self.configs)
        ]
        return _all(futs, lambda rs: min(h.n for h, _ in rs))

    def pull(self, rows: torch.Tensor | np.ndarray, *, step: int = 0) -> Work[torch.Tensor]:
        """Rows' current values, float32 [len(rows), dim] (duplicates allowed: each unique row is fetched once).
        ``step``: wait until the table has applied that many sync steps (Parallax §5: workers wait for the
        chief's update)."""
        r = _as_rows(rows, self.rows)
        uniq, inv = np.unique(r, return_inverse=True)
        parts = self._split(uniq)
        # the request (8 bytes a row) and its reply (4 * dim) must each fit max_message_bytes
        max_rows = max(1, (self.client.max_message_bytes - wire.HEADER.size) // max(8, 4 * self.dim))
        futs, which = [], []
        for p, part in enumerate(parts):
            for lo in range(0, part.size, max_rows):
                pos = part[lo : lo + max_rows]
                futs.append(
                    self.client.request(
                        self.server_of(p),
                        self._head(Op.PULL, p, n=pos.size, step=step),
                        *wire.rows_body(uniq[pos]),
                    )
                )
                which.append(pos)

        def combine(rs: list[tuple[Header, bytes]]) -> torch.Tensor:
            vals = np.empty((uniq.size, self.dim), dtype=np.float32)
            for pos, (_h, body) in zip(which, rs, strict=True):
                vals[pos] = np.frombuffer(body, dtype="<f4").reshape(pos.size, self.dim)
            return torch.from_numpy(vals[inv])

        return _all(futs, combine)

    def push(
        self,
        rows: torch.Tensor | np.ndarray,
        grads: torch.Tensor | np.ndarray,
        *,
        step: int = 0,
        coalesce: bool = True,
    ) -> Work[None]:
        """Send gradient rows; duplicates are summed here first unless ``coalesce=False`` (the "no local
        aggregation" baseline: the server sums them). Sync mode sends to every partition, empty ones included,
        so each partition counts one push per pusher per step."""
        r = _as_rows(rows, self.rows)
        g = grads.detach().cpu().numpy() if isinstance(grads, torch.Tensor) else np.asarray(grads)
        g = g.reshape(r.size, self.dim).astype(np.float32, copy=False)
        if coalesce:
            r, g = coalesce_rows(r, g)
        return self._send_rows(Op.PUSH, r, g, step=step, all_parts=self.mode == "sync")

    def set(self, rows: torch.Tensor | np.ndarray, values: torch.Tensor | np.ndarray) -> Work[None]:
        """Overwrite rows (e.g. the initial weights, from the chief)."""
        r = _as_rows(rows, self.rows)
        v = values.detach().cpu().numpy() if isinstance(values, torch.Tensor) else np.asarray(values)
        return self._send_rows(Op.SET, r, v.reshape(r.size, self.dim).astype(np.float32, copy=False), step=0)

    def _send_rows(
        self, op: Op, r: np.ndarray, g: np.ndarray, *, step: int, all_parts: bool = False
    ) -> Work[None]:
        per_row = 8 + 4 * self.dim
        max_rows = max(1, (self.client.max_message_bytes - wire.HEADER.size) // per_row)
        futs = []
        for p, pos in enumerate(self._split(r)):
            if not pos.size and not all_parts:
                continue
            if op == Op.PUSH and pos.size > max_rows:
                raise ValueError(
                    f"push of {pos.size} rows to one partition exceeds max_message_bytes; use more partitions"
                )
            for lo in range(0, max(pos.size, 1), max_rows):
                sel = pos[lo : lo + max_rows]
                head = self._head(op, p, n=sel.size, step=step)
                futs.append(self.client.request(self.server_of(p), head, *wire.rows_body(r[sel], g[sel])))
        return _all(futs, lambda rs: None)

    def apply(self, step: int) -> Work[None]:
        """Sync mode, chief only: apply ``step`` on every partition once all its pushes arrived (Parallax §5)."""
        futs = [
            self.client.request(self.server_of(p), self._head(Op.APPLY, p, step=step))
            for p in range(self.partitions)
        ]
        return _all(futs, lambda rs: None)

    def read_all(self) -> torch.Tensor:
        """The whole table (tests, checkpoints on the worker side)."""
        return self.pull(np.arange(self.rows)).wait()


def save_servers(client: PSClient) -> Work[list[str]]:
    """Checkpoint every server's tables and optimizer state; the Work gives the files written."""
    futs = [client.request(s, client.header(Op.SAVE)) for s in range(client.num_servers)]
    return _all(futs, lambda rs: [b.decode() for _, b in rs])


def server_stats(client: PSClient) -> list[Any]:
    futs = [client.request(s, client.header(Op.STATS)) for s in range(client.num_servers)]
    return _all(futs, lambda rs: [wire.parse_json(memoryview(b)) for _, b in rs]).wait()
