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

Kernels: vectorized torch over chunks of 512K values (``CHUNK``: a chunk's passes stay in L2/L3
and no tensor-sized temporary is allocated, a fresh 100 MB buffer costing more in page faults than the
arithmetic on it; 128K chunks paid 20% more in per-op dispatch). Rounding noise is 16 random bits per value,
drawn as 64-bit words (``random_`` on int64: a few times cheaper per value than ``torch.rand``): the rounding
is unbiased up to 2^-17 of a quantization step (the float32 ``torch.rand`` it replaces was unbiased up to
2^-24). Codes are packed with integer shifts on int32 / int64 views of int16 codes (little-endian layout, as
on every platform torch runs on) and decoded by one ``index_select`` per byte from a 256-entry table of that
byte's ``8 // bits`` levels (faster than unpacking with shifts). Timings: docs/compress_results.md.

Aggregation: see ``qsgd_allreduce.py`` (``aggregation="reduce_scatter"``, the default for P > 2) and
``base.py`` (allgather).
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
    check_positive_int,
)
from sparsync.stream import SparseStream

CHUNK = 1 << 19  # values per kernel pass (module doc)
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
        out = self.empty_payload(n)
        self.encode_range(flat, 0, n, out, Workspace(self, n), self.generator(ctx))
        return out  # the last bucket's padding stays home

    def empty_payload(self, n: int) -> QuantizedPayload:
        """Uninitialized codes and scales for ``n`` values (``payload_nbytes(n)`` bytes)."""
        codes = torch.empty(self.code_bytes(n), dtype=torch.uint8)
        return QuantizedPayload(codes, torch.empty(-(-n // self.bucket), dtype=torch.float32))

    def payload_nbytes(self, n: int) -> int:
        """Bytes of the payload of ``n`` values: packed codes and one float32 scale per bucket."""
        return self.code_bytes(n) + 4 * -(-n // self.bucket)

    def encode_range(
        self, flat: torch.Tensor, a: int, b: int, out: QuantizedPayload, ws: Workspace, gen: torch.Generator
    ) -> None:
        """Encode values [a, b) of ``flat`` into ``out`` (the payload of all of ``flat``), ``a`` a multiple of
        ``chunk_step()``: encoding [0, n) in consecutive ranges gives the bits of one ``compress`` call with the
        same generator state (the chunks, and so the noise draws, are the same)."""
        for c0, c1 in self._chunks(b, a):
            ws.encode(flat[c0:c1], out.scales[c0 // self.bucket : -(-c1 // self.bucket)], gen)
            ws.pack(c1 - c0, out.codes[c0 * self.bits // 8 : -(-c1 * self.bits // 8)])

    def decode_into(self, payload: QuantizedPayload, out: torch.Tensor, ws: Workspace) -> None:
        """out (float32, the payload's values) = decode(payload), chunk by chunk with ``ws``'s scratch."""
        for a, b in self._chunks(out.numel()):
            ws.decode_into([payload], a, b, out[a:b])

    def workspace(self, n: int) -> Workspace:
        """Scratch for encoding or decoding up to ``chunk_step()`` values at a time, of a tensor of ``n``."""
        return Workspace(self, n)

    def chunk_step(self) -> int:
        """Values per kernel pass: whole buckets, a whole number of aligned units (codes start on a byte)."""
        return _chunk_values(self.bucket, self.unit())

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
        """float32 sum of the decoded ``payloads`` (each of ``n`` values), accumulated per chunk in cache."""
        out = fresh(n)  # large: huge pages, cheaper to fault in
        ws = Workspace(self, n)
        for a, b in self._chunks(n):
            ws.decode_into(payloads, a, b, out[a:b])
        return out

    def sum_requantize(
        self, payloads: list[QuantizedPayload], n: int, gen: torch.Generator, exact: torch.Tensor | None = None
    ) -> QuantizedPayload:
        """Quantized payload of ``exact`` (if given) plus the sum of ``payloads`` (each of ``n`` values): decode,
        add in that order and re-quantize with noise from ``gen``, chunk by chunk (qsgd_allreduce's step 2)."""
        out = self.empty_payload(n)
        ws = Workspace(self, n)
        acc = torch.empty(min(n, ws.chunk), dtype=torch.float32)
        for a, b in self._chunks(n):
            ws.decode_into(payloads, a, b, acc[: b - a], None if exact is None else exact[a:b])
            ws.encode(acc[: b - a], out.scales[a // self.bucket : -(-b // self.bucket)], gen)
            ws.pack(b - a, out.codes[a * self.bits // 8 : -(-b * self.bits // 8)])
        return out

    def _chunks(self, n: int, start: int = 0) -> list[tuple[int, int]]:
        """[a, b) ranges of whole buckets from ``start`` to ``n`` (the last one may end in a partial bucket),
        each a whole number of aligned units, so every chunk's codes start on a byte."""
        step = self.chunk_step()
        return [(a, min(n, a + step)) for a in range(start, n, step)]

    def finish(self, out: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
        """The tensor ``spec`` describes from decoded float32 values (dtype, shape, layout)."""
        out = out.to(spec.dtype).reshape(spec.shape)
        return out.to_sparse(spec.sparse_dim) if spec.sparse_dim is not None else out


def _chunk_values(bucket: int, unit: int) -> int:
    return max(unit, CHUNK // bucket // unit * unit) * bucket


class Workspace:
    """Scratch buffers of one call, sized for one chunk and reused by every chunk."""

    def __init__(self, q: QSGD, n: int) -> None:
        self.bits, self.bucket, self.s, self.l2 = q.bits, q.bucket, q.levels, q.scale == "l2"
        self.chunk = min(n, _chunk_values(q.bucket, q.unit()))
        words = -(-self.chunk // 4)
        self.noise = torch.empty(words, dtype=torch.int64)  # 4 x 16 random bits per word
        self.codes = torch.empty(words * 4, dtype=torch.int16)  # room to pad a chunk to whole int64 words
        self.f = torch.empty(self.chunk, dtype=torch.float32)
        self.wide = torch.empty(words * 2, dtype=torch.int64)
        per = 8 // self.bits  # decode: the levels of every byte value, per codes a byte (first in the low bits)
        byte = torch.arange(256, dtype=torch.int32).unsqueeze(1)
        codes = byte.bitwise_right_shift(torch.arange(per, dtype=torch.int32) * self.bits) & ((1 << self.bits) - 1)
        lut = (codes - self.s).to(torch.float32)  # (256, per)
        self.lut = lut.view(256) if per == 1 else lut
        self.idx = torch.empty(-(-self.chunk * self.bits // 8), dtype=torch.int32)
        self.lvl = torch.empty(self.idx.numel() * per, dtype=torch.float32)

    def encode(self, x: torch.Tensor, scales: torch.Tensor, gen: torch.Generator) -> None:
        """Codes q + s of the chunk ``x`` into ``self.codes`` and its bucket scales into ``scales``."""
        k, B = x.numel(), self.bucket
        full = k // B * B
        if full:
            self._round(x[:full].view(-1, B), scales[: full // B], self.codes[:full].view(-1, B), gen)
        if full < k:  # the tensor's last, partial bucket
            self._round(x[full:].view(1, -1), scales[full // B :], self.codes[full:k].view(1, -1), gen)

    def _round(self, x: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor, gen: torch.Generator) -> None:
        xf = x if x.dtype == torch.float32 else x.to(torch.float32)
        s = self.s
        k = xf.numel()
        t = self.f[:k].view_as(xf)  # scratch: |x| here, then the rounded levels (no fresh chunk-sized temporary)
        S = torch.linalg.vector_norm(xf, dim=1) if self.l2 else torch.abs(xf, out=t).amax(1)
        scales.copy_(S)
        inv = torch.where(S > 0, s / S, torch.zeros_like(S)).unsqueeze(1)  # a zero bucket: code s, value 0
        noise = self.noise[: -(-k // 4)].random_(-(2**63), None, generator=gen).view(torch.int16)[:k]
        # code = floor(v·s/S + s + u) with u = (r + 32768.5) / 2^16 ∈ (0, 1), r a uniform int16: rounds up
        # with probability frac(v·s/S) ± 2^-17. t ≥ 0, so the float -> int16 conversion's truncation floors.
        t.copy_(noise.view_as(xf)).mul_(2.0**-16).add_(s + 0.5 + 2.0**-17)
        t.addcmul_(xf, inv).clamp_(0, 2 * s)  # clamp: float rounding at ±S must not leave [0, 2s]
        codes.copy_(t)

    def pack(self, k: int, out: torch.Tensor) -> None:
        """Pack the first ``k`` codes of ``self.codes``, ``8 // bits`` to a byte (first in the low bits)."""
        per = 8 // self.bits
        if per == 1:
            out.copy_(self.codes[:k])
            return
        m = -(-k // per)
        self.codes[k : m * per] = 0
        # An int32 (int64) word holds 2 (4) int16 codes c_j at bit 16j; shifting it right by j·(16 - bits)
        # brings c_j to bit j·bits. OR the shifted copies; the narrowing to uint8 keeps the low byte.
        word = self.codes[: m * per].view(torch.int32 if per == 2 else torch.int64)
        tmp = self.wide[:m] if per == 4 else self.wide.view(torch.int32)[:m]
        for j in range(1, per):
            word.bitwise_or_(torch.bitwise_right_shift(word, j * (16 - self.bits), out=tmp))
        out.copy_(word)

    def levels(self, packed: torch.Tensor, k: int, dst: torch.Tensor) -> None:
        """dst (float32, k values) = the levels q = code - s of ``packed`` bytes, exact small integers: one
        table lookup per byte (``index_select`` of the byte's ``8 // bits`` levels, read as one 4-, 8- or
        16-byte word), the inverse of ``pack``."""
        per, m = 8 // self.bits, packed.numel()
        idx = self.idx[:m]
        idx.copy_(packed)
        aligned = k == m * per and dst.storage_offset() % per == 0  # dst viewed as words of per levels
        lvl = dst if aligned else self.lvl[: m * per]
        if per == 1:
            torch.index_select(self.lut, 0, idx, out=lvl)
        elif per == 2:
            torch.index_select(self.lut.view(torch.int64).view(-1), 0, idx, out=lvl.view(torch.int64))
        else:
            torch.index_select(self.lut.view(torch.int64), 0, idx, out=lvl.view(torch.int64).view(m, 2))
        if not aligned:
            dst.copy_(lvl[:k])

    def decode_into(
        self,
        payloads: list[QuantizedPayload],
        a: int,
        b: int,
        out: torch.Tensor,
        first: torch.Tensor | None = None,
    ) -> None:
        """out = first + Σ_p decode(p)[a:b] (float32; ``first``, if given: values [a, b) of an exact term);
        [a, b) a chunk of ``QSGD._chunks``."""
        B, bits = self.bucket, self.bits
        nb = -(-(b - a) // B)
        full = (b - a) // B * B
        if first is not None:
            out.copy_(first)
        for i, p in enumerate(payloads):
            step = p.scales[a // B : a // B + nb] / self.s
            dst = out if i == 0 and first is None else self.f[: b - a]
            self.levels(p.codes[a * bits // 8 : -(-b * bits // 8)], b - a, dst)  # exact q; one rounding: q·(S/s)
            if full:
                dst[:full].view(-1, B).mul_(step[: full // B].unsqueeze(1))
            if full < b - a:
                dst[full:].mul_(step[-1])
            if dst is not out:
                out.add_(dst)
