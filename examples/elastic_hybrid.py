"""Elastic restarts of hybrid training: parameter servers per node, checkpoints of everything.

python examples/elastic_hybrid.py CKPT_DIR                     # 4 local processes as 2 emulated nodes x 2
sparsync cluster --hosts 2 --procs-per-host 2 --max-restarts 3 -- examples/elastic_hybrid.py CKPT_DIR \\
    --kill-rank 3 --kill-step 5

The model has three parts, each synchronised differently: an embedding on the parameter servers (server-side
Adagrad), an embedding reduced by the S2 sketch with error feedback (local SGD), and a dense head (allreduce,
local SGD with momentum). Every node's first rank starts that node's server (``node_servers``) with a
checkpoint directory. After each step: every rank writes its own state (error-feedback residuals, the sketch's
step counter) and rank 0 the local parameters and optimizers, each to a file named by the step (atomically);
then rank 0 has the servers checkpoint their tables and Adagrad state. A kill between the two leaves the
servers one step behind the newest worker files, so the previous step's files are kept, and a resumed run
loads the worker files of the servers' step.

With ``--kill-rank R --kill-step S`` rank R kills itself (SIGKILL) at step S of the first attempt; torchrun
restarts the group, servers included (they die with the rank that started them), and the run ends at the same
parameters, bit for bit, as an uninterrupted one (sync mode sums pushes in worker order; the sketch's hashes
are seeded by the step). Prints a SHA-256 of every parameter, the servers' table included.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import sparsync
from sparsync.compress import SparseSketch
from sparsync.hybrid import HybridConfig, HybridTrainer
from sparsync.ps import OptimizerConfig, node_servers

VOCAB, DIM, CLASSES, BATCH = 20_000, 16, 4, 64


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.users = nn.EmbeddingBag(VOCAB, DIM, sparse=True)  # on the servers
        self.items = nn.EmbeddingBag(VOCAB, DIM, sparse=True)  # sketch with error feedback
        self.head = nn.Linear(2 * DIM, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.users(tokens[:, :4]), self.items(tokens[:, 4:])], 1))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = (torch.rand(BATCH, 8, generator=g) ** 3 * VOCAB).long()  # skewed: low ids hot
    return tokens, tokens[:, 0] % CLASSES


def _save(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)  # atomic: a kill never leaves half a file


def _checkpoint(ckpt: Path, rank: int, step: int, model: Model, tr: HybridTrainer, opts: list[Any]) -> None:
    _save(tr.state_dict(), ckpt / f"rank{rank}-{step}.pt")
    if rank == 0:
        local = {k: v for k, v in model.state_dict().items() if not k.startswith("users.")}
        _save({"model": local, "opts": [o.state_dict() for o in opts]}, ckpt / f"model-{step}.pt")
    dist.barrier()  # every worker file of this step is on disk before the servers move on to it
    if rank == 0:
        tr.save()
    dist.barrier()  # nobody starts step + 1 before the servers hold step
    for old in ckpt.glob(f"*-{step - 2}.pt"):  # keep two steps: the servers may be one behind after a kill
        old.unlink(missing_ok=True)


def work(rank: int, ckpt_dir: str, steps: int, kill_rank: int, kill_step: int) -> str:
    sparsync.set_deterministic()
    ckpt = Path(ckpt_dir)
    torch.manual_seed(0)
    model = Model()
    dense_opt = torch.optim.SGD(model.head.parameters(), lr=0.5, momentum=0.9)
    sparse_opt = torch.optim.SGD(model.items.parameters(), lr=0.5)
    cfg = HybridConfig(
        mode="sync", sparse_reduce="mean", optimizer=OptimizerConfig("adagrad", lr=0.3),
        sketch=SparseSketch(ratio=0.2), sketch_error_feedback=True,
    )  # fmt: skip
    with node_servers(checkpoint_dir=str(ckpt / "servers")) as servers:
        tr = HybridTrainer(
            model, servers.addresses, cfg, dense_optimizer=dense_opt, sparse_optimizer=sparse_opt,
            placements={"items.weight": "sketch"}, sparse_params=["users.weight"],
        )  # fmt: skip
        start = tr.step_no  # the servers' checkpointed step (0 on a fresh start)
        if start:
            state = torch.load(ckpt / f"model-{start}.pt", weights_only=True)
            model.load_state_dict(state["model"], strict=False)
            for opt, s in zip((dense_opt, sparse_opt), state["opts"], strict=True):
                opt.load_state_dict(s)
            tr.load_state_dict(torch.load(ckpt / f"rank{rank}-{start}.pt", weights_only=True))
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        loss = 0.0
        for step in range(start, steps):
            if rank == kill_rank and step == kill_step and attempt == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            tokens, y = batch(step, rank)
            loss = tr.step(lambda t=tokens, y=y: nn.functional.cross_entropy(model(t), y))
            _checkpoint(ckpt, rank, step + 1, model, tr, [dense_opt, sparse_opt])
        table = tr.tables["users.weight"].read_all()
        tr.close()
    parts = [table, model.items.weight, model.head.weight, model.head.bias]
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in parts)).hexdigest()
    return f"rank {rank}: attempt {attempt} resumed at step {start}, loss {loss:.6f}, params {digest[:16]}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--kill-rank", type=int, default=-1)
    ap.add_argument("--kill-step", type=int, default=-1)
    ap.add_argument("--procs-per-host", type=int, default=2, help="local runs: emulated nodes of this many ranks")
    a = ap.parse_args()
    os.makedirs(a.ckpt, exist_ok=True)
    args = (a.ckpt, a.steps, a.kill_rank, a.kill_step)
    for line in sparsync.launch(work, nprocs=4, args=args, procs_per_host=a.procs_per_host):
        print(line, flush=True)


if __name__ == "__main__":
    main()
