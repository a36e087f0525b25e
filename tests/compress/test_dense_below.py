"""``TopK(ratio, dense_below=N)``: a tensor of fewer than N entries is sent whole, the others keep their top
``ratio``; with ``ErrorFeedback`` through ``compressed_allreduce`` on real gloo groups it equals a float64
reference written here (numpy): per rank and name, c = g + e; a small tensor sends c and keeps e = 0; a large
one sends its k = ceil(ratio·n) largest |c| and keeps the rest as e; the result is the sum over ranks of what was
sent."""

from __future__ import annotations

import math

import _dense_below_workers as dw
import numpy as np
import pytest
import torch

from sparsync import launch
from sparsync.compress import TensorSpec, TopK, from_spec


def reference(world: int) -> list[dict[str, np.ndarray]]:
    grads = [dw.gradients(r) for r in range(world)]
    err = [{name: np.zeros(shape) for name, shape in dw.SHAPES.items()} for _ in range(world)]
    out = []
    for t in range(dw.STEPS):
        total = {name: np.zeros(shape) for name, shape in dw.SHAPES.items()}
        for r in range(world):
            for name in dw.SHAPES:
                c = (grads[r][t][name].numpy() + err[r][name]).reshape(-1)
                k = c.size if c.size < dw.DENSE_BELOW else max(1, math.ceil(dw.RATIO * c.size))
                sent = np.zeros_like(c)
                idx = np.argsort(-np.abs(c), kind="stable")[:k]
                sent[idx] = c[idx]
                err[r][name] = (c - sent).reshape(dw.SHAPES[name])
                total[name] += sent.reshape(dw.SHAPES[name])
        out.append(total)
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 3, pytest.param(5, marks=pytest.mark.large)])
def test_dense_below_equals_the_float64_reference(world: int) -> None:
    want = reference(world)
    for got in launch(dw.worker, nprocs=world, timeout=100):
        for t, (g, w) in enumerate(zip(got, want, strict=True)):
            for name in dw.SHAPES:
                assert torch.equal(g[name] != 0, torch.from_numpy(w[name] != 0)), (t, name)
                np.testing.assert_allclose(g[name].numpy(), w[name], rtol=1e-12, atol=1e-12, err_msg=f"{t} {name}")


def test_small_tensors_whole_large_ones_sparse() -> None:
    top = from_spec("topk:ratio=0.01,dense_below=100")
    assert isinstance(top, TopK) and top.dense_below == 100
    small, large = torch.randn(99), torch.randn(100)
    assert torch.equal(top.decompress(top.compress(small), TensorSpec.of(small)), small)
    assert int((top.decompress(top.compress(large), TensorSpec.of(large)) != 0).sum()) == 1
    coo = torch.sparse_coo_tensor(torch.tensor([[1, 5]]), torch.tensor([2.0, -3.0]), (50,))
    back = top.decompress(top.compress(coo), TensorSpec.of(coo))
    assert torch.equal(back.to_dense() if back.is_sparse else back, coo.to_dense())
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="dense_below"):
            TopK(0.01, dense_below=bad)
