"""Plans at many ranks with error bars from measurement: ``python -m sparsync_bench.plan_scale OUT.png
--checks RUN.json [...] --plans NAME=PLANS.json [...]``.

``PLANS.json``: ``sparsync plan --json``'s plans of one model on one link, one per cluster size. ``RUN.json``:
``plan_check --out``'s points. Each part kind the checks measured (dense buckets, the grouped sparse call, the
sharded exchange) gets the range of measured / predicted over the checked points with at most ``--max-world``
ranks; a plan's step is then bounded by each part's predicted seconds times its kind's range. Parts of a kind the
checks did not measure (the parameter servers) are left at their prediction and named in the table. With
``--published``, the dense range also spans published / predicted of ``plan_published``'s figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sparsync_bench.report import pyplot, save_figure, write_json_md

KIND_OF_PART = {"dense_allreduce": "dense", "sparse_allreduce": "sparse", "sharded": "sharded"}


def ranges(points: Sequence[dict[str, Any]], max_world: int) -> dict[str, tuple[float, float]]:
    """Per checked part: (least, most) measured / predicted over ``points`` with at most ``max_world`` ranks."""
    out: dict[str, tuple[float, float]] = {}
    for part in sorted(set(KIND_OF_PART.values())):
        r = [pt["measured"][part] / pt["predicted"][part] for pt in points if pt["setting"]["world"] <= max_world]
        if r:
            out[part] = (min(r), max(r))
    return out


def with_published(bars: dict[str, tuple[float, float]], rows: Sequence[dict[str, Any]]) -> None:
    """Widen the dense range by published / predicted of each ``plan_published`` row (NCCL's ring and tree on
    real clusters, which the emulated links do not run). Mutates ``bars``."""
    r = [1 / float(row["ratio"]) for row in rows]
    lo, hi = bars.get("dense", (min(r), max(r)))
    bars["dense"] = (min(lo, *r), max(hi, *r))


def bounded(plan: Mapping[str, Any], bars: Mapping[str, tuple[float, float]]) -> dict[str, Any]:
    """The plan's ranks, predicted step, its (low, high) bounds, and the part kinds left unbounded."""
    c = plan["cluster"]
    lo = hi = 0.0
    unbounded = set()
    for p in plan["step"]:
        part = KIND_OF_PART.get(p["kind"])
        a, b = bars.get(part, (1.0, 1.0)) if part is not None else (1.0, 1.0)
        if part not in bars:
            unbounded.add(p["kind"])
        lo, hi = lo + a * p["seconds"], hi + b * p["seconds"]
    step = plan["step_seconds"]  # a range that excludes the prediction (every ratio above 1) still spans it
    return {"ranks": c["machines"] * c["procs_per_machine"], "step": step, "low": min(lo, step),
            "high": max(hi, step), "parts": sorted({p["kind"] for p in plan["step"]}),
            "unbounded": sorted(unbounded)}  # fmt: skip


def draw(rows: Mapping[str, list[dict[str, Any]]], png: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for name, rs in rows.items():
        xs = [r["ranks"] for r in rs]
        ys = [r["step"] * 1e3 for r in rs]
        err = [[y - r["low"] * 1e3 for y, r in zip(ys, rs, strict=True)],
               [r["high"] * 1e3 - y for y, r in zip(ys, rs, strict=True)]]  # fmt: skip
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks (8 a node)")
    ax.set_ylabel("predicted step communication, ms")
    ax.legend(fontsize=8)
    return save_figure(fig, png, dpi=110)


def table(rows: Mapping[str, list[dict[str, Any]]]) -> str:
    lines = ["| model, link | ranks | parts | step ms | range ms | left at the prediction |",
             "|---|---:|---|---:|---:|---|"]  # fmt: skip
    for name, rs in rows.items():
        for r in rs:
            left = ", ".join(r["unbounded"]) or "-"
            lines.append(f"| {name} | {r['ranks']} | {', '.join(r['parts'])} | {r['step'] * 1e3:.2f} | "
                         f"{r['low'] * 1e3:.2f}-{r['high'] * 1e3:.2f} | {left} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sparsync_bench.plan_scale", description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path, help="OUT.png; OUT.md and OUT.json beside it")
    ap.add_argument("--checks", type=Path, nargs="+", required=True)
    ap.add_argument("--plans", nargs="+", required=True, help="NAME=PLANS.json")
    ap.add_argument("--max-world", type=int, default=8)
    ap.add_argument("--published", type=Path, default=None, help="plan_published's JSON: widens the dense range")
    a = ap.parse_args(argv)
    points = [pt for p in a.checks for pt in json.loads(p.read_text())]
    bars = ranges(points, a.max_world)
    if a.published is not None:
        with_published(bars, json.loads(a.published.read_text()))
    rows = {}
    for spec in a.plans:
        name, _, path = spec.partition("=")
        rows[name] = [bounded(plan, bars) for plan in json.loads(Path(path).read_text())]
    draw(rows, a.out)
    text = table(rows)
    print(text)
    write_json_md(a.out, {"ranges": bars, "plans": rows}, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
