"""What ``sparsync bench tta`` shows: per model, the target (the dense run's smoothed loss at 3/4 of its steps),
each method's time to reach it, its smoothed loss after the same number of steps, its step time and its bytes;
the targets; a figure of loss against wall time, one curve per method, one panel per model; the markdown.

The loss of a step is the mean over ranks of each rank's batch loss; "smoothed" is the mean of the last
``WINDOW`` steps' losses (one batch per rank is a noisy estimate)."""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from sparsync_bench.fmt import markdown_table
from sparsync_bench.report import Check, pyplot, save_figure, targets_markdown
from sparsync_bench.tables import show_table
from sparsync_bench.tta import METHODS

Rows = list[dict[str, Any]]
WINDOW = 5  # steps averaged in a smoothed loss
SPEEDUP = 0.8  # target: sparsync's best at most this fraction of torch's PowerSGD's and dense DDP's time
DENSE = "ddp"


def smoothed(loss: list[float]) -> list[float]:
    return [statistics.fmean(loss[max(0, i - WINDOW + 1) : i + 1]) for i in range(len(loss))]


def step_ms(times: list[float]) -> float:
    """The median step, leaving out the first two (DDP's bucket rebuild, the compressors' first calls)."""
    steps = [b - a for a, b in itertools.pairwise(times)][1:] or [times[-1]]
    return 1e3 * statistics.median(steps)


def analyse(rows: Rows) -> Rows:
    """The rows with ``target``, ``time_to_target_s`` (None: not reached), ``final_loss``, ``ms_per_step``,
    ``over_dense_step`` (step / dense's), per model."""
    out: Rows = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        dense = next((r for r in mine if r["method"] == DENSE), mine[0])
        target = smoothed(dense["loss"])[max(0, (3 * dense["steps"]) // 4 - 1)]
        dense_ms = step_ms(dense["times_s"])
        for r in mine:
            s = smoothed(r["loss"])
            hit = next((i for i, v in enumerate(s) if v <= target), None)
            ms = step_ms(r["times_s"])
            out.append({**r, "target": target, "final_loss": s[-1], "ms_per_step": ms,
                        "over_dense_step": ms / dense_ms,
                        "time_to_target_s": None if hit is None else r["times_s"][hit],
                        "steps_to_target": None if hit is None else hit + 1})  # fmt: skip
    return out


def _sparsync(r: dict[str, Any]) -> bool:
    return METHODS[r["method"]].kind in ("hook", "opt")


def _ttt(r: dict[str, Any]) -> float:
    t = r["time_to_target_s"]
    return float("inf") if t is None else float(t)


def check_targets(rows: Rows) -> list[Check]:
    checks: list[Check] = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        ours = [r for r in mine if _sparsync(r)]
        if not ours:
            continue
        best = min(ours, key=_ttt)
        for rival in ("torch-powersgd", DENSE):
            theirs = [r for r in mine if r["method"] == rival or r["method"].startswith(rival + "-r")]
            if not theirs:
                continue
            ref = min(theirs, key=_ttt)
            checks.append(_versus(model, best, ref))
        for r in ours:
            checks.append((f"{model}: {r['method']} step ≤ dense DDP's", r["over_dense_step"] <= 1.0,
                           f"{r['over_dense_step']:.2f}x"))  # fmt: skip
    return checks


def _versus(model: str, best: dict[str, Any], ref: dict[str, Any]) -> Check:
    """sparsync's best against ``ref`` (the rival's best): met when it reaches the target in at most SPEEDUP of
    the rival's time, or reaches it where the rival does not."""
    name = f"{model}: sparsync's best to target ≤ {SPEEDUP}x {ref['method']}"
    if best["time_to_target_s"] is None:
        return (name, False, f"{best['method']}: not reached")
    if ref["time_to_target_s"] is None:
        return (name, True, f"{best['method']}: {_ttt(best):.1f} s, {ref['method']}: not reached")
    ratio = _ttt(best) / _ttt(ref)
    return (name, ratio <= SPEEDUP, f"{best['method']}: {ratio:.2f}x")


def _fmt_t(r: dict[str, Any]) -> str:
    t = r["time_to_target_s"]
    return "not reached" if t is None else f"{t:.1f} s ({r['steps_to_target']})"


HEAD = ("model", "method", "time to target (steps)", "loss at last step", "ms/step", "x dense step", "MB/step")


def _cells(r: dict[str, Any]) -> list[str]:
    return [r["model"], r["method"], _fmt_t(r), f"{r['final_loss']:.3f}", f"{r['ms_per_step']:.0f}",
            f"{r['over_dense_step']:.2f}", f"{r['bytes_per_step'] / 1e6:.2f}"]  # fmt: skip


def print_table(rows: Rows, console: Console, title: str) -> None:
    table = Table(title=title)
    for c in HEAD:
        table.add_column(c, justify="left" if c in ("model", "method") else "right")
    for r in rows:
        table.add_row(*_cells(r))
    show_table(console, table)


def plot(rows: Rows, out: Path, title: str) -> Path:
    plt = pyplot()
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        mine = [r for r in rows if r["model"] == model]
        colors = plt.get_cmap("tab20").colors
        for i, r in enumerate(mine):
            ax.plot(r["times_s"], smoothed(r["loss"]), label=r["method"], color=colors[i % len(colors)],
                    lw=2.2 if r["method"] == DENSE else 1.2, ls="-" if _sparsync(r) else "--")  # fmt: skip
        ax.axhline(mine[0]["target"], color="grey", ls=":", lw=1, label="target")
        ax.set_title(f"{model} (dashed: torch's DDP and hooks; solid: sparsync)")
        ax.set_xlabel("wall time (s)")
        ax.set_ylabel(f"loss (mean of last {WINDOW} steps)")
        ax.legend(fontsize=7)
    fig.suptitle(title)
    return save_figure(fig, out.with_suffix(".png"), dpi=110)


def markdown(rows: Rows, checks: list[Check], title: str) -> str:
    lines = [f"# Time to accuracy: {title}", "",
             "Target: the dense DDP run's loss (mean of the last 5 steps) at 3/4 of its steps. Time to target is "
             "the method's own clock on rank 0 (the sum of its steps' wall times: the methods take turns, block "
             "by block) at the first step whose smoothed loss reaches the target; the loss at the last step is "
             "the same smoothed loss after as many steps as dense. ms/step: the median step, the first two left "
             "out. MB/step: bytes each rank's link interface sent per step.", ""]  # fmt: skip
    lines += markdown_table(list(HEAD), [_cells(r) for r in rows])
    return "\n".join(lines + targets_markdown(checks, "Targets") + [""])
