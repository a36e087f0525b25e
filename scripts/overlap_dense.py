"""DistributedOptimizer against DDP on a dense model (docs/optimizer.md#reduction-during-backward): six 1024 x 1024
Linear layers, 64 samples per rank, SGD, loopback. Three set-ups interleaved step by step (so the host's load
falls on all alike): DDP, DistributedOptimizer reducing during backward (the default), and
DistributedOptimizer with ``overlap=False`` (every gradient reduced in ``step()``, as before); the order in which
they run rotates from step to step. Each repeat
reports the slowest rank's median step after the warm-up; the ratios to DDP are what to compare. A fourth
set-up leaves out the NaN check (``check_nan=False``), to show what it costs.

    .venv/bin/python scripts/overlap_dense.py [--procs 4] [--steps 30] [--repeats 3] [--out docs/data/overlap_dense.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import sparsync

WIDTH, LAYERS, BATCH, WARMUP = 1024, 6, 64, 5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def step_times(rank: int, steps: int, repeats: int) -> list[dict[str, float]]:
    torch.set_num_threads(1)
    setups: dict[str, tuple[nn.Module, Any]] = {}
    d = nn.parallel.DistributedDataParallel(_model())
    setups["ddp"] = (d, torch.optim.SGD(d.parameters(), lr=0.01))
    for name, overlap, check in (
        ("sparsync", True, True),
        ("sparsync check_nan=False", True, False),
        ("sparsync overlap=False", False, True),
    ):
        m = _model()
        opt = sparsync.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.01), m, overlap=overlap, check_nan=check
        )
        setups[name] = (m, opt)
    g = torch.Generator().manual_seed(rank)
    out = []
    for _ in range(repeats):
        times: dict[str, list[float]] = {k: [] for k in setups}
        for step in range(steps):
            x = torch.randn(BATCH, WIDTH, generator=g)
            names = list(setups)
            for name in names[step % len(names) :] + names[: step % len(names)]:  # rotated: no set-up always first
                model, opt = setups[name]
                dist.barrier()
                t0 = time.perf_counter()
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
                if step >= WARMUP:
                    times[name].append(time.perf_counter() - t0)
        out.append({k: statistics.median(v) for k, v in times.items()})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, default=4, help="ranks (default 4)")
    ap.add_argument(
        "--steps", type=int, default=30, help=f"steps per set-up and repeat (default 30, {WARMUP} warm-up)"
    )
    ap.add_argument("--repeats", type=int, default=3, help="repeats (default 3)")
    ap.add_argument("--out", type=Path, default=None, help="write the medians and ratios here as JSON")
    a = ap.parse_args()
    per_rank = sparsync.launch(step_times, nprocs=a.procs, args=(a.steps, a.repeats), timeout=1200)
    print(f"{LAYERS} x Linear({WIDTH}, {WIDTH}), {BATCH} samples per rank, P = {a.procs}, loopback, SGD")
    rows = []
    for k in range(a.repeats):
        worst = {name: max(r[k][name] for r in per_rank) for name in per_rank[0][k]}
        rows.append(worst)
        cells = ", ".join(f"{n} {t * 1e3:.1f} ms ({t / worst['ddp']:.2f}x ddp)" for n, t in worst.items())
        print(f"  repeat {k + 1}: {cells}")
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(
            json.dumps({"procs": a.procs, "steps": a.steps, "warmup": WARMUP, "repeats": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
