"""``sparsync demo``'s automatic plan: α of the embedding measured over warm-up steps, the link and the
parameter servers measured on the demo's own processes (``sparsync.measure_link``, ``sparsync.ps.measure_server``:
every rank at once, as training runs), the Parallax placement plan (``sparsync.plan.make_plan``) priced with
them, and training with that plan; if the plan puts the embedding on the parameter server, the hybrid
(Parallax §3.1: dense parameters by dense allreduce, the embedding on one colocated server per process, sync
mode) through ``HybridTrainer``.

Each run's predicted step (``predicted_steps``) is its local work, measured on the warm-up batches with every
process at once (``measure_compute``: the forward and backward pass, and for the dense run the densified
embedding gradient, the flat bucket and SGD's dense update of the whole table), plus the plan's communication
priced as that run sends it: ``wrap_optimizer``'s agreement on which parameters have gradients (one tiny
allreduce), then every gradient in one fused dense allreduce, or its grouped call (``Plan.grouped_seconds``);
the hybrid's servers and fused dense allreduce (``Plan.fused_seconds``). DDP's run is torch's own path, which
the plan does not price.
``predicted_split`` splits each priced run's communication into its latency (the same plan priced with infinite
bandwidth) and its bandwidth part, for the demo's lines on why a plan won or lost.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Generator, Mapping
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from sparsync.collectives.calibrate import measure_link
from sparsync.hybrid import HybridConfig, HybridTrainer
from sparsync.plan.cluster import Cluster, ServerModel
from sparsync.plan.detect import ParamStats, RowFractionMeter
from sparsync.plan.planner import Plan, make_plan
from sparsync.ps import PSClient, measure_server
from sparsync.ps.optim import OptimizerConfig
from sparsync.record import CommLog, workload_bytes

AUTO = "auto plan"
DDP_PLAN = "DDP (sparse grads)"
# run ids (the summaries' "run" key): dense allreduce, DDP with sparse gradients, sparsync plan, automatic plan
RUNS = ("dense", "ddp_sparse", "sparse", "auto")
PLACEMENT_WORDS = {"ps": "parameter server", "dense_allreduce": "dense allreduce",
                   "sparse_allreduce": "sparse allreduce", "sketch": "sketch"}  # fmt: skip
ASSUMED_BANDWIDTH, ASSUMED_LATENCY = 1.25e8, 50e-6  # plan_pricing="assumed": 1 Gbit/s, 50 µs per message


def measure_compute(ctx: Any, model: torch.nn.Module, batches: list[Any]) -> tuple[float, float]:
    """Local seconds per step without communication, on every replica at once (they share the machine's cores,
    as in training), the slowest replica's median over ``batches``: (a forward and backward pass, what the
    dense run adds: ``DenseAllreduce``'s densified embedding gradient and flat bucket, and SGD's update of every
    row by the dense gradient, into a scratch copy). Leaves the model as it was, with no gradient."""
    params = [p for p in model.parameters() if p.requires_grad]
    scratch = {p: torch.zeros_like(p) for p in params}
    backward, dense = [], []
    # The first batch twice, its first pass untimed: the buffers' first touch (8.4 MB each for the demo's
    # densified table) is not what a training step pays once the allocator reuses them.
    for i, (tok, y) in enumerate([batches[0], *batches]):
        t0 = time.perf_counter()
        _loss(model, tok, y).backward()  # type: ignore[no-untyped-call]
        t1 = time.perf_counter()
        with_grad = [p for p in params if p.grad is not None]
        grads = [p.grad for p in with_grad if p.grad is not None]
        flat = torch.cat([(g.to_dense() if g.is_sparse else g).reshape(-1) for g in grads])
        pieces = torch.split(flat, [g.numel() for g in grads])
        with torch.no_grad():
            for p, piece in zip(with_grad, pieces, strict=True):
                torch.add(p, piece.view(p.shape), alpha=-1.0, out=scratch[p])
        if i:
            backward.append(t1 - t0)
            dense.append(time.perf_counter() - t1)
        model.zero_grad(set_to_none=True)
    med = torch.tensor([statistics.median(backward), statistics.median(dense)], dtype=torch.float64)
    worst = ctx.all_reduce(med, "max")
    return float(worst[0]), float(worst[1])


def auto_same_as(plan: Plan) -> str | None:
    """The run whose placements the automatic plan's equal ("sparse" or "dense": ``RUNS``; dense
    layers always go dense), or None when it puts a parameter on the servers (the hybrid, a run of its own)."""
    kinds = {e.placement for e in plan.entries}
    if "ps" in kinds:
        return None
    return "sparse" if "sparse_allreduce" in kinds else "dense"


def run_compute(backward: float, dense_extra: float, plan: Plan) -> dict[str, float]:
    """Each run's local seconds per step (``measure_compute``'s two parts) by run id (``RUNS``): the
    dense run adds ``dense_extra``; the automatic plan's is that of the run it equals (the hybrid's: the forward
    and backward pass, its servers update the embedding)."""
    out = {"dense": backward + dense_extra, "ddp_sparse": backward, "sparse": backward}
    same = auto_same_as(plan)
    return {**out, "auto": backward if same is None else out[same]}


def predicted_steps(plan: Plan, compute: Mapping[str, float]) -> dict[str, float]:
    """Predicted step seconds of the demo's runs ("dense", "sparse", "auto": ``RUNS``): each run's
    local ``compute`` (``run_compute``) plus the communication of ``plan``'s parameters as it sends them (module
    doc)."""
    return {k: compute[k] + v for k, v in _communication(plan).items()}


def predicted_split(plan: Plan) -> dict[str, tuple[float, float]]:
    """(latency, bandwidth) seconds of each priced run's communication (``predicted_steps`` less the compute).
    Latency: the same placements priced on the same link with infinite bandwidth (β = 0, the servers' seconds
    per byte 0): the α terms, the measured fixed costs and the γ terms of merging, the servers' round trips.
    Bandwidth: the rest. Where ``auto`` would pick another SparCML algorithm at β = 0 (``choose_robust``), the
    latency is that algorithm's, not the one the run sends with."""
    full, latency = _communication(plan), _communication(_infinite_bandwidth(plan))
    return {k: (latency[k], full[k] - latency[k]) for k in full}


