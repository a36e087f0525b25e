"""Asynchronous parameter-server training with compressed pushes and error feedback (DCT §3.3).

Three workers train a small embedding + MLP model on the parameter servers in async mode (TF-Replicator's
async PS replicator: every push is applied when it arrives). The dense layers' gradients are pushed
uncompressed, compressed by DCT's threshold (1% of the entries, τ recomputed every 10 pushes) with per-worker
error feedback, and compressed the same way without it. The final loss on 1024 held-out samples is printed for
each, with the bytes each worker sent (pushes carry whole rows, so a 1% threshold saves less than 99%: a row
goes out when any of its entries passed). Async runs are not bitwise repeatable (pushes interleave freely).

    python examples/async_error_feedback.py            # ~20 s on two cores
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sparsync import launch
from sparsync.compress import Compressor, Threshold
from sparsync.hybrid import HybridConfig, HybridTrainer
from sparsync.ps import OptimizerConfig, start_servers

VOCAB, DIM, HIDDEN, CLASSES, SEQ, BATCH = 100, 16, 64, 8, 4, 32


class Model(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, DIM, sparse=True)
        self.mlp = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                                 nn.Linear(HIDDEN, CLASSES))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mlp(self.emb(x).mean(1))
        return out


TEACHER = Model(seed=123)  # labels come from a fixed random model of the same shape: a learnable task


def batch(seed: int, size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    with torch.no_grad():
        y = TEACHER(x).argmax(1)
    return x, y


def methods() -> dict[str, tuple[Compressor | None, bool]]:
    return {
        "uncompressed": (None, True),
        "threshold 1% + EF": (Threshold(0.01, lifespan=10), True),
        "threshold 1%, no EF": (Threshold(0.01, lifespan=10), False),
    }


def worker(rank: int, addresses: list[str], steps: int, lr: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, (name, (comp, ef)) in enumerate(methods().items()):
        model = Model()
        cfg = HybridConfig(mode="async", optimizer=OptimizerConfig("sgd", lr=lr), push_compressor=comp,
                           push_error_feedback=ef, table_prefix=f"m{i}/", timeout=60.0)  # fmt: skip
        tr = HybridTrainer(model, addresses, cfg)
        t0 = time.perf_counter()
        for s in range(steps):
            x, y = batch(10_000 * rank + s)
            tr.step(lambda x=x, y=y, m=model: nn.functional.cross_entropy(m(x), y))
        sent = tr.client.bytes_sent
        dist.barrier()  # every worker done: read the final model from the servers
        params = dict(model.named_parameters())
        with torch.no_grad():
            for n, t in tr.tables.items():
                params[n].copy_(t.read_all().reshape(params[n].shape))
        tr.close()
        x, y = batch(999_999, 1024)  # held out
        with torch.no_grad():
            loss = float(nn.functional.cross_entropy(model(x), y))
        out[name] = {"loss": loss, "bytes_sent": sent, "seconds": time.perf_counter() - t0}
        dist.barrier()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="steps per worker")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--lr", type=float, default=0.5)
    args = ap.parse_args()
    servers = start_servers(2, wait_timeout=30.0)
    try:
        res = launch(worker, nprocs=args.workers, args=([s.address for s in servers], args.steps, args.lr),
                     timeout=300)  # fmt: skip
    finally:
        for s in servers:
            s.kill()
    print(f"{args.workers} async workers x {args.steps} steps, SGD lr {args.lr}, loss on 1024 held-out samples:")
    for name in methods():
        mb = sum(r[name]["bytes_sent"] for r in res) / len(res) / 1e6
        print(f"  {name:22s} loss {res[0][name]['loss']:.4f}   {mb:.2f} MB sent per worker (pushes, pulls)")


if __name__ == "__main__":
    main()
