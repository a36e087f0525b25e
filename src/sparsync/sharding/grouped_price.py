"""What ``plan="auto"`` prices for the tables it keeps whole when their optimizer runs in backward
(``auto_plan(fused=True)``): those tables go in replicated groups (``sharding.replicated``), which

- send their rows by a sparse allreduce, whatever the planner's cheapest replicated kind for the table: a table
  kept whole is priced on ``GROUPED_KIND``, never the dense allreduce;
- sum by the algorithm the groups run (``replicated.SUM_ALGORITHM``, the allgather), not the one the planner
  would pick for the same rows: one call per row width, as the plan's step prices its sparse allreduce
  (``plan.step.grouped_call``); on a two-level cluster, where the plan prices each sparse table its own
  hierarchical call, its price stays the plan's;
- sum over the ranks at the end of backward, where the tables (the model's first layers) leave no backward to
  hide the sum behind: their parts of the step are priced on its path, not behind ``Plan.overlap``;
- open each forward with one header allreduce (every rank's verdict on its ids): one small allreduce, on the
  step's path, whenever any table is kept whole.
"""

from __future__ import annotations

import math
from collections.abc import Collection

from sparsync.plan import Plan
from sparsync.plan.backend import dense_allreduce
from sparsync.plan.step import Part, grouped_call
from sparsync.sharding.replicated import SUM_ALGORITHM

GROUPED_KIND = "sparse_allreduce"
HEADER_BYTES = 64  # a header row per rank: a latency-bound allreduce


def grouped_exposed(plan: Plan, whole: Collection[str]) -> float:
    """``plan.step_exposed_seconds`` with the parts carrying any of ``whole`` (parameter names of tables kept in
    replicated groups) priced as the groups sum (``grouped_seconds``) and on the step's path instead of behind
    backward, plus the groups' header allreduce when ``whole`` is not empty."""
    if not whole:
        return plan.step_exposed_seconds
    parts = plan.step.parts
    grouped = [p for p in parts if p.hidden and not set(p.members).isdisjoint(whole)]
    hidden = sum(p.seconds for p in parts if p.hidden) - sum(p.seconds for p in grouped)
    path = sum(p.seconds for p in parts if not p.hidden) + sum(grouped_seconds(plan, p) for p in grouped)
    return max(0.0, hidden - plan.overlap) + path + dense_allreduce(HEADER_BYTES, plan.cluster)[1]


def grouped_seconds(plan: Plan, part: Part) -> float:
    """``part``'s seconds when the groups sum its rows: its one-level sparse allreduce call priced by
    ``SUM_ALGORITHM``; any other part (a two-level cluster's per-table call) as the plan prices it."""
    if part.kind != GROUPED_KIND or plan.cluster.two_level:
        return part.seconds
    members = [e for e in plan.entries if e.name in part.members]
    width, itemsize = math.prod(members[0].shape[1:]), members[0].itemsize
    cluster = plan.cluster
    return grouped_call(members, 0, width, itemsize, cluster.machines, cluster.link, use=SUM_ALGORITHM)[1]
