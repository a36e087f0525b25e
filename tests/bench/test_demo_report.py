"""``sparsync demo``'s report without processes: the blocks the runs take turns on, the ratios' spread and
verdict, why a plan won or lost (exact lines from synthetic step parts), why the plan chose its placements,
and the split of a priced step into latency and bandwidth."""

from __future__ import annotations

import dataclasses

import pytest

from sparsync.plan import Cluster, make_plan
from sparsync.plan.detect import ParamStats
from sparsync_bench.demo_plan import predicted_split, predicted_steps, run_compute
from sparsync_bench.demo_report import (
    Spread,
    StepParts,
    block_medians,
    block_ratios,
    block_sizes,
    choice_lines,
    why_line,
)
from sparsync_bench.train_demo import DemoConfig

LINK = "the measured 598 MB/s"
# A sparsync-plan-like step and a dense-allreduce-like one (priced), and a DDP-like one (not priced).
SPARSE = StepParts(step_ms=10.0, compute_ms=1.0, bytes_per_step=0.23e6, bandwidth_ms=0.4, latency_ms=2.0)
DENSE = StepParts(step_ms=30.0, compute_ms=1.0, bytes_per_step=12.6e6, bandwidth_ms=21.0, latency_ms=3.0)
DDP = StepParts(step_ms=7.0, compute_ms=1.0, bytes_per_step=0.21e6, bandwidth_ms=0.35)


def _stats() -> list[ParamStats]:
    emb = ParamStats("emb.weight", (65536, 32), 0.007, True, 0.02)
    return [emb, ParamStats("mlp.0.weight", (64, 32), 1.0, False), ParamStats("mlp.0.bias", (64,), 1.0, False)]


def test_blocks_cut_the_timed_steps_and_a_short_remainder_joins_the_last() -> None:
    assert block_sizes(150, 5, 10) == [10] * 13 + [15]
    assert block_sizes(12, 2, 2) == [2] * 5
    assert block_sizes(12, 2, 20) == [10]  # fewer timed steps than a block: one block of all of them
    with pytest.raises(ValueError, match="block=0"):
        block_sizes(12, 2, 0)
    assert block_medians([99, 99, 1, 3, 2, 5, 6, 7, 100], 2, [3, 3]) == [2, 6]


def test_demo_config_names_a_bad_block() -> None:
    with pytest.raises(ValueError, match=r"block must be >= 1 step .*got 0"):
        DemoConfig(block=0)


def test_demo_config_names_the_warm_up_bound_on_steps() -> None:
    with pytest.raises(ValueError, match=r"steps must exceed the 5 warm-up steps .*got 5$"):
        DemoConfig(steps=5)
    assert DemoConfig(steps=6).steps == 6


def test_ratios_are_taken_block_by_block_and_a_run_that_is_another_is_left_out() -> None:
    runs = [{"run": "dense", "block_ms": [30.0, 60.0]}, {"run": "ddp_sparse", "block_ms": [10.0, 20.0]},
            {"run": "sparse", "block_ms": [5.0, 30.0]},
            {"run": "auto", "block_ms": [5.0, 30.0], "same_as": "sparse"}]  # fmt: skip
    assert block_ratios(runs) == {("dense", "ddp_sparse"): [3.0, 3.0], ("sparse", "ddp_sparse"): [0.5, 1.5],
                                  ("sparse", "dense"): [1 / 6, 0.5]}  # fmt: skip
    s = Spread.of([0.5, 1.5, 0.9])
    assert (s.median, s.low, s.high, s.blocks, s.verdict) == (0.9, 0.5, 1.5, 3, "tie")
    assert Spread.of([0.3, 0.9]).verdict == "won" and Spread.of([1.1, 2]).verdict == "lost"
    assert Spread.of([1.0]).verdict == "tie"  # exactly 1 is not a win
    with pytest.raises(ValueError, match="at least one block"):
        Spread.of([])


def test_a_win_names_the_part_that_saved_the_most() -> None:
    # bandwidth -20.6 ms, latency -1, unpriced rest (8.6 - 2 against 8 - 3) +1.6: the bandwidth won it
    line = why_line("sparsync plan", SPARSE, "dense allreduce", DENSE, Spread(0.34, 0.30, 0.38, 14), LINK)
    assert line == ("sparsync plan vs dense allreduce: won (0.34x, 0.30-0.38): 0.23 MB/step instead of 12.6 MB, "
                    "0.4 ms instead of 21 ms at the measured 598 MB/s")  # fmt: skip


