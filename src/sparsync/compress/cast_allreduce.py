"""16-bit casts of large dense tensors, cast, allreduced and widened chunk by chunk (half the
bytes must cost less than half the time).

A cast's payload is linear, so ``reduce`` sends it through gloo's dense allreduce of the 16-bit buffer (a ring:
2(P - 1)/P·n·2 bytes per rank). Done whole, the cast of n values, the allreduce and the widening of the result
run one after the other, and the two passes over memory cost about a fifth of the time the bytes save. Here the
tensor goes in chunks of ``CHUNK`` values: while chunk i is cast and its allreduce started (asynchronously),
chunk i - 1's allreduce finishes and is widened into the float32 result (divided by ``divisor`` there, in float32,
as ``reduce`` divides a whole result). Same bytes, same ring, same software sums in the wire dtype as the whole
allreduce, the same bits on every rank; only the chunk boundaries change which rank's ring segment adds an
element, i.e. the order of its P - 1 roundings.

Chunk size: the fastest of 1M, 4M, 8M values and the whole tensor at P = 4, 25M values, 1 Gbit/s links
(docs/results_compress.md); below 1M each chunk's 2(P - 1) latencies start to show. Tensors under
``MIN_VALUES`` go whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from sparsync.buffers import fresh
from sparsync.collectives.comm import ring_allreduce_bytes
from sparsync.compress.aggregate import Result, expect, pipelined
from sparsync.compress.base import Aggregator, DensePayload, Encoding, ReduceCall
from sparsync.compress.memory import Memory

CHUNK = 1 << 20
MIN_VALUES = 2 * CHUNK  # one chunk has nothing to overlap with


def chunks(n: int) -> list[tuple[int, int]]:
    """[a, b) value ranges of the chunks (``CHUNK`` values each, the last one shorter)."""
    return [(a, min(n, a + CHUNK)) for a in range(0, n, CHUNK)]


def cast_allreduce(
    values: torch.Tensor,
    wire: torch.dtype,
    group: dist.ProcessGroup,
    divisor: int = 1,
    *,
    cast: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """Sum over ``group`` of every rank's ``values`` sent and added in ``wire`` (float16 or bfloat16), widened
    to float32 and divided by ``divisor``; flat. Returns it and the bytes this rank sent (the ring's). ``cast``:
    ``values`` already in ``wire``, a tensor of the caller's that the chunks' allreduces may sum into (not
    cast again). Collective: every rank calls it with the same numel and ``wire``, in the same order."""
    flat = values.reshape(-1) if cast is None else cast.reshape(-1)
    n, P = flat.numel(), dist.get_world_size(group)
    out = fresh(n, device=flat.device)
    in_flight: list[tuple[int, int, torch.Tensor, dist.Work]] = []

    def widen() -> None:
        a, b, buf, work = in_flight.pop(0)
        work.wait()
        dst = out[a:b].copy_(buf)
        if divisor != 1:
            dst.div_(divisor)  # float32, as reduce's whole-tensor average

    for a, b in chunks(n):
        buf = flat[a:b].to(wire)  # a fresh copy; a view where ``cast`` was given (already wire)
        work = dist.all_reduce(buf, group=group, async_op=True)
        assert work is not None
        in_flight.append((a, b, buf, work))
        if len(in_flight) > 1:
            widen()
    while in_flight:
        widen()
    return out, ring_allreduce_bytes(n * wire.itemsize, P)


@dataclass(frozen=True)
class CastPipeline(Aggregator[DensePayload]):
    """A large float32 tensor sent in ``wire`` (FP16, BF16): ``cast_allreduce``. Without error feedback nothing
    is cast before the pipeline; with it the residual (x - the 16-bit round trip) needs the whole cast on the
    caller's thread, and the pipeline then sends that cast instead of casting again."""

    name: ClassVar[str] = "allreduce"
    wire: torch.dtype

    def compress(self, enc: Encoding) -> DensePayload | None:
        if not enc.feedback:
            return None  # cast chunk by chunk inside the pipeline
        return expect(enc.compressor.compress(enc.values, enc.ctx), DensePayload, self)

    def feedback(self, enc: Encoding, payload: DensePayload | None, memory: Memory) -> torch.Tensor | None:
        local = enc.compressor.decompress(expect(payload, DensePayload, self), enc.spec)
        memory.update(enc.ctx.name, enc.x, local)
        return local

    def aggregate(self, call: ReduceCall, payload: DensePayload | None) -> Result:
        n, P, wire = call.enc.spec.numel, call.world_size, self.wire
        cast = None if payload is None else payload.values
        msgs = 2 * (P - 1) * len(chunks(n))
        divisor = P if call.average else 1  # the pipeline divides while it widens: no pass to divide

        def casts() -> tuple[torch.Tensor, int]:
            return cast_allreduce(call.enc.values, wire, call.comm, divisor, cast=cast)

        return pipelined(call, n * wire.itemsize, n, "allreduce", msgs, casts)
