"""The bucket layout of reduction during backward (``optim.overlap``): which parameters travel together,
in which order, and by which path.

DDP's reducer (Li et al., "PyTorch Distributed", VLDB 2020, §3.2.3 and §4.2) groups gradients into buckets in
the order backward produces them and starts a bucket's allreduce as soon as its last gradient is ready; it lays
the buckets out again from the order seen in the first iteration. We take the same shape, with two choices of
ours where the paper is silent or does not apply:

- The order is rank 0's first round (broadcast), so every rank issues the same buckets in the same order
  whatever its own autograd order was. A parameter rank 0 did not see comes after, in reverse registration
  order (DDP's initial guess).
- A bucket holds consecutive parameters (in that order) of one placement object, one dtype and one layout
  (dense or sparse, as agreed in the first round). Dense gradients under ``DenseAllreduce`` (or ``ByLayout``'s
  default dense side) take the *fast path*: one flat allreduce with the checks carried in the payload
  (``optim.jobs``), split at DDP's caps (1 MiB for the first bucket, ``cap_bytes`` after).
  Sparse gradients under ``ByLayout``/``SparseAllreduce`` share one bucket (one metadata round for their sizes),
  launched when the last of them is ready.
  Any other placement (a compressor, a sketch, ``Grouped``, a custom reduction) keeps all of its parameters in
  one bucket, so it gets the call ``ReplicatedOptimizer.aggregate`` makes (a DCT-DP threshold over the
  whole bucket, one sketch seed per step).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from sparsync.placement import ByLayout, DenseAllreduce, NamedParam, Placement, SparseAllreduce
from sparsync.placement.bucketing import CAP_BYTES, FIRST_CAP_BYTES, DenseRuns
from sparsync.replicator.optimizer import DENSE, NONE, SPARSE


@dataclass(frozen=True)
class Bucket:
    """One reduction of the layout: ``members`` (indices into the optimizer's parameter list), how they go
    (``fast``: one flat allreduce with the checks in its tail; otherwise the placement's own ``aggregate``
    after a header round), and their dtype and sizes for the fast path's buffer."""

    index: int
    placement: Placement
    members: tuple[int, ...]
    fast: bool
    dtype: torch.dtype
    sizes: tuple[int, ...]
    local: bool = False  # the placement does not communicate: only op="mean"'s division, in the caller's thread
    grouped: bool = False  # the default's sparse gradients: one grouped_allreduce that carries who had each

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    @functools.cached_property
    def slots(self) -> tuple[slice, ...]:
        """Where each member sits in the fast path's flat buffer (read per gradient in backward: computed once)."""
        ends = list(itertools.accumulate(self.sizes))
        return tuple(slice(end - size, end) for end, size in zip(ends, self.sizes, strict=True))


def is_fast(placement: Placement, layout: int) -> bool:
    """Whether a parameter of ``layout`` under ``placement`` takes the fast path: a plain dense allreduce
    (DenseAllreduce densifies a sparse gradient as it always did)."""
    if type(placement) is DenseAllreduce:
        return layout != NONE
    return type(placement) is ByLayout and type(placement.dense) is DenseAllreduce and layout == DENSE


def is_grouped(placement: Placement) -> bool:
    """Whether a placement sends its sparse gradients as the default does: one ``grouped_allreduce`` per row
    width (``ByLayout`` with its default sides)."""
    return (
        type(placement) is ByLayout
        and placement.fuse
        and type(placement.dense) is DenseAllreduce
        and type(placement.sparse) is SparseAllreduce
    )


def splits(placement: Placement) -> bool:
    """Whether a placement's parameters may go in several calls without changing what it computes: per-tensor
    reductions and the dense/sparse split of the default."""
    if type(placement) in (DenseAllreduce, SparseAllreduce):
        return True
    return type(placement) is ByLayout and type(placement.dense) is DenseAllreduce


def default_order(first_round: Sequence[int], count: int) -> list[int]:
    """Rank 0's order of readiness in the first round, then the parameters it did not see, last registered
    first (backward meets the last layers first)."""
    seen = set(first_round)
    return [*first_round, *(i for i in reversed(range(count)) if i not in seen)]


def lay_out(
    params: Sequence[NamedParam],
    plan: Mapping[str, Placement],
    layouts: Sequence[int],
    order: Sequence[int],
    *,
    cap_bytes: int = CAP_BYTES,
    first_cap_bytes: int = FIRST_CAP_BYTES,
) -> list[Bucket]:
    """The buckets, in the order every rank launches them: a bucket's position is when its last member becomes
    ready in ``order``."""
    pos = {i: k for k, i in enumerate(order)}
    runs = DenseRuns(cap_bytes, first_cap_bytes)  # consecutive dense members of one fast key, up to the cap
    sparse: dict[tuple[int, int, torch.dtype], list[int]] = {}  # the rest of a splitting placement, by key
    whole: dict[int, list[int]] = {}  # one bucket per non-splitting placement object
    for i in order:
        p = params[i]
        pl = plan[p.name]
        if not pl.communicates or not splits(pl) or layouts[i] == NONE:
            whole.setdefault(id(pl), []).append(i)
        elif not is_fast(pl, layouts[i]):  # sparse gradients: one call for all (their sizes need a round each)
            sparse.setdefault((id(pl), layouts[i], p.param.dtype), []).append(i)
        else:
            runs.add(i, (id(pl), p.param.dtype), p.param.numel() * p.param.element_size())
    groups = [(members, True) for members in runs.runs]
    groups += [(members, False) for members in sparse.values()]
    # a non-splitting placement sees its parameters in plan order, as ReplicatedOptimizer.aggregate passes them
    groups += [(sorted(members), False) for members in whole.values()]
    groups.sort(key=lambda g: max(pos[i] for i in g[0]))
    out = []
    for k, (members, fast) in enumerate(groups):
        first = params[members[0]]
        out.append(
            Bucket(
                k, plan[first.name], tuple(members), fast, first.param.dtype,
                tuple(params[i].param.numel() for i in members), local=not plan[first.name].communicates,
                grouped=not fast and is_grouped(plan[first.name]) and all(layouts[i] == SPARSE for i in members),
            )
        )  # fmt: skip
    return out
