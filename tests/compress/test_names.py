"""``name=`` and ``check_nan`` are agreed across ranks by every reduction, not only the sparse collectives: two
same-shape gradients swapped on one rank raise the same ValueError on every rank (compressed_allreduce on each
of its paths, the ``Compressed`` placement through ``DistributedOptimizer``, the Replicator's primitives), and a
rank that asked for the NaN check never gets NaN back. Real gloo groups of 3 ranks."""

from __future__ import annotations

from typing import Any

import _names_workers as nw
import pytest

from sparsync import launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

Results = list[dict[str, tuple[str, Any]]]


@pytest.fixture(scope="module")
def results() -> Results:
    return launch(nw.worker, nprocs=nw.WORLD, args=(list(nw.CASES),), timeout=120)


def _raised_everywhere(results: Results, case: str, pattern: str) -> None:
    import re

    got = [r[case] for r in results]
    assert all(kind == "ValueError" and re.search(pattern, msg) for kind, msg in got), got


SWAPS = [c for c in nw.CASES if c.startswith(("reduce_", "optimizer_", "primitive_"))]


@pytest.mark.parametrize("case", SWAPS)
def test_swapped_named_calls_raise_on_every_rank(results: Results, case: str) -> None:
    """Rank 1 issues the two named calls in the other order: the same ValueError naming the mismatch everywhere
    (unnamed, or with the name left out of the metadata, they pair up silently: wrong sums)."""
    _raised_everywhere(results, case, r"name mismatch")


def test_ddp_hook_refuses_swapped_parameters_on_every_rank(results: Results) -> None:
    """The DDP compression hook reduces each gradient under its parameter's name: a rank whose two same-shape
    layers are registered in another order raises on every rank (DDP re-raises the hook's ValueError from
    backward() as a RuntimeError with its message) instead of summing one layer's gradient into the other's."""
    got = [r["hook_fp16"] for r in results]
    assert all(kind in ("ValueError", "RuntimeError") and "name mismatch" in msg for kind, msg in got), got


@pytest.mark.parametrize("case", [c for c in nw.CASES if c.startswith("nan_")])
def test_nan_never_reaches_a_rank_that_asked_for_the_check(results: Results, case: str) -> None:
    """NaN on rank 1 with check_nan=False there, True elsewhere: every rank raises (the ranks disagree about
    check_nan), and no rank that asked for the check gets NaN back."""
    _raised_everywhere(results, case, r"check_nan")


@pytest.mark.parametrize("case", ["check_nan_differs_reduce", "check_nan_differs_primitive"])
def test_check_nan_disagreement_raises_on_every_rank(results: Results, case: str) -> None:
    _raised_everywhere(results, case, r"check_nan mismatch .*(rank|replica) 2")


@pytest.mark.timeout(120)
def test_bad_stream_raises_on_its_rank_and_the_others_time_out() -> None:
    """What README promises for a bad SparseStream: its constructor raises ValueError naming the index on the
    rank that built it (a constructor cannot reach the other ranks); the others get PeerError after their
    timeout, never a hang or a wrong sum."""
    res = launch(nw.bad_stream, nprocs=nw.WORLD, timeout=60)
    assert res[1][0] == "ValueError" and "99" in res[1][1], res
    assert [res[r][0] for r in (0, 2)] == ["PeerError", "PeerError"], res
