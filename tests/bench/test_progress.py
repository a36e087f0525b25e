"""Progress on a pipe (``sparsync_bench.progress``): plain lines at every tenth of a task, where rich's bar would
print nothing."""

from __future__ import annotations

import io

import pytest

from sparsync_bench.progress import LineProgress, display
from sparsync_bench.report import progress


def test_lines_at_every_tenth_and_at_the_end() -> None:
    out = io.StringIO()
    bar = LineProgress(out)
    task = bar.add_task("dense allreduce", total=150)
    for _ in range(150):
        bar.advance(task)
    lines = out.getvalue().splitlines()
    assert lines == [f"dense allreduce: {15 * k}/150" for k in range(1, 11)]
    other = bar.add_task("P=4", total=3)
    bar.update(other, description="P=4 density 0.1", advance=1)
    assert out.getvalue().splitlines()[-1] == "P=4 density 0.1: 1/3"


def test_a_pipe_gets_lines_and_no_progress_gets_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert isinstance(display(), LineProgress)  # pytest's captured stdout is not a terminal
    with progress(True, "P=3", 4) as update:
        for i in range(4):
            update(f"P=3 point {i}", 1)
    assert capsys.readouterr().out.splitlines() == [f"P=3 point {i}: {i + 1}/4" for i in range(4)]
    with progress(False, "P=3", 4) as update:
        update(None, 4)
    assert capsys.readouterr().out == ""
