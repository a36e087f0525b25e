"""Deep Gradient Compression (Lin et al. 2018): ``TopK(ratio, warmup=W)`` with ``MomentumCorrection(m)`` through
``compressed_allreduce`` on real gloo groups equals a reference written here in float64 (numpy): per rank
u = m·u + g, v = v + u, send the k largest |v| with k from DGC's warm-up schedule, zero v and u where sent;
the result is the sum over ranks of what was sent."""

from __future__ import annotations

import math

import _dgc_workers as dw
import numpy as np
import pytest
import torch

from sparsync import launch
from sparsync.compress import ErrorFeedback, MomentumCorrection, TensorSpec, TopK


def warmup_ratio(call: int) -> float:
    """DGC §3.4: 75%, 93.75%, 98.4375%, 99.6% sparsity, a quarter of the warm-up each, then the ratio."""
    if call >= dw.WARMUP:
        return dw.RATIO
    return max(dw.RATIO, [0.25, 0.0625, 0.015625, 0.00390625][call * 4 // dw.WARMUP])


def reference(world: int) -> list[np.ndarray]:
    u = [np.zeros(dw.N) for _ in range(world)]
    v = [np.zeros(dw.N) for _ in range(world)]
    grads = [[g.numpy() for g in dw.gradients(r)] for r in range(world)]
    out = []
    for t in range(dw.STEPS):
        k = max(1, math.ceil(warmup_ratio(t) * dw.N))
        total = np.zeros(dw.N)
        for r in range(world):
            u[r] = dw.MOMENTUM * u[r] + grads[r][t]
            v[r] = v[r] + u[r]
            idx = np.argsort(-np.abs(v[r]), kind="stable")[:k]
            total[idx] += v[r][idx]
            v[r][idx] = 0.0
            u[r][idx] = 0.0
        out.append(total)
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 3, pytest.param(5, marks=pytest.mark.large)])
def test_dgc_equals_the_float64_reference(world: int) -> None:
    want = reference(world)
    for got in launch(dw.dgc_worker, nprocs=world, timeout=100):
        for t, (g, w) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(g != 0, torch.from_numpy(w != 0)), t  # the same coordinates sent
            np.testing.assert_allclose(g.numpy(), w, rtol=1e-12, atol=1e-12, err_msg=f"step {t}")


def test_warmup_schedule_and_state() -> None:
    top = TopK(0.01, warmup=dw.WARMUP)
    assert [top.ratio_at(c) for c in range(dw.WARMUP + 2)] == [warmup_ratio(c) for c in range(dw.WARMUP + 2)]
    x = torch.randn(1000)
    kept = [int((top.decompress(top.compress(x), TensorSpec.of(x)) != 0).sum()) for _ in range(dw.WARMUP + 1)]
    assert kept == [max(1, math.ceil(warmup_ratio(c) * 1000)) for c in range(dw.WARMUP + 1)]
    again = TopK(0.01, warmup=dw.WARMUP)
    again.load_state_dict(top.state_dict())
    assert again.state_dict() == top.state_dict() == {"": {"calls": dw.WARMUP + 1}}
    with pytest.raises(ValueError, match="warmup"):
        TopK(0.01, warmup=-1)
    with pytest.raises(ValueError, match="keeps no state"):
        TopK(0.01).load_state_dict({"w": {"calls": 3}})


def test_momentum_correction_without_momentum_is_error_feedback() -> None:
    mc, ef = MomentumCorrection(0.0), ErrorFeedback()
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        g = torch.randn(50, generator=gen, dtype=torch.float64)
        a, b = mc.compensate("w", g), ef.compensate("w", g)
        assert torch.equal(a, b)
        idx = torch.topk(a.abs(), 5).indices
        mc.update_selected("w", a, idx, a[idx].clone(), owned=True)
        ef.update_selected("w", b, idx, b[idx].clone(), owned=False)
    assert torch.equal(mc.error("w"), ef.error("w"))
    state = mc.state_dict()
    fresh = MomentumCorrection(0.5)
    fresh.load_state_dict(state)
    assert fresh.momentum == 0.0 and torch.equal(fresh.error("w"), mc.error("w"))
    with pytest.raises(ValueError, match="momentum"):
        MomentumCorrection(1.0)
