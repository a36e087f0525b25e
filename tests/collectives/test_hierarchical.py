"""Hierarchical sparse allreduce on real gloo groups of emulated hosts (``launch(procs_per_host=)``,
loopback): exact against a dense allreduce at every mode, density and width, bitwise the same on every rank;
the two-level model's choice; hosts of unequal size refused with a message."""

from __future__ import annotations

import re
from typing import Any

import _hier_workers as hw
import pytest

from sparsync import launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

# (world size, ranks per host): one host, hosts of one rank (degenerate: flat), 2 x 2, 2 x 3.
LAYOUTS = ((1, 1), (3, 1), (5, 1), (4, 2), pytest.param(6, 3, marks=pytest.mark.large))


@pytest.mark.parametrize(("world", "per_host"), LAYOUTS, ids=lambda v: str(v))
def test_exact_at_every_mode_density_and_width(world: int, per_host: int) -> None:
    results: list[dict[str, Any]] = launch(
        hw.exact_worker, nprocs=world, args=(per_host,), procs_per_host=per_host
    )
    hosts = world // per_host
    assert sorted(r["topology"] for r in results) == sorted(
        (h, hosts, j, per_host) for h in range(hosts) for j in range(per_host)
    )
    keys = results[0]["cases"].keys()
    assert len(keys) == len(hw.MODES) * len(hw.DENSITIES) * len(hw.WIDTHS) * len(hw.DTYPES)
    for key in keys:
        got = [r["cases"][key] for r in results]
        assert all(g[0] for g in got), (
            f"{key}: not the dense sum on ranks {[i for i, g in enumerate(got) if not g[0]]}"
        )
        assert all(g[1] == got[0][1] for g in got), f"{key}: ranks disagree"
        assert all(g[3] for g in got), f"{key}: dimension, row width or dtype changed"
        mode = key[0]
        ran = {g[2] for g in got}
        if hosts == 1 or per_host == 1 or mode == "flat":
            assert "hierarchical" not in ran and len(ran) == 1, (key, ran)  # one flat algorithm everywhere
        elif mode == "hierarchical":
            assert ran == {"hierarchical"}, (key, ran)


def test_two_level_model_chooses_hierarchical_behind_a_slow_link_on_every_rank() -> None:
    results = launch(hw.choice_worker, nprocs=4, args=(2,), procs_per_host=2)
    for r in results:
        preds = r["preds"]
        assert preds["hierarchical"] < preds["flat"], preds
        assert r["chosen"] == "hierarchical" and r["exact"]
        assert r["decision"]["hierarchical"] < r["decision"]["flat"], r["decision"]
    # Every rank priced the levels alike (the hosts' and cross groups' links averaged over the world) and made
    # the same choice for the tiny call too, whichever it was.
    assert all(r["preds"] == results[0]["preds"] for r in results), [r["preds"] for r in results]
    assert len({r["tiny_chosen"] for r in results}) == 1


def test_hosts_of_unequal_size_are_refused() -> None:
    messages = launch(hw.unequal_worker, nprocs=3, timeout=30)
    assert all("hosts hold different numbers of ranks {0: 2, 1: 1}" in m for m in messages), messages


def test_procs_per_host_must_divide_the_world() -> None:
    with pytest.raises(ValueError, match="procs_per_host=2 does not divide nprocs=3"):
        launch(hw.unequal_worker, nprocs=3, procs_per_host=2)


def test_bad_input_on_one_rank_raises_the_same_error_on_every_rank() -> None:
    results = launch(hw.bad_input_worker, nprocs=4, procs_per_host=2, timeout=60)
    for case in range(2):
        messages = {re.sub(r" \(seen on rank \d+\)", "", r[case]) for r in results}
        assert len(messages) == 1, messages  # the same error, each naming the rank that saw it
    assert "rank 1" in results[0][0] and "NaN" in results[0][0], results[0][0]
    assert "rank 0 has dim=97, rank 2 has dim=98" in results[0][1], results[0][1]
