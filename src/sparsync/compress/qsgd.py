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

Kernels (``qsgd_kernels.py``): in C where the extension is built, in vectorized torch otherwise, the same
bits either way; chunks of 512K values. Rounding noise is 16 bits per value from a counter-based stream
(splitmix64) seeded by one draw of the generator per chunk: the rounding is unbiased up to 2^-17 of a
quantization step. Timings: docs/results_compress.md.

Aggregation: see ``qsgd_allreduce.py`` (``aggregation="reduce_scatter"``, the default for P > 2) and
``base.py`` (allgather). With error feedback (``compressed_allreduce(memory=...)``) "auto" gathers instead: the
reduce-scatter re-quantizes the owners' partial sums, an error no worker's memory holds, so the feedback
invariant Σ(results) + Σ(residuals) = Σ(gradients) would not hold (an owner-side memory, as 1-bit Adam's
server compensation, would keep it at the reduce-scatter's bytes: not built).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch

from sparsync.buffers import fresh
from sparsync.collectives.allreduce import DsarCall
from sparsync.compress.base import (
    NO_CONTEXT,
    Compressor,
    Context,
    QuantizedPayload,
    TensorSpec,
    check_kernels,
    check_positive_int,
    native_for,
)
from sparsync.compress.qsgd_kernels import CHUNK, Workspace, chunk_values, native_available
from sparsync.stream import SparseStream

__all__ = ["CHUNK", "QSGD", "REQUANTIZE_STREAM", "Workspace"]

_NOISE_STREAM = 0  # generator streams of one (name, rank): the compressor's own rounding ...
REQUANTIZE_STREAM = 1  # ... and the re-quantization of a partition sum (qsgd_allreduce.py)


@dataclass(frozen=True, eq=False)
class QSGD(Compressor):
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

    @property
    def levels(self) -> int:
        return int(2 ** (self.bits - 1) - 1)

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
        from sparsync.compress.dsar_quantized import dsar_quantized  # late: it builds on this module

        return dsar_quantized(call, self)

    def generator(self, ctx: Context, stream: int = _NOISE_STREAM) -> torch.Generator:
        """The rounding noise of (ctx.name, ctx.rank): one generator per stream, seeded by (seed, name, rank,
        stream) and advanced by every call, so a run is reproducible and ranks round independently."""
        key = (ctx.name, ctx.rank, stream)
        g = self._gens.get(key)
        if g is None:
            mix = (self.seed, zlib.crc32(ctx.name.encode()), ctx.rank) + ((stream,) if stream else ())
            g = torch.Generator().manual_seed(hash(mix) % 2**62)  # hash of ints: the same in every process
            self._gens[key] = g
        return g

    def compress(self, tensor: torch.Tensor, ctx: Context = NO_CONTEXT) -> QuantizedPayload:
        flat = tensor.reshape(-1)
        n = flat.numel()
        out = self.empty_payload(n, flat.device)
        self.encode_range(flat, 0, n, out, Workspace(self, n, flat.device), self.generator(ctx))
        return out  # the last bucket's padding stays home

    def empty_payload(self, n: int, device: torch.device | None = None) -> QuantizedPayload:
        """Uninitialized codes and scales for ``n`` values (``payload_nbytes(n)`` bytes) on ``device`` (default
        the host)."""
        codes = torch.empty(self.code_bytes(n), dtype=torch.uint8, device=_HOST if device is None else device)
        return QuantizedPayload(codes, torch.empty(-(-n // self.bucket), dtype=torch.float32, device=codes.device))

    def payload_nbytes(self, n: int) -> int:
        """Bytes of the payload of ``n`` values: packed codes and one float32 scale per bucket."""
        return self.code_bytes(n) + 4 * -(-n // self.bucket)

    def encode_range(
        self, flat: torch.Tensor, a: int, b: int, out: QuantizedPayload, ws: Workspace, gen: torch.Generator
    ) -> None:
        """Encode values [a, b) of ``flat`` into ``out`` (the payload of all of ``flat``), ``a`` a multiple of
        ``chunk_step()``: encoding [0, n) in consecutive ranges gives the bits of one ``compress`` call with the
        same generator state (the chunks, and so the noise draws, are the same)."""
        for c0, c1 in self._chunks(b, a, ws.pass_values):
            scales = out.scales[c0 // self.bucket : -(-c1 // self.bucket)]
            ws.quantize(flat[c0:c1], scales, out.codes[c0 * self.bits // 8 : -(-c1 * self.bits // 8)], gen)

    def decode_into(self, payload: QuantizedPayload, out: torch.Tensor, ws: Workspace) -> None:
        """out (float32, the payload's values) = decode(payload), chunk by chunk with ``ws``'s scratch."""
        for a, b in self._chunks(out.numel(), 0, ws.pass_values):
            ws.decode_into([payload], a, b, out[a:b])

    def workspace(self, n: int, device: torch.device | None = None) -> Workspace:
        """Scratch for encoding or decoding up to ``chunk_step()`` values at a time, of a tensor of ``n`` on
        ``device`` (default the host)."""
        return Workspace(self, n, device)

    def chunk_step(self) -> int:
        """Values per kernel pass: whole buckets, a whole number of aligned units (codes start on a byte)."""
        return chunk_values(self.bucket, self.unit())

    def decompress(self, payload: QuantizedPayload, spec: TensorSpec) -> torch.Tensor:
        return self.finish(self.decode_sum([payload], spec.numel), spec)

    def decompress_gathered(self, payloads: list[QuantizedPayload], spec: TensorSpec) -> torch.Tensor:
        """Sum of every rank's payload, decoded chunk by chunk into one output (no P full-size decodes)."""
        return self.finish(self.decode_sum(payloads, spec.numel), spec)

    # --- kernels shared with qsgd_allreduce ---------------------------------------------------------------
    def code_bytes(self, n: int) -> int:
        """Bytes of ``n`` packed codes."""
        return -(-n * self.bits // 8)

    def unit(self) -> int:
        """Buckets per aligned unit: a run of whole units starts on a byte of the packed codes."""
        per = 8 // self.bits
        return per // math.gcd(self.bucket, per)

    def decode_sum(self, payloads: list[QuantizedPayload], n: int) -> torch.Tensor:
        """float32 sum of the decoded ``payloads`` (each of ``n`` values), accumulated per chunk in cache, on
        the payloads' device."""
        device = _device_of(payloads)
        out = fresh(n, device=device)  # large: huge pages, cheaper to fault in (the host)
        ws = Workspace(self, n, device)
        for a, b in self._chunks(n, 0, ws.pass_values):
            ws.decode_into(payloads, a, b, out[a:b])
        return out

    def sum_requantize(
        self, payloads: list[QuantizedPayload], n: int, gen: torch.Generator, exact: torch.Tensor | None = None
    ) -> QuantizedPayload:
        """Quantized payload of ``exact`` (if given) plus the sum of ``payloads`` (each of ``n`` values): decode,
        add in that order and re-quantize with noise from ``gen``, chunk by chunk (qsgd_allreduce's step 2)."""
        device = exact.device if exact is not None else _device_of(payloads)
        out = self.empty_payload(n, device)
        ws = Workspace(self, n, device)
        acc = torch.empty(min(n, ws.chunk), dtype=torch.float32, device=device)
        for a, b in self._chunks(n, 0, ws.pass_values):
            ws.decode_into(payloads, a, b, acc[: b - a], None if exact is None else exact[a:b])
            scales = out.scales[a // self.bucket : -(-b // self.bucket)]
            ws.quantize(acc[: b - a], scales, out.codes[a * self.bits // 8 : -(-b * self.bits // 8)], gen)
        return out

    def _chunks(self, n: int, start: int, step: int) -> list[tuple[int, int]]:
        """[a, b) ranges of ``step`` values (whole noise chunks: a ``Workspace``'s ``pass_values``) from
        ``start`` to ``n``; the last one may end in a partial bucket. Every range's codes start on a byte."""
        return [(a, min(n, a + step)) for a in range(start, n, step)]

    def finish(self, out: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
        """The tensor ``spec`` describes from decoded float32 values (dtype, shape, layout)."""
        out = out.to(spec.dtype).reshape(spec.shape)
        return out.to_sparse(spec.sparse_dim) if spec.sparse_dim is not None else out


_HOST = torch.device("cpu")


def _device_of(payloads: list[QuantizedPayload]) -> torch.device:
    """Where payloads live (every one on the same device; the host for none)."""
    return payloads[0].codes.device if payloads else _HOST
