"""The table of a ``scripts/dlrm_shard_series.sh`` run (docs/results_dlrm.md, "Sharded tables in DLRM's own
script"): per variant and run the median of DLRM's printed ms/it windows after the first (the first 10 iterations
warm up), the median over the runs, and each run against DLRM's own all-to-all in the same run (the variants of a
run follow each other, so the ratio sees the same host).

    .venv/bin/python scripts/dlrm_shard_summary.py /tmp/dlrm_shard_series/loads.txt
"""

from __future__ import annotations

import argparse
import re
import statistics
from pathlib import Path

from sparsync_bench.fmt import markdown_table

BASE = "none"
NAMES = {"none": "DLRM's own all-to-all", "shard": "`--shard`", "shard-fused": "`--shard-fused`"}


def parse(text: str) -> tuple[dict[str, list[float]], dict[str, set[str]]]:
    """variant -> per run the median of its windows after the first; variant -> the losses printed."""
    ms: dict[str, list[float]] = {}
    losses: dict[str, set[str]] = {}
    variant = ""
    for line in text.splitlines():
        head = re.match(r"run \d+ (\S+) load", line)
        if head:
            variant = head.group(1)
            continue
        windows = [float(w) for w in re.findall(r"([0-9.]+) ms/it", line)]
        if variant and len(windows) > 1:
            ms.setdefault(variant, []).append(statistics.median(windows[1:]))
            loss = re.search(r"loss ([0-9.]+)", line)
            losses.setdefault(variant, set()).add(loss.group(1) if loss else "none")
    return ms, losses


def table(ms: dict[str, list[float]], losses: dict[str, set[str]]) -> list[str]:
    base = ms[BASE]
    runs = len(base)
    rows = []
    for v, per_run in ms.items():
        paired = [a / b for a, b in zip(per_run, base, strict=False)]
        med = statistics.median(per_run)
        rows.append(
            [NAMES.get(v, v), *(f"{x:.2f}" for x in per_run), f"{med:.2f}",
             f"{med / statistics.median(base):.2f}x / {statistics.median(paired):.2f}x "
             f"({min(paired):.2f}-{max(paired):.2f})", ", ".join(sorted(losses[v]))]
        )  # fmt: skip
    head = ["variant", *(f"run {i + 1}" for i in range(runs)), "median of runs",
            "vs own: medians / paired (range)", "loss at the last iteration"]  # fmt: skip
    return markdown_table(head, rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("loads", type=Path, help="the series' loads.txt")
    a = ap.parse_args()
    print("\n".join(table(*parse(a.loads.read_text()))))


if __name__ == "__main__":
    main()
