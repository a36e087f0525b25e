"""``sparsync demo``: real training with the Replicator API, plain dense allreduce vs sparsync's plans.

A bag-of-tokens classifier with a sparse embedding (``nn.Embedding(sparse=True)``, vocab 65,536) on synthetic
Zipf-distributed tokens, trained on 4 local processes from the same seed and data several ways: every gradient
averaged by a dense allreduce (the embedding's gradient densified, as Horovod and DDP do), and
``wrap_optimizer``'s default plan (the embedding's COO gradient by SparCML's sparse allreduce, chosen by the
α-β model; the dense layers in one bucketed allreduce). Both use plain SGD, so they compute the same updates
and end at the same loss; what differs is the bytes on the wire and the step time.

Beside them, the baseline a PyTorch user would pick: the same model, data and SGD under torch's
``DistributedDataParallel`` on gloo, the embedding's COO gradient reduced by gloo's sparse allreduce (an
allgather of every rank's rows), no sparsync involved; its bytes come from ``ddp_baseline``.

And the automatic plan: α of the embedding measured over the warm-up steps' inputs, Parallax's placement plan
for the demo's cluster priced with the link and the parameter servers measured on the demo's own processes,
and training with that plan (the hybrid, on one colocated server per process, when the plan puts the
embedding on the servers; else the allreduce run it equals). Its measurements come first.

The runs are interleaved: each trainer is a generator that yields after each step, keeping its own model,
optimizer, data and step count, and ``interleave`` lets them take turns, the warm-up steps first, then blocks
of ``DemoConfig.block`` steps (dense, DDP, sparsync, hybrid, dense, ...), the same turns on every replica so
that their collectives line up. Host drift during the run then reaches every plan alike within a block, and
each plan's step time is compared block by block (``demo_report``): a ratio with its spread, and why a plan
won or lost.
"""

from __future__ import annotations

import json
import statistics
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from rich.table import Table
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import sparsync
from sparsync.plan.planner import Plan
from sparsync.record import AGREE, workload_bytes
from sparsync.replicator import PER_REPLICA, DenseAllreduce, ReplicaContext, Replicator
from sparsync_bench import demo_report as dr
from sparsync_bench.ddp_baseline import ddp_step_bytes
from sparsync_bench.demo_plan import (
    AUTO,
    DDP_PLAN,
    PLACEMENT_WORDS,
    RUNS,
    auto_same_as,
    measure_compute,
    measure_plan,
    run_compute,
    train_hybrid,
)
from sparsync_bench.demo_report import block_medians, block_sizes
from sparsync_bench.fmt import markdown_table, mb
from sparsync_bench.interleave import Trainer, interleave
from sparsync_bench.netem import net_spec
from sparsync_bench.progress import display
from sparsync_bench.report import print_plan
from sparsync_bench.runner import ranks
from sparsync_bench.tables import show_table
from sparsync_bench.tensorboard import summary_writer

PLANS = ("dense allreduce", "sparsync plan")


@dataclass(frozen=True)
class DemoConfig:
    vocab: int = 65536  # embedding rows (>= 50k)
    dim: int = 32  # embedding width
    tokens: int = 16  # tokens per sample
    classes: int = 16
    batch: int = 64  # per replica
    steps: int = 150
    warmup: int = 5  # steps left out of the step-time median (the first auto call measures the link)
    zipf: float = 1.1  # token frequency ∝ 1 / rank^zipf
    lr: float = 1.0  # higher rates make the two runs drift apart by float summation order (chaotic updates)
    replicas: int = 4
    seed: int = 0
    # the automatic plan's prices: "measured" (the demo's link and servers) or "assumed" (a nominal 1 Gbit/s,
    # 50 µs link, the servers priced by it: deterministic, so the tests of the hybrid run use it)
    plan_pricing: str = "measured"
    block: int = 10  # steps each run trains in its turn before the next run's (the runs are interleaved)

    def __post_init__(self) -> None:
        if self.steps <= self.warmup:
            raise ValueError(
                f"steps must exceed the {self.warmup} warm-up steps (they are left out of the timing), got "
                f"{self.steps}"
            )
        if self.vocab < 2 or self.replicas < 1 or self.batch < 1:
            raise ValueError(f"bad demo config {self}: vocab must be >= 2, replicas and batch >= 1")
        if self.block < 1:
            raise ValueError(f"block must be >= 1 step (the runs take turns block by block), got {self.block}")
        if self.plan_pricing not in ("measured", "assumed"):
            raise ValueError(f"plan_pricing must be 'measured' or 'assumed', got {self.plan_pricing!r}")


