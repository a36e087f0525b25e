"""Each rank's peak memory while a sharded table and its fused Adam (two per-row moments) are saved as one DCP
checkpoint at P ranks (``sparsync.sharding.checkpoint.save``) and loaded at other world sizes (docs/sharding.md):
the most bytes of torch allocations held at once beyond what the rank held before (torch's profiler, every
allocation and free), and the growth of the peak resident set (``VmHWM``, reset before), beside the rank's
shard (the table's rows it owns) and its block (the rows it writes or reads: ``ceil(rows / P)``).

    .venv/bin/python scripts/dcp_peak.py --rows 1000000 --dim 32 --save-at 4 --load-at 3 6 \\
        --out docs/data/dcp_peak.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile

import sparsync
from sparsync.sharding import Adam, checkpoint


def _hwm_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def _measured(fn: Callable[[], object]) -> dict[str, float]:
    """Run ``fn``: its torch allocation peak (bytes), peak RSS growth (bytes) and seconds."""
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the current RSS
    rss0 = _hwm_kb()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    seconds = time.perf_counter() - t0
    rss = (_hwm_kb() - rss0) * 1024
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text())["traceEvents"]
    return {"torch_peak_bytes": _peak([e for e in events if e.get("name") == "[memory]"]), "rss_growth_bytes": rss,
            "seconds": seconds}  # fmt: skip


def _peak(events: list[dict[str, Any]]) -> int:
    """The most bytes live at once in the trace's allocations and frees. A free on another thread (gloo's, which
    drops a finished collective's tensors) is not in the trace: an address allocated again while still live was
    freed in between."""
    live: dict[int, int] = {}
    total = top = 0
    for e in sorted(events, key=lambda e: e["ts"]):
        addr, change = e["args"]["Addr"], e["args"]["Bytes"]
        if change > 0:
            total -= live.pop(addr, 0)  # its free was not recorded
            live[addr] = change
        else:
            live.pop(addr, None)
        total += change
        top = max(top, total)
    return top


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
                r["rss_growth_blocks"] = r["rss_growth_bytes"] / r["block_bytes"]
            torch_worst = max(r["torch_peak_blocks"] for r in res)
            rss_worst = max(r["rss_growth_blocks"] for r in res)
            print(f"{mode} at P = {P}: the worst rank's peak beyond its shards: {torch_worst:.3f} blocks of torch "
                  f"allocations, {rss_worst:.3f} blocks of RSS growth")  # fmt: skip
            runs += res
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
