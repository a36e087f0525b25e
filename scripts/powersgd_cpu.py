"""The CPU one PowerSGD hook call costs on a DDP bucket, with no communication (one rank): torch's
``powerSGD_hook`` against sparsync's ``compression_hook(PowerSGD(rank), ErrorFeedback())``, on one bucket holding
all the gradients of a ``sparsync bench tta`` model (as the bench configures torch's hook), rank 2, error feedback,
warm start, one intra-op thread (what each of ``tta``'s 4 ranks gets on 2 cores). The hooks take turns, ``calls``
calls each per round, so that whatever else the host runs falls on both alike.

    python scripts/powersgd_cpu.py --out docs/data/tta_powersgd_cpu --label after
    PYTHONPATH=<an older tree>/src python scripts/powersgd_cpu.py --out ... --label before

``--profile``: also write OUT_profile.txt, cProfile's top functions over 10 calls of sparsync's hook on the
first model's bucket, run on the calling thread (``async_op=False``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

from sparsync.compress import ErrorFeedback, PowerSGD
from sparsync.compress.hooks import compression_hook
from sparsync_bench import tta
from sparsync_bench.grad_bucket import GradBucket


def hooks(model: torch.nn.Module, rank: int) -> dict[str, Callable[[GradBucket], Any]]:
    state = torch_psgd.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=2, random_seed=0)
    ours = compression_hook(PowerSGD(rank=rank, start_iter=2), ErrorFeedback(), module=model)
    return {
        "torch powerSGD_hook": lambda b: torch_psgd.powerSGD_hook(state, b),
        "sparsync hook": lambda b: ours(None, b),
    }


def measure(model_name: str, rank: int, rounds: int, calls: int) -> list[dict[str, Any]]:
    model = tta.build_model(tta.MODELS[model_name], 0)
    params = list(model.parameters())[::-1]  # DDP's order
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    runs = hooks(model, rank)
    for fn in runs.values():
        for _ in range(4):  # past start_iter, warm-started
            fn(GradBucket(params, grads)).wait()
    timed: dict[str, list[float]] = {label: [] for label in runs}
    for _ in range(rounds):
        for label, fn in runs.items():
            for _ in range(calls):
                b = GradBucket(params, grads)
                t0 = time.perf_counter()
                fn(b).wait()
                timed[label].append(time.perf_counter() - t0)
    numel = sum(g.numel() for g in grads)
    return [
        {"model": model_name, "hook": label, "rank": rank, "numel": numel, "calls": len(ts),
         "min_ms": 1e3 * min(ts), "median_ms": 1e3 * statistics.median(ts)}
        for label, ts in timed.items()
    ]  # fmt: skip


def profile(model_name: str, rank: int) -> str:
    """cProfile's top 20 functions (by own time) over 10 calls of sparsync's hook, on this thread."""
    model = tta.build_model(tta.MODELS[model_name], 0)
    params = list(model.parameters())[::-1]
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    hook = compression_hook(PowerSGD(rank=rank, start_iter=2), ErrorFeedback(), module=model, async_op=False)
    for _ in range(4):
        hook(None, GradBucket(params, grads)).wait()
    prof = cProfile.Profile()
    for _ in range(10):
        b = GradBucket(params, grads)
        prof.enable()
        hook(None, b).wait()
        prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(20)
    return out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="lm,transformer")
    ap.add_argument("--rank", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", required=True, help="path stem for .json and .md")
    ap.add_argument("--profile", action="store_true", help="also OUT_profile.txt (cProfile of sparsync's hook)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29731")
    dist.init_process_group("gloo", rank=0, world_size=1)
    rows = [r for m in args.models.split(",") for r in measure(m, args.rank, args.rounds, args.calls)]
    load = os.getloadavg()
    meta = {"label": args.label, "load_average": load, "torch": torch.__version__}
    Path(args.out + ".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [f"# PowerSGD hook CPU per bucket call, one rank ({args.label}; load average {load[0]:.1f})", "",
             "| model | hook | values | min ms | median ms |", "|---|---|---|---|---|"]  # fmt: skip
    lines += [
        f"| {r['model']} | {r['hook']} | {r['numel']} | {r['min_ms']:.1f} | {r['median_ms']:.1f} |" for r in rows
    ]
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if args.profile:
        text = f"{args.label}; load average {os.getloadavg()[0]:.1f}\n" + profile(
            args.models.split(",")[0], args.rank
        )
        Path(args.out + "_profile.txt").write_text(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
