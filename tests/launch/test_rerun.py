"""tests/conftest.py's rule: a test whose rank a fatal signal killed runs once more (torch's DDP with sparse
gradients crashes rarely; docs/results_tests.md), and only such a test; a crash that comes back fails it."""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent.parent

INNER = """
import os
import _fault_workers as fw
from sparsync import launch


def test_crashes_once(tmp_path_factory):
    flag = tmp_path_factory.getbasetemp() / "crashed"
    assert launch(fw.crash_once, nprocs=2, args=(str(flag),), timeout=20) == [0, 1]


def test_crashes_always():
    launch(fw.crash_in_native_code, nprocs=2, args=(1,), timeout=20)


RUNS = []


def test_fails_otherwise():
    RUNS.append(1)
    assert len(RUNS) > 1, "an ordinary failure"
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_test_whose_rank_died_of_a_signal_runs_once_more(pytester: pytest.Pytester) -> None:
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-rfER")
    out = result.stdout.str()
    assert result.parseoutcomes() == {"passed": 1, "failed": 2, "rerun": 2}, out
    reruns = [line.split()[1] for line in out.splitlines() if line.startswith("RERUN ")]
    # an ordinary failure is not run again
    assert reruns == ["test_inner.py::test_crashes_once", "test_inner.py::test_crashes_always"], out
    assert "FAILED test_inner.py::test_crashes_always" in out and "PASSED test_inner.py::test_crashes_once" in out
