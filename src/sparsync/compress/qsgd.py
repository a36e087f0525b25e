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
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch

from sparsync.compress.base import (
    NO_CONTEXT,
    Compressor,
    Context,
    QuantizedPayload,
    TensorSpec,
    check_positive_int,
)


@dataclass(frozen=True, eq=False)
class QSGD(Compressor):
    """Unbiased stochastic quantization to ``bits`` bits per value."""

    name: ClassVar[str] = "qsgd"
    unbiased: ClassVar[bool] = True

    bits: int = 4  # bits per value, sign included: 2, 4 or 8
    bucket: int = 512  # values per scale
    scale: Literal["max", "l2"] = "max"  # per-bucket scale: ‖v‖∞ (default) or ‖v‖₂ (QSGD paper)
    seed: int = 0  # rounding noise: a generator seeded by (seed, name, rank), advanced every call
    _gens: dict[tuple[str, int], torch.Generator] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.bits not in (2, 4, 8):
            raise ValueError(f"bits must be 2, 4 or 8 (codes are packed whole into bytes), got {self.bits!r}")
        check_positive_int(self.bucket, "bucket")
        if self.scale not in ("max", "l2"):
            raise ValueError(f"scale must be 'max' or 'l2', got {self.scale!r}")

    @property
    def levels(self) -> int:
        return int(2 ** (self.bits - 1) - 1)

    def _generator(self, ctx: Context) -> torch.Generator:
        key = (ctx.name, ctx.rank)
        g = self._gens.get(key)
        if g is None:
            g = torch.Generator().manual_seed(hash((self.seed, zlib.crc32(ctx.name.encode()), ctx.rank)) % 2**62)
            self._gens[key] = g
        return g

    def compress(self, tensor: torch.Tensor, ctx: Context = NO_CONTEXT) -> QuantizedPayload:
        flat = tensor.reshape(-1).to(torch.float32)
        n = flat.numel()
        nb = -(-n // self.bucket)
        x = torch.nn.functional.pad(flat, (0, nb * self.bucket - n)).reshape(nb, self.bucket)
        scales = x.abs().amax(1) if self.scale == "max" else torch.linalg.vector_norm(x, dim=1)
        s = self.levels
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        # Signed level l = v·s/S ∈ [-s, s]; floor(l + u), u ~ U[0, 1), rounds up with probability frac(l):
        # the same unbiased rounding as QSGD's sign·(⌊|l|⌋ + Bernoulli(frac|l|)), with the same variance
        # frac(1 - frac), in three passes instead of a separate sign.
        level = x * (s / safe).unsqueeze(1)
        level += torch.rand(level.shape, generator=self._generator(ctx))
        codes = level.floor_().add_(s).clamp_(0, 2 * s).to(torch.uint8).reshape(-1)
        return QuantizedPayload(_pack(codes[:n], self.bits), scales)  # the last bucket's padding stays home

    def decompress(self, payload: QuantizedPayload, spec: TensorSpec) -> torch.Tensor:
        n = spec.numel
        nb = payload.scales.numel()
        codes = _unpack(payload.codes, self.bits, n)
        codes = torch.nn.functional.pad(codes, (0, nb * self.bucket - n), value=self.levels).reshape(
            nb, self.bucket
        )
        s = self.levels
        vals = (codes.to(torch.float32) - s) * (payload.scales / s).unsqueeze(1)
        out = vals.reshape(-1)[:n].to(spec.dtype).reshape(spec.shape)
        return out.to_sparse(spec.sparse_dim) if spec.sparse_dim is not None else out


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``8 // bits`` codes per byte, first code in the low bits."""
    per = 8 // bits
    if per == 1:
        return codes
    pad = (-codes.numel()) % per
    c = torch.nn.functional.pad(codes, (0, pad)).reshape(-1, per)
    out = c[:, 0].clone()
    for j in range(1, per):
        out |= c[:, j] << (j * bits)
    return out


def _unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    per = 8 // bits
    if per == 1:
        return packed[:n]
    shifts = torch.arange(per, dtype=torch.int32) * bits
    c = (packed.to(torch.int32).unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return c.reshape(-1)[:n].to(torch.uint8)
