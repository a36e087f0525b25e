"""``TopK(ratio, scope="bucket")`` through the DDP hook selects over a bucket's gradients at once: on real gloo
groups it equals a float64 reference written here (numpy): per rank, c = the concatenation of every parameter's
g + e, send its k = ceil(ratio·n) largest |c|, keep the rest as each parameter's e; the result is the mean over
ranks of what was sent. ``scope="tensor"`` (the default) selects per parameter."""

from __future__ import annotations

import math

import _topk_scope_workers as sw
import numpy as np
import pytest
import torch

from sparsync import launch
from sparsync.compress import TopK
from sparsync.compress.bucket_sparse import fusable


def reference(got: list[list[tuple[list[torch.Tensor], list[torch.Tensor]]]]) -> list[list[np.ndarray]]:
    """The mean over ranks of what each rank sent, per step and parameter, from each rank's local gradients."""
    world = len(got)
    shapes = [g.shape for g in got[0][0][0]]
    sizes = [math.prod(s) for s in shapes]
    err = [np.zeros(sum(sizes)) for _ in range(world)]
    out = []
    for t in range(sw.STEPS):
        total = np.zeros(sum(sizes))
        for r in range(world):
            c = np.concatenate([g.numpy().reshape(-1) for g in got[r][t][0]]) + err[r]
            idx = np.argsort(-np.abs(c), kind="stable")[: max(1, math.ceil(sw.RATIO * c.size))]
            sent = np.zeros_like(c)
            sent[idx] = c[idx]
            err[r] = c - sent
            total += sent
        out.append(
            [p.reshape(s) for p, s in zip(np.split(total / world, np.cumsum(sizes)[:-1]), shapes, strict=True)]
        )
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 3, pytest.param(5, marks=pytest.mark.large)])
def test_bucket_scope_equals_the_float64_reference(world: int) -> None:
    got = launch(sw.worker, nprocs=world, timeout=100)
    want = reference(got)
    for rank_out in got:
        for t, (_, reduced) in enumerate(rank_out):
            for g, w in zip(reduced, want[t], strict=True):
                assert torch.equal(g != 0, torch.from_numpy(w != 0)), t
                np.testing.assert_allclose(g.numpy(), w, rtol=1e-12, atol=1e-12, err_msg=f"step {t}")


def test_scope_routes_and_bad_value() -> None:
    buf = torch.zeros(10)
    assert fusable(buf, [TopK(0.1)]) and not fusable(buf, [TopK(0.1, scope="bucket")])
    with pytest.raises(ValueError, match="scope"):
        TopK(0.1, scope="model")
