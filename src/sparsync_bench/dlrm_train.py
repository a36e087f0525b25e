"""``sparsync bench dlrm``: DLRM trained data-parallel on Criteo-format data, torch's own paths
beside sparsync's, in one run, from the same initial weights, on the same samples:

- ``torch_ddp_dense``: ``DistributedDataParallel`` with dense embedding gradients (``sparse=False``): every
  table's whole gradient by gloo's ring allreduce, what a user gets from DDP by default;
- ``torch_ddp_sparse``: DDP with ``nn.EmbeddingBag(sparse=True)``: each table's COO gradient by gloo's sparse
  allreduce (an allgather of rows), the MLPs in DDP's buckets: torch's own sparse path;
- ``sparsync``: the same model and SGD, wrapped by ``sparsync.DistributedOptimizer`` (the two-line drop-in):
  the 26 row-sparse table gradients and the MLPs' dense ones in one grouped sparse allreduce;
- ``sparsync_dct``: DCT-DP (DCT §3.1) on the MLPs (``Compressed(Threshold(η, lifespan=L), ErrorFeedback(),
  bucket=True)``: the threshold reused for L steps, over all MLP gradients as one vector in one collective)
  and the row-sparse allreduce on the tables.

Two more on request (``--methods``), for S2's comparison (``sparsync reproduce``): the large tables (at least
``large_table_rows`` rows; the small ones stay on the row-sparse allreduce) by

- ``sparsync_omnireduce``: the OmniReduce-style block-sparse allreduce (``omnireduce.py``, exact);
- ``sparsync_sketch``: S2's sketch (``Compressed(SparseSketch(ratio=λ·α_t))``, lossy, no error feedback, as
  S2), α_t the largest share of table t's rows one rank's first batch touches (max over ranks, so every rank
  builds the same sketch), λ = ``sketch_lambda``.

and, beside them, torchrec (``torchrec_baseline``): ``torchrec_tw`` and ``torchrec_rw``, the tables in one
``EmbeddingBagCollection`` sharded table-wise or row-wise by ``DistributedModelParallel``, the MLPs by DDP, run in
torchrec's own environment (``scripts/torchrec_env.sh``); in the default set only where that environment exists
(``default_methods``), a row ``unavailable: <reason>`` where it cannot run.

And, for Parallax's Table 4 on DLRM, three parameter-server placements (``HybridTrainer``, one server per rank,
server-side SGD at the same lr, sync, mean): ``sparsync_ps`` (every variable on the servers, each dense one
whole on one server: Parallax's PS), ``sparsync_ps_split`` (dense variables split over all servers: OptPS) and
``sparsync_hybrid`` (tables on the servers, MLPs by allreduce: HYB). Their bytes per rank per step are the
collectives' bytes sent plus the rank's client traffic with the other ranks' servers (sent and received: by
symmetry what the rank's machine, client and colocated server together, sends on average).

And the tables' rows owned by the ranks (``dlrm_shard``, docs/sharding.md): ``sparsync_sharded`` (every table
sharded by ``sparsync.shard``, the MLPs by ``DistributedOptimizer`` as in ``sparsync``), ``sparsync_sharded_fused``
(the same with the tables' SGD fused into their backward: ``shard(optimizer=SGD(lr))``) and ``sparsync_auto``
(the tables the cost model's plan places ``sharded``, the rest as in ``sparsync``), and ``sparsync_sharded_bf16``
(``sparsync_sharded`` with the rows in bf16: lossy). Their bytes per step count
the shards' exchanges (the ``shard_lookup`` and ``shard_grad`` records), also reported alone
(``shard_bytes_per_step``), beside how many tables were sharded (``tables_sharded``).

And a floor beside them all, ``floor_tables_unsent``: DDP over the MLPs (torch's own allreduce, as torchrec's
dense layers), each rank's tables stepped on its own batch's gradient and never sent (``DistributedDataParallel``
told to ignore them), so the replicas' tables drift apart and its loss is no method's. Its step is what any
data-parallel system's step would take on this host if its tables cost nothing on the wire and nothing beyond a
local lookup and update; a step rate above it is out of reach for every placement.

Per method: median seconds per training step (forward, backward, aggregation, SGD) after ``warmup`` steps, the
slowest rank's; bytes sent per rank per step (sparsync's ``CommLog``; DDP's computed from what gloo sends,
``ddp_baseline.py``); the mean training loss over the last ``tail`` steps averaged over ranks, and its
relative difference to ``torch_ddp_sparse``'s (DDP and sparsync take the same SGD steps on the same means, so
only float rounding separates them; DCT's lossy MLP gradients may move it).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sparsync import trace_step
from sparsync.compress import ErrorFeedback, SparseSketch, Threshold
from sparsync.hybrid import HybridConfig, HybridTrainer
from sparsync.optim import DistributedOptimizer
from sparsync.placement import Compressed, CustomReduce, Placement
from sparsync.ps import OptimizerConfig
from sparsync.record import CommLog, CommRecord, workload_bytes
from sparsync.sharding import ShardedTable, dense_parameters
from sparsync_bench.criteo import CriteoBatch, read_criteo, table_rows, write_criteo
from sparsync_bench.ddp_baseline import WireBytes, gloo_sparse_allreduce_bytes, ring_allreduce_bytes
from sparsync_bench.dlrm import DLRM, MLPS, mlp_shapes
from sparsync_bench.dlrm_shard import DDP_METHODS, SHARD_METHODS, SHARD_OPS, batches, shard_tables, table_figures
from sparsync_bench.fmt import MISSING, markdown_table, mb, ms, times, unavailable_row
from sparsync_bench.hybrid import ps_remote_bytes
from sparsync_bench.omnireduce import block_allreduce
from sparsync_bench.op_profile import step_profiler
from sparsync_bench.tensorboard import summary_writer
from sparsync_bench.torchrec_baseline import TORCHREC_METHODS, train_torchrec, unavailable

METHODS = ("torch_ddp_dense", "torch_ddp_sparse", "sparsync", "sparsync_dct")
PS_METHODS = ("sparsync_ps", "sparsync_ps_split", "sparsync_hybrid")
LARGE_TABLE_METHODS = ("sparsync_omnireduce", "sparsync_sketch")
# sparsync_step: sparsync with every gradient reduced in step(), after backward (overlap=False), not during it
# floor_tables_unsent: a floor, not a way to train (module doc): DDP over the MLPs, the tables never sent
FLOOR = "floor_tables_unsent"
OPTIONAL = (*LARGE_TABLE_METHODS, *PS_METHODS, *TORCHREC_METHODS, "sparsync_step", *SHARD_METHODS, FLOOR)


@dataclass(frozen=True)
class DlrmBenchConfig:
    data: str  # a Criteo-format file (``sparsync_bench.criteo``)
    steps: int = 30  # training steps per method
    batch: int = 128  # samples per rank per step
    max_rows: int = 100_000  # rows per table at most (DLRM's --max-ind-range)
    dim: int = 16  # embedding width
    lr: float = 0.1
    warmup: int = 3  # steps left out of the timing
    tail: int = 10  # steps whose mean loss is reported
    dct_ratio: float = 0.01  # DCT-DP's η for sparsync_dct
    dct_lifespan: int = 10  # DCT-DP's L
    sketch_lambda: float = 2.0  # S2's λ for sparsync_sketch
    large_table_rows: int = 10_000  # tables the optional methods reduce their way
    mlp: str = "small"  # a key of MLPS
    methods: tuple[str, ...] = METHODS
    seed: int = 0
    tensorboard: str = ""  # a directory: rank 0 writes each step's CommLog scalars there (TensorBoard)

    def __post_init__(self) -> None:
        bad = [m for m in self.methods if m not in (*METHODS, *OPTIONAL)]
        if bad:
            raise KeyError(f"unknown methods {bad}; valid: {', '.join((*METHODS, *OPTIONAL))}")
        if self.mlp not in MLPS:
            raise KeyError(f"unknown mlp {self.mlp!r}; valid: {', '.join(MLPS)}")
        if self.steps <= self.warmup or self.steps < self.tail or min(self.batch, self.tail) < 1:
            raise ValueError(
                f"need steps > warmup, steps >= tail >= 1 and batch >= 1, got steps={self.steps}, "
                f"warmup={self.warmup}, tail={self.tail}, batch={self.batch}"
            )


def default_methods() -> tuple[tuple[str, ...], str | None]:
    """The methods ``bench dlrm`` runs unless told: ``METHODS``, and torchrec's where its environment exists;
    with a note saying why torchrec's are left out (None when they are in)."""
    why = unavailable()
    if why is None:
        return (*METHODS, *TORCHREC_METHODS), None
    return METHODS, f"torchrec rows left out: {why}"


