"""Elastic restarts on another world size: sharded tables checkpointed with DCP every few steps, resumed by any
number of ranks.

python examples/elastic_sharded.py CKPT_DIR --nprocs 4 --steps 6       # 4 ranks: steps 0-5, checkpoints
python examples/elastic_sharded.py CKPT_DIR --nprocs 3 --steps 12      # 3 ranks: resumes at step 6
torchrun --nnodes 1:4 --max-restarts 3 ... examples/elastic_sharded.py CKPT_DIR   # a restart after a node leaves

Every ``--every`` steps each rank writes only its rows of the tables and of their momentum
(``sparsync.sharding.checkpoint.save``, into ``CKPT_DIR/step_<n>``), then rank 0 names it in ``CKPT_DIR/latest``
(atomically: a kill never leaves a half-written checkpoint named). A start finds the latest and loads it at its
own world size (``checkpoint.load``: the rows dealt to their new owners). Batches are drawn from (step, rank,
world size). Rank 0 prints the step it resumed at, the last loss and a SHA-256 of the tables and head gathered
whole.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import sparsync
from sparsync.sharding import checkpoint, plan_of

VOCAB, DIM, BATCH = 5_000, 8, 32


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * world + rank)
    ids = (torch.rand(BATCH * 4, generator=g) ** 3 * VOCAB).long()  # skewed: low ids hot
    return ids, torch.arange(0, BATCH * 4, 4)


def work(rank: int, ckpt: str, steps: int, every: int) -> str:
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = sparsync.shard(nn.ModuleDict({"emb": nn.EmbeddingBag(VOCAB, DIM), "head": nn.Linear(DIM, 1)}))
    opt = sparsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model,
                                        plan=plan_of(model), sync_parameters=False)  # fmt: skip
    latest = Path(ckpt) / "latest"
    start = 0
    if latest.exists():
        name = latest.read_text().strip()
        checkpoint.load(str(Path(ckpt) / name), model, opt)
        start = int(name.removeprefix("step_"))
    loss = torch.zeros(())
    for step in range(start, steps):
        ids, offsets = batch(step, rank, world)
        opt.zero_grad()
        loss = model["head"](model["emb"](ids, offsets)).square().mean()
        loss.backward()
        opt.step()
        if (step + 1) % every == 0:
            name = f"step_{step + 1}"
            checkpoint.save(str(Path(ckpt) / name), model, opt)
            dist.barrier()  # every rank's rows on disk before rank 0 names the checkpoint
            if rank == 0:
                (Path(ckpt) / "latest.tmp").write_text(name)
                os.replace(Path(ckpt) / "latest.tmp", latest)
    whole = model.state_dict()  # the tables gathered on rank 0 (collective)
    digest = hashlib.sha256(b"".join(v.numpy().tobytes() for v in whole.values())).hexdigest()
    return (
        f"{world} ranks resumed at step {start}, loss {loss.item():.6f}, params {digest[:16]}" if rank == 0 else ""
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--nprocs", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=2)
    a = ap.parse_args()
    os.makedirs(a.ckpt, exist_ok=True)
    for line in sparsync.launch(work, nprocs=a.nprocs, args=(a.ckpt, a.steps, a.every)):
        if line:
            print(line, flush=True)


if __name__ == "__main__":
    main()
