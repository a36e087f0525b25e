"""Overhead of the flight recorder (collectives/flight.py) on a small call, side by side with sparsync built
without it: P = 4 ranks on loopback, each reducing a 1,000-row embedding gradient (``nn.Embedding(1000, 16)``,
a batch of 64 lookups: a sparse COO gradient) with ``sparsync.allreduce`` (``set_deterministic``, so auto never
calibrates). Rounds alternate the two source trees, so both see the same load on a shared host.

    .venv/bin/python scripts/flight_overhead.py --baseline-rev f41d7e6 --rounds 6 --out docs/data/flight_overhead.md

``--baseline-rev``: a commit without the recorder; its ``src`` is extracted to a temporary directory (the compiled
extensions are copied from this tree).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
P = 4


def work(rank: int, calls: int, warmup: int) -> list[float]:
    import torch
    import torch.distributed as dist

    import sparsync

    torch.manual_seed(rank)
    sparsync.set_deterministic()
    emb = torch.nn.Embedding(1000, 16, sparse=True)
    emb(torch.randint(0, 1000, (64,))).sum().backward()
    grad = emb.weight.grad
    assert grad is not None
    times = []
    for i in range(warmup + calls):
        dist.barrier()  # every call starts together: the time is the call's, not a wait for a slow rank
        t0 = time.perf_counter()
        sparsync.allreduce(grad)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def worker(calls: int, warmup: int) -> None:
    import sparsync

    per_rank = sparsync.launch(work, nprocs=P, args=(calls, warmup), timeout=60)
    # a call's time: the slowest rank's, call by call
    slowest = [max(ts) for ts in zip(*per_rank, strict=True)]
    print(json.dumps({"median_s": statistics.median(slowest), "mean_s": statistics.fmean(slowest)}))


def hook_cost(n: int = 20000) -> float:
    """Seconds the recorder adds to one call on the caller's path, timed on the real classes in this process:
    an entry begun, the op set twice, a phase noted, the metadata row copied (28 int64), the guard's wrapper
    and its close. Load on a shared host moves it far less than it moves a P = 4 call."""
    import torch

    sys.path.insert(0, str(ROOT / "src"))  # this tree's sparsync, whatever is installed
    from sparsync.collectives.failure import guard
    from sparsync.collectives.flight import FlightRecorder
    from sparsync.collectives.traffic import Traffic

    rec, row = FlightRecorder(calls=64), torch.zeros(28, dtype=torch.int64)

    def call() -> None:
        e = rec.begin("0", "collective", Traffic())
        assert e is not None
        e.op = "sparse_allreduce"
        e.op = "sparse_allreduce"
        e.phase = "meta"
        e.fingerprint = tuple(row.tolist())

    def bare() -> None:
        Traffic()  # the call builds its Traffic either way

    best = []
    for fn in (guard(rec, call), bare):
        runs = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            runs.append((time.perf_counter() - t0) / n)
        best.append(min(runs))
    return best[0] - best[1]


def baseline_tree(rev: str, into: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    for so in (ROOT / "src" / "sparsync" / "compress").glob("*.so"):
        shutil.copy(so, into / "src" / "sparsync" / "compress" / so.name)
    return into / "src"


def run_once(src: Path, calls: int, warmup: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(src), "TORCH_CPP_LOG_LEVEL": "ERROR"}
    cmd = [sys.executable, __file__, "--worker", "--calls", str(calls), "--warmup", str(warmup)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    result: dict[str, float] = json.loads(out.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-rev", default="f41d7e6", help="a commit without the flight recorder")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--out", type=Path, help="write the results as markdown here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.calls, a.warmup)
        return
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"without recorder": baseline_tree(a.baseline_rev, Path(tmp)), "with recorder": ROOT / "src"}
        rows: dict[str, list[float]] = {k: [] for k in trees}
        for r in range(a.rounds):
            order = list(trees) if r % 2 == 0 else list(trees)[::-1]  # alternate who goes first
            for name in order:
                rows[name].append(run_once(trees[name], a.calls, a.warmup)["median_s"])
                print(f"round {r}: {name}: {rows[name][-1] * 1e6:.0f} us", flush=True)
    added = hook_cost()
    print(f"the recorder's own work per call: {added * 1e6:.2f} us", flush=True)
    base = statistics.median(rows["without recorder"])
    with_ = statistics.median(rows["with recorder"])
    # paired by round: the two runs of a round saw the same load
    paired = [w / b - 1 for w, b in zip(rows["with recorder"], rows["without recorder"], strict=True)]
    lines = [
        "# Flight recorder overhead",
        "",
        "Command: `.venv/bin/python scripts/flight_overhead.py "
        f"--baseline-rev {a.baseline_rev} --rounds {a.rounds} --calls {a.calls} --out docs/data/flight_overhead.md`",
        "",
        f"P = {P} ranks, gloo on loopback, `sparsync.allreduce` of an `nn.Embedding(1000, 16, sparse=True)` "
        f"gradient (64 lookups), {a.calls} timed calls after {a.warmup} per run (a call's time: the slowest "
        "rank's; each call starts after a barrier); the median call per run; runs alternate the two trees.",
        "",
        "| round | without recorder (us) | with recorder (us) | difference |",
        "|---|---|---|---|",
    ]
    for r, (b, w, d) in enumerate(zip(rows["without recorder"], rows["with recorder"], paired, strict=True)):
        lines.append(f"| {r} | {b * 1e6:.0f} | {w * 1e6:.0f} | {d * 100:+.1f}% |")
    lines += [
        "",
        f"Median of the runs: without {base * 1e6:.0f} us, with {with_ * 1e6:.0f} us: "
        f"{(with_ / base - 1) * 100:+.1f}%; "
        f"median of the paired differences {statistics.median(paired) * 100:+.1f}%.",
        "",
        "The recorder's own work per call (`hook_cost`: begin, op, phase, the row's copy, the guard; "
        f"the best of 7 runs of 20,000): {added * 1e6:.2f} us, "
        f"{added / base * 100:.3f}% of the median call without it.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if a.out:
        a.out.write_text(text)


if __name__ == "__main__":
    main()