def rank_samples(data: CriteoBatch, rank: int, P: int, cfg: DlrmBenchConfig) -> CriteoBatch:
    """Rank r's samples: consecutive global batches of P·batch, rank r taking its slice of each."""
    need = cfg.steps * cfg.batch * P
    if data.label.numel() < need:
        raise ValueError(f"{cfg.data} holds {data.label.numel()} samples; {cfg.steps} steps of {P} x "
                         f"{cfg.batch} need {need}")  # fmt: skip
    idx = torch.arange(need).reshape(cfg.steps, P, cfg.batch)[:, rank].reshape(-1)
    return CriteoBatch(data.dense[idx], data.sparse[idx], data.label[idx])


def step_batches(
    shard: CriteoBatch, cfg: DlrmBenchConfig
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """A rank's samples (``rank_samples``) cut into its ``cfg.steps`` batches: (dense, ids, label) each."""
    cut = [slice(s * cfg.batch, (s + 1) * cfg.batch) for s in range(cfg.steps)]
    return [(shard.dense[sl], shard.sparse[sl], shard.label[sl]) for sl in cut]


def bce(logits: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(logits, label)


def dlrm_model(cfg: DlrmBenchConfig, sparse: bool) -> DLRM:
    """Every method's model: ``cfg``'s tables and MLPs, from ``cfg.seed``."""
    torch.manual_seed(cfg.seed)
    bottom, top = MLPS[cfg.mlp]
    return DLRM(table_rows(cfg.max_rows), cfg.dim, bottom=(*bottom, cfg.dim), top=top, sparse=sparse)


def ddp_over_mlps(model: DLRM) -> DistributedDataParallel:
    """``model`` in DDP with its tables left out (``FLOOR``): each rank's own, never sent."""
    tables = [n for n, _ in model.named_parameters() if n.startswith("tables.")]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, tables)  # type: ignore[no-untyped-call]
    return DistributedDataParallel(model)


def _mlp_bytes(cfg: DlrmBenchConfig) -> int:
    """Bytes of the MLPs' parameters (fp32), from the model's description (``mlp_shapes``)."""
    return sum(4 * math.prod(shape) for _, shape in mlp_shapes(len(table_rows(cfg.max_rows)), cfg.dim, cfg.mlp))


def _ddp_bytes(model: DLRM, rows: list[list[int]], rank: int, sparse: bool) -> WireBytes:
    """What gloo sends for one DDP step: the dense parameters by ring allreduce (all of them without sparse
    gradients), each table's rows by its sparse allreduce (rows[t][i]: table t's rows on rank i)."""
    P = len(rows[0]) if rows else 1
    tables = {id(p) for t in model.tables for p in t.parameters()}
    dense = sum(p.numel() * p.element_size() for p in model.parameters() if sparse is False or id(p) not in tables)
    total = ring_allreduce_bytes(dense, P)
    if sparse:
        for t, per_rank in zip(model.tables, rows, strict=True):
            w = t.weight
            assert isinstance(w, torch.Tensor)
            total = total + gloo_sparse_allreduce_bytes(per_rank, w.shape[1] * w.element_size(), rank)
    return total


def _large_table_plan(
    method: str, model: DLRM, first: torch.Tensor, cfg: DlrmBenchConfig, log: CommLog
) -> dict[str, Placement]:
    """The plan of the optional methods (module doc): the large tables by OmniReduce or the sketch."""
    plan: dict[str, Placement] = {}
    for j, table in enumerate(model.tables):
        w = table.weight
        assert isinstance(w, torch.Tensor)
        if w.shape[0] < cfg.large_table_rows:
            continue
        name = f"tables.{j}.weight"
        if method == "sparsync_omnireduce":
            plan[name] = CustomReduce(lambda g, _n, group: block_allreduce(g, group=group, log=log))
            continue
        alpha = torch.tensor([torch.unique(first[:, j]).numel() / w.shape[0]], dtype=torch.float64)
        dist.all_reduce(alpha, op=dist.ReduceOp.MAX)
        plan[name] = Compressed(SparseSketch(ratio=cfg.sketch_lambda * float(alpha), seed=cfg.seed + j))
    return plan


def _hybrid_trainer(method: str, model: DLRM, cfg: DlrmBenchConfig, addresses: list[str], log: CommLog) -> Any:
    dense = [p for n, p in model.named_parameters() if not n.startswith("tables.")]
    hc = HybridConfig(mode="sync", sparse_reduce="mean", dense_reduce="mean",
                      optimizer=OptimizerConfig("sgd", lr=cfg.lr), ps_dense=method != "sparsync_hybrid",
                      dense_whole=method == "sparsync_ps", table_prefix=f"{method}/", timeout=300.0)  # fmt: skip
    return HybridTrainer(model, addresses, hc, dense_optimizer=torch.optim.SGD(dense, lr=cfg.lr), log=log)


@dataclass
class _Setup:
    """One method's training on this rank: the module its forward calls, its optimizer, the parameter-server
    trainer (``PS_METHODS``; else None) and the cost model's predictions (``SHARD_METHODS``; else empty)."""

    forward: nn.Module
    opt: torch.optim.Optimizer
    trainer: Any
    predicted: dict[str, float]


@dataclass
class _Steps:
    """What this rank's steps of one method measured: wall and CPU seconds, losses, and (torch's DDP) each
    step's distinct ids per table, the rows gloo's sparse allreduce sends (``_ddp_bytes``)."""

    times: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    rows: list[list[int]] = field(default_factory=list)


def _sparsync_optimizer(
    method: str, model: DLRM, opt: torch.optim.Optimizer, first: torch.Tensor, cfg: DlrmBenchConfig, log: CommLog
) -> DistributedOptimizer:
    """``opt`` wrapped by ``DistributedOptimizer`` with ``method``'s plan: DCT-DP on the MLPs (``sparsync_dct``),
    the large tables' reductions (``LARGE_TABLE_METHODS``) or the default; ``first``: the first batch's ids."""
    plan: dict[str, Placement] | None = None
    if method == "sparsync_dct":
        dct = Compressed(Threshold(cfg.dct_ratio, lifespan=cfg.dct_lifespan), ErrorFeedback(), bucket=True)
        plan = {n: dct for n, _ in model.named_parameters() if not n.startswith("tables.")}
    elif method in LARGE_TABLE_METHODS:
        plan = _large_table_plan(method, model, first, cfg, log)
    return DistributedOptimizer(opt, model, plan=plan, log=log, overlap=method != "sparsync_step")


def _set_up(
    method: str, cfg: DlrmBenchConfig, model: DLRM, shard: CriteoBatch, log: CommLog, addresses: list[str] | None
) -> _Setup:
    """``method``'s forward module, optimizer and parameter-server trainer around ``model`` (module doc)."""
    first = (shard.dense[: cfg.batch], shard.sparse[: cfg.batch])
    predicted: dict[str, float] = {}
    if method in SHARD_METHODS:  # before the optimizer: the shards replace the tables' parameters
        predicted = shard_tables(method, model, first, log, cfg.lr)
    # the tables sharded with SGD fused into backward (``*_fused``) take no part in the optimizer
    opt: torch.optim.Optimizer = torch.optim.SGD(dense_parameters(model), lr=cfg.lr)
    forward: nn.Module = model
    trainer: Any = None
    if method in PS_METHODS:
        if not addresses:
            raise ValueError(f"{method} needs parameter servers (run_dlrm_bench starts them)")
        trainer = _hybrid_trainer(method, model, cfg, addresses, log)
    elif method == FLOOR:
        forward = ddp_over_mlps(model)
    elif method.startswith("torch_ddp") or method in DDP_METHODS:
        forward = DistributedDataParallel(model)  # DDP_METHODS: the tables left out by sparsync.shard itself
    else:
        opt = _sparsync_optimizer(method, model, opt, first[1], cfg, log)
    return _Setup(forward, opt, trainer, predicted)


def _step(model: DLRM, setup: _Setup, dense: torch.Tensor, cats: torch.Tensor, label: torch.Tensor) -> float:
    """One training step of ``model`` by ``setup``'s method; returns this rank's loss."""
    if setup.trainer is not None:
        loss: float = setup.trainer.step(lambda: bce(model(dense, cats), label))
        return loss
    setup.opt.zero_grad()
    out = bce(setup.forward(dense, cats), label)
    out.backward()  # type: ignore[no-untyped-call]
    setup.opt.step()
    return out.item()


def _run_steps(
    method: str, cfg: DlrmBenchConfig, model: DLRM, shard: CriteoBatch, setup: _Setup, log: CommLog, rank: int
) -> _Steps:
    """``cfg.steps`` steps of ``method`` on this rank's samples, each timed from a barrier; rank 0 writes each
    step's ``log`` records to TensorBoard when ``cfg.tensorboard`` names a directory."""
    P = dist.get_world_size()
    writer = summary_writer(Path(cfg.tensorboard) / f"P{P}") if cfg.tensorboard and rank == 0 else None
    profile = step_profiler(method, rank, cfg.warmup, cfg.steps)
    source = batches(method, model, step_batches(shard, cfg))
    out = _Steps()
    for s in range(cfg.steps):
        before = len(log)
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        with trace_step(s):  # the step on SPARSYNC_TRACE's timeline
            dense, cats, label = next(source)  # a lookahead's ids round for the next batch starts here
            out.losses.append(_step(model, setup, dense, cats, label))
        out.times.append(time.perf_counter() - t0)
        out.cpu.append(time.process_time() - c0)
        if writer is not None:  # torch DDP's steps log nothing: their curves stay empty
            log.to_tensorboard(writer, s, since=before, prefix=f"sparsync/{method}")
            writer.add_scalar(f"step_seconds/{method}", out.times[-1], s)
        if method.startswith("torch_ddp"):
            out.rows.append([int(torch.unique(cats[:, j]).numel()) for j in range(cats.shape[1])])
        if profile is not None:
            profile.step()
    if profile is not None:
        profile.stop()
    if writer is not None:
        writer.close()
    return out


def _ddp_bytes_per_step(model: DLRM, rows: list[list[int]], rank: int, sparse: bool) -> float:
    """The mean over steps of what gloo sends for one DDP step, from every rank's ``rows`` (collective)."""
    P = dist.get_world_size()
    everyone: list[Any] = [None] * P
    dist.all_gather_object(everyone, rows)
    per_step = [
        _ddp_bytes(model, [[everyone[r][s][j] for r in range(P)] for j in range(len(rows[0]))], rank, sparse).sent
        for s in range(len(rows))
    ]
    return statistics.fmean(per_step)


def _bytes_per_step(
    method: str, cfg: DlrmBenchConfig, model: DLRM, steps: _Steps, records: list[CommRecord], rank: int
) -> float:
    """Bytes this rank sent per step (module doc); ``records``: the log's records of the steps."""
    if method.startswith("torch_ddp"):
        return _ddp_bytes_per_step(model, steps.rows, rank, method != "torch_ddp_dense")
    # the shards' exchanges (shard_lookup, shard_grad) are records of the log too
    logged = sum(workload_bytes(r) for r in records) / cfg.steps
    if method == FLOOR or method in DDP_METHODS:  # the MLPs by DDP's ring allreduce, beside what the log holds
        return ring_allreduce_bytes(_mlp_bytes(cfg), dist.get_world_size()).sent + logged
    return logged


def _close_servers(trainer: Any, model: DLRM) -> None:
    """Copies the servers' final tables into ``model`` (its local copy holds only the rows pulled, as of the last
    step's start), then closes ``trainer``."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in trainer.tables:
                table = trainer.tables[n]
                p.copy_(table.pull(torch.arange(table.rows), step=trainer.step_no).wait().reshape(p.shape))
    trainer.close()


def _model_figures(model: DLRM, tables0: list[torch.Tensor]) -> tuple[float, float]:
    """(Σ |w| over every parameter, the tables' ``moved``: ``table_figures``), in float64 (collective)."""
    # What the sparse path alone decides: one step moves a few hundred of the tables' 10^5 rows, so the loss
    # and the whole-model digest barely see a lost or misplaced table gradient (table_figures' "moved").
    tables_abs, moved = table_figures(model.tables, tables0)
    in_tables = {id(p) for p in model.tables.parameters()}
    digest = tables_abs + float(sum(p.detach().double().abs().sum() for p in model.parameters()
                                    if id(p) not in in_tables))  # fmt: skip
    return digest, moved


def _train(
    method: str, cfg: DlrmBenchConfig, shard: CriteoBatch, rank: int, P: int, addresses: list[str] | None = None
) -> dict[str, Any]:
    model = dlrm_model(cfg, sparse=method != "torch_ddp_dense")
    tables0 = [t.weight.detach().clone() for t in model.tables]  # type: ignore[operator]
    log = CommLog()
    setup = _set_up(method, cfg, model, shard, log, addresses)
    constructed = len(log)  # the steps' records from here: the broadcast at construction is no step's
    steps = _run_steps(method, cfg, model, shard, setup, log, rank)
    t = torch.tensor([statistics.median(steps.times[cfg.warmup :])], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    cpu_s = _mean_over_ranks(statistics.median(steps.cpu[cfg.warmup :]))
    tail = torch.tensor([statistics.fmean(steps.losses[-cfg.tail :])], dtype=torch.float64)
    dist.all_reduce(tail)
    records = log.records[constructed:]
    nbytes = _bytes_per_step(method, cfg, model, steps, records, rank)
    shard_bytes = sum(r.bytes_sent for r in records if r.op in SHARD_OPS) / cfg.steps
    if setup.trainer is not None:
        nbytes += ps_remote_bytes(setup.trainer, rank) / cfg.steps
        _close_servers(setup.trainer, model)
    digest, moved = _model_figures(model, tables0)
    sharded = sum(isinstance(t, ShardedTable) for t in model.tables)
    return {"method": method, "step_s": float(t), "cpu_s": cpu_s, "bytes_per_step": nbytes,
            "loss": float(tail) / P, "first_loss": steps.losses[0], "param_abs_sum": digest, "tables_moved": moved,
            "shard_bytes_per_step": shard_bytes, "tables_sharded": sharded, **setup.predicted}  # fmt: skip


def _mean_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def worker(
    rank: int, cfg: DlrmBenchConfig, data: CriteoBatch, addresses: list[str] | None = None
) -> list[dict[str, Any]]:
    P = dist.get_world_size()
    shard = rank_samples(data, rank, P, cfg)
    mlp_sent = ring_allreduce_bytes(_mlp_bytes(cfg), P).sent
    out = []
    for m in cfg.methods:
        if m in TORCHREC_METHODS:
            row = train_torchrec(m, cfg, shard, rank, P)
        else:
            row = _train(m, cfg, shard, rank, P, addresses)
        row["world_size"] = P
        if row.get("bytes_per_step") is not None:  # the MLPs' part, which every method sends the same way
            row["dense_bytes_per_step"] = mlp_sent
            row["table_bytes_per_step"] = row["bytes_per_step"] - row["dense_bytes_per_step"]
        out.append(row)
        if rank == 0 and row.get("unavailable"):
            print(f"  {m}: unavailable: {row['unavailable']}", flush=True)
        elif rank == 0:
            print(f"  {m}: {row['step_s'] * 1e3:.1f} ms/step, {row['bytes_per_step'] / 1e6:.2f} MB/step, "
                  f"loss {row['loss']:.5f}", flush=True)  # fmt: skip
    return out


def load(cfg: DlrmBenchConfig, P: int) -> CriteoBatch:
    return read_criteo(cfg.data, max_rows=cfg.max_rows, limit=cfg.steps * cfg.batch * P)


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adds, per world size, each method's speedup over torch_ddp_sparse and its loss difference to it."""
    for P in sorted({r["world_size"] for r in rows}):
        mine = [r for r in rows if r["world_size"] == P]
        base = next((r for r in mine if r["method"] == "torch_ddp_sparse"), None)
        for r in mine:
            if base is not None and r.get("step_s") is not None:
                r["speedup_vs_ddp_sparse"] = base["step_s"] / r["step_s"]
                r["loss_rel_diff"] = abs(r["loss"] - base["loss"]) / base["loss"]
    return rows


_COLUMNS = ("P", "method", "ms/step", "CPU ms/step", "MB sent/rank/step", "of which MLPs", "of which tables",
            "loss (last steps)", "vs DDP sparse: speed", "loss diff")  # fmt: skip


def _markdown_row(r: dict[str, Any]) -> list[str]:
    if r.get("unavailable"):
        return unavailable_row([r["world_size"], r["method"]], r["unavailable"], len(_COLUMNS))
    ld = r.get("loss_rel_diff")
    # "-" for a split a row does not carry (a row of before the MLP/table columns, a test's)
    mbs = [mb(r.get(k), ".2f") for k in ("bytes_per_step", "dense_bytes_per_step", "table_bytes_per_step")]
    speed = times(r.get("speedup_vs_ddp_sparse"))
    cpu = MISSING if r.get("cpu_s") is None else ms(r["cpu_s"], ".1f")
    return [str(r["world_size"]), r["method"], ms(r["step_s"], ".1f"), cpu, *mbs, f"{r['loss']:.5f}", speed,
            MISSING if ld is None else f"{ld:.2%}"]  # fmt: skip


def markdown(rows: list[dict[str, Any]], cfg: DlrmBenchConfig, where: str) -> str:
    title = (
        f"### DLRM, {where}, {cfg.batch} samples per rank per step, {cfg.steps} steps, tables capped at "
        f"{cfg.max_rows:,} rows, dim {cfg.dim}"
    )
    return "\n".join([title, "", *markdown_table(_COLUMNS, map(_markdown_row, rows))]) + "\n"


def config_dict(cfg: DlrmBenchConfig) -> dict[str, Any]:
    return asdict(cfg)


def default_data(path: Path, samples: int) -> Path:
    """A generated Criteo-format file at ``path`` (written once; reused when it already holds enough lines)."""
    if path.exists():
        with path.open() as f:
            if sum(1 for _ in f) >= samples:
                return path
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_criteo(path, samples)
