"""``sparsync demo``: real training with the Replicator API, plain dense allreduce vs sparsync's plan.

A bag-of-tokens classifier with a sparse embedding (``nn.Embedding(sparse=True)``, vocab 65,536) on synthetic
Zipf-distributed tokens, trained on 4 local processes twice from the same seed and data: once with every
gradient averaged by a dense allreduce (the embedding's gradient densified, as Horovod and DDP do), once by
``wrap_optimizer``'s default plan (the embedding's COO gradient by SparCML's sparse allreduce, chosen by the
α-β model; the dense layers in one bucketed allreduce). Both runs use plain SGD, so they compute the same
updates and end at the same loss; what differs is the bytes on the wire and the step time.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from sparsync.replicator import PER_REPLICA, DenseAllreduce, ReplicaContext, Replicator

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

    def __post_init__(self) -> None:
        if self.vocab < 2 or self.steps <= self.warmup or self.replicas < 1 or self.batch < 1:
            raise ValueError(f"bad demo config {self}")


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


def _train(ctx: ReplicaContext, cfg: DemoConfig, plan: str, progress: Any) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    model = BagClassifier(cfg)
    default = DenseAllreduce() if plan == PLANS[0] else None
    sgd = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    opt = ctx.wrap_optimizer(sgd, op="mean", model=model, default=default)
    log = ctx.log
    assert log is not None  # the demo's replicator records
    log.clear()

    def step_fn(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tok, y = batch
        opt.zero_grad()
        loss = F.cross_entropy(model(tok), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        return loss

    times, nbytes, losses = [], [], []
    task = progress.add_task(plan, total=cfg.steps) if progress is not None else None
    for batch in ctx.input(_input_fn(cfg), PER_REPLICA):
        before = len(log)
        t0 = time.perf_counter()
        step_fn_loss = ctx.run(step_fn, batch)
        times.append(time.perf_counter() - t0)
        nbytes.append(sum(r.bytes_sent for r in log.records[before:]))
        losses.append(step_fn_loss)
        if progress is not None:
            progress.advance(task)
    # Losses reduced once at the end, outside the timed steps.
    mean_losses = ctx.all_mean(torch.stack(losses)).tolist()
    worst = ctx.all_reduce(torch.tensor(times), "max").tolist()  # a step ends when its slowest replica does
    chosen = sorted({r.algorithm for r in log.records})
    return {
        "plan": plan,
        "step_ms": 1e3 * statistics.median(worst[cfg.warmup :]),
        "bytes_per_step": statistics.mean(nbytes[cfg.warmup :]),
        "first_loss": mean_losses[0],
        "final_loss": statistics.mean(mean_losses[-10:]),
        "algorithms": chosen,
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()} if ctx.replica_id == 0 else None,
    }


def demo_program(ctx: ReplicaContext, cfg: DemoConfig, show_progress: bool) -> list[dict[str, Any]] | None:
    torch.set_num_threads(1)
    progress = None
    if show_progress and ctx.replica_id == 0:
        from rich.progress import Progress

        progress = Progress(transient=True)
        progress.start()
    try:
        runs = [_train(ctx, cfg, plan, progress) for plan in PLANS]
    finally:
        if progress is not None:
            progress.stop()
    return runs if ctx.replica_id == 0 else None


def run_demo(
    cfg: DemoConfig, *, show_progress: bool = True, net: str | None = None
) -> tuple[list[dict[str, Any]], float]:
    """Both runs on ``cfg.replicas`` local processes (each in a namespace with ``net``-shaped links when
    given, e.g. "1gbit"); returns their summaries and the largest parameter difference between the two runs'
    final models."""
    repl = Replicator(num_replicas=cfg.replicas, record=True)
    if net is None:
        runs = repl.start(demo_program, cfg, show_progress)[0]
    else:
        from sparsync.netem import NetNamespaces, NetSpec, require_root

        require_root()
        with NetNamespaces(cfg.replicas, NetSpec(net)) as ns:
            runs = repl.start(demo_program, cfg, show_progress, netns=ns)[0]
    a, b = runs[0].pop("params"), runs[1].pop("params")
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    return runs, diff


def config_dict(cfg: DemoConfig) -> dict[str, Any]:
    return asdict(cfg)


def print_demo(
    runs: list[dict[str, Any]], diff: float, cfg: DemoConfig, console: Any, out: Any, net: str | None = None
) -> None:
    """The side-by-side table on screen, and ``out``.json / ``out``.md."""
    import json

    from rich.table import Table

    where = f"{net} links" if net else "loopback"
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
    console.print(table)
    d, s = runs
    lines = [
        f"bytes per step: {d['bytes_per_step'] / s['bytes_per_step']:.1f}x fewer with sparsync's plan; "
        f"step time dense / sparsync: {d['step_ms'] / s['step_ms']:.2f}",
        f"loss {s['first_loss']:.4f} -> {s['final_loss']:.4f} (mean of the last 10 steps); the two runs' final "
        f"parameters differ by at most {diff:.2e} (same SGD updates, different summation order)",
    ]
    for line in lines:
        console.print(line)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(
        json.dumps({"config": config_dict(cfg), "net": net, "runs": runs, "max_param_diff": diff}, indent=1)
    )
    md = ["| gradient plan | step ms | MB/step/rank | final loss |", "| --- | --- | --- | --- |"]
    md += [
        f"| {r['plan']} | {r['step_ms']:.1f} | {r['bytes_per_step'] / 1e6:.3f} | {r['final_loss']:.4f} |"
        for r in runs
    ]
    out.with_suffix(".md").write_text("\n".join([*md, "", *lines, ""]))
    console.print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