class BagClassifier(nn.Module):
    def __init__(self, cfg: DemoConfig) -> None:
        super().__init__()
        self.emb = nn.Embedding(cfg.vocab, cfg.dim, sparse=True)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 64), nn.ReLU(), nn.Linear(64, cfg.classes))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mlp(self.emb(tokens).mean(1))
        return out


def _teacher(cfg: DemoConfig) -> torch.Tensor:
    """A fixed random vote table: a sample's label is the class with the most votes from its tokens."""
    return torch.randn(cfg.vocab, cfg.classes, generator=torch.Generator().manual_seed(cfg.seed + 1))


def _input_fn(cfg: DemoConfig) -> Any:
    probs = 1.0 / torch.arange(1, cfg.vocab + 1, dtype=torch.float64) ** cfg.zipf
    teacher = _teacher(cfg)

    def fn(replica_id: int) -> Any:
        g = torch.Generator().manual_seed(cfg.seed * 1000 + replica_id)
        for _ in range(cfg.steps):
            tok = torch.multinomial(probs, cfg.batch * cfg.tokens, replacement=True, generator=g)
            tok = tok.view(cfg.batch, cfg.tokens)
            yield tok, teacher[tok].sum(1).argmax(1)

    return fn


def _train(ctx: ReplicaContext, cfg: DemoConfig, plan: str, progress: Any, writer: Any = None) -> Trainer:
    """One of sparsync's plans, as a ``Trainer``; ``writer``: rank 0's TensorBoard writer (each step's CommLog
    scalars). The replicator's CommLog is shared with the other runs: only this run's steps' records count."""
    torch.manual_seed(cfg.seed)
    model = BagClassifier(cfg)
    default = DenseAllreduce() if plan == PLANS[0] else None
    sgd = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    opt = ctx.wrap_optimizer(sgd, op="mean", model=model, default=default)
    log = ctx.log
    assert log is not None  # the demo's replicator records

    def step_fn(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tok, y = batch
        opt.zero_grad()
        loss = F.cross_entropy(model(tok), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        return loss

    times, nbytes, losses, chosen = [], [], [], set[str]()
    task = progress.add_task(plan, total=cfg.steps) if progress is not None else None
    offset = PLANS.index(plan) * cfg.steps  # steps numbered across the runs on one timeline
    yield
    for i, batch in enumerate(ctx.input(_input_fn(cfg), PER_REPLICA)):
        before = len(log)
        t0 = time.perf_counter()
        # the warm-up steps (the first auto call measures the link) are left out of the timing and the timeline's
        # steps alike
        with sparsync.trace_step(offset + i) if i >= cfg.warmup else nullcontext():
            step_fn_loss = ctx.run(step_fn, batch)
        times.append(time.perf_counter() - t0)
        nbytes.append(sum(workload_bytes(r) for r in log.records[before:]))
        # the reductions' algorithms
        chosen.update(r.algorithm for r in log.records[before:] if r.op != AGREE)
        if writer is not None:
            log.to_tensorboard(writer, offset + i, since=before, prefix=f"sparsync/{plan}")
            writer.add_scalar(f"step_seconds/{plan}", times[-1], offset + i)
        losses.append(step_fn_loss)
        if progress is not None:
            progress.advance(task)
        yield
    # Losses reduced once at the end, outside the timed steps.
    mean_losses = ctx.all_mean(torch.stack(losses)).tolist()
    worst = ctx.all_reduce(torch.tensor(times), "max").tolist()  # a step ends when its slowest replica does
    return {
        "run": RUNS[0] if plan == PLANS[0] else RUNS[2],
        "plan": plan,
        "step_ms": 1e3 * statistics.median(worst[cfg.warmup :]),
        "steps_ms": [1e3 * w for w in worst],
        "bytes_per_step": statistics.mean(nbytes[cfg.warmup :]),
        "first_loss": mean_losses[0],
        "final_loss": statistics.mean(mean_losses[-10:]),
        "algorithms": sorted(chosen),
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()} if ctx.replica_id == 0 else None,
    }


def _train_ddp(ctx: ReplicaContext, cfg: DemoConfig, progress: Any) -> Trainer:
    """torch's own path, as a ``Trainer``: ``DistributedDataParallel`` on the replicas' group (gloo), same init,
    data and SGD as ``_train``. DDP divides each gradient by P before summing, so it averages as ``op="mean"``
    does; the embedding's gradient is reduced in its own bucket by gloo's sparse allreduce, the MLP's in a dense
    bucket. Its autograd hooks sit on its own model, so the runs between its steps do not trigger them."""
    torch.manual_seed(cfg.seed)
    model = BagClassifier(cfg)
    ddp = DistributedDataParallel(model, process_group=ctx.dp_group)  # broadcasts rank 0's parameters
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    times, rows, losses = [], [], []
    task = progress.add_task(DDP_PLAN, total=cfg.steps) if progress is not None else None
    yield
    for tok, y in ctx.input(_input_fn(cfg), PER_REPLICA):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(ddp(tok), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        times.append(time.perf_counter() - t0)
        rows.append(int(torch.unique(tok).numel()))  # the rows of the coalesced embedding gradient gloo sends
        losses.append(loss.detach())
        if progress is not None:
            progress.advance(task)
        yield
    del ddp  # its autograd hooks stay on the parameters otherwise
    mean_losses = ctx.all_mean(torch.stack(losses)).tolist()
    worst = ctx.all_reduce(torch.tensor(times), "max").tolist()
    every = ctx.all_gather(torch.tensor(rows))  # [replicas, steps]
    nbytes = [ddp_step_bytes(model, every[:, i].tolist(), ctx.replica_id).sent for i in range(len(rows))]
    return {
        "run": RUNS[1],
        "plan": DDP_PLAN,
        "step_ms": 1e3 * statistics.median(worst[cfg.warmup :]),
        "steps_ms": [1e3 * w for w in worst],
        "bytes_per_step": statistics.mean(nbytes[cfg.warmup :]),
        "first_loss": mean_losses[0],
        "final_loss": statistics.mean(mean_losses[-10:]),
        "algorithms": ["gloo", "gloo sparse"],
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()} if ctx.replica_id == 0 else None,
    }


def demo_program(
    ctx: ReplicaContext,
    cfg: DemoConfig,
    show_progress: bool,
    addresses: list[str],
    trace_dir: str = "",
    tensorboard: str = "",
) -> tuple[list[dict[str, Any]], Plan] | None:
    """The runs on one replica. ``trace_dir``: every rank's timeline there (``sparsync.trace``);
    ``tensorboard``: rank 0's per-step scalars there."""
    with sparsync.trace(trace_dir) if trace_dir else nullcontext():
        writer = summary_writer(tensorboard) if tensorboard and ctx.replica_id == 0 else None
        try:
            return _demo_runs(ctx, cfg, show_progress, addresses, writer)
        finally:
            if writer is not None:
                writer.close()


def _demo_runs(
    ctx: ReplicaContext, cfg: DemoConfig, show_progress: bool, addresses: list[str], writer: Any
) -> tuple[list[dict[str, Any]], Plan] | None:
    """The automatic plan's measurements, then every run interleaved (module doc); rank 0's summaries, each
    with its timed blocks' medians (``block_ms``) and its turns' places in the order (``turns``), and the plan."""
    torch.set_num_threads(1)
    progress = None
    if show_progress and ctx.replica_id == 0:
        progress = display()  # a bar on a terminal, progress lines on a pipe or in a log
        progress.start()
    try:
        measured: dict[str, Any] = {}

        def automatic() -> dict[str, Trainer]:
            """After the warm-up turn (every run's threads and connections up, as in training), the plan priced
            with what it measures, and the hybrid joins when the plan puts a parameter on the servers."""
            torch.manual_seed(cfg.seed)
            model = BagClassifier(cfg)  # the automatic plan's, trained by the hybrid when the plan has one
            batches = list(_input_fn(cfg)(ctx.replica_id))
            measured["plan"] = plan = measure_plan(ctx, cfg, model, batches[: cfg.warmup], addresses)
            measured["compute"] = measure_compute(ctx, model, batches[: cfg.warmup])
            if auto_same_as(plan) is None:
                return {RUNS[3]: train_hybrid(ctx, cfg, model, plan, addresses, batches, progress)}
            return {}

        trainers = {RUNS[0]: _train(ctx, cfg, PLANS[0], progress, writer), RUNS[1]: _train_ddp(ctx, cfg, progress),
                    RUNS[2]: _train(ctx, cfg, PLANS[1], progress, writer)}  # fmt: skip
        sizes = block_sizes(cfg.steps, cfg.warmup, cfg.block)
        runs, order = interleave(trainers, ([cfg.warmup] if cfg.warmup else []) + sizes, automatic)
        plan = measured["plan"]
        backward, dense_extra = measured["compute"]
        compute = run_compute(backward, dense_extra, plan)
    finally:
        if progress is not None:
            progress.stop()
    if ctx.replica_id != 0:
        return None
    runs = {run: {"run": run, **r, "block_ms": block_medians(r["steps_ms"], cfg.warmup, sizes),
                  "turns": [t for t, o in enumerate(order) if o == run]} for run, r in runs.items()}  # fmt: skip
    same = auto_same_as(plan)
    auto = runs[RUNS[3]] if same is None else _same_run(same, runs)
    out = [runs[RUNS[0]], runs[RUNS[1]], runs[RUNS[2]], dict(auto)]
    return [{**r, "compute_ms": 1e3 * compute[r["run"]]} for r in out], plan


def _same_run(same_as: str, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The automatic plan's summary when it puts no parameter on the servers: the allreduce run it equals
    (``demo_plan.auto_same_as``), under its own name, with ``same_as`` naming that run and no turns."""
    same = runs[same_as]
    return {**same, "run": RUNS[3], "plan": f"{AUTO}: same as {same['plan']}", "same_as": same_as, "turns": []}


def run_demo(
    cfg: DemoConfig,
    *,
    show_progress: bool = True,
    net: str | None = None,
    trace_dir: str = "",
    tensorboard: str = "",
) -> tuple[list[dict[str, Any]], float, Plan]:
    """The four runs (dense allreduce, DDP with sparse gradients, sparsync's default plan, the automatic plan,
    keyed "run" = ``RUNS``) on ``cfg.replicas``
    local processes, with one parameter server per process (each process and its server in a namespace
    with ``net``-shaped links when given, e.g. "1gbit"); returns their summaries, the largest parameter
    difference between any run's final model and the dense run's, and the automatic plan. ``trace_dir``: each
    rank's timeline (``sparsync trace merge`` draws it); ``tensorboard``: per-step scalars of sparsync's plans."""
    repl = Replicator(num_replicas=cfg.replicas, record=True)
    with ranks(cfg.replicas, net_spec(net), servers=True) as where:
        runs, plan = repl.start(
            demo_program, cfg, show_progress, where.servers, trace_dir, tensorboard, setup=where.setup
        )[0]
    ref = runs[0]["params"]
    for r in runs:
        p = r.pop("params")
        r["max_param_diff"] = max(float((ref[k] - p[k]).abs().max()) for k in ref)
    return runs, max(r["max_param_diff"] for r in runs), plan


def config_dict(cfg: DemoConfig) -> dict[str, Any]:
    return asdict(cfg)


def plan_summary(plan: Plan) -> str:
    """One line naming each parameter's placement, e.g. 'plan chose: parameter server for emb.weight (hybrid);
    dense allreduce for mlp.0.weight, ...'."""
    by: dict[str, list[str]] = {}
    for e in plan.entries:
        by.setdefault(e.placement, []).append(e.name)
    kind = "hybrid" if "ps" in by and len(by) > 1 else ("parameter server" if "ps" in by else "allreduce")
    parts = [f"{PLACEMENT_WORDS[pl]} for {', '.join(names)}" for pl, names in by.items()]
    return f"plan chose: {'; '.join(parts)} ({kind})"


def _plan_lines(plan: Plan, cfg: DemoConfig, console: Any) -> list[str]:
    """Prints ``plan``'s table (titled with the link and servers it priced) and returns the lines saying what it
    chose and why."""
    c = plan.cluster
    m, sv = c.measured, c.server
    link = f"link measured: α {m.alpha * 1e6:.0f} µs, {1 / m.beta / 1e6:.0f} MB/s" if m else "an assumed link"
    if sv is not None:
        rate = "per byte below the probe's resolution" if sv.per_byte == 0 else f"{1e-6 / sv.per_byte:.0f} MB/s"
        link += f"; servers measured: {sv.round_trip * 1e3:.2f} ms a round trip, {rate}"
    print_plan(
        plan,
        console,
        title=f"automatic plan: α measured over {cfg.warmup} warm-up steps; {c.machines} machines; {link}",
    )
    return [plan_summary(plan), *dr.choice_lines(plan)]


def _runs_table(runs: list[dict[str, Any]], cfg: DemoConfig, where: str) -> Table:
    """The runs side by side: plan, median step time, bytes, final loss, algorithms."""
    table = Table(title=f"{cfg.replicas} processes, {cfg.steps} steps, batch {cfg.batch}/replica ({where})")
    for col in ("gradient plan", "step time ms (median)", "MB sent/step/rank", "final loss", "algorithms"):
        table.add_column(col, justify="left" if col in ("gradient plan", "algorithms") else "right")
    for r in runs:
        table.add_row(
            r["plan"],
            f"{r['step_ms']:.1f}",
            f"{r['bytes_per_step'] / 1e6:.3f}",
            f"{r['final_loss']:.4f}",
            ", ".join(r["algorithms"]),
        )
    return table


def _report_lines(
    runs: list[dict[str, Any]], diff: float, cfg: DemoConfig, plan: Plan | None, where: str
) -> list[str]:
    """``demo_report``'s lines on the runs: against the baselines, predicted against measured (with a priced
    plan), the interleaved blocks' ratios and verdicts, the loss. Sets each priced run's ``parts``."""
    s = runs[-1]
    priced = plan if plan is not None and "compute_ms" in s else None  # a plan and the runs' compute times
    lines = [dr.headline(runs, where), *dr.compare_lines(runs)]
    sizes = dr.block_sizes(cfg.steps, cfg.warmup, cfg.block)
    if priced is not None:
        lines += dr.prediction_lines(runs, priced)
    lines += dr.ratio_lines(runs, sizes)
    if priced is not None:
        lines += dr.why_lines(runs, priced)
        for run, parts in dr.step_parts(runs, priced).items():
            next(r for r in runs if r["run"] == run)["parts"] = {**asdict(parts), "rest_ms": parts.rest_ms}
    lines.append(
        f"loss {s['first_loss']:.4f} -> {s['final_loss']:.4f} (mean of the last 10 steps); every run's final "
        f"parameters differ from the dense run's by at most {diff:.2e} (same SGD updates, different summation "
        "order)"
    )
    return lines


def _write_demo(
    out: Path, runs: list[dict[str, Any]], diff: float, cfg: DemoConfig, net: str | None, plan: Plan | None,
    lines: list[str],
) -> None:  # fmt: skip
    """``out``.json (the config, the runs, the plan, the interleaving) and ``out``.md (the table and ``lines``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    sizes = dr.block_sizes(cfg.steps, cfg.warmup, cfg.block)
    meta = {"config": config_dict(cfg), "net": net, "runs": runs, "max_param_diff": diff,
            "plan": plan.as_dict() if plan is not None else None,
            "interleaving": dr.interleaving(runs, cfg.block, sizes)}  # fmt: skip
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1))
    md = markdown_table(
        ["gradient plan", "step ms", "MB/step/rank", "final loss"],
        [
            [r["plan"], f"{r['step_ms']:.1f}", mb(r["bytes_per_step"], ".3f"), f"{r['final_loss']:.4f}"]
            for r in runs
        ],
        rule=" --- ",
    )
    out.with_suffix(".md").write_text("\n".join([*md, "", *lines, ""]))


def print_demo(
    runs: list[dict[str, Any]],
    diff: float,
    cfg: DemoConfig,
    console: Any,
    out: Path,
    net: str | None = None,
    plan: Plan | None = None,
) -> None:
    """The plan and why it chose so, the side-by-side table on screen, the lines of ``demo_report`` (against
    the baselines, predicted against measured, the interleaved blocks' ratios and verdicts), and ``out``.json /
    ``out``.md (the JSON: every run's per-step and per-block times and step parts, the interleaving's order and
    ratios)."""
    lines: list[str] = []
    if plan is not None:
        lines = _plan_lines(plan, cfg, console)
        for line in lines:
            console.print(line)
    where = f"emulated {net} links" if net else "loopback"
    show_table(console, _runs_table(runs, cfg, where))
    report = _report_lines(runs, diff, cfg, plan, where)
    for line in report:
        console.print(line)
    _write_demo(out, runs, diff, cfg, net, plan, [*lines, *report])
    console.print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
