"""every rank fails the same way, at once. Tensors of one size but different shapes or
layouts, ranks whose auto would choose from different link models or policies, and ±Inf (refused like NaN
unless check_nan=False, then summed as IEEE 754 says) raise the same ValueError on every rank of a real gloo
group, well before the timeout, and the group keeps working."""

from __future__ import annotations

import math
from typing import Any

import _fingerprint_workers as fw
import pytest

from sparsync import launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return launch(fw.fingerprint_worker, nprocs=3, timeout=120)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("dense_shape", r"shape mismatch across ranks: rank 0 passed shape \(5, 2\), rank 1 shape \(2, 5\)"),
        ("coo_shape", r"shape mismatch across ranks: rank 0 passed shape \(4, 6\), rank 1 shape \(2, 2, 6\)"),
        ("grouped_shape", "shape mismatch across ranks"),
        ("link", "auto's inputs differ across ranks: rank 1 uses another link model or policy"),
        ("policy", "auto's inputs differ across ranks: rank 1"),
        ("inf", r"rank 0 contributed \+Inf \(at vector index 1\)"),
        ("nan", r"rank 1 contributed NaN \(at vector index 0\)"),
        ("skipped", r"dim mismatch across ranks: rank 0 has dim=4, rank 1 has dim=6"),
        ("reordered", r"dim mismatch across ranks: rank 0 has dim=4, rank 1 has dim=6"),
        ("site", r"call site mismatch across ranks: rank 2's call was issued from another line than rank 0's"),
        ("site_reduce", r"call site mismatch across ranks: rank 2's call"),
        ("site_replica", r"call site mismatch across replicas: replica 2's call"),
        ("stateful_policy", r"auto chose different algorithms across ranks: rank 0 chose dense, rank 1 chose"),
        ("unvalidated", r"rank 1 passed index 10 at position 0, out of range \[0, 10\)"),
    ],
)
def test_the_same_error_on_every_rank_at_once(results: list[dict[str, Any]], case: str, message: str) -> None:
    import re

    errors = [r[case].get("error", "no error") for r in results]
    for rank, e in enumerate(errors):
        assert re.search(message, e), f"rank {rank}: {e}"
        assert f"seen on rank {rank}" in e or f", {rank}, called from" in e or case in ("inf", "nan")
    assert max(r[case]["seconds"] for r in results) < 10.0  # not the 20 s timeout
    assert all(r[case]["after"] == [3.0, 3.0, 3.0] for r in results)


def test_calls_from_two_lines_pair_up_when_named(results: list[dict[str, Any]]) -> None:
    """The same two lines with the same name= on every rank: the ranks meant them as one call."""
    assert all(r["site_named"]["ok"] == [4.0] * 4 for r in results)


def test_inf_sums_as_ieee_when_asked(results: list[dict[str, Any]]) -> None:
    for r in results:
        first, second = r["inf_ieee"]["ok"]
        assert first == 3.0 and math.isnan(second)  # +Inf + -Inf + 0 is NaN (IEEE 754)
