"""What a DLRM step's CPU is made of, variant by variant, in interleaved rounds
(docs/sharding.md#measured-the-grid-2026-11-28).

Each variant trains `bench dlrm`'s model on its data (`dlrm_model`, `rank_samples`: Kaggle MLPs, 26 tables
capped at 100,000 rows, dim 16, the generated Criteo file's Zipf ids, results/criteo_synthetic.txt) for 25 steps
of ``--batch`` samples on P local gloo ranks, one thread each, and reports the ranks' mean process CPU per step
(median over the steps after 5; a step from taking its batch out of the loader to its optimizer step) and rank 0's
main-thread CPU:

- ``ddp``: DDP over the MLPs, the tables left out of DDP (``ddp_over_mlps``: each rank's own, never sent, as
  ``floor_tables_unsent``);
- ``dmlp``: the same with ``sparsync.DistributedOptimizer`` over the MLPs instead of DDP;
- ``shard+ddp``, ``shard+dmlp``: the same with every table sharded (``sparsync.shard``);
- ``fused+ddp``, ``fused+dmlp``: the same with the sharded tables' SGD in their backward
  (``sparsync.shard(optimizer=SGD(lr))``, the tables out of the step's optimizer);
- ``fused+ddp+ahead``: ``fused+ddp`` with its batches through ``sparsync.sharding.Lookahead`` (as ``bench dlrm``'s
  ``sparsync_sharded_fused_lookahead``): each batch's ids go to their owners inside the step before's gradient
  rows round, so a step runs two all-to-all rounds of the tables instead of three;
- ``shard+ddp:torch``, ``fused+ddp:torch``: ``shard+ddp`` and ``fused+ddp`` with the torch ops the table groups
  run when their C kernels (``sparsync.sharding.kernels``) are not built (the same results);
- ``torchrec``: ``bench dlrm``'s ``torchrec_tw`` on the same samples (``torchrec_baseline``: the tables in one
  ``EmbeddingBagCollection`` sharded table-wise by ``DistributedModelParallel``, fbgemm's fused SGD, the MLPs in
  DDP), run in torchrec's environment (``scripts/torchrec_env.sh``), one subprocess per rank, the same torch.
  Its step is timed from the optimizer's ``zero_grad``: the batch's ``KeyedJaggedTensor`` is built before
  (sparsync's variants count taking the batch from the loader in their step).

The variants run one after another, ``--rounds`` times over, so that a drift of the host's speed reaches all of
them alike. Timings are this host's; compare the variants within one run. ``--variants`` runs a subset.

Each row also splits the ranks' mean CPU per step by thread (``/proc/self/task``, whole run after the warm-up
steps, so clock ticks of 10 ms add up over the steps): the main thread (the model, autograd, the hooks, the
sharded tables' stages), gloo's transport thread (``gloo_tcp_loop``: every message of every group's
collectives, one per group), gloo's work threads (``pt_gloo_runloop``: torch's collectives run there) and the
Python threads (sparsync's queue threads, one per group with work: ``DistributedOptimizer``'s buckets).

    .venv/bin/python scripts/dlrm_cpu_parts.py --procs 2 --rounds 5 --out docs/data/dlrm_cpu_parts_p2.md

``--paired N`` measures the variants side by side within one run instead: each rank builds every variant's model
(torchrec and the ``:torch`` variants excepted) and runs N rounds, a round being one step of each variant in turn
on the same batch. Per variant: the ranks' mean of the median process CPU per step and of the median, over the
rounds after the warm-up, of its step's CPU minus ``ddp``'s step's in the same round (so a drift of the host's
speed between runs does not enter the difference), the same for the main thread. No thread split.

    .venv/bin/python scripts/dlrm_cpu_parts.py --procs 8 --paired 60 --variants ddp,dmlp
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

from sparsync import DistributedOptimizer, launch
from sparsync.record import CommLog
from sparsync.sharding import dense_parameters, kernels
from sparsync_bench import thread_cpu
from sparsync_bench.criteo import CriteoBatch
from sparsync_bench.dlrm_shard import batches, shard_tables
from sparsync_bench.dlrm_train import (
    DlrmBenchConfig,
    ddp_over_mlps,
    default_data,
    dlrm_model,
    load,
    rank_samples,
    step_batches,
)
from sparsync_bench.fmt import markdown_table
from sparsync_bench.torchrec_baseline import train_torchrec, unavailable

VARIANTS = (
    "ddp",
    "dmlp",
    "shard+ddp",
    "shard+dmlp",
    "fused+ddp",
    "fused+dmlp",
    "fused+ddp+ahead",
    "shard+ddp:torch",
    "fused+ddp:torch",
    "torchrec",
)
DATA = Path("results/criteo_synthetic.txt")  # bench dlrm's generated file
THREADS = thread_cpu.KINDS


def _config(batch: int) -> DlrmBenchConfig:
    return DlrmBenchConfig(str(DATA), steps=25, batch=batch, mlp="kaggle", warmup=5)


class _Both:
    """``DistributedOptimizer`` over the MLPs, plain SGD over each rank's own tables."""

    def __init__(self, model: nn.Module, lr: float) -> None:
        held = {id(p) for p in dense_parameters(model)}  # all but tables trained in their backward
        mlps = [p for n, p in model.named_parameters() if not n.startswith("tables.")]
        tables = [p for n, p in model.named_parameters() if n.startswith("tables.") and id(p) in held]
        self.mlps = DistributedOptimizer(torch.optim.SGD(mlps, lr=lr))
        self.tables = torch.optim.SGD(tables, lr=lr) if tables else None

    def zero_grad(self) -> None:
        self.mlps.zero_grad()
        if self.tables is not None:
            self.tables.zero_grad()

    def step(self) -> None:
        self.mlps.step()
        if self.tables is not None:
            self.tables.step()


