"""A compressor added from outside the package in this one file: ``ScaledSign`` (1 bit per value and one scale,
signSGD with a norm, as EF-signSGD, Karimireddy et al. 2019) with its own payload and its own aggregation.

Its payloads do not add up (every rank has its own scale), so it names an allgather of its own
(``SignAllgather``); a template that ignored the compressor's aggregator (summing payloads as they come, or
dispatching on known payload types) fails here. Registered through ``sparsync.compress.REGISTRY``, built by
``from_spec`` and run through ``compressed_allreduce`` on gloo groups of 1 and 3 ranks, against a numpy
reference."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
import torch.distributed as dist

from sparsync import CommLog, launch
from sparsync.compress import (
    REGISTRY,
    Aggregator,
    Compressor,
    Context,
    Encoding,
    ErrorFeedback,
    Payload,
    ReduceCall,
    TensorSpec,
    compressed_allreduce,
    from_spec,
)
from sparsync.compress.aggregate import PayloadAggregator, Result, collective, decoded, expect, record
from sparsync.compress.base import NO_CONTEXT

N = 1001
STEPS = 3


@dataclass(frozen=True)
class SignPayload(Payload):
    """One sign bit per value (as uint8: 1 for x >= 0) and the scale mean|x|."""

    signs: torch.Tensor  # uint8, n
    scale: torch.Tensor  # float32, (1,)

    @property
    def nbytes(self) -> int:
        return self.signs.numel() + 4


class SignAllgather(PayloadAggregator[SignPayload]):
    """Every rank's signs and scale to every rank (two allgathers), decoded one by one and summed in rank order."""

    name: ClassVar[str] = "sign_allgather"

    def check(self, payload: Payload) -> SignPayload:
        return expect(payload, SignPayload, self)

    def aggregate(self, call: ReduceCall, payload: SignPayload | None) -> Result:
        p = expect(payload, SignPayload, self)
        P = call.world_size

        def run() -> list[SignPayload]:
            signs = [torch.empty_like(p.signs) for _ in range(P)]
            scales = [torch.empty_like(p.scale) for _ in range(P)]
            dist.all_gather(signs, p.signs, group=call.comm)
            dist.all_gather(scales, p.scale, group=call.comm)
            record(call, self.name, p.signs.numel(), (P - 1) * p.nbytes, 2 * (P - 1), device=p.signs.device)
            return [SignPayload(s, c) for s, c in zip(signs, scales, strict=True)]

        work = collective(call, self.name, p.nbytes, run)
        comp, spec = call.enc.compressor, call.enc.spec
        return decoded(call, work, lambda ps: call.finish(comp.decompress_gathered(ps, spec)))


SIGN_ALLGATHER = SignAllgather()


@dataclass(frozen=True, eq=False)
class ScaledSign(Compressor):
    """x -> mean|x| · sign(x) (sign(0) = +1)."""

    name: ClassVar[str] = "toy_scaled_sign"

    def compress(self, tensor: torch.Tensor, ctx: Context = NO_CONTEXT) -> SignPayload:
        flat = tensor.reshape(-1).to(torch.float32)
        return SignPayload((flat >= 0).to(torch.uint8), flat.abs().mean().reshape(1))

    def decompress(self, payload: SignPayload, spec: TensorSpec) -> torch.Tensor:
        signs = payload.signs.to(torch.float32) * 2 - 1
        return (signs * payload.scale).to(spec.dtype).reshape(spec.shape)

    def aggregator(self, enc: Encoding) -> Aggregator[Any]:
        return SIGN_ALLGATHER


# --- the ranks -------------------------------------------------------------------------------------------------
def rank_input(rank: int, step: int) -> np.ndarray:
    g = np.random.default_rng([rank, step, 77])
    x = g.standard_normal(N).astype(np.float32)
    x[g.random(N) < 0.1] = 0.0  # some exact zeros: sign(0) = +1
    return x


def toy_worker(rank: int) -> dict[str, Any]:
    """The toy compressor by its registered name, with error feedback for ``STEPS`` steps (sync, the last one
    async) and once without."""
    out: dict[str, Any] = {"steps": [], "algs": []}
    with REGISTRY.registered(ScaledSign):
        comp = from_spec("toy_scaled_sign")
        mem, log = ErrorFeedback(), CommLog()
        for step in range(STEPS):
            x = torch.from_numpy(rank_input(rank, step))
            if step == STEPS - 1:
                work = compressed_allreduce(x, comp, memory=mem, name="w", log=log, async_op=True)
                y = work.wait()
            else:
                y = compressed_allreduce(x, comp, memory=mem, name="w", log=log)
            out["steps"].append(y.numpy())
        x0 = torch.from_numpy(rank_input(rank, 0))
        out["plain"] = compressed_allreduce(x0, comp, name="v", average=False, log=log).numpy()
        out["algs"] = [r.algorithm for r in log.records]
    return out


# --- the reference ---------------------------------------------------------------------------------------------
def scaled_sign(x: np.ndarray) -> np.ndarray:
    return np.abs(x).mean() * np.where(x >= 0, 1.0, -1.0)


def reference(P: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Every rank's compensate -> compress -> update replayed in float64, the decoded payloads summed."""
    residual = [np.zeros(N) for _ in range(P)]
    steps = []
    for step in range(STEPS):
        total = np.zeros(N)
        for r in range(P):
            x = rank_input(r, step) + residual[r]
            sent = scaled_sign(x)
            residual[r] = x - sent
            total += sent
        steps.append(total / P)
    plain = sum(scaled_sign(rank_input(r, 0).astype(np.float64)) for r in range(P))
    return steps, np.asarray(plain)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("P", [1, 3])
def test_toy_compressor_through_compressed_allreduce(P: int) -> None:
    results = launch(toy_worker, nprocs=P, timeout=120)
    steps, plain = reference(P)
    for rank, res in enumerate(results):
        for step in range(STEPS):
            got = res["steps"][step]
            np.testing.assert_allclose(got, steps[step], rtol=1e-5, atol=1e-5, err_msg=f"rank {rank}")
            np.testing.assert_array_equal(got, results[0]["steps"][step])  # the same on every rank
        np.testing.assert_allclose(res["plain"], plain, rtol=1e-5, atol=1e-5)
        assert res["algs"] == ["sign_allgather"] * (STEPS + 1)  # the toy's own aggregator ran every call


def test_registry_scopes_the_toy() -> None:
    with REGISTRY.registered(ScaledSign):
        assert isinstance(from_spec("toy_scaled_sign"), ScaledSign)
        with pytest.raises(ValueError, match="taken"):
            REGISTRY.register(ScaledSign)
    with pytest.raises(KeyError, match="toy_scaled_sign"):
        from_spec("toy_scaled_sign")
