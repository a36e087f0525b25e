"""Several series of the DLRM grid (``sparsync bench dlrm`` JSON files named ``<prefix>_p<P>_b<B>_<net>.json``,
one prefix per series) as one: per point and method, the median over the series of the step and of the CPU per
step, written as a JSON file of the same form (``<out>_p<P>_b<B>_<net>.json``, the other fields from the first
series) that ``scripts/dlrm_grid_table.py`` reads; each method's steps in every series under ``series_step_s``,
and its step over the floor's in each series under ``series_over_floor`` (the ratio measured within a run).

    .venv/bin/python scripts/dlrm_grid_median.py docs/data/dlrm_grid9 docs/data/dlrm_grid9s2 \\
        docs/data/dlrm_grid9s3 --out docs/data/dlrm_grid9_median
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

FLOOR = "floor_tables_unsent"


def merged(paths: list[Path]) -> dict[str, Any]:
    """The series of one point as one file's content (module doc)."""
    runs = [{r["method"]: r for r in json.loads(p.read_text())["rows"]} for p in paths]
    first = json.loads(paths[0].read_text())
    rows = []
    for method, row in runs[0].items():
        ours = [run[method] for run in runs if method in run]
        steps = [r["step_s"] for r in ours]
        ratios = [run[method]["step_s"] / run[FLOOR]["step_s"] for run in runs if method in run and FLOOR in run]
        out = dict(row, step_s=statistics.median(steps), series_step_s=steps, series_over_floor=ratios)
        cpus = [r["cpu_s"] for r in ours if r.get("cpu_s")]
        if cpus:
            out["cpu_s"] = statistics.median(cpus)
        rows.append(out)
    meta = dict(first["meta"], series=[str(p) for p in paths])
    return {"meta": meta, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prefixes", nargs="+", help="one path prefix per series, e.g. docs/data/dlrm_grid9")
    ap.add_argument("--out", required=True, help="path prefix of the files written")
    a = ap.parse_args()
    for P in (4, 8):
        for B in (128, 512):
            for net in ("loopback", "1gbit"):
                name = f"_p{P}_b{B}_{net}.json"
                paths = [Path(p + name) for p in a.prefixes if Path(p + name).exists()]
                if paths:
                    Path(a.out + name).write_text(json.dumps(merged(paths), indent=1) + "\n")
                    print(f"wrote {a.out + name} from {len(paths)} series")


if __name__ == "__main__":
    main()
