"""``SparseSketch``: S2 Reducer (S2 §3.1, Algorithm 1).

Compress: a bitmap of the non-zero blocks (S2 §2.2: a block is one embedding row, or a fixed chunk of a flat
gradient) and an r x c count sketch into which every non-zero g(i) is added as s_j(i)·g(i) at S[j, h_j(i)]
(Alg. 1 lines 1-6). Both are linear in g (S2 §3.1: the sketch is Aᵀg), so one dense allreduce of their
concatenation yields the bitmap and sketch of the sum (line 8). Decompress: only the elements of blocks set
in the reduced bitmap are queried, as the median over the r rows of s_j(i)·S[j, h_j(i)] (lines 9-15); for an
even r the mean of the two middle estimates, so the estimate stays symmetric about g(i) (S2 Thm. 1,
unbiasedness).

Unlike the authors' public code, the table is a fresh zero table on every call (theirs accumulates across
steps) and ``reduce`` writes the queried result back into the gradient (theirs drops it).

Size: ``cols`` directly, or ``ratio`` = (sketch cells r·c) / (tensor entries), so c = ceil(ratio·numel / r).
S2's λ = m / (α·d) (m buckets, α the density of the gradient, d its size) relates to it by λ = ratio / α: for an
embedding gradient of density α, ``ratio = λ·α``. A fixed ratio (not a per-call α) keeps c identical on every
rank without an extra exchange. The hashes are a splitmix64 mix of (seed, row, index): the same on every rank
for the same seed, computed only for the indices that are queried or inserted (no d-sized hash tables).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from sparsync.collectives.tensor import coo_to_stream
from sparsync.compress.base import NO_CONTEXT, Compressor, Context, SketchPayload, TensorSpec, check_positive_int
from sparsync.stream import SparseStream

FLAT_BLOCK = 64  # default block of a 1-D tensor (a 2-D+ tensor's default block is one row)
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, eq=False)
class SparseSketch(Compressor):
    """Bitmap + count sketch, summed by one dense allreduce (S2 Reducer)."""

    name: ClassVar[str] = "sketch"
    accepts_sparse: ClassVar[bool] = True
    unbiased: ClassVar[bool] = True

    rows: int = 3  # r: independent hash rows; the query is their median
    cols: int | None = None  # c: buckets per row (give cols or ratio)
    ratio: float | None = None  # r·c / numel, i.e. S2's λ times the gradient's density α
    block: int | None = None  # entries per bitmap bit; None: one row of a 2-D+ tensor, FLAT_BLOCK for 1-D
    seed: int = 0  # hash seed: must be the same on every rank

    def __post_init__(self) -> None:
        check_positive_int(self.rows, "rows")
        if (self.cols is None) == (self.ratio is None):
            raise ValueError(f"give exactly one of cols and ratio, got cols={self.cols!r}, ratio={self.ratio!r}")
        if self.cols is not None:
            check_positive_int(self.cols, "cols")
        if self.ratio is not None and not (isinstance(self.ratio, int | float) and self.ratio > 0):
            raise ValueError(f"ratio must be > 0, got {self.ratio!r}")
        if self.block is not None:
            check_positive_int(self.block, "block")

    def width(self, numel: int) -> int:
        """c for a tensor of ``numel`` entries."""
        if self.cols is not None:
            return self.cols
        assert self.ratio is not None
        return max(1, math.ceil(self.ratio * numel / self.rows))

    def payload_numel(self, shape: Sequence[int]) -> int:
        """Entries of the payload (bitmap + r x c table) for a tensor of ``shape``: what every rank puts into the
        one dense allreduce (S2 Alg. 1 line 8), whatever the gradient's density."""
        spec = TensorSpec(torch.Size(shape), torch.float32)
        return -(-spec.numel // self.block_size(spec)) + self.rows * self.width(spec.numel)

    def block_size(self, spec: TensorSpec) -> int:
        if self.block is not None:
            return self.block
        if len(spec.shape) >= 2:
            return max(1, math.prod(spec.shape[1:]))
        return FLAT_BLOCK

    def compress(self, tensor: torch.Tensor, ctx: Context = NO_CONTEXT) -> SketchPayload:
        spec = TensorSpec.of(tensor)
        s = (
            coo_to_stream(tensor).elements()
            if tensor.is_sparse
            else SparseStream.from_dense(tensor, auto_dense=False)
        )
        assert s.indices is not None
        idx, vals = s.indices.to(torch.int64), s.values
        b = self.block_size(spec)
        dtype = tensor.dtype
        bitmap = torch.zeros(-(-spec.numel // b), dtype=dtype)
        bitmap[idx // b] = 1
        c = self.width(spec.numel)
        table = torch.zeros(self.rows, c, dtype=dtype)
        for j in range(self.rows):
            h, sign = self._hash(idx, j, c)
            table[j].index_add_(0, h, torch.where(sign, -vals, vals))
        return SketchPayload(bitmap, table)

    def decompress(self, payload: SketchPayload, spec: TensorSpec) -> torch.Tensor:
        b = self.block_size(spec)
        n = spec.numel
        blocks = torch.nonzero(payload.bitmap > 0, as_tuple=True)[0]
        idx = (blocks.unsqueeze(1) * b + torch.arange(b)).reshape(-1)
        idx = idx[idx < n]
        c = payload.table.shape[1]
        est = torch.empty(self.rows, idx.numel(), dtype=payload.table.dtype)
        for j in range(self.rows):
            h, sign = self._hash(idx, j, c)
            e = payload.table[j][h]
            est[j] = torch.where(sign, -e, e)
        if self.rows == 3:  # the default r: the middle of three by min/max, ~8x faster than median(0)
            e0, e1, e2 = est[0], est[1], est[2]
            vals = torch.maximum(torch.minimum(e0, e1), torch.minimum(torch.maximum(e0, e1), e2))
        elif self.rows % 2:
            vals = est.median(0).values  # odd r: the middle estimate itself
        else:
            srt = est.sort(0).values
            vals = (srt[self.rows // 2 - 1] + srt[self.rows // 2]) / 2
        if spec.sparse_dim is not None:
            from sparsync.collectives.tensor import stream_to_coo

            return stream_to_coo(
                SparseStream(idx, vals.to(spec.dtype), n, validate=False), spec.shape, spec.sparse_dim
            )
        out = torch.zeros(n, dtype=spec.dtype)
        out[idx] = vals.to(spec.dtype)
        return out.reshape(spec.shape)

    def _hash(self, idx: torch.Tensor, row: int, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(bucket in [0, c), sign flip) of every index for hash row ``row``."""
        salt = _splitmix_int(_splitmix_int(self.seed) ^ row)
        z = _splitmix(idx ^ _signed(salt))
        return (z & 0x7FFF_FFFF_FFFF_FFFF) % c, z < 0


def _signed(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def _splitmix_int(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 tensors (multiplication wraps modulo 2^64)."""
    z = x + _signed(0x9E3779B97F4A7C15)
    z = (z ^ _shr(z, 30)) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ _shr(z, 27)) * _signed(0x94D049BB133111EB)
    return z ^ _shr(z, 31)
