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

Hashing (``hash=``): S2 Alg. 1 hashes every element i to its own bucket h_j(i) and sign s_j(i)
(``"element"``). The default ``"block"`` hashes each block B once and adds its b values to the b cells of bucket
h_j(B) with sign s_j(B) (the table read as c/b buckets of b cells; c rounded up to whole blocks). Each element's
estimate is still s_j(B)·S[j, h_j(B)·b + t] = g(B, t) + Σ over the other blocks K in its bucket of
s_j(B)s_j(K)·g(K, t), so the pairwise independent signs keep it unbiased (S2 Thm. 1); a bucket holds b/c of the
other blocks' entries at the same offset where the element hash holds 1/c of all the entries, so the expected
squared error is the same when the gradient's energy is spread over the b offsets, and the collisions of a
block's entries are shared (correlated) instead of independent. It costs one hash per block instead of one per
element and moves whole rows: on an embedding gradient of dim 64, 64x fewer hashes (docs/results_compress.md).
The paper is silent on the hash family; the hashes and kernels are in ``sketch_hash``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from sparsync.collectives.comm import Comm, ring_allreduce_bytes
from sparsync.collectives.tensor import coo_to_stream, pack_bits, stream_to_coo, unpack_bits
from sparsync.compress.aggregate import PayloadAggregator, Result, collective, decoded, expect, record
from sparsync.compress.base import (
    NO_CONTEXT,
    Aggregator,
    Compressor,
    Context,
    Encoding,
    Payload,
    ReduceCall,
    SketchPayload,
    TensorSpec,
    check_kernels,
    check_positive_int,
    native_for,
    packed_bitmap_bytes,
)
from sparsync.compress.sketch_hash import CHUNK, Hasher, Index, RowRun, native_available
from sparsync.stream import SparseStream

FLAT_BLOCK = 64  # default block of a 1-D tensor (a 2-D+ tensor's default block is one row)
BLOCK_CHUNK = 1 << 18  # values per pass of the block hash (at least one block)
DEVICE_CHUNK = 1 << 24  # keys or values per pass on another device (a GPU): its passes are bound by launches


def chunk_for(device: torch.device, host: int = CHUNK) -> int:
    """Keys (values) per pass of the kernels on ``device``: ``host`` (cache-sized) on the host, DEVICE_CHUNK
    elsewhere (a GPU's passes are bound by launches; measured: docs/gpu.md). A pass's size does
    not change a result: the table cells are sums of the same terms."""
    return host if device.type == "cpu" else DEVICE_CHUNK


