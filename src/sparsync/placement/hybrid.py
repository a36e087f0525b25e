"""A hybrid training loop without the Replicator: dense parameters by allreduce, sparse ones by the parameter
server (Parallax §3.1), in sync or async mode.

Sync (Parallax §4-5): every step, each worker pulls the rows its batch reads (forward pre-hooks on the
embeddings), waiting until the servers applied the previous step; after backward it sends those rows'
gradients (duplicates summed inside the worker, and, with local aggregation, across the workers of a machine
by the machine's local chief); dense gradients are allreduced with sparsync over the torch process group and
applied by a local torch optimizer; then the chief triggers the servers' update, once per step.

Async (TF-Replicator's asynchronous PS replicator, Hogwild-style as DCT-DP §3.3 trains its sparse part):
every parameter lives on the servers (dense ones as one-row-per-leading-index tables); each worker pulls,
computes, pushes and goes on, and the server applies each push when it arrives; no collective runs, so a slow
or dead worker stops no one. Local aggregation needs the machine's workers to meet, so async mode does not use
it (duplicates inside a worker are still summed).

Overlap (Parallax §5): the chief's APPLY goes out right behind its pushes (each server parks it until all
pushes of the step arrived), not after a round trip of its own; ``step(prefetch=next_input)`` then requests the
next step's rows at once (the servers answer them after the update) while the dense allreduce still runs.
``phases`` accumulates milliseconds per phase of the step (``PHASES``).

Placements (sync mode): ``placements=`` (a ``Plan`` from ``make_plan``, or a dict name -> placement) overrides
the default (the ``sparse_params`` embeddings on the servers, everything else dense allreduce) for any
parameter: ``dense_allreduce`` (one flat dense allreduce), ``ps`` (an embedding by rows, any other parameter as
a whole table), ``sparse_allreduce`` and ``sketch`` (``reduced.py``), each followed by the local optimizers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from sparsync.collectives.tensor import allreduce
from sparsync.compress.base import Compressor
from sparsync.compress.sketch import SparseSketch
from sparsync.handle import Work
from sparsync.placement.client import PSClient
from sparsync.placement.detect import embedding_modules, rows_of_input
from sparsync.placement.feedback import PushFeedback, load_optional_state
from sparsync.placement.nodes import procs_per_machine_from_env
from sparsync.placement.optim import OptimizerConfig
from sparsync.placement.plan import Plan
from sparsync.placement.reduced import REDUCED, Reduced, resolve_placements
from sparsync.placement.table import SPLITS, PSTable, save_servers
from sparsync.placement.wire import CurveKeys
from sparsync.record import CommLog

# timing scopes of HybridTrainer.phases: compute (pull waits excluded), pull waits, issuing the pushes (with the
# machine gather) and the chief's APPLY, the dense allreduce with its optimizer step, waiting for push/apply
# replies
PHASES = ("forward_backward", "pull", "push", "dense_allreduce", "apply_wait")


@dataclass(frozen=True)
class HybridConfig:
    mode: str = "sync"  # "sync" (chief-triggered update) or "async" (apply each push as it arrives)
    sparse_reduce: str = "sum"  # "sum" (Parallax's default for sparse) or "mean" over all workers
    dense_reduce: str = "mean"  # "mean" (Parallax's default for dense) or "sum"
    local_aggregation: bool = True  # sum a machine's sparse gradients before one push (sync only)
    # ranks [k·m, (k+1)·m) form machine k; None: torchrun's LOCAL_WORLD_SIZE (1 when unset: one rank per machine)
    procs_per_machine: int | None = None
    partitions: int | None = None  # per sparse table; None: one per server
    split: str = "strided"  # rows to partitions: "strided" (row % P, spreads Zipf-hot rows) or "range"
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)  # server-side (all tables)
    timeout: float = 60.0  # seconds per PS request
    ps_dense: bool = False  # sync: dense parameters on the servers too (the PS-only architecture)
    dense_whole: bool = False  # dense tables whole on one server each, round-robin (Parallax), not split
    table_prefix: str = ""  # prepended to table names, to run several trainers against the same servers
    sketch: SparseSketch = field(default_factory=lambda: SparseSketch(ratio=0.05))  # "sketch" placements
    sketch_error_feedback: bool = False  # "sketch": keep each worker's residual and add it to the next step
    push_compressor: Compressor | None = None  # compress pushes of dense parameters to the servers (DCT §3.3)
    push_error_feedback: bool = True  # with push_compressor: per-worker residuals fed back into the next push

    def __post_init__(self) -> None:
        if self.mode not in ("sync", "async"):
            raise KeyError(f"unknown mode {self.mode!r}; valid: sync, async")
        for name in ("sparse_reduce", "dense_reduce"):
            if getattr(self, name) not in ("sum", "mean"):
                raise ValueError(f"{name} must be 'sum' or 'mean', got {getattr(self, name)!r}")
        if self.split not in SPLITS:
            raise KeyError(f"unknown split {self.split!r}; valid: {', '.join(SPLITS)}")
        if self.procs_per_machine is not None and self.procs_per_machine < 1:
            raise ValueError(f"procs_per_machine must be >= 1, got {self.procs_per_machine}")


class HybridTrainer:
    """``trainer.step(closure)``: the closure runs the forward pass and returns the loss.

    ``dense_optimizer`` (sync mode) updates the dense parameters after their allreduce; ``sparse_optimizer``
    too, for the ``sparse_allreduce`` and ``sketch`` placements whose gradients stay sparse COO (``SGD``,
    ``SparseAdam``, ``Adagrad``); parameters on the servers get no local gradient. Async mode updates
    everything on the servers with ``cfg.optimizer``. Every rank builds the same model; rank 0's initial
    weights win (local ones broadcast, the servers' written by rank 0). ``keys``: this worker's CURVE keypair
    for servers that authenticate (default: the run's, from the environment ``start_servers`` set up).
    """

    def __init__(
        self,
        model: nn.Module,
        addresses: Sequence[str],
        cfg: HybridConfig | None = None,
        *,
        dense_optimizer: torch.optim.Optimizer | None = None,
        sparse_optimizer: torch.optim.Optimizer | None = None,
        placements: Plan | Mapping[str, str] | None = None,
        log: CommLog | None = None,
        sparse_params: Sequence[str] | None = None,
        keys: CurveKeys | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.cfg = cfg = cfg or HybridConfig()
        self.model = model
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        m = self.procs_per_machine = cfg.procs_per_machine or procs_per_machine_from_env()
        if self.world % m:
            raise ValueError(f"world size {self.world} is not a multiple of procs_per_machine={m}")
        self.machine = self.rank // m
        self.local_agg = cfg.mode == "sync" and cfg.local_aggregation and m > 1
        self.machine_group: dist.ProcessGroup | None = None
        if self.local_agg:
            for k in range(self.world // m):  # every rank must create every group, in the same order
                g = dist.new_group(list(range(k * m, (k + 1) * m)))
                if k == self.machine:
                    self.machine_group = g
        self.dense_optimizer, self.sparse_optimizer = dense_optimizer, sparse_optimizer
        self.log = log
        emb = dict(embedding_modules(model))
        names = list(sparse_params) if sparse_params is not None else list(emb)
        params = dict(model.named_parameters())
        bad = [n for n in names if n not in emb]
        if bad:
            raise KeyError(
                f"{bad} are not embedding weights; the PS serves nn.Embedding/EmbeddingBag: {list(emb)}"
            )
        default_ps = names if cfg.mode == "sync" and not cfg.ps_dense else list(params)
        default = {n: "ps" if n in default_ps else "dense_allreduce" for n in params}
        placed = resolve_placements(list(params), default, placements)
        if cfg.mode == "async" and any(pl != "ps" for pl in placed.values()):
            raise ValueError(f"async mode keeps every parameter on the servers, got placements {placed}")
        on_ps = [n for n, pl in placed.items() if pl == "ps"]
        # By rows: the sparse_params embeddings, and embeddings placed "ps" explicitly; others as whole tables.
        names = [n for n in on_ps if n in names or (n in emb and default[n] != "ps")]
        self.placements = placed
        self.dense = [(n, p) for n, p in params.items() if placed[n] == "dense_allreduce"]
        self.reduced = Reduced(
            {n: pl for n, pl in placed.items() if pl in REDUCED},
            {n: (cfg.sparse_reduce if n in emb else cfg.dense_reduce) == "mean" for n in params},
            sparse_grads=[n for n, m in emb.items() if getattr(m, "sparse", False)],
            sketch=cfg.sketch, error_feedback=cfg.sketch_error_feedback, group=group, log=log,
        )  # fmt: skip
        self.client = PSClient(addresses, keys=keys, timeout=cfg.timeout, sender=self.rank)
        # Local aggregation gathers the row-wise tables only: every worker pushes its whole-table gradients.
        pushers = self.world // m if self.local_agg else self.world
        self.tables: dict[str, PSTable] = {}
        whole = 0  # dense variables placed whole so far: the next goes to server whole mod S
        for n in on_ps:
            rows, dim = _table_shape(params[n])
            mean = cfg.sparse_reduce if n in names else cfg.dense_reduce
            is_whole = cfg.dense_whole and n not in names
            parts = 1 if is_whole else min(cfg.partitions or len(addresses), rows)
            self.tables[n] = PSTable(
                self.client, cfg.table_prefix + n, rows, dim, partitions=parts,
                optimizer=cfg.optimizer, mode=cfg.mode, pushers=pushers if n in names else self.world,
                divisor=float(self.world) if mean == "mean" else 1.0, split=cfg.split,
                first_server=whole % len(addresses) if is_whole else 0,
            )  # fmt: skip
            whole += is_whole
        self.phases: dict[str, float] = dict.fromkeys(PHASES, 0.0)  # accumulated ms per phase
        self._prefetch: dict[str, tuple[int, np.ndarray, Work[torch.Tensor]]] = {}  # name -> step, rows, pull
        self.push = (
            None
            if cfg.push_compressor is None
            else PushFeedback(cfg.push_compressor, error_feedback=cfg.push_error_feedback, rank=self.rank,
                              world=self.world)
        )  # fmt: skip
        self.rows: dict[str, torch.Tensor] = {}
        self._hooks = [emb[n].register_forward_pre_hook(self._pull_hook(n)) for n in names]
        self.sparse_names = names
        self.step_no = self._init_tables(params)

    def _init_tables(self, params: dict[str, nn.Parameter]) -> int:
        if self.rank == 0:
            resume = min(t.create().wait() for t in self.tables.values()) if self.tables else 0
            if resume == 0:
                for n, t in self.tables.items():
                    rows, dim = _table_shape(params[n])
                    t.set(torch.arange(rows), params[n].detach().reshape(rows, dim)).wait()
        dist.barrier(group=self.group)
        step = min(t.create().wait() for t in self.tables.values()) if self.tables else 0
        for p in [p for _, p in self.dense] + self.reduced.params(dict(self.model.named_parameters())):
            dist.broadcast(p.data, src=0, group=self.group)
        return step

    @contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phases[phase] += 1e3 * (time.perf_counter() - t0)

    def _pull_hook(self, name: str) -> Callable[[nn.Module, tuple[object, ...]], None]:
        def hook(m: nn.Module, args: tuple[object, ...]) -> None:
            with self._timed("pull"):
                rows = rows_of_input(m, args)
                self.rows[name] = rows
                vals = self._prefetched(name, rows)
                if vals is None:
                    step = self.step_no if self.cfg.mode == "sync" else 0
                    vals = self.tables[name].pull(rows, step=step).wait()
                weight = m.weight
                assert isinstance(weight, torch.Tensor)
                with torch.no_grad():
                    weight[rows] = vals.to(weight.dtype)

        return hook

    def _prefetched(self, name: str, rows: torch.Tensor) -> torch.Tensor | None:
        """The rows' values from this step's prefetch, or None when none was made or it lacks a row."""
        got = self._prefetch.get(name)
        if got is None or got[0] != self.step_no:
            return None
        have, work = got[1], got[2]
        want = rows.detach().cpu().numpy().astype(np.int64, copy=False)
        pos = np.minimum(np.searchsorted(have, want), max(have.size - 1, 0))
        if have.size == 0 or not np.array_equal(have[pos], want):
            return None
        return work.wait()[torch.from_numpy(pos)]

    def _start_prefetch(self, prefetch: torch.Tensor | Mapping[str, torch.Tensor]) -> None:
        """Request the next step's rows now; sync servers answer once this step's update is applied."""
        given = prefetch if isinstance(prefetch, Mapping) else dict.fromkeys(self.sparse_names, prefetch)
        bad = [n for n in given if n not in self.sparse_names]
        if bad:
            raise KeyError(f"prefetch names {bad} are not sparse tables: {self.sparse_names}")
        step = self.step_no + 1 if self.cfg.mode == "sync" else 0
        for n, x in given.items():
            rows = np.unique(x.detach().cpu().numpy().reshape(-1).astype(np.int64))
            self._prefetch[n] = (self.step_no + 1, rows, self.tables[n].pull(rows, step=step))

    def step(
        self,
        closure: Callable[[], torch.Tensor],
        *,
        prefetch: torch.Tensor | Mapping[str, torch.Tensor] | None = None,
    ) -> float:
        """One training step; returns this worker's loss. ``prefetch``: the next step's embedding input (one
        tensor for every sparse table, or a mapping table name -> input) whose rows are pulled during this
        step's dense allreduce; the next step pulls only rows it lacks."""
        for p in self.model.parameters():
            p.grad = None
        self._prefetch = {n: v for n, v in self._prefetch.items() if v[0] == self.step_no}
        with self._timed("pull"):
            self._pull_dense_on_ps()
        t0, pulled = time.perf_counter(), self.phases["pull"]
        loss = closure()
        loss.backward()  # type: ignore[no-untyped-call]
        self.phases["forward_backward"] += 1e3 * (time.perf_counter() - t0) - (self.phases["pull"] - pulled)
        t_push = time.perf_counter()
        params = dict(self.model.named_parameters())
        works: list[Work[None]] = []
        for n in self.sparse_names:
            rows, vals = self._sparse_grad(n, params[n])
            if self.local_agg:
                rows, vals = self._machine_gather(rows, vals)
                if self.rank % self.procs_per_machine:
                    continue  # only the machine's local chief pushes
            agg = self.cfg.local_aggregation
            works.append(self.tables[n].push(rows, vals, step=self.step_no, coalesce=agg))
        for n, p in params.items():  # dense parameters on the servers: async, PS-only, or placed "ps"
            if n not in self.tables or n in self.sparse_names:
                continue
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            nrows, dim = _table_shape(p)
            g = g.reshape(nrows, dim)
            rows, vals = (torch.arange(nrows), g) if self.push is None else self.push.rows(n, g)
            works.append(self.tables[n].push(rows, vals, step=self.step_no))
        if self.cfg.mode == "sync" and self.rank == 0:
            # Parallax §5: the chief triggers the update, once, right behind its pushes (servers park it until
            # every pusher's gradient of the step is in)
            works += [t.apply(self.step_no) for t in self.tables.values()]
        if prefetch is not None:
            self._start_prefetch(prefetch)
        self.phases["push"] += 1e3 * (time.perf_counter() - t_push)
        if self.cfg.mode == "sync" and (self.dense or self.reduced.names):
            with self._timed("dense_allreduce"):
                self._reduce_local(params)
        with self._timed("apply_wait"):
            for w in works:
                w.wait()
        self.step_no += 1
        return float(loss.detach())

    def _pull_dense_on_ps(self) -> None:
        step = self.step_no if self.cfg.mode == "sync" else 0
        pulls = [
            (p, self.tables[n].pull(torch.arange(self.tables[n].rows), step=step))
            for n, p in self.model.named_parameters()
            if n in self.tables and n not in self.sparse_names
        ]
        for p, w in pulls:
            with torch.no_grad():
                p.copy_(w.wait().reshape(p.shape))

    def _sparse_grad(self, name: str, p: nn.Parameter) -> tuple[torch.Tensor, torch.Tensor]:
        g = p.grad
        if g is not None and g.is_sparse and not self.cfg.local_aggregation:
            return g._indices()[0], g._values()  # one row per lookup: the server sums duplicates
        if g is None:
            return torch.zeros(0, dtype=torch.int64), torch.zeros(0, p.shape[1])
        if g.is_sparse:
            g = g.coalesce()  # duplicates inside the worker summed
            return g.indices()[0], g.values()
        rows = self.rows[name]  # dense grad of an EmbeddingBag: only its input rows can be nonzero
        return rows, g[rows]

    def _machine_gather(self, rows: torch.Tensor, vals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """All of the machine's (rows, grads), concatenated (the table coalesces them before sending)."""
        g, m = self.machine_group, self.procs_per_machine
        n = torch.tensor([rows.numel()])
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(m)]
        dist.all_gather(counts, n, group=g)
        top = int(max(c.item() for c in counts))
        pr = torch.zeros(top, dtype=torch.int64)
        pv = torch.zeros(top, vals.shape[1])
        pr[: rows.numel()], pv[: rows.numel()] = rows, vals
        ar, av = [torch.empty_like(pr) for _ in range(m)], [torch.empty_like(pv) for _ in range(m)]
        dist.all_gather(ar, pr, group=g)
        dist.all_gather(av, pv, group=g)
        k = [int(c.item()) for c in counts]
        return torch.cat([a[:c] for a, c in zip(ar, k, strict=True)]), torch.cat(
            [a[:c] for a, c in zip(av, k, strict=True)]
        )

    def _reduce_local(self, params: dict[str, nn.Parameter]) -> None:
        """Every placement but "ps", then the local optimizers (which skip the servers' parameters)."""
        if not self.dense and not self.reduced.names:
            return
        self._allreduce_dense()
        self.reduced.reduce(params)
        for n in self.tables:
            params[n].grad = None
        for opt in (self.dense_optimizer, self.sparse_optimizer):
            if opt is not None:
                opt.step()

    def _allreduce_dense(self) -> None:
        if not self.dense:
            return
        grads = [_dense_grad(p) for _, p in self.dense]
        flat = torch.cat([g.reshape(-1) for g in grads])
        out = allreduce(flat, algorithm="dense", group=self.group, log=self.log)
        assert isinstance(out, torch.Tensor)
        if self.cfg.dense_reduce == "mean":
            out /= self.world
        off = 0
        for _, p in self.dense:
            p.grad = out[off : off + p.numel()].reshape(p.shape).clone()
            off += p.numel()

    def save(self) -> list[str]:
        """Checkpoint the servers (call on the chief between steps); each worker's own part of the checkpoint
        is ``state_dict()``."""
        return save_servers(self.client).wait()

    def state_dict(self) -> dict[str, Any]:
        """This worker's state besides the servers': the error-feedback residuals (sketch placements and
        compressed pushes) and the push compressor's state. Save one per rank, next to ``save()``."""
        return {
            "reduced": self.reduced.state_dict(),
            "push": None if self.push is None else self.push.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.reduced.load_state_dict(state["reduced"])
        load_optional_state(self.push, state.get("push"), "compressed-push state", "push_compressor")

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self.client.close()


def _dense_grad(p: torch.Tensor) -> torch.Tensor:
    if p.grad is None:
        return torch.zeros_like(p)
    return p.grad.to_dense() if p.grad.is_sparse else p.grad  # an embedding placed on dense allreduce


def _table_shape(p: torch.Tensor) -> tuple[int, int]:
    if p.dim() >= 2:
        return int(p.shape[0]), int(p.numel() // p.shape[0])
    return 1, int(p.numel())
