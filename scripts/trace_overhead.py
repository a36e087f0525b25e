"""Cost of the profiler ranges and of the timeline (docs/profiling.md#cost-of-the-profiler-ranges-and-of-the-timeline): a small call,
``sparsync.allreduce`` of a 1,000-row embedding gradient (COO, rows of 64 float32, a 100,000-row table) at
P = 4 on loopback, in three builds side by side:

- ``off``: the ranges and the tracer's hooks compiled out (``trace.RANGES`` false, as ``SPARSYNC_RANGES=0``
  makes it at import; every hook reads it at call time, so the run flips it between blocks);
- ``ranges``: the default, with no profiler and no timeline active (what every user pays);
- ``timeline``: a timeline recording every call, phase and wait (``sparsync.trace``'s tracer).

One ``launch``: the builds alternate in blocks of ``--block`` calls (rotating which goes first) for
``--blocks`` rounds, so a slow stretch of a shared machine hits all three alike. A block's figure is the
median of rank 0's seconds per call; the overhead of a build is the median over rounds of its block's figure
divided by the ``off`` block's of the same round, minus 1. A microbenchmark adds what the checks cost alone.

    PYTHONPATH=src .venv/bin/python scripts/trace_overhead.py --blocks 40 --block 25 --out results/trace_overhead.md
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import timeit
from pathlib import Path
from typing import Any

MODES = ("off", "ranges", "timeline")
ROWS, TABLE, WIDTH, P = 1000, 100_000, 64, 4


def worker(rank: int, blocks: int, block: int, tmp: str) -> dict[str, list[float]]:
    """Per-block median seconds per call of each build, after 30 warm-up calls."""
    import time

    import torch
    import torch.distributed as dist

    import sparsync
    from sparsync.collectives import trace
    from sparsync.collectives.timeline import set_tracer

    sparsync.set_deterministic()  # one algorithm in every build: the model's choice, not a timed calibration
    g = torch.Generator().manual_seed(rank)
    rows = torch.randperm(TABLE, generator=g)[:ROWS].sort().values
    grad = torch.sparse_coo_tensor(rows[None], torch.randn(ROWS, WIDTH, generator=g), (TABLE, WIDTH)).coalesce()
    for _ in range(30):
        sparsync.allreduce(grad, timeout=120)
    tracer = trace.Tracer(tmp, rank, dist.get_world_size())
    out: dict[str, list[float]] = {m: [] for m in MODES}
    for b in range(blocks):
        for m in MODES[b % 3 :] + MODES[: b % 3]:  # every rank flips at the same call
            trace.RANGES = m != "off"
            set_tracer(tracer if m == "timeline" else None)
            times = []
            for _ in range(block):
                t0 = time.perf_counter()
                sparsync.allreduce(grad, timeout=120)
                times.append(time.perf_counter() - t0)
            out[m].append(statistics.median(times))
    trace.RANGES = True
    set_tracer(None)
    if not tracer.to_json()["traceEvents"]:
        raise RuntimeError("the timeline build recorded nothing")
    out.update({f"checks per call: {k}": [v] for k, v in count_checks(lambda: sparsync.allreduce(grad)).items()})
    return out


def count_checks(call: Any, n: int = 10) -> dict[str, float]:
    """How often one call runs each check of the default build (no profiler, no timeline): ``profiling()``
    (per call, phase and algorithm scope), ``tracer()`` (per call), ``Comm.running`` (per call)."""
    from sparsync.collectives import comm, fifo, trace

    counts = {"profiling()": 0, "tracer()": 0, "Comm.running": 0}
    saved = trace.profiling, fifo.tracer, comm.Comm.running

    def wrap(name: str, fn: Any) -> Any:
        def counted(*a: Any, **k: Any) -> Any:
            counts[name] += 1
            return fn(*a, **k)

        return counted

    trace.profiling = wrap("profiling()", saved[0])  # type: ignore[assignment]
    fifo.tracer = wrap("tracer()", saved[1])  # type: ignore[assignment]
    comm.Comm.running = wrap("Comm.running", saved[2])  # type: ignore[method-assign]
    try:
        for _ in range(n):
            call()
    finally:
        trace.profiling, fifo.tracer, comm.Comm.running = saved  # type: ignore[method-assign]
    return {k: v / n for k, v in counts.items()}


def measure(blocks: int, block: int) -> dict[str, list[float]]:
    import sparsync

    with tempfile.TemporaryDirectory() as tmp:
        result: dict[str, list[float]] = sparsync.launch(
            worker, nprocs=P, args=(blocks, block, tmp), timeout=3600
        )[0]
    return result


def check_costs() -> dict[str, float]:
    """ns per check in one process with a 1-rank group, nothing recording."""
    import sparsync

    return sparsync.launch(_check_costs, nprocs=1)[0]


def _check_costs(rank: int) -> dict[str, float]:
    from types import SimpleNamespace

    from sparsync.collectives import comm, trace
    from sparsync.collectives.timeline import tracer

    n = 200_000
    fake = SimpleNamespace(_span=None, op="sparse_allreduce")

    def running() -> None:
        with comm.Comm.running(fake, "allgather"):  # type: ignore[arg-type]
            pass

    return {
        "profiling()": timeit.timeit(trace.profiling, number=n) / n * 1e9,
        "tracer()": timeit.timeit(tracer, number=n) / n * 1e9,
        "Comm.running": timeit.timeit(running, number=n) / n * 1e9,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=40, help="rounds of the three builds")
    ap.add_argument("--block", type=int, default=25, help="calls per build per round")
    ap.add_argument("--out", type=Path, default=None, help="write the markdown table here too")
    args = ap.parse_args()
    per = measure(args.blocks, args.block)
    lines = [
        f"P = {P}, loopback, `sparsync.allreduce` of a {ROWS:,}-row embedding gradient ({TABLE:,} x {WIDTH} "
        f"float32 table, auto on the reference link), {args.blocks} rounds of {args.block} calls per build",
        "",
        "| build | ms/call (median of blocks) | overhead vs off (median of paired ratios) | IQR of ratios |",
        "| --- | --- | --- | --- |",
    ]
    for m in MODES:
        ratios = sorted(x / o - 1 for x, o in zip(per[m], per["off"], strict=True))
        q1, q3 = ratios[len(ratios) // 4], ratios[3 * len(ratios) // 4]
        lines.append(
            f"| {m} | {statistics.median(per[m]) * 1e3:.3f} | {100 * statistics.median(ratios):+.2f}% "
            f"| {100 * q1:+.1f}% .. {100 * q3:+.1f}% |"
        )
    costs = check_costs()
    per_call = {k.split(": ")[1]: v[0] for k, v in per.items() if k.startswith("checks per call")}
    total_ns = sum(costs[k] * per_call[k] for k in costs)
    off_ns = statistics.median(per["off"]) * 1e9
    lines += ["", "| check (default build, nothing recording) | ns each (1 rank) | per call | ns per call |",
              "| --- | --- | --- | --- |"]  # fmt: skip
    lines += [f"| `{k}` | {costs[k]:.0f} | {per_call[k]:.1f} | {costs[k] * per_call[k]:.0f} |" for k in costs]
    lines += [f"| total | | | {total_ns:.0f} = {100 * total_ns / off_ns:.3f}% of the off build's call |"]
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
