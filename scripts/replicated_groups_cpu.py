"""CPU per step of DLRM's 26 tables placed "replicated": grouped with their SGD in backward
(``sparsync.shard(model, plan, optimizer=SGD(lr))``, ``sparsync/sharding/replicated.py``) against the same tables
as the user's ``nn.EmbeddingBag(sparse=True)`` modules reduced by ``DistributedOptimizer`` and stepped by
``torch.optim.SGD``, in interleaved rounds (docs/sharding.md, "Replicated tables in groups").

Each variant trains ``bench dlrm``'s model on its data (``dlrm_model``, ``rank_samples``: Kaggle MLPs, 26 tables
capped at 100,000 rows, dim 16, the generated Criteo file's Zipf ids) for 25 steps of ``--batch`` samples on P
local gloo ranks, one thread each, and reports the ranks' mean process CPU per step (median over the steps after
5), that CPU split by thread (``/proc/self/task`` over the steps after 5: the main thread, gloo's transport and
work threads, the Python threads: sparsync's queue threads) and how far table 0's rows after the last step lie
from the ``replicated`` variant's (every variant but the floor trains the same model):

- ``floor``: ``DistributedOptimizer`` over the MLPs, each rank's tables its own (plain SGD, never sent);
- ``replicated``: ``DistributedOptimizer`` over every parameter (the tables' sparse gradients by its default
  placement), ``torch.optim.SGD``;
- ``grouped``: the tables grouped, their SGD in backward; ``DistributedOptimizer`` over ``dense_parameters``;
- ``grouped:split``: the same, the group's sum over the ranks by the split allgather instead of the allgather
  (``replicated.SUM_ALGORITHM``).

    .venv/bin/python scripts/replicated_groups_cpu.py --procs 2 --rounds 5 \
        --out docs/data/replicated_groups_cpu_p2.md
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

import sparsync
from sparsync import DistributedOptimizer, launch
from sparsync.sharding import SGD, dense_parameters, replicated
from sparsync_bench import thread_cpu
from sparsync_bench.criteo import CriteoBatch
from sparsync_bench.dlrm_train import DlrmBenchConfig, default_data, dlrm_model, load, rank_samples, step_batches

VARIANTS = ("floor", "replicated", "grouped", "grouped:split")
THREADS = thread_cpu.KINDS
DATA = Path("results/criteo_synthetic.txt")  # bench dlrm's generated file


def _optimizer(variant: str, model: nn.Module, lr: float) -> list[Any]:
    """The variant's optimizers (module doc); ``grouped`` swaps the tables first (collective)."""
    if variant == "grouped":
        plan = {n: "replicated" for n, m in model.named_modules() if isinstance(m, nn.EmbeddingBag)}
        sparsync.shard(model, plan, optimizer=SGD(lr=lr))
        return [DistributedOptimizer(torch.optim.SGD(dense_parameters(model), lr=lr), model)]
    if variant == "replicated":
        return [DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr), model)]
    mlps = [p for n, p in model.named_parameters() if not n.startswith("tables.")]
    tables = [p for n, p in model.named_parameters() if n.startswith("tables.")]
    return [DistributedOptimizer(torch.optim.SGD(mlps, lr=lr)), torch.optim.SGD(tables, lr=lr)]


def _worker(rank: int, variant: str, cfg: DlrmBenchConfig, data: CriteoBatch) -> dict[str, Any]:
    variant, _, setting = variant.partition(":")
    if setting == "split":
        with mock.patch.object(replicated, "SUM_ALGORITHM", "ssar_split_allgather"):
            return _train(rank, variant, cfg, data)
    return _train(rank, variant, cfg, data)


def _train(rank: int, variant: str, cfg: DlrmBenchConfig, data: CriteoBatch) -> dict[str, Any]:
    P = dist.get_world_size()
    model = dlrm_model(cfg, sparse=True)
    mine = rank_samples(data, rank, P, cfg)
    steps = step_batches(mine, cfg)
    opts = _optimizer(variant, model, cfg.lr)
    cpu = []
    for s, (dense, ids, label) in enumerate(steps):
        dist.barrier()
        if s == cfg.warmup:
            before = thread_cpu.reading()
        c0 = time.process_time()
        for o in opts:
            o.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(model(dense, ids), label)
        loss.backward()  # type: ignore[no-untyped-call]
        for o in opts:
            o.step()
        loss.item()
        cpu.append(time.process_time() - c0)
    split = thread_cpu.per_step(before, thread_cpu.reading(), cfg.steps - cfg.warmup)
    t = torch.tensor([statistics.median(cpu[cfg.warmup :]), *split], dtype=torch.float64)
    dist.all_reduce(t)
    ms = (t / P * 1e3).tolist()
    table = model.tables[0].weight.detach()  # type: ignore[index]
    return {"cpu_ms": ms[0], "threads_ms": ms[1:], "table0": table.clone()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    cfg = DlrmBenchConfig(str(DATA), steps=25, batch=a.batch, mlp="kaggle", warmup=5)
    default_data(DATA, cfg.steps * a.batch * a.procs)  # generated once, as bench dlrm does
    data = load(cfg, a.procs)
    got: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for r in range(a.rounds):
        for v in VARIANTS:
            res = launch(_worker, nprocs=a.procs, args=(v, cfg, data))[0]
            got[v].append(res)
            split = ", ".join(f"{k} {x:.1f}" for k, x in zip(THREADS, res["threads_ms"], strict=True))
            print(f"round {r + 1}/{a.rounds} {v}: CPU {res['cpu_ms']:.1f} ms/step ({split})")
    differ = float((got["grouped"][0]["table0"] - got["replicated"][0]["table0"]).abs().max())
    base = statistics.median(x["cpu_ms"] for x in got["floor"])
    head = " | ".join(f"{k} ms/step" for k in THREADS)
    lines = [
        f"P = {a.procs}, {a.batch} samples per rank, {a.rounds} interleaved rounds "
        f"(`scripts/replicated_groups_cpu.py --procs {a.procs} --batch {a.batch} --rounds {a.rounds}`); "
        f"table 0 after 25 steps, grouped vs replicated: largest difference {differ:.2e}",
        "",
        f"| variant | CPU ms/step (median of rounds) | range | over floor | {head} |",
        "|---|---|---|---|" + "---|" * len(THREADS),
    ]
    for v in VARIANTS:
        c = [x["cpu_ms"] for x in got[v]]
        parts = " | ".join(
            f"{statistics.median(x['threads_ms'][i] for x in got[v]):.1f}" for i in range(len(THREADS))
        )
        lines.append(f"| {v} | {statistics.median(c):.1f} | {min(c):.1f}-{max(c):.1f} | "
                     f"{statistics.median(c) - base:+.1f} | {parts} |")  # fmt: skip
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if a.out is not None:
        a.out.write_text(text)


if __name__ == "__main__":
    main()
