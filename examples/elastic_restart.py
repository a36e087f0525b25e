"""Elastic restarts: train with a checkpoint per step; killed workers resume where the group stopped.

python examples/elastic_restart.py CKPT_DIR                         # 4 local processes
sparsync cluster --hosts 2 --procs-per-host 2 --max-restarts 3 -- examples/elastic_restart.py CKPT_DIR
sparsync cluster ... --max-restarts 3 -- examples/elastic_restart.py CKPT_DIR --kill-rank 3 --kill-step 7

With ``--kill-rank R --kill-step S`` rank R kills itself (SIGKILL) at step S of the first attempt: torchrun
restarts the group (``--max-restarts``), every rank loads the last checkpoint (model and optimizer state, written
by rank 0 after each step, atomically) and goes on. Sync training with ``sparsync.set_deterministic`` (auto's
choices depend on the data only) and batches drawn from (step, rank): the resumed run ends at the same
parameters, bit for bit, as an uninterrupted one. Prints the final loss and a SHA-256 of the parameters.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional

import sparsync

VOCAB, DIM, CLASSES, BATCH = 20_000, 16, 4, 64


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = (torch.rand(BATCH, 8, generator=g) ** 3 * VOCAB).long()  # skewed: low ids hot
    return tokens, tokens[:, 0] % CLASSES


def work(rank: int, ckpt: str, steps: int, kill_rank: int, kill_step: int) -> str:
    sparsync.set_deterministic()
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        {"emb": torch.nn.EmbeddingBag(VOCAB, DIM, sparse=True), "head": torch.nn.Linear(DIM, CLASSES)}
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    path = Path(ckpt) / "state.pt"
    start = 0
    if path.exists():
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    loss = torch.zeros(())
    for step in range(start, steps):
        if rank == kill_rank and step == kill_step and attempt == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        tokens, y = batch(step, rank)
        opt.zero_grad()
        loss = functional.cross_entropy(model["head"](model["emb"](tokens)), y)
        loss.backward()
        for p in model.parameters():
            assert p.grad is not None
            p.grad = sparsync.allreduce(p.grad, name=f"grad{step}") / world
        opt.step()
        if rank == 0:
            tmp = path.with_suffix(".tmp")
            torch.save({"step": step + 1, "model": model.state_dict(), "opt": opt.state_dict()}, tmp)
            os.replace(tmp, path)  # atomic: a kill never leaves half a checkpoint
        dist.barrier()  # nobody starts step s + 1 before step s is on disk
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    return f"rank {rank}: attempt {attempt} resumed at step {start}, loss {loss.item():.6f}, params {digest[:16]}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--kill-rank", type=int, default=-1)
    ap.add_argument("--kill-step", type=int, default=-1)
    a = ap.parse_args()
    os.makedirs(a.ckpt, exist_ok=True)
    for line in sparsync.launch(work, nprocs=4, args=(a.ckpt, a.steps, a.kill_rank, a.kill_step)):
        print(line, flush=True)


if __name__ == "__main__":
    main()
