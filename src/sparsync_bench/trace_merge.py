"""``sparsync trace merge DIR``: the ranks' timelines (``rank<r>.json``, written by ``sparsync.trace`` or
``SPARSYNC_TRACE``) on one clock in ``DIR/merged.json`` (opens in Perfetto / chrome://tracing), and a picture
of the slowest step, ranks as rows.

**One clock.** A timeline's zero is ``perf_counter`` at its start. With ``clock = "barrier"`` every rank read it
as it left one barrier, so the zeros are one instant (to the barrier's exit skew, tens of µs on one host) and
the ranks need no shift. Otherwise each rank's zero is placed by the ``time.time()`` it read with it: exact on
one host, NTP's accuracy across hosts.

**Waiting vs communication.** A collective cannot finish before its last rank arrives: of a call's time on rank
r, the part before the last rank started the same call is waiting (for a slower peer), the rest is the
exchange itself. The k-th call of a group is the same call on every rank (a group's calls run in issue order).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparsync_bench.report import pyplot, save_figure

MERGED = "merged.json"
PICTURE = "slowest_step.png"


def load_ranks(directory: Path) -> list[dict[str, Any]]:
    """Every ``rank<r>.json`` in ``directory``, by rank; ValueError naming what is missing or malformed."""
    files = sorted(directory.glob("rank*.json"), key=lambda p: int(p.stem[4:]) if p.stem[4:].isdigit() else -1)
    if not files:
        raise ValueError(f"no rank*.json timelines in {directory} (run with SPARSYNC_TRACE={directory})")
    out = []
    for f in files:
        try:
            data = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{f} is not JSON: {e}") from e
        if not isinstance(data, dict) or "traceEvents" not in data or "otherData" not in data:
            raise ValueError(f"{f} is not a sparsync timeline (no traceEvents/otherData)")
        out.append(data)
    ranks = [d["otherData"]["sparsync_rank"] for d in out]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"{directory} holds two timelines of one rank: ranks {ranks}")
    return out


def offsets_us(timelines: list[dict[str, Any]]) -> list[float]:
    """Shift of each timeline onto the common clock (µs): 0 when every rank started at one barrier, else the
    difference of the wall clocks read at the zeros."""
    meta = [t["otherData"] for t in timelines]
    if all(m["clock"] == "barrier" for m in meta):
        return [0.0] * len(meta)
    first = min(m["wall_time_at_zero"] for m in meta)
    return [round((m["wall_time_at_zero"] - first) * 1e6, 3) for m in meta]


def merge(directory: Path) -> dict[str, Any]:
    """The ranks' events on one clock, as one trace-event JSON object (also written to ``DIR/merged.json``)."""
    timelines = load_ranks(directory)
    shifts = offsets_us(timelines)
    events: list[dict[str, Any]] = []
    for t, shift in zip(timelines, shifts, strict=True):
        for e in t["traceEvents"]:
            e = dict(e)
            if "ts" in e:
                e["ts"] = round(e["ts"] + shift, 3)
            events.append(e)
    merged = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "ranks": [t["otherData"]["sparsync_rank"] for t in timelines],
            "clock": "barrier" if not any(shifts) else "wall",
            "offsets_us": shifts,
            "dropped_events": sum(t["otherData"].get("dropped_events", 0) for t in timelines),
        },
    }
    (directory / MERGED).write_text(json.dumps(merged))
    return merged


@dataclass(frozen=True)
class Window:
    """The stretch of the merged timeline the picture shows."""

    label: str
    start: float  # µs
    end: float


def slowest_step(merged: dict[str, Any], step: int | None = None, first: int = 0) -> Window:
    """The step (``sparsync.trace_step``) numbered ``first`` or more whose first start to last end over the
    ranks is longest (or step ``step``); the whole timeline when no step was marked."""
    steps: dict[int, list[float]] = {}
    for e in merged["traceEvents"]:
        if e.get("cat") == "step" and e.get("ph") == "X":
            lo_hi = steps.setdefault(e["args"]["step"], [float("inf"), float("-inf")])
            lo_hi[0], lo_hi[1] = min(lo_hi[0], e["ts"]), max(lo_hi[1], e["ts"] + e["dur"])
    if step is not None:
        if step not in steps:
            raise ValueError(f"step {step} is not on the timeline; marked steps: {sorted(steps) or 'none'}")
        return Window(f"step {step}", *steps[step])
    later = {k: v for k, v in steps.items() if k >= first}
    if steps and not later:
        raise ValueError(f"no step numbered {first} or more; marked steps: {min(steps)}..{max(steps)}")
    if later:
        worst, (lo, hi) = max(later.items(), key=lambda kv: kv[1][1] - kv[1][0])
        return Window(f"slowest step ({worst})", lo, hi)
    timed = [e for e in merged["traceEvents"] if e.get("ph") in ("X", "b", "e")]
    if not timed:
        raise ValueError("the timeline holds no events")
    return Window("whole run", min(e["ts"] for e in timed), max(e["ts"] + e.get("dur", 0) for e in timed))


