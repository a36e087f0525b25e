"""QSGD's quantizer (Alistarh et al. 2017; SparCML §5 "Low-Precision Support"): the encode and decode that the
compressor (``qsgd.py``), its quantized reduce-scatter (``qsgd_allreduce.py``) and DSAR's quantized dense phase
(``dsar_quantized.py``) share. A mixin of ``QSGD``, which holds the settings; apart from it so that those two
modules build on the quantizer and ``qsgd.py`` on them, with no import going back (module doc of ``qsgd.py``).
"""

from __future__ import annotations

import math
import zlib
from typing import Literal

import torch

from sparsync.buffers import fresh
from sparsync.compress.base import NO_CONTEXT, Context, QuantizedPayload, TensorSpec
from sparsync.compress.qsgd_kernels import CHUNK, Workspace, chunk_values

__all__ = ["CHUNK", "REQUANTIZE_STREAM", "QSGDCodec", "Workspace"]

_NOISE_STREAM = 0  # generator streams of one (name, rank): the compressor's own rounding ...
REQUANTIZE_STREAM = 1  # ... and the re-quantization of a partition sum (qsgd_allreduce.py)


class QSGDCodec:
    """Encode, decode and re-quantize with ``bits`` bits per value and one scale per ``bucket`` values; the
    settings and the generators are ``QSGD``'s fields (declared here for the type checker)."""

    bits: int
    bucket: int
    scale: Literal["max", "l2"]
    seed: int
    kernels: Literal["auto", "c", "torch"]
    _gens: dict[tuple[str, int, int], torch.Generator]

    @property
    def levels(self) -> int:
        return int(2 ** (self.bits - 1) - 1)

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