HASHES = ("block", "element")


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
    hash: str = "block"  # "block": one hash per block (the default); "element": one per element (S2 Alg. 1)
    # the insert/query kernels: "auto" (C where built, else torch), "c" (raise if not built), "torch"; the same
    # table sums and estimates either way (sketch_hash.py)
    kernels: str = "auto"

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
        if self.hash not in HASHES:
            raise ValueError(f"hash must be one of {HASHES}, got {self.hash!r}")
        check_kernels("SparseSketch", self.kernels, native_available(), "_sketch_c")

    def check_device(self, device: torch.device) -> None:
        native_for("SparseSketch", self.kernels, native_available(), device)

    def _hasher(self, c: int, work: torch.dtype, device: torch.device, size: int) -> Hasher:
        native = native_for("SparseSketch", self.kernels, native_available(), device)
        return Hasher(self.rows, self.seed, c, work, size, native=native, device=device)

    def width(self, numel: int) -> int:
        """c for a tensor of ``numel`` entries, before the block hash rounds it up (``table_cols``)."""
        if self.cols is not None:
            return self.cols
        assert self.ratio is not None
        return max(1, math.ceil(self.ratio * numel / self.rows))

    def table_cols(self, shape: Sequence[int]) -> int:
        """Columns of the r x c table for a tensor of ``shape``: ``width``, rounded up to whole blocks for the
        block hash."""
        spec = TensorSpec(torch.Size(shape), torch.float32)
        c = self.width(spec.numel)
        if self.hash == "element":
            return c
        b = self.block_size(spec)
        return -(-c // b) * b

    def payload_numel(self, shape: Sequence[int]) -> int:
        """Entries of the payload (bitmap + r x c table) for a tensor of ``shape`` in S2's one-allreduce form
        (``SketchPayload.to_buffer``, S2 Alg. 1 line 8), whatever the gradient's density."""
        spec = TensorSpec(torch.Size(shape), torch.float32)
        return -(-spec.numel // self.block_size(spec)) + self.rows * self.table_cols(shape)

    def payload_nbytes(self, shape: Sequence[int], itemsize: int = 4) -> int:
        """Bytes every rank allreduces for a tensor of ``shape`` (``SketchPayload.nbytes``): the packed bitmap
        and the r x c table of ``itemsize``-byte entries, whatever the gradient's density."""
        spec = TensorSpec(torch.Size(shape), torch.float32)
        blocks = -(-spec.numel // self.block_size(spec))
        return packed_bitmap_bytes(blocks) + self.rows * self.table_cols(shape) * itemsize

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
        dtype, device = tensor.dtype, tensor.device
        work = torch.float64 if dtype == torch.float64 else torch.float32
        # the one O(blocks) structure of a call (S2 Alg. 1 line 2)
        bitmap = torch.zeros(nblocks, dtype=dtype, device=device)
        c = self.table_cols(spec.shape)
        table = torch.zeros(self.rows, c, dtype=work, device=device)
        if self.hash == "block":
            hasher = self._hasher(c // b, work, device, max(min(chunk_for(device, BLOCK_CHUNK), n), b))
            _compress_blocks(hasher, table, bitmap, tensor, b)
            return SketchPayload(bitmap, table.to(dtype))
        step = chunk_for(device)
        hasher = self._hasher(c, work, device, max(1, min(step, n)))
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
                for a in range(0, idx.numel(), step):
                    hasher.insert(table, idx[a : a + step], vals[a : a + step])
                return SketchPayload(bitmap, table.to(dtype))
        else:
            flat = tensor.reshape(-1)
            blocks = _nonzero_blocks(flat, b)
            if blocks.numel() == nblocks:  # every block set: hash positions a..b, no index list
                bitmap.fill_(1)
                for a in range(0, n, step):
                    hasher.insert(table, a, flat[a : a + step].to(work))
                return SketchPayload(bitmap, table.to(dtype))
            # zeros inside a set block add 0 to the table: hash the same set of positions decompress queries
            vals = _gather_blocks(flat, blocks, b).to(work)
        bitmap[blocks] = 1
        for h, lo, hi in _runs(blocks, b, n, step):
            hasher.insert(table, h, vals[lo:hi])
        return SketchPayload(bitmap, table.to(dtype))

    def aggregator(self, enc: Encoding) -> Aggregator[Any]:
        return SKETCH_ALLREDUCE

    def decompress(self, payload: SketchPayload, spec: TensorSpec) -> torch.Tensor:
        b, n = self.block_size(spec), spec.numel
        blocks = torch.nonzero(payload.bitmap > 0, as_tuple=True)[0]
        c = payload.table.shape[1]
        work = torch.float64 if payload.table.dtype == torch.float64 else torch.float32
        table = payload.table.to(work).contiguous()
        device = table.device
        every = blocks.numel() == -(-n // b)
        if self.hash == "block":
            if c % b:
                raise ValueError(f"a block-hash table's {c} columns are not whole blocks of {b}")
            hasher = self._hasher(c // b, work, device, max(min(chunk_for(device, BLOCK_CHUNK), n), b))
            vals = _query_blocks(hasher, table, blocks, b, n)
            if spec.sparse_dim is None and every:  # every block set: the values are the tensor
                return vals.to(spec.dtype).reshape(spec.shape)
            return _assemble(vals.to(spec.dtype), blocks, b, spec)
        step = chunk_for(device)
        hasher = self._hasher(c, work, device, max(1, min(step, n)))
        if spec.sparse_dim is None and every:  # every block set: write in place
            out = torch.empty(n, dtype=work, device=device)
            for a in range(0, n, step):
                hasher.query(table, a, out[a : a + step])
            return out.to(spec.dtype).reshape(spec.shape)
        vals = torch.empty(_block_numel(blocks, b, n), dtype=work, device=device)
        for h, lo, hi in _runs(blocks, b, n, step):
            hasher.query(table, h, vals[lo:hi])
        return _assemble(vals.to(spec.dtype), blocks, b, spec)


class SketchAllreduce(PayloadAggregator[SketchPayload]):
    """S2 Alg. 1 line 8: the table summed by one dense allreduce, the bitmap OR-ed by a second one started beside
    it, packed one bit per block (``SketchPayload``)."""

    name: ClassVar[str] = "allreduce"

    def check(self, payload: Payload) -> SketchPayload:
        return expect(payload, SketchPayload, self)

    def aggregate(self, call: ReduceCall, payload: SketchPayload | None) -> Result:
        p = expect(payload, SketchPayload, self)
        work = collective(call, "allreduce", p.nbytes, lambda: _sketch_allreduce(call, p))
        return decoded(call, work, lambda s: call.finish(call.enc.compressor.decompress(s, call.enc.spec)))


SKETCH_ALLREDUCE = SketchAllreduce()


def _sketch_allreduce(call: ReduceCall, payload: SketchPayload) -> SketchPayload:
    table, device, g = payload.table.clone(), payload.table.device, call.comm
    exact = Comm(g, device=device).exact
    if exact:
        # NCCL has no BOR (collectives/transport.py): one byte per block reduced with MAX, on the device (8x the
        # bitmap's packed bytes, no host round trip)
        words, op = (payload.bitmap != 0).to(torch.uint8), dist.ReduceOp.MAX
    else:
        # gloo: packed 32 to an int32 word on the host (a device bitmap comes over once, n_blocks bytes) and
        # OR-ed there; gloo reduces host and device tensors on one group
        words, op = pack_bits((payload.bitmap != 0).cpu()), dist.ReduceOp.BOR
    works = [
        dist.all_reduce(table, group=g, async_op=True),
        dist.all_reduce(words, op=op, group=g, async_op=True),
    ]
    for w in works:
        w.wait()
    P = call.world_size
    sent = table.numel() * table.element_size() + words.numel() * words.element_size()  # gloo: payload.nbytes
    nb = ring_allreduce_bytes(sent, P)  # two ring allreduces, counted as one of both payloads
    record(call, "allreduce", table.numel() + words.numel(), nb, 4 * (P - 1), device=device)
    flags = words if exact else unpack_bits(words, payload.bitmap.numel()).to(device)
    return SketchPayload(flags.to(table.dtype), table)


def _assemble(vals: torch.Tensor, blocks: torch.Tensor, b: int, spec: TensorSpec) -> torch.Tensor:
    """The tensor of ``spec`` whose set ``blocks`` (ascending) hold ``vals`` (their entries, block after block)
    and whose other entries are zero (a COO tensor of the set blocks for a COO ``spec``)."""
    n = spec.numel
    if spec.sparse_dim is not None:
        if math.prod(spec.shape[spec.sparse_dim :]) == b:  # blocks are COO rows: no per-element regrouping
            return stream_to_coo(SparseStream(blocks, vals, n, row=b, validate=False), spec.shape, spec.sparse_dim)
        idx = _block_elements(blocks, b, n)
        return stream_to_coo(SparseStream(idx, vals, n, validate=False), spec.shape, spec.sparse_dim)
    out = torch.zeros(n, dtype=spec.dtype, device=vals.device)
    if n % b == 0:
        out.view(-1, b)[blocks] = vals.view(-1, b)
    else:
        out[_block_elements(blocks, b, n)] = vals
    return out.reshape(spec.shape)


def _compress_blocks(h: Hasher, table: torch.Tensor, bitmap: torch.Tensor, tensor: torch.Tensor, b: int) -> None:
    """Block hash: set the bitmap and add every set block's values to ``table`` (one hash per block)."""
    n, work = tensor.numel(), table.dtype
    if tensor.is_sparse:
        s = coo_to_stream(tensor)  # coalesced rows, O(nnz): a COO input is never densified
        assert s.indices is not None
        if s.row == b:  # a block is one COO row (an embedding row)
            keys = s.indices.to(torch.int64)
            bitmap[keys] = 1
            _insert_rows(h, table, s.values.view(-1, b), keys)
            return
        e = s.elements()
        assert e.indices is not None
        idx = e.indices.to(torch.int64)
        keys, inv = torch.unique(idx // b, return_inverse=True)
        rows = torch.zeros(keys.numel(), b, dtype=work, device=table.device)
        rows[inv, idx % b] = e.values.to(work)
        bitmap[keys] = 1
        _insert_rows(h, table, rows, keys)
        return
    flat = tensor.reshape(-1)
    full = n // b
    blocks = _nonzero_blocks(flat, b)
    bitmap[blocks] = 1
    whole = flat[: full * b].view(full, b)
    if blocks.numel() == bitmap.numel():  # every block set: no gather
        _insert_rows(h, table, whole, None)
    else:
        _insert_rows(h, table, whole, blocks[: int(torch.searchsorted(blocks, full))], gather=True)
    if full * b < n and blocks.numel() and int(blocks[-1]) == full:  # the short last block, zero-padded
        pad = torch.zeros(1, b, dtype=work, device=table.device)
        pad[0, : n - full * b] = flat[full * b :]
        h.insert_blocks(table, blocks[-1:], pad)


def _insert_rows(
    h: Hasher, table: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor | None, *, gather: bool = False
) -> None:
    """Insert, in passes, the blocks ``keys`` (None: 0, 1, ... for every row of ``rows``) with the values
    ``rows[keys]`` (``gather``) or the rows of ``rows`` in order."""
    m = rows.shape[0] if keys is None else keys.numel()
    step = max(1, h.z.numel() // rows.shape[1])
    for a in range(0, m, step):
        hi = min(m, a + step)
        part = torch.arange(a, hi, device=table.device) if keys is None else keys[a:hi]
        vals = rows[part] if gather else rows[a:hi]
        h.insert_blocks(table, part, vals.to(table.dtype))


def _query_blocks(h: Hasher, table: torch.Tensor, blocks: torch.Tensor, b: int, n: int) -> torch.Tensor:
    """Block hash: the estimates of the set ``blocks`` (ascending), block after block, the tensor's short last
    block cut short."""
    m = blocks.numel()
    vals = torch.empty(m, b, dtype=table.dtype, device=table.device)
    step = max(1, h.z.numel() // b)
    for a in range(0, m, step):
        h.query_blocks(table, blocks[a : a + step], vals[a : a + step])
    return vals.view(-1)[: _block_numel(blocks, b, n)]


def _runs(blocks: torch.Tensor, b: int, n: int, chunk: int) -> Iterator[tuple[Index, int, int]]:
    """(indices, lo, hi): the element indices of the set ``blocks`` in chunks of at most ``chunk``, with their
    offsets [lo, hi) into the concatenated values of those blocks. Whole blocks as ``RowRun``s; an index list
    where a block is wider than a chunk or the tensor's short last block is set."""
    short = blocks.numel() > 0 and int(blocks[-1]) * b + b > n
    if b <= chunk and not short:
        step = chunk // b
        for a in range(0, blocks.numel(), step):
            part = blocks[a : a + step]
            yield RowRun(part, b), a * b, (a + part.numel()) * b
        return
    idx = _block_elements(blocks, b, n)
    for a in range(0, idx.numel(), chunk):
        yield idx[a : a + chunk], a, min(idx.numel(), a + chunk)


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
    step = max(1, chunk_for(flat.device) // b) * b
    peaks = [flat[a : min(full * b, a + step)].view(-1, b).abs().amax(1) for a in range(0, full * b, step)]
    if full * b < n:
        peaks.append(flat[full * b :].abs().amax().reshape(1))
    if not peaks:
        return torch.zeros(0, dtype=torch.int64, device=flat.device)
    peak = torch.cat(peaks)  # max |x| per block: 3x cheaper than ne(0).any(1)
    return torch.nonzero((peak > 0) | peak.isnan(), as_tuple=True)[0]


def _block_elements(blocks: torch.Tensor, b: int, n: int) -> torch.Tensor:
    """Element indices of ``blocks`` (ascending), clipped to the tensor's ``n`` entries."""
    idx = (blocks.unsqueeze(1) * b + torch.arange(b, device=blocks.device)).reshape(-1)
    if blocks.numel() and int(blocks[-1]) * b + b > n:  # only the tensor's last block can be short
        idx = idx[: idx.numel() - (int(blocks[-1]) * b + b - n)]
    return idx
