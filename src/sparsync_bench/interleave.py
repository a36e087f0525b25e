"""Training runs that take turns: each run is a generator (a ``Trainer``) that yields once set up and then after
each step, keeping its own model, optimizer, data and step count; ``interleave`` advances them block by block
in a fixed order. Every process of a data-parallel job runs the same turns, so the collectives of the runs (a
constructor's broadcast, every step's reductions, the final ones) line up across processes. ``sparsync
demo`` interleaves its plans so that host drift reaches every plan alike within a block."""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import ExitStack
from typing import Any

# Yields once set up, then after each step; returns its summary.
Trainer = Generator[None, None, dict[str, Any]]
_DONE = object()  # next()'s default: the trainer returned


def interleave(
    trainers: dict[str, Trainer], turns: Sequence[int], after_first: Callable[[], dict[str, Trainer]] | None = None
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Run ``trainers`` (by run id) in turns: each sets up in dict order, then for each length in ``turns``
    each trains that many steps in dict order, then each returns its summary in dict order. ``after_first``:
    called once the first turn is done (the warm-up: ``sparsync demo`` measures its link there, with every
    run's threads and connections up, as in training); the trainers it returns join, set up and take the first
    turn at once, then every turn after. Every replica must call it with the same trainers and turns, so that
    their collectives (DDP's broadcast at set-up, the hybrid's tables, every step's reductions) line up.
    Returns the summaries and the run id of each turn. Closes every trainer on the way out (a trainer's
    ``finally``, e.g. the hybrid's servers' clients)."""
    order: list[str] = []
    running: dict[str, Trainer] = {}
    with ExitStack() as stack:

        def join(new: dict[str, Trainer], first: Sequence[int]) -> None:
            for g in new.values():
                stack.callback(g.close)
            running.update(new)
            for g in new.values():
                next(g)
            for n in first:
                _turn(new, n, order, sum(turns))

        join(trainers, turns[:1])
        if after_first is not None:
            join(after_first(), turns[:1])
        for n in turns[1:]:
            _turn(running, n, order, sum(turns))
        return {run: _summary(run, g) for run, g in running.items()}, order


def _turn(trainers: dict[str, Trainer], n: int, order: list[str], total: int) -> None:
    """``n`` steps of each trainer in dict order; each turn's run id appended to ``order``."""
    for run, g in trainers.items():
        for _ in range(n):
            if next(g, _DONE) is _DONE:
                raise RuntimeError(f"run {run!r} ended before its turns did ({total} steps)")
        order.append(run)


def _summary(run: str, trainer: Trainer) -> dict[str, Any]:
    """The summary ``trainer`` returns once its steps are done (its final reductions run here)."""
    try:
        next(trainer)
    except StopIteration as done:
        summary: dict[str, Any] = done.value
        return summary
    raise RuntimeError(f"run {run!r} has more steps than its turns gave it (a shorter input_fn?)")
