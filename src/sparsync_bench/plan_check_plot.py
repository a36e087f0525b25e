"""The figure of ``plan_check`` runs: predicted / measured per part against P, one panel per link rate, the
issue's 1.5x band shaded. ``python -m sparsync_bench.plan_check_plot OUT.png RUN.json [RUN.json ...]``."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sparsync_bench.netem import parse_rate
from sparsync_bench.plan_check import PARTS
from sparsync_bench.report import pyplot, save_figure

BAND = 1.5  # the target: predicted within 1.5x of measured


def load(paths: Sequence[Path]) -> dict[str, list[dict[str, Any]]]:
    """The points of ``paths`` (``plan_check --out``'s JSON) by link rate, in P order."""
    by: dict[str, list[dict[str, Any]]] = {}
    for p in paths:
        for pt in json.loads(p.read_text()):
            by.setdefault(pt["setting"]["rate"] or "loopback", []).append(pt)
    return {k: sorted(v, key=lambda pt: pt["setting"]["world"]) for k, v in by.items()}


def _rate(rate: str) -> int:
    return 0 if rate == "loopback" else parse_rate(rate)


def draw(points: dict[str, list[dict[str, Any]]], png: Path) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(points), figsize=(4.2 * len(points), 3.4), sharey=True, squeeze=False)
    for ax, (rate, pts) in zip(axes[0], sorted(points.items(), key=lambda kv: _rate(kv[0])), strict=True):
        ax.axhspan(1 / BAND, BAND, color="0.92", label=f"within {BAND}x")
        ax.axhline(1.0, color="0.6", lw=0.8)
        for part, marker in zip(PARTS, "osD", strict=True):
            xs = [pt["setting"]["world"] for pt in pts]
            ax.plot(xs, [pt["ratio"][part] for pt in pts], marker=marker, label=part)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{rate} links (tc tbf, a netns per rank)")
        ax.set_xlabel("ranks P")
    axes[0][0].set_ylabel("predicted / measured")
    axes[0][0].legend(fontsize=8)
    return save_figure(fig, png, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2:
        print("usage: python -m sparsync_bench.plan_check_plot OUT.png RUN.json [RUN.json ...]", file=sys.stderr)
        return 2
    draw(load([Path(a) for a in args[1:]]), Path(args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
