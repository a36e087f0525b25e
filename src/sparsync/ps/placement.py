"""The parameter-server placement (Parallax §3.1, §4.3, §5): the parameters placed ``ps`` live on the servers.

Embeddings go by rows: a forward pre-hook pulls the rows the batch reads, waiting in sync mode until the
servers applied the previous step; after backward each worker pushes those rows' gradients (duplicates summed
inside the worker and, with a ``MachineAggregator``, across the machine's workers by its local chief). Any
other parameter is a table of one row per leading index, pulled whole before the step and pushed whole
(optionally compressed with error feedback, ``PushFeedback``: DCT §3.3). In sync mode the chief's APPLY goes out
right behind its pushes (each server parks it until all pushes of the step arrived), and ``prefetch`` requests
the next step's rows at once (the servers answer them after the update).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from sparsync.handle import Work
from sparsync.placement.base import NamedParam, Placement, ReduceEnv, load_optional_state
from sparsync.placement.embeddings import rows_of_input
from sparsync.ps.aggregate import MachineAggregator
from sparsync.ps.client import PSClient
from sparsync.ps.feedback import PushFeedback
from sparsync.ps.optim import OptimizerConfig
from sparsync.ps.table import PSTable, save_servers


@contextmanager
def timed(phases: dict[str, float], phase: str) -> Iterator[None]:
    """Add the milliseconds the block takes to ``phases[phase]``."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        phases[phase] += 1e3 * (time.perf_counter() - t0)