def _worker(rank: int, variant: str, cfg: DlrmBenchConfig, data: CriteoBatch) -> dict[str, float]:
    if variant == "torchrec":
        return _torchrec(rank, cfg, data)
    variant, _, setting = variant.partition(":")
    if setting == "torch":
        with mock.patch.object(kernels, "_native", None):  # as without the C extension: the torch ops
            return _train(rank, variant, cfg, data)
    return _train(rank, variant, cfg, data)


def _torchrec(rank: int, cfg: DlrmBenchConfig, data: CriteoBatch) -> dict[str, float]:
    """The ``torchrec`` variant (module doc): ``torchrec_tw``'s CPU per step; an error naming why it cannot run."""
    P = dist.get_world_size()
    row = train_torchrec("torchrec_tw", cfg, rank_samples(data, rank, P, cfg), rank, P)
    if row.get("unavailable"):
        raise RuntimeError(f"the torchrec variant cannot run: {row['unavailable']}")
    return {
        "cpu_ms": row["cpu_s"] * 1e3,
        "main_ms": row["main_s"] * 1e3,
        **{f"thread {kind}": row["thread_cpu_s"][kind] * 1e3 for kind in THREADS},
    }


class _Run:
    """One variant's model, forward, optimizer and batches on this rank (module doc), ready to step."""

    def __init__(self, variant: str, cfg: DlrmBenchConfig, steps: list[Any], lr: float) -> None:
        model = dlrm_model(cfg, sparse=True)
        variant, ahead = variant.removesuffix("+ahead"), variant.endswith("+ahead")
        if variant.startswith("shard+"):
            shard_tables("sparsync_sharded", model, steps[0][:2], CommLog())
        if variant.startswith("fused+"):
            shard_tables("sparsync_sharded_fused", model, steps[0][:2], CommLog(), lr)
        self.loader = batches(
            "sparsync_sharded_fused_lookahead" if ahead else "sparsync_sharded_fused", model, steps
        )
        self.forward: nn.Module = model
        self.opt: Any
        if variant.endswith("ddp"):
            self.forward = ddp_over_mlps(model)
            self.opt = torch.optim.SGD(dense_parameters(model), lr=lr)
        else:
            self.opt = _Both(model, lr)

    def step(self) -> tuple[float, float]:
        """One step, from a barrier: (process CPU seconds, this thread's CPU seconds)."""
        dist.barrier()
        c0, m0 = time.process_time(), time.thread_time()
        dense, ids, label = next(self.loader)  # with Lookahead: this batch's ids, as received, read
        self.opt.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(self.forward(dense, ids), label)
        loss.backward()  # type: ignore[no-untyped-call]
        self.opt.step()
        loss.item()
        return time.process_time() - c0, time.thread_time() - m0


def _train(rank: int, variant: str, cfg: DlrmBenchConfig, data: CriteoBatch) -> dict[str, float]:
    steps = step_batches(rank_samples(data, rank, dist.get_world_size(), cfg), cfg)
    run = _Run(variant, cfg, steps, cfg.lr)
    cpu, main = [], []
    before: thread_cpu.Reading = {}
    for s in range(len(steps)):
        if s == cfg.warmup:
            before = thread_cpu.reading()
        c, m = run.step()
        cpu.append(c)
        main.append(m)
    split = thread_cpu.per_step(before, thread_cpu.reading(), cfg.steps - cfg.warmup)
    t = torch.tensor([statistics.median(cpu[cfg.warmup :]), *split], dtype=torch.float64)
    dist.all_reduce(t)
    means = (t / dist.get_world_size() * 1e3).tolist()
    return {
        "cpu_ms": means[0],
        "main_ms": statistics.median(main[cfg.warmup :]) * 1e3,
        **{f"thread {kind}": v for kind, v in zip(THREADS, means[1:], strict=True)},
    }