def _infinite_bandwidth(plan: Plan) -> Plan:
    """``plan``'s placements repriced with β = 0 on its (one-level) cluster's link and servers."""
    c = plan.cluster
    server = dataclasses.replace(c.server, per_byte=0.0) if c.server is not None else None
    link = dataclasses.replace(c.link, beta=0.0, beta_exchange=None)  # None: the exchange phases' β is β's
    cluster = dataclasses.replace(c, measured=link, server=server)
    sparse = {e.name: "sparse_allreduce" in e.candidates or "ps" in e.candidates for e in plan.entries}
    stats = [ParamStats(e.name, e.shape, e.row_fraction, sparse[e.name], e.row_fraction_machine)
             for e in plan.entries]  # fmt: skip
    return make_plan(stats, cluster, overrides=plan.kinds, sketch=plan.sketch)


def _communication(plan: Plan) -> dict[str, float]:
    """Communication seconds per step of each priced run, as it sends ``plan``'s parameters (module doc)."""

    def placed(kind: str) -> Plan:
        entries = tuple(
            dataclasses.replace(e, placement=kind if kind in e.candidates else "dense_allreduce")
            for e in plan.entries
        )
        return dataclasses.replace(plan, entries=entries)

    # wrap_optimizer's step first agrees which parameters have gradients (``fill_missing_grads``: gloo's ring
    # allreduce of one int32 per parameter, 2(P-1) latency steps); HybridTrainer's does not.
    N = plan.cluster.machines
    agree = 2 * (N - 1) * plan.cluster.link.alpha
    out = {
        "dense": agree + placed("dense_allreduce").fused_seconds,
        "sparse": agree + placed("sparse_allreduce").grouped_seconds,
    }
    same = auto_same_as(plan)
    out["auto"] = plan.fused_seconds if same is None else out[same]
    return out