def table_shape(p: torch.Tensor) -> tuple[int, int]:
    """(rows, row width) of a parameter as a server table: one row per leading index."""
    if p.dim() >= 2:
        return int(p.shape[0]), int(p.numel() // p.shape[0])
    return 1, int(p.numel())


class ParameterServer(Placement):
    """The ``ps`` parameters of one worker. ``by_rows``: name -> embedding module (pulled and pushed by rows);
    ``whole``: the other parameters on the servers (pulled and pushed whole). ``mean``: name -> divide the sum
    over the workers by their number (on the servers). ``phases`` receives the pull waits as "pull".

    Collective at construction (``start``): rank 0 creates the tables and writes its weights unless the
    servers resume from a checkpoint; every rank then learns the step to resume at."""

    kind = "ps"
    overlaps = False  # every parameter pushed each step, from step(): not bucket by bucket in backward

    def __init__(
        self,
        client: PSClient,
        by_rows: Mapping[str, nn.Module],
        whole: Sequence[str],
        params: Mapping[str, nn.Parameter],
        *,
        rank: int,
        world: int,
        mode: str,
        mean: Mapping[str, bool],
        optimizer: OptimizerConfig,
        partitions: int | None,
        split: str,
        dense_whole: bool,
        table_prefix: str,
        machine: MachineAggregator | None,
        coalesce: bool,
        push: PushFeedback | None,
        phases: dict[str, float],
    ) -> None:
        self.client, self.rank, self.mode = client, rank, mode
        self.machine, self.coalesce, self.push_feedback, self.phases = machine, coalesce, push, phases
        self.by_rows = list(by_rows)
        servers = len(client.addresses)
        # Local aggregation gathers the row-wise tables only: every worker pushes its whole-table gradients.
        pushers = world // machine.procs_per_machine if machine is not None else world
        self.tables: dict[str, PSTable] = {}
        placed_whole = 0  # parameters placed whole on one server so far: the next goes to server count mod S
        for n in [*by_rows, *whole]:
            rows, dim = table_shape(params[n])
            is_whole = dense_whole and n not in by_rows
            parts = 1 if is_whole else min(partitions or servers, rows)
            self.tables[n] = PSTable(
                client, table_prefix + n, rows, dim, partitions=parts, optimizer=optimizer, mode=mode,
                pushers=pushers if n in by_rows else world, divisor=float(world) if mean[n] else 1.0,
                split=split, first_server=placed_whole % servers if is_whole else 0,
            )  # fmt: skip
            placed_whole += is_whole
        self.step = 0
        self.rows: dict[str, torch.Tensor] = {}  # this step's input rows per embedding
        self._prefetch: dict[str, tuple[int, np.ndarray, Work[torch.Tensor]]] = {}  # name -> step, rows, pull
        self._works: list[Work[None]] = []
        self._hooks = [m.register_forward_pre_hook(self._pull_hook(n)) for n, m in by_rows.items()]

    def start(self, params: Mapping[str, nn.Parameter], group: dist.ProcessGroup | None) -> int:
        """Create the tables (rank 0 writes its weights unless the servers resumed); the step to resume at."""
        if self.rank == 0:
            resume = min(t.create().wait() for t in self.tables.values()) if self.tables else 0
            if resume == 0:
                for n, t in self.tables.items():
                    rows, dim = table_shape(params[n])
                    t.set(torch.arange(rows), params[n].detach().reshape(rows, dim)).wait()
        dist.barrier(group=group)
        self.step = min(t.create().wait() for t in self.tables.values()) if self.tables else 0
        return self.step

    # --- pulls ------------------------------------------------------------------------------------------------
    def _pull_step(self) -> int:
        return self.step if self.mode == "sync" else 0

    def _pull_hook(self, name: str) -> Callable[[nn.Module, tuple[object, ...]], None]:
        def hook(m: nn.Module, args: tuple[object, ...]) -> None:
            with timed(self.phases, "pull"):
                rows = rows_of_input(m, args)
                self.rows[name] = rows
                vals = self._prefetched(name, rows)
                if vals is None:
                    vals = self.tables[name].pull(rows, step=self._pull_step()).wait()
                weight = m.weight
                assert isinstance(weight, torch.Tensor)
                with torch.no_grad():  # the servers answer on the host; the parameter may live on a GPU
                    weight[rows] = vals.to(weight.device, weight.dtype)

        return hook

    def _prefetched(self, name: str, rows: torch.Tensor) -> torch.Tensor | None:
        """The rows' values from this step's prefetch, or None when none was made or it lacks a row."""
        got = self._prefetch.get(name)
        if got is None or got[0] != self.step:
            return None
        have, work = got[1], got[2]
        want = rows.detach().cpu().numpy().astype(np.int64, copy=False)
        pos = np.minimum(np.searchsorted(have, want), max(have.size - 1, 0))
        if have.size == 0 or not np.array_equal(have[pos], want):
            return None
        return work.wait()[torch.from_numpy(pos)]

    def begin_step(self, params: Mapping[str, nn.Parameter]) -> None:
        """Drop stale prefetches and pull the whole tables into their parameters (the rows come by the hooks)."""
        self._prefetch = {n: v for n, v in self._prefetch.items() if v[0] == self.step}
        pulls = [
            (params[n], t.pull(torch.arange(t.rows), step=self._pull_step()))
            for n, t in self.tables.items()
            if n not in self.by_rows
        ]
        for p, w in pulls:
            with torch.no_grad():
                p.copy_(w.wait().reshape(p.shape))

    def prefetch(self, inputs: torch.Tensor | Mapping[str, torch.Tensor]) -> None:
        """Request the next step's rows now; sync servers answer once this step's update is applied."""
        given = inputs if isinstance(inputs, Mapping) else dict.fromkeys(self.by_rows, inputs)
        bad = [n for n in given if n not in self.by_rows]
        if bad:
            raise KeyError(f"prefetch names {bad} are not sparse tables: {self.by_rows}")
        step = self.step + 1 if self.mode == "sync" else 0
        for n, x in given.items():
            rows = np.unique(x.detach().cpu().numpy().reshape(-1).astype(np.int64))
            self._prefetch[n] = (self.step + 1, rows, self.tables[n].pull(rows, step=step))

    # --- pushes -----------------------------------------------------------------------------------------------
    def aggregate(self, params: list[NamedParam], env: ReduceEnv) -> None:
        """Push the gradients of ``params`` (every ``ps`` parameter, with a gradient or not: every pusher
        pushes to every partition each step) and, on the chief in sync mode, the step's APPLY; ``finish``
        waits for the replies. The servers sum, apply and keep the result, so the local gradients are cleared
        (a local optimizer never updates these parameters)."""
        del env  # the servers aggregate, not a collective of the group
        works: list[Work[None]] = []
        for p in params:
            n = p.name
            if n in self.by_rows:
                rows, vals = self._sparse_grad(n, p.param)
                if self.machine is not None:
                    rows, vals = self.machine.gather(rows, vals)
                    if not self.machine.is_chief:
                        continue  # only the machine's local chief pushes
                works.append(self.tables[n].push(rows, vals, step=self.step, coalesce=self.coalesce))
            else:
                g = p.param.grad if p.param.grad is not None else torch.zeros_like(p.param)
                if g.is_sparse:  # a table pushed whole (e.g. left "replicated" by a shard plan, under ps_dense)
                    g = g.to_dense()
                nrows, dim = table_shape(p.param)
                g = g.reshape(nrows, dim)
                rows, vals = (
                    (torch.arange(nrows), g) if self.push_feedback is None else self.push_feedback.rows(n, g)
                )
                works.append(self.tables[n].push(rows, vals, step=self.step))
        if self.mode == "sync" and self.rank == 0:
            # Parallax §5: the chief triggers the update, once, right behind its pushes (servers park it until
            # every pusher's gradient of the step is in)
            works += [t.apply(self.step) for t in self.tables.values()]
        self._works = works

    def _sparse_grad(self, name: str, p: nn.Parameter) -> tuple[torch.Tensor, torch.Tensor]:
        g = p.grad
        if g is not None and g.is_sparse and not self.coalesce:
            return g._indices()[0], g._values()  # one row per lookup: the server sums duplicates
        if g is None:
            return torch.zeros(0, dtype=torch.int64), torch.zeros(0, p.shape[1], device=p.device)
        if g.is_sparse:
            g = g.coalesce()  # duplicates inside the worker summed
            return g.indices()[0], g.values()
        rows = self.rows[name]  # dense grad of an EmbeddingBag: only its input rows can be nonzero
        return rows, g[rows]

    def finish(self) -> None:
        """Wait for this step's push and apply replies; the next step begins."""
        for w in self._works:
            w.wait()
        self._works = []
        self.step += 1

    # --- state ------------------------------------------------------------------------------------------------
    def save(self) -> list[str]:
        """Checkpoint the servers (call on the chief between steps)."""
        return save_servers(self.client).wait()

    def state_dict(self) -> dict[str, Any] | None:
        """The compressed pushes' residuals and compressor state (per worker), None without a push compressor."""
        return None if self.push_feedback is None else self.push_feedback.state_dict()

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        load_optional_state(self.push_feedback, state, "compressed-push state", "push_compressor")

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self.client.close()