def _paired(rank: int, variants: list[str], cfg: DlrmBenchConfig, data: CriteoBatch, n: int) -> list[list[float]]:
    """``--paired``: every variant's model on this rank, ``n`` rounds of one step of each in turn on the same batch
    (the run's batches over again); per variant, the ranks' mean of (median process CPU per step, median of its
    step's CPU minus ddp's step's in the same round, the same two of the main thread), in ms, after the warm-up."""
    steps = step_batches(rank_samples(data, rank, dist.get_world_size(), cfg), cfg)
    again = [steps[s % len(steps)] for s in range(n)]
    runs = [_Run(v, cfg, again, cfg.lr) for v in variants]
    got = [[run.step() for run in runs] for _ in range(n)][cfg.warmup :]  # got[round][variant] = (cpu, main)
    base = variants.index("ddp")
    out = []
    for v in range(len(variants)):
        row = []
        for k in (0, 1):
            row += [statistics.median(r[v][k] for r in got), statistics.median(r[v][k] - r[base][k] for r in got)]
        out.append(row)
    t = torch.tensor(out, dtype=torch.float64)
    dist.all_reduce(t)
    means: list[list[float]] = (t / dist.get_world_size() * 1e3).tolist()
    return means


def _paired_table(a: argparse.Namespace, variants: list[str], rows: list[list[float]]) -> str:
    base = rows[variants.index("ddp")][0]
    head = ("variant", "CPU ms/step", "over ddp's step in the same round", "x ddp", "main thread ms/step",
            "main over ddp")  # fmt: skip
    body = [(v, f"{cpu:.1f}", f"{over:+.2f}", f"{(base + over) / base:.3f}", f"{main:.1f}", f"{main_over:+.2f}")
            for v, (cpu, over, main, main_over) in zip(variants, rows, strict=True)]  # fmt: skip
    title = (
        f"P = {a.procs}, {a.batch} samples per rank, {a.paired} rounds of one step of each variant in turn on "
        f"each rank (`scripts/dlrm_cpu_parts.py --procs {a.procs} --batch {a.batch} --paired {a.paired} "
        f"--variants {','.join(variants)}`)"
    )
    return "\n".join([title, "", *markdown_table(head, body)]) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--paired", type=int, default=0, metavar="N", help="N rounds of the variants' steps in turn (module doc)"
    )
    offered = [v for v in VARIANTS if v != "torchrec" or unavailable() is None]  # torchrec: where it can run
    ap.add_argument("--variants", default=",".join(offered), help="comma-separated, of: " + ", ".join(VARIANTS))
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    variants = a.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or "ddp" not in variants:
        ap.error(f"--variants: unknown {unknown}; the list must hold ddp (the rows' base) and any of {VARIANTS}")
    if a.paired and any(v == "torchrec" or ":" in v for v in variants):
        ap.error("--paired runs every variant in one process: torchrec (its own) and the :torch ones cannot")
    if a.paired and a.paired <= _config(a.batch).warmup:
        ap.error(f"--paired {a.paired}: needs more rounds than the {_config(a.batch).warmup} of warm-up")
    cfg = _config(a.batch)
    default_data(DATA, cfg.steps * a.batch * a.procs)  # generated once, as bench dlrm does
    data = load(cfg, a.procs)
    if a.paired:
        text = _paired_table(a, variants, launch(_paired, nprocs=a.procs, args=(variants, cfg, data, a.paired))[0])
    else:
        text = _interleaved(a, variants, cfg, data)
    print(text, end="")
    if a.out is not None:
        a.out.write_text(text)


def _interleaved(a: argparse.Namespace, variants: list[str], cfg: DlrmBenchConfig, data: CriteoBatch) -> str:
    got: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for r in range(a.rounds):
        for v in variants:
            res = launch(_worker, nprocs=a.procs, args=(v, cfg, data))[0]
            got[v].append(res)
            print(
                f"round {r + 1}/{a.rounds} {v}: CPU {res['cpu_ms']:.1f} ms/step, main thread {res['main_ms']:.1f}"
            )
    base = statistics.median(x["cpu_ms"] for x in got["ddp"])
    chosen = "" if variants == list(VARIANTS) else f" --variants {a.variants}"
    lines = [
        f"P = {a.procs}, {a.batch} samples per rank, {a.rounds} interleaved rounds "
        f"(`scripts/dlrm_cpu_parts.py --procs {a.procs} --batch {a.batch} --rounds {a.rounds}{chosen}`)",
        "",
        "| variant | CPU ms/step (median of rounds) | range | over ddp | rank 0 main thread ms/step | "
        + " | ".join(f"{k} (ranks' mean, over ddp)" for k in THREADS)
        + " |",
        "|---|---|---|---|---|" + "---|" * len(THREADS),
    ]
    for v in variants:
        c = [x["cpu_ms"] for x in got[v]]
        m = statistics.median(x["main_ms"] for x in got[v])
        split = [_split(got, v, k) for k in THREADS]
        lines.append(f"| {v} | {statistics.median(c):.1f} | {min(c):.1f}-{max(c):.1f} | "
                     f"{statistics.median(c) - base:+.1f} | {m:.1f} | " + " | ".join(split) + " |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _split(got: dict[str, list[dict[str, float]]], v: str, kind: str) -> str:
    """A variant's median CPU per step in threads of ``kind``, and that over ddp's."""
    key = f"thread {kind}"
    mine, base = (statistics.median(x[key] for x in got[w]) for w in (v, "ddp"))
    return f"{mine:.1f} ({mine - base:+.1f})"


if __name__ == "__main__":
    main()
