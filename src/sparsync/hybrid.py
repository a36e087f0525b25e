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

A model placed by ``sparsync.shard(model, plan={...})`` brings its own placements (``plan_of(model)``), read off
the model here: a table placed ``"server"`` goes on the servers by rows (whatever its ``sparse`` flag), a
sharded table keeps its own exchange (``Sharded``: its gradient is already the sum over the ranks when backward
leaves, so only ``sparse_reduce="mean"`` divides it, as it divides a replicated table's; its shard differs per
rank and is never broadcast), and the tables the plan left replicated are not on the servers by default:
they take the collective default (``dense_allreduce``) unless ``sparse_params`` or ``placements`` say otherwise
(with ``ps_dense``, which puts every parameter a plan does not place on the servers, they go there whole, as the
dense ones do). Async mode runs no collective, so it refuses sharded tables.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sparsync.compress.base import Compressor
from sparsync.compress.sketch import SparseSketch
from sparsync.placement import NamedParam, Placement, ReduceEnv, aggregate, plan_of, updated_in_backward
from sparsync.placement.base import zero_grad
from sparsync.placement.embeddings import embedding_modules
from sparsync.plan.planner import Plan
from sparsync.plan.registry import kind_of, objects, resolve
from sparsync.ps.aggregate import MachineAggregator
from sparsync.ps.client import PSClient
from sparsync.ps.feedback import PushFeedback
from sparsync.ps.nodes import procs_per_machine_from_env
from sparsync.ps.optim import OptimizerConfig
from sparsync.ps.placement import ParameterServer, timed
from sparsync.ps.table import SPLITS
from sparsync.ps.wire import CurveKeys
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
    split: str = "stride"  # rows to partitions: "stride" (row % P, spreads Zipf-hot rows) or "range"
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


def _sparse_names(
    emb: Mapping[str, nn.Module], sparse_params: Sequence[str] | None, default: Sequence[str]
) -> list[str]:
    """The embeddings the servers keep by rows by default: ``sparse_params`` (each must name an embedding's
    weight; KeyError naming the others and the embeddings there are), else ``default``."""
    names = list(sparse_params) if sparse_params is not None else list(default)
    bad = [n for n in names if n not in emb]
    if bad:
        raise KeyError(f"{bad} are not embedding weights; the PS serves nn.Embedding/EmbeddingBag: {list(emb)}")
    return names


def _tables(
    model: nn.Module, cfg: HybridConfig, sparse_params: Sequence[str] | None
) -> tuple[dict[str, Placement], dict[str, nn.Module], list[str]]:
    """The placements ``sparsync.shard`` marked on ``model`` (``plan_of``); the embeddings by weight name, a
    table placed ``"server"`` included whatever its ``sparse`` flag; and the tables the servers keep by rows
    by default: once ``sparsync.shard`` placed the tables (sync mode), only those it placed there."""
    marked = plan_of(model)
    served = [n for n, pl in marked.items() if kind_of(pl) == "ps"]
    emb: dict[str, nn.Module] = dict(embedding_modules(model))
    emb.update({n: model.get_submodule(n.rpartition(".")[0]) for n in served})
    names = _sparse_names(emb, sparse_params, served if marked and cfg.mode == "sync" else list(emb))
    return marked, emb, names + [n for n in served if n not in names]


def _refuse_updated_in_backward(model: nn.Module) -> None:
    """ValueError naming the tables that ``sparsync.shard(optimizer=...)`` updates in backward: the trainer steps
    every parameter itself, and would step them again (or push them to the servers)."""
    names = updated_in_backward(model)
    if names:
        raise ValueError(
            f"HybridTrainer cannot train {names}: sparsync.shard(optimizer=...) updates these tables at the end "
            "of backward, and the trainer would step them again; shard without optimizer= for HybridTrainer, or "
            "train the rest with DistributedOptimizer over sparsync.sharding.dense_parameters(model)"
        )


def _with_marks(
    cfg: HybridConfig, marked: Mapping[str, Placement], placements: Plan | Mapping[str, str | Placement] | None
) -> dict[str, str | Placement]:
    """``placements`` over the placements ``sparsync.shard`` marked on the model (``plan_of``): its server
    tables as ``ps``, its shards as their ``Sharded``. ValueError naming the shards when async mode is asked
    for, or when ``placements`` moves a shard to another kind: a shard holds one rank's rows only, so no other
    placement could train it."""
    given = dict(placements.kinds if isinstance(placements, Plan) else placements or {})
    shards = [n for n, pl in marked.items() if not pl.replicated]
    if shards and cfg.mode == "async":
        raise ValueError(
            f"mode='async' cannot train the sharded tables {shards}: their rows are exchanged by a collective of "
            "every rank each step, and async mode runs none; use mode='sync', or place those tables 'server' "
            "(or 'replicated') in sparsync.shard's plan"
        )
    moved = {n: kind_of(given[n]) for n in shards if n in given and kind_of(given[n]) != marked[n].kind}
    if moved:
        raise ValueError(
            f"placements {moved} name shards of sparsync.shard, which each rank holds only its own rows of; "
            "they can only stay 'sharded' (to place such a table otherwise, choose it in sparsync.shard's plan)"
        )
    return {**{n: "ps" if kind_of(pl) == "ps" else pl for n, pl in marked.items()}, **given}