def call_waits(merged: dict[str, Any]) -> dict[tuple[int, float], float]:
    """(rank, start) of each call -> the µs it waited for the last rank to start the same call."""
    by_key: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    counters: dict[tuple[int, str], int] = defaultdict(int)
    calls = sorted((e for e in merged["traceEvents"] if e.get("cat") == "call"), key=lambda e: e["ts"])
    for e in calls:
        group = str(e["args"].get("group", ""))
        k = counters[(e["pid"], group)]
        counters[(e["pid"], group)] += 1
        by_key[(group, k)].append(e)
    out = {}
    for same in by_key.values():
        last = max(e["ts"] for e in same)
        for e in same:
            out[(e["pid"], e["ts"])] = min(e["dur"], last - e["ts"])
    return out


COLORS = {"communication": "#1f77b4", "waiting": "#ff7f0e", "compress": "#2ca02c", "ps": "#9467bd",
          "wait": "#7f7f7f", "backward": "#bcbd22"}  # fmt: skip


def draw(merged: dict[str, Any], png: Path, step: int | None = None, first: int = 0) -> Path:
    """The slowest step, one row per rank (the caller's thread; queued async calls in a thin lane below it):
    each call split into waiting for the last rank and the exchange after it; compressor steps, the caller's
    waits on async handles, parameter-server requests and DistributedOptimizer's backward rounds (whose buckets
    run in the lane below) in their own colours; blank is computation."""
    window = slowest_step(merged, step, first)
    span = window.end - window.start
    waits = call_waits(merged)
    ranks = sorted({e["pid"] for e in merged["traceEvents"]})
    main_tid = {}
    for e in merged["traceEvents"]:
        if e.get("ph") == "M" and e["name"] == "thread_name" and e["args"]["name"] == "MainThread":
            main_tid[e["pid"]] = e["tid"]
    plt = pyplot()
    # constrained layout keeps the figure's legend ("outside", below) clear of the axis label at any number of
    # ranks; the extra 0.5 in holds its two rows
    fig, ax = plt.subplots(figsize=(11, 1.3 + 0.7 * len(ranks)), layout="constrained")
    ms = 1e-3
    for e in merged["traceEvents"]:
        if e.get("ph") not in ("X", "b") or e["ts"] > window.end:
            continue
        end = e["ts"] + e.get("dur", 0)
        if e.get("ph") == "X" and end < window.start:
            continue
        row = ranks.index(e["pid"])
        lane = 0.0 if e["tid"] == main_tid.get(e["pid"], e["tid"]) else 0.42
        y, h = row + lane - 0.2, 0.38 if lane == 0 else 0.2
        x0 = (e["ts"] - window.start) * ms
        cat = e.get("cat")
        if cat == "call":
            w = waits.get((e["pid"], e["ts"]), 0.0)
            ax.broken_barh([(x0, w * ms)], (y, h), color=COLORS["waiting"])
            ax.broken_barh([(x0 + w * ms, (e["dur"] - w) * ms)], (y, h), color=COLORS["communication"])
            visible = min(end, window.end) - max(e["ts"], window.start)
            if visible > 0.12 * span and lane == 0:  # name the calls wide enough to hold it
                mid = (max(e["ts"], window.start) + visible / 2 - window.start) * ms
                ax.text(mid, y + h / 2, e["name"], ha="center", va="center", fontsize=7, color="white")
        elif cat == "step" and e["ts"] <= window.end and end >= window.start:  # the rank's own step
            ax.plot([x0, (end - window.start) * ms], [y - 0.04] * 2, color="black", linewidth=1)
        elif cat == "reduce":
            ax.broken_barh([(x0, e["dur"] * ms)], (y, h), color=COLORS["compress"])
        elif cat == "wait":
            ax.broken_barh([(x0, e["dur"] * ms)], (y, h), color=COLORS["wait"], alpha=0.5)
        elif cat == "backward":  # DistributedOptimizer's round: its buckets (the lane below) start inside it
            ax.broken_barh([(x0, e["dur"] * ms)], (y, h), color=COLORS["backward"], alpha=0.35)
        elif cat == "ps" and e.get("ph") == "b":
            ax.plot([x0], [y + h / 2], marker="|", color=COLORS["ps"])
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_xlim(0, span * ms)
    ax.set_xlabel(f"ms from the start of {window.label} ({span * ms:.1f} ms; black line: each rank's own step)")
    labels = {"communication": "exchange", "waiting": "waiting for the last rank",
              "compress": "compress/decompress", "wait": "caller waits for an async call",
              "ps": "parameter-server request", "backward": "backward, first bucket ready to its end"}  # fmt: skip
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in labels]
    fig.legend(handles, labels.values(), loc="outside lower center", ncol=3, fontsize=8)
    ax.set_title(f"sparsync timeline, {window.label}: ranks as rows (blank: computation)")
    return save_figure(fig, png, dpi=110)


def merge_and_draw(
    directory: Path, step: int | None = None, png: Path | None = None, first: int = 0
) -> tuple[Path, Path]:
    """``sparsync trace merge``: ``DIR/merged.json`` and the picture (``DIR/slowest_step.png`` by default) of
    the slowest step numbered ``first`` or more, or of ``step``."""
    merged = merge(directory)
    return directory / MERGED, draw(merged, png or directory / PICTURE, step, first)
