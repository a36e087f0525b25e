"""``interleave`` without processes: runs take turns block by block, each keeps its own steps and returns its
summary, and every run is closed when one fails."""

from __future__ import annotations

import pytest

from sparsync_bench.interleave import Trainer, interleave


def _run(name: str, steps: int, log: list[str], fail_at: int = -1) -> Trainer:
    log.append(f"{name} set up")
    try:
        yield
        for i in range(steps):
            if i == fail_at:
                raise RuntimeError(f"{name} failed at step {i}")
            log.append(f"{name} {i}")
            yield
    finally:
        log.append(f"{name} closed")
    return {"name": name, "steps": steps}


def test_runs_take_turns_and_each_returns_its_summary() -> None:
    log: list[str] = []
    out, order = interleave({"a": _run("a", 5, log), "b": _run("b", 5, log)}, [1, 2, 2])
    assert out == {"a": {"name": "a", "steps": 5}, "b": {"name": "b", "steps": 5}}
    assert order == ["a", "b", "a", "b", "a", "b"]
    assert log == ["a set up", "b set up", "a 0", "b 0", "a 1", "a 2", "b 1", "b 2", "a 3", "a 4", "b 3", "b 4",
                   "a closed", "b closed"]  # fmt: skip


def test_a_run_longer_or_shorter_than_its_turns_is_named() -> None:
    with pytest.raises(RuntimeError, match="run 'b' has more steps than its turns gave it"):
        interleave({"a": _run("a", 2, []), "b": _run("b", 3, [])}, [2])
    with pytest.raises(RuntimeError, match=r"run 'b' ended before its turns did \(4 steps\)"):
        interleave({"a": _run("a", 4, []), "b": _run("b", 3, [])}, [2, 2])


def test_a_failing_run_closes_the_others() -> None:
    log: list[str] = []
    with pytest.raises(RuntimeError, match="b failed at step 1"):
        interleave({"a": _run("a", 4, log), "b": _run("b", 4, log, fail_at=1)}, [2, 2])
    assert "a closed" in log and "b closed" in log
