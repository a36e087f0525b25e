"""Time ``sparsync.launch`` of a no-op at P = 1, 3, 5 ranks, ranks forked from the forkserver (the default) and
spawned, in alternating rounds so both see the same load; the first forkserver launch (which starts the server
and imports torch there once) is reported apart.

    .venv/bin/python scripts/launch_start.py --rounds 5 --out docs/data/launch_start.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from sparsync import launch

SIZES = (1, 3, 5)


def noop(rank: int) -> int:
    return rank


def timed(nprocs: int, start_method: str) -> float:
    t0 = time.perf_counter()
    assert launch(noop, nprocs=nprocs, start_method=start_method) == list(range(nprocs))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds per size and method (default 5)")
    ap.add_argument("--out", type=Path, default=Path("results/launch_start.md"), help="a .md and a .json beside")
    args = ap.parse_args()
    first = timed(1, "forkserver")  # starts this process's forkserver
    times: dict[str, dict[int, list[float]]] = {"forkserver": {}, "spawn": {}}
    for r in range(args.rounds):
        for n in SIZES:
            for method in ("spawn", "forkserver") if r % 2 else ("forkserver", "spawn"):
                times[method].setdefault(n, []).append(timed(n, method))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    lines = [
        f"`sparsync.launch` of a no-op, median of {args.rounds} alternating rounds (seconds); the first "
        f"forkserver launch of the process (it starts the server): {first:.2f} s",
        "",
        "| ranks | spawn | forkserver | spawn / forkserver |",
        "| --- | --- | --- | --- |",
    ]
    for n in SIZES:
        s, f = statistics.median(times["spawn"][n]), statistics.median(times["forkserver"][n])
        lines.append(f"| {n} | {s:.2f} | {f:.2f} | {s / f:.1f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps({"first_forkserver": first, "times": times}, indent=1))


if __name__ == "__main__":
    main()
