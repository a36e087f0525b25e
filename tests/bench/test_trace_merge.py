"""``sparsync trace merge``'s picture: the legend sits clear of the x-axis label at any number of ranks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sparsync_bench import trace_merge


def _timelines(directory: Path, ranks: int) -> None:
    """One marked step per rank holding one call (the later ranks start it later: the others wait)."""
    for r in range(ranks):
        events = [
            {"name": "thread_name", "ph": "M", "pid": r, "tid": 1, "args": {"name": "MainThread"}},
            {"name": "step", "cat": "step", "ph": "X", "pid": r, "tid": 1, "ts": 0.0, "dur": 1000.0,
             "args": {"step": 0}},
            {"name": "all_reduce:ring", "cat": "call", "ph": "X", "pid": r, "tid": 1, "ts": 100.0 + 10 * r,
             "dur": 500.0, "args": {"group": "0"}},
        ]  # fmt: skip
        doc = {"traceEvents": events, "otherData": {"sparsync_rank": r, "world_size": ranks, "clock": "barrier"}}
        (directory / f"rank{r}.json").write_text(json.dumps(doc))


@pytest.mark.parametrize("ranks", [1, 2, 3, 8])
def test_the_legend_does_not_cover_the_axis_label(
    tmp_path: Path, ranks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The figure as ``draw`` saved it (its layout, its dpi), drawn again by the Agg renderer: the legend's box
    and the x-axis label's box do not overlap, and the legend lies inside the picture."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    saved: list[tuple[Any, int]] = []
    save = trace_merge.save_figure

    def keep(fig: Any, png: Path, *, dpi: int) -> Path:
        saved.append((fig, dpi))
        return save(fig, png, dpi=dpi)

    monkeypatch.setattr(trace_merge, "save_figure", keep)
    _timelines(tmp_path, ranks)
    _, png = trace_merge.merge_and_draw(tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ((fig, dpi),) = saved
    fig.set_dpi(dpi)
    canvas = FigureCanvasAgg(fig)  # the saved figure was closed; draw it again as savefig did
    canvas.draw()
    renderer = canvas.get_renderer()
    (ax,) = fig.axes
    legends = [*fig.legends, *([ax.get_legend()] if ax.get_legend() else [])]
    assert len(legends) == 1
    legend = legends[0].get_window_extent(renderer)
    label = ax.xaxis.label.get_window_extent(renderer)
    assert ax.xaxis.label.get_text() and label.height > 0
    assert not legend.overlaps(label), f"{ranks} ranks: legend {legend} covers the x-axis label {label}"
    assert fig.bbox.contains(legend.x0, legend.y0) and fig.bbox.contains(legend.x1, legend.y1)
