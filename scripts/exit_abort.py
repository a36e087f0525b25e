"""How often a torchrun job's ranks abort at the interpreter's exit ("terminate called without an active
exception", exit code -6), by how the script ends (docs/sharding.md, "Ending a torchrun script").

Each configuration runs ``--runs`` torchrun jobs of ``--procs`` gloo ranks on loopback; a job is this file with
``--worker CONFIG``: 20 steps, then the ending CONFIG names:

- ``torch``: 20 gloo allreduces (no sparsync), then nothing: the groups left to the interpreter's exit;
- ``torch+destroy``: the same, then ``dist.destroy_process_group()``;
- ``shard+destroy``: four tables sharded by ``sparsync.shard`` trained 20 steps (torch's SGD), then
  ``dist.destroy_process_group()``, the model still alive;
- ``shard+free+destroy``: the same, the model freed first (``del``, ``gc.collect()``);
- ``dopt+destroy``, ``dopt+free+destroy``: the same two with the tables' optimizer and a dense layer's
  ``sparsync.DistributedOptimizer`` (which holds the groups it reduces on, and sparsync's side groups, while it
  lives).

    .venv/bin/python scripts/exit_abort.py --runs 6 --out docs/data/exit_abort.md
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
from pathlib import Path

from sparsync_bench.fmt import markdown_table

CONFIGS = ("torch", "torch+destroy", "shard+destroy", "shard+free+destroy", "dopt+destroy", "dopt+free+destroy")


def _worker(config: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if config.startswith("torch"):
        for _ in range(20):
            dist.all_reduce(torch.ones(100))
    # as a script's module-level model: alive until the interpreter's exit
    globals()["kept_until_exit"] = None if config.startswith("torch") else _train(config)
    if config.endswith("destroy"):
        dist.destroy_process_group()


def _train(config: str) -> object:
    """Four tables sharded (``shard``: torch's SGD over them; ``dopt``: a dense layer beside them under
    ``DistributedOptimizer``), 20 steps; the model and its optimizer freed when ``config`` says ``free``."""
    import torch
    from torch import nn

    import sparsync

    torch.manual_seed(0)
    model = nn.Module()
    model.tables = nn.ModuleList(nn.EmbeddingBag(1000, 16, mode="sum") for _ in range(4))
    model.top = nn.Linear(64, 1)
    sparsync.shard(model)
    params = sparsync.sharding.dense_parameters(model)
    sgd = torch.optim.SGD(params, lr=0.1)
    opt = sparsync.DistributedOptimizer(sgd, model) if config.startswith("dopt") else sgd
    for _ in range(20):
        ids, offsets = torch.randint(0, 1000, (64,)), torch.arange(64)
        model.top(torch.cat([t(ids, offsets) for t in model.tables], 1)).sum().backward()
        opt.step()
        opt.zero_grad()
    if "free" in config:
        del model, opt, sgd, params
        gc.collect()
        return None
    return model, opt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=CONFIGS, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.worker is not None:
        _worker(a.worker)
        return
    torchrun = Path(sys.executable).parent / "torchrun"
    lines = [
        f"torchrun jobs of {a.procs} gloo ranks on loopback, {a.runs} per ending "
        f"(`scripts/exit_abort.py --runs {a.runs} --procs {a.procs}`)",
    ]
    body = []
    port = 29700
    for config in CONFIGS:
        failed = aborted = 0
        for _ in range(a.runs):
            port += 1
            cmd = [str(torchrun), "--nproc-per-node", str(a.procs), "--master-port", str(port), __file__,
                   "--worker", config]  # fmt: skip
            res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            failed += res.returncode != 0
            aborted += "terminate called without an active exception" in res.stdout + res.stderr
        print(f"{config}: {failed} of {a.runs} jobs failed, {aborted} aborted at exit", flush=True)
        body.append((config, f"{failed} of {a.runs}", aborted))
    lines += ["", *markdown_table(("ending", "jobs that failed", "of which aborted at exit"), body)]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if a.out is not None:
        a.out.write_text(text)


if __name__ == "__main__":
    main()
