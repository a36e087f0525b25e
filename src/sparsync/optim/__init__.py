"""``DistributedOptimizer`` and its reducer: a torch optimizer that reduces every gradient across the ranks of
a group by a per-parameter plan of ``sparsync.placement`` placements.

- ``optimizer``: ``DistributedOptimizer`` (the user's two lines, clipping, ``no_sync()``, checkpoints).
- ``overlap``: the reducer's autograd hooks and rounds (reduction during backward, as DDP's reducer).
- ``buckets``: which parameters travel together, in which order, by which path (agreed once).
- ``jobs``: one bucket's reduction in one round, on the group's queue thread.
"""

from sparsync.optim.optimizer import LAYOUT_KEY, DistributedOptimizer

__all__ = ["LAYOUT_KEY", "DistributedOptimizer"]
