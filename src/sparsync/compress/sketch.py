"""``SparseSketch``: S2 Reducer (S2 §3.1, Algorithm 1).

Compress: a bitmap of the non-zero blocks (S2 §2.2: a block is one embedding row, or a fixed chunk of a flat
gradient) and an r x c count sketch into which every non-zero g(i) is added as s_j(i)·g(i) at S[j, h_j(i)]
(Alg. 1 lines 1-6). Both are linear in g (S2 §3.1: the sketch is Aᵀg), so one dense allreduce of their
concatenation yields the bitmap and sketch of the sum (line 8). Decompress: only the elements of blocks set
in the reduced bitmap are queried, as the median over the r rows of s_j(i)·S[j, h_j(i)] (lines 9-15); for an
even r the mean of the two middle estimates, so the estimate stays symmetric about g(i) (S2 Thm. 1,
unbiasedness). A COO input (an ``nn.Embedding(sparse=True)`` gradient) is read as its coalesced rows: with
the default block (one row) the rows are the set blocks, so compress costs O(nnz) besides the zeroed bitmap
and table, and decompress O(blocks) for the bitmap scan besides the queried rows.

Unlike the authors' public code, the table is a fresh zero table on every call (theirs accumulates across
steps) and ``reduce`` writes the queried result back into the gradient (theirs drops it).

Size: ``cols`` directly, or ``ratio`` = (sketch cells r·c) / (tensor entries), so c = ceil(ratio·numel / r).
S2's λ = m / (α·d) (m buckets, α the density of the gradient, d its size) relates to it by λ = ratio / α: for an
embedding gradient of density α, ``ratio = λ·α``. A fixed ratio (not a per-call α) keeps c identical on every
rank without an extra exchange.

Hashes: row j's multiply-add-shift hash z = (a_j·i + b_j) mod 2^64, with (a_j, b_j) drawn from
``seed`` (the same on every rank). For indices i < 2^32 the top 32 bits of z are pairwise independent and
uniform over random (a_j, b_j) (Dietzfelbinger 1996, strongly universal multiply-add-shift), so the sign
s_j(i) = bit 63 and the bucket h_j(i) = ⌊c·(bits 32..62)/2^31⌋ are independent of each other, and the signs of
two indices are pairwise independent: E[s_j(i)s_j(k)] = 0, which is all S2 Thm. 1's unbiasedness needs. Five
int64 passes per row (for a run of positions an add replaces the multiply and add; for a run of whole blocks,
one broadcast add of a per-block base and a_j·t), over chunks of 64K indices that stay in cache; the
splitmix64 mix it replaces was two orders of magnitude slower. The sign is applied by XOR-ing the
value's sign bit; the median of r ≤ 8 rows is a min/max sorting network (torch.median over a short dim is much
slower). Timings: docs/compress_results.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from sparsync.collectives.tensor import coo_to_stream, stream_to_coo
from sparsync.compress.base import (
    NO_CONTEXT,
    Compressor,
    Context,
    SketchPayload,
    TensorSpec,
    check_positive_int,
    packed_bitmap_bytes,
)
from sparsync.stream import SparseStream

FLAT_BLOCK = 64  # default block of a 1-D tensor (a 2-D+ tensor's default block is one row)
CHUNK = 1 << 16  # indices per hashing pass
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
            if self.cols >= 2**31:
                raise ValueError(
                    f"cols must be < 2**31 (the bucket is a 31-bit fraction times c), got {self.cols}"
                )
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
        """Entries of the payload (bitmap + r x c table) for a tensor of ``shape`` in S2's one-allreduce form
        (``SketchPayload.to_buffer``, S2 Alg. 1 line 8), whatever the gradient's density."""
        spec = TensorSpec(torch.Size(shape), torch.float32)
        return -(-spec.numel // self.block_size(spec)) + self.rows * self.width(spec.numel)

    def payload_nbytes(self, shape: Sequence[int], itemsize: int = 4) -> int:
        """Bytes every rank allreduces for a tensor of ``shape`` (``SketchPayload.nbytes``): the packed bitmap
        and the r x c table of ``itemsize``-byte entries, whatever the gradient's density."""
        spec = TensorSpec(torch.Size(shape), torch.float32)
        blocks = -(-spec.numel // self.block_size(spec))
        return packed_bitmap_bytes(blocks) + self.rows * self.width(spec.numel) * itemsize

    def block_size(self, spec: TensorSpec) -> int:
        if self.block is not None:
            return self.block
        if len(spec.shape) >= 2:
            return max(1, math.prod(spec.shape[1:]))
        return FLAT_BLOCK

    def compress(self, tensor: torch.Tensor, ctx: Context = NO_CONTEXT) -> SketchPayload:
        spec = TensorSpec.of(tensor)
        b, n = self.block_size(spec), spec.numel
        nblocks = -(-n // b)
        dtype = tensor.dtype
        work = torch.float64 if dtype == torch.float64 else torch.float32
        bitmap = torch.zeros(nblocks, dtype=dtype)  # the one O(blocks) structure of a call (S2 Alg. 1 line 2)
        c = self.width(n)
        table = torch.zeros(self.rows, c, dtype=work)
        hasher = _Hasher(self, c, work)
        if tensor.is_sparse:
            s = coo_to_stream(tensor)  # coalesced rows, O(nnz): a COO input is never densified
            assert s.indices is not None
            if s.row == b:  # a block is one COO row (an embedding row): the rows are the set blocks
                blocks, vals = s.indices.to(torch.int64), s.values.to(work)
            else:
                e = s.elements()
                assert e.indices is not None
                idx, vals = e.indices.to(torch.int64), e.values.to(work)
                bitmap[idx // b] = 1
                for a in range(0, idx.numel(), CHUNK):
                    hasher.insert(table, idx[a : a + CHUNK], vals[a : a + CHUNK])
                return SketchPayload(bitmap, table.to(dtype))
        else:
            flat = tensor.reshape(-1)
            blocks = _nonzero_blocks(flat, b)
            if blocks.numel() == nblocks:  # every block set: hash positions a..b, no index list
                bitmap.fill_(1)
                for a in range(0, n, CHUNK):
                    hasher.insert(table, a, flat[a : a + CHUNK].to(work))
                return SketchPayload(bitmap, table.to(dtype))
            # zeros inside a set block add 0 to the table: hash the same set of positions decompress queries
            vals = _gather_blocks(flat, blocks, b).to(work)
        bitmap[blocks] = 1
        for h, lo, hi in _runs(blocks, b, n):
            hasher.insert(table, h, vals[lo:hi])
        return SketchPayload(bitmap, table.to(dtype))

    def decompress(self, payload: SketchPayload, spec: TensorSpec) -> torch.Tensor:
        b, n = self.block_size(spec), spec.numel
        blocks = torch.nonzero(payload.bitmap > 0, as_tuple=True)[0]
        c = payload.table.shape[1]
        work = torch.float64 if payload.table.dtype == torch.float64 else torch.float32
        table = payload.table.to(work)
        hasher = _Hasher(self, c, work)
        if spec.sparse_dim is None and blocks.numel() == -(-n // b):  # every block set: write in place
            out = torch.empty(n, dtype=work)
            for a in range(0, n, CHUNK):
                hasher.query(table, a, out[a : a + CHUNK])
            return out.to(spec.dtype).reshape(spec.shape)
        vals = torch.empty(_block_numel(blocks, b, n), dtype=work)
        for h, lo, hi in _runs(blocks, b, n):
            hasher.query(table, h, vals[lo:hi])
        vals = vals.to(spec.dtype)
        if spec.sparse_dim is not None:
            if math.prod(spec.shape[spec.sparse_dim :]) == b:  # blocks are COO rows: no per-element regrouping
                return stream_to_coo(
                    SparseStream(blocks, vals, n, row=b, validate=False), spec.shape, spec.sparse_dim
                )
            idx = _block_elements(blocks, b, n)
            return stream_to_coo(SparseStream(idx, vals, n, validate=False), spec.shape, spec.sparse_dim)
        out = torch.zeros(n, dtype=spec.dtype)
        if n % b == 0:
            out.view(-1, b)[blocks] = vals.view(-1, b)
        else:
            out[_block_elements(blocks, b, n)] = vals
        return out.reshape(spec.shape)


@dataclass(frozen=True)
class _RowRun:
    """The element indices of whole blocks: ``blocks[i]·width + t`` for t < width, block by block (ascending
    when ``blocks`` is): the hashes of a run cost one broadcast add per sketch row (``_Hasher._z``)."""

    blocks: torch.Tensor  # int64
    width: int


Index = torch.Tensor | int | _RowRun  # element indices, the first of a run of positions, or whole blocks


def _runs(blocks: torch.Tensor, b: int, n: int) -> Iterator[tuple[Index, int, int]]:
    """(indices, lo, hi): the element indices of the set ``blocks`` in chunks of at most CHUNK, with their
    offsets [lo, hi) into the concatenated values of those blocks. Whole blocks as ``_RowRun``s; an index list
    where a block is wider than a chunk or the tensor's short last block is set."""
    short = blocks.numel() > 0 and int(blocks[-1]) * b + b > n
    if b <= CHUNK and not short:
        step = CHUNK // b
        for a in range(0, blocks.numel(), step):
            part = blocks[a : a + step]
            yield _RowRun(part, b), a * b, (a + part.numel()) * b
        return
    idx = _block_elements(blocks, b, n)
    for a in range(0, idx.numel(), CHUNK):
        yield idx[a : a + CHUNK], a, min(idx.numel(), a + CHUNK)


def _block_numel(blocks: torch.Tensor, b: int, n: int) -> int:
    """Entries in ``blocks`` (ascending), the tensor's short last block counted short."""
    if not blocks.numel():
        return 0
    return blocks.numel() * b - max(0, int(blocks[-1]) * b + b - n)


def _gather_blocks(flat: torch.Tensor, blocks: torch.Tensor, b: int) -> torch.Tensor:
    """The entries of ``blocks`` (ascending) of ``flat``, block after block."""
    n = flat.numel()
    if n % b == 0:
        return flat.view(-1, b)[blocks].reshape(-1)
    return flat[_block_elements(blocks, b, n)]


def _nonzero_blocks(flat: torch.Tensor, b: int) -> torch.Tensor:
    """Indices of the blocks of ``flat`` (blocks of ``b`` entries, the last one possibly short) holding a
    non-zero (NaN included, as ``!= 0`` counts it), chunk by chunk: no tensor-sized temporary."""
    n = flat.numel()
    full = n // b
    step = max(1, CHUNK // b) * b
    peaks = [flat[a : min(full * b, a + step)].view(-1, b).abs().amax(1) for a in range(0, full * b, step)]
    if full * b < n:
        peaks.append(flat[full * b :].abs().amax().reshape(1))
    if not peaks:
        return torch.zeros(0, dtype=torch.int64)
    peak = torch.cat(peaks)  # max |x| per block: 3x cheaper than ne(0).any(1)
    return torch.nonzero((peak > 0) | peak.isnan(), as_tuple=True)[0]


def _block_elements(blocks: torch.Tensor, b: int, n: int) -> torch.Tensor:
    """Element indices of ``blocks`` (ascending), clipped to the tensor's ``n`` entries."""
    idx = (blocks.unsqueeze(1) * b + torch.arange(b)).reshape(-1)
    if blocks.numel() and int(blocks[-1]) * b + b > n:  # only the tensor's last block can be short
        idx = idx[: idx.numel() - (int(blocks[-1]) * b + b - n)]
    return idx


class _Hasher:
    """Row hashes of one call (see the module docstring) and their scratch buffers, sized for one chunk."""

    def __init__(self, sk: SparseSketch, c: int, work: torch.dtype) -> None:
        self.c, self.rows = c, sk.rows
        base = _splitmix_int(sk.seed)
        self.ab = [
            (_signed(_splitmix_int(base ^ (2 * j))), _signed(_splitmix_int(base ^ (2 * j + 1))))
            for j in range(sk.rows)
        ]
        self.itype = torch.int64 if work == torch.float64 else torch.int32  # the value's bits, for the sign
        self.z = torch.empty(CHUNK, dtype=torch.int64)
        self.base = torch.empty(CHUNK, dtype=torch.int64)  # a _RowRun's per-block a_j·w·block + b_j
        self.sign = torch.empty(CHUNK, dtype=self.itype)
        self.signed = torch.empty(CHUNK, dtype=self.itype)
        self.est = torch.empty(sk.rows, CHUNK, dtype=work)
        self._steps: list[torch.Tensor] = []

    def _z(self, idx: Index, k: int, j: int) -> torch.Tensor:
        """z = a_j·i + b_j mod 2^64 (int64 arithmetic wraps) for the indices ``idx``, for start + 0..k-1, or for
        a run of whole blocks: a_j·(block·w + t) + b_j = (a_j·w·block + b_j) + a_j·t."""
        a, b = self.ab[j]
        z = self.z[:k]
        if isinstance(idx, torch.Tensor):
            return torch.mul(idx, a, out=z).add_(b)
        if not self._steps:  # a_j·0..CHUNK-1, once per call: a chunk of positions then costs one add
            self._steps = [torch.arange(CHUNK, dtype=torch.int64).mul_(aj) for aj, _ in self.ab]
        if isinstance(idx, _RowRun):
            m, w = idx.blocks.numel(), idx.width
            base = torch.mul(idx.blocks, _signed(a * w), out=self.base[:m]).add_(b)
            torch.add(base.unsqueeze(1), self._steps[j][:w], out=z.view(m, w))
            return z
        return torch.add(self._steps[j][:k], _signed(a * idx + b), out=z)

    def _row(self, idx: Index, k: int, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(h_j(i) ∈ [0, c), sign mask: the value type's sign bit where s_j(i) = -1)."""
        z = self._z(idx, k, j).bitwise_right_shift_(32)  # the top 32 bits, sign-extended
        sign = self.sign[:k]
        if self.itype == torch.int64:
            torch.bitwise_and(z, -(2**63), out=sign)  # bit 63
        else:
            sign.copy_(z).bitwise_and_(-(2**31))  # bits 32..63 as int32: its sign bit is bit 63
        return z.bitwise_and_(0x7FFF_FFFF).mul_(self.c).bitwise_right_shift_(31), sign

    def insert(self, table: torch.Tensor, idx: Index, vals: torch.Tensor) -> None:
        """table[j, h_j(i)] += s_j(i)·v(i) for every row j (S2 Alg. 1 line 5). ``idx``: the indices of ``vals``,
        the first of a run of consecutive ones, or a run of whole blocks."""
        k = vals.numel()
        bits = vals.view(self.itype)
        for j in range(self.rows):
            h, sign = self._row(idx, k, j)
            signed = torch.bitwise_xor(bits, sign, out=self.signed[:k])
            table[j].index_add_(0, h, signed.view(table.dtype))

    def query(self, table: torch.Tensor, idx: Index, out: torch.Tensor) -> None:
        """out(i) = median over rows of s_j(i)·table[j, h_j(i)] (S2 Alg. 1 lines 11-14)."""
        k = out.numel()
        est = self.est[:, :k]
        for j in range(self.rows):
            h, sign = self._row(idx, k, j)
            torch.index_select(table[j], 0, h, out=est[j])
            est[j].view(self.itype).bitwise_xor_(sign)
        _median_rows(est, out)


def _median_rows(est: torch.Tensor, out: torch.Tensor) -> None:
    """Median over dim 0 of a (r, k) tensor into ``out``; for an even r the mean of the two middle values.
    Destroys ``est``. r ≤ 8: odd-even transposition sort by min/max (in place, vectorized over k)."""
    r = est.shape[0]
    if r == 1:
        out.copy_(est[0])
    elif r == 3:  # the default: the middle of three in four passes
        e0, e1, e2 = est
        lo = torch.minimum(e0, e1)
        torch.maximum(e0, e1, out=out)
        torch.minimum(out, e2, out=out)
        torch.maximum(lo, out, out=out)
    elif r <= 8:
        tmp = torch.empty_like(est[0])
        for rnd in range(r):
            for i in range(rnd % 2, r - 1, 2):
                torch.minimum(est[i], est[i + 1], out=tmp)
                torch.maximum(est[i], est[i + 1], out=est[i + 1])
                est[i].copy_(tmp)
        _middle(est, out)
    else:
        _middle(est.sort(0).values, out)


def _middle(srt: torch.Tensor, out: torch.Tensor) -> None:
    r = srt.shape[0]
    if r % 2:
        out.copy_(srt[r // 2])
    else:
        torch.add(srt[r // 2 - 1], srt[r // 2], out=out).mul_(0.5)


def _signed(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def _splitmix_int(x: int) -> int:
    """splitmix64 finaliser on a Python int: derives each row's (a, b) from the seed."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)
