"""Where a DistributedOptimizer step goes, from a ``SPARSYNC_TRACE`` directory (docs/optimizer.md#reduction-during-backward):
per rank, over the steps numbered ``--from-step`` or more that hold a ``backward`` round, the medians of the
step, the end of backward's round and of the last bucket (ms from the step's start), and the metadata rounds'
time (``meta`` and ``header`` phases) as a share of the step. A ``meta`` phase that sent all of its call's bytes
carried the payload inline (``collectives.meta``: an allgather's rows ride in the metadata round, one round in
all): it is the call's data round, counted apart ("payload inline"), not as a metadata round.

    .venv/bin/python scripts/overlap_timeline.py /tmp/dlrm_trace --from-step 5 --out docs/data/dlrm_overlap_p4_timeline.md
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def rank_rows(path: Path, first: int) -> dict[str, float]:
    ev = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    rows: dict[str, list[float]] = {
        "step": [], "backward_end": [], "buckets_end": [], "meta": [], "share": [], "inline": []
    }  # fmt: skip
    for st in (e for e in ev if e.get("cat") == "step" and e["args"]["step"] >= first):
        a, b = st["ts"], st["ts"] + st["dur"]
        inside = [e for e in ev if a <= e["ts"] < b]
        rounds = [e for e in inside if e["name"] == "backward"]
        buckets = [e for e in inside if e["name"].startswith("bucket:")]
        if not rounds or not buckets:
            continue  # another method's step
        calls = [e for e in inside if e.get("cat") == "call"]
        rounds_ = [e for e in inside if e["name"] in ("meta", "header")]
        carried = [e for e in rounds_ if _carries_payload(e, calls)]
        meta = sum(e["dur"] for e in rounds_ if e not in carried)
        rows["inline"].append(sum(e["dur"] for e in carried) / 1e3)
        rows["step"].append(st["dur"] / 1e3)
        rows["backward_end"].append((max(e["ts"] + e["dur"] for e in rounds) - a) / 1e3)
        rows["buckets_end"].append((max(e["ts"] + e["dur"] for e in buckets) - a) / 1e3)
        rows["meta"].append(meta / 1e3)
        rows["share"].append(100 * meta / st["dur"])
    return {k: statistics.median(v) for k, v in rows.items()} | {"steps": float(len(rows["step"]))}


def _carries_payload(phase: dict, calls: list[dict]) -> bool:
    """Whether a ``meta`` phase sent every byte of the call around it (same thread): the payload rode inline."""
    sent = phase.get("args", {}).get("bytes_sent", 0)
    for c in calls:
        if c["tid"] == phase["tid"] and c["ts"] <= phase["ts"] <= c["ts"] + c["dur"]:
            return phase["name"] == "meta" and sent > 0 and sent == c.get("args", {}).get("bytes_sent")
    return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path)
    ap.add_argument("--from-step", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    lines = [
        "| rank | steps | step (ms) | backward's round ends (ms) | last bucket ends (ms) | metadata rounds (ms) | "
        "share of the step | payload inline in a metadata round (ms) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for path in sorted(a.dir.glob("rank*.json"), key=lambda p: int(p.stem[4:])):
        r = rank_rows(path, a.from_step)
        lines.append(
            f"| {path.stem[4:]} | {r['steps']:.0f} | {r['step']:.1f} | {r['backward_end']:.1f} | "
            f"{r['buckets_end']:.1f} | {r['meta']:.1f} | {r['share']:.1f}% | {r['inline']:.1f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out is not None:
        cmd = f"scripts/overlap_timeline.py {a.dir} --from-step {a.from_step} --out {a.out}"
        a.out.write_text(f"Medians per rank (`.venv/bin/python {cmd}`):\n\n" + text)


if __name__ == "__main__":
    main()
