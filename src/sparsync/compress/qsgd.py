"""``QSGD(bits=4, bucket=512)``: stochastic quantization with one scale per bucket (Alistarh et al. 2017, as
SparCML §5 "Low-Precision Support" uses it: buckets of B values, B low-precision integers packed plus one
full-precision scaling factor each).

Each value v of a bucket with scale S becomes S·q/s, where s = 2^(bits-1) - 1 levels and the integer
q ∈ [-s, s] is v·s/S rounded down or up, up with probability equal to the fractional part: unbiased. The code
q + s ∈ [0, 2s] fits in ``bits`` bits and ``8 // bits`` codes share a byte, so 4-bit really costs 4 bits.

Variance per bucket (n values): Σ (S/s)² p_i(1 - p_i) with p_i the fractional parts, hence at most
n·S²/(4s²). ``scale="l2"`` is the QSGD paper's choice S = ‖v‖₂, with Lemma 3.1's bound min(n/s², √n/s)·‖v‖²;
``scale="max"`` (default) uses S = ‖v‖∞ ≤ ‖v‖₂, a tighter grid for the same bits: at 4 bits (s = 7) the l2
grid leaves most values of a 512-bucket on level 0 or 1.

The quantizer itself is ``qsgd_codec.py`` (a mixin of ``QSGD``), which the reduce-scatter and DSAR's quantized
dense phase (``dsar_quantized.py``) build on; this module builds on those two. Kernels (``qsgd_kernels.py``):
in C where the extension is built, in vectorized torch otherwise, the same bits either way; chunks of 512K
values. Rounding noise is 16 bits per value from a counter-based stream
(splitmix64) seeded by one draw of the generator per chunk: the rounding is unbiased up to 2^-17 of a
quantization step. Timings: docs/results_compress.md.

Aggregation (``QSGD.aggregator``, beside it here): ``qsgd_allreduce.py``'s quantized reduce-scatter
(``aggregation="reduce_scatter"``, the default for P > 2) or an allgather of the payloads
(``ScaledAllgather``). With error feedback (``compressed_allreduce(memory=...)``) "auto" gathers instead: the
reduce-scatter re-quantizes the owners' partial sums, an error no worker's memory holds, so the feedback
invariant Σ(results) + Σ(residuals) = Σ(gradients) would not hold (an owner-side memory, as 1-bit Adam's
server compensation, would keep it at the reduce-scatter's bytes: not built).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from sparsync.collectives.allreduce import DsarCall
from sparsync.compress.aggregate import GatherAggregator, Result, expect, pipelined
from sparsync.compress.base import (
    Aggregator,
    Compressor,
    Encoding,
    QuantizedPayload,
    ReduceCall,
    check_kernels,
    check_positive_int,
    native_for,
)
from sparsync.compress.dsar_quantized import dsar_quantized
from sparsync.compress.memory import Memory
from sparsync.compress.qsgd_allreduce import encode_remote, local_estimate, quantized_allreduce, segments
from sparsync.compress.qsgd_codec import CHUNK, REQUANTIZE_STREAM, QSGDCodec, Workspace
from sparsync.compress.qsgd_kernels import native_available
from sparsync.stream import SparseStream

__all__ = ["CHUNK", "QSGD", "REQUANTIZE_STREAM", "Workspace"]


@dataclass(frozen=True, eq=False)
class QSGD(QSGDCodec, Compressor):
    """Unbiased stochastic quantization to ``bits`` bits per value."""

    name: ClassVar[str] = "qsgd"
    unbiased: ClassVar[bool] = True

    bits: int = 4  # bits per value, sign included: 2, 4 or 8
    bucket: int = 512  # values per scale
    scale: Literal["max", "l2"] = "max"  # per-bucket scale: ‖v‖∞ (default) or ‖v‖₂ (QSGD paper)
    seed: int = 0  # rounding noise: a generator seeded by (seed, name, rank), advanced every call
    # how ``reduce`` sums the payloads: "allgather" (every rank decodes all P payloads), "reduce_scatter"
    # (each rank sums and re-quantizes one partition, then the quantized partitions are allgathered; SparCML
    # §5's dense phase), or "auto": reduce_scatter when P > 2 (at P = 2 it moves the same bytes and only adds
    # the re-quantization's variance)
    aggregation: Literal["auto", "allgather", "reduce_scatter"] = "auto"
    # the encode/decode kernels: "auto" (C where built, else torch), "c" (raise if not built), "torch". The
    # same bits either way (qsgd_kernels.py).
    kernels: Literal["auto", "c", "torch"] = "auto"
    _gens: dict[tuple[str, int, int], torch.Generator] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.bits not in (2, 4, 8):
            raise ValueError(f"bits must be 2, 4 or 8 (codes are packed whole into bytes), got {self.bits!r}")
        check_positive_int(self.bucket, "bucket")
        if self.scale not in ("max", "l2"):
            raise ValueError(f"scale must be 'max' or 'l2', got {self.scale!r}")
        if self.aggregation not in ("auto", "allgather", "reduce_scatter"):
            raise ValueError(
                f"aggregation must be 'auto', 'allgather' or 'reduce_scatter', got {self.aggregation!r}"
            )
        check_kernels("QSGD", self.kernels, native_available(), "_qsgd_c")

    def check_device(self, device: torch.device) -> None:
        native_for("QSGD", self.kernels, native_available(), device)

    def aggregator(self, enc: Encoding) -> Aggregator[Any]:
        """The quantized reduce-scatter when ``uses_reduce_scatter(P)`` and no memory is given (module doc), else
        the allgather, decoded from scales / P."""
        if self.uses_reduce_scatter(enc.world_size) and not enc.feedback:
            return QuantizedReduceScatter(self)
        return SCALED_ALLGATHER

    def check_feedback(self) -> None:
        if self.aggregation == "reduce_scatter":
            # The owners re-quantize their partial sums (qsgd_allreduce.py): that error would be in no memory, and
            # Σ(results) + Σ(residuals) would drift from Σ(gradients) (by 69% over 20 steps at 2 bits).
            raise ValueError(
                "QSGD(aggregation='reduce_scatter') with error feedback: the re-quantized partial sums' error is "
                "kept in no memory; use aggregation='auto' (which gathers every rank's quantized gradient when a "
                "memory is given) or 'allgather'"
            )

    def uses_reduce_scatter(self, world_size: int) -> bool:
        """Whether ``reduce`` aggregates by quantized reduce-scatter + allgather on ``world_size`` ranks."""
        if self.aggregation == "auto":
            return world_size > 2
        return self.aggregation == "reduce_scatter"

    # --- the quantizer of DSAR's dense phase (``sparse_allreduce(quantize=...)``, collectives.DenseQuantizer)
    def quantize_key(self) -> str:
        """The settings every rank must share (the metadata round compares a hash of it)."""
        return f"qsgd(bits={self.bits}, bucket={self.bucket}, scale={self.scale!r}, seed={self.seed})"

    def dsar_allreduce(self, call: DsarCall) -> SparseStream:
        """DSAR with its dense phase in this precision (``compress/dsar_quantized.py``)."""
        return dsar_quantized(call, self)


class ScaledAllgather(GatherAggregator):
    """QSGD's allgather: QSGD decodes linearly in its scales, so the average is decoded from scales / P (n / bucket
    divisions, not a pass over the n decoded values)."""

    def scale(self, call: ReduceCall) -> float | None:
        return 1.0 / call.world_size if call.average else 1.0


SCALED_ALLGATHER = ScaledAllgather()


@dataclass(frozen=True)
class QuantizedReduceScatter(Aggregator[QuantizedPayload]):
    """``qsgd_allreduce.quantized_allreduce`` (SparCML §5's dense phase): a synchronous call encodes while it
    sends; an asynchronous one (or one whose residual is kept) encodes on the caller's thread first
    (``encode_remote``), so that the caller's thread is done with the input when the call returns."""

    name: ClassVar[str] = "reduce_scatter"
    q: QSGD

    def compress(self, enc: Encoding) -> QuantizedPayload | None:
        if not (enc.async_op or enc.feedback):
            return None  # encoded segment by segment while the previous one is on the wire
        return encode_remote(self.q, enc.values, enc.spec.numel, enc.ctx, enc.world_size)

    def feedback(self, enc: Encoding, payload: QuantizedPayload | None, memory: Memory) -> torch.Tensor | None:
        sent = expect(payload, QuantizedPayload, self)
        local = self.q.finish(local_estimate(self.q, sent, enc.values, enc.world_size, enc.ctx.rank), enc.spec)
        memory.update(enc.ctx.name, enc.x, local)
        return local

    def aggregate(self, call: ReduceCall, payload: QuantizedPayload | None) -> Result:
        q, enc = self.q, call.enc
        n, P = enc.spec.numel, call.world_size
        scale = 1.0 / P if call.average else 1.0  # the pipeline scales while it decodes: no pass to divide

        def quantized() -> tuple[torch.Tensor, int]:
            r = quantized_allreduce(q, enc.values, n, enc.ctx, call.comm, scale, payload=payload)
            return r.total, r.sent

        msgs = 2 * (P - 1) * len(segments(q, n))
        nb = q.payload_nbytes(n)
        return pipelined(call, nb, nb, "quantized_reduce_scatter", msgs, quantized)  # a byte payload
