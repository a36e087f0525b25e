"""The bucket layout of reduction during backward (optim/buckets.py), one process: DDP's caps for dense
buckets, one bucket for a placement's sparse gradients, a non-splitting placement's parameters together in plan
order, the order of launch."""

from __future__ import annotations

import torch

from sparsync.compress import TopK
from sparsync.optim.buckets import default_order, lay_out
from sparsync.placement import ByLayout, Compressed, NamedParam, Sharded
from sparsync.replicator.optimizer import DENSE, NONE, SPARSE


def _params(sizes: list[int]) -> list[NamedParam]:
    return [NamedParam(f"p{i}", torch.nn.Parameter(torch.zeros(n))) for i, n in enumerate(sizes)]


def test_dense_buckets_follow_ddps_caps_in_the_order_of_readiness() -> None:
    mib = 1 << 18  # float32 elements in a MiB
    params = _params([mib, mib, 2 * mib, mib, mib])
    one = ByLayout()  # placements group by object, as the optimizer's default plan shares one
    plan = {p.name: one for p in params}
    order = [4, 3, 2, 1, 0]
    buckets = lay_out(params, plan, [DENSE] * 5, order, cap_bytes=3 << 20, first_cap_bytes=1 << 20)
    # first bucket closes at 1 MiB, the next at 3 MiB
    assert [b.members for b in buckets] == [(4,), (3, 2), (1, 0)]
    assert all(b.fast for b in buckets) and [b.index for b in buckets] == [0, 1, 2]
    assert buckets[1].sizes == (mib, 2 * mib) and buckets[1].numel == 3 * mib


def test_sparse_unknown_and_non_splitting_placements() -> None:
    params = _params([10, 20, 30, 40, 50, 60])
    default, topk = ByLayout(), Compressed(TopK(0.5))
    plan = {"p0": default, "p1": topk, "p2": default, "p3": topk, "p4": default, "p5": default}
    layouts = [SPARSE, DENSE, DENSE, DENSE, SPARSE, NONE]
    buckets = lay_out(params, plan, layouts, [3, 4, 2, 0, 1, 5])
    got = {b.members: (b.fast, b.placement) for b in buckets}
    assert got[(2,)] == (True, default)  # the only dense gradient of the default
    assert got[(4, 0)] == (False, default)  # both sparse ones in one call, in order of readiness
    assert got[(1, 3)] == (False, topk)  # the compressor's parameters together, in plan order
    assert got[(5,)] == (False, default)  # layout unknown: the header round decides
    # launched when their last member is ready: 2 (position 2), then 4,0 (3), then 1,3 (4), then 5
    assert [b.members for b in buckets] == [(2,), (4, 0), (1, 3), (5,)]


def test_default_order_puts_unseen_parameters_last_registered_first() -> None:
    assert default_order([2, 0], 5) == [2, 0, 4, 3, 1]


def test_a_placement_that_sends_nothing_gets_one_local_bucket() -> None:
    """A placement whose gradients backward already summed (``communicates`` False, as ``Sharded``): all its
    parameters in one bucket marked local (no collective: only the mean's division), whatever their layouts;
    launched when its last member is ready; the other buckets are not local, and only the default's sparse one
    goes as one grouped call."""
    params = _params([10, 20, 30, 40, 50])
    default, summed = ByLayout(), Sharded()
    plan = {"p0": default, "p1": summed, "p2": default, "p3": summed, "p4": default}
    layouts = [DENSE, SPARSE, SPARSE, NONE, NONE]
    buckets = lay_out(params, plan, layouts, [1, 0, 3, 2, 4])
    got = {b.members: (b.local, b.fast, b.grouped) for b in buckets}
    assert got == {
        (0,): (False, True, False),  # the default's dense gradient: the fast path
        (1, 3): (True, False, False),  # the summed ones, sparse and unknown alike, in plan order
        (2,): (False, False, True),  # the default's sparse gradient: one grouped call
        (4,): (False, False, False),  # layout unknown: the header round decides
    }
    assert [b.members for b in buckets] == [(0,), (1, 3), (2,), (4,)]
