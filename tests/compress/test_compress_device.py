"""Compressors on any device, checked without a GPU: every allocation follows the input's device, and the C
kernels (which read host memory) serve CPU tensors only.

The first tests run each compressor's CPU path with torch's factory functions defaulting to the ``meta``
device (``_MetaDefault``, torch's ``with torch.device("meta")`` less the sparse constructors, which take the
device of their index and value tensors): a tensor made without ``device=`` then lands on ``meta``, where
mixing it with the CPU input raises or leaves data-less values in the result. Bit-for-bit equal results
therefore show that every buffer of the call was made on its input's device, as a CUDA input needs. The
``cuda`` test compares CPU and CUDA results where a GPU is present.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from sparsync.compress import (
    QSGD,
    Context,
    ErrorFeedback,
    SparseSketch,
    TensorSpec,
    Threshold,
    from_spec,
    qsgd_kernels,
)
from sparsync.compress.base import native_for
from sparsync.compress.qsgd_allreduce import encode_remote, local_estimate, simulate
from sparsync.compress.qsgd_kernels import Workspace
from sparsync.compress.sketch_hash import Hasher

# Every compressor, the C-backed ones through their torch kernels (the ones a CUDA tensor gets), both hashes.
SPECS = (
    "identity",
    "fp16",
    "bf16",
    "topk:ratio=0.05",
    "topk:ratio=0.05,bucket=64",
    "threshold:ratio=0.05,lifespan=2,kernels=torch",
    "randomk:ratio=0.05",
    "qsgd:bits=4,bucket=64,kernels=torch",
    "qsgd:bits=2,bucket=50,kernels=torch",
    "qsgd:bits=8,bucket=64,scale=l2,kernels=torch",
    "sketch:rows=3,cols=300,block=8,kernels=torch",
    "sketch:rows=4,cols=300,hash=element,kernels=torch",
    "blocktopk:ratio=0.1,block=16",
)


def _inputs() -> list[torch.Tensor]:
    """A flat tensor with half zeros, a 2-D one (the sketch's blocks are its rows), an embedding's COO gradient."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3001, generator=g) * (torch.rand(3001, generator=g) < 0.5)
    emb = torch.nn.Embedding(60, 5, sparse=True)
    (emb(torch.tensor([1, 3, 17, 17])) * torch.arange(1, 6)).sum().backward()
    assert emb.weight.grad is not None
    return [x, x[:3000].reshape(60, 50), emb.weight.grad.coalesce()]


def _round_trip(spec: str, inputs: list[torch.Tensor], device: str = "cpu") -> list[torch.Tensor]:
    """Compress, decompress, error feedback and the gathered decode of ``spec`` on every input moved to
    ``device``, twice (the compressors' state moves); every result checked to be on ``device``."""
    out = []
    comp, mem = from_spec(spec), ErrorFeedback()
    for i, t in enumerate(inputs):
        t = t.to(device)
        for step in range(2):
            x = mem.compensate(f"t{i}", t)
            if x.is_sparse and not comp.accepts_sparse:
                x = x.to_dense()
            payload = comp.compress(x, Context(f"t{i}", 1, 3))
            back = comp.decompress(payload, TensorSpec.of(x))
            mem.update(f"t{i}", x, back)
            err = mem.error(f"t{i}")
            assert err is not None
            out += [back.to_dense() if back.is_sparse else back, err]
            if step == 1 and not x.is_sparse:
                other = comp.compress(x * 0.5, Context(f"t{i}", 2, 3))
                out.append(comp.decompress_gathered([payload, other], TensorSpec.of(x)))
    assert all(o.device.type == device for o in out), spec
    return out


def _qsgd_reduce_scatter(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """QSGD's reduce-scatter pieces that run without a group: each rank's payload, its estimate, the sum."""
    q, P = QSGD(bits=4, bucket=64, kernels="torch"), len(xs)
    ctxs = [Context("w", r, P) for r in range(P)]
    sent = [encode_remote(q, x, x.numel(), c, P) for x, c in zip(xs, ctxs, strict=True)]
    est = [local_estimate(q, s, x, P, c.rank) for s, x, c in zip(sent, xs, ctxs, strict=True)]
    return [*(s.codes for s in sent), *est, simulate(q, sent, xs, ctxs)]


# The factory functions that take their device from ``device=`` alone (or the default device).
_FACTORIES = {
    torch.empty, torch.zeros, torch.ones, torch.full, torch.arange, torch.tensor, torch.rand, torch.randn,
    torch.randint, torch.randperm, torch.linspace, torch.eye, torch.empty_strided,
}  # fmt: skip


class _MetaDefault(TorchFunctionMode):
    """Factory functions called without ``device=`` make ``meta`` tensors (module doc)."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func in _FACTORIES and kwargs.get("device") is None:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


def _on_meta_default(fn: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
    """``fn()`` under ``_MetaDefault``."""
    with _MetaDefault():
        return fn()


@pytest.mark.parametrize("spec", SPECS)
def test_every_buffer_is_made_on_the_inputs_device(spec: str) -> None:
    inputs = _inputs()
    want = _round_trip(spec, inputs)
    got = _on_meta_default(lambda: _round_trip(spec, inputs))
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b), spec


def test_qsgd_reduce_scatter_buffers_follow_the_input() -> None:
    xs = [torch.randn(2000, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    want = _qsgd_reduce_scatter(xs)
    got = _on_meta_default(lambda: _qsgd_reduce_scatter(xs))
    for a, b in zip(got, want, strict=True):
        assert a.device.type == "cpu" and torch.equal(a, b)


def test_c_kernels_serve_cpu_tensors_only() -> None:
    """kernels="auto" picks the torch kernels for a tensor off the host, "c" raises a ValueError naming the
    device (``meta`` stands for CUDA here: any device but the host), and nothing changes on the host."""
    other = torch.device("meta")
    assert native_for("QSGD", "auto", True, other) is False
    assert native_for("QSGD", "torch", True, other) is False
    assert native_for("QSGD", "auto", True, torch.device("cpu")) is True
    assert native_for("QSGD", "torch", True, torch.device("cpu")) is False
    assert native_for("QSGD", "auto", False, torch.device("cpu")) is False
    with pytest.raises(ValueError, match=r"QSGD\(kernels='c'\).*CPU tensors only.*meta"):
        native_for("QSGD", "c", True, other)
    assert Workspace(QSGD(), 100, other).native is False
    assert Hasher(3, 0, 10, torch.float32, 64, device=other).native is False
    x = torch.zeros(640, device=other)
    for comp in (QSGD(kernels="c"), SparseSketch(cols=64, kernels="c"), Threshold(0.1, kernels="c")):
        with pytest.raises(ValueError, match=r"kernels='c'.*CPU tensors only"):
            comp.compress(x, Context("w"))
    for comp in (QSGD(kernels="c"), SparseSketch(cols=64, kernels="c"), Threshold(0.1, kernels="c")):
        with pytest.raises(ValueError, match=r"kernels='c'.*CPU tensors only.*meta"):
            comp.check_device(other)  # compressed_allreduce's check, before any rank communicates
        comp.check_device(torch.device("cpu"))
    t = Threshold(0.1, kernels="c")
    with pytest.raises(ValueError):
        t.compress(x, Context("w"))
    assert t.threshold("w") is None  # refused before its state moved


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("spec", SPECS)
def test_cuda_results_equal_the_cpu_path(spec: str) -> None:
    """On a GPU: results stay on the device and equal the CPU path's (its default kernels: C where built), bit
    for bit where both are deterministic (the sketch's table sums go through CUDA's atomic adds, in any order,
    and QSGD's l2 scales are norms summed in another order: within float32 rounding)."""
    on_host, inputs = spec.replace(",kernels=torch", ""), _inputs()
    want = _round_trip(on_host, inputs)
    got = _round_trip(on_host, inputs, "cuda")
    for a, b in zip(got, want, strict=True):
        if spec.startswith("sketch") or "scale=l2" in spec:  # l2: the norm's sum is ordered differently
            torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(a.cpu(), b), spec


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize(
    "spec",
    ["qsgd:bits=4,bucket=512", "qsgd:bits=4,bucket=101", "threshold:ratio=0.01,lifespan=1", "topk:ratio=0.01"],
)
def test_cuda_large_inputs_equal_the_cpu_path(spec: str) -> None:
    """Inputs of several QSGD noise chunks (one GPU pass covers them all) and above topk's sampling size (the
    GPU's selections): the same bits as on the host."""
    x = torch.randn(2 * qsgd_kernels.CHUNK + 12_345, generator=torch.Generator().manual_seed(9))
    got, want = (_round_trip(spec, [x], device) for device in ("cuda", "cpu"))
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.cpu(), b), spec