def _placed(
    cfg: HybridConfig,
    params: Sequence[str],
    names: Sequence[str],
    placements: Plan | Mapping[str, str | Placement] | None,
) -> tuple[dict[str, str | Placement], dict[str, str]]:
    """Every parameter's placement (``placements`` over the default), and the default's kind per parameter:
    the ``names`` embeddings on the servers (in sync mode without ``ps_dense``; else every parameter), the
    rest ``dense_allreduce``."""
    default_ps = names if cfg.mode == "sync" and not cfg.ps_dense else list(params)
    default = {n: "ps" if n in default_ps else "dense_allreduce" for n in params}
    placed = resolve(list(params), default, placements.kinds if isinstance(placements, Plan) else placements)
    return placed, default


def _push_feedback(cfg: HybridConfig, rank: int, world: int) -> PushFeedback | None:
    """The compression of pushes to the servers that ``cfg.push_compressor`` asks for (DCT §3.3), or None."""
    if cfg.push_compressor is None:
        return None
    return PushFeedback(cfg.push_compressor, error_feedback=cfg.push_error_feedback, rank=rank, world=world)


class HybridTrainer:
    """``trainer.step(closure)``: the closure runs the forward pass and returns the loss.

    The replicated optimizer (``sparsync.placement``'s template method over the collective placements) plus a
    ``ParameterServer`` placement (tables, pulls, prefetch, pushes) with a per-machine ``MachineAggregator``.
    ``dense_optimizer`` (sync mode) updates the dense parameters after their allreduce; ``sparse_optimizer``
    too, for the ``sparse_allreduce`` and ``sketch`` placements whose gradients stay sparse COO (``SGD``,
    ``SparseAdam``, ``Adagrad``); parameters on the servers get no local gradient. Async mode updates
    everything on the servers with ``cfg.optimizer``. Every rank builds the same model; rank 0's initial
    weights win (local ones broadcast, the servers' written by rank 0). ``keys``: this worker's CURVE keypair
    for servers that authenticate (default: the run's, from the environment ``start_servers`` set up).
    ``placements``: a ``Plan``, or per parameter name a kind (``dense_allreduce``, ``sparse_allreduce``,
    ``sketch``, ``ps``) or a ``Placement`` object (e.g. ``Compressed(Threshold(...), ErrorFeedback())``).
    A model from ``sparsync.shard(model, plan={...})`` brings its placements (module doc): its server tables on
    the servers by rows, its shards through their own exchange, the tables it left replicated reduced by the
    collective default (with ``ps_dense``, pushed whole to the servers like every unsharded parameter);
    ``placements`` wins for any parameter but a shard, and the local optimizers step the shards (their gradients
    are sparse COO: SGD, Adagrad, SparseAdam). Raises ValueError for sharded tables in async mode or a shard given
    another placement, naming them.
    """

    def __init__(
        self,
        model: nn.Module,
        addresses: Sequence[str],
        cfg: HybridConfig | None = None,
        *,
        dense_optimizer: torch.optim.Optimizer | None = None,
        sparse_optimizer: torch.optim.Optimizer | None = None,
        placements: Plan | Mapping[str, str | Placement] | None = None,
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
        # every rank must create every machine's group, in the same order
        aggregator = MachineAggregator(self.rank, self.world, m) if self.local_agg else None
        self.dense_optimizer, self.sparse_optimizer = dense_optimizer, sparse_optimizer
        self.log = log
        _refuse_updated_in_backward(model)
        marked, emb, names = _tables(model, cfg, sparse_params)
        params = dict(model.named_parameters())
        placed, default = _placed(cfg, list(params), names, _with_marks(cfg, marked, placements))
        self.placements = {n: kind_of(pl) for n, pl in placed.items()}
        if cfg.mode == "async" and any(k != "ps" for k in self.placements.values()):
            raise ValueError(f"async mode keeps every parameter on the servers, got placements {self.placements}")
        on_ps = [n for n, k in self.placements.items() if k == "ps"]
        # By rows: the sparse_params embeddings, and embeddings placed "ps" explicitly; others as whole tables.
        by_rows = [n for n in on_ps if n in names or (n in emb and default[n] != "ps")]
        self.sparse_names = by_rows
        # a table's sum divides as sparse_reduce says, whether replicated, sharded or on the servers
        tables = set(emb) | set(marked)
        self.mean = {n: (cfg.sparse_reduce if n in tables else cfg.dense_reduce) == "mean" for n in params}
        self.sparse_grads = {n for n, mod in emb.items() if getattr(mod, "sparse", False)}
        self.phases: dict[str, float] = dict.fromkeys(PHASES, 0.0)  # accumulated ms per phase
        self.plan = objects(placed, sketch=cfg.sketch, sketch_error_feedback=cfg.sketch_error_feedback)
        self.env = ReduceEnv(group or dist.group.WORLD, self.world, None, log)  # type: ignore[arg-type]
        push = _push_feedback(cfg, self.rank, self.world)
        self.servers = ParameterServer(
            PSClient(addresses, keys=keys, timeout=cfg.timeout, sender=self.rank),
            {n: emb[n] for n in by_rows}, [n for n in on_ps if n not in by_rows], params,
            rank=self.rank, world=self.world, mode=cfg.mode, mean=self.mean, optimizer=cfg.optimizer,
            partitions=cfg.partitions, split=cfg.split, dense_whole=cfg.dense_whole,
            table_prefix=cfg.table_prefix, machine=aggregator, coalesce=cfg.local_aggregation, push=push,
            phases=self.phases,
        )  # fmt: skip
        self.servers.start(params, group)
        own = {n for n, pl in self.plan.items() if not pl.replicated}  # shards: sparsync.shard scattered rank 0's
        for n, p in params.items():  # rank 0's initial weights win
            if n not in self.servers.tables and n not in own:
                dist.broadcast(p.data, src=0, group=group)

    # the parameter server's parts, as the trainer's own attributes (examples/ and the bench read them)
    @property
    def tables(self) -> dict[str, Any]:
        return self.servers.tables

    @property
    def client(self) -> PSClient:
        return self.servers.client

    @property
    def step_no(self) -> int:
        return self.servers.step

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
        params = dict(self.model.named_parameters())
        with timed(self.phases, "pull"):
            self.servers.begin_step(params)
        t0, pulled = time.perf_counter(), self.phases["pull"]
        loss = closure()
        loss.backward()  # type: ignore[no-untyped-call]
        self.phases["forward_backward"] += 1e3 * (time.perf_counter() - t0) - (self.phases["pull"] - pulled)
        t_push = time.perf_counter()
        self.servers.aggregate([NamedParam(n, params[n]) for n in self.servers.tables], self.env)
        if prefetch is not None:
            self.servers.prefetch(prefetch)
        self.phases["push"] += 1e3 * (time.perf_counter() - t_push)
        if self.cfg.mode == "sync" and self.plan:
            with timed(self.phases, "dense_allreduce"):
                self._reduce_local(params)
        with timed(self.phases, "apply_wait"):
            self.servers.finish()
        return float(loss.detach())

    def _reduce_local(self, params: dict[str, nn.Parameter]) -> None:
        """Every placement but "ps" (sums, then the mean where asked), then the local optimizers (which skip
        the servers' parameters)."""
        named = [NamedParam(n, params[n]) for n in self.plan]
        for p in named:  # what a worker that did not use a parameter contributes
            if p.param.grad is None:
                p.param.grad = zero_grad(p.param, sparse=p.name in self.sparse_grads and p.param.dim() >= 2)
        aggregate(self.plan, named, self.env)
        for p in named:
            g = p.param.grad
            if self.mean[p.name] and self.world > 1 and g is not None:
                p.param.grad = g / self.world
        for n in self.servers.tables:
            params[n].grad = None
        for opt in (self.dense_optimizer, self.sparse_optimizer):
            if opt is not None:
                opt.step()

    def save(self) -> list[str]:
        """Checkpoint the servers (call on the chief between steps); each worker's own part of the checkpoint
        is ``state_dict()``."""
        return self.servers.save()

    def state_dict(self) -> dict[str, Any]:
        """This worker's state besides the servers': the collective placements' (sketch residuals and hash
        counter) and the compressed pushes' residuals and compressor state. Save one per rank, next to
        ``save()``."""
        local = {}
        for pl in self._distinct_placements():
            state = pl.state_dict()
            if state is not None:
                local[pl.kind] = state
        return {"placements": local, "push": self.servers.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        # checkpoints written before the placements were objects kept the sketch's state under "reduced"
        local = state["placements"] if "placements" in state else {"sketch": state["reduced"]}
        for pl in self._distinct_placements():
            pl.load_state_dict(local.get(pl.kind, {}))
        self.servers.load_state_dict(state.get("push"))

    def _distinct_placements(self) -> list[Placement]:
        """Each collective placement object once (parameters of one kind share it)."""
        return list({id(pl): pl for pl in self.plan.values()}.values())

    def close(self) -> None:
        self.servers.close()