def measure_plan(ctx: Any, cfg: Any, model: torch.nn.Module, batches: list[Any], addresses: list[str]) -> Plan:
    """α of each sparse parameter over ``batches`` (forward passes only: α depends on the input alone),
    averaged over the replicas, and the plan for ``cfg.replicas`` machines priced with the measured link and
    the measured servers at ``addresses`` (module doc)."""
    meter = RowFractionMeter(model)
    with torch.no_grad():
        for tok, _ in batches:
            model(tok)
            meter.end_step()
    meter.close()
    stats = meter.stats()
    for s in stats:
        if s.sparse:
            s.row_fraction = float(ctx.all_mean(torch.tensor([s.row_fraction], dtype=torch.float64))[0])
            s.row_fraction_machine = s.row_fraction  # one process per machine
    if cfg.plan_pricing == "assumed":
        return make_plan(stats, Cluster(cfg.replicas, bandwidth=ASSUMED_BANDWIDTH, latency=ASSUMED_LATENCY))
    link = measure_link()
    server = None
    sparse = [s for s in stats if s.sparse]
    if sparse and addresses:  # the largest sparse table's rows per step, pulled from the demo's own servers
        big = max(sparse, key=lambda s: s.nbytes)
        rows, dim = big.shape[0], big.numel // big.shape[0]
        with PSClient(addresses, sender=ctx.replica_id) as client:
            times = measure_server(client, rows=max(1, round(big.row_fraction * rows)), dim=dim)
        server = ServerModel(times.round_trip, times.per_byte)
    return make_plan(stats, Cluster(cfg.replicas, measured=link, server=server))


def train_hybrid(
    ctx: Any, cfg: Any, model: torch.nn.Module, plan: Plan, addresses: list[str], batches: Any, progress: Any
) -> Generator[None, None, dict[str, Any]]:
    """Train with ``plan``'s parameter-server parameters on the servers at ``addresses`` (plain SGD, mean
    over the replicas: the same updates as the allreduce runs). A generator, as ``train_demo._train``: it yields
    once set up (the servers' tables made: collective), then after each step, and returns the same summary."""
    sparse = [e.name for e in plan.entries if e.placement == "ps"]
    dense = [p for n, p in model.named_parameters() if n not in sparse]
    hc = HybridConfig(mode="sync", sparse_reduce="mean", dense_reduce="mean", local_aggregation=True,
                      optimizer=OptimizerConfig("sgd", lr=cfg.lr), timeout=120.0)  # fmt: skip
    log = CommLog()
    trainer = HybridTrainer(model, addresses, hc, dense_optimizer=torch.optim.SGD(dense, lr=cfg.lr), log=log,
                            sparse_params=sparse)  # fmt: skip
    me = ctx.replica_id
    times, nbytes, losses = [], [], []
    task = progress.add_task(f"{AUTO} (hybrid)", total=cfg.steps) if progress is not None else None
    try:
        yield
        for tok, y in batches:
            before, ps0 = len(log), _remote_bytes(trainer, me)
            t0 = time.perf_counter()
            loss = trainer.step(partial(_loss, model, tok, y))
            times.append(time.perf_counter() - t0)
            # bytes this process's machine sends: its allreduce bytes, plus its client's traffic with the
            # remote servers (requests out; the replies it gets equal, by symmetry, those its server sends)
            sent = sum(workload_bytes(r) for r in log.records[before:])
            nbytes.append(sent + _remote_bytes(trainer, me) - ps0)
            losses.append(loss)
            if progress is not None:
                progress.advance(task)
            yield
        params = {k: v.detach().clone() for k, v in model.state_dict().items()}
        for n in sparse:  # the sparse parameters live on the servers
            t = trainer.tables[n]
            params[n] = t.pull(torch.arange(t.rows), step=trainer.step_no).wait().reshape(params[n].shape)
    finally:
        trainer.close()
    mean_losses = ctx.all_mean(torch.tensor(losses)).tolist()
    worst = ctx.all_reduce(torch.tensor(times), "max").tolist()
    # Averaged over the processes: the PS traffic is not symmetric (a server holding hot rows sends more).
    nbytes = ctx.all_mean(torch.tensor(nbytes, dtype=torch.float64)).tolist()
    return {
        "plan": f"{AUTO}: hybrid (PS for {', '.join(sparse)})",
        "step_ms": 1e3 * statistics.median(worst[cfg.warmup :]),
        "steps_ms": [1e3 * w for w in worst],
        "bytes_per_step": statistics.mean(nbytes[cfg.warmup :]),
        "first_loss": mean_losses[0],
        "final_loss": statistics.mean(mean_losses[-10:]),
        "algorithms": ["dense" if not log.records else sorted({r.algorithm for r in log.records})[0], "ps"],
        "params": params if me == 0 else None,
    }


def _loss(model: torch.nn.Module, tok: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tok), y)


def _remote_bytes(trainer: HybridTrainer, rank: int) -> int:
    per = trainer.client.bytes_per_server
    return sum(per) - per[rank % len(per)]  # server i is colocated with process i