def test_a_loss_against_an_unpriced_run_names_the_measured_rest() -> None:
    # DDP is not priced: the comparison is of the measured rest (step - compute - bandwidth), 8.6 against 5.65
    line = why_line("sparsync plan", SPARSE, "DDP", DDP, Spread(1.30, 1.10, 1.50, 14), LINK)
    assert line == ("sparsync plan vs DDP: lost (1.30x, 1.10-1.50): the rest 8.6 ms instead of 5.7 ms "
                    "(measured: step - compute - bandwidth; sparsync plan priced at 2 ms with infinite "
                    "bandwidth)")  # fmt: skip


def test_a_tie_names_the_largest_difference_either_way() -> None:
    # bandwidth -0.05 ms, latency +4, unpriced rest (8.6 - 6 against 8.55 - 2) -3.95: the latency is the largest
    a = dataclasses.replace(SPARSE, latency_ms=6.0)
    b = StepParts(step_ms=10.0, compute_ms=1.0, bytes_per_step=0.26e6, bandwidth_ms=0.45, latency_ms=2.0)
    line = why_line("auto plan", a, "sparsync plan", b, Spread(0.97, 0.88, 1.03, 14), LINK)
    assert line == ("auto plan vs sparsync plan: tie (0.97x, 0.88-1.03): the steps differ by less than they vary "
                    "block to block; largest difference in their parts: latency 6 ms instead of 2 ms (priced with "
                    "infinite bandwidth)")  # fmt: skip


def test_a_win_ignores_a_larger_part_that_went_the_other_way() -> None:
    # bandwidth +3.15 ms against the rest -7.15 (3.5 against 10.65): the win came from the rest, though this plan
    # sent more bytes
    a = StepParts(step_ms=8.0, compute_ms=1.0, bytes_per_step=2e6, bandwidth_ms=3.5)
    line = why_line("dense allreduce", a, "DDP", dataclasses.replace(DDP, step_ms=12.0), Spread(0.8, 0.7, 0.9, 5),
                    LINK)  # fmt: skip
    assert line == ("dense allreduce vs DDP: won (0.80x, 0.70-0.90): the rest 3.5 ms instead of 11 ms (measured: "
                    "step - compute - bandwidth)")  # fmt: skip


def test_the_plan_says_why_it_placed_the_embedding() -> None:
    plan = make_plan(_stats(), Cluster(4, bandwidth=1.25e8, latency=50e-6))
    emb = plan.entries[0]
    assert emb.placement == "ps"
    lines = choice_lines(plan)
    assert len(lines) == 1  # the dense parameters had no lossless alternative
    assert lines[0].startswith("auto chose parameter server for emb.weight: ")
    alt = emb.candidates["sparse_allreduce"]
    assert lines[0].endswith(f"against {1e3 * alt[1]:.2g} ms and {alt[0] / 1e6:.3g} MB by sparse allreduce, "
                             "the best alternative")  # fmt: skip


def test_a_priced_step_splits_into_latency_and_bandwidth() -> None:
    plan = make_plan(_stats(), Cluster(4, bandwidth=1.25e8, latency=50e-6))
    split, steps = predicted_split(plan), predicted_steps(plan, dict.fromkeys(("dense", "sparse", "auto"), 0.0))
    assert split.keys() == steps.keys() == {"dense", "sparse", "auto"}
    for run, (latency, bandwidth) in split.items():
        assert latency > 0 and bandwidth > 0
        assert latency + bandwidth == pytest.approx(steps[run])
    assert split["auto"][0] > 6 * 50e-6  # the hybrid on a nominal link: the servers' six latencies, and more
    assert split["dense"][1] > 20 * split["sparse"][1]  # the densified embedding's bytes
    fast = make_plan(_stats(), Cluster(4, bandwidth=1e15, latency=50e-6))  # bandwidth all but infinite
    for latency, bandwidth in predicted_split(fast).values():
        assert 0 <= bandwidth < 1e-4 * latency


def test_each_run_has_its_own_local_work() -> None:
    """The dense run adds its densify, bucket and dense update; the automatic plan's is that of the run it
    equals (the hybrid's: forward and backward, its servers update the embedding)."""
    hybrid = make_plan(_stats(), Cluster(4, bandwidth=1.25e8, latency=50e-6))
    assert {e.placement for e in hybrid.entries} == {"ps", "dense_allreduce"}
    assert run_compute(1.0, 5.0, hybrid) == {"dense": 6.0, "ddp_sparse": 1.0, "sparse": 1.0, "auto": 1.0}
    all_dense = make_plan(
        _stats(), Cluster(4, bandwidth=1.25e8, latency=50e-6), overrides={"emb.weight": "dense_allreduce"}
    )
    assert run_compute(1.0, 5.0, all_dense)["auto"] == 6.0
    sparse = make_plan(
        _stats(), Cluster(4, bandwidth=1.25e8, latency=50e-6), overrides={"emb.weight": "sparse_allreduce"}
    )
    assert run_compute(1.0, 5.0, sparse)["auto"] == 1.0
