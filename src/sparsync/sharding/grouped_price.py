"""What ``plan="auto"`` prices for the tables it keeps whole when their optimizer runs in backward
(``auto_plan(fused=True)``): those tables go in replicated groups (``sharding.replicated``), which

- send their rows by a sparse allreduce, whatever the planner's cheapest replicated kind for the table: a table
  kept whole is priced on ``GROUPED_KIND``, never the dense allreduce;
- sum over the ranks at the end of backward, where the tables (the model's first layers) leave no backward to
  hide the sum behind: their parts of the step are priced on its path, not behind ``Plan.overlap``;
- open each forward with one header allreduce (every rank's verdict on its ids): one small allreduce, on the
  step's path, whenever any table is kept whole.

Not priced as it runs: the sum's algorithm (the groups run an allgather, which sums the rows in the same order on
every rank; the planner prices its own choice of sparse-allreduce algorithm for the same rows).
"""

from __future__ import annotations

from collections.abc import Collection

from sparsync.plan import Plan
from sparsync.plan.backend import dense_allreduce

GROUPED_KIND = "sparse_allreduce"
HEADER_BYTES = 64  # a header row per rank: a latency-bound allreduce


def grouped_exposed(plan: Plan, whole: Collection[str]) -> float:
    """``plan.step_exposed_seconds`` with the parts carrying any of ``whole`` (parameter names of tables kept in
    replicated groups) on the step's path instead of behind backward, plus the groups' header allreduce when
    ``whole`` is not empty."""
    if not whole:
        return plan.step_exposed_seconds
    parts = plan.step.parts
    grouped = [p for p in parts if p.hidden and not set(p.members).isdisjoint(whole)]
    hidden = sum(p.seconds for p in parts if p.hidden) - sum(p.seconds for p in grouped)
    path = sum(p.seconds for p in parts if not p.hidden) + sum(p.seconds for p in grouped)
    return max(0.0, hidden - plan.overlap) + path + dense_allreduce(HEADER_BYTES, plan.cluster)[1]
