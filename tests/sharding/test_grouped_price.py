"""``plan="auto"`` with the tables' optimizer in backward prices the tables it keeps whole as the replicated
groups run (``sharding.grouped_price``): their sum on the step's path, one header allreduce, a sparse allreduce
only; and chooses by that price (``auto._cheapest``)."""

from __future__ import annotations

import pytest

from sparsync.costmodel import LinkModel, Problem, predict
from sparsync.plan import KINDS, Cluster, ParamStats, make_plan
from sparsync.plan.backend import dense_allreduce
from sparsync.sharding.auto import AUTO_KINDS, AutoPlan, _cheapest, step_cost
from sparsync.sharding.grouped_price import GROUPED_KIND, HEADER_BYTES, grouped_exposed, grouped_seconds
from sparsync.sharding.table_cpu import TableCpu

LINK = LinkModel(alpha=50e-6, beta=1e-8, gamma_sparse=0.0, gamma_dense=0.0, gamma_scatter=0.0)
NAMES = ("t0", "t1")


def _plan(overlap: float, placement: str) -> object:
    """A dense layer and two tables (1% of their rows read), every table on ``placement``, backward ``overlap``
    seconds long."""
    stats = [ParamStats("fc.weight", (256, 256), 1.0, False)]
    stats += [ParamStats(f"{n}.weight", (100_000, 16), 0.01, True, 0.01) for n in NAMES]
    plan = make_plan(stats, Cluster(4, measured=LINK), swap_modules=True, overlap_seconds=overlap,
                     kinds=[KINDS.entry(k) for k in AUTO_KINDS])  # fmt: skip
    return plan.moved({f"{n}.weight": placement for n in NAMES})


def _cpu(fused: bool) -> TableCpu:
    """No CPU for any placement: the communication alone decides."""
    zero = dict.fromkeys(NAMES, 0.0)
    return TableCpu(zero, zero, dict.fromkeys(NAMES, ("g", 0.0)), fused=fused,
                    replicated_group=dict.fromkeys(NAMES, ("r", 0.0)))  # fmt: skip


def test_the_groups_sum_runs_on_the_steps_path_with_one_header_round() -> None:
    plan = _plan(overlap=10.0, placement=GROUPED_KIND)  # backward long enough to hide every hidden part
    parts = plan.step.parts  # type: ignore[attr-defined]
    tables = [p for p in parts if {"t0.weight", "t1.weight"} & set(p.members)]
    assert tables and all(p.hidden for p in tables)
    header = dense_allreduce(HEADER_BYTES, plan.cluster)[1]  # type: ignore[attr-defined]
    on_path = sum(p.seconds for p in parts if not p.hidden)
    # without the groups, every hidden part hides behind backward; with them, the tables' parts do not
    assert plan.step_exposed_seconds == pytest.approx(on_path)  # type: ignore[attr-defined]
    got = grouped_exposed(plan, ["t0.weight", "t1.weight"])  # type: ignore[arg-type]
    assert got == pytest.approx(on_path + sum(p.seconds for p in tables) + header)
    assert grouped_exposed(plan, []) == plan.step_exposed_seconds  # type: ignore[arg-type, attr-defined]
    assert step_cost(plan, _cpu(fused=True)) == pytest.approx(got)  # type: ignore[arg-type]
    assert step_cost(plan, _cpu(fused=False)) == pytest.approx(on_path)  # type: ignore[arg-type]


def test_with_the_optimizer_in_backward_a_table_kept_whole_goes_by_sparse_allreduce_and_may_be_sharded() -> None:
    plan = _plan(overlap=10.0, placement="dense_allreduce")
    unfused = _cheapest(plan, _cpu(fused=False), set())  # type: ignore[arg-type]
    fused = _cheapest(plan, _cpu(fused=True), set())  # type: ignore[arg-type]
    kinds = {n: fused.placement(f"{n}.weight") for n in NAMES}
    # the groups never send a table dense
    assert set(kinds.values()) <= {"sharded", GROUPED_KIND}, kinds
    # backward hides the replicated kinds' reduction: without the groups nothing pays for sharding
    assert all(unfused.placement(f"{n}.weight") != "sharded" for n in NAMES)
    # priced as the groups run, the sharded exchange (on the path) against their sum and header round (on the
    # path too): here sharding is cheaper, and chosen
    whole = step_cost(fused.moved({f"{n}.weight": GROUPED_KIND for n in NAMES}), _cpu(fused=True))
    sharded = step_cost(fused.moved({f"{n}.weight": "sharded" for n in NAMES}), _cpu(fused=True))
    assert sharded < whole
    assert kinds == dict.fromkeys(NAMES, "sharded")
    assert step_cost(fused, _cpu(fused=True)) == pytest.approx(sharded)


def test_the_predicted_step_prices_the_groups_as_the_choice_does() -> None:
    """``AutoPlan.step_seconds`` with the optimizer in backward: the sample's forward and backward plus
    ``step_cost``, so a plan keeping the tables whole predicts their sum on the step's path."""
    plan = _plan(overlap=10.0, placement=GROUPED_KIND)
    distinct = dict.fromkeys(NAMES, (1000.0, 4000))

    def predicted(fused: bool) -> float:
        auto = AutoPlan(plan, distinct, (), 0.25, 0.125, cpu=_cpu(fused))  # type: ignore[arg-type]
        return auto.step_seconds()

    assert predicted(True) == pytest.approx(0.375 + step_cost(plan, _cpu(fused=True)))  # type: ignore[arg-type]
    assert predicted(False) == pytest.approx(0.375 + plan.exposed_seconds)  # type: ignore[attr-defined]
    assert predicted(True) > predicted(False)


def test_the_groups_sum_is_priced_by_the_allgather_they_run() -> None:
    """At 16 ranks reading 20% of the rows the planner's sparse allreduce is the split allgather; the groups run
    the allgather (``replicated.SUM_ALGORITHM``), which receives every rank's rows: that is their price."""
    stats = [ParamStats("fc.weight", (256, 256), 1.0, False)]
    stats += [ParamStats(f"{n}.weight", (100_000, 16), 0.2, True, 0.2) for n in NAMES]
    plan = make_plan(stats, Cluster(16, measured=LINK), swap_modules=True, overlap_seconds=10.0,
                     kinds=[KINDS.entry(k) for k in AUTO_KINDS])  # fmt: skip
    plan = plan.moved({f"{n}.weight": GROUPED_KIND for n in NAMES})
    (part,) = [p for p in plan.step.parts if p.kind == GROUPED_KIND]
    assert part.algorithm == "ssar_split_allgather"
    # the reference: one sparse allreduce of both tables' rows (200,000 rows of 16 float32, int32 indices), each
    # rank holding 20% of each table's, by the allgather
    k = 2 * 20_000
    want = predict("allgather", Problem(16, 200_000, (k,) * 16, 4 * 16, 4, row=16), LINK)
    assert grouped_seconds(plan, part) == pytest.approx(want)
    assert want > 2 * part.seconds  # every rank's rows to every rank: here dearer than the split allgather
    header = dense_allreduce(HEADER_BYTES, plan.cluster)[1]
    on_path = sum(p.seconds for p in plan.step.parts if not p.hidden)
    got = grouped_exposed(plan, [f"{n}.weight" for n in NAMES])
    assert got == pytest.approx(on_path + want + header)
