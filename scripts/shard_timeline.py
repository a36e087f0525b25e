"""Where a sharded DLRM step goes, from a ``SPARSYNC_TRACE`` directory (docs/sharding.md, the breakdown): per
rank, over the steps that hold an exchange round (``shard:*``: another method's steps are left out), the
medians of the step and of each event's total duration within it: backward, the exchange's rounds (on the
caller's thread) and the MLPs' buckets (on the reducer's lane), in ms.

    SPARSYNC_TRACE=/tmp/tr8 sparsync bench dlrm --procs 8 --net 1gbit --mlp kaggle --steps 20 --batch 512 \\
        --methods sparsync_sharded --out /tmp/prof8
    .venv/bin/python scripts/shard_timeline.py /tmp/tr8 --out docs/data/dlrm_p8_b512_sharded_timeline.md
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

COLUMNS = ("step", "backward", "shard:ids", "shard:rows", "shard:grads", "bucket:0", "bucket:1", "bucket:2")


def rank_row(path: Path) -> dict[str, float]:
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    per: dict[str, list[float]] = {c: [] for c in COLUMNS}
    for st in (e for e in events if e.get("cat") == "step"):
        a, b = st["ts"], st["ts"] + st["dur"]
        inside = [e for e in events if a <= e["ts"] < b]
        if not any(e["name"].startswith("shard:") for e in inside):
            continue
        per["step"].append(st["dur"] / 1e3)
        for c in COLUMNS[1:]:
            per[c].append(sum(e["dur"] for e in inside if e["name"] == c) / 1e3)
    return {c: statistics.median(v) if v else 0.0 for c, v in per.items()} | {"steps": float(len(per["step"]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    lines = ["| rank | steps | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 2) + "|"]
    for path in sorted(a.dir.glob("rank*.json"), key=lambda p: int(p.stem[4:])):
        r = rank_row(path)
        cells = " | ".join(f"{r[c]:.1f}" for c in COLUMNS)
        lines.append(f"| {path.stem[4:]} | {r['steps']:.0f} | {cells} |")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if a.out is not None:
        a.out.write_text(f"Medians per rank, ms (`.venv/bin/python scripts/shard_timeline.py {a.dir}`):\n\n{text}")


if __name__ == "__main__":
    main()
