"""Each rank's peak memory while a sharded table and its fused Adam (two per-row moments) are saved as one DCP
checkpoint at P ranks (``sparsync.sharding.checkpoint.save``) and loaded at other world sizes (docs/sharding.md):
the most bytes of torch allocations held at once beyond what the rank held before (torch's profiler, every
allocation and free), the Python heap's peak (``tracemalloc``), and the growth of the peak resident set
(``VmHWM``, reset before; a call of its own, without either), beside the rank's shard (the table's rows it
owns) and its block (the rows it writes or reads: ``ceil(rows / P)``).

    .venv/bin/python scripts/dcp_peak.py --rows 1000000 --dim 32 --save-at 4 --load-at 3 6 \\
        --out docs/data/dcp_peak.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

import sparsync
from sparsync.sharding import Adam, checkpoint
from sparsync_bench.op_profile import allocation_peak


def _hwm_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def _measured(fn: Callable[[], object]) -> dict[str, float]:
    """Run ``fn`` three times: alone, its peak RSS growth (bytes) and seconds; under torch's profiler, its torch
    allocation peak (bytes, ``allocation_peak``); under ``tracemalloc``, its Python heap's peak beyond what it
    held before (bytes). Apart, since the profiler's and tracemalloc's own records would count."""
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the current RSS
    rss0 = _hwm_kb()
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    rss = (_hwm_kb() - rss0) * 1024
    peak = allocation_peak(fn)
    tracemalloc.start()
    try:
        fn()
        python = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return {"torch_peak_bytes": peak, "python_peak_bytes": python, "rss_growth_bytes": rss, "seconds": seconds}


def work(rank: int, path: str, mode: str, rows: int, dim: int) -> dict[str, Any]:
    table = nn.ModuleDict({"t": nn.EmbeddingBag(rows, dim, mode="sum", device="meta")})
    model = sparsync.shard(table, seed=3, optimizer=Adam(lr=0.01))
    fused = model["t"].group.fused
    fused.state["exp_avg"].copy_(model["t"].group.flat)
    P = dist.get_world_size()
    fn = (lambda: checkpoint.save(path, model)) if mode == "save" else (lambda: checkpoint.load(path, model))
    out = _measured(fn)
    shard = model["t"].weight
    row = dim * shard.element_size()
    return {"rank": rank, "P": P, "mode": mode, "shard_bytes": shard.numel() * shard.element_size(),
            "block_bytes": -(-rows // P) * row, **out}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--save-at", type=int, default=4)
    ap.add_argument("--load-at", type=int, nargs="+", default=[3, 6])
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/ck"
        for P, mode in [(args.save_at, "save"), *((p, "load") for p in args.load_at)]:
            res = sparsync.launch(work, nprocs=P, args=(path, mode, args.rows, args.dim))
            for r in res:
                r["torch_peak_blocks"] = r["torch_peak_bytes"] / r["block_bytes"]
                r["torch_plus_python_blocks"] = (r["torch_peak_bytes"] + r["python_peak_bytes"]) / r["block_bytes"]
                r["rss_growth_blocks"] = r["rss_growth_bytes"] / r["block_bytes"]
            torch_worst = max(r["torch_plus_python_blocks"] for r in res)
            rss_worst = max(r["rss_growth_blocks"] for r in res)
            print(f"{mode} at P = {P}: the worst rank's peak beyond its shards: {torch_worst:.3f} blocks of torch "
                  f"allocations and Python heap, {rss_worst:.3f} blocks of RSS growth")  # fmt: skip
            runs += res
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
